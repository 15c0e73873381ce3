"""NumPy twins of the probes and of the synthetic-data generator.

Never imports opscope_nb: each function is the plain statement of the
definition (upstream rlx-opscope ``probe.rs`` / ``lib.rs``), written for
clarity, not speed.  Float32 values are formed with NumPy float32 operations
(correctly rounded); sums are float64.
"""
import numpy as np

__all__ = [
    "naive_round_half_away",
    "naive_levels",
    "naive_quantize_rows_sym",
    "naive_quantize_tensor_sym",
    "naive_quantize_groups_sym",
    "naive_pack_intn",
    "naive_intn_plane_bytes",
    "naive_frob",
    "naive_rel_err",
    "naive_sigma_max",
    "naive_stable_rank",
    "naive_quant_error",
    "naive_per_channel_quant_error",
    "naive_best_bitwidth",
    "naive_nm_sparsity_error",
    "naive_ternary_error",
    "naive_outlier_channels",
    "naive_cardinality",
    "naive_philox_words",
    "naive_box_muller",
    "naive_sample",
    "DIST_LABELS",
]

DIST_LABELS = ("gaussian", "uniform", "sparse90", "lowrank", "outlier",
               "quantized", "coherent")


def naive_round_half_away(v):
    """Round half away from zero; exact for float32 input (the +0.5 is done in float64)."""
    v = np.asarray(v)
    r = np.trunc(v.astype(np.float64) + np.copysign(0.5, v))
    return r.astype(v.dtype) if v.dtype.kind == "f" else r


def naive_levels(bits):
    return max(2 ** (bits - 1) - 1, 1)


def _codes(x, scale, levels):
    q = (x.astype(np.float32) / np.float32(scale)).astype(np.float32)  # IEEE float32 division
    return np.clip(naive_round_half_away(q), -levels, levels)


def naive_quantize_rows_sym(x, bits):
    x = np.asarray(x, np.float32)
    levels = naive_levels(bits)
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    scales = np.where(amax < 1e-20, np.float32(1.0),
                      amax / np.float32(levels)).astype(np.float32)
    codes = _codes(x, scales[:, None], levels).astype(np.int8)
    return codes, scales


def naive_quantize_groups_sym(x, bits, group):
    """Codes int8 [rows, cols] and scales float32 [rows, ceil(cols/group)]: one
    symmetric scale per ``group`` consecutive values of a row (last group short)."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    levels = naive_levels(bits)
    ng = -(-cols // group)
    codes = np.zeros((rows, cols), np.int8)
    scales = np.ones((rows, ng), np.float32)
    for g in range(ng):
        seg = x[:, g * group:(g + 1) * group]
        amax = np.abs(seg).max(axis=1)
        sc = np.where(amax < 1e-20, np.float32(1.0),
                      amax / np.float32(levels)).astype(np.float32)
        scales[:, g] = sc
        codes[:, g * group:(g + 1) * group] = _codes(seg, sc[:, None], levels)
    return codes, scales


def naive_intn_plane_bytes(bits, cols):
    """Bytes per row of the (lo, hi) planes: lo holds 2 bits per code for
    b <= 3 and 4 bits otherwise, hi the remaining b - lo bits."""
    lo_bits = 2 if bits <= 3 else 4
    hi_bits = bits - lo_bits
    return -(-cols * lo_bits // 8), -(-cols * hi_bits // 8)


def naive_pack_intn(codes, bits):
    """Offset-binary bit planes, written out field by field: u = code + 2^(b-1);
    lo gets u's low lo_bits, hi its high bits; column j of an f-bit plane sits
    in byte j // (8 // f) at bit f * (j % (8 // f)); unused bits are 0."""
    codes = np.asarray(codes, np.int64)
    rows, cols = codes.shape
    lo_bits = 2 if bits <= 3 else 4
    hi_bits = bits - lo_bits
    nlo, nhi = naive_intn_plane_bytes(bits, cols)
    lo = np.zeros((rows, nlo), np.int64)
    hi = np.zeros((rows, nhi), np.int64)
    u = codes + 2 ** (bits - 1)
    assert (u >= 1).all() and (u < 2 ** bits).all()
    for j in range(cols):
        per = 8 // lo_bits
        lo[:, j // per] += (u[:, j] % 2 ** lo_bits) * 2 ** (lo_bits * (j % per))
        if hi_bits:
            per = 8 // hi_bits
            hi[:, j // per] += (u[:, j] // 2 ** lo_bits) * 2 ** (hi_bits * (j % per))
    return lo.astype(np.uint8), hi.astype(np.uint8)


def naive_quantize_tensor_sym(x, bits):
    x = np.asarray(x, np.float32)
    levels = naive_levels(bits)
    amax = np.abs(x).max()
    scale = np.float32(1.0) if amax < 1e-20 else np.float32(amax) / np.float32(levels)
    return _codes(x, scale, levels).astype(np.int8), np.float32(scale)


def _ratio(num, den):
    return 0.0 if den < 1e-20 else float(np.sqrt(num / den))


def naive_frob(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.sum(x * x)))


def naive_rel_err(ref, approx):
    a = np.asarray(ref, np.float32).astype(np.float64)
    b = np.asarray(approx, np.float32).astype(np.float64)
    return _ratio(np.sum((a - b) ** 2), np.sum(a * a))


def naive_sigma_max(x, iters=30):
    """Upstream's power iteration on X^T X from v = 1/sqrt(cols)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return 0.0
    v = np.full(cols, 1.0 / np.sqrt(cols))
    for _ in range(iters):
        w = x.T @ (x @ v)
        n = np.linalg.norm(w)
        if n < 1e-20:
            break
        v = w / n
    return float(np.linalg.norm(x @ v))


def naive_stable_rank(x):
    s = naive_sigma_max(x, 30)
    if s < 1e-20:
        return 0.0
    return naive_frob(x) ** 2 / s ** 2


def _err_with_scales(x, scales, levels):
    x = np.asarray(x, np.float32)
    q = _codes(x, scales, levels).astype(np.float64) * np.asarray(scales, np.float64)
    x64 = x.astype(np.float64)
    return _ratio(np.sum((x64 - q) ** 2), np.sum(x64 * x64))


def naive_quant_error(x, bits):
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max()
    if amax < 1e-20:
        return 0.0
    levels = naive_levels(bits)
    return _err_with_scales(x, np.float32(amax) / np.float32(levels), levels)


def naive_per_channel_quant_error(x, bits):
    x = np.asarray(x, np.float32)
    levels = naive_levels(bits)
    amax = np.abs(x).max(axis=1)
    scales = np.where(amax < 1e-20, np.float32(1.0), amax / np.float32(levels))
    return _err_with_scales(x, scales.astype(np.float32)[:, None], levels)


def naive_best_bitwidth(x, budget):
    for b in (3, 4, 6, 8):
        if naive_per_channel_quant_error(x, b) < budget:
            return b
    return None


def naive_nm_sparsity_error(x, n=2, m=4):
    """Stable sort of each group by descending |v|; keep the first n.

    The row is padded to whole groups with zeros whose sort key (-1) puts them
    after every real value, so a short last group keeps its own n largest.
    """
    x = np.asarray(x, np.float32).astype(np.float64)
    rows, cols = x.shape
    groups = -(-cols // m)
    xp = np.zeros((rows, groups * m))
    xp[:, :cols] = x
    key = np.full((rows, groups * m), -1.0)
    key[:, :cols] = np.abs(x)
    xp = xp.reshape(rows, groups, m)
    order = np.argsort(-key.reshape(rows, groups, m), axis=2, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(m), axis=2)
    dropped = np.where(rank >= n, xp, 0.0)
    return _ratio(np.sum(dropped ** 2), np.sum(x * x))


def naive_ternary_error(x):
    x = np.asarray(x, np.float32).astype(np.float64).ravel()
    delta = 0.7 * np.abs(x).mean()
    kept = np.abs(x)[np.abs(x) > delta]
    alpha = kept.mean() if kept.size else 0.0
    t = np.where(x > delta, alpha, np.where(x < -delta, -alpha, 0.0))
    return _ratio(np.sum((x - t) ** 2), np.sum(x * x))


def naive_outlier_channels(x, ratio):
    x = np.asarray(x, np.float32)
    cmax = np.abs(x).max(axis=0)
    med = max(np.sort(cmax)[x.shape[1] // 2], np.float32(1e-20))
    thr = np.float32(ratio) * np.float32(med)
    return int(np.count_nonzero(cmax > thr)), float(cmax.max()) / float(med)


def naive_cardinality(x, round_to):
    x = np.asarray(x, np.float32).ravel()
    with np.errstate(over="ignore"):          # overflow to inf is part of the spec
        p = (x * np.float32(round_to)).astype(np.float32)
    r = naive_round_half_away(p).astype(np.float64)
    r = np.clip(r, -2.0 ** 63, 2.0 ** 63)   # saturate like Rust `as i64`
    return min(len(np.unique(r)), 100_001)


# ----------------------------------------------------------------- Philox

_M0 = np.uint64(0xD2561A75)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)


def naive_philox_words(seed, count, start=0):
    """Words ``start..start+count`` of rlx_ir's Philox4x32-10 stream for ``seed``."""
    if count == 0:
        return np.zeros(0, np.uint32)
    b0, b1 = start // 4, (start + count - 1) // 4
    blk = np.arange(b0, b1 + 1, dtype=np.uint64)
    s = [blk & _LO, blk >> np.uint64(32), np.zeros_like(blk), np.zeros_like(blk)]
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64(seed >> 32)
    for _ in range(10):
        p0 = s[0] * _M0
        p1 = s[2] * _M1
        s = [(p1 >> np.uint64(32)) ^ s[1] ^ k0, p1 & _LO,
             (p0 >> np.uint64(32)) ^ s[3] ^ k1, p0 & _LO]
        k0 = (k0 + _W0) & _LO
        k1 = (k1 + _W1) & _LO
    words = np.stack(s, axis=1).reshape(-1).astype(np.uint32)
    off = start - 4 * b0
    return words[off:off + count]


def naive_box_muller(words):
    w = np.asarray(words, np.uint32)
    u = (w >> np.uint32(8)).astype(np.float32) / np.float32(2 ** 24)
    u1 = np.maximum(u[0::2], np.float32(np.finfo(np.float32).tiny))
    u2 = u[1::2]
    r = np.sqrt(np.float32(-2.0) * np.log(u1))
    return (r * np.cos(np.float32(2.0) * np.float32(np.pi) * u2)).astype(np.float32)


def naive_sample(dist, rows, cols, seed=0):
    """Upstream ``sample`` with NumPy streams (see opscope_nb.io.synth for the spec)."""
    n = rows * cols
    mseed = seed ^ 0x9E3779B97F4A7C15

    def normals(sd, start, cnt):
        return naive_box_muller(naive_philox_words(sd, 2 * cnt, start))

    if n == 0:
        return np.zeros((rows, cols), np.float32)
    base = normals(seed, 0, n)
    if dist == "gaussian":
        out = base
    elif dist == "uniform":
        u = naive_philox_words(seed, n, 2 * n).astype(np.float32) / np.float32(2 ** 32 - 1)
        out = np.float32(2) * u - np.float32(1)
    elif dist == "sparse90":
        out = np.where(naive_philox_words(mseed, n) % 10 == 0, base, np.float32(0))
    elif dist == "lowrank":
        u = normals(seed, 2 * n, rows * 4).reshape(rows, 4)
        v = normals(mseed, 0, 4 * cols).reshape(4, cols)
        out = np.zeros((rows, cols), np.float32)
        for k in range(4):
            out = out + u[:, k:k + 1] * v[k:k + 1]
        out = out * np.float32(0.5)
    elif dist == "outlier":
        out = np.where(naive_philox_words(mseed, n) % 100 == 0, base * np.float32(30), base)
    elif dist == "quantized":
        out = naive_round_half_away(base * np.float32(2)) / np.float32(2)
    elif dist == "coherent":
        row = normals(seed, 2 * n, cols)
        steps = normals(mseed, 0, (rows - 1) * cols).reshape(rows - 1, cols)
        out = np.empty((rows, cols), np.float32)
        out[0] = row
        for i in range(1, rows):
            row = row + np.float32(0.15) * steps[i - 1]
            out[i] = row
    else:
        raise ValueError(dist)
    return np.asarray(out, np.float32).reshape(rows, cols)
