"""Decoder forward pass of the Llama family with a KV cache (numpy + PackedLinear).

One block-step design covers every architecture :mod:`.loader` accepts (Llama
2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, Phi-3); the normalised ``config``
says which pieces a model has.  Activations are ``[T, hidden]`` float32 for
the ``T`` new tokens of a call; weights ``[out, in]`` run through
``PackedLinear`` (``y = x @ Wᵀ``).  Per block::

    h = rms(x)                                  (weight w, or 1 + w: ``norm_offset``)
    q, k, v = Wq h (+ bq), Wk h (+ bk), Wv h (+ bv)     or one fused Wqkv h (Phi-3)
    q, k = rms_head(q), rms_head(k)             per head, Qwen3 / Gemma 3 (``qk_norm``)
    q, k = rope(q), rope(k)
    s = scale · q kᵀ ; s = cap · tanh(s / cap)  (Gemma 2 ``attn_softcap``)
    a = Wo softmax(s + causal / sliding-window mask) v   (GQA)
    x = x + post_rms(a)                         (post norm: Gemma 2/3 ``post_norms``)
    g, u = Wgate rms(x), Wup rms(x)             or one fused Wgate_up (Phi-3: gate first)
    x = x + post_rms(Wdown (act(g) * u))        act: silu (SwiGLU) or gelu-tanh (GeGLU)

``logits = cap · tanh(head(rms(x)) / cap)`` (``final_softcap``, Gemma 2) with
the untied ``lm_head`` / ``output.weight`` or the tied token embedding; the
embedding is multiplied by ``embed_scale`` (Gemma: ``sqrt(hidden)``).

RoPE: ``inv_freq[i] = base^(-2i/d) / factor[i]`` (``rope_factors``: Llama 3's
``rope_freqs``, Phi-3's short LongRoPE factors), YaRN's ramp between
interpolated and extrapolated frequencies (``rope_yarn``), positions times the
linear ``rope_scale``, cos/sin times ``rope_attn_factor``.  Layers flagged in
``swa`` (sliding window of ``sliding_window`` keys, Gemma) use
``rope_base_swa`` and no linear scaling.  Hugging Face weights rotate
``(i, i + d/2)`` (``rotate_half``); llama-arch GGUF files store Q/K rows
permuted so that adjacent pairs ``(2i, 2i+1)`` rotate (``rope_interleaved``);
the other GGUF architectures keep Hugging Face's order.  The cache holds
``K``/``V`` as ``[n_kv, capacity, head_dim]`` per block; a call appends its
``T`` tokens at positions ``cache.length ..``.
"""
from __future__ import annotations

import numpy as np
from scipy.special import expit

__all__ = ["KVCache", "forward", "head_linear", "embed_tokens", "rope_context", "block",
           "final_norm", "logits"]


class KVCache:
    """Keys/values of the tokens seen so far, ``[n_kv, capacity, head_dim]`` per block."""

    def __init__(self, config: dict, capacity: int):
        n, nkv, hd = config["n_layers"], config["n_kv"], config["head_dim"]
        self.capacity = int(capacity)
        self.k = [np.zeros((nkv, self.capacity, hd), dtype=np.float32) for _ in range(n)]
        self.v = [np.zeros((nkv, self.capacity, hd), dtype=np.float32) for _ in range(n)]
        self.length = 0


def _rms_norm(x, g, eps, offset=0.0):
    ms = np.mean(x * x, axis=-1, keepdims=True)
    if offset:
        g = g + np.float32(offset)
    return (x / np.sqrt(ms + np.float32(eps)) * g).astype(np.float32, copy=False)


def _rms_divisor(x, eps):
    """Per-row ``sqrt(mean(x²) + eps)`` of an RMSNorm's input, float64 ``[rows]``."""
    x64 = x.astype(np.float64)
    return np.sqrt(np.einsum("ij,ij->i", x64, x64) / x64.shape[-1] + float(eps))


def _rope_tables(config, pos, swa=False):
    hd = config["head_dim"]
    # sliding-window layers with a RoPE of their own (Gemma: ``rope_base_swa``,
    # no scaling); otherwise they share the global layers' RoPE (Mistral)
    local = swa and config.get("rope_base_swa") is not None
    inv = config["rope_base_swa" if local else "rope_base"] ** (
        -np.arange(0, hd, 2, dtype=np.float64) / hd)
    fac = config.get("rope_factors")
    if fac is not None and not local:
        inv = inv / np.asarray(fac, dtype=np.float64)
    yarn = config.get("rope_yarn")
    if yarn and not local:
        # YaRN (ggml's rope_yarn, HF's "yarn"): interpolated (inv / factor) where a
        # dimension turns fewer than beta_slow times over the original context,
        # extrapolated above beta_fast turns, a linear ramp between
        factor, orig, fast, slow = (float(v) for v in yarn)
        base = float(config["rope_base"])

        def corr(turns):
            return hd * np.log(orig / (turns * 2 * np.pi)) / (2 * np.log(base))
        lo, hi = max(0.0, np.floor(corr(fast))), min(hd - 1.0, np.ceil(corr(slow)))
        r = 1.0 - np.clip((np.arange(hd // 2) - lo) / max(0.001, hi - lo), 0.0, 1.0)
        inv = inv / factor * (1.0 - r) + inv * r
    scale = 1.0 if local else float(config.get("rope_scale", 1.0))
    ang = (pos[:, None].astype(np.float64) * scale) * inv[None, :]          # [T, hd/2]
    m = float(config.get("rope_attn_factor", 1.0))
    return (np.cos(ang) * m).astype(np.float32), (np.sin(ang) * m).astype(np.float32)


def _rope(x, cos, sin, interleaved):
    """Rotate ``x`` ``[..., T, heads, hd]`` (returns a new array)."""
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
    """The token embeddings ``[T, hidden]`` float32 of ``ids`` (the first block's
    input), times ``embed_scale`` when the architecture scales them (Gemma)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    x = np.ascontiguousarray(model.tensors[model.config["names"]["embed"]][ids],
                             dtype=np.float32)
    sc = model.config.get("embed_scale")
    if sc:
        x *= np.float32(sc)
    return x


class _Context:
    """RoPE tables and masks of one call, shared by every block: global layers and
    sliding-window layers (``config["swa"]``) each get theirs, made on first use."""

    def __init__(self, config, p0, T):
        self.config, self.p0, self.T = config, int(p0), int(T)
        self._got = {}

    def __iter__(self):            # (cos, sin, mask) of a global layer, as before
        return iter(self.of(None))

    def of(self, i):
        """``(cos, sin, mask)`` of block ``i`` (``None``: a global-attention block)."""
        swa = self.config.get("swa")
        kind = bool(swa[i]) if (swa is not None and i is not None) else False
        got = self._got.get(kind)
        if got is None:
            got = self._got[kind] = self._make(kind)
        return got

    def _make(self, sliding):
        cfg, p0, T = self.config, self.p0, self.T
        cos, sin = _rope_tables(cfg, np.arange(p0, p0 + T), sliding)
        S = p0 + T
        win = int(cfg.get("sliding_window") or 0) if sliding else 0
        if T > 1 or (win and S > win):
            # query t (absolute p0+t) sees keys k <= p0+t, and p0+t - k < window
            kpos = np.arange(S)[None, :]
            qpos = np.arange(p0, S)[:, None]
            ok = kpos <= qpos
            if win:
                ok &= (qpos - kpos) < win
            mask = np.where(ok, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        else:
            mask = None
        return cos, sin, mask


def rope_context(config, p0, T):
    """The per-call context of ``T`` new tokens at positions ``p0 ..``: for each
    kind of block (global, sliding-window) the RoPE tables ``[T, head_dim / 2]``
    and the mask ``[T, p0 + T]`` (``None`` for one token that sees every key).
    Shared by every block of a call; ``ctx.of(i)`` is block ``i``'s
    ``(cos, sin, mask)``."""
    return _Context(config, p0, T)


def _act(cfg, g):
    if cfg.get("act", "silu") == "gelu_tanh":
        c = np.float32(np.sqrt(2.0 / np.pi))
        return np.float32(0.5) * g * (np.float32(1.0) + np.tanh(
            c * (g + np.float32(0.044715) * g * g * g)))
    return g * expit(g)


def block(model, i, x, kc, vc, p0, ctx, *, act="auto", seqs=1, norm_scale=None) -> np.ndarray:
    """Block ``i`` of the decoder on ``x`` ``[T, hidden]`` float32 (the new tokens).

    ``kc`` / ``vc`` (``[n_kv, capacity, head_dim]`` float32, this block's
    cache) receive the tokens' keys/values at ``p0 .. p0 + T - 1`` and hold
    the earlier ones; ``ctx`` is :func:`rope_context` ``(config, p0, T)``.
    Returns the block's output ``[T, hidden]`` float32.  Reads only block
    ``i``'s tensors, so a caller may hold one block at a time
    (:mod:`opscope_nb.profile.calib` streams the model this way).

    ``seqs > 1`` runs that many independent sequences of ``T`` tokens at
    once: ``x`` is ``[seqs * T, hidden]`` (sequence-major), ``kc`` / ``vc``
    are None and ``p0`` 0 (no cache); each sequence attends to itself only.
    The linear layers then see one ``[seqs * T, in]`` input (one GEMM for
    every sequence).  ``kc = vc = None`` with ``seqs = 1`` is one sequence
    without a cache.

    ``norm_scale``, optional: called with the residual stream's per-row RMS
    ``sqrt(mean(x²) + eps)`` (float64 ``[rows]``) after the attention's and
    after the feed-forward's output is added: the divisor every later norm
    applies to a sublayer's output error at that token (the calibration's
    token weights).  Not called for architectures that normalise the
    sublayer outputs themselves (``post_norms``: Gemma 2/3).
    """
    cfg, W = model.config, model.tensors
    nm = cfg["names"]
    B = int(seqs)
    if B < 1 or x.shape[0] % B:
        raise ValueError(f"block: seqs must be >= 1 and divide the {x.shape[0]} rows of x; "
                         f"got seqs={seqs!r}.")
    if B > 1 and (kc is not None or vc is not None or p0):
        raise ValueError("block: seqs > 1 runs without a KV cache; pass kc=vc=None and p0=0.")
    T = x.shape[0] // B
    S = p0 + T
    nh, nkv, hd = cfg["n_heads"], cfg["n_kv"], cfg["head_dim"]
    rep = nh // nkv
    cos, sin, mask = ctx.of(i) if isinstance(ctx, _Context) else ctx
    scale = np.float32(cfg.get("attn_scale") or 1.0 / np.sqrt(hd))
    inter = cfg["rope_interleaved"]
    eps, off = cfg["eps"], cfg.get("norm_offset", 0.0)

    def name(role):
        return nm[role].format(i=i)

    h = _rms_norm(x, W[name("attn_norm")], eps, off)
    if cfg.get("fused_qkv"):
        qkv = W[name("qkv")](h, act=act)
        q, k, v = np.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
    else:
        q = W[name("q")](h, act=act)
        k = W[name("k")](h, act=act)
        v = W[name("v")](h, act=act)
    if cfg.get("qkv_bias"):
        q = q + W[name("q_bias")]
        k = k + W[name("k_bias")]
        v = v + W[name("v_bias")]
    q = q.reshape(B, T, nh, hd)
    k = k.reshape(B, T, nkv, hd)
    if cfg.get("qk_norm"):
        q = _rms_norm(q, W[name("q_norm")], eps, off)
        k = _rms_norm(k, W[name("k_norm")], eps, off)
    q = _rope(q, cos, sin, inter)
    k = _rope(k, cos, sin, inter)
    v = v.reshape(B, T, nkv, hd)
    if kc is not None:
        kc[:, p0:S] = k[0].transpose(1, 0, 2)
        vc[:, p0:S] = v[0].transpose(1, 0, 2)
        K = kc[None, :, :S]                                       # [1, nkv, S, hd]
        V = vc[None, :, :S]
    else:
        K = k.transpose(0, 2, 1, 3)                               # [B, nkv, T, hd]
        V = v.transpose(0, 2, 1, 3)
    # queries grouped by their KV head: [B, nkv, rep*T, hd] (head-major inside a group)
    qg = q.transpose(0, 2, 1, 3).reshape(B, nkv, rep * T, hd)
    s = np.matmul(qg, K.transpose(0, 1, 3, 2)) * scale            # [B, nkv, rep*T, S]
    cap = cfg.get("attn_softcap")
    if cap:
        s = np.tanh(s / np.float32(cap)) * np.float32(cap)
    if mask is not None:
        s = s.reshape(B, nkv, rep, T, S)
        s += mask
        s = s.reshape(B, nkv, rep * T, S)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = np.matmul(s, V).reshape(B, nh, T, hd).transpose(0, 2, 1, 3).reshape(B * T, nh * hd)
    a = W[name("o")](np.ascontiguousarray(o, dtype=np.float32), act=act)
    if cfg.get("post_norms"):
        a = _rms_norm(a, W[name("attn_post_norm")], eps, off)
    x = x + a
    post = cfg.get("post_norms")
    if norm_scale is not None and not post:
        norm_scale(_rms_divisor(x, eps))
    h = _rms_norm(x, W[name("ffn_norm")], eps, off)
    if cfg.get("fused_gate_up"):
        gu = W[name("gate_up")](h, act=act)
        g, u = gu[:, :cfg["ffn"]], gu[:, cfg["ffn"]:]
    else:
        g = W[name("gate")](h, act=act)
        u = W[name("up")](h, act=act)
    a = _act(cfg, g) * u
    y = W[name("down")](np.ascontiguousarray(a, dtype=np.float32), act=act)
    if post:
        y = _rms_norm(y, W[name("ffn_post_norm")], eps, off)
    out = (x + y).astype(np.float32, copy=False)
    if norm_scale is not None and not post:
        norm_scale(_rms_divisor(out, eps))
    return out


def final_norm(model, x) -> np.ndarray:
    """The output norm of the last block's output ``x`` (the head's input)."""
    cfg = model.config
    return np.ascontiguousarray(_rms_norm(x, model.tensors[cfg["names"]["out_norm"]],
                                          cfg["eps"], cfg.get("norm_offset", 0.0)))


def logits(model, x, *, act="auto", head=None) -> np.ndarray:
    """The logits ``[T, vocab]`` of the last block's output ``x``: the output
    norm, the head (``head``, default :func:`head_linear`) and the final
    soft-capping of architectures that have it (Gemma 2)."""
    z = (head or head_linear(model))(final_norm(model, x), act=act)
    cap = model.config.get("final_softcap")
    if cap:
        z = (np.tanh(z / np.float32(cap)) * np.float32(cap)).astype(np.float32)
    return z


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
    return _logits(model, x, act=act)


_logits = logits
