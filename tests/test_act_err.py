"""llama.cpp's activation rounding in the profile's error model (issue 59):
the calibration's per-input rounding sums, ``LayerProfile.act_err``, and the
allocators' ``act_quant`` terms."""
import json
import os

import numpy as np
import pytest

from naive_models import write_tiny_llama


def _rounding_twin(x, inv=None):
    """The obvious twin of ``calib._act_sq``: round each token row with
    ``runtime_activations`` and sum the squared differences per column."""
    from opscope_nb.formats.ggml import runtime_activations
    out = {}
    for a, (wt, block) in {"F16": ("F16", 1), "BF16": ("BF16", 1), "Q8_0": ("Q4_0", 32),
                           "Q8_K": ("Q6_K", 256)}.items():
        if x.shape[1] % block:
            continue
        tot = np.zeros(x.shape[1])
        for t in range(x.shape[0]):
            d = runtime_activations(x[t:t + 1], wt)[0].astype(np.float64) - x[t]
            tot += (1.0 if inv is None else inv[t]) * d * d
        out[a] = tot
    return out


@pytest.mark.parametrize("cols", [256, 96, 7])
def test_act_sq_equals_row_by_row_twin(cols):
    from opscope_nb.profile.calib import _act_sq
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((40, cols)).astype(np.float32)
    x[3, 5] = 60.0                        # an outlier: its block rounds coarsely
    inv = rng.uniform(0.1, 3.0, 40)
    for w in (None, inv):
        got, ref = _act_sq(x, w), _rounding_twin(x, w)
        assert set(got) == set(ref) == ({"F16", "BF16", "Q8_0", "Q8_K"} if cols == 256 else
                                        {"F16", "BF16", "Q8_0"} if cols == 96 else
                                        {"F16", "BF16"})
        for a in ref:
            np.testing.assert_allclose(got[a], ref[a], rtol=1e-6, atol=0, err_msg=a)
    # Q8_K's 256-blocks round coarser than Q8_0's 32-blocks around an outlier
    if cols == 256:
        s = _act_sq(x)
        assert s["Q8_K"].sum() > s["Q8_0"].sum() > s["F16"].sum() > 0
    assert _act_sq(np.zeros((0, cols), np.float32)) == {}


def test_activation_errors_track_the_true_output_error():
    """The estimate ``sum_c e_c |W_c|²`` against ``|(X̂ - X) Wᵀ|²`` itself."""
    from opscope_nb.formats.ggml import runtime_activations
    from opscope_nb.profile.calib import _act_sq
    from opscope_nb.profile.mining import activation_errors
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 512)).astype(np.float32)
    x[:, 17] *= 30.0                      # an outlier channel, as real inputs have
    w = rng.standard_normal((384, 512)).astype(np.float32)
    den = float(np.sum((x.astype(np.float64) @ w.T.astype(np.float64)) ** 2))
    est = activation_errors(w, _act_sq(x), den)
    for a, wt in (("F16", "F16"), ("Q8_0", "Q8_0"), ("Q8_K", "Q4_K")):
        d = (runtime_activations(x, wt).astype(np.float64) - x) @ w.T.astype(np.float64)
        true = float(np.sqrt(np.sum(d * d) / den))
        assert est[a] == pytest.approx(true, rel=0.05), a
    assert est["Q8_K"] > 1.5 * est["Q8_0"] > 0
    assert activation_errors(w, _act_sq(x), 0.0) == {a: 0.0 for a in est}


def _ggml_layer(name, seed, cols=256, rows=64, act_sq=True, outlier=40.0):
    from opscope_nb.profile.calib import _act_sq
    from opscope_nb.profile.mining import profile_layer
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal((300, cols)).astype(np.float32)
    x[:, 3] *= outlier
    g = x.T.astype(np.float64) @ x.astype(np.float64)
    return profile_layer(name, w, menu="ggml", ggml_types=["Q8_0", "Q6_K", "Q4_K", "Q4_0"],
                         gram=g, gptq="none", act_sq=_act_sq(x) if act_sq else None,
                         sensitivity=1.0)


def test_profile_layer_act_err_round_trip_and_checks():
    from opscope_nb.profile.mining import LayerProfile, profile_layer
    lp = _ggml_layer("a", 1)
    assert set(lp.act_err) == {"F16", "BF16", "Q8_0", "Q8_K"}
    assert lp.act_err["Q8_K"] > lp.act_err["Q8_0"] > lp.act_err["F16"] > 0
    back = LayerProfile.from_dict(json.loads(json.dumps(lp.to_dict())))
    assert back.act_err == pytest.approx(lp.act_err)
    assert LayerProfile.from_dict(_ggml_layer("b", 1, act_sq=False).to_dict()).act_err is None
    w = np.ones((4, 64), np.float32)
    g = np.eye(64)
    with pytest.raises(ValueError, match="needs gram"):
        profile_layer("x", w, menu="ggml", act_sq={"Q8_0": np.zeros(64)})
    with pytest.raises(ValueError, match="unknown activation type 'Q8_1'"):
        profile_layer("x", w, menu="ggml", gram=g, act_sq={"Q8_1": np.zeros(64)})
    with pytest.raises(ValueError, match="64 finite values"):
        profile_layer("x", w, menu="ggml", gram=g, act_sq={"Q8_0": np.full(64, np.nan)})
    with pytest.raises(ValueError, match="64 finite values"):
        profile_layer("x", w, menu="ggml", gram=g, act_sq={"Q8_0": np.zeros(32)})
    with pytest.raises(TypeError, match="act_sq must be a dict"):
        profile_layer("x", w, menu="ggml", gram=g, act_sq=[np.zeros(64)])


def test_allocators_add_the_activation_term():
    from opscope_nb.plan import allocate as al
    from opscope_nb.plan.allocate import option_act_type
    # a strong outlier channel: Q6_K's weights beat Q8_0's, but its Q8_K
    # activations round the other 255 inputs of each block coarsely
    lps = [_ggml_layer(f"l{i}", 10 + i, outlier=200.0) for i in range(3)]
    lbl = [o.label for o in lps[0].options]
    types = {o.label: option_act_type(lps[0], o) for o in lps[0].options}
    assert types[lbl[0]] is None                             # dense float32 as stored
    assert {types[k] for k in lbl if "Q4_K" in k or "Q6_K" in k} == {"Q8_K"}
    assert {types[k] for k in lbl if "Q4_0" in k or "Q8_0" in k} == {"Q8_0"}
    # the twin: each option's term by hand
    for aq in ("ggml", "none"):
        for j, o in enumerate(lps[0].options):
            a = lps[0].act_err.get(types[o.label], 0.0) if aq == "ggml" else 0.0
            assert al.predicted_damage(lps[:1], [j], "sensitivity", aq) == pytest.approx(
                o.out_err ** 2 + a ** 2, rel=1e-12)
    assert al.act_quant_mode("auto", lps) == "ggml"
    # Q8_0's bytes: without the activations Q6_K wins on its weight error;
    # with them, Q8_0 (Q8_0 activations)
    b = 8.0 * sum(o.bytes for lp in lps for o in lp.options if o.label == "Q8_0") / (3 * 64 * 256)
    none = al.exact_allocate(lps, budget_bpw=b, objective="sensitivity", act_quant="none")
    gg = al.exact_allocate(lps, budget_bpw=b, objective="sensitivity")
    assert [lps[0].options[c].label for c in none.choice] == ["Q6_K"] * 3
    assert [lps[0].options[c].label for c in gg.choice] == ["Q8_0"] * 3
    assert gg.extra["act_quant_layers"] == 3 and "act_quant_layers" not in none.extra
    assert gg.total_err == pytest.approx(al.predicted_damage(lps, gg.choice, "sensitivity"))
    # the output objective adds it too; the weight objective never does
    out = al.exact_allocate(lps, budget_bpw=b, objective="output")
    assert [lps[0].options[c].label for c in out.choice] == ["Q8_0"] * 3
    wt = al.exact_allocate(lps, budget_bpw=b, objective="weight")
    assert "act_quant_layers" not in wt.extra
    with pytest.raises(ValueError, match="act_quant must be one of"):
        al.exact_allocate(lps, budget_bpw=4.0, objective="sensitivity", act_quant="yes")


def test_stream_act_sq_equals_the_layer_inputs_twin(tmp_path):
    """The calibration's per-layer rounding sums equal the twin on the very
    inputs a whole-model forward feeds that layer."""
    from test_calib_stream import _whole_model_grams
    from opscope_nb.profile.calib import CalibrationStream
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=4, n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv=2)
    name = "model.layers.1.mlp.down_proj.weight"
    _g, x = _whole_model_grams(src, 200, window=100, keep=name)
    st = CalibrationStream(src, max_tokens=200, sensitivity=False, window=100)
    st.gram(name)
    got = st.act_sq(name)
    ref = _rounding_twin(x.astype(np.float32))
    assert set(got) == set(ref) == {"F16", "BF16", "Q8_0", "Q8_K"}
    for a in ref:
        np.testing.assert_allclose(got[a], ref[a], rtol=1e-6, atol=1e-12, err_msg=a)
    q = "model.layers.1.self_attn.q_proj.weight"
    st2 = CalibrationStream(src, max_tokens=200, sensitivity=False, window=100)
    st2.gram(q)
    assert st2.act_sq(q) is st2.act_sq("model.layers.1.self_attn.k_proj.weight")


def test_cli_profile_calib_records_act_err(tmp_path):
    from test_calib_stream import _cli
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=5, n_layers=2, hidden=256, ffn=512)
    out = str(tmp_path / "o")
    r = _cli("profile", src, "--calib", "--calib-tokens", "120", "--out", out, "--menu", "ggml",
             "--types", "Q8_0,Q6_K,Q4_K,Q4_0", "--bpw", "5", "--no-sensitivity",
             "--objective", "output")
    assert r.returncode == 0, r.stderr
    doc = json.load(open(os.path.join(out, "profile.json")))
    assert doc["layers"] and all(set(rec["profile"]["act_err"]) == {"F16", "BF16", "Q8_0", "Q8_K"}
                                 for rec in doc["layers"])
    plan = json.load(open(os.path.join(out, "plan.json")))
    assert "act_quant_layers" in json.dumps(plan)


def test_plan_validation_reads_llamacpps_activations(tmp_path):
    """``CalibrationStream(plans=..., act_quant="ggml")``: a Q8_0 plan measures
    more than with float activations (its inputs go through Q8_0 blocks), a
    dense plan the same; the result says which."""
    from opscope_nb.formats import Decomp
    from opscope_nb.models.loader import is_linear
    from opscope_nb.models import open_model
    from opscope_nb.profile.calib import CalibrationStream
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=6, n_layers=2, hidden=256, ffn=512)
    m = open_model(src)
    names = [n for n, t in m.tensors.items() if is_linear(t)]
    q8 = {n: Decomp(kind="ggml", qtype="Q8_0") for n in names}
    dense = {n: Decomp(kind="dense") for n in names}
    got = {}
    for aq in ("none", "ggml"):
        st = CalibrationStream(src, max_tokens=400, sensitivity=False, window=100,
                               validate=0.5, plans={"q8": q8, "dense": dense}, act_quant=aq)
        got[aq] = st.result(rest=False).validation
    assert got["ggml"]["q8"]["act_quant"] == "ggml" and got["none"]["q8"]["act_quant"] == "none"
    assert got["ggml"]["q8"]["measured"] > 1.5 * got["none"]["q8"]["measured"] > 0
    assert got["ggml"]["dense"]["measured"] == got["none"]["dense"]["measured"]
    with pytest.raises(ValueError, match="act_quant must be 'none' or 'ggml'"):
        CalibrationStream(src, max_tokens=400, validate=0.5, plans={"q8": q8}, act_quant="yes")
