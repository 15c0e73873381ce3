"""W4A8 prefill as an outer product: int4 weights broadcast x int8 activation panel.

``y[m, n] = x[m, k] @ What.T`` for the int4 pack layout (``codes`` uint8
``[n, ceil(k/2)]``, two's-complement nibbles, column ``2t`` in the low nibble of
byte ``t``; ``scales`` float32 ``[n]`` per channel or ``[n, ceil(k/g)]`` for
groups ``g`` that are a multiple of 32).  The int8-activation int4 entry points
use it for ``m >= W4_PANEL_MIN_M`` (9) on hosts with ``vpdpbusd`` or AVX2
(:data:`W4_PANEL`).  On AVX2 the tile multiplies with ``vpmaddubsw`` (the
unsigned codes ``u <= 15`` times the signed activations) and adds eight
steps' int16 pair sums (at most ``8 * 2 * 15 * 128 = 30720``) before one
``vpmaddwd`` by ones widens them into the int32 accumulators; its panel has
8 rows (16 vector registers: 6 int16 + 6 float32 accumulators).

Why it is built this way (the 4 rows x 2 outputs dot tiles it replaces
re-unpack every nibble for each block of four rows and reduce every sum
horizontally):

* the nibbles of 6 outputs are unpacked **once per tile** into unsigned offset
  codes ``u = code + 8`` (``nibble ^ 8``, in [0, 15]) in column order in a
  small buffer (:func:`unpack_w4_tile`: per 16 packed bytes one ``xor``,
  ``and``, shift and byte interleave);
* the activations of 16 (or 32) rows are laid out **once per call** as a panel
  of int32 words, word ``(kk, r)`` holding the four signed codes
  ``x[r, 4kk:4kk+4]`` (:func:`pack_w4_panel`);
* the tile (:func:`make_w4_panel_tile`) broadcasts four ``u`` bytes of each
  output (the *unsigned* operand of ``vpdpbusd``) against the panel vectors
  (the signed operand): every lane is an activation row, no horizontal sums;
* the offset is removed exactly per (row, group): each group's int32
  accumulators start at ``-8 * sum_(p in group) x[r, p]`` (a panel-side
  vector computed with the panel), so no weight sums are needed;
* after each group the exact int32 sums are converted and multiplied by the
  group scale into float32 accumulators (per channel: pseudo-groups of
  :data:`W4_PANEL_PCHUNKS` chunks sharing the row scale).

Products are exact for any int8 activation (``15 * 128 * 4`` per lane step
cannot overflow); the columns past the last whole 32-column chunk take a
scalar integer path.  Outputs ``n % 6`` are left to the caller.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from ._jit import intrinsic

from ._jit import njit, njit_parallel
from ._w8a8 import _pack_panel_words
from ._simd import (
    HOST_I8_PATH,
    I8_PATHS,
    _PANEL_LANES,
    _dpbusd,
    _maddubs,
    _madd16_ones,
    I8_PANEL,
    panel_pack8,
)

__all__ = [
    "W4_PANEL",
    "W4_PANEL_J",
    "W4_PANEL_ROWS",
    "W4_PANEL_PCHUNKS",
    "make_w4_panel_tile",
    "w4panel_tile",
    "pack_w4_panel",
    "unpack_w4_tile",
    "w4a8_panel_matmul",
]

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()

#: Outputs per W4A8 panel tile.
W4_PANEL_J = 6
#: Whether the host runs the W4A8 panel (``vpdpbusd`` or AVX2 hosts, as for W8A8).
W4_PANEL = I8_PANEL
#: 32-column chunks per scale pseudo-group of per-channel int4 (the exact
#: int32 group sum, at most 1024 * 8 * 128, stays exact in float32).
W4_PANEL_PCHUNKS = 32


#: Steps (four columns each) the AVX2 tile sums in int16 before widening:
#: ``vpmaddubsw`` pair sums of ``u <= 15`` by ``|x| <= 128`` are at most 3840,
#: eight of them 30720 < 2**15 -- exact for every int8 activation.
_AVX2_I16_STEPS = 8


def _panel_rows(path):
    # two panel vectors: 12 int32 + 12 float32 accumulators + 2 panel vectors
    # fit the 32 vector registers of AVX-512; AVX-VNNI and AVX2 (16 registers)
    # take one (AVX2: 6 int16 + 6 float32 accumulators, panel, broadcast)
    return _PANEL_LANES[path] * (1 if path in ("avxvnni", "avx2") else 2)


#: Activation rows per panel on the host path (16 with 8-lane vectors).
W4_PANEL_ROWS = _panel_rows(HOST_I8_PATH)
_LANES = _PANEL_LANES[HOST_I8_PATH]


def make_w4_panel_tile(path: str | None = None):
    """Build the W4A8 outer-product tile for an int8 ``path`` (default the
    host's): ``rows`` = ``W4_PANEL_ROWS`` of that path x :data:`W4_PANEL_J`
    outputs.

    Called from ``@njit`` code as ``tile(P, poff, C, coff, U, uoff, ustride,
    S, soff, sstride, sgstep, ng, gkk, out, ooff)``; returns 0.

    * ``P`` int32: activation panel (:func:`pack_w4_panel`), ``rows`` words
      per four-column step ``kk``, starting at ``poff``.
    * ``C`` int32: ``rows`` offset corrections per group, starting at ``coff``.
    * ``U`` uint8: unsigned weight codes of the 6 outputs
      (:func:`unpack_w4_tile`), output ``j``'s byte ``4kk`` at
      ``uoff + j * ustride + 4kk``.
    * ``S`` float32: scale of output ``j``, group ``g`` at
      ``soff + j * sstride + g * sgstep``.
    * ``ng`` groups of ``gkk`` steps each.
    * ``out`` float32: ``rows * 6`` results at ``ooff``; result
      ``(v * 6 + j) * L + l`` (``L`` lanes per vector) is
      ``sum_g scale[j, g] * (sum_(kk in g) sum_t u[j, 4kk+t] * x[v*L+l, 4kk+t] + C[g, v*L+l])``.

    No bounds or input validation.
    """
    path = path or HOST_I8_PATH
    if path not in I8_PATHS:
        raise ValueError(f"unknown int8 path {path!r}; expected one of {I8_PATHS}")
    lanes = _PANEL_LANES[path]
    rows = _panel_rows(path)
    RV, J = rows // lanes, W4_PANEL_J

    @intrinsic
    def tile(typingctx, P, poff, C, coff, U, uoff, ustride, S, soff, sstride, sgstep, ng,
             gkk, out, ooff):
        if not (isinstance(P, types.Array) and P.dtype == types.int32
                and isinstance(C, types.Array) and C.dtype == types.int32
                and isinstance(U, types.Array) and U.dtype == types.uint8
                and isinstance(S, types.Array) and S.dtype == types.float32
                and isinstance(out, types.Array) and out.dtype == types.float32):
            return None
        ip = types.intp
        sig = types.int32(P, ip, C, ip, U, ip, ip, S, ip, ip, ip, ip, ip, out, ip)

        def codegen(context, builder, sig, args):
            arr = [context.make_array(sig.args[i])(context, builder, args[i])
                   for i in (0, 2, 4, 7, 13)]
            pa, ca, ua, sa, oa = arr
            poff, coff, uoff, ust, soff, sst, sgs, ng, gkk, ooff = [
                context.cast(builder, args[i], sig.args[i], types.intp)
                for i in (1, 3, 5, 6, 8, 9, 10, 11, 12, 14)]
            intp = context.get_value_type(types.intp)
            vi = ir.VectorType(_I32, lanes)
            vf = ir.VectorType(_F32, lanes)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fmuladd.v{lanes}f32")
            iacc = [cgutils.alloca_once(builder, vi) for _ in range(RV * J)]
            facc = []
            for _ in range(RV * J):
                a = cgutils.alloca_once(builder, vf)
                builder.store(ir.Constant(vf, None), a)
                facc.append(a)

            def c(v):
                return ir.Constant(intp, v)

            splat = ir.Constant(ir.VectorType(_I32, lanes), [ir.Constant(_I32, 0)] * lanes)
            urow = [builder.gep(ua.data, [builder.add(uoff, builder.mul(ust, c(j)))],
                                inbounds=True) for j in range(J)]
            srow = [builder.gep(sa.data, [builder.add(soff, builder.mul(sst, c(j)))],
                                inbounds=True) for j in range(J)]
            pbase = builder.gep(pa.data, [poff], inbounds=True)
            cbase = builder.gep(ca.data, [coff], inbounds=True)
            def avx2_group(kk0):
                """The group's ``gkk`` steps (a multiple of 8) on AVX2: blocks
                of :data:`_AVX2_I16_STEPS` steps summed in int16 registers
                (``vpmaddubsw`` of the broadcast unsigned codes by the signed
                panel, ``vpaddw``), widened by ``vpmaddwd`` by ones into the
                int32 accumulators."""
                v32 = ir.VectorType(_I8, 32)
                nblk = builder.udiv(gkk, c(_AVX2_I16_STEPS))
                with cgutils.for_range(builder, nblk) as bl:
                    kb = builder.add(kk0, builder.mul(bl.index, c(_AVX2_I16_STEPS)))
                    a16 = [None] * (RV * J)
                    for st in range(_AVX2_I16_STEPS):
                        kk = builder.add(kb, c(st))
                        po = builder.mul(kk, c(rows))
                        xv = []
                        for v in range(RV):
                            p = builder.gep(pbase, [builder.add(po, c(v * lanes))],
                                            inbounds=True)
                            xv.append(builder.load(builder.bitcast(p, v32.as_pointer()),
                                                   align=4))
                        uo = builder.mul(kk, c(4))
                        for j in range(J):
                            p = builder.gep(urow[j], [uo], inbounds=True)
                            u32 = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1)
                            b = builder.insert_element(ir.Constant(vi, None), u32,
                                                       ir.Constant(_I32, 0))
                            b = builder.bitcast(builder.shuffle_vector(b, b, splat), v32)
                            for v in range(RV):
                                t = v * J + j
                                p16 = _maddubs(builder, b, xv[v])
                                a16[t] = p16 if a16[t] is None else builder.add(a16[t], p16)
                    for t in range(RV * J):
                        builder.store(builder.add(builder.load(iacc[t]),
                                                  _madd16_ones(builder, a16[t])), iacc[t])

            with cgutils.for_range(builder, ng) as gl:
                g = gl.index
                # int32 accumulators start at the group's offset correction
                for v in range(RV):
                    p = builder.gep(cbase, [builder.add(builder.mul(g, c(rows)), c(v * lanes))],
                                    inbounds=True)
                    cv = builder.load(builder.bitcast(p, vi.as_pointer()), align=4)
                    for j in range(J):
                        builder.store(cv, iacc[v * J + j])
                kk0 = builder.mul(g, gkk)
                if path == "avx2":
                    avx2_group(kk0)
                else:
                    with cgutils.for_range(builder, gkk) as sl:
                        kk = builder.add(kk0, sl.index)
                        po = builder.mul(kk, c(rows))
                        xv = []
                        for v in range(RV):
                            p = builder.gep(pbase, [builder.add(po, c(v * lanes))], inbounds=True)
                            xv.append(builder.load(builder.bitcast(p, vi.as_pointer()), align=4))
                        uo = builder.mul(kk, c(4))
                        for j in range(J):
                            p = builder.gep(urow[j], [uo], inbounds=True)
                            u32 = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1)
                            b = builder.insert_element(ir.Constant(vi, None), u32,
                                                       ir.Constant(_I32, 0))
                            b = builder.shuffle_vector(b, b, splat)
                            for v in range(RV):
                                a = iacc[v * J + j]
                                builder.store(_dpbusd(builder, builder.load(a), b, xv[v], path), a)
                so = builder.mul(g, sgs)
                for j in range(J):
                    s = builder.load(builder.gep(srow[j], [so], inbounds=True))
                    sv = builder.insert_element(ir.Constant(vf, None), s, ir.Constant(_I32, 0))
                    sv = builder.shuffle_vector(sv, sv, splat)
                    for v in range(RV):
                        t = v * J + j
                        fv = builder.sitofp(builder.load(iacc[t]), vf)
                        builder.store(builder.call(fma, [fv, sv, builder.load(facc[t])]),
                                      facc[t])
            ob = builder.gep(oa.data, [ooff], inbounds=True)
            for t in range(RV * J):
                p = builder.gep(ob, [c(t * lanes)], inbounds=True)
                builder.store(builder.load(facc[t]), builder.bitcast(p, vf.as_pointer()),
                              align=4)
            return ir.Constant(_I32, 0)

        return sig, codegen

    return tile


#: The host's W4A8 panel tile (``W4_PANEL_ROWS`` rows x 6 outputs).
w4panel_tile = make_w4_panel_tile()


@intrinsic
def _nib_unpack(typingctx, src, soff, n16, dst, doff):
    """``dst[doff + 2t] = (src[soff + t] & 15) ^ 8``, ``dst[doff + 2t + 1] =
    (src[soff + t] >> 4) ^ 8`` for ``t < 16 * n16`` (uint8 arrays), 16 source
    bytes per step: one ``xor``, ``and``, shift and two byte interleaves."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8
            and isinstance(dst, types.Array) and dst.dtype == types.uint8):
        return None
    ip = types.intp
    sig = types.int32(src, ip, ip, dst, ip)

    def codegen(context, builder, sig, args):
        sa = context.make_array(sig.args[0])(context, builder, args[0])
        da = context.make_array(sig.args[3])(context, builder, args[3])
        soff, n16, doff = [context.cast(builder, args[i], sig.args[i], types.intp)
                           for i in (1, 2, 4)]
        intp = context.get_value_type(types.intp)
        v16 = ir.VectorType(_I8, 16)
        v32 = ir.VectorType(_I8, 32)
        k88 = ir.Constant(v16, [ir.Constant(_I8, 0x88)] * 16)
        k0f = ir.Constant(v16, [ir.Constant(_I8, 15)] * 16)
        k4 = ir.Constant(v16, [ir.Constant(_I8, 4)] * 16)
        mix = ir.Constant(ir.VectorType(_I32, 32),
                          [ir.Constant(_I32, (t // 2) + 16 * (t % 2)) for t in range(32)])
        sb = builder.gep(sa.data, [soff], inbounds=True)
        db = builder.gep(da.data, [doff], inbounds=True)
        with cgutils.for_range(builder, n16) as loop:
            o = builder.mul(loop.index, ir.Constant(intp, 16))
            v = builder.load(builder.bitcast(builder.gep(sb, [o], inbounds=True),
                                             v16.as_pointer()), align=1)
            v = builder.xor(v, k88)
            lo = builder.and_(v, k0f)
            hi = builder.lshr(v, k4)
            u = builder.shuffle_vector(lo, hi, mix)
            p = builder.gep(db, [builder.mul(o, ir.Constant(intp, 2))], inbounds=True)
            builder.store(u, builder.bitcast(p, v32.as_pointer()), align=1)
        return ir.Constant(_I32, 0)

    return sig, codegen


@njit
def pack_w4_panel(xq, i0, rows, nch, cpg, P, poff, C, coff):
    """Lay out rows ``i0 .. i0+rows-1`` of ``xq[m, k]`` (int8, C-contiguous)
    for :func:`w4panel_tile`.

    ``P[poff + kk * rows + r]`` (int32, ``kk < 8 * nch``) holds the four codes
    ``xq[i0 + r, 4kk:4kk+4]``, first byte lowest.  ``C[coff + g * rows + r]``
    (int32) is ``-8 * sum`` of the row's codes over the 32-column chunks of
    group ``g`` (chunks ``g * cpg .. g * cpg + cpg - 1``, clipped at ``nch``).
    ``rows`` is a multiple of 8; rows at or past ``m`` are zero.  No validation.
    """
    m, k = xq.shape
    ngt = (nch + cpg - 1) // cpg
    xf = xq.ravel()
    S = np.empty(8 * max(nch, 1), dtype=np.int32)
    for r0 in range(0, rows, 8):
        live = min(8, m - (i0 + r0))
        if live == 8:
            panel_pack8(xf, (i0 + r0) * k, k, nch, P, poff + r0, rows, S, 0, 0)
        else:
            # last rows of x: fill the block in scalar code, zeros past m
            for r in range(8):
                i = i0 + r0 + r
                _pack_panel_words(xq, i, r0 + r, rows, np.int64(0), 8 * nch, P, poff, False)
                for ch in range(nch):
                    sg = np.int32(0)
                    if r < live:
                        for p in range(32 * ch, 32 * ch + 32):
                            sg += np.int32(xq[i, p])
                    S[8 * ch + r] = sg
        for g in range(ngt):
            for r in range(8):
                sg = np.int32(0)
                for ch in range(g * cpg, min(nch, (g + 1) * cpg)):
                    sg += S[8 * ch + r]
                C[coff + g * rows + r0 + r] = np.int32(-8) * sg


@njit
def unpack_w4_tile(codes, j0, nch, U):
    """Unsigned offset codes ``u = code + 8`` (in [0, 15]) of outputs
    ``j0 .. j0+5`` for :func:`w4panel_tile`, in column order:
    ``U[q * 32 * nch + p] = u[j0 + q, p]`` for ``p < 32 * nch``.

    ``codes`` uint8 ``[n, ceil(k/2)]`` (int4 nibbles), C-contiguous.  No
    validation.
    """
    cf = codes.ravel()
    nb = codes.shape[1]
    for q in range(W4_PANEL_J):
        _nib_unpack(cf, (j0 + q) * nb, nch, U, q * 32 * nch)


@njit
def _code4(codes, j, p):
    """Signed int4 code of output ``j``, column ``p``."""
    v = (np.int64(codes[j, p >> 1]) >> (4 * (p & 1))) & 15
    return v - 16 if v >= 8 else v


@njit
def _tail4(xq, i, codes, j, p0, cols, sflat, soff, group, grouped):
    """Columns ``p0 .. cols-1``: grouped -> ``sum_g scale * int sum``;
    per channel -> the plain integer sum."""
    tot = np.float64(0.0)
    p = p0
    while p < cols:
        e = min((p // group + 1) * group, cols) if grouped else cols
        a = np.int64(0)
        for q in range(p, e):
            a += np.int64(xq[i, q]) * _code4(codes, j, q)
        tot += np.float64(np.float32(a) * sflat[soff + p // group]) if grouped else np.float64(a)
        p = e
    return tot


# -O3 as the panel: a late callee keeps its own level (it is not optimised
# again inside its caller)
@njit
def _tiles(xq, sx, codes, sflat, sstride, cols, group, grouped, P, C, npan, nch, cpg,
           ngf, rem, y, t0, t1):
    """6-output tiles ``t0 .. t1-1`` against every panel.  Tile ``t`` writes
    outputs ``6 t ..``; the last one, past ``n // 6``, is computed on the
    last 6 outputs ``n - 6 .. n - 1`` and writes only those from ``6 t`` on,
    so the panel fills every output of ``n >= 6`` (no dot-tile tail)."""
    m = xq.shape[0]
    n = codes.shape[0]
    R = W4_PANEL_ROWS
    J = W4_PANEL_J
    kk = 8 * nch
    ngt = ngf + (1 if rem > 0 else 0)
    sgs = 1 if grouped else 0
    U = np.empty(J * 32 * nch, dtype=np.uint8)
    out = np.empty(2 * R * J, dtype=np.float32)
    region = 32 * nch
    for t in range(t0, t1):
        jw = t * J
        j0 = min(jw, n - J)
        unpack_w4_tile(codes, j0, nch, U)
        so = j0 * sstride
        for pn in range(npan):
            poff = pn * R * kk
            coff = pn * R * ngt
            if ngf > 0:
                w4panel_tile(P, poff, C, coff, U, 0, 32 * nch, sflat, so, sstride, sgs, ngf,
                             8 * cpg, out, 0)
            if rem > 0:
                k0 = 8 * cpg * ngf
                w4panel_tile(P, poff + k0 * R, C, coff + ngf * R, U, 4 * k0, 32 * nch,
                             sflat, so + ngf * sgs, sstride, sgs, 1, 8 * rem, out, R * J)
            for r in range(R):
                i = pn * R + r
                if i >= m:
                    break
                base = (r // _LANES) * J * _LANES + r % _LANES
                for q in range(jw - j0, J):
                    j = j0 + q
                    v = np.float64(0.0)
                    if ngf > 0:
                        v += np.float64(out[base + q * _LANES])
                    if rem > 0:
                        v += np.float64(out[R * J + base + q * _LANES])
                    if region < cols:
                        tl = _tail4(xq, i, codes, j, region, cols, sflat, j * sstride, group,
                                    grouped)
                        v += tl if grouped else tl * np.float64(sflat[j * sstride])
                    y[i, j] = np.float32(v * np.float64(sx[i]))



@njit_parallel
def w4a8_panel_matmul(xq, sx, codes, sflat, sstride, cols, group, min_parallel, y):
    """W4A8 through the panel tiles: fills ``y`` (every output when ``n >= 6``;
    nothing below).

    Parameters
    ----------
    xq : ndarray of int8, shape (m, cols), C-contiguous
    sx : ndarray of float32, shape (m,)
    codes : ndarray of uint8, shape (n, ceil(cols/2)), C-contiguous
        int4 nibbles (module docstring).
    sflat : ndarray of float32, 1-D
        Scales, output ``j``'s first at ``j * sstride``.
    sstride : int
    cols : int
    group : int
        Group length, a multiple of 32; ``<= 0`` or ``>= cols``: per channel.
    min_parallel : int
        Below ``m * cols * n`` of this size the call stays on one thread.
    y : ndarray of float32, shape (m, n)
        Output.  The ``n % 6`` last outputs come from one more tile on the
        last 6 outputs (its first ones were computed already; not written
        again), so every output takes the same arithmetic.

    Every output is computed by one thread in a fixed order (reproducible).
    No validation: callers check the layout and that ``group % 32 == 0``.
    """
    m = xq.shape[0]
    n = codes.shape[0]
    R = W4_PANEL_ROWS
    grouped = 0 < group < cols
    nch = cols // 32
    if grouped:
        cpg = group // 32
        g = group
    else:
        cpg = W4_PANEL_PCHUNKS
        g = max(cols, 1)
    ngf = nch // cpg
    rem = nch - ngf * cpg
    ngt = ngf + (1 if rem > 0 else 0)
    npan = (m + R - 1) // R
    P = np.empty(npan * R * 8 * nch, dtype=np.int32)
    C = np.empty(npan * R * max(ngt, 1), dtype=np.int32)
    # tiles of 6 outputs; the last covers n - 6 .. n - 1 (see _tiles)
    nt = (n + W4_PANEL_J - 1) // W4_PANEL_J if n >= W4_PANEL_J else 0
    nc = min(nt, 16)
    if m * cols * n < min_parallel:
        # below min_parallel: the same block functions on this thread, in order
        for pn in range(npan):
            pack_w4_panel(xq, pn * R, R, nch, cpg, P, pn * R * 8 * nch, C, pn * R * ngt)
        _tiles(xq, sx, codes, sflat, sstride, cols, g, grouped, P, C, npan, nch, cpg,
               ngf, rem, y, 0, nt)
        return
    for pn in prange(npan):
        pack_w4_panel(xq, pn * R, R, nch, cpg, P, pn * R * 8 * nch, C, pn * R * ngt)
    for c in prange(nc):
        _tiles(xq, sx, codes, sflat, sstride, cols, g, grouped, P, C, npan, nch, cpg,
               ngf, rem, y, c * nt // nc, (c + 1) * nt // nc)
