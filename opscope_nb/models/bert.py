"""BERT-style encoder forward pass and sentence-transformers pooling (numpy + PackedLinear).

Layout: activations are ``[tokens, hidden]`` float32 (a padded batch ``[B, L]``
is flattened to ``[B*L, hidden]`` for every linear layer); weights ``[out, in]``
run through ``PackedLinear`` (``y = x @ Wᵀ + b``).  Blocks are post-LayerNorm::

    h = LN(h + Wo·attn(Wq h, Wk h, Wv h))
    h = LN(h + W2·gelu(W1 h))

with the exact erf GELU.  Attention uses numpy's batched matmul (BLAS).
An MPNet checkpoint written in this layout (:func:`opscope_nb.models.mpnet.to_bert_dir`)
adds its relative-position bias to the attention scores of every block.
Pooling follows ``1_Pooling/config.json`` (mean over non-pad tokens by
default) and the sentence embedding is L2-normalised when ``modules.json``
lists ``Normalize``.
"""
from __future__ import annotations

import numpy as np
from scipy.special import erf

__all__ = ["forward", "pool", "embed", "tokenize_batch", "embed_tokens", "attention_bias",
           "block"]


def _layer_norm(x, g, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return (xc / np.sqrt(var + np.float32(eps)) * g + b).astype(np.float32, copy=False)


def _ln_divisor(x, eps):
    """Per-row ``sqrt(var + eps)`` of a LayerNorm's input, float64 ``[rows]``."""
    x64 = x.astype(np.float64)
    return np.sqrt(x64.var(axis=-1) + float(eps))


def _gelu(x):
    return (0.5 * x * (1.0 + erf(x * np.float32(1.0 / np.sqrt(2.0))))).astype(np.float32,
                                                                             copy=False)


def tokenize_batch(model, texts) -> tuple:
    """Token ids ``[B, L]`` int64 (padded with the pad id) and mask ``[B, L]`` float32.

    Each text is truncated to the model's ``max_seq_len`` keeping its final
    (``[SEP]``) token.
    """
    cfg = model.config
    seqs = []
    for t in texts:
        ids = model.tokenizer.encode(t).ids
        if len(ids) > cfg["max_seq_len"]:
            ids = ids[:cfg["max_seq_len"] - 1] + ids[-1:]
        seqs.append(ids)
    L = max(len(s) for s in seqs)
    ids = np.full((len(seqs), L), cfg["pad_id"], dtype=np.int64)
    mask = np.zeros((len(seqs), L), dtype=np.float32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1.0
    return ids, mask


def embed_tokens(model, ids) -> np.ndarray:
    """The first block's input ``[B*L, hidden]`` float32 of padded ids ``[B, L]``:
    word + position (+ token type 0) embeddings, then the embedding LayerNorm."""
    cfg, T = model.config, model.tensors
    p = cfg["prefix"]
    B, L = ids.shape
    x = T[p + "embeddings.word_embeddings.weight"][ids]
    x = x + T[p + "embeddings.position_embeddings.weight"][:L][None]
    tt = p + "embeddings.token_type_embeddings.weight"
    if tt in T:
        x = x + T[tt][0]
    return _layer_norm(x.reshape(B * L, cfg["hidden"]), T[p + "embeddings.LayerNorm.weight"],
                       T[p + "embeddings.LayerNorm.bias"], cfg["eps"])


def attention_bias(mask) -> np.ndarray:
    """Additive key mask ``[B, 1, 1, L]`` float32 (``-1e30`` on padding)."""
    return ((1.0 - mask) * np.float32(-1e30)).astype(np.float32)[:, None, None, :]


def block(model, i, h, bias, *, act="auto", norm_scale=None) -> np.ndarray:
    """Encoder block ``i`` on ``h`` ``[B*L, hidden]`` float32 with the key mask
    ``bias`` (:func:`attention_bias`, ``[B, 1, 1, L]``); returns ``[B*L, hidden]``.
    Reads only block ``i``'s tensors (:mod:`opscope_nb.profile.calib` streams the
    model one block at a time).

    ``norm_scale``, optional: called with each LayerNorm's per-row divisor
    ``sqrt(var + eps)`` (float64 ``[B*L]``) after the attention and after the
    feed-forward sublayer: how much a sublayer's output error at each token is
    scaled down before the next block sees it (the calibration's token weights)."""
    cfg, T = model.config, model.tensors
    B, L = bias.shape[0], bias.shape[-1]
    H, nh = cfg["hidden"], cfg["n_heads"]
    hd = H // nh
    scale = np.float32(1.0 / np.sqrt(hd))
    b = f"{cfg['prefix']}encoder.layer.{i}."

    def lin(name, v):
        return T[name + ".weight"](v, act=act) + T[name + ".bias"]

    q = lin(b + "attention.self.query", h).reshape(B, L, nh, hd).transpose(0, 2, 1, 3)
    k = lin(b + "attention.self.key", h).reshape(B, L, nh, hd).transpose(0, 2, 3, 1)
    v = lin(b + "attention.self.value", h).reshape(B, L, nh, hd).transpose(0, 2, 1, 3)
    s = np.matmul(q, k) * scale + bias                           # [B, nh, L, L]
    if cfg.get("rel_buckets"):             # MPNet's relative-position bias (models.mpnet)
        from .mpnet import position_bias
        s += position_bias(T[cfg["prefix"] + "encoder.relative_attention_bias.weight"], L,
                           cfg["rel_buckets"], cfg["rel_max_distance"])[None]
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    ctx = np.matmul(s, v).transpose(0, 2, 1, 3).reshape(B * L, H)
    a = lin(b + "attention.output.dense", np.ascontiguousarray(ctx))
    h = h + a
    if norm_scale is not None:
        norm_scale(_ln_divisor(h, cfg["eps"]))
    h = _layer_norm(h, T[b + "attention.output.LayerNorm.weight"],
                    T[b + "attention.output.LayerNorm.bias"], cfg["eps"])
    f = _gelu(lin(b + "intermediate.dense", h))
    f = h + lin(b + "output.dense", f)
    if norm_scale is not None:
        norm_scale(_ln_divisor(f, cfg["eps"]))
    return _layer_norm(f, T[b + "output.LayerNorm.weight"],
                       T[b + "output.LayerNorm.bias"], cfg["eps"])


def forward(model, ids, mask, *, act="auto") -> np.ndarray:
    """Last hidden states ``[B, L, hidden]`` float32 of a padded batch.

    Parameters
    ----------
    model : Model
        An ``encoder`` family model from :func:`opscope_nb.models.open_model`.
    ids : ndarray of int64, shape (B, L)
    mask : ndarray of float32, shape (B, L)
        1 for real tokens, 0 for padding (padded keys get no attention).
    act : {"auto", "f32", "int8"}
        Activation mode passed to every ``PackedLinear`` call.
    """
    B, L = ids.shape
    h = embed_tokens(model, ids)
    bias = attention_bias(mask)
    for i in range(model.config["n_layers"]):
        h = block(model, i, h, bias, act=act)
    return h.reshape(B, L, model.config["hidden"])


def pool(model, hidden, mask) -> np.ndarray:
    """Sentence embeddings ``[B, hidden]`` float32 (pooling + optional L2 normalisation)."""
    mode = model.config["pooling"]
    m = mask[:, :, None]
    if mode == "cls":
        e = hidden[:, 0]
    elif mode == "max":
        e = np.where(m > 0, hidden, -np.inf).max(axis=1)
    else:
        cnt = np.maximum(m.sum(axis=1), 1e-9)
        e = (hidden * m).sum(axis=1) / (np.sqrt(cnt) if mode == "mean_sqrt_len" else cnt)
    e = e.astype(np.float32)
    if model.config["normalize"]:
        n = np.linalg.norm(e, axis=1, keepdims=True)
        e = e / np.maximum(n, np.float32(1e-12))
    return e.astype(np.float32, copy=False)


def embed(model, texts, *, act="auto", batch=32) -> np.ndarray:
    """Sentence embeddings ``[len(texts), hidden]`` float32 of a list of strings."""
    out = []
    for s in range(0, len(texts), batch):
        ids, mask = tokenize_batch(model, texts[s:s + batch])
        out.append(pool(model, forward(model, ids, mask, act=act), mask))
    return np.concatenate(out, axis=0)
