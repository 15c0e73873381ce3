"""Probes: how well does a weight matrix take quantisation, sparsity, low rank?

Every function validates its input at this boundary and calls the ``@njit``
core of the same name in :mod:`opscope_nb.kernels` (which your own numba code
may call directly).

Layout and shapes
-----------------
A weight is 2-D ``[rows, cols]``; for a PyTorch ``nn.Linear`` weight
``[out_features, in_features]`` a **row is an output channel** (the
per-channel quantiser's scale is per row), and :func:`outlier_channels` looks
at **columns** (input channels).

* Tensor-wise probes accept any ``ndim >= 1`` (they only see the values):
  :func:`frob`, :func:`rel_err`, :func:`quant_error`, :func:`ternary_error`,
  :func:`cardinality`.
* Matrix probes require exactly 2-D: :func:`sigma_max`, :func:`stable_rank`,
  :func:`per_channel_quant_error`, :func:`nm_sparsity_error`,
  :func:`outlier_channels`, :func:`best_bitwidth`, :func:`save_tensor`.

Input rules
-----------
Real numeric input (float16/float32/float64/integers) is converted to
float32 and computed in float32 (sums in float64, see
:mod:`opscope_nb.kernels._quant_probe`); non-contiguous arrays are copied.  NaN/Inf,
empty arrays, the wrong ``ndim``, bool/complex/object dtypes, ``bits`` outside
2..16 and ``n > m`` raise ``ValueError``/``TypeError`` naming the rule, the
value received and the fix.  Results are Python ``float``/``int``.

Conventions: relative error is ``||x - x_hat||_F / ||x||_F`` (0 for an
all-zero ``x``); quantisation is symmetric with ``levels = max(2^(bits-1) - 1,
1)``, ``scale = amax / levels`` and round half away from zero.
"""
from __future__ import annotations

import numbers
import os

import numpy as np

from opscope_nb import kernels as _k
from opscope_nb._validation import as_float32, as_matrix, check_bits, check_int

__all__ = [
    "frob",
    "rel_err",
    "sigma_max",
    "stable_rank",
    "quant_error",
    "per_channel_quant_error",
    "nm_sparsity_error",
    "ternary_error",
    "outlier_channels",
    "best_bitwidth",
    "cardinality",
    "save_tensor",
    "load_tensor",
]

_HEADER_BYTES = 8          # u32 LE rows, u32 LE cols
_U32_MAX = 2**32 - 1


def _writable(a: np.ndarray) -> np.ndarray:
    # numba compiles a separate specialisation for read-only arrays (memmaps,
    # np.frombuffer); a copy is cheaper than that compile.
    return a if a.flags.writeable else a.copy()


def _mat(x, name: str) -> np.ndarray:
    """2-D float32 C-contiguous, finite, non-empty."""
    return _writable(as_matrix(x, name))


def _as_2d_view(x, name: str) -> np.ndarray:
    """Any-ndim input -> float32 C-contiguous 2-D view for the tensor-wise cores."""
    if np.ndim(x) == 0:
        raise ValueError(f"{name} must have at least 1 dimension; got a 0-D scalar "
                         f"{x!r}. Wrap it, e.g. np.atleast_1d({name}).")
    a = _writable(as_float32(x, name))
    if a.ndim == 1:
        return a.reshape(1, a.shape[0])
    return a.reshape(-1, a.shape[-1])


_F32_MAX = float(np.finfo(np.float32).max)


def _check_real(value, name: str, *, positive: bool = False, f32: bool = False) -> float:
    """A finite real (``positive``: > 0; ``f32``: also finite as float32)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r} "
                        f"({type(value).__name__}).")
    v = float(value)
    if not np.isfinite(v) or (f32 and abs(v) > _F32_MAX):
        what = "finite as float32 (|v| <= 3.4e38)" if f32 else "finite"
        raise ValueError(f"{name} must be {what}; got {value!r}.")
    if positive and not v > 0:
        raise ValueError(f"{name} must be > 0; got {value!r}.")
    return v


def frob(x) -> float:
    """Frobenius norm ``sqrt(sum x^2)``.

    Parameters
    ----------
    x : array_like, any shape with ndim >= 1
        Converted to float32; must be finite and non-empty.

    Returns
    -------
    float
        Accumulated in float64.
    """
    return float(_k.frob(_as_2d_view(x, "x")))


def rel_err(ref, approx) -> float:
    """Relative Frobenius error ``||ref - approx||_F / ||ref||_F``.

    Parameters
    ----------
    ref : array_like, any shape with ndim >= 1
        The reference (e.g. the original weight).
    approx : array_like, same shape as ``ref``
        The approximation.

    Returns
    -------
    float
        0 when ``ref`` is all zero (``sum ref^2 < 1e-20``), whatever ``approx``.
    """
    a = as_float32(ref, "ref")
    b = as_float32(approx, "approx")
    if a.shape != b.shape:
        raise ValueError(f"ref and approx must have the same shape; got {a.shape} "
                         f"and {b.shape}. Compare a matrix with its own reconstruction.")
    return float(_k.rel_err(_as_2d_view(a, "ref"), _as_2d_view(b, "approx")))


def sigma_max(x, iters: int = 30) -> float:
    """Largest singular value by power iteration on ``x^T x`` (upstream method).

    Parameters
    ----------
    x : array_like of shape (rows, cols)
        2-D, converted to float32.
    iters : int, default 30
        Power steps, ``0 <= iters <= 10**6``.  The start vector is the
        deterministic ``1/sqrt(cols)``; like any power method the estimate is
        a lower bound that converges slowly when ``sigma_1 ≈ sigma_2``.

    Returns
    -------
    float
    """
    w = _mat(x, "x")
    it = check_int(iters, "iters", 0, 10**6)
    return float(_k.sigma_max(w, it))


def stable_rank(x) -> float:
    """Stable rank ``||x||_F^2 / sigma_max^2`` (an effective-rank proxy).

    Parameters
    ----------
    x : array_like of shape (rows, cols)

    Returns
    -------
    float
        Uses :func:`sigma_max` with 30 iterations; 0 for an all-zero matrix.
    """
    return float(_k.stable_rank(_mat(x, "x")))


def quant_error(x, bits: int) -> float:
    """Relative error of **per-tensor** symmetric ``bits``-bit quantisation.

    Parameters
    ----------
    x : array_like, any shape with ndim >= 1
    bits : int
        2..16; ``levels = max(2^(bits-1) - 1, 1)``.

    Returns
    -------
    float
        ``||x - q||_F / ||x||_F``, ``q = clamp(round_half_away(x / scale),
        -levels, levels) * scale``, ``scale = max|x| / levels``; 0 when
        ``max|x| < 1e-20``.
    """
    b = check_bits(bits)
    return float(_k.quant_error(_as_2d_view(x, "x"), b))


def per_channel_quant_error(x, bits: int) -> float:
    """Relative error of **per-row** (per output channel) symmetric quantisation.

    Parameters
    ----------
    x : array_like of shape (rows, cols)
        ``[out_features, in_features]``; each row gets its own scale
        ``amax_row / levels`` (1.0 for an all-zero row).
    bits : int
        2..16.

    Returns
    -------
    float
        ``sqrt(sum (x - q)^2 / sum x^2)`` with both sums over the whole matrix
        (not a mean of per-row errors).
    """
    b = check_bits(bits)
    return float(_k.per_channel_quant_error(_mat(x, "x"), b))


def nm_sparsity_error(x, n: int = 2, m: int = 4) -> float:
    """Relative error of N:M structured sparsity along each row.

    Parameters
    ----------
    x : array_like of shape (rows, cols)
    n, m : int
        Keep the ``n`` largest ``|v|`` of every ``m`` consecutive values of a
        row (the last group may be shorter; ties keep the lower index).
        ``1 <= n <= m``.

    Returns
    -------
    float
        ``sqrt(sum dropped^2 / sum x^2)``.
    """
    w = _mat(x, "x")
    nn = check_int(n, "n", 1)
    mm = check_int(m, "m", 1)
    if nn > mm:
        raise ValueError(f"n must be <= m (keep n of every m values); got n={nn}, "
                         f"m={mm}. For 2:4 sparsity pass n=2, m=4.")
    return float(_k.nm_sparsity_error(w, nn, mm))


def ternary_error(x) -> float:
    """Relative error of TWN ternary quantisation (Li & Liu, 2016).

    Parameters
    ----------
    x : array_like, any shape with ndim >= 1

    Returns
    -------
    float
        ``delta = 0.7 * mean|x|``, ``alpha = mean |x| over |x| > delta``
        (strict), ``t = sign(x) * alpha`` where ``|x| > delta`` else 0; the
        relative Frobenius error of ``t``.
    """
    return float(_k.ternary_error(_as_2d_view(x, "x")))


def outlier_channels(x, ratio: float) -> tuple[int, float]:
    """Outlier **input channels** (columns) by column max-abs.

    Parameters
    ----------
    x : array_like of shape (rows, cols)
        ``[out_features, in_features]``: column c is input channel c.
    ratio : float
        Finite as float32, > 0.  A column is an outlier when its max-abs exceeds
        ``ratio * median`` (product rounded to float32).

    Returns
    -------
    count : int
        Number of outlier columns.
    max_over_median : float
        ``max(cmax) / median``.

    Notes
    -----
    ``median = sorted(cmax)[cols // 2]`` (the upper median), floored at 1e-20.
    """
    r = _check_real(ratio, "ratio", positive=True, f32=True)
    count, mom = _k.outlier_channels(_mat(x, "x"), r)
    return int(count), float(mom)


def best_bitwidth(x, budget: float) -> int | None:
    """First of 3, 4, 6, 8 bits whose per-channel error is ``< budget``.

    Parameters
    ----------
    x : array_like of shape (rows, cols)
    budget : float
        Finite; strict bound on :func:`per_channel_quant_error`.

    Returns
    -------
    int or None
        ``None`` when even 8 bits miss the budget (the kernel returns -1).
    """
    b = _check_real(budget, "budget")
    r = int(_k.best_bitwidth(_mat(x, "x"), b))
    return None if r < 0 else r


def cardinality(x, round_to: float) -> int:
    """Number of distinct values after snapping to a ``1/round_to`` grid.

    Parameters
    ----------
    x : array_like, any shape with ndim >= 1
    round_to : float
        Finite as float32, > 0.  Counts distinct ``round_half_away(float32(v *
        round_to))`` as int64 (saturating), e.g. ``round_to=1000`` for a
        1e-3 grid.

    Returns
    -------
    int
        The distinct count, **capped**: like upstream, counting stops once
        more than 100 000 distinct values are seen, so any larger count is
        reported as **100_001**.
    """
    rt = _check_real(round_to, "round_to", positive=True, f32=True)
    return int(_k.cardinality(_as_2d_view(x, "x"), rt))


def save_tensor(path, x) -> None:
    """Write a matrix in the upstream ``.tensor`` format.

    Parameters
    ----------
    path : str or os.PathLike
    x : array_like of shape (rows, cols)
        Converted to float32.  NaN/Inf are written as they are (a dump keeps
        the data; the probes reject it later); ``rows``/``cols`` may be 0 but
        must be < 2^32.

    Notes
    -----
    Format: u32 LE ``rows``, u32 LE ``cols``, then ``rows*cols`` float32 LE
    values in row-major order (no padding, no magic).
    """
    a = as_matrix(x, "x", allow_empty=True, check_finite=False)
    rows, cols = a.shape
    if rows > _U32_MAX or cols > _U32_MAX:
        raise ValueError(f"x shape {a.shape} does not fit the .tensor header "
                         f"(u32 rows/cols, each < 2**32).")
    header = np.array([rows, cols], dtype="<u4").tobytes()
    with open(os.fspath(path), "wb") as f:
        f.write(header)
        f.write(a.astype("<f4", copy=False).tobytes(order="C"))


def load_tensor(path) -> np.ndarray:
    """Read a ``.tensor`` file written by :func:`save_tensor` or the Rust tool.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    ndarray of shape (rows, cols), float32, C-contiguous, writable

    Raises
    ------
    ValueError
        When the file is shorter than the 8-byte header, or its size is not
        exactly ``8 + 4*rows*cols`` bytes (truncated or with trailing data);
        the message gives both sizes.
    """
    from opscope_nb.io import read_tensor_file      # the package's one .tensor reader
    return read_tensor_file(path)
