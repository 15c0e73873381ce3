"""SIMD tiles for packed low-bit weights (int4 nibbles, ternary crumbs, ...).

The tiles read packed weight bytes and unpack them **in registers**; no dense
weight matrix is ever written.  Every packed format is turned into *unsigned
offset codes* ``u = code + off`` (``off = 2**(b-1)``; ternary: ``off = 1``)
with two or three byte operations, then multiplied with signed activations:

* int8 activations (``a8``): ``u8 x s8`` dot products into int32 lanes --
  ``vpdpbusd`` (AVX-512 VNNI with VL, or AVX-VNNI) or, on AVX2-only hosts,
  ``vpmaddubsw`` + ``vpmaddwd`` by ones (pair sums are at most
  ``2 * 63 * 127 < 2**15``: no saturation); a portable widen-multiply-add
  elsewhere;
* int16 activations (``a16``): the offset codes are zero-extended to int16
  and multiplied with ``vpmaddwd`` (portable IR elsewhere).

The offset is removed exactly: the caller passes, per *flush* (a run of units
that shares one scale), an int32 vector ``corr`` holding ``off * sum(x)`` over
those columns, which the tile subtracts before scaling.

Activation arrangement
----------------------
A *unit* is 32 packed weight bytes (64 columns of int4, 128 of ternary).  The
packed byte ``t`` of a unit holds ``P`` columns ``P*t + s`` (``s < P``) in its
``s``-th field, so the caller pre-arranges each activation row once per call:
``xp[u*UNIT + s*32 + t] = x[u*UNIT + P*t + s]`` -- field ``s`` of 32
consecutive bytes then lines up lane for lane with activation slot ``s``.
This costs one pass over ``x`` (small) instead of a byte shuffle per weight.

Formats (``fmt``) and flush modes (``mode``)
--------------------------------------------
====  =========  ====  ====  ===================================================
fmt   name       P     off   unpack (``b`` = 32 packed bytes)
====  =========  ====  ====  ===================================================
0     int4 nib   2     8     ``bx = b ^ 0x88``; ``u0 = bx & 15``; ``u1 = bx >> 4``
1     ternary    4     1     ``b' = b ^ 0x55 ^ ((b & 0x55) << 1)`` (each crumb
                             ``c -> (c + 1) & 3``: 0->1, 1->2, 3->0);
                             ``u_s = (b' >> 2s) & 3``
====  =========  ====  ====  ===================================================

* mode 0: one scale per row; int32 lanes are flushed into int64 every
  ``upf`` units, result = exact integer sum (returned as float64);
* mode 1: group of 32 with 64-column units: int32 lanes 0-3 are the unit's
  first group and lanes 4-7 its second; flushed every unit as
  ``float(lanes) * [s0 x4, s1 x4]`` into float32 accumulators;
* mode 2: groups of ``upf`` units: flushed every group as
  ``float(lanes) * s_g``;
* mode 3 (int4, groups of 32, int8 activations only): *double units* of 128
  columns (64 packed bytes, groups A-D); the 16 dwords of the two 32-byte
  loads are permuted so that dword ``4g + 2h + (l % 2)`` goes to lane ``l =
  2g + (l % 2)`` of vector ``h``; activations are arranged to match (vector
  ``(h, s)`` of slot ``s``, see ``_arrange`` in :mod:`._packed_quant`), lane
  ``l`` of the int32 accumulator sums 16 columns of group ``l // 2``, ``corr``
  holds the group's ``off * sum(x)`` in lane ``2g`` (0 in ``2g + 1``), and one
  flush ``float(lanes) * [sA sA sB sB sC sC sD sD]`` per double unit; ``nunits``
  counts double units;
* modes 4-6 (intN fmts 2-5, int8 activations only): *big units* of 128
  columns with the ``hi`` plane merged into the ``lo`` fields in registers
  (one byte shuffle per row picks each lane's ``hi`` byte, a bit test per
  field bit ORs ``1 << (lo_bits + i)`` into the code; int6's crumbs: one
  ``vpmullw`` per slot vector moves both bytes' crumbs of a 16-bit word into
  place, see ``_merge_crumbs_nib``), so every unit is four
  ``vpdpbusd`` per weight row whatever the bit width -- the 64-column modes
  spend a second set of dot products on the ``hi`` plane.  ``lo`` crumbs
  (int2/int3): slot ``q`` byte ``t`` = column ``4 t + q``; ``lo`` nibbles
  (int5/int6): the mode-3 dword permute.  Either way int32 lane ``l`` sums
  columns of group ``l // 2`` (``LOWBIT_BIG_LANES`` gives every lane's
  column).  Mode 4: groups of 32, one flush per unit as mode 3 (``corr``
  lane ``2 g``); mode 5: one scale per row, exact int64 sums every ``upf``
  units; mode 6: groups of ``128 * upf`` columns, one scale per flush.

Every unit prefetches the same offset ``pf`` bytes further into **L2**
(``prefetcht1``), and the scale rows too: prefetching the next tile's rows
into L1 evicted lines before their use.  On the Zen 4 development machine
(4096 x 4096 int4/g32 and int5/g32 stacks streamed, m = 1, 2 threads) the L2
hint lifted the decode from 21-24 GB/s to 28-30 GB/s; ``python bench.py``
section 8 reports the rate of every format against the measured streaming
bandwidth.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from ._jit import intrinsic

from ._simd import _FEATS, _X86, HOST_I8_PATH, I8_PATH_FORCED, _hsum, _madd16, _shuffle
from ._simd import prefetch as _prefetch

__all__ = [
    "LOWBIT_PATH",
    "LOWBIT_PATHS",
    "LOWBIT_LANES",
    "LOWBIT_BIG_LANES",
    "LOWBIT_BIG_UNIT",
    "LOWBIT_SLOTS",
    "LOWBIT_UNIT",
    "LOWBIT_OFFSET",
    "LOWBIT_PLANE_BYTES",
    "lowbit_path_supported",
    "make_lowbit_tile",
    "LOWBIT_UNIT_BYTES",
    "lowbit_tile_1x1",
    "lowbit_tile_1x4",
    "lowbit_tile_1x8",
    "lowbit_tile_4x2",
]

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32, _F64 = ir.FloatType(), ir.DoubleType()
_V32I8 = ir.VectorType(_I8, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, 8)
_V8I64 = ir.VectorType(_I64, 8)
_V8F32 = ir.VectorType(_F32, 8)
_V8F64 = ir.VectorType(_F64, 8)


#: The low-bit path of each int8 path (:data:`._simd.I8_PATHS`): a forced int8
#: path (``OPSCOPE_I8_PATH``) forces the low-bit tiles onto the same instructions.
_FROM_I8_PATH = {"avx512vnni": "vnni256", "avx512vnni256": "vnni256", "avxvnni": "avxvnni",
                 "avx2": "avx2", "portable": "portable"}


def _pick_path() -> str:
    if I8_PATH_FORCED:
        return _FROM_I8_PATH[HOST_I8_PATH]
    if _X86 and "avx512vnni" in _FEATS and "avx512vl" in _FEATS:
        return "vnni256"
    if _X86 and "avxvnni" in _FEATS:
        return "avxvnni"
    if _X86 and "avx2" in _FEATS:
        return "avx2"
    return "portable"


#: The ``u8 x s8`` dot path the low-bit tiles compile to on this machine
#: (chosen at import from the features numba targets -- numba's on-disk cache
#: is keyed on the same CPU, so a cached kernel matches -- or from a forced
#: int8 path, ``OPSCOPE_I8_PATH``, whose runs cache apart).
LOWBIT_PATH = _pick_path()
#: Every ``u8 x s8`` path the tiles can be compiled for (tests build each one
#: this machine can execute with ``make_lowbit_tile``).
LOWBIT_PATHS = ("vnni256", "avxvnni", "avx2", "portable")

#: Packed weight bytes per unit (one step of a tile, per weight row).
LOWBIT_UNIT_BYTES = 32

# fmt -> (unit columns, offset, [(plane, decoder, shift)]): plane 0 = ``w``
# (codes / lo), 1 = ``w2`` (hi); decoder "nib4x" (two's complement nibbles,
# xor 0x88), "nib" (offset-binary nibbles), "tern" (ternary crumbs), "crumb"
# (16 bytes -> 2 slots), "bit" (8 bytes -> 2 slots); shift = log2 of the
# plane's weight in ``u`` (0 for ``lo``, ``lo_bits`` for ``hi``).
_FMTS = {
    0: (64, 8, [(0, "nib4x", 0)]),                    # int4
    1: (128, 1, [(0, "tern", 0)]),                    # ternary
    2: (64, 2, [(0, "crumb", 0)]),                    # int2
    3: (64, 4, [(0, "crumb", 0), (1, "bit", 2)]),     # int3
    4: (64, 16, [(0, "nib", 0), (1, "bit", 4)]),      # int5
    5: (64, 32, [(0, "nib", 0), (1, "crumb", 4)]),    # int6
}
#: Packed bytes per unit each decoder reads from its plane.
_DEC_BYTES = {"nib4x": 32, "nib": 32, "tern": 32, "crumb": 16, "bit": 8}
_DEC_SLOTS = {"nib4x": 2, "nib": 2, "tern": 4, "crumb": 2, "bit": 2}


def _dec_lane_cols(dec):
    """Column (inside the unit) of every lane of every slot a decoder emits."""
    if dec in ("nib4x", "nib"):
        return [[2 * t + s for t in range(32)] for s in range(2)]
    if dec == "tern":
        return [[4 * t + q for t in range(32)] for q in range(4)]
    if dec == "crumb":
        out = []
        for k in range(2):
            out.append([32 * ((i // 8) // 2) + 4 * (i % 8) + 2 * k + (i // 8) % 2
                        for i in range(32)])
        return out
    if dec == "bit":
        out = []
        for k in range(2):
            out.append([32 * (i // 16) + 8 * ((i % 16) % 4) + 4 * k + (i % 16) // 4
                        for i in range(32)])
        return out
    raise AssertionError(dec)


def _lane_table():
    nf = max(_FMTS) + 1
    tab = np.zeros((nf, 4, 32), dtype=np.int64)
    nslots = np.zeros(nf, dtype=np.int64)
    units = np.zeros(nf, dtype=np.int64)
    offs = np.zeros(nf, dtype=np.int64)
    pbytes = np.zeros((nf, 2), dtype=np.int64)
    for f, (unit, off, planes) in _FMTS.items():
        k = 0
        for plane, dec, _ in planes:
            for lanes in _dec_lane_cols(dec):
                tab[f, k] = lanes
                k += 1
            pbytes[f, plane] = _DEC_BYTES[dec]
        nslots[f] = k
        units[f] = unit
        offs[f] = off
    return tab, nslots, units, offs, pbytes


#: ``LOWBIT_LANES[fmt, slot, lane]``: column inside the unit that activation
#: slot ``slot`` holds in lane ``lane`` (the arrangement the tiles expect);
#: ``LOWBIT_SLOTS[fmt]`` slots, ``LOWBIT_UNIT[fmt]`` columns per unit,
#: ``LOWBIT_OFFSET[fmt]`` offset of the unsigned codes,
#: ``LOWBIT_PLANE_BYTES[fmt, plane]`` packed bytes per unit and plane.
LOWBIT_LANES, LOWBIT_SLOTS, LOWBIT_UNIT, LOWBIT_OFFSET, LOWBIT_PLANE_BYTES = _lane_table()

# Big units (modes 4-6, int8 activations, intN fmts 2-5): 128 columns per
# unit and four 32-lane slot vectors that already hold the *whole* offset code
# (the hi plane is merged into the lo fields in registers), so a unit costs
# four ``vpdpbusd`` per weight row whatever the bit width, and every int32 lane
# sums columns of one group of 32 (lane ``l`` -> group ``l // 2``).
# fmt -> (lo decoder, lo bytes per unit, hi decoder or None, hi bytes per unit)
_BIG = {0: ("nib4x", 64, None, 0),
        2: ("crumb4", 32, None, 0), 3: ("crumb4", 32, "bit", 16),
        4: ("nib", 64, "bit", 16), 5: ("nib", 64, "crumb", 32)}
_LO_BITS = {2: 2, 3: 2, 4: 4, 5: 4}
#: Columns per big unit.
LOWBIT_BIG_UNIT = 128


def _big_lane_cols(lo):
    """Column (inside a 128-column unit) of every lane of the 4 slot vectors."""
    if lo == "crumb4":   # byte t of the 32 lo bytes holds columns 4t .. 4t+3
        return [[4 * t + q for t in range(32)] for q in range(4)]
    # nibbles: 64 lo bytes, the two 32-byte loads dword-permuted (as mode 3):
    # vector v = 2 h + s, byte 4 l + e <- packed byte 16 (l // 2) + 8 h + 4 (l % 2) + e
    return [[2 * (16 * (l // 2) + 8 * h + 4 * (l % 2) + e) + s
             for l in range(8) for e in range(4)] for h in range(2) for s in range(2)]


def _big_table():
    tab = np.zeros((max(_FMTS) + 1, 4, 32), dtype=np.int64)
    for f, (lo, _, _, _) in _BIG.items():
        tab[f] = _big_lane_cols(lo)
    return tab


#: ``LOWBIT_BIG_LANES[fmt, slot, lane]``: column inside a 128-column big unit
#: that activation slot ``slot`` holds in lane ``lane`` (modes 4-6).
LOWBIT_BIG_LANES = _big_table()


def _splat8(v):
    return ir.Constant(_V32I8, [ir.Constant(_I8, v)] * 32)


def _splat(vty, v):
    return ir.Constant(vty, [ir.Constant(vty.element, v)] * vty.count)


def _decode(builder, dec, b, shift):
    """Packed bytes -> list of unsigned ``<32 x i8>`` slot vectors (times ``2**shift``)."""
    if dec in ("nib4x", "nib"):
        bx = builder.xor(b, _splat8(0x88)) if dec == "nib4x" else b
        return [builder.and_(bx, _splat8(0x0F)), builder.lshr(bx, _splat8(4))]
    if dec == "tern":
        t = builder.shl(builder.and_(b, _splat8(0x55)), _splat8(1))
        b2 = builder.xor(builder.xor(b, _splat8(0x55)), t)
        out = [builder.and_(b2, _splat8(3))]
        for s in (1, 2):
            out.append(builder.and_(builder.lshr(b2, _splat8(2 * s)), _splat8(3)))
        out.append(builder.lshr(b2, _splat8(6)))
        return out
    if dec == "crumb":  # b: <16 x i8>
        v16 = ir.VectorType(_I8, 16)
        idx = ir.Constant(ir.VectorType(_I32, 32), [ir.Constant(_I32, i) for i in (
            list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32)))])
        out = []
        for k in range(2):
            a = builder.lshr(b, _splat(v16, 4 * k)) if k else b
            c = builder.lshr(b, _splat(v16, 4 * k + 2))
            v = builder.and_(builder.shuffle_vector(a, c, idx), _splat8(3))
            out.append(builder.shl(v, _splat8(shift)) if shift else v)
        return out
    if dec == "bit":  # b: <8 x i8>
        out = []
        for k in range(2):
            idx = [4 * (i // 16) + (i % 16) % 4 for i in range(32)]
            masks = [1 << (4 * k + (i % 16) // 4) for i in range(32)]
            bc = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(_I32, 32),
                                                          [ir.Constant(_I32, i) for i in idx]))
            m = ir.Constant(_V32I8, [ir.Constant(_I8, q if q < 128 else q - 256)
                                     for q in masks])
            nz = builder.icmp_unsigned("!=", builder.and_(bc, m), _splat8(0))
            out.append(builder.select(nz, _splat8(1 << shift), _splat8(0)))
        return out
    raise AssertionError(dec)


def _merge_crumbs_nib(builder, sl, hv):
    """OR the hi crumbs of a 128-column int6 unit into its 4 nibble slot vectors.

    Slot vector ``v = 2 h + s`` byte ``4 l + e`` holds column ``c = 32 (l // 2) +
    16 h + 8 (l % 2) + 2 e + s``; its hi crumb is field ``c % 4 = 2 (e % 2) + s``
    of hi byte ``c // 4``.  The two bytes of every 16-bit word (``e`` even, odd)
    share that hi byte, so one in-lane byte shuffle puts it in the word's low
    byte (high byte 0) and one ``vpmullw`` moves both crumbs to bits 4-5 of
    their own byte: with ``b = h & (0x33 << 2 s)`` (the two crumbs of slot
    ``s``), ``b * (2**(4 - 2 s) + 2**(8 - 2 s))`` has the even byte's crumb at
    bits 4-5 and the odd byte's at bits 12-13 (the cross terms land on bits
    8-10 only), then ``& 0x3030``: four operations per slot vector instead of
    a compare-and-select per bit."""
    v16 = ir.VectorType(_I16, 16)
    zero = ir.Constant(_V32I8, None)
    out = list(sl)
    for h in range(2):
        idx = []
        for l in range(8):
            for e in range(4):
                idx.append(8 * (l // 2) + 4 * h + 2 * (l % 2) + e // 2 if e % 2 == 0 else 32)
        sh = builder.bitcast(builder.shuffle_vector(hv, zero, ir.Constant(
            ir.VectorType(_I32, 32), [ir.Constant(_I32, i) for i in idx])), v16)
        for s in range(2):
            b = builder.and_(sh, _splat(v16, 0x33 << (2 * s)))
            p = builder.mul(b, _splat(v16, (1 << (4 - 2 * s)) + (1 << (8 - 2 * s))))
            p = builder.bitcast(builder.and_(p, _splat(v16, 0x3030)), _V32I8)
            out[2 * h + s] = builder.or_(out[2 * h + s], p)
    return out


def _dot_u8s8(builder, acc, u, s, path):
    """``acc[l] += sum_{i<4} u[4l+i] * s[4l+i]`` (u unsigned, s signed bytes)."""
    mod = builder.module
    if path in ("vnni256", "avxvnni"):
        fn = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_V8I32, [_V8I32, _V8I32, _V8I32]),
            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [acc, builder.bitcast(u, _V8I32),
                                 builder.bitcast(s, _V8I32)])
    if path == "avx2":
        maddubs = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_V16I16, [_V32I8, _V32I8]), "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_V8I32, [_V16I16, _V16I16]), "llvm.x86.avx2.pmadd.wd")
        p16 = builder.call(maddubs, [u, s])
        ones = ir.Constant(_V16I16, [ir.Constant(_I16, 1)] * 16)
        return builder.add(acc, builder.call(maddwd, [p16, ones]))
    v32 = ir.VectorType(_I32, 32)
    p = builder.mul(builder.zext(u, v32), builder.sext(s, v32))
    tot = acc
    for i in range(4):
        tot = builder.add(tot, _shuffle(builder, p, [4 * l + i for l in range(8)]))
    return tot


#: Largest unsigned offset code of each fmt's int8-activation big units
#: (``2**bits - 1``; int4: 15).
_BIG_UMAX = {0: 15, 2: 3, 3: 7, 4: 31, 5: 63}


def _dot_u8s8_many(builder, acc, us, ss, path, umax):
    """``acc`` plus the products of every ``(us[i], ss[i])`` pair as
    :func:`_dot_u8s8` (the same int32 lanes).  On ``avx2`` the ``vpmaddubsw``
    int16 results of up to ``32767 // (2 * umax * 128)`` pairs are added in
    int16 before one ``vpmaddwd`` by ones (each pair sum is at most ``2 *
    umax * 128`` for codes ``u <= umax`` and any int8 activation, so no int16
    sum saturates or wraps: the same exact int32 lanes, fewer widenings --
    int4/int5/int3 units: one ``vpmaddwd`` instead of four, int6: two)."""
    if path != "avx2":
        for u, s in zip(us, ss):
            acc = _dot_u8s8(builder, acc, u, s, path)
        return acc
    per = max(1, 32767 // (2 * umax * 128))
    mod = builder.module
    maddubs = cgutils.get_or_insert_function(
        mod, ir.FunctionType(_V16I16, [_V32I8, _V32I8]), "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(
        mod, ir.FunctionType(_V8I32, [_V16I16, _V16I16]), "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(_V16I16, [ir.Constant(_I16, 1)] * 16)
    for i0 in range(0, len(us), per):
        p16 = None
        for u, s in zip(us[i0:i0 + per], ss[i0:i0 + per]):
            p = builder.call(maddubs, [u, s])
            p16 = p if p16 is None else builder.add(p16, p)
        acc = builder.add(acc, builder.call(maddwd, [p16, ones]))
    return acc


def _zext16(builder, u, half):
    return builder.zext(_shuffle(builder, u, list(range(16 * half, 16 * half + 16))),
                        _V16I16)


def lowbit_path_supported(path: str) -> bool:
    """Whether this machine can run tiles compiled for ``path`` (plain Python)."""
    need = {"vnni256": ("avx512vnni", "avx512vl", "avx2"), "avxvnni": ("avxvnni", "avx2"),
            "avx2": ("avx2",), "portable": ()}
    if path not in need:
        raise ValueError(f"unknown low-bit path {path!r}; expected one of {LOWBIT_PATHS}")
    return path == "portable" or (_X86 and all(f in _FEATS for f in need[path]))


def _make_tile(R: int, C: int, path: str | None = None):
    """Build an ``R x C`` low-bit tile for ``path`` (default: the host's)."""
    path = path or LOWBIT_PATH
    ret = types.UniTuple(types.float64, R * C)

    # prefer_literal: a call with constant ``fmt`` and ``mode`` emits that
    # variant only (no run-time dispatch over every format and mode: smaller
    # code that LLVM inlines into the caller's loop, and a shorter compile);
    # a constant ``fmt`` with a run-time ``mode`` emits that format's modes
    # only (3-6 variants instead of all 29: the kernels pass ``fmt`` as a
    # literal down from their per-format entry points)
    @intrinsic(prefer_literal=True)
    def tile(typingctx, xp, xoff, xstride, corr, coff, cstride, w, woff, wstride,
             w2, w2off, w2stride, sc, soff, sstride, nunits, upf, fmt, mode, pf, pf2):
        if not (isinstance(xp, types.Array) and xp.dtype in (types.int8, types.int16)
                and isinstance(corr, types.Array) and corr.dtype == types.int32
                and isinstance(w, types.Array) and w.dtype == types.uint8
                and isinstance(w2, types.Array) and w2.dtype == types.uint8
                and isinstance(sc, types.Array) and sc.dtype == types.float32):
            return None
        act = "a8" if xp.dtype == types.int8 else "a16"
        litf = fmt.literal_value if isinstance(fmt, types.IntegerLiteral) else None
        lit = (litf, mode.literal_value) if (
            litf is not None and isinstance(mode, types.IntegerLiteral)) else None
        ip = types.intp
        sig = ret(xp, ip, ip, corr, ip, ip, w, ip, ip, w2, ip, ip, sc, ip, ip, ip, ip, ip, ip,
                  ip, ip)

        def codegen(context, builder, sig, args):
            xa = context.make_array(sig.args[0])(context, builder, args[0])
            ca = context.make_array(sig.args[3])(context, builder, args[3])
            wa = context.make_array(sig.args[6])(context, builder, args[6])
            w2a = context.make_array(sig.args[9])(context, builder, args[9])
            sa = context.make_array(sig.args[12])(context, builder, args[12])
            (xoff_, xstr, coff_, cstr, woff_, wstr, w2off_, w2str, soff_, sstr, nun, upf_,
             fmt_, mode_, pf_, pf2_) = [
                context.cast(builder, args[i], sig.args[i], types.intp)
                for i in (1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20)]
            fmuladd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V8F32, [_V8F32, _V8F32, _V8F32]),
                "llvm.fmuladd.v8f32")
            intp = context.get_value_type(types.intp)

            def K(v):
                return ir.Constant(intp, v)

            res = []
            for _ in range(R * C):
                a = cgutils.alloca_once(builder, _F64)
                builder.store(ir.Constant(_F64, 0.0), a)
                res.append(a)
            xrow = [builder.gep(xa.data, [builder.add(xoff_, builder.mul(xstr, K(r)))],
                                inbounds=True) for r in range(R)]
            crow = [builder.gep(ca.data, [builder.add(coff_, builder.mul(cstr, K(r)))],
                                inbounds=True) for r in range(R)]
            wrow = [builder.gep(wa.data, [builder.add(woff_, builder.mul(wstr, K(c)))],
                                inbounds=True) for c in range(C)]
            w2row = [builder.gep(w2a.data, [builder.add(w2off_, builder.mul(w2str, K(c)))],
                                 inbounds=True) for c in range(C)]
            srow = [builder.gep(sa.data, [builder.add(soff_, builder.mul(sstr, K(c)))],
                                inbounds=True) for c in range(C)]
            nacc = R * C * (1 if act == "a8" else 2)
            iacc = [cgutils.alloca_once(builder, _V8I32) for _ in range(nacc)]
            acc64 = [cgutils.alloca_once(builder, _V8I64) for _ in range(R * C)]
            facc = [cgutils.alloca_once(builder, _V8F32) for _ in range(R * C)]

            def vload(base, off, vty):
                p = builder.gep(base, [off], inbounds=True)
                return builder.load(builder.bitcast(p, vty.as_pointer()), align=1)

            def flush(t, a, exact, sv):
                """Fold int32 lanes ``a`` into output ``t``: exact int64 sums, or
                ``float(a) * sv`` into the float32 accumulators."""
                if exact:
                    builder.store(builder.add(builder.load(acc64[t]),
                                              builder.sext(a, _V8I64)), acc64[t])
                else:
                    builder.store(builder.call(fmuladd, [
                        builder.sitofp(a, _V8F32), sv, builder.load(facc[t])]), facc[t])

            def finish(exact):
                """Horizontal sums of the accumulators into the results."""
                for t in range(R * C):
                    if exact:
                        s = _hsum(builder, builder.load(acc64[t]), 8, builder.add)
                        builder.store(builder.sitofp(s, _F64), res[t])
                    else:
                        v = builder.fpext(builder.load(facc[t]), _V8F64)
                        builder.store(_hsum(builder, v, 8, builder.fadd), res[t])

            def emit(fm, md):
                planes = _FMTS[fm][2]
                P = sum(_DEC_SLOTS[d] for _, d, _ in planes)
                unit_x = 32 * P  # activation elements per unit
                for t in range(R * C):
                    builder.store(ir.Constant(_V8I64, None), acc64[t])
                    builder.store(ir.Constant(_V8F32, None), facc[t])
                nfl = builder.udiv(builder.add(nun, builder.sub(upf_, K(1))), upf_)
                with cgutils.for_range(builder, nfl) as fl:
                    f = fl.index
                    for a in iacc:
                        builder.store(ir.Constant(_V8I32, None), a)
                    u0 = builder.mul(f, upf_)
                    rem = builder.sub(nun, u0)
                    cnt = builder.select(builder.icmp_signed("<", rem, upf_), rem, upf_)
                    with cgutils.for_range(builder, cnt) as ul:
                        u = builder.add(u0, ul.index)
                        pieces = []
                        for c in range(C):
                            pc = []
                            for plane, dec, shift in planes:
                                nbyt = _DEC_BYTES[dec]
                                base = wrow[c] if plane == 0 else w2row[c]
                                uo = builder.mul(u, K(nbyt))
                                bv = vload(base, uo, ir.VectorType(_I8, nbyt))
                                pa = builder.gep(base, [builder.add(
                                    uo, pf_ if plane == 0 else pf2_)], inbounds=False)
                                _prefetch(builder, pa)
                                pc += _decode(builder, dec, bv, shift)
                            pieces.append(pc)
                        xbase = builder.mul(u, K(unit_x))
                        for r in range(R):
                            if act == "a8":
                                xs = [vload(xrow[r], builder.add(xbase, K(32 * s)), _V32I8)
                                      for s in range(P)]
                            else:
                                xs = [(vload(xrow[r], builder.add(xbase, K(32 * s)), _V16I16),
                                       vload(xrow[r], builder.add(xbase, K(32 * s + 16)),
                                             _V16I16)) for s in range(P)]
                            for c in range(C):
                                t = r * C + c
                                if act == "a8":
                                    a = builder.load(iacc[t])
                                    for s in range(P):
                                        a = _dot_u8s8(builder, a, pieces[c][s], xs[s], path)
                                    builder.store(a, iacc[t])
                                else:
                                    aA = builder.load(iacc[2 * t])
                                    aB = builder.load(iacc[2 * t + 1])
                                    for s in range(P):
                                        pv = pieces[c][s]
                                        aA = builder.add(aA, _madd16(
                                            builder, _zext16(builder, pv, 0), xs[s][0]))
                                        aB = builder.add(aB, _madd16(
                                            builder, _zext16(builder, pv, 1), xs[s][1]))
                                    builder.store(aA, iacc[2 * t])
                                    builder.store(aB, iacc[2 * t + 1])
                    # flush
                    foff = builder.mul(f, K(8))
                    cv = [vload(crow[r], foff, _V8I32) for r in range(R)]
                    svec = []
                    if md == 1:
                        for c in range(C):
                            prefetch_scales(c, builder.mul(f, K(2)))
                            p0 = builder.gep(srow[c], [builder.mul(f, K(2))], inbounds=True)
                            s0 = builder.load(p0)
                            s1 = builder.load(builder.gep(p0, [K(1)], inbounds=True))
                            v = ir.Constant(_V8F32, None)
                            for l in range(8):
                                v = builder.insert_element(v, s0 if l < 4 else s1,
                                                           ir.Constant(_I32, l))
                            svec.append(v)
                    elif md == 2:
                        svec = [splat_scale(c, f) for c in range(C)]
                    for r in range(R):
                        for c in range(C):
                            t = r * C + c
                            if act == "a8":
                                a = builder.load(iacc[t])
                            else:
                                aA = builder.load(iacc[2 * t])
                                aB = builder.load(iacc[2 * t + 1])
                                if md == 1:
                                    ev = builder.shuffle_vector(aA, aB, ir.Constant(
                                        ir.VectorType(_I32, 8),
                                        [ir.Constant(_I32, i) for i in range(0, 16, 2)]))
                                    od = builder.shuffle_vector(aA, aB, ir.Constant(
                                        ir.VectorType(_I32, 8),
                                        [ir.Constant(_I32, i) for i in range(1, 16, 2)]))
                                    a = builder.add(ev, od)
                                else:
                                    a = builder.add(aA, aB)
                            flush(t, builder.sub(a, cv[r]), md == 0,
                                  svec[c] if md else None)
                finish(md == 0)

            idx3 = [ir.Constant(_I32, 4 * (l // 2) + 2 * h + (l % 2))
                    for h in range(2) for l in range(8)]
            perm3 = [ir.Constant(ir.VectorType(_I32, 8), idx3[8 * h:8 * h + 8])
                     for h in range(2)]

            # scales stream too (one float per 32 columns and row): prefetch
            # them into L2 as many rows ahead as the weights (pf / wstride rows)
            pf_rows = builder.sdiv(pf_, builder.select(
                builder.icmp_signed(">", wstr, K(0)), wstr, K(1)))
            spf = builder.mul(pf_rows, sstr)

            def prefetch_scales(c, off):
                pa = builder.gep(srow[c], [builder.add(off, spf)], inbounds=False)
                _prefetch(builder, pa)

            def splat_scale(c, f):
                """Scale ``f`` of weight row ``c`` in all 8 lanes (one scale
                per flush: channel-wise or one group per flush)."""
                prefetch_scales(c, f)
                s0 = builder.load(builder.gep(srow[c], [f], inbounds=True))
                v = builder.insert_element(ir.Constant(_V8F32, None), s0, ir.Constant(_I32, 0))
                return _shuffle(builder, v, [0] * 8)

            def big_slots(fm, c, u):
                """The 4 slot vectors (whole offset codes) of big unit ``u``,
                weight row ``c`` of the tile."""
                lo, lob, hi, hib = _BIG[fm]
                uo = builder.mul(u, K(lob))
                if lo == "crumb4":
                    bv = vload(wrow[c], uo, _V32I8)
                    sl = [builder.and_(bv, _splat8(3))]
                    for q in (1, 2):
                        sl.append(builder.and_(builder.lshr(bv, _splat8(2 * q)), _splat8(3)))
                    sl.append(builder.lshr(bv, _splat8(6)))
                else:
                    b0 = builder.bitcast(vload(wrow[c], uo, _V32I8), _V8I32)
                    b1 = builder.bitcast(vload(wrow[c], builder.add(uo, K(32)), _V32I8),
                                         _V8I32)
                    sl = []
                    for h in range(2):
                        v = builder.bitcast(builder.shuffle_vector(b0, b1, perm3[h]), _V32I8)
                        sl += _decode(builder, lo, v, 0)
                pa = builder.gep(wrow[c], [builder.add(uo, pf_)], inbounds=False)
                _prefetch(builder, pa)
                if hi is None:
                    return sl
                ho = builder.mul(u, K(hib))
                hv = vload(w2row[c], ho, ir.VectorType(_I8, hib))
                pa = builder.gep(w2row[c], [builder.add(ho, pf2_)], inbounds=False)
                _prefetch(builder, pa)
                if hi == "crumb" and lo == "nib":
                    # int6: 4 operations per slot vector instead of 2 x 4 (4096 x
                    # 4096 streamed, m = 1, 2 threads, AMD EPYC Zen 3, avx2, 1 x 4
                    # tiles: 16.1 -> 19.1 GB/s against a copy of the old merge)
                    return _merge_crumbs_nib(builder, sl, hv)
                # hi fields: per lane, pick the byte holding its column's field
                # (one byte shuffle, shared by slots with the same byte pattern),
                # test each field bit and OR ``1 << (lo_bits + bit)`` into the code
                fb = 1 if hi == "bit" else 2
                per = 8 // fb
                lb = _LO_BITS[fm]
                cache = {}
                for k, cols in enumerate(_big_lane_cols(lo)):
                    idx = tuple(cc // per for cc in cols)
                    if idx not in cache:
                        cache[idx] = builder.shuffle_vector(hv, hv, ir.Constant(
                            ir.VectorType(_I32, 32), [ir.Constant(_I32, i) for i in idx]))
                    sh = cache[idx]
                    for i in range(fb):
                        msk = [1 << (fb * (cc % per) + i) for cc in cols]
                        mv = ir.Constant(_V32I8, [ir.Constant(_I8, q if q < 128 else q - 256)
                                                  for q in msk])
                        nz = builder.icmp_unsigned("!=", builder.and_(sh, mv), _splat8(0))
                        sl[k] = builder.select(nz, builder.or_(sl[k], _splat8(1 << (lb + i))),
                                               sl[k])
                return sl

            def emit_big4(fm):
                # groups of 32 (mode 3: int4, mode 4: intN): one flush per
                # unit of 128 columns, each int32 chain started at -corr
                for t in range(R * C):
                    builder.store(ir.Constant(_V8F32, None), facc[t])
                with cgutils.for_range(builder, nun) as dl:
                    d = dl.index
                    pieces = [big_slots(fm, c, d) for c in range(C)]
                    sp = []
                    for c in range(C):
                        prefetch_scales(c, builder.mul(d, K(4)))
                        p4 = builder.gep(srow[c], [builder.mul(d, K(4))], inbounds=True)
                        v4 = builder.load(builder.bitcast(p4, ir.VectorType(_F32, 4).as_pointer()),
                                          align=4)
                        sp.append(_shuffle(builder, v4, [0, 0, 1, 1, 2, 2, 3, 3]))
                    xbase = builder.mul(d, K(128))
                    foff = builder.mul(d, K(8))
                    for r in range(R):
                        xs = [vload(xrow[r], builder.add(xbase, K(32 * v)), _V32I8)
                              for v in range(4)]
                        nc = builder.sub(ir.Constant(_V8I32, None), vload(crow[r], foff, _V8I32))
                        for c in range(C):
                            t = r * C + c
                            a = _dot_u8s8_many(builder, nc, pieces[c], xs, path,
                                               _BIG_UMAX[fm])
                            flush(t, a, False, sp[c])
                finish(False)

            def emit_big(fm, md):
                # md 5: one scale per row (exact int64 sums); md 6: one scale per
                # flush of ``upf`` units (groups of 128 * upf columns)
                for t in range(R * C):
                    builder.store(ir.Constant(_V8I64, None), acc64[t])
                    builder.store(ir.Constant(_V8F32, None), facc[t])
                nfl = builder.udiv(builder.add(nun, builder.sub(upf_, K(1))), upf_)
                with cgutils.for_range(builder, nfl) as fl:
                    f = fl.index
                    foff = builder.mul(f, K(8))
                    for r in range(R):
                        nc = builder.sub(ir.Constant(_V8I32, None), vload(crow[r], foff, _V8I32))
                        for c in range(C):
                            builder.store(nc, iacc[r * C + c])
                    u0 = builder.mul(f, upf_)
                    rem = builder.sub(nun, u0)
                    cnt = builder.select(builder.icmp_signed("<", rem, upf_), rem, upf_)
                    with cgutils.for_range(builder, cnt) as ul:
                        u = builder.add(u0, ul.index)
                        pieces = [big_slots(fm, c, u) for c in range(C)]
                        xbase = builder.mul(u, K(128))
                        for r in range(R):
                            xs = [vload(xrow[r], builder.add(xbase, K(32 * v)), _V32I8)
                                  for v in range(4)]
                            for c in range(C):
                                t = r * C + c
                                a = _dot_u8s8_many(builder, builder.load(iacc[t]),
                                                   pieces[c], xs, path, _BIG_UMAX[fm])
                                builder.store(a, iacc[t])
                    svec = [splat_scale(c, f) for c in range(C)] if md == 6 else []
                    for r in range(R):
                        for c in range(C):
                            t = r * C + c
                            flush(t, builder.load(iacc[t]), md == 5,
                                  svec[c] if md == 6 else None)
                finish(md == 5)

            variants = []
            if act == "a8":
                variants.append((0, 3, lambda: emit_big4(0)))
                for fm in (2, 3, 4, 5):
                    for md in (4, 5, 6):
                        variants.append((fm, md, (lambda fm=fm: emit_big4(fm)) if md == 4
                                         else (lambda fm=fm, md=md: emit_big(fm, md))))
            for fm in _FMTS:
                modes = (0, 1, 2) if _FMTS[fm][0] == 64 else (0,)
                for md in modes:
                    variants.append((fm, md, lambda fm=fm, md=md: emit(fm, md)))
            for fm, md, body in variants:
                if lit is not None:
                    if (fm, md) == lit:
                        body()
                    continue
                if litf is not None:
                    # literal ``fmt``, run-time ``mode``: that format's modes only
                    if fm != litf:
                        continue
                    cond = builder.icmp_signed("==", mode_, K(md))
                else:
                    cond = builder.and_(builder.icmp_signed("==", fmt_, K(fm)),
                                        builder.icmp_signed("==", mode_, K(md)))
                with builder.if_then(cond):
                    body()
            vals = [builder.load(a) for a in res]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    tile.__doc__ = f"""Low-bit dot tile: {R} activation row(s) x {C} packed weight rows.

    Call from ``@njit`` code as ``t = tile(xp, xoff, xstride, corr, coff, cstride,
    w, woff, wstride, w2, w2off, w2stride, sc, soff, sstride, nunits, upf, fmt, mode)``.

    Parameters
    ----------
    xp : ndarray of int8 (``a8``) or int16 (``a16``), C-contiguous (addressed flat)
        Activations arranged per unit (module docstring); row ``r`` of the tile
        starts at ``xoff + r * xstride``.
    corr : ndarray of int32 (flat)
        Per activation row and flush, 8 int32 lanes subtracted before scaling
        (``off * sum(x)``; mode 1: first group in lane 0, second in lane 4).
        Row ``r`` at ``coff + r * cstride``, flush ``f`` at ``+ 8 f``.
    w : ndarray of uint8 (flat)
        Packed weights; weight row ``c`` of the tile starts at ``woff + c * wstride``;
        unit ``u`` is bytes ``[B u, B u + B)`` of the row (``B =
        LOWBIT_PLANE_BYTES[fmt, 0]``).
    w2 : ndarray of uint8 (flat)
        Second (``hi``) plane of the intN formats, addressed like ``w``
        (pass ``w`` again for formats with one plane).
    sc : ndarray of float32 (flat)
        Scales of weight row ``c`` at ``soff + c * sstride`` (unused in mode 0;
        mode 1: two per unit; mode 2: one per flush).
    nunits, upf : int
        Units to process and units per flush (``upf >= 1``).
    fmt, mode : int
        Packed format and flush mode (module docstring).
    pf, pf2 : int
        Software-prefetch distance in bytes for the ``w`` and ``w2`` rows: while
        reading unit ``u`` of a row the tile prefetches the same offset
        ``pf`` bytes further (the caller passes the next tile's rows, so a
        decode streams its weights ahead of use).  Prefetches never fault.

    Returns
    -------
    tuple of {R * C} float64
        ``t[r * {C} + c]`` = mode 0: exact ``sum(x * code)`` over the units;
        modes 1/2: ``sum_g s_g * sum_(p in g)(x * code)`` (float32 lanes).
    """
    return tile


def make_lowbit_tile(R: int, C: int, path: str):
    """A fresh ``R x C`` low-bit tile intrinsic compiled for ``path`` (one of
    :data:`LOWBIT_PATHS`; check :func:`lowbit_path_supported` before running
    it).  The package's kernels use the host path's tiles below."""
    if path not in LOWBIT_PATHS:
        raise ValueError(f"unknown low-bit path {path!r}; expected one of {LOWBIT_PATHS}")
    return _make_tile(R, C, path)


lowbit_tile_1x1 = _make_tile(1, 1)
lowbit_tile_1x4 = _make_tile(1, 4)
lowbit_tile_1x8 = _make_tile(1, 8)
lowbit_tile_4x2 = _make_tile(4, 2)
