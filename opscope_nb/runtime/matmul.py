"""Matmul kernels with input validation: the public twins of the ``@njit``
cores in :mod:`opscope_nb.kernels` (``kernels/_matmul.py``).

Every function here checks its input at the Python boundary and calls the
core of the same name, which your own numba code may call directly (the
cores assume valid input).

Layouts
-------
* activations ``x[m, k]`` float32, or int8 codes ``xq[m, k]``;
* reference weights ``w[k, n]`` (``y = x @ w``);
* output-major weights ``wt[n, k]`` (float32) or int8 codes ``wtq[n, k]``
  with one float32 scale per output, ``scale[n]`` (a PyTorch ``nn.Linear``
  weight ``[out_features, in_features]`` already is ``wt``);
* outputs ``y[m, n]`` float32 (int32 for :func:`matmul_i8i8_i32`).

Input rules
-----------
float inputs: any real dtype, converted to float32; finite; non-empty; the
``ndim`` each function names.  int8 code inputs: dtype ``int8`` exactly (a
``TypeError`` otherwise; convert with the quantisers), codes in [-127, 127]
(``-128`` is rejected: the VNNI/AVX2 sign trick computes ``-128 x -128`` as
``-16384``), and ``k <= I8_MAX_K = 133144`` so the int32 sums cannot
overflow.  Non-contiguous arrays are copied.  Shape disagreements raise
``ValueError``.  Every error names the rule, the value received and the fix.
"""
from __future__ import annotations

import numpy as np

from opscope_nb import kernels as _k
from opscope_nb._validation import as_float32, check_int
from opscope_nb.kernels._w8a8 import I8_MAX_K, PAR_MIN, _prefill_kw

__all__ = [
    "I8_MAX_K",
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
    "matmul_i8i8_i32",
    "simd_path",
]


def _f32(x, name, ndim):
    a = as_float32(x, name, ndim=ndim)
    return a if a.flags.writeable else a.copy()


def _codes(x, name):
    """2-D int8 codes in [-127, 127], C-contiguous (copied if not)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy int8 array; got {type(x).__name__}. "
                        f"Quantise float data with quantize_rows_i8 / quantize_cols_t.")
    if x.dtype != np.int8:
        raise TypeError(f"{name} must have dtype int8; got {x.dtype}. Quantise float "
                        f"data with quantize_rows_i8 / quantize_cols_t, or convert codes "
                        f"known to lie in [-127, 127] with {name}.astype(np.int8).")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D; got {x.ndim}-D with shape {x.shape}. "
                         f"Reshape it, e.g. {name}.reshape(rows, -1).")
    if x.size == 0:
        raise ValueError(f"{name} must not be empty; got shape {x.shape}. "
                         f"Pass at least one element along every axis.")
    bad = int(np.count_nonzero(x == -128))
    if bad:
        pos = tuple(int(v) for v in np.argwhere(x == -128)[0])
        raise ValueError(f"{name} must hold codes in [-127, 127]; it holds {bad} "
                         f"code(s) -128 (first at {pos}). Clip them, e.g. "
                         f"np.maximum({name}, -127), or quantise with levels 127.")
    a = np.ascontiguousarray(x)
    return a if a.flags.writeable else a.copy()


def _check_k(k, fn):
    if k > I8_MAX_K:
        raise ValueError(f"{fn}: k = {k} exceeds I8_MAX_K = {I8_MAX_K}, the largest "
                         f"depth whose int8 x int8 sums are exact in int32 "
                         f"(k * 127^2 < 2^31). Split k into chunks of at most "
                         f"{I8_MAX_K} and add the partial results.")


def _same(a, b, what, fix):
    if a != b:
        raise ValueError(f"{what}: got {a} and {b}. {fix}")


def _vec(x, name, n):
    v = _f32(x, name, 1)
    if v.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},); got {v.shape}. "
                         f"Pass one scale per row/output.")
    return v


def _wsum(wsum, wtq):
    """``None`` or exactly ``sum(wtq, axis=1)`` as int32 ``[n]``."""
    if wsum is None:
        return None
    if not isinstance(wsum, np.ndarray) or wsum.dtype != np.int32 or wsum.shape != (wtq.shape[0],):
        raise ValueError(
            f"wsum must be an int32 array of shape ({wtq.shape[0]},); got "
            f"{getattr(wsum, 'dtype', type(wsum).__name__)} {getattr(wsum, 'shape', '')}. "
            f"Pass kernels.i8_row_sums(wtq), or None.")
    if not np.array_equal(wsum, wtq.sum(axis=1, dtype=np.int64)):
        raise ValueError("wsum must equal wtq.sum(axis=1) (kernels.i8_row_sums(wtq)); "
                         "sums of other weights give wrong products.")
    return np.ascontiguousarray(wsum)


def _minpar(min_parallel):
    return check_int(min_parallel, "min_parallel", 0)


def simd_path() -> str:
    """Name of the int8 dot-product path compiled on this machine."""
    return _k.simd_path()


def a16_levels(k) -> int:
    """int16 activation levels :func:`matmul_w8a16` uses at depth ``k``
    (32767, fewer when ``k > 4128``)."""
    return int(_k.a16_levels(check_int(k, "k", 1)))


def transpose(w) -> np.ndarray:
    """``w[k, n] -> wt[n, k]`` (float32, C-contiguous copy)."""
    return _k.transpose(_f32(w, "w", 2))


def dense_matmul(x, w, min_parallel=PAR_MIN) -> np.ndarray:
    """``y[m, n] = x[m, k] @ w[k, n]`` in float32 (see the core)."""
    x, w = _f32(x, "x", 2), _f32(w, "w", 2)
    _same(x.shape[1], w.shape[0], "x.shape[1] must equal w.shape[0]",
          "Pass x[m, k] and w[k, n].")
    return _k.dense_matmul(x, w, _minpar(min_parallel))


def sparse_skip_matmul(x, w, min_parallel=PAR_MIN) -> np.ndarray:
    """``x[m, k] @ w[k, n]`` skipping the zero activations (float32)."""
    x, w = _f32(x, "x", 2), _f32(w, "w", 2)
    _same(x.shape[1], w.shape[0], "x.shape[1] must equal w.shape[0]",
          "Pass x[m, k] and w[k, n].")
    return _k.sparse_skip_matmul(x, w, _minpar(min_parallel))


def factored_matmul(x, u, v) -> np.ndarray:
    """``(x[m, k] @ u[k, r]) @ v[r, n]`` (float32)."""
    x, u, v = _f32(x, "x", 2), _f32(u, "u", 2), _f32(v, "v", 2)
    _same(x.shape[1], u.shape[0], "x.shape[1] must equal u.shape[0]",
          "Pass x[m, k], u[k, r], v[r, n].")
    _same(u.shape[1], v.shape[0], "u.shape[1] must equal v.shape[0]",
          "Pass x[m, k], u[k, r], v[r, n].")
    return _k.factored_matmul(x, u, v)


def quant_matmul(x, w) -> np.ndarray:
    """``x[m, k] @ w[k, n]`` with ``w`` quantised per output column to int8 and
    the activations carried as per-row int16 codes (W8A16)."""
    x, w = _f32(x, "x", 2), _f32(w, "w", 2)
    _same(x.shape[1], w.shape[0], "x.shape[1] must equal w.shape[0]",
          "Pass x[m, k] and w[k, n].")
    return _k.quant_matmul(x, w)


def quantize_cols_t(w):
    """Per-output-column int8 codes of ``w[k, n]``: ``(wtq[n, k] int8,
    scale[n] float32)``."""
    return _k.quantize_cols_t(_f32(w, "w", 2))


def quantize_rows_i8(x, min_parallel=PAR_MIN):
    """Per-row int8 codes of ``x[m, k]``: ``(xq[m, k] int8, sx[m] float32)``."""
    return _k.quantize_rows_i8(_f32(x, "x", 2), _minpar(min_parallel))


def quantize_row_i8(x):
    """Per-tensor int8 codes of ``x[m, k]``: ``(xq[m, k] int8, s float)``."""
    xq, s = _k.quantize_row_i8(_f32(x, "x", 2))
    return xq, float(s)


def quantize_rows_i16(x, levels, min_parallel=PAR_MIN):
    """Per-row int16 codes with ``levels`` (1..32767): ``(xq int16, sx float32)``."""
    lv = check_int(levels, "levels", 1, 32767)
    return _k.quantize_rows_i16(_f32(x, "x", 2), lv, _minpar(min_parallel))


def matmul_f32(x, wt, min_parallel=PAR_MIN) -> np.ndarray:
    """``y[m, n] = x[m, k] @ wt[n, k].T`` (float32, output-major weights)."""
    x, wt = _f32(x, "x", 2), _f32(wt, "wt", 2)
    _same(x.shape[1], wt.shape[1], "x.shape[1] must equal wt.shape[1]",
          "Pass x[m, k] and output-major wt[n, k] (transpose w[k, n] first).")
    return _k.matmul_f32(x, wt, _minpar(min_parallel))


def matmul_w8a16(x, wtq, scale, min_parallel=PAR_MIN) -> np.ndarray:
    """W8A16: ``x[m, k]`` float32 against int8 ``wtq[n, k]`` with ``scale[n]``."""
    x = _f32(x, "x", 2)
    wtq = _codes(wtq, "wtq")
    _same(x.shape[1], wtq.shape[1], "x.shape[1] must equal wtq.shape[1]",
          "Pass x[m, k] and output-major wtq[n, k].")
    scale = _vec(scale, "scale", wtq.shape[0])
    return _k.matmul_w8a16(x, wtq, scale, _minpar(min_parallel))


def matmul_i8i8_i32(xq, wtq, min_parallel=PAR_MIN, wsum=None) -> np.ndarray:
    """Exact ``xq[m, k] @ wtq[n, k].T`` in int32 (int8 codes in [-127, 127],
    ``k <= I8_MAX_K``).  ``wsum``: optional ``kernels.i8_row_sums(wtq)``
    (checked here; the njit core trusts it)."""
    xq, wtq = _codes(xq, "xq"), _codes(wtq, "wtq")
    _same(xq.shape[1], wtq.shape[1], "xq.shape[1] must equal wtq.shape[1]",
          "Pass xq[m, k] and output-major wtq[n, k].")
    _check_k(xq.shape[1], "matmul_i8i8_i32")
    return _k.matmul_i8i8_i32(xq, wtq, _minpar(min_parallel), _wsum(wsum, wtq))


def matmul_w8a8(xq, sx, wtq, scale, min_parallel=PAR_MIN, wsum=None) -> np.ndarray:
    """W8A8: ``float(xq[m, k] @ wtq[n, k].T) * sx[m, None] * scale[None, n]``
    (``wsum`` as in :func:`matmul_i8i8_i32`)."""
    xq, wtq = _codes(xq, "xq"), _codes(wtq, "wtq")
    _same(xq.shape[1], wtq.shape[1], "xq.shape[1] must equal wtq.shape[1]",
          "Pass xq[m, k] and output-major wtq[n, k].")
    _check_k(xq.shape[1], "matmul_w8a8")
    sx = _vec(sx, "sx", xq.shape[0])
    scale = _vec(scale, "scale", wtq.shape[0])
    mp, ws = _minpar(min_parallel), _wsum(wsum, wtq)
    return _k.matmul_w8a8(xq, sx, wtq, scale, mp, ws, **_prefill_kw(
        xq.shape[0], xq.shape[1], wtq.shape[0], mp, ws is not None))


def dynamic_matmul_w8a8(x, wtq, scale, min_parallel=PAR_MIN, wsum=None) -> np.ndarray:
    """W8A8 from float activations (ONNX Runtime's ``DynamicQuantizeMatMul``):
    ``x[m, k]`` float32 quantised per row, against int8 ``wtq[n, k]`` with
    ``scale[n]``; equals ``matmul_w8a8(*quantize_rows_i8(x), wtq, scale)`` bit
    for bit (``wsum`` as in :func:`matmul_i8i8_i32`)."""
    x = _f32(x, "x", 2)
    wtq = _codes(wtq, "wtq")
    _same(x.shape[1], wtq.shape[1], "x.shape[1] must equal wtq.shape[1]",
          "Pass x[m, k] and output-major wtq[n, k].")
    _check_k(x.shape[1], "dynamic_matmul_w8a8")
    scale = _vec(scale, "scale", wtq.shape[0])
    mp, ws = _minpar(min_parallel), _wsum(wsum, wtq)
    return _k.dynamic_matmul_w8a8(x, wtq, scale, mp, ws, **_prefill_kw(
        x.shape[0], x.shape[1], wtq.shape[0], mp, ws is not None))
