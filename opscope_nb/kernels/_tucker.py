"""3-way Tucker decomposition by single-pass HOSVD (not HOOI).

Mode-``i`` unfolding has ``dims[i]`` rows and the remaining indices in natural
row-major order as columns (mode 0 -> (i1, i2), mode 1 -> (i0, i2),
mode 2 -> (i0, i1)).  ``U_i`` holds the top-``r_i`` left singular vectors of
that unfolding; the core is ``X x0 U0^T x1 U1^T x2 U2^T``.

Cost: mode 0 reuses the truncated-SVD core on the free view
``x.reshape(d0, -1)`` (block Krylov with block ``r0 + 16`` and depth 4 for a long
mode, exact otherwise); modes 1 and 2 only need the
``d_i x d_i`` Grams of their unfoldings, formed **in float64** (one float64
copy of the tensor, float64 BLAS GEMMs, no materialised unfolding: mode 2 is a
free view, mode 1 sums ``X[i0] X[i0]^T``), then an exact ``eigh``.  A float32
Gram would square the condition number in float32 and lose the small
eigenvalues' directions to rounding; the factors and the core are float32.  No input validation here; see :mod:`opscope_nb.profile.decompose`.

References
----------
.. [1] L. De Lathauwer, B. De Moor, J. Vandewalle, "A multilinear singular
   value decomposition", SIAM J. Matrix Anal. Appl. 21(4), 2000.
.. [2] T. Kolda, B. Bader, "Tensor decompositions and applications",
   SIAM Review 51(3), 2009.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit
from ._coerce import as_f32c, as_i64_vector, njit_entry
from ._krylov import top_eigvecs, truncated_svd_opts

__all__ = ["tucker_hosvd", "tucker_reconstruct", "tucker_params"]


@njit
def _factor_from_gram(g, r):
    """Top-``r`` eigenvectors of a float64 Gram as float32 ``[d, r]``, with the
    largest-|.| entry of each column positive (deterministic signs)."""
    _, vecs = top_eigvecs(g, r)
    d = vecs.shape[0]
    out = np.empty((d, r), dtype=np.float32)
    for k in range(r):
        best = 0
        for i in range(1, d):
            if abs(vecs[i, k]) > abs(vecs[best, k]):
                best = i
        sgn = -1.0 if vecs[best, k] < 0 else 1.0
        for i in range(d):
            out[i, k] = sgn * vecs[i, k]
    return out


@njit
def _tucker_hosvd(x3, ranks):
    """Truncated HOSVD of a 3-way tensor.

    Parameters
    ----------
    x3 : ndarray of shape (d0, d1, d2), float32, C-contiguous, finite
    ranks : tuple or ndarray of 3 ints
        Multilinear ranks; each is clamped to ``[1, d_i]``.

    Returns
    -------
    core : ndarray of shape (r0, r1, r2), float32
    factors : tuple (U0 [d0, r0], U1 [d1, r1], U2 [d2, r2]), float32,
        orthonormal columns
    """
    d0, d1, d2 = x3.shape
    r0 = max(1, min(ranks[0], d0))
    r1 = max(1, min(ranks[1], d1))
    r2 = max(1, min(ranks[2], d2))
    x0 = x3.reshape(d0, d1 * d2)
    # Cheaper Krylov settings than truncated_svd's defaults (block r0 + 16,
    # depth 4): only the subspace matters here, and on a flat spectrum its
    # projection error is within ~0.1 % of the exact one.
    # (np.int64, not literal constants: one compiled SVD chain with truncated_svd)
    u0 = np.ascontiguousarray(truncated_svd_opts(x0, r0, np.int64(0), np.int64(16),
                                                 np.int64(4), np.int64(64), 1e-6)[0])
    # Grams of modes 1 and 2 in float64 (products and sums), from one float64
    # copy of the tensor.
    x64 = x3.astype(np.float64)
    # mode 2: the unfolding is the transpose of the free view (d0*d1, d2).
    x2 = x64.reshape(d0 * d1, d2)
    g2 = np.dot(x2.T, x2)
    u2 = _factor_from_gram(g2, r2)
    # mode 1: Gram = sum_i0 X[i0] X[i0]^T.
    g1 = np.zeros((d1, d1), dtype=np.float64)
    for i in range(d0):
        sl = x64[i]
        g1 += np.dot(sl, sl.T)
    u1 = _factor_from_gram(g1, r1)
    # core = X x0 U0^T x1 U1^T x2 U2^T, shrinking the longest mode first.
    t0 = np.dot(u0.T, x0)                                   # (r0, d1*d2)
    t0_3 = t0.reshape(r0, d1, d2)
    t1 = np.empty((r0, r1, d2), dtype=np.float32)
    u1t = np.ascontiguousarray(u1.T)
    # np.dot(..., out): a slice assignment would compile numba's shape-mismatch
    # error formatter into this function (seconds of a cold compile)
    for a in range(r0):
        np.dot(u1t, np.ascontiguousarray(t0_3[a]), t1[a])   # (r1, d2)
    core = np.dot(t1.reshape(r0 * r1, d2), u2).reshape(r0, r1, r2)
    return core, (u0, u1, u2)


@njit
def _tucker_reconstruct(core, factors):
    """``G x0 U0 x1 U1 x2 U2``: the dense ``[d0, d1, d2]`` tensor.

    Parameters
    ----------
    core : ndarray of shape (r0, r1, r2), float32, C-contiguous
    factors : tuple of 3 ndarrays (U0 [d0, r0], U1 [d1, r1], U2 [d2, r2]),
        float32, C-contiguous

    Returns
    -------
    ndarray of shape (d0, d1, d2), float32
    """
    u0, u1, u2 = factors
    r0, r1, r2 = core.shape
    d0 = u0.shape[0]
    d1 = u1.shape[0]
    d2 = u2.shape[0]
    a = np.dot(np.ascontiguousarray(core).reshape(r0 * r1, r2),
               u2.T).reshape(r0, r1, d2)
    b = np.empty((r0, d1, d2), dtype=np.float32)
    for i in range(r0):
        np.dot(u1, np.ascontiguousarray(a[i]), b[i])
    out = np.dot(u0, b.reshape(r0, d1 * d2))
    return out.reshape(d0, d1, d2)


@njit
def tucker_params(dims, ranks):
    """Stored parameters ``r0*r1*r2 + sum_i d_i * r_i`` (ranks as given,
    not clamped, as in the upstream)."""
    return (ranks[0] * ranks[1] * ranks[2] + dims[0] * ranks[0]
            + dims[1] * ranks[1] + dims[2] * ranks[2])


# Public entry points: any real dtype / layout in, float32 C-contiguous inside.

@njit_entry
def tucker_hosvd(x3, ranks):
    """Truncated HOSVD ``x3 ~= core x0 U0 x1 U1 x2 U2`` of a 3-way tensor.

    Parameters
    ----------
    x3 : ndarray of shape (d0, d1, d2), real dtype (computed in float32), finite
    ranks : tuple, list or ndarray of 3 ints
        Multilinear ranks; each is clamped to ``[1, d_i]``.

    Returns
    -------
    core : ndarray of shape (r0, r1, r2), float32
    factors : tuple (U0 [d0, r0], U1 [d1, r1], U2 [d2, r2]), float32,
        orthonormal columns
    """
    return _tucker_hosvd(as_f32c(x3), as_i64_vector(ranks))


@njit_entry
def tucker_reconstruct(core, factors):
    """``core x0 U0 x1 U1 x2 U2``: the dense ``[d0, d1, d2]`` tensor.

    Parameters
    ----------
    core : ndarray of shape (r0, r1, r2), real dtype (computed in float32)
    factors : tuple or list of 3 ndarrays (U0 [d0, r0], U1 [d1, r1], U2 [d2, r2])

    Returns
    -------
    ndarray of shape (d0, d1, d2), float32
    """
    return _tucker_reconstruct(as_f32c(core), (as_f32c(factors[0]), as_f32c(factors[1]),
                                               as_f32c(factors[2])))
