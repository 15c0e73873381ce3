"""ggml (llama.cpp) block quantisers and decoders, bit for bit.

One ``quantize_<type>`` and one ``dequantize_<type>`` numba entry per ggml
type.  The quantisers reproduce the bytes that ``ggml_quantize_chunk`` writes
(``ggml-quants.c``): without importance the reference path (``*_ref``, and
``quantize_iq4_nl`` / ``quantize_iq4_xs`` with ``NULL`` weights), with an
importance vector the ``quantize_row_*_impl`` path.  The algorithms were
written from a reading of ggml's sources; nothing is copied.

Bit-exactness rules followed everywhere
--------------------------------------
* Every intermediate is ``float32`` with the C evaluation order: integer
  operands are turned into ``float32`` explicitly (numba would otherwise promote
  ``float32 * int`` to ``float64``), constants are ``float32`` literals.
* ``fastmath=False``: no reassociation and no ``a*b+c`` contraction.  ggml's
  quantisers live in ``libggml-base``, which CMake compiles with
  ``-O3 -DNDEBUG -std=gnu11`` and *without* the ``-march`` flags of
  ``GGML_NATIVE`` (those only reach the ``ggml-cpu`` backend), so on x86-64 the
  reference has no FMA instructions to contract into (checked: the object file
  holds no ``vfmadd``).  LLVM without ``contract`` never fuses either.
* ``nearest_int`` is ggml's magic-number trick on the float bits (round half to
  even inside +/-2**22, the same garbage outside, as ggml with ``NDEBUG``);
  fp16 rounding is ggml's portable ``fp32 -> fp16`` bit recipe.
* Integer stores wrap like C's ``uint8_t``/``int8_t`` stores.

All functions here assume valid input (see :mod:`opscope_nb.formats.ggml`): ``w`` is a
C-contiguous finite ``float32`` ``[rows, cols]`` with ``cols`` a multiple of the
block, ``qw`` a ``float32`` ``[cols]`` importance vector or an empty array for
"no importance".  No input validation.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._jit import njit, njit_exact, njit_parallel, njit_parallel_exact

F = np.float32
_EPS = np.float32(1e-15)          # GROUP_MAX_EPS
_MAGIC = np.float32(12582912.0)   # 1.5 * 2**23
_KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
               dtype=np.int8)
_KVF = _KV.astype(np.float32)




# ----------------------------------------------------------------- primitives
@njit_exact
def _nearest_int(fval):
    """ggml ``nearest_int``: float bits of ``fval + 1.5*2**23``, low 23 bits."""
    val = F(fval + _MAGIC)
    i = np.int64(val.view(np.int32))
    return (i & 0x007FFFFF) - 0x00400000


@njit_exact
def _fp16_bits(f):
    """ggml ``ggml_compute_fp32_to_fp16`` (round to nearest even), as an int."""
    base = (F(abs(f)) * F(5.192296858534828e+33)) * F(7.703719777548943e-34)
    w = np.int64(F(f).view(np.uint32))
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = np.uint32((bias >> 1) + 0x07800000).view(np.float32) + base
    bits = np.int64(F(base).view(np.uint32))
    exp_bits = (bits >> 13) & 0x00007C00
    mantissa_bits = bits & 0x00000FFF
    nonsign = exp_bits + mantissa_bits
    if shl1_w > 0xFF000000:
        nonsign = 0x7E00
    return ((sign >> 16) | nonsign) & 0xFFFF


@njit_exact
def _fp16_value(h):
    """fp16 bits -> float32 value (exact)."""
    s = (h >> 15) & 1
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = math.ldexp(float(m), -24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(1024 + m), e - 25)
    return F(-v) if s else F(v)


@njit_exact
def _round_f16(f):
    """float32 -> fp16 -> float32 (what ggml reads back after storing)."""
    return _fp16_value(_fp16_bits(f))


@njit_exact
def _put_f16(out, p, f):
    h = _fp16_bits(f)
    out[p] = h & 0xFF
    out[p + 1] = (h >> 8) & 0xFF
    return h


@njit_exact
def _get_f16(data, p):
    return _fp16_value(np.int64(data[p]) | (np.int64(data[p + 1]) << 8))


@njit_exact
def _roundf(x):
    """C ``roundf``/``lroundf``: half away from zero, exact for any float32."""
    t = F(math.trunc(x))
    r = x - t
    if r >= F(0.5):
        t += F(1.0)
    elif r <= F(-0.5):
        t -= F(1.0)
    return np.int64(t)


@njit_exact
def _best_index(x):
    """ggml ``best_index_int8`` over ``kvalues_iq4nl``."""
    if x <= _KVF[0]:
        return 0
    if x >= _KVF[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < _KVF[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - _KVF[mu - 1] < _KVF[mu] - x else mu


@njit_exact
def _i8(v):
    return ((v + 128) & 0xFF) - 128


# ------------------------------------------------------- scale/level searches
@njit_exact
def _make_qx_quants(n, nmax, x, L, w):
    """ggml ``make_qx_quants`` with ``rmse_type == 1`` and weights ``w``."""
    mx = F(0.0)
    amax = F(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(-nmax) / mx
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        l = _nearest_int(iscale * x[i])
        l = max(-nmax, min(nmax - 1, l))
        L[i] = l + nmax
        fl = F(l)
        sumlx += w[i] * x[i] * fl
        suml2 += w[i] * fl * fl
    scale = sumlx / suml2 if suml2 != F(0.0) else F(0.0)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(F(nmax) + F(0.1) * F(is_)) / mx
        sumlx = F(0.0)
        suml2 = F(0.0)
        for i in range(n):
            l = _nearest_int(iscale * x[i])
            l = max(-nmax, min(nmax - 1, l))
            fl = F(l)
            sumlx += w[i] * x[i] * fl
            suml2 += w[i] * fl * fl
        if suml2 > F(0.0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = _nearest_int(iscale * x[i])
                L[i] = nmax + max(-nmax, min(nmax - 1, l))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit_exact
def _make_q3_quants(n, nmax, x, L):
    """ggml ``make_q3_quants`` with ``do_rmse`` (x**2 weights)."""
    mx = F(0.0)
    amax = F(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(-nmax) / mx
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        l = _nearest_int(iscale * x[i])
        l = max(-nmax, min(nmax - 1, l))
        L[i] = l
        w = x[i] * x[i]
        fl = F(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fli = F(L[i])
            slx = sumlx - w * x[i] * fli
            if slx > F(0.0):
                sl2 = suml2 - w * fli * fli
                new_l = _nearest_int(x[i] * sl2 / slx)
                new_l = max(-nmax, min(nmax - 1, new_l))
                if new_l != L[i]:
                    fnl = F(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if sl2 > F(0.0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > F(0.0) else F(0.0)


@njit_exact
def _make_qkx_quants(n, nmax, x, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """ggml ``make_qkx2_quants`` / ``make_qkx3_quants`` (weights given).

    Returns ``(scale, the_min)`` with ``the_min = -min``.
    """
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > F(0.0):
        mn = F(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return F(0.0), -mn
    iscale = F(nmax) / (mx - mn)
    scale = F(1.0) / iscale
    best_error = F(0.0)
    for i in range(n):
        l = _nearest_int(iscale * (x[i] - mn))
        L[i] = max(0, min(nmax, l))
        diff = scale * F(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * F(is_) + F(nmax)) / (mx - mn)
        sum_l = F(0.0)
        sum_l2 = F(0.0)
        sum_xl = F(0.0)
        for i in range(n):
            l = _nearest_int(iscale * (x[i] - mn))
            l = max(0, min(nmax, l))
            Laux[i] = l
            fl = F(l)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > F(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > F(0.0):
                this_min = F(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F(0.0)
            for i in range(n):
                diff = this_scale * F(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit_exact
def _make_qp_quants(n, nmax, x, L, qw):
    """ggml ``make_qp_quants`` (super-block scales; ``L`` is uint8)."""
    mx = F(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < _EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(nmax) / mx
    for i in range(n):
        L[i] = _nearest_int(iscale * x[i]) & 0xFF
    scale = F(1.0) / iscale
    best_mse = F(0.0)
    for i in range(n):
        diff = x[i] - scale * F(L[i])
        best_mse += qw[i] * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (F(0.1) * F(is_) + F(nmax)) / mx
        scale_is = F(1.0) / iscale_is
        mse = F(0.0)
        for i in range(n):
            l = min(nmax, _nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        l = min(nmax, _nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = F(l)
        sumlx += qw[i] * x[i] * fl
        suml2 += qw[i] * fl * fl
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            fli = F(L[i])
            slx = sumlx - w * x[i] * fli
            sl2 = suml2 - w * fli * fli
            if slx > F(0.0) and sl2 > F(0.0):
                new_l = min(nmax, _nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fnl = F(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > F(0.0) else F(0.0)


@njit_exact
def _row_sigma2(x, n):
    """Sequential float32 sum of squares (ggml's order)."""
    s = F(0.0)
    for j in range(n):
        s += x[j] * x[j]
    return s


@njit_exact
def _iq_weights(x, qw, sigma2, w):
    """``w[j] = qw[j] * sqrtf(sigma2 + x[j]**2)``."""
    for j in range(x.shape[0]):
        w[j] = qw[j] * np.sqrt(F(sigma2 + x[j] * x[j]))


# ========================================================== 32-element types
@njit_exact
def _q8_0_row(x, qw, out):
    for ib in range(x.shape[0] // 32):
        xb = x[32 * ib:32 * ib + 32]
        o = 34 * ib
        amax = F(0.0)
        for j in range(32):
            a = abs(xb[j])
            amax = amax if amax > a else a
        d = amax / F(127.0)
        idd = F(1.0) / d if d != F(0.0) else F(0.0)
        _put_f16(out, o, d)
        for j in range(32):
            out[o + 2 + j] = _roundf(xb[j] * idd) & 0xFF


@njit_exact
def _amax_signed(xb, n):
    amax = F(0.0)
    mx = F(0.0)
    for j in range(n):
        a = abs(xb[j])
        if amax < a:
            amax = a
            mx = xb[j]
    return mx


@njit_exact
def _min_max(xb, n):
    mn = F(3.4028234663852886e+38)
    mx = F(-3.4028234663852886e+38)
    for j in range(n):
        v = xb[j]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


@njit_exact
def _q4_0_row(x, qw, out):
    n = x.shape[0]
    nb = n // 32
    if qw.shape[0] == 0:
        for ib in range(nb):
            xb = x[32 * ib:32 * ib + 32]
            o = 18 * ib
            d = _amax_signed(xb, 32) / F(-8.0)
            idd = F(1.0) / d if d != F(0.0) else F(0.0)
            _put_f16(out, o, d)
            for j in range(16):
                x0 = xb[j] * idd
                x1 = xb[16 + j] * idd
                q0 = min(15, np.int64(math.trunc(F(x0 + F(8.5)))))
                q1 = min(15, np.int64(math.trunc(F(x1 + F(8.5)))))
                out[o + 2 + j] = (q0 | (q1 << 4)) & 0xFF
        return
    w = np.empty(32, np.float32)
    L = np.empty(32, np.int64)
    sigma2 = _row_sigma2(x, n) / F(n)
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        o = 18 * ib
        _iq_weights(xb, qw[32 * ib:32 * ib + 32], sigma2, w)
        d = _make_qx_quants(32, 8, xb, L, w)
        _put_f16(out, o, d)
        for j in range(16):
            out[o + 2 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@njit_exact
def _q4_1_row(x, qw, out):
    n = x.shape[0]
    nb = n // 32
    if qw.shape[0] == 0:
        for ib in range(nb):
            xb = x[32 * ib:32 * ib + 32]
            o = 20 * ib
            mn, mx = _min_max(xb, 32)
            d = (mx - mn) / F(15.0)
            idd = F(1.0) / d if d != F(0.0) else F(0.0)
            _put_f16(out, o, d)
            _put_f16(out, o + 2, mn)
            for j in range(16):
                x0 = (xb[j] - mn) * idd
                x1 = (xb[16 + j] - mn) * idd
                q0 = min(15, np.int64(math.trunc(F(x0 + F(0.5)))))
                q1 = min(15, np.int64(math.trunc(F(x1 + F(0.5)))))
                out[o + 4 + j] = (q0 | (q1 << 4)) & 0xFF
        return
    w = np.empty(32, np.float32)
    L = np.empty(32, np.int64)
    Laux = np.empty(32, np.int64)
    sigma2 = _row_sigma2(x, n) / F(n)
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        o = 20 * ib
        _iq_weights(xb, qw[32 * ib:32 * ib + 32], sigma2, w)
        d, the_min = _make_qkx_quants(32, 15, xb, w, L, Laux, F(-0.9), F(0.05), 36, False)
        _put_f16(out, o, d)
        _put_f16(out, o + 2, -the_min)
        for j in range(16):
            out[o + 4 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@njit_exact
def _pack5(L, out, o):
    """Q5_0/Q5_1 nibbles + qh (at ``o``: qh[4] then qs[16])."""
    qh = 0
    for j in range(16):
        a = L[j] & 0xFF
        b = L[j + 16] & 0xFF
        out[o + 4 + j] = ((a & 0x0F) | ((b & 0x0F) << 4)) & 0xFF
        qh |= ((a & 0x10) >> 4) << j
        qh |= ((b & 0x10) >> 4) << (j + 16)
    for k in range(4):
        out[o + k] = (qh >> (8 * k)) & 0xFF


@njit_exact
def _q5_0_row(x, qw, out):
    n = x.shape[0]
    nb = n // 32
    L = np.empty(32, np.int64)
    if qw.shape[0] == 0:
        for ib in range(nb):
            xb = x[32 * ib:32 * ib + 32]
            o = 22 * ib
            d = _amax_signed(xb, 32) / F(-16.0)
            idd = F(1.0) / d if d != F(0.0) else F(0.0)
            _put_f16(out, o, d)
            for j in range(32):
                L[j] = min(31, np.int64(math.trunc(F(xb[j] * idd + F(16.5)))))
            _pack5(L, out, o + 2)
        return
    w = np.empty(32, np.float32)
    sigma2 = _row_sigma2(x, n) / F(n)
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        o = 22 * ib
        _iq_weights(xb, qw[32 * ib:32 * ib + 32], sigma2, w)
        d = _make_qx_quants(32, 16, xb, L, w)
        _put_f16(out, o, d)
        _pack5(L, out, o + 2)


@njit_exact
def _q5_1_row(x, qw, out):
    n = x.shape[0]
    nb = n // 32
    L = np.empty(32, np.int64)
    if qw.shape[0] == 0:
        for ib in range(nb):
            xb = x[32 * ib:32 * ib + 32]
            o = 24 * ib
            mn, mx = _min_max(xb, 32)
            d = (mx - mn) / F(31.0)
            idd = F(1.0) / d if d != F(0.0) else F(0.0)
            _put_f16(out, o, d)
            _put_f16(out, o + 2, mn)
            for j in range(32):
                L[j] = np.int64(math.trunc(F((xb[j] - mn) * idd + F(0.5))))
            _pack5(L, out, o + 4)
        return
    w = np.empty(32, np.float32)
    Laux = np.empty(32, np.int64)
    sigma2 = _row_sigma2(x, n) / F(n)
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        o = 24 * ib
        _iq_weights(xb, qw[32 * ib:32 * ib + 32], sigma2, w)
        d, the_min = _make_qkx_quants(32, 31, xb, w, L, Laux, F(-0.9), F(0.05), 36, False)
        _put_f16(out, o, d)
        _put_f16(out, o + 2, -the_min)
        _pack5(L, out, o + 4)


# ============================================================== IQ4_NL / XS
@njit_exact
def _iq4_block_scale(xb, w, Lb, ntry):
    """First stage of ``quantize_row_iq4_nl_impl`` for one 32-block."""
    amax = F(0.0)
    mx = F(0.0)
    for j in range(32):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            mx = xb[j]
    if amax < _EPS:
        return F(0.0), False
    d = -mx / _KVF[0]
    idd = F(1.0) / d
    sumqx = F(0.0)
    sumq2 = F(0.0)
    for j in range(32):
        l = _best_index(idd * xb[j])
        Lb[j] = l
        q = _KVF[l]
        sumqx += w[j] * q * xb[j]
        sumq2 += w[j] * q * q
    d = sumqx / sumq2 if sumq2 > F(0.0) else F(0.0)
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        idd = F(itry - 127) / mx
        sumqx = F(0.0)
        sumq2 = F(0.0)
        for j in range(32):
            q = _KVF[_best_index(idd * xb[j])]
            sumqx += w[j] * q * xb[j]
            sumq2 += w[j] * q * q
        if sumq2 > F(0.0) and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d, True


@njit_exact
def _iq4_q(v):
    """``kvalues_iq4nl[best_index_int8(v)]`` without branches: the largest
    value <= v and the smallest > v, the nearer one (the lower only when
    strictly nearer, as ggml).  Below the first value ``lo`` stays it and
    wins, above the last ``hi`` stays it and wins: ggml's two clamps."""
    lo = _KVF[0]
    hi = _KVF[15]
    for k in range(1, 15):
        c = _KVF[k]
        lo = c if c <= v else lo
    for k in range(14, 0, -1):
        c = _KVF[k]
        hi = c if c > v else hi
    return lo if v - lo < hi - v else hi


@njit_exact
def _iq4_index(v):
    """ggml ``best_index_int8(16, kvalues_iq4nl, v)`` without branches (see
    :func:`_iq4_q`; ``n`` counts the values after the first that are <= v)."""
    lo = _KVF[0]
    hi = _KVF[15]
    n = 0
    for k in range(1, 15):
        c = _KVF[k]
        le = c <= v
        lo = c if le else lo
        n += 1 if le else 0
    for k in range(14, 0, -1):
        c = _KVF[k]
        hi = c if c > v else hi
    return n if v - lo < hi - v else n + 1


@njit_exact(inline="always")
def _iq4_lane_sums(xt, wt, idd, sqx, sq2):
    """Per lane ``j``: ``sqx[j] = sum_i w q x``, ``sq2[j] = sum_i w q q`` over the
    32 values of block ``j`` with ``q = _iq4_q(idd[j] * x)`` (ggml's order)."""
    nl = xt.shape[1]
    for j in range(nl):
        sqx[j] = F(0.0)
        sq2[j] = F(0.0)
    for i in range(32):
        for j in range(nl):
            q = _iq4_q(idd[j] * xt[i, j])
            w = wt[i, j]
            sqx[j] += w * q * xt[i, j]
            sq2[j] += w * q * q


@njit_exact
def _iq4_scales_lanes(xs, ws, ntry, xt, wt, st, d_out, ok_out):
    """The first stage of ``quantize_row_iq4_nl_impl`` (:func:`_iq4_block_scale`:
    the block scale ``d``) of ``nl = xt.shape[1]`` 32-blocks of ``xs`` at once,
    block = SIMD lane, bit for bit; ``st`` float32 ``[6, nl]``."""
    nl = xt.shape[1]
    mx = st[0]; idd = st[1]; sqx = st[2]; sq2 = st[3]; best = st[4]; d = st[5]
    for j in range(nl):
        amax = F(0.0)
        m = F(0.0)
        for i in range(32):
            v = xs[32 * j + i]
            xt[i, j] = v
            wt[i, j] = ws[32 * j + i]
            ax = abs(v)
            if ax > amax:
                amax = ax
                m = v
        mx[j] = m
        ok_out[j] = amax >= _EPS
    for j in range(nl):
        dj = -mx[j] / _KVF[0]
        idd[j] = F(1.0) / dj
    _iq4_lane_sums(xt, wt, idd, sqx, sq2)
    for j in range(nl):
        dj = sqx[j] / sq2[j] if sq2[j] > F(0.0) else F(0.0)
        d[j] = dj
        best[j] = dj * sqx[j]
    for itry in range(-ntry, ntry + 1):
        num = F(itry - 127)
        for j in range(nl):
            idd[j] = num / mx[j]
        _iq4_lane_sums(xt, wt, idd, sqx, sq2)
        for j in range(nl):
            a = sqx[j]
            b = sq2[j]
            if b > F(0.0) and a * a > best[j] * b:
                d[j] = a / b
                best[j] = d[j] * a
    for j in range(nl):
        d_out[j] = d[j] if ok_out[j] else F(0.0)


@njit_exact
def _iq4_nl_row(x, qw, out):
    w = np.empty(32, np.float32)
    L = np.zeros(32, np.int64)
    ws = np.empty(256, np.float32)
    xt = np.empty((32, 8), np.float32)
    wt = np.empty((32, 8), np.float32)
    st = np.empty((6, 8), np.float32)
    ds = np.empty(8, np.float32)
    oks = np.empty(8, np.bool_)
    has = qw.shape[0] > 0
    nb = x.shape[0] // 32
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        o = 18 * ib
        k = ib % 8
        if k == 0 and ib + 8 <= nb:
            # the scales of the next 8 blocks at once (lanes); their weights first
            for b in range(8):
                xg = x[32 * (ib + b):32 * (ib + b) + 32]
                sig = _row_sigma2(xg, 32) * F(0.0625)
                if has:
                    _iq_weights(xg, qw[32 * (ib + b):32 * (ib + b) + 32], sig,
                                ws[32 * b:32 * b + 32])
                else:
                    for j in range(32):
                        ws[32 * b + j] = xg[j] * xg[j]
            _iq4_scales_lanes(x[32 * ib:32 * ib + 256], ws, 7, xt, wt, st, ds, oks)
        if ib - k + 8 <= nb:
            d = ds[k]
        else:
            sigma2 = _row_sigma2(xb, 32) * F(0.0625)
            if has:
                _iq_weights(xb, qw[32 * ib:32 * ib + 32], sigma2, w)
            else:
                for j in range(32):
                    w[j] = xb[j] * xb[j]
            d, ok = _iq4_block_scale(xb, w, L, 7)
        _put_f16(out, o, d)
        idd = F(1.0) / d if d != F(0.0) else F(0.0)
        for j in range(32):
            L[j] = _iq4_index(idd * xb[j])
        for j in range(16):
            out[o + 2 + j] = (L[j] | (L[16 + j] << 4)) & 0xFF


@njit_exact
def _iq4_xs_row(x, qw, out):
    ws = np.empty(256, np.float32)
    L = np.zeros(256, np.int64)
    scales = np.empty(8, np.float32)
    xt = np.empty((32, 8), np.float32)
    wt = np.empty((32, 8), np.float32)
    st = np.empty((6, 8), np.float32)
    oks = np.empty(8, np.bool_)
    has = qw.shape[0] > 0
    for ibl in range(x.shape[0] // 256):
        xs = x[256 * ibl:256 * ibl + 256]
        o = 136 * ibl
        sigma2 = _row_sigma2(xs, 256) * F(0.0078125)
        if has:
            for ib in range(8):
                c = 256 * ibl + 32 * ib
                _iq_weights(xs[32 * ib:32 * ib + 32], qw[c:c + 32], sigma2,
                            ws[32 * ib:32 * ib + 32])
        else:
            for j in range(256):
                ws[j] = xs[j] * xs[j]
        # the 8 blocks' scales at once (lanes; quantize_row_iq4_nl_impl's first stage)
        _iq4_scales_lanes(xs, ws, 7, xt, wt, st, scales, oks)
        max_scale = F(0.0)
        amax_scale = F(0.0)
        for ib in range(8):
            if not oks[ib]:
                continue
            d = scales[ib]
            ad = abs(d)
            if ad > amax_scale:
                amax_scale = ad
                max_scale = d
        d = -max_scale / F(32.0)
        _put_f16(out, o, d)
        idd = F(1.0) / d if d != F(0.0) else F(0.0)
        sh = 0
        for k in range(4):
            out[o + 4 + k] = 0
        for ib in range(8):
            l = _nearest_int(idd * scales[ib])
            l = max(-32, min(31, l))
            dl = d * F(l)
            idl = F(1.0) / dl if dl != F(0.0) else F(0.0)
            for j in range(32):
                L[32 * ib + j] = _iq4_index(idl * xs[32 * ib + j])
            l += 32
            if ib % 2 == 0:
                out[o + 4 + ib // 2] = l & 0xF
            else:
                out[o + 4 + ib // 2] |= (l & 0xF) << 4
            sh |= (l >> 4) << (2 * ib)
        out[o + 2] = sh & 0xFF
        out[o + 3] = (sh >> 8) & 0xFF
        _pack_iq4_xs_qs(L, out, o)


@njit_exact
def _pack_iq4_xs_qs(L, out, o):
    """IQ4_XS codes ``L[256]`` into the block at ``out[o:]``: per 32-sub-block,
    16 bytes of nibble pairs (low = value j, high = value j + 16)."""
    for i in range(8):
        for j in range(16):
            out[o + 8 + 16 * i + j] = (L[32 * i + j] | (L[32 * i + 16 + j] << 4)) & 0xFF


# =========================================================== K-quants (256)
@njit_exact
def _pack_scale_min_k4(ls, lm, sc):
    """Q4_K/Q5_K 6-bit scale/min packing into ``sc[12]`` (uint8 stores)."""
    for k in range(12):
        sc[k] = 0
    for j in range(8):
        a = ls[j] & 0xFF
        b = lm[j] & 0xFF
        if j < 4:
            sc[j] = a
            sc[j + 4] = b
        else:
            sc[j + 4] = ((a & 0xF) | ((b & 0xF) << 4)) & 0xFF
            sc[j - 4] = (sc[j - 4] | ((a >> 4) << 6)) & 0xFF
            sc[j] = (sc[j] | ((b >> 4) << 6)) & 0xFF


@njit_exact
def _get_scale_min_k4(j, q, o):
    if j < 4:
        return np.int64(q[o + j]) & 63, np.int64(q[o + j + 4]) & 63
    a = np.int64(q[o + j + 4])
    d = (a & 0xF) | ((np.int64(q[o + j - 4]) >> 6) << 4)
    m = (a >> 4) | ((np.int64(q[o + j]) >> 6) << 4)
    return d, m


@njit_exact
def _qk_requant(x, out, o_scales, dd, dmin, L, nmax):
    """Re-quantise every 32-sub-block with the stored fp16 d/dmin and scales."""
    for j in range(8):
        sc, m = _get_scale_min_k4(j, out, o_scales)
        d = dd * F(sc)
        if d == F(0.0):
            continue
        dm = dmin * F(m)
        for ii in range(32):
            l = _nearest_int((x[32 * j + ii] + dm) / d)
            L[32 * j + ii] = max(0, min(nmax, l))


@njit_exact
def _make_qkx_quants_lanes(xs, ws, n, nmax, rmin, rdelta, nstep, use_mad, xt, wt, lb, la, st, L,
                           scales, mins):
    """``make_qkx2_quants`` / ``make_qkx3_quants`` (:func:`_make_qkx_quants`)
    of the ``nl = xt.shape[1]`` sub-blocks of ``n`` values of ``xs`` (weights
    ``ws``) at once, bit for bit: sub-block ``j`` is SIMD lane ``j``
    (``xt``/``wt`` ``[n, nl]`` transposes, ``lb``/``la`` int64 ``[n, nl]`` best
    and trial levels, ``st`` float32 ``[12, nl]`` lane state), each lane's sums
    in ggml's order, the ``nstep + 1`` trials in ggml's order with per-lane
    decisions (a lane's ``min`` moves with its improvements, as in ggml).
    Writes ``L[n * nl]``, ``scales[nl]`` and ``mins[nl]`` (``-min``)."""
    nl = xt.shape[1]
    mn = st[0]; mx = st[1]; sw = st[2]; sx = st[3]; scale = st[4]; berr = st[5]
    isc = st[6]; sl = st[7]; sl2 = st[8]; sxl = st[9]; cerr = st[10]; live = st[11]
    for j in range(nl):
        for i in range(n):
            xt[i, j] = xs[n * j + i]
            wt[i, j] = ws[n * j + i]
    for j in range(nl):
        mn[j] = xt[0, j]
        mx[j] = xt[0, j]
        sw[j] = wt[0, j]
        sx[j] = wt[0, j] * xt[0, j]
    for i in range(1, n):
        for j in range(nl):
            v = xt[i, j]
            mn[j] = v if v < mn[j] else mn[j]
            mx[j] = v if v > mx[j] else mx[j]
            sw[j] += wt[i, j]
            sx[j] += wt[i, j] * v
    fnmax = F(nmax)
    for j in range(nl):
        if mn[j] > F(0.0):
            mn[j] = F(0.0)
        live[j] = F(1.0) if mx[j] > mn[j] else F(0.0)
        isc[j] = fnmax / (mx[j] - mn[j])
        scale[j] = F(1.0) / isc[j]
        berr[j] = F(0.0)
    for i in range(n):
        for j in range(nl):
            l = _nearest_int(isc[j] * (xt[i, j] - mn[j]))
            l = max(0, min(nmax, l))
            lb[i, j] = l
            diff = scale[j] * F(l) + mn[j] - xt[i, j]
            diff = abs(diff) if use_mad else diff * diff
            berr[j] += wt[i, j] * diff
    for is_ in range(nstep + 1):
        num = rmin + rdelta * F(is_) + fnmax
        for j in range(nl):
            isc[j] = num / (mx[j] - mn[j])
            sl[j] = F(0.0)
            sl2[j] = F(0.0)
            sxl[j] = F(0.0)
        for i in range(n):
            for j in range(nl):
                l = _nearest_int(isc[j] * (xt[i, j] - mn[j]))
                l = max(0, min(nmax, l))
                la[i, j] = l
                fl = F(l)
                w = wt[i, j]
                sl[j] += w * fl
                sl2[j] += w * fl * fl
                sxl[j] += w * fl * xt[i, j]
        for j in range(nl):
            D = sw[j] * sl2[j] - sl[j] * sl[j]
            ts = (sw[j] * sxl[j] - sx[j] * sl[j]) / D
            tm = (sl2[j] * sx[j] - sl[j] * sxl[j]) / D
            if tm > F(0.0):
                tm = F(0.0)
                ts = sxl[j] / sl2[j]
            sl[j] = ts          # reuse: this_scale, this_min
            sl2[j] = tm
            sxl[j] = F(1.0) if (D > F(0.0) and live[j] != F(0.0)) else F(0.0)
            cerr[j] = F(0.0)
        for i in range(n):
            for j in range(nl):
                diff = sl[j] * F(la[i, j]) + sl2[j] - xt[i, j]
                diff = abs(diff) if use_mad else diff * diff
                cerr[j] += wt[i, j] * diff
        any_ = False
        for j in range(nl):
            if sxl[j] != F(0.0) and cerr[j] < berr[j]:
                berr[j] = cerr[j]
                scale[j] = sl[j]
                mn[j] = sl2[j]
                cerr[j] = F(1.0)
                any_ = True
            else:
                cerr[j] = F(0.0)
        if any_:
            for i in range(n):
                for j in range(nl):
                    if cerr[j] != F(0.0):
                        lb[i, j] = la[i, j]
    for j in range(nl):
        if live[j] == F(0.0):
            scales[j] = F(0.0)
            mins[j] = -mn[j]
            for i in range(n):
                L[n * j + i] = 0
        else:
            scales[j] = scale[j]
            mins[j] = -mn[j]
            for i in range(n):
                L[n * j + i] = lb[i, j]


@njit_exact
def _qk_scales_ref(xs, L, ws, scr, lt, st, scales, mins, ls, lm, nmax, rmin, nstep):
    """Q4_K/Q5_K ``_ref`` sub-block search (the 8 sub-blocks as lanes) and
    6-bit scale quantisation."""
    for j in range(8):
        sum_x2 = F(0.0)
        for l in range(32):
            sum_x2 += xs[32 * j + l] * xs[32 * j + l]
        av_x = np.sqrt(F(sum_x2 / F(32.0)))
        for l in range(32):
            ws[32 * j + l] = av_x + abs(xs[32 * j + l])
    _make_qkx_quants_lanes(xs, ws, 32, nmax, rmin, F(0.1), nstep, False, scr[0], scr[1], lt[0],
                           lt[1], st, L, scales, mins)
    max_scale = F(0.0)
    max_min = F(0.0)
    for j in range(8):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = F(63.0) / max_scale if max_scale > F(0.0) else F(0.0)
    inv_min = F(63.0) / max_min if max_min > F(0.0) else F(0.0)
    for j in range(8):
        ls[j] = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
        lm[j] = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
    return max_scale / F(63.0), max_min / F(63.0)


@njit_exact
def _qk_scales_imp(xs, qws, L, ws, scr, lt, st, scales, mins, ls, lm, sw, nmax):
    """Q4_K/Q5_K ``_impl`` (importance) sub-block search (lanes) + ``make_qp_quants``."""
    sigma2 = F(2.0) * _row_sigma2(xs, 256) / F(256.0)
    for j in range(8):
        _iq_weights(xs[32 * j:32 * j + 32], qws[32 * j:32 * j + 32], sigma2,
                    ws[32 * j:32 * j + 32])
        sumw = F(0.0)
        for l in range(32):
            sumw += ws[32 * j + l]
        sw[j] = sumw
    _make_qkx_quants_lanes(xs, ws, 32, nmax, F(-0.9), F(0.05), 36, False, scr[0], scr[1],
                           lt[0], lt[1], st, L, scales, mins)
    d_block = _make_qp_quants(8, 63, scales, ls, sw)
    m_block = _make_qp_quants(8, 63, mins, lm, sw)
    return d_block, m_block


@njit_exact
def _q4_K_row(x, qw, out):
    L = np.zeros(256, np.int64)
    ws = np.empty(256, np.float32)
    scr = np.empty((2, 32, 8), np.float32)
    lt = np.empty((2, 32, 8), np.int64)
    st = np.empty((12, 8), np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    sw = np.empty(8, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    sc = np.empty(12, np.int64)
    has = qw.shape[0] > 0
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 144 * i
        if has:
            dv, mv = _qk_scales_imp(xs, qw[256 * i:256 * i + 256], L, ws, scr, lt, st, scales,
                                    mins, ls, lm, sw, 15)
        else:
            dv, mv = _qk_scales_ref(xs, L, ws, scr, lt, st, scales, mins, ls, lm, 15, F(-1.0),
                                    20)
        _pack_scale_min_k4(ls, lm, sc)
        for k in range(12):
            out[o + 4 + k] = sc[k]
        dd = _fp16_value(_put_f16(out, o, dv))
        dmin = _fp16_value(_put_f16(out, o + 2, mv))
        _qk_requant(xs, out, o + 4, dd, dmin, L, 15)
        for c in range(4):
            for l in range(32):
                out[o + 16 + 32 * c + l] = (L[64 * c + l] | (L[64 * c + 32 + l] << 4)) & 0xFF


@njit_exact
def _q5_K_row(x, qw, out):
    L = np.zeros(256, np.int64)
    ws = np.empty(256, np.float32)
    scr = np.empty((2, 32, 8), np.float32)
    lt = np.empty((2, 32, 8), np.int64)
    st = np.empty((12, 8), np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    sw = np.empty(8, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    sc = np.empty(12, np.int64)
    has = qw.shape[0] > 0
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 176 * i
        if has:
            dv, mv = _qk_scales_imp(xs, qw[256 * i:256 * i + 256], L, ws, scr, lt, st, scales,
                                    mins, ls, lm, sw, 31)
            for j in range(8):
                ls[j] = min(63, ls[j])
                lm[j] = min(63, lm[j])
        else:
            dv, mv = _qk_scales_ref(xs, L, ws, scr, lt, st, scales, mins, ls, lm, 31, F(-0.5),
                                    15)
        _pack_scale_min_k4(ls, lm, sc)
        for k in range(12):
            out[o + 4 + k] = sc[k]
        dd = _fp16_value(_put_f16(out, o, dv))
        dmin = _fp16_value(_put_f16(out, o + 2, mv))
        _qk_requant(xs, out, o + 4, dd, dmin, L, 31)
        for k in range(32):
            out[o + 16 + k] = 0
        m1 = 1
        m2 = 2
        for c in range(4):
            for j in range(32):
                l1 = L[64 * c + j]
                if l1 > 15:
                    l1 -= 16
                    out[o + 16 + j] |= m1
                l2 = L[64 * c + j + 32]
                if l2 > 15:
                    l2 -= 16
                    out[o + 16 + j] |= m2
                out[o + 48 + 32 * c + j] = (l1 | (l2 << 4)) & 0xFF
            m1 <<= 2
            m2 <<= 2


@njit_exact
def _make_qx_quants_x16(xs, ws, nmax, xt, wt, wxt, mxs, its, slx, sl2, best, scale, bt, L,
                        scales):
    """``make_qx_quants(16, nmax, x, L, 1, w)`` of the 16 sub-blocks of a
    256-value super-block at once, bit for bit: sub-block ``sb`` is SIMD lane
    ``sb`` (``xt``/``wt``/``wxt`` are the ``[16, 16]`` transposes), each lane
    sums its 16 values in ggml's order, and the 19 scale trials run in ggml's
    order with per-lane decisions.  In the trials ``|iscale * x| <= nmax + 0.9``,
    so ``nearest_int`` is ``(v + 1.5*2**23) - 1.5*2**23`` in float32 (the same
    integer; no int round trip).  Writes ``L[256]`` (``l + nmax``) and
    ``scales[16]``; a sub-block with ``max |x| < GROUP_MAX_EPS`` gets ``L = 0``
    and scale 0, as in ggml."""
    fnmax = F(nmax)
    lo = F(-nmax)
    hi = F(nmax - 1)
    for sb in range(16):
        amax = F(0.0)
        mx = F(0.0)
        for i in range(16):
            v = xs[16 * sb + i]
            wv = ws[16 * sb + i]
            xt[i, sb] = v
            wt[i, sb] = wv
            wxt[i, sb] = wv * v
            ax = abs(v)
            if ax > amax:
                amax = ax
                mx = v
        mxs[sb] = mx
        bt[sb] = -1 if amax < _EPS else 9
    # trial k = 0 is ggml's first pass (is = 0), then is = -9..-1, 1..9
    for k in range(19):
        t = 9 if k == 0 else (k - 1 if k <= 9 else k)
        fis = F(t - 9)
        for sb in range(16):
            its[sb] = -(fnmax + F(0.1) * fis) / mxs[sb]
            slx[sb] = F(0.0)
            sl2[sb] = F(0.0)
        for i in range(16):
            for sb in range(16):
                r = F(F(its[sb] * xt[i, sb]) + _MAGIC) - _MAGIC
                r = hi if r > hi else r
                r = lo if r < lo else r
                slx[sb] += wxt[i, sb] * r
                sl2[sb] += wt[i, sb] * r * r
        if k == 0:
            for sb in range(16):
                s = slx[sb] / sl2[sb] if sl2[sb] != F(0.0) else F(0.0)
                scale[sb] = s
                best[sb] = s * slx[sb]
        else:
            for sb in range(16):
                a = slx[sb]
                b = sl2[sb]
                if b > F(0.0) and a * a > best[sb] * b:
                    s = a / b
                    scale[sb] = s
                    best[sb] = s * a
                    if bt[sb] >= 0:
                        bt[sb] = t
    for sb in range(16):
        if bt[sb] < 0:
            scales[sb] = F(0.0)
            for i in range(16):
                L[16 * sb + i] = 0
            continue
        scales[sb] = scale[sb]
        it = -(fnmax + F(0.1) * F(bt[sb] - 9)) / mxs[sb]
        for i in range(16):
            l = _nearest_int(it * xs[16 * sb + i])
            L[16 * sb + i] = nmax + max(-nmax, min(nmax - 1, l))


@njit_exact
def _q6_K_row(x, qw, out):
    L = np.zeros(256, np.int64)
    ws = np.empty(256, np.float32)
    xt = np.empty((16, 16), np.float32)
    wt = np.empty((16, 16), np.float32)
    wxt = np.empty((16, 16), np.float32)
    mxs = np.empty(16, np.float32)
    its = np.empty(16, np.float32)
    slx = np.empty(16, np.float32)
    sl2 = np.empty(16, np.float32)
    best = np.empty(16, np.float32)
    scale = np.empty(16, np.float32)
    bt = np.empty(16, np.int64)
    scales = np.empty(16, np.float32)
    has = qw.shape[0] > 0
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 210 * i
        # ggml: make_qx_quants(16, 32, x, L, 1, qw) -- weights qw, or x*x without
        if has:
            for j in range(256):
                ws[j] = qw[256 * i + j]
        else:
            for j in range(256):
                ws[j] = xs[j] * xs[j]
        _make_qx_quants_x16(xs, ws, 32, xt, wt, wxt, mxs, its, slx, sl2, best, scale, bt, L,
                            scales)
        max_scale = F(0.0)
        max_abs_scale = F(0.0)
        for ib in range(16):
            s = scales[ib]
            a = abs(s)
            if a > max_abs_scale:
                max_abs_scale = a
                max_scale = s
        if max_abs_scale < _EPS:
            for k in range(210):
                out[o + k] = 0
            continue
        iscale = F(-128.0) / max_scale
        dd = _fp16_value(_put_f16(out, o + 208, F(1.0) / iscale))
        for ib in range(16):
            out[o + 192 + ib] = min(127, _nearest_int(iscale * scales[ib])) & 0xFF
        for j in range(16):
            d = dd * F(_i8(np.int64(out[o + 192 + j])))
            if d == F(0.0):
                continue
            for ii in range(16):
                l = _nearest_int(xs[16 * j + ii] / d)
                L[16 * j + ii] = max(-32, min(31, l)) + 32
        for h in range(2):
            for l in range(32):
                b = 128 * h
                q1 = L[b + l] & 0xF
                q2 = L[b + l + 32] & 0xF
                q3 = L[b + l + 64] & 0xF
                q4 = L[b + l + 96] & 0xF
                out[o + 64 * h + l] = (q1 | (q3 << 4)) & 0xFF
                out[o + 64 * h + 32 + l] = (q2 | (q4 << 4)) & 0xFF
                out[o + 128 + 32 * h + l] = ((L[b + l] >> 4) | ((L[b + l + 32] >> 4) << 2)
                                             | ((L[b + l + 64] >> 4) << 4)
                                             | ((L[b + l + 96] >> 4) << 6)) & 0xFF


@njit_exact
def _pack2(L, out, o):
    """Q2_K/Q3_K 2-bit packing of ``L[256]`` into ``out[o:o+64]``."""
    for h in range(2):
        for l in range(32):
            b = 128 * h
            out[o + 32 * h + l] = (L[b + l] | (L[b + l + 32] << 2) | (L[b + l + 64] << 4)
                                   | (L[b + l + 96] << 6)) & 0xFF


@njit_exact
def _q3_K_finish(xs, out, o, L):
    """Q3_K: re-quantise with the stored scales, then hmask + 2-bit packing."""
    dd = _get_f16(out, o + 108)
    for j in range(16):
        if j < 8:
            sc = np.int64(out[o + 96 + j]) & 0xF
        else:
            sc = np.int64(out[o + 96 + j - 8]) >> 4
        sc = (sc | (((np.int64(out[o + 96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        d = dd * F(sc)
        if d == F(0.0):
            continue
        for ii in range(16):
            l = _nearest_int(xs[16 * j + ii] / d)
            L[16 * j + ii] = max(-4, min(3, l)) + 4
    for k in range(32):
        out[o + k] = 0
    m = 0
    hm = 1
    for j in range(256):
        if L[j] > 3:
            out[o + m] |= hm
            L[j] -= 4
        m += 1
        if m == 32:
            m = 0
            hm <<= 1
    _pack2(L, out, o + 32)


@njit_exact
def _q3_pack_scale(out, o, j, l):
    if j < 8:
        out[o + 96 + j] = l & 0xF
    else:
        out[o + 96 + j - 8] |= (l & 0xF) << 4
    l >>= 4
    out[o + 96 + 8 + j % 4] |= (l << (2 * (j // 4))) & 0xFF


@njit_exact
def _q3_K_row(x, qw, out):
    L = np.zeros(256, np.int64)
    Ls = np.empty(16, np.int64)
    ws = np.empty(256, np.float32)
    tr = np.empty((3, 16, 16), np.float32)
    ln = np.empty((6, 16), np.float32)
    bt = np.empty(16, np.int64)
    sw = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    has = qw.shape[0] > 0
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 110 * i
        for k in range(12):
            out[o + 96 + k] = 0
        if has:
            sigma2 = F(2.0) * _row_sigma2(xs, 256) / F(256.0)
            for j in range(16):
                c = 256 * i + 16 * j
                _iq_weights(xs[16 * j:16 * j + 16], qw[c:c + 16], sigma2, ws[16 * j:16 * j + 16])
                sumw = F(0.0)
                for l in range(16):
                    sumw += ws[16 * j + l]
                sw[j] = sumw
            # make_qx_quants(16, 4, ...) of the 16 sub-blocks at once (lanes)
            _make_qx_quants_x16(xs, ws, 4, tr[0], tr[1], tr[2], ln[0], ln[1], ln[2], ln[3],
                                ln[4], ln[5], bt, L, scales)
            d_block = _make_qx_quants(16, 32, scales, Ls, sw)
            for j in range(16):
                _q3_pack_scale(out, o, j, Ls[j])
            _put_f16(out, o + 108, d_block)
        else:
            max_scale = F(0.0)
            amax = F(0.0)
            for j in range(16):
                s = _make_q3_quants(16, 4, xs[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
                scales[j] = s
                a = abs(s)
                if a > amax:
                    amax = a
                    max_scale = s
            if max_scale != F(0.0):
                iscale = F(-32.0) / max_scale
                for j in range(16):
                    l = _i8(_nearest_int(iscale * scales[j]))
                    l = max(-32, min(31, l)) + 32
                    _q3_pack_scale(out, o, j, l)
                _put_f16(out, o + 108, F(1.0) / iscale)
            else:
                _put_f16(out, o + 108, F(0.0))
        _q3_K_finish(xs, out, o, L)


@njit_exact
def _q2_K_row(x, qw, out):
    L = np.zeros(256, np.int64)
    ws = np.empty(256, np.float32)
    scr = np.empty((2, 16, 16), np.float32)
    lt = np.empty((2, 16, 16), np.int64)
    st = np.empty((12, 16), np.float32)
    sw = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    Ls = np.empty(16, np.int64)
    Lm = np.empty(16, np.int64)
    has = qw.shape[0] > 0
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 84 * i
        if has:
            sigma2 = _row_sigma2(xs, 256) / F(256.0)
            for j in range(16):
                c = 256 * i + 16 * j
                _iq_weights(xs[16 * j:16 * j + 16], qw[c:c + 16], sigma2, ws[16 * j:16 * j + 16])
                sumw = F(0.0)
                for l in range(16):
                    sumw += ws[16 * j + l]
                sw[j] = sumw
            _make_qkx_quants_lanes(xs, ws, 16, 3, F(-0.9), F(0.05), 36, False, scr[0], scr[1],
                                   lt[0], lt[1], st, L, scales, mins)
            dm = _make_qp_quants(16, 15, scales, Ls, sw)
            mm = _make_qp_quants(16, 15, mins, Lm, sw)
            dd = _fp16_value(_put_f16(out, o + 80, dm))
            dmin = _fp16_value(_put_f16(out, o + 82, mm))
            for j in range(16):
                out[o + j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
        else:
            max_scale = F(0.0)
            max_min = F(0.0)
            for j in range(256):
                ws[j] = abs(xs[j])
            _make_qkx_quants_lanes(xs, ws, 16, 3, F(-0.5), F(0.1), 15, True, scr[0], scr[1],
                                   lt[0], lt[1], st, L, scales, mins)
            for j in range(16):
                if scales[j] > max_scale:
                    max_scale = scales[j]
                if mins[j] > max_min:
                    max_min = mins[j]
            if max_scale > F(0.0):
                iscale = F(15.0) / max_scale
                for j in range(16):
                    out[o + j] = _nearest_int(iscale * scales[j]) & 0xFF
                dd = _fp16_value(_put_f16(out, o + 80, max_scale / F(15.0)))
            else:
                for j in range(16):
                    out[o + j] = 0
                dd = _fp16_value(_put_f16(out, o + 80, F(0.0)))
            if max_min > F(0.0):
                iscale = F(15.0) / max_min
                for j in range(16):
                    out[o + j] = (out[o + j] | (_nearest_int(iscale * mins[j]) << 4)) & 0xFF
                dmin = _fp16_value(_put_f16(out, o + 82, max_min / F(15.0)))
            else:
                dmin = _fp16_value(_put_f16(out, o + 82, F(0.0)))
        for j in range(16):
            d = dd * F(np.int64(out[o + j]) & 0xF)
            if d == F(0.0):
                continue
            dm = dmin * F(np.int64(out[o + j]) >> 4)
            for ii in range(16):
                l = _nearest_int((xs[16 * j + ii] + dm) / d)
                L[16 * j + ii] = max(0, min(3, l))
        _pack2(L, out, o + 16)


# ================================================================== ternary
@njit_exact
def _tq_amax(xs):
    amax = F(0.0)
    for j in range(256):
        a = abs(xs[j])
        amax = amax if amax > a else a
    return amax


@njit_exact
def _tq1_0_row(x, qw, out):
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 54 * i
        d = _tq_amax(xs)
        idd = F(1.0) / d if d != F(0.0) else F(0.0)
        _put_f16(out, o + 52, d)
        for m in range(32):
            q = 0
            for n in range(5):
                q = q * 3 + _roundf(xs[m + 32 * n] * idd) + 1
            out[o + m] = ((q & 0xFF) * 256 + 242) // 243
        for m in range(16):
            q = 0
            for n in range(5):
                q = q * 3 + _roundf(xs[160 + m + 16 * n] * idd) + 1
            out[o + 32 + m] = ((q & 0xFF) * 256 + 242) // 243
        for j in range(4):
            q = 0
            for m in range(4):
                q = q * 3 + _roundf(xs[240 + j + 4 * m] * idd) + 1
            q = (q * 3) & 0xFF
            out[o + 48 + j] = (q * 256 + 242) // 243


@njit_exact
def _tq2_0_row(x, qw, out):
    for i in range(x.shape[0] // 256):
        xs = x[256 * i:256 * i + 256]
        o = 66 * i
        d = _tq_amax(xs)
        idd = F(1.0) / d if d != F(0.0) else F(0.0)
        _put_f16(out, o + 64, d)
        for h in range(2):
            for m in range(32):
                q = 0
                for n in range(4):
                    q += ((_roundf(xs[128 * h + m + 32 * n] * idd) + 1) & 3) << (2 * n)
                out[o + 32 * h + m] = q & 0xFF


# ================================================================ decoders
@njit_exact
def _dq_q8_0(b, o, y):
    d = _get_f16(b, o)
    for j in range(32):
        y[j] = F(_i8(np.int64(b[o + 2 + j]))) * d


@njit_exact
def _dq_q4_0(b, o, y):
    d = _get_f16(b, o)
    for j in range(16):
        y[j] = d * F((b[o + 2 + j] & 0xF) - 8)
        y[j + 16] = d * F((b[o + 2 + j] >> 4) - 8)


@njit_exact
def _dq_q4_1(b, o, y):
    d = _get_f16(b, o)
    m = _get_f16(b, o + 2)
    for j in range(16):
        y[j] = d * F(b[o + 4 + j] & 0xF) + m
        y[j + 16] = d * F(b[o + 4 + j] >> 4) + m


@njit_exact
def _q5_codes(b, o, j):
    qh = (np.int64(b[o]) | (np.int64(b[o + 1]) << 8) | (np.int64(b[o + 2]) << 16)
          | (np.int64(b[o + 3]) << 24))
    lo = (b[o + 4 + j] & 0xF) | (((qh >> j) & 1) << 4)
    hi = (b[o + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
    return lo, hi


@njit_exact
def _dq_q5_0(b, o, y):
    d = _get_f16(b, o)
    for j in range(16):
        lo, hi = _q5_codes(b, o + 2, j)
        y[j] = d * F(lo - 16)
        y[j + 16] = d * F(hi - 16)


@njit_exact
def _dq_q5_1(b, o, y):
    d = _get_f16(b, o)
    m = _get_f16(b, o + 2)
    for j in range(16):
        lo, hi = _q5_codes(b, o + 4, j)
        y[j] = d * F(lo) + m
        y[j + 16] = d * F(hi) + m


@njit_exact
def _dq_iq4_nl(b, o, y):
    d = _get_f16(b, o)
    for j in range(16):
        y[j] = d * _KVF[b[o + 2 + j] & 0xF]
        y[j + 16] = d * _KVF[b[o + 2 + j] >> 4]


@njit_exact
def _dq_iq4_xs(b, o, y):
    d = _get_f16(b, o)
    sh = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
    for ib in range(8):
        ls = ((b[o + 4 + ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * F(ls - 32)
        for j in range(16):
            q = b[o + 8 + 16 * ib + j]
            y[32 * ib + j] = dl * _KVF[q & 0xF]
            y[32 * ib + 16 + j] = dl * _KVF[q >> 4]


@njit_exact
def _dq_q4_K(b, o, y):
    d = _get_f16(b, o)
    dmin = _get_f16(b, o + 2)
    for c in range(4):
        s1, m1 = _get_scale_min_k4(2 * c, b, o + 4)
        s2, m2 = _get_scale_min_k4(2 * c + 1, b, o + 4)
        d1 = d * F(s1)
        dm1 = dmin * F(m1)
        d2 = d * F(s2)
        dm2 = dmin * F(m2)
        for l in range(32):
            q = b[o + 16 + 32 * c + l]
            y[64 * c + l] = d1 * F(q & 0xF) - dm1
            y[64 * c + 32 + l] = d2 * F(q >> 4) - dm2


@njit_exact
def _dq_q5_K(b, o, y):
    d = _get_f16(b, o)
    dmin = _get_f16(b, o + 2)
    for c in range(4):
        s1, m1 = _get_scale_min_k4(2 * c, b, o + 4)
        s2, m2 = _get_scale_min_k4(2 * c + 1, b, o + 4)
        d1 = d * F(s1)
        dm1 = dmin * F(m1)
        d2 = d * F(s2)
        dm2 = dmin * F(m2)
        for l in range(32):
            q = b[o + 48 + 32 * c + l]
            h = b[o + 16 + l]
            y[64 * c + l] = d1 * F((q & 0xF) + (((h >> (2 * c)) & 1) << 4)) - dm1
            y[64 * c + 32 + l] = d2 * F((q >> 4) + (((h >> (2 * c + 1)) & 1) << 4)) - dm2


@njit_exact
def _dq_q6_K(b, o, y):
    # ggml's layout loop by loop (h: 128-halves, k: 32-quarters, two 16-value
    # scale groups), so each inner loop is contiguous and vectorises
    d = _get_f16(b, o + 208)
    for h in range(2):
        for k in range(4):
            for g in range(2):
                e0 = 128 * h + 32 * k + 16 * g
                dl = d * F(_i8(np.int64(b[o + 192 + e0 // 16])))
                for l in range(16 * g, 16 * g + 16):
                    ql = np.int64(b[o + 64 * h + 32 * (k % 2) + l])
                    lo = ql & 0xF if k < 2 else ql >> 4
                    hi = (np.int64(b[o + 128 + 32 * h + l]) >> (2 * k)) & 3
                    y[128 * h + 32 * k + l] = dl * F((lo | (hi << 4)) - 32)


@njit_exact
def _dq_q3_K(b, o, y):
    d = _get_f16(b, o + 108)
    for e in range(256):
        j = e // 16
        if j < 8:
            sc = b[o + 96 + j] & 0xF
        else:
            sc = b[o + 96 + j - 8] >> 4
        sc = (sc | (((b[o + 96 + 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        h = e // 128
        r = e % 128
        k = r // 32
        l = r % 32
        q = (b[o + 32 + 32 * h + l] >> (2 * k)) & 3
        hb = (b[o + e % 32] >> (e // 32)) & 1
        y[e] = (d * F(sc)) * F(q - (0 if hb else 4))


@njit_exact
def _dq_q2_K(b, o, y):
    d = _get_f16(b, o + 80)
    dmin = _get_f16(b, o + 82)
    for e in range(256):
        s = b[o + e // 16]
        h = e // 128
        r = e % 128
        k = r // 32
        l = r % 32
        q = (b[o + 16 + 32 * h + l] >> (2 * k)) & 3
        y[e] = (d * F(s & 0xF)) * F(q) - dmin * F(s >> 4)


@njit_exact
def _dq_tq1_0(b, o, y):
    d = _get_f16(b, o + 52)
    pw = (1, 3, 9, 27, 81)
    for m in range(32):
        for n in range(5):
            q = (b[o + m] * pw[n]) & 0xFF
            y[m + 32 * n] = d * F(((q * 3) >> 8) - 1)
    for m in range(16):
        for n in range(5):
            q = (b[o + 32 + m] * pw[n]) & 0xFF
            y[160 + m + 16 * n] = d * F(((q * 3) >> 8) - 1)
    for j in range(4):
        for m in range(4):
            q = (b[o + 48 + j] * pw[m]) & 0xFF
            y[240 + j + 4 * m] = d * F(((q * 3) >> 8) - 1)


@njit_exact
def _dq_tq2_0(b, o, y):
    d = _get_f16(b, o + 64)
    for h in range(2):
        for m in range(32):
            q = b[o + 32 * h + m]
            for n in range(4):
                y[128 * h + m + 32 * n] = d * F(((q >> (2 * n)) & 3) - 1)


# ========================================================= parallel drivers
# One explicit pair of entries per type (not a factory of closures: numba's
# on-disk cache does not reuse closures, so those recompiled in every process).
# Each entry compiles only on the first use of its type.

@njit_parallel_exact
def quantize_q8_0(w, qw):
    """ggml Q8_0 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 32), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/32*34].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 32 * 34), np.uint8)
    for r in prange(rows):
        _q8_0_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q8_0(data, cols):
    """ggml Q8_0 decoder: uint8 [rows, cols/32*34] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 32):
            _dq_q8_0(row, ib * 34, out[r, ib * 32:(ib + 1) * 32])
    return out

@njit_parallel_exact
def quantize_q4_0(w, qw):
    """ggml Q4_0 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 32), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/32*18].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 32 * 18), np.uint8)
    for r in prange(rows):
        _q4_0_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q4_0(data, cols):
    """ggml Q4_0 decoder: uint8 [rows, cols/32*18] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 32):
            _dq_q4_0(row, ib * 18, out[r, ib * 32:(ib + 1) * 32])
    return out

@njit_parallel_exact
def quantize_q4_1(w, qw):
    """ggml Q4_1 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 32), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/32*20].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 32 * 20), np.uint8)
    for r in prange(rows):
        _q4_1_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q4_1(data, cols):
    """ggml Q4_1 decoder: uint8 [rows, cols/32*20] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 32):
            _dq_q4_1(row, ib * 20, out[r, ib * 32:(ib + 1) * 32])
    return out

@njit_parallel_exact
def quantize_q5_0(w, qw):
    """ggml Q5_0 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 32), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/32*22].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 32 * 22), np.uint8)
    for r in prange(rows):
        _q5_0_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q5_0(data, cols):
    """ggml Q5_0 decoder: uint8 [rows, cols/32*22] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 32):
            _dq_q5_0(row, ib * 22, out[r, ib * 32:(ib + 1) * 32])
    return out

@njit_parallel_exact
def quantize_q5_1(w, qw):
    """ggml Q5_1 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 32), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/32*24].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 32 * 24), np.uint8)
    for r in prange(rows):
        _q5_1_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q5_1(data, cols):
    """ggml Q5_1 decoder: uint8 [rows, cols/32*24] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 32):
            _dq_q5_1(row, ib * 24, out[r, ib * 32:(ib + 1) * 32])
    return out

@njit_parallel_exact
def quantize_iq4_nl(w, qw):
    """ggml IQ4_NL quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 32), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/32*18].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 32 * 18), np.uint8)
    for r in prange(rows):
        _iq4_nl_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_iq4_nl(data, cols):
    """ggml IQ4_NL decoder: uint8 [rows, cols/32*18] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 32):
            _dq_iq4_nl(row, ib * 18, out[r, ib * 32:(ib + 1) * 32])
    return out

@njit_parallel_exact
def quantize_iq4_xs(w, qw):
    """ggml IQ4_XS quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*136].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 136), np.uint8)
    for r in prange(rows):
        _iq4_xs_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_iq4_xs(data, cols):
    """ggml IQ4_XS decoder: uint8 [rows, cols/256*136] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_iq4_xs(row, ib * 136, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_q2_K(w, qw):
    """ggml Q2_K quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*84].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 84), np.uint8)
    for r in prange(rows):
        _q2_K_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q2_K(data, cols):
    """ggml Q2_K decoder: uint8 [rows, cols/256*84] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_q2_K(row, ib * 84, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_q3_K(w, qw):
    """ggml Q3_K quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*110].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 110), np.uint8)
    for r in prange(rows):
        _q3_K_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q3_K(data, cols):
    """ggml Q3_K decoder: uint8 [rows, cols/256*110] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_q3_K(row, ib * 110, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_q4_K(w, qw):
    """ggml Q4_K quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*144].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 144), np.uint8)
    for r in prange(rows):
        _q4_K_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q4_K(data, cols):
    """ggml Q4_K decoder: uint8 [rows, cols/256*144] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_q4_K(row, ib * 144, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_q5_K(w, qw):
    """ggml Q5_K quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*176].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 176), np.uint8)
    for r in prange(rows):
        _q5_K_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q5_K(data, cols):
    """ggml Q5_K decoder: uint8 [rows, cols/256*176] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_q5_K(row, ib * 176, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_q6_K(w, qw):
    """ggml Q6_K quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*210].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 210), np.uint8)
    for r in prange(rows):
        _q6_K_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_q6_K(data, cols):
    """ggml Q6_K decoder: uint8 [rows, cols/256*210] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_q6_K(row, ib * 210, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_tq1_0(w, qw):
    """ggml TQ1_0 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*54].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 54), np.uint8)
    for r in prange(rows):
        _tq1_0_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_tq1_0(data, cols):
    """ggml TQ1_0 decoder: uint8 [rows, cols/256*54] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_tq1_0(row, ib * 54, out[r, ib * 256:(ib + 1) * 256])
    return out

@njit_parallel_exact
def quantize_tq2_0(w, qw):
    """ggml TQ2_0 quantiser: ``w`` float32 [rows, cols] C-contiguous (cols a
    multiple of 256), ``qw`` float32 [cols] importance or an empty array ->
    uint8 [rows, cols/256*66].  No input validation."""
    rows, cols = w.shape
    out = np.empty((rows, cols // 256 * 66), np.uint8)
    for r in prange(rows):
        _tq2_0_row(w[r], qw, out[r])
    return out


@njit_parallel_exact
def dequantize_tq2_0(data, cols):
    """ggml TQ2_0 decoder: uint8 [rows, cols/256*66] -> float32 [rows, cols].
    No input validation."""
    rows = data.shape[0]
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        row = data[r].astype(np.int64)
        for ib in range(cols // 256):
            _dq_tq2_0(row, ib * 66, out[r, ib * 256:(ib + 1) * 256])
    return out


# ====================================================== apply's one-pass helpers
@njit_parallel_exact
def widen_bf16_rows(raw, out):
    """bfloat16 words ``raw`` (uint16 ``[rows, cols]``) widened into ``out``
    (uint32 ``[rows, cols]``, read as float32: exact, bf16 is float32's top
    half); returns how many values are NaN/Inf (ggml's quantisers are
    undefined on them).  One pass, no temporaries."""
    rows, cols = raw.shape
    bad = np.zeros(rows, np.int64)
    for r in prange(rows):
        n = 0
        for j in range(cols):
            v = np.uint32(raw[r, j]) << np.uint32(16)
            out[r, j] = v
            if (v & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
                n += 1
        bad[r] = n
    return bad.sum()


@njit_parallel
def count_nonfinite(w):
    """NaN/Inf values of a float32 ``[rows, cols]`` (rows in parallel)."""
    rows, cols = w.shape
    bad = np.zeros(rows, np.int64)
    for r in prange(rows):
        n = 0
        for j in range(cols):
            if not np.isfinite(w[r, j]):
                n += 1
        bad[r] = n
    return bad.sum()


@njit
def _sq_err_sums(x, y):
    """``(sum (x - y)**2, sum x**2)`` of two float32 rows in float64."""
    se = 0.0
    sx = 0.0
    for j in range(x.shape[0]):
        a = np.float64(x[j])
        d = a - np.float64(y[j])
        se += d * d
        sx += a * a
    return se, sx


@njit_exact
def _dq_row(code, b, y):
    """Decode one row's blocks ``b`` (int64 bytes) of ggml type ``code``
    (:data:`GGML_CODES`) into ``y``."""
    cols = y.shape[0]
    if code == 0:
        for ib in range(cols // 32):
            _dq_q8_0(b, ib * 34, y[ib * 32:(ib + 1) * 32])
    elif code == 1:
        for ib in range(cols // 32):
            _dq_q4_0(b, ib * 18, y[ib * 32:(ib + 1) * 32])
    elif code == 2:
        for ib in range(cols // 32):
            _dq_q4_1(b, ib * 20, y[ib * 32:(ib + 1) * 32])
    elif code == 3:
        for ib in range(cols // 32):
            _dq_q5_0(b, ib * 22, y[ib * 32:(ib + 1) * 32])
    elif code == 4:
        for ib in range(cols // 32):
            _dq_q5_1(b, ib * 24, y[ib * 32:(ib + 1) * 32])
    elif code == 5:
        for ib in range(cols // 32):
            _dq_iq4_nl(b, ib * 18, y[ib * 32:(ib + 1) * 32])
    elif code == 6:
        for ib in range(cols // 256):
            _dq_iq4_xs(b, ib * 136, y[ib * 256:(ib + 1) * 256])
    elif code == 7:
        for ib in range(cols // 256):
            _dq_q2_K(b, ib * 84, y[ib * 256:(ib + 1) * 256])
    elif code == 8:
        for ib in range(cols // 256):
            _dq_q3_K(b, ib * 110, y[ib * 256:(ib + 1) * 256])
    elif code == 9:
        for ib in range(cols // 256):
            _dq_q4_K(b, ib * 144, y[ib * 256:(ib + 1) * 256])
    elif code == 10:
        for ib in range(cols // 256):
            _dq_q5_K(b, ib * 176, y[ib * 256:(ib + 1) * 256])
    elif code == 11:
        for ib in range(cols // 256):
            _dq_q6_K(b, ib * 210, y[ib * 256:(ib + 1) * 256])
    elif code == 12:
        for ib in range(cols // 256):
            _dq_tq1_0(b, ib * 54, y[ib * 256:(ib + 1) * 256])
    else:
        for ib in range(cols // 256):
            _dq_tq2_0(b, ib * 66, y[ib * 256:(ib + 1) * 256])


@njit_parallel_exact
def ggml_error_sums(w, data, code):
    """Per row of ``w`` (float32 ``[rows, cols]``) and its ggml blocks ``data``
    (uint8 ``[rows, row bytes]`` of type ``code``, :data:`GGML_CODES`), in
    float64: ``(e2, x2)`` with ``e2[r] = sum (w - decoded)**2`` and
    ``x2[r] = sum w**2`` -- the sums of
    :func:`opscope_nb.formats.gptq.option_errors` without a gram, each row
    decoded into a row buffer (no decoded matrix), rows in parallel (each
    row's sums the same for any thread count)."""
    rows, cols = w.shape
    e2 = np.empty(rows, np.float64)
    x2 = np.empty(rows, np.float64)
    for r in prange(rows):
        b = data[r].astype(np.int64)
        y = np.empty(cols, np.float32)
        _dq_row(code, b, y)
        se, sx = _sq_err_sums(w[r], y)
        e2[r] = se
        x2[r] = sx
    return e2, x2


#: name -> (quantize entry, dequantize entry, block size, bytes per block)
GGML_KERNELS = {
    "q8_0": (quantize_q8_0, dequantize_q8_0, 32, 34),
    "q4_0": (quantize_q4_0, dequantize_q4_0, 32, 18),
    "q4_1": (quantize_q4_1, dequantize_q4_1, 32, 20),
    "q5_0": (quantize_q5_0, dequantize_q5_0, 32, 22),
    "q5_1": (quantize_q5_1, dequantize_q5_1, 32, 24),
    "iq4_nl": (quantize_iq4_nl, dequantize_iq4_nl, 32, 18),
    "iq4_xs": (quantize_iq4_xs, dequantize_iq4_xs, 256, 136),
    "q2_K": (quantize_q2_K, dequantize_q2_K, 256, 84),
    "q3_K": (quantize_q3_K, dequantize_q3_K, 256, 110),
    "q4_K": (quantize_q4_K, dequantize_q4_K, 256, 144),
    "q5_K": (quantize_q5_K, dequantize_q5_K, 256, 176),
    "q6_K": (quantize_q6_K, dequantize_q6_K, 256, 210),
    "tq1_0": (quantize_tq1_0, dequantize_tq1_0, 256, 54),
    "tq2_0": (quantize_tq2_0, dequantize_tq2_0, 256, 66),
}

#: ggml type name (``GGML_KERNELS``' keys) -> the ``code`` of :func:`ggml_error_sums`.
GGML_CODES = {k: i for i, k in enumerate(GGML_KERNELS)}

__all__ = [n for k in GGML_KERNELS for n in (f"quantize_{k}", f"dequantize_{k}")]
