"""Refine a plan by measuring it: a search over plans scored by the model's own output.

The allocators (:mod:`.allocate`) are exact for an additive model of the
error -- the sum over layers of a per-layer term (``sensitivity x
out_err**2`` with calibration).  That sum does not predict the end-to-end
error exactly (EvoPress, ICML 2025).  :func:`refine` starts from a plan (the
exact one), proposes plans that keep the bytes within the budget and keeps
the one whose **measured** score is lowest:

* decoders: mean next-token ``KL(dense || plan)`` over the search tokens
  (float64; the dense log-probabilities computed once);
* encoders: mean ``1 - cos`` of the pooled sentence embeddings.

Moves (each keeps ``bytes <= budget``): one layer up one step of its
*ladder* (its options that no cheaper option beats in the predicted error),
paid for by layers moved down (picked by predicted cost per byte freed,
among a few random ones), optionally a slack-filling move up; or a swap
inside one block (one layer up, another down).  Seeds (the exact plans of
nearby budgets, of other objectives) are scored first.  ``search="evo"``
is a (1 + lambda) evolutionary step in EvoPress's manner (``offspring``
candidates of one to three mutations each); ``search="local"`` a
first-improvement hill climb (one candidate of one mutation per step).
Candidates pass up to three stages of selection, each dearer than the last:
the predicted damage (free: ``preselect`` times more proposals than
measured), a short *screen* split (``PlanScorer(screen_tokens=...)``), and
for the best ``survivors`` that beat the parent there, the search split.

Before the moves, a *measured table* (``table`` > 0, the default): each
layer is run alone -- every other layer at its best option -- at its start
option and its ladder neighbours (:func:`singleton_table`); the exact
allocator solves those measured terms (:func:`table_layers`,
:func:`solve_table`), the table grows around its plan for a few rounds, and
the solved plans are the first seeds.  The predicted terms can be right in
sum and several times off per layer; the table replaces them where it
measured.

Candidates are scored without re-quantising: each (layer, option) is packed
once (:class:`PlanScorer` keeps its float32 reconstruction), and a candidate
runs only from the first block whose tensors differ from its parent's,
starting from the parent's cached input of that block (a changed head runs
the head alone).  A decoder candidate's KL is one compiled pass over its
logits against per-row constants of the dense reference.  The result is
never worse than the start on a held-out split: :func:`refine` scores both
plans there and returns the refined one only if it measures lower (``kept``).

The scorer is this package's forward (:class:`PlanScorer`) or, for a GGUF
decoder, llama.cpp's logits of each candidate's GGUF file
(:class:`opscope_nb.plan.refine_llamacpp.LlamaCppScorer`, same interface;
``refine --runtime llama.cpp``); :attr:`RefineResult.runtime` names it.

Layer 4 (imports :mod:`opscope_nb.models`, :mod:`opscope_nb.runtime`,
:mod:`opscope_nb.formats`, :mod:`.allocate`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from opscope_nb._threads import _one_blas_thread

from .allocate import (act_quant_mode, budget_bytes, exact_allocate, predicted_damage,
                       silence_native_output)

__all__ = ["PlanScorer", "RefineResult", "refine", "split_passages", "text_chunks", "ladders",
           "plan_bytes", "propose", "STATE_VERSION", "load_state", "save_state",
           "choice_key", "base_choice", "singleton_table", "table_layers", "solve_table",
           "paired_z", "PAIR_BATCH", "ACCEPT_Z"]

#: Version of the state file layout (:func:`save_state`).
STATE_VERSION = 1
#: Rows of logits turned into float64 log-probabilities at once (the reference).
_ROWS = 64
#: Consecutive next-token positions per unit of :func:`paired_z` in
#: :func:`refine` (decoders): neighbouring tokens' KL is correlated, so the
#: standard error comes from the means of batches of this many tokens.
PAIR_BATCH = 16
#: :func:`refine`'s default ``accept_z``: a move is kept when it lowers the
#: search score by at least this many standard errors of the paired difference.
ACCEPT_Z = 2.0


def _kl_kernel():
    """The compiled per-row KL / log-sum-exp of a candidate's logits (made once)."""
    got = _KERNEL.get("kl")
    if got is None:
        from numba import prange
        from opscope_nb.kernels._jit import njit_parallel

        @njit_parallel
        def kl_rows(z, p, c, s, kl, lse):
            # per row r: lse = log sum exp z (float64), and
            # KL(ref || q) = sum p (lp_ref - lq) = c - p.z + s * lse,
            # c = sum p lp_ref, s = sum p (the reference's float32 p, lp_ref)
            n, v = z.shape
            for r in prange(n):
                m = -np.inf
                for k in range(v):
                    if z[r, k] > m:
                        m = z[r, k]
                m64 = np.float64(m)
                acc = 0.0
                dot = 0.0
                for k in range(v):
                    zk = np.float64(z[r, k])
                    acc += np.exp(zk - m64)
                    dot += np.float64(p[r, k]) * zk
                lse[r] = m64 + np.log(acc)
                kl[r] = c[r] - dot + s[r] * lse[r]
        got = _KERNEL["kl"] = kl_rows
    return got


_KERNEL = {}


# --------------------------------------------------------------------------- #
# text
# --------------------------------------------------------------------------- #
def split_passages(items, frac, seed) -> tuple:
    """``(search, held_out)``: a seeded choice of ``ceil(frac * n)`` items held
    out (at least one, leaving at least one), both in text order -- the rule
    of :class:`opscope_nb.profile.calib.CalibrationStream` (same ``frac`` and
    seed: the same held-out passages as ``profile --calib --validate``)."""
    items = list(items)
    n = len(items)
    if not (isinstance(frac, (int, float)) and 0.0 < float(frac) < 1.0):
        raise ValueError(f"frac must be a fraction in (0, 1); got {frac!r}.")
    if n < 2:
        raise ValueError(f"need at least 2 passages to hold one out; got {n}. Give a "
                         f"longer text or a separate held-out text.")
    k = min(n - 1, max(1, int(np.ceil(float(frac) * n))))
    held = set(np.random.default_rng(int(seed)).choice(n, k, replace=False).tolist())
    return ([x for i, x in enumerate(items) if i not in held],
            [x for i, x in enumerate(items) if i in held])


def _decoder_chunks(model, passages, max_tokens, window):
    from opscope_nb.models.evaluate import _decoder_ids
    cfg = model.config
    ids = _decoder_ids(cfg, model.tokenizer, passages, max_tokens)
    window = int(min(window, cfg.get("context", window)))
    return [ids[s:s + window] for s in range(0, len(ids) - 1, window)
            if len(ids[s:s + window]) >= 2]


def _screen_chunks(chunks, tokens, family):
    """The screen split's chunks: a prefix of the search chunks (see
    :class:`PlanScorer`'s ``screen_tokens``)."""
    if family == "decoder":
        # as few windows as hold the tokens: each block call has a fixed cost
        # (the kernels' parallel launches), so two windows of 64 cost nearly
        # twice one of 128
        out, left = [], int(tokens)
        for c in chunks:
            if left < 2:
                break
            out.append(np.asarray(c[:left]))
            left -= len(out[-1])
        return out
    out, tot = [], 0
    for ids, mask in chunks:
        n = np.asarray(mask).sum(axis=1)
        keep = 0
        while keep < len(n) and (keep == 0 or tot + n[keep] <= tokens):
            tot += int(n[keep])
            keep += 1
        L = int(np.flatnonzero(np.asarray(mask[:keep]).any(axis=0)).max()) + 1
        out.append((np.ascontiguousarray(ids[:keep, :L]),
                    np.ascontiguousarray(mask[:keep, :L])))   # padding columns cut
        if tot >= tokens or keep < len(n):
            break
    return out


def _encoder_chunks(model, texts, max_tokens, batch=32):
    from opscope_nb.models import bert
    keep, tot = [], 0
    for t in texts:
        n = min(len(model.tokenizer.encode(t).ids), model.config["max_seq_len"])
        if max_tokens is not None and keep and tot + n > max_tokens:
            break
        keep.append(t)
        tot += n
    if not keep:
        raise ValueError("the text has no sentence to embed; give a longer text.")
    return [bert.tokenize_batch(model, keep[s:s + batch]) for s in range(0, len(keep), batch)]


def text_chunks(model, *, text=None, held_out_text=None, split=0.25, split_seed=0,
                tokens=2048, held_out_tokens=2048, window=256) -> tuple:
    """``(search chunks, held-out chunks)`` of ``model`` from text, as
    :meth:`PlanScorer.from_text` describes (the llama.cpp scorer takes the
    same windows)."""
    from opscope_nb.data import TEXT_KEYWORDS
    from opscope_nb.models.evaluate import _sentences, load_passages
    for nm, v in (("tokens", tokens), ("held_out_tokens", held_out_tokens),
                  ("window", window)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 2:
            raise ValueError(f"{nm} must be an integer >= 2; got {v!r}.")

    def items(t):
        ps = load_passages(t)
        if model.family == "encoder" and (t is None or t in TEXT_KEYWORDS):
            return _sentences(ps)
        return ps
    if held_out_text is None:
        fit, held = split_passages(items(text), split, split_seed)
    else:
        fit, held = items(text), items(held_out_text)
    if model.family == "encoder":
        return (_encoder_chunks(model, fit, tokens),
                _encoder_chunks(model, held, held_out_tokens))
    return (_decoder_chunks(model, fit, tokens, window),
            _decoder_chunks(model, held, held_out_tokens, window))


# --------------------------------------------------------------------------- #
# plans
# --------------------------------------------------------------------------- #
def check_choice(layers, choice) -> tuple:
    """``choice`` as a tuple of ints, one option index per layer of ``layers``;
    ``ValueError`` naming the entry otherwise."""
    c = tuple(int(x) for x in choice)
    if len(c) != len(layers):
        raise ValueError(f"choice has {len(c)} entries; the plan has {len(layers)} layers.")
    for i, (lp, j) in enumerate(zip(layers, c)):
        if not 0 <= j < len(lp.options):
            raise ValueError(f"choice[{i}] = {j} is not an option index of layer "
                             f"{lp.name!r} (0..{len(lp.options) - 1}).")
    return c


def plan_bytes(layers, choice) -> int:
    """Bytes of ``choice`` (one option index per layer)."""
    return int(sum(int(lp.options[int(c)].bytes) for lp, c in zip(layers, choice)))


def choice_key(choice) -> str:
    """A short stable key of a plan (sha1 of its option indices)."""
    return hashlib.sha1(",".join(str(int(c)) for c in choice).encode()).hexdigest()[:16]


def _terms(layers, objective):
    """Per layer, per option: the predicted objective term (``act_quant``
    resolved over all the layers, as the allocators do)."""
    aq = act_quant_mode("auto", layers)
    return [[predicted_damage([lp], [j], objective, aq) for j in range(len(lp.options))]
            for lp in layers]


def ladders(layers, objective, keep=()) -> list:
    """Per layer, the option indices a move walks, fewest bytes first: the
    options no option of fewer (or equal) bytes beats in the predicted term,
    plus every index of each plan in ``keep`` (so a seed's options can move)."""
    terms = _terms(layers, objective)
    out = []
    for i, lp in enumerate(layers):
        order = sorted(range(len(lp.options)), key=lambda j: (int(lp.options[j].bytes),
                                                              terms[i][j], j))
        lad, best = [], math.inf
        for j in order:
            if terms[i][j] < best:
                lad.append(j)
                best = terms[i][j]
        extra = {int(p[i]) for p in keep} - set(lad)
        lad = sorted(set(lad) | extra, key=lambda j: (int(lp.options[j].bytes), terms[i][j], j))
        out.append(lad)
    return out


def _step(lad, cur, d):
    """The option ``d`` (+1 / -1) steps from ``cur`` along ``lad``, or None."""
    try:
        k = lad.index(cur)
    except ValueError:
        # not on the ladder: the nearest rung in bytes order
        k = None
    if k is None:
        return None
    k += d
    return lad[k] if 0 <= k < len(lad) else None


def propose(layers, choice, budget, lads, terms, stage_of, rng, *, mutations=1,
            p_swap=0.3, p_fill=0.5, sample=4):
    """A plan near ``choice`` with bytes ``<= budget``, or None when no move fits.

    ``mutations`` moves up (each one layer one rung up its ladder, or a swap
    inside a block with ``p_swap``), then layers move down (the least
    predicted cost per byte freed among ``sample`` random ones, never a
    layer just moved up) until the bytes fit; with ``p_fill`` one more layer
    moves up when the slack allows.
    """
    c = [int(x) for x in choice]
    n = len(layers)
    nb = plan_bytes(layers, c)
    ob = [[int(o.bytes) for o in lp.options] for lp in layers]
    raised = set()
    for _ in range(int(mutations)):
        ups = [i for i in range(n) if _step(lads[i], c[i], +1) is not None]
        if not ups:
            return None
        if rng.random() < p_swap:
            i = int(rng.choice(ups))
            mates = [j for j in range(n) if j != i and stage_of[j] == stage_of[i]
                     and _step(lads[j], c[j], -1) is not None]
            if mates:
                j = int(rng.choice(mates))
                u, d = _step(lads[i], c[i], +1), _step(lads[j], c[j], -1)
                nb += ob[i][u] - ob[i][c[i]] + ob[j][d] - ob[j][c[j]]
                c[i], c[j] = u, d
                raised.add(i)
                continue
        i = int(rng.choice(ups))
        u = _step(lads[i], c[i], +1)
        nb += ob[i][u] - ob[i][c[i]]
        c[i] = u
        raised.add(i)
    while nb > budget:
        downs = [j for j in range(n) if j not in raised
                 and _step(lads[j], c[j], -1) is not None]
        if not downs:
            return None
        pick = rng.choice(downs, size=min(int(sample), len(downs)), replace=False)

        def cost(j):
            d = _step(lads[j], c[j], -1)
            freed = ob[j][c[j]] - ob[j][d]
            return (terms[j][d] - terms[j][c[j]]) / max(freed, 1)
        j = int(min(pick, key=cost))
        d = _step(lads[j], c[j], -1)
        nb += ob[j][d] - ob[j][c[j]]
        c[j] = d
    if rng.random() < p_fill:
        fits = [i for i in range(n) if _step(lads[i], c[i], +1) is not None
                and nb + ob[i][_step(lads[i], c[i], +1)] - ob[i][c[i]] <= budget]
        if fits:
            pick = rng.choice(fits, size=min(int(sample), len(fits)), replace=False)

            def gain(i):
                u = _step(lads[i], c[i], +1)
                return (terms[i][c[i]] - terms[i][u]) / max(ob[i][u] - ob[i][c[i]], 1)
            i = int(max(pick, key=gain))
            u = _step(lads[i], c[i], +1)
            nb += ob[i][u] - ob[i][c[i]]
            c[i] = u
    if c == [int(x) for x in choice]:
        return None
    return c


# --------------------------------------------------------------------------- #
# the scorer
# --------------------------------------------------------------------------- #
def _pack_option(lp, j, orig, entry, grams, requantize):
    """Layer ``lp``'s option ``j`` packed from ``orig`` (the loaded tensor): the
    tensor itself for dense, the source's stored blocks for an option in the
    ggml type ``entry`` (the source entry) is stored in (unless
    ``requantize``), else :meth:`PackedLinear.pack` with the layer's gram when
    the option reads one -- the bytes ``apply`` writes."""
    from opscope_nb.runtime._packed import PackedLinear
    d = lp.options[int(j)].decomp
    if d.kind == "dense":
        return orig
    if (entry is not None and d.kind == "ggml" and d.rounding is None
            and str(entry.dtype).upper() == d.qtype
            and not requantize):
        raw = np.ascontiguousarray(entry.raw()).view(np.uint8).reshape(entry.shape[0], -1)
        return PackedLinear(d, {"blocks": np.array(raw)}, tuple(entry.shape))
    w = orig if isinstance(orig, np.ndarray) else orig.dense()
    g = grams.get(lp.name) if d.reads_gram else None
    return PackedLinear.pack(np.asarray(w, dtype=np.float32), d, gram=g)


class _Split:
    """The chunks of one text split, the dense reference outputs, and the
    parent plan's cached block inputs."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.ref = None          # decoder: [(logp f32, p f32)] per chunk; encoder: [n, d]
        self.cache = None        # per stage 0..n_blocks: per chunk, the stage's input
        self.cache_key = None    # the plan (tuple of option indices) the cache belongs to
        self.cache_score = None
        self.cache_rows = None   # the cached plan's per-unit losses (:attr:`PlanScorer.last_rows`)
        self.tokens = 0
        self.ppl_dense = None


class PlanScorer:
    """The measured score of plans of ``layers`` on a model held in memory.

    Parameters
    ----------
    model : opscope_nb.models.Model
        The dense model (:func:`opscope_nb.models.open_model`, not lazy).
        Its linear layers are swapped in place while a plan runs and put
        back afterwards.
    layers : sequence of LayerProfile
        The planned layers: linear layers of ``model``, a decoder's token
        embedding or an encoder's embedding tables (``*_embeddings.weight``:
        every block re-runs when one changes); a layer the forward never reads
        (a BERT pooler under mean pooling) is *inert* -- its option changes the
        bytes, never the score.
    search, held_out : list
        Chunks: decoders, 1-D int64 token windows; encoders, ``(ids, mask)``
        batches (:func:`opscope_nb.models.bert.tokenize_batch`).  Build them
        with :meth:`from_text`.
    grams : mapping of str -> ndarray, optional
        Calibration grams; a planned option that reads one (``+gptq``, ggml
        importance) is packed with the layer's gram, as ``apply`` does.
    stored : mapping of str -> source entry, optional
        The source's entries: an option in the ggml type a tensor is stored in
        runs from the stored blocks (``apply`` copies them), unless
        ``requantize``.
    requantize : bool
    act : {"f32", "auto", "int8"}
        Activation mode of every linear call (default ``"f32"``: the score is
        the plan's weight error alone, as ``eval`` measures it).
    act_quant : {"none", "ggml"}
        ``"ggml"``: every linear layer reads its input as llama.cpp's CPU
        matmul does for the layer's ggml type
        (:func:`opscope_nb.formats.ggml.runtime_activations`: Q8_0 / Q8_K
        blocks for quantised types, F16 / BF16 rounding for a tensor kept in
        those), the dense reference included (its stored types), so the
        score is the error the plan adds in llama.cpp, not its weights' alone.
        A layer at a non-ggml option or stored as F32 reads float32.  Default
        ``"none"``.
    dequantise : bool
        Hold each packed option as its float32 reconstruction (default): the
        forward runs dense matmuls instead of the packed kernels (no kernel to
        compile per format, BLAS speed), at the packed kernels' values up to
        float32 rounding; ``False`` runs the ``PackedLinear`` itself.
    screen_tokens : int, optional
        Also keep a *screen* split (``score(..., "screen")``): the first
        ``screen_tokens`` tokens of the search windows, in as few windows as
        hold them (decoders), or the first search sentences up to
        ``screen_tokens`` tokens (encoders).  :func:`refine` scores every candidate there first
        and only the best on the whole search split (multi-stage selection).
    table_tokens : int, optional
        Also keep a *table* split, cut from the search chunks as the screen
        is: :func:`refine` measures its singleton table there
        (:func:`singleton_table`) instead of on the whole search split.
    blocks : dict, optional
        A dict in which :meth:`option` also keeps every ggml option's packed
        blocks under ``(layer index, option index)`` (the llama.cpp scorer
        assembles its candidate files from them: each option packed once for
        both runtimes).

    Attributes
    ----------
    metric : str
        ``"kl"`` (decoders) or ``"1-cos"`` (encoders).
    seconds : dict of str -> float
        ``pack``, ``forward`` (blocks), ``head`` (output norm and head matmul,
        or pooling), ``kl`` (log-sum-exp and KL, or cosine), ``reference``
        (the dense outputs).
    block_runs : int
        Block forwards run (one per block per split pass; the head counts as one).
    token_runs : int
        Tokens run through a stage, summed over stage runs (:attr:`forwards`).
    last_rows : ndarray of float64 or None
        The per-unit losses of the last :meth:`score` call, whose mean is the
        score: ``[tokens]`` KL per next-token position (decoders, chunk after
        chunk, clipped at 0) or ``[sentences]`` ``1 - cos`` (encoders).
        :func:`refine`'s paired test reads them.
    """

    def __init__(self, model, layers, search, held_out, *, grams=None, stored=None,
                 requantize=False, act="f32", act_quant="none", dequantise=True,
                 screen_tokens=None, table_tokens=None, blocks=None):
        from opscope_nb.models.loader import is_linear
        if getattr(model, "entries", None) and not model.tensors:
            raise ValueError("PlanScorer needs a loaded model (open_model(..., lazy=False)).")
        if act not in ("f32", "auto", "int8"):
            raise ValueError(f"act must be 'f32', 'auto' or 'int8'; got {act!r}.")
        if act_quant not in ("none", "ggml"):
            raise ValueError(f"act_quant must be 'none' or 'ggml'; got {act_quant!r}.")
        if not search or not held_out:
            raise ValueError("PlanScorer needs chunks in both the search and the held-out "
                             "split; give a longer text.")
        self.model, self.layers, self.act = model, list(layers), act
        self.family = model.family
        self.metric = "kl" if self.family == "decoder" else "1-cos"
        self.grams = grams or {}
        self.stored = stored or {}
        self.requantize = bool(requantize)
        self.dequantise = bool(dequantise)
        #: where :meth:`option` also keeps each ggml option's packed blocks
        #: (``(layer, option) -> uint8 [rows, row bytes]``), or None
        self.blocks = blocks
        cfg = model.config
        self.n_blocks = int(cfg["n_layers"])
        nm = cfg.get("names", {})
        self._embed = nm.get("embed") if self.family == "decoder" else None
        self._tied = bool(cfg.get("tied")) if self.family == "decoder" else False
        head = (self._embed if self._tied else nm.get("head")) if self.family == "decoder" \
            else None
        stage = {}
        for b in range(self.n_blocks):
            for n in model.block_tensors(b)[0]:
                stage[n] = b
        if head is not None:
            stage[head] = self.n_blocks
        if self._embed is not None:
            stage[self._embed] = 0      # a planned embedding table: everything re-runs
        #: planned embedding tables (held as float32 tables, not PackedLinear)
        self._tables = {self._embed} if self._embed is not None else set()
        if self.family == "encoder":
            # an encoder's word / position / token-type tables are read at the
            # input: a planned one re-runs every block (it is not inert)
            for lp in self.layers:
                t = model.tensors.get(lp.name)
                if lp.name.endswith("_embeddings.weight") and isinstance(t, np.ndarray) \
                        and t.ndim == 2:
                    stage[lp.name] = 0
                    self._tables.add(lp.name)
        self.stage_of = []
        #: planned layers the forward never reads (a BERT pooler under mean
        #: pooling): their option changes the bytes, never the score
        self.inert = set()
        for i, lp in enumerate(self.layers):
            if lp.name not in stage:
                self.inert.add(i)
                self.stage_of.append(self.n_blocks + 1)
                continue
            t = model.tensors.get(lp.name)
            if t is None or (lp.name not in self._tables and not is_linear(t)):
                raise ValueError(f"layer {lp.name!r} is not held by the model.")
            if tuple(np.shape(t)) != (int(lp.rows), int(lp.cols)):
                raise ValueError(f"layer {lp.name!r} has shape {tuple(np.shape(t))} in the "
                                 f"model but {lp.rows}x{lp.cols} in the profile.")
            self.stage_of.append(stage[lp.name])
        if len(self.inert) == len(self.layers):
            raise ValueError(f"none of the planned layers (e.g. {self.layers[0].name!r}) is "
                             f"read by the {model.arch} forward; the profile was made for "
                             f"another model.")
        self._orig = {lp.name: model.tensors[lp.name] for i, lp in enumerate(self.layers)
                      if i not in self.inert}
        self._orig_head = model.extras.get("head")
        #: ggml type each linear layer (and a tied head's table) runs at when
        #: nothing planned changes it (``act_quant="ggml"``), else empty
        self._src_types = {}
        if act_quant == "ggml":
            from opscope_nb.models.ggml_acts import run_type, stored_types
            src = ({n: run_type(e.dtype) for n, e in self.stored.items()} if self.stored
                   else stored_types(getattr(model, "source_path", "")))
            for n, t in model.tensors.items():
                if is_linear(t) or n == self._embed:
                    self._src_types[n] = src.get(n, "F32")
            self._orig.update({n: model.tensors[n] for n in self._src_types})
        self.act_quant = act_quant
        self._opts = {}
        self.seconds = {"pack": 0.0, "forward": 0.0, "head": 0.0, "kl": 0.0,
                        "reference": 0.0}
        self.block_runs = 0
        self.token_runs = 0
        self.last_rows = None
        self.splits = {"search": _Split(search), "held_out": _Split(held_out)}
        for nm, v in (("screen", screen_tokens), ("table", table_tokens)):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 2:
                raise ValueError(f"{nm}_tokens must be an integer >= 2 or None; got {v!r}.")
            self.splits[nm] = _Split(_screen_chunks(search, int(v), self.family))
        for s in self.splits.values():
            self._reference(s)

    # ---- construction from text ------------------------------------------ #
    @classmethod
    def from_text(cls, model, layers, *, text=None, held_out_text=None, split=0.25,
                  split_seed=0, tokens=2048, held_out_tokens=2048, window=256, **kw):
        """A scorer whose search and held-out chunks come from text.

        ``text`` (a path, ``"sample"``, ``"builtin"`` or None = the sample,
        :func:`opscope_nb.models.evaluate.load_passages`) is split with
        :func:`split_passages` (``split``, ``split_seed``) unless
        ``held_out_text`` is given (then all of ``text`` is searched on and
        ``held_out_text`` held out).  Encoders take the sentences of the
        built-in texts; decoders the passages joined by newlines, cut at
        ``tokens`` / ``held_out_tokens`` and windowed by ``window``.
        """
        ch = text_chunks(model, text=text, held_out_text=held_out_text, split=split,
                         split_seed=split_seed, tokens=tokens,
                         held_out_tokens=held_out_tokens, window=window)
        return cls(model, layers, ch[0], ch[1], **kw)

    # ---- options ---------------------------------------------------------- #
    def option(self, i, j):
        """The tensor layer ``i`` holds under its option ``j`` (packed once, cached):
        a ``PackedLinear``, or for a tied embedding the float32 table."""
        key = (i, int(j))
        got = self._opts.get(key)
        if got is not None:
            return got
        t0 = time.perf_counter()
        lp = self.layers[i]
        d = lp.options[int(j)].decomp
        got = _pack_option(lp, int(j), self._orig[lp.name], self.stored.get(lp.name),
                           self.grams, self.requantize)
        if self.blocks is not None and d.kind == "ggml":
            self.blocks[key] = got.arrays["blocks"]
        if lp.name in self._tables and not isinstance(got, np.ndarray):
            got = got.dense()           # the loader holds an embedding table as floats
        elif self.dequantise and d.kind != "dense":
            from opscope_nb.models.loader import dense_linear
            got = dense_linear(got.dense())
        self._opts[key] = got
        self.seconds["pack"] += time.perf_counter() - t0
        return got

    def _install(self, choice):
        """Swap ``choice``'s options in (``None``: the source's tensors, only
        wrapped for ``act_quant="ggml"``)."""
        m = self.model
        types = dict(self._src_types)
        if choice is not None:
            for i, (lp, c) in enumerate(zip(self.layers, choice)):
                if i not in self.inert:
                    m.tensors[lp.name] = self.option(i, c)
                    if types:
                        d = lp.options[int(c)].decomp
                        types[lp.name] = (d.qtype if d.kind == "ggml" else
                                          types.get(lp.name) if d.kind == "dense" else None)
        if self._tied:
            m.extras.pop("head", None)      # rebuilt from the (planned) table
        if types:
            from opscope_nb.models.ggml_acts import wrap_linears
            wrap_linears(m, types)          # self._orig holds what _restore puts back

    def _restore(self):
        m = self.model
        m.tensors.update(self._orig)
        if self._tied:
            if self._orig_head is not None:
                m.extras["head"] = self._orig_head
            else:
                m.extras.pop("head", None)

    # ---- forwards --------------------------------------------------------- #
    def _embed_chunk(self, c):
        from opscope_nb.models import bert, llama
        if self.family == "encoder":
            ids, _mask = c
            return bert.embed_tokens(self.model, ids)
        return llama.embed_tokens(self.model, c)

    def _block(self, b, c, x):
        from opscope_nb.models import bert, llama
        m = self.model
        if self.family == "encoder":
            return bert.block(m, b, x, bert.attention_bias(c[1]), act=self.act)
        cfg = m.config
        T = x.shape[0]
        kc = np.zeros((cfg["n_kv"], T, cfg["head_dim"]), dtype=np.float32)
        return llama.block(m, b, x, kc, np.zeros_like(kc), 0, llama.rope_context(cfg, 0, T),
                           act=self.act)

    def _outputs(self, split, start, xs, keep):
        """Blocks ``start ..`` on the stage inputs ``xs`` (per chunk); returns
        ``(final hidden per chunk, stage inputs per stage or None)``."""
        new = None
        if keep:
            new = list(split.cache) if split.cache is not None else [None] * (self.n_blocks + 1)
        t0 = time.perf_counter()
        for b in range(start, self.n_blocks):
            if keep:
                new[b] = xs
            xs = [self._block(b, c, x) for c, x in zip(split.chunks, xs)]
            self.block_runs += 1
            self.token_runs += split.tokens
        if keep:
            new[self.n_blocks] = xs
        self.seconds["forward"] += time.perf_counter() - t0
        return xs, new

    def _final(self, split, xs, ids_for_nll=False):
        """The score of final hidden states ``xs`` against the dense reference
        (and the negative log-likelihoods of decoders' next tokens).

        Decoders: ``KL(dense || plan)`` per position is ``sum p (lp_ref - lq)``
        with ``lq = z - logsumexp(z)`` in float64; it is computed as ``c - p.z
        + s * logsumexp(z)`` with the reference's ``c = sum p lp_ref`` and ``s =
        sum p`` (per row, float64, made once), so a candidate takes one pass
        over its logits (a compiled kernel) instead of a float64 log-softmax."""
        from opscope_nb.models import bert, llama
        from opscope_nb.models.evaluate import cosine
        t0 = time.perf_counter()
        m = self.model
        self.block_runs += 1
        self.token_runs += split.tokens
        nll, rows = [], None
        if self.family == "encoder":
            embs = []
            for (ids, mask), x in zip(split.chunks, xs):
                B, L = mask.shape
                embs.append(bert.pool(m, x.reshape(B, L, m.config["hidden"]), mask))
            e = np.concatenate(embs)
            t1 = time.perf_counter()
            if split.ref is None:
                out = (e, None)
            else:
                rows = 1.0 - np.asarray(cosine(split.ref, e), np.float64)
                out = (float(np.mean(rows)), None)
        else:
            kls, refs = [], []
            t1 = t0
            for k, (c, x) in enumerate(zip(split.chunks, xs)):
                th = time.perf_counter()
                z = llama.logits(m, x, act=self.act)
                t1 += time.perf_counter() - th
                if split.ref is None:
                    ref, nl = _reference_rows(z, c, ids_for_nll)
                    refs.append(ref)
                    if nl is not None:
                        nll.append(nl)
                    continue
                kl, nl = _kl_rows(z, split.ref[k], c, ids_for_nll)
                kls.append(kl)
                if nl is not None:
                    nll.append(nl)
                del z
            if split.ref is None:
                out = (refs, None)
            else:
                rows = np.maximum(np.concatenate(kls), 0.0)
                out = (float(rows.mean()), None)
        if ids_for_nll and nll:
            out = (out[0], float(np.exp(np.concatenate(nll).mean())))
        t2 = time.perf_counter()
        self.seconds["head"] += t1 - t0
        self.seconds["kl"] += t2 - t1
        self.last_rows = rows
        return out

    def _reference(self, split):
        t0 = time.perf_counter()
        sec = dict(self.seconds)
        runs, toks = self.block_runs, self.token_runs
        split.tokens = int(sum(len(c) for c in split.chunks)) if self.family == "decoder" \
            else int(sum(float(c[1].sum()) for c in split.chunks))
        with _one_blas_thread():
            if self._src_types:
                self._install(None)
            try:
                xs = [self._embed_chunk(c) for c in split.chunks]
                xs, _ = self._outputs(split, 0, xs, False)
                ref, ppl = self._final(split, xs, ids_for_nll=True)
            finally:
                self._restore()
        split.ref, split.ppl_dense = ref, ppl
        self.seconds = sec
        self.block_runs, self.token_runs = runs, toks
        self.seconds["reference"] += time.perf_counter() - t0

    def units(self, split) -> int:
        """Entries of :attr:`last_rows` a score on ``split`` gives: its tokens
        (decoders) or sentences (encoders).  The screen and table splits are
        prefixes of the search split: their units are its first ones."""
        ch = self.splits[split].chunks
        if self.family == "decoder":
            return int(sum(len(c) for c in ch))
        return int(sum(np.asarray(c[1]).shape[0] for c in ch))

    @property
    def forwards(self) -> float:
        """Work done so far in full forwards of the search split: the tokens
        run through each stage (blocks and head), over the search split's
        ``tokens x (n_blocks + 1)``."""
        return self.token_runs / max(self.splits["search"].tokens * (self.n_blocks + 1), 1)

    def score(self, choice, split="search", *, adopt=None, ppl=False):
        """The measured score of ``choice`` on ``split`` (``"search"`` or
        ``"held_out"``).

        Runs from the first stage whose tensors differ from the plan the
        split's cache holds (everything when there is none), from that
        stage's cached input.  ``adopt``: keep this plan's stage inputs as
        the split's cache (default: when the split has no cache yet).
        ``ppl=True`` returns ``(score, perplexity)`` (decoders; encoders give
        ``None``) and always runs the whole model.

        Returns
        -------
        float or tuple
            Mean ``KL(dense || plan)`` per next-token position (decoders) or
            mean ``1 - cos`` of the pooled embeddings (encoders).
        """
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)}; got {split!r}.")
        c = check_choice(self.layers, choice)
        s = self.splits[split]
        if adopt is None:
            adopt = s.cache is None
        start = 0
        if s.cache is not None and not ppl:
            diff = [self.stage_of[i] for i, (a, b) in enumerate(zip(c, s.cache_key)) if a != b]
            start = min(diff) if diff else None
        if start is None or start > self.n_blocks:      # nothing the forward reads changed
            if adopt:
                s.cache_key = c
            self.last_rows = s.cache_rows
            return s.cache_score
        with _one_blas_thread():
            self._install(c)
            try:
                if start == 0 or s.cache is None:
                    xs = [self._embed_chunk(ch) for ch in s.chunks]
                    start = 0
                else:
                    xs = s.cache[start]
                xs, new = self._outputs(s, start, xs, adopt)
                val, p = self._final(s, xs, ids_for_nll=ppl)
            finally:
                self._restore()
        if adopt:
            s.cache, s.cache_key, s.cache_score = new, c, val
            s.cache_rows = self.last_rows
        return (val, p) if ppl else val

    def adopt(self, choice, split="search"):
        """Make ``choice`` the plan the split's cache holds (scores it)."""
        return self.score(choice, split, adopt=True)

    def full_score(self, choice, split="search") -> float:
        """``choice`` run from the embeddings with every tensor swapped in (no
        cache read or written): what :meth:`score` must equal."""
        s = self.splits[split]
        with _one_blas_thread():
            self._install(tuple(int(x) for x in choice))
            try:
                xs = [self._embed_chunk(ch) for ch in s.chunks]
                xs, _ = self._outputs(s, 0, xs, False)
                return self._final(s, xs)[0]
            finally:
                self._restore()


def _reference_rows(z, ids, want_nll):
    """``((p, c, s), nll or None)`` of the dense logits ``z`` [T, V] of the
    window ``ids``: the float32 probabilities, per row ``c = sum p lp`` and
    ``s = sum p`` (float64), and the next-token negative log-likelihoods."""
    p = np.empty(z.shape, dtype=np.float32)
    cc = np.empty(z.shape[0], dtype=np.float64)
    ss = np.empty(z.shape[0], dtype=np.float64)
    nll = []
    for r in range(0, z.shape[0], _ROWS):
        lp = _log_softmax64(z[r:r + _ROWS]).astype(np.float32)
        pr = np.exp(lp)
        p[r:r + _ROWS] = pr
        cc[r:r + _ROWS] = (pr.astype(np.float64) * lp).sum(axis=1)
        ss[r:r + _ROWS] = pr.sum(axis=1, dtype=np.float64)
        if want_nll:
            rows = np.arange(r, min(r + _ROWS, len(ids) - 1))
            nll.append(-lp[rows - r, ids[rows + 1]].astype(np.float64))
    return (p, cc, ss), (np.concatenate(nll) if want_nll and nll else None)


def _kl_rows(z, ref, ids, want_nll):
    """``(KL per row, nll or None)`` of a candidate's logits ``z`` against the
    reference rows ``ref`` (:func:`_reference_rows`): one compiled pass."""
    p, cc, ss = ref
    kl = np.empty(z.shape[0], dtype=np.float64)
    lse = np.empty(z.shape[0], dtype=np.float64)
    _kl_kernel()(z, p, cc, ss, kl, lse)
    nll = None
    if want_nll:
        rows = np.arange(len(ids) - 1)
        nll = lse[rows] - z[rows, ids[rows + 1]].astype(np.float64)
    return kl, nll


def paired_z(new, old, batch=1) -> float:
    """How many standard errors ``new``'s mean lies below ``old``'s, paired.

    Parameters
    ----------
    new, old : ndarray of float, shape (n,)
        Per-unit losses of two plans on the same units (:attr:`PlanScorer.last_rows`).
    batch : int
        Consecutive units per batch (>= 1): the standard error of the mean
        difference is that of the means of ``ceil(n / batch)`` batches (the
        last may be short), which holds when neighbouring units correlate.

    Returns
    -------
    float
        ``mean(old - new) / se``: positive when ``new`` is lower; ``+inf`` /
        ``-inf`` when the difference is the same nonzero value everywhere or
        there are fewer than 2 batches, ``0.0`` when it is zero.
    """
    new = np.asarray(new, np.float64)
    old = np.asarray(old, np.float64)
    if new.shape != old.shape or new.ndim != 1:
        raise ValueError(f"new and old must be 1-D of one length; got shapes {new.shape} "
                         f"and {old.shape}.")
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1; got {batch!r}.")
    d = old - new
    n = len(d)
    if n == 0:
        return 0.0
    starts = np.arange(0, n, int(batch))
    means = np.add.reduceat(d, starts) / np.diff(np.append(starts, n))
    mu = float(d.mean())
    se = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else 0.0
    if se > 0.0:
        return mu / se
    return 0.0 if mu == 0.0 else math.copysign(math.inf, mu)


def _log_softmax64(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# --------------------------------------------------------------------------- #
# the search
# --------------------------------------------------------------------------- #
@dataclass
class RefineResult:
    """What :func:`refine` found.

    Attributes
    ----------
    choice : list of int
        The plan returned: the refined one when ``kept``, else the start.
    start, best : list of int
        The start plan and the best plan of the search (by the search score).
    kept : bool
        The best plan measured lower than the start on the held-out split.
    scores : dict
        ``start`` / ``best`` -> ``{"search", "held_out", "predicted", "bytes",
        "ppl"}`` (``ppl``: held-out perplexity, decoders; ``ppl_dense`` too);
        ``held_out_z``: :func:`paired_z` of the best plan against the start on
        the held-out split (``0.0`` when they are the same plan); ``accept_z``.
    evals : int
        Candidates scored in all runs (the resumed ones included).
    accepted : int
        Moves kept.
    history : list of tuple
        ``(evals, best search score, forwards spent)`` at each improvement
        (forwards: full forwards of the search split, resumed runs included).
    seconds : dict of str -> float
        This run's search time per part: ``pack``, ``forward``, ``head``, ``kl``,
        ``reference``, ``propose``, in all ``search``; then ``held_out``
        (the never-worse check) and ``total``.
    block_runs : int
        Stage runs of this run's search (a full forward is ``n_blocks + 1``).
    forwards : float
        This run's search work in full forwards of the search split
        (:attr:`PlanScorer.forwards`): screen runs and partial forwards count
        by their tokens and stages.
    stopped : str
        ``"evals"``, ``"minutes"``, ``"no move"`` or ``"done"``.
    runtime : str
        Whose forward gave the search and held-out scores: ``"numba"`` (this
        package's) or ``"llama.cpp"`` (:class:`opscope_nb.plan.refine_llamacpp.LlamaCppScorer`;
        its screen split may still run on this package's forward).
    """

    choice: list
    start: list
    best: list
    kept: bool
    scores: dict
    evals: int
    accepted: int
    history: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    block_runs: int = 0
    stopped: str = "evals"
    metric: str = "kl"
    run_evals: int = 0
    forwards: float = 0.0
    runtime: str = "numba"

    def forwards_per_second(self, n_blocks=None) -> float:
        """Full-forward equivalents (of the search split) per second of this
        run's search: :attr:`forwards` over the search seconds."""
        t = self.seconds.get("search", 0.0)
        return self.forwards / t if t > 0 else math.nan

    def to_dict(self) -> dict:
        return {"choice": [int(c) for c in self.choice], "start": [int(c) for c in self.start],
                "best": [int(c) for c in self.best], "kept": bool(self.kept),
                "scores": self.scores, "evals": int(self.evals),
                "run_evals": int(self.run_evals), "accepted": int(self.accepted),
                "history": [[int(h[0]), float(h[1])] + [float(x) for x in h[2:]]
                            for h in self.history],
                "seconds": {k: float(v) for k, v in self.seconds.items()},
                "block_runs": int(self.block_runs), "forwards": float(self.forwards),
                "stopped": self.stopped,
                "metric": self.metric, "runtime": self.runtime}


def save_state(path, state: dict) -> None:
    """Write the search state (JSON) to ``path`` atomically."""
    from opscope_nb.io._fs import atomic_write
    atomic_write(path, json.dumps(state, indent=None, sort_keys=True))


def load_state(path, key: str):
    """The state saved at ``path`` when its ``key`` is ``key`` (the same
    profile, budget and settings), else None."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            st = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(st, dict) or st.get("version") != STATE_VERSION or st.get("key") != key:
        return None
    return st


def base_choice(layers, terms) -> list:
    """Per layer, the option of least predicted term (fewest bytes among ties):
    the plan :func:`singleton_table` measures every option against (the dense
    option where the profile has one)."""
    return [min(range(len(lp.options)),
                key=lambda j, i=i, lp=lp: (terms[i][j], int(lp.options[j].bytes), j))
            for i, lp in enumerate(layers)]


def singleton_table(scorer, plan, base, lads, table, *, width=1, split="search",
                    order=None, stop=None, progress=None) -> tuple:
    """Measure the damage of each layer alone: ``table[(i, j)] = score(base
    with layer i at option j) - score(base)`` on ``split``, for the options
    within ``width`` steps of ``plan[i]`` on layer ``i``'s ladder ``lads[i]``
    (and ``plan[i]`` itself); entries already in ``table`` are kept.

    A layer's run starts at its own block from the base plan's cached input,
    so a layer of block ``b`` costs ``n_blocks - b`` block forwards.  When
    anything was measured, the scorer's cache of ``split`` holds the base
    plan afterwards.

    Parameters
    ----------
    scorer : PlanScorer
    plan, base : sequence of int
        Option index per layer: the plan whose neighbourhood is measured, and
        the plan each option is measured against (:func:`base_choice`).
    lads : list of list of int
        Per layer, option indices fewest bytes first (:func:`ladders`).
    table : dict
        ``(layer, option) -> float``, filled in place.
    width : int
        Ladder steps measured either side of ``plan[i]`` (>= 0).
    order : sequence of int, optional
        Layers in the order to measure (default: index order); what is left
        when ``stop`` fires stays unmeasured.
    stop : callable, optional
        ``stop()`` true ends the measurement early.
    progress : callable, optional
        ``progress(done, to_do)`` after each entry.

    Returns
    -------
    (int, bool)
        Entries measured by this call; ``True`` when every asked entry is in
        ``table``.
    """
    base = [int(c) for c in base]
    todo = []
    for i in (range(len(base)) if order is None else order):
        if i in scorer.inert:
            continue
        lad = sorted(set(lads[i]) | {int(plan[i])},
                     key=lambda j, i=i: (int(scorer.layers[i].options[j].bytes), j))
        k = lad.index(int(plan[i]))
        todo += [(i, j) for j in lad[max(0, k - width):k + width + 1]
                 if j != base[i] and (i, j) not in table]
    if not todo:
        return 0, True
    b_score = scorer.adopt(base, split)
    for n, (i, j) in enumerate(todo):
        if stop is not None and stop():
            return n, False
        c = list(base)
        c[i] = j
        table[(i, j)] = float(scorer.score(c, split, adopt=False)) - b_score
        if progress is not None:
            progress(n + 1, len(todo))
    return len(todo), True


def table_layers(layers, terms, table, base, inert=()) -> list:
    """``layers`` whose objective term per option is the measured one: each
    option's ``out_err`` set to ``sqrt(term)`` and ``sensitivity`` to 1, for
    the ``"sensitivity"`` objective of the allocators.

    ``term`` is ``max(table[(i, j)], 0)`` where measured, 0 for the base
    option, else the predicted term ``terms[i][j]`` times the layer's
    measured-to-predicted ratio (the geometric mean over its measured
    options; the mean over all layers for a layer without one), clipped to
    [0.1, 10].  Inert layers keep the predicted terms times the mean ratio.
    """
    logs = {}
    for (i, j), m in table.items():
        if m > 0 and terms[i][j] > 0:
            logs.setdefault(i, []).append(math.log(m / terms[i][j]))
    allv = [v for vs in logs.values() for v in vs]
    glob = math.exp(float(np.mean(allv))) if allv else 1.0
    out = []
    for i, lp in enumerate(layers):
        f = glob if i in inert or i not in logs else math.exp(float(np.mean(logs[i])))
        f = min(max(f, 0.1), 10.0)
        opts = []
        for j, o in enumerate(lp.options):
            if i in inert:
                v = terms[i][j] * f
            elif j == base[i]:
                v = 0.0
            elif (i, j) in table:
                v = max(table[(i, j)], 0.0)
            else:
                v = terms[i][j] * f
            opts.append(dataclasses.replace(o, out_err=math.sqrt(v)))
        # the measured terms hold the activations' and the lookup's error already
        out.append(dataclasses.replace(lp, options=opts, sensitivity=1.0, act_err=None,
                                       lookup=None))
    return out


#: share of ``refine``'s time limit the measured table may use
TABLE_SHARE = 0.7


def solve_table(layers, budget, *, time_limit=60.0):
    """The exact plan (:func:`opscope_nb.plan.allocate.exact_allocate`) of
    :func:`table_layers`' layers within ``budget`` bytes, or None."""
    n = sum(int(lp.rows) * int(lp.cols) for lp in layers)
    bpw = 8.0 * budget / max(n, 1)
    for _ in range(8):          # the bits-per-weight that gives exactly ``budget`` bytes
        b = budget_bytes(layers, budget_bpw=bpw)
        if b == budget:
            break
        bpw = math.nextafter(bpw, math.inf if b < budget else -math.inf)
    with silence_native_output():
        a = exact_allocate(layers, budget_bpw=bpw, objective="sensitivity",
                           time_limit=time_limit)
    c = [int(x) for x in a.choice]
    return c if a.feasible and plan_bytes(layers, c) <= budget else None


def refine(scorer, start, budget, *, objective, evals=200, minutes=None, search="local",
           offspring=16, survivors=2, preselect=1, seed=0, seeds=(), table=1, table_rounds=4,
           accept_z=ACCEPT_Z, state=None, on_state=None, log=None, table_log=None,
           clock=time.perf_counter) -> RefineResult:
    """Search for a plan of ``scorer.layers`` with bytes ``<= budget`` whose
    measured score beats ``start``'s; never return one worse on the held-out split.

    Each step proposes candidates near the best plan so far (:func:`propose`);
    with a screen split (``PlanScorer(screen_tokens=...)``) every candidate is
    scored there first and only those that beat the best plan there -- at
    most ``survivors`` of them, best first -- are scored on the search split
    (EvoPress's multi-stage selection); the best of those replaces the best
    plan when it scores lower on the search split by at least ``accept_z``
    standard errors of the paired per-token (per-sentence) difference
    (:func:`paired_z`).

    Parameters
    ----------
    scorer : PlanScorer
    start : sequence of int
        The start plan (option index per layer), e.g. the exact allocator's;
        its bytes must be within ``budget``.
    budget : int
        Byte budget (the allocators' ``B``).
    objective : str
        The predicted objective the moves are guided by and that is reported
        (:func:`opscope_nb.plan.allocate.predicted_damage`).
    evals : int
        Candidates to score in all (resumed runs included; >= 0); a candidate
        screened out counts as one.
    minutes : float, optional
        Wall-time limit of this run's search.
    search : {"local", "evo"}
        ``"local"`` (default): a first-improvement hill climb, one candidate
        of one mutation per step; ``"evo"``: (1 + ``offspring``) evolution in
        EvoPress's manner, each candidate one to three mutations of the best
        plan.  Local search reached lower scores per forward spent on MiniLM
        and SmolLM2 (docs/performance.md, issue 59).
    offspring : int
        Candidates per generation of ``"evo"`` (>= 1).
    survivors : int
        Candidates per generation that pass the screen to the search split (>= 1).
    preselect : int
        Propose ``preselect`` times the candidates a step measures and keep
        those of least predicted damage (a free first stage; 1: no cut).
    seed : int
        Moves come from ``numpy.random.default_rng([seed, evals so far, misses])``:
        the same run resumed proposes the same moves.
    seeds : sequence of sequences of int
        Plans scored first on the search split (the exact plans of nearby
        budgets, of other objectives); those over ``budget`` are skipped.
    table : int
        Ladder steps either side of each layer's option that the measured
        table takes (>= 0; 0: no table).  Before the seeds, each layer is
        measured alone against :func:`base_choice` (:func:`singleton_table`,
        on the scorer's ``table`` split when it has one), the exact allocator
        solves the measured terms (:func:`table_layers`, :func:`solve_table`),
        and the table is measured again around its plan, up to
        ``table_rounds`` rounds; the solved plans are scored first, as seeds.
        The table's layer runs are not candidates (``evals`` does not count
        them); they stop at :data:`TABLE_SHARE` (0.7) of ``minutes``, largest
        predicted terms first, so that the plan solved on what was measured is
        still scored.  This package's forward only.
    table_rounds : int
        Most rounds of the table (>= 1).
    accept_z : float
        A candidate replaces the best plan only when its search score is lower
        and :func:`paired_z` of its per-unit losses against the best plan's
        (:attr:`PlanScorer.last_rows`; batches of :data:`PAIR_BATCH` tokens
        for decoders, single sentences for encoders) is at least
        ``accept_z`` (>= 0; default :data:`ACCEPT_Z`, 2).  ``0``: any lower
        score.  A gain carried by a few tokens of the search text is noise to
        held-out text; the test keeps the moves whose gain is spread.
    state : dict, optional
        A state from an earlier run (:func:`load_state`): the search continues.
    on_state : callable, optional
        ``on_state(state)`` with the JSON-ready state after each improvement
        and every 10 candidates (write it with :func:`save_state`).
    log : callable, optional
        ``log(evals, total, best, start, elapsed, eta)`` after each candidate.
    table_log : callable, optional
        ``table_log(round, done, to_do, elapsed)`` after each layer run of the
        table.

    Returns
    -------
    RefineResult
    """
    t_all = clock()
    layers = scorer.layers
    start = [int(c) for c in start]
    budget = int(budget)
    if isinstance(evals, bool) or not isinstance(evals, (int, np.integer)) or evals < 0:
        raise ValueError(f"evals must be an integer >= 0; got {evals!r}.")
    if minutes is not None and not (isinstance(minutes, (int, float)) and minutes > 0):
        raise ValueError(f"minutes must be a number > 0; got {minutes!r}.")
    if search not in ("local", "evo"):
        raise ValueError(f"search must be 'local' or 'evo'; got {search!r}.")
    if isinstance(accept_z, bool) or not isinstance(accept_z, (int, float, np.integer,
                                                               np.floating)) or \
            not (accept_z >= 0) or math.isinf(accept_z):
        raise ValueError(f"accept_z must be a finite number >= 0 (0: any lower score); "
                         f"got {accept_z!r}.")
    if isinstance(table, bool) or not isinstance(table, (int, np.integer)) or table < 0:
        raise ValueError(f"table must be an integer >= 0 (0: no table); got {table!r}.")
    for nm, v in (("offspring", offspring), ("survivors", survivors),
                  ("preselect", preselect), ("table_rounds", table_rounds)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
            raise ValueError(f"{nm} must be an integer >= 1; got {v!r}.")
    if len(start) != len(layers):
        raise ValueError(f"start has {len(start)} entries; the plan has {len(layers)} layers.")
    sb = plan_bytes(layers, start)
    if sb > budget:
        raise ValueError(f"the start plan takes {sb} bytes, over the budget of {budget}; "
                         f"start from a plan that fits.")
    seeds = [[int(x) for x in s] for s in seeds]
    lads = ladders(layers, objective, keep=[start] + seeds)
    terms = _terms(layers, objective)
    screen = "screen" in scorer.splits
    if state:
        best, best_score = [int(c) for c in state["best"]], float(state["best_score"])
        n_eval, accepted = int(state["evals"]), int(state["accepted"])
        history = [tuple(h) for h in state.get("history", [])]
        seen = set(state.get("seen", []))
        seeds_done = bool(state.get("seeds_done"))
        start_score = float(state["start_score"])
        prior_sec = float(state.get("seconds", 0.0))
        prior_fw = float(state.get("forwards", 0.0))
        pending = state.get("pending")
    else:
        pending = None
        best, n_eval, accepted, history = list(start), 0, 0, []
        seen, seeds_done, prior_sec, prior_fw = {choice_key(start)}, False, 0.0, 0.0
        start_score = best_score = None
    tbl = {(int(a), int(b)): float(v) for a, b, v in (state or {}).get("table", [])}
    runs0, sec0, fw0 = scorer.block_runs, dict(scorer.seconds), scorer.forwards
    t_prop = 0.0
    t0 = clock()

    def spent():
        return prior_fw + scorer.forwards - fw0

    batch = PAIR_BATCH if scorer.metric == "kl" else 1
    cur = scorer.adopt(best)
    best_rows = getattr(scorer, "last_rows", None)
    if start_score is None:
        start_score = best_score = cur
        history.append((0, cur, spent()))
    elif not math.isclose(cur, best_score, rel_tol=1e-6, abs_tol=1e-12):
        raise ValueError(f"the saved state's best plan now scores {cur:.6g}, not the "
                         f"{best_score:.6g} it recorded: the model, text or options changed; "
                         f"delete the state file to start over.")
    best_score = cur
    best_screen = scorer.adopt(best, "screen") if screen else None
    run_evals = 0
    stopped = "evals"

    def snapshot():
        return {"version": STATE_VERSION, "best": [int(c) for c in best],
                "best_score": float(best_score), "start": [int(c) for c in start],
                "start_score": float(start_score), "evals": int(n_eval),
                "accepted": int(accepted),
                "history": [[int(h[0]), float(h[1])] + [float(x) for x in h[2:]]
                            for h in history],
                "seen": sorted(seen), "seeds_done": bool(seeds_done),
                "seconds": prior_sec + clock() - t0, "forwards": spent(),
                "table": [[int(i), int(j), float(v)] for (i, j), v in sorted(tbl.items())],
                "pending": None if pending is None else {
                    "kids": [[int(x) for x in k] for k in pending["kids"]],
                    "scored": [[float(v), [int(x) for x in k]]
                               for v, k in pending["scored"]]}}

    def report():
        if log is None:
            return
        el = clock() - t0
        left = []
        if run_evals:
            left.append((evals - n_eval) * el / run_evals)
        if minutes is not None:
            left.append(max(minutes * 60.0 - el, 0.0))
        log(n_eval, evals, best_score, start_score, el, min(left) if left else None)

    def out_of_time():
        return minutes is not None and clock() - t0 >= minutes * 60.0

    def table_out_of_time():
        # the table stops at TABLE_SHARE of the time limit: its solved plans
        # and the seeds are then still scored (a table that took all the time
        # returned the start plan unscored)
        return minutes is not None and clock() - t0 >= TABLE_SHARE * minutes * 60.0

    def prefix_units(split):
        # the leading search rows a split (a prefix of the search chunks) holds
        if split not in scorer.splits or not hasattr(scorer, "units"):
            return 0
        return scorer.units(split)

    def better(v, rows, skip=0):
        # lower, and by enough standard errors of the paired difference, on
        # the search rows past the first ``skip`` (those that selected the
        # candidate: a plan picked on some tokens is judged on others)
        if rows is None or best_rows is None:
            return v < best_score
        r, b = (rows[skip:], best_rows[skip:]) if 0 < skip < len(rows) else (rows, best_rows)
        if not r.mean() < b.mean():
            return False
        return accept_z <= 0 or paired_z(r, b, batch) >= accept_z

    def take(c):
        nonlocal best, best_score, best_screen, accepted, best_rows
        best = list(c)
        best_score = scorer.adopt(c)
        best_rows = getattr(scorer, "last_rows", None)
        if screen:
            best_screen = scorer.adopt(c, "screen")
        accepted += 1
        history.append((n_eval, best_score, spent()))
        if on_state:
            on_state(snapshot())

    # the measured table: each layer alone near the start plan, solved exactly
    table_keys = set()      # the plans solved on it (judged on the other search tokens)
    tinfo = {"singletons": 0, "rounds": 0, "plans": 0, "seconds": 0.0, "complete": None,
             "split": None}
    if int(table) > 0 and not seeds_done and n_eval < evals and \
            getattr(scorer, "runtime", "numba") == "numba":
        tt = clock()
        tsplit = "table" if "table" in scorer.splits else "search"
        base = base_choice(layers, terms)
        plan_t, tplans, n_meas, complete = list(start), [], 0, True
        for rd in range(int(table_rounds)):
            order = sorted(range(len(layers)), key=lambda i: (-terms[i][plan_t[i]], i))
            prog = None if table_log is None else (
                lambda k, m, rd=rd: table_log(rd + 1, k, m, clock() - tt))
            got, complete = singleton_table(scorer, plan_t, base, lads, tbl,
                                            width=int(table), split=tsplit, order=order,
                                            stop=table_out_of_time, progress=prog)
            n_meas += got
            tinfo["rounds"] += 1
            c = solve_table(table_layers(layers, terms, tbl, base, scorer.inert), budget)
            if c is None or c == plan_t:
                break
            tplans.append(c)
            plan_t = c
            if not complete:
                break
        known = {choice_key(c) for c in seeds}
        seeds = [c for c in tplans if choice_key(c) not in known] + seeds
        if tsplit == "table":
            table_keys.update(choice_key(c) for c in tplans)
        lads = ladders(layers, objective, keep=[start] + seeds)
        if tsplit == "search":
            best_score = scorer.adopt(best)         # the singletons moved the cache
            best_rows = getattr(scorer, "last_rows", None)
        tinfo.update(singletons=n_meas, plans=len(tplans), seconds=clock() - tt,
                     complete=complete, split=tsplit, entries=len(tbl))
        if on_state:
            on_state(snapshot())

    # seeds first, on the search split
    if not seeds_done:
        for sd in seeds:
            if n_eval >= evals or out_of_time():
                break
            if choice_key(sd) in seen or plan_bytes(layers, sd) > budget:
                continue
            seen.add(choice_key(sd))
            v = scorer.score(sd)
            n_eval += 1
            run_evals += 1
            skip = prefix_units("table") if choice_key(sd) in table_keys else 0
            if better(v, getattr(scorer, "last_rows", None), skip):
                take(sd)
            report()
        seeds_done = n_eval < evals and not out_of_time()
    misses = 0
    rows_of = {}            # this generation's per-unit search losses, by plan
    local = search == "local"
    lam = 1 if local else int(offspring)
    while True:
        rows_of.clear()
        if pending is not None:         # a generation an earlier run left unfinished
            kids = [[int(x) for x in k] for k in pending["kids"]]
            scored = [(float(v), [int(x) for x in k]) for v, k in pending["scored"]]
            pending = None
        else:
            if n_eval >= evals:
                stopped = "evals"
                break
            if out_of_time():
                stopped = "minutes"
                break
            tp = clock()
            rng = np.random.default_rng([int(seed), int(n_eval), misses])
            kids, keys = [], set()
            for _ in range(lam * int(preselect)):
                for _try in range(20):
                    mut = 1 if local else int(min(3, rng.geometric(0.5)))
                    c = propose(layers, best, budget, lads, terms, scorer.stage_of, rng,
                                mutations=mut)
                    if c is None:
                        continue
                    k = choice_key(c)
                    if k not in seen and k not in keys:
                        kids.append(c)
                        keys.add(k)
                        break
            if len(kids) > lam:
                # stage 0 (free): the predicted damage picks the lam to measure
                base = sum(terms[i][c] for i, c in enumerate(best))
                pred = [base + sum(terms[i][c[i]] - terms[i][best[i]] for i in range(len(c))
                                   if c[i] != best[i]) for c in kids]
                order = sorted(range(len(kids)), key=lambda k: (pred[k], k))
                kids = [kids[k] for k in order[:lam]]
            t_prop += clock() - tp
            if not kids:
                misses += 1
                if misses > 5:
                    stopped = "no move"
                    break
                continue
            misses = 0
            scored = []
        # stage 1: every candidate on the screen split (or the search split)
        for c in kids[len(scored):]:
            if n_eval >= evals or out_of_time():
                break
            seen.add(choice_key(c))
            v = scorer.score(c, "screen") if screen else scorer.score(c)
            scored.append((v, c))
            if not screen:
                rows_of[choice_key(c)] = getattr(scorer, "last_rows", None)
            n_eval += 1
            run_evals += 1
            report()
        if len(scored) < len(kids):     # stopped inside a generation: finish it on resume
            pending = {"kids": kids, "scored": scored}
            stopped = "evals" if n_eval >= evals else "minutes"
            break
        if screen:
            # stage 2: the best few that beat the best plan on the screen
            order = sorted(range(len(scored)), key=lambda k: (scored[k][0], k))
            pool = [scored[k][1] for k in order if scored[k][0] < best_screen]
            scored = []
            for c in pool[:int(survivors)]:
                scored.append((scorer.score(c), c))
                rows_of[choice_key(c)] = getattr(scorer, "last_rows", None)
        if scored:
            v, c = min(scored, key=lambda t: t[0])
            rows = rows_of.get(choice_key(c))
            if rows is None and v < best_score:     # scored by an earlier run: again
                scorer.score(c)
                rows = getattr(scorer, "last_rows", None)
            if better(v, rows, prefix_units("screen") if screen else 0):
                take(c)
                continue
        if on_state and n_eval % 10 < len(kids):
            on_state(snapshot())
    if on_state:
        on_state(snapshot())
    t_search = clock() - t0
    search_runs = scorer.block_runs - runs0
    forwards = scorer.forwards - fw0
    sec = {k: scorer.seconds[k] - sec0.get(k, 0.0) for k in scorer.seconds}
    # never worse: both plans on the held-out split
    th = clock()
    h_start, ppl_start = scorer.score(start, "held_out", adopt=False, ppl=True)
    rows_start = getattr(scorer, "last_rows", None)
    if best == start:
        h_best, ppl_best, z_held = h_start, ppl_start, 0.0
    else:
        h_best, ppl_best = scorer.score(best, "held_out", adopt=False, ppl=True)
        rows_best = getattr(scorer, "last_rows", None)
        z_held = None if rows_start is None or rows_best is None else \
            paired_z(rows_best, rows_start, batch)
    t_held = clock() - th
    kept = best != start and h_best < h_start
    sec.update(propose=t_prop, search=t_search, held_out=t_held, total=clock() - t_all)
    ppl_dense = getattr(scorer.splits["held_out"], "ppl_dense", None)
    scores = {
        "start": {"search": float(start_score), "held_out": float(h_start),
                  "predicted": predicted_damage(layers, start, objective),
                  "bytes": plan_bytes(layers, start), "ppl": ppl_start},
        "best": {"search": float(best_score), "held_out": float(h_best),
                 "predicted": predicted_damage(layers, best, objective),
                 "bytes": plan_bytes(layers, best), "ppl": ppl_best},
        "ppl_dense": ppl_dense, "budget": budget, "objective": objective,
        "held_out_z": z_held, "accept_z": float(accept_z),
        "search_tokens": scorer.splits["search"].tokens,
        "screen_tokens": scorer.splits["screen"].tokens if screen else None,
        "held_out_tokens": scorer.splits["held_out"].tokens,
        "runtime": getattr(scorer, "runtime", "numba"), "table": tinfo}
    return RefineResult(list(best) if kept else list(start), list(start), list(best), kept,
                        scores, n_eval, accepted, history, sec, search_runs, stopped,
                        scorer.metric, run_evals, forwards,
                        getattr(scorer, "runtime", "numba"))
