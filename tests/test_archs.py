"""The decoder families users run (issue 58 item 1): Llama 2/3 (Llama 3 RoPE
scaling), Mistral, Qwen2 (Q/K/V biases), Qwen3 (Q/K norms; and YaRN), Gemma 2/3 (GeGLU,
pre + post norms, scaled embeddings, soft-capping, sliding-window layers, tied
head), Phi-3 (fused QKV and gate/up, LongRoPE).

Each tiny random-weight model (:mod:`tiny_archs`) is written as a GGUF file with
llama.cpp's names and keys and as a Hugging Face checkpoint.  Our logits on the
GGUF file are compared with llama.cpp's own logits for the same 64 token ids:
golden files ``tests/fixtures/archs/<arch>.npz`` made by llama-cpp-python
(``OPSCOPE_WRITE_GOLDEN=1 python -m pytest tests/test_archs.py -k golden``
rewrites them; with llama-cpp-python installed the test also compares with a
fresh llama.cpp run).  Target: mean KL(llama.cpp || ours) <= 1e-4.
"""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tiny_archs as ta                                                 # noqa: E402
from naive_models import decode_vs_full                                   # noqa: E402
from opscope_nb.models import UnsupportedModelError, detect, llama, llamacpp, open_model  # noqa: E402
from opscope_nb.models.evaluate import kl_stats                          # noqa: E402

FIX = pathlib.Path(__file__).parent / "fixtures" / "archs"
KL_MAX = 1e-4
ARCHS = list(ta.ARCHS)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (GGUF path, HF directory), written once for the module."""
    d = tmp_path_factory.mktemp("archs")
    return {a: (ta.write_gguf(d / f"{a}.gguf", a), ta.write_hf(str(d / a), a)) for a in ARCHS}


def _ours(path, ids=None):
    m = open_model(path)
    ids = ta.token_ids() if ids is None else ids
    return m, llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")


def _llamacpp_logits(path, ids):
    llm = llamacpp.load(path, n_ctx=len(ids), n_threads=1)
    try:
        return llamacpp.logits(llm, ids)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_golden_llamacpp_logits(files, arch):
    """Our forward of the GGUF file against llama.cpp's logits (golden file; and
    a fresh llama.cpp run when llama-cpp-python is installed)."""
    path = files[arch][0]
    ids = ta.token_ids()
    m, ours = _ours(path, ids)
    assert m.arch == f"gguf-{ta.ARCHS[arch][1]}"
    fix = FIX / f"{arch}.npz"
    if llamacpp.available():
        theirs = _llamacpp_logits(path, ids)
        kl = kl_stats(theirs, ours)[0]
        print(f"{arch}: mean KL(llama.cpp || ours) = {kl.mean():.3g} (fresh llama.cpp)")
        assert kl.mean() <= KL_MAX, (arch, kl.mean())
        if os.environ.get("OPSCOPE_WRITE_GOLDEN"):
            import llama_cpp
            FIX.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(fix, logits=theirs.astype(np.float32), ids=ids,
                                digest=np.array(ta.weights_digest(arch)),
                                made_by=np.array(f"llama-cpp-python {llama_cpp.__version__}, "
                                                 f"tests/tiny_archs.py {arch}, 1 thread"))
    with np.load(fix) as g:
        assert str(g["digest"]) == ta.weights_digest(arch), "tiny model changed: rewrite goldens"
        assert np.array_equal(g["ids"], ids)
        gold = g["logits"]
    kl = kl_stats(gold, ours)[0]
    print(f"{arch}: mean KL(llama.cpp golden || ours) = {kl.mean():.3g}, max {kl.max():.3g}")
    assert kl.mean() <= KL_MAX, (arch, kl.mean())


#: per architecture, config changes that drop one of its features: each must move
#: the logits far from llama.cpp's (the tiny models exercise every feature)
FEATURES = {
    "llama": [{"rope_interleaved": False}],
    "llama3": [{"rope_factors": None}],
    "mistral": [{"rope_interleaved": False}],
    "qwen2": [{"qkv_bias": False}],
    "qwen3": [{"qk_norm": False}],
    "gemma2": [{"attn_softcap": None}, {"final_softcap": None}, {"swa": None},
               {"embed_scale": None}, {"act": "silu"}, {"post_norms": False}],
    "gemma3": [{"qk_norm": False}, {"swa": None}, {"rope_scale": 1.0},
               {"rope_base_swa": 1e6}],
    "phi3": [{"rope_factors": None}, {"rope_attn_factor": 1.0}],
    "qwen3_yarn": [{"rope_yarn": None}, {"rope_attn_factor": 1.0}],
}


@pytest.mark.parametrize("arch", ARCHS)
def test_each_feature_matters(files, arch):
    """Dropping any one architecture feature takes our logits away from llama.cpp's
    golden ones (KL > 10x the target): the golden test sees every feature."""
    ids = ta.token_ids()
    m = open_model(files[arch][0])
    with np.load(FIX / f"{arch}.npz") as g:
        gold = g["logits"]
    base = dict(m.config)
    for change in FEATURES[arch]:
        m.config = dict(base, **change)
        lg = llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")
        kl = kl_stats(gold, lg)[0].mean()
        print(arch, change, f"{kl:.3g}")
        assert kl > 10 * KL_MAX, (arch, change)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_safetensors_twin_equals_gguf(files, arch):
    """The Hugging Face checkpoint of the same weights (HF names, unpermuted Q/K,
    Gemma norms without the + 1, RoPE scaling from config.json) gives the
    GGUF file's logits."""
    gm, a = _ours(files[arch][0])
    hm, b = _ours(files[arch][1])
    assert hm.arch == ta.ARCHS[arch][0] and hm.family == "decoder"
    assert np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(a).max())
    assert kl_stats(a, b)[0].mean() < 1e-8
    assert hm.config["tied"] == gm.config["tied"]


def test_phi3_fused_weights_are_one_linear_each(files):
    """Phi-3's fused qkv and gate/up stay one matrix each (one option per weight)."""
    m = open_model(files["phi3"][1])
    lin, _ = m.block_tensors(0)
    assert lin == ["model.layers.0.self_attn.qkv_proj.weight",
                   "model.layers.0.self_attn.o_proj.weight",
                   "model.layers.0.mlp.gate_up_proj.weight",
                   "model.layers.0.mlp.down_proj.weight"]
    assert m.tensors[lin[0]].shape == ((ta.HEADS + 2 * ta.KV) * ta.head_dim("phi3"), ta.HIDDEN)
    g = open_model(files["phi3"][0])
    assert g.block_tensors(1)[0] == ["blk.1.attn_qkv.weight", "blk.1.attn_output.weight",
                                     "blk.1.ffn_up.weight", "blk.1.ffn_down.weight"]


def test_kv_cache_decode_with_sliding_window(files):
    """Token-by-token decode (the sliding window masks old keys past 16) equals the
    full forward on Gemma 2."""
    m = open_model(files["gemma2"][0])
    prefill, decode = decode_vs_full(m, ta.token_ids(40, seed=3), 8)
    assert prefill < 1e-4 and decode < 1e-4


def test_unknown_architecture_names_supported_per_format(tmp_path):
    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), "starcoder2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        detect(str(p))
    msg = str(e.value)
    assert "'starcoder2'" in msg and "\n" not in msg
    for a in ("'llama'", "'qwen2'", "'qwen3'", "'gemma2'", "'gemma3'", "'phi3'"):
        assert a in msg.split("safetensors")[0]          # the GGUF architectures first
    d = tmp_path / "hf"
    ta.write_hf(str(d), "qwen2")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        detect(str(d))
    msg = str(e.value)
    assert "'gpt_neox'" in msg and "config.json model_type" in msg
    for a in ("'qwen3'", "'gemma3_text'", "'phi3'", "'mistral'"):
        assert a in msg.split("safetensors")[1]


def test_eval_runtime_llamacpp_runs_architectures_we_do_not(files, tmp_path, monkeypatch):
    """``eval --runtime llama.cpp`` leaves the architecture to llama.cpp: a Gemma (1)
    GGUF, which this package's forward refuses, is tokenised and scored by
    llama.cpp (here a stand-in that records what it was asked)."""
    from opscope_nb.cli import main
    p = ta.write_gguf(tmp_path / "g1.gguf", "gemma2", gguf_arch="gemma")
    with pytest.raises(UnsupportedModelError, match="'gemma'"):
        detect(p)
    asked = {}

    class FakeLlm:
        def n_ctx(self):
            return 64

        def close(self):
            pass

    def fake_tokenize(path, text):
        asked["tokenize"] = path
        return list(range(1, 40))

    def fake_logits(llm, ids):
        return np.tile(np.linspace(0, 1, ta.VOCAB, dtype=np.float32), (len(ids), 1))

    monkeypatch.setattr(llamacpp, "tokenize", fake_tokenize)
    monkeypatch.setattr(llamacpp, "load", lambda path, n_ctx: asked.setdefault("load", path)
                        and FakeLlm())
    monkeypatch.setattr(llamacpp, "logits", fake_logits)
    monkeypatch.setattr(llamacpp, "speed", lambda llm, prompt, n: (10.0, 5.0))
    assert main(["eval", p, "--runtime", "llama.cpp", "--max-tokens", "32", "--window", "16",
                 "--decode-steps", "2", "--prompt-tokens", "4", "-q"]) == 0
    assert asked == {"tokenize": p, "load": p}


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python not installed")
def test_eval_runtime_llamacpp_real_on_an_architecture_we_do_not_run(tmp_path, capsys):
    from opscope_nb.cli import main
    p = ta.write_gguf(tmp_path / "g1.gguf", "gemma2", gguf_arch="gemma")
    assert main(["eval", p, "--compressed", p, "--runtime", "llama.cpp", "--max-tokens", "32",
                 "--window", "16", "--decode-steps", "2", "--prompt-tokens", "4", "-q"]) == 0
    out = capsys.readouterr().out
    assert "gguf-gemma decoder" in out and "KL(dense||compressed) mean 0 " in out


def _cli(*args):
    import contextlib
    import io
    from opscope_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("arch,fmt", [(a, "gguf") for a in ARCHS] +
                         [("phi3", "hf"), ("gemma3", "hf"), ("qwen2", "hf")])
def test_cli_profile_calib(files, arch, fmt, tmp_path):
    """``profile --calib`` streams every tiny model: a gram and a positive
    sensitivity for every linear layer of the blocks."""
    src = files[arch][0 if fmt == "gguf" else 1]
    rc, out, err = _cli("profile", src, "--calib", "--calib-tokens", "40", "--menu", "ggml",
                        "--types", "Q8_0,Q4_0", "--out", tmp_path / "o", "-q")
    assert rc == 0, err
    doc = json.loads((tmp_path / "o" / "profile.json").read_text())
    m = open_model(src, lazy=True)
    want = {n for i in range(ta.LAYERS) for n in m.block_tensors(i)[0]}
    got = {r["name"]: r["profile"]["sensitivity"] for r in doc["layers"]}
    assert want <= set(got), sorted(want - set(got))
    assert all(got[n] > 0 for n in want)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cli_eval(files, arch, fmt, tmp_path):
    src = files[arch][0 if fmt == "gguf" else 1]
    js = tmp_path / "e.json"
    rc, out, err = _cli("eval", src, "--max-tokens", "40", "--window", "20", "--decode-steps",
                        "2", "--prompt-tokens", "4", "--json", js, "-q")
    assert rc == 0, err
    r = json.loads(js.read_text())
    assert r["family"] == "decoder" and r["tokens"] == 40
    assert np.isfinite(r["ppl_dense"]) and r["ppl_dense"] > 1.0


SPM_TEXTS = ["the and then, hand the band", "  two  spaces and\nnew lines\n",
             "\u00fcn\u00ef code \u2581 mixed\ttabs", "hand"]


def test_gguf_sentencepiece_vocabulary_tokenises_as_llama_cpp(tmp_path):
    """A GGUF SentencePiece vocabulary (``tokenizer.ggml.model = llama``, as Llama 2,
    Mistral, Gemma and Phi-3 files have) is rebuilt: llama.cpp's own token ids for
    the same texts (golden file; fresh when llama-cpp-python is installed)."""
    p = ta.write_gguf(tmp_path / "spm.gguf", "llama", spm=True)
    m = open_model(p)
    ours = [m.tokenizer.encode(t).ids for t in SPM_TEXTS]
    fix = FIX / "spm_ids.json"
    if llamacpp.available():
        theirs = [llamacpp.tokenize(p, t) for t in SPM_TEXTS]
        if os.environ.get("OPSCOPE_WRITE_GOLDEN"):
            fix.write_text(json.dumps({"texts": SPM_TEXTS, "ids": theirs}) + "\n")
    gold = json.loads(fix.read_text())
    assert gold["texts"] == SPM_TEXTS
    assert m.config["add_bos"] is False and m.config["bos"] == 1    # the file says so
    for t, a, g in zip(SPM_TEXTS, ours, gold["ids"]):
        assert a == g, t
        if llamacpp.available():
            assert g == llamacpp.tokenize(p, t)
    assert m.tokenizer.decode(ours[0]) == SPM_TEXTS[0]
    # merges follow the scores: "▁the" (not "▁t" + "he") and byte fallback for "ü"
    assert ours[0][0] == ta.spm_vocab()[0].index("\u2581the")
    assert [0xC3 + 3, 0xBC + 3] == ours[2][1:3]


def test_cli_eval_sentencepiece_gguf(tmp_path):
    p = ta.write_gguf(tmp_path / "spm.gguf", "llama", spm=True)
    rc, out, err = _cli("eval", p, "--max-tokens", "40", "--window", "20", "--decode-steps",
                        "2", "--prompt-tokens", "4", "-q")
    assert rc == 0, err
    assert out.startswith("gguf-llama decoder, 40 tokens")


def test_gemma3_multimodal_checkpoint_runs_its_language_model(files, tmp_path):
    """Gemma 3 4B/12B/27B ship as ``Gemma3ForConditionalGeneration``: config.json
    ``model_type gemma3`` with a sparse ``text_config`` (Gemma3TextConfig's
    defaults fill the rest) and ``language_model.model.*`` tensors beside the
    vision tower; the forward is the text model's."""
    from safetensors.numpy import load_file, save_file
    src = pathlib.Path(files["gemma3"][1])
    d = tmp_path / "mm"
    d.mkdir()
    W = {"language_model." + k: v for k, v in load_file(src / "model.safetensors").items()}
    W["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3),
                                                                              np.float32)
    save_file(W, d / "model.safetensors")
    text = {k: v for k, v in ta.config("gemma3").items()
            if k not in ("architectures", "hidden_act", "hidden_activation",
                         "tie_word_embeddings", "final_logit_softcapping",
                         "attn_logit_softcapping", "rms_norm_eps", "rope_theta",
                         "rope_local_base_freq", "bos_token_id", "eos_token_id")}
    text["rms_norm_eps"] = 1e-6
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
           "bos_token_id": ta.BOS, "eos_token_id": ta.EOS}
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    m, b = _ours(str(d))
    assert m.arch == "gemma3_text" and m.config["tied"] is True
    assert m.config["names"]["q"] == "language_model.model.layers.{i}.self_attn.q_proj.weight"
    _, a = _ours(str(src))
    assert np.abs(a - b).max() == 0.0


def test_partial_rotary_refused(files, tmp_path):
    d = tmp_path / "p4"
    src = pathlib.Path(files["phi3"][1])
    d.mkdir()
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["partial_rotary_factor"] = 0.75                    # Phi-4-mini
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="partial RoPE"):
        detect(str(d))


def test_mistral_sliding_window_limits_what_a_token_sees(files, tmp_path):
    """HF Mistral's ``sliding_window`` (every layer): with a window of 8 keys and 2
    blocks, token 0 reaches no position past 14; without the window it does."""
    d = tmp_path / "mw"
    src = pathlib.Path(files["mistral"][1])
    d.mkdir()
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    cfg = ta.config("mistral")
    cfg["sliding_window"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    ids = ta.token_ids(32, seed=5)
    ids2 = ids.copy()
    ids2[0] = (ids[0] + 1) % 200
    for path, far_equal in ((str(d), True), (str(src), False)):
        m = open_model(path)
        a = llama.forward(m, ids, llama.KVCache(m.config, 32), act="f32")
        b = llama.forward(m, ids2, llama.KVCache(m.config, 32), act="f32")
        assert np.array_equal(a[15:], b[15:]) is far_equal
        assert not np.allclose(a[:8], b[:8])


def test_cli_ggml_gptq_twins_profile_plan_apply(files, tmp_path):
    """``profile --menu ggml --calib --gptq all`` offers each type's ``+gptq``
    twin (same bytes); a plan of twins applies to a GGUF holding GPTQ's blocks
    for the kept grams; without ``--gptq all`` there are no ggml twins."""
    import gguf
    from opscope_nb.formats import ggml
    from opscope_nb.profile.calib import load_grams
    src = files["llama"][0]
    o = tmp_path / "o"
    rc, out, err = _cli("profile", src, "--calib", "--calib-tokens", "64", "--menu", "ggml",
                        "--types", "Q8_0,Q4_0", "--bpw", "5", "--gptq", "all", "--out", o,
                        "-q")
    assert rc == 0, err
    doc = json.loads((o / "profile.json").read_text())
    for r in doc["layers"]:
        if r["profile"]["cols"] % 32:
            continue
        by = {x["label"]: x for x in r["profile"]["options"]}
        for t in ("Q8_0", "Q4_0"):
            assert by[f"{t}+gptq"]["bytes"] == by[t]["bytes"]
    plan = json.loads((o / "plan.json").read_text())
    meth = plan["methods"][plan["best"]] if "best" in plan else \
        next(iter(plan["methods"].values()))
    # the plan with every quantised layer on its +gptq twin
    for lay in meth["layers"]:
        if lay["decomp"]["kind"] == "ggml" and lay["decomp"]["qtype"] in ("Q8_0", "Q4_0"):
            lay["decomp"]["rounding"] = "gptq"
            lay["label"] = lay["decomp"]["label"] = lay["decomp"]["qtype"] + "+gptq"
    twins = [lay["name"] for lay in meth["layers"] if lay["label"].endswith("+gptq")]
    assert twins
    (o / "plan.json").write_text(json.dumps(plan))
    rc, out, err = _cli("apply", src, o / "plan.json", "-o", tmp_path / "x.gguf", "-q",
                        "--over-budget")
    assert rc == 0, err
    grams = load_grams(o / "calib.npz")[0]
    srcr = {t.name: t for t in gguf.GGUFReader(src).tensors}
    got = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "x.gguf")).tensors}
    qt = {lay["name"]: lay["decomp"]["qtype"] for lay in meth["layers"]}
    for n in twins:
        s = srcr[n]
        rows, cols = int(s.shape[1]), int(s.shape[0])
        w = np.ascontiguousarray(gguf.quants.dequantize(s.data, s.tensor_type)
                                 .reshape(rows, cols), np.float32)
        want = ggml.quantize_gptq(w, qt[n], grams[n])
        assert got[n].tensor_type.name == qt[n]
        np.testing.assert_array_equal(np.asarray(got[n].data).view(np.uint8).reshape(-1),
                                      want.reshape(-1))
    rc, out, err = _cli("profile", src, "--calib", "--calib-tokens", "64", "--menu", "ggml",
                        "--types", "Q8_0", "--out", tmp_path / "p", "-q")
    assert rc == 0, err
    doc = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert not any("+gptq" in x["label"] for r in doc["layers"]
                   for x in r["profile"]["options"])
