"""``@njit`` packing and quantisation cores of the menu options (no input validation).

Symmetric group-wise quantisation along a row (one rounding core:
:func:`opscope_nb.kernels.round_half_away` on the correctly rounded float32
quotient :func:`opscope_nb.kernels.div_f32`), nibble (int4) and 2-bit (crumb)
packing, the bit-plane packing of int2/int3/int5/int6 codes
(:func:`pack_intn`), N:M pruning and ternary (TWN) codes.

intN bit planes
---------------
A ``b``-bit symmetric code ``c`` in ``[-L, L]`` (``L = 2**(b-1) - 1``) is
stored *offset binary*: ``u = c + 2**(b-1)``, an unsigned value in
``[1, 2**b - 1]`` (0 never occurs).  ``u`` is split into a low plane of
``lo_bits`` and a high plane of ``hi_bits = b - lo_bits``
(:func:`intn_plane_bits`):

====  =======  =======  ==========================================
b     lo_bits  hi_bits  planes per row (bytes)
====  =======  =======  ==========================================
2     2        0        lo: ceil(cols/4) crumbs
3     2        1        lo: ceil(cols/4) crumbs; hi: ceil(cols/8) bits
5     4        1        lo: ceil(cols/2) nibbles; hi: ceil(cols/8) bits
6     4        2        lo: ceil(cols/2) nibbles; hi: ceil(cols/4) crumbs
====  =======  =======  ==========================================

Inside a plane of field width ``f`` (1, 2 or 4 bits) column ``j`` sits in
byte ``j // (8 // f)`` at bit ``f * (j % (8 // f))`` (the lowest column in the
lowest bits, as :func:`pack_nibbles` / :func:`pack_crumbs`); unused fields of
a row's last byte are 0.  ``u = lo | (hi << lo_bits)`` and the weight is
``(u - 2**(b-1)) * scale``.  Per row the two planes take at most
``ceil(b * cols / 8) + 1`` bytes.

Layout: matrices are ``[rows, cols]`` row-major, a row is an output channel of
a PyTorch ``nn.Linear`` weight ``[out_features, in_features]``; packing runs
along a row, and each row starts at a byte boundary.

Every function assumes valid, C-contiguous input of the documented dtype; the
validating wrapper is :mod:`opscope_nb.profile.mining`.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit
from ._quant_probe import absmax_f32, div_f32, round_half_away, sym_scale

__all__ = [
    "quantize_groups_sym",
    "dequantize_groups",
    "dequantize_nibbles",
    "ternary_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "pack_crumbs",
    "unpack_crumbs",
    "nm_prune",
    "nm_unprune",
    "ternary_twn",
    "intn_plane_bits",
    "intn_row_bytes",
    "pack_intn",
    "unpack_intn",
    "dequantize_intn",
]


@njit
def quantize_groups_sym(x, bits, group):
    """Symmetric quantisation with one scale per ``group`` values of a row.

    Row ``i`` is cut into ``ceil(cols / group)`` consecutive groups (the last
    may be short).  ``levels = max(2**(bits-1) - 1, 1)``, ``scale = amax /
    levels`` (1.0 when ``amax < 1e-20``), ``code = clamp(round_half_away(x /
    scale), -levels, levels)`` with the float32 quotient :func:`div_f32` and
    the project's one rounding core :func:`round_half_away`.  ``group = cols``
    is per-channel (per-row) and gives exactly the codes and scales of
    :func:`opscope_nb.kernels.quantize_rows_sym`.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32, C-contiguous
    bits : int
        2..8.
    group : int
        Group length along a row (``>= 1``).

    Returns
    -------
    codes : ndarray of shape (rows, cols), int8
    scales : ndarray of shape (rows, ceil(cols / group)), float32
    """
    rows, cols = x.shape
    ng = (cols + group - 1) // group
    levels = max((1 << (bits - 1)) - 1, 1)
    flev = np.float32(levels)
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, ng), dtype=np.float32)
    for i in range(rows):
        for g in range(ng):
            lo = g * group
            hi = min(lo + group, cols)
            amax = absmax_f32(x[i], lo, hi)
            sc = sym_scale(amax, flev)
            scales[i, g] = sc
            for j in range(lo, hi):
                r = round_half_away(div_f32(x[i, j], sc))
                if r > flev:
                    r = flev
                elif r < -flev:
                    r = -flev
                codes[i, j] = np.int8(r)
    return codes, scales


@njit
def dequantize_groups(codes, scales, group):
    """Inverse of :func:`quantize_groups_sym`: ``codes * scale`` in float32.

    Parameters
    ----------
    codes : ndarray of shape (rows, cols), int8
    scales : ndarray of shape (rows, ceil(cols / group)), float32
    group : int

    Returns
    -------
    ndarray of shape (rows, cols), float32
    """
    rows, cols = codes.shape
    out = np.empty((rows, cols), dtype=np.float32)
    ng = (cols + group - 1) // group
    for i in range(rows):
        for g in range(ng):
            sc = scales[i, g]
            for j in range(g * group, min(g * group + group, cols)):
                out[i, j] = np.float32(codes[i, j]) * sc
    return out


@njit
def dequantize_nibbles(packed, scales, group, cols):
    """Fused :func:`unpack_nibbles` + :func:`dequantize_groups` for int4.

    Parameters
    ----------
    packed : ndarray of shape (rows, ceil(cols / 2)), uint8
    scales : ndarray of shape (rows, ceil(cols / group)), float32
    group, cols : int

    Returns
    -------
    ndarray of shape (rows, cols), float32
    """
    rows = packed.shape[0]
    out = np.empty((rows, cols), dtype=np.float32)
    ng = (cols + group - 1) // group
    for i in range(rows):
        for g in range(ng):
            sc = scales[i, g]
            for j in range(g * group, min(g * group + group, cols)):
                v = (np.int32(packed[i, j >> 1]) >> (4 * (j & 1))) & 0xF
                v -= (v & 8) << 1  # sign-extend the nibble
                out[i, j] = np.float32(v) * sc
    return out


@njit
def ternary_decode(packed, alpha, cols):
    """Dense float32 ``alpha * code`` from 2-bit ternary codes (0 -> 0,
    1 -> +1, 3 -> -1), packed as in :func:`pack_crumbs`.

    Parameters
    ----------
    packed : ndarray of shape (rows, ceil(cols / 4)), uint8
    alpha : float32
    cols : int

    Returns
    -------
    ndarray of shape (rows, cols), float32
    """
    rows = packed.shape[0]
    out = np.empty((rows, cols), dtype=np.float32)
    lut = np.array([0.0, 1.0, 0.0, -1.0], dtype=np.float32) * alpha
    for i in range(rows):
        for j in range(cols):
            out[i, j] = lut[(np.int32(packed[i, j >> 2]) >> (2 * (j & 3))) & 3]
    return out


@njit
def pack_nibbles(codes):
    """Pack int4 codes (two's complement, in [-8, 7]) two per byte, per row.

    Column ``2t`` goes to the low nibble of byte ``t``, column ``2t+1`` to the
    high nibble; an odd last column leaves the high nibble zero.

    Parameters
    ----------
    codes : ndarray of shape (rows, cols), int8

    Returns
    -------
    ndarray of shape (rows, ceil(cols / 2)), uint8
    """
    rows, cols = codes.shape
    nb = (cols + 1) // 2
    out = np.zeros((rows, nb), dtype=np.uint8)
    for i in range(rows):
        for j in range(cols):
            v = np.int64(codes[i, j]) & 0xF
            out[i, j >> 1] |= np.uint8(v << (4 * (j & 1)))
    return out


@njit
def unpack_nibbles(packed, cols):
    """Inverse of :func:`pack_nibbles`.

    Parameters
    ----------
    packed : ndarray of shape (rows, ceil(cols / 2)), uint8
    cols : int

    Returns
    -------
    ndarray of shape (rows, cols), int8
    """
    rows = packed.shape[0]
    out = np.empty((rows, cols), dtype=np.int8)
    for i in range(rows):
        for j in range(cols):
            v = (np.int64(packed[i, j >> 1]) >> (4 * (j & 1))) & 0xF
            if v >= 8:
                v -= 16
            out[i, j] = np.int8(v)
    return out


@njit
def pack_crumbs(vals):
    """Pack 2-bit values (0..3) four per byte, per row (value ``4t+q`` in bits
    ``2q..2q+1`` of byte ``t``).

    Parameters
    ----------
    vals : ndarray of shape (rows, n), uint8, each in 0..3

    Returns
    -------
    ndarray of shape (rows, ceil(n / 4)), uint8
    """
    rows, n = vals.shape
    nb = (n + 3) // 4
    out = np.zeros((rows, nb), dtype=np.uint8)
    for i in range(rows):
        for j in range(n):
            v = np.int64(vals[i, j]) & 3
            out[i, j >> 2] |= np.uint8(v << (2 * (j & 3)))
    return out


@njit
def unpack_crumbs(packed, n):
    """Inverse of :func:`pack_crumbs`.

    Parameters
    ----------
    packed : ndarray of shape (rows, ceil(n / 4)), uint8
    n : int

    Returns
    -------
    ndarray of shape (rows, n), uint8 in 0..3
    """
    rows = packed.shape[0]
    out = np.empty((rows, n), dtype=np.uint8)
    for i in range(rows):
        for j in range(n):
            out[i, j] = np.uint8((np.int64(packed[i, j >> 2]) >> (2 * (j & 3))) & 3)
    return out


@njit
def nm_prune(x, n, m):
    """N:M structured pruning along each row: the kept values and their slots.

    Every row is cut into groups of ``m`` consecutive values (the last may be
    short); in each group the ``n`` largest ``|v|`` are kept (ties keep the
    lower index), all of a group shorter than ``n``.  Kept values are stored in
    increasing column order with their position inside the group.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32
    n, m : int
        ``1 <= n <= m <= 256``.

    Returns
    -------
    values : ndarray of shape (rows, nv), float32
    slots : ndarray of shape (rows, nv), uint8
        Position of each kept value inside its group (``0..m-1``).
        ``nv = n * (cols // m) + min(n, cols % m)``.
    """
    rows, cols = x.shape
    full = cols // m
    tail = cols - full * m
    nv = n * full + min(n, tail)
    values = np.empty((rows, nv), dtype=np.float32)
    slots = np.empty((rows, nv), dtype=np.uint8)
    keep = np.zeros(m, dtype=np.bool_)
    for i in range(rows):
        t = 0
        for lo in range(0, cols, m):
            ln = min(m, cols - lo)
            kn = min(n, ln)
            for q in range(ln):
                keep[q] = False
            for _ in range(kn):
                bq = -1
                bv = np.float32(0.0)
                for q in range(ln):
                    if keep[q]:
                        continue
                    a = abs(x[i, lo + q])
                    if bq < 0 or a > bv:
                        bq = q
                        bv = a
                keep[bq] = True
            for q in range(ln):
                if keep[q]:
                    values[i, t] = x[i, lo + q]
                    slots[i, t] = np.uint8(q)
                    t += 1
    return values, slots


@njit
def nm_unprune(values, slots, cols, n, m):
    """Scatter :func:`nm_prune` output back to a dense ``[rows, cols]`` float32.

    Parameters
    ----------
    values : ndarray of shape (rows, nv), float32
    slots : ndarray of shape (rows, nv), uint8
    cols, n, m : int

    Returns
    -------
    ndarray of shape (rows, cols), float32
    """
    rows = values.shape[0]
    out = np.zeros((rows, cols), dtype=np.float32)
    for i in range(rows):
        t = 0
        for lo in range(0, cols, m):
            kn = min(n, cols - lo)
            for _ in range(kn):
                out[i, lo + slots[i, t]] = values[i, t]
                t += 1
    return out


@njit
def ternary_twn(x):
    """Ternary weight network codes (Li & Liu 2016), one scale per tensor.

    ``delta = 0.7 * mean|x|``, ``alpha = mean of |x| over |x| > delta``
    (0 when nothing passes), codes ``+1`` where ``x > delta``, ``-1`` where
    ``x < -delta``, else 0.  Sums are accumulated in float64.

    Parameters
    ----------
    x : ndarray of shape (rows, cols), float32

    Returns
    -------
    codes : ndarray of shape (rows, cols), int8 in {-1, 0, 1}
    alpha : float32
    """
    rows, cols = x.shape
    tot = 0.0
    for i in range(rows):
        for j in range(cols):
            tot += abs(x[i, j])
    delta = np.float32(0.7 * tot / (rows * cols))
    s = 0.0
    cnt = 0
    codes = np.zeros((rows, cols), dtype=np.int8)
    for i in range(rows):
        for j in range(cols):
            v = x[i, j]
            if v > delta:
                codes[i, j] = 1
                s += v
                cnt += 1
            elif v < -delta:
                codes[i, j] = -1
                s -= v
                cnt += 1
    alpha = np.float32(s / cnt) if cnt > 0 else np.float32(0.0)
    return codes, alpha



# ───────────────────────────── intN bit planes ─────────────────────────────

@njit
def intn_plane_bits(bits):
    """``(lo_bits, hi_bits)`` of the bit-plane layout of ``bits``-bit codes:
    2 -> (2, 0), 3 -> (2, 1), 5 -> (4, 1), 6 -> (4, 2) (4 -> (4, 0)).
    No input validation (``2 <= bits <= 6``)."""
    lo = 2 if bits <= 3 else 4
    return lo, bits - lo


@njit
def _plane_shift(f):
    """``(s, q)`` for a plane of ``f``-bit fields: column ``j`` is in byte
    ``j >> s`` at field ``j & q`` (``8 // f`` fields per byte)."""
    if f == 1:
        return 3, 7
    if f == 2:
        return 2, 3
    return 1, 1


@njit
def intn_row_bytes(bits, cols):
    """``(lo, hi)`` plane widths in bytes of one row of ``cols`` codes:
    ``ceil(cols * lo_bits / 8)``, ``ceil(cols * hi_bits / 8)``."""
    lb, hb = intn_plane_bits(bits)
    return (cols * lb + 7) // 8, (cols * hb + 7) // 8


@njit
def pack_intn(codes, bits):
    """Pack symmetric ``bits``-bit codes into offset-binary bit planes.

    Parameters
    ----------
    codes : ndarray of shape (rows, cols), int8
        Each in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``.
    bits : int
        2, 3, 5 or 6.

    Returns
    -------
    lo : ndarray of shape (rows, ceil(cols * lo_bits / 8)), uint8
        Low ``lo_bits`` of ``u = code + 2**(bits-1)`` (see the module
        docstring for the bit positions).
    hi : ndarray of shape (rows, ceil(cols * hi_bits / 8)), uint8
        High ``hi_bits`` of ``u``; shape ``(rows, 0)`` when ``bits == 2``.
    """
    rows, cols = codes.shape
    lb, hb = intn_plane_bits(bits)
    nlo, nhi = intn_row_bytes(bits, cols)
    off = np.int64(1) << (bits - 1)
    lmask = (np.int64(1) << lb) - 1
    ls, lq = _plane_shift(lb)
    hs, hq = _plane_shift(hb)
    lo = np.zeros((rows, nlo), dtype=np.uint8)
    hi = np.zeros((rows, nhi), dtype=np.uint8)
    for i in range(rows):
        for j in range(cols):
            u = np.int64(codes[i, j]) + off
            lo[i, j >> ls] |= np.uint8((u & lmask) << (lb * (j & lq)))
            if hb > 0:
                hi[i, j >> hs] |= np.uint8((u >> lb) << (hb * (j & hq)))
    return lo, hi


@njit
def unpack_intn(lo, hi, bits, cols):
    """Inverse of :func:`pack_intn`: the signed codes.

    Parameters
    ----------
    lo, hi : ndarray of uint8
        As returned by :func:`pack_intn` (``hi`` may have 0 columns for
        ``bits == 2``).
    bits, cols : int

    Returns
    -------
    ndarray of shape (rows, cols), int8
    """
    rows = lo.shape[0]
    lb, hb = intn_plane_bits(bits)
    off = np.int64(1) << (bits - 1)
    lmask = (np.int64(1) << lb) - 1
    hmask = (np.int64(1) << hb) - 1
    ls, lq = _plane_shift(lb)
    hs, hq = _plane_shift(hb)
    out = np.empty((rows, cols), dtype=np.int8)
    for i in range(rows):
        for j in range(cols):
            u = (np.int64(lo[i, j >> ls]) >> (lb * (j & lq))) & lmask
            if hb > 0:
                u |= ((np.int64(hi[i, j >> hs]) >> (hb * (j & hq))) & hmask) << lb
            out[i, j] = np.int8(u - off)
    return out


@njit
def dequantize_intn(lo, hi, scales, bits, group, cols):
    """Fused :func:`unpack_intn` + :func:`dequantize_groups`: ``code * scale``.

    Parameters
    ----------
    lo, hi : ndarray of uint8
        Bit planes of :func:`pack_intn`.
    scales : ndarray of shape (rows, ceil(cols / group)), float32
        ``group = cols`` (one column) for per-channel scales.
    bits, group, cols : int

    Returns
    -------
    ndarray of shape (rows, cols), float32
    """
    rows = lo.shape[0]
    lb, hb = intn_plane_bits(bits)
    off = np.int64(1) << (bits - 1)
    lmask = (np.int64(1) << lb) - 1
    hmask = (np.int64(1) << hb) - 1
    ls, lq = _plane_shift(lb)
    hs, hq = _plane_shift(hb)
    ng = (cols + group - 1) // group
    out = np.empty((rows, cols), dtype=np.float32)
    for i in range(rows):
        for g in range(ng):
            sc = scales[i, g]
            for j in range(g * group, min(g * group + group, cols)):
                u = (np.int64(lo[i, j >> ls]) >> (lb * (j & lq))) & lmask
                if hb > 0:
                    u |= ((np.int64(hi[i, j >> hs]) >> (hb * (j & hq))) & hmask) << lb
                out[i, j] = np.float32(u - off) * sc
    return out
