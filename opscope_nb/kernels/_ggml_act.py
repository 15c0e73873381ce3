"""llama.cpp's CPU activation quantisation, as the values its matmul reads.

ggml's CPU backend does not multiply a quantised weight by float activations:
``ggml_compute_forward_mul_mat`` first converts the input rows to the weight
type's ``vec_dot_type`` and takes integer block dot products (F16 weights: the
input rounded to F16).  These kernels return that converted input decoded back
to float32, so ``act_*(x) @ dequantize(W).T`` is llama.cpp's product up to the
float summation order:

* ``act_q8_0`` -- Q8_0 / Q8_1 blocks of 32 (x86's ``quantize_row_q8_0`` /
  ``q8_1``: ``d = amax / 127`` stored as F16, codes ``round(x * (127 / amax))``
  to nearest even; Q8_1 adds a block sum the values do not depend on);
* ``act_q8_k`` -- Q8_K blocks of 256 (``quantize_row_q8_K_ref``, which x86
  uses: ``iscale = -127 / max`` of the signed largest value, codes
  ``min(127, nearest_int(iscale * x))``, ``d = 1 / iscale`` in float32);
* ``act_f16`` -- ggml's F16 conversion (nearest even) for F16 weights;
* ``act_bf16`` -- ggml's BF16 conversion (``ggml_compute_fp32_to_bf16``:
  nearest even, NaN kept quiet) for BF16 weights.

``x`` is a C-contiguous finite float32 ``[rows, cols]`` with ``cols`` a
multiple of the block; no input validation (see
:func:`opscope_nb.formats.ggml.runtime_activations`).  Rows run in parallel and
each row's result is independent of the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ._ggml_quant import _nearest_int, _round_f16
from ._jit import njit_exact, njit_parallel_exact

F = np.float32

__all__ = ["act_q8_0", "act_q8_k", "act_f16", "act_bf16"]


@njit_exact
def _absmax(x, r, o, n):
    """``(max |x[r, o:o+n]|, the first value with that magnitude)`` (ggml's
    strict ``>`` scan, so the first one wins); indices, not a slice, to keep
    the per-block loop free of array views."""
    amax = F(0.0)
    mx = F(0.0)
    for j in range(o, o + n):
        a = abs(x[r, j])
        if a > amax:
            amax = a
            mx = x[r, j]
    return amax, mx


@njit_parallel_exact
def act_q8_0(x):
    """``x`` float32 [rows, cols] (cols a multiple of 32) as llama.cpp's Q8_0 /
    Q8_1 activation blocks decode: float32 [rows, cols]."""
    rows, cols = x.shape
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        for b in range(cols // 32):
            o = b * 32
            amax, _ = _absmax(x, r, o, 32)
            d = F(amax / F(127.0))
            dh = _round_f16(d)
            iv = F(F(127.0) / amax) if amax != F(0.0) else F(0.0)
            for j in range(32):
                q = _nearest_int(F(x[r, o + j] * iv))
                out[r, o + j] = F(F(q) * dh)
    return out


@njit_parallel_exact
def act_q8_k(x):
    """``x`` float32 [rows, cols] (cols a multiple of 256) as llama.cpp's Q8_K
    activation blocks decode: float32 [rows, cols]."""
    rows, cols = x.shape
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        for b in range(cols // 256):
            o = b * 256
            amax, mx = _absmax(x, r, o, 256)
            if amax == F(0.0):
                for j in range(256):
                    out[r, o + j] = F(0.0)
                continue
            iscale = F(F(-127.0) / mx)
            d = F(F(1.0) / iscale)
            for j in range(256):
                q = _nearest_int(F(iscale * x[r, o + j]))
                if q > 127:
                    q = 127
                out[r, o + j] = F(d * F(q))
    return out


@njit_parallel_exact
def act_f16(x):
    """``x`` float32 [rows, cols] rounded to F16 as ggml converts it (nearest
    even; beyond 65504 to inf, NaN kept), back in float32 [rows, cols].  On
    the bits, so that it vectorises (numpy's float16 cast gives the same values
    about ten times slower)."""
    rows, cols = x.shape
    out = np.empty((rows, cols), np.float32)
    xb = x.view(np.uint32)
    ob = out.view(np.uint32)
    for r in prange(rows):
        for c in range(cols):
            u = xb[r, c]
            s = u & np.uint32(0x80000000)
            a = u & np.uint32(0x7FFFFFFF)
            if a >= np.uint32(0x7F800000):               # inf / NaN: kept
                v = u
            elif a >= np.uint32(0x477FF000):             # rounds past 65504: inf
                v = s | np.uint32(0x7F800000)
            elif a >= np.uint32(0x38800000):             # F16 normal: 10 mantissa bits
                v = s | ((a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1)))
                         & np.uint32(0xFFFFE000))
            else:                                        # F16 subnormal: steps of 2**-24
                out[r, c] = F(np.rint(x[r, c] * F(2.0 ** 24)) * F(2.0 ** -24))
                continue
            ob[r, c] = v
    return out


@njit_parallel_exact
def act_bf16(x):
    """``x`` float32 [rows, cols] rounded to BF16 as ggml converts it
    (``ggml_compute_fp32_to_bf16``: nearest even on the top 16 bits, so past
    the largest BF16 to inf; a NaN stays a quiet NaN), back in float32
    [rows, cols]."""
    rows, cols = x.shape
    out = np.empty((rows, cols), np.float32)
    xb = x.view(np.uint32)
    ob = out.view(np.uint32)
    for r in prange(rows):
        for c in range(cols):
            u = xb[r, c]
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):     # NaN
                ob[r, c] = ((u >> np.uint32(16)) | np.uint32(64)) << np.uint32(16)
            else:
                ob[r, c] = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
                            >> np.uint32(16)) << np.uint32(16)
    return out
