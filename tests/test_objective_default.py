"""Issue 26 item 0: the default objective follows the output (sum rel_err**2
without calibration, sensitivity x out_err**2 with it), ``--objective weight``
stays as the seed's choice, and a plan whose predicted output damage is far
above the run's best at the same budget is flagged on stderr and in plan.json."""
from __future__ import annotations

import numpy as np
import pytest

from opscope_nb.plan.allocate import output_objective, predicted_damage
from opscope_nb.cli._budget import run_allocators
from opscope_nb.formats import Decomp
from opscope_nb.profile.mining import DecompOption, LayerProfile


def _layer(i, sens=None, out_err=None):
    # bytes 100 / 75 / 1 at relative errors 0 / 0.1 / 0.39: concentrating the
    # error in one layer is cheaper in sum rel_err, four times worse in sum rel_err**2
    ds = (Decomp.dense(), Decomp.int8(), Decomp.intn(2, 32))
    errs, sizes = (0.0, 0.1, 0.39), (100, 75, 1)
    opts = [DecompOption(d, e, b, 10, {}, None if out_err is None else out_err[k])
            for k, (d, e, b) in enumerate(zip(ds, errs, sizes))]
    return LayerProfile(f"l{i}", 10, 10, 100, opts, {}, sens)


def test_output_objective_and_damage_twin():
    layers = [_layer(i) for i in range(4)]
    assert output_objective(layers) == "output"
    choice = [0, 0, 0, 2]
    assert predicted_damage(layers, choice) == pytest.approx(0.39 ** 2)
    cal = [_layer(i, sens=2.0 + i, out_err=(0.0, 0.2, 0.5)) for i in range(4)]
    assert output_objective(cal) == "sensitivity"
    assert predicted_damage(cal, [1, 0, 0, 2]) == pytest.approx(2.0 * 0.04 + 5.0 * 0.25)


def test_weight_plan_is_flagged_default_is_not(capsys):
    layers = [_layer(i) for i in range(4)]
    spec = {"budget_frac": 301 / 400}
    w = run_allocators(layers, dict(spec, objective="weight"), ("exact", "greedy"))
    a = w["exact"][0]
    assert sorted(a.choice) == [0, 0, 0, 2]                 # concentrated
    assert a.extra["predicted_damage"] == pytest.approx(0.39 ** 2)
    assert a.extra["damage_flag"] == pytest.approx(0.39 ** 2 / (4 * 0.01))
    err = capsys.readouterr().err
    assert "predicted output damage" in err and "--objective weight" in err
    d = run_allocators(layers, dict(spec), ("exact",))       # default: auto -> output
    b = d["exact"][0]
    assert list(b.choice) == [1, 1, 1, 1]                    # spread
    assert b.extra["objective"] == "output" and "damage_flag" not in b.extra
    assert b.extra["predicted_damage"] == pytest.approx(4 * 0.01)
    assert "damage" not in capsys.readouterr().err


def test_cli_default_objective_is_recorded(tmp_path):
    import json
    from opscope_nb.cli import main
    out = tmp_path / "o"
    assert main(["profile", "--include", "k_proj|q_proj", "--rank-cap", "4", "--method",
                 "greedy", "--out", str(out), "-q"]) == 0
    plan = json.load(open(out / "plan.json"))
    assert plan["objective"] == "auto" and plan["objective_used"] == "output"
    g = plan["methods"]["greedy"]
    assert g["total_err"] == pytest.approx(sum(r["rel_err"] ** 2 for r in g["layers"]))
    assert np.isfinite(g["extra"]["predicted_damage"])


# --- the output head's data-free weight (issue 22: a tied head chosen by sum rel_err**2) ---
def test_prior_weight_scales_the_output_objective_only():
    from opscope_nb.plan.allocate import exact_allocate
    plain = [_layer(i) for i in range(2)]
    head = [_layer(0), _layer(1)]
    head[0].prior_weight = 20.0
    # 150 of 200 bytes: int8 twice (0.01 + 0.01) or dense + int2 (0.39**2)
    assert list(exact_allocate(plain, 0.75, objective="output").choice) == [1, 1]
    a = exact_allocate(head, 0.75, objective="output")
    assert list(a.choice) == [0, 2]                          # the head stays dense
    assert a.total_err == pytest.approx(0.39 ** 2)
    assert predicted_damage(head, [1, 1]) == pytest.approx(20 * 0.01 + 0.01)
    # the weight objective (sum rel_err) ignores it
    assert list(exact_allocate(head, 0.75, objective="weight").choice) == [1, 1]
    # a measured sensitivity replaces it; a layer without one uses mean x prior
    cal = [_layer(0, sens=1.0, out_err=(0.0, 0.1, 0.39)),
           _layer(1, sens=1.0, out_err=(0.0, 0.1, 0.39))]
    cal[0].prior_weight = 20.0
    assert predicted_damage(cal, [1, 1]) == pytest.approx(0.02)
    cal[0].sensitivity = None
    assert predicted_damage(cal, [1, 1]) == pytest.approx(20 * 0.01 + 0.01)


def test_prior_weight_round_trip_and_validation():
    from opscope_nb.profile.mining import profile_layer
    lp = _layer(0)
    assert "prior_weight" not in lp.to_dict()                # old profiles read the same
    lp.prior_weight = 60.0
    assert LayerProfile.from_dict(lp.to_dict()).prior_weight == 60.0
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    assert profile_layer("x", w, menu="ggml", ggml_types=["Q8_0"],
                         prior_weight=3).prior_weight == 3.0
    for bad, exc in ((0.0, ValueError), (float("nan"), ValueError), (-1, ValueError),
                     ("2", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="prior_weight"):
            profile_layer("x", w, menu="ggml", ggml_types=["Q8_0"], prior_weight=bad)
    d = lp.to_dict()
    d["prior_weight"] = float("inf")
    with pytest.raises(ValueError, match="prior_weight"):
        LayerProfile.from_dict(d)


def test_output_head_by_layout(tmp_path):
    import json
    from naive_models import smollm2_gguf, write_tiny_llama
    from opscope_nb.models.loader import output_head
    d = tmp_path / "untied"
    W = write_tiny_llama(str(d), n_layers=3)
    assert output_head(str(d), W) == ("lm_head.weight", 6.0)
    assert output_head(str(d / "model.safetensors"), W) == ("lm_head.weight", 6.0)
    t = tmp_path / "tied"
    W = write_tiny_llama(str(t), n_layers=4, tied=True)
    assert output_head(str(t), W) == ("model.embed_tokens.weight", 8.0)
    # an encoder has no head, whatever its embedding is called
    b = tmp_path / "bert"
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    names = ["embeddings.word_embeddings.weight", "encoder.layer.0.output.dense.weight"]
    assert output_head(str(b), names) is None
    # a config that unties the head but a checkpoint without lm_head: no guess
    cfg = json.loads((t / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (t / "config.json").write_text(json.dumps(cfg))
    assert output_head(str(t), W) is None
    assert output_head(str(t), ["model.embed_tokens.weight"]) is None   # no blocks
    assert output_head("x.gguf", ["output.weight", "token_embd.weight",
                                  "blk.0.attn_q.weight", "blk.11.ffn_up.weight"]) == (
        "output.weight", 24.0)
    import gguf
    p = tmp_path / "enc.gguf"
    wr = gguf.GGUFWriter(str(p), "bert")
    wr.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    wr.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))
    for step in (wr.write_header_to_file, wr.write_kv_data_to_file,
                 wr.write_tensors_to_file, wr.close):
        step()
    assert output_head(str(p), ["token_embd.weight", "blk.0.attn_q.weight"]) is None
    g = smollm2_gguf()
    if g is not None:       # SmolLM2-135M: 30 blocks, head tied to token_embd
        from opscope_nb.io import open_source
        names = [e.name for e in open_source(g).entries]
        assert output_head(g, names) == ("token_embd.weight", 60.0)


@pytest.mark.parametrize("tied", [True, False])
def test_cli_profile_weighs_the_head(tmp_path, tied):
    import json
    from naive_models import write_tiny_llama
    from opscope_nb.cli import main
    src = tmp_path / "m"
    write_tiny_llama(str(src), n_layers=2, tied=tied)
    out = tmp_path / "o"
    assert main(["profile", str(src), "--include", "embed|lm_head|q_proj",
                 "--include-embeddings", "--menu", "ggml", "--types", "Q8_0,Q4_0",
                 "--method", "greedy", "--out", str(out), "-q"]) == 0
    doc = json.load(open(out / "profile.json"))
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    got = {r["name"]: r["profile"].get("prior_weight") for r in doc["layers"]}
    assert got.pop(head) == 4.0
    assert set(got.values()) == {None} and len(got) == (2 if tied else 3)
    plan = json.load(open(out / "plan.json"))
    g = plan["methods"]["greedy"]
    assert g["total_err"] == pytest.approx(sum(
        (4.0 if r["name"] == head else 1.0) * r["rel_err"] ** 2 for r in g["layers"]))


# --- an encoder's word embedding without calibration (issue 55 item 5: MPNet Q6_K) ---
def test_word_embedding_by_layout(tmp_path):
    import gguf
    from opscope_nb.models.loader import EMBED_PRIOR, word_embedding
    assert EMBED_PRIOR == 2.0
    for p in ("", "bert.", "model."):
        names = [p + "embeddings.word_embeddings.weight", p + "encoder.layer.0.output.dense.weight"]
        assert word_embedding(str(tmp_path), names) == (names[0], 2.0)
    # a decoder's token table (tied head or a plain lookup) is not weighed here
    assert word_embedding(str(tmp_path), ["model.embed_tokens.weight",
                                          "model.layers.0.mlp.down_proj.weight"]) is None
    for arch, want in (("bert", ("token_embd.weight", 2.0)), ("llama", None)):
        p = tmp_path / f"{arch}.gguf"
        wr = gguf.GGUFWriter(str(p), arch)
        wr.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        wr.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))
        for step in (wr.write_header_to_file, wr.write_kv_data_to_file,
                     wr.write_tensors_to_file, wr.close):
            step()
        assert word_embedding(str(p), ["token_embd.weight", "blk.0.attn_q.weight"]) == want
        assert word_embedding(str(p), ["blk.0.attn_q.weight"]) is None


def test_cli_profile_weighs_an_encoders_word_embedding_without_calib(tmp_path, capsys):
    import json
    from safetensors.numpy import save_file
    from opscope_nb.cli import main
    from opscope_nb.cli import profile as cp
    rng = np.random.default_rng(0)
    t = {"embeddings.word_embeddings.weight": rng.standard_normal((64, 32)).astype(np.float32),
         "encoder.layer.0.output.dense.weight": rng.standard_normal((32, 64)).astype(np.float32)}
    src = tmp_path / "model.safetensors"
    save_file(t, str(src))
    out = tmp_path / "o"
    assert main(["profile", str(src), "--include-embeddings", "--menu", "ggml", "--types",
                 "Q8_0,Q4_0", "--method", "greedy", "--out", str(out), "-q"]) == 0
    assert "word embedding: embeddings.word_embeddings.weight weighs 2x" in capsys.readouterr().out
    doc = json.load(open(out / "profile.json"))
    got = {r["name"]: r["profile"].get("prior_weight") for r in doc["layers"]}
    assert got == {"embeddings.word_embeddings.weight": 2.0,
                   "encoder.layer.0.output.dense.weight": None}
    g = json.load(open(out / "plan.json"))["methods"]["greedy"]
    assert g["total_err"] == pytest.approx(sum(
        (2.0 if "embeddings" in r["name"] else 1.0) * r["rel_err"] ** 2 for r in g["layers"]))
    # with --calib (a stream) the table keeps weight 1: it takes the measured mean
    layers = [LayerProfile.from_dict(r["profile"]) for r in doc["layers"]]
    for lp in layers:
        lp.prior_weight = 1.0
    recs = [{"profile": {}} for _ in layers]
    from opscope_nb.io import open_source
    cp._data_free_priors({"src": open_source(str(src)), "stream": object()}, recs, layers)
    assert [lp.prior_weight for lp in layers] == [1.0, 1.0]
    cp._data_free_priors({"src": open_source(str(src)), "stream": None}, recs, layers)
    assert {lp.name: lp.prior_weight for lp in layers} == {
        "embeddings.word_embeddings.weight": 2.0, "encoder.layer.0.output.dense.weight": 1.0}
