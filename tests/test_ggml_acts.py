"""``eval --act-quant ggml`` / :mod:`opscope_nb.models.ggml_acts`: this package's
forward with llama.cpp's activations, on a tiny random Qwen2 GGUF (tied head)
whose compressed twin stores some layers in ggml types."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tiny_archs as ta                                                   # noqa: E402
from opscope_nb.formats import Decomp, ggml                               # noqa: E402
from opscope_nb.models import llama, open_model                           # noqa: E402
from opscope_nb.models.evaluate import _decoder_ids, evaluate, kl_stats, load_passages  # noqa: E402
from opscope_nb.models.ggml_acts import llamacpp_activations, run_type, stored_types  # noqa: E402
from opscope_nb.models.loader import is_linear                            # noqa: E402

TYPES = {"blk.0.attn_q.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_1",
         "blk.1.attn_v.weight": "Q5_0", "blk.1.ffn_up.weight": "IQ4_NL",
         "token_embd.weight": "Q8_0"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from opscope_nb.io.gguf_export import export_gguf
    d = tmp_path_factory.mktemp("ggml_acts")
    src = str(ta.write_gguf(d / "src.gguf", "qwen2"))
    comp = str(d / "comp.gguf")
    export_gguf(src, {n: Decomp.ggml(t) for n, t in TYPES.items()}, comp)
    return src, comp


class _Twin:
    """A layer reading its input through ggml's activation type, by hand."""

    def __init__(self, lin, t):
        self.lin, self.t = lin, t

    def __call__(self, x, act="auto"):
        return self.lin(ggml.runtime_activations(np.asarray(x, np.float32), self.t), act=act)


def test_stored_types_and_run_type(pair):
    src, comp = pair
    st = stored_types(comp)
    for n, t in TYPES.items():
        assert st[n] == t
    assert set(stored_types(src).values()) == {"F32"}
    assert run_type("float16") == "F16" and run_type("BF16") == "BF16"
    assert run_type("I8") == "F32" and stored_types("") == {}


def test_eval_act_quant_equals_hand_twin_and_restores(pair):
    src, comp = pair
    r0 = evaluate(src, comp, max_tokens=80, window=40, decode_steps=2, prompt_tokens=4)
    r1 = evaluate(src, comp, max_tokens=80, window=40, decode_steps=2, prompt_tokens=4,
                  act_quant="ggml")
    assert r1["act_quant"] == "ggml" and r0["act_quant"] == "none"
    dense, c = open_model(src), open_model(src, comp)
    for n, t in TYPES.items():
        if n != "token_embd.weight":
            c.tensors[n] = _Twin(c.tensors[n], t)
    c.extras["head"] = _Twin(llama.head_linear(c), TYPES["token_embd.weight"])
    ids = _decoder_ids(dense.config, dense.tokenizer, load_passages(None), 80)
    kl = []
    for s in range(0, len(ids) - 1, 40):
        ch = ids[s:s + 40]
        if len(ch) < 2:
            break
        kl.append(kl_stats(llama.forward(dense, ch, llama.KVCache(dense.config, len(ch))),
                           llama.forward(c, ch, llama.KVCache(c.config, len(ch))))[0])
    want = float(np.concatenate(kl).mean())
    assert r1["kl_mean"] == pytest.approx(want, rel=1e-6)
    assert r1["kl_mean"] != pytest.approx(r0["kl_mean"], rel=1e-3)
    assert r1["ppl_dense"] == pytest.approx(r0["ppl_dense"], rel=1e-6)   # F32 source: float
    m = open_model(src, comp)
    before = dict(m.tensors)
    with llamacpp_activations(m, stored_types(comp)):
        assert not is_linear(m.tensors["blk.0.attn_q.weight"])
        assert m.extras["head"].qtype == "Q8_0"
    assert all(m.tensors[k] is v for k, v in before.items()) and "head" not in m.extras


def test_eval_act_quant_bad_values(pair):
    src, comp = pair
    with pytest.raises(ValueError, match="act_quant"):
        evaluate(src, comp, act_quant="int8")
    with pytest.raises(ValueError, match="quantises its activations itself"):
        evaluate(src, comp, act_quant="ggml", runtime="llama.cpp")
