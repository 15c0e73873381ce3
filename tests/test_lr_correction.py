"""Quantised + low-rank-correction composites (``int4/g32+lr16``): labels,
honest bytes, the output-space fit against a NumPy twin, the runtime call,
the menu of :func:`profile_layer`, and a checkpoint round trip.

The twins (``_twin_factors``, ``_twin_quant``) use NumPy's LAPACK SVD /
Cholesky and never import the code under test."""
from __future__ import annotations

import numpy as np
import pytest

from opscope_nb.runtime import checkpoint
from opscope_nb.formats import (
    LR_KINDS,
    Decomp,
    approximate,
    correction_factors,
    layout,
    pack,
    packed_bytes,
    unpack,
)
from opscope_nb.profile.mining import profile_layer
from opscope_nb.runtime import PackedLinear

from naive_runtime import unpack as twin_unpack

DAMP = 0.1           # formats.LR_DAMP, restated (the twin does not import it)


def _data(rows=48, cols=96, n=300, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    # anisotropic inputs: a few loud columns, so output space != weight space
    x = rng.standard_normal((n, cols)) * np.linspace(0.2, 2.0, cols)
    x[:, :4] *= 8.0
    return w, x, x.T @ x


def _twin_factors(e, r, gram):
    """``argmin ‖(E − UV) L‖`` over rank r, ``L Lᵀ = gram/mean + DAMP I``."""
    e = np.asarray(e, np.float64)
    if gram is None:
        p, s, qt = np.linalg.svd(e, full_matrices=False)
        return p[:, :r] * s[:r], qt[:r]
    h = gram / np.mean(np.diag(gram)) + DAMP * np.eye(gram.shape[0])
    lo = np.linalg.cholesky(h)
    p, s, qt = np.linalg.svd(e @ lo, full_matrices=False)
    return p[:, :r] * s[:r], qt[:r] @ np.linalg.inv(lo)


def _correction(p):
    """``(u * s) @ v`` of packed int8 factors, in float64."""
    return (p["lr_u"].astype(np.float64) * p["lr_s"]) @ p["lr_v"].astype(np.float64)


def _out_err(w, w_hat, gram):
    d = np.asarray(w, np.float64) - w_hat
    return np.sqrt(np.trace(d @ gram @ d.T) / np.trace(w.astype(np.float64) @ gram @ w.T))


# ───────────────────────────── the Decomp ─────────────────────────────

@pytest.mark.parametrize("label", ["int8/chan+lr8", "int4/chan+lr16", "int4/g32+lr32",
                                   "int3/g32+gptq+lr16", "int2/g32+lr8", "int6/chan+lr4"])
def test_label_round_trip(label):
    d = Decomp.from_label(label)
    assert d.label == label and d.lr == int(label.rsplit("+lr", 1)[1])
    assert d.kind in LR_KINDS
    assert Decomp.from_dict(d.to_dict()) == d
    assert d.with_correction(None).label == label.rsplit("+lr", 1)[0]
    assert d.reads_gram


def test_bad_corrections_say_the_rule():
    with pytest.raises(ValueError, match="applies to the kinds"):
        Decomp.lowrank(4).with_correction(8)
    with pytest.raises(ValueError, match="applies to the kinds"):
        Decomp.from_label("Q4_K+lr8")
    with pytest.raises(ValueError):
        Decomp.int8().with_correction(0)
    with pytest.raises(ValueError, match="min\\(rows, cols\\)"):
        layout(16, 8, Decomp.int4(4).with_correction(9))
    assert not Decomp.int4(32).reads_gram


def test_layout_and_bytes_are_honest():
    w, _, g = _data()
    for label in ("int8/chan+lr8", "int4/g32+lr16", "int5/g32+lr8", "int3/chan+lr32"):
        d = Decomp.from_label(label)
        p = pack(w, d, gram=g)
        lay = layout(*w.shape, d)
        assert list(p) == list(lay)
        assert p["lr_u"].dtype == np.int8 and p["lr_u"].shape == (48, d.lr)
        assert p["lr_v"].dtype == np.int8 and p["lr_v"].shape == (d.lr, 96)
        assert p["lr_s"].dtype == np.float32 and p["lr_s"].shape == (d.lr,)
        assert sum(a.nbytes for a in p.values()) == packed_bytes(*w.shape, d)
        base = packed_bytes(*w.shape, d.with_correction(None))
        assert packed_bytes(*w.shape, d) == base + (48 + 96 + 4) * d.lr


# ───────────────────────────── the fit ─────────────────────────────

@pytest.mark.parametrize("with_gram", [False, True])
def test_fit_equals_numpy_twin(with_gram):
    w, _, g = _data()
    d = Decomp.from_label("int3/g32+lr8")
    gram = g if with_gram else None
    p = pack(w, d, gram=gram)
    q = twin_unpack({k: v for k, v in p.items() if not k.startswith("lr_")}, "intn",
                    w.shape, group=32, bits=3)
    e = w.astype(np.float64) - q
    tu, tv = _twin_factors(e, 8, gram)
    ours = _correction(p)
    twin = tu @ tv
    # the product is unique (distinct singular values); int8 factors: ~0.5 %
    assert np.abs(ours - twin).max() <= 2e-2 * np.abs(twin).max()
    assert np.linalg.norm(ours - twin) <= 1e-2 * np.linalg.norm(twin)
    np.testing.assert_allclose(unpack(p, d, w.shape), q + ours, rtol=0, atol=1e-6)
    # the codes: symmetric int8 per column of u / row of v, round half away
    for codes, axis in ((p["lr_u"], 0), (p["lr_v"], 1)):
        assert np.abs(codes.astype(int)).max(axis=axis).min() == 127
        assert codes.min() >= -127


def test_output_space_fit_beats_weight_space_on_the_inputs():
    w, _, g = _data()
    d = Decomp.from_label("int3/g32+lr8")
    base = approximate(w, d.with_correction(None))
    fit_out = approximate(w, d, gram=g)
    fit_w = approximate(w, d)
    e_base, e_out, e_w = (_out_err(w, a, g) for a in (base, fit_out, fit_w))
    assert e_out < e_w < e_base
    # weight space: the plain SVD is the better weight-space fit
    assert np.linalg.norm(w - fit_w) < np.linalg.norm(w - fit_out)


def test_ranks_nest_and_improve():
    w, _, g = _data()
    errs = []
    prev = prev_s = None
    for r in (4, 8, 16, 32):
        p = pack(w, Decomp.int4(32).with_correction(r), gram=g)
        if prev is not None:          # the leading triplets of one SVD
            np.testing.assert_array_equal(p["lr_u"][:, :prev.shape[1]], prev)
            np.testing.assert_array_equal(p["lr_s"][:prev.shape[1]], prev_s)
        prev_s = p["lr_s"]
        prev = p["lr_u"]
        errs.append(_out_err(w, unpack(p, Decomp.int4(32).with_correction(r), w.shape), g))
    assert all(b < a for a, b in zip(errs, errs[1:]))


def test_degenerate_inputs():
    w, _, g = _data(rows=8, cols=12)
    # a gram that saw no input: weight-space fit, no NaN
    p = pack(w, Decomp.int4().with_correction(4), gram=np.zeros((12, 12)))
    assert np.isfinite(unpack(p, Decomp.int4().with_correction(4), w.shape)).all()
    # an all-zero weight: zero residual, zero factors
    z = np.zeros((8, 12), np.float32)
    p = pack(z, Decomp.intn(3).with_correction(2), gram=g[:12, :12])
    assert not p["lr_u"].any() or not p["lr_v"].any()
    # a diagonal gram works and matches the 2-D gram of the same diagonal
    d = Decomp.int4().with_correction(4)
    e = w - approximate(w, Decomp.int4())
    dg = np.diag(g).copy()
    a = correction_factors(e, 4, dg)
    b = correction_factors(e, 4, np.diag(dg))
    assert a[0].shape == (8, 4) and a[1].shape == (4, 12)
    pa, pb = ((f[0].astype(np.float64) * f[2]) @ f[1] for f in (a, b))
    assert np.abs(pa - pb).max() <= 1e-2 * np.abs(pb).max()
    with pytest.raises(ValueError):
        pack(np.full((8, 12), np.nan, np.float32), d)


# ───────────────────────────── runtime ─────────────────────────────

@pytest.mark.parametrize("label", ["int8/chan+lr8", "int4/chan+lr8", "int4/g32+lr16",
                                   "int5/g32+lr8", "int2/g32+lr4"])
def test_packed_linear_runs_codes_plus_correction(label):
    w, x, g = _data(rows=40, cols=96)
    d = Decomp.from_label(label)
    p = pack(w, d, gram=g)
    base = d.with_correction(None)
    q = twin_unpack({k: v for k, v in p.items() if not k.startswith("lr_")},
                    base.kind, w.shape, group=base.group, bits=base.bits)
    w_hat = q + _correction(p)
    lin = PackedLinear(d, p, w.shape)
    assert lin.nbytes == packed_bytes(*w.shape, d)
    xs = x[:5].astype(np.float32)
    ref = xs.astype(np.float64) @ w_hat.T
    y = lin(xs, act="f32")
    assert y.dtype == np.float32 and y.shape == (5, 40)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()
    y1 = lin(xs[0], act="f32")
    assert y1.shape == (40,)
    np.testing.assert_allclose(y1, y[0], rtol=1e-5, atol=1e-6)
    assert lin(np.zeros((0, 96), np.float32)).shape == (0, 40)
    with pytest.raises(ValueError, match="finite"):
        lin(np.full((1, 96), np.inf, np.float32))
    bad = dict(p)
    bad["lr_v"] = p["lr_v"].astype(np.float16)
    with pytest.raises(ValueError, match="lr_v"):
        PackedLinear(d, bad, w.shape)
    with pytest.raises(ValueError, match="lr_u"):
        PackedLinear(d, {k: v for k, v in p.items() if k != "lr_u"}, w.shape)


def test_checkpoint_round_trip(tmp_path):
    w, _, g = _data(rows=24, cols=64)
    d = Decomp.from_label("int3/g32+gptq+lr8")
    lin = PackedLinear.pack(w, d, gram=g)
    path = checkpoint.save(tmp_path / "m.safetensors", {"l": lin}, {})
    got, _ = checkpoint.load(path)
    assert got["l"].decomp == d
    for k, a in lin.arrays.items():
        np.testing.assert_array_equal(got["l"].arrays[k], a)


# ───────────────────────────── the menu ─────────────────────────────

def test_profile_layer_offers_measured_composites():
    w, _, g = _data(rows=48, cols=96)
    lp = profile_layer("l", w, gram=g, seed=2)
    labels = [o.label for o in lp.options]
    # every quantised option (and +gptq twin) is followed by its +lr ranks that fit
    i = labels.index("int4/g32")
    assert labels[i + 1:i + 4] == ["int4/g32+lr8", "int4/g32+lr16", "int4/g32+lr32"]
    assert "int3/g32+gptq+lr16" in labels
    ref = 4 * 48 * 96
    for o in lp.options:
        if o.decomp.lr is None:
            continue
        assert o.bytes < ref and o.decomp.seed == 2
        a = approximate(w, o.decomp, gram=g)
        assert o.bytes == sum(v.nbytes for v in pack(w, o.decomp, gram=g).values())
        assert o.rel_err == pytest.approx(np.linalg.norm(w - a) / np.linalg.norm(w),
                                          rel=1e-6)
        assert o.out_err == pytest.approx(_out_err(w, a, g), rel=1e-6, abs=1e-9)
        base = next(b for b in lp.options if b.decomp == o.decomp.with_correction(None))
        assert o.out_err < base.out_err
    none = profile_layer("l", w, gram=g, lr_ranks=())
    assert not any(o.decomp.lr for o in none.options)
    assert [o.label for o in none.options] == [lab for lab in labels if "+lr" not in lab]


def test_profile_layer_only_composites_that_compress():
    w, _, _ = _data(rows=16, cols=64)
    lp = profile_layer("l", w, lr_ranks=(8, 16, 32))
    got = {o.decomp.lr for o in lp.options if o.decomp.lr}
    # rank 32 > min(rows, cols) = 16: not offered; rank 16 on int8: 16*64 + 64 + 84*16 B
    assert got == {8, 16}
    assert all(o.bytes < 4 * 16 * 64 for o in lp.options if o.decomp.lr)
    assert all(o.out_err is None for o in lp.options)
    with pytest.raises(TypeError):
        profile_layer("l", w, lr_ranks="8")
    with pytest.raises(ValueError):
        profile_layer("l", w, lr_ranks=(0,))


def test_cli_lr_ranks(tmp_path):
    import json

    from opscope_nb.cli import main
    from test_io import write_st
    rng = np.random.default_rng(1)
    src = tmp_path / "m.safetensors"
    write_st(src, {"a.weight": rng.standard_normal((24, 64)).astype(np.float32)})
    for arg, want in (([], {8, 16}), (["--lr-ranks", "8"], {8}), (["--lr-ranks", "none"],
                                                                   set())):
        out = tmp_path / f"o{len(want)}"
        assert main(["profile", str(src), "--out", str(out), "-q", *arg]) == 0
        doc = json.load(open(out / "profile.json"))
        got = {o["decomp"].get("lr") for o in doc["layers"][0]["profile"]["options"]} - {None}
        assert got == want
        assert doc["settings"]["lr_ranks"] == ([8, 16, 32] if not arg else
                                               ([8] if want else []))
