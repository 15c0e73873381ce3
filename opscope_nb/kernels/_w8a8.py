"""Matmul ``@njit`` cores: dense reference, sparse-skip, factored, int8.

Layouts (every array C-contiguous):

* activations ``x[m, k]`` (float32) or ``xq[m, k]`` (int8);
* reference weights ``w[k, n]`` (``y = x @ w``);
* output-major, weight-stationary weights ``wt[n, k]`` (float32) or
  ``wtq[n, k]`` (int8) with one float32 scale per output ``scale[n]``;
* outputs ``y[m, n]`` float32 (int32 for :func:`matmul_i8i8_i32`).

Quantisation (weights per output column, activations per row or per tensor)
is symmetric: ``scale = amax / 127``, ``code = clamp(round_half_away(v /
scale), -127, 127)``, and ``scale = 1`` when ``amax < 1e-20``.  The division
is a correctly rounded float32 division (the package compiles without
``arcp``), so codes match NumPy's ``x / scale`` bit for bit.

Numerics of the weight-stationary kernels:

* ``matmul_f32``: float32 dot products, 8-lane fused multiply-add, tree
  reduction at the end of each dot product;
* ``matmul_w8a16``: int8 weights, activations carried as per-row int16 codes
  (:func:`quantize_rows_i16`; relative rounding ~1.5e-5 of the row maximum),
  exact integer sums (int32 lanes, reduced in float64), dequantised once;
* ``matmul_w8a8``: int8 x int8, exact int32 sums (:func:`matmul_i8i8_i32`),
  dequantised once with ``sx[i] * scale[j]``.

Parallelism: output blocks of four run in parallel (``prange``); each block
walks the rows two at a time with a 2-row x 4-output register tile from
:mod:`._simd` (W8A8: four at a time with a 4 x 4 tile first), so the block's
weights are loaded once per group of rows and stay in L1/L2 across all rows
(decode, ``m == 1``, uses the 1 x 4 tile).  A
call whose work ``m * k * n`` is below ``min_parallel`` runs on the calling
thread.  The work split never depends on the thread count, and every output
is computed by one thread in a fixed order, so results are reproducible.
(The W8A8 prefill also has a row-split schedule, chosen from the thread
count -- :func:`_w8a8_row_plan` -- whose results equal the output split's
bit for bit: exact integer sums, the same float finish.)

These cores assume valid input (see each docstring); they only check shape
agreement, in O(1), with constant messages.  (numba keys its on-disk cache
on each function's own file; ``_config`` drops the package's cache whenever
any source file changes, so an edit of ``_simd.py`` is never masked.)
"""
from __future__ import annotations

import functools

import numpy as np
import numba
from llvmlite import ir as _llir
from numba import prange, types
from numba.core import cgutils
from ._jit import intrinsic

from ._jit import njit, njit_parallel
from ._quant_probe import absmax_f32, div_f32, round_half_away, sym_scale
from ._simd import (
    F32_CHUNK,
    I8_CHUNK,
    i8dot_raw_tile_4x4,
    i8dot_rawc_tile_4x4,
    f32dot_tile_1x1,
    f32dot_tile_1x4,
    f32dot_tile_2x4,
    i8dot_tile_1x1,
    i8dot_tile_1x4,
    i8dot_tile_2x1,
    i8dot_tile_2x4,
    W16_CHUNK,
    w16dot_tile_1x1,
    w16dot_tile_1x4,
    w16dot_tile_2x1,
    w16dot_tile_2x4,
    I8_PANEL,
    I8_PANEL_CORR,
    I8_PANEL_J,
    I8_PANEL_LANES,
    panel_pack8,
    i8panel_tile_16,
    i8panel_tile_32,
    i8panel_ttile_16,
    i8panel_ttile_32,
    f32_transpose8,
)

__all__ = [
    "dense_matmul",
    "sparse_skip_matmul",
    "factored_matmul",
    "quant_matmul",
    "transpose",
    "quantize_cols_t",
    "quantize_rows_i8",
    "quantize_row_i8",
    "quantize_rows_i16",
    "a16_levels",
    "matmul_f32",
    "matmul_w8a16",
    "matmul_w8a8",
    "dynamic_matmul_w8a8",
    "I8_ROWSPLIT_MAX_W",
    "I8_PANEL_MIN_M",
    "w8a8_prefill_kw",
    "matmul_i8i8_i32",
    "pack_i8_panel",
    "i8_row_sums",
]

#: Outputs per column block (the C of the register tiles).
_NB = 4
#: Default work size (``m * k * n`` multiply-adds) below which a kernel runs on
#: the calling thread: a parallel launch costs microseconds and, on a busy
#: machine, a time slice.  Every kernel takes it as the ``min_parallel``
#: argument, so callers can change it without recompiling.
PAR_MIN = 1 << 17
#: Number of contiguous column-block chunks a parallel kernel splits into:
#: a fixed count (never the thread count, so the split -- and every result --
#: is the same on any machine), enough to balance 2-16 threads.
_NCHUNK = 16


@njit
def _chunks(nb):
    return min(nb, _NCHUNK)


# Callees get ``np.int64(0)`` / ``np.int64(i)``, never a bare ``0`` or a
# ``prange`` index, and no global such as ``PAR_MIN`` as an argument: numba
# compiles an ``@njit`` callee once per argument *type*, and a literal
# (``Literal[int](0)``) or a ``prange`` index (``uint64``) beside the ``int64``
# of the parallel path compiled the block functions, with all they inline, twice.


#: Largest k for which int8 x int8 sums of codes in [-127, 127] are exact in
#: int32 (k * 127^2 < 2^31); the cores raise ValueError above it.
I8_MAX_K = 133144


# --------------------------------------------------------------------------
# reference / structured float kernels
# --------------------------------------------------------------------------
@njit
def _axpy_chain(yi, xi, idx, cnt, w):
    """``yi[:] += sum_t xi[idx[t]] * w[idx[t], :]`` for ``t < cnt``, in order.

    Four selected weight rows per sweep over ``yi`` (a quarter of its
    loads/stores); the chain ``((y + a0 w0) + a1 w1) + ...`` keeps the order
    of the sums, so the dense and zero-skipping products stay bit-identical.
    """
    n = w.shape[1]
    t = 0
    while t + 4 <= cnt:
        p0 = idx[t]
        p1 = idx[t + 1]
        p2 = idx[t + 2]
        p3 = idx[t + 3]
        a0 = xi[p0]
        a1 = xi[p1]
        a2 = xi[p2]
        a3 = xi[p3]
        w0 = w[p0]
        w1 = w[p1]
        w2 = w[p2]
        w3 = w[p3]
        for j in range(n):
            v = yi[j] + a0 * w0[j]
            v = v + a1 * w1[j]
            v = v + a2 * w2[j]
            yi[j] = v + a3 * w3[j]
        t += 4
    while t < cnt:
        p = idx[t]
        a = xi[p]
        wp = w[p]
        for j in range(n):
            yi[j] += a * wp[j]
        t += 1


@njit
def _dense_rows(x, w, y, i0, i1):
    """Rows ``i0..i1-1`` of ``y = x @ w`` (``y`` zeroed by the caller)."""
    k = x.shape[1]
    idx = np.arange(k)
    for i in range(i0, i1):
        _axpy_chain(y[i], x[i], idx, k, w)


@njit_parallel
def dense_matmul(x, w, min_parallel=PAR_MIN):
    """Reference dense product ``y[m, n] = x[m, k] @ w[k, n]``.

    Each output accumulates over ``p = 0..k-1`` in order (``y[i, :] +=
    x[i, p] * w[p, :]``, four ``p`` per sweep, vectorised along ``n``); rows
    run in parallel, so the result does not depend on the thread count.

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous
    w : ndarray of float32, shape (k, n), C-contiguous
    min_parallel : int, optional
        Below ``m * k * n`` multiply-adds of this size the call stays on the
        calling thread (a parallel launch costs more than it saves).

    Returns
    -------
    ndarray of float32, shape (m, n)

    Notes
    -----
    No input validation beyond the shape agreement.
    """
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError("dense_matmul: x.shape[1] must equal w.shape[0]")
    n = w.shape[1]
    y = np.zeros((m, n), dtype=np.float32)
    if m < 2 or m * k * n < min_parallel:
        _dense_rows(x, w, y, np.int64(0), m)
    else:
        for i in prange(m):
            _dense_rows(x, w, y, np.int64(i), np.int64(i) + 1)
    return y


@njit
def _sparse_rows(x, w, y, i0, i1):
    """Rows ``i0..i1-1`` of the zero-skipping product (``y`` zeroed)."""
    k = x.shape[1]
    idx = np.empty(k, dtype=np.intp)
    for i in range(i0, i1):
        nnz = 0
        xi = x[i]
        for p in range(k):
            if xi[p] != 0.0:
                idx[nnz] = p
                nnz += 1
        _axpy_chain(y[i], xi, idx, nnz, w)


@njit_parallel
def sparse_skip_matmul(x, w, min_parallel=PAR_MIN):
    """``y[m, n] = x[m, k] @ w[k, n]`` touching only rows ``p`` of ``w`` with
    ``x[i, p] != 0``.

    Per row, the non-zero positions are gathered first, then each selected
    weight row is added (``y[i, :] += x[i, p] * w[p, :]``, vectorised along
    ``n``).  The sums are those of :func:`dense_matmul` in the same order with
    the zero terms left out, so the result equals the dense one (a skipped
    term only ever adds ``+-0``).

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous
        Activations, mostly zero for a speed-up (cost ~ nnz(x) * n).
    w : ndarray of float32, shape (k, n), C-contiguous
    min_parallel : int, optional
        Below ``m * k * n`` of this size the call stays on the calling thread.

    Returns
    -------
    ndarray of float32, shape (m, n)

    Notes
    -----
    No input validation beyond the shape agreement.
    """
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError("sparse_skip_matmul: x.shape[1] must equal w.shape[0]")
    n = w.shape[1]
    y = np.zeros((m, n), dtype=np.float32)
    if m < 2 or m * k * n < min_parallel:
        _sparse_rows(x, w, y, np.int64(0), m)
    else:
        nch = min(m, 16)
        for c in prange(nch):
            _sparse_rows(x, w, y, c * m // nch, (c + 1) * m // nch)
    return y


@njit
def factored_matmul(x, u, v):
    """Low-rank product ``y[m, n] = (x[m, k] @ u[k, r]) @ v[r, n]``.

    Cost ``m * r * (k + n)`` instead of ``m * k * n``; both products use
    :func:`dense_matmul`.

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous
    u : ndarray of float32, shape (k, r), C-contiguous
    v : ndarray of float32, shape (r, n), C-contiguous

    Returns
    -------
    ndarray of float32, shape (m, n)
    """
    if u.shape[0] != x.shape[1] or v.shape[0] != u.shape[1]:
        raise ValueError("factored_matmul: shapes must chain x[m,k] @ u[k,r] @ v[r,n]")
    return dense_matmul(dense_matmul(x, u), v)


# --------------------------------------------------------------------------
# quantisers
# --------------------------------------------------------------------------
@njit
def _code(v, scale):
    """int8 code of ``v``: ``clamp(round_half_away(v / scale), -127, 127)``."""
    r = round_half_away(div_f32(v, scale))
    if r > 127.0:
        r = np.float32(127.0)
    elif r < -127.0:
        r = np.float32(-127.0)
    return np.int8(r)


@njit_parallel
def transpose(w):
    """``wt[n, k] = w[k, n].T`` as a new C-contiguous array (blocked copy).

    Parameters
    ----------
    w : ndarray, shape (k, n), C-contiguous

    Returns
    -------
    ndarray, shape (n, k), same dtype, C-contiguous
    """
    k, n = w.shape
    wt = np.empty((n, k), dtype=w.dtype)
    bs = 64
    nb = (n + bs - 1) // bs
    for jb in prange(nb):
        j0 = jb * bs
        j1 = min(j0 + bs, n)
        for p0 in range(0, k, bs):
            p1 = min(p0 + bs, k)
            for j in range(j0, j1):
                for p in range(p0, p1):
                    wt[j, p] = w[p, j]
    return wt


@njit_parallel
def quantize_cols_t(w):
    """Per-output-column int8 quantisation of ``w[k, n]``, stored transposed.

    Parameters
    ----------
    w : ndarray of float32, shape (k, n), C-contiguous, finite

    Returns
    -------
    wtq : ndarray of int8, shape (n, k)
        Output-major codes: ``wtq[j, p] = code(w[p, j] / scale[j])``.
    scale : ndarray of float32, shape (n,)
        ``amax_j / 127`` over column ``j`` (1 for an all-zero column).
    """
    wt = transpose(w)
    n, k = wt.shape
    wtq = np.empty((n, k), dtype=np.int8)
    scale = np.empty(n, dtype=np.float32)
    for j in prange(n):
        amax = absmax_f32(wt[j], np.int64(0), k)
        s = sym_scale(amax, 127)
        scale[j] = s
        for p in range(k):
            wtq[j, p] = _code(wt[j, p], s)
    return wtq, scale


@njit
def _q8_rows(x, xq, sx, i0, i1):
    # the steps of _code written without branches on the value (floor, one
    # compare-select, min, sign select): same codes, about 20 % faster per
    # row (32 x 1024, one Zen 4 core: 9.6 -> 7.7 us)
    k = x.shape[1]
    for i in range(i0, i1):
        amax = absmax_f32(x[i], np.int64(0), k)
        s = sym_scale(amax, 127)
        sx[i] = s
        for p in range(k):
            q = div_f32(x[i, p], s)
            a = abs(q)
            t = np.floor(a)
            t = t + np.float32(1.0) if a - t >= np.float32(0.5) else t
            t = min(t, np.float32(127.0))
            xq[i, p] = np.int8(t) if q >= np.float32(0.0) else np.int8(-t)


@njit
def quantize_rows_i8(x, min_parallel=PAR_MIN):
    """Per-row int8 quantisation (the W8A8 activations).

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous, finite
    min_parallel : int, optional
        Below ``m * k * 16`` of this size the call stays on the calling thread.

    Returns
    -------
    xq : ndarray of int8, shape (m, k)
    sx : ndarray of float32, shape (m,)
        ``amax_i / 127`` over row ``i`` (1 for an all-zero row).
    """
    m, k = x.shape
    xq = np.empty((m, k), dtype=np.int8)
    sx = np.empty(m, dtype=np.float32)
    _quantize_rows_into(x, xq, sx, np.int64(min_parallel))   # (no literal: see _w8a8_float)
    return xq, sx


@njit_parallel
def _quantize_rows_into(x, xq, sx, min_parallel):
    """:func:`quantize_rows_i8` into the caller's ``xq[m, k]`` / ``sx[m]``."""
    _q8_par(x, xq, sx, min_parallel)


@njit(inline="always")
def _q8_par(x, xq, sx, min_parallel):
    """:func:`quantize_rows_i8`'s loop, inlined into the caller: a parallel
    entry that quantises its own activations runs this prange in its own
    parallel region (no second parallel function to compile)."""
    m, k = x.shape
    if m < 2 or m * k * 16 < min_parallel:
        _q8_rows(x, xq, sx, np.int64(0), m)
    else:
        for i in prange(m):
            _q8_rows(x, xq, sx, np.int64(i), np.int64(i) + 1)


@njit
def quantize_row_i8(x):
    """Per-tensor int8 quantisation (one scale for the whole array).

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous, finite

    Returns
    -------
    xq : ndarray of int8, shape (m, k)
    s : float32
        ``amax / 127`` over all of ``x`` (1 for an all-zero array).
    """
    m, k = x.shape
    amax = np.float32(0.0)
    for i in range(m):
        amax = max(amax, absmax_f32(x[i], np.int64(0), k))
    s = sym_scale(amax, 127)
    xq = np.empty((m, k), dtype=np.int8)
    for i in range(m):
        for p in range(k):
            xq[i, p] = _code(x[i, p], s)
    return xq, s


# --------------------------------------------------------------------------
# float32 and W8A16 weight-stationary kernels
# --------------------------------------------------------------------------
@njit
def _tail_dot(xf, xo, wf, wo, p0, k):
    """Scalar float32 dot over elements ``p0..k-1`` (a tile's tail); int8
    codes in ``wf`` are widened exactly."""
    a = np.float32(0.0)
    for p in range(p0, k):
        a += xf[xo + p] * np.float32(wf[wo + p])
    return a


@njit
def _float_block(xf, m, k, wf, wo, j0, j1, y):
    """float32 outputs ``j0..j1-1`` (at most 4) of every row of flat
    ``xf[m, k]``; ``wf`` is a flat output-major float32 array whose row ``j``
    starts at ``wo + (j - j0) * k``.  2 x 4 register tiles, a 1 x 4 tile for
    an odd last row."""
    nch = k // F32_CHUNK
    kv = nch * F32_CHUNK
    tail = kv < k
    c = j1 - j0
    w1 = wo + k
    w2 = w1 + k
    w3 = w2 + k
    if c == 4:
        i = 0
        while i + 2 <= m:
            xo = i * k
            x1 = xo + k
            a0, a1, a2, a3, b0, b1, b2, b3 = f32dot_tile_2x4(xf, xo, k, wf, wo, k, nch)
            if tail:
                a0 += _tail_dot(xf, xo, wf, wo, kv, k)
                a1 += _tail_dot(xf, xo, wf, w1, kv, k)
                a2 += _tail_dot(xf, xo, wf, w2, kv, k)
                a3 += _tail_dot(xf, xo, wf, w3, kv, k)
                b0 += _tail_dot(xf, x1, wf, wo, kv, k)
                b1 += _tail_dot(xf, x1, wf, w1, kv, k)
                b2 += _tail_dot(xf, x1, wf, w2, kv, k)
                b3 += _tail_dot(xf, x1, wf, w3, kv, k)
            y[i, j0] = a0
            y[i, j0 + 1] = a1
            y[i, j0 + 2] = a2
            y[i, j0 + 3] = a3
            y[i + 1, j0] = b0
            y[i + 1, j0 + 1] = b1
            y[i + 1, j0 + 2] = b2
            y[i + 1, j0 + 3] = b3
            i += 2
        if i < m:
            xo = i * k
            a0, a1, a2, a3 = f32dot_tile_1x4(xf, xo, k, wf, wo, k, nch)
            if tail:
                a0 += _tail_dot(xf, xo, wf, wo, kv, k)
                a1 += _tail_dot(xf, xo, wf, w1, kv, k)
                a2 += _tail_dot(xf, xo, wf, w2, kv, k)
                a3 += _tail_dot(xf, xo, wf, w3, kv, k)
            y[i, j0] = a0
            y[i, j0 + 1] = a1
            y[i, j0 + 2] = a2
            y[i, j0 + 3] = a3
    else:
        for i in range(m):
            xo = i * k
            for q in range(c):
                v = f32dot_tile_1x1(xf, xo, k, wf, wo + q * k, k, nch)[0]
                if tail:
                    v += _tail_dot(xf, xo, wf, wo + q * k, kv, k)
                y[i, j0 + q] = v


@njit
def _f32_blocks(xf, m, k, wf, n, y, b0, b1):
    for b in range(b0, b1):
        j0 = b * _NB
        _float_block(xf, m, k, wf, j0 * k, j0, min(j0 + _NB, n), y)


@njit_parallel
def matmul_f32(x, wt, min_parallel=PAR_MIN):
    """``y[m, n] = x[m, k] @ wt[n, k].T`` (weight-stationary float32).

    Output blocks of four run in parallel; each block walks the rows two at
    a time with a 2-row x 4-output register tile (``f32dot_tile_2x4``), so
    the block's weights are loaded once per pair of rows and stay in cache
    across all rows.  Decode (``m == 1``) uses the 1 x 4 tile.

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous
    wt : ndarray of float32, shape (n, k), C-contiguous (output-major)
    min_parallel : int, optional
        Below ``m * k * n`` of this size the call stays on the calling thread.

    Returns
    -------
    ndarray of float32, shape (m, n)
    """
    m, k = x.shape
    if wt.shape[1] != k:
        raise ValueError("matmul_f32: x.shape[1] must equal wt.shape[1]")
    n = wt.shape[0]
    y = np.empty((m, n), dtype=np.float32)
    xf = x.ravel()
    wf = wt.ravel()
    nb = (n + _NB - 1) // _NB
    if m * k * n < min_parallel:
        _f32_blocks(xf, m, k, wf, n, y, np.int64(0), nb)
    else:
        nc = _chunks(nb)
        for c in prange(nc):
            _f32_blocks(xf, m, k, wf, n, y, c * nb // nc, (c + 1) * nb // nc)
    return y


@njit
def a16_levels(k):
    """int16 activation levels for W8A16 at depth ``k``.

    32767, or fewer when ``k > 4128`` so that every int32 lane of the
    ``w16dot`` tiles (which adds ``k / 8`` products ``|x| * 127``) stays exact:
    ``levels * 127 * ceil(k / 8) < 2**31``.
    """
    per_lane = (k + 7) // 8
    lv = 2147483647 // (127 * max(per_lane, 1))
    return min(32767, max(lv, 1))


@njit
def _q16_rows(x, lv, xq, sx, i0, i1):
    k = x.shape[1]
    for i in range(i0, i1):
        amax = absmax_f32(x[i], np.int64(0), k)
        s = sym_scale(amax, lv)
        sx[i] = s
        for p in range(k):
            r = round_half_away(div_f32(x[i, p], s))
            if r > lv:
                r = lv
            elif r < -lv:
                r = -lv
            xq[i, p] = np.int16(r)


@njit_parallel
def quantize_rows_i16(x, levels, min_parallel=PAR_MIN):
    """Per-row symmetric int16 codes of the W8A16 activations.

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous, finite
    levels : int
        Largest code (``a16_levels(k)``), at most 32767.
    min_parallel : int, optional
        Below ``m * k * 16`` of this size the call stays on the calling thread.

    Returns
    -------
    xq : ndarray of int16, shape (m, k)
        ``clamp(round_half_away(x / s), -levels, levels)``.
    sx : ndarray of float32, shape (m,)
        ``amax_i / levels`` (1 for an all-zero row).
    """
    m, k = x.shape
    xq = np.empty((m, k), dtype=np.int16)
    sx = np.empty(m, dtype=np.float32)
    _q16_par(x, np.float32(levels), xq, sx, min_parallel)
    return xq, sx


@njit(inline="always")
def _q16_par(x, lv, xq, sx, min_parallel):
    """:func:`quantize_rows_i16`'s loop (``lv`` float32 levels), inlined into
    the caller as :func:`_q8_par`."""
    m, k = x.shape
    if m < 2 or m * k * 16 < min_parallel:
        _q16_rows(x, lv, xq, sx, np.int64(0), m)
    else:
        for i in prange(m):
            _q16_rows(x, lv, xq, sx, np.int64(i), np.int64(i) + 1)


@njit
def _w16_tail(xf, xo, wf, wo, p0, k):
    a = np.int64(0)
    for p in range(p0, k):
        a += np.int64(xf[xo + p]) * np.int64(wf[wo + p])
    return np.float64(a)


@njit
def _w16_block(xf, m, k, wf, j0, j1, sx, scale, y):
    """W8A16 outputs ``j0..j1-1`` (at most 4) of every row: exact integer
    sums of int16 activation codes ``xf`` and int8 weight codes ``wf``
    (flat, output-major), dequantised with ``sx[i] * scale[j]``."""
    nch = k // W16_CHUNK
    kv = nch * W16_CHUNK
    tail = kv < k
    c = j1 - j0
    wo = j0 * k
    w1 = wo + k
    w2 = w1 + k
    w3 = w2 + k
    if c == 4:
        s0 = np.float64(scale[j0])
        s1 = np.float64(scale[j0 + 1])
        s2 = np.float64(scale[j0 + 2])
        s3 = np.float64(scale[j0 + 3])
        i = 0
        while i + 2 <= m:
            xo = i * k
            x1 = xo + k
            a0, a1, a2, a3, b0, b1, b2, b3 = w16dot_tile_2x4(xf, xo, k, wf, wo, k, nch)
            if tail:
                a0 += _w16_tail(xf, xo, wf, wo, kv, k)
                a1 += _w16_tail(xf, xo, wf, w1, kv, k)
                a2 += _w16_tail(xf, xo, wf, w2, kv, k)
                a3 += _w16_tail(xf, xo, wf, w3, kv, k)
                b0 += _w16_tail(xf, x1, wf, wo, kv, k)
                b1 += _w16_tail(xf, x1, wf, w1, kv, k)
                b2 += _w16_tail(xf, x1, wf, w2, kv, k)
                b3 += _w16_tail(xf, x1, wf, w3, kv, k)
            ra = np.float64(sx[i])
            rb = np.float64(sx[i + 1])
            y[i, j0] = np.float32(a0 * ra * s0)
            y[i, j0 + 1] = np.float32(a1 * ra * s1)
            y[i, j0 + 2] = np.float32(a2 * ra * s2)
            y[i, j0 + 3] = np.float32(a3 * ra * s3)
            y[i + 1, j0] = np.float32(b0 * rb * s0)
            y[i + 1, j0 + 1] = np.float32(b1 * rb * s1)
            y[i + 1, j0 + 2] = np.float32(b2 * rb * s2)
            y[i + 1, j0 + 3] = np.float32(b3 * rb * s3)
            i += 2
        if i < m:
            xo = i * k
            a0, a1, a2, a3 = w16dot_tile_1x4(xf, xo, k, wf, wo, k, nch)
            if tail:
                a0 += _w16_tail(xf, xo, wf, wo, kv, k)
                a1 += _w16_tail(xf, xo, wf, w1, kv, k)
                a2 += _w16_tail(xf, xo, wf, w2, kv, k)
                a3 += _w16_tail(xf, xo, wf, w3, kv, k)
            ra = np.float64(sx[i])
            y[i, j0] = np.float32(a0 * ra * s0)
            y[i, j0 + 1] = np.float32(a1 * ra * s1)
            y[i, j0 + 2] = np.float32(a2 * ra * s2)
            y[i, j0 + 3] = np.float32(a3 * ra * s3)
    else:
        for q in range(c):
            woq = wo + q * k
            sq = np.float64(scale[j0 + q])
            i = 0
            while i + 2 <= m:
                xo = i * k
                a0, b0 = w16dot_tile_2x1(xf, xo, k, wf, woq, k, nch)
                if tail:
                    a0 += _w16_tail(xf, xo, wf, woq, kv, k)
                    b0 += _w16_tail(xf, xo + k, wf, woq, kv, k)
                y[i, j0 + q] = np.float32(a0 * np.float64(sx[i]) * sq)
                y[i + 1, j0 + q] = np.float32(b0 * np.float64(sx[i + 1]) * sq)
                i += 2
            if i < m:
                xo = i * k
                a0 = w16dot_tile_1x1(xf, xo, k, wf, woq, k, nch)[0]
                if tail:
                    a0 += _w16_tail(xf, xo, wf, woq, kv, k)
                y[i, j0 + q] = np.float32(a0 * np.float64(sx[i]) * sq)


@njit
def _w16_blocks(xf, m, k, wf, n, sx, scale, y, b0, b1):
    for b in range(b0, b1):
        j0 = b * _NB
        _w16_block(xf, m, k, wf, j0, min(j0 + _NB, n), sx, scale, y)


@njit_parallel
def matmul_w8a16(x, wtq, scale, min_parallel=PAR_MIN):
    """W8A16: int8 weights, 16-bit activations, float32 in and out.

    ``y[i, j] ~= (sum_p x[i, p] * wtq[j, p]) * scale[j]``, computed as
    ``(sum_p xq[i, p] * wtq[j, p]) * sx[i] * scale[j]`` where ``xq, sx =
    quantize_rows_i16(x, a16_levels(k))``: the activations are carried as
    per-row int16 codes (relative rounding ~1.5e-5 of the row's max, far
    below the int8 weight error) so the dot products run on the integer
    ``vpmaddwd`` path, exact in int32 lanes and reduced in float64.  Weights
    are 4x fewer bytes than float32.

    Accuracy against the float-activation formula ``(x @ wtq.T) * scale``
    (relative L2, measured by ``tests/test_matmul.py::
    test_w8a16_error_with_outlier_channels``, n = 8, 4 rows): the int16 step
    is ``row max / a16_levels(k)``, and the levels shrink above k = 4128
    (9436 at k = 14336), so the error grows with outliers and with k --
    Gaussian rows: 3.2e-5 at k = 4096, 1.4e-4 at k = 14336; with 100x outlier
    channels (0.1 % / 1 % of k): 2.8e-4 / 2.6e-4 at k = 4096, 1.7e-3 / 5.5e-4
    at k = 14336.  All far below the int8 weight error (~1e-2).

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous, finite
    wtq : ndarray of int8, shape (n, k), C-contiguous (output-major codes)
    scale : ndarray of float32, shape (n,)
    min_parallel : int, optional
        Below ``m * k * n`` of this size the call stays on the calling thread.

    Returns
    -------
    ndarray of float32, shape (m, n)
    """
    m, k = x.shape
    if wtq.shape[1] != k or scale.shape[0] != wtq.shape[0]:
        raise ValueError("matmul_w8a16: need x[m,k], wtq[n,k], scale[n]")
    n = wtq.shape[0]
    xq, sx = quantize_rows_i16(x, a16_levels(k), min_parallel)
    y = np.empty((m, n), dtype=np.float32)
    xf = xq.ravel()
    wf = wtq.ravel()
    nb = (n + _NB - 1) // _NB
    if m * k * n < min_parallel:
        _w16_blocks(xf, m, k, wf, n, sx, scale, y, np.int64(0), nb)
    else:
        nc = _chunks(nb)
        for c in prange(nc):
            _w16_blocks(xf, m, k, wf, n, sx, scale, y, c * nb // nc, (c + 1) * nb // nc)
    return y


# --------------------------------------------------------------------------
# int8 x int8 (W8A8)
# --------------------------------------------------------------------------
@njit
def _i8_tail(xf, xo, wf, wo, p0, k):
    """Scalar int32 dot over elements ``p0..k-1`` (the tile's tail)."""
    a = np.int32(0)
    for p in range(p0, k):
        a += np.int32(xf[xo + p]) * np.int32(wf[wo + p])
    return a


@njit
def _put(acc, y, sx, scale, want_y, i, j, v):
    """Store one W8A8 result: dequantised into ``y`` or exact into ``acc``."""
    if want_y:
        y[i, j] = np.float32(v) * sx[i] * scale[j]
    else:
        acc[i, j] = v


@njit
def _i8_block(xf, m, k, wf, j0, j1, acc, y, sx, scale, want_y, i0):
    """W8A8 outputs ``j0..j1-1`` (``j1 - j0 <= 4``) of rows ``i0..m-1`` of the
    flat ``xf[m, k]`` against the flat output-major ``wf``; see :func:`_put`.

    Tuple results are unpacked with constant indices (kept in registers) and
    the k-tail is only visited when ``k`` is not a multiple of the step.
    """
    nch = k // I8_CHUNK
    kv = nch * I8_CHUNK
    tail = kv < k
    c = j1 - j0
    wo = j0 * k
    w1 = wo + k
    w2 = w1 + k
    w3 = w2 + k
    if c == 4:
        i = i0
        # Raw 4 x 4 tiles on VNNI: the first row group also returns 128 * sum w
        # of each weight row (i8dot_rawc_tile_4x4); later groups reuse it.
        cc = (np.int32(0), np.int32(0), np.int32(0), np.int32(0))
        if i + 4 <= m:
            t20 = i8dot_rawc_tile_4x4(xf, i * k, k, wf, wo, k, nch)
            cc = (t20[16], t20[17], t20[18], t20[19])
            for r in range(4):
                for q in range(4):
                    v = np.int32(t20[4 * r + q] - cc[q])
                    if tail:
                        v += _i8_tail(xf, (i + r) * k, wf, wo + q * k, kv, k)
                    _put(acc, y, sx, scale, want_y, i + r, j0 + q, v)
            i += 4
        while i + 4 <= m:
            t = i8dot_raw_tile_4x4(xf, i * k, k, wf, wo, k, nch)
            for r in range(4):
                for q in range(4):
                    v = np.int32(t[4 * r + q] - cc[q])
                    if tail:
                        v += _i8_tail(xf, (i + r) * k, wf, wo + q * k, kv, k)
                    _put(acc, y, sx, scale, want_y, i + r, j0 + q, v)
            i += 4
        while i + 2 <= m:
            xo = i * k
            x1 = xo + k
            a0, a1, a2, a3, b0, b1, b2, b3 = i8dot_tile_2x4(xf, xo, k, wf, wo, k, nch)
            if tail:
                a0 += _i8_tail(xf, xo, wf, wo, kv, k)
                a1 += _i8_tail(xf, xo, wf, w1, kv, k)
                a2 += _i8_tail(xf, xo, wf, w2, kv, k)
                a3 += _i8_tail(xf, xo, wf, w3, kv, k)
                b0 += _i8_tail(xf, x1, wf, wo, kv, k)
                b1 += _i8_tail(xf, x1, wf, w1, kv, k)
                b2 += _i8_tail(xf, x1, wf, w2, kv, k)
                b3 += _i8_tail(xf, x1, wf, w3, kv, k)
            _put(acc, y, sx, scale, want_y, i, j0, a0)
            _put(acc, y, sx, scale, want_y, i, j0 + 1, a1)
            _put(acc, y, sx, scale, want_y, i, j0 + 2, a2)
            _put(acc, y, sx, scale, want_y, i, j0 + 3, a3)
            _put(acc, y, sx, scale, want_y, i + 1, j0, b0)
            _put(acc, y, sx, scale, want_y, i + 1, j0 + 1, b1)
            _put(acc, y, sx, scale, want_y, i + 1, j0 + 2, b2)
            _put(acc, y, sx, scale, want_y, i + 1, j0 + 3, b3)
            i += 2
        if i < m:
            xo = i * k
            a0, a1, a2, a3 = i8dot_tile_1x4(xf, xo, k, wf, wo, k, nch)
            if tail:
                a0 += _i8_tail(xf, xo, wf, wo, kv, k)
                a1 += _i8_tail(xf, xo, wf, w1, kv, k)
                a2 += _i8_tail(xf, xo, wf, w2, kv, k)
                a3 += _i8_tail(xf, xo, wf, w3, kv, k)
            _put(acc, y, sx, scale, want_y, i, j0, a0)
            _put(acc, y, sx, scale, want_y, i, j0 + 1, a1)
            _put(acc, y, sx, scale, want_y, i, j0 + 2, a2)
            _put(acc, y, sx, scale, want_y, i, j0 + 3, a3)
    else:
        for q in range(c):
            woq = wo + q * k
            i = i0
            while i + 2 <= m:
                xo = i * k
                a0, b0 = i8dot_tile_2x1(xf, xo, k, wf, woq, k, nch)
                if tail:
                    a0 += _i8_tail(xf, xo, wf, woq, kv, k)
                    b0 += _i8_tail(xf, xo + k, wf, woq, kv, k)
                _put(acc, y, sx, scale, want_y, i, j0 + q, a0)
                _put(acc, y, sx, scale, want_y, i + 1, j0 + q, b0)
                i += 2
            if i < m:
                xo = i * k
                a0 = i8dot_tile_1x1(xf, xo, k, wf, woq, k, nch)[0]
                if tail:
                    a0 += _i8_tail(xf, xo, wf, woq, kv, k)
                _put(acc, y, sx, scale, want_y, i, j0 + q, a0)


@njit
def _w8a8_blocks(xf, m, k, wf, n, acc, y, sx, scale, want_y, b0, b1):
    """Blocks ``b0..b1-1``: exact int32 sums into ``acc``, or (``want_y``)
    the dequantised ``y = sum * sx[i] * scale[j]``.

    No k-blocking: the raw 4 x 4 tile over the full depth measured 430 GOP/s
    on one Zen 4 core at k = 4096 (the activation panel streams from L2 fast
    enough), while 512-deep k-blocks with an int32 panel lost a third to the
    per-call reductions (benchmarks/bench_int8.py notes)."""
    if m < 4:
        _w8a8_decode(xf, m, k, wf, n, acc, y, sx, scale, want_y, b0, b1)
        return
    for b in range(b0, b1):
        j0 = b * _NB
        _i8_block(xf, m, k, wf, j0, min(j0 + _NB, n), acc, y, sx, scale, want_y, np.int64(0))


@njit
def _w8a8_decode(xf, m, k, wf, n, acc, y, sx, scale, want_y, b0, b1):
    """Blocks ``b0..b1-1`` for ``m < 4``: one 1 x 4 tile per row and block in
    a loop of its own.  Through :func:`_i8_block` (which also carries the
    4 x 4 and 2 x 4 tiles) the same tiles ran 20-50 % slower on one Zen 4
    core (1 x 1024 x 3072: 80.4 vs 53.6 us, one-off timing)."""
    nch = k // I8_CHUNK
    kv = nch * I8_CHUNK
    tail = kv < k
    for b in range(b0, b1):
        j0 = b * _NB
        wo = j0 * k
        if j0 + _NB <= n:
            for i in range(m):
                xo = i * k
                a0, a1, a2, a3 = i8dot_tile_1x4(xf, xo, k, wf, wo, k, nch)
                if tail:
                    a0 += _i8_tail(xf, xo, wf, wo, kv, k)
                    a1 += _i8_tail(xf, xo, wf, wo + k, kv, k)
                    a2 += _i8_tail(xf, xo, wf, wo + 2 * k, kv, k)
                    a3 += _i8_tail(xf, xo, wf, wo + 3 * k, kv, k)
                _put(acc, y, sx, scale, want_y, i, j0, a0)
                _put(acc, y, sx, scale, want_y, i, j0 + 1, a1)
                _put(acc, y, sx, scale, want_y, i, j0 + 2, a2)
                _put(acc, y, sx, scale, want_y, i, j0 + 3, a3)
        else:
            for j in range(j0, n):
                for i in range(m):
                    a0 = i8dot_tile_1x1(xf, i * k, k, wf, j * k, k, nch)[0]
                    if tail:
                        a0 += _i8_tail(xf, i * k, wf, j * k, kv, k)
                    _put(acc, y, sx, scale, want_y, i, j, a0)


@njit
def _pack_panel_words(xq, i, r, rows, kk0, kk1, P, poff, flip=True):
    """Scalar panel words ``kk0..kk1-1`` of row ``r`` (= ``xq`` row ``i``,
    code 0 past ``m``), XORed with ``0x80808080`` when ``flip`` (the W8A8
    panel; the W4A8 panel keeps the signed codes)."""
    m = xq.shape[0]
    for kk in range(kk0, kk1):
        w = np.uint32(0)
        if i < m:
            b = 4 * kk
            # four consecutive bytes, first lowest (LLVM folds them into one
            # 32-bit load)
            w = (np.uint32(np.uint8(xq[i, b]))
                 | (np.uint32(np.uint8(xq[i, b + 1])) << np.uint32(8))
                 | (np.uint32(np.uint8(xq[i, b + 2])) << np.uint32(16))
                 | (np.uint32(np.uint8(xq[i, b + 3])) << np.uint32(24)))
        if flip:
            w ^= np.uint32(0x80808080)
        P[poff + kk * rows + r] = np.int32(w)


@njit
def _pack_panel_part(xq, i0, rows, kk0, kk1, P, poff):
    """:func:`pack_i8_panel` for the four-element groups ``kk0..kk1-1``:
    blocks of 8 live rows x 8 groups through the ``panel_pack8`` transpose
    (32 x 3072 panel: 20.5 -> 4.0 us against word-by-word stores, Zen 4),
    the rest word by word."""
    m, k = xq.shape
    nch = (kk1 - kk0) // 8
    kv = kk0 + 8 * nch
    xf = xq.ravel()
    S = np.empty(8 * max(nch, 1), dtype=np.int32)
    for r0 in range(0, rows, 8):
        if i0 + r0 + 8 <= m and nch > 0:
            panel_pack8(xf, (i0 + r0) * k + 4 * kk0, k, nch, P, poff + kk0 * rows + r0, rows,
                        S, 0, _PANEL_FLIP)
            for r in range(r0, r0 + 8):
                _pack_panel_words(xq, i0 + r, r, rows, kv, kk1, P, poff, _PANEL_FLIP != 0)
        else:
            for r in range(r0, r0 + 8):
                _pack_panel_words(xq, i0 + r, r, rows, kk0, kk1, P, poff, _PANEL_FLIP != 0)


#: Whether the host's W8A8 panel holds ``x ^ 0x80`` (1: the offset panels of
#: the VNNI paths) or the signed codes (0: AVX2, see ``I8_PANEL_CORR``).
_PANEL_FLIP = 1 if I8_PANEL_CORR else 0
#: Four-element groups per panel-packing block (32 rows x 64 groups = 8 KiB:
#: the strided panel writes stay in L1).
_PACK_KB = 64


@njit
def pack_i8_panel(xq, i0, rows, k4, P, poff):
    """Write rows ``i0 .. i0+rows-1`` of ``xq[m, k]`` (int8, C-contiguous) into
    the activation panel of the ``i8panel_tile_*`` intrinsics.

    ``P[poff + kk * rows + r]`` (int32) receives the four codes
    ``xq[i0 + r, 4kk:4kk+4] ^ 0x80`` (``x + 128`` as unsigned bytes, first
    byte lowest) for ``kk < k4`` -- on the AVX2 panel (``I8_PANEL_CORR ==
    0``) the signed codes without the flip.  Rows at or past ``m`` get code 0
    (``0x80808080``, resp. 0); the caller discards their sums.  No validation.
    """
    for kk0 in range(0, k4, _PACK_KB):
        _pack_panel_part(xq, i0, rows, kk0, min(kk0 + _PACK_KB, k4), P, poff)


@njit
def _tail_sum(wf, wo, p0, k):
    """``sum wf[wo + p]`` for ``p0 <= p < k`` (int32)."""
    a = np.int32(0)
    for p in range(p0, k):
        a += np.int32(wf[wo + p])
    return a


@njit
def _wsum6(wf, wo, k, kv, ones):
    """``sum_p wf[wo + q*k + p]`` for ``p < kv`` and the six rows ``q`` of a
    panel tile, exact int32 (the ``128 * sum w`` correction of the offset
    activations).  Streaming the rows here also pulls them into L1/L2 just
    before the tile reads them."""
    nch = kv // I8_CHUNK
    a0, a1, a2, a3 = i8dot_tile_1x4(ones, 0, 0, wf, wo, k, nch)
    a4 = i8dot_tile_1x1(ones, 0, 0, wf, wo + 4 * k, k, nch)[0]
    a5 = i8dot_tile_1x1(ones, 0, 0, wf, wo + 5 * k, k, nch)[0]
    p0 = nch * I8_CHUNK
    return (np.int32(a0 + _tail_sum(wf, wo, p0, kv)),
            np.int32(a1 + _tail_sum(wf, wo + k, p0, kv)),
            np.int32(a2 + _tail_sum(wf, wo + 2 * k, p0, kv)),
            np.int32(a3 + _tail_sum(wf, wo + 3 * k, p0, kv)),
            np.int32(a4 + _tail_sum(wf, wo + 4 * k, p0, kv)),
            np.int32(a5 + _tail_sum(wf, wo + 5 * k, p0, kv)))


@njit_parallel
def i8_row_sums(wtq):
    """Exact per-output sums of int8 weight codes: ``wsum[j] = sum_p wtq[j, p]``.

    The ``wsum`` argument of :func:`matmul_w8a8` / :func:`matmul_i8i8_i32`:
    computed once per weight matrix (as ONNX Runtime pre-packs its ``B``), it
    spares the prefill kernels one streaming pass over the weights per call.

    Parameters
    ----------
    wtq : ndarray of int8, shape (n, k), C-contiguous (output-major codes)

    Returns
    -------
    ndarray of int32, shape (n,)
    """
    n, k = wtq.shape
    out = np.zeros(n, dtype=np.int32)
    for j in prange(n):
        a = np.int32(0)
        for p in range(k):
            a += np.int32(wtq[j, p])
        out[j] = a
    return out


@njit
def _panel_tiles(xf, m, mp, k, P, wf, acc, y, sx, scale, want_y, t0, t1, buf, ones, wsum):
    """Panel tiles ``t0..t1-1`` (outputs ``6t .. 6t+5``): rows ``0..mp-1``
    through the outer-product tiles (blocks of 32 rows, then one of 16), the
    last ``m - mp < 16`` rows through the 4-output dot tiles."""
    J = I8_PANEL_J
    L = I8_PANEL_LANES
    k4 = k // 4
    kv = 4 * k4
    tail = kv < k
    n = y.shape[1]
    # finish in registers (want_y, no k tail): the tiles write the chunk's
    # results output-major into yt, then 8 x 8 register transposes move them
    # into y eight rows at a time.  The scalar per-output finish below cost
    # about a fifth of the tile time at 32 x 1024 x 1024.
    fin = want_y and not tail
    jc = J * t0
    nj = J * (t1 - t0)
    yt = np.empty(nj * mp if fin else 0, dtype=np.float32)
    ws6 = np.empty(J, dtype=np.int32)
    for t in range(t0, t1):
        j0 = t * J
        wo = j0 * k
        if I8_PANEL_CORR == 0:
            # sums of x * w (the AVX2 panel): no weight-sum correction
            ws = (np.int32(0), np.int32(0), np.int32(0), np.int32(0), np.int32(0),
                  np.int32(0))
        elif wsum.shape[0] == 0:
            ws = _wsum6(wf, wo, k, kv, ones)
        else:
            # the panel covers p < kv: drop the k % 4 tail from the given sums
            ws = (np.int32(wsum[j0] - _tail_sum(wf, wo, kv, k)),
                  np.int32(wsum[j0 + 1] - _tail_sum(wf, wo + k, kv, k)),
                  np.int32(wsum[j0 + 2] - _tail_sum(wf, wo + 2 * k, kv, k)),
                  np.int32(wsum[j0 + 3] - _tail_sum(wf, wo + 3 * k, kv, k)),
                  np.int32(wsum[j0 + 4] - _tail_sum(wf, wo + 4 * k, kv, k)),
                  np.int32(wsum[j0 + 5] - _tail_sum(wf, wo + 5 * k, kv, k)))
        i0 = 0
        if fin:
            for q in range(J):
                ws6[q] = ws[q]
            yo = (j0 - jc) * mp
            while i0 < mp:
                if mp - i0 >= 32:
                    i8panel_ttile_32(P, i0 * k4, wf, wo, k, k4, ws6, sx, i0, scale, j0, yt,
                                     yo + i0, mp)
                    i0 += 32
                else:
                    i8panel_ttile_16(P, i0 * k4, wf, wo, k, k4, ws6, sx, i0, scale, j0, yt,
                                     yo + i0, mp)
                    i0 += 16
        while i0 < mp:
            rows = 32 if mp - i0 >= 32 else 16
            if rows == 32:
                i8panel_tile_32(P, i0 * k4, wf, wo, k, k4, buf, 0)
            else:
                i8panel_tile_16(P, i0 * k4, wf, wo, k, k4, buf, 0)
            for r in range(rows):
                i = i0 + r
                base = (r // L) * J * L + r % L
                for q in range(J):
                    # wrapping int32: the offset sums may wrap, the exact
                    # product (|sum| < 2^31 for k <= I8_MAX_K) does not
                    v = np.int32(np.int32(buf[base + q * L])
                                 - np.int32(np.int32(I8_PANEL_CORR) * ws[q]))
                    if tail:
                        v += _i8_tail(xf, i * k, wf, wo + q * k, kv, k)
                    _put(acc, y, sx, scale, want_y, i, j0 + q, v)
            i0 += rows
        if mp < m:
            _i8_block(xf, m, k, wf, j0, j0 + 4, acc, y, sx, scale, want_y, mp)
            _i8_block(xf, m, k, wf, j0 + 4, j0 + 6, acc, y, sx, scale, want_y, mp)
    if fin:
        yf = y.ravel()
        for r0 in range(0, mp, 8):
            jj = 0
            while jj + 8 <= nj:
                f32_transpose8(yt, jj * mp + r0, mp, yf, r0 * n + jc + jj, n)
                jj += 8
            for j in range(jj, nj):
                for r in range(r0, r0 + 8):
                    y[r, jc + j] = yt[j * mp + r]


@njit_parallel
def _w8a8_panel(xq, wtq, acc, y, sx, scale, want_y, min_parallel, wsum):
    """W8A8 prefill (``m >= 16`` on a VNNI or AVX2 host): the activation panel is
    built once per call, then chunks of 6-output tiles run in parallel; the
    ``n % 6`` last outputs go through the 4-output dot tiles."""
    m, k = xq.shape
    n = wtq.shape[0]
    k4 = k // 4
    mp = m // 16 * 16
    P = np.empty(mp * k4, dtype=np.int32)
    nblk = (mp + 31) // 32
    nkb = (k4 + _PACK_KB - 1) // _PACK_KB
    if mp * k < min_parallel:
        for b in range(nblk):
            rows = 32 if mp - 32 * b >= 32 else 16
            pack_i8_panel(xq, 32 * b, rows, k4, P, 32 * b * k4)
    else:
        for t in prange(nblk * nkb):
            b = t // nkb
            kk0 = (t % nkb) * _PACK_KB
            rows = 32 if mp - 32 * b >= 32 else 16
            _pack_panel_part(xq, 32 * b, rows, kk0, min(kk0 + _PACK_KB, k4), P, 32 * b * k4)
    xf = xq.ravel()
    wf = wtq.ravel()
    # all-ones activations for _wsum6, only when the caller gave no sums
    ones = np.ones(k if wsum.shape[0] == 0 and I8_PANEL_CORR else 0, dtype=np.int8)
    nt = n // I8_PANEL_J
    nc = _chunks(nt)
    bsz = 2 * 16 * I8_PANEL_J
    if m * k * n < min_parallel:
        buf = np.empty(bsz, dtype=np.int32)
        _panel_tiles(xf, m, mp, k, P, wf, acc, y, sx, scale, want_y, np.int64(0), nt, buf, ones,
                     wsum)
    else:
        for c in prange(nc):
            buf = np.empty(bsz, dtype=np.int32)
            _panel_tiles(xf, m, mp, k, P, wf, acc, y, sx, scale, want_y,
                         c * nt // nc, (c + 1) * nt // nc, buf, ones, wsum)
    for j0 in range(nt * I8_PANEL_J, n, _NB):
        _i8_block(xf, m, k, wf, j0, min(j0 + _NB, n), acc, y, sx, scale, want_y, np.int64(0))


#: Smallest m that takes the panel path (on a VNNI or AVX2 host; below it the dot
#: tiles with their horizontal sums win, see :func:`_w8a8_panel`).
I8_PANEL_MIN_M = 16


def w8a8_prefill_kw(m: int, k: int | None = None, n: int | None = None,
                    min_parallel: int = PAR_MIN, wsum: bool = True) -> dict:
    """Keyword arguments for a W8A8 call with ``m`` activation rows (plain
    Python helper) that keep every path this call does not take out of the
    compiled code (numba prunes an ``x is None`` test only for an ``x`` typed
    None; an explicit ``bool`` would compile one more specialisation of the
    same code, so a path that may run keeps its omitted default).

    With ``m`` alone: ``{"prefill": None}`` below :data:`I8_PANEL_MIN_M` (a
    decode never reaches the panel), else ``{}`` (every path, picked at run
    time).  Given the weight shape ``k``, ``n`` too (and the call's
    ``min_parallel`` and whether it passes ``wsum``), the helper makes the
    kernels' own choice here -- :func:`_w8a8_row_plan` for this thread's
    ``numba.get_num_threads()`` -- and names one path:

    * ``{"prefill": None}``: the dot tiles (a decode, a shape the panel does
      not take, or a host without the panel tiles);
    * ``{"outsplit": None}``: the row split only;
    * ``{"rowsplit": None, "tiles": None}``: the output split's panel only.

    The result is the same bit for bit whichever path runs; a flag that does
    not fit the call raises ``ValueError`` in the kernel."""
    if k is None or n is None:
        return {"prefill": None} if m < I8_PANEL_MIN_M else {}
    return dict(_prefill_kw(int(m), int(k), int(n), int(min_parallel), bool(wsum)))


def _prefill_kw(m, k, n, min_parallel, wsum):
    """:func:`w8a8_prefill_kw` for a validated shape, as a dict shared by
    every call with that answer (callers only ``**``-expand it, never
    edit it): about 0.3 us per call instead of 1.4 us."""
    if m < I8_PANEL_MIN_M:
        return _KW_TILES
    # the thread count only matters for a parallel-sized call (the row split);
    threads = numba.get_num_threads() if m * k * n >= min_parallel else 1
    return _prefill_path(m, k, n, min_parallel, wsum, threads)


_KW_TILES = {"prefill": None}
_KW_ROWSPLIT = {"outsplit": None}
_KW_PANEL = {"rowsplit": None, "tiles": None}


@functools.lru_cache(maxsize=4096)
def _prefill_path(m, k, n, min_parallel, wsum, threads):
    # memoised: a layer calls with the same shape every time (the row plan in
    # Python took about 2 us of a 16 x 64 x 256 call's 17)
    if not _i8_panel_rule(m, k, n):
        return _KW_TILES
    if _w8a8_row_plan.py_func(m, k, n, min_parallel, wsum, threads) > 0:
        return _KW_ROWSPLIT
    return _KW_PANEL


def _i8_panel_rule(m, k, n):
    # Python and numba share this rule (the dispatcher below inlines it)
    return I8_PANEL and m >= I8_PANEL_MIN_M and n >= I8_PANEL_J and k >= 4


_i8_panel_ok = njit(inline="always")(_i8_panel_rule)

_NO_I8_TILES = ("W8A8: tiles=None needs a prefill the panel takes (w8a8_prefill_kw with the "
                "shape); omit tiles")
_NO_I8_ROWS = ("W8A8: outsplit=None needs a call the row split takes (w8a8_prefill_kw with "
               "the shape, in the calling thread); omit outsplit")


@njit_parallel
def _w8a8_run(xq, wtq, acc, y, sx, scale, want_y, min_parallel, wsum, prefill=True):
    """The W8A8 core behind both entry points (validated input; ``wsum``
    empty when the caller gave none): panel tiles for a prefill on a VNNI or AVX2
    host, else the dot tiles over blocks of 4 outputs.  ``prefill=None``
    leaves the panel out of the compiled code (dot tiles for every ``m``)."""
    m, k = xq.shape
    n = wtq.shape[0]
    if prefill is not None and _i8_panel_ok(m, k, n):
        _w8a8_panel(xq, wtq, acc, y, sx, scale, want_y, min_parallel, wsum)
        return
    xf = xq.ravel()
    wf = wtq.ravel()
    nb = (n + _NB - 1) // _NB
    if m * k * n < min_parallel:
        _w8a8_blocks(xf, m, k, wf, n, acc, y, sx, scale, want_y, np.int64(0), nb)
    else:
        nc = _chunks(nb)
        for c in prange(nc):
            _w8a8_blocks(xf, m, k, wf, n, acc, y, sx, scale, want_y,
                         c * nb // nc, (c + 1) * nb // nc)


@intrinsic(py=numba.get_num_threads)
def _num_threads(typingctx):
    """The calling thread's numba thread count (``numba.get_num_threads()``)
    as an intrinsic: numba's own overload reads it through a ctypes pointer,
    which keeps every caller out of the on-disk cache; this calls the
    threading layer's ``get_num_threads`` symbol (which numba registers with
    LLVM for its own parallel code) by name.  The package's one use of a numba
    detail beyond the extension API: read-only, in the package's own kernels
    only, and only in functions that also link a parallel kernel (numba then
    starts its threading layer before loading them from the cache);
    ``tests/test_numba_citizen.py`` fails if numba drops the symbol.  Used
    only to pick between schedules that give the same bits."""
    numba.get_num_threads()          # launches the layer: registers the symbol

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, _llir.FunctionType(
            cgutils.intp_t, []), "get_num_threads")
        return builder.call(fn, [])
    return types.intp(), codegen




#: Largest weight matrix (``n * k`` bytes) that takes the W8A8 row split:
#: every row block streams all of the weights, which pays while they stay in
#: L2/L3 (32 x 2048 x 4096 on Zen 4, 2 threads: 629 us row split against 665
#: us output split) and no longer at 16 MiB (32 x 4096 x 4096: 1343 against
#: 1302 us).
I8_ROWSPLIT_MAX_W = 1 << 23
#: Outputs (6-output tiles) finished per register-transpose pass of a row block.
_ROW_TG = 8


@njit
def _w8a8_row_plan(m, k, n, min_parallel, have_wsum, threads):
    """Rows per block of the W8A8 row split, or 0 for the output split.

    The row split gives each thread whole row blocks: it quantises (the fused
    entry) and packs its own panel, then runs every output tile over it, so
    the call is one parallel region with no shared panel, and a 16-row panel
    (16 KiB at k = 1024) stays in L1 next to the weight tile.  Taken on a VNNI or AVX2
    host for ``m >= 16``, ``k % 4 == 0``, given weight sums, weights of at
    most :data:`I8_ROWSPLIT_MAX_W` bytes, a parallel-sized call, and a split
    whose blocks spread over the threads within 10 % (static ``prange``
    chunks): 32-row blocks first, then 16.
    """
    if not (I8_PANEL and have_wsum and m >= 16 and k >= 4 and k % 4 == 0
            and n >= I8_PANEL_J and n * k <= I8_ROWSPLIT_MAX_W
            and m * k * n >= min_parallel and threads >= 2):
        return 0
    mp = m // 16 * 16
    for rows in (32, 16):
        if mp % rows == 0:
            nb = mp // rows
            if nb >= threads and (nb + threads - 1) // threads * threads * 10 <= 11 * nb:
                return rows
    return 0


@njit
def _w8a8_rowblock(x, quant, xq, sx, i0, rows, rest, wf, scale, wsum, y, P, yt):
    """Rows ``i0 .. i0+rows-1`` of the W8A8 product through the panel tiles,
    then (``rest``) rows ``i0+rows .. m-1`` (fewer than 16) through the dot
    tiles.  ``quant``: quantise those rows of ``x`` into ``xq``/``sx`` first
    (as :func:`quantize_rows_i8`).  ``P`` (``rows * k/4`` int32) and ``yt``
    (``_ROW_TG * 6 * rows`` float32) are the caller's per-task buffers;
    ``wsum`` the exact weight sums; ``k % 4 == 0``."""
    m, k = xq.shape
    n = y.shape[1]
    k4 = k // 4
    J = I8_PANEL_J
    i1 = m if rest else i0 + rows
    if quant:
        _q8_rows(x, xq, sx, i0, i1)
    pack_i8_panel(xq, i0, rows, k4, P, np.int64(0))
    nt = n // J
    yf = y.ravel()
    xf = xq.ravel()
    for tg in range(0, nt, _ROW_TG):
        te = min(tg + _ROW_TG, nt)
        for t in range(tg, te):
            j0 = J * t
            yo = (t - tg) * J * rows
            if rows == 32:
                i8panel_ttile_32(P, 0, wf, j0 * k, k, k4, wsum[j0:j0 + J], sx, i0, scale, j0,
                                 yt, yo, rows)
            else:
                i8panel_ttile_16(P, 0, wf, j0 * k, k, k4, wsum[j0:j0 + J], sx, i0, scale, j0,
                                 yt, yo, rows)
        # yt holds outputs jc.. output-major; 8 x 8 register transposes into y
        nj = J * (te - tg)
        jc = J * tg
        for r0 in range(0, rows, 8):
            jj = 0
            while jj + 8 <= nj:
                f32_transpose8(yt, jj * rows + r0, rows, yf, (i0 + r0) * n + jc + jj, n)
                jj += 8
            for j in range(jj, nj):
                for r in range(r0, r0 + 8):
                    y[i0 + r, jc + j] = yt[j * rows + r]
    acc = np.empty((0, 0), dtype=np.int32)
    # the n % 6 last outputs of these rows, then the rest rows on all outputs
    for j0 in range(nt * J, n, _NB):
        _i8_block(xf, i0 + rows, k, wf, j0, min(j0 + _NB, n), acc, y, sx, scale, True, i0)
    if rest:
        for j0 in range(0, n, _NB):
            _i8_block(xf, m, k, wf, j0, min(j0 + _NB, n), acc, y, sx, scale, True, i0 + rows)


@njit_parallel
def _w8a8_rowsplit(x, quant, xq, sx, wtq, scale, wsum, y, rows):
    """The row-split W8A8 schedule (see :func:`_w8a8_row_plan`): one
    parallel task per block of ``rows`` rows; the last task also takes the
    ``m % 16`` rows past the last block."""
    m, k = xq.shape
    nb = (m // 16 * 16) // rows
    wf = wtq.ravel()
    for b in prange(nb):
        P = np.empty(rows * (k // 4), dtype=np.int32)
        yt = np.empty(_ROW_TG * I8_PANEL_J * rows, dtype=np.float32)
        _w8a8_rowblock(x, quant, xq, sx, b * rows, rows, b == nb - 1 and nb * rows < m,
                       wf, scale, wsum, y, P, yt)


# dynamic_matmul_w8a8 and _w8a8_float are inlined (numba IR) into their njit
# callers (PackedLinear's int8-activation path): compiled as functions of
# their own, each re-optimised and re-emitted the whole W8A8 tree below it (a
# cold PackedLinear int8/chan act=int8 call, Zen 3, int8 path avx2: 70.6 s ->
# 62.9 s without those two levels).  matmul_w8a8 has no njit caller here; it
# is inlined the same way into user numba code that calls it.
@njit(inline="always")
def dynamic_matmul_w8a8(x, wtq, scale, min_parallel=PAR_MIN, wsum=None, prefill=True,
                        rowsplit=True, outsplit=True, tiles=True):
    """W8A8 with the activation quantisation fused in (ONNX Runtime's
    ``DynamicQuantizeMatMul``): equals
    ``matmul_w8a8(*quantize_rows_i8(x), wtq, scale, min_parallel, wsum)`` bit
    for bit.

    With ``wsum`` on a VNNI or AVX2 host, a prefill whose weights fit
    :data:`I8_ROWSPLIT_MAX_W` runs as one parallel region: each thread
    quantises and packs its own block of rows and runs all outputs over it
    (:func:`_w8a8_row_plan`; 32 x 1024 x 1024 on Zen 4, avx512vnni256, 2
    threads: 88 us, against 106 us for the two calls on the output split).
    Otherwise it quantises, then runs :func:`matmul_w8a8`'s output split.

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous, finite
        Activations, quantised per row (``sx = amax / 127``).
    wtq : ndarray of int8, shape (n, k), C-contiguous (output-major codes)
    scale : ndarray of float32, shape (n,)
    min_parallel : int, optional
        Below ``m * k * n`` of this size the call stays on the calling thread.
    wsum : ndarray of int32, shape (n,), optional
        ``i8_row_sums(wtq)``; see :func:`matmul_i8i8_i32`.
    prefill : True or None, optional
        ``None`` leaves the prefill paths (row split and panel tiles) out of
        the compiled code, about half of it: every ``m`` then runs the dot
        tiles, bit for bit the same result, slower from ``m >=
        I8_PANEL_MIN_M`` on (numba prunes ``is None`` tests by type).
    rowsplit, outsplit, tiles : True or None, optional
        ``None`` leaves the row split, the output split, or the output
        split's dot tiles out of the compiled code; the call must then take
        another path (else ``ValueError``).  :func:`w8a8_prefill_kw` with the
        call's shape gives the flags of the one path it takes (a cold
        PackedLinear int8/chan act=int8 call at m = 16 compiles the panel
        only).

    Returns
    -------
    ndarray of float32, shape (m, n)
    """
    m, k = x.shape
    if wtq.shape[1] != k or scale.shape[0] != wtq.shape[0]:
        raise ValueError("dynamic_matmul_w8a8: need x[m,k], wtq[n,k], scale[n]")
    _check_w8a8(k, wtq.shape[0], wsum)
    xq = np.empty((m, k), dtype=np.int8)
    sx = np.empty(m, dtype=np.float32)
    return _w8a8_float(x, True, xq, sx, wtq, scale, min_parallel, wsum, prefill, rowsplit,
                       outsplit, tiles)


@njit
def _check_w8a8(k, n, wsum):
    """The O(1) checks every W8A8 core makes: ``wsum`` length, ``k``."""
    if wsum is not None and wsum.shape[0] != n:
        raise ValueError("W8A8: wsum must have shape (n,) (i8_row_sums(wtq))")
    if k > I8_MAX_K:
        raise ValueError("W8A8: k exceeds I8_MAX_K = 133144 (int32 sums could "
                         "overflow); split k and add the partial products")


@njit(inline="always")
def _w8a8_float(x, quant, xq, sx, wtq, scale, min_parallel, wsum, prefill=True,
                rowsplit=True, outsplit=True, tiles=True):
    """Float W8A8 output, the row split or the output split; ``quant``: fill
    ``xq``/``sx`` from ``x`` first (inside the row split's tasks, or as
    :func:`quantize_rows_i8`), else they are given and ``x`` is unused.
    ``prefill=None``: the output split's dot tiles only; ``rowsplit=None`` /
    ``outsplit=None`` / ``tiles=None`` leave that path out
    (:func:`w8a8_prefill_kw`)."""
    m, k = xq.shape
    n = wtq.shape[0]
    # an int64 for the cores below: an omitted default reaches here as the
    # literal PAR_MIN, and a literal would compile a second specialisation of
    # each of them beside an explicit value's
    min_parallel = np.int64(min_parallel)
    y = np.empty((m, n), dtype=np.float32)
    ws = np.empty(0, dtype=np.int32) if wsum is None else wsum
    if prefill is not None and rowsplit is not None:
        rows = _w8a8_row_plan(m, k, n, min_parallel, ws.shape[0] > 0, _num_threads())
        if rows > 0:
            _w8a8_rowsplit(x, quant, xq, sx, wtq, scale, ws, y, rows)
            return y
    if outsplit is None:
        # a row-split-only variant ends here: the output split is not compiled
        raise ValueError(_NO_I8_ROWS)
    if quant:
        _quantize_rows_into(x, xq, sx, min_parallel)
    acc = np.empty((0, 0), dtype=np.int32)
    if tiles is None:
        # the panel alone, called directly: no _w8a8_run level to compile.  An
        # omitted flag resolves to neither outcome, so a decode variant types
        # this branch too; it ends there at the raise (prefill is None).
        if prefill is None or not _i8_panel_ok(m, k, n):
            raise ValueError(_NO_I8_TILES)
        _w8a8_panel(xq, wtq, acc, y, sx, scale, True, min_parallel, ws)
        return y
    _w8a8_run(xq, wtq, acc, y, sx, scale, True, min_parallel, ws, prefill)
    return y


@njit
def matmul_i8i8_i32(xq, wtq, min_parallel=PAR_MIN, wsum=None):
    """Exact integer core of W8A8: ``acc[m, n] = xq[m, k] @ wtq[n, k].T`` in int32.

    Lowered through the ``i8dot_tile_*`` intrinsics on the host's int8 path
    (:func:`simd_path`: ``vpdpbusd`` with AVX-512 VNNI / AVX-VNNI, ``vpmaddubsw``
    + ``vpmaddwd`` on AVX2, portable IR elsewhere); rows go four at a time
    through a 4 x 4 register tile, then 2 x 4, then 1 x 4.  On a VNNI or AVX2 host a
    prefill (``m >= I8_PANEL_MIN_M = 16``) instead runs the outer-product
    panel tiles (:func:`~opscope_nb.kernels.make_i8_panel_tile`): the
    activations of 32 (or 16) rows are packed once per call with the ``+128``
    offset, and each step broadcasts four weight bytes of 6 outputs against
    them -- every ``vpdpbusd`` lane is an output, so no horizontal sums, and
    10 loads feed 24 ``vpdpbusd`` instead of 8 feeding 16 (AVX2: the signed
    codes, no offset, ``vpmaddubsw`` sign trick, 8 rows per pass over k).  The rows past the
    last multiple of 16 and the last ``n % 6`` outputs use the dot tiles.
    Equals
    ``xq.astype(np.int32) @ wtq.astype(np.int32).T`` bit for bit for codes in
    [-127, 127] and ``k <= I8_MAX_K = 133144`` (a larger ``k`` raises
    ``ValueError``).  ``-128`` is outside the contract and not checked here
    (O(m k) per call): the 4 x 4 and 2 x 4 VNNI tiles (``+128`` offset) are
    exact for it, but the sign trick of the 1 x 4 tiles and of the AVX2 path
    turns a ``-128 x -128`` product into ``-16384``.
    :func:`opscope_nb.runtime.matmul.matmul_i8i8_i32` rejects ``-128``.

    Parameters
    ----------
    xq : ndarray of int8, shape (m, k), C-contiguous, values in [-127, 127]
    wtq : ndarray of int8, shape (n, k), C-contiguous (output-major)
    min_parallel : int, optional
        Below ``m * k * n`` of this size the call stays on the calling thread.
    wsum : ndarray of int32, shape (n,), optional
        ``i8_row_sums(wtq)``, computed once per weight matrix.  The panel path
        needs ``sum_p wtq[j, p]`` for its offset correction; without
        ``wsum`` it sums each 6-row weight tile just before using it (about
        one more pass over the weights per call).  Sums that do not match
        ``wtq`` give wrong results; they are not checked.

    Returns
    -------
    ndarray of int32, shape (m, n)
    """
    m, k = xq.shape
    if wtq.shape[1] != k:
        raise ValueError("matmul_i8i8_i32: xq.shape[1] must equal wtq.shape[1]")
    _check_w8a8(k, wtq.shape[0], wsum)
    n = wtq.shape[0]
    acc = np.empty((m, n), dtype=np.int32)
    dummy_y = np.empty((0, 0), dtype=np.float32)
    dummy_s = np.empty(0, dtype=np.float32)
    ws = np.empty(0, dtype=np.int32) if wsum is None else wsum
    _w8a8_run(xq, wtq, acc, dummy_y, dummy_s, dummy_s, False, np.int64(min_parallel), ws)
    return acc


@njit(inline="always")
def matmul_w8a8(xq, sx, wtq, scale, min_parallel=PAR_MIN, wsum=None, prefill=True,
                rowsplit=True, outsplit=True, tiles=True):
    """W8A8: ``y[i, j] = float(sum_p xq[i, p] * wtq[j, p]) * sx[i] * scale[j]``.

    The integer sums are exact int32 (see :func:`matmul_i8i8_i32`, including
    what ``-128`` does); the dequantisation happens once per output.  ``k``
    above ``I8_MAX_K = 133144`` raises ``ValueError``.

    Parameters
    ----------
    xq : ndarray of int8, shape (m, k), C-contiguous, values in [-127, 127]
        Per-row quantised activations (:func:`quantize_rows_i8`).
    sx : ndarray of float32, shape (m,)
    wtq : ndarray of int8, shape (n, k), C-contiguous (output-major codes)
    scale : ndarray of float32, shape (n,)
    min_parallel : int, optional
        Below ``m * k * n`` of this size the call stays on the calling thread.
    wsum : ndarray of int32, shape (n,), optional
        ``i8_row_sums(wtq)``; see :func:`matmul_i8i8_i32`.
    prefill : True or None, optional
        As :func:`dynamic_matmul_w8a8`'s: ``None`` compiles the dot tiles
        only, the same result bit for bit; below ``I8_PANEL_MIN_M`` rows it
        is also the same path, so :func:`opscope_nb.runtime.matmul.matmul_w8a8`
        passes it for a decode (a cold first call at m = 1: 21.9 s against
        74.7 s, Zen 3, 2 cores, beside another job).
    rowsplit, outsplit, tiles : True or None, optional
        As :func:`dynamic_matmul_w8a8`'s.

    Returns
    -------
    ndarray of float32, shape (m, n)
    """
    m, k = xq.shape
    if wtq.shape[1] != k or sx.shape[0] != m or scale.shape[0] != wtq.shape[0]:
        raise ValueError("matmul_w8a8: need xq[m,k], sx[m], wtq[n,k], scale[n]")
    _check_w8a8(k, wtq.shape[0], wsum)
    return _w8a8_float(np.empty((0, k), dtype=np.float32), False, xq, sx, wtq, scale,
                       min_parallel, wsum, prefill, rowsplit, outsplit, tiles)


@njit
def quant_matmul(x, w):
    """``x[m, k] @ w[k, n]`` with ``w`` quantised per output column to int8.

    ``scale_j = amax_j / 127`` (:func:`quantize_cols_t`), then the W8A16
    product :func:`matmul_w8a16`: the float32 activations are turned into
    per-row int16 codes (``quantize_rows_i16(x, a16_levels(k))``), multiplied
    exactly against the int8 codes, and dequantised once:
    ``y[i, j] = (sum_p xq[i, p] * q[p, j]) * sx[i] * scale_j``.  The result is
    close to the float-activation formula ``(x @ q) * scale`` (see
    :func:`matmul_w8a16` for the measured bound), not equal to it.

    Parameters
    ----------
    x : ndarray of float32, shape (m, k), C-contiguous
    w : ndarray of float32, shape (k, n), C-contiguous, finite

    Returns
    -------
    ndarray of float32, shape (m, n)
    """
    if w.shape[0] != x.shape[1]:
        raise ValueError("quant_matmul: x.shape[1] must equal w.shape[0]")
    wtq, scale = quantize_cols_t(w)
    return matmul_w8a16(x, wtq, scale)
