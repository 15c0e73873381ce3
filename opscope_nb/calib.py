"""Calibration: the inputs every linear layer sees, and how much each layer matters.

:func:`calibrate` opens a model with :func:`opscope_nb.models.open_model`, runs
its dense forward pass (:mod:`opscope_nb.models.bert` /
:mod:`opscope_nb.models.llama`, the ``opscope-nb eval`` forwards) on
calibration text and, for every linear layer, accumulates the second moment of
its inputs

    ``H = sum_t x_t x_tᵀ``  (``[cols, cols]`` float64, ``cols`` = in_features)

streamed one batch at a time (never all activations at once).  Layers are
observed by wrapping the model's ``PackedLinear`` objects from outside
(:class:`_Tap`, a duck-typed callable); layers that receive the very same
input array in a forward (q/k/v, gate/up) share one accumulator.  Padding
rows of an encoder batch are left out.  A layer with more than
``full_max_cols`` inputs (default 2048: at most 32 MiB per accumulator) keeps
``diag(H)`` only.

Sensitivity (``d metric / d out_err**2``, one layer at a time): for each layer,
its output ``y = x Wᵀ`` (before the bias) gets Gaussian noise of relative size
``eps`` (``eps * rms(y) * z``, ``z`` from an explicit seed), the model's final
output is compared with the clean one and ``sensitivity = metric / eps**2``
-- encoders: mean over texts of ``1 - cos`` of the pooled embeddings;
decoders: mean next-token ``KL(clean || perturbed)``.  For a small error
both metrics are quadratic in the output error, so ``sensitivity *
out_err**2`` predicts the metric a quantised layer costs; the one-layer
perturbation *is* the measurement (no proxy), at ``n_layers + 1`` forwards
over at most ``sens_tokens`` tokens.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Calibration", "calibrate", "FULL_MAX_COLS", "save_grams", "load_grams",
           "GramsError"]

#: Largest in_features for which the full ``[cols, cols]`` gram is kept.
FULL_MAX_COLS = 2048


@dataclass
class Calibration:
    """What :func:`calibrate` measured.

    Attributes
    ----------
    grams : dict of str -> ndarray of float64
        Per linear weight name: ``[cols, cols]`` (full) or ``[cols]`` (diagonal).
        Layers sharing an input share the same array object.
    tokens : int
        Token rows accumulated into every gram.
    sensitivity : dict of str -> float
        ``metric / eps**2`` per weight name (empty when not measured).
    metric : str
        ``"1-cos"`` (encoders) or ``"kl"`` (decoders).
    eps : float
    sens_tokens : int
        Tokens the sensitivity forwards ran on.
    seconds : dict of str -> float
        ``load``, ``grams``, ``sensitivity``.
    """

    grams: dict
    tokens: int
    sensitivity: dict = field(default_factory=dict)
    metric: str = ""
    eps: float = 0.0
    sens_tokens: int = 0
    seconds: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """JSON-ready facts (no arrays)."""
        full = sum(1 for g in self.grams.values() if g.ndim == 2)
        return {"tokens": int(self.tokens), "layers": len(self.grams),
                "full_grams": full, "diag_grams": len(self.grams) - full,
                "metric": self.metric, "eps": float(self.eps),
                "sens_tokens": int(self.sens_tokens),
                "seconds": {k: float(v) for k, v in self.seconds.items()}}


class _Recorder:
    def __init__(self, full_max_cols):
        self.full_max_cols = full_max_cols
        self.acc = {}        # group key -> float64 accumulator
        self.alias = {}      # layer name -> group key
        self.rows = None     # bool mask of real token rows (encoder padding)
        self.prev_x = None
        self.prev_name = None
        self.on = True
        self.perturb = None  # (name, eps, rng)
        self.tokens = 0

    def observe(self, name, x):
        if not self.on:
            return
        same = x is self.prev_x
        prev = self.prev_name
        self.prev_x, self.prev_name = x, name
        if name not in self.alias:
            self.alias[name] = self.alias[prev] if same and prev in self.alias else name
        key = self.alias[name]
        if same and self.alias.get(prev) == key:
            return  # this input was already accumulated for the group
        x2 = x.reshape(-1, x.shape[-1])
        if self.rows is not None and self.rows.shape[0] == x2.shape[0]:
            x2 = x2[self.rows]
        x64 = x2.astype(np.float64)
        cols = x64.shape[1]
        if cols <= self.full_max_cols:
            g = x64.T @ x64
        else:
            g = np.einsum("ij,ij->j", x64, x64)
        if key in self.acc:
            self.acc[key] += g
        else:
            self.acc[key] = g


class _Tap:
    """Wraps a ``PackedLinear``: records its input, optionally perturbs its output."""

    def __init__(self, inner, name, rec):
        self._inner, self._name, self._rec = inner, name, rec

    def __getattr__(self, a):
        return getattr(self._inner, a)

    def __call__(self, x, act="auto"):
        self._rec.observe(self._name, x)
        y = self._inner(x, act=act)
        p = self._rec.perturb
        if p is not None and p[0] == self._name:
            _, eps, rng = p
            rms = float(np.sqrt(np.mean(np.square(y, dtype=np.float64))))
            y = (y + (eps * rms) * rng.standard_normal(y.shape)).astype(np.float32)
        return y


def calibrate(source, *, text=None, max_tokens=None, full_max_cols=FULL_MAX_COLS,
              sensitivity=True, eps=0.05, seed=0, sens_tokens=256, act="f32",
              batch=32, window=256, log=None) -> Calibration:
    """Accumulate every linear layer's input gram (and sensitivity) on calibration text.

    Parameters
    ----------
    source : str
        A checkpoint :func:`opscope_nb.models.open_model` reads (BERT-style
        encoder or Llama-style decoder).
    text : str, optional
        Text file, one passage per line; ``None`` = the built-in English
        sample (:func:`opscope_nb.models.evaluate.load_passages`): encoders use
        its sentences, decoders its token stream.
    max_tokens : int, optional
        Cap on calibration tokens (encoders: whole sentences while within the
        cap, at least one).
    full_max_cols : int
        Keep the full gram up to this many inputs, ``diag(H)`` above.
    sensitivity : bool
        Also measure per-layer sensitivity (``n_layers + 1`` forwards).
    eps : float
        Relative size of the output noise of the sensitivity probe (> 0).
    seed : int
        Seed of the probe noise (one generator per layer: ``seed + index``).
    sens_tokens : int
        Token cap for the sensitivity forwards (also capped by ``max_tokens``).
    act : {"f32", "auto", "int8"}
        Activation mode of the dense ``PackedLinear`` calls.
    batch : int
        Encoder sentences per forward.
    window : int
        Decoder tokens per forward (fresh KV cache each).
    log : callable, optional
        ``log(str)`` progress lines (default: stderr when it is a terminal).

    Returns
    -------
    Calibration
    """
    from .models import open_model
    from .models.evaluate import load_passages
    from .models.loader import is_linear
    if not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0; got {eps!r}.")
    if int(full_max_cols) < 1:
        raise ValueError(f"full_max_cols must be >= 1; got {full_max_cols!r}.")
    if max_tokens is not None and int(max_tokens) < 2:
        raise ValueError(f"max_tokens must be >= 2; got {max_tokens!r}.")
    if log is None:
        log = (lambda s: print(s, file=sys.stderr, flush=True)) if sys.stderr.isatty() \
            else (lambda s: None)
    t0 = time.perf_counter()
    model = open_model(source)
    passages = load_passages(text)
    rec = _Recorder(int(full_max_cols))
    names = [n for n, v in model.tensors.items() if is_linear(v)]
    for n in names:
        model.tensors[n] = _Tap(model.tensors[n], n, rec)
    if model.family == "decoder" and model.config.get("tied"):
        from .models.loader import dense_linear
        en = model.config["names"]["embed"]
        model.extras["head"] = _Tap(dense_linear(model.tensors[en]), en, rec)
        names.append(en)
    secs = {"load": time.perf_counter() - t0}
    t1 = time.perf_counter()
    if model.family == "encoder":
        run, ntok, nsens = _encoder_runner(model, passages, text is None, max_tokens,
                                           sens_tokens, rec, act, batch)
        metric = "1-cos"
    else:
        run, ntok, nsens = _decoder_runner(model, passages, max_tokens, sens_tokens, rec,
                                           act, window)
        metric = "kl"
    run("grams")
    grams = {n: rec.acc[rec.alias[n]] for n in names if n in rec.alias}
    secs["grams"] = time.perf_counter() - t1
    log(f"calibration: {ntok} tokens, {len(grams)} layers "
        f"({sum(1 for g in grams.values() if g.ndim == 2)} full grams), "
        f"{secs['grams']:.1f}s")
    sens = {}
    if sensitivity:
        t2 = time.perf_counter()
        rec.on = False
        clean = run("clean")
        for i, n in enumerate(names):
            rec.perturb = (n, float(eps), np.random.default_rng([int(seed), i]))
            sens[n] = float(run(clean)) / float(eps) ** 2
            rec.perturb = None
            if (i + 1) % 8 == 0 or i + 1 == len(names):
                log(f"sensitivity: {i + 1}/{len(names)} layers, "
                    f"{time.perf_counter() - t2:.1f}s")
        secs["sensitivity"] = time.perf_counter() - t2
    return Calibration(grams, ntok, sens, metric, float(eps), nsens, secs)


def _encoder_runner(model, passages, builtin, max_tokens, sens_tokens, rec, act, batch):
    from .models import bert
    from .models.evaluate import _sentences
    texts = _sentences(passages) if builtin else list(passages)
    lens = [min(len(model.tokenizer.encode(t).ids), model.config["max_seq_len"])
            for t in texts]

    def cap(n):
        keep, tot = [], 0
        for t, k in zip(texts, lens):
            if keep and tot + k > n:
                break
            keep.append(t)
            tot += k
        return keep, tot

    cal, ntok = cap(max_tokens) if max_tokens is not None else (texts, sum(lens))
    sens_texts, nsens = cap(int(sens_tokens) if max_tokens is None
                            else min(int(sens_tokens), int(max_tokens)))

    def embed(ts):
        out = []
        for s in range(0, len(ts), batch):
            ids, mask = bert.tokenize_batch(model, ts[s:s + batch])
            rec.rows = mask.reshape(-1) > 0
            rec.prev_x = None
            out.append(bert.pool(model, bert.forward(model, ids, mask, act=act), mask))
        rec.rows = None
        return np.concatenate(out, axis=0)

    def run(what):
        if isinstance(what, str) and what == "grams":
            embed(cal)
            return None
        e = embed(sens_texts)
        if isinstance(what, str):
            return e
        from .models.evaluate import cosine
        return float(np.mean(1.0 - cosine(what, e)))

    return run, int(ntok), int(nsens)


def _decoder_runner(model, passages, max_tokens, sens_tokens, rec, act, window):
    from .models import llama
    from .models.evaluate import kl_stats
    cfg = model.config
    ids = list(model.tokenizer.encode("\n".join(passages)).ids)
    if cfg.get("add_bos") and cfg.get("bos") is not None:
        ids = [int(cfg["bos"])] + ids
    if max_tokens is not None:
        ids = ids[:int(max_tokens)]
    ids = np.asarray(ids, dtype=np.int64)
    window = int(min(window, cfg.get("context", window)))
    sens_ids = ids[:max(2, min(int(sens_tokens), len(ids), window))]

    def fwd(chunk):
        cache = llama.KVCache(model.config, len(chunk))
        rec.prev_x = None
        return llama.forward(model, chunk, cache, act=act)

    def run(what):
        if isinstance(what, str) and what == "grams":
            for s in range(0, len(ids), window):
                fwd(ids[s:s + window])
            return None
        lg = fwd(sens_ids)
        if isinstance(what, str):
            return lg
        return float(kl_stats(what, lg)[0].mean())

    return run, int(len(ids)), int(len(sens_ids))


class GramsError(ValueError):
    """A calibration-grams file (or mapping) breaks the :func:`save_grams` schema."""


def _check_gram_array(name, g, where):
    """float64 C-contiguous copy of one gram: 1-D ``[cols]`` or square ``[cols, cols]``,
    a float dtype, finite; else :class:`GramsError`."""
    a = np.asarray(g)
    if a.dtype.kind != "f":
        raise GramsError(f"{where}: gram of {name!r} must be a float array; got dtype "
                         f"{a.dtype}. Re-run the calibration.")
    if a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[0] != a.shape[1]):
        raise GramsError(f"{where}: gram of {name!r} must be [cols] or square "
                         f"[cols, cols]; got shape {a.shape}. Re-run the calibration.")
    if not np.isfinite(a).all():
        raise GramsError(f"{where}: gram of {name!r} has "
                         f"{int(np.count_nonzero(~np.isfinite(a)))} NaN/Inf entries. "
                         f"Re-run the calibration.")
    return np.ascontiguousarray(a, dtype=np.float64)


def save_grams(path, grams, meta=None) -> None:
    """Write calibration grams to an ``.npz`` file (atomic replace).

    Parameters
    ----------
    path : str or os.PathLike
    grams : mapping of str -> ndarray
        ``[cols]`` or ``[cols, cols]``, float, finite.  Names sharing one array
        object are stored once and share it again after :func:`load_grams`.
    meta : dict, optional
        JSON-serialisable facts stored beside the arrays.

    Notes
    -----
    Layout: arrays ``g0, g1, ...``; ``names``, a JSON list of ``[name, key]``
    string pairs; ``meta``, a JSON object.

    Raises
    ------
    GramsError
        A name that is not a string, or an array breaking the rules above.
    """
    import json
    import os
    path = os.fspath(path)
    if not hasattr(grams, "items"):
        raise GramsError(f"{path}: grams must be a mapping name -> array; got "
                         f"{type(grams).__name__}.")
    keys, arrays, pairs = {}, {}, []
    for n, g in grams.items():
        if not isinstance(n, str):
            raise GramsError(f"{path}: gram names must be strings; got {n!r}.")
        k = keys.get(id(g))
        if k is None:
            k = keys[id(g)] = f"g{len(keys)}"
            arrays[k] = _check_gram_array(n, g, path)
        pairs.append([n, k])
    try:
        meta_json = json.dumps(meta or {})
    except (TypeError, ValueError) as exc:
        raise GramsError(f"{path}: meta must be JSON-serialisable ({exc}).") from None
    from ._fs import atomic_writer          # the package's one atomic writer
    with atomic_writer(path, "wb") as f:
        np.savez(f, names=np.array(json.dumps(pairs)), meta=np.array(meta_json), **arrays)


def _short(value, limit=80):
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def load_grams(path) -> tuple:
    """Read a :func:`save_grams` file, validating it (the file is untrusted).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    grams : dict of str -> ndarray of float64, C-contiguous
        A name sharing a key with another shares the array object.
    meta : dict

    Raises
    ------
    GramsError
        Unreadable or not an ``.npz``; ``names`` not a JSON list of ``[name,
        key]`` string pairs (names unique, keys stored in the file); ``meta``
        not a JSON object; an array not float, not ``[cols]`` / square
        ``[cols, cols]``, or not finite.  Every message is one line.
    """
    import json
    import os
    import zipfile
    path = os.fspath(path)
    fix = "Re-run the calibration (opscope-nb profile --calib) to rewrite it."
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise GramsError(f"{path}: no such file.") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise GramsError(f"{path}: not a calibration-grams .npz file "
                         f"({type(exc).__name__}). {fix}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise GramsError(f"{path}: not a calibration-grams .npz file (a single array). "
                         f"{fix}")

    def text(entry):
        if entry not in z.files:
            raise GramsError(f"{path}: the {entry!r} entry is missing. {fix}")
        try:
            a = z[entry]
            if a.ndim != 0 or a.dtype.kind != "U":
                raise ValueError
            return json.loads(str(a))
        except (ValueError, RecursionError, OSError, zipfile.BadZipFile, EOFError):
            raise GramsError(f"{path}: the {entry!r} entry must be a JSON string. "
                             f"{fix}") from None

    with z:
        pairs = text("names")
        meta = text("meta")
        if not isinstance(meta, dict):
            raise GramsError(f"{path}: 'meta' must be a JSON object; got "
                             f"{type(meta).__name__}. {fix}")
        if not isinstance(pairs, list):
            raise GramsError(f"{path}: 'names' must be a JSON list of [name, key] pairs; "
                             f"got {type(pairs).__name__}. {fix}")
        cache, out = {}, {}
        for p in pairs:
            if not (isinstance(p, list) and len(p) == 2
                    and all(isinstance(v, str) for v in p)):
                raise GramsError(f"{path}: 'names' must hold [name, key] string pairs; "
                                 f"got {_short(p)}. {fix}")
            n, k = p
            if n in out:
                raise GramsError(f"{path}: gram name {_short(n)} is listed twice. {fix}")
            if k in ("names", "meta") or k not in z.files:
                raise GramsError(f"{path}: gram {_short(n)} refers to array {_short(k)}, "
                                 f"which the file does not hold. {fix}")
            if k not in cache:
                try:
                    arr = z[k]
                except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
                    raise GramsError(f"{path}: array {_short(k)} cannot be read "
                                     f"({type(exc).__name__}). {fix}") from None
                cache[k] = _check_gram_array(n, arr, path)
            out[n] = cache[k]
    return out, meta
