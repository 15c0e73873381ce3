"""GPTQ rounding, output-space error and gram validation vs tests/naive_gptq.py."""
import json

import numpy as np
import pytest

import naive_gptq as ng
from opscope_nb.formats.gptq import check_gram, gptq_quantize, output_error
from opscope_nb.formats import Decomp, approximate, pack
from opscope_nb.profile.mining import DecompOption, LayerProfile, profile_layer


def _data(rows, cols, n=300, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    mix = rng.standard_normal((cols, cols)) * 0.3 + np.eye(cols)
    x = rng.standard_normal((n, cols)) @ mix
    x[:, :3] *= 4.0
    return w, x, x.T @ x


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, None), (3, 32)])
def test_gptq_codes_equal_numpy_twin(bits, group):
    w, _, h = _data(24, 160, seed=bits)
    codes, scales = gptq_quantize(w, h, bits, group, block=64)
    c2, s2 = ng.gptq(w, h, bits, group or 160)
    np.testing.assert_array_equal(scales.reshape(24, -1), s2)
    np.testing.assert_array_equal(codes, c2)


def test_gptq_core_from_njit_caller():
    from opscope_nb.kernels._jit import njit
    from opscope_nb.formats.gptq import hessian_factor, sweep_order
    from opscope_nb.kernels._gptq_round import gptq_core, gptq_group_scales

    @njit
    def call(w, wp, imp, u, perm):
        sc = gptq_group_scales(w, imp, 4, 32, 20)
        return gptq_core(wp, u, perm, sc, 4, 32, 64), sc

    w, _, h = _data(8, 96, seed=3)
    order = sweep_order(h)
    w64 = np.array(w, np.float64)
    codes, scales = call(w64, np.ascontiguousarray(w64[:, order]), np.diag(h).copy(),
                         hessian_factor(h[np.ix_(order, order)]), order)
    s2 = ng.clip_scales(w, np.diag(h), 4, 32, 20)
    np.testing.assert_array_equal(scales, s2)
    np.testing.assert_array_equal(codes, ng.gptq_sweep(w, h, 4, 32, s2))


@pytest.mark.parametrize("act,clip", [(False, False), (True, False), (False, True)])
def test_gptq_switches_equal_numpy_twin(act, clip):
    w, _, h = _data(20, 96, seed=13)
    codes, scales = gptq_quantize(w, h, 3, 32, act_order=act, clip=clip)
    s2 = ng.clip_scales(w, np.diag(h), 3, 32, 20 if clip else 0)
    c2 = ng.gptq_sweep(w, h, 3, 32, s2, act=act)
    if clip:    # the clipped sweep is kept only when its output error is lower
        s0 = ng.clip_scales(w, np.diag(h), 3, 32, 0)
        c0 = ng.gptq_sweep(w, h, 3, 32, s0, act=act)
        e = [float(np.einsum("ij,jk,ik->", d, h, d)) for d in (
            w - c0 * np.repeat(s0, 32, axis=1), w - c2 * np.repeat(s2, 32, axis=1))]
        assert e[1] < e[0]          # this seed exercises the clipped branch
    np.testing.assert_array_equal(scales, s2)
    np.testing.assert_array_equal(codes, c2)


def test_gptq_diagonal_gram_is_clipped_round_to_nearest():
    """Nothing to compensate: the importance-weighted clipped RTN codes, which
    differ from the plain ones here (the test would pass vacuously otherwise)."""
    w, x, _ = _data(16, 96, seed=5)
    d = (x * x).sum(axis=0)
    codes, scales = gptq_quantize(w, d, 4, 32)
    s2 = ng.clip_scales(w, d, 4, 32, 20)
    lev = np.float32(7)
    c2 = np.clip(ng.round_half_away(w / np.repeat(s2, 32, axis=1)), -lev, lev)
    np.testing.assert_array_equal(scales, s2)
    np.testing.assert_array_equal(codes, c2)
    assert not np.array_equal(scales, ng.rtn(w, 4, 32)[1])


def test_gptq_act_order_and_clipping_beat_natural_order():
    """The sweep order and the clipped scales lower the output error against
    textbook GPTQ (natural order, unclipped dynamic scales) on inputs whose
    columns differ in energy."""
    w, x, h = _data(48, 128, n=400, seed=11)
    x[:, 64:] *= 3.0
    h = x.T @ x
    for bits, group in ((4, None), (3, 32)):
        grp = group or 128
        codes, scales = gptq_quantize(w, h, bits, group)
        ours = ng.out_err_explicit(w, codes * np.repeat(scales, grp, axis=1), x)
        c0, s0 = ng.gptq_natural(w, h, bits, grp)
        base = ng.out_err_explicit(w, c0 * np.repeat(s0, grp, axis=1), x)
        assert ours < 0.97 * base, (bits, group, ours, base)


def test_out_err_matches_explicit_products():
    w, x, h = _data(20, 64, seed=7)
    for label in ("int4/g32", "int8/chan", "int3/chan+gptq", "lowrank(r=5)"):
        d = Decomp.from_label(label)
        wh = approximate(w, d, gram=h)
        assert output_error(w, wh, check_gram(h, 64)) == pytest.approx(
            ng.out_err_explicit(w, wh, x), rel=1e-9)
    lp = profile_layer("l", w, gram=h, rank_cap=8)
    for o in lp.options:
        wh = approximate(w, o.decomp, gram=h)
        # +lr: out_err by float64 expansion of the exact factor product, which
        # the float32 reconstruction rounds (~1e-7 of the weight's output)
        rel, ab = (1e-6, 1e-7) if o.decomp.lr else (1e-9, 1e-15)
        assert o.out_err == pytest.approx(ng.out_err_explicit(w, wh, x), rel=rel, abs=ab)


def test_diag_path_equals_full_path_for_diagonal_gram():
    w, x, _ = _data(12, 64, seed=9)
    dg = (x * x).sum(axis=0)
    a = profile_layer("l", w, gram=dg, rank_cap=4)
    b = profile_layer("l", w, gram=np.diag(dg), rank_cap=4, gptq=False)
    assert [o.label for o in a.options] == [o.label for o in b.options]
    for oa, ob in zip(a.options, b.options):
        # +lr fits: the diagonal metric scales in float64, the full one runs a
        # float32 product and a triangular solve (same fit, other rounding)
        rel = 1e-5 if oa.decomp.lr else 1e-12
        assert oa.out_err == pytest.approx(ob.out_err, rel=rel, abs=1e-15)
    # the diagonal gram offers no +gptq options (nothing to compensate)
    assert not any("+gptq" in o.label for o in a.options)


def test_gptq_beats_round_to_nearest_on_output_error():
    w, x, h = _data(32, 256, n=600, seed=11)
    lp = profile_layer("l", w, gram=h, rank_cap=4)
    by = {o.label: o for o in lp.options}
    for base in ("int4/g128", "int4/g32", "int3/g32"):
        assert by[base + "+gptq"].out_err < 0.9 * by[base].out_err
        assert by[base + "+gptq"].bytes == by[base].bytes


def test_gptq_packs_same_layout_and_runs_in_packedlinear():
    from opscope_nb.runtime import PackedLinear
    w, x, h = _data(16, 128, seed=13)
    for label in ("int4/g32+gptq", "int4/g128+gptq", "int8/chan+gptq", "int5/g32+gptq"):
        d = Decomp.from_label(label)
        p = pack(w, d, gram=h)
        q = pack(w, d.with_rounding(None))
        assert {k: (v.shape, v.dtype) for k, v in p.items()} == \
            {k: (v.shape, v.dtype) for k, v in q.items()}
        lin = PackedLinear(d, p, w.shape)
        xs = np.ascontiguousarray(x[:3], dtype=np.float32)
        ref = xs.astype(np.float64) @ approximate(w, d, gram=h).T.astype(np.float64)
        got = lin(xs, act="f32")
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_gptq_needs_gram():
    w, _, _ = _data(8, 64)
    with pytest.raises(ValueError, match="gram="):
        pack(w, Decomp.from_label("int4/g32+gptq"))
    with pytest.raises(ValueError, match="rounding"):
        Decomp("lowrank", r=2, rounding="gptq")
    with pytest.raises(ValueError, match="rounding"):
        Decomp("int8", rounding="awq-ish")


def test_labels_and_fields_round_trip_json():
    w, _, h = _data(8, 96, seed=2)
    lp = profile_layer("l", w, gram=h, rank_cap=4, sensitivity=0.25)
    back = LayerProfile.from_dict(json.loads(json.dumps(lp.to_dict())))
    assert back.sensitivity == 0.25
    assert [o.label for o in back.options] == [o.label for o in lp.options]
    assert [o.out_err for o in back.options] == [o.out_err for o in lp.options]
    assert [o.decomp for o in back.options] == [o.decomp for o in lp.options]
    for lab in ("int4/g128+gptq", "int8/chan+gptq", "int3/chan+gptq", "int2/g32+gptq"):
        d = Decomp.from_label(lab)
        assert d.label == lab and d.rounding == "gptq"
        assert Decomp.from_dict(json.loads(json.dumps(d.to_dict()))) == d
        assert d != d.with_rounding(None)
    plain = profile_layer("l", w, rank_cap=4)
    assert all(o.out_err is None for o in plain.options) and plain.sensitivity is None
    o = DecompOption.from_dict(json.loads(json.dumps(plain.options[1].to_dict())))
    assert o.out_err is None


@pytest.mark.parametrize("bad,match", [
    (np.ones((5, 5)), "shape"),
    (np.ones(5), "shape"),
    (np.ones((6, 6, 1)), "shape"),
    (np.full((6, 6), np.nan), "finite"),
    (np.array([1.0, np.inf, 1, 1, 1, 1]), "finite"),
    (np.triu(np.ones((6, 6))), "symmetric"),
    (-np.eye(6), "semi-definite"),
    (np.diag([1.0, 1, 1, 1, 1, -1]), "semi-definite"),
    (np.array([[1.0, 2, 0, 0, 0, 0], [2, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
               [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]), "semi-definite"),
    (-np.ones(6), ">= 0"),
])
def test_bad_gram_raises(bad, match):
    w = np.ones((3, 6), np.float32)
    with pytest.raises(ValueError, match=match):
        profile_layer("l", w, gram=bad)


def test_psd_within_tolerance_accepted_and_zero_gram():
    w, x, h = _data(4, 16, n=8)  # rank 8 < 16: singular PSD
    h2 = h.copy()
    h2[0, 1] += 1e-12 * np.abs(h).max()
    lp = profile_layer("l", w, gram=h2, rank_cap=2)
    assert all(np.isfinite(o.out_err) for o in lp.options)
    z = profile_layer("l", w, gram=np.zeros((16, 16)), rank_cap=2)
    assert all(o.out_err == 0.0 for o in z.options)


# --- review finding 1: the cached Hessian factor follows the gram's content ---
def test_gptq_gram_modified_in_place_between_calls_uses_new_gram():
    w, x, h = _data(16, 96, seed=11)
    rng = np.random.default_rng(12)
    first = gptq_quantize(w, h, 4, 32, block=32)
    np.testing.assert_array_equal(first[0], ng.gptq(w, h, 4, 32)[0])
    x2 = rng.standard_normal((400, 96)) * np.linspace(0.1, 6.0, 96)
    h += x2.T @ x2            # same array object, new content
    codes, scales = gptq_quantize(w, h, 4, 32, block=32)
    c2, s2 = ng.gptq(w, h, 4, 32)
    assert not np.array_equal(c2, first[0])   # the two grams really give other codes
    np.testing.assert_array_equal(scales.reshape(16, -1), s2)
    np.testing.assert_array_equal(codes, c2)


def test_gptq_same_gram_content_in_new_array_reuses_nothing_stale():
    w, _, h = _data(8, 64, seed=13)
    a = gptq_quantize(w, h, 4, 32)
    h2 = h.copy()
    h2[0, 0] *= 3.0
    b = gptq_quantize(w, h2, 4, 32)
    np.testing.assert_array_equal(b[0], ng.gptq(w, h2, 4, 32)[0])
    np.testing.assert_array_equal(gptq_quantize(w, h.copy(), 4, 32)[0], a[0])


@pytest.mark.parametrize("bits,group,act", [(4, 32, True), (3, None, True), (2, 32, False),
                                            (8, None, True), (4, 128, False)])
def test_gptq_lowrank_path_equals_numpy_twin(bits, group, act, monkeypatch):
    """A gram of t < cols / 4 rows takes the low-rank sweep (the dense core is
    never called), and its codes are the dense GPTQ's (numpy twin)."""
    from opscope_nb.formats import gptq as G
    rng = np.random.default_rng(bits * 7 + int(act))
    cols, t = 256, 40
    w = rng.standard_normal((48, cols)).astype(np.float32)
    x = rng.standard_normal((t, cols)) @ (rng.standard_normal((cols, cols)) * 0.2 + np.eye(cols))
    x[:, :3] *= 4.0
    x[:, 7] = 0.0                       # a dead input: H[7, 7] = 0
    h = x.T @ x
    assert G._lowrank_prep(G.check_gram(h, cols), G.DAMP, act, 64) is not None

    def dense_core(*a):
        raise AssertionError("the dense GPTQ core ran on a low-rank gram")
    monkeypatch.setattr("opscope_nb.kernels._gptq_round.gptq_core", dense_core)
    codes, scales = gptq_quantize(w, h, bits, group, block=64, act_order=act)
    monkeypatch.undo()
    if act:
        c2, s2 = ng.gptq(w, h, bits, group or cols)
    else:
        s2 = ng.clip_scales(w, np.diag(h), bits, group or cols, 20)
        c2 = ng.gptq_sweep(w, h, bits, group or cols, s2, act=False)
        s0 = ng.clip_scales(w, np.diag(h), bits, group or cols, 0)
        c0 = ng.gptq_sweep(w, h, bits, group or cols, s0, act=False)
        g = group or cols
        e = [float(np.einsum("ij,jk,ik->", w - c * np.repeat(s, g, axis=1)[:, :cols], h,
                             w - c * np.repeat(s, g, axis=1)[:, :cols]))
             for c, s in ((c0, s0), (c2, s2))]
        if not e[1] < e[0]:
            c2, s2 = c0, s0
    np.testing.assert_array_equal(scales.reshape(48, -1), s2)
    assert np.mean(codes == c2) >= 0.999        # float64 summation order only
    # and the same codes through the dense path of this package
    monkeypatch.setattr(G, "LOWRANK_FRACTION", 10 ** 9)
    c3, _ = gptq_quantize(w, h, bits, group, block=64, act_order=act)
    assert np.mean(codes == c3) >= 0.999


def test_gptq_full_rank_gram_takes_dense_path():
    from opscope_nb.formats import gptq as G
    w, _, h = _data(8, 96, seed=5)          # 300 rows: full rank
    assert G._lowrank_prep(G.check_gram(h, 96), G.DAMP, True, 128) is None


def test_check_gram_validation_cached_by_content_not_identity():
    """The PSD check is cached by the gram's content: the same array made
    indefinite in place is checked again (and rejected)."""
    from opscope_nb.formats import gptq as G
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 24))
    h = x.T @ x
    assert G.check_gram(h, 24) is not None
    h[0, 1] = h[1, 0] = 10 * np.abs(h).max()          # symmetric, clearly indefinite
    with pytest.raises(ValueError, match="positive semi-definite"):
        G.check_gram(h, 24)


def test_pinned_gram_reuses_entry_only_for_the_same_object():
    from opscope_nb.formats import gptq as G
    rng = np.random.default_rng(4)
    x = rng.standard_normal((10, 64))
    h = G.check_gram(x.T @ x, 64)
    twin = h.copy()
    with G.pinned_gram(h):
        f1 = G.gram_factor(h)
        assert G.gram_factor(h) is f1
        assert G.gram_factor(twin) is f1          # same content: the cache by content
        twin[0, 0] += 1.0                         # another array: compared in full
        assert G.gram_factor(twin) is not f1
    assert id(h) not in G._PINNED


def test_nested_pins_share_one_entry_and_profile_layer_hashes_its_gram_once(monkeypatch):
    """A pin inside a pin of the same array neither hashes it again nor unpins
    it on exit; profile_layer hashes a calibration-style gram (float64,
    C-contiguous) once for its check and its whole menu."""
    from opscope_nb.formats import gptq as G
    from opscope_nb.profile.mining import profile_layer
    rng = np.random.default_rng(5)
    x = rng.standard_normal((200, 96))
    h = x.T @ x
    calls = []
    real = G._digest
    monkeypatch.setattr(G, "_digest", lambda g: calls.append(g.shape) or real(g))
    with G.pinned_gram(h):
        with G.pinned_gram(h):
            G.check_gram(h, 96)
        assert id(h) in G._PINNED
        G.gram_factor(h)
    assert id(h) not in G._PINNED and calls == [(96, 96)]
    h2 = h + np.eye(96)
    calls.clear()
    profile_layer("l", rng.standard_normal((64, 96)).astype(np.float32), gram=h2,
                  sample_rows="all", rank_cap=8)
    assert calls == [(96, 96)] and id(h2) not in G._PINNED


def test_low_rank_gram_certified_psd_without_cholesky(monkeypatch):
    """A gram of t < cols/4 rows is shown PSD by its pivoted-Cholesky factor
    (Gershgorin on the remainder), with no cols³ Cholesky; a low-rank gram
    with a clearly negative direction added is not certified and the
    Cholesky rejects it; a full-rank gram still goes to the Cholesky."""
    import scipy.linalg
    from opscope_nb.formats import gptq as G
    rng = np.random.default_rng(8)
    cols = 256
    x = rng.standard_normal((40, cols))
    h = x.T @ x
    calls = []
    real = scipy.linalg.cholesky

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(scipy.linalg, "cholesky", spy)
    G.check_gram(h, cols)
    assert calls == []                                       # certified by the factor
    v = rng.standard_normal(cols)
    bad = h - 1e-3 * np.abs(h).max() * np.outer(v, v) / (v @ v)
    with pytest.raises(ValueError, match="positive semi-definite"):
        G.check_gram(bad, cols)
    assert calls == [1]
    shift = 1e-6 * np.diag(h).mean()
    assert not G._psd_by_factor(bad, cols, shift)
    xf = rng.standard_normal((400, cols))
    G.check_gram(xf.T @ xf, cols)                            # rank 256 > cols/4
    assert calls == [1, 1]
