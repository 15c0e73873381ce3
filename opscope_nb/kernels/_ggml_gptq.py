"""GPTQ rounding into ggml block types: llama.cpp's scales, error-compensated codes.

A ggml block stores scales (and, for some types, minimums) and one code per
weight; a weight decodes to ``s * level[code] + m`` with a per-weight scale
``s`` and offset ``m`` read from its block.  The ``+gptq`` twin of a ggml
type keeps the scales the type's own quantiser chose (:mod:`._ggml_quant`,
with the layer's ``diag(H)`` as importance, as llama.cpp's imatrix) and
replaces the round-to-nearest codes by GPTQ's (Frantar et al. 2022): the
columns are swept in order and each column's rounding error is pushed onto
the columns not yet rounded through the inverse Hessian's Cholesky factor.
The blocks keep the type's layout byte for byte (any ggml reader decodes
them); only the codes differ.

Per type two helpers, written from the layouts of the decoders in
:mod:`._ggml_quant`: ``_grid_<type>(b, o, s, m)`` reads the block at ``b[o:]``
into per-weight ``s`` / ``m`` (float32, the decoder's own products, so
``s * level + m`` is the decoded value bit for bit), and
``_setq_<type>(b, o, L)`` writes the level indices ``L`` into the block's
code fields (scales untouched).  :data:`GPTQ_LEVELS` gives each type's
levels.  No input validation here (:func:`opscope_nb.formats.ggml.quantize_gptq`).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ._ggml_quant import (_KVF, F, _get_f16, _get_scale_min_k4, _i8, _pack2, _pack5,
                          _pack_iq4_xs_qs)
from ._jit import njit_exact, njit_parallel_exact
from ._quant_probe import round_half_away

__all__ = ["ggml_grid", "ggml_set_codes", "ggml_gptq_sweep"]


# ------------------------------------------------------------------ grids
@njit_exact
def _grid_d(b, o, s, m):
    """Q8_0 / Q4_0 / Q5_0 / IQ4_NL: one fp16 ``d`` at the block's start."""
    d = _get_f16(b, o)
    for j in range(32):
        s[j] = d
        m[j] = F(0.0)


@njit_exact
def _grid_dm(b, o, s, m):
    """Q4_1 / Q5_1: fp16 ``d`` and ``m``."""
    d = _get_f16(b, o)
    mm = _get_f16(b, o + 2)
    for j in range(32):
        s[j] = d
        m[j] = mm


@njit_exact
def _grid_iq4_xs(b, o, s, m):
    d = _get_f16(b, o)
    sh = np.int64(b[o + 2]) | (np.int64(b[o + 3]) << 8)
    for ib in range(8):
        ls = ((b[o + 4 + ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * F(ls - 32)
        for j in range(32):
            s[32 * ib + j] = dl
            m[32 * ib + j] = F(0.0)


@njit_exact
def _grid_qk(b, o, s, m):
    """Q4_K / Q5_K: ``d * scale`` and ``-(dmin * min)`` per 32-sub-block."""
    d = _get_f16(b, o)
    dmin = _get_f16(b, o + 2)
    for j in range(8):
        sc, mn = _get_scale_min_k4(j, b, o + 4)
        dl = d * F(sc)
        ml = -(dmin * F(mn))
        for l in range(32):
            s[32 * j + l] = dl
            m[32 * j + l] = ml


@njit_exact
def _grid_q6_K(b, o, s, m):
    d = _get_f16(b, o + 208)
    for j in range(16):
        dl = d * F(_i8(np.int64(b[o + 192 + j])))
        for l in range(16):
            s[16 * j + l] = dl
            m[16 * j + l] = F(0.0)


@njit_exact
def _grid_q3_K(b, o, s, m):
    d = _get_f16(b, o + 108)
    for j in range(16):
        if j < 8:
            sc = b[o + 96 + j] & 0xF
        else:
            sc = b[o + 96 + j - 8] >> 4
        sc = (sc | (((b[o + 96 + 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        dl = d * F(sc)
        for l in range(16):
            s[16 * j + l] = dl
            m[16 * j + l] = F(0.0)


@njit_exact
def _grid_q2_K(b, o, s, m):
    d = _get_f16(b, o + 80)
    dmin = _get_f16(b, o + 82)
    for j in range(16):
        sc = b[o + j]
        dl = d * F(sc & 0xF)
        ml = -(dmin * F(sc >> 4))
        for l in range(16):
            s[16 * j + l] = dl
            m[16 * j + l] = ml


# ------------------------------------------------------------- code stores
@njit_exact
def _setq_q8_0(b, o, L):
    for j in range(32):
        b[o + 2 + j] = (L[j] - 128) & 0xFF


@njit_exact
def _setq_nib(b, o, L):
    """Q4_0 / Q4_1 / IQ4_NL nibbles at ``b[o:o+16]``: low = j, high = j + 16."""
    for j in range(16):
        b[o + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@njit_exact
def _setq_q4_K(b, o, L):
    for c in range(4):
        for l in range(32):
            b[o + 16 + 32 * c + l] = (L[64 * c + l] | (L[64 * c + 32 + l] << 4)) & 0xFF


@njit_exact
def _setq_q5_K(b, o, L):
    for l in range(32):
        h = 0
        for c in range(4):
            a = L[64 * c + l]
            z = L[64 * c + 32 + l]
            b[o + 48 + 32 * c + l] = ((a & 0xF) | ((z & 0xF) << 4)) & 0xFF
            h |= ((a >> 4) & 1) << (2 * c)
            h |= ((z >> 4) & 1) << (2 * c + 1)
        b[o + 16 + l] = h & 0xFF


@njit_exact
def _setq_q6_K(b, o, L):
    for h in range(2):
        for l in range(32):
            q0 = L[128 * h + l]
            q1 = L[128 * h + 32 + l]
            q2 = L[128 * h + 64 + l]
            q3 = L[128 * h + 96 + l]
            b[o + 64 * h + l] = ((q0 & 0xF) | ((q2 & 0xF) << 4)) & 0xFF
            b[o + 64 * h + 32 + l] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
            b[o + 128 + 32 * h + l] = ((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4)
                                       | ((q3 >> 4) << 6)) & 0xFF


@njit_exact
def _setq_q3_K(b, o, L):
    # level index c = q + 4 * hbit (value (c - 4) * scale): 2 low bits packed as
    # Q2_K's, the high bit in hmask[e % 32] bit e // 32
    lo = np.empty(256, np.int64)
    for j in range(32):
        b[o + j] = 0
    for e in range(256):
        lo[e] = L[e] & 3
        b[o + e % 32] = (b[o + e % 32] | ((L[e] >> 2) << (e // 32))) & 0xFF
    _pack2(lo, b, o + 32)


@njit_exact
def _setq_q2_K(b, o, L):
    _pack2(L, b, o + 16)


# --------------------------------------------------------------- row entries
@njit_exact
def _grid_row(code, b, s, m):
    """Per-weight scale and offset of one row's blocks ``b`` (int64 bytes) of
    ggml type ``code`` (:data:`._ggml_quant.GGML_CODES`)."""
    cols = s.shape[0]
    if code == 0:
        for ib in range(cols // 32):
            _grid_d(b, ib * 34, s[ib * 32:], m[ib * 32:])
    elif code == 1 or code == 5:
        for ib in range(cols // 32):
            _grid_d(b, ib * 18, s[ib * 32:], m[ib * 32:])
    elif code == 2:
        for ib in range(cols // 32):
            _grid_dm(b, ib * 20, s[ib * 32:], m[ib * 32:])
    elif code == 3:
        for ib in range(cols // 32):
            _grid_d(b, ib * 22, s[ib * 32:], m[ib * 32:])
    elif code == 4:
        for ib in range(cols // 32):
            _grid_dm(b, ib * 24, s[ib * 32:], m[ib * 32:])
    elif code == 6:
        for ib in range(cols // 256):
            _grid_iq4_xs(b, ib * 136, s[ib * 256:], m[ib * 256:])
    elif code == 7:
        for ib in range(cols // 256):
            _grid_q2_K(b, ib * 84, s[ib * 256:], m[ib * 256:])
    elif code == 8:
        for ib in range(cols // 256):
            _grid_q3_K(b, ib * 110, s[ib * 256:], m[ib * 256:])
    elif code == 9:
        for ib in range(cols // 256):
            _grid_qk(b, ib * 144, s[ib * 256:], m[ib * 256:])
    elif code == 10:
        for ib in range(cols // 256):
            _grid_qk(b, ib * 176, s[ib * 256:], m[ib * 256:])
    else:
        for ib in range(cols // 256):
            _grid_q6_K(b, ib * 210, s[ib * 256:], m[ib * 256:])


@njit_exact
def _setq_row(code, b, L):
    """Write level indices ``L`` (int64 ``[cols]``) into one row's blocks ``b``."""
    cols = L.shape[0]
    if code == 0:
        for ib in range(cols // 32):
            _setq_q8_0(b, ib * 34, L[ib * 32:])
    elif code == 1 or code == 5:
        for ib in range(cols // 32):
            _setq_nib(b, ib * 18 + 2, L[ib * 32:])
    elif code == 2:
        for ib in range(cols // 32):
            _setq_nib(b, ib * 20 + 4, L[ib * 32:])
    elif code == 3:
        for ib in range(cols // 32):
            _pack5(L[ib * 32:], b, ib * 22 + 2)
    elif code == 4:
        for ib in range(cols // 32):
            _pack5(L[ib * 32:], b, ib * 24 + 4)
    elif code == 6:
        for ib in range(cols // 256):
            _pack_iq4_xs_qs(L[ib * 256:], b, ib * 136)
    elif code == 7:
        for ib in range(cols // 256):
            _setq_q2_K(b, ib * 84, L[ib * 256:])
    elif code == 8:
        for ib in range(cols // 256):
            _setq_q3_K(b, ib * 110, L[ib * 256:])
    elif code == 9:
        for ib in range(cols // 256):
            _setq_q4_K(b, ib * 144, L[ib * 256:])
    elif code == 10:
        for ib in range(cols // 256):
            _setq_q5_K(b, ib * 176, L[ib * 256:])
    else:
        for ib in range(cols // 256):
            _setq_q6_K(b, ib * 210, L[ib * 256:])


@njit_parallel_exact
def ggml_grid(data, code, cols):
    """Per-weight ``(s, m)`` (float32 ``[rows, cols]`` each) of ggml blocks
    ``data`` (uint8 ``[rows, row bytes]``) of type ``code``: weight ``c`` of
    row ``r`` decodes to ``s[r, c] * level + m[r, c]``.  Rows in parallel."""
    rows = data.shape[0]
    s = np.empty((rows, cols), np.float32)
    m = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        _grid_row(code, data[r].astype(np.int64), s[r], m[r])
    return s, m


@njit_parallel_exact
def ggml_set_codes(data, code, levels):
    """A copy of ggml blocks ``data`` (uint8 ``[rows, row bytes]``, type
    ``code``) with every code replaced by the level index ``levels`` (int16
    ``[rows, cols]``); scales and minimums kept.  Rows in parallel."""
    rows, cols = levels.shape
    out = np.empty_like(data)
    for r in prange(rows):
        b = data[r].astype(np.int64)
        _setq_row(code, b, levels[r].astype(np.int64))
        for k in range(b.shape[0]):
            out[r, k] = np.uint8(b[k])
    return out


@njit_exact
def _nearest_level(x, s, m, lev, uniform):
    """Index of the level whose ``s * lev + m`` is nearest ``x`` (float64);
    ``uniform``: ``lev`` is ``lev[0], lev[0] + 1, ...`` (round, clamp), else
    sorted (a scan).  ``s == 0``: every level decodes to ``m``; the one
    nearest 0 is taken."""
    n = lev.shape[0]
    if s == 0.0:
        t = 0.0
    else:
        t = (x - np.float64(m)) / np.float64(s)
    if uniform:
        # float64 throughout: a float32 cast could move a value just below a
        # half onto it
        k = np.int64(round_half_away(min(max(t, -1e6), 1e6))) - np.int64(lev[0])
        return min(max(k, 0), n - 1)
    best = 0
    bd = abs(t - np.float64(lev[0]))
    for k in range(1, n):
        dd = abs(t - np.float64(lev[k]))
        if dd < bd:
            bd = dd
            best = k
    return best


@njit_exact
def ggml_gptq_sweep(w, u, perm, s, m, lev, uniform, block):
    """GPTQ's column sweep onto fixed ggml grids.

    Sweep position ``i`` is original column ``c = perm[i]``: ``k`` = the level
    index nearest ``w[r, i]`` on weight ``(r, c)``'s grid
    (:func:`_nearest_level`), ``q = float32(s[r, c] * lev[k]) + m[r, c]`` (the
    decoded value), ``e_r = (w[r, i] - q) / u[i, i]`` and ``w[r, j] -= e_r *
    u[i, j]`` for ``j > i``; updates beyond the current block of ``block``
    columns are applied at the block's end as one matrix product (as
    :func:`opscope_nb.kernels._gptq_round.gptq_core`).

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float64, C-contiguous
        Weights with columns in sweep order; **overwritten**.
    u : ndarray of shape (cols, cols), float64
        Upper Cholesky factor of the dampened inverse Hessian in sweep order.
    perm : ndarray of shape (cols,), int64
        Sweep position -> original column.
    s, m : ndarray of shape (rows, cols), float32
        Per-weight scale and offset in the original column order (:func:`ggml_grid`).
    lev : ndarray of shape (n,), float32
        The type's levels, ascending.
    uniform : bool
        ``lev`` is consecutive integers.
    block : int
        Lazy-update width, ``>= 1``.

    Returns
    -------
    ndarray of shape (rows, cols), int16
        Level indices in the original column order.
    """
    rows, cols = w.shape
    codes = np.empty((rows, cols), dtype=np.int16)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        err = np.empty((rows, b1 - b0), dtype=np.float64)
        for i in range(b0, b1):
            c = perm[i]
            d = u[i, i]
            for r in range(rows):
                sc = s[r, c]
                mm = m[r, c]
                k = _nearest_level(w[r, i], sc, mm, lev, uniform)
                codes[r, c] = np.int16(k)
                q = F(sc * lev[k]) + mm
                e = (w[r, i] - np.float64(q)) / d
                err[r, i - b0] = e
                for j in range(i + 1, b1):
                    w[r, j] -= e * u[i, j]
        if b1 < cols:
            w[:, b1:] -= err @ np.ascontiguousarray(u[b0:b1, b1:])
    return codes


def _uniform(lo, n):
    return np.arange(lo, lo + n, dtype=np.float32)


#: ggml type name (``GGML_KERNELS``' keys) -> ``(levels float32, uniform)``:
#: the values a code decodes to before its scale and offset.
GPTQ_LEVELS = {
    "q8_0": (_uniform(-128, 256), True),
    "q4_0": (_uniform(-8, 16), True),
    "q4_1": (_uniform(0, 16), True),
    "q5_0": (_uniform(-16, 32), True),
    "q5_1": (_uniform(0, 32), True),
    "iq4_nl": (_KVF.copy(), False),
    "iq4_xs": (_KVF.copy(), False),
    "q2_K": (_uniform(0, 4), True),
    "q3_K": (_uniform(-4, 8), True),
    "q4_K": (_uniform(0, 16), True),
    "q5_K": (_uniform(0, 32), True),
    "q6_K": (_uniform(-32, 64), True),
}
