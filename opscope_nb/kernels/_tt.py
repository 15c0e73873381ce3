"""Tensor-Train decomposition by TT-SVD (Oseledets 2011).

A tensor of shape ``dims`` (row-major) is swept left to right: at mode ``k``
the remainder is a ``(r_prev * d_k) x rest`` matrix; its rank-``r_k``
truncated SVD (``r_k = clamp(max_rank, 1, min(rows, cols))``; zero singular
values do not shrink it) gives the core ``U.reshape(r_prev, d_k, r_k)`` and the
new remainder ``diag(S) Vt``.  The last core is the remainder itself,
``(r_prev, d_last, 1)``.  Each step uses the truncated-SVD core (exact Gram
path for a short side, block Krylov with block ``r_k + 16`` and depth 4
otherwise).
No input validation here; see :mod:`opscope_nb.decompose`.

References
----------
.. [1] I. Oseledets, "Tensor-train decomposition", SIAM J. Sci. Comput.
   33(5), 2011.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.typed import List

from .._config import njit
from ._coerce import as_f32c, as_i64_vector, njit_entry
from ._svd import truncated_svd_opts

__all__ = ["tt_svd", "tt_reconstruct", "tt_params"]

_CORE = types.Array(types.float32, 3, "C")


@njit
def _tt_svd(x, dims, max_rank):
    """TT-SVD of a row-major tensor.

    Parameters
    ----------
    x : ndarray of shape (prod(dims),), float32, C-contiguous, finite
    dims : ndarray of shape (ndim,), int64, every entry >= 1
    max_rank : int
        Bond-rank cap, >= 1.

    Returns
    -------
    numba.typed.List of ndarray, each (r_prev, d_k, r_next) float32
        ``r_0 = r_ndim = 1``.
    """
    nd = dims.shape[0]
    cores = List.empty_list(_CORE)
    c = x                       # never written: each step makes a new remainder
    r_prev = 1
    for k in range(nd - 1):
        rows = r_prev * dims[k]
        cols = c.size // rows
        rk = max(1, min(max_rank, min(rows, cols)))
        # block rk + 16, depth 4: cheaper than truncated_svd's defaults, and
        # the sweep only needs a good subspace (exact path for short sides).
        # (np.int64, not literal constants: a literal makes numba compile a
        # second specialisation of the whole SVD chain next to truncated_svd's)
        u, s, vt = truncated_svd_opts(c.reshape(rows, cols), rk, np.int64(0), np.int64(16),
                                      np.int64(4), np.int64(64), 1e-6)
        cores.append(np.ascontiguousarray(u).reshape(r_prev, dims[k], rk))
        rem = np.empty((rk, cols), dtype=np.float32)
        for i in range(rk):         # a loop: a slice assignment compiles an error formatter
            for j in range(cols):
                rem[i, j] = s[i] * vt[i, j]
        c = rem.ravel()
        r_prev = rk
    cores.append(c.reshape(r_prev, dims[nd - 1], 1))
    return cores


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
        g = cores[k]
        rp, d, rn = g.shape
        nxt = np.dot(acc, np.ascontiguousarray(g).reshape(rp, d * rn))
        acc = nxt.reshape(acc.shape[0] * d, rn)
    return acc.ravel()


@njit
def tt_params(cores):
    """Stored parameters ``sum_k r_prev * d_k * r_next``."""
    total = 0
    for k in range(len(cores)):
        g = cores[k]
        total += g.shape[0] * g.shape[1] * g.shape[2]
    return total


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
