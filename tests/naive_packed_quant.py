"""NumPy twins for the packed-quantised matmul kernels (never imports the package).

Unpack the packed layouts of ``mining.pack`` in plain NumPy and multiply:
``y = x @ unpack(...).T`` in float64.
"""
import numpy as np


def round_half_away(v):
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def quant_sym(w, bits, group=None):
    """Symmetric codes/scales per row (group=None) or per group (NumPy twin)."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    g = cols if group is None else group
    ng = -(-cols // g)
    lv = max(2 ** (bits - 1) - 1, 1)
    codes = np.zeros((rows, cols), np.int8)
    scales = np.zeros((rows, ng), np.float32)
    for k in range(ng):
        blk = w[:, k * g:(k + 1) * g]
        amax = np.abs(blk).max(axis=1)
        sc = np.where(amax >= 1e-20, amax / np.float32(lv), np.float32(1.0)).astype(np.float32)
        scales[:, k] = sc
        q = round_half_away(blk / sc[:, None])
        codes[:, k * g:(k + 1) * g] = np.clip(q, -lv, lv)
    return codes, scales


def pack_nibbles(codes):
    rows, cols = codes.shape
    c = np.zeros((rows, 2 * (-(-cols // 2))), np.uint8)
    c[:, :cols] = codes.astype(np.int64) & 15
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed, cols):
    p = packed.astype(np.int64)
    v = np.empty((p.shape[0], 2 * p.shape[1]), np.int64)
    v[:, 0::2] = p & 15
    v[:, 1::2] = p >> 4
    v = np.where(v >= 8, v - 16, v)
    return v[:, :cols]


def pack_crumbs(vals):
    rows, n = vals.shape
    c = np.zeros((rows, 4 * (-(-n // 4))), np.uint8)
    c[:, :n] = vals
    return (c[:, 0::4] | (c[:, 1::4] << 2) | (c[:, 2::4] << 4) | (c[:, 3::4] << 6)).astype(np.uint8)


def unpack_ternary(packed, cols):
    p = packed.astype(np.int64)
    v = np.empty((p.shape[0], 4 * p.shape[1]), np.int64)
    for q in range(4):
        v[:, q::4] = (p >> (2 * q)) & 3
    v = np.where(v == 3, -1, v)
    return v[:, :cols]


def dequant_groups(codes, scales, cols):
    """codes int [rows, cols]; scales [rows] or [rows, ng] -> float64 What."""
    s = np.asarray(scales, np.float64)
    if s.ndim == 1:
        s = s[:, None]
    ng = s.shape[1]
    g = -(-cols // ng) if ng > 1 else cols
    # group length is the one that gives ng groups; callers pass exact groups
    return codes.astype(np.float64) * np.repeat(s, g, axis=1)[:, :cols]


def int4_dense(packed, scales, cols, group):
    codes = unpack_nibbles(packed, cols)
    s = np.asarray(scales, np.float64)
    if s.ndim == 1:
        return codes * s[:, None]
    return codes * np.repeat(s, group, axis=1)[:, :cols]


def ternary_dense(packed, alpha, cols):
    return unpack_ternary(packed, cols) * np.float64(alpha[0])


def quant_rows_i8(x):
    """Per-row int8 activation codes (the W8A8 activations)."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=1)
    s = np.where(amax >= 1e-20, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(round_half_away(x / s[:, None]), -127, 127).astype(np.int8)
    return q, s


def intn_planes(bits):
    lo = 2 if bits <= 3 else 4
    return lo, bits - lo


def _pack_fields(vals, f):
    per = 8 // f
    rows, n = vals.shape
    nb = -(-n // per)
    c = np.zeros((rows, nb * per), np.int64)
    c[:, :n] = vals
    out = np.zeros((rows, nb), np.int64)
    for q in range(per):
        out |= c[:, q::per] << (f * q)
    return out.astype(np.uint8)


def _unpack_fields(packed, f, n):
    per = 8 // f
    p = packed.astype(np.int64)
    v = np.empty((p.shape[0], p.shape[1] * per), np.int64)
    for q in range(per):
        v[:, q::per] = (p >> (f * q)) & ((1 << f) - 1)
    return v[:, :n]


def pack_intn(codes, bits):
    """Offset-binary planes (mining's intN layout): lo = low bits, hi = rest."""
    lb, hb = intn_planes(bits)
    u = codes.astype(np.int64) + (1 << (bits - 1))
    lo = _pack_fields(u & ((1 << lb) - 1), lb)
    hi = _pack_fields(u >> lb, hb) if hb else np.zeros((codes.shape[0], 0), np.uint8)
    return lo, hi


def unpack_intn(lo, hi, bits, cols):
    lb, hb = intn_planes(bits)
    u = _unpack_fields(lo, lb, cols)
    if hb:
        u = u | (_unpack_fields(hi, hb, cols) << lb)
    return u - (1 << (bits - 1))


def intn_dense(lo, hi, scales, bits, cols, group):
    codes = unpack_intn(lo, hi, bits, cols)
    s = np.asarray(scales, np.float64)
    if s.ndim == 1:
        return codes * s[:, None]
    return codes * np.repeat(s, group, axis=1)[:, :cols]
