"""intN menu options (int2/3/5/6): Decomp API, bit-plane packing vs NumPy twins,
the one quantiser at rounding edges, honest bytes, profile_layer menu."""
import json
import math

import numba
import numpy as np
import pytest

from naive_alloc import naive_rel_err
from naive_probe import (naive_intn_plane_bytes, naive_pack_intn,
                         naive_per_channel_quant_error, naive_quantize_groups_sym)
from opscope_nb import kernels
from opscope_nb.formats import Decomp, approximate, pack, packed_bytes, unpack
from opscope_nb.profile.mining import profile_layer, quant_stat

BITS = (2, 3, 5, 6)


def gauss(rows, cols, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


# ───────────────────────────── Decomp API ─────────────────────────────

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [None, 32, 128, 7])
def test_intn_label_json_roundtrip(bits, group):
    d = Decomp.intn(bits, group)
    label = f"int{bits}/chan" if group is None else f"int{bits}/g{group}"
    assert d.label == label and str(d) == label
    assert d.kind == "intn" and d.bits == bits and d.group == group
    assert Decomp.from_label(label) == d
    back = Decomp.from_dict(json.loads(json.dumps(d.to_dict())))
    assert back == d and back.label == label and hash(back) == hash(d)


def test_intn_distinct_from_int4_int8():
    ds = [Decomp.intn(b, g) for b in BITS for g in (None, 32)]
    ds += [Decomp.int4(), Decomp.int4(32), Decomp.int8()]
    assert len(set(ds)) == len(ds) and len({d.label for d in ds}) == len(ds)
    # the existing kinds keep their labels
    assert Decomp.from_label("int4/g32") == Decomp.int4(32)
    assert Decomp.from_label("int4/chan").kind == "int4"
    assert Decomp.from_label("int8/chan").kind == "int8"


@pytest.mark.parametrize("label", ["int7/chan", "int1/g32", "int4/g", "int3/g0",
                                   "int5/gx", "int6/chan ", "int2", "int3/row"])
def test_intn_from_label_errors(label):
    with pytest.raises(ValueError):
        Decomp.from_label(label)


def test_intn_constructor_errors():
    with pytest.raises(ValueError, match="bits must be one of"):
        Decomp.intn(4)
    with pytest.raises(ValueError, match="bits must be one of"):
        Decomp.intn(8, 32)
    with pytest.raises(ValueError, match="needs 'bits'"):
        Decomp("intn")
    with pytest.raises(ValueError, match="takes no 'bits'"):
        Decomp("int4g", group=32, bits=3)
    with pytest.raises(ValueError, match="takes no 'r'"):
        Decomp("intn", bits=3, r=2)
    with pytest.raises(ValueError):
        Decomp.intn(3, 0)
    with pytest.raises(TypeError):
        Decomp.intn(3.5)


# ───────────────────────────── packing vs twins ─────────────────────────────

SHAPES = [(1, 1), (1, 9), (3, 7), (5, 13), (4, 33), (3, 130), (2, 257)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", BITS)
def test_intn_pack_equals_twin_bit_for_bit(shape, bits):
    w = gauss(*shape, seed=shape[0] * 1000 + shape[1] + bits)
    w[0, 0] = 0.0
    rows, cols = shape
    for group in (None, 4, 32):
        d = Decomp.intn(bits, group)
        p = pack(w, d)
        g = cols if group is None else group
        codes, scales = naive_quantize_groups_sym(w, bits, g)
        lo, hi = naive_pack_intn(codes, bits)
        want = {"lo": lo, "scales": scales[:, 0] if group is None else scales}
        if bits != 2:
            want["hi"] = hi
        assert set(p) == set(want), d.label
        for k, a in want.items():
            assert p[k].dtype == a.dtype and p[k].shape == a.shape, (d.label, k)
            assert p[k].flags.c_contiguous
            np.testing.assert_array_equal(p[k], a, err_msg=f"{d.label} {k}")
        # approximate = unpack(pack) = code * scale exactly
        ref = (codes.astype(np.float32) * np.repeat(scales, g, axis=1)[:, :cols])
        np.testing.assert_array_equal(approximate(w, d), ref)
        np.testing.assert_array_equal(unpack(p, d, shape), ref)


_EDGE = np.array([0.49999997, -0.49999997, 0.5, -0.5, 1.5, -1.5, 2.4999998, -2.4999998,
                  0.0, 1.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize("bits", BITS)
def test_intn_codes_at_rounding_edges(bits):
    """x / scale = 0.49999997 -> 0 and exact ties away from zero, as the probe's
    quantiser (per channel) and the twin; levels 1 (int2) clamps at 1."""
    levels = 2 ** (bits - 1) - 1
    edge = _EDGE[np.abs(_EDGE) <= levels]  # the row max stays `levels`: scale 1
    w = np.empty((2, 1 + edge.size), np.float32)
    w[0, 0], w[0, 1:] = levels, edge
    w[1, 0], w[1, 1:] = -levels, -edge
    cols = w.shape[1]
    for group in (None, 4):
        d = Decomp.intn(bits, group)
        p = pack(w, d)
        hi = p.get("hi", np.zeros((2, 0), np.uint8))
        codes = kernels.unpack_intn(p["lo"], hi, bits, cols)
        want, _ = naive_quantize_groups_sym(w, bits, cols if group is None else group)
        np.testing.assert_array_equal(codes, want)
        if group is None:
            np.testing.assert_array_equal(p["scales"], np.ones(2, np.float32))
            ref, ref_s = kernels.quantize_rows_sym(w, bits)
            np.testing.assert_array_equal(codes, ref)
            np.testing.assert_array_equal(p["scales"], ref_s)
            exp = np.array([0, 0, 1, -1, 2, -2, 2, -2, 0, 1, -1])[np.abs(_EDGE) <= levels]
            np.testing.assert_array_equal(codes[0, 1:], exp)
            np.testing.assert_array_equal(codes[1, 1:], -exp)


@numba.njit
def _roundtrip_from_njit(codes, bits):
    lo, hi = kernels.pack_intn(codes, bits)
    back = kernels.unpack_intn(lo, hi, bits, codes.shape[1])
    return lo, hi, back


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("cols", [1, 3, 7, 8, 9, 17, 63])
def test_pack_intn_roundtrip_every_code_from_njit(bits, cols):
    levels = 2 ** (bits - 1) - 1
    allc = np.arange(-levels, levels + 1)
    rng = np.random.default_rng(bits * 100 + cols)
    codes = rng.choice(allc, size=(9, cols)).astype(np.int8)
    codes[0, :] = -levels
    codes[1, :] = levels
    codes[2, : min(cols, allc.size)] = allc[: min(cols, allc.size)]
    lo, hi, back = _roundtrip_from_njit(codes, bits)
    np.testing.assert_array_equal(back, codes)
    tlo, thi = naive_pack_intn(codes, bits)
    np.testing.assert_array_equal(lo, tlo)
    np.testing.assert_array_equal(hi, thi)
    assert (lo.shape[1], hi.shape[1]) == naive_intn_plane_bytes(bits, cols)
    assert kernels.intn_row_bytes(bits, cols) == naive_intn_plane_bytes(bits, cols)


def test_dequantize_intn_equals_codes_times_scales():
    rng = np.random.default_rng(3)
    for bits in BITS:
        levels = 2 ** (bits - 1) - 1
        codes = rng.integers(-levels, levels + 1, (4, 45)).astype(np.int8)
        scales = rng.uniform(0.1, 2, (4, 3)).astype(np.float32)
        lo, hi = kernels.pack_intn(codes, bits)
        got = kernels.dequantize_intn(lo, hi, scales, bits, 16, 45)
        want = codes.astype(np.float32) * np.repeat(scales, 16, axis=1)[:, :45]
        np.testing.assert_array_equal(got, want)


# ───────────────────────────── honest bytes ─────────────────────────────

@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 13), (2, 33), (3, 130)])
def test_intn_bytes_formula_vs_packed_arrays(shape):
    rows, cols = shape
    w = gauss(*shape, seed=7)
    for bits in BITS:
        for group in (None, 4, 32, 128):
            d = Decomp.intn(bits, group)
            p = pack(w, d)
            nb = sum(a.nbytes for a in p.values())
            assert nb == packed_bytes(rows, cols, d), d.label
            code_bytes = nb - p["scales"].nbytes
            # tight: at most one byte of padding per row over ceil(b cols / 8)
            assert code_bytes <= rows * (math.ceil(bits * cols / 8) + 1), d.label
            assert code_bytes >= rows * math.ceil(bits * cols / 8), d.label
            ng = 1 if group is None else -(-cols // group)
            assert p["scales"].nbytes == 4 * rows * ng
            assert p["scales"].shape == ((rows,) if group is None else (rows, ng))


# ───────────────────────────── profile_layer menu ─────────────────────────────

def test_profile_menu_order_with_intn():
    w = gauss(16, 200, seed=4)
    prof = profile_layer("m", w)
    # the +lr composites follow their base (tests/test_lr_correction.py)
    labels = [o.label for o in prof.options if "+lr" not in o.label]
    quant = ["int8/chan",
             "int6/chan", "int6/g32", "int6/g128",
             "int5/chan", "int5/g32", "int5/g128",
             "int4/chan", "int4/g32", "int4/g128",
             "int3/chan", "int3/g32", "int3/g128",
             "int2/g32"]
    # the half-width options follow dense: 2 bytes per weight, any stored dtype
    assert labels[: 3 + len(quant) + 2] == ["dense", "BF16", "F16"] + quant + \
        ["ternary", "sparse2:4"]
    for o in prof.options:
        assert o.bytes == packed_bytes(16, 200, o.decomp) == \
            sum(a.nbytes for a in pack(w, o.decomp).values()), o.label
        assert o.rel_err == pytest.approx(naive_rel_err(w, approximate(w, o.decomp)),
                                          rel=1e-6, abs=1e-9), o.label
        if o.decomp.kind == "intn":
            assert o.flops == 16 * 200 + (16 + 200) * (o.decomp.lr or 0)
    err = {o.label: o.rel_err for o in prof.options}
    # more bits, less error (per channel and per group)
    assert err["int8/chan"] < err["int6/chan"] < err["int5/chan"] < err["int4/chan"] \
        < err["int3/chan"]
    assert err["int6/g32"] < err["int5/g32"] < err["int4/g32"] < err["int3/g32"] \
        < err["int2/g32"]


def test_profile_menu_options_and_rules():
    w = gauss(8, 40, seed=5)
    labels = [o.label for o in profile_layer("m", w, intn_bits=(), int2_groups=(),
                                             lr_ranks=()).options]
    assert not any(lbl.startswith(("int2", "int3", "int5", "int6")) for lbl in labels)
    assert labels[:6] == ["dense", "BF16", "F16", "int8/chan", "int4/chan", "int4/g32"]
    labels = [o.label for o in profile_layer("m", w, intn_bits=(3, 5), groups=(32,),
                                             int2_groups=(8, 64), lr_ranks=()).options]
    assert labels[:11] == ["dense", "BF16", "F16", "int8/chan", "int5/chan", "int5/g32", "int4/chan",
                          "int4/g32", "int3/chan", "int3/g32", "int2/g8"]
    assert "int2/g64" not in labels  # 40 columns: one group of 64 is not group-wise
    with pytest.raises(ValueError, match="intn_bits"):
        profile_layer("m", w, intn_bits=(4,))
    with pytest.raises(TypeError, match="int2_groups"):
        profile_layer("m", w, int2_groups=32)
    with pytest.raises(ValueError):
        profile_layer("m", w, int2_groups=(0,))


def test_quant_stat_int5_int6():
    w = gauss(12, 40, seed=6)
    qs = quant_stat("model.layers.1.mlp.up_proj.weight", w, 0.03)
    for bits, got in ((5, qs.int5_pc), (6, qs.int6_pc)):
        assert got == pytest.approx(naive_per_channel_quant_error(w, bits), rel=1e-6)
        assert got == pytest.approx(
            naive_rel_err(w, approximate(w, Decomp.intn(bits))), rel=1e-6)
    assert qs.int8_pc < qs.int6_pc < qs.int5_pc < qs.int4_pc < qs.int3_pc
    d = qs.to_dict()
    assert {"int5_pc", "int6_pc"} <= set(d)


def test_layout_modules_export_through_kernels():
    """Packing cores live in kernels._pack, the Philox generator in kernels._rng,
    both re-exported by opscope_nb.kernels; _dado keeps only allocator cores."""
    from opscope_nb.kernels import _dado, _pack, _quant_probe as _probe, _rng

    for mod in (_pack, _rng):
        for name in mod.__all__:
            assert name in kernels.__all__ and getattr(kernels, name) is getattr(mod, name)
    assert {"pack_nibbles", "quantize_groups_sym", "nm_prune", "pack_intn"} <= set(_pack.__all__)
    assert {"philox_words", "box_muller", "philox4x32_block"} == set(_rng.__all__)
    assert not set(_pack.__all__) & set(_dado.__all__)
    assert not set(_rng.__all__) & set(_probe.__all__)
    assert {"div_f32", "round_half_away"} <= set(_probe.__all__)
