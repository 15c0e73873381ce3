"""llama.cpp's activation quantisation (:func:`opscope_nb.formats.ggml.runtime_activations`,
kernels ``act_q8_0`` / ``act_q8_k``) against libggml-cpu's bytes and NumPy twins.

Golden fixture ``tests/fixtures/ggml/act.npz``: the rows ``x_real`` / ``x_odd`` of
``inputs.npz`` (see ``test_ggml.py``: real weight rows and every edge case --
zeros, outliers, denormals, half steps, huge and tiny values) run through
libggml-cpu's exported ``quantize_row_q8_0`` / ``quantize_row_q8_1`` /
``quantize_row_q8_K`` (the x86 functions its matmul calls on an input; the
library of llama-cpp-python 0.3.16 built with ``GGML_NATIVE`` on AMD Zen 4),
one row per call through ctypes, saved as uint8 ``[rows, blocks x block
bytes]`` under ``q8_0_real``, ``q8_0_odd``, ...  The harness is not part of
the repository.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from opscope_nb.formats import ggml
from opscope_nb.kernels import act_f16, act_q8_0, act_q8_k

FIX = pathlib.Path(__file__).parent / "fixtures" / "ggml"


def _decode(kind, y, cols):
    """ggml's activation blocks -> float32 values (d * q)."""
    rows = y.shape[0]
    if kind in ("q8_0", "q8_1"):
        nb = 34 if kind == "q8_0" else 36
        b = y.reshape(rows, -1, nb)
        d = np.ascontiguousarray(b[:, :, :2]).view(np.float16).astype(np.float32)
        q = np.ascontiguousarray(b[:, :, nb - 32:]).view(np.int8).astype(np.float32)
    else:
        b = y.reshape(rows, -1, 292)
        d = np.ascontiguousarray(b[:, :, :4]).view(np.float32)
        q = np.ascontiguousarray(b[:, :, 4:260]).view(np.int8).astype(np.float32)
    return (q * d).reshape(rows, cols)


def _q8_0_twin(x):
    """Q8_0 as x86's quantize_row_q8_0: d = amax/127 (kept as F16), codes
    rint(x * 127/amax)."""
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        iv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((xb * iv).astype(np.float32))
    return (q * d.astype(np.float16).astype(np.float32)).astype(np.float32).reshape(x.shape)


def _q8_k_twin(x):
    """Q8_K as quantize_row_q8_K_ref: iscale = -127/max (signed), codes
    min(127, rint(iscale * x)), d = 1/iscale."""
    xb = x.reshape(-1, 256)
    i = np.abs(xb).argmax(axis=1)
    mx = xb[np.arange(len(xb)), i][:, None]
    out = np.zeros_like(xb)
    nz = mx[:, 0] != 0
    isc = (np.float32(-127) / mx[nz]).astype(np.float32)
    q = np.minimum(127, np.rint((isc * xb[nz]).astype(np.float32)))
    out[nz] = ((np.float32(1) / isc).astype(np.float32) * q).astype(np.float32)
    return out.reshape(x.shape)


@pytest.mark.parametrize("kind, wtype", [("q8_0", "Q5_0"), ("q8_1", "Q4_1"), ("q8_K", "Q6_K")])
@pytest.mark.parametrize("key", ["real", "odd"])
def test_runtime_activations_equal_libggml(kind, wtype, key):
    x = np.load(FIX / "inputs.npz")["x_" + key].astype(np.float32)
    gold = _decode(kind, np.load(FIX / "act.npz")[f"{kind}_{key}"], x.shape[1])
    got = ggml.runtime_activations(x, wtype)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, gold)


@pytest.mark.parametrize("cols", [32, 256, 1536])
def test_kernels_equal_numpy_twins(cols):
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((7, cols)).astype(np.float32)
    x[:, 3] *= 80.0                   # an outlier channel, as in real activations
    x[2] = 0.0                        # an all-zero row
    x[4, : min(cols, 256)] *= -1e-3   # tiny values beside a negative maximum
    np.testing.assert_array_equal(act_q8_0(x), _q8_0_twin(x))
    if cols % 256 == 0:
        np.testing.assert_array_equal(act_q8_k(x), _q8_k_twin(x))


def test_f16_kernel_equals_numpys_cast_on_every_range():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(512) * sc for sc in (1e-7, 1e-5, 1.0, 3e3, 7e4)])
    x = np.concatenate([x, [65504, 65519.99, 65520, -65520, 2.0 ** -25, 3 * 2.0 ** -25,
                            2.0 ** -14, -0.0, np.inf, -np.inf, 0.0, 1.0009765625 * 2]])
    x = x.astype(np.float32).reshape(1, -1)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    got = act_f16(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.isnan(act_f16(np.full((1, 3), np.nan, np.float32))).all()


def test_act_bf16_is_ggmls_conversion_on_every_range():
    """Bit for bit the numpy form of ``ggml_compute_fp32_to_bf16``
    (``formats.ggml._bf16_bits``) on every exponent, ties, inf, NaN, -0."""
    from opscope_nb.formats.ggml import _bf16_bits
    from opscope_nb.kernels import act_bf16
    rng = np.random.default_rng(7)
    u = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, 200, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                        0x80000000, 0, 0x7F7FFFFF, 0x00000001, 0x3F808000, 0x3F818000],
                       np.uint32)
    x = np.concatenate([u, ties, special]).view(np.float32).reshape(1, -1)
    want = (_bf16_bits(x).astype(np.uint32) << np.uint32(16))
    np.testing.assert_array_equal(act_bf16(x).view(np.uint32), want)


def test_float_types_and_shapes():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, 64)) * 5).astype(np.float32)
    assert ggml.runtime_activations(x, "F32") is x
    np.testing.assert_array_equal(ggml.runtime_activations(x, "f16"),
                                  x.astype(np.float16).astype(np.float32))
    bf = ggml.dequantize(ggml.quantize(x.reshape(-1, 64), "BF16"), "BF16", (6, 64))
    np.testing.assert_array_equal(ggml.runtime_activations(x, "BF16"), bf.reshape(x.shape))
    got = ggml.runtime_activations(x, "Q8_0")          # leading axes kept
    np.testing.assert_array_equal(got, _q8_0_twin(x.reshape(-1, 64)).reshape(x.shape))
    assert ggml.runtime_activations(np.zeros((0, 256), np.float32), "Q4_K").shape == (0, 256)
    assert ggml.runtime_activations(np.zeros((3, 0), np.float32), "Q8_0").shape == (3, 0)
    # the error is that of 8-bit blocks: about 1 % relative on Gaussian rows
    y = rng.standard_normal((16, 512)).astype(np.float32)
    rel = np.linalg.norm(ggml.runtime_activations(y, "Q4_0") - y) / np.linalg.norm(y)
    assert 0.002 < rel < 0.03


def test_activation_types_cover_every_weight_type():
    assert set(ggml.GGML_TYPES) <= set(ggml.ACTIVATION_TYPES)
    assert ggml.ACTIVATION_TYPES["IQ4_NL"] == "Q8_0"
    assert ggml.ACTIVATION_TYPES["IQ4_XS"] == "Q8_K"
    assert ggml.ACTIVATION_TYPES["Q5_1"] == "Q8_1"


def test_bad_input():
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="unknown ggml weight type"):
        ggml.runtime_activations(x, "Q7_0")
    with pytest.raises(TypeError, match="float32"):
        ggml.runtime_activations(x.astype(np.float64), "Q8_0")
    with pytest.raises(TypeError, match="float32"):
        ggml.runtime_activations([[1.0] * 32], "Q8_0")
    with pytest.raises(ValueError, match="blocks of 256"):
        ggml.runtime_activations(x, "Q4_K")
    with pytest.raises(ValueError, match="blocks of 32"):
        ggml.runtime_activations(np.ones((2, 48), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="at least one axis"):
        ggml.runtime_activations(np.ones((), np.float32), "Q8_0")
