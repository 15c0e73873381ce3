"""Refine's scores from llama.cpp: ``opscope-nb refine --runtime llama.cpp`` (issue 59, item 3).

:class:`LlamaCppScorer` measures a plan of a GGUF decoder the way the user
will run it: the plan's GGUF file (what ``opscope-nb apply SOURCE.gguf PLAN -o
OUT.gguf`` writes, byte for byte) is loaded by llama.cpp and its logits are
compared with llama.cpp's logits of the **source GGUF file itself** -- the
dense reference of ``opscope-nb eval SOURCE.gguf --compressed OUT.gguf
--runtime llama.cpp`` (an F16 / BF16 / F32 source is the float model; a
quantised source is the reference as stored, as ``eval`` takes it).  Both see
the same token windows, made by this package's tokenizer (as ``eval`` does).
The score is the mean next-token ``KL(dense || plan)`` in float64, the same
kernel as :class:`opscope_nb.plan.refine.PlanScorer`'s.

Candidates are not re-quantised: each (tensor, option) is packed once (the
bytes of :func:`opscope_nb.formats.pack`, as ``apply`` packs them) and kept
in memory; :class:`GGUFAssembler` writes a candidate's file from those blocks
and the source's stored bytes (header and key-values of the source, parsed
once) into a temporary directory (``/dev/shm`` when there is one), llama.cpp
loads it, and the file is deleted after the run.

Which stages run where (the default, ``screen="numba"``): llama.cpp's cost
per candidate is a whole forward from the embeddings plus the file and the
load (about 0.3 s for SmolLM2-135M), while this package's forward of a
candidate starts at its first changed block from the parent's cached input
(:class:`PlanScorer`).  So the cheap stages stay on our forward -- the
predicted damage and the short *screen* split that most candidates fail --
and the decisions llama.cpp must own are llama.cpp's: a candidate that passes
the screen is accepted only when llama.cpp's KL on the search split beats the
best plan's, and the held-out "never worse" comparison of the start and the
best plan is llama.cpp's KL.  ``screen="llama.cpp"`` scores the screen split
with llama.cpp too (everything llama.cpp's; docs/performance.md gives both
rates on SmolLM2).

Layer 4 (imports :mod:`opscope_nb.plan.refine`, :mod:`opscope_nb.models`,
:mod:`opscope_nb.io`).
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
import weakref

import numpy as np

from . import refine as rf

__all__ = ["LlamaCppScorer", "GGUFAssembler", "check_source", "check_options"]

#: GGUF value type ids of the key-values the assembler writes itself.
_UINT32, _BOOL, _STRING, _UINT64, _INT64, _FLOAT64 = 4, 7, 8, 10, 11, 12


def check_source(path) -> None:
    """Raise ValueError unless ``path`` is a GGUF file of a decoder: what
    ``--runtime llama.cpp`` can score (checked before llama.cpp is imported)."""
    from opscope_nb.models.loader import _GGUF_ENCODERS, gguf_metadata, is_gguf
    path = os.fspath(path)
    if not is_gguf(path):
        raise ValueError(f"--runtime llama.cpp scores GGUF files; the source {path} is not "
                         f"one: profile the model's GGUF (llama.cpp's convert_hf_to_gguf.py "
                         f"writes it) or use --runtime numba.")
    try:
        arch = str(gguf_metadata(path).get("general.architecture"))
    except Exception as exc:            # a broken file: the loader words it later
        raise ValueError(f"--runtime llama.cpp: {path} is not a readable GGUF file "
                         f"({type(exc).__name__}: {exc}).") from None
    if arch in _GGUF_ENCODERS:
        raise ValueError(f"--runtime llama.cpp scores decoders (next-token KL); the source "
                         f"{path} is a {arch} encoder: use --runtime numba (1 - cosine of "
                         f"the embeddings).")


def check_options(layers) -> None:
    """Raise ValueError unless every option of every layer is a ggml type or
    dense: a candidate must be a GGUF file llama.cpp runs."""
    for lp in layers:
        for o in lp.options:
            if o.decomp.kind not in ("ggml", "dense"):
                raise ValueError(f"--runtime llama.cpp runs GGUF files, so every option must "
                                 f"be a ggml type or dense; layer {lp.name!r} has option "
                                 f"{o.decomp.label!r}: profile with --menu ggml (or use "
                                 f"--runtime numba).")


def _key(name: str) -> bytes:
    b = name.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv_record(name, value) -> bytes:
    """One GGUF key-value record as ``gguf.GGUFWriter`` writes it (the types
    :func:`opscope_nb.io.gguf_export.export_gguf` gives its ``tool_kv``)."""
    if isinstance(value, str):
        v = value.encode("utf-8")
        return _key(name) + struct.pack("<IQ", _STRING, len(v)) + v
    if isinstance(value, bool):
        return _key(name) + struct.pack("<I?", _BOOL, value)
    if isinstance(value, int):
        return _key(name) + (struct.pack("<IQ", _UINT64, value) if value >= 0
                             else struct.pack("<Iq", _INT64, value))
    if isinstance(value, float):
        return _key(name) + struct.pack("<Id", _FLOAT64, value)
    raise TypeError(f"key-value {name!r} must be a str, bool, int or float; got "
                    f"{type(value).__name__}.")


class GGUFAssembler:
    """Writes GGUF files of plans of one source from already packed blocks.

    The file is what :func:`opscope_nb.io.gguf_export.export_gguf` writes for
    the same plan (tests/test_refine_llamacpp.py compares them byte for byte):
    the source's key-values in its order (``general.file_type`` as llama.cpp
    guesses it when a tensor changes type), ``tool_kv`` after them, every
    tensor in the source's order -- a re-typed one from its blocks, every
    other byte for byte as stored -- each at an offset padded to the file's
    alignment.  The source is parsed once; a write is the header (a few kB)
    and one copy of every tensor's bytes.

    Parameters
    ----------
    source : str
        A little-endian GGUF file.
    """

    def __init__(self, source):
        from opscope_nb.io import gguf_reader
        self.source = os.fspath(source)
        r = gguf_reader(self.source)
        if r.endianess.name != "LITTLE":
            raise ValueError(f"{self.source}: a big-endian GGUF file; the llama.cpp scorer "
                             f"writes little-endian files only.")
        self.alignment = int(getattr(r, "alignment", 32))
        self.tensors = list(r.tensors)
        self.by_name = {t.name: t for t in self.tensors}
        self._kv = [(f.name, bytes(f.raw)) for f in r.fields.values()
                    if not f.name.startswith(("GGUF.", "opscope."))]
        ft = r.fields.get("general.file_type")
        self._ft_kept = None if ft is None else int(ft.contents())
        self._infos = {}            # (name, type) -> tensor info record without its offset

    def _info(self, t, qtype):
        k = (t.name, qtype)
        got = self._infos.get(k)
        if got is None:
            import gguf
            dims = [int(x) for x in t.shape]
            got = (_key(t.name) + struct.pack("<I", len(dims))
                   + struct.pack(f"<{len(dims)}Q", *dims)
                   + struct.pack("<I", int(gguf.GGMLQuantizationType[qtype])))
            self._infos[k] = got
        return got

    def write(self, path, blocks, tool_kv=None) -> int:
        """Write the source with ``blocks`` to ``path``; returns the file's bytes.

        Parameters
        ----------
        path : str
        blocks : dict of str -> (str, ndarray)
            Tensor name -> (ggml type name, its packed blocks as uint8) for the
            tensors written in another type or re-quantised; every other
            tensor is copied as stored.
        tool_kv : dict, optional
            Key-values appended after the source's (``export_gguf``'s ``tool_kv``).
        """
        from opscope_nb.formats import ggml
        from opscope_nb.io.gguf_export import guess_file_type
        align = self.alignment
        written, data, retyped = {}, [], False
        for t in self.tensors:
            b = blocks.get(t.name)
            if b is not None:
                qt, arr = b
                cols, rows = int(t.shape[0]), int(t.shape[1])
                arr = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
                if arr.size != rows * ggml.row_bytes(qt, cols):
                    raise ValueError(f"tensor {t.name!r}: {arr.size} bytes of {qt} blocks "
                                     f"for a [{rows}x{cols}] tensor; expected "
                                     f"{rows * ggml.row_bytes(qt, cols)}.")
                retyped |= qt != t.tensor_type.name
                written[t.name] = (qt, len(t.shape))
                data.append((t, qt, arr))
            else:
                written[t.name] = (t.tensor_type.name, len(t.shape))
                data.append((t, t.tensor_type.name,
                             np.asarray(t.data).view(np.uint8).reshape(-1)))
        kv = []
        if retyped or self._ft_kept is None:
            ft = guess_file_type(written)[0]
            rec = _key("general.file_type") + struct.pack("<II", _UINT32, ft)
            kv = [rec if n == "general.file_type" else raw for n, raw in self._kv]
            if self._ft_kept is None:
                kv.append(rec)
        else:
            kv = [raw for _, raw in self._kv]
        for k, v in (tool_kv or {}).items():
            kv.append(_kv_record(k, v))
        head = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(kv)), *kv]
        off = 0
        for t, qt, arr in data:
            head.append(self._info(t, qt) + struct.pack("<Q", off))
            off += -(-arr.size // align) * align
        hb = b"".join(head)
        hb += b"\0" * (-len(hb) % align)
        total = len(hb)
        with open(path, "wb") as f:
            f.write(hb)
            for _t, _qt, arr in data:
                f.write(memoryview(arr))
                pad = -arr.size % align
                if pad:
                    f.write(b"\0" * pad)
                total += arr.size + pad
        return total


class _LSplit:
    """A split scored by llama.cpp: its windows, the reference rows, tokens."""

    def __init__(self, chunks):
        self.chunks = [np.asarray(c, dtype=np.int64) for c in chunks]
        self.tokens = int(sum(len(c) for c in self.chunks))
        self.ref = None
        self.ppl_dense = None


def _shm_for(nbytes):
    """``/dev/shm`` when it is writable and has room for four files of
    ``nbytes`` (a candidate, llama.cpp's map of it and slack; a 7B model's
    candidates would otherwise fill a RAM disk), else None (the system's
    temporary directory)."""
    d = "/dev/shm"
    try:
        ok = os.path.isdir(d) and os.access(d, os.W_OK) \
            and shutil.disk_usage(d).free > 4 * int(nbytes)
    except OSError:
        ok = False
    return d if ok else None


class LlamaCppScorer:
    """The measured score of plans of a GGUF decoder, from llama.cpp's logits.

    Same interface as :class:`opscope_nb.plan.refine.PlanScorer` (what
    :func:`opscope_nb.plan.refine.refine` calls): :meth:`score`,
    :meth:`adopt`, ``splits``, ``seconds``, ``forwards``, ``stage_of``.

    Parameters
    ----------
    source : str
        The profiled GGUF file: the dense reference (llama.cpp's logits of it)
        and the bytes every candidate file copies.
    model : opscope_nb.models.Model
        ``open_model(source)`` (loaded): its tensors are what options are
        packed from, its tokenizer made the windows.
    layers : sequence of LayerProfile
        The planned layers (GGUF tensor names); every option a ggml type or
        dense (:func:`check_options`).
    search, held_out : list of 1-D int arrays
        Token windows (:func:`opscope_nb.plan.refine.text_chunks`).
    grams, stored, requantize
        As :class:`PlanScorer` (and ``apply``): an option reading a gram is
        packed with it; an option in a tensor's stored type copies its blocks.
    screen_tokens : int, optional
        A screen split of the first ``screen_tokens`` search tokens
        (:class:`PlanScorer`'s rule).
    screen : {"numba", "llama.cpp"}
        Whose forward scores the screen split (default ``"numba"``: this
        package's, from the first changed block; the search and held-out
        splits are always llama.cpp's).
    n_threads : int, optional
        llama.cpp's threads (default: numba's thread count,
        :func:`opscope_nb._threads.worker_count`).
    tmpdir : str, optional
        Where candidate files are written (default: a new directory under
        ``/dev/shm`` when it exists with room for four source-sized files,
        else the system's temporary directory; removed by :meth:`close`).
    act_quant : {"none", "ggml"}
        Passed to the numba screen's :class:`~opscope_nb.plan.refine.PlanScorer`
        (``"ggml"``: its forward reads activations as llama.cpp does).

    Attributes
    ----------
    runtime : str
        ``"llama.cpp"``.
    seconds : dict of str -> float
        ``pack``, ``assemble`` (candidate files written), ``load`` (llama.cpp
        loading them), ``llama`` (llama.cpp's forwards), ``kl``,
        ``reference`` and, with a numba screen, ``forward`` / ``head`` of it.
    runs : dict of str -> list
        Per runtime, ``[candidate forwards, tokens, seconds]`` of its scoring
        forwards (llama.cpp: assemble + load + forward; numba: the screen's
        block runs, partial forwards counted by their tokens and stages).
    last_rows : ndarray of float64 or None
        The per-token KL of the last :meth:`score` call (as
        :attr:`~opscope_nb.plan.refine.PlanScorer.last_rows`).
    """

    runtime = "llama.cpp"
    metric = "kl"

    def __init__(self, source, model, layers, search, held_out, *, grams=None, stored=None,
                 requantize=False, screen_tokens=None, screen="numba", n_threads=None,
                 tmpdir=None, act_quant="none"):
        from opscope_nb.models import llamacpp
        check_source(source)
        if model.family != "decoder":
            raise ValueError(f"--runtime llama.cpp scores decoders; {source} is a "
                             f"{model.arch} {model.family}: use --runtime numba.")
        check_options(layers)
        if screen not in ("numba", "llama.cpp"):
            raise ValueError(f"screen must be 'numba' or 'llama.cpp'; got {screen!r}.")
        if not search or not held_out:
            raise ValueError("LlamaCppScorer needs chunks in both the search and the "
                             "held-out split; give a longer text.")
        self.source = os.fspath(source)
        self.layers = list(layers)
        self.asm = GGUFAssembler(self.source)
        missing = [lp.name for lp in self.layers if lp.name not in self.asm.by_name]
        if missing:
            raise ValueError(f"layer {missing[0]!r} is not a tensor of {self.source}: the "
                             f"llama.cpp runtime needs a profile of the GGUF file itself.")
        self._blocks = {}
        self.stored = stored or {}
        self.requantize = bool(requantize)
        self.grams = grams or {}
        self.model = model
        self.splits = {"search": _LSplit(search), "held_out": _LSplit(held_out)}
        self._numba = None
        if screen_tokens is not None:
            if isinstance(screen_tokens, bool) or not isinstance(
                    screen_tokens, (int, np.integer)) or int(screen_tokens) < 2:
                raise ValueError(f"screen_tokens must be an integer >= 2 or None; got "
                                 f"{screen_tokens!r}.")
            sc = rf._screen_chunks(search, int(screen_tokens), "decoder")
            if screen == "numba":
                # our forward of the screen windows ("search" inside it); its
                # packing also fills the blocks the files are made of
                self._numba = rf.PlanScorer(model, layers, sc, sc[:1], grams=grams,
                                            stored=stored, requantize=requantize,
                                            blocks=self._blocks, act_quant=act_quant)
                self.splits["screen"] = self._numba.splits["search"]
            else:
                self.splits["screen"] = _LSplit(sc)
        self._ps = self._numba or rf.PlanScorer(model, layers, [np.asarray(search[0][:2])],
                                                [np.asarray(search[0][:2])], grams=grams,
                                                stored=stored, requantize=requantize)
        self.stage_of = self._ps.stage_of
        self.n_blocks = self._ps.n_blocks
        self.n_threads = int(n_threads) if n_threads else None
        if self.n_threads is None:
            from opscope_nb._threads import worker_count
            self.n_threads = worker_count()
        self.n_ctx = max(len(c) for s in self.splits.values() for c in s.chunks)
        base = tmpdir or _shm_for(os.path.getsize(self.source))
        self.tmpdir = tempfile.mkdtemp(prefix="opscope-refine-", dir=base)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.tmpdir, True)
        self._own = {"pack": 0.0, "assemble": 0.0, "load": 0.0, "llama": 0.0, "kl": 0.0,
                     "reference": 0.0}
        self._memo = {}
        self.last_rows = None
        self._n_files = 0
        self.runs = {"llama.cpp": [0, 0, 0.0]}
        self._llamacpp = llamacpp
        t0 = time.perf_counter()
        llm = llamacpp.load(self.source, n_ctx=self.n_ctx, n_threads=self.n_threads)
        try:
            for nm, s in self.splits.items():
                if isinstance(s, _LSplit):
                    refs, nll = [], []
                    for c in s.chunks:
                        ref, nl = rf._reference_rows(llamacpp.logits(llm, c), c, True)
                        refs.append(ref)
                        nll.append(nl)
                    s.ref = refs
                    s.ppl_dense = float(np.exp(np.concatenate(nll).mean()))
        finally:
            llm.close()
        self._own["reference"] += time.perf_counter() - t0

    # ---- from text ------------------------------------------------------- #
    @classmethod
    def from_text(cls, source, model, layers, *, text=None, held_out_text=None, split=0.25,
                  split_seed=0, tokens=2048, held_out_tokens=512, window=256, **kw):
        """A scorer whose windows are :func:`opscope_nb.plan.refine.text_chunks`'
        (the same as :meth:`PlanScorer.from_text` takes)."""
        if model.family != "decoder":
            raise ValueError(f"--runtime llama.cpp scores decoders; {source} is a "
                             f"{model.arch} {model.family}: use --runtime numba.")
        s, h = rf.text_chunks(model, text=text, held_out_text=held_out_text, split=split,
                              split_seed=split_seed, tokens=tokens,
                              held_out_tokens=held_out_tokens, window=window)
        return cls(source, model, layers, s, h, **kw)

    # ---- bookkeeping ------------------------------------------------------ #
    @property
    def seconds(self) -> dict:
        out = dict(self._own)
        if self._numba is not None:
            for k, v in self._numba.seconds.items():
                if k in ("forward", "head"):
                    out[k] = out.get(k, 0.0) + v
                elif k == "kl":
                    out["kl"] += v
                elif k == "pack":
                    out["pack"] += v
        return out

    @property
    def block_runs(self) -> int:
        """Stage runs: llama.cpp's forwards count ``n_blocks + 1`` each."""
        return self.runs["llama.cpp"][0] * (self.n_blocks + 1) + (
            self._numba.block_runs if self._numba is not None else 0)

    @property
    def forwards(self) -> float:
        """Work done so far in full forwards of the search split: llama.cpp's
        tokens run plus the numba screen's tokens x stages."""
        tok = float(self.runs["llama.cpp"][1])
        if self._numba is not None:
            tok += self._numba.token_runs / (self.n_blocks + 1)
        return tok / max(self.splits["search"].tokens, 1)

    def rates(self) -> dict:
        """Per runtime, ``{"runs", "tokens", "seconds", "forwards_per_s"}``: full
        forwards of the search split per second of that runtime's scoring."""
        out = {}
        n, tok, sec = self.runs["llama.cpp"]
        out["llama.cpp"] = {"runs": n, "tokens": tok, "seconds": sec,
                            "forwards_per_s": tok / self.splits["search"].tokens / sec
                            if sec > 0 else None}
        if self._numba is not None:
            s = self._numba.seconds
            sec = s["forward"] + s["head"] + s["kl"]
            fw = self._numba.token_runs / (self.n_blocks + 1) / self.splits["search"].tokens
            out["numba"] = {"runs": self._numba.block_runs, "tokens": self._numba.token_runs,
                            "seconds": sec, "forwards_per_s": fw / sec if sec > 0 else None}
        return out

    def close(self) -> None:
        """Remove the temporary directory of candidate files."""
        self._cleanup()

    # ---- candidates -------------------------------------------------------- #
    def packed(self, choice) -> dict:
        """``{tensor name: (ggml type, blocks)}`` of the tensors ``choice``
        re-types or re-quantises (packed once per (tensor, option), kept)."""
        out = {}
        for i, (lp, j) in enumerate(zip(self.layers, choice)):
            d = lp.options[int(j)].decomp
            if d.kind == "dense":
                continue
            t = self.asm.by_name[lp.name]
            if t.tensor_type.name == d.qtype and not self.requantize:
                continue                    # copied as stored, as apply does
            key = (i, int(j))
            b = self._blocks.get(key)
            if b is None:
                t0 = time.perf_counter()
                if self._numba is not None:
                    self._numba.option(i, int(j))      # packs and keeps the blocks
                    b = self._blocks[key]
                else:
                    e = self.stored.get(lp.name)
                    lin = rf._pack_option(lp, int(j), self._ps._orig[lp.name], e,
                                          self.grams, self.requantize)
                    b = self._blocks[key] = lin.arrays["blocks"]
                    self._own["pack"] += time.perf_counter() - t0
            out[lp.name] = (d.qtype, b)
        return out

    def write(self, choice, path, tool_kv=None) -> int:
        """Write ``choice``'s GGUF file to ``path`` (from the cached blocks)."""
        return self.asm.write(path, self.packed(choice), tool_kv)

    def _check(self, choice):
        return rf.check_choice(self.layers, choice)

    def _run(self, c, split, ppl):
        s = self.splits[split]
        lc = self._llamacpp
        t0 = time.perf_counter()
        blocks = self.packed(c)
        t1 = time.perf_counter()
        self._n_files += 1
        path = os.path.join(self.tmpdir, f"candidate-{self._n_files}.gguf")
        try:
            self.asm.write(path, blocks)
            t2 = time.perf_counter()
            llm = lc.load(path, n_ctx=self.n_ctx, n_threads=self.n_threads)
            t3 = time.perf_counter()
            try:
                kls, nll, t_kl = [], [], 0.0
                for k, ch in enumerate(s.chunks):
                    z = lc.logits(llm, ch)
                    tk = time.perf_counter()
                    kl, nl = rf._kl_rows(z, s.ref[k], ch, ppl)
                    t_kl += time.perf_counter() - tk
                    kls.append(kl)
                    if nl is not None:
                        nll.append(nl)
            finally:
                llm.close()
        finally:
            if os.path.exists(path):
                os.remove(path)
        t4 = time.perf_counter()
        self._own["assemble"] += t2 - t1
        self._own["load"] += t3 - t2
        self._own["llama"] += t4 - t3 - t_kl
        self._own["kl"] += t_kl
        r = self.runs["llama.cpp"]
        r[0] += 1
        r[1] += s.tokens
        r[2] += t4 - t0 - (t1 - t0)         # packing is counted apart (once per option)
        rows = np.maximum(np.concatenate(kls), 0.0)
        val = float(rows.mean())
        return ((val, float(np.exp(np.concatenate(nll).mean()))) if ppl else val), rows

    def score(self, choice, split="search", *, adopt=None, ppl=False):
        """The measured score of ``choice`` on ``split``: llama.cpp's mean
        ``KL(dense || plan)`` per next-token position (the screen split: our
        forward's, with ``screen="numba"``).  A plan scored before on a split
        is not run again.  ``ppl=True`` returns ``(score, perplexity)``;
        ``adopt`` is accepted for :class:`PlanScorer`'s interface (a llama.cpp
        run has no cache to keep)."""
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)}; got {split!r}.")
        c = self._check(choice)
        if split == "screen" and self._numba is not None:
            v = self._numba.score(c, "search", adopt=adopt)
            self.last_rows = self._numba.last_rows
            return (v, None) if ppl else v
        key = (split, c, bool(ppl))
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._run(c, split, ppl)
            if ppl:
                self._memo[(split, c, False)] = (got[0][0], got[1])
        self.last_rows = got[1]
        return got[0]

    def adopt(self, choice, split="search"):
        """Score ``choice`` on ``split`` (the numba screen keeps it as its cache)."""
        return self.score(choice, split, adopt=True)

    def full_score(self, choice, split="search") -> float:
        """``choice`` scored afresh (no memo): what :meth:`score` returns."""
        c = self._check(choice)
        if split == "screen" and self._numba is not None:
            return self._numba.full_score(c, "search")
        return self._run(c, split, False)[0]
