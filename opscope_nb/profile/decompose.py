"""Validated low-rank, Monarch, Tucker and Tensor-Train decompositions.

Each function checks and coerces its input (float32, C-contiguous, finite;
float64/float16/int accepted and converted), then calls the ``@njit`` core of
the same name in :mod:`opscope_nb.kernels`.

Layouts
-------
* :func:`factorize` takes a matmul-layout ``w[k, n]`` (``x[m, k] @ w``).
* Monarch weights are square ``[n, n]`` with ``n = m**2``, applied as
  ``x[batch, n] @ W``; see :mod:`opscope_nb.kernels._monarch` for the index
  convention of ``w1``/``w2``.
* Tucker works on 3-way tensors ``[d0, d1, d2]``; TT on any row-major tensor.
"""
from __future__ import annotations

import numbers

import numpy as np

from opscope_nb._validation import as_float32, as_matrix, check_int
from opscope_nb.kernels import _lowrank, _monarch, _tt, _tucker

__all__ = ["factorize", "monarch_blocks", "monarch_params", "monarch_project",
           "monarch_reconstruct", "monarch_matmul", "tucker_hosvd",
           "tucker_reconstruct", "tucker_params", "tt_svd", "tt_reconstruct",
           "tt_params"]

_SEED_MAX = 2 ** 63 - 1


def _int_triple(v, name):
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != 3:
        raise ValueError(f"{name} must be a sequence of 3 positive integers; got "
                         f"{v!r}. Pass e.g. {name}=(32, 16, 48).")
    return tuple(check_int(x, f"{name}[{i}]", 1) for i, x in enumerate(v))


# --------------------------------------------------------------------- low-rank
def factorize(w, r, seed=0):
    """Cheap randomized range finder ``w ~= U @ V`` (matmul layout ``w[k, n]``).

    A seeded sketch, two power iterations with re-orthonormalisation, then
    ``V = U^T W``.  Exact when ``rank(w) <= r``; otherwise close to (never
    better than) the optimal rank-``r`` error.  Use
    :func:`opscope_nb.profile.svd.truncated_svd` when accuracy matters.

    Parameters
    ----------
    w : array_like of shape (k, n)
        Finite, non-empty real matrix; computed in float32.
    r : int
        ``1 <= r <= min(k, n)``.
    seed : int, default 0
        Non-negative sketch seed.

    Returns
    -------
    U : ndarray of shape (k, r), float32, orthonormal columns
    V : ndarray of shape (r, n), float32
    """
    w = as_matrix(w, "w")
    r = check_int(r, "r", 1, min(w.shape))
    seed = check_int(seed, "seed", 0, _SEED_MAX)
    return _lowrank.factorize(w, r, seed)


# ---------------------------------------------------------------------- Monarch
def monarch_blocks(n):
    """``m`` with ``m * m == n``, or ``None`` when ``n`` is not a perfect square.

    Parameters
    ----------
    n : int, >= 0

    Returns
    -------
    int or None
    """
    n = check_int(n, "n", 0)
    m = _monarch.monarch_blocks(n)
    return None if m is None else int(m)


def monarch_params(m):
    """Parameters of a Monarch factorisation with block size ``m``: ``2 m**3``."""
    m = check_int(m, "m", 1)
    return 2 * m ** 3


def _square_side(w, name):
    if w.shape[0] != w.shape[1]:
        raise ValueError(f"Monarch needs a square {name}; got shape {w.shape}. "
                         f"Use low-rank or Tucker for rectangular weights.")
    m = _monarch.monarch_blocks(w.shape[0])
    if m is None:
        raise ValueError(f"Monarch needs a side n = m**2 (a perfect square); got "
                         f"n = {w.shape[0]}. Pad the weight or pick another "
                         f"decomposition.")
    return int(m)


def monarch_project(w):
    """Best Monarch approximation of a square weight ``w [n, n]``, ``n = m**2``.

    Every ``m x m`` block ``B[s, j] = W[ri*m + j, l*m + s]`` gets its exact
    best rank-1 approximation ``sigma u v^T``: ``w2[l, s, ri] = sigma u_s``,
    ``w1[ri, j, l] = v_j``.  The implied dense matrix is
    ``M[ri*m + j, l*m + s] = w1[ri, j, l] * w2[l, s, ri]`` (see
    :func:`monarch_reconstruct`).

    Parameters
    ----------
    w : array_like of shape (n, n), n a perfect square

    Returns
    -------
    w1, w2 : ndarray of shape (m, m, m), float32
    """
    w = as_matrix(w, "w")
    _square_side(w, "w")
    return _monarch.monarch_project(w)


def _monarch_pair(w1, w2):
    w1 = as_float32(w1, "w1", ndim=3)
    w2 = as_float32(w2, "w2", ndim=3)
    m = w1.shape[0]
    if w1.shape != (m, m, m) or w2.shape != (m, m, m):
        raise ValueError(f"w1 and w2 must both have shape (m, m, m); got "
                         f"{w1.shape} and {w2.shape}. Use monarch_project's output.")
    return w1, w2


def monarch_reconstruct(w1, w2):
    """Dense Monarch matrix ``W[ri*m + j, l*m + s] = w1[ri, j, l] * w2[l, s, ri]``.

    Parameters
    ----------
    w1, w2 : array_like of shape (m, m, m)

    Returns
    -------
    ndarray of shape (m*m, m*m), float32
    """
    w1, w2 = _monarch_pair(w1, w2)
    return _monarch.monarch_reconstruct(w1, w2)


def monarch_matmul(x, w1, w2):
    """``x @ monarch_reconstruct(w1, w2)`` in ``2 * batch * m**3`` multiply-adds.

    Parameters
    ----------
    x : array_like of shape (batch, m*m) or (m*m,)
    w1, w2 : array_like of shape (m, m, m)

    Returns
    -------
    ndarray of shape (batch, m*m) (or (m*m,) for 1-D ``x``), float32
    """
    w1, w2 = _monarch_pair(w1, w2)
    x = as_float32(x, "x")
    one_d = x.ndim == 1
    if one_d:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise ValueError(f"x must be 1-D or 2-D [batch, n]; got shape {x.shape}.")
    n = w1.shape[0] ** 2
    if x.shape[1] != n:
        raise ValueError(f"x must have n = m**2 = {n} columns to match w1/w2; got "
                         f"shape {x.shape}.")
    y = _monarch.monarch_matmul(x, w1, w2)
    return y[0] if one_d else y


# ----------------------------------------------------------------------- Tucker
def tucker_hosvd(x3, ranks):
    """Truncated HOSVD of a 3-way tensor.

    Parameters
    ----------
    x3 : array_like of shape (d0, d1, d2)
        Finite real tensor, computed in float32 (row-major).
    ranks : sequence of 3 positive ints
        Multilinear ranks; a rank larger than its dimension is clamped to it
        (so ``core`` may be smaller than ``ranks``).

    Returns
    -------
    core : ndarray of shape (r0, r1, r2), float32
    factors : tuple (U0 [d0, r0], U1 [d1, r1], U2 [d2, r2]) of float32
        Orthonormal columns: the top left singular vectors of each mode
        unfolding (mode-i unfolding: ``d_i`` rows, the other indices in
        row-major order as columns).
    """
    x3 = as_float32(x3, "x3", ndim=3)
    ranks = _int_triple(ranks, "ranks")
    return _tucker.tucker_hosvd(x3, ranks)


def tucker_reconstruct(core, factors):
    """Dense tensor ``core x0 U0 x1 U1 x2 U2`` of shape ``(d0, d1, d2)``.

    Parameters
    ----------
    core : array_like of shape (r0, r1, r2)
    factors : sequence of 3 arrays, ``U_i`` of shape (d_i, r_i)

    Returns
    -------
    ndarray of shape (d0, d1, d2), float32
    """
    core = as_float32(core, "core", ndim=3)
    if isinstance(factors, np.ndarray) or not hasattr(factors, "__len__") \
            or len(factors) != 3:
        raise ValueError("factors must be a sequence of 3 matrices (U0, U1, U2); "
                         f"got {type(factors).__name__}.")
    fs = tuple(as_matrix(f, f"factors[{i}]") for i, f in enumerate(factors))
    for i, f in enumerate(fs):
        if f.shape[1] != core.shape[i]:
            raise ValueError(f"factors[{i}] must have core.shape[{i}] = "
                             f"{core.shape[i]} columns; got shape {f.shape}.")
    return _tucker.tucker_reconstruct(core, fs)


def tucker_params(dims, ranks):
    """Stored parameters ``r0*r1*r2 + sum_i d_i*r_i`` (ranks as given, unclamped).

    Parameters
    ----------
    dims, ranks : sequences of 3 positive ints

    Returns
    -------
    int
    """
    d = _int_triple(dims, "dims")
    r = _int_triple(ranks, "ranks")
    return r[0] * r[1] * r[2] + d[0] * r[0] + d[1] * r[1] + d[2] * r[2]


# ------------------------------------------------------------------ Tensor-Train
def _dims(dims):
    if isinstance(dims, numbers.Integral) and not isinstance(dims, bool):
        dims = (dims,)
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__len__") or len(dims) == 0:
        raise ValueError(f"dims must be a non-empty sequence of positive ints; got "
                         f"{dims!r}.")
    return tuple(check_int(d, f"dims[{i}]", 1) for i, d in enumerate(dims))


def tt_svd(x, dims, max_rank):
    """TT-SVD (Oseledets 2011): Tensor-Train cores of a row-major tensor.

    Parameters
    ----------
    x : array_like
        Any real array with ``x.size == prod(dims)``, read in row-major order.
    dims : sequence of positive ints
        Mode sizes ``(d_1, ..., d_K)``.
    max_rank : int
        Bond-rank cap, ``>= 1``; each bond is ``min(max_rank, rows, cols)`` of
        its unfolding (zero singular values do not shrink it).

    Returns
    -------
    list of ndarray
        ``K`` cores, core ``k`` of shape ``(r_{k-1}, d_k, r_k)`` float32 with
        ``r_0 = r_K = 1``.
    """
    dims = _dims(dims)
    max_rank = check_int(max_rank, "max_rank", 1)
    x = as_float32(x, "x")
    if x.size != int(np.prod(np.array(dims, dtype=object))):
        raise ValueError(f"x.size must equal prod(dims) = "
                         f"{int(np.prod(np.array(dims, dtype=object)))}; got x of "
                         f"shape {x.shape} (size {x.size}).")
    flat, shapes = _tt.tt_svd_flat(np.ascontiguousarray(x.ravel()),
                                   np.array(dims, dtype=np.int64), max_rank)
    return _tt._split_cores(flat, shapes)


def _tt_cores(cores):
    if isinstance(cores, np.ndarray) or not hasattr(cores, "__len__") or len(cores) == 0:
        raise ValueError("cores must be a non-empty sequence of 3-D arrays "
                         "(r_prev, d, r_next).")
    out = [as_float32(c, f"cores[{i}]", ndim=3) for i, c in enumerate(cores)]
    prev = 1
    for i, c in enumerate(out):
        if c.shape[0] != prev:
            raise ValueError(f"cores[{i}] must have r_prev = {prev} (the previous "
                             f"core's r_next, 1 for the first); got shape {c.shape}.")
        prev = c.shape[2]
    if prev != 1:
        raise ValueError(f"the last core must have r_next = 1; got "
                         f"{out[-1].shape}.")
    return out


def tt_reconstruct(cores):
    """Dense tensor of shape ``(d_1, ..., d_K)`` from TT cores.

    Parameters
    ----------
    cores : sequence of arrays ``(r_prev, d_k, r_next)``, ``r_0 = r_K = 1``

    Returns
    -------
    ndarray of shape (d_1, ..., d_K), float32 (``.ravel()`` gives the
    row-major flat tensor that :func:`tt_svd` takes)
    """
    cs = _tt_cores(cores)
    flat = _tt.tt_reconstruct_flat(*_tt._join_cores(cs))
    return flat.reshape(tuple(c.shape[1] for c in cs))


def tt_params(cores):
    """Stored parameters ``sum_k r_prev * d_k * r_next``."""
    return int(sum(int(np.prod(np.shape(c))) for c in _tt_cores(cores)))
