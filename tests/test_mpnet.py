"""MPNet (all-mpnet-base-v2's architecture, issue 55) through the BERT layout of
:mod:`opscope_nb.models.mpnet`: a tiny random MPNet checkpoint, written with
MPNet's own tensor names and config, against a NumPy twin of Hugging Face's
``MPNetModel`` (MPNet names, ``create_position_ids_from_input_ids``, the bucket
function in plain Python, one text at a time, float64).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from opscope_nb.models import bert, mpnet
from opscope_nb.models.loader import open_model

TEXTS = ["the cat sat on the mat", "a dog", "the mat sat on a dog and the cat sat on the mat "
         "and a dog sat"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "and"]


def _bucket_py(rel, num_buckets=32, max_distance=128):
    """Hugging Face's ``MPNetEncoder.relative_position_bucket`` on one integer."""
    half = num_buckets // 2
    n = -rel
    ret = half if n < 0 else 0
    n = abs(n)
    exact = half // 2
    if n < exact:
        return ret + n
    big = exact + int(np.float32(math.log(np.float32(n) / exact) / math.log(max_distance / exact)
                                 * (half - exact)))
    return ret + min(big, half - 1)


def _write_tiny_mpnet(path, *, seed=0, hidden=32, n_heads=4, ffn=48, n_layers=2, buckets=32):
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = ["<s>", "<pad>", "</s>", "[UNK]"] + WORDS

    def r(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    W = {"embeddings.word_embeddings.weight": r(len(vocab), hidden, s=1.0),
         "embeddings.position_embeddings.weight": r(64, hidden, s=0.5),
         "embeddings.position_ids": np.arange(64, dtype=np.int64)[None],
         "embeddings.LayerNorm.weight": 1.0 + r(hidden, s=0.1),
         "embeddings.LayerNorm.bias": r(hidden, s=0.1),
         # large enough that the bias visibly changes the embeddings
         "encoder.relative_attention_bias.weight": r(buckets, n_heads, s=2.0),
         "pooler.dense.weight": r(hidden, hidden), "pooler.dense.bias": r(hidden)}
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        for n, shape in (("attention.attn.q", (hidden, hidden)),
                         ("attention.attn.k", (hidden, hidden)),
                         ("attention.attn.v", (hidden, hidden)),
                         ("attention.attn.o", (hidden, hidden)),
                         ("intermediate.dense", (ffn, hidden)),
                         ("output.dense", (hidden, ffn))):
            W[p + n + ".weight"] = r(*shape)
            W[p + n + ".bias"] = r(shape[0], s=0.1)
        for n in ("attention.LayerNorm", "output.LayerNorm"):
            W[p + n + ".weight"] = 1.0 + r(hidden, s=0.1)
            W[p + n + ".bias"] = r(hidden, s=0.1)
    save_file(W, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["MPNetForMaskedLM"], "model_type": "mpnet", "hidden_act": "gelu",
           "hidden_size": hidden, "num_attention_heads": n_heads, "intermediate_size": ffn,
           "num_hidden_layers": n_layers, "layer_norm_eps": 1e-5, "vocab_size": len(vocab),
           "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 0,
           "eos_token_id": 2, "relative_attention_num_buckets": buckets}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.save(os.path.join(path, "tokenizer.json"))
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_mean_tokens": True}, f)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"type": "sentence_transformers.models.Transformer"},
                   {"type": "sentence_transformers.models.Pooling"},
                   {"type": "sentence_transformers.models.Normalize"}], f)
    return W, cfg


def _ln(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _naive_mpnet(W, cfg, ids, *, rel=True):
    """Normalised mean-pooled embedding (float64) of one unpadded sequence."""
    from scipy.special import erf
    W = {k: v.astype(np.float64) for k, v in W.items() if v.dtype.kind == "f"}
    H, nh, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    hd, L, pad = H // nh, len(ids), cfg["pad_token_id"]
    pos = [pad + 1 + j for j in range(L)]           # create_position_ids_from_input_ids
    h = _ln(W["embeddings.word_embeddings.weight"][ids]
            + W["embeddings.position_embeddings.weight"][pos],
            W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    tab = W["encoder.relative_attention_bias.weight"]
    bias = np.array([[[tab[_bucket_py(k - q, cfg["relative_attention_num_buckets"]), head]
                       for k in range(L)] for q in range(L)] for head in range(nh)])
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(n, v):
            return v @ W[p + n + ".weight"].T + W[p + n + ".bias"]
        q = lin("attention.attn.q", h).reshape(L, nh, hd).transpose(1, 0, 2)
        k = lin("attention.attn.k", h).reshape(L, nh, hd).transpose(1, 0, 2)
        v = lin("attention.attn.v", h).reshape(L, nh, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + (bias if rel else 0.0)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(L, H)
        h = _ln(h + lin("attention.attn.o", ctx), W[p + "attention.LayerNorm.weight"],
                W[p + "attention.LayerNorm.bias"], eps)
        f = lin("intermediate.dense", h)
        f = 0.5 * f * (1.0 + erf(f / math.sqrt(2.0)))
        h = _ln(h + lin("output.dense", f), W[p + "output.LayerNorm.weight"],
                W[p + "output.LayerNorm.bias"], eps)
    e = h.mean(0)
    return e / np.linalg.norm(e)


def test_bucket_matches_plain_python():
    rel = np.arange(-300, 301)
    got = mpnet.relative_position_bucket(rel)
    assert got.tolist() == [_bucket_py(int(r)) for r in rel]
    assert got.min() == 0 and got.max() == 31
    b = mpnet.position_bias(np.arange(64, dtype=np.float32).reshape(32, 2), 5)
    assert b.shape == (2, 5, 5) and b.dtype == np.float32
    assert b[1, 0, 3] == 2 * _bucket_py(3) + 1


def test_mpnet_as_bert_matches_the_numpy_twin(tmp_path):
    W, cfg = _write_tiny_mpnet(str(tmp_path / "mpnet"))
    d = mpnet.to_bert_dir(str(tmp_path / "mpnet"), str(tmp_path / "bert"))
    m = open_model(d)
    assert m.config["rel_buckets"] == 32 and m.config["pad_id"] == 1
    got = bert.embed(m, TEXTS, act="f32")                      # one padded batch
    for t, e in zip(TEXTS, got):
        ids = m.tokenizer.encode(t).ids
        assert ids[0] == 0 and ids[-1] == 2
        want = _naive_mpnet(W, cfg, ids)
        np.testing.assert_allclose(e, want, atol=2e-5)
        # the relative bias and the position offset matter: without either, far off
        assert np.abs(_naive_mpnet(W, cfg, ids, rel=False) - want).max() > 1e-2
    # positions read from row pad_id + 1 on
    np.testing.assert_array_equal(m.tensors["embeddings.position_embeddings.weight"],
                                  W["embeddings.position_embeddings.weight"][2:])


def test_to_bert_dir_refuses_other_models(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type is 'bert'.*'mpnet'"):
        mpnet.to_bert_dir(str(d), str(tmp_path / "y"))
