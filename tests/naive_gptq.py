"""Plain NumPy twins for GPTQ and the output-space error (never imports opscope_nb).

Layouts: ``w`` ``[rows, cols]`` = ``[out, in]``; ``x`` ``[tokens, cols]``;
``h`` ``[cols, cols]`` = ``x.T @ x``.
"""
import numpy as np


def round_half_away(v):
    """Round to nearest, ties away from zero (float array in, same dtype out)."""
    a = np.abs(v)
    t = np.floor(a)
    t = np.where(a - t >= 0.5, np.ceil(a), t)
    return np.where(v >= 0, t, -t).astype(v.dtype)


def out_err_explicit(w, w_hat, x):
    """``||x (w - w_hat)ᵀ||_F / ||x wᵀ||_F`` with the products formed explicitly."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    e = x @ (w - np.asarray(w_hat, np.float64)).T
    y = x @ w.T
    return float(np.sqrt((e * e).sum() / (y * y).sum()))


def rtn(w, bits, group):
    """Round-to-nearest symmetric quantisation: codes int8 [rows, cols],
    scales float32 [rows, ceil(cols/group)]."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    lev = np.float32(2 ** (bits - 1) - 1)
    ng = -(-cols // group)
    codes = np.zeros((rows, cols), np.int8)
    scales = np.zeros((rows, ng), np.float32)
    for g in range(ng):
        sl = slice(g * group, min((g + 1) * group, cols))
        amax = np.abs(w[:, sl]).max(axis=1)
        sc = np.where(amax >= np.float32(1e-20), amax / lev, np.float32(1)).astype(np.float32)
        scales[:, g] = sc
        codes[:, sl] = np.clip(round_half_away(w[:, sl] / sc[:, None]), -lev, lev)
    return codes, scales


def gptq(w, h, bits, group, damp=0.01):
    """Textbook unblocked GPTQ (columns in natural order).

    ``H`` dampened by ``damp * mean(diag H)`` after zero diagonal entries are
    set to 1; ``u`` = upper Cholesky factor of ``H^-1``; a group's scale is
    fixed from the error-updated weights when its first column is reached.
    """
    w = np.array(w, np.float64)
    rows, cols = w.shape
    h = np.array(h, np.float64)
    d = np.diag(h).copy()
    d[d <= 0] = 1.0
    h[np.arange(cols), np.arange(cols)] = d + damp * d.mean()
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    lev = np.float32(2 ** (bits - 1) - 1)
    ng = -(-cols // group)
    codes = np.zeros((rows, cols), np.int8)
    scales = np.zeros((rows, ng), np.float32)
    for i in range(cols):
        g = i // group
        if i % group == 0:
            amax = np.abs(w[:, i:min(i + group, cols)].astype(np.float32)).max(axis=1)
            scales[:, g] = np.where(amax >= np.float32(1e-20), amax / lev, np.float32(1))
        sc = scales[:, g]
        q = np.clip(round_half_away(w[:, i].astype(np.float32) / sc), -lev, lev)
        codes[:, i] = q
        e = (w[:, i] - (q * sc).astype(np.float64)) / u[i, i]
        w[:, i + 1:] -= np.outer(e, u[i, i + 1:])
    return codes, scales
