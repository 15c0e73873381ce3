"""Tensor-Train decomposition by TT-SVD (Oseledets 2011).

A tensor of shape ``dims`` (row-major) is swept left to right: at mode ``k``
the remainder is a ``(r_prev * d_k) x rest`` matrix; its rank-``r_k``
truncated SVD (``r_k = clamp(max_rank, 1, min(rows, cols))``; zero singular
values do not shrink it) gives the core ``U.reshape(r_prev, d_k, r_k)`` and the
new remainder ``diag(S) Vt``.  The last core is the remainder itself,
``(r_prev, d_last, 1)``.  Each step uses the truncated-SVD core (exact Gram
path for a short side, block Krylov with block ``r_k + 16`` and depth 4
otherwise).
No input validation here; see :mod:`opscope_nb.profile.decompose`.

References
----------
.. [1] I. Oseledets, "Tensor-train decomposition", SIAM J. Sci. Comput.
   33(5), 2011.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.typed import List

from ._jit import njit
from ._coerce import as_f32c, as_i64_vector, njit_entry
from ._krylov import truncated_svd_opts

__all__ = ["tt_svd", "tt_reconstruct", "tt_params", "tt_svd_flat", "tt_reconstruct_flat"]

_CORE = types.Array(types.float32, 3, "C")


@njit
def _tt_shapes(dims, max_rank):
    """Core shapes ``(r_prev, d_k, r_k)`` of the sweep (they depend on ``dims``
    and ``max_rank`` only), as an ``(ndim, 3)`` int64 array."""
    nd = dims.shape[0]
    shapes = np.empty((nd, 3), dtype=np.int64)
    size = 1
    for k in range(nd):
        size *= dims[k]
    r_prev = 1
    for k in range(nd - 1):
        rows = r_prev * dims[k]
        cols = size // dims[k]
        rk = max(1, min(max_rank, min(rows, cols)))
        shapes[k, 0] = r_prev
        shapes[k, 1] = dims[k]
        shapes[k, 2] = rk
        size = size // dims[k]
        r_prev = rk
    shapes[nd - 1, 0] = r_prev
    shapes[nd - 1, 1] = dims[nd - 1]
    shapes[nd - 1, 2] = 1
    return shapes


@njit
def _tt_offsets(shapes):
    """Start of each core in the flat form: ``offs[k]`` = summed sizes of
    cores ``0 .. k-1`` (``offs[ndim]`` = the total), int64 ``(ndim + 1,)``."""
    nd = shapes.shape[0]
    offs = np.empty(nd + 1, dtype=np.int64)
    offs[0] = 0
    for k in range(nd):
        offs[k + 1] = offs[k] + shapes[k, 0] * shapes[k, 1] * shapes[k, 2]
    return offs


@njit
def tt_svd_flat(x, dims, max_rank):
    """:func:`tt_svd` with the cores in one flat array (no ``numba.typed.List``:
    Python callers use this form, since a List crossing into Python compiles
    its accessors in every process, uncached).

    Parameters
    ----------
    x : ndarray of shape (prod(dims),), float32, C-contiguous, finite
    dims : ndarray of shape (ndim,), int64, every entry >= 1
    max_rank : int
        Bond-rank cap, >= 1.

    Returns
    -------
    flat : ndarray of shape (sum of core sizes,), float32
        The cores' C-order elements, one after another.
    shapes : ndarray of shape (ndim, 3), int64
        Core ``k`` is ``flat[o_k : o_k + prod(shapes[k])].reshape(shapes[k])``,
        ``o_k`` the summed sizes of the cores before it; ``r_0 = r_ndim = 1``.
    """
    nd = dims.shape[0]
    shapes = _tt_shapes(dims, max_rank)
    offs = _tt_offsets(shapes)
    flat = np.empty(offs[nd], dtype=np.float32)
    c = x                       # never written: each step makes a new remainder
    for k in range(nd - 1):
        o = offs[k]
        rows = shapes[k, 0] * shapes[k, 1]
        cols = c.size // rows
        rk = shapes[k, 2]
        # block rk + 16, depth 4: cheaper than truncated_svd's defaults, and
        # the sweep only needs a good subspace (exact path for short sides).
        # (np.int64, not literal constants: a literal makes numba compile a
        # second specialisation of the whole SVD chain next to truncated_svd's)
        u, s, vt = truncated_svd_opts(c.reshape(rows, cols), rk, np.int64(0), np.int64(16),
                                      np.int64(4), np.int64(64), 1e-6)
        for i in range(rows):       # core k = u (rows, rk), row-major
            for j in range(rk):
                flat[o + i * rk + j] = u[i, j]
        rem = np.empty((rk, cols), dtype=np.float32)
        for i in range(rk):         # a loop: a slice assignment compiles an error formatter
            for j in range(cols):
                rem[i, j] = s[i] * vt[i, j]
        c = rem.ravel()
    o = offs[nd - 1]
    for i in range(c.size):
        flat[o + i] = c[i]
    return flat, shapes


@njit
def _tt_svd(x, dims, max_rank):
    """TT-SVD of a row-major tensor (:func:`tt_svd_flat`'s cores as a List).

    Returns
    -------
    numba.typed.List of ndarray, each (r_prev, d_k, r_next) float32
        ``r_0 = r_ndim = 1``.
    """
    flat, shapes = tt_svd_flat(x, dims, max_rank)
    offs = _tt_offsets(shapes)
    cores = List.empty_list(_CORE)
    for k in range(shapes.shape[0]):
        cores.append(flat[offs[k]:offs[k + 1]].copy().reshape(shapes[k, 0], shapes[k, 1],
                                                             shapes[k, 2]))
    return cores


@njit(inline="always")
def _contract(acc, g):
    """``acc (n, r_prev) @ g (r_prev, d, r_next)`` -> ``(n * d, r_next)``."""
    rp, d, rn = g.shape
    nxt = np.dot(acc, np.ascontiguousarray(g).reshape(rp, d * rn))
    return nxt.reshape(acc.shape[0] * d, rn)


@njit
def tt_reconstruct(cores):
    """Contract TT cores left to right into the flat row-major tensor.

    Parameters
    ----------
    cores : numba.typed.List of ndarray (r_prev, d_k, r_next), float32,
        C-contiguous, with ``r_0 = r_last = 1``

    Returns
    -------
    ndarray of shape (prod(d_k),), float32 (reshape to the dims yourself)
    """
    first = cores[0]
    acc = np.ascontiguousarray(first).reshape(first.shape[0] * first.shape[1],
                                              first.shape[2])
    for k in range(1, len(cores)):
        acc = _contract(acc, cores[k])
    return acc.ravel()


@njit
def tt_reconstruct_flat(flat, shapes):
    """:func:`tt_reconstruct` of cores in :func:`tt_svd_flat`'s flat form.

    Parameters
    ----------
    flat : ndarray of shape (sum of core sizes,), float32, C-contiguous
    shapes : ndarray of shape (ndim, 3), int64, ``shapes[0, 0] = shapes[-1, 2] = 1``

    Returns
    -------
    ndarray of shape (prod(shapes[:, 1]),), float32
    """
    offs = _tt_offsets(shapes)
    acc = flat[:offs[1]].reshape(shapes[0, 0] * shapes[0, 1], shapes[0, 2])
    for k in range(1, shapes.shape[0]):
        acc = _contract(acc, flat[offs[k]:offs[k + 1]].reshape(shapes[k, 0], shapes[k, 1],
                                                               shapes[k, 2]))
    return np.ascontiguousarray(acc).ravel()


@njit
def tt_params(cores):
    """Stored parameters ``sum_k r_prev * d_k * r_next``."""
    total = 0
    for k in range(len(cores)):
        g = cores[k]
        total += g.shape[0] * g.shape[1] * g.shape[2]
    return total


def _split_cores(flat, shapes):
    """TT cores (C-contiguous float32 copies) from :func:`tt_svd_flat`'s
    flat form (no ``numba.typed.List`` in Python: its accessors compile in
    every process).  The offsets are :func:`_tt_offsets`'s, in NumPy: calling
    that dispatcher from Python would compile one more entry."""
    offs = np.concatenate(([0], np.cumsum(np.prod(shapes, axis=1))))
    return [flat[offs[k]:offs[k + 1]].reshape(shp).copy()
            for k, shp in enumerate(shapes.tolist())]


def _join_cores(cores):
    """``(flat, shapes)`` of TT cores for :func:`tt_reconstruct_flat`."""
    flat = np.concatenate([np.asarray(c, dtype=np.float32).ravel() for c in cores])
    shapes = np.array([np.shape(c) for c in cores], dtype=np.int64).reshape(len(cores), 3)
    return np.ascontiguousarray(flat), shapes


@njit_entry
def tt_svd(x, dims, max_rank):
    """TT-SVD (Oseledets 2011) of a row-major tensor into cores ``(r_prev, d_k, r_next)``.

    Parameters
    ----------
    x : ndarray of any shape with ``x.size == prod(dims)``, real dtype
        (computed in float32), read in row-major order
    dims : tuple, list or 1-D int array, every entry >= 1
    max_rank : int
        Bond-rank cap, >= 1.

    Returns
    -------
    numba.typed.List of ndarray, each (r_prev, d_k, r_next) float32
        ``r_0 = r_ndim = 1``.
    """
    return _tt_svd(as_f32c(x).ravel(), as_i64_vector(dims), max_rank)
