"""Llama-style decoder forward pass with a KV cache (numpy + PackedLinear).

Activations are ``[T, hidden]`` float32 for the ``T`` new tokens of a call;
weights ``[out, in]`` run through ``PackedLinear`` (``y = x @ Wᵀ``).  Per block::

    h = x + Wo·attn(rope(Wq rms(x)), rope(Wk rms(x)), Wv rms(x))      (causal, GQA)
    x = h + Wdown·(silu(Wgate rms(h)) * Wup rms(h))

then ``logits = head(rms(x))`` with the untied ``lm_head`` / ``output.weight`` or
the tied token embedding.  RoPE: ``inv_freq[i] = base^(-2i/d)``; Hugging Face
weights rotate ``(i, i + d/2)`` (``rotate_half``), GGUF files store Q/K rows
permuted so that adjacent pairs ``(2i, 2i+1)`` rotate (``rope_interleaved``).
Grouped-query attention: query head ``h`` reads KV head ``h // (n_heads / n_kv)``.
The cache holds ``K``/``V`` as ``[n_kv, capacity, head_dim]`` per block; a
call appends its ``T`` tokens at positions ``cache.length ..``.
"""
from __future__ import annotations

import numpy as np
from scipy.special import expit

__all__ = ["KVCache", "forward", "head_linear", "embed_tokens", "rope_context", "block",
           "final_norm"]


class KVCache:
    """Keys/values of the tokens seen so far, ``[n_kv, capacity, head_dim]`` per block."""

    def __init__(self, config: dict, capacity: int):
        n, nkv, hd = config["n_layers"], config["n_kv"], config["head_dim"]
        self.capacity = int(capacity)
        self.k = [np.zeros((nkv, self.capacity, hd), dtype=np.float32) for _ in range(n)]
        self.v = [np.zeros((nkv, self.capacity, hd), dtype=np.float32) for _ in range(n)]
        self.length = 0


def _rms_norm(x, g, eps):
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + np.float32(eps)) * g).astype(np.float32, copy=False)


def _rope_tables(config, pos):
    hd = config["head_dim"]
    inv = config["rope_base"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]          # [T, hd/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rope(x, cos, sin, interleaved):
    """Rotate ``x`` ``[T, heads, hd]`` in place semantics (returns a new array)."""
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x2 * c + x1 * s
        return out
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def head_linear(model):
    """The output head as a ``PackedLinear`` (the tied embedding wrapped without a copy)."""
    nm = model.config["names"]
    if not model.config["tied"]:
        return model.tensors[nm["head"]]
    h = model.extras.get("head")
    if h is None:
        from .loader import dense_linear
        h = dense_linear(model.tensors[nm["embed"]])
        model.extras["head"] = h
    return h


def embed_tokens(model, ids) -> np.ndarray:
    """The token embeddings ``[T, hidden]`` float32 of ``ids`` (the first block's input)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return np.ascontiguousarray(model.tensors[model.config["names"]["embed"]][ids],
                                dtype=np.float32)


def rope_context(config, p0, T) -> tuple:
    """``(cos, sin, mask)`` for ``T`` new tokens at positions ``p0 ..``: the RoPE
    tables ``[T, head_dim / 2]`` and the causal mask ``[T, p0 + T]`` (``None``
    for one token).  Shared by every block of a call."""
    cos, sin = _rope_tables(config, np.arange(p0, p0 + T))
    S = p0 + T
    if T > 1:
        # query t (absolute p0+t) sees keys <= p0+t
        kpos = np.arange(S)[None, :]
        qpos = np.arange(p0, S)[:, None]
        mask = np.where(kpos <= qpos, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    else:
        mask = None
    return cos, sin, mask


def block(model, i, x, kc, vc, p0, ctx, *, act="auto") -> np.ndarray:
    """Block ``i`` of the decoder on ``x`` ``[T, hidden]`` float32 (the new tokens).

    ``kc`` / ``vc`` (``[n_kv, capacity, head_dim]`` float32, this block's
    cache) receive the tokens' keys/values at ``p0 .. p0 + T - 1`` and hold
    the earlier ones; ``ctx`` is :func:`rope_context` ``(config, p0, T)``.
    Returns the block's output ``[T, hidden]`` float32.  Reads only block
    ``i``'s tensors, so a caller may hold one block at a time
    (:mod:`opscope_nb.profile.calib` streams the model this way).
    """
    cfg, W = model.config, model.tensors
    nm = cfg["names"]
    T = x.shape[0]
    S = p0 + T
    nh, nkv, hd = cfg["n_heads"], cfg["n_kv"], cfg["head_dim"]
    rep = nh // nkv
    cos, sin, mask = ctx
    scale = np.float32(1.0 / np.sqrt(hd))
    inter = cfg["rope_interleaved"]

    def name(role):
        return nm[role].format(i=i)

    h = _rms_norm(x, W[name("attn_norm")], cfg["eps"])
    q = W[name("q")](h, act=act)
    k = W[name("k")](h, act=act)
    v = W[name("v")](h, act=act)
    if cfg.get("qkv_bias"):
        q = q + W[name("q_bias")]
        k = k + W[name("k_bias")]
        v = v + W[name("v_bias")]
    q = _rope(q.reshape(T, nh, hd), cos, sin, inter)
    k = _rope(k.reshape(T, nkv, hd), cos, sin, inter)
    kc[:, p0:S] = k.transpose(1, 0, 2)
    vc[:, p0:S] = v.reshape(T, nkv, hd).transpose(1, 0, 2)
    K = kc[:, :S]                                                 # [nkv, S, hd]
    V = vc[:, :S]
    # queries grouped by their KV head: [nkv, rep*T, hd] (head-major inside a group)
    qg = q.transpose(1, 0, 2).reshape(nkv, rep * T, hd)
    s = np.matmul(qg, K.transpose(0, 2, 1)) * scale               # [nkv, rep*T, S]
    if mask is not None:
        s = s.reshape(nkv, rep, T, S)
        s += mask
        s = s.reshape(nkv, rep * T, S)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = np.matmul(s, V).reshape(nh, T, hd).transpose(1, 0, 2).reshape(T, nh * hd)
    x = x + W[name("o")](np.ascontiguousarray(o), act=act)
    h = _rms_norm(x, W[name("ffn_norm")], cfg["eps"])
    g = W[name("gate")](h, act=act)
    u = W[name("up")](h, act=act)
    a = g * expit(g) * u
    return x + W[name("down")](np.ascontiguousarray(a, dtype=np.float32), act=act)


def final_norm(model, x) -> np.ndarray:
    """The output norm of the last block's output ``x`` (the head's input)."""
    return np.ascontiguousarray(_rms_norm(x, model.tensors[model.config["names"]["out_norm"]],
                                          model.config["eps"]))


def forward(model, ids, cache: KVCache, *, act="auto", logits="all") -> np.ndarray:
    """Run ``ids`` (new tokens) through the decoder, appending to ``cache``.

    Parameters
    ----------
    model : Model
        A ``decoder`` family model from :func:`opscope_nb.models.open_model`.
    ids : array_like of int, shape (T,)
        Token ids at positions ``cache.length .. cache.length + T - 1``.
    cache : KVCache
        Updated in place (``length`` grows by ``T``); must have room.
    act : {"auto", "f32", "int8"}
        Activation mode of every ``PackedLinear`` call.
    logits : {"all", "last"}
        Return ``[T, vocab]`` or only the last row ``[1, vocab]`` (decode).

    Returns
    -------
    ndarray of float32, shape (T, vocab) or (1, vocab)
    """
    cfg = model.config
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    T = ids.shape[0]
    p0 = cache.length
    if p0 + T > cache.capacity:
        raise ValueError(f"KV cache holds {cache.capacity} positions; {p0} used + {T} new "
                         f"tokens do not fit. Make a larger KVCache.")
    x = embed_tokens(model, ids)
    ctx = rope_context(cfg, p0, T)
    for i in range(cfg["n_layers"]):
        x = block(model, i, x, cache.k[i], cache.v[i], p0, ctx, act=act)
    cache.length = p0 + T
    if logits == "last":
        x = x[-1:]
    return head_linear(model)(final_norm(model, x), act=act)
