"""``@njit`` cores of the probes (:mod:`opscope_nb.profile.probe`) and the shared
rounding primitives (:func:`round_half_away`, :func:`div_f32`).  The synthetic
data generator's Philox cores live in :mod:`opscope_nb.kernels._rng`.

**No input validation**: every core assumes C-contiguous, finite ``float32``
arrays of the documented shape and in-range integers.  The validating public
twins live in :mod:`opscope_nb.profile.probe`.

Layout
------
Matrices are 2-D ``[rows, cols]`` row-major.  For a PyTorch ``nn.Linear``
weight ``[out_features, in_features]`` a row is an *output* channel: the
per-channel quantiser has one scale per row, while :func:`outlier_channels`
looks at *columns* (input channels), as upstream does.  Tensor-wise probes
(:func:`frob`, :func:`rel_err`, :func:`quant_error`, :func:`ternary_error`,
:func:`cardinality`) only see the values, so any tensor can be passed as a 2-D
C-contiguous view (the public wrappers use ``x.reshape(-1, x.shape[-1])``).

Numerics
--------
* Values stay ``float32`` where upstream computes them in ``float32``
  (quantisation codes, scales, dequantised values are exact functions of
  float32 inputs); **sums are accumulated in float64**, one partial per row
  then a serial reduction in row order.  The result is deterministic and does
  not depend on the thread count.  Upstream sums sequentially in float32,
  which drifts: on a 1024x3072 Gaussian its sum of squares is 0.3 % low, so
  the Rust tool's errors differ from these (accurate) ones at the 1e-3 level
  on big matrices.
* Quotients that feed a rounding decision (``x / scale`` before
  round-half-away, ``amax / levels``) are float32 IEEE divisions
  (:func:`div_f32`), so codes and scales equal Rust's / NumPy's float32
  division bit for bit.  This holds because the package's fastmath set has no
  ``arcp`` (see :mod:`opscope_nb.kernels._jit`).
* Rounding is half away from zero (Rust ``f32::round``), never NumPy's
  half-to-even: :func:`round_half_away`.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from ._jit import intrinsic

from ._jit import njit, njit_parallel

__all__ = [
    # shared primitives
    "round_half_away",
    "quant_levels",
    "div_f32",
    "row_absmax",
    "quantize_rows_sym",
    "quantize_tensor_sym",
    # probes
    "frob",
    "rel_err",
    "sigma_max",
    "stable_rank",
    "quant_error",
    "per_channel_quant_error",
    "best_bitwidth",
    "nm_sparsity_error",
    "ternary_error",
    "outlier_channels",
    "cardinality",
    "residual_rows",
    "gram_stats",
    "abs_diff_sums",
]

# Column-block width for the column max-abs (a reduction down the rows): the
# running maxima of one block stay in registers/L1 while the rows stream by.
_COL_BLOCK = 128

# Parallelism policy: the probes that profile_layer runs on every layer
# (per-channel / per-tensor quantisation error, 2:4, ternary, rel_err, the
# per-row quantiser, sigma_max's X^T X v) and the generator's hot loops use
# prange over rows with per-row partials and a serial reduction.  One-pass
# helpers that cost ~1 ms on 1024x3072 (row/column max-abs, frob, the
# per-tensor quantiser, cardinality keys) stay serial: a parallel kernel adds
# ~1.5 s of compile time and, on a busy machine, more launch overhead than it
# saves.


# --------------------------------------------------------------------------
# shared primitives
# --------------------------------------------------------------------------

@njit
def round_half_away(v):
    """Round to the nearest integer, ties away from zero (Rust ``f32::round``).

    Parameters
    ----------
    v : float32 or float64 scalar

    Returns
    -------
    Same type as ``v``; an integral value.

    Notes
    -----
    ``floor(|v| + 0.5)`` is wrong for 0.49999997 (the add rounds up to 1) and
    for odd integers >= 2^23; comparing the exact fraction ``|v| - floor(|v|)``
    with 0.5 has neither problem.  No input validation.
    """
    a = abs(v)
    t = np.floor(a)
    if a - t >= 0.5:
        t = np.ceil(a)     # == t + 1 here (a is not integral), same dtype
    return t if v >= 0 else -t


@njit
def quant_levels(bits):
    """Symmetric quantisation levels ``max(2^(bits-1) - 1, 1)`` (int).

    8 -> 127, 6 -> 31, 4 -> 7, 3 -> 3, 2 -> 1.  No input validation.
    """
    lv = (1 << (bits - 1)) - 1
    return lv if lv > 1 else 1


@njit
def div_f32(a, b):
    """Correctly rounded float32 quotient ``a / b``.

    Parameters
    ----------
    a, b : float32 scalars (``b != 0``)

    Returns
    -------
    float32
        Identical to IEEE float32 division (Rust ``a / b``, NumPy float32
        ``a / b``): the package compiles without ``arcp``.
    """
    return np.float32(a) / np.float32(b)


def _f32_from_bits_py(v):
    return np.array(v, dtype=np.int32).view(np.float32)[()]


def _require_f32_array_py(r):
    if not (isinstance(r, np.ndarray) and r.dtype == np.float32):
        raise TypeError(f"expected a float32 array; got {getattr(r, 'dtype', type(r))}")


@intrinsic(py=_f32_from_bits_py)
def _f32_from_bits(typingctx, v):
    """Reinterpret an int32 bit pattern as float32 (no conversion)."""
    if v != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic(py=_require_f32_array_py)
def _require_f32_array(typingctx, r):
    """Typing guard: compiles only for float32 arrays (a float64 row viewed as
    int32 would give wrong maxima silently)."""
    if not (isinstance(r, types.Array) and r.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.none(r), codegen


@njit
def absmax_f32(r, lo, hi):
    """``max |r[lo:hi]|`` of a float32 1-D C-contiguous array (0 when empty).

    Compares the IEEE bit patterns with the sign bit cleared as int32: for
    finite floats (and infinities) that order is the float order, and an
    integer max reduction vectorises, whereas the float ``if a > m`` loop does
    not without ``nnan`` (about 9x slower; it bounded every quantiser of
    activations).  A NaN maps above ``inf``, so it is not silently skipped.
    """
    _require_f32_array(r)
    ri = r.view(np.int32)
    m = np.int32(0)
    for j in range(lo, hi):
        a = np.int32(ri[j] & np.int32(0x7FFFFFFF))
        if a > m:
            m = a
    return _f32_from_bits(np.int32(m))


@njit
def row_absmax(x):
    """Per-row ``max |x|``.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous

    Returns
    -------
    ndarray of shape (rows,), float32
    """
    rows, cols = x.shape
    out = np.zeros(rows, dtype=np.float32)
    for i in range(rows):
        out[i] = absmax_f32(x[i], 0, cols)
    return out


@njit
def _tensor_absmax(x):
    """``max |x|`` over a 2-D array (serial reduction of :func:`row_absmax`)."""
    ra = row_absmax(x)
    m = np.float32(0.0)
    for i in range(ra.shape[0]):
        if ra[i] > m:
            m = ra[i]
    return m


#: ``max|x|`` of a block below which it quantises as all zero (scale 1);
#: float32, so every quantiser compares it as its NumPy twin does.
ZERO_AMAX = np.float32(1e-20)


@njit
def sym_scale(amax, levels):
    """Symmetric scale ``amax / levels`` (float32), 1 when ``amax < ZERO_AMAX``:
    the scale rule of every symmetric quantiser of the package."""
    if amax < ZERO_AMAX:
        return np.float32(1.0)
    return div_f32(amax, np.float32(levels))


@njit
def _code(v, scale, levels):
    """``clamp(round_half_away(v / scale), -levels, levels)`` as float32."""
    q = round_half_away(div_f32(v, scale))
    fl = np.float32(levels)
    if q > fl:
        q = fl
    elif q < -fl:
        q = -fl
    return q


@njit_parallel
def quantize_rows_sym(x, bits):
    """Per-row (per output channel) symmetric quantiser with int8 codes.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
        ``[out_features, in_features]``: one scale per row.
    bits : int
        2..8 (codes must fit int8).

    Returns
    -------
    codes : ndarray of shape (rows, cols), int8
        ``clamp(round_half_away(x / scale), -levels, levels)``.
    scales : ndarray of shape (rows,), float32
        ``amax_row / levels``; 1.0 for a row with ``amax < 1e-20``.

    Notes
    -----
    ``x ≈ codes * scales[:, None]``.  Raises ``ValueError`` (constant message)
    when ``bits`` is outside 2..8; no other validation.
    """
    if bits < 2 or bits > 8:
        raise ValueError("quantize_rows_sym: bits must be in 2..8 for int8 codes")
    rows, cols = x.shape
    levels = quant_levels(bits)
    amax = row_absmax(x)
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty(rows, dtype=np.float32)
    for i in prange(rows):
        s = sym_scale(amax[i], levels)
        scales[i] = s
        for j in range(cols):
            codes[i, j] = np.int8(_code(x[i, j], s, levels))
    return codes, scales


@njit
def quantize_tensor_sym(x, bits):
    """Per-tensor symmetric quantiser with int8 codes.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    bits : int
        2..8.

    Returns
    -------
    codes : ndarray of shape (rows, cols), int8
    scale : float32
        ``amax / levels`` over the whole tensor; 1.0 when ``amax < 1e-20``.
    """
    if bits < 2 or bits > 8:
        raise ValueError("quantize_tensor_sym: bits must be in 2..8 for int8 codes")
    rows, cols = x.shape
    levels = quant_levels(bits)
    s = sym_scale(_tensor_absmax(x), levels)
    codes = np.empty((rows, cols), dtype=np.int8)
    for i in range(rows):
        for j in range(cols):
            codes[i, j] = np.int8(_code(x[i, j], s, levels))
    return codes, s


@njit
def _ratio(num, den):
    """``sqrt(num / den)``, 0 when ``den < 1e-20`` (upstream's guard)."""
    if den < 1e-20:
        return 0.0
    return np.sqrt(num / den)


@njit
def _partials_ratio(pn, pd):
    """:func:`_ratio` of per-row partial sums, added serially in row order so
    the result does not depend on the thread count."""
    num = 0.0
    den = 0.0
    for i in range(pn.shape[0]):
        num += pn[i]
        den += pd[i]
    return _ratio(num, den)


# --------------------------------------------------------------------------
# norms and spectra
# --------------------------------------------------------------------------

@njit
def frob(x):
    """Frobenius norm ``sqrt(sum x^2)``.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous

    Returns
    -------
    float64
        Accumulated in float64 (per-row partials, serial reduction).
    """
    rows, cols = x.shape
    part = np.zeros(rows, dtype=np.float64)
    for i in range(rows):
        s = 0.0
        for j in range(cols):
            v = np.float64(x[i, j])
            s += v * v
        part[i] = s
    tot = 0.0
    for i in range(rows):
        tot += part[i]
    return np.sqrt(tot)


@njit_parallel
def rel_err(ref, approx):
    """Relative Frobenius error ``||ref - approx||_F / ||ref||_F``.

    Parameters
    ----------
    ref, approx : ndarray of shape (rows, cols), float32, C-contiguous
        Same shape; ``ref`` is the reference.

    Returns
    -------
    float64
        0 when ``sum ref^2 < 1e-20`` (an all-zero reference), whatever
        ``approx`` is (upstream convention).
    """
    rows, cols = ref.shape
    pn = np.zeros(rows, dtype=np.float64)
    pd = np.zeros(rows, dtype=np.float64)
    for i in prange(rows):
        n = 0.0
        d = 0.0
        for j in range(cols):
            a = np.float64(ref[i, j])
            e = a - np.float64(approx[i, j])
            n += e * e
            d += a * a
        pn[i] = n
        pd[i] = d
    return _partials_ratio(pn, pd)


@njit
def _matvec(x, v, out):
    """``out = x @ v`` (float64); serial: sigma_max calls it once."""
    rows, cols = x.shape
    for i in range(rows):
        s = 0.0
        for j in range(cols):
            s += np.float64(x[i, j]) * v[j]
        out[i] = s


@njit_parallel
def _gram_matvec(x, v, part, out):
    """``out = x.T @ (x @ v)`` in one pass over ``x`` (float64).

    Rows are cut into ``part.shape[0]`` fixed chunks (a function of ``rows``
    only); chunk c accumulates ``sum_i (x_i . v) x_i`` over its rows into
    ``part[c]`` while each row is still in L1, then the chunks are summed in
    order.  Deterministic and independent of the thread count.
    """
    rows, cols = x.shape
    nchunk = part.shape[0]
    step = (rows + nchunk - 1) // nchunk
    for c in prange(nchunk):
        for j in range(cols):
            part[c, j] = 0.0
        for i in range(c * step, min((c + 1) * step, rows)):
            ui = 0.0
            for j in range(cols):
                ui += np.float64(x[i, j]) * v[j]
            for j in range(cols):
                part[c, j] += np.float64(x[i, j]) * ui
    for j in range(cols):
        out[j] = 0.0
    for c in range(nchunk):
        for j in range(cols):
            out[j] += part[c, j]


@njit
def _norm64(v):
    s = 0.0
    for i in range(v.shape[0]):
        s += v[i] * v[i]
    return np.sqrt(s)


@njit
def sigma_max(x, iters):
    """Largest singular value by power iteration on ``x^T x`` (upstream method).

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    iters : int
        Number of power steps (upstream default 30).

    Returns
    -------
    float64
        ``||x v||`` for the final unit vector ``v``.  0 for an empty matrix.

    Notes
    -----
    Start ``v = 1/sqrt(cols)`` everywhere (deterministic, not random); each
    step ``w = x^T (x v)`` (one pass over ``x``), stop when ``||w|| < 1e-20``
    else ``v = w / ||w||``.  Vectors and sums in float64.  Like any power method it
    converges slowly when ``sigma_1 ≈ sigma_2`` and returns a lower bound.
    """
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return 0.0
    v = np.full(cols, 1.0 / np.sqrt(np.float64(cols)))
    u = np.empty(rows, dtype=np.float64)
    w = np.empty(cols, dtype=np.float64)
    # <= 64 row chunks of >= 16 rows: bounded scratch, enough parallel slack
    nchunk = min(64, (rows + 15) // 16)
    part = np.empty((nchunk, cols), dtype=np.float64)
    for _ in range(iters):
        _gram_matvec(x, v, part, w)
        n = _norm64(w)
        if n < 1e-20:
            break
        for j in range(cols):
            v[j] = w[j] / n
    _matvec(x, v, u)
    return _norm64(u)


@njit
def stable_rank(x):
    """Stable rank ``||x||_F^2 / sigma_max^2`` (sigma_max with 30 iterations).

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous

    Returns
    -------
    float64
        0 when ``sigma_max < 1e-20``.
    """
    s = sigma_max(x, 30)
    if s < 1e-20:
        return 0.0
    f = frob(x)
    return (f * f) / (s * s)


# --------------------------------------------------------------------------
# quantisation probes
# --------------------------------------------------------------------------

@njit_parallel
def residual_rows(w, recon, y):
    """Residual and per-row squared error in one pass, in place.

    ``recon`` (float32 ``[rows, cols]``, writable) becomes ``w - recon`` in
    float32 and ``y[r] = sum_j (w[r, j] - recon[r, j])**2`` from the float64
    difference (exact for float32 inputs), summed in column order: the same
    bits for any thread count.  ``w`` float32 ``[rows, cols]``; ``y`` float64
    ``[rows]``.  (The residual's float32 rounding is exact when ``w`` and
    ``recon`` are within a factor 2, or either is 0; else ~6e-8 relative.)
    """
    rows, cols = w.shape
    for r in prange(rows):
        s = 0.0
        for j in range(cols):
            d = np.float64(w[r, j]) - np.float64(recon[r, j])
            s += d * d
            recon[r, j] = np.float32(d)
        y[r] = s


@njit_parallel
def gram_stats(g, tile):
    """One pass over a square float64 matrix for its validation.

    Returns ``(amax, asym, bad)``: ``max |g|`` over the finite entries,
    ``max |g[i, j] - g[j, i]|`` over the pairs whose both entries are
    finite, and the number of NaN/Inf entries (int64).  ``g`` is read in
    ``tile x tile`` blocks (the upper triangle's tile row by tile row, each
    against its mirror tile), so both reads stay in cache where
    ``g[:, j]`` would stride by a row.  Maxima and counts do not depend on
    the order: the same result for any thread count.
    """
    n = g.shape[0]
    nt = (n + tile - 1) // tile
    am = np.zeros(nt, dtype=np.float64)
    asy = np.zeros(nt, dtype=np.float64)
    bad = np.zeros(nt, dtype=np.int64)
    for bi in prange(nt):
        i0 = bi * tile
        i1 = min(i0 + tile, n)
        a = 0.0
        s = 0.0
        b = 0
        for bj in range(bi, nt):
            j0 = bj * tile
            j1 = min(j0 + tile, n)
            for i in range(i0, i1):
                for j in range(max(j0, i), j1):
                    x = g[i, j]
                    y = g[j, i]
                    fx = np.isfinite(x)
                    fy = np.isfinite(y)
                    if fx:
                        a = max(a, abs(x))
                    else:
                        b += 1
                    if i != j:
                        if fy:
                            a = max(a, abs(y))
                        else:
                            b += 1
                        if fx and fy:
                            s = max(s, abs(x - y))
        am[bi] = a
        asy[bi] = s
        bad[bi] = b
    return am.max() if nt else 0.0, asy.max() if nt else 0.0, bad.sum()


@njit_parallel
def abs_diff_sums(a, b, rs, cs):
    """Row and column sums of ``|a - b|`` in float64, ``rs`` set and ``cs``
    accumulated (``+=``).

    ``a``, ``b`` float64 ``[rows, cols]``; ``rs`` ``[rows]``, ``cs``
    ``[cols]`` float64.  Rows are summed in column order, columns in row
    order (parallel over rows, then over blocks of columns): the same bits
    for any thread count.
    """
    rows, cols = a.shape
    for r in prange(rows):
        s = 0.0
        for j in range(cols):
            s += abs(a[r, j] - b[r, j])
        rs[r] = s
    nb = (cols + 255) // 256
    for k in prange(nb):
        j0 = k * 256
        j1 = min(j0 + 256, cols)
        for r in range(rows):
            for j in range(j0, j1):
                cs[j] += abs(a[r, j] - b[r, j])


@njit_parallel
def _quant_err_sums(x, scales, per_row, levels):
    """Whole-matrix ``(sum (x - q)^2, sum x^2)`` in float64.

    ``scales[i]`` is row i's scale when ``per_row`` else ``scales[0]`` is used
    for every row.  The dequantised value ``code * scale`` is formed exactly in
    float64.
    """
    rows, cols = x.shape
    pn = np.zeros(rows, dtype=np.float64)
    pd = np.zeros(rows, dtype=np.float64)
    for i in prange(rows):
        s = scales[i] if per_row else scales[0]
        s64 = np.float64(s)
        n = 0.0
        d = 0.0
        for j in range(cols):
            v = x[i, j]
            v64 = np.float64(v)
            e = v64 - np.float64(_code(v, s, levels)) * s64
            n += e * e
            d += v64 * v64
        pn[i] = n
        pd[i] = d
    num = 0.0
    den = 0.0
    for i in range(rows):
        num += pn[i]
        den += pd[i]
    return num, den


@njit
def quant_error(x, bits):
    """Relative error of per-tensor symmetric ``bits``-bit quantisation.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    bits : int
        2..16 (``levels = max(2^(bits-1) - 1, 1)``).

    Returns
    -------
    float64
        ``||x - q||_F / ||x||_F`` with ``q = clamp(round_half_away(x/scale),
        -levels, levels) * scale`` and ``scale = max|x| / levels``; 0 when
        ``max|x| < 1e-20``.
    """
    amax = _tensor_absmax(x)
    if amax < 1e-20:
        return 0.0
    levels = quant_levels(bits)
    sc = np.empty(1, dtype=np.float32)
    sc[0] = div_f32(amax, np.float32(levels))
    num, den = _quant_err_sums(x, sc, False, levels)
    return _ratio(num, den)


@njit
def _per_channel_err_from_amax(x, amax, bits):
    levels = quant_levels(bits)
    rows = x.shape[0]
    sc = np.empty(rows, dtype=np.float32)
    for i in range(rows):
        sc[i] = sym_scale(amax[i], levels)
    num, den = _quant_err_sums(x, sc, True, levels)
    return _ratio(num, den)


@njit
def per_channel_quant_error(x, bits):
    """Relative error of per-row (per output channel) symmetric quantisation.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
        ``[out_features, in_features]``; one scale per row (1.0 for a row
        with ``amax < 1e-20``).
    bits : int
        2..16.

    Returns
    -------
    float64
        ``sqrt(sum (x - q)^2 / sum x^2)`` with numerator and denominator summed
        over the whole matrix (not a mean of per-row errors); 0 when
        ``sum x^2 < 1e-20``.
    """
    return _per_channel_err_from_amax(x, row_absmax(x), bits)


@njit
def best_bitwidth(x, budget):
    """First bit-width of (3, 4, 6, 8) whose per-channel error is ``< budget``.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    budget : float
        Strict upper bound on :func:`per_channel_quant_error`.

    Returns
    -------
    int
        3, 4, 6 or 8; **-1 when none qualifies** (the public
        :func:`opscope_nb.profile.probe.best_bitwidth` returns ``None`` instead).
    """
    amax = row_absmax(x)   # shared by the four candidate widths
    for b in (3, 4, 6, 8):
        if _per_channel_err_from_amax(x, amax, b) < budget:
            return b
    return -1


@njit
def _nm_groups_generic(x, i, start, n, m):
    """(dropped^2, total^2) of row ``i`` from column ``start`` on, any ``m``."""
    cols = x.shape[1]
    dropped = 0.0
    tot = 0.0
    for g0 in range(start, cols, m):
        g1 = min(g0 + m, cols)
        short = g1 - g0 <= n          # the whole group is kept
        for a in range(g0, g1):
            va = abs(x[i, a])
            v64 = np.float64(x[i, a])
            sq = v64 * v64
            tot += sq
            if short:
                continue
            # branch-free rank count: |v| in random data makes every
            # comparison a coin flip for the branch predictor
            beat = 0
            for b in range(g0, a):
                beat += abs(x[i, b]) >= va
            for b in range(a + 1, g1):
                beat += abs(x[i, b]) > va
            dropped += sq if beat >= n else 0.0
    return dropped, tot


@njit
def _nm_groups_m4(x, i, n):
    """(dropped^2, total^2) over the full 4-wide groups of row ``i``.

    Unrolled 2:4-style path (~30x faster than the generic loop): the six
    pairwise comparisons give every element's rank; ``bjk = |x_j| >= |x_k|``
    means j beats k (for j < k the lower index wins ties).
    """
    dropped = 0.0
    tot = 0.0
    for g in range(x.shape[1] // 4):
        j = 4 * g
        a0 = abs(x[i, j])
        a1 = abs(x[i, j + 1])
        a2 = abs(x[i, j + 2])
        a3 = abs(x[i, j + 3])
        b01 = np.int64(a0 >= a1)
        b02 = np.int64(a0 >= a2)
        b03 = np.int64(a0 >= a3)
        b12 = np.int64(a1 >= a2)
        b13 = np.int64(a1 >= a3)
        b23 = np.int64(a2 >= a3)
        r0 = 3 - b01 - b02 - b03
        r1 = b01 + 2 - b12 - b13
        r2 = b02 + b12 + 1 - b23
        r3 = b03 + b13 + b23
        s0 = np.float64(a0) * np.float64(a0)
        s1 = np.float64(a1) * np.float64(a1)
        s2 = np.float64(a2) * np.float64(a2)
        s3 = np.float64(a3) * np.float64(a3)
        tot += (s0 + s1) + (s2 + s3)
        dropped += ((s0 if r0 >= n else 0.0) + (s1 if r1 >= n else 0.0)
                    + (s2 if r2 >= n else 0.0) + (s3 if r3 >= n else 0.0))
    return dropped, tot


@njit
def _kth_smallest(buf, length, k):
    """Value of rank ``k`` (0-based, ascending) among ``buf[:length]``.

    In-place quickselect (Hoare partition, middle pivot): O(length) expected,
    no allocation.  Reorders ``buf[:length]``.
    """
    lo = 0
    hi = length - 1
    while lo < hi:
        pivot = buf[(lo + hi) // 2]
        a = lo
        b = hi
        while a <= b:
            while buf[a] < pivot:
                a += 1
            while buf[b] > pivot:
                b -= 1
            if a <= b:
                t = buf[a]
                buf[a] = buf[b]
                buf[b] = t
                a += 1
                b -= 1
        if k <= b:
            hi = b
        elif k >= a:
            lo = a
        else:
            return buf[k]
    return buf[k]


@njit
def _nm_groups_select(x, i, n, m, buf):
    """(dropped^2, total^2) of row ``i`` for large ``m``: O(m) per group.

    The n-th largest ``|v|`` (``thr``) comes from a quickselect on the scratch
    ``buf`` (length >= m, reused for every group); values above ``thr`` are
    kept, and of those equal to ``thr`` the lowest-index ones fill the
    remaining places (upstream's stable-sort tie rule).
    """
    cols = x.shape[1]
    dropped = 0.0
    tot = 0.0
    for g0 in range(0, cols, m):
        g1 = min(g0 + m, cols)
        glen = g1 - g0
        if glen <= n:
            for a in range(g0, g1):
                v = np.float64(x[i, a])
                tot += v * v
            continue
        for a in range(g0, g1):
            buf[a - g0] = abs(x[i, a])
        thr = _kth_smallest(buf, glen, glen - n)
        above = 0
        for a in range(g0, g1):
            above += abs(x[i, a]) > thr
        ties_kept = n - above
        for a in range(g0, g1):
            va = abs(x[i, a])
            v = np.float64(x[i, a])
            sq = v * v
            tot += sq
            if va > thr:
                continue
            if va == thr and ties_kept > 0:
                ties_kept -= 1
                continue
            dropped += sq
    return dropped, tot


@njit_parallel
def nm_sparsity_error(x, n, m):
    """Relative error of N:M structured sparsity along each row.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    n, m : int
        ``1 <= n``, ``1 <= m``; keep the ``n`` largest ``|v|`` of every ``m``
        consecutive values of a row (the last group may be shorter).

    Returns
    -------
    float64
        ``sqrt(sum dropped^2 / sum x^2)``; 0 when ``sum x^2 < 1e-20``.

    Notes
    -----
    Ties keep the lower index (upstream's stable sort).  Instead of sorting
    each group, an element is kept when fewer than ``n`` group members beat
    it (larger ``|v|``, or equal ``|v|`` at a lower index): O(m) work per
    element, no allocation, for ``m <= 16``; ``m == 4`` (2:4, 1:4, 3:4)
    takes an unrolled path for the full groups; ``m > 16`` finds each group's
    n-th largest ``|v|`` by quickselect in one per-row scratch buffer (O(m)
    per group instead of O(m^2)).
    """
    rows, cols = x.shape
    pn = np.zeros(rows, dtype=np.float64)
    pd = np.zeros(rows, dtype=np.float64)
    for i in prange(rows):
        dropped = 0.0
        tot = 0.0
        start = 0
        if m > 16:
            buf = np.empty(m, dtype=np.float32)   # one scratch per row
            dropped, tot = _nm_groups_select(x, i, n, m, buf)
            start = cols
        elif m == 4:
            dropped, tot = _nm_groups_m4(x, i, n)
            start = cols - cols % 4
        d2, t2 = _nm_groups_generic(x, i, start, n, m)
        pn[i] = dropped + d2
        pd[i] = tot + t2
    return _partials_ratio(pn, pd)


@njit_parallel
def ternary_error(x):
    """Relative error of TWN ternary quantisation (Li & Liu, 2016), per tensor.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous

    Returns
    -------
    float64
        ``||x - t||_F / ||x||_F`` with ``delta = 0.7 * mean|x|``,
        ``alpha = mean |x| over |x| > delta`` (strict; 0 if none) and
        ``t = +alpha`` where ``x > delta``, ``-alpha`` where ``x < -delta``,
        else 0.  ``delta``, ``alpha`` and all sums are float64.
    """
    rows, cols = x.shape
    size = rows * cols
    p1 = np.zeros(rows, dtype=np.float64)
    for i in prange(rows):
        s = 0.0
        for j in range(cols):
            s += abs(np.float64(x[i, j]))
        p1[i] = s
    tot = 0.0
    for i in range(rows):
        tot += p1[i]
    delta = 0.7 * (tot / max(size, 1))
    pk = np.zeros(rows, dtype=np.float64)
    pc = np.zeros(rows, dtype=np.int64)
    for i in prange(rows):
        s = 0.0
        c = 0
        for j in range(cols):
            a = abs(np.float64(x[i, j]))
            keep = a > delta
            s += a if keep else 0.0     # selects, not branches (vectorises)
            c += keep
        pk[i] = s
        pc[i] = c
    kept = 0.0
    cnt = 0
    for i in range(rows):
        kept += pk[i]
        cnt += pc[i]
    alpha = kept / cnt if cnt > 0 else 0.0
    pn = np.zeros(rows, dtype=np.float64)
    pd = np.zeros(rows, dtype=np.float64)
    for i in prange(rows):
        n = 0.0
        d = 0.0
        for j in range(cols):
            v = np.float64(x[i, j])
            t = alpha if v > delta else 0.0
            t = -alpha if v < -delta else t
            e = v - t
            n += e * e
            d += v * v
        pn[i] = n
        pd[i] = d
    return _partials_ratio(pn, pd)


# --------------------------------------------------------------------------
# outliers and cardinality
# --------------------------------------------------------------------------

@njit
def _col_absmax(x):
    """Per-column ``max |x|`` (float32), column block by column block."""
    rows, cols = x.shape
    out = np.zeros(cols, dtype=np.float32)
    nblk = (cols + _COL_BLOCK - 1) // _COL_BLOCK
    for b in range(nblk):
        c0 = b * _COL_BLOCK
        c1 = min(c0 + _COL_BLOCK, cols)
        for i in range(rows):
            for j in range(c0, c1):
                a = abs(x[i, j])
                if a > out[j]:
                    out[j] = a
    return out


@njit
def outlier_channels(x, ratio):
    """Outlier input channels (columns) by column max-abs.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
        ``[out_features, in_features]``: a column is an input channel.
    ratio : float
        A column is an outlier when ``cmax > float32(ratio) * median``
        (product rounded to float32, as upstream).

    Returns
    -------
    count : int
        Number of outlier columns.
    max_over_median : float64
        ``max(cmax) / median``.

    Notes
    -----
    ``cmax[c] = max_r |x[r, c]|``; ``median = sorted(cmax)[cols // 2]`` (the
    upper median) floored at 1e-20.  For an empty matrix returns ``(0, 0.0)``.
    """
    cols = x.shape[1]
    if cols == 0:
        return 0, 0.0
    cmax = _col_absmax(x)
    # upper median by quickselect on a copy (np.sort would cost seconds of
    # compile time for one order statistic)
    med = _kth_smallest(cmax.copy(), cols, cols // 2)
    if med < np.float32(1e-20):
        med = np.float32(1e-20)
    top = cmax.max()
    # float32 product, correctly rounded (exact in float64, then one rounding)
    thr = np.float32(np.float64(np.float32(ratio)) * np.float64(med))
    count = 0
    for j in range(cols):
        count += cmax[j] > thr
    return count, np.float64(top) / np.float64(med)


_TWO63 = 9.223372036854775808e18   # 2^63


@njit
def _card_keys(x, rt):
    """``round_half_away(float32(v * rt))`` as int64, saturating like Rust ``as i64``."""
    rows, cols = x.shape
    keys = np.empty(rows * cols, dtype=np.int64)
    for i in range(rows):
        for j in range(cols):
            p = np.float32(np.float64(x[i, j]) * np.float64(rt))
            r = max(np.float64(round_half_away(p)), -_TWO63)   # -2^63 converts exactly
            k = np.int64(9223372036854775807)
            if r < _TWO63:
                k = np.int64(r)
            keys[i * cols + j] = k
    return keys


@njit
def _count_distinct_hashed(keys, cap):
    """Distinct int64 values in ``keys``, stopping once the count reaches ``cap``.

    Open addressing (multiplicative hash, linear probing) in a table of at
    least twice ``min(len(keys), cap)`` slots: O(len) expected, no sort.
    """
    need = min(keys.shape[0], cap)
    bits = 1
    while (1 << bits) < 2 * need:
        bits += 1
    size = 1 << bits
    mask = size - 1
    table = np.empty(size, dtype=np.int64)
    used = np.zeros(size, dtype=np.uint8)
    mult = np.uint64(0x9E3779B97F4A7C15)
    shift = np.uint64(64 - bits)
    cnt = 0
    for k in keys:
        h = np.int64((np.uint64(k) * mult) >> shift)
        while used[h] and table[h] != k:
            h = (h + 1) & mask
        if not used[h]:
            used[h] = 1
            table[h] = k
            cnt += 1
            if cnt >= cap:
                return cap
    return cnt


@njit
def cardinality(x, round_to):
    """Number of distinct ``round_half_away(v * round_to)`` values, capped.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    round_to : float
        Grid density: values are snapped to multiples of ``1 / round_to``
        (``v * round_to`` is formed in float32, as upstream).

    Returns
    -------
    int
        The distinct count, **capped at 100_001**: upstream stops as soon as
        its set holds more than 100 000 values, so any count above 100 000 is
        reported as 100 001.

    Notes
    -----
    Keys are int64, saturating like Rust's ``v as i64``.  When the key span
    is small (< max(2^24, 4 x size)) a byte map counts them in O(size);
    otherwise an open-addressing hash set does.  The result is
    order-independent.
    """
    size = x.shape[0] * x.shape[1]
    if size == 0:
        return 0
    keys = _card_keys(x, np.float32(round_to))
    kmin = keys[0]
    kmax = keys[0]
    for k in keys:
        kmin = min(kmin, k)
        kmax = max(kmax, k)
    cap = 100_001
    # the span is compared in float64: kmax - kmin may overflow int64
    if np.float64(kmax) - np.float64(kmin) < max(16777216.0, 4.0 * size):
        seen = np.zeros(kmax - kmin + 1, dtype=np.uint8)
        cnt = 0
        for k in keys:
            idx = k - kmin
            cnt += seen[idx] == 0
            seen[idx] = 1
        return min(cnt, cap)
    return _count_distinct_hashed(keys, cap)
