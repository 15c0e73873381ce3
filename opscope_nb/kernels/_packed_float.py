"""``@njit`` layer kernels for the float-weight packed formats of
:func:`opscope_nb.profile.mining.pack`: dense, 2:4 sparse, low-rank, Monarch, Tucker
and Tensor-Train.

Every kernel computes ``y[m, rows] = x[m, cols] @ W_hat.T`` where ``W_hat`` is
the ``[rows, cols]`` (``[out, in]``, PyTorch Linear layout) weight that
``formats.unpack`` would rebuild from the same arrays -- but **from the packed
arrays themselves**: the dense ``W_hat`` is never materialised.  Inputs are
float32, C-contiguous, finite, and shaped as the docstrings say (the
validating public entry point is :class:`opscope_nb.runtime.PackedLinear`);
outputs are new float32 C-contiguous ``[m, rows]`` arrays.

Work per input row (multiply-adds), i.e. the order each kernel uses:

=============  =====================================================  ==================
kernel         order                                                  MACs per row
=============  =====================================================  ==================
dense          ``matmul_f32(x, w)`` (``w`` is output-major already)   ``rows * cols``
sparse 2:4     kept values only; slots decoded from the 2-bit crumbs  ``rows * nv``
low-rank       ``(x @ b.T) @ a.T`` through the rank                   ``(rows + cols) r``
Monarch        block-diagonal ``w2`` then block-diagonal ``w1``       ``2 m**3``
Tucker         ``u2`` then ``u1`` (or ``u1`` then ``u2`` when that    see ``tucker_linear``
               is cheaper), then the core, then ``u0``
TT             input cores right to left, then output cores right     see ``tt_linear``
               to left
=============  =====================================================  ==================

Parallelism: a call whose work is below ``min_parallel`` multiply-adds runs
on the calling thread; above it, independent outputs (row blocks, Monarch
blocks, samples) run in ``prange``.  The split never depends on the thread
count and each output is summed by one thread in a fixed order, so results
are reproducible.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from ._jit import intrinsic

from ._jit import njit, njit_parallel
from ._w8a8 import matmul_f32
from ._simd import USE_AVX2_PMADDWD as _HAS_AVX2
from ._simd import _FEATS, _X86
from ._simd import prefetch as _prefetch

#: AVX-512F host: the 2:4 pick uses vpermi2ps over 32 inputs (16 values/step).
_HAS_AVX512 = _X86 and "avx512f" in _FEATS

__all__ = [
    "dense_linear",
    "sparse24_linear",
    "lowrank_linear",
    "monarch_linear",
    "tucker_linear",
    "tucker_order",
    "tt_linear",
    "tt_split",
    "sparse24_dot_1x1",
    "sparse24_dot_1x4",
    "sparse24_dot_4x1",
]

#: Default work (multiply-adds per call) below which a kernel stays serial.
PAR_MIN = 1 << 17
#: Fixed number of row chunks a parallel kernel splits its outputs into.
_NCHUNK = 16
#: Samples per parallel chunk of the TT kernel.
_TT_BATCH = 8


# --------------------------------------------------------------------------
# dense
# --------------------------------------------------------------------------
# dense_linear / lowrank_linear call matmul_f32, which lives in another file.
# (numba keys a caller's cache on the caller's file only; _config drops the
# package's cache whenever any of its sources changes.)
@njit
def dense_linear(x, w, min_parallel=PAR_MIN):
    """``y[m, rows] = x[m, cols] @ w.T`` for the ``dense`` pack (``w`` f32
    ``[rows, cols]`` is already the output-major ``wt[n, k]`` that
    :func:`matmul_f32` takes).

    Parameters
    ----------
    x : ndarray of float32, shape (m, cols), C-contiguous
    w : ndarray of float32, shape (rows, cols), C-contiguous
    min_parallel : int
        Serial below ``m * rows * cols`` multiply-adds.

    Returns
    -------
    ndarray of float32, shape (m, rows)
    """
    return matmul_f32(x, w, min_parallel)


# --------------------------------------------------------------------------
# sparse 2:4
# --------------------------------------------------------------------------
@njit
def _sparse_planes(x, nb8):
    """``xp[i, 4 h + q, b] = x[i, 8 b + 4 h + q]``: each sample's first
    ``8 nb8`` inputs as eight contiguous planes (input ``q`` of the first
    (``h = 0``) or second (``h = 1``) group covered by index byte ``b``)."""
    m = x.shape[0]
    xp = np.empty((m, 8, nb8), dtype=np.float32)
    for i in range(m):
        for b in range(nb8):
            for e in range(8):
                xp[i, e, b] = x[i, 8 * b + e]
    return xp


@njit
def _sparse_dot(v, ind, xpi, b0, nb8):
    """Sum over the ``4 nb8`` values of full index bytes: value ``4 b + j``
    multiplies input ``8 b + 4 (j // 2) + slot_j``.

    Branch-free and gather-free so LLVM vectorises the loop along ``b``: the
    index byte is converted to float32 once and split into its eight bits
    with exact ``floor`` halvings (numba would widen integer shifts to
    int64 lanes); each value's input is then picked from the four candidates
    of its group by two bit-weighted interpolations ``lo = a0 + f (a1 - a0)``,
    ``hi = a2 + f (a3 - a2)``, ``x = lo + g (hi - lo)`` with ``f, g`` in
    ``{0, 1}`` (the slot's low and high bit).  The pick is exact up to one
    rounding of ``a1 - a0`` (``<= 2 eps max|x|``).
    """
    acc = np.float32(0.0)
    p0 = xpi[0]
    p1 = xpi[1]
    p2 = xpi[2]
    p3 = xpi[3]
    p4 = xpi[4]
    p5 = xpi[5]
    p6 = xpi[6]
    p7 = xpi[7]
    half = np.float32(0.5)
    two = np.float32(2.0)
    for b in range(b0, nb8):
        c = np.float32(ind[b])
        h = np.floor(c * half)
        f0 = c - two * h
        c = np.floor(h * half)
        g0 = h - two * c
        h = np.floor(c * half)
        f1 = c - two * h
        c = np.floor(h * half)
        g1 = h - two * c
        h = np.floor(c * half)
        f2 = c - two * h
        c = np.floor(h * half)
        g2 = h - two * c
        h = np.floor(c * half)
        f3 = c - two * h
        g3 = h
        a0 = p0[b]
        d01 = p1[b] - a0
        a2 = p2[b]
        d23 = p3[b] - a2
        e0 = p4[b]
        e01 = p5[b] - e0
        e2 = p6[b]
        e23 = p7[b] - e2
        lo = a0 + f0 * d01
        hi = a2 + f0 * d23
        x0 = lo + g0 * (hi - lo)
        lo = a0 + f1 * d01
        hi = a2 + f1 * d23
        x1 = lo + g1 * (hi - lo)
        lo = e0 + f2 * e01
        hi = e2 + f2 * e23
        x2 = lo + g2 * (hi - lo)
        lo = e0 + f3 * e01
        hi = e2 + f3 * e23
        x3 = lo + g3 * (hi - lo)
        acc += (v[4 * b] * x0 + v[4 * b + 1] * x1 + v[4 * b + 2] * x2
                + v[4 * b + 3] * x3)
    return acc


_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
#: Software-prefetch distance (bytes) of the 2:4 value stream.
_PF_BYTES = 2048


def _cvec(vals):
    return ir.Constant(ir.VectorType(_I32, len(vals)), [ir.Constant(_I32, v) for v in vals])


def _permps(builder, src, idx):
    """``src[idx[i]]`` for ``<8 x float>`` ``src`` and ``<8 x i32>`` ``idx``
    (0..7): ``vpermps`` on AVX2 hosts; elsewhere per-lane extract/insert,
    which any LLVM target lowers."""
    f32 = ir.FloatType()
    v8f = ir.VectorType(f32, 8)
    if _HAS_AVX2:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8f, [v8f, ir.VectorType(_I32, 8)]),
            "llvm.x86.avx2.permps")
        return builder.call(fn, [src, idx])
    out = ir.Constant(v8f, None)
    for i in range(8):
        li = builder.extract_element(idx, ir.Constant(_I32, i))
        out = builder.insert_element(out, builder.extract_element(src, li),
                                     ir.Constant(_I32, i))
    return out


def _make_s24(R, C=1):
    """Build the 2:4 row-dot intrinsic for ``R`` samples x ``C`` weight rows
    at once (a row's slot decode and value loads are shared by the ``R``
    samples; ``C`` rows keep ``2 C`` memory streams in flight)."""

    def typer(typingctx, v, voff, vstride, ind, ioff, istride, x, xoff, xstride, nquad):
        if not (isinstance(v, types.Array) and v.dtype == types.float32
                and isinstance(ind, types.Array) and ind.dtype == types.uint8
                and isinstance(x, types.Array) and x.dtype == types.float32):
            return None
        ip = types.intp
        sig = types.UniTuple(types.float32, R * C)(v, ip, ip, ind, ip, ip, x, ip, ip, ip)

        def codegen(context, builder, sig, args):
            va = context.make_array(sig.args[0])(context, builder, args[0])
            ia = context.make_array(sig.args[3])(context, builder, args[3])
            xa = context.make_array(sig.args[6])(context, builder, args[6])
            voff, vstride, ioff, istride, xoff, xstride, n = [
                context.cast(builder, args[i], sig.args[i], types.intp)
                for i in (1, 2, 4, 5, 7, 8, 9)]
            intp = context.get_value_type(types.intp)

            def c_(v):
                return ir.Constant(intp, v)

            f32 = ir.FloatType()
            wide = _HAS_AVX512
            L = 16 if wide else 8           # lanes per step (values)
            vf = ir.VectorType(f32, L)
            vi = ir.VectorType(_I32, L)
            nb = L // 4                      # index bytes per step
            vbi8 = ir.VectorType(_I8, nb)
            vbi32 = ir.VectorType(_I32, nb)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fmuladd.v{L}f32")
            # two accumulator sets when there are few independent chains
            U = 2 if R * C < 4 else 1
            accs = {}
            for u in range(U):
                for c in range(C):
                    for r in range(R):
                        a = cgutils.alloca_once(builder, vf)
                        builder.store(ir.Constant(vf, None), a)
                        accs[u, c, r] = a
            rep = _cvec([t >> 2 for t in range(L)])
            shifts = _cvec([2 * (t & 3) for t in range(L)])
            three = _cvec([3] * L)
            # input column of value t inside the step: 8 (t // 4) + 4 ((t % 4) // 2)
            offs = _cvec([8 * (t >> 2) + 4 * ((t >> 1) & 1) for t in range(L)])
            if wide:
                perm = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(vf, [vf, vi, vf]),
                    "llvm.x86.avx512.vpermi2var.ps.512")
            blend = _cvec([0, 1, 2, 3, 12, 13, 14, 15])
            vrow = [builder.gep(va.data, [builder.add(voff, builder.mul(vstride, c_(c)))],
                                inbounds=True) for c in range(C)]
            irow = [builder.gep(ia.data, [builder.add(ioff, builder.mul(istride, c_(c)))],
                                inbounds=True) for c in range(C)]
            xrow = [builder.gep(xa.data, [builder.add(xoff, builder.mul(xstride, c_(r)))],
                                inbounds=True) for r in range(R)]

            def load(ptr, off, ty, align):
                p = builder.gep(ptr, [off], inbounds=True)
                return builder.load(builder.bitcast(p, ty.as_pointer()), align=align)

            def step(k, u):
                """Step k: index bytes nb k.., values L k.., inputs 2 L k.."""
                picks = []
                xs = []
                for r in range(R):
                    xo = builder.mul(k, c_(2 * L))
                    lo = load(xrow[r], xo, vf, 4)
                    hi = load(xrow[r], builder.add(xo, c_(L)), vf, 4)
                    xs.append((lo, hi))
                for c in range(C):
                    b = load(irow[c], builder.mul(k, c_(nb)), vbi8, 1)
                    bw = builder.shuffle_vector(builder.zext(b, vbi32),
                                                ir.Constant(vbi32, None), rep)
                    idx = builder.add(builder.and_(builder.lshr(bw, shifts), three), offs)
                    vals = load(vrow[c], builder.mul(k, c_(L)), vf, 4)
                    for r in range(R):
                        lo, hi = xs[r]
                        if wide:
                            pick = builder.call(perm, [lo, idx, hi])
                        else:
                            pick = builder.shuffle_vector(_permps(builder, lo, idx),
                                                          _permps(builder, hi, idx), blend)
                        a = accs[u, c, r]
                        builder.store(builder.call(fma, [vals, pick, builder.load(a)]), a)
                    picks.append(None)

            def prefetch(k):
                # the value streams _PF_BYTES ahead (past a row: the next rows)
                for c in range(C):
                    p = builder.gep(vrow[c], [builder.add(builder.mul(k, c_(L)),
                                                          c_(_PF_BYTES // 4))])
                    _prefetch(builder, p, 3)

            # a "quad" is 4 index bytes = 16 values: 1 wide step or 2 narrow ones
            if wide:
                nsteps = n
            else:
                nsteps = builder.mul(n, c_(2))
            nmain = builder.udiv(nsteps, c_(U)) if U > 1 else nsteps
            with cgutils.for_range(builder, nmain) as loop:
                base = builder.mul(loop.index, c_(U)) if U > 1 else loop.index
                for u in range(U):
                    if wide or u == 0:      # one cache line of values per 16
                        prefetch(builder.add(base, c_(u)))
                    step(builder.add(base, c_(u)), u)
            if U > 1:
                done = builder.mul(nmain, c_(U))
                with cgutils.for_range(builder, builder.sub(nsteps, done)) as loop:
                    step(builder.add(done, loop.index), 0)
            outs = []
            for c in range(C):
                for r in range(R):
                    tot = builder.load(accs[0, c, r])
                    for u in range(1, U):
                        tot = builder.fadd(tot, builder.load(accs[u, c, r]))
                    w = L
                    while w > 1:
                        w //= 2
                        tot = builder.fadd(
                            builder.shuffle_vector(tot, tot, _cvec(list(range(w)))),
                            builder.shuffle_vector(tot, tot, _cvec(list(range(w, 2 * w)))))
                    outs.append(builder.extract_element(tot, ir.Constant(_I32, 0)))
            return context.make_tuple(builder, sig.return_type, outs)

        return sig, codegen

    typer.__name__ = f"sparse24_dot_{R}x{C}"
    fn = intrinsic(typer)
    fn.__doc__ = f"""2:4 row dots, {R} sample(s) x {C} weight row(s), over each row's
    first ``16 nquad`` kept values: result ``c * {R} + r`` is ``sum_t v[voff + c
    vstride + t] * x[xoff + r xstride + 8 (t // 4) + 4 ((t % 4) // 2) + slot_t]``
    with ``slot_t`` the 2-bit field ``t % 4`` of byte ``ind[ioff + c istride + t
    // 4]``; float32, a ``{R * C}``-tuple.

    Register-level decode (no gather, no dense row): the index bytes of a step
    are widened, broadcast four lanes each, shifted by ``0, 2, 4, 6``, masked to
    the slots and offset to the input column inside the step; one permute per
    sample picks the inputs (AVX-512: ``vpermi2ps`` over 32 inputs, 16 values
    per step; AVX2: two ``vpermps`` + a blend, 8 values per step; elsewhere
    portable lane extracts), one fused multiply-add accumulates.  A row's
    decode and value load serve all {R} sample(s); a software prefetch runs
    ahead on each value stream.

    Call from ``@njit`` code as ``f(v, voff, vstride, ind, ioff, istride, x,
    xoff, xstride, nquad)`` with flat C-contiguous ``v`` float32, ``ind`` uint8
    and ``x`` float32 1-D arrays (each row / sample must hold ``16 nquad``
    values, ``4 nquad`` index bytes, ``32 nquad`` inputs from its offset).
    """
    return fn


sparse24_dot_1x1 = _make_s24(1, 1)
sparse24_dot_1x4 = _make_s24(1, 4)
sparse24_dot_4x1 = _make_s24(4, 1)


@njit
def _sparse_rows(x, xp, values, indices, y, r0, r1, rows4):
    """Rows ``r0..r1-1`` of ``y``: register-decoded dots for the first
    ``32 (cols // 32)`` inputs (4 samples x 1 row; with ``rows4`` and fewer
    than 4 samples, 1 sample x 4 rows), then the
    vectorised float pick for the remaining full index bytes and a scalar
    short last group."""
    m = x.shape[0]
    nv = values.shape[1]
    nb8 = xp.shape[2]
    nq = nb8 // 4
    k = x.shape[1]
    xf = x.ravel()
    vf = values.ravel()
    fi = indices.ravel()
    sv = values.shape[1]
    si = indices.shape[1]
    r = r0
    if m < 4 and rows4:
        while r + 4 <= r1:
            for i in range(m):
                a0, a1, a2, a3 = sparse24_dot_1x4(vf, r * sv, sv, fi, r * si, si,
                                                  xf, i * k, k, nq)
                y[i, r] = a0
                y[i, r + 1] = a1
                y[i, r + 2] = a2
                y[i, r + 3] = a3
            r += 4
    for rr in range(r, r1):
        i = 0
        while i + 4 <= m:
            a0, a1, a2, a3 = sparse24_dot_4x1(vf, rr * sv, sv, fi, rr * si, si,
                                              xf, i * k, k, nq)
            y[i, rr] = a0
            y[i + 1, rr] = a1
            y[i + 2, rr] = a2
            y[i + 3, rr] = a3
            i += 4
        while i < m:
            y[i, rr] = sparse24_dot_1x1(vf, rr * sv, sv, fi, rr * si, si, xf, i * k, k, nq)[0]
            i += 1
    for rr in range(r0, r1):
        v = values[rr]
        ind = indices[rr]
        for i in range(m):
            acc = _sparse_dot(v, ind, xp[i], 4 * nq, nb8)
            for t in range(4 * nb8, nv):          # values of a short tail
                sl = (np.int32(ind[t >> 2]) >> np.int32(2 * (t & 3))) & 3
                acc += v[t] * x[i, 4 * (t >> 1) + sl]
            y[i, rr] += acc


@njit_parallel
def sparse24_linear(x, values, indices, min_parallel=PAR_MIN, rows4=False):
    """``y = x @ W_hat.T`` for the ``sparse2:4`` pack, using only the kept
    values.

    Layout (``mining``): ``values`` f32 ``[rows, nv]`` (the two kept values of
    each group of four consecutive columns, in column order; a short last group
    keeps ``min(2, cols % 4)``), ``indices`` u8 ``[rows, ceil(nv / 4)]`` (value
    ``t``'s 2-bit slot inside its group in bits ``2 (t % 4)`` of byte
    ``t // 4``), ``nv = 2 (cols // 4) + min(2, cols % 4)``.

    Samples four at a time per weight row (``sparse24_dot_4x1``), then
    single samples (``sparse24_dot_1x1``; ``rows4``: four weight rows per
    sample): the 2-bit slots are decoded in
    registers and each value's input picked with ``vpermi2ps`` / ``vpermps``
    (no gather, no dense row), for the first ``32 (cols // 32)`` inputs; the
    remaining full index bytes use a branch-free float pick that LLVM
    vectorises (``_sparse_dot`` over eight input planes) and a short last
    group is summed scalar.  ``rows * nv`` multiply-adds per sample, half of
    dense, reading ``4 nv + nv / 4`` weight bytes per row instead of
    ``4 cols``.

    Parameters
    ----------
    x : ndarray of float32, shape (m, cols), C-contiguous (``cols >= nv``)
    values : ndarray of float32, shape (rows, nv), C-contiguous
    indices : ndarray of uint8, shape (rows, ceil(nv / 4)), C-contiguous
    min_parallel : int
        Serial below ``m * rows * nv`` multiply-adds; above, 16 fixed row
        chunks run in ``prange``.
    rows4 : bool
        For fewer than 4 samples, decode 4 weight rows per step
        (``sparse24_dot_1x4``).  Faster from cache, slower when the weights
        stream from DRAM (measured here: 4096 x 4096, 1 thread, 2.7 vs 2.0 ms),
        hence off by default.

    Returns
    -------
    ndarray of float32, shape (m, rows)
    """
    m = x.shape[0]
    rows, nv = values.shape
    y = np.empty((m, rows), dtype=np.float32)
    xp = _sparse_planes(x, x.shape[1] // 8)
    if m * rows * nv < min_parallel or rows < 2:
        _sparse_rows(x, xp, values, indices, y, np.int64(0), rows, rows4)
    else:
        nc = min(rows, _NCHUNK)
        for c in prange(nc):
            _sparse_rows(x, xp, values, indices, y, c * rows // nc, (c + 1) * rows // nc,
                         rows4)
    return y


# --------------------------------------------------------------------------
# low-rank
# --------------------------------------------------------------------------
@njit
def lowrank_linear(x, a, b, min_parallel=PAR_MIN):
    """``y = (x @ b.T) @ a.T`` for the ``lowrank`` pack ``W_hat = a @ b``.

    Two weight-stationary products through the rank (``b`` f32 ``[r, cols]``
    and ``a`` f32 ``[rows, r]`` are both output-major already):
    ``(rows + cols) r`` multiply-adds per sample instead of ``rows * cols``.

    Parameters
    ----------
    x : ndarray of float32, shape (m, cols), C-contiguous
    a : ndarray of float32, shape (rows, r), C-contiguous
    b : ndarray of float32, shape (r, cols), C-contiguous
    min_parallel : int
        Passed to each :func:`matmul_f32`.

    Returns
    -------
    ndarray of float32, shape (m, rows)
    """
    t = matmul_f32(x, b, min_parallel)
    return matmul_f32(t, a, min_parallel)


# --------------------------------------------------------------------------
# Monarch
# --------------------------------------------------------------------------
@njit
def _monarch_stage1(x, w2, t, i, l):
    """``t[i, l, :] = sum_s x[i, l m + s] w2[l, s, :]`` (block ``l`` of the
    first block-diagonal product)."""
    m = w2.shape[0]
    tl = t[i, l]
    for ri in range(m):
        tl[ri] = np.float32(0.0)
    for s in range(m):
        xv = x[i, l * m + s]
        ws = w2[l, s]
        for ri in range(m):
            tl[ri] += xv * ws[ri]


@njit
def _monarch_stage2(t, w1, y, i, ri):
    """``y[i, ri m + j] = sum_l w1[ri, j, l] t[i, l, ri]`` (block ``ri`` of
    the second block-diagonal product)."""
    m = w1.shape[0]
    tc = np.empty(m, dtype=np.float32)
    for l in range(m):
        tc[l] = t[i, l, ri]
    for j in range(m):
        wj = w1[ri, j]
        acc = np.float32(0.0)
        for l in range(m):
            acc += wj[l] * tc[l]
        y[i, ri * m + j] = acc


@njit_parallel
def monarch_linear(x, w1, w2, min_parallel=PAR_MIN):
    """``y = x @ W_hat.T`` for the ``monarch`` pack, in ``2 m**3``
    multiply-adds per sample.

    ``W_hat[ri m + j, l m + s] = w1[ri, j, l] * w2[l, s, ri]``
    (``formats.unpack`` / ``monarch_reconstruct``; row = output ``ri m + j``,
    column = input ``l m + s``), so

    1. ``t[l, ri] = sum_s w2[l, s, ri] x[l m + s]`` -- ``m`` independent
       ``m x m`` blocks, each an axpy sweep over contiguous ``w2[l, s, :]``;
    2. ``y[ri m + j] = sum_l w1[ri, j, l] t[l, ri]`` -- ``m`` blocks, each
       ``m`` contiguous dot products over ``w1[ri, j, :]``.

    Parameters
    ----------
    x : ndarray of float32, shape (batch, m*m), C-contiguous
    w1 : ndarray of float32, shape (m, m, m), C-contiguous, ``w1[ri, j, l]``
    w2 : ndarray of float32, shape (m, m, m), C-contiguous, ``w2[l, s, ri]``
    min_parallel : int
        Serial below ``2 batch m**3`` multiply-adds; above, the blocks of each
        stage run in ``prange``.

    Returns
    -------
    ndarray of float32, shape (batch, m*m)
    """
    batch = x.shape[0]
    m = w1.shape[0]
    y = np.empty((batch, m * m), dtype=np.float32)
    t = np.empty((batch, m, m), dtype=np.float32)
    if 2 * batch * m * m * m < min_parallel:
        for i in range(batch):
            for l in range(m):
                _monarch_stage1(x, w2, t, i, l)
            for ri in range(m):
                _monarch_stage2(t, w1, y, i, ri)
    else:
        for q in prange(batch * m):
            _monarch_stage1(x, w2, t, q // m, q % m)
        for q in prange(batch * m):
            _monarch_stage2(t, w1, y, q // m, q % m)
    return y


# --------------------------------------------------------------------------
# Tucker
# --------------------------------------------------------------------------
@njit
def tucker_order(dims, ranks):
    """Which inner mode a Tucker layer contracts first, and the MACs per
    sample: ``(0, macs)`` = ``u2`` then ``u1``, ``(1, macs)`` = ``u1`` then
    ``u2`` (whichever is cheaper; ties take ``u2`` first).

    ``macs = first two mode products + r0 r1 r2 (core) + d0 r0 (u0)``.
    """
    d0, d1, d2 = dims[0], dims[1], dims[2]
    r0, r1, r2 = ranks[0], ranks[1], ranks[2]
    a = d1 * d2 * r2 + d1 * r1 * r2
    b = d1 * d2 * r1 + d2 * r1 * r2
    rest = r0 * r1 * r2 + d0 * r0
    if a <= b:
        return 0, a + rest
    return 1, b + rest


@njit
def _tucker_one(x, i, core, u0, u1, u2, order, z1, z2, z3, y):
    d0, r0 = u0.shape
    d1, r1 = u1.shape
    d2, r2 = u2.shape
    xo = 0
    if order == 0:
        # z1[a, r] = sum_b x[a, b] u2[b, r]                (d1 d2 r2)
        for a in range(d1):
            za = z1[a]
            for r in range(r2):
                za[r] = np.float32(0.0)
            xo = a * d2
            for b in range(d2):
                xv = x[i, xo + b]
                ub = u2[b]
                for r in range(r2):
                    za[r] += xv * ub[r]
        # z2[q, r] = sum_a u1[a, q] z1[a, r]                (d1 r1 r2)
        for q in range(r1):
            for r in range(r2):
                z2[q, r] = np.float32(0.0)
        for a in range(d1):
            za = z1[a]
            ua = u1[a]
            for q in range(r1):
                c = ua[q]
                zq = z2[q]
                for r in range(r2):
                    zq[r] += c * za[r]
    else:
        # z1[q, b] = sum_a u1[a, q] x[a, b]                 (d1 r1 d2)
        for q in range(r1):
            for b in range(d2):
                z1[q, b] = np.float32(0.0)
        for a in range(d1):
            xo = a * d2
            ua = u1[a]
            for q in range(r1):
                c = ua[q]
                zq = z1[q]
                for b in range(d2):
                    zq[b] += c * x[i, xo + b]
        # z2[q, r] = sum_b z1[q, b] u2[b, r]                (r1 d2 r2)
        for q in range(r1):
            zq = z2[q]
            for r in range(r2):
                zq[r] = np.float32(0.0)
            z1q = z1[q]
            for b in range(d2):
                c = z1q[b]
                ub = u2[b]
                for r in range(r2):
                    zq[r] += c * ub[r]
    # z3[p] = sum_{q, r} core[p, q, r] z2[q, r]             (r0 r1 r2)
    zf = z2.ravel()
    n12 = r1 * r2
    for p in range(r0):
        cp = core[p].ravel()
        acc = np.float32(0.0)
        for t in range(n12):
            acc += cp[t] * zf[t]
        z3[p] = acc
    # y[i, row] = sum_p u0[row, p] z3[p]                    (d0 r0)
    for row in range(d0):
        ur = u0[row]
        acc = np.float32(0.0)
        for p in range(r0):
            acc += ur[p] * z3[p]
        y[i, row] = acc


@njit_parallel
def tucker_linear(x, core, u0, u1, u2, min_parallel=PAR_MIN):
    """``y = x @ W_hat.T`` for the ``tucker`` pack: ``W_hat.reshape(d0, d1,
    d2) = core x0 u0 x1 u1 x2 u2`` (``d0 = rows``, ``d1 d2 = cols``).

    Each sample ``x[i]`` is viewed as ``X[d1, d2]`` and contracted with the
    input factors first (``u2`` then ``u1``, or ``u1`` then ``u2`` when
    :func:`tucker_order` says that is cheaper), then with the core, then
    expanded by ``u0``: ``min(d1 d2 r2 + d1 r1 r2, d1 d2 r1 + d2 r1 r2) +
    r0 r1 r2 + d0 r0`` multiply-adds per sample.

    Parameters
    ----------
    x : ndarray of float32, shape (m, d1*d2), C-contiguous
    core : ndarray of float32, shape (r0, r1, r2), C-contiguous
    u0, u1, u2 : ndarray of float32, shapes (d0, r0), (d1, r1), (d2, r2),
        C-contiguous
    min_parallel : int
        Serial below this many multiply-adds per call; above, samples run in
        ``prange``.

    Returns
    -------
    ndarray of float32, shape (m, d0)
    """
    m = x.shape[0]
    d0, r0 = u0.shape
    d1, r1 = u1.shape
    d2, r2 = u2.shape
    order, macs = tucker_order((d0, d1, d2), (r0, r1, r2))
    y = np.empty((m, d0), dtype=np.float32)
    n1 = r2 if order == 0 else d2
    m1 = d1 if order == 0 else r1
    if m < 2 or m * macs < min_parallel:
        z1 = np.empty((m1, n1), dtype=np.float32)
        z2 = np.empty((r1, r2), dtype=np.float32)
        z3 = np.empty(r0, dtype=np.float32)
        for i in range(m):
            _tucker_one(x, i, core, u0, u1, u2, order, z1, z2, z3, y)
    else:
        for i in prange(m):
            z1 = np.empty((m1, n1), dtype=np.float32)
            z2 = np.empty((r1, r2), dtype=np.float32)
            z3 = np.empty(r0, dtype=np.float32)
            _tucker_one(x, np.int64(i), core, u0, u1, u2, order, z1, z2, z3, y)
    return y


# --------------------------------------------------------------------------
# Tensor-Train
# --------------------------------------------------------------------------
@njit
def tt_split(shapes, rows):
    """Number of leading TT modes whose product is ``rows`` (the output
    modes), or ``-1`` when no prefix multiplies to ``rows``.

    Parameters
    ----------
    shapes : ndarray of int64, shape (n, 3)
        ``(r_prev, d_k, r_next)`` of each core.
    rows : int
    """
    n = shapes.shape[0]
    p = 1
    for k in range(n + 1):
        if p == rows and 0 < k < n:
            return k
        if k < n:
            p *= shapes[k, 1]
    return -1


@njit
def _tt_chunk(x, i0, i1, flat, shapes, offs, split, bufa, bufb, y):
    """Samples ``i0..i1-1`` through the TT operator together (the batch is
    part of the prefix on the input side and the innermost, contiguous axis
    on the output side, so every inner loop runs over ``batch x`` more
    elements)."""
    n = shapes.shape[0]
    mb = i1 - i0
    cols = x.shape[1]
    cur = bufa
    nxt = bufb
    for i in range(mb):
        for p in range(cols):
            cur[i * cols + p] = x[i0 + i, p]
    # Input side, t = n-1 .. split: v[(P, d), b] -> v'[P, a] = sum G[a, d, b] v.
    pp = mb * cols
    for t in range(n - 1, split - 1, -1):
        ra = shapes[t, 0]
        d = shapes[t, 1]
        rn = shapes[t, 2]
        g = flat[offs[t]: offs[t] + ra * d * rn]
        npre = pp // d
        inner = d * rn
        for q in range(npre):
            base = q * inner
            for a in range(ra):
                go = a * inner
                acc = np.float32(0.0)
                for e in range(inner):
                    acc += g[go + e] * cur[base + e]
                nxt[q * ra + a] = acc
        cur, nxt = nxt, cur
        pp = npre
    # cur is u[i, b] (mb x r_split): make the batch innermost, u[b, i].
    rs = shapes[split, 0]
    for i in range(mb):
        for b in range(rs):
            nxt[b * mb + i] = cur[i * rs + b]
    cur, nxt = nxt, cur
    # Output side, t = split-1 .. 0:
    # u_t[a, (i_t, rest, i)] = sum_b G_t[a, i_t, b] u_{t+1}[b, (rest, i)].
    qlen = mb
    for t in range(split - 1, -1, -1):
        ra = shapes[t, 0]
        d = shapes[t, 1]
        rn = shapes[t, 2]
        g = flat[offs[t]: offs[t] + ra * d * rn]
        span = d * qlen
        for e in range(ra * span):
            nxt[e] = np.float32(0.0)
        for a in range(ra):
            for it in range(d):
                o = a * span + it * qlen
                go = (a * d + it) * rn
                for b in range(rn):
                    c = g[go + b]
                    ob = b * qlen
                    for e in range(qlen):
                        nxt[o + e] += c * cur[ob + e]
        cur, nxt = nxt, cur
        qlen = span
    rows = qlen // mb
    for r in range(rows):
        for i in range(mb):
            y[i0 + i, r] = cur[r * mb + i]


@njit
def _tt_buffer(shapes, split, cols, rows):
    """Scratch length for one sample: the largest intermediate vector."""
    n = shapes.shape[0]
    big = max(cols, rows)
    pp = cols
    for t in range(n - 1, split - 1, -1):
        pp = pp // shapes[t, 1]
        big = max(big, pp * shapes[t, 0])
    q = 1
    for t in range(split - 1, -1, -1):
        q *= shapes[t, 1]
        big = max(big, q * shapes[t, 0])
    return big


@njit_parallel
def tt_linear(x, flat, shapes, split, min_parallel=PAR_MIN):
    """``y = x @ W_hat.T`` for the ``tt`` pack, whose dense view is
    ``W_hat.reshape(modes) = core0 x core1 x ... x core{n-1}`` with the first
    ``split`` modes multiplying to ``rows`` (outputs) and the rest to ``cols``
    (inputs).

    Contraction order (no dense ``W_hat``): the samples, viewed as a tensor
    over the input modes, are contracted with the input cores **right to
    left** (``core{n-1}`` first, each step contiguous dot products of length
    ``d_k r_next``), leaving one bond vector per sample; the output cores then
    expand them, again right to left, with the samples as the innermost axis
    (axpy sweeps over ``prod(d[t+1..split-1]) x batch`` elements).  Samples
    are processed together (in chunks of 8 in ``prange`` above
    ``min_parallel``).  Multiply-adds per sample:
    ``sum_{t >= split} prod(d[split..t]) r_t r_{t+1} + sum_{t < split}
    r_t r_{t+1} prod(d[t..split-1])`` (``mining``'s ``flops``).

    Parameters
    ----------
    x : ndarray of float32, shape (m, cols), C-contiguous
    flat : ndarray of float32, 1-D
        The cores' elements concatenated in order (core ``k`` is
        ``flat[off_k : off_k + r_prev d_k r_next]`` in ``(r_prev, d_k,
        r_next)`` row-major order).
    shapes : ndarray of int64, shape (n, 3)
        ``(r_prev, d_k, r_next)`` per core, ``r_0 = r_n = 1``.
    split : int
        Output modes (see :func:`tt_split`), ``1 <= split < n``.
    min_parallel : int
        Serial below ``m * (params + cols + rows)`` of this size (or fewer
        than 16 samples); above, chunks of 8 samples run in ``prange``.

    Returns
    -------
    ndarray of float32, shape (m, rows)
    """
    m, cols = x.shape
    n = shapes.shape[0]
    offs = np.zeros(n + 1, dtype=np.int64)
    rows = 1
    for k in range(n):
        offs[k + 1] = offs[k] + shapes[k, 0] * shapes[k, 1] * shapes[k, 2]
        if k < split:
            rows *= shapes[k, 1]
    y = np.empty((m, rows), dtype=np.float32)
    nb = _tt_buffer(shapes, split, cols, rows)
    if m < 2 * _TT_BATCH or m * (offs[n] + cols + rows) < min_parallel:
        bufa = np.empty(nb * m, dtype=np.float32)
        bufb = np.empty(nb * m, dtype=np.float32)
        _tt_chunk(x, np.int64(0), m, flat, shapes, offs, split, bufa, bufb, y)
    else:
        nc = (m + _TT_BATCH - 1) // _TT_BATCH
        for c in prange(nc):
            i0 = c * _TT_BATCH
            i1 = min(m, i0 + _TT_BATCH)
            bufa = np.empty(nb * (i1 - i0), dtype=np.float32)
            bufb = np.empty(nb * (i1 - i0), dtype=np.float32)
            _tt_chunk(x, i0, i1, flat, shapes, offs, split, bufa, bufb, y)
    return y
