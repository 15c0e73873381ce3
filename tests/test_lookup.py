"""A token-embedding table read as a lookup (issue 59: a tied table's input
role was missing from the error model): the calibration's row counts and
lookup probe, ``LayerProfile.lookup``, the allocators' term and the plans'
validation with the table quantised in both roles."""
import json
import os

import numpy as np
import pytest

from naive_models import write_tiny_llama
from opscope_nb.formats import Decomp
from opscope_nb.profile.mining import DecompOption, LayerProfile


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("lk") / "m")
    write_tiny_llama(src, seed=5, n_layers=2, hidden=256, ffn=512, tied=True)
    return src


def _fit_ids(st, src):
    from opscope_nb.models import open_model
    from opscope_nb.models.evaluate import load_passages
    m = open_model(src)
    ids = list(m.tokenizer.encode("\n".join(load_passages(None))).ids)
    if m.config.get("add_bos") and m.config.get("bos") is not None:
        ids = [int(m.config["bos"])] + ids
    return np.asarray(ids[:st.tokens], np.int64)


def test_stream_counts_rows_and_probes_the_lookup_like_a_twin(tied):
    """Row counts are those of the calibration tokens; the lookup probe's
    sensitivity is KL(clean || table rows + s Z) / eps² of a whole forward with
    the perturbed table (the obvious twin), apart from the head's own probe,
    and the same on a second run."""
    from opscope_nb.models import llama, open_model
    from opscope_nb.models.evaluate import kl_stats
    from opscope_nb.models.loader import dense_linear
    from opscope_nb.profile.calib import LOOKUP, CalibrationStream
    st = CalibrationStream(tied, max_tokens=120, sensitivity=True, sens_tokens=64)
    name = st.lookup_table
    assert name == "model.embed_tokens.weight"
    rows, counts = st.lookup(name)
    ids = _fit_ids(st, tied)
    r, c = np.unique(ids, return_counts=True)
    np.testing.assert_array_equal(rows, r)
    np.testing.assert_array_equal(counts, c.astype(np.float64))
    assert st.lookup("model.layers.0.mlp.up_proj.weight") is None
    idx = st._sens_index[name + LOOKUP]
    cal = st.result()
    ls = cal.lookup_sensitivity[name]
    assert name in cal.sensitivity and name + LOOKUP not in cal.sensitivity
    assert ls > 0 and not np.isclose(ls, cal.sensitivity[name], rtol=0.1)
    # the twin: perturb the looked-up rows of the table, run the whole model
    m = open_model(tied)
    W = np.asarray(m.tensors[name], np.float32).copy()
    sids = ids[:st.sens_tokens]
    u = np.unique(sids)
    z = np.stack([np.random.default_rng([0, idx, int(k)]).standard_normal(W.shape[1],
                                                                         dtype=np.float32)
                  for k in u])
    zt = np.zeros_like(W)
    zt[u] = z
    s = 0.05 * np.linalg.norm(W[sids].astype(np.float64)) / np.linalg.norm(
        zt[sids].astype(np.float64))

    def run(table):
        m.tensors[name] = table
        m.extras["head"] = dense_linear(W)
        return llama.forward(m, sids, llama.KVCache(m.config, len(sids)), act="f32")
    kl = kl_stats(run(W), run(W + np.float32(s) * zt))[0].mean()
    assert ls == pytest.approx(kl / 0.05 ** 2, rel=1e-3)
    again = CalibrationStream(tied, max_tokens=120, sensitivity=True, sens_tokens=64).result()
    assert again.lookup_sensitivity[name] == ls
    # no sensitivity asked for: the counts only
    st0 = CalibrationStream(tied, max_tokens=120, sensitivity=False)
    assert st0.lookup(name) is not None and st0.result().lookup_sensitivity == {}


def _twin_lookup_err(w, rows, counts, qt):
    from opscope_nb.formats import ggml
    q = ggml.dequantize(ggml.quantize(w[rows], qt), qt, (len(rows), w.shape[1]))
    num = counts @ ((w[rows].astype(np.float64) - q) ** 2).sum(1)
    return float(np.sqrt(num / (counts @ (w[rows].astype(np.float64) ** 2).sum(1))))


@pytest.mark.parametrize("sample_rows", ["all", "256"])
def test_profile_layer_lookup_errors_equal_the_numpy_twin(sample_rows):
    from opscope_nb.profile.mining import profile_layer
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3000, 64)).astype(np.float32)
    w[:40] *= 6.0                                    # frequent rows: larger, coarser
    rows = np.array([1, 5, 7, 30, 2999])
    counts = np.array([40.0, 3.0, 1.0, 9.0, 2.0])
    lp = profile_layer("tok", w, menu="ggml", ggml_types=["Q8_0", "Q4_0"],
                       sample_rows=sample_rows, lookup=(rows, counts))
    labels = [o.label for o in lp.options]
    assert lp.lookup["tokens"] == 55 and lp.lookup["rows"] == 5
    assert lp.lookup["err"][labels.index("dense")] == 0.0
    for qt in ("Q8_0", "Q4_0"):
        got = lp.lookup["err"][labels.index(qt)]
        assert got == pytest.approx(_twin_lookup_err(w, rows, counts, qt), rel=1e-6)
    # the frequent rows weigh more: not the table's plain relative error
    o = lp.options[labels.index("Q4_0")]
    assert abs(lp.lookup["err"][labels.index("Q4_0")] - o.rel_err) > 1e-3
    back = LayerProfile.from_dict(json.loads(json.dumps(lp.to_dict())))
    assert back.lookup == lp.lookup


def test_profile_layer_lookup_bad_input():
    from opscope_nb.profile.mining import profile_layer
    w = np.random.default_rng(0).standard_normal((50, 32)).astype(np.float32)
    for bad, exc in ((([1, 50], [1.0, 1.0]), ValueError),
                     (([1, 1], [1.0, 1.0]), ValueError),
                     (([-1], [1.0]), ValueError),
                     (([], []), ValueError),
                     (([1, 2], [1.0]), ValueError),
                     (([1.0, 2.0], [1.0, 1.0]), ValueError),
                     (([1, 2], [1.0, 0.0]), ValueError),
                     (([1, 2], [1.0, np.nan]), ValueError),
                     ("rows", TypeError)):
        with pytest.raises(exc, match="lookup"):
            profile_layer("t", w, menu="ggml", ggml_types=["Q8_0"], lookup=bad)
    lp = profile_layer("t", w, menu="ggml", ggml_types=["Q8_0"], lookup=([1], [2.0]))
    d = lp.to_dict()
    d["lookup"]["err"] = d["lookup"]["err"][:1]
    with pytest.raises(ValueError, match="lookup err has 1 values"):
        LayerProfile.from_dict(d)


def _table(sens, out_err, lookup):
    ds = (Decomp.dense(), Decomp.int8(), Decomp.intn(2, 32))
    errs, sizes = (0.0, 0.1, 0.39), (100, 75, 1)
    opts = [DecompOption(d, e, b, 10, {}, None if out_err is None else out_err[k])
            for k, (d, e, b) in enumerate(zip(ds, errs, sizes))]
    return LayerProfile("tok", 10, 10, 100, opts, {}, sens, lookup=lookup)


def test_allocators_add_the_lookup_term():
    from opscope_nb.plan.allocate import exact_allocate, predicted_damage
    lk = {"err": [0.0, 0.3, 0.8], "tokens": 10, "rows": 3, "sensitivity": 50.0}
    other = _table(1.0, (0.0, 0.1, 0.39), None)
    other.name = "l1"
    # tied: the head's term plus the lookup's
    head = _table(2.0, (0.0, 0.1, 0.39), dict(lk))
    assert predicted_damage([head, other], [1, 2]) == pytest.approx(
        2.0 * 0.01 + 50.0 * 0.09 + 1.0 * 0.39 ** 2)
    # 160 of 200 bytes: int8 twice without the lookup; with it the table stays
    # dense and the other layer takes the int2 cut
    bare = _table(2.0, (0.0, 0.1, 0.39), None)
    assert list(exact_allocate([bare, other], 0.8, objective="sensitivity").choice) == [1, 1]
    a = exact_allocate([head, other], 0.8, objective="sensitivity")
    assert list(a.choice) == [0, 2] and a.extra["lookup_layers"] == 1
    # untied (no out_err): the lookup replaces the weight-error fallback
    untied = _table(None, None, dict(lk))
    assert predicted_damage([untied, other], [1, 0]) == pytest.approx(50.0 * 0.09)
    e = exact_allocate([untied, other], 0.8, objective="sensitivity")
    assert e.extra["objective_fallback_layers"] == 0
    # the output objective (no sensitivities) weighs the lookup as one layer
    plain = _table(None, (0.0, 0.1, 0.39), {"err": [0.0, 0.3, 0.8], "tokens": 10, "rows": 3})
    assert predicted_damage([plain], [1], "output") == pytest.approx(0.01 + 0.09)
    with pytest.raises(ValueError, match="lookup sensitivity"):
        predicted_damage([_table(1.0, (0.0, 0.1, 0.39), dict(lk, sensitivity=-1.0))], [1])


def test_validation_runs_the_tables_lookup_quantised(tied):
    """A plan that quantises the tied table is measured with both roles
    quantised: the twin with both equals it, the head alone does not."""
    from opscope_nb.models import llama, open_model
    from opscope_nb.models.evaluate import kl_stats
    from opscope_nb.models.loader import dense_linear
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.formats.ggml import dequantize, quantize
    name = "model.embed_tokens.weight"
    d = Decomp.ggml("Q8_0")
    st = CalibrationStream(tied, max_tokens=200, sensitivity=False, validate=0.5,
                           plans={"p": {name: d}})
    val = st.result().validation["p"]
    m = open_model(tied)
    W = np.asarray(m.tensors[name], np.float32).copy()
    Wq = dequantize(quantize(W, "Q8_0"), "Q8_0", W.shape)
    got = {}
    for lab, inp in (("both", Wq), ("head", W)):
        kls = []
        for c in st._val_chunks:
            ids = c["ids"]

            def run(table, head):
                m.tensors[name] = table
                m.extras["head"] = dense_linear(head)
                return llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")
            kls.append(kl_stats(run(W, W), run(inp, Wq))[0])
        got[lab] = float(np.concatenate(kls).mean())
    assert val["measured"] == pytest.approx(got["both"], rel=1e-3)
    assert not np.isclose(val["measured"], got["head"], rtol=0.05)


def test_cli_profile_records_the_lookup(tied, tmp_path):
    from test_calib_stream import _cli
    out = str(tmp_path / "o")
    r = _cli("profile", tied, "--calib", "--calib-tokens", "120", "--out", out, "--menu", "ggml",
             "--types", "Q8_0,Q4_0", "--bpw", "5", "--include-embeddings", "--sens-tokens", "64",
             "--method", "exact", "-q")
    assert r.returncode == 0, r.stderr
    doc = json.load(open(os.path.join(out, "profile.json")))
    got = {rec["name"]: rec["profile"].get("lookup") for rec in doc["layers"]}
    lk = got.pop("model.embed_tokens.weight")
    assert set(got.values()) == {None}
    assert lk["sensitivity"] > 0 and lk["tokens"] == 120 and len(lk["err"]) == 3
    plan = json.load(open(os.path.join(out, "plan.json")))
    assert plan["methods"]["exact"]["extra"]["lookup_layers"] == 1
