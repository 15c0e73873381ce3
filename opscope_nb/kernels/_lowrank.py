"""Cheap low-rank factoriser (the upstream's randomized range finder).

**No input validation** here; the validating twin is
:func:`opscope_nb.profile.decompose.factorize`.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit
from ._coerce import as_f32c, njit_entry
from ._krylov import _append_block, _complete_rows, uniform_sketch

__all__ = ["factorize"]


@njit_entry
def factorize(w, r, seed=0):
    """Randomized range finder ``w ~= u @ v`` in matmul layout ``w[k, n]``.

    ``Omega [n, r]`` comes from a seeded splitmix64 stream (uniform in
    [-1, 1)), ``Y = W Omega`` is orthonormalised, then two power iterations
    ``Y = W (W^T Y)`` with re-orthonormalisation after each product (the
    upstream skips it, which loses the small directions in float32), and
    finally ``V = U^T W``.  Cheaper and less accurate than
    :func:`truncated_svd` (no oversampling, no Krylov space); exact when
    ``rank(w) <= r``.  If ``w`` has fewer than ``r`` independent directions the
    basis is completed with orthonormal coordinate vectors (their ``v`` rows are
    then ~0).

    Parameters
    ----------
    w : ndarray of shape (k, n), finite; float32 C-contiguous is used as is,
        any other real dtype / layout is converted to it first
    r : int
        Rank, clamped to ``[1, min(k, n)]``.
    seed : int, optional
        Non-negative sketch seed (default 0).

    Returns
    -------
    u : ndarray of shape (k, r), float32, orthonormal columns
    v : ndarray of shape (r, n), float32
    """
    return _factorize(as_f32c(w), r, seed)


@njit
def _factorize(w, r, seed):
    """:func:`factorize` on a float32 C-contiguous ``w``."""
    k, n = w.shape
    r = max(1, min(r, min(k, n)))
    basis = np.zeros((r, k), dtype=np.float32)
    ot = uniform_sketch(r, n, seed)
    yt = np.dot(ot, w.T)                       # (r, k) = (W Omega)^T
    p = _append_block(basis, np.int64(0), yt, 1e-5)
    for _ in range(2):
        if p == 0:
            break
        zt = np.dot(np.ascontiguousarray(basis[:p]), w)     # (p, n) = (W^T Q)^T
        yt = np.dot(zt, w.T)                                # (p, k) = (W W^T Q)^T
        basis[:, :] = 0.0
        p = _append_block(basis, np.int64(0), yt, 1e-5)
    if p < r:
        _complete_rows(basis, p)
    v = np.dot(basis, w)                       # (r, n) = U^T W
    u = np.ascontiguousarray(basis.T)
    return u, v
