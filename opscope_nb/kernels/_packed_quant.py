"""Matmul ``@njit`` cores computing straight from *packed* quantised weights.

``y[m, rows] = x[m, cols] @ What.T`` where ``What`` is the dequantised weight
of :func:`opscope_nb.profile.mining.pack`; the dense ``What`` is never materialised.
Layouts (every array C-contiguous; weight row = output channel, so the packed
arrays are already output-major):

================  ==========================================================
kind              arrays
================  ==========================================================
``int8/chan``     ``codes`` int8 [rows, cols]; ``scales`` float32 [rows]
``int4/chan``     ``codes`` uint8 [rows, ceil(cols/2)] (two's-complement
                  nibbles, column ``2t`` in the low nibble of byte ``t``);
                  ``scales`` float32 [rows]
``int4/g{g}``     ``codes`` as int4/chan; ``scales`` float32 [rows, ceil(cols/g)]
                  (the last group may be short)
``ternary``       ``codes`` uint8 [rows, ceil(cols/4)] (column ``4t+q`` in bits
                  ``2q..2q+1`` of byte ``t``: 0 -> 0, 1 -> +1, 3 -> -1);
                  ``alpha`` float32 [1]
``int{b}/chan``,  (b = 2, 3, 5, 6) offset codes ``u = code + 2**(b-1)``:
``int{b}/g{g}``   ``lo`` uint8 [rows, ceil(cols*lb/8)] (low ``lb`` bits, lb = 2
                  for b <= 3 else 4), ``hi`` uint8 [rows, ceil(cols*(b-lb)/8)]
                  (the rest; absent for b = 2); column ``j`` in byte
                  ``j // (8/f)`` at bit ``f * (j % (8/f))`` of a plane of
                  ``f``-bit fields; ``scales`` float32 [rows] or
                  [rows, ceil(cols/g)]
================  ==========================================================

``act="auto"`` (runtime) runs the int8-activation path for every kind here:
measured on the Zen 4 development machine (benchmarks/bench_packed_quant.py),
it is at least as fast as the int16 path at m = 1 (both stream the same
weight bytes; the A8 inner step is one ``vpdpbusd`` per 32 weights against
two zero-extends and two ``vpmaddwd``) and faster at m = 32.  Use
``act="f32"`` when the ~1 % int8 activation error matters.

Activations
-----------
* ``a8`` (``act="int8"``): each row of ``x`` is quantised to int8
  (:func:`~opscope_nb.kernels.quantize_rows_i8`: ``sx = amax/127``, round half
  away from zero), the products are exact integer sums per scale group, then
  ``y = sum * sx * scale``.  Error vs ``x @ What.T``: the int8 rounding of
  ``x`` (about 0.5 % relative on Gaussian data).
* ``a16`` (``act="f32"``): each row of ``x`` becomes int16 codes with
  ``levels = min(32767, (2**31 - 1) // (umax * flush_columns))`` (so no int32
  lane can overflow), relative rounding ~1e-5 of the row maximum; sums are
  exact integers per scale group.

How the SIMD works (:mod:`._simd_lowbit`): the packed bytes are turned into
unsigned offset codes in registers (``nibble ^ 8``, ``(crumb + 1) & 3``),
multiplied with activations that were *rearranged once per call* so that
each nibble/crumb field lines up with its activation lane, and the offset is
removed exactly with one precomputed ``offset * sum(x)`` per scale group.
int8 activations use ``vpdpbusd`` (AVX-512 VNNI / AVX-VNNI) or
``vpmaddubsw`` + ``vpmaddwd`` (AVX2); int16 activations use ``vpmaddwd``.
Columns past the last whole unit (64 columns; 128 for ternary) or
group, and group sizes that are neither 32 nor a multiple of the unit, take a
scalar path with the same integer sums.

int4/g32 with int8 activations (the W4A8 format of ONNX Runtime's
``MatMulNBits``) steps through 128-column double units whenever the number of
64-column units is even (tile mode 3: the two 32-byte weight loads are
dword-permuted so every int32 lane sums 16 columns of one group, halving the
per-group convert/scale work); otherwise 64-column units (mode 1).

intN (int2/3/5/6) with int8 activations steps through 128-column *big
units* whose four slot vectors carry the whole offset code (the ``hi`` plane is
merged into the ``lo`` fields in registers; tile modes 4-6 of
:mod:`._simd_lowbit`), so a unit costs four ``vpdpbusd`` per weight row for
every bit width; groups that are neither 32 nor a multiple of 128, rows
narrower than 128 columns and int16 activations keep the 64-column modes.

int4 with int8 activations at ``m >= W4_PANEL_MIN_M`` on a ``vpdpbusd`` or AVX2 host
(per channel, or groups that are a multiple of 32) runs the outer-product
panel of :mod:`._w4panel` instead of the dot tiles below (6 outputs unpacked
once per tile and broadcast against 16 activation rows; 32 x 4096 x 4096
int4/g32 on the Zen 4 development machine, 2 threads: 3.5-3.9 ms -> 1.7-1.8 ms
in one-off timings); its ``n % 6`` last outputs take the dot tiles.

Decode (``m < 4``) uses a 1 row x 4 outputs tile; prefill (``m >= 4``) a
4 rows x 2 outputs tile, so each unpacked weight vector is reused by four
activation rows from registers.  Prefill is k-blocked (``_blocks_kb``): for
each block of 2048 columns (whole flushes) the tiles of 16 output blocks run
against the same L1-resident activation block, weight pair outer and
activation rows inner, and the partial sums are added in float64 -- without
it every tile re-read its activation rows over the full depth from the
caches and two threads ran no faster than one (W4A8 32 x 4096 x 4096 on the
Zen 4 development machine, ``python bench.py`` section 9, this blocking plus
the scale-row prefetch: 6.90 ms -> 3.69 ms).  Output blocks of four run in parallel
(``prange``) above ``min_parallel`` multiply-adds; the split never depends on
the thread count and every output is computed by one thread in a fixed
order, so results are reproducible.

These cores assume valid input (validated in :mod:`opscope_nb.runtime`).
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from ._jit import NO_JIT, njit, njit_parallel

# Thin wrappers and small helpers are ``inline="always"`` (inlined in numba IR
# into their caller): a wrapper compiled as a function of its own re-optimises
# and re-emits the machine code of everything it calls, and a chain of four
# of them around ``_run`` cost as much compile time as ``_run`` itself (a
# cold ``PackedLinear`` int4 call: 4 x ~8 s of ~90 s on the 2-core host).
# The public cores below are plain @njit functions that call a parallel
# (prange) kernel; numba's thread pool is started by ``_config`` at import
# (a cached serial caller would not start it, and its first call crashed).
from ._w8a8 import (
    PAR_MIN,
    _q8_par,
    _q8_rows,
    _q16_par,
    _q16_rows,
    dynamic_matmul_w8a8,
    matmul_w8a16,
    quantize_rows_i8,
    quantize_rows_i16,
)
from ._quant_probe import absmax_f32
from ._w4panel import W4_PANEL, W4_PANEL_J, w4a8_panel_matmul
from ._simd_lowbit import (
    LOWBIT_BIG_LANES,
    LOWBIT_BIG_UNIT,
    LOWBIT_LANES,
    LOWBIT_OFFSET,
    LOWBIT_PATH,
    LOWBIT_PLANE_BYTES,
    LOWBIT_SLOTS,
    LOWBIT_UNIT,
    lowbit_tile_1x1,
    lowbit_tile_1x4,
    lowbit_tile_1x8,
    lowbit_tile_4x2,
)

__all__ = [
    "FMT_INT4",
    "FMT_TERNARY",
    "lowbit_matmul_a8",
    "lowbit_matmul_a16",
    "w4a8_matmul",
    "W4_PANEL_MIN_M",
    "w4a8_tiles_kw",
    "w4a16_matmul",
    "ternary_matmul_a8",
    "ternary_matmul_a16",
    "packed_int8_linear",
    "packed_int4_linear",
    "packed_ternary_linear",
    "intn_fmt",
    "intn_matmul_a8",
    "intn_matmul_a16",
    "packed_intn_linear",
    "packed_int4_linear_a8",
    "packed_int4_linear_a16",
    "packed_ternary_linear_a8",
    "packed_ternary_linear_a16",
    "intn_linear_entry",
    "int4_linear_checked_a8",
    "int4_linear_checked_a16",
    "ternary_linear_checked_a8",
    "ternary_linear_checked_a16",
]

#: ``fmt`` id of two's-complement nibbles (int4/chan, int4/g{g}).
FMT_INT4 = 0
#: ``fmt`` id of ternary 2-bit crumbs.
FMT_TERNARY = 1

_NB = 4
_NCHUNK = 16
#: units per flush in mode 0 (per-row scale)
_UPF0 = 8


_LANES = LOWBIT_LANES
_BIGL = LOWBIT_BIG_LANES
_PBYTES = LOWBIT_PLANE_BYTES
_BIGU = LOWBIT_BIG_UNIT
_SLOTS = LOWBIT_SLOTS
_UNIT = LOWBIT_UNIT
_OFF = LOWBIT_OFFSET


@njit(inline="always")
def _bits(fmt):
    """Code width of an intN fmt (2, 3, 5, 6)."""
    return (0, 0, 2, 3, 5, 6)[fmt]


@njit(inline="always")
def _umax(fmt):
    """Largest unsigned offset code of ``fmt``."""
    if fmt == 0:
        return 15
    if fmt == 1:
        return 3
    return (1 << _bits(fmt)) - 1


@njit(inline="always")
def _field(plane, j, p, f):
    """``f``-bit field of column ``p`` in row ``j`` of a plane."""
    per = 8 // f
    return (np.int64(plane[j, p // per]) >> (f * (p % per))) & ((1 << f) - 1)


@njit
def _code_at(w, w2, j, p, fmt):
    """Signed code of weight row ``j``, column ``p``."""
    if fmt == 0:
        v = _field(w, j, p, 4)
        return v - 16 if v >= 8 else v
    if fmt == 1:
        v = _field(w, j, p, 2)
        return np.int64(-1) if v == 3 else v
    b = _bits(fmt)
    lb = 2 if b <= 3 else 4
    u = _field(w, j, p, lb)
    if b - lb > 0:
        u |= _field(w2, j, p, b - lb) << lb
    return u - (1 << (b - 1))


@njit(inline="always")
def _plan(cols, ng, group, fmt, a8=False):
    """(mode, nunits, upf): flush mode, whole units on the SIMD path, units/flush.

    Mode 3 (int4/g32 with int8 activations, an even number of 64-column units)
    counts 128-column double units."""
    unit = _UNIT[fmt]
    # a row whose last 64 columns would miss the 128-column units (576 =
    # 4 x 128 + 64: SmolLM2's width) runs the 64-column modes, which cover it:
    # the scalar tail cost ~0.2 us per output (576 x 576, m = 1, 2 threads,
    # AMD EPYC Zen 3, avx2: int3/g32 121 -> 32-49 us, int6/g128 117 -> 37 us)
    big_tail = cols % _BIGU >= unit
    if a8 and fmt >= 2 and cols >= _BIGU and not big_tail:
        # intN with int8 activations: 128-column big units, hi plane merged in
        # registers (modes 4-6; groups that are neither 32 nor a multiple of
        # 128 keep the 64-column modes below)
        if ng == 1:
            return 5, cols // _BIGU, _UPF0
        if group == 32:
            return 4, cols // _BIGU, 1
        if group % _BIGU == 0:
            # a partial last group is a short last flush (its scale exists)
            upf = group // _BIGU
            return 6, cols // _BIGU, upf
    if ng == 1:
        return 0, cols // unit, _UPF0
    if a8 and fmt == 0 and group == 32 and (cols // 64) % 2 == 0:
        return 3, cols // 128, 1
    if unit == 64 and group == 32:
        return 1, cols // 64, 1
    if group % unit == 0:
        upf = group // unit
        return 2, cols // unit, upf
    return -1, 0, 1


@njit
def _arrange_big(xq, nunits, fmt, upf, mode):
    """128-column unit (modes 3-6) arrangement and corrections.

    ``xp[i, 128 u + 32 k + l] = xq[i, 128 u + LOWBIT_BIG_LANES[fmt, k, l]]``;
    modes 3/4 (groups of 32): ``corr[i, 8 u + 2 g] = off * sum`` of group ``g``
    (columns ``128 u + 32 g ..``), odd lanes 0; modes 5/6: ``corr[i, 8 f] = off * sum``
    over the columns of flush ``f`` (``upf`` units), other lanes 0.
    """
    m = xq.shape[0]
    off = _OFF[fmt]
    xp = np.empty((m, max(nunits * _BIGU, 1)), dtype=xq.dtype)
    nfl = (nunits + upf - 1) // upf
    corr = np.zeros((m, max(nfl, 1) * 8), dtype=np.int32)
    for i in range(m):
        for u in range(nunits):
            b = u * _BIGU
            for k in range(4):
                for t in range(32):
                    xp[i, b + 32 * k + t] = xq[i, b + _BIGL[fmt, k, t]]
        if mode <= 4:
            for u in range(nunits):
                for g in range(4):
                    sg = np.int64(0)
                    for p in range(u * _BIGU + 32 * g, u * _BIGU + 32 * g + 32):
                        sg += xq[i, p]
                    corr[i, 8 * u + 2 * g] = off * sg
        else:
            for f in range(nfl):
                sg = np.int64(0)
                for p in range(f * upf * _BIGU, min(nunits, (f + 1) * upf) * _BIGU):
                    sg += xq[i, p]
                corr[i, 8 * f] = off * sg
    return xp, corr


@njit
def _arrange(xq, nunits, fmt, upf, mode, big=True):
    """Per-unit field order of the activations and the offset corrections.

    ``big=None`` leaves the 128-column modes (3-6, int8 activations only)
    out of the compiled code: the int16-activation entries pass it."""
    m = xq.shape[0]
    if big is not None and mode >= 3:
        return _arrange_big(xq, nunits, fmt, upf, mode)
    P = _SLOTS[fmt]
    unit = _UNIT[fmt]
    off = _OFF[fmt]
    nx = nunits * 32 * P
    xp = np.empty((m, max(nx, 1)), dtype=xq.dtype)
    nfl = (nunits + upf - 1) // upf
    corr = np.zeros((m, max(nfl, 1) * 8), dtype=np.int32)
    for i in range(m):
        if fmt == 0:
            # int4 nibbles: slot s of a unit = columns 2t + s (a plain deinterleave,
            # same as the table below, without the per-element lookup)
            for u in range(nunits):
                b = u * 64
                for t in range(32):
                    xp[i, b + t] = xq[i, b + 2 * t]
                    xp[i, b + 32 + t] = xq[i, b + 2 * t + 1]
            nu0 = nunits
        else:
            nu0 = 0
        for u in range(nu0, nunits):
            b = u * unit
            bx = u * 32 * P
            for s in range(P):
                for t in range(32):
                    xp[i, bx + s * 32 + t] = xq[i, b + _LANES[fmt, s, t]]
        for f in range(nfl):
            c0 = f * upf * unit
            c1 = min(nunits, (f + 1) * upf) * unit
            if mode == 1:
                sa = np.int64(0)
                sb = np.int64(0)
                for p in range(c0, c0 + 32):
                    sa += xq[i, p]
                for p in range(c0 + 32, c0 + 64):
                    sb += xq[i, p]
                corr[i, 8 * f] = off * sa
                corr[i, 8 * f + 4] = off * sb
            else:
                s = np.int64(0)
                for p in range(c0, c1):
                    s += xq[i, p]
                corr[i, 8 * f] = off * s
    return xp, corr


@njit
def _tail(xq, i, w, w2, j, p0, cols, fmt, sflat, soff, group, scaled):
    """Scalar sum over columns ``p0..cols-1`` (mode 0: integer; else scaled)."""
    if not scaled:
        a = np.int64(0)
        for p in range(p0, cols):
            a += np.int64(xq[i, p]) * _code_at(w, w2, j, p, fmt)
        return np.float64(a)
    tot = np.float64(0.0)
    p = p0
    while p < cols:
        g = p // group
        e = min((g + 1) * group, cols)
        a = np.int64(0)
        for q in range(p, e):
            a += np.int64(xq[i, q]) * _code_at(w, w2, j, q, fmt)
        tot += np.float64(np.float32(a) * sflat[soff + g])
        p = e
    return tot


@njit(inline="always")
def _fin(t, sxi, s0, mode):
    """``_put`` without a tail: the same float64 arithmetic (``t + 0.0`` as
    there, so even the sign of a zero matches)."""
    v = t + np.float64(0.0)
    if mode == 0 or mode == 5:
        return np.float32(v * np.float64(sxi) * np.float64(s0))
    return np.float32(v * np.float64(sxi))


@njit
def _put(y, i, j, t, xq, w, w2, sflat, sstride, group, cols, fmt, region, mode, sx):
    soff = j * sstride
    # one call site with a run-time flag: a literal True / False compiled
    # ``_tail`` twice
    exact = mode == 0 or mode == 5
    v = t + _tail(xq, i, w, w2, j, region, cols, fmt, sflat, soff, group, not exact)
    if exact:
        y[i, j] = np.float32(v * np.float64(sx[i]) * np.float64(sflat[soff]))
    else:
        y[i, j] = np.float32(v * np.float64(sx[i]))


@njit(inline="always")
def _t14(xp, xo, xs, cf, co, cs, wf, wo, ws, w2, w2o, w2s, sf, so, ss, nun, upf, fmt,
         mode):
    return lowbit_tile_1x4(xp, xo, xs, cf, co, cs, wf, wo, ws, w2, w2o, w2s, sf, so, ss,
                           nun, upf, fmt, mode, 8 * ws, 8 * w2s)


@njit(inline="always")
def _t42(xp, xo, xs, cf, co, cs, wf, wo, ws, w2, w2o, w2s, sf, so, ss, nun, upf, fmt,
         mode):
    return lowbit_tile_4x2(xp, xo, xs, cf, co, cs, wf, wo, ws, w2, w2o, w2s, sf, so, ss,
                           nun, upf, fmt, mode, 2 * ws, 2 * w2s)


#: Prefill k-blocking: activation columns per k-block (int8; half for int16),
#: so a block of ``m`` activation rows stays in L1 while a group of
#: ``_KB_G`` output blocks streams its weights through it.
_KB_COLS = 2048
_KB_G = 16


@njit(inline="always")
def _unit_geom(fmt, mode):
    """(columns, arranged activations, lo bytes, hi bytes) per unit of a mode."""
    if mode == 3:
        return 128, 128, 64, 0
    if mode >= 4:
        return _BIGU, _BIGU, (32 if fmt <= 3 else 64), (0, 0, 0, 16, 16, 32)[fmt]
    return _UNIT[fmt], 32 * _SLOTS[fmt], _PBYTES[fmt, 0], _PBYTES[fmt, 1]


@njit(inline="always")
def _scale_off(mode, u0, upf):
    """Offset of unit ``u0``'s first scale in a weight row's scales."""
    if mode == 1:
        return 2 * u0
    if mode == 3 or mode == 4:
        return 4 * u0
    if mode == 2 or mode == 6:
        return u0 // upf
    return 0


@njit
def _blocks_kb(xp, corr, xq, w, w2, sflat, sstride, cols, group, fmt, nunits, upf, mode,
               sx, y, b0, b1):
    """Prefill (``m >= 4``) over output blocks ``b0..b1``, k-blocked.

    Without blocking every 4 x 2 tile re-read its four activation rows over
    the full depth from the caches, and two threads ran no faster than one
    (the cause was not pinned down; the blocking fixed it).  Here
    the depth is cut into blocks of ``_KB_COLS`` columns (whole flushes); for
    each k-block the tiles of ``_KB_G`` output blocks run against the same
    L1-resident activation block, and the partial sums (exact integers, or
    per-group scaled float32 lanes) are added in float64.
    """
    m = xq.shape[0]
    rows = w.shape[0]
    wb = w.shape[1]
    xst = xp.shape[1]
    cst = corr.shape[1]
    xpf = xp.ravel()
    cf = corr.ravel()
    wf = w.ravel()
    w2b = w2.shape[1]
    w2f = w2.ravel()
    ucols, xpu, lob, hib = _unit_geom(fmt, mode)
    tail = nunits * ucols < cols
    region = nunits * ucols
    kbc = _KB_COLS if xq.itemsize == 1 else _KB_COLS // 2
    kbu = max(1, kbc // ucols)
    kbu = max(upf, kbu // upf * upf)
    acc = np.zeros((m, _NB * _KB_G))
    for g0 in range(b0, b1, _KB_G):
        g1 = min(b1, g0 + _KB_G)
        acc[:] = 0.0
        for u0 in range(0, nunits, kbu):
            nu = min(kbu, nunits - u0)
            so = _scale_off(mode, u0, upf)
            co = (u0 // upf) * 8
            for b in range(g0, g1):
                js = min(b * _NB, rows - _NB)
                for h in range(2):
                    jh = js + 2 * h
                    for i0 in range(0, m, 4):
                        i_s = min(i0, m - 4)
                        t = _t42(xpf, i_s * xst + u0 * xpu, xst, cf, i_s * cst + co, cst, wf,
                                 jh * wb + u0 * lob, wb, w2f, jh * w2b + u0 * hib, w2b,
                                 sflat, jh * sstride + so, sstride, nu, upf, fmt, mode)
                        for r in range(4):
                            i = i_s + r
                            if i >= i0:
                                for c in range(2):
                                    acc[i, (b - g0) * _NB + 2 * h + c] += t[r * 2 + c]
        for b in range(g0, g1):
            j0 = b * _NB
            js = min(j0, rows - _NB)
            for q in range(_NB):
                j = js + q
                if j >= j0:
                    for i in range(m):
                        v = acc[i, (b - g0) * _NB + q]
                        if tail:
                            _put(y, i, j, v, xq, w, w2, sflat, sstride, group, cols, fmt,
                                 region, mode, sx)
                        else:
                            y[i, j] = _fin(v, sx[i], sflat[j * sstride], mode)


@njit
def _decode_i4m3(xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0, b1):
    """Decode of int4/g32 with int8 activations (mode 3, no tail): the tile is
    called with literal ``fmt`` / ``mode`` so LLVM keeps only that variant and
    inlines it into the loop.  Through the generic call (run-time ``fmt`` and
    ``mode``, every variant in one out-of-line function) each tile cost about
    30-40 ns more: 1 x 1024 x 3072 on one Zen 4 core, 81.5 us through the
    generic call against 57.4 us for a loop like this one (one-off timing).
    Outputs go eight at a time (1 x 8 tiles: each activation load feeds eight
    weight rows; 55.7 against 59.7 us for 1 x 4 on that shape), the last
    block of four through a 1 x 4 tile."""
    m = y.shape[0]
    rows = y.shape[1]
    j1 = min(b1 * _NB, rows)
    j0 = b0 * _NB
    while j0 + 8 <= j1:
        for i in range(m):
            t = lowbit_tile_1x8(xpf, i * xst, xst, cf, i * cst, cst, wf, j0 * wb, wb,
                                wf, j0 * wb, wb, sflat, j0 * sstride, sstride, nunits, 1,
                                0, 3, 8 * wb, 8 * wb)
            for c in range(8):
                y[i, j0 + c] = _fin(t[c], sx[i], np.float32(1.0), 3)
        j0 += 8
    while j0 < j1:
        # a block of four; the last one may start before j0 (rows >= 4)
        js = min(j0, rows - _NB)
        for i in range(m):
            t = lowbit_tile_1x4(xpf, i * xst, xst, cf, i * cst, cst, wf, js * wb, wb,
                                wf, js * wb, wb, sflat, js * sstride, sstride, nunits, 1,
                                0, 3, 8 * wb, 8 * wb)
            for c in range(_NB):
                j = js + c
                if j >= j0:
                    y[i, j] = _fin(t[c], sx[i], np.float32(1.0), 3)
        j0 += _NB


#: Decode of the intN 128-column modes (4-6) one weight row per tile on the
#: ``avx2`` path.  Streamed 4096 x 4096 stacks (m = 1, 2 threads, AMD EPYC Zen 3,
#: avx2, int8 activations; ``benchmarks/bench_decode_rows.py``) read their packed
#: bytes at int6/g128 19.9 / int5/g32 27.1 / int3/g32 23.4 / int2/g32 28.2 GB/s
#: through 1 x 1 tiles against 17.8 / 22.0 / 19.7 / 24.2 GB/s through 1 x 4
#: tiles (one run; every kind faster in each run tried): a 1 x 4 tile reads
#: four rows of each plane (and scales) at once, and those streams arrived late
#: on this part.  VNNI hosts keep the 1 x 4 tiles they were tuned with.
DEC_ONE_ROW = LOWBIT_PATH == "avx2"
#: Software-prefetch distance of the one-row decode, in weight rows.
_PF_ROWS1 = 4


@njit
def _rows1(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols, group, fmt,
           nunits, upf, mode, sx, y, b0, b1):
    """:func:`_decode_rows1`'s loop for one constant ``mode``."""
    m = y.shape[0]
    rows = y.shape[1]
    region = nunits * _BIGU
    tail = region < cols
    for j in range(b0 * _NB, min(b1 * _NB, rows)):
        for i in range(m):
            t = lowbit_tile_1x1(xpf, i * xst, xst, cf, i * cst, cst, wf, j * wb, wb,
                                w2f, j * w2b, w2b, sflat, j * sstride, sstride, nunits, upf,
                                fmt, mode, _PF_ROWS1 * wb, _PF_ROWS1 * w2b)
            if tail:
                # np.int64(mode): the literal mode would compile one more
                # _put per mode (~0.4 s each, cold)
                _put(y, i, j, t[0], xq, w, w2, sflat, sstride, group, cols, fmt, region,
                     np.int64(mode), sx)
            else:
                y[i, j] = _fin(t[0], sx[i], sflat[j * sstride], mode)


@njit
def _decode_rows1(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols, group,
                  fmt, nunits, upf, mode, sx, y, b0, b1):
    """Decode (``m < 4``) of output blocks ``b0..b1`` in a 128-column mode
    (4-6) one weight row per 1 x 1 tile (:data:`DEC_ONE_ROW`); the results are
    the 1 x 4 tiles' bit for bit (every output keeps its own accumulation).
    Each mode's loop calls the tile with constant ``fmt`` and ``mode``, so it
    holds that variant only (a run-time ``mode`` put all six in the loop).
    ``_rows1`` is a function of its own, compiled per constant ``mode``:
    inlined three times (``inline="always"``), every copy ran the last
    copy's mode."""
    if mode == 4:
        _rows1(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols, group,
               fmt, nunits, upf, 4, sx, y, b0, b1)
    elif mode == 5:
        _rows1(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols, group,
               fmt, nunits, upf, 5, sx, y, b0, b1)
    else:
        _rows1(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols, group,
               fmt, nunits, upf, 6, sx, y, b0, b1)


def _decode_rows1_a8(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols,
                     group, fmt, nunits, upf, mode, sx, y, b0, b1):
    """:func:`_decode_rows1` where it applies (int8 activations on a
    :data:`DEC_ONE_ROW` host), returning True; else False.  Decided when
    numba types the call, so int16-activation kernels and VNNI hosts compile
    none of the one-row decode (a ``None`` flag cannot enter the parallel
    loops that call this)."""
    raise NotImplementedError(NO_JIT)


@overload(_decode_rows1_a8, prefer_literal=True, jit_options={"cache": True})
def _ov_decode_rows1_a8(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols,
                        group, fmt, nunits, upf, mode, sx, y, b0, b1):
    # int4 / ternary (fmt 0 / 1, a literal from their entries) never take the
    # 128-column modes 4-6: no one-row decode in their code (~5 s of a cold
    # first int4/g32 act=int8 call)
    low_fmt = isinstance(fmt, types.IntegerLiteral) and fmt.literal_value < 2
    if not (DEC_ONE_ROW and xpf.dtype == types.int8) or low_fmt:
        return (lambda xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols,
                group, fmt, nunits, upf, mode, sx, y, b0, b1: False)

    def impl(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols, group, fmt,
             nunits, upf, mode, sx, y, b0, b1):
        _decode_rows1(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat, sstride, cols,
                      group, fmt, nunits, upf, mode, sx, y, b0, b1)
        return True
    return impl


def _decode_i4m3_a8(xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0, b1, fmt):
    """:func:`_decode_i4m3` where it can apply (int8 activations, ``fmt`` 0 or
    not a literal), returning True; else False, decided when numba types the
    call: the other kinds (mode 3 is int4/g32 with int8 activations only)
    compile none of it (~0.8 s of each one's cold first call)."""
    raise NotImplementedError(NO_JIT)


@overload(_decode_i4m3_a8, prefer_literal=True, jit_options={"cache": True})
def _ov_decode_i4m3_a8(xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0, b1, fmt):
    other = isinstance(fmt, types.IntegerLiteral) and fmt.literal_value != FMT_INT4
    if xpf.dtype != types.int8 or other:
        return (lambda xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0, b1,
                fmt: False)

    def impl(xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0, b1, fmt):
        _decode_i4m3(xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0, b1)
        return True
    return impl


@njit
def _blocks_dec(xp, corr, xq, w, w2, sflat, sstride, cols, group, fmt, nunits, upf, mode,
                sx, y, b0, b1):
    """Output blocks ``b0..b1`` through the decode tiles (any ``m``; the path of
    ``m < 4`` or ``rows < 4``)."""
    m = xq.shape[0]
    rows = w.shape[0]
    wb = w.shape[1]
    xst = xp.shape[1]
    cst = corr.shape[1]
    xpf = xp.ravel()
    cf = corr.ravel()
    wf = w.ravel()
    w2b = w2.shape[1]
    w2f = w2.ravel()
    region = nunits * _unit_geom(fmt, mode)[0]
    # no scalar tail: finish in place (``_put`` is an out-of-line call taking six
    # arrays, ~50 ns per output -- it dominated small-k prefill)
    tail = region < cols
    if (fmt == 0 and mode == 3 and rows >= _NB and not tail
            and _decode_i4m3_a8(xpf, xst, cf, cst, wf, wb, sflat, sstride, nunits, sx, y, b0,
                                b1, fmt)):
        return
    if mode >= 4 and _decode_rows1_a8(xpf, xst, cf, cst, wf, wb, w2f, w2b, xq, w, w2, sflat,
                                      sstride, cols, group, fmt, nunits, upf, mode, sx, y,
                                      b0, b1):
        return
    # decode (m < 4): one 1 x 4 tile per activation row and output block; with
    # fewer than 4 outputs one tile per output row (weight strides 0, its
    # first result used).  One tile call site: each inlines the tile's code.
    four = rows >= _NB
    ws = wb if four else 0
    w2s = w2b if four else 0
    ss = sstride if four else 0
    nout = _NB if four else 1
    for b in range(b0, b1):
        j0 = b * _NB
        for q in range(1 if four else rows):
            js = min(j0, rows - _NB) if four else q
            for i in range(m):
                t = _t14(xpf, i * xst, xst, cf, i * cst, cst, wf, js * wb, ws,
                         w2f, js * w2b, w2s, sflat, js * sstride, ss, nunits, upf, fmt, mode)
                # a constant trip count: t[c] stays a register (a run-time
                # bound indexed the result tuple in memory, ~20 % slower decode)
                for c in range(_NB):
                    j = js + c
                    if c < nout and (j >= j0 or not four):
                        if tail:
                            _put(y, i, j, t[c], xq, w, w2, sflat, sstride, group, cols,
                                 fmt, region, mode, sx)
                        else:
                            y[i, j] = _fin(t[c], sx[i], sflat[j * sstride], mode)


@njit(inline="always")
def _ngroups(cols, group):
    if group <= 0 or group >= cols:
        return 1
    return (cols + group - 1) // group


#: Why a variant with both flags None raises.  The ``raise`` sits inside each
#: ``if prefill is None:`` branch: numba prunes ``x is None`` only when ``x`` is
#: typed None (an omitted ``True`` or a ``bool`` resolves to neither outcome),
#: so in a prefill-only variant (``decode=None``) the decode branch survives
#: its own test, and only the raise under ``decode is None`` ends it before
#: its code is typed (int4/g32 int8 prefill at m = 16 compiled the decode
#: tiles as well).
_NO_PATH = ("decode=None and prefill=None (or tiles=None and panel=None) leave no path; "
            "leave one at its default")
_NO_TILES = "tiles=None needs an int4 product the W4A8 panel takes (w4a8_tiles_kw); omit tiles"


_ONE_PATH = "_run compiles one path: pass decode=None or prefill=None (or call _run_any)"


@njit_parallel
def _run(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode=True,
         prefill=True, big=True):
    """One path of the low-bit product: exactly one of ``decode`` /
    ``prefill`` is None (:func:`_run_any` takes both).  Every caller -- the
    public cores and ``PackedLinear``'s entries, decode and prefill -- calls
    this one function (linked late: its code is not optimised again in each
    caller), so a variant compiles once per process.  ``big`` as
    :func:`_arrange`; like ``decode`` / ``prefill`` it never enters a prange
    body (a None-typed value passed into a parfor gave wrong results in some
    processes)."""
    m = xq.shape[0]
    rows = w.shape[0]
    if decode is None and (m < 4 or rows < _NB):
        raise ValueError("low-bit product compiled without the decode path (decode=None) "
                         "needs m >= 4 and rows >= 4; pass decode=True")
    ng = _ngroups(cols, group)
    g = group if ng > 1 else max(cols, 1)
    mode, nunits, upf = _plan(cols, ng, g, fmt, xq.itemsize == 1)
    xp, corr = _arrange(xq, nunits, fmt, upf, mode, big)
    y = np.empty((m, rows), dtype=np.float32)
    nb = (rows + _NB - 1) // _NB
    serial = m * cols * rows < min_parallel or nb < 2
    nc = min(nb, _NCHUNK)
    # The path is picked here, outside the parallel loops, by ``is None`` tests
    # numba prunes on the argument types (a None-typed flag; the other flag's
    # branch ends at the raise of _NO_PATH or _ONE_PATH): a variant holds one
    # pair of loops.  The flags never enter a prange body -- a None-typed value passed
    # into a parfor gave wrong results in some processes.  np.int64(0): a
    # literal 0 would compile a second specialisation of the block function.
    if prefill is None:
        if decode is None:
            raise ValueError(_NO_PATH)
        if serial:
            _blocks_dec(xp, corr, xq, w, w2, sflat, sstride, cols, g, fmt, nunits, upf, mode,
                        sx, y, np.int64(0), nb)
        else:
            for c in prange(nc):
                _blocks_dec(xp, corr, xq, w, w2, sflat, sstride, cols, g, fmt, nunits, upf,
                            mode, sx, y, c * nb // nc, (c + 1) * nb // nc)
    elif decode is None:
        if serial:
            _blocks_kb(xp, corr, xq, w, w2, sflat, sstride, cols, g, fmt, nunits, upf, mode,
                       sx, y, np.int64(0), nb)
        else:
            for c in prange(nc):
                _blocks_kb(xp, corr, xq, w, w2, sflat, sstride, cols, g, fmt, nunits, upf,
                           mode, sx, y, c * nb // nc, (c + 1) * nb // nc)
    else:
        # (:func:`_run_any` never sends both flags here)
        raise ValueError(_ONE_PATH)
    return y


def _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode=True,
             prefill=True, big=True):
    """:func:`_run` with any flags: a call holding both paths picks one of the
    two one-path variants of :func:`_run` by shape at run time (the rule the
    tiles always followed: the prefill tiles for ``m >= 4`` and ``rows >= 4``),
    so it compiles no variant of its own and shares its code with every
    one-path caller (``PackedLinear``'s)."""
    raise NotImplementedError(NO_JIT)


def _typed_none(t):
    """``t`` (a numba type) is None or an omitted ``None``."""
    return isinstance(t, types.NoneType) or (isinstance(t, types.Omitted) and t.value is None)


@overload(_run_any, inline="always", prefer_literal=True)
def _ov_run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode=True,
                prefill=True, big=True):
    if _typed_none(decode) or _typed_none(prefill):
        def impl(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode=True,
                 prefill=True, big=True):
            return _run(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode,
                        prefill, big)
        return impl

    def impl(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode=True,
             prefill=True, big=True):
        if xq.shape[0] >= 4 and w.shape[0] >= _NB:
            return _run(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, None,
                        True, big)
        return _run(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, True, None,
                    big)
    return impl


#: Smallest ``m`` that takes the W4A8 panel (on a ``vpdpbusd`` host): at m = 8 the
#: 16-row panel and the 4 x 2 dot tiles tied (1024 x 1024 and 4096 x 4096, Zen 4),
#: at m = 12 the panel was 1.4-1.6x faster.
W4_PANEL_MIN_M = 9


def _w4_panel_rule(m, rows, cols, group):
    # Python and numba share this rule (the dispatcher below inlines it)
    # one scale per row (per channel, or a group spanning the row), else groups of 32k
    return (W4_PANEL and m >= W4_PANEL_MIN_M and rows >= W4_PANEL_J and cols >= 32
            and (group <= 0 or group >= cols or group % 32 == 0))


_w4_panel_ok = njit(inline="always")(_w4_panel_rule)


def w4a8_tiles_kw(m, rows, cols, group):
    """Keyword flags for an int4 W8A8 prefill call (plain Python helper).

    Returns ``{"tiles": None}`` when the W4A8 panel takes every row of an
    ``m x cols`` by ``rows x cols`` product with ``group`` (``<= 0``: per
    channel) on this host, else ``{"panel": None}``.  Passed to
    :func:`int4_linear_checked_a8` with ``decode=None``, they leave the
    path the shape never takes out of the compiled function (the dot-tile
    core, or the panel: about half of a cold int4 prefill at ``m = 5``).
    """
    if _w4_panel_rule(int(m), int(rows), int(cols), int(group)):
        return {"tiles": None}
    return {"panel": None}


@njit(inline="always")
def _panel_a8(xq, sx, w, sflat, sstride, cols, group, min_parallel):
    """The int4 W4A8 product through the panel alone (caller checked
    :func:`_w4_panel_ok`): float32 ``[m, rows]``."""
    m = xq.shape[0]
    rows = w.shape[0]
    y = np.empty((m, rows), dtype=np.float32)
    # every output, the n % 6 last too (rows >= 6 here): no dot-tile tail, whose
    # arrangement and blocks were a quarter of a cold int4 prefill's compile
    w4a8_panel_matmul(xq, sx, w, sflat, sstride, cols, group, min_parallel, y)
    return y


@njit
def _run_a8(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode=True,
            prefill=True):
    """:func:`_run` for int8 activations: int4 prefill on a VNNI or AVX2 host goes
    through the outer-product panel (:mod:`._w4panel`), every output."""
    if (prefill is not None and fmt == FMT_INT4
            and _w4_panel_ok(xq.shape[0], w.shape[0], cols, group)):
        return _panel_a8(xq, sx, w, sflat, sstride, cols, group, min_parallel)
    return _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                    decode, prefill)


@njit(inline="always")
def lowbit_matmul_a8(xq, sx, w, w2, sflat, sstride, cols, group, fmt, min_parallel=PAR_MIN,
                     decode=True, prefill=True):
    """Generic int8-activation product from packed low-bit weights.

    Parameters
    ----------
    xq : ndarray of int8, shape (m, cols), C-contiguous, values in [-127, 127]
    sx : ndarray of float32, shape (m,)
        Per-row activation scales (``y`` is multiplied by ``sx[i]``).
    w : ndarray of uint8, shape (rows, nbytes), C-contiguous
        Packed codes in format ``fmt`` (module docstring; intN: the ``lo`` plane).
    w2 : ndarray of uint8, shape (rows, nbytes2), C-contiguous
        The ``hi`` plane of int3/int5/int6; pass ``w`` for other formats.
    sflat : ndarray of float32, 1-D
        Scales, row ``j``'s first at ``j * sstride`` (``sstride = 0``: one
        shared scale, e.g. ternary ``alpha``).
    sstride : int
    cols : int
        Logical number of columns (``<= fields * nbytes``).
    group : int
        Group length along a row; ``<= 0`` or ``>= cols`` means one scale per
        row.
    fmt : int
        ``FMT_INT4``, ``FMT_TERNARY`` or ``intn_fmt(bits)``.
    min_parallel : int, optional
        Below ``m * cols * rows`` of this size the call stays on one thread.
    decode, prefill : True or None, optional
        Which paths the compiled function holds (both by default).  The
        decode tiles serve ``m < 4`` (or ``rows < 4``), the prefill tiles and
        panels the rest; ``None`` leaves a path out of the compiled code,
        about half of it (numba prunes ``is None`` tests of arguments on
        their type; leave the other flag at its default, since an explicit
        ``True`` is a ``bool`` that cannot be pruned and compiles every
        path).  With ``prefill=None`` every shape takes the decode tiles
        (the same results as the prefill tiles in the tests, slower for
        large ``m``); ``decode=None`` needs ``m >= 4`` and ``rows >= 4``
        (``ValueError`` otherwise).

    Returns
    -------
    ndarray of float32, shape (m, rows)
        ``y[i, j] = sx[i] * sum_g scale[j, g] * sum_(p in g) xq[i, p] * code[j, p]``;
        the integer sums are exact, the sum over groups is float32/float64.
    """
    return _run_a8(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                   decode, prefill)


@njit(inline="always")
def _a16_levels(cols, group, fmt):
    ng = _ngroups(cols, group)
    g = group if ng > 1 else max(cols, 1)
    mode, nunits, upf = _plan(cols, ng, g, fmt)
    flush_cols = upf * _UNIT[fmt]
    lv = 2147483647 // (_umax(fmt) * max(flush_cols, 1))
    return min(32767, max(lv, 1))


@njit(inline="always")
def lowbit_matmul_a16(x, w, w2, sflat, sstride, cols, group, fmt, min_parallel=PAR_MIN,
                      decode=True, prefill=True):
    """Generic float-activation product from packed low-bit weights.

    ``x`` (float32 ``[m, cols]``, C-contiguous, finite) is carried as per-row
    int16 codes (levels chosen so no int32 lane overflows; see the module
    docstring), then multiplied exactly with the unpacked codes.  Other
    parameters (``decode`` / ``prefill`` too) as :func:`lowbit_matmul_a8`.

    Returns
    -------
    ndarray of float32, shape (m, rows)
    """
    xq, sx = quantize_rows_i16(x, _a16_levels(cols, group, fmt), min_parallel)
    # (int16 activations never take the 128-column modes: big=None)
    return _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                    decode, prefill, None)


@njit(inline="always")
def w4a8_matmul(xq, sx, codes, scales, cols, group, min_parallel=PAR_MIN, decode=True,
                prefill=True):
    """W4A8 from the int4 pack layout.

    Parameters
    ----------
    xq : ndarray of int8, shape (m, cols), values in [-127, 127]
    sx : ndarray of float32, shape (m,)
    codes : ndarray of uint8, shape (rows, ceil(cols/2)) (nibbles, even column low)
    scales : ndarray of float32, shape (rows,) (per channel) or (rows, ceil(cols/group))
    cols, group : int
        ``group <= 0`` (or ``>= cols``) for per-channel scales.
    decode, prefill : True or None, optional
        As :func:`lowbit_matmul_a8`.

    Returns
    -------
    ndarray of float32, shape (m, rows)
    """
    rows = codes.shape[0]
    sf = scales.ravel()
    return _run_a8(xq, sx, codes, codes, sf, sf.size // max(rows, 1), cols, group, 0,
                   np.int64(min_parallel), decode, prefill)


@njit(inline="always")
def w4a16_matmul(x, codes, scales, cols, group, min_parallel=PAR_MIN, decode=True,
                 prefill=True):
    """W4A16 (float activations carried as int16 codes) from the int4 pack layout.

    ``x`` float32 ``[m, cols]``; other parameters as :func:`w4a8_matmul`.
    """
    rows = codes.shape[0]
    sf = scales.ravel()
    return lowbit_matmul_a16(x, codes, codes, sf, sf.size // max(rows, 1), cols, group, 0,
                             min_parallel, decode, prefill)


@njit(inline="always")
def ternary_matmul_a8(xq, sx, codes, alpha, cols, min_parallel=PAR_MIN, decode=True,
                      prefill=True):
    """Ternary x int8 from the ternary pack layout.

    Parameters
    ----------
    xq : ndarray of int8, shape (m, cols); sx : float32 (m,)
    codes : ndarray of uint8, shape (rows, ceil(cols/4))
    alpha : ndarray of float32, shape (1,)

    Returns
    -------
    ndarray of float32, shape (m, rows): ``sx[i] * alpha * sum_p xq[i,p] * t[j,p]``.
    ``decode`` / ``prefill`` as :func:`lowbit_matmul_a8`.
    """
    return _run_any(xq, sx, codes, codes, alpha, 0, cols, 0, 1, np.int64(min_parallel), decode,
                    prefill)


@njit(inline="always")
def ternary_matmul_a16(x, codes, alpha, cols, min_parallel=PAR_MIN, decode=True,
                       prefill=True):
    """Ternary x float activations (int16 codes); see :func:`ternary_matmul_a8`."""
    return lowbit_matmul_a16(x, codes, codes, alpha, 0, cols, 0, 1, min_parallel, decode,
                             prefill)


@njit
def packed_int8_linear(x, codes, scales, act8, min_parallel=PAR_MIN, wsum=None):
    """``x[m, cols] @ (codes * scales[:, None]).T`` for the int8/chan layout.

    ``act8``: W8A8 (:func:`dynamic_matmul_w8a8`: ``quantize_rows_i8`` + exact
    int32 sums); else W8A16.
    ``codes`` int8 ``[rows, cols]``, ``scales`` float32 ``[rows]``; ``wsum``
    optional int32 ``[rows]`` = ``i8_row_sums(codes)`` (see ``matmul_w8a8``).
    """
    if act8:
        return dynamic_matmul_w8a8(x, codes, scales, min_parallel, wsum)
    return matmul_w8a16(x, codes, scales, min_parallel)


@njit(inline="always")
def packed_int4_linear_a8(x, codes, scales, cols, group, min_parallel=PAR_MIN, decode=True,
                          prefill=True):
    """:func:`packed_int4_linear` with int8 activations only (compiles one path;
    ``decode`` / ``prefill`` as :func:`lowbit_matmul_a8`)."""
    xq, sx = quantize_rows_i8(x, min_parallel)
    return w4a8_matmul(xq, sx, codes, scales, cols, group, min_parallel, decode, prefill)


@njit(inline="always")
def packed_int4_linear_a16(x, codes, scales, cols, group, min_parallel=PAR_MIN, decode=True,
                           prefill=True):
    """:func:`packed_int4_linear` with float activations only (compiles one path;
    ``decode`` / ``prefill`` as :func:`lowbit_matmul_a8`)."""
    return w4a16_matmul(x, codes, scales, cols, group, min_parallel, decode, prefill)


@njit
def packed_int4_linear(x, codes, scales, cols, group, act8, min_parallel=PAR_MIN):
    """``x @ What.T`` for int4/chan (``group <= 0``) and int4/g{group}; ``x`` float32.

    Compiles both activation paths; :func:`packed_int4_linear_a8` /
    :func:`packed_int4_linear_a16` compile one."""
    if act8:
        return packed_int4_linear_a8(x, codes, scales, cols, group, min_parallel)
    return packed_int4_linear_a16(x, codes, scales, cols, group, min_parallel)


@njit(inline="always")
def packed_ternary_linear_a8(x, codes, alpha, cols, min_parallel=PAR_MIN, decode=True,
                             prefill=True):
    """:func:`packed_ternary_linear` with int8 activations only (``decode`` /
    ``prefill`` as :func:`lowbit_matmul_a8`)."""
    xq, sx = quantize_rows_i8(x, min_parallel)
    return ternary_matmul_a8(xq, sx, codes, alpha, cols, min_parallel, decode, prefill)


@njit(inline="always")
def packed_ternary_linear_a16(x, codes, alpha, cols, min_parallel=PAR_MIN, decode=True,
                              prefill=True):
    """:func:`packed_ternary_linear` with float activations only (``decode`` /
    ``prefill`` as :func:`lowbit_matmul_a8`)."""
    return ternary_matmul_a16(x, codes, alpha, cols, min_parallel, decode, prefill)


@njit
def packed_ternary_linear(x, codes, alpha, cols, act8, min_parallel=PAR_MIN):
    """``x @ What.T`` for ternary; ``x`` float32 (both activation paths)."""
    if act8:
        return packed_ternary_linear_a8(x, codes, alpha, cols, min_parallel)
    return packed_ternary_linear_a16(x, codes, alpha, cols, min_parallel)


@njit
def intn_fmt(bits):
    """``fmt`` id of the intN plane layout of ``bits`` (2, 3, 5, 6)."""
    if bits == 2:
        return 2
    if bits == 3:
        return 3
    return 4 if bits == 5 else 5


@njit(inline="always")
def _intn_a8(xq, sx, lo, hi, scales, cols, group, fmt, min_parallel, decode=True,
             prefill=True):
    """intN x int8 for one ``fmt`` (a literal: only its tile variants compile)."""
    rows = lo.shape[0]
    sf = scales.ravel()
    return _run_any(xq, sx, lo, hi, sf, sf.size // max(rows, 1), cols, group, fmt,
                    np.int64(min_parallel), decode, prefill)


@njit(inline="always")
def _intn_a16(x, lo, hi, scales, cols, group, fmt, min_parallel, decode=True,
              prefill=True):
    """intN x float activations for one ``fmt`` (a literal)."""
    rows = lo.shape[0]
    sf = scales.ravel()
    return lowbit_matmul_a16(x, lo, hi, sf, sf.size // max(rows, 1), cols, group, fmt,
                             min_parallel, decode, prefill)


@njit(inline="always")
def intn_matmul_a8(xq, sx, lo, hi, scales, bits, cols, group, min_parallel=PAR_MIN):
    """W-intN-A8 from mining's intN plane layout (int2/3/5/6).

    Parameters
    ----------
    xq : ndarray of int8, shape (m, cols), values in [-127, 127]
    sx : ndarray of float32, shape (m,)
    lo : ndarray of uint8, shape (rows, ceil(cols * lo_bits / 8))
        Low plane of the offset codes ``u = code + 2**(bits-1)`` (crumbs for
        bits 2, 3; nibbles for 5, 6; lowest column in the lowest bits).
    hi : ndarray of uint8, shape (rows, ceil(cols * hi_bits / 8))
        High plane (bit plane for bits 3, 5; crumbs for 6); pass ``lo`` for
        bits 2.
    scales : ndarray of float32, shape (rows,) or (rows, ceil(cols / group))
    bits : int
        2, 3, 5 or 6.
    cols, group : int
        ``group <= 0`` (or ``>= cols``) for per-channel scales.

    Returns
    -------
    ndarray of float32, shape (m, rows)
        ``sx[i] * sum_g scale[j, g] * sum_(p in g) xq[i, p] * code[j, p]``
        (exact integer sums per group).
    """
    if bits == 2:
        return _intn_a8(xq, sx, lo, hi, scales, cols, group, 2, min_parallel)
    if bits == 3:
        return _intn_a8(xq, sx, lo, hi, scales, cols, group, 3, min_parallel)
    if bits == 5:
        return _intn_a8(xq, sx, lo, hi, scales, cols, group, 4, min_parallel)
    return _intn_a8(xq, sx, lo, hi, scales, cols, group, 5, min_parallel)


@njit(inline="always")
def intn_matmul_a16(x, lo, hi, scales, bits, cols, group, min_parallel=PAR_MIN):
    """W-intN-A16: float32 ``x [m, cols]`` carried as int16 codes; other
    parameters as :func:`intn_matmul_a8`."""
    if bits == 2:
        return _intn_a16(x, lo, hi, scales, cols, group, 2, min_parallel)
    if bits == 3:
        return _intn_a16(x, lo, hi, scales, cols, group, 3, min_parallel)
    if bits == 5:
        return _intn_a16(x, lo, hi, scales, cols, group, 4, min_parallel)
    return _intn_a16(x, lo, hi, scales, cols, group, 5, min_parallel)


@njit
def packed_intn_linear(x, lo, hi, scales, bits, cols, group, act8, min_parallel=PAR_MIN):
    """``x @ What.T`` for int{bits}/chan (``group <= 0``) and int{bits}/g{group}.

    Compiles every bit width and both activation paths;
    :func:`intn_linear_entry` gives the kernel of one."""
    if act8:
        xq, sx = quantize_rows_i8(x, min_parallel)
        return intn_matmul_a8(xq, sx, lo, hi, scales, bits, cols, group, min_parallel)
    return intn_matmul_a16(x, lo, hi, scales, bits, cols, group, min_parallel)


# ── checked entries: what ``PackedLinear`` calls ────────────────────────────
# One parallel function per format and activation path: the check and the
# activation quantiser inlined, the product through :func:`_run` (``fmt``
# reaches it as a constant, so only that format's variants compile, shared
# with the public cores).  Each checks that ``x`` is finite first and returns an
# empty ``(0, rows)`` array if not (a parallel function cannot return
# ``None`` or an array: numba's array analysis rejects the optional).


@njit(inline="always")
def _finite(x):
    return math.isfinite(absmax_f32(x.ravel(), 0, x.size))


@njit(inline="always")
def _checked_a8(x, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode, prefill,
                tiles=True, panel=True):
    rows = w.shape[0]
    if not _finite(x):
        return np.empty((0, rows), np.float32)
    m = x.shape[0]
    xq = np.empty((m, x.shape[1]), np.int8)
    sx = np.empty(m, np.float32)
    if prefill is None:
        # decode only: quantise on this thread (no parallel loop to compile)
        if decode is None:
            raise ValueError(_NO_PATH)
        _q8_rows(x, xq, sx, np.int64(0), m)
        # (_run_a8 without its prefill panel is _run; called, not inlined: the
        # public cores' decode calls the same variant, so it compiles once.
        # Through _run_any: a plain _run call here failed numba's array
        # analysis in the both-paths variant, "Dimension mismatch")
        return _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt,
                        np.int64(min_parallel), decode, prefill)
    # with the prefill path: quantise in this function's parallel loop, then
    # the separate kernel (inlined here, its prefill loops ran up to 25 %
    # slower -- ternary f32 m = 32)
    _q8_par(x, xq, sx, np.int64(min_parallel))
    if fmt != FMT_INT4:
        # only int4 has a panel; the entries pass ``fmt`` as a constant, so
        # numba prunes this test and the other formats compile no panel
        return _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                        decode, prefill)
    # (numba prunes ``f is None`` only for an ``f`` typed None: with
    # panel=None the raise below ends the panel branch before it is typed)
    if tiles is None:
        # the panel takes the whole product: called from here, not through
        # _run_a8 (one function less that re-emits the panel's code)
        if panel is None:
            raise ValueError(_NO_PATH)
        if not _w4_panel_ok(m, rows, cols, group):
            raise ValueError(_NO_TILES)
        return _panel_a8(xq, sx, w, sflat, sstride, cols, group, np.int64(min_parallel))
    if panel is None:
        # the dot tiles alone (w4a8_tiles_kw's flag for a shape the panel
        # does not take)
        return _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                        decode, prefill)
    return _run_a8(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                   decode, prefill)


@njit(inline="always")
def _checked_a16(x, w, w2, sflat, sstride, cols, group, fmt, min_parallel, decode, prefill):
    rows = w.shape[0]
    if not _finite(x):
        return np.empty((0, rows), np.float32)
    lv = np.float32(_a16_levels(cols, group, fmt))
    m = x.shape[0]
    xq = np.empty((m, x.shape[1]), np.int16)
    sx = np.empty(m, np.float32)
    if prefill is None:
        if decode is None:
            raise ValueError(_NO_PATH)
        _q16_rows(x, lv, xq, sx, np.int64(0), m)
    else:
        _q16_par(x, lv, xq, sx, np.int64(min_parallel))
    # int16 activations never take the 128-column modes: big=None
    return _run_any(xq, sx, w, w2, sflat, sstride, cols, group, fmt, np.int64(min_parallel),
                    decode, prefill, None)


@njit_parallel
def int4_linear_checked_a8(x, codes, scales, cols, group, min_parallel=PAR_MIN, decode=True,
                           prefill=True, tiles=True, panel=True):
    """:func:`packed_int4_linear_a8` as one compiled function, after a check
    that ``x`` is finite.

    Parameters and result as :func:`packed_int4_linear_a8`, except that an
    ``x`` holding NaN or Inf gives an empty ``(0, rows)`` float32 array (the
    caller raises).  ``decode`` / ``prefill`` as :func:`lowbit_matmul_a8`;
    ``tiles=None`` with ``decode=None`` (the flags :func:`w4a8_tiles_kw`
    gives for a shape the W4A8 panel takes) compiles the panel path alone,
    and raises ``ValueError`` for another shape; ``panel=None`` (its flags
    for the other shapes) compiles the dot tiles alone (any shape).
    """
    rows = codes.shape[0]
    sf = scales.ravel()
    return _checked_a8(x, codes, codes, sf, sf.size // max(rows, 1), cols, group, 0,
                       min_parallel, decode, prefill, tiles, panel)


@njit_parallel
def int4_linear_checked_a16(x, codes, scales, cols, group, min_parallel=PAR_MIN, decode=True,
                            prefill=True):
    """:func:`packed_int4_linear_a16` checked as :func:`int4_linear_checked_a8`."""
    rows = codes.shape[0]
    sf = scales.ravel()
    return _checked_a16(x, codes, codes, sf, sf.size // max(rows, 1), cols, group, 0,
                        min_parallel, decode, prefill)


@njit_parallel
def ternary_linear_checked_a8(x, codes, alpha, cols, min_parallel=PAR_MIN, decode=True,
                              prefill=True):
    """:func:`packed_ternary_linear_a8` checked as :func:`int4_linear_checked_a8`."""
    return _checked_a8(x, codes, codes, alpha, 0, cols, 0, 1, min_parallel, decode, prefill)


@njit_parallel
def ternary_linear_checked_a16(x, codes, alpha, cols, min_parallel=PAR_MIN, decode=True,
                               prefill=True):
    """:func:`packed_ternary_linear_a16` checked as :func:`int4_linear_checked_a8`."""
    return _checked_a16(x, codes, codes, alpha, 0, cols, 0, 1, min_parallel, decode, prefill)


@njit(inline="always")
def _intn_sf(lo, scales):
    sf = scales.ravel()
    return sf, sf.size // max(lo.shape[0], 1)


@njit_parallel
def _int2_a8(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a8(x, lo, hi, sf, ss, cols, group, 2, min_parallel, decode, prefill)


@njit_parallel
def _int3_a8(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a8(x, lo, hi, sf, ss, cols, group, 3, min_parallel, decode, prefill)


@njit_parallel
def _int5_a8(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a8(x, lo, hi, sf, ss, cols, group, 4, min_parallel, decode, prefill)


@njit_parallel
def _int6_a8(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a8(x, lo, hi, sf, ss, cols, group, 5, min_parallel, decode, prefill)


@njit_parallel
def _int2_a16(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a16(x, lo, hi, sf, ss, cols, group, 2, min_parallel, decode, prefill)


@njit_parallel
def _int3_a16(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a16(x, lo, hi, sf, ss, cols, group, 3, min_parallel, decode, prefill)


@njit_parallel
def _int5_a16(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a16(x, lo, hi, sf, ss, cols, group, 4, min_parallel, decode, prefill)


@njit_parallel
def _int6_a16(x, lo, hi, scales, cols, group, min_parallel, decode=True, prefill=True):
    sf, ss = _intn_sf(lo, scales)
    return _checked_a16(x, lo, hi, sf, ss, cols, group, 5, min_parallel, decode, prefill)


_INTN_ENTRY = {(2, True): _int2_a8, (3, True): _int3_a8, (5, True): _int5_a8,
               (6, True): _int6_a8, (2, False): _int2_a16, (3, False): _int3_a16,
               (5, False): _int5_a16, (6, False): _int6_a16}


def intn_linear_entry(bits, act8):
    """The compiled ``x @ What.T`` of one intN bit width and activation path
    (plain Python helper): ``fn(x, lo, hi, scales, cols, group, min_parallel,
    decode=True, prefill=True)``, arguments as :func:`packed_intn_linear` (and
    ``decode`` / ``prefill`` as :func:`lowbit_matmul_a8`); bit for bit its
    result, compiling only that format's code, as one parallel function.  An
    ``x`` holding NaN or Inf gives an empty ``(0, rows)`` float32 array.

    Raises
    ------
    ValueError
        ``bits`` not in (2, 3, 5, 6).
    """
    try:
        return _INTN_ENTRY[(int(bits), bool(act8))]
    except KeyError:
        raise ValueError(f"intN bits must be 2, 3, 5 or 6; got {bits!r}.") from None
