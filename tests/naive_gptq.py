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


def gptq_natural(w, h, bits, group, damp=0.1):
    """Textbook unblocked GPTQ (Frantar et al.): columns in natural order, a
    group's unclipped scale fixed from the error-updated weights when its first
    column is reached.  The baseline the package's sweep is compared with."""
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


def clip_scales(w, imp, bits, group, steps):
    """Static group scales: per row and group the clipping ``amax * (1 - 0.5 k /
    steps)`` (k = 0..steps, float32 arithmetic) with the least ``imp``-weighted
    round-to-nearest error (summed in column order; first minimum wins)."""
    w = np.asarray(w, np.float64)
    rows, cols = w.shape
    lev = np.float32(2 ** (bits - 1) - 1)
    ng = -(-cols // group)
    scales = np.zeros((rows, ng), np.float32)
    for g in range(ng):
        sl = slice(g * group, min((g + 1) * group, cols))
        blk = w[:, sl]
        amax = np.abs(blk.astype(np.float32)).max(axis=1)
        best_e = np.full(rows, np.inf)
        best_s = np.zeros(rows, np.float32)
        for k in range(steps + 1):
            f = np.float32(1.0 - 0.5 * k / steps) if steps else np.float32(1.0)
            s = (amax * f) / lev
            q = np.clip(round_half_away(blk.astype(np.float32) / s[:, None]), -lev, lev)
            d = blk - (q * s[:, None]).astype(np.float64)
            e = np.cumsum(imp[sl] * d * d, axis=1)[:, -1]     # column order, as a loop
            better = e < best_e
            best_e = np.where(better, e, best_e)
            best_s = np.where(better, s, best_s)
        scales[:, g] = np.where(amax >= np.float32(1e-20), best_s, np.float32(1))
    return scales


def gptq_sweep(w, h, bits, group, scales, damp=0.1, act=True):
    """Textbook unblocked GPTQ with fixed group ``scales``, columns swept by
    decreasing ``H[i, i]`` (stable; natural order without ``act``): returns
    int8 codes in natural order."""
    w = np.array(w, np.float64)
    rows, cols = w.shape
    h = np.array(h, np.float64)
    order = np.argsort(-np.diag(h), kind="stable") if act else np.arange(cols)
    d = np.diag(h).copy()
    d[d <= 0] = 1.0
    h[np.arange(cols), np.arange(cols)] = d + damp * d.mean()
    hp = h[np.ix_(order, order)]
    u = np.linalg.cholesky(np.linalg.inv(hp)).T
    lev = np.float32(2 ** (bits - 1) - 1)
    w = w[:, order]
    codes = np.zeros((rows, cols), np.int8)
    for i in range(cols):
        sc = scales[:, order[i] // group]
        q = np.clip(round_half_away(w[:, i].astype(np.float32) / sc), -lev, lev)
        codes[:, order[i]] = q
        e = (w[:, i] - (q * sc).astype(np.float64)) / u[i, i]
        w[:, i + 1:] -= np.outer(e, u[i, i + 1:])
    return codes


def gptq(w, h, bits, group, damp=0.1, steps=20):
    """GPTQ as the package defines it: act-order sweep with static scales,
    run with the unclipped and the clipped scales, keeping the codes of lower
    ``tr(dW H dWᵀ)`` (ties: unclipped)."""
    h = np.array(h, np.float64)
    w64 = np.asarray(w, np.float64)
    rows, cols = w64.shape
    best = None
    for st in (0, steps):
        sc = clip_scales(w64, np.diag(h), bits, group, st)
        codes = gptq_sweep(w, h, bits, group, sc, damp)
        deq = codes.astype(np.float32) * np.repeat(sc, group, axis=1)[:, :cols]
        dw = w64 - deq
        err = float(np.einsum("ij,jk,ik->", dw, h, dw))
        if best is None or err < best[2]:
            best = (codes, sc, err)
    return best[0], best[1]
