"""Tiny random-weight decoders of every architecture the forward supports, written
twice from the same float32 weights: as a Hugging Face checkpoint (config.json,
model.safetensors with HF tensor names, tokenizer.json) and as a GGUF file with
llama.cpp's tensor names and metadata keys, converted the way llama.cpp's
``convert_hf_to_gguf.py`` does (Q/K rows permuted for the ``llama`` architecture,
Gemma norm weights stored + 1, Llama 3's ``rope_freqs`` and Phi-3's LongRoPE
factors as tensors).  Never imports opscope_nb.

Every model: 2 blocks, hidden 64, 4 query heads, 2 KV heads, FFN 96, a
byte-level BPE vocabulary of 256 bytes + 14 merges + 2 control tokens (272).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from naive_models import permute_for_gguf

#: architecture -> (HF model_type, GGUF general.architecture)
ARCHS = {
    "llama": ("llama", "llama"),
    "llama3": ("llama", "llama"),
    "mistral": ("mistral", "llama"),
    "qwen2": ("qwen2", "qwen2"),
    "qwen3": ("qwen3", "qwen3"),
    "gemma2": ("gemma2", "gemma2"),
    "gemma3": ("gemma3_text", "gemma3"),
    "phi3": ("phi3", "phi3"),
    "qwen3_yarn": ("qwen3", "qwen3"),
}
#: variants: the architecture whose weights and keys they otherwise have
BASE = {"qwen3_yarn": "qwen3"}
SEEDS = {a: 100 + i for i, a in enumerate(ARCHS)}
HIDDEN, HEADS, KV, FFN, LAYERS = 64, 4, 2, 96, 2
MERGES = ["Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "e n", "a t",
          "o r", "Ġ w", "e s", "i s"]


def _alphabet():
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def vocab_tokens():
    toks = _alphabet()
    for m in MERGES:
        toks.append(m.replace(" ", ""))
    return toks + ["<s>", "</s>"]


VOCAB = 256 + len(MERGES) + 2
BOS, EOS = VOCAB - 2, VOCAB - 1


#: a SentencePiece vocabulary of the same size (tokenizer.ggml.model = llama):
#: <unk> <s> </s>, the 256 byte tokens, 13 pieces (score: longer is better)
SPM_PIECES = ["\u2581", "t", "h", "e", "a", "n", "d", "he", "\u2581t", "an", "\u2581the",
              "and", "\u2581and"]


def spm_vocab():
    """``(tokens, scores, types)`` of the SentencePiece twin vocabulary."""
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    scores = [0.0] * 259 + [-100.0 + 10 * len(p) + 0.1 * i for i, p in enumerate(SPM_PIECES)]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    return toks, scores, types


def head_dim(arch):
    arch = BASE.get(arch, arch)
    return 32 if arch in ("qwen3", "gemma2", "gemma3") else HIDDEN // HEADS


def llama3_rope_factors(rs, base, hd):
    """convert_hf_to_gguf.py's LlamaModel ``rope_freqs`` (Llama 3 scaling)."""
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < old / hi:
            out.append(1.0)
        elif wl > old / lo:
            out.append(factor)
        else:
            sm = (old / wl - lo) / (hi - lo)
            out.append(1 / ((1 - sm) / factor + sm))
    return np.asarray(out, dtype=np.float32)


def config(arch):
    """The config.json of the tiny ``arch`` model."""
    variant, arch = arch, BASE.get(arch, arch)
    mt = ARCHS[arch][0]
    hd = head_dim(arch)
    cfg = {"architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                              "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                              "phi3": "Phi3ForCausalLM"}[mt]],
           "model_type": mt, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": hd, "intermediate_size": FFN,
           "num_hidden_layers": LAYERS, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "vocab_size": VOCAB, "tie_word_embeddings": arch in ("qwen2", "gemma2", "gemma3"),
           "hidden_act": "silu", "max_position_embeddings": 512,
           "bos_token_id": BOS, "eos_token_id": EOS}
    if arch == "llama3":
        cfg["rope_theta"] = 500000.0
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if arch == "mistral":
        cfg["sliding_window"] = 4096
    if arch == "qwen3":
        cfg["attention_bias"] = False
    if arch in ("gemma2", "gemma3"):
        cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=hd, sliding_window=16)
    if arch == "gemma2":
        cfg.update(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if arch == "gemma3":
        cfg.update(rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling={"rope_type": "linear", "factor": 8.0},
                   sliding_window_pattern=2, final_logit_softcapping=None,
                   attn_logit_softcapping=None)
    if arch == "phi3":
        rng = np.random.default_rng(7)
        cfg.update(max_position_embeddings=131072, original_max_position_embeddings=4096,
                   sliding_window=2047,
                   rope_scaling={"type": "longrope",
                                 "short_factor": (1 + rng.random(hd // 2)).round(4).tolist(),
                                 "long_factor": (4 + rng.random(hd // 2)).round(4).tolist()})
    if variant == "qwen3_yarn":       # YaRN over a 32-token original context
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32}
    return cfg


def hf_weights(arch):
    """The float32 HF-named weights of the tiny ``arch`` model (seeded)."""
    cfg = config(arch)
    rng = np.random.default_rng(SEEDS[arch])
    hd = head_dim(arch)
    arch = BASE.get(arch, arch)
    gemma = arch.startswith("gemma")

    def r(*shape, s=0.25):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm(n):  # Gemma stores w with (1 + w) applied: keep w near 0
        return r(n, s=0.1) if gemma else (1.0 + r(n, s=0.1)).astype(np.float32)
    W = {"model.embed_tokens.weight": r(VOCAB, HIDDEN, s=1.0 if not gemma else 0.15),
         "model.norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        W[p + "input_layernorm.weight"] = norm(HIDDEN)
        W[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        if gemma:
            W[p + "pre_feedforward_layernorm.weight"] = norm(HIDDEN)
            W[p + "post_feedforward_layernorm.weight"] = norm(HIDDEN)
        q, k, v = r(HEADS * hd, HIDDEN), r(KV * hd, HIDDEN), r(KV * hd, HIDDEN)
        if arch == "phi3":
            W[p + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
        else:
            W[p + "self_attn.q_proj.weight"] = q
            W[p + "self_attn.k_proj.weight"] = k
            W[p + "self_attn.v_proj.weight"] = v
        if arch == "qwen2":
            W[p + "self_attn.q_proj.bias"] = r(HEADS * hd, s=0.5)
            W[p + "self_attn.k_proj.bias"] = r(KV * hd, s=0.5)
            W[p + "self_attn.v_proj.bias"] = r(KV * hd, s=0.5)
        if arch in ("qwen3", "gemma3"):
            W[p + "self_attn.q_norm.weight"] = norm(hd)
            W[p + "self_attn.k_norm.weight"] = norm(hd)
        W[p + "self_attn.o_proj.weight"] = r(HIDDEN, HEADS * hd)
        if arch == "phi3":
            W[p + "mlp.gate_up_proj.weight"] = r(2 * FFN, HIDDEN)
        else:
            W[p + "mlp.gate_proj.weight"] = r(FFN, HIDDEN)
            W[p + "mlp.up_proj.weight"] = r(FFN, HIDDEN)
        W[p + "mlp.down_proj.weight"] = r(HIDDEN, FFN)
    if not cfg["tie_word_embeddings"]:
        W["lm_head.weight"] = r(VOCAB, HIDDEN)
    return W


def write_hf(path, arch):
    """config.json, model.safetensors, tokenizer.json of the tiny ``arch`` model."""
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    os.makedirs(path, exist_ok=True)
    save_file(hf_weights(arch), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(arch), f)
    toks = vocab_tokens()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(toks[:-2])},
                               [tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False}, f)
    return path


_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensors(arch):
    """The GGUF tensors (name -> float32 array, numpy ``[out, in]`` order)."""
    cfg = config(arch)
    gemma = arch.startswith("gemma")
    out = {}
    for name, w in hf_weights(arch).items():
        w = w.copy()
        if gemma and name.endswith("norm.weight"):
            w = (w + 1.0).astype(np.float32)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = w
            continue
        if name == "lm_head.weight":
            out["output.weight"] = w
            continue
        parts = name.split(".")
        i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        if rest == "post_attention_layernorm":
            g = "post_attention_norm" if gemma else "ffn_norm"
        else:
            g = _GGUF_BLOCK[rest]
        if ARCHS[arch][1] == "llama" and g in ("attn_q", "attn_k") and kind == "weight":
            w = permute_for_gguf(w, HEADS if g == "attn_q" else KV)   # the converter's permute
        out[f"blk.{i}.{g}.{kind}"] = w
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(rs, cfg["rope_theta"], head_dim(arch))
    if arch == "phi3":
        out["rope_factors_long.weight"] = np.asarray(rs["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rs["short_factor"], np.float32)
    return out


def write_gguf(path, arch, *, gguf_arch=None, spm=False):
    """The tiny ``arch`` model as a GGUF file (F32 tensors) at ``path``.
    ``gguf_arch="gemma"`` writes the Gemma 2 weights without their post norms as a
    Gemma (1) file: an architecture llama.cpp runs and this package does not."""
    import gguf
    cfg = config(arch)
    ga = gguf_arch or ARCHS[arch][1]
    hd = head_dim(arch)
    w = gguf.GGUFWriter(str(path), ga)
    # not the architecture's name: llama.cpp's vocabulary loader special-cases a
    # model named "phi3" (it looks up Phi-3's <unk> / <|endoftext|> tokens)
    w.add_name("opscope tiny model")
    w.add_block_count(LAYERS)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(VOCAB)
    if arch in ("gemma2", "gemma3") and ga != "gemma":
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2" and ga != "gemma":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        w.add_sliding_window_pattern(cfg["sliding_window_pattern"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])
        w.add_rope_scaling_orig_ctx_len(cfg["rope_scaling"]["original_max_position_embeddings"])
    if arch == "phi3":
        s = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(s) / math.log(cfg["original_max_position_embeddings"])))
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    if spm:                      # SentencePiece vocabulary of the same size
        toks, scores, types = spm_vocab()
        assert len(toks) == VOCAB
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(vocab_tokens())
        w.add_token_types([1] * (VOCAB - 2) + [3, 3])
        w.add_token_merges(MERGES)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)
    for name, a in gguf_tensors(arch).items():
        if ga == "gemma" and "post_" in name:
            continue
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def token_ids(n=64, seed=0):
    """The evaluated ids: a fixed pseudo-random sequence over the vocabulary."""
    return np.random.default_rng(seed).integers(0, VOCAB - 2, size=n).astype(np.int64)


def weights_digest(arch):
    """SHA-256 of the GGUF tensors (names, shapes, bytes): ties a golden file to them."""
    import hashlib
    h = hashlib.sha256()
    for name, a in sorted(gguf_tensors(arch).items()):
        h.update(name.encode())
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()
