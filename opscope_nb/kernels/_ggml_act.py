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

(F16 / BF16 inputs are numpy casts: :func:`opscope_nb.formats.ggml.runtime_activations`.)

``x`` is a C-contiguous finite float32 ``[rows, cols]`` with ``cols`` a
multiple of the block; no input validation (see
:func:`opscope_nb.formats.ggml.runtime_activations`).  Rows run in parallel and
each row's result is independent of the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ._ggml_quant import _nearest_int, _round_f16
from ._jit import njit_parallel_exact

F = np.float32

__all__ = ["act_q8_0", "act_q8_k"]


@njit_parallel_exact
def act_q8_0(x):
    """``x`` float32 [rows, cols] (cols a multiple of 32) as llama.cpp's Q8_0 /
    Q8_1 activation blocks decode: float32 [rows, cols]."""
    rows, cols = x.shape
    out = np.empty((rows, cols), np.float32)
    for r in prange(rows):
        for b in range(cols // 32):
            o = b * 32
            amax = F(0.0)
            for j in range(32):
                a = abs(x[r, o + j])
                if a > amax:
                    amax = a
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
            amax = F(0.0)
            mx = F(0.0)
            for j in range(256):
                a = abs(x[r, o + j])
                if a > amax:
                    amax = a
                    mx = x[r, o + j]
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
