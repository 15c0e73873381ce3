"""PackedLinear and the float-kind layer kernels vs their NumPy twins
(tests/naive_runtime.py), constructor validation, bad input, njit callers,
latency fields."""
import json
import math

import numba
import numpy as np
import pytest

import naive_runtime as nv
from opscope_nb import kernels as K
from opscope_nb.profile import mining
from opscope_nb.formats import Decomp
from opscope_nb.profile.mining import DecompOption, LayerProfile, profile_layer
from opscope_nb.runtime import PackedLinear, expected_arrays, has_kernel, measure_latency

# Float-weight kinds on odd shapes: cols not a multiple of 2, 4 or 32.
FLOAT_CASES = [
    ((37, 51), Decomp.dense()),
    ((37, 51), Decomp.sparse24()),
    ((5, 6), Decomp.sparse24()),          # cols % 4 == 2: short last group of 2
    ((3, 13), Decomp.sparse24()),         # cols % 4 == 1: short group keeps 1
    ((37, 51), Decomp.lowrank(5)),
    ((49, 49), Decomp.monarch()),
    ((35, 51), Decomp.tucker((35, 3, 17), (4, 2, 5))),
    ((35, 51), Decomp.tucker((35, 17, 3), (6, 9, 2))),   # the other order
    ((35, 51), Decomp.tt((5, 7, 3, 17), 4)),
    ((35, 51), Decomp.tt((35, 3, 17), 3)),
    ((1, 1), Decomp.dense()),
    ((1, 3), Decomp.sparse24()),
]
MS = (1, 7, 33)


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _x(m, cols, seed=1):
    return np.random.default_rng(seed).standard_normal((m, cols)).astype(np.float32)


def _twin(lin, packed=None):
    d = lin.decomp
    return nv.unpack(packed if packed is not None else lin.arrays, d.kind, lin.shape,
                     group=d.group, modes=d.modes, bits=getattr(d, "bits", None),
                     qtype=getattr(d, "qtype", None))


@pytest.mark.parametrize("shape,d", FLOAT_CASES, ids=lambda v: getattr(v, "label", str(v)))
def test_float_kinds_vs_twin(shape, d):
    w = _w(shape)
    lin = PackedLinear.pack(w, d)
    packed = mining.pack(w, d)
    wt = _twin(lin, packed)
    np.testing.assert_allclose(lin.dense(), wt, rtol=1e-5, atol=1e-6)
    for m in MS:
        x = _x(m, shape[1], seed=m)
        y = lin(x)
        assert y.dtype == np.float32 and y.shape == (m, shape[0])
        ref = nv.linear(x, wt)
        assert nv.rel(y, ref) <= 1e-5, (d.label, m, nv.rel(y, ref))
        for act in ("f32", "int8"):     # float kinds: every act computes in f32
            np.testing.assert_array_equal(lin(x, act), y)


def test_one_row_and_conversions():
    w = _w((37, 51))
    lin = PackedLinear.pack(w, Decomp.lowrank(4))
    x = _x(1, 51)[0]
    y1 = lin(x)
    assert y1.shape == (37,)
    np.testing.assert_array_equal(y1, lin(x[None])[0])
    for dt in (np.float64, np.float16):
        xc = x.astype(dt)
        np.testing.assert_array_equal(lin(xc), lin(xc.astype(np.float32)))
    x2 = _x(8, 102)[:, ::2]                      # non-contiguous
    np.testing.assert_array_equal(lin(x2), lin(np.ascontiguousarray(x2)))
    assert lin(np.zeros((0, 51), np.float32)).shape == (0, 37)
    np.testing.assert_array_equal(lin(np.zeros((2, 51))), np.zeros((2, 37), np.float32))


def test_bad_x():
    lin = PackedLinear.pack(_w((6, 10)), Decomp.sparse24())
    x = _x(2, 10)
    for bad in (np.nan, np.inf, -np.inf):
        xb = x.copy()
        xb[1, 3] = bad
        with pytest.raises(ValueError, match="finite"):
            lin(xb)
    with pytest.raises(ValueError, match="10 columns"):
        lin(_x(2, 9))
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        lin(np.zeros((1, 2, 10), np.float32))
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        lin(np.float32(1.0))
    with pytest.raises(TypeError, match="dtype"):
        lin(np.zeros((2, 10), bool))
    with pytest.raises(ValueError, match="act"):
        lin(x, act="int4")


def test_no_densification_at_call(monkeypatch):
    """``__call__`` must not rebuild W: break every reconstruction path."""
    cases = [((37, 51), d) for d in (Decomp.sparse24(), Decomp.lowrank(3))]
    cases += [((49, 49), Decomp.monarch()),
              ((35, 51), Decomp.tucker((35, 3, 17), (4, 2, 5))),
              ((35, 51), Decomp.tt((5, 7, 3, 17), 4))]
    lins = [(PackedLinear.pack(_w(s), d), _x(3, s[1])) for s, d in cases]
    want = [lin(x) for lin, x in lins]

    def boom(*a, **k):
        raise AssertionError("densified at call time")
    from opscope_nb import formats
    monkeypatch.setattr(mining, "unpack", boom)
    monkeypatch.setattr(formats, "unpack", boom)
    for name in ("monarch_reconstruct", "tucker_reconstruct", "tt_reconstruct",
                 "nm_unprune", "unpack_crumbs"):
        monkeypatch.setattr(K, name, boom)
    for (lin, x), y in zip(lins, want):
        np.testing.assert_array_equal(lin(x), y)


def test_channel_and_group_layers_share_one_entry(monkeypatch):
    """int4/chan and intN/chan layers hand the kernels their per-channel scales
    as the ``(rows, 1)`` view of the stored buffer, as the group layers' 2-D
    scales: numba types a 1-D and a 2-D array apart, so with 1-D scales a plan
    mixing int4/chan and int4/g32 compiled every int4 entry twice.  The stored
    arrays and ``nbytes`` are unchanged."""
    import opscope_nb.runtime._packed as R
    seen = []

    def spy(real):
        def call(x, codes, codes_or_hi, *rest, **kw):
            # (int4: codes, scales, ...; intN: lo, hi, scales, ...)
            sc = codes_or_hi if codes_or_hi.dtype == np.float32 else rest[0]
            seen.append((sc.ndim, sc.shape[0]))
            return real(x, codes, codes_or_hi, *rest, **kw)
        return call

    for name in ("int4_linear_checked_a8", "int4_linear_checked_a16"):
        monkeypatch.setattr(R._k, name, spy(getattr(K, name)))
    real_entry = K.intn_linear_entry
    monkeypatch.setattr(R._k, "intn_linear_entry", lambda b, a8: spy(real_entry(b, a8)))
    w = _w((8, 64))
    x = _x(2, 64)
    for d in (Decomp.int4(), Decomp.int4(group=32), Decomp.intn(3), Decomp.intn(3, group=32)):
        lin = PackedLinear.pack(w, d)
        for act in ("f32", "int8"):
            seen.clear()
            lin(x, act)
            assert seen == [(2, 8)], (d.label, act, seen)
        assert lin.arrays["scales"].ndim == (1 if d.group is None else 2)
        assert lin.nbytes == sum(a.nbytes for a in lin.arrays.values())


# ---------------------------------------------------------------- menu kinds
def _menu(shape):
    return [o.decomp for o in profile_layer("t", _w(shape, 3), rank_cap=8).options]


@pytest.mark.parametrize("shape", [(36, 49), (49, 49), (16, 96)])
def test_arrays_nbytes_dense_every_menu_kind(shape):
    w = _w(shape, 3)
    kinds = set()
    for d in _menu(shape):
        kinds.add(d.kind)
        lin = PackedLinear.pack(w, d)
        ref = mining.pack(w, d)
        assert set(lin.arrays) == set(ref)
        for k, a in ref.items():
            assert lin.arrays[k].dtype == a.dtype and lin.arrays[k].shape == a.shape
            np.testing.assert_array_equal(lin.arrays[k], a)
        assert lin.nbytes == mining.packed_bytes(*shape, d) == sum(a.nbytes for a in ref.values())
        np.testing.assert_array_equal(lin.dense(), mining.unpack(ref, d, shape))
        np.testing.assert_allclose(lin.dense(), _twin(lin), rtol=1e-5, atol=1e-6)
        want = expected_arrays(*shape, d)
        assert {k: (a.dtype, a.shape) for k, a in ref.items()} == want
        # rebuilding from the arrays alone gives the same layer
        again = PackedLinear(d.to_dict(), lin.arrays, shape)
        np.testing.assert_array_equal(again.dense(), lin.dense())
        if has_kernel(d.kind):
            x = _x(3, shape[1])
            tol = 1e-5 if d.kind in ("dense", "sparse24", "lowrank", "monarch", "tucker",
                                     "tt") else 3e-4
            assert nv.rel(lin(x, "f32"), nv.linear(x, _twin(lin))) <= tol, d.label
    assert {"dense", "int8", "int4", "ternary", "sparse24"} <= kinds


# -------------------------------------------------------- constructor checks
def test_constructor_rejects_bad_arrays():
    w = _w((37, 51))
    good = mining.pack(w, Decomp.lowrank(5))
    d = Decomp.lowrank(5)
    with pytest.raises(ValueError, match=r"'a'.*expected dtype float32 shape \(37, 5\).*"
                                         r"got dtype float32 shape \(37, 4\)"):
        PackedLinear(d, {"a": good["a"][:, :4], "b": good["b"]}, (37, 51))
    with pytest.raises(ValueError, match=r"'b'.*expected dtype float32.*got dtype float64"):
        PackedLinear(d, {"a": good["a"], "b": good["b"].astype(np.float64)}, (37, 51))
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        PackedLinear(d, {"a": good["a"]}, (37, 51))
    with pytest.raises(ValueError, match=r"unexpected \['c'\]"):
        PackedLinear(d, dict(good, c=good["a"]), (37, 51))
    bad = good["b"].copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="'b'.*finite"):
        PackedLinear(d, {"a": good["a"], "b": bad}, (37, 51))
    with pytest.raises(ValueError, match="'a'.*expected ndarray"):
        PackedLinear(d, {"a": good["a"].tolist(), "b": good["b"]}, (37, 51))
    with pytest.raises(TypeError, match="dict"):
        PackedLinear(d, [good["a"], good["b"]], (37, 51))
    with pytest.raises(ValueError, match="shape"):
        PackedLinear(d, good, (37,))
    with pytest.raises(ValueError, match="r must be"):
        PackedLinear(Decomp.lowrank(60), good, (37, 51))
    with pytest.raises(TypeError, match="Decomp"):
        PackedLinear(5, good, (37, 51))
    sp = mining.pack(w, Decomp.sparse24())
    with pytest.raises(ValueError, match=r"'indices'.*uint8.*got dtype int8"):
        PackedLinear("sparse2:4", {"values": sp["values"],
                                   "indices": sp["indices"].view(np.int8)}, (37, 51))
    # a wrong weight shape for otherwise valid arrays
    with pytest.raises(ValueError, match="'values'"):
        PackedLinear("sparse2:4", sp, (37, 55))
    # non-contiguous but valid arrays are accepted (copied)
    big = np.zeros((37, 10), np.float32)
    big[:, ::2] = good["a"]
    lin = PackedLinear(d, {"a": big[:, ::2], "b": good["b"]}, (37, 51))
    np.testing.assert_array_equal(lin.dense(), PackedLinear(d, good, (37, 51)).dense())


def test_tt_without_split_is_refused():
    w = _w((6, 10))
    d = Decomp.tt((4, 15), 2)          # 4 does not divide into rows=6 / cols=10
    with pytest.raises(ValueError, match="no leading modes multiply to rows"):
        PackedLinear.pack(w, d)


# ----------------------------------------------------------- njit callers
def test_cores_from_njit_caller():
    rng = np.random.default_rng(5)

    @numba.njit
    def call_all(x, w, values, indices, a, b, xm, w1, w2, core, u0, u1, u2, xt, flat,
                 shapes, split):
        return (K.dense_linear(x, w, 0), K.sparse24_linear(x, values, indices, 0),
                K.sparse24_linear(x[:3], values, indices, 1 << 40),
                K.lowrank_linear(x, a, b, 0), K.monarch_linear(xm, w1, w2, 0),
                K.tucker_linear(x, core, u0, u1, u2, 0),
                K.tt_linear(xt, flat, shapes, split, 0))

    w = _w((37, 51))
    x = _x(5, 51)
    sp = mining.pack(w, Decomp.sparse24())
    lr = mining.pack(w, Decomp.lowrank(4))
    mo = mining.pack(_w((49, 49)), Decomp.monarch())
    xm = _x(5, 49)
    d = Decomp.tucker((37, 3, 17), (4, 2, 5))
    tu = mining.pack(w, d)
    wt = _w((35, 51))
    dtt = Decomp.tt((5, 7, 3, 17), 4)
    tt = mining.pack(wt, dtt)
    shapes = np.array([tt[f"core{i}"].shape for i in range(4)], np.int64)
    flat = np.concatenate([tt[f"core{i}"].ravel() for i in range(4)])
    split = K.tt_split(shapes, 35)
    assert split == 2
    out = call_all(x, w, sp["values"], sp["indices"], lr["a"], lr["b"], xm, mo["w1"],
                   mo["w2"], tu["core"], tu["u0"], tu["u1"], tu["u2"], _x(5, 51), flat,
                   shapes, split)
    refs = [nv.linear(x, w), nv.linear(x, nv.unpack(sp, "sparse24", (37, 51))),
            nv.linear(x[:3], nv.unpack(sp, "sparse24", (37, 51))),
            nv.linear(x, nv.unpack(lr, "lowrank", (37, 51))),
            nv.linear(xm, nv.unpack(mo, "monarch", (49, 49))),
            nv.linear(x, nv.unpack(tu, "tucker", (37, 51))),
            nv.linear(_x(5, 51), nv.unpack(tt, "tt", (35, 51), modes=dtt.modes))]
    for got, ref in zip(out, refs):
        assert got.shape == ref.shape
        assert nv.rel(got, ref) <= 1e-5
    # the parallel branch equals the serial one bit for bit
    np.testing.assert_array_equal(out[1], K.sparse24_linear(x, sp["values"], sp["indices"],
                                                            1 << 40))
    ref_sp = nv.linear(x[:3], nv.unpack(sp, "sparse24", (37, 51)))
    assert nv.rel(K.sparse24_linear(x[:3], sp["values"], sp["indices"], 0, True),
                  ref_sp) <= 1e-5
    x20 = _x(20, 51)                    # TT: chunks of 8 samples in prange
    np.testing.assert_array_equal(K.tt_linear(x20, flat, shapes, split, 0),
                                  K.tt_linear(x20, flat, shapes, split, 1 << 40))
    assert nv.rel(K.tt_linear(x20, flat, shapes, split, 0),
                  nv.linear(x20, nv.unpack(tt, "tt", (35, 51), modes=dtt.modes))) <= 1e-5
    # both contraction orders are exercised by FLOAT_CASES:
    # (3*17*2 + 17*2*5 = 272) < (3*17*5 + 3*2*5 = 285): u1 first
    assert tuple(K.tucker_order((35, 3, 17), (4, 2, 5))) == (1, 272 + 40 + 35 * 4)
    # (17*3*2 + 17*9*2 = 408) < (17*3*9 + 3*9*2 = 513): u2 first
    assert tuple(K.tucker_order((35, 17, 3), (6, 9, 2))) == (0, 408 + 108 + 35 * 6)
    assert K.tt_split(shapes, 36) == -1
    del rng


# ----------------------------------------------------------- latency fields
def test_latency_json_round_trip():
    o = DecompOption(Decomp.lowrank(3), 0.25, 100, 7, {1: 3.5, 32: 12.25})
    d = json.loads(json.dumps(o.to_dict()))
    assert d["latency_us"] == {"1": 3.5, "32": 12.25}
    back = DecompOption.from_dict(d)
    assert back.latency_us == {1: 3.5, 32: 12.25}
    assert all(type(k) is int for k in back.latency_us)
    assert back == o and hash(back) == hash(o)
    plain = DecompOption.from_dict({k: v for k, v in d.items() if k != "latency_us"})
    assert plain.latency_us == {}
    lp = LayerProfile("l", 4, 4, 64, [o])
    lp2 = LayerProfile.from_dict(json.loads(json.dumps(lp.to_dict())))
    assert lp2.options[0].latency_us == {1: 3.5, 32: 12.25}


def test_profile_layer_latency():
    w = _w((16, 36), 4)
    lp = profile_layer("t", w, rank_cap=4, latency=(1, 3))
    assert "latency" in lp.timings
    for o in lp.options:
        if has_kernel(o.decomp.kind):
            assert set(o.latency_us) == {1, 3}, o.label
            assert all(math.isfinite(v) and v > 0 for v in o.latency_us.values())
        else:
            assert o.latency_us == {}
    assert lp.options[0].latency_us          # dense always runs
    lp0 = profile_layer("t", w, rank_cap=4)
    assert all(o.latency_us == {} for o in lp0.options)
    assert "latency" not in lp0.timings
    for bad in ((0,), (1.5,), (), "x"):
        with pytest.raises((ValueError, TypeError), match="latency batch sizes"):
            profile_layer("t", w, latency=bad)


def test_measure_latency():
    lin = PackedLinear.pack(_w((8, 12)), Decomp.dense())
    t = measure_latency(lin, [2, 2, 1], rounds=1)
    assert list(t) == [2, 1] and all(v > 0 for v in t.values())
    t25 = measure_latency(lin, (1,), rounds=1, quantile=0.25)
    assert set(t25) == {1} and t25[1] > 0
    with pytest.raises(TypeError, match="PackedLinear"):
        measure_latency(np.zeros(3), (1,))
    for q in (0.0, 1.5):
        with pytest.raises(ValueError, match="quantile"):
            measure_latency(lin, (1,), quantile=q)


def test_int8_weight_sums_at_construction():
    """int8/chan: the code sums the W8A8 prefill needs are computed when the
    layer is built (never cached on first use); results equal the kernel run
    with sums computed here."""
    w = _w((45, 68), seed=3)
    lin = PackedLinear.pack(w, Decomp.int8())
    x = _x(33, 68, seed=4)
    # writable copies (a read-only array is a numba specialisation of its own)
    codes, scales = lin.arrays["codes"].copy(), lin.arrays["scales"].copy()
    np.testing.assert_array_equal(lin._aux, codes.astype(np.int64).sum(1))
    y = lin(x, "int8")
    xq, sx = K.quantize_rows_i8(x)
    np.testing.assert_array_equal(y, K.matmul_w8a8(xq, sx, codes, scales))
    np.testing.assert_array_equal(lin(x, "int8"), y)


def test_arrays_are_read_only_views():
    """Review finding (issue 23): ``arrays`` handed out the live buffers, so an
    in-place edit of the codes changed the layer behind the cached W8A8 sums
    (a silently wrong prefill).  Now every array is a read-only view."""
    w = _w((16, 40), seed=5)
    for d in (Decomp.int8(), Decomp.int4(8), Decomp.dense(), Decomp.lowrank(3)):
        lin = PackedLinear.pack(w, d)
        x = _x(9, 40, seed=6)
        y0 = lin(x, "int8" if d.kind == "int8" else "auto")
        for name, a in lin.arrays.items():
            assert not a.flags.writeable, (d.label, name)
            with pytest.raises(ValueError, match="read-only"):
                a.reshape(-1)[0] = 1
        np.testing.assert_array_equal(lin(x, "int8" if d.kind == "int8" else "auto"), y0)