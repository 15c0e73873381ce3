"""NumPy twins of the matmul kernels (never imports opscope_nb).

Layouts: activations ``x[m, k]``, weights ``w[k, n]``, output-major weights
``wt[n, k]``, outputs ``[m, n]``.  Quantisation: symmetric, ``scale =
amax / 127`` (1 when ``amax < 1e-20``), ``code = clamp(round_half_away(t),
-127, 127)`` with ``t = v / scale`` in float32 and ``round_half_away(t) =
trunc(t + copysign(0.5, t))`` evaluated in float64 (exact for every float32
``t``; ``floor(|t| + 0.5)`` in float32 maps 0.49999997 to 1).
"""
import numpy as np

__all__ = [
    "naive_dense_matmul",
    "naive_sparse_skip_matmul",
    "naive_factored_matmul",
    "naive_round_half_away",
    "naive_scale",
    "naive_codes",
    "naive_quantize_cols_t",
    "naive_quantize_rows_i8",
    "naive_quantize_row_i8",
    "naive_quant_matmul",
    "naive_matmul_f32",
    "naive_matmul_w8a16",
    "naive_matmul_w8a16_f32act",
    "naive_a16_levels",
    "naive_quantize_rows_i16",
    "naive_matmul_w8a8",
    "naive_i8i8_i32",
    "naive_rel_l2",
]


def naive_dense_matmul(x, w):
    """``x @ w`` with each output summed over ``p`` in order, in float32."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    m, k = x.shape
    y = np.zeros((m, w.shape[1]), np.float32)
    for p in range(k):
        y += x[:, p:p + 1] * w[p:p + 1, :]
    return y


def naive_sparse_skip_matmul(x, w):
    """Same sums as :func:`naive_dense_matmul`, zero activations left out."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    m, k = x.shape
    y = np.zeros((m, w.shape[1]), np.float32)
    for i in range(m):
        for p in np.flatnonzero(x[i]):
            y[i] += x[i, p] * w[p]
    return y


def naive_factored_matmul(x, u, v):
    """``(x @ u) @ v`` in float64, returned as float32."""
    return ((np.asarray(x, np.float64) @ u) @ v).astype(np.float32)


def naive_round_half_away(t):
    """Round half away from zero, exact for float32 ``t`` (the ``+ 0.5`` is
    done in float64, where it cannot round)."""
    t = np.asarray(t, np.float32)
    return np.trunc(t.astype(np.float64) + np.copysign(0.5, t)).astype(np.float32)


def naive_scale(amax):
    """float32 ``amax / 127``, or 1 where ``amax < 1e-20``."""
    amax = np.asarray(amax, np.float32)
    return np.where(amax < 1e-20, np.float32(1.0),
                    amax / np.float32(127.0)).astype(np.float32)


def naive_codes(v, scale):
    t = np.asarray(v, np.float32) / np.asarray(scale, np.float32)
    return np.clip(naive_round_half_away(t), -127, 127).astype(np.int8)


def naive_quantize_cols_t(w):
    w = np.asarray(w, np.float32)
    s = naive_scale(np.abs(w).max(axis=0))
    return naive_codes(w, s[None, :]).T.copy(), s


def naive_quantize_rows_i8(x):
    x = np.asarray(x, np.float32)
    s = naive_scale(np.abs(x).max(axis=1))
    return naive_codes(x, s[:, None]), s


def naive_quantize_row_i8(x):
    x = np.asarray(x, np.float32)
    s = naive_scale(np.abs(x).max())
    return naive_codes(x, s), np.float32(s)


def naive_matmul_f32(x, wt):
    return (np.asarray(x, np.float64) @ np.asarray(wt, np.float64).T).astype(np.float32)


def naive_matmul_w8a16_f32act(x, wtq, scale):
    """Upstream W8A16 formula with float activations: (x @ q.T) * scale."""
    acc = np.asarray(x, np.float64) @ np.asarray(wtq, np.float64).T
    return (acc * np.asarray(scale, np.float64)[None, :]).astype(np.float32)


def naive_a16_levels(k):
    """Largest int16 activation code such that levels * 127 * ceil(k/8) < 2**31."""
    return int(min(32767, max(1, (2**31 - 1) // (127 * max(-(-k // 8), 1)))))


def naive_quantize_rows_i16(x, levels):
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=1)
    s = np.where(amax < 1e-20, np.float32(1.0),
                 amax / np.float32(levels)).astype(np.float32)
    t = x / s[:, None]
    q = np.clip(naive_round_half_away(t), -levels, levels).astype(np.int16)
    return q, s


def naive_matmul_w8a16(x, wtq, scale):
    """W8A16 as the kernel defines it: int16 activation codes (per row,
    ``naive_a16_levels(k)`` levels) times int8 weight codes, exact integer
    sums, dequantised in float64."""
    x = np.asarray(x, np.float32)
    xq, sx = naive_quantize_rows_i16(x, naive_a16_levels(x.shape[1]))
    acc = (xq.astype(np.int64) @ np.asarray(wtq).astype(np.int64).T).astype(np.float64)
    return (acc * sx.astype(np.float64)[:, None]
            * np.asarray(scale, np.float64)[None, :]).astype(np.float32)


def naive_i8i8_i32(xq, wtq):
    return np.asarray(xq).astype(np.int32) @ np.asarray(wtq).astype(np.int32).T


def naive_matmul_w8a8(xq, sx, wtq, scale):
    acc = naive_i8i8_i32(xq, wtq).astype(np.float64)
    return (acc * np.asarray(sx, np.float64)[:, None]
            * np.asarray(scale, np.float64)[None, :]).astype(np.float32)


def naive_matmul_w8a8_f32(xq, sx, wtq, scale):
    """W8A8 finished in float32 in the kernels' order: ``(float32(acc) * sx) * scale``."""
    acc = naive_i8i8_i32(xq, wtq).astype(np.float32)
    return (acc * np.asarray(sx, np.float32)[:, None]) * np.asarray(scale, np.float32)[None, :]


def naive_quant_matmul(x, w):
    wtq, s = naive_quantize_cols_t(w)
    return naive_matmul_w8a16(x, wtq, s)


def naive_rel_l2(ref, approx):
    ref = np.asarray(ref, np.float64)
    d = np.sum((ref - np.asarray(approx, np.float64)) ** 2)
    r = np.sum(ref ** 2)
    return 0.0 if r < 1e-20 else float(np.sqrt(d / r))
