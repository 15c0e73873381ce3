"""Dense vs compressed: what a plan does to a model's outputs, size and speed.

:func:`evaluate` runs the dense model (weights from the source) and, when
given, the compressed checkpoint (``opscope-nb apply`` output) on the same
tokens and returns one flat dict (the ``eval --json`` document):

* both: ``family``, ``arch``, ``tokens``, ``dense_weight_bytes``,
  ``compressed_weight_bytes`` (every array each model holds, packed arrays
  counted packed), ``dense_tokens_per_s``, ``compressed_tokens_per_s``,
  ``peak_rss_mb`` (this process);
* encoders: ``cosine_mean``, ``cosine_min`` of the per-text pooled embeddings
  (``cos = 1 - |u - v|^2 / 2`` of the unit vectors, float64, so identical
  embeddings give exactly 1); ``*_tokens_per_s`` is the warm batch-forward rate;
* decoders: ``kl_mean`` = mean over positions of KL(dense || compressed) of the
  next-token distributions (float64 log-softmax), ``top1_agree``, ``ppl_dense``,
  ``ppl_compressed`` (over non-overlapping windows of ``window`` tokens);
  ``*_tokens_per_s`` is the warm **decode** rate (``decode_steps`` greedy
  tokens, one at a time with the KV cache, m = 1) and
  ``*_prefill_tokens_per_s`` the warm rate of a ``prompt_tokens`` prompt.

Without a compressed checkpoint the ``compressed_*`` figures and the
comparison metrics are None.
"""
from __future__ import annotations

import contextlib
import os
import re
import time

import numpy as np

from opscope_nb.io._fs import peak_rss_mb
from opscope_nb.data import TEXT_KEYWORDS
from .loader import ModelError, open_model

__all__ = ["evaluate", "load_passages", "JSON_KEYS", "kl_stats", "cosine"]

#: Keys every ``eval --json`` document has (None where not applicable).
JSON_KEYS = ("family", "tokens", "dense_weight_bytes", "compressed_weight_bytes",
             "dense_tokens_per_s", "compressed_tokens_per_s", "cosine_mean", "cosine_min",
             "kl_mean", "top1_agree", "ppl_dense", "ppl_compressed")


def load_passages(text=None) -> list:
    """Passages: non-empty lines of ``text`` (a path); ``None`` or ``"sample"``
    the built-in sample; ``"builtin"`` the larger built-in set
    (:func:`opscope_nb.data.builtin_passages`, the standard library's prose
    docstrings).  The keywords win over a file of that name (write
    ``./sample`` for the file).

    Raises
    ------
    ModelError
        The file is missing, unreadable or has no non-blank line; ``builtin``
        on an installation without the standard library's sources.
    """
    if text is None or text == "sample":
        from opscope_nb.data import sample_passages
        return sample_passages()
    if text == "builtin":
        from opscope_nb.data import builtin_passages
        got = list(builtin_passages())
        if not got:
            raise ModelError("--calib-text builtin: this Python has no standard-library "
                             "sources to read; give a text file.")
        return got
    path = os.fspath(text)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f]
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the text file ({exc.strerror or exc}).") from None
    except UnicodeDecodeError:
        raise ModelError(f"{path}: not UTF-8 text; give one passage per line.") from None
    lines = [ln for ln in lines if ln]
    if not lines:
        raise ModelError(f"{path}: the text file is empty; give one passage per line.")
    return lines


#: Sentence boundary: whitespace after . ! ? (optionally a closing quote), not after
#: the abbreviations Mr. Mrs. Dr. St.
_SENT_SPLIT = re.compile(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)"
                         r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+")


def _sentences(passages) -> list:
    out = []
    for p in passages:
        out += [s.strip() for s in _SENT_SPLIT.split(p) if s.strip()]
    return out


def cosine(a, b) -> np.ndarray:
    """Row-wise cosine of ``a``, ``b`` ``[n, d]`` as ``1 - |u - v|^2 / 2`` (float64)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    u = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-300)
    v = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-300)
    return 1.0 - 0.5 * ((u - v) ** 2).sum(axis=1)


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_stats(logits_p, logits_q) -> tuple:
    """Per-position ``KL(p || q)`` and top-1 agreement of two logit arrays ``[T, V]``.

    Returns
    -------
    kl : ndarray of float64, shape (T,)
    agree : ndarray of bool, shape (T,)
    """
    ref = _kl_reference(logits_p)
    lq = _log_softmax(logits_q)
    return _kl_to(ref, lq), np.argmax(ref[0], axis=-1) == np.argmax(lq, axis=-1)


def _kl_reference(logits_p) -> tuple:
    """``(log p, p)`` of logits ``[T, V]`` (float64): what every ``KL(p || .)``
    against the same reference reuses (:func:`kl_stats`; the sensitivity sweep
    compares one clean output with every perturbed one)."""
    lp = _log_softmax(logits_p)
    return lp, np.exp(lp)


def _kl_to(ref, lq) -> np.ndarray:
    """Per-position ``KL(p || q)`` (float64 ``[T]``, clipped at 0) from
    :func:`_kl_reference` ``ref`` and ``lq = log q``."""
    lp, p = ref
    return np.maximum((p * (lp - lq)).sum(axis=-1), 0.0)


def _nll(logits, targets):
    lp = _log_softmax(logits)
    return -lp[np.arange(len(targets)), targets]


class _NoBar:
    def show(self, i, name):
        pass

    def advance(self, w):
        pass

    def close(self):
        pass


def evaluate(source, compressed=None, *, text=None, act="f32", max_tokens=None,
             decode_steps=64, prompt_tokens=64, window=256, make_progress=None,
             speed_act="auto", runtime="numba", act_quant="none") -> dict:
    """Run the dense (and compressed) model on the same tokens; return the figures.

    Parameters
    ----------
    source : str
        The original checkpoint (its config and tokenizer are used for both models).
    compressed : str or None
        ``opscope-nb apply`` output for ``source``: a checkpoint, or a GGUF file
        (``apply SOURCE.gguf PLAN -o OUT.gguf``, or a llama-quantize output of
        the same model) whose ggml-typed layers run from their own blocks.
    text : str or None
        Text file, one passage per line; None = the built-in English sample.
    act : {"f32", "auto", "int8"}
        Activation mode of every ``PackedLinear`` call (both models) in the
        quality runs (cosine / KL / perplexity).  Default ``"f32"``: the score
        is the plan's weight error alone, as the dense model runs in float32
        too (``"auto"`` would add the int8 activation error of the packed
        kernels to the compressed model only).
    speed_act : {"auto", "f32", "int8"}
        Activation mode of the timed runs (tokens per second); default
        ``"auto"``, the fastest path each kind has.
    max_tokens : int or None
        Cap on the tokens evaluated (decoders: the token stream; encoders:
        whole texts are added while the total stays within the cap, at least one).
    decode_steps, prompt_tokens : int
        Decoder speed run: greedy tokens decoded after a prompt of this length.
    window : int
        Decoder perplexity/KL window (non-overlapping, fresh KV cache each).
    make_progress : callable or None
        ``make_progress(n_items, total_work) -> bar`` with ``show(i, name)``,
        ``advance(work)``, ``close()`` (the CLI's stderr bar); None = silent.
    runtime : {"numba", "llama.cpp"}
        ``"numba"``: this package's forward (both models); ``"llama.cpp"``:
        decoders in GGUF files scored by llama.cpp's own forward
        (:mod:`opscope_nb.models.llamacpp`, needs llama-cpp-python) on the
        same token ids, for every architecture llama.cpp loads (this
        package's architecture check does not apply); ``act`` / ``speed_act`` do not apply, the weight bytes
        are the files' tensor bytes as stored.
    act_quant : {"none", "ggml"}
        ``"ggml"`` (``runtime="numba"``): in the quality runs every linear layer
        of both models reads its input as llama.cpp's CPU matmul does for the
        type its file stores it in (:mod:`opscope_nb.models.ggml_acts`: Q8_0 /
        Q8_K blocks, F16 rounding), so KL and perplexity estimate llama.cpp's
        without llama.cpp.  Default ``"none"``: float activations, the
        weights' error alone.

    Returns
    -------
    dict
        Every key of :data:`JSON_KEYS` plus ``arch``, ``act``, ``act_quant``, ``source``,
        ``compressed``, ``peak_rss_mb``, ``load_seconds`` and, for decoders,
        ``dense_prefill_tokens_per_s``, ``compressed_prefill_tokens_per_s``,
        ``decode_steps``, ``prompt_tokens``, ``kl_max``; for encoders ``texts``.

    Raises
    ------
    ModelError, UnsupportedModelError, opscope_nb.io.SourceError
        Bad input (unknown architecture, empty text, checkpoint of another model).
    """
    for nm, v in (("act", act), ("speed_act", speed_act)):
        if v not in ("auto", "f32", "int8"):
            raise ValueError(f"{nm} must be 'auto', 'f32' or 'int8'; got {v!r}.")
    for nm, v in (("decode_steps", decode_steps), ("prompt_tokens", prompt_tokens),
                  ("window", window)):
        if int(v) < 1:
            raise ValueError(f"{nm} must be >= 1; got {v}.")
    if max_tokens is not None and int(max_tokens) < 2:
        raise ValueError(f"max_tokens must be >= 2; got {max_tokens}.")
    if runtime not in ("numba", "llama.cpp"):
        raise ValueError(f"runtime must be 'numba' or 'llama.cpp'; got {runtime!r}.")
    if act_quant not in ("none", "ggml"):
        raise ValueError(f"act_quant must be 'none' or 'ggml'; got {act_quant!r}.")
    if act_quant == "ggml" and runtime != "numba":
        raise ValueError("act_quant='ggml' emulates llama.cpp in this package's forward; "
                         "runtime='llama.cpp' quantises its activations itself: drop one.")
    passages = load_passages(text)
    mk = make_progress or (lambda n, w: _NoBar())
    if runtime == "llama.cpp":
        res = {k: None for k in JSON_KEYS}
        res.update(runtime=runtime, act=None, speed_act=None, source=os.fspath(source),
                   compressed=None if compressed is None else os.fspath(compressed))
        t0 = time.perf_counter()
        _eval_llamacpp(res, source, compressed, passages, max_tokens, decode_steps,
                       prompt_tokens, window, mk)
        res["seconds"] = time.perf_counter() - t0
        rss = peak_rss_mb()
        res["peak_rss_mb"] = rss if np.isfinite(rss) else None
        return res
    t0 = time.perf_counter()
    dense = open_model(source, make_progress=make_progress)
    comp = None
    if compressed is not None:
        comp = open_model(source, compressed)
    load_s = time.perf_counter() - t0
    res = {k: None for k in JSON_KEYS}
    res.update(family=dense.family, arch=dense.arch, act=act, speed_act=speed_act,
               runtime=runtime, act_quant=act_quant,
               source=os.fspath(source),
               compressed=None if compressed is None else os.fspath(compressed),
               dense_weight_bytes=dense.weight_bytes(),
               compressed_weight_bytes=None if comp is None else comp.weight_bytes(),
               load_seconds=load_s)
    acts = _quality_acts(act_quant, source, compressed, dense, comp)
    if dense.family == "encoder":
        _eval_encoder(res, dense, comp, passages, text is None or text in TEXT_KEYWORDS, act,
                      speed_act, max_tokens, mk, acts)
    else:
        _eval_decoder(res, dense, comp, passages, act, speed_act, max_tokens,
                      decode_steps, prompt_tokens, window, mk, acts)
    rss = peak_rss_mb()
    res["peak_rss_mb"] = rss if np.isfinite(rss) else None
    return res


def _quality_acts(act_quant, source, compressed, dense, comp):
    """``acts(model)``: the context the quality runs of ``model`` happen in
    (llama.cpp's activations at each file's stored types for ``"ggml"``)."""
    if act_quant != "ggml":
        return lambda m: contextlib.nullcontext()
    from .ggml_acts import llamacpp_activations, stored_types
    types = {id(dense): stored_types(source)}
    if comp is not None:
        types[id(comp)] = stored_types(compressed)
    return lambda m: llamacpp_activations(m, types[id(m)])


# --------------------------------------------------------------------------- #
def _eval_encoder(res, dense, comp, passages, builtin, act, speed_act, max_tokens, mk,
                  acts):
    from . import bert
    texts = _sentences(passages) if builtin else list(passages)
    if max_tokens is not None:
        keep, tot = [], 0
        for t in texts:
            n = len(dense.tokenizer.encode(t).ids)
            if keep and tot + n > max_tokens:
                break
            keep.append(t)
            tot += n
        texts = keep
    ids_all = [min(len(dense.tokenizer.encode(t).ids), dense.config["max_seq_len"])
               for t in texts]
    ntok = int(sum(ids_all))
    models = [("dense", dense)] + ([("compressed", comp)] if comp is not None else [])
    bar = mk(2 * len(models), 2 * len(models))
    embs = {}
    for j, (tag, m) in enumerate(models):
        bar.show(2 * j, f"{tag} forward")
        with acts(m):
            embs[tag] = bert.embed(m, texts, act=act)      # quality
        bar.advance(1)
        bar.show(2 * j + 1, f"{tag} timed forward")
        if speed_act != act:
            bert.embed(m, texts[:1], act=speed_act)        # warm the speed path
        t = time.perf_counter()
        bert.embed(m, texts, act=speed_act)
        res[f"{tag}_tokens_per_s"] = ntok / max(time.perf_counter() - t, 1e-12)
        bar.advance(1)
    bar.close()
    res["tokens"] = ntok
    res["texts"] = len(texts)
    if comp is not None:
        c = cosine(embs["dense"], embs["compressed"])
        res["cosine_mean"] = float(c.mean())
        res["cosine_min"] = float(c.min())


def _score_windows(res, ids, window, models, run, bar) -> None:
    """Perplexity of each model and KL / top-1 of the second against the first
    over non-overlapping windows of ``ids``; ``run(model, chunk) -> logits [T, V]``
    (a fresh context per window).  Fills ``res``; one ``bar`` step per window."""
    starts = list(range(0, len(ids) - 1, window))
    nll = {tag: [] for tag, _ in models}
    kls, agree = [], []
    for wi, s in enumerate(starts):
        chunk = ids[s:s + window]
        if len(chunk) < 2:
            break
        bar.show(wi, f"window {wi + 1}/{len(starts)}")
        logits = {}
        for tag, m in models:
            logits[tag] = run(m, chunk)
            nll[tag].append(_nll(logits[tag][:-1], chunk[1:]))
            bar.advance(1)
        if len(models) > 1:
            k, a = kl_stats(logits["dense"], logits["compressed"])
            kls.append(k)
            agree.append(a)
        del logits
    res["tokens"] = int(sum(len(x) for x in nll["dense"]) + len(nll["dense"]))
    res["ppl_dense"] = float(np.exp(np.concatenate(nll["dense"]).mean()))
    if len(models) > 1:
        res["ppl_compressed"] = float(np.exp(np.concatenate(nll["compressed"]).mean()))
        k = np.concatenate(kls)
        res["kl_mean"] = float(k.mean())
        res["kl_max"] = float(k.max())
        res["top1_agree"] = float(np.concatenate(agree).mean())


def _eval_llamacpp(res, source, compressed, passages, max_tokens, decode_steps,
                   prompt_tokens, window, mk) -> None:
    """:func:`evaluate` with ``runtime="llama.cpp"``: both GGUF files scored by
    llama.cpp's own forward on this package's token ids -- or, for an
    architecture or vocabulary this package does not read, on llama.cpp's own
    (:func:`opscope_nb.models.llamacpp.tokenize`): any file llama.cpp loads."""
    from opscope_nb import io as tio
    from . import llamacpp
    from .loader import _GGUF_ENCODERS, detect, gguf_metadata, is_gguf
    for nm, p in (("source", source), ("compressed", compressed)):
        if p is not None and not is_gguf(p):
            raise ModelError(f"--runtime llama.cpp runs GGUF files; the {nm} {p} is not "
                             f"one (write one with 'opscope-nb apply SOURCE.gguf PLAN -o "
                             f"OUT.gguf').")
    # llama.cpp decides which architectures it runs: this package's loader only
    # supplies the tokenizer when it knows the file (both runtimes then see the
    # same ids); otherwise llama.cpp's own vocabulary tokenises
    try:
        family, arch, cfg, tok = detect(source)
    except ModelError:           # unsupported architecture, RoPE scaling or vocabulary
        md = gguf_metadata(source)
        a = str(md.get("general.architecture"))
        family = "encoder" if a in _GGUF_ENCODERS else "decoder"
        arch, tok = f"gguf-{a}", None
        cfg = {"context": int(md.get(f"{a}.context_length") or 2048)}
    if family != "decoder":
        raise ModelError(f"--runtime llama.cpp scores decoders; {source} is a {arch} {family}.")
    if tok is not None:
        ids = _decoder_ids(cfg, tok, passages, max_tokens)
    else:
        ids = llamacpp.tokenize(source, "\n".join(passages))
        if max_tokens is not None:
            ids = ids[:int(max_tokens)]
        if len(ids) < 2:
            raise ModelError("the text has fewer than 2 tokens; give a longer text.")
        ids = np.asarray(ids, dtype=np.int64)
    window = int(min(window, cfg.get("context", window)))
    prompt = ids[:max(1, min(int(prompt_tokens), len(ids)))]
    n_ctx = max(window, len(prompt) + int(decode_steps) + 2)
    paths = [("dense", source)] + ([("compressed", compressed)] if compressed else [])
    for tag, p in paths:
        res[f"{tag}_weight_bytes"] = int(sum(e.raw().size for e in tio.open_source(p).entries))
    llms = [(tag, llamacpp.load(p, n_ctx=n_ctx)) for tag, p in paths]
    starts = list(range(0, len(ids) - 1, window))
    bar = mk(len(starts) + len(llms), len(starts) * len(llms) + len(llms))
    _score_windows(res, ids, window, llms, llamacpp.logits, bar)
    for j, (tag, llm) in enumerate(llms):
        bar.show(len(starts) + j, f"{tag} decode speed")
        pre, dec = llamacpp.speed(llm, prompt, int(decode_steps))
        res[f"{tag}_prefill_tokens_per_s"] = pre
        res[f"{tag}_tokens_per_s"] = dec
        bar.advance(1)
    bar.close()
    res.setdefault("compressed_prefill_tokens_per_s", None)
    res.update(family=family, arch=arch, decode_steps=int(decode_steps),
               prompt_tokens=int(len(prompt)))
    for _tag, llm in llms:
        llm.close()


def _decoder_ids(cfg, tokenizer, passages, max_tokens) -> np.ndarray:
    """The evaluated token stream: the passages joined by newlines, BOS first
    when the model wants one, cut at ``max_tokens``."""
    ids = list(tokenizer.encode("\n".join(passages)).ids)
    if cfg.get("add_bos") and cfg.get("bos") is not None:
        ids = [int(cfg["bos"])] + ids
    if max_tokens is not None:
        ids = ids[:int(max_tokens)]
    if len(ids) < 2:
        raise ModelError("the text has fewer than 2 tokens; give a longer text.")
    return np.asarray(ids, dtype=np.int64)


def _eval_decoder(res, dense, comp, passages, act, speed_act, max_tokens, decode_steps,
                  prompt_tokens, window, mk, acts):
    from . import llama
    cfg = dense.config
    ids = _decoder_ids(cfg, dense.tokenizer, passages, max_tokens)
    window = int(min(window, cfg.get("context", window)))
    models = [("dense", dense)] + ([("compressed", comp)] if comp is not None else [])
    starts = list(range(0, len(ids) - 1, window))
    n_work = len(starts) * len(models) + len(models) * (decode_steps + 1)
    bar = mk(len(starts) + len(models), n_work)

    def run(m, chunk):
        with acts(m):
            return llama.forward(m, chunk, llama.KVCache(m.config, len(chunk)), act=act)

    _score_windows(res, ids, window, models, run, bar)
    # speed: warm prefill of a prompt, then greedy decode one token at a time
    prompt = ids[:max(1, min(int(prompt_tokens), len(ids)))]
    for j, (tag, m) in enumerate(models):
        bar.show(len(starts) + j, f"{tag} decode speed")
        cap = len(prompt) + decode_steps + 2
        warm = llama.KVCache(m.config, cap)
        lg = llama.forward(m, prompt[:min(8, len(prompt))], warm, act=speed_act, logits="last")
        for _ in range(2):
            lg = llama.forward(m, [int(np.argmax(lg[-1]))], warm, act=speed_act, logits="last")
        cache = llama.KVCache(m.config, cap)
        t = time.perf_counter()
        lg = llama.forward(m, prompt, cache, act=speed_act, logits="last")
        t_pre = time.perf_counter() - t
        bar.advance(1)
        t = time.perf_counter()
        for _ in range(decode_steps):
            nxt = int(np.argmax(lg[-1]))
            lg = llama.forward(m, [nxt], cache, act=speed_act, logits="last")
            bar.advance(1)
        t_dec = time.perf_counter() - t
        res[f"{tag}_prefill_tokens_per_s"] = len(prompt) / max(t_pre, 1e-12)
        res[f"{tag}_tokens_per_s"] = decode_steps / max(t_dec, 1e-12)
    res.setdefault("compressed_prefill_tokens_per_s", None)
    res["decode_steps"] = int(decode_steps)
    res["prompt_tokens"] = int(len(prompt))
    bar.close()
