"""Monarch matrices (Dao et al. 2022) for square ``n = m**2`` weights.

Index convention (the upstream's), for ``W`` of shape ``[n, n]`` read as
``x[n] @ W`` (row index = input, column index = output):

* block ``(l, ri)`` is ``B[s, j] = W[ri*m + j, l*m + s]`` (``m x m``);
* its best rank-1 approximation ``sigma * u v^T`` gives
  ``w2[l, s, ri] = sigma * u_s`` and ``w1[ri, j, l] = v_j``;
* the implied dense matrix is ``M[ri*m + j, l*m + s] = w1[ri, j, l] * w2[l, s, ri]``.

``monarch_matmul`` applies ``x @ M`` in ``2 * batch * m**3`` multiply-adds.
Kernels here do **no input validation**; the validating twins are in
:mod:`opscope_nb.profile.decompose`.

References
----------
.. [1] T. Dao et al., "Monarch: Expressive structured matrices for efficient
   and accurate training", ICML 2022.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import njit, njit_parallel
from ._coerce import as_f32c, njit_entry

__all__ = ["monarch_blocks", "monarch_params", "monarch_project",
           "monarch_reconstruct", "monarch_matmul"]


@njit
def monarch_blocks(n):
    """Block size ``m`` with ``m * m == n``, or ``None`` when ``n`` is not a
    perfect square (or ``n < 1``).

    Parameters
    ----------
    n : int

    Returns
    -------
    int or None
    """
    if n < 1:
        return None
    m = int(np.sqrt(np.float64(n)) + 0.5)
    while m * m > n:
        m -= 1
    while (m + 1) * (m + 1) <= n:
        m += 1
    if m * m == n:
        return m
    return None


@njit
def monarch_params(m):
    """Stored parameters of a Monarch factorisation: ``2 * m**3``."""
    return 2 * m * m * m


@njit_parallel
def _monarch_project(w):
    """Best Monarch approximation of a square ``w [n, n]``, ``n = m**2``.

    Each of the ``m**2`` blocks gets its exact best rank-1 approximation: the
    top eigenvector of the ``m x m`` float64 Gram ``B^T B`` (LAPACK ``eigh``;
    exact even on clustered spectra, unlike a fixed power iteration), computed
    in parallel over blocks.  Sign: the largest-|.| entry of each ``w1`` fibre
    is positive.

    Parameters
    ----------
    w : ndarray of shape (n, n), float32, C-contiguous; ``n`` a perfect square

    Returns
    -------
    w1 : ndarray of shape (m, m, m), float32, ``w1[ri, j, l]``
    w2 : ndarray of shape (m, m, m), float32, ``w2[l, s, ri]``
    """
    n = w.shape[0]
    m = int(np.sqrt(np.float64(n)) + 0.5)
    w1 = np.zeros((m, m, m), dtype=np.float32)
    w2 = np.zeros((m, m, m), dtype=np.float32)
    for idx in prange(m * m):
        l = idx // m
        ri = idx % m
        blk = np.empty((m, m), dtype=np.float64)     # blk[j, s] = B[s, j]
        for j in range(m):
            for s in range(m):
                blk[j, s] = w[ri * m + j, l * m + s]
        g = np.dot(blk, blk.T)                         # (j, j) Gram
        _, vecs = np.linalg.eigh(g)
        v = vecs[:, m - 1].copy()
        best = 0
        for j in range(1, m):
            if abs(v[j]) > abs(v[best]):
                best = j
        if v[best] < 0:
            v = -v
        for j in range(m):
            w1[ri, j, l] = v[j]
        for s in range(m):
            acc = 0.0
            for j in range(m):
                acc += blk[j, s] * v[j]
            w2[l, s, ri] = acc                          # sigma * u_s
    return w1, w2


@njit_parallel
def _monarch_reconstruct(w1, w2):
    """Dense ``W[ri*m + j, l*m + s] = w1[ri, j, l] * w2[l, s, ri]``.

    Parameters
    ----------
    w1, w2 : ndarray of shape (m, m, m), float32

    Returns
    -------
    ndarray of shape (m*m, m*m), float32
    """
    m = w1.shape[0]
    n = m * m
    out = np.empty((n, n), dtype=np.float32)
    # parallel: 36.7 ms against 62.6 ms serial at 4096 x 4096 (Zen 3, 2 threads),
    # which repays its ~1 s of extra compile on a model's first large layers
    for ri in prange(m):
        for j in range(m):
            row = ri * m + j
            for l in range(m):
                a = w1[ri, j, l]
                for s in range(m):
                    out[row, l * m + s] = a * w2[l, s, ri]
    return out


@njit_parallel
def _monarch_matmul(x, w1, w2):
    """``y = x @ M`` for the Monarch matrix ``M`` of ``(w1, w2)``.

    ``t[ri, l] = sum_j x[ri*m + j] w1[ri, j, l]``, then
    ``y[l*m + s] = sum_ri t[ri, l] w2[l, s, ri]``: ``2 * batch * m**3``
    multiply-adds, rows processed in parallel.

    Parameters
    ----------
    x : ndarray of shape (batch, m*m), float32, C-contiguous
    w1, w2 : ndarray of shape (m, m, m), float32

    Returns
    -------
    ndarray of shape (batch, m*m), float32
    """
    batch = x.shape[0]
    m = w1.shape[0]
    n = m * m
    y = np.empty((batch, n), dtype=np.float32)
    for b in prange(batch):
        t = np.zeros((m, m), dtype=np.float32)         # t[ri, l]
        for ri in range(m):
            for j in range(m):
                xv = x[b, ri * m + j]
                for l in range(m):
                    t[ri, l] += xv * w1[ri, j, l]
        for l in range(m):
            for s in range(m):
                acc = np.float32(0.0)
                for ri in range(m):
                    acc += t[ri, l] * w2[l, s, ri]
                y[b, l * m + s] = acc
    return y


# Public entry points: any real dtype / layout in, float32 C-contiguous inside
# (a no-op for input that already is), so Python callers and numba callers
# alike can pass what they have.

@njit_entry
def monarch_project(w):
    """Best Monarch approximation ``(w1, w2)`` of a square ``w [n, n]``, ``n = m**2``.

    Parameters
    ----------
    w : ndarray of shape (n, n), real dtype (computed in float32), finite;
        ``n`` a perfect square (matmul layout: the implied operator is ``x @ W``)

    Returns
    -------
    w1 : ndarray of shape (m, m, m), float32, ``w1[ri, j, l]``
    w2 : ndarray of shape (m, m, m), float32, ``w2[l, s, ri]``

    See ``_monarch_project`` for the block convention and the method.
    """
    return _monarch_project(as_f32c(w))


@njit_entry
def monarch_reconstruct(w1, w2):
    """Dense ``W[ri*m + j, l*m + s] = w1[ri, j, l] * w2[l, s, ri]``.

    Parameters
    ----------
    w1, w2 : ndarray of shape (m, m, m), real dtype (computed in float32)

    Returns
    -------
    ndarray of shape (m*m, m*m), float32
    """
    return _monarch_reconstruct(as_f32c(w1), as_f32c(w2))


@njit_entry
def monarch_matmul(x, w1, w2):
    """``y[batch, n] = x[batch, n] @ monarch_reconstruct(w1, w2)`` in ``2 * batch * m**3``
    multiply-adds.

    Parameters
    ----------
    x : ndarray of shape (batch, m*m), real dtype (computed in float32)
    w1, w2 : ndarray of shape (m, m, m), real dtype

    Returns
    -------
    ndarray of shape (batch, m*m), float32
    """
    return _monarch_matmul(as_f32c(x), as_f32c(w1), as_f32c(w2))
