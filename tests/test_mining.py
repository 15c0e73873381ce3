"""Mining: Decomp naming/JSON, honest packing, true errors, profile_layer rules."""
import json
import math

import numpy as np
import pytest

from naive_alloc import (naive_group_quant, naive_lowrank, naive_nm_prune, naive_rel_err,
                         naive_ternary)
from opscope_nb.kernels import rel_err as kernel_rel_err
from opscope_nb.formats import Decomp, approximate, balanced_factor, pack, packed_bytes
from opscope_nb.profile.mining import DecompOption, LayerProfile, parse_layer_kind, profile_layer, quant_stat

ALL_DECOMPS = [
    (Decomp.dense(), "dense"),
    (Decomp.int8(), "int8/chan"),
    (Decomp.int4(), "int4/chan"),
    (Decomp.int4(128), "int4/g128"),
    (Decomp.intn(6), "int6/chan"),
    (Decomp.intn(5, 32), "int5/g32"),
    (Decomp.intn(3, 128), "int3/g128"),
    (Decomp.intn(2, 32), "int2/g32"),
    (Decomp.ternary(), "ternary"),
    (Decomp.sparse24(), "sparse2:4"),
    (Decomp.lowrank(12), "lowrank(r=12)"),
    (Decomp.monarch(), "monarch"),
    (Decomp.tucker((1024, 32, 96), (32, 16, 48)), "tucker(1024x32x96->32,16,48)"),
    (Decomp.tt((32, 32, 32, 96), 16), "tt(32x32x32x96,cap=16)"),
]


def gauss(rows, cols, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


# ───────────────────────────── Decomp ─────────────────────────────

@pytest.mark.parametrize("d,label", ALL_DECOMPS, ids=[lbl for _, lbl in ALL_DECOMPS])
def test_label_json_roundtrip(d, label):
    assert d.label == label
    assert Decomp.from_label(label) == d
    s = json.dumps(d.to_dict())
    back = Decomp.from_dict(json.loads(s))
    assert back == d and back.label == label and hash(back) == hash(d)


def test_decomp_hashable_and_distinct():
    labels = {d: lbl for d, lbl in ALL_DECOMPS}
    assert len(labels) == len(ALL_DECOMPS)
    assert Decomp.int4(32) != Decomp.int4(128) != Decomp.int4()
    assert Decomp.lowrank(3, svd_rank=48, seed=5) == Decomp.lowrank(3)  # provenance only
    d = Decomp.from_dict(Decomp.lowrank(3, svd_rank=48, seed=5).to_dict())
    assert (d.svd_rank, d.seed) == (48, 5)


def test_decomp_bad():
    with pytest.raises(ValueError, match="kind"):
        Decomp("int2")
    with pytest.raises(ValueError, match="needs 'r'"):
        Decomp("lowrank")
    with pytest.raises(ValueError, match="takes no"):
        Decomp("int8", r=3)
    with pytest.raises(ValueError):
        Decomp.lowrank(0)
    with pytest.raises(ValueError, match="ranks must be <= dims"):
        Decomp.tucker((4, 2, 2), (5, 1, 1))
    with pytest.raises(ValueError, match="unknown decomposition label"):
        Decomp.from_label("lowrank(r=x)")
    with pytest.raises(ValueError):
        Decomp.from_dict({"r": 3})


# ───────────────────────────── packing ─────────────────────────────

SHAPES = [(1, 1), (1, 9), (9, 1), (7, 13), (37, 50), (16, 130)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits,kind", [(8, "int8"), (4, "int4"), (4, "g4"), (4, "g32")])
def test_quant_matches_naive_exactly(shape, bits, kind):
    w = gauss(*shape, seed=shape[0] * 100 + shape[1])
    w[0, 0] = 0.0
    if kind.startswith("g"):
        g = int(kind[1:])
        d, ref = Decomp.int4(g), naive_group_quant(w, 4, g)
    else:
        d = Decomp.int8() if bits == 8 else Decomp.int4()
        ref = naive_group_quant(w, bits, shape[1])
    got = approximate(w, d)
    assert got.dtype == np.float32 and got.shape == w.shape
    np.testing.assert_array_equal(got, ref)


def test_quant_exact_on_wide_dynamic_range():
    rng = np.random.default_rng(21)
    w = (rng.standard_normal((64, 512)) * np.exp(rng.uniform(-8, 8, (64, 1)))).astype(np.float32)
    for bits, g in ((8, 512), (4, 512), (4, 32), (4, 100)):
        d = Decomp.int8() if bits == 8 else (Decomp.int4() if g == 512 else Decomp.int4(g))
        np.testing.assert_array_equal(approximate(w, d), naive_group_quant(w, bits, g))


# Values whose quotient by the scale is 0.49999997 (rounds to 0; floor(|t| + 0.5)
# in float32 gives 1) and exact ties at +-0.5, +-1.5, +-2.5 (away from zero).
# The first entry of each row is the row's max, so the per-channel scale is 1.
_EDGE = np.array([0.49999997, -0.49999997, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5,
                  2.4999998, -2.4999998, 0.0, 1.0], dtype=np.float32)


def _edge_matrix(levels):
    w = np.empty((2, 1 + _EDGE.size), dtype=np.float32)
    w[0, 0], w[0, 1:] = np.float32(levels), _EDGE
    w[1, 0], w[1, 1:] = np.float32(-levels), -_EDGE
    return w


@pytest.mark.parametrize("bits", [8, 4])
def test_mining_codes_equal_probe_quantiser_at_edges(bits):
    from opscope_nb.kernels import quantize_rows_sym, unpack_nibbles

    levels = 2 ** (bits - 1) - 1
    w = _edge_matrix(levels)
    d = Decomp.int8() if bits == 8 else Decomp.int4()
    p = pack(w, d)
    codes = p["codes"] if bits == 8 else unpack_nibbles(p["codes"], w.shape[1])
    ref_codes, ref_scales = quantize_rows_sym(w, bits)
    np.testing.assert_array_equal(p["scales"], ref_scales)
    assert p["scales"][0] == 1.0
    np.testing.assert_array_equal(codes, ref_codes)
    # the edge values themselves: 0.49999997 -> 0, ties away from zero
    np.testing.assert_array_equal(codes[0, 1:9], [0, 0, 1, -1, 2, -2, 3, -3])
    np.testing.assert_array_equal(codes[0, 9:11], [2, -2])
    np.testing.assert_array_equal(approximate(w, d), naive_group_quant(w, bits, w.shape[1]))


def test_group_quantiser_core_from_njit_at_edges():
    """quantize_groups_sym called from a user's @njit function; the groups of 4
    each start with their max so every scale is 1."""
    import numba
    from opscope_nb.kernels import quantize_groups_sym

    @numba.njit
    def run(x, bits, g):
        return quantize_groups_sym(x, bits, g)

    x = np.array([[7.0, 0.49999997, -0.5, 2.5, 7.0, -0.49999997, 1.5, -2.4999998]],
                 dtype=np.float32)
    codes, scales = run(x, 4, 4)
    np.testing.assert_array_equal(scales, np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(codes, [[7, 0, -1, 3, 7, 0, 2, -2]])


def test_naive_twin_rounds_edges():
    from naive_alloc import naive_round_half_away

    got = naive_round_half_away(_EDGE)
    np.testing.assert_array_equal(got, [0, 0, 1, -1, 2, -2, 3, -3, 2, -2, 0, 1])


def test_bit_packing_roundtrip():
    from opscope_nb.kernels import pack_crumbs, pack_nibbles, unpack_crumbs, unpack_nibbles

    rng = np.random.default_rng(0)
    for cols in (1, 2, 3, 7, 8):
        c = rng.integers(-8, 8, (3, cols)).astype(np.int8)
        p = pack_nibbles(c)
        assert p.shape == (3, (cols + 1) // 2)
        np.testing.assert_array_equal(unpack_nibbles(p, cols), c)
        v = rng.integers(0, 4, (3, cols)).astype(np.uint8)
        q = pack_crumbs(v)
        assert q.shape == (3, (cols + 3) // 4)
        np.testing.assert_array_equal(unpack_crumbs(q, cols), v)
    # explicit bit layout: low nibble first, two's complement
    assert pack_nibbles(np.array([[-1, 2]], np.int8))[0, 0] == 0x2F
    assert pack_crumbs(np.array([[1, 3, 0, 2]], np.uint8))[0, 0] == 0b10001101


def test_quant_zero_rows_and_half_away_rounding():
    w = np.zeros((3, 8), np.float32)
    w[1] = [7.0, 3.5, -3.5, 0.5, -0.5, 1.5, 2.5, -7.0]  # scale 1 at 4 bits: exact halves
    got = approximate(w, Decomp.int4())
    np.testing.assert_array_equal(got[1], [7, 4, -4, 1, -1, 2, 3, -7])
    assert not got[0].any() and not got[2].any()


@pytest.mark.parametrize("shape", SHAPES)
def test_ternary_and_sparse_match_naive(shape):
    w = gauss(*shape, seed=3)
    np.testing.assert_allclose(approximate(w, Decomp.ternary()), naive_ternary(w),
                               rtol=1e-6, atol=0)
    np.testing.assert_array_equal(approximate(w, Decomp.sparse24()), naive_nm_prune(w))


def test_sparse_ties_keep_lower_index():
    w = np.array([[1.0, -1.0, 1.0, 1.0, 2.0, 2.0, 0.0]], np.float32)
    np.testing.assert_array_equal(approximate(w, Decomp.sparse24()),
                                  [[1.0, -1.0, 0, 0, 2.0, 2.0, 0.0]])


def test_ternary_all_zero():
    w = np.zeros((4, 5), np.float32)
    assert not approximate(w, Decomp.ternary()).any()


def test_lowrank_near_optimal():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((60, 6)) @ rng.standard_normal((6, 80))).astype(np.float32)
    w += 0.01 * rng.standard_normal(w.shape).astype(np.float32)
    for r in (1, 3, 6):
        opt = naive_rel_err(w, naive_lowrank(w, r))
        got = naive_rel_err(w, approximate(w, Decomp.lowrank(r)))
        assert got <= opt * 1.01 + 1e-6


def _applicable(shape):
    rows, cols = shape
    out = [Decomp.dense(), Decomp.int8(), Decomp.int4(), Decomp.int4(4), Decomp.ternary(),
           Decomp.sparse24(), Decomp.lowrank(1), Decomp.intn(2, 4), Decomp.intn(3),
           Decomp.intn(5, 4), Decomp.intn(6)]
    if min(shape) >= 3:
        out.append(Decomp.lowrank(3, svd_rank=min(shape), seed=2))
    m = math.isqrt(rows)
    if rows == cols and m * m == rows:
        out.append(Decomp.monarch())
    c1, c2 = balanced_factor(cols)
    if c1 > 1:
        out.append(Decomp.tucker((rows, c1, c2), (max(rows // 2, 1), max(c1 // 2, 1),
                                                  max(c2 // 2, 1))))
        r1, r2 = balanced_factor(rows)
        if r1 > 1:
            out.append(Decomp.tt((r1, r2, c1, c2), 3))
    return out


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (6, 1), (7, 13), (16, 16), (12, 18)])
def test_bytes_equal_packed_size_every_kind(shape):
    w = gauss(*shape, seed=9)
    for d in _applicable(shape):
        p = pack(w, d)
        nb = sum(a.nbytes for a in p.values())
        assert nb == packed_bytes(*shape, d), d.label
        for a in p.values():
            assert a.flags.c_contiguous
        approx = approximate(w, d)
        assert approx.shape == w.shape and approx.dtype == np.float32
        assert kernel_rel_err(w, approx) == pytest.approx(naive_rel_err(w, approx), rel=1e-6,
                                                       abs=1e-12)


def test_packed_layouts_explicit():
    w = gauss(5, 11)
    p = pack(w, Decomp.int4(4))
    assert p["codes"].dtype == np.uint8 and p["codes"].shape == (5, 6)
    assert p["scales"].dtype == np.float32 and p["scales"].shape == (5, 3)
    p = pack(w, Decomp.ternary())
    assert p["codes"].shape == (5, 3) and p["alpha"].shape == (1,)
    p = pack(w, Decomp.sparse24())
    assert p["values"].shape == (5, 6) and p["indices"].shape == (5, 2)  # 2+2+2 kept
    p = pack(w, Decomp.int8())
    assert p["codes"].dtype == np.int8 and p["scales"].shape == (5,)


def test_planted_structure_recovered():
    rng = np.random.default_rng(4)
    # exact rank 2 -> lowrank(2) exact
    w = (rng.standard_normal((20, 2)) @ rng.standard_normal((2, 30))).astype(np.float32)
    assert naive_rel_err(w, approximate(w, Decomp.lowrank(2))) < 1e-4
    # Tucker multilinear rank (2,2,2) on the view [12, 4, 6]
    g = rng.standard_normal((2, 2, 2))
    u = [rng.standard_normal((d, 2)) for d in (12, 4, 6)]
    x = np.einsum("abc,ia,jb,kc->ijk", g, *u).astype(np.float32).reshape(12, 24)
    assert naive_rel_err(x, approximate(x, Decomp.tucker((12, 4, 6), (2, 2, 2)))) < 1e-3
    # TT bond rank 2 over (4, 3, 4, 6)
    cores = [rng.standard_normal(s) for s in ((1, 4, 2), (2, 3, 2), (2, 4, 2), (2, 6, 1))]
    t = np.einsum("aib,bjc,ckd,dle->ijkl", *cores).astype(np.float32).reshape(12, 24)
    assert naive_rel_err(t, approximate(t, Decomp.tt((4, 3, 4, 6), 2))) < 1e-3


def test_pack_bad_input():
    w = gauss(6, 8)
    with pytest.raises(ValueError, match="monarch"):
        pack(w, Decomp.monarch())
    with pytest.raises(ValueError, match="lowrank r"):
        pack(w, Decomp.lowrank(7))
    with pytest.raises(ValueError, match="tucker dims"):
        pack(w, Decomp.tucker((6, 2, 2), (1, 1, 1)))
    with pytest.raises(ValueError, match="tt modes"):
        pack(w, Decomp.tt((2, 3, 2, 2), 2))
    with pytest.raises(TypeError, match="Decomp"):
        pack(w, "int8/chan")
    bad = w.copy()
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="finite"):
        approximate(bad, Decomp.int8())
    with pytest.raises(ValueError, match="2-D"):
        approximate(w.ravel(), Decomp.int8())


# ───────────────────────────── profile_layer ─────────────────────────────

def _check_profile(prof, w):
    assert prof.dense_bytes == 4 * w.size and prof.options[0].decomp == Decomp.dense()
    assert (prof.rows, prof.cols) == w.shape
    for o in prof.options:
        approx = approximate(w, o.decomp)
        assert o.rel_err == pytest.approx(naive_rel_err(w, approx), rel=1e-6, abs=1e-9), \
            o.label
        assert o.bytes == sum(a.nbytes for a in pack(w, o.decomp).values()), o.label
        assert o.bytes == packed_bytes(*w.shape, o.decomp)
    labels = [o.label for o in prof.options]
    assert len(set(labels)) == len(labels)


def test_profile_order_and_rules_64x64():
    w = gauss(64, 64, seed=5)
    prof = profile_layer("x", w)
    # the +lr composites follow their base (tests/test_lr_correction.py)
    labels = [o.label for o in prof.options if "+lr" not in o.label]
    lowr = [lbl for lbl in labels if lbl.startswith("lowrank")]
    quant = ["int8/chan", "int6/chan", "int6/g32", "int5/chan", "int5/g32", "int4/chan",
             "int4/g32", "int3/chan", "int3/g32", "int2/g32"]
    assert labels[:5 + len(quant) + len(lowr)] == ["dense", "BF16", "F16"] + quant + [
        "ternary", "sparse2:4"] + lowr
    assert labels[-3:] == ["monarch", "tucker(64x8x8->32,4,4)", "tt(8x8x8x8,cap=16)"]
    assert "int4/g128" not in labels  # 64 columns: a single group of 128 is per-channel
    _check_profile(prof, w)
    assert set(prof.timings) == {"quant", "ternary", "sparse", "svd", "lowrank",
                                 "monarch", "tucker", "tt", "lr"}


def test_profile_lowrank_ranks_from_energy():
    rng = np.random.default_rng(2)
    q1, _ = np.linalg.qr(rng.standard_normal((80, 40)))
    q2, _ = np.linalg.qr(rng.standard_normal((120, 40)))
    s = np.array([10.0, 6, 3, 1.5, 1, 0.8] + [0.3] * 10 + [0.05] * 24)
    w = ((q1 * s) @ q2.T).astype(np.float32)
    prof = profile_layer("p", w, rank_cap=40)
    e = np.cumsum(s ** 2) / np.sum(s ** 2)
    want = []
    for f in (0.9, 0.99, 0.999):
        r = int(np.flatnonzero(e >= f)[0]) + 1
        if r not in want and (80 + 120) * r < 80 * 120:
            want.append(r)
    got = [o.decomp.r for o in prof.options if o.decomp.kind == "lowrank"]
    assert got == want
    _check_profile(prof, w)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (3, 5), (37, 50), (24, 200)])
def test_profile_odd_shapes(shape):
    w = gauss(*shape, seed=11)
    prof = profile_layer("odd", w, groups=(4, 32))
    _check_profile(prof, w)
    g = [o.decomp.group for o in prof.options if o.decomp.kind == "int4g" and not o.decomp.lr]
    assert g == [x for x in (4, 32) if shape[1] > x]
    for o in prof.options:
        if o.decomp.kind in ("lowrank", "tucker", "tt"):
            assert o.bytes < prof.dense_bytes


def test_profile_all_zero_weight():
    prof = profile_layer("z", np.zeros((16, 16), np.float32))
    assert all(o.rel_err == 0.0 for o in prof.options)


def test_profile_bad_input():
    with pytest.raises(ValueError, match="finite"):
        profile_layer("x", np.full((4, 4), np.inf, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        profile_layer("x", np.ones(4, np.float32))
    with pytest.raises(ValueError, match="empty"):
        profile_layer("x", np.ones((0, 4), np.float32))
    with pytest.raises(ValueError, match="rank_cap"):
        profile_layer("x", np.ones((4, 4), np.float32), rank_cap=0)
    with pytest.raises(ValueError):
        profile_layer("x", np.ones((4, 4), np.float32), groups=(0,))
    with pytest.raises(TypeError, match="groups"):
        profile_layer("x", np.ones((4, 4), np.float32), groups=32)
    with pytest.raises(ValueError, match="seed"):
        profile_layer("x", np.ones((4, 4), np.float32), seed=-1)
    with pytest.raises(TypeError):
        profile_layer(3, np.ones((4, 4), np.float32))
    with pytest.raises(TypeError):
        profile_layer("x", np.ones((4, 4), bool))


def test_profile_float64_and_noncontiguous():
    w = gauss(20, 40, seed=1)
    a = profile_layer("a", w)
    b = profile_layer("b", np.asfortranarray(w.astype(np.float64)))
    assert [o.to_dict() for o in a.options] == [o.to_dict() for o in b.options]


def test_layer_profile_helpers_and_json():
    opts = [DecompOption(Decomp.dense(), 0.0, 400, 100),
            DecompOption(Decomp.int8(), 0.01, 104, 100),
            DecompOption(Decomp.lowrank(2), 0.01, 104, 40),
            DecompOption(Decomp.ternary(), 0.5, 29, 50)]
    lp = LayerProfile("l", 10, 10, 400, opts, {"quant": 0.1})
    assert lp.dense() is opts[0]
    assert lp.best_within(0.02) is opts[1]  # first wins the byte tie
    assert lp.best_within(0.9) is opts[3]
    assert lp.best_within(-1.0) is opts[0]
    back = LayerProfile.from_dict(json.loads(json.dumps(lp.to_dict())))
    assert back == lp


# ───────────────────────────── seed tests ─────────────────────────────

def test_seed_lowrank_layer_has_cheap_lowrank_option():
    from opscope_nb.io.synth import Dist, sample

    prof = profile_layer("lr", sample(Dist.LOWRANK, 64, 64, 1))
    low = next(o for o in prof.options if o.decomp.kind == "lowrank")
    assert low.rel_err < 0.05 and low.bytes < prof.dense_bytes


def test_seed_dado_matches_greedy_four_layers():
    from opscope_nb.plan.allocate import dado_allocate, exact_allocate, greedy_allocate
    from opscope_nb.io.synth import Dist, sample

    layers = [profile_layer("a", sample(Dist.LOWRANK, 64, 64, 1)),
              profile_layer("b", sample(Dist.QUANTIZED, 48, 32, 2)),
              profile_layer("c", sample(Dist.GAUSSIAN, 32, 48, 3)),
              profile_layer("d", sample(Dist.LOWRANK, 36, 36, 4))]
    dense = sum(lp.dense_bytes for lp in layers)
    g = greedy_allocate(layers, 0.4)
    d = dado_allocate(layers, 0.4)
    x = exact_allocate(layers, 0.4)
    for a in (g, d, x):
        assert a.feasible and a.total_bytes <= 0.4 * dense
    assert d.total_err <= g.total_err + 1e-6
    assert x.total_err <= d.total_err + 1e-9
    assert x.lower_bound <= x.total_err


# ───────────────────────────── quant sweep / names ─────────────────────────────

@pytest.mark.parametrize("name,want", [
    ("model.layers.3.self_attn.q_proj.weight", (3, "self_attn.q_proj")),
    ("model.layers.27.mlp.down_proj.weight", (27, "mlp.down_proj")),
    ("encoder.layer.0.attention.self.query.weight", (0, "attention.self.query")),
    ("bert.encoder.layer.11.output.dense.weight", (11, "output.dense")),
    ("encoder.layer.2.intermediate.dense.weight", (2, "intermediate.dense")),
    ("h.5.attn.c_attn.weight", (5, "attn.c_attn")),
    ("transformer.h.10.mlp.c_proj.weight", (10, "mlp.c_proj")),
    ("blk.2.attn_q.weight", (2, "attn_q")),
    ("blk.31.ffn_down.weight", (31, "ffn_down")),
    ("lm_head.weight", (None, "lm_head")),
    ("model.embed_tokens.weight", (None, "model.embed_tokens")),
    ("pooler.dense.weight", (None, "pooler.dense")),
    ("q_proj", (None, "q_proj")),
])
def test_parse_layer_kind(name, want):
    assert parse_layer_kind(name) == want


def test_parse_layer_kind_bad():
    with pytest.raises(TypeError):
        parse_layer_kind(3)


def test_quant_stat_matches_naive():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    w[:, 7] *= 40.0  # an outlier input channel (column)
    qs = quant_stat("model.layers.4.mlp.up_proj.weight", w, 0.03)
    assert (qs.layer, qs.kind, qs.numel) == (4, "mlp.up_proj", w.size)
    flat = w.reshape(1, -1)
    assert qs.int8_pt == pytest.approx(naive_rel_err(flat, naive_group_quant(flat, 8, w.size)),
                                       rel=1e-4)
    for bits, got in ((8, qs.int8_pc), (4, qs.int4_pc), (3, qs.int3_pc)):
        assert got == pytest.approx(naive_rel_err(w, naive_group_quant(w, bits, 40)), rel=1e-4)
    cmax = np.abs(w).max(axis=0)
    med = np.sort(cmax)[len(cmax) // 2]
    assert qs.outlier == pytest.approx(cmax.max() / med, rel=1e-5)
    assert qs.outlier_count == int((cmax > 5.0 * med).sum()) == 1
    errs = {b: naive_rel_err(w, naive_group_quant(w, b, 40)) for b in (3, 4, 6, 8)}
    want = next((b for b in (3, 4, 6, 8) if errs[b] < 0.03), None)
    assert qs.best_bits == want
    json.dumps(qs.to_dict())
    with pytest.raises(ValueError, match="budget"):
        quant_stat("x", w, 0.0)


def test_flops_hand_counted():
    """MACs per input row, counted by hand for the contraction orders."""
    from opscope_nb.formats import flops as _flops

    assert _flops(12, 24, Decomp.tt((4, 3, 4, 6), 16)) == 144 + 288 + 144 + 48
    assert _flops(12, 24, Decomp.tucker((12, 4, 6), (2, 2, 2))) == 48 + 16 + 8 + 24
    assert _flops(16, 16, Decomp.monarch()) == 2 * 4 ** 3
    assert _flops(10, 20, Decomp.lowrank(3)) == 90
    assert _flops(3, 10, Decomp.sparse24()) == 3 * (2 + 2 + 2)
    assert _flops(3, 10, Decomp.int4(4)) == 30


from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9).flatmap(lambda r: st.integers(1, 17).flatmap(
    lambda c: arrays(np.float32, (r, c), elements=st.floats(
        -1e3, 1e3, width=32, allow_nan=False)))))
def test_hypothesis_packing_honest_and_exact(w):
    rows, cols = w.shape
    for d in _applicable(w.shape):
        p = pack(w, d)
        assert sum(a.nbytes for a in p.values()) == packed_bytes(rows, cols, d)
        a = approximate(w, d)
        assert a.shape == w.shape and np.isfinite(a).all()
    for bits, d in ((8, Decomp.int8()), (4, Decomp.int4()), (4, Decomp.int4(4)),
                    (6, Decomp.intn(6)), (5, Decomp.intn(5, 4)), (3, Decomp.intn(3, 4)),
                    (2, Decomp.intn(2, 4))):
        g = cols if d.group is None else d.group
        np.testing.assert_array_equal(approximate(w, d), naive_group_quant(w, bits, g))
    np.testing.assert_array_equal(approximate(w, Decomp.sparse24()), naive_nm_prune(w))
