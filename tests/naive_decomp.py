"""NumPy twins of the SVD and decomposition kernels (never imports opscope_nb).

Each twin is the textbook statement, computed in float64 with LAPACK's full
SVD: the reference the tests compare against.
"""
from __future__ import annotations

import numpy as np

__all__ = ["naive_truncated_svd", "naive_rank_r_error", "naive_monarch_reconstruct",
           "naive_monarch_matmul", "naive_monarch_project", "naive_unfold",
           "naive_hosvd", "naive_tucker_reconstruct", "naive_tucker_params",
           "naive_tt_svd", "naive_tt_reconstruct", "naive_tt_params",
           "naive_rel_err"]


def naive_rel_err(ref, approx):
    """||ref - approx||_F / ||ref||_F in float64 (0 for an all-zero ref)."""
    ref = np.asarray(ref, dtype=np.float64)
    approx = np.asarray(approx, dtype=np.float64)
    den = np.sqrt(np.sum(ref * ref))
    if den * den < 1e-20:
        return 0.0
    return float(np.sqrt(np.sum((ref - approx) ** 2)) / den)


def naive_truncated_svd(w, r):
    """Top-``r`` triplets of LAPACK's full SVD (float64)."""
    u, s, vt = np.linalg.svd(np.asarray(w, dtype=np.float64), full_matrices=False)
    return u[:, :r], s[:r], vt[:r]


def naive_rank_r_error(w, r):
    """Eckart-Young optimum ||w - w_r||_F (float64)."""
    s = np.linalg.svd(np.asarray(w, dtype=np.float64), compute_uv=False)
    return float(np.sqrt(np.sum(s[r:] ** 2)))


def naive_monarch_reconstruct(w1, w2):
    """Loop statement of ``M[ri*m+j, l*m+s] = w1[ri,j,l] * w2[l,s,ri]``."""
    m = w1.shape[0]
    out = np.zeros((m * m, m * m))
    for ri in range(m):
        for j in range(m):
            for l in range(m):
                for s in range(m):
                    out[ri * m + j, l * m + s] = w1[ri, j, l] * w2[l, s, ri]
    return out


def naive_monarch_matmul(x, w1, w2):
    """Two-stage Monarch product by einsum (float64)."""
    m = w1.shape[0]
    xb = np.asarray(x, dtype=np.float64).reshape(-1, m, m)     # [b, ri, j]
    t = np.einsum("brj,rjl->brl", xb, w1)                      # [b, ri, l]
    y = np.einsum("brl,lsr->bls", t, w2)                       # [b, l, s]
    return y.reshape(-1, m * m)


def naive_monarch_project(w):
    """Rank-1 LAPACK SVD of every block ``B[s, j] = W[ri*m+j, l*m+s]``."""
    n = w.shape[0]
    m = int(round(np.sqrt(n)))
    w = np.asarray(w, dtype=np.float64)
    w1 = np.zeros((m, m, m))
    w2 = np.zeros((m, m, m))
    for l in range(m):
        for ri in range(m):
            b = w[ri * m:(ri + 1) * m, l * m:(l + 1) * m].T        # B[s, j]
            u, s, vt = np.linalg.svd(b)
            w2[l, :, ri] = s[0] * u[:, 0]
            w1[ri, :, l] = vt[0]
    return w1, w2


def naive_unfold(x, mode):
    """Mode-``mode`` unfolding: ``dims[mode]`` rows, other indices row-major."""
    return np.moveaxis(np.asarray(x, dtype=np.float64), mode, 0).reshape(
        x.shape[mode], -1)


def naive_hosvd(x, ranks):
    """HOSVD from LAPACK SVDs of the three unfoldings, core by einsum."""
    rs = [max(1, min(r, d)) for r, d in zip(ranks, x.shape)]
    us = [np.linalg.svd(naive_unfold(x, k), full_matrices=False)[0][:, :rs[k]]
          for k in range(3)]
    core = np.einsum("ijk,ia,jb,kc->abc", np.asarray(x, dtype=np.float64), *us,
                     optimize=True)
    return core, us


def naive_tucker_reconstruct(core, factors):
    """``G x0 U0 x1 U1 x2 U2`` by einsum."""
    return np.einsum("abc,ia,jb,kc->ijk", np.asarray(core, dtype=np.float64),
                     *[np.asarray(f, dtype=np.float64) for f in factors], optimize=True)


def naive_tucker_params(dims, ranks):
    return int(np.prod(ranks) + sum(d * r for d, r in zip(dims, ranks)))


def naive_tt_svd(x, dims, max_rank):
    """Left-to-right TT-SVD with LAPACK SVDs (float64)."""
    c = np.asarray(x, dtype=np.float64).ravel()
    cores = []
    r_prev = 1
    for k, d in enumerate(dims[:-1]):
        rows = r_prev * d
        mat = c.reshape(rows, -1)
        rk = max(1, min(max_rank, mat.shape[0], mat.shape[1]))
        u, s, vt = np.linalg.svd(mat, full_matrices=False)
        cores.append(u[:, :rk].reshape(r_prev, d, rk))
        c = (s[:rk, None] * vt[:rk]).ravel()
        r_prev = rk
    cores.append(c.reshape(r_prev, dims[-1], 1))
    return cores


def naive_tt_reconstruct(cores):
    """Contract cores with tensordot; returns the dims-shaped tensor."""
    out = np.asarray(cores[0], dtype=np.float64)
    for g in cores[1:]:
        out = np.tensordot(out, np.asarray(g, dtype=np.float64), axes=(-1, 0))
    return out.reshape(out.shape[1:-1])


def naive_tt_params(cores):
    return int(sum(np.prod(np.shape(g)) for g in cores))
