"""Truncated SVD cores: randomized block Krylov (Halko et al.; Musco & Musco)
with an exact Gram-eigh path for short sides.

All functions here **perform no input validation**: they expect a finite,
C-contiguous ``float32`` matrix and ``1 <= r <= min(w.shape)``.  The validating
public twin is :func:`opscope_nb.profile.svd.truncated_svd`.

Algorithm (for ``M`` = the short-fat orientation of ``w``, ``m' <= n'``)
-----------------------------------------------------------------------
* **Exact path** when ``m' <= max(64, 4 r)`` or the Krylov space would not be
  smaller than ``m'``: ``G = M M^T`` in float64, LAPACK ``eigh``,
  ``C = M^T E`` in float64.  Exact to float32 round-off.
* **Randomized block Krylov** otherwise: a uniform sketch ``Omega [n', b]``
  (``b = r + oversample``) from a serial splitmix64 stream seeded by ``seed``
  (thread-count independent); blocks ``Q_0 = orth(M Omega)``,
  ``Q_{j+1} = orth(M M^T Q_j)``, each orthogonalised twice against all earlier
  blocks and whitened by a float64 Gram-eigh (block Lanczos with full
  re-orthogonalisation; directions that are only round-off are dropped, so a
  rank-deficient ``M`` ends the space early).  No matrix passes are wasted:
  the products ``M M^T Q_j`` give the projected Gram ``G = Q^T M M^T Q``
  directly.  Block Krylov converges like a Chebyshev polynomial of the
  spectrum, so even a flat (Gaussian) spectrum gives sigma_1 to ~3e-5.
* **Ritz finish**: ``eigh(G)`` -> ``E``; ``U = Q E``; ``C^T = U^T M`` (one pass
  of width ``r``), then the exact SVD of the small ``C^T`` (float64 ``r x r``
  Gram) rotates ``U`` so ``Vt`` is orthogonal; ``S_i = ||C_i||`` (recomputed);
  ``Vt_i = C_i / S_i``.  Singular values ``<= zero_tol * S_0`` are set to 0 and
  their ``Vt`` rows completed to an orthonormal set, so ``U`` and ``Vt`` are
  always orthonormal.
* Signs follow sklearn's ``svd_flip``: the largest-magnitude entry of each
  column of ``U`` is positive.

References
----------
.. [1] N. Halko, P.-G. Martinsson, J. Tropp, "Finding structure with
   randomness", SIAM Review 53(2), 2011.
.. [2] C. Musco, C. Musco, "Randomized block Krylov methods for stronger and
   faster approximate singular value decomposition", NeurIPS 2015.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit
from ._coerce import as_f32c, njit_entry
from ._sort import argsort_stable

__all__ = ["truncated_svd", "truncated_svd_opts", "uniform_sketch",
           "top_eigvecs", "svd_flip"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@njit
def _splitmix_next(state):
    """One splitmix64 step: returns (new_state, 64-bit output)."""
    state = state + _GOLDEN
    z = state
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return state, z


@njit
def _copy_rows(dst, d0, src):
    """``dst[d0:d0 + len(src)] = src`` (with a cast) as a plain loop: a slice
    assignment from an array compiles numba's shape-mismatch error formatter
    (string joins, ~5 s of a cold compile) into its caller."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[d0 + i, j] = src[i, j]


@njit
def svd_flip(u, vt):
    """Make the largest-|.| entry of each column of ``u`` positive (in place).

    The matching row of ``vt`` is flipped with it, so ``u @ diag(s) @ vt`` is
    unchanged.  Ties keep the lowest index.

    Parameters
    ----------
    u : ndarray of shape (rows, r), float32
    vt : ndarray of shape (r, cols), float32
    """
    rows, r = u.shape
    for k in range(r):
        best = 0
        amax = -1.0
        for i in range(rows):
            a = abs(u[i, k])
            if a > amax:
                amax = a
                best = i
        if u[best, k] < 0:
            for i in range(rows):
                u[i, k] = -u[i, k]
            for j in range(vt.shape[1]):
                vt[k, j] = -vt[k, j]


@njit
def top_eigvecs(g, r):
    """Top-``r`` eigenpairs of a symmetric float64 matrix, descending.

    Parameters
    ----------
    g : ndarray of shape (d, d), float64, symmetric
    r : int
        ``1 <= r <= d``.

    Returns
    -------
    vals : ndarray of shape (r,), float64, descending
    vecs : ndarray of shape (d, r), float64, C-contiguous, orthonormal columns
    """
    d = g.shape[0]
    lam, e = np.linalg.eigh(g)
    vals = np.empty(r, dtype=np.float64)
    vecs = np.empty((d, r), dtype=np.float64)
    for k in range(r):
        src = d - 1 - k
        vals[k] = lam[src]
        for i in range(d):
            vecs[i, k] = e[i, src]
    return vals, vecs


@njit
def uniform_sketch(rows, cols, seed):
    """Uniform ``[-1, 1)`` ``float32 [rows, cols]`` matrix from a splitmix64 stream.

    Filled row-major by a serial stream, so the result depends only on
    ``(rows, cols, seed)`` (never on the thread count).  Any i.i.d. zero-mean
    sketch works for a range finder; uniform avoids transcendental calls.

    Parameters
    ----------
    rows, cols : int
        Shape of the sketch.
    seed : int
        Non-negative seed.

    Returns
    -------
    ndarray of shape (rows, cols), float32, C-contiguous
    """
    n = rows * cols
    out = np.empty(n, dtype=np.float32)
    state = np.uint64(seed) * _MIX2 + _GOLDEN
    scale = 2.0 / 16777216.0  # 2 / 2**24
    for i in range(n):
        state, z = _splitmix_next(state)
        out[i] = np.float64(z >> np.uint64(40)) * scale - 1.0
    return out.reshape(rows, cols)


@njit
def _times_m(yt, w, trans):
    """``yt @ M`` with ``M = w.T if trans else w`` (BLAS, no copy of w)."""
    if trans:
        return np.dot(yt, w.T)
    return np.dot(yt, w)


@njit
def _times_mt(zt, w, trans):
    """``zt @ M.T`` with ``M = w.T if trans else w`` (BLAS, no copy of w)."""
    if trans:
        return np.dot(zt, w)
    return np.dot(zt, w.T)


@njit
def _project_out(yt, basis, p):
    """``yt -= (yt @ basis[:p].T) @ basis[:p]`` (rows of basis orthonormal)."""
    if p == 0:
        return
    pre = basis[:p]
    coef = np.dot(yt, pre.T)
    yt -= np.dot(coef, pre)


@njit
def _whiten_rows(yt, ref2, drop_tol):
    """Orthonormal rows spanning ``yt``'s row space (float64 Gram + eigh).

    Directions whose energy is below ``drop_tol**2 * ref2`` are dropped (they
    are round-off left by projecting out an already-found subspace), so the
    result may have fewer rows than ``yt``.
    """
    yd = yt.astype(np.float64)
    h = np.dot(yd, yd.T)
    lam, v = np.linalg.eigh(h)
    k = yt.shape[0]
    keep = 0
    for i in range(k):
        if lam[i] > drop_tol * drop_tol * ref2 and lam[i] > 0.0:
            keep += 1
    out = np.empty((keep, yt.shape[1]), dtype=np.float32)
    if keep == 0:
        return out
    coef = np.empty((keep, k), dtype=np.float64)
    row = 0
    for i in range(k - 1, -1, -1):               # strongest direction first
        if lam[i] > drop_tol * drop_tol * ref2 and lam[i] > 0.0:
            inv = 1.0 / np.sqrt(lam[i])
            for j in range(k):
                coef[row, j] = v[j, i] * inv
            row += 1
    _copy_rows(out, np.int64(0), np.dot(coef, yd))
    return out


@njit
def _append_block(basis, p, yt, drop_tol):
    """Orthogonalise ``yt`` against ``basis[:p]`` (twice), whiten, append.

    Returns the new basis row count.
    """
    ref2 = 0.0
    for i in range(yt.shape[0]):
        for j in range(yt.shape[1]):
            ref2 += np.float64(yt[i, j]) * yt[i, j]
    if ref2 == 0.0:
        return p
    for _ in range(2):                             # "twice is enough"
        _project_out(yt, basis, p)
        yt = _whiten_rows(yt, ref2, drop_tol)
        ref2 = np.float64(yt.shape[0])
        if yt.shape[0] == 0:
            return p
    _copy_rows(basis, p, yt)
    return p + yt.shape[0]


@njit
def _complete_rows(vt, start):
    """Replace rows ``start..`` of ``vt`` by unit vectors orthogonal to the rest.

    Used for singular values that are numerically zero, where ``C_i / S_i``
    carries no direction.  Candidates are coordinate vectors, orthogonalised
    twice (classical Gram-Schmidt in float64) against all accepted rows.
    """
    r, n = vt.shape
    cand = 0
    row = np.empty(n, dtype=np.float64)
    for k in range(start, r):
        while cand < n:
            row[:] = 0.0
            row[cand] = 1.0
            cand += 1
            for _ in range(2):
                for p in range(k):
                    d = 0.0
                    for j in range(n):
                        d += vt[p, j] * row[j]
                    for j in range(n):
                        row[j] -= d * vt[p, j]
            nrm = np.sqrt(np.sum(row * row))
            if nrm > 0.5:
                for j in range(n):
                    vt[k, j] = row[j] / nrm
                break


@njit(inline="always")
def _exact_svd(w, trans, r, zero_tol):
    """Exact rank-``r`` SVD of ``M`` (``w.T`` if ``trans`` else ``w``) through
    the float64 Gram ``M M^T`` of its short side, LAPACK ``eigh``, and
    ``C = M^T E`` (float64, so small singular values keep their accuracy)."""
    bd = w.astype(np.float64)
    if trans:
        g = np.dot(bd.T, bd)
    else:
        g = np.dot(bd, bd.T)
    _, e = top_eigvecs(g, r)
    if trans:
        c = np.dot(bd, e)                  # (n', r) = M^T E
    else:
        c = np.dot(bd.T, e)
    n = c.shape[0]
    s = np.empty(r, dtype=np.float64)
    for k in range(r):
        acc = 0.0
        for j in range(n):
            acc += c[j, k] * c[j, k]
        s[k] = np.sqrt(acc)
    return _sort_normalise(e.astype(np.float32), np.ascontiguousarray(c.T), s, r,
                           zero_tol)


@njit
def _sort_normalise(u_in, ct, s, r, zero_tol):
    """Sort by ``s`` (descending), ``Vt_i = C_i / S_i``, complete null rows.

    ``u_in`` (m', r) are the left vectors, ``ct`` (r, n') the rows ``U^T M``.
    """
    # eigh order is by Rayleigh quotient; re-sort by the recomputed norms.
    order = argsort_stable(-s)       # descending; ties keep index order
    n = ct.shape[1]
    mp = u_in.shape[0]
    vt = np.empty((r, n), dtype=np.float32)
    u = np.empty((mp, r), dtype=np.float32)
    sf = np.empty(r, dtype=np.float32)
    smax = s[order[0]]
    nzero_from = r
    for k in range(r):
        src = order[k]
        sk = s[src]
        for i in range(mp):
            u[i, k] = u_in[i, src]
        if sk <= zero_tol * smax or sk == 0.0:
            if nzero_from == r:
                nzero_from = k
            sf[k] = 0.0
            vt[k, :] = 0.0
        else:
            sf[k] = sk
            inv = 1.0 / sk
            for j in range(n):
                vt[k, j] = ct[src, j] * inv
    if nzero_from < r:
        _complete_rows(vt, nzero_from)
    return u, sf, vt


@njit(inline="always")
def _krylov_basis(w, trans, b, depth, seed, r):
    """Orthonormal rows ``Q^T`` spanning the block Krylov space of ``M M^T``
    started at ``M O``, and ``(M M^T Q)^T`` for the Rayleigh-Ritz step.

    The space is ``span[M O, (M M^T) M O, ..., (M M^T)^depth M O]``.  Each new
    block is orthogonalised against the basis so far (block Lanczos with full
    re-orthogonalisation) so the basis stays orthonormal in float32.  The raw
    products ``M M^T Q_j`` are kept: ``Q^T (M M^T Q)`` is then the projected
    Gram matrix without another pass over ``M``.  If the space is exhausted
    (rank-deficient ``M``) it is completed with orthonormal coordinate
    directions up to ``r`` rows.

    Returns
    -------
    qt : ndarray (l', m') float32, orthonormal rows, ``l' >= r``
    yt : ndarray (l', m') float32, rows of ``(M M^T Q)^T``
    """
    mp = w.shape[1] if trans else w.shape[0]
    np_ = w.shape[0] if trans else w.shape[1]
    l = b * (depth + 1)
    basis = np.zeros((max(l, r), mp), dtype=np.float32)
    yall = np.zeros((max(l, r), mp), dtype=np.float32)
    ot = uniform_sketch(b, np_, seed)
    p = _append_block(basis, np.int64(0), _times_mt(ot, w, trans), 1e-5)   # (M O)^T
    start = 0
    for j in range(depth + 1):
        if p == start:
            break
        cur = np.ascontiguousarray(basis[start:p])                  # newest block
        yt = _times_mt(_times_m(cur, w, trans), w, trans)           # (M M^T Q_j)^T
        _copy_rows(yall, start, yt)
        if j == depth:
            break
        start = p
        p = _append_block(basis, p, yt, 1e-5)
    if p < r:
        _complete_rows(basis[:r], p)
        cur = np.ascontiguousarray(basis[p:r])
        _copy_rows(yall, p, _times_mt(_times_m(cur, w, trans), w, trans))
        p = r
    return np.ascontiguousarray(basis[:p]), np.ascontiguousarray(yall[:p])


@njit(inline="always")
def _krylov_finish(w, trans, qt, yt, r, zero_tol):
    """Rayleigh-Ritz on the Krylov basis: ``G = Q^T M M^T Q``, ``eigh``,
    ``U = Q E``, ``C^T = U^T M`` (one pass of width ``r``), then an exact
    float64 SVD of the small ``C^T`` (its ``r x r`` Gram) so the rows of
    ``Vt`` are orthogonal to float32 round-off even when ``U`` is only a
    float32-accurate Ritz basis."""
    # float32 product (yt already carries float32 round-off of M M^T Q; S and
    # Vt are recomputed from U^T M below), float64 eigh: a float32 eigh
    # compiles a second top_eigvecs / eigh chain (cold truncated_svd 20.4 s
    # against 19.1 s) to save 0.1 ms at l = 64 and 11 ms at l = 448 (warm
    # top_eigvecs, Zen 3).
    g = np.dot(qt, yt.T)
    g = np.float32(0.5) * (g + g.T)
    _, e = top_eigvecs(g.astype(np.float64), r)
    ut = np.dot(e.T.astype(np.float32), qt)        # (r, m') = (Q E)^T
    ct = _times_m(np.ascontiguousarray(ut), w, trans)   # (r, n') = U^T M
    cd = ct.astype(np.float64)
    lam, rot = top_eigvecs(np.dot(cd, cd.T), r)    # C^T = R diag(s) V^T
    ct2 = np.dot(rot.T, cd)                        # (r, n') = diag(s) V^T
    ut2 = np.dot(rot.T.astype(np.float32), ut)     # (r, m') = (U R)^T
    n = ct2.shape[1]
    s = np.empty(r, dtype=np.float64)
    for k in range(r):
        acc = 0.0
        for j in range(n):
            acc += ct2[k, j] * ct2[k, j]
        s[k] = np.sqrt(acc)
    return _sort_normalise(np.ascontiguousarray(ut2.T), ct2, s, r, zero_tol)


@njit
def truncated_svd_opts(w, r, seed, oversample, depth, exact_side, zero_tol):
    """:func:`truncated_svd` with its tuning knobs exposed.

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float32, C-contiguous, finite
    r : int
        Rank, ``1 <= r <= min(rows, cols)`` (clamped).
    seed : int
        Seed of the uniform ``[-1, 1)`` sketch (:func:`uniform_sketch`;
        non-negative).
    oversample : int
        Extra sketch columns: block size ``b = r + oversample``.
    depth : int
        Krylov depth ``q`` (``q + 1`` blocks, ``2 q + 2`` passes over ``w``).
    exact_side : int
        Use the exact Gram-eigh path when ``min(rows, cols) <= max(exact_side, 4 r)``
        or the Krylov space would not be smaller than the short side.
    zero_tol : float
        ``sigma_i <= zero_tol * sigma_1`` is reported as 0 (its singular vectors
        are then an arbitrary orthonormal completion).

    Returns
    -------
    u : ndarray (rows, r) float32, orthonormal columns
    s : ndarray (r,) float32, descending, non-negative
    vt : ndarray (r, cols) float32, orthonormal rows
    """
    rows, cols = w.shape
    trans = rows > cols                      # work on the short-fat orientation
    mp = min(rows, cols)
    r = max(1, min(r, mp))
    b = min(r + max(oversample, 0), mp)
    depth = max(depth, 0)
    if mp <= max(exact_side, 4 * r) or b * (depth + 1) >= mp:
        u, s, vt = _exact_svd(w, trans, r, zero_tol)
    else:
        qt, yt = _krylov_basis(w, trans, b, depth, seed, r)
        u, s, vt = _krylov_finish(w, trans, qt, yt, r, zero_tol)
    if trans:
        u2 = np.ascontiguousarray(vt.T)
        vt2 = np.ascontiguousarray(u.T)
        svd_flip(u2, vt2)
        return u2, s, vt2
    svd_flip(u, vt)
    return u, s, vt


@njit_entry
def truncated_svd(w, r, seed=0):
    """Rank-``r`` SVD ``w ~= u @ diag(s) @ vt`` (no input validation).

    Randomized block Krylov (block ``max(r + max(16, r // 3), 64)``, depth 6)
    for large short sides, exact float64 Gram-eigh otherwise; see the module
    docstring.

    Parameters
    ----------
    w : ndarray of shape (rows, cols), finite; float32 C-contiguous is used
        as is, any other real dtype / layout is converted to it first
    r : int
        ``1 <= r <= min(rows, cols)`` (clamped into that range).
    seed : int, optional
        Non-negative sketch seed (default 0); same seed -> same result.

    Returns
    -------
    u : ndarray (rows, r) float32
    s : ndarray (r,) float32, descending
    vt : ndarray (r, cols) float32
    """
    # Block >= 64 even for small r: sigma_1's accuracy depends on the gap
    # sigma_1 / sigma_{b+1}, which a tiny block leaves small on flat spectra.
    b = max(r + max(16, r // 3), 64)
    # np.int64, not literals: the Tucker / TT sweeps call truncated_svd_opts
    # with other constants, and literal arguments would compile a second
    # specialisation of the whole Krylov chain in the same process
    return truncated_svd_opts(as_f32c(w), r, np.int64(seed), np.int64(b - r), np.int64(6),
                              np.int64(64), 1e-6)
