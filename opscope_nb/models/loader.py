"""Recognise a checkpoint's architecture, read its config and tokenizer, and hold
its tensors for the forward passes in :mod:`.bert` and :mod:`.llama`.

Families (anything else raises :class:`UnsupportedModelError`):

* ``encoder`` - BERT-style (``BertModel`` / ``model_type`` ``bert``) safetensors
  with ``config.json``; sentence-transformers pooling from ``1_Pooling/config.json``
  and ``modules.json`` (``Normalize``) when present.
* ``decoder`` - the Llama family, in GGUF files and in Hugging Face safetensors
  (``config.json``): Llama 2/3 (with Llama 3's RoPE scaling) and Mistral (GGUF
  ``llama``; ``llama``, ``mistral``), Qwen2/2.5 (``qwen2``, Q/K/V biases), Qwen3
  (``qwen3``, per-head Q/K RMS norms), Gemma 2/3 (``gemma2``, ``gemma3`` /
  ``gemma3_text``, and the language model of a multimodal ``gemma3``
  checkpoint: GeGLU, pre and post norms, scaled embeddings, soft-capping,
  sliding-window layers, tied head), Phi-3 (``phi3``: fused QKV and gate/up).
  :data:`SUPPORTED` names them per file format.

Phi-3's fused ``qkv_proj`` / ``attn_qkv`` and ``gate_up_proj`` / ``ffn_up``
weights stay one matrix each, as stored: one linear layer for the forward,
the calibration grams and the planner (one option per fused weight; the
written file keeps the fused tensor, as llama.cpp and Hugging Face load it).

Every linear layer is held as a :class:`opscope_nb.runtime.PackedLinear`
(``Decomp.dense()`` when it is not compressed), every other tensor as a float32
ndarray.  A weight is ``[out, in]``; GGUF's permuted Q/K rows are kept as stored
and :mod:`.llama` rotates adjacent pairs for them (``rope_interleaved``).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from opscope_nb import io as tio

__all__ = ["Model", "ModelError", "UnsupportedModelError", "open_model", "detect",
           "dense_linear", "gguf_metadata", "SUPPORTED", "block_tensors", "output_head",
           "HEAD_PRIOR_PER_BLOCK"]

#: One line naming what :func:`detect` accepts, per file format.
SUPPORTED = ("GGUF files of architecture 'llama' (Llama 2/3, Mistral), 'qwen2', 'qwen3', "
             "'gemma2', 'gemma3' or 'phi3'; safetensors whose config.json model_type is "
             "'bert' (encoders), 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', "
             "'gemma3_text', 'gemma3' (its language model) or 'phi3'")


class ModelError(ValueError):
    """The model cannot be run: inconsistent tensors, missing files, bad plan."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture is not one of :data:`SUPPORTED`."""


# --------------------------------------------------------------------------- #
# linear layers
# --------------------------------------------------------------------------- #
def dense_linear(w: np.ndarray):
    """A dense ``PackedLinear`` over ``w`` ``[out, in]`` float32 (no copy when possible)."""
    from opscope_nb.runtime._packed import PackedLinear
    from opscope_nb.formats import Decomp
    w = np.ascontiguousarray(w, dtype=np.float32)
    return PackedLinear(Decomp.dense(), {"w": w}, w.shape)


def is_linear(x) -> bool:
    """Whether a model tensor is a linear layer (a :class:`~opscope_nb.runtime.
    PackedLinear`, dense or packed) rather than a plain array."""
    from opscope_nb.runtime._packed import PackedLinear
    return isinstance(x, PackedLinear)


# --------------------------------------------------------------------------- #
# model
# --------------------------------------------------------------------------- #
@dataclass
class Model:
    """A loaded model ready for :func:`opscope_nb.models.bert.embed` or
    :func:`opscope_nb.models.llama.forward`.

    Attributes
    ----------
    family : str
        ``"encoder"`` or ``"decoder"``.
    arch : str
        ``bert``, a config.json ``model_type`` (``llama``, ``mistral``, ``qwen2``,
        ``qwen3``, ``gemma2``, ``gemma3_text``, ``phi3``) or ``gguf-<architecture>``
        (``gguf-llama``, ``gguf-qwen2`` ...).
    config : dict
        Normalised hyper-parameters (see :func:`detect`).
    tensors : dict of str -> PackedLinear or ndarray
        Linear weights as ``PackedLinear``, everything else float32.
    tokenizer : tokenizers.Tokenizer
    source_path : str
    """

    family: str
    arch: str
    config: dict
    tensors: dict = field(repr=False)
    tokenizer: object = field(repr=False)
    source_path: str = ""
    #: derived objects that share memory with :attr:`tensors` (e.g. a tied head)
    extras: dict = field(default_factory=dict, repr=False)
    #: name -> source entry of the tensors a lazy model (``open_model(...,
    #: lazy=True)``) reads on :meth:`load`; empty for a loaded model
    entries: dict = field(default_factory=dict, repr=False)
    #: names of the linear layers (held as ``PackedLinear`` once loaded)
    linear_names: frozenset = field(default_factory=frozenset, repr=False)

    def load(self, names) -> int:
        """Read ``names`` from the source into :attr:`tensors` (linear layers as
        dense ``PackedLinear``, the rest float32) unless already held; returns
        the bytes read.  For a lazy model (:func:`open_model` ``lazy=True``)."""
        got = 0
        for n in names:
            if n in self.tensors:
                continue
            e = self.entries.get(n)
            if e is None:
                raise ModelError(f"{self.source_path}: tensor {n!r} is not in the source.")
            a = e.load()
            got += int(a.nbytes)
            self.tensors[n] = dense_linear(a) if n in self.linear_names else a
        return got

    def drop(self, names) -> None:
        """Forget ``names`` (a lazy model re-reads them on the next :meth:`load`)."""
        for n in names:
            self.tensors.pop(n, None)

    def block_tensors(self, i) -> tuple:
        """``(linear names, other names)`` block ``i``'s forward reads."""
        return block_tensors(self.family, self.config, i)

    def weight_bytes(self) -> int:
        """Bytes of every array the model holds (packed arrays counted as packed)."""
        seen = set()
        total = 0
        for v in self.tensors.values():
            if id(v) in seen:
                continue
            seen.add(id(v))
            total += int(v.nbytes)
        return total

    def linear(self, name):
        return self.tensors[name]

    def array(self, name):
        return self.tensors[name]


# --------------------------------------------------------------------------- #
# detection
# --------------------------------------------------------------------------- #
def gguf_metadata(path: str) -> dict:
    """The GGUF key/value metadata as plain Python values (arrays as lists)."""
    try:
        reader = tio.gguf_reader(path)
    except Exception as exc:
        raise tio.SourceError(f"{path}: not a readable GGUF file ({type(exc).__name__}: "
                              f"{exc}).") from None
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # pragma: no cover - exotic field types
            continue
    return out


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc.strerror or exc}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc}).") from None


def _model_dir(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def detect(path: str) -> tuple:
    """``(family, arch, config, tokenizer)`` of a checkpoint, from headers only.

    ``config`` keys: encoders ``n_layers, hidden, n_heads, ffn, eps, vocab,
    max_pos, type_vocab, prefix, pooling, normalize, max_seq_len, act``;
    decoders ``n_layers, hidden, n_heads, n_kv, head_dim, ffn, eps, rope_base,
    rope_interleaved, vocab, tied, names`` (role -> tensor name pattern with
    ``{i}`` for the block), ``bos, eos, add_bos, context, family`` and the
    block's pieces (see :mod:`.llama`): ``qkv_bias, qk_norm, post_norms, act,
    fused_qkv, fused_gate_up`` and, where the architecture has them,
    ``rope_factors, rope_scale, rope_yarn, rope_attn_factor, rope_base_swa, swa,
    sliding_window, norm_offset, embed_scale, attn_scale, attn_softcap,
    final_softcap``.

    Raises
    ------
    UnsupportedModelError
        Unknown architecture (one line naming :data:`SUPPORTED`).
    ModelError, SourceError
        Missing / unreadable config or tokenizer.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise tio.SourceError(f"{path}: no such file or directory.")
    if path.lower().endswith(".gguf"):
        return _detect_gguf(path)
    d = _model_dir(path)
    cfg_path = os.path.join(d, "config.json")
    if not os.path.isfile(cfg_path):
        raise UnsupportedModelError(f"{path}: no config.json next to the weights, so the "
                                    f"architecture is unknown; eval supports {SUPPORTED}.")
    cfg = _read_json(cfg_path)
    mt = str(cfg.get("model_type", "")).lower()
    archs = [str(a) for a in cfg.get("architectures") or []]
    if mt == "bert" or any(a.startswith("Bert") for a in archs):
        return _detect_bert(d, cfg)
    if mt == "gemma3" and isinstance(cfg.get("text_config"), dict):
        # Gemma 3 4B/12B/27B: the multimodal checkpoint; its language model only
        return _detect_hf_decoder(d, _gemma3_text_config(cfg), "gemma3_text",
                                  prefix=_gemma3_prefix(path))
    if mt not in _HF_TYPES:
        mt = next((_HF_ARCH_CLASSES[a] for a in archs if a in _HF_ARCH_CLASSES), mt)
    if mt in _HF_TYPES:
        return _detect_hf_decoder(d, cfg, mt)
    raise UnsupportedModelError(f"{cfg_path}: model_type {mt or archs!r} is not supported; "
                                f"eval supports {SUPPORTED}.")


def _detect_bert(d, cfg):
    from .tokenize import from_dir
    if str(cfg.get("hidden_act", "gelu")) != "gelu":
        raise UnsupportedModelError(f"{d}: BERT hidden_act {cfg.get('hidden_act')!r}; only "
                                    f"exact 'gelu' is implemented.")
    if str(cfg.get("position_embedding_type", "absolute")) != "absolute":
        raise UnsupportedModelError(f"{d}: BERT position_embedding_type "
                                    f"{cfg.get('position_embedding_type')!r}; only "
                                    f"'absolute' is implemented.")
    pool = {"pooling_mode_mean_tokens": True}
    pp = os.path.join(d, "1_Pooling", "config.json")
    if os.path.isfile(pp):
        pool = _read_json(pp)
    mode = "mean"
    if pool.get("pooling_mode_cls_token"):
        mode = "cls"
    elif pool.get("pooling_mode_max_tokens"):
        mode = "max"
    elif pool.get("pooling_mode_mean_sqrt_len_tokens"):
        mode = "mean_sqrt_len"
    normalize = True
    mp = os.path.join(d, "modules.json")
    if os.path.isfile(mp):
        mods = _read_json(mp)
        normalize = any("Normalize" in str(m.get("type", "")) for m in mods)
    max_seq = int(cfg.get("max_position_embeddings", 512))
    sp = os.path.join(d, "sentence_bert_config.json")
    lower = True
    if os.path.isfile(sp):
        sb = _read_json(sp)
        max_seq = min(max_seq, int(sb.get("max_seq_length", max_seq)))
    tc = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(tc):
        lower = bool(_read_json(tc).get("do_lower_case", True))
    tok = from_dir(d, lower_case=lower)
    if tok is None:
        raise ModelError(f"{d}: no tokenizer.json or vocab.txt for the BERT tokenizer.")
    conf = {
        "n_layers": int(cfg["num_hidden_layers"]), "hidden": int(cfg["hidden_size"]),
        "n_heads": int(cfg["num_attention_heads"]), "ffn": int(cfg["intermediate_size"]),
        "eps": float(cfg.get("layer_norm_eps", 1e-12)), "vocab": int(cfg["vocab_size"]),
        "max_pos": int(cfg.get("max_position_embeddings", 512)),
        "type_vocab": int(cfg.get("type_vocab_size", 2)),
        "pooling": mode, "normalize": normalize, "max_seq_len": max_seq,
        "pad_id": int(cfg.get("pad_token_id", 0) or 0), "prefix": "",
    }
    if cfg.get("relative_attention_num_buckets"):      # MPNet in BERT layout (models.mpnet)
        conf["rel_buckets"] = int(cfg["relative_attention_num_buckets"])
        conf["rel_max_distance"] = int(cfg.get("relative_attention_max_distance", 128))
    return "encoder", "bert", conf, tok


_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "qkv": "model.layers.{i}.self_attn.qkv_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "attn_post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "gate_up": "model.layers.{i}.mlp.gate_up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "ffn_post_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
    "out_norm": "model.norm.weight",
    "head": "lm_head.weight",
}
#: Gemma 2/3 have four norms per block: HF's post_attention_layernorm is the
#: attention's post norm there, the FFN's input norm is pre_feedforward_layernorm.
_HF_GEMMA_NAMES = dict(_HF_NAMES, ffn_norm="model.layers.{i}.pre_feedforward_layernorm.weight")

_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "qkv": "blk.{i}.attn_qkv.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "o": "blk.{i}.attn_output.weight",
    "attn_post_norm": "blk.{i}.post_attention_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "gate_up": "blk.{i}.ffn_up.weight",      # Phi-3 stores the fused gate/up as ffn_up
    "down": "blk.{i}.ffn_down.weight",
    "ffn_post_norm": "blk.{i}.post_ffw_norm.weight",
    "out_norm": "output_norm.weight",
    "head": "output.weight",
}

#: Decoder roles that are linear layers (run through PackedLinear), unfused layout.
DECODER_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


def decoder_linear_roles(conf) -> tuple:
    """The linear roles of a decoder block: Phi-3 has one fused ``qkv`` and one
    fused ``gate_up`` weight (each one matrix for the planner, as stored)."""
    att = ("qkv",) if conf.get("fused_qkv") else ("q", "k", "v")
    ffn = ("gate_up",) if conf.get("fused_gate_up") else ("gate", "up")
    return att + ("o",) + ffn + ("down",)


#: Per family: ``(GGUF general.architecture, config.json model_types)`` and the
#: pieces of the block (see :mod:`.llama`).  ``rope_interleaved`` is the GGUF
#: layout only: llama-arch files hold Q/K rows permuted for adjacent-pair RoPE
#: (ggml's "normal" RoPE); the others use NeoX RoPE on Hugging Face's order.
_FAMILIES = {
    "llama": {"gguf": "llama", "hf": ("llama", "mistral"), "rope_interleaved": True},
    "qwen2": {"gguf": "qwen2", "hf": ("qwen2",), "qkv_bias": True},
    "qwen3": {"gguf": "qwen3", "hf": ("qwen3",), "qk_norm": True},
    "gemma2": {"gguf": "gemma2", "hf": ("gemma2",), "post_norms": True, "act": "gelu_tanh",
               "gemma": True},
    "gemma3": {"gguf": "gemma3", "hf": ("gemma3_text",), "post_norms": True, "qk_norm": True,
               "act": "gelu_tanh", "gemma": True},
    "phi3": {"gguf": "phi3", "hf": ("phi3",), "fused_qkv": True, "fused_gate_up": True},
}
_GGUF_ARCHS = {f["gguf"]: k for k, f in _FAMILIES.items()}
_HF_TYPES = {t: k for k, f in _FAMILIES.items() for t in f["hf"]}
_HF_ARCH_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                    "Phi3ForCausalLM": "phi3"}


def _block_flags(family) -> dict:
    f = _FAMILIES[family]
    return {"qkv_bias": bool(f.get("qkv_bias")), "qk_norm": bool(f.get("qk_norm")),
            "post_norms": bool(f.get("post_norms")), "act": f.get("act", "silu"),
            "fused_qkv": bool(f.get("fused_qkv")),
            "fused_gate_up": bool(f.get("fused_gate_up"))}


def _swa_layers(n_layers, pattern=None, layer_types=None, even=False):
    """Per block: True for a sliding-window layer.  ``layer_types`` (HF list of
    ``"sliding_attention"`` / ``"full_attention"``, or GGUF bools) wins; else
    ``pattern`` n: every n-th block (the last of each n) is global, as
    llama.cpp's ``set_swa_pattern`` and HF's ``(i + 1) % n``; ``even``: Gemma 2's
    even blocks slide."""
    if layer_types is not None:
        lt = list(layer_types)
        if len(lt) != n_layers:
            raise ModelError(f"{len(lt)} layer types for {n_layers} layers.")
        return [bool(t) if isinstance(t, (bool, int)) else str(t) == "sliding_attention"
                for t in lt]
    if pattern is not None:
        n = int(pattern)
        return [n == 0 or (i % n) < n - 1 for i in range(n_layers)]
    if even:
        return [i % 2 == 0 for i in range(n_layers)]
    return None


def _llama3_factors(rs, base, hd) -> list:
    """Llama 3's RoPE frequency divisors, as the GGUF converter writes
    ``rope_freqs.weight`` from ``rope_scaling`` (``rope_type == "llama3"``)."""
    import math
    factor = float(rs.get("factor", 8.0))
    lo = float(rs.get("low_freq_factor", 1.0))
    hi = float(rs.get("high_freq_factor", 4.0))
    old = float(rs.get("original_max_position_embeddings", 8192))
    lo_wl, hi_wl = old / lo, old / hi
    freqs = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    out = []
    for f in freqs.astype(np.float64):
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            sm = (old / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - sm) / factor + sm))
    return [float(np.float32(x)) for x in out]


def _hf_rope(d, cfg, family, conf) -> None:
    """Fill ``conf``'s RoPE scaling from ``rope_scaling`` (none, ``linear``,
    ``llama3``, Phi-3's ``longrope``)."""
    import math
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return
    if kind == "linear":
        conf["rope_scale"] = 1.0 / float(rs["factor"])
    elif kind == "llama3":
        conf["rope_factors"] = _llama3_factors(rs, conf["rope_base"], conf["head_dim"])
    elif kind in ("longrope", "su"):
        orig = int(cfg.get("original_max_position_embeddings") or conf["context"])
        conf["rope_factors"] = [float(x) for x in rs["short_factor"]]
        s = conf["context"] / orig
        af = rs.get("attention_factor")
        if af is None:
            af = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))
        conf["rope_attn_factor"] = float(af)
        conf["context"] = orig          # the short factors hold up to here
    elif kind == "yarn":
        factor = float(rs["factor"])
        if rs.get("mscale") not in (None, 1, 1.0) or rs.get("mscale_all_dim") not in (None, 0):
            raise UnsupportedModelError(f"{d}: YaRN with mscale / mscale_all_dim is not "
                                        f"implemented.")
        orig = int(rs.get("original_max_position_embeddings") or conf["context"])
        conf["rope_yarn"] = [factor, orig, float(rs.get("beta_fast") or 32.0),
                             float(rs.get("beta_slow") or 1.0)]
        af = rs.get("attention_factor")
        conf["rope_attn_factor"] = float(af) if af is not None else (
            1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0)
    else:
        raise UnsupportedModelError(
            f"{d}: rope_scaling {kind!r} is not implemented; eval supports plain RoPE, "
            f"'linear', 'llama3', 'yarn' and Phi-3's 'longrope'.")


#: Gemma3TextConfig's defaults: a multimodal Gemma 3 config.json states only
#: what differs from them in its ``text_config``.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "rope_scaling": None, "tie_word_embeddings": True,
}


def _gemma3_text_config(cfg) -> dict:
    tc = dict(_GEMMA3_TEXT_DEFAULTS)
    tc.update({k: v for k, v in cfg["text_config"].items()})
    for k in ("bos_token_id", "eos_token_id"):
        if tc.get(k) is None and cfg.get(k) is not None:
            tc[k] = cfg[k]
    return tc


def _gemma3_prefix(path) -> str:
    """Where a multimodal Gemma 3 checkpoint keeps its language model's tensors:
    ``language_model.`` before ``model.`` (the published files) or ``model.language_model.``
    instead of ``model.`` (newer transformers)."""
    names = {e.name for e in tio.open_source(path).entries}
    for pre in ("language_model.model.", "model.language_model."):
        if pre + "embed_tokens.weight" in names:
            return pre
    return "model."


def _detect_hf_decoder(d, cfg, mt, prefix="model."):
    from .tokenize import from_dir
    family = _HF_TYPES[mt]
    fam = _FAMILIES[family]
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedModelError(f"{d}: partial RoPE (partial_rotary_factor "
                                    f"{cfg['partial_rotary_factor']}) is not implemented.")
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    want = "gelu_tanh" if fam.get("act") == "gelu_tanh" else "silu"
    if act not in (("gelu_pytorch_tanh", "gelu_tanh") if want == "gelu_tanh" else ("silu",)):
        raise UnsupportedModelError(f"{d}: hidden_act {act!r}; the {mt} forward implements "
                                    f"{'GeGLU (gelu_pytorch_tanh)' if want != 'silu' else 'SwiGLU (silu)'}.")
    tok = from_dir(d)
    if tok is None:
        raise ModelError(f"{d}: no tokenizer.json next to the weights.")
    try:
        hidden = int(cfg["hidden_size"])
        nh = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        gemma = bool(fam.get("gemma"))
        conf = {
            "n_layers": n_layers, "hidden": hidden, "n_heads": nh,
            "n_kv": int(cfg.get("num_key_value_heads") or nh),
            "head_dim": int(cfg.get("head_dim") or hidden // nh),
            "ffn": int(cfg["intermediate_size"]), "eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_base": float(cfg.get("rope_theta", 10000.0)), "rope_interleaved": False,
            "vocab": int(cfg["vocab_size"]),
            "tied": bool(cfg.get("tie_word_embeddings", gemma)),
            "names": dict(_HF_GEMMA_NAMES if gemma else _HF_NAMES),
            "bos": cfg.get("bos_token_id"), "eos": cfg.get("eos_token_id"),
            "add_bos": mt in ("llama", "mistral") or gemma,
            "context": int(cfg.get("max_position_embeddings", 2048)),
            "family": family, **_block_flags(family),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{d}/config.json: incomplete {mt} config ({exc!r}).") from None
    if mt == "qwen2" and cfg.get("attention_bias") is False:
        conf["qkv_bias"] = False
    if mt == "qwen3" and cfg.get("attention_bias"):
        conf["qkv_bias"] = True
    if prefix != "model.":
        conf["names"] = {r: (prefix + n[len("model."):] if n.startswith("model.") else n)
                         for r, n in conf["names"].items()}
    _hf_rope(d, cfg, family, conf)
    if gemma:
        conf["norm_offset"] = 1.0                 # Gemma's RMSNorm scales by (1 + w)
        conf["embed_scale"] = float(np.sqrt(np.float32(hidden)))
        qs = cfg.get("query_pre_attn_scalar")
        if qs:
            conf["attn_scale"] = float(qs) ** -0.5
        conf["attn_softcap"] = cfg.get("attn_logit_softcapping") or None
        conf["final_softcap"] = cfg.get("final_logit_softcapping") or None
        win = cfg.get("sliding_window")
        if win:
            conf["sliding_window"] = int(win)
            conf["swa"] = _swa_layers(n_layers, cfg.get("sliding_window_pattern"),
                                      cfg.get("layer_types"), even=family == "gemma2")
            conf["rope_base_swa"] = float(cfg.get("rope_local_base_freq",
                                                  conf["rope_base"]))
    elif mt == "mistral" and cfg.get("sliding_window"):
        conf["sliding_window"] = int(cfg["sliding_window"])
        conf["swa"] = [True] * n_layers
    # Phi-3's sliding_window is ignored, as llama.cpp does (it only binds beyond 2k tokens)
    tcp = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(tcp):
        tc = _read_json(tcp)
        if "add_bos_token" in tc:
            conf["add_bos"] = bool(tc["add_bos_token"])
    return "decoder", mt, conf, tok


# kept for callers of the old name
def _detect_hf_llama(d, cfg, mt):
    return _detect_hf_decoder(d, cfg, mt)


def _gguf_vector(path, name):
    """A small F32 tensor of a GGUF file (RoPE factors) as a list, or None."""
    for t in tio.gguf_reader(path).tensors:
        if t.name == name:
            return [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    return None


def _detect_gguf(path):
    from .tokenize import from_gguf_fields
    md = gguf_metadata(path)
    arch = md.get("general.architecture")
    family = _GGUF_ARCHS.get(arch)
    if family is None:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"eval supports {SUPPORTED} ('eval --runtime llama.cpp' "
                                    f"scores any file llama.cpp loads).")

    def g(key, default=None):
        return md.get(f"{arch}.{key}", default)

    try:
        hidden = int(g("embedding_length"))
        nh = int(g("attention.head_count"))
        n_layers = int(g("block_count"))
        hd = int(g("attention.key_length", hidden // nh))
        conf = {
            "n_layers": n_layers, "hidden": hidden, "n_heads": nh,
            "n_kv": int(g("attention.head_count_kv", nh)), "head_dim": hd,
            "ffn": int(g("feed_forward_length")),
            "eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_base": float(g("rope.freq_base", 10000.0)),
            "rope_interleaved": bool(_FAMILIES[family].get("rope_interleaved")),
            "vocab": int(g("vocab_size", len(md.get("tokenizer.ggml.tokens", [])))),
            "tied": None, "names": dict(_GGUF_NAMES),
            "bos": md.get("tokenizer.ggml.bos_token_id"),
            "eos": md.get("tokenizer.ggml.eos_token_id"),
            "add_bos": bool(md.get("tokenizer.ggml.add_bos_token", True)),
            "context": int(g("context_length", 2048)),
            "family": family, **_block_flags(family),
        }
        n_rot = int(g("rope.dimension_count", hd))
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: GGUF {arch} metadata incomplete ({exc}).") from None
    if n_rot != hd:
        raise UnsupportedModelError(f"{path}: partial RoPE ({n_rot} of {hd} dimensions) is "
                                    f"not implemented.")
    # RoPE scaling as llama.cpp reads it: linear factor (default type), Llama 3's
    # rope_freqs tensor, Phi-3's short LongRoPE factors and attention factor
    kind = g("rope.scaling.type") or "linear"
    if kind not in ("none", "linear", "yarn") or float(
            g("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) != 0.0:
        raise UnsupportedModelError(f"{path}: RoPE scaling {kind!r} is not implemented; eval "
                                    f"supports plain, linear, YaRN, Llama 3 and Phi-3 "
                                    f"LongRoPE.")
    factor = float(g("rope.scaling.factor", 0.0) or g("rope.scale_linear", 0.0) or 0.0)
    if kind == "linear" and factor not in (0.0, 1.0):
        conf["rope_scale"] = 1.0 / factor
    if kind == "yarn" and factor > 1.0:
        # llama.cpp: beta 32 / 1 over the original context, attention factor
        # 1 + 0.1 ln(factor) (times rope.scaling.attn_factor)
        orig = int(g("rope.scaling.original_context_length", conf["context"]))
        conf["rope_yarn"] = [factor, orig, 32.0, 1.0]
        conf["rope_attn_factor"] = (1.0 + 0.1 * math.log(factor)) * float(
            g("rope.scaling.attn_factor", 1.0))
    fac = _gguf_vector(path, "rope_freqs.weight")
    if fac is None and family == "phi3":
        fac = _gguf_vector(path, "rope_factors_short.weight")
        if fac is not None:
            conf["rope_attn_factor"] = float(g("rope.scaling.attn_factor", 1.0))
            conf["context"] = int(g("rope.scaling.original_context_length", conf["context"]))
    if fac is not None:
        conf["rope_factors"] = fac
    if _FAMILIES[family].get("gemma"):
        # GGUF stores Gemma's norm weights already + 1 (the converter adds it)
        conf["embed_scale"] = float(np.sqrt(np.float32(hidden)))
        big = n_layers == (46 if family == "gemma2" else 62)     # llama.cpp's 27B rule
        conf["attn_scale"] = 1.0 / float(np.sqrt(np.float32(hidden // nh if big else hd)))
        win = g("attention.sliding_window")
        if family == "gemma2":
            conf["attn_softcap"] = float(g("attn_logit_softcapping", 50.0))
            conf["final_softcap"] = float(g("final_logit_softcapping", 30.0))
            win = int(win or 4096)
        else:
            conf["final_softcap"] = float(g("final_logit_softcapping", 0.0)) or None
        if win:
            pat = g("attention.sliding_window_pattern")
            lt = pat if isinstance(pat, (list, tuple)) else None
            n = None if lt is not None else (pat if pat is not None else
                                             (2 if family == "gemma2" else 6))
            conf["sliding_window"] = int(win)
            conf["swa"] = _swa_layers(n_layers, n, lt)
            conf["rope_base_swa"] = float(g("rope.freq_base_swa", conf["rope_base"]
                                            if family == "gemma2" else 10000.0))
    if "tokenizer.ggml.tokens" not in md:
        raise ModelError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata.")
    try:
        tok = from_gguf_fields({"model": md.get("tokenizer.ggml.model"),
                                "pre": md.get("tokenizer.ggml.pre"),
                                "tokens": md["tokenizer.ggml.tokens"],
                                "merges": md.get("tokenizer.ggml.merges", []),
                                "token_type": md.get("tokenizer.ggml.token_type"),
                                "scores": md.get("tokenizer.ggml.scores"),
                                "add_space_prefix": md.get("tokenizer.ggml.add_space_prefix"),
                                "unk": md.get("tokenizer.ggml.unknown_token_id")})
    except ValueError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from None
    return "decoder", f"gguf-{arch}", conf, tok


#: Data-free weight of a decoder's output head in the ``output`` objective, per
#: transformer block (see :func:`output_head`).
HEAD_PRIOR_PER_BLOCK = 2.0
#: GGUF architectures without an output head (encoders).
_GGUF_ENCODERS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "t5encoder",
                  "modern-bert", "neo-bert")
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:blk|layers|layer|h)\.(\d+)\.")


def output_head(path, names) -> tuple | None:
    """The tensor that computes a decoder's logits and its data-free weight in
    the ``output`` objective (:attr:`opscope_nb.profile.mining.LayerProfile.prior_weight`).

    Why a weight: without calibration the objective sums every layer's squared
    relative error alike.  A block's linear layer adds its error to one of the
    ``2 * blocks`` sublayer outputs that sum into the last hidden state, so
    (independent errors of similar size) its share there is about
    ``1 / (2 * blocks)``; the head's error goes straight into the logits.  The
    head therefore counts :data:`HEAD_PRIOR_PER_BLOCK` ``* blocks`` times as
    much.  On SmolLM2-135M the measured sensitivity (``profile --calib``) of
    its tied head is 140x the blocks' mean (``benchmarks/bench_gguf.py``).

    Parameters
    ----------
    path : str
        The checkpoint (a ``.gguf`` file, a ``.safetensors`` file or its
        directory with ``config.json``).
    names : iterable of str
        The checkpoint's tensor names.

    Returns
    -------
    (str, float) or None
        ``(head tensor name, prior weight)``: GGUF ``output.weight``, or
        ``token_embd.weight`` when the head is tied to it (no
        ``output.weight``; every decoder architecture llama.cpp knows does
        so); Hugging Face ``lm_head.weight``, or the ``embed_tokens`` table
        of a ``*ForCausalLM`` whose config ties them.  ``None`` for
        encoders, unknown layouts, or when no block index is found in the
        names.
    """
    names = set(names)
    blocks = {int(m.group(1)) for n in names for m in [_BLOCK_INDEX.search(n)] if m}
    if not blocks:
        return None
    weight = HEAD_PRIOR_PER_BLOCK * (max(blocks) + 1)
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
        if "output.weight" in names:
            return "output.weight", weight
        try:
            arch = tio.gguf_reader(path).fields[
                "general.architecture"].contents()
        except Exception:
            return None
        if arch in _GGUF_ENCODERS or "token_embd.weight" not in names:
            return None
        return "token_embd.weight", weight
    if "lm_head.weight" in names:
        return "lm_head.weight", weight
    cfg_path = os.path.join(_model_dir(path), "config.json")
    try:
        cfg = _read_json(cfg_path)
    except ModelError:
        return None
    causal = any(str(a).endswith("ForCausalLM") for a in cfg.get("architectures") or [])
    if not causal or not cfg.get("tie_word_embeddings", True):
        return None
    embed = sorted(n for n in names if n.endswith("embed_tokens.weight"))
    return (embed[0], weight) if len(embed) == 1 else None


#: Data-free weight of an encoder's word-embedding table in the ``output``
#: objective (see :func:`word_embedding`).
EMBED_PRIOR = 2.0


def word_embedding(path, names) -> tuple | None:
    """An encoder's word-embedding table and its data-free weight in the
    ``output`` objective (:attr:`opscope_nb.profile.mining.LayerProfile.prior_weight`).

    Why a weight: without calibration the objective sums every layer's squared
    relative error alike.  The table's error enters the residual stream before
    the first block, so every block reads it, where a block's linear layer is
    read by the blocks after it only (half of them on average); and the rows
    the text looks up are the frequent tokens', which quantise worse than the
    average row.  Its term therefore counts :data:`EMBED_PRIOR` times a
    layer's.  Measured on all-mpnet-base-v2 at Q6_K's size: per unit of
    predicted error the table cost 1.8-2.0x the rest of the plan in ``1 - cos``
    (docs, performance page, "Closing the misses").  With ``--calib`` the
    weight is not set: there the table takes the mean measured sensitivity.

    Parameters
    ----------
    path : str
        The checkpoint (a ``.gguf`` file, a ``.safetensors`` file or its
        directory).
    names : iterable of str
        The checkpoint's tensor names.

    Returns
    -------
    (str, float) or None
        ``(table name, prior weight)``: GGUF ``token_embd.weight`` of an
        encoder architecture (``bert``, ``nomic-bert`` ...), or a BertModel's
        ``[bert.|model.]embeddings.word_embeddings.weight``.  ``None`` for
        decoders (their token table is the tied head or a lookup llama.cpp's
        presets keep small) and unknown layouts.
    """
    names = set(names)
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
        if "token_embd.weight" not in names:
            return None
        try:
            arch = tio.gguf_reader(path).fields["general.architecture"].contents()
        except Exception:
            return None
        return ("token_embd.weight", EMBED_PRIOR) if arch in _GGUF_ENCODERS else None
    for p in ("", "bert.", "model."):
        if p + "embeddings.word_embeddings.weight" in names:
            return p + "embeddings.word_embeddings.weight", EMBED_PRIOR
    return None


# --------------------------------------------------------------------------- #
# tensor names the forward needs
# --------------------------------------------------------------------------- #
def _bert_prefix(names) -> str:
    for p in ("", "bert.", "model."):
        if p + "embeddings.word_embeddings.weight" in names:
            return p
    raise ModelError("no 'embeddings.word_embeddings.weight' tensor: not a BertModel "
                     "checkpoint.")


_BERT_LINEAR = ("attention.self.query", "attention.self.key", "attention.self.value",
                "attention.output.dense", "intermediate.dense", "output.dense")


def block_tensors(family, conf, i) -> tuple:
    """``(linear names, other names)`` of block ``i`` (after :func:`required_tensors`
    has filled ``conf``): the tensors :func:`opscope_nb.models.bert.block` /
    :func:`opscope_nb.models.llama.block` read."""
    if family == "encoder":
        b = f"{conf['prefix']}encoder.layer.{i}."
        lin = [b + part + ".weight" for part in _BERT_LINEAR]
        other = [b + part + ".bias" for part in _BERT_LINEAR]
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            other += [b + ln + ".weight", b + ln + ".bias"]
        if conf.get("rel_buckets"):                    # shared by every block (MPNet)
            other.append(f"{conf['prefix']}encoder.relative_attention_bias.weight")
        return lin, other
    nm = conf["names"]
    lin = [nm[r].format(i=i) for r in decoder_linear_roles(conf)]
    roles = ["attn_norm", "ffn_norm"]
    if conf.get("qkv_bias"):
        roles += ["q_bias", "k_bias", "v_bias"]
    if conf.get("qk_norm"):
        roles += ["q_norm", "k_norm"]
    if conf.get("post_norms"):
        roles += ["attn_post_norm", "ffn_post_norm"]
    return lin, [nm[r].format(i=i) for r in roles]


def required_tensors(family, conf, names) -> tuple:
    """``(linear names, other names, optional names)`` the forward reads."""
    lin, other, opt = [], [], []
    if family == "encoder":
        p = _bert_prefix(names)
        conf["prefix"] = p
        other += [p + "embeddings.word_embeddings.weight",
                  p + "embeddings.position_embeddings.weight",
                  p + "embeddings.LayerNorm.weight", p + "embeddings.LayerNorm.bias"]
        opt.append(p + "embeddings.token_type_embeddings.weight")
    else:
        nm = conf["names"]
        other += [nm["embed"], nm["out_norm"]]
        if nm["head"] in names:
            lin.append(nm["head"])
            conf["tied"] = False
        else:
            conf["tied"] = True
    for i in range(conf["n_layers"]):
        bl, bo = block_tensors(family, conf, i)
        lin += bl
        other += bo
    return lin, other, opt


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #
def is_gguf(path) -> bool:
    """True when ``path`` is a GGUF file (its magic, else its ``.gguf`` suffix)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return path.lower().endswith(".gguf")


def _gguf_held(path, family, conf) -> dict:
    """The tensors of a GGUF file (``apply SOURCE.gguf PLAN -o OUT.gguf`` or a
    llama-quantize output) as the forward holds them: linear layers stored in a
    ggml type as ``PackedLinear`` of that type over the file's own blocks (run
    by :mod:`opscope_nb.formats`' ggml decode, counted at their stored bytes),
    F32 linear layers dense, every other tensor the forward needs dequantised
    to float32 (tensors it does not need are not read)."""
    from opscope_nb.runtime._packed import PackedLinear
    from opscope_nb.formats import Decomp
    from opscope_nb.formats.ggml import GGML_TYPES, row_bytes
    src = tio.open_source(path)
    names = {e.name for e in src.entries}
    lin, other, opt = required_tensors(family, conf, names)
    want = set(lin) | set(other) | (set(opt) & names)     # the forward's tensors only
    lin = set(lin)
    out = {}
    for e in src.entries:
        if e.name not in want:
            continue
        if e.name in lin and len(e.shape) == 2 and e.dtype.upper() in GGML_TYPES:
            rows, cols = (int(x) for x in e.shape)
            qt = e.dtype.upper()
            blocks = np.array(e.raw(), dtype=np.uint8).reshape(rows, row_bytes(qt, cols))
            out[e.name] = PackedLinear(Decomp.ggml(qt), {"blocks": blocks}, (rows, cols))
        else:
            out[e.name] = e.load()
    return out


def open_model(source, compressed=None, *, make_progress=None, lazy=False) -> Model:
    """Load a model for eval: dense from ``source``, or its compressed checkpoint.

    Parameters
    ----------
    source : str
        The original checkpoint (config, tokenizer; weights when ``compressed`` is None).
    compressed : str or None
        A ``.safetensors`` file written by ``opscope-nb apply`` /
        :func:`opscope_nb.runtime.save`; its tensors replace the source's.
    make_progress : callable or None
        ``make_progress(n_items, total_work)`` -> a bar with ``show(i, name)`` /
        ``advance(work)`` / ``close()`` for reading the source's tensors.
    lazy : bool
        Read no weights now: :meth:`Model.load` / :meth:`Model.drop` bring
        tensors in and out (one block at a time, see :mod:`opscope_nb.profile.calib`).
        Only without ``compressed``.

    Returns
    -------
    Model

    Raises
    ------
    UnsupportedModelError, ModelError, SourceError
        Unknown architecture; the compressed file lacks a tensor the forward needs
        or holds one of another shape (a plan for another model).
    """
    family, arch, conf, tok = detect(source)
    if lazy and compressed is not None:
        raise ValueError("open_model: lazy=True reads the dense source; give compressed=None.")
    if compressed is None:
        src = tio.open_source(source)
        names = {e.name for e in src.entries}
        lin, other, opt = required_tensors(family, conf, names)
        want = set(lin) | set(other) | (set(opt) & names)
        missing = sorted((set(lin) | set(other)) - names)
        if missing:
            raise ModelError(f"{source}: tensor {missing[0]!r} missing ({len(missing)} "
                             f"missing); is this a complete {arch} checkpoint?")
        tensors = {}
        entries = [e for e in src.entries if e.name in want]
        if lazy:
            return Model(family, arch, conf, tensors, tok, os.fspath(source),
                         entries={e.name: e for e in entries}, linear_names=frozenset(lin))
        progress = None if make_progress is None else \
            make_progress(len(entries), sum(e.numel for e in entries))
        for i, e in enumerate(entries):
            if progress is not None:
                progress.show(i, e.name)
            a = e.load()
            tensors[e.name] = dense_linear(a) if e.name in lin else a
            if progress is not None:
                progress.advance(e.numel)
        if progress is not None:
            progress.close()
    else:
        from opscope_nb.runtime.checkpoint import load as ck_load
        src = tio.open_source(source)
        shapes = {e.name: tuple(e.shape) for e in src.entries}
        if is_gguf(compressed):
            loaded = _gguf_held(compressed, family, conf)
        else:
            loaded, _meta = ck_load(compressed)
        names = set(loaded)
        lin, other, opt = required_tensors(family, conf, names)
        want = set(lin) | set(other) | (set(opt) & names)
        tensors = {}
        for n in sorted(want):
            if n not in loaded:
                raise ModelError(f"{compressed}: tensor {n!r} that the {arch} forward needs "
                                 f"is missing; was it written from {os.path.basename(source)}?")
            v = loaded[n]
            shp = tuple(v.shape)
            if n in shapes and shapes[n] != shp:
                raise ModelError(f"{compressed}: tensor {n!r} has shape {shp} but "
                                 f"{os.path.basename(source)} has {shapes[n]}; the checkpoint "
                                 f"belongs to another model.")
            if n in lin and not is_linear(v):
                v = dense_linear(v)
            elif n not in lin and is_linear(v):
                v = v.dense()
            tensors[n] = v
    return Model(family, arch, conf, tensors, tok, os.fspath(source))
