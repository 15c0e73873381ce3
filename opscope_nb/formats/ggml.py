"""ggml (llama.cpp / GGUF) quantisation types, byte-identical to libggml.

``quantize(w, qtype, importance=None)`` returns the bytes
``ggml_quantize_chunk(type, w, ..., imatrix)`` writes, and
``dequantize(data, qtype, shape)`` decodes them (equal to
``gguf.quants.dequantize``).  Without ``importance`` the reference path is used
(``quantize_row_*_ref``; for IQ4_NL / IQ4_XS ``quantize_iq4_*`` with ``NULL``
weights, as ``ggml_quantize_chunk`` does); with it, ggml's importance-weighted
path.  Q8_0, TQ1_0 and TQ2_0 ignore importance, as ggml does.

The numba cores live in :mod:`opscope_nb.kernels._ggml_quant`; this module validates
at the boundary.  F16 is numpy's cast (round to nearest even), BF16 is ggml's
``ggml_compute_fp32_to_bf16`` (round to nearest even on the bits, NaN made
quiet) in numpy.

Example
-------
>>> import numpy as np
>>> from opscope_nb.formats import ggml
>>> w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
>>> q = ggml.quantize(w, "q4_K")
>>> q.shape, ggml.row_bytes("Q4_K", 256)
((4, 144), 144)
>>> ggml.dequantize(q, "q4_K", w.shape).shape
(4, 256)
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class GGMLType(NamedTuple):
    """One ggml tensor type: its id in ``enum ggml_type``, block and bytes."""

    name: str
    id: int
    block: int
    bytes: int


#: ggml's type table for the supported types (ids as in ``ggml.h``).
GGML_TYPES = {t.name: t for t in (
    GGMLType("F16", 1, 1, 2),
    GGMLType("BF16", 30, 1, 2),
    GGMLType("Q8_0", 8, 32, 34),
    GGMLType("Q6_K", 14, 256, 210),
    GGMLType("Q5_K", 13, 256, 176),
    GGMLType("Q5_1", 7, 32, 24),
    GGMLType("Q5_0", 6, 32, 22),
    GGMLType("Q4_K", 12, 256, 144),
    GGMLType("Q4_1", 3, 32, 20),
    GGMLType("Q4_0", 2, 32, 18),
    GGMLType("IQ4_NL", 20, 32, 18),
    GGMLType("IQ4_XS", 23, 256, 136),
    GGMLType("Q3_K", 11, 256, 110),
    GGMLType("Q2_K", 10, 256, 84),
    GGMLType("TQ2_0", 35, 256, 66),
    GGMLType("TQ1_0", 34, 256, 54),
)}

#: llama-quantize's replacement when a row is not a multiple of the block.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "Q4_0", "Q2_K": "Q4_0",
             "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "IQ4_XS": "IQ4_NL"}

#: What llama.cpp's CPU matmul converts its input to for weights of each type
#: (``type_traits_cpu[...].vec_dot_type``); "F32" is no conversion.  Q8_1
#: decodes to the same values as Q8_0.
ACTIVATION_TYPES = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q8_0": "Q8_0", "Q5_0": "Q8_0", "Q4_0": "Q8_0", "IQ4_NL": "Q8_0",
    "Q5_1": "Q8_1", "Q4_1": "Q8_1",
    "Q6_K": "Q8_K", "Q5_K": "Q8_K", "Q4_K": "Q8_K", "Q3_K": "Q8_K", "Q2_K": "Q8_K",
    "IQ4_XS": "Q8_K", "TQ2_0": "Q8_K", "TQ1_0": "Q8_K",
}

__all__ = ["GGML_TYPES", "GGMLType", "ACTIVATION_TYPES", "runtime_activations",
           "row_bytes", "fallback_type", "quantize", "dequantize",
           "error_sums", "count_nonfinite"]


def _type(qtype) -> GGMLType:
    if isinstance(qtype, GGMLType):
        return qtype
    if not isinstance(qtype, str):
        raise TypeError(f"qtype must be a ggml type name (str), got {type(qtype).__name__} "
                        f"{qtype!r}; use one of {sorted(GGML_TYPES)}")
    t = GGML_TYPES.get(qtype.upper())
    if t is None:
        raise ValueError(f"unknown ggml type {qtype!r}; the supported types are "
                         f"{sorted(GGML_TYPES)} (case-insensitive)")
    return t


def _cols(cols) -> int:
    if isinstance(cols, (bool, np.bool_)) or not isinstance(cols, (int, np.integer)):
        raise TypeError(f"cols must be an int, got {type(cols).__name__} {cols!r}")
    if cols < 1:
        raise ValueError(f"cols must be >= 1, got {cols}")
    return int(cols)


def row_bytes(qtype, cols) -> int:
    """Bytes of one row of ``cols`` values in ``qtype`` (``ggml_row_size``).

    Raises ValueError when ``cols`` is not a multiple of the type's block.
    """
    t = _type(qtype)
    cols = _cols(cols)
    if cols % t.block:
        raise ValueError(f"{t.name} needs rows that are a multiple of {t.block} values, got "
                         f"cols={cols}; use fallback_type({t.name!r}, {cols}) "
                         f"(= {fallback_type(t.name, cols)!r}) instead")
    return cols // t.block * t.bytes


def fallback_type(qtype, cols) -> str:
    """The type llama-quantize uses for ``qtype`` when ``cols`` does not fit its block.

    Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q3_K/Q2_K/TQ1_0/TQ2_0 -> Q4_0,
    IQ4_XS -> IQ4_NL; when ``cols`` is not a multiple of 32 either, F16.
    Returns ``qtype``'s canonical name when ``cols`` fits.
    """
    t = _type(qtype)
    cols = _cols(cols)
    if cols % t.block == 0:
        return t.name
    alt = _FALLBACK.get(t.name, "F16")
    if cols % GGML_TYPES[alt].block:
        return "F16"
    return alt


def _bf16_bits(w: np.ndarray) -> np.ndarray:
    """``ggml_compute_fp32_to_bf16`` on an array: uint16 bits."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32)
    r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = np.where(nan, (u >> np.uint32(16)) | np.uint32(64), r)
    return r.astype(np.uint16)


def _check_weights(w, check_finite=True) -> np.ndarray:
    if not isinstance(w, np.ndarray):
        raise TypeError(f"w must be a numpy array, got {type(w).__name__}; "
                        "use np.asarray(w, dtype=np.float32)")
    if w.dtype != np.float32:
        raise TypeError(f"w must be float32, got {w.dtype}; use w.astype(np.float32) "
                        "(ggml quantises float32 rows)")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [rows, cols], got shape {w.shape}; "
                         "reshape to (-1, cols)")
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"w must not be empty, got shape {w.shape}")
    if check_finite and not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"w must be finite (ggml's quantisers are undefined on NaN/Inf), got "
                         f"{w[tuple(bad)]} at {tuple(int(i) for i in bad)}; clean the weights first")
    return np.ascontiguousarray(w)


def _check_importance(importance, cols) -> np.ndarray:
    if importance is None:
        return np.empty(0, np.float32)
    imp = np.asarray(importance)
    if imp.dtype.kind not in "fiu":
        raise TypeError(f"importance must be a real numeric array, got dtype {imp.dtype}")
    imp = np.ascontiguousarray(imp, dtype=np.float32)
    if imp.ndim != 1 or imp.shape[0] != cols:
        raise ValueError(f"importance must have shape ({cols},) (one weight per column), "
                         f"got {imp.shape}; pass the imatrix row for this tensor")
    if not np.isfinite(imp).all():
        raise ValueError("importance must be finite, got NaN/Inf at column "
                         f"{int(np.argwhere(~np.isfinite(imp))[0, 0])}")
    if (imp < 0).any():
        j = int(np.argwhere(imp < 0)[0, 0])
        raise ValueError(f"importance must be >= 0, got {imp[j]} at column {j}; "
                         "imatrix values are mean squared activations")
    return imp


def quantize(w, qtype, importance=None, *, checked_finite=False) -> np.ndarray:
    """Quantise ``w`` to ggml ``qtype``: the bytes ``ggml_quantize_chunk`` writes.

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float32
        Finite weights; ``cols`` must be a multiple of the type's block.
    qtype : str
        ggml type name, case-insensitive (``"q4_K"``, ``"Q4_K"``, ``"iq4_xs"``...).
    importance : ndarray of shape (cols,), optional
        Non-negative importance (imatrix) per column; ``None`` selects ggml's
        reference quantiser.  Ignored by Q8_0, TQ1_0, TQ2_0, F16 and BF16.
    checked_finite : bool
        The caller has already checked that every value of ``w`` is finite
        (skips that scan of ``w``; non-finite values then give unspecified
        bytes, as in ggml).

    Returns
    -------
    ndarray of shape (rows, row_bytes(qtype, cols)), uint8
    """
    t = _type(qtype)
    w = _check_weights(w, not checked_finite)
    rows, cols = w.shape
    row_bytes(t, cols)
    imp = _check_importance(importance, cols)
    if t.name == "F16":
        return w.astype(np.float16).view(np.uint8).reshape(rows, cols * 2)
    if t.name == "BF16":
        return _bf16_bits(w).view(np.uint8).reshape(rows, cols * 2)
    from opscope_nb.kernels._ggml_quant import GGML_KERNELS
    return GGML_KERNELS[_name_key(t)][0](w, imp)


def _name_key(t: GGMLType) -> str:
    n = t.name.lower()
    return n[:-1] + "K" if n.endswith("_k") else n


def dequantize(data, qtype, shape) -> np.ndarray:
    """Decode ggml ``qtype`` bytes to float32 of ``shape`` = (rows, cols).

    ``data`` is uint8 of shape (rows, row_bytes(qtype, cols)) (or flat with that
    many bytes).
    """
    t = _type(qtype)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise TypeError(f"data must be a uint8 numpy array, got "
                        f"{getattr(data, 'dtype', type(data).__name__)}; pass quantize()'s output")
    try:
        rows, cols = (int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be (rows, cols), got {shape!r}") from None
    if rows < 1:
        raise ValueError(f"shape must have rows >= 1, got {shape!r}")
    rb = row_bytes(t, cols)
    if data.size != rows * rb:
        raise ValueError(f"{t.name} data for shape ({rows}, {cols}) must hold {rows}x{rb} = "
                         f"{rows * rb} bytes, got {data.size} (shape {data.shape})")
    data = np.ascontiguousarray(data).reshape(rows, rb)
    if t.name == "F16":
        return data.view(np.float16).astype(np.float32)
    if t.name == "BF16":
        return (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    from opscope_nb.kernels._ggml_quant import GGML_KERNELS
    return GGML_KERNELS[_name_key(t)][1](data, cols)


def runtime_activations(x, qtype) -> np.ndarray:
    """``x`` as llama.cpp's CPU matmul reads it against weights of ``qtype``.

    ggml converts a matmul's input rows to the weight type's activation type
    (:data:`ACTIVATION_TYPES`) before its block dot products: Q8_0 / Q8_1
    blocks of 32 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL weights, Q8_K
    blocks of 256 for the K-quants, IQ4_XS and TQ1_0 / TQ2_0, F16 / BF16
    rounding for F16 / BF16 weights, nothing for F32.  The result, decoded to
    float32, times the decoded weights is llama.cpp's product up to the float
    summation order, so a float forward through it measures the error
    llama.cpp adds on top of the weights' own.

    Parameters
    ----------
    x : ndarray of float32, shape (..., cols)
        Activations (finite; rows of any leading shape).  ``cols`` must be a
        multiple of the activation type's block (32 or 256), as the weight's
        row length is.
    qtype : str
        The weight's ggml type name (``"Q4_K"``, ``"F16"``, ``"F32"`` ...).

    Returns
    -------
    ndarray of float32, shape of ``x``
        A new array (``x`` itself for F32).
    """
    name = str(qtype).upper()
    act = ACTIVATION_TYPES.get(name)
    if act is None:
        raise ValueError(f"runtime_activations: unknown ggml weight type {qtype!r}; use one "
                         f"of {sorted(ACTIVATION_TYPES)}")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeError(f"runtime_activations: x must be a float32 numpy array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}; cast with "
                        f"x.astype(np.float32)")
    if x.ndim < 1:
        raise ValueError("runtime_activations: x must have at least one axis (cols last).")
    if act == "F32":
        return x
    block = 256 if act == "Q8_K" else 1 if act in ("F16", "BF16") else 32
    cols = x.shape[-1]
    if cols % block:
        raise ValueError(f"runtime_activations: {name} weights read {act} activations in "
                         f"blocks of {block}, got rows of {cols} values; a {name} weight "
                         f"cannot have such rows (see fallback_type)")
    from opscope_nb.kernels._ggml_act import act_bf16, act_f16, act_q8_0, act_q8_k
    if x.size == 0:
        return x.copy()
    x2 = np.ascontiguousarray(x).reshape(-1, cols)
    fn = {"F16": act_f16, "BF16": act_bf16, "Q8_K": act_q8_k}.get(act, act_q8_0)
    return fn(x2).reshape(x.shape)


def count_nonfinite(w) -> int:
    """How many values of the float32 ``[rows, cols]`` array ``w`` are NaN/Inf
    (rows in parallel, no temporary array)."""
    from opscope_nb.kernels._ggml_quant import count_nonfinite as _count
    return int(_count(np.ascontiguousarray(w, dtype=np.float32)))


def error_sums(w, data, qtype) -> tuple:
    """``(sum (w - dequantize(data))**2, sum w**2)`` in float64: the sums of a
    weight error, each row decoded on its own (no decoded matrix), rows in
    parallel and added up in row order (the same for any thread count).

    ``w`` float32 ``[rows, cols]``; ``data`` its ``qtype`` blocks as
    :func:`quantize` returns them.  No input validation beyond the type.
    """
    from opscope_nb.kernels._ggml_quant import GGML_CODES, ggml_error_sums
    t = _type(qtype)
    if t.name in ("F16", "BF16"):
        x = np.asarray(w, dtype=np.float64)
        e = x - dequantize(np.ascontiguousarray(data), t, x.shape).astype(np.float64)
        return float(np.einsum("ij,ij->", e, e)), float(np.einsum("ij,ij->", x, x))
    e2, x2 = ggml_error_sums(np.ascontiguousarray(w, dtype=np.float32),
                             np.ascontiguousarray(data), GGML_CODES[_name_key(t)])
    return float(e2.sum()), float(x2.sum())


#: The types with a ``+gptq`` twin (:func:`quantize_gptq`): every block type
#: whose weights each carry a code (not F16 / BF16, and not TQ1_0 / TQ2_0,
#: whose ternary codes are a trained model's own).
GPTQ_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_NL",
              "IQ4_XS", "Q3_K", "Q2_K")


def quantize_gptq(w, qtype, gram, *, damp=None, act_order=True, block=128,
                  checked_finite=False) -> np.ndarray:
    """ggml ``qtype`` blocks of ``w`` with GPTQ's codes on llama.cpp's scales.

    The scales (and minimums) are those :func:`quantize` writes with
    ``importance = diag(gram)`` (llama.cpp's imatrix of the same data); the
    codes are chosen column by column, each column's rounding error pushed
    onto the columns not yet rounded (GPTQ, static groups:
    :func:`opscope_nb.kernels.ggml_gptq_sweep`), which lowers the output error
    ``tr(ΔW H ΔWᵀ)`` of the same bytes.  The result is ordinary ``qtype``
    data: :func:`dequantize`, ``gguf`` and llama.cpp read it unchanged.

    Rows are independent given the gram: they run in fixed blocks of
    :data:`opscope_nb.formats.gptq.GPTQ_ROWS` rows on every core, the same
    bytes for any thread count.

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float32
        ``[out_features, in_features]``, finite; ``cols`` a multiple of the
        type's block.
    qtype : str
        One of :data:`GPTQ_TYPES` (case-insensitive).
    gram : ndarray of shape (cols, cols) or (cols,)
        ``H = sum x xᵀ`` of the layer's inputs (a 1-D gram is a diagonal,
        with which GPTQ is round-to-nearest on the same scales).
    damp : float, optional
        Relative dampening of ``H`` (default
        :data:`opscope_nb.formats.gptq.DAMP`).
    act_order : bool
        Sweep the columns largest ``H[i, i]`` first (default) or in order.
    block : int
        Lazy-update width (changes only the float64 summation order).
    checked_finite : bool
        As :func:`quantize`.

    Returns
    -------
    ndarray of shape (rows, row_bytes(qtype, cols)), uint8
    """
    from opscope_nb.formats.gptq import DAMP, check_gram
    t = _type(qtype)
    if t.name not in GPTQ_TYPES:
        raise ValueError(f"quantize_gptq: {t.name} has no GPTQ rounding; use one of "
                         f"{', '.join(GPTQ_TYPES)}, or quantize() for {t.name}.")
    w = _check_weights(w, not checked_finite)
    cols = w.shape[1]
    row_bytes(t, cols)
    g = check_gram(gram, cols)
    damp = DAMP if damp is None else float(damp)
    if not np.isfinite(damp) or damp < 0:
        raise ValueError(f"damp must be finite and >= 0; got {damp!r}.")
    if isinstance(block, bool) or int(block) != block or int(block) < 1:
        raise ValueError(f"block must be an int >= 1; got {block!r}.")
    return _gptq_blocks(w, t.name, g, damp, bool(act_order), int(block))


def _gptq_blocks(w, qtype, g, damp=None, act_order=True, block=128) -> np.ndarray:
    """:func:`quantize_gptq` on validated input (``w`` finite float32 2-D,
    ``qtype`` a canonical :data:`GPTQ_TYPES` name whose block divides the
    rows, ``g`` from :func:`opscope_nb.formats.gptq.check_gram`); no checks
    (the gram's own check costs a pivoted Cholesky of it)."""
    from opscope_nb._threads import map_row_blocks
    from opscope_nb.formats.gptq import DAMP, GPTQ_ROWS, _cached_factor
    from opscope_nb.kernels._ggml_gptq import GPTQ_LEVELS, ggml_grid, ggml_gptq_sweep, \
        ggml_set_codes
    from opscope_nb.kernels._ggml_quant import GGML_CODES
    t = GGML_TYPES[qtype]
    damp = DAMP if damp is None else float(damp)
    rows, cols = w.shape
    imp = np.ascontiguousarray(g if g.ndim == 1 else np.diag(g), dtype=np.float32)
    blocks = quantize(w, t, importance=imp, checked_finite=True)
    key = _name_key(t)
    code = GGML_CODES[key]
    lev, uniform = GPTQ_LEVELS[key]
    order, u = _cached_factor(g, damp, bool(act_order))
    s, m = ggml_grid(blocks, code, cols)

    def run(a, b):
        wp = np.ascontiguousarray(np.asarray(w[a:b], dtype=np.float64)[:, order])
        return ggml_gptq_sweep(wp, u, order, s[a:b], m[a:b], lev, uniform, int(block))

    codes = np.concatenate(map_row_blocks(run, rows, block=GPTQ_ROWS))
    return ggml_set_codes(blocks, code, codes)
