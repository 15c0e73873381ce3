"""Apply a plan: read ``plan.json``, compress a checkpoint's planned layers and
write the compressed checkpoint (:mod:`opscope_nb.runtime.checkpoint`'s format).

Layer 3 (imports :mod:`opscope_nb.runtime.checkpoint`, :mod:`opscope_nb.runtime`,
:mod:`opscope_nb.formats`, :mod:`opscope_nb.io`).
"""
from __future__ import annotations

import collections
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from opscope_nb import io as tio
from opscope_nb.runtime.checkpoint import CheckpointWriter
from opscope_nb.profile.checkpoint import FingerprintError, check_fingerprints
from opscope_nb.formats import Decomp, packed_bytes, unpack
from opscope_nb.formats.gptq import option_errors
from opscope_nb.runtime._packed import PackedLinear

__all__ = ["apply_plan", "read_plan", "PlanError", "FINGERPRINT", "check_made_from",
           "BYTES_RTOL", "plan_summary"]

#: How far (relative) the bytes ``apply`` writes for the planned layers may be
#: from the bytes the plan records for them.
BYTES_RTOL = 1e-3

#: What ``source_sha256`` in a compressed file hashes (files of before hashed
#: the float32 values as loaded, and carry no ``source_fingerprint``).
FINGERPRINT = "sha256 of stored bytes"


class PlanError(ValueError):
    """A plan.json is missing, malformed, or made for another model."""


def read_plan(plan_path, method=None) -> tuple:
    """``(method, {layer name: Decomp}, plan doc)`` from a ``plan.json``.

    ``method`` None picks ``refined`` when present (``opscope-nb refine`` writes
    it only when it beat the exact plan on held-out text), else ``exact``, else
    the first method.  Decomp
    parameters come from the ``profile.json`` next to the plan when it lists the
    same layer and option (keeps low-rank provenance: SVD rank and seed), else
    from the option's label.

    Raises
    ------
    ValueError
        Missing/unreadable plan, unknown method, malformed layer entries.
    """
    plan_path = os.fspath(plan_path)
    if not os.path.isfile(plan_path):
        raise PlanError(f"{plan_path}: no such plan file; write one with "
                         f"'opscope-nb profile SOURCE --out DIR' (DIR/plan.json).")
    try:
        with open(plan_path, encoding="utf-8") as f:
            doc = json.load(f)
        methods = doc["methods"]
        if not isinstance(methods, dict) or not methods:
            raise KeyError
    except OSError as exc:
        raise PlanError(f"{plan_path}: cannot read ({exc.strerror or exc}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise PlanError(f"{plan_path}: not an opscope-nb plan.json (needs a 'methods' "
                         f"object from 'profile --out' or 'allocate --out').") from None
    if method is None:
        method = next((m for m in ("refined", "exact") if m in methods), next(iter(methods)))
    if method not in methods:
        raise PlanError(f"{plan_path}: method {method!r} not in the plan; it has "
                         f"{sorted(methods)}.")
    prof_opts = {}
    prof_path = os.path.join(os.path.dirname(os.path.abspath(plan_path)), "profile.json")
    if os.path.isfile(prof_path):
        try:
            with open(prof_path, encoding="utf-8") as f:
                pdoc = json.load(f)
            for ent in pdoc.get("layers", []):
                p = ent.get("profile", ent)
                prof_opts[p["name"]] = [o["decomp"] for o in p["options"]]
        except Exception:  # a stray/old profile.json only loses provenance
            prof_opts = {}
    out = {}
    for ent in methods[method].get("layers", []):
        try:
            name, label = str(ent["name"]), str(ent["label"])
            d = Decomp.from_label(label)
            full = ent.get("decomp")
            if isinstance(full, dict):
                # the row's own full decomp (rank, sketch, seed): the same arrays
                # whichever directory the plan is applied from
                dd = Decomp.from_dict(full)
            else:  # an older plan: provenance from the profile next to it
                opts = prof_opts.get(name)
                oi = ent.get("option")
                dd = (Decomp.from_dict(opts[int(oi)])
                      if opts is not None and oi is not None and 0 <= int(oi) < len(opts)
                      else d)
            if dd != d:
                raise ValueError(f"its decomp {full!r} is not its label {label!r}")
            d = dd
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{plan_path}: bad layer entry {ent!r} in method "
                             f"{method!r} ({exc}).") from None
        out[name] = (d, ent.get("bytes"))
    if not out:
        raise PlanError(f"{plan_path}: method {method!r} lists no layers.")
    return method, out, doc


def plan_summary(doc, method) -> dict:
    """The plan's own totals for ``method`` from a ``plan.json`` document:
    ``bytes`` (its layers' recorded bytes), ``weights``, ``bits_per_weight``,
    ``budget_bytes`` / ``budget`` / ``budget_bpw`` (None when not recorded),
    ``objective`` and ``requantize``."""
    m = doc["methods"][method]
    rows = m.get("layers") or []
    nb = sum(int(r.get("bytes") or 0) for r in rows)
    nw = m.get("n_weights")
    return {"bytes": nb, "weights": None if nw is None else int(nw),
            "bits_per_weight": (8.0 * nb / int(nw)) if nw else None,
            "budget_bytes": m.get("budget_bytes"), "budget": m.get("budget_frac"),
            "budget_bpw": m.get("budget_bpw"),
            "objective": doc.get("objective_used") or doc.get("objective"),
            "requantize": bool(doc.get("requantize", False))}


def _tool_kv(summary, method) -> dict:
    """The ``opscope.*`` key-values a GGUF export records its plan under."""
    from opscope_nb import __version__
    kv = {"opscope.version": str(__version__), "opscope.plan.method": str(method)}
    for key, val in (("opscope.plan.budget", summary["budget"]),
                     ("opscope.plan.budget_bpw", summary["budget_bpw"]),
                     ("opscope.plan.budget_bytes", summary["budget_bytes"]),
                     ("opscope.plan.bytes", summary["bytes"]),
                     ("opscope.plan.bits_per_weight", summary["bits_per_weight"]),
                     ("opscope.plan.objective", summary["objective"])):
        if val is not None:
            kv[key] = (int(val) if key.endswith("bytes") else
                       str(val) if key.endswith("objective") else float(val))
    kv["opscope.plan.requantize"] = bool(summary["requantize"])
    return kv


#: Outputs of sources of at least this many weights keep room for their header
#: up front, so the data is written once (smaller ones get an exact header).
_RESERVE_FROM = 8 << 20


def _header_reserve(entries, doc) -> int:
    """Bytes to keep for the output's header (``CheckpointWriter(reserve=...)``).

    Generous: per tensor its name up to 8 times (header entries of its arrays,
    their record, its source hash) and 1.7 kB of fixed fields (six arrays'
    dtype, shape, offsets and SHA-256), plus the plan's budget record; under
    1 MB for a 7B model (0.03 % of a 4-bit file).  A header that would not fit
    is written the slow way (a copy), never wrongly.
    """
    if sum(int(e.numel) for e in entries) < _RESERVE_FROM:
        return 0
    budget = json.dumps(doc.get("budget"), default=str)
    return 16384 + 2 * len(budget) + sum(8 * len(e.name) + 1700 for e in entries)


def apply_plan(source, plan_path, out_path, *, method=None, make_progress=None,
               grams=None, force=False, requantize=None, over_budget=False,
               measure=()) -> dict:
    """Compress ``source`` as ``plan.json`` says and write the checkpoint to ``out_path``.

    Parameters
    ----------
    source : str
        The checkpoint the plan was made from (any :func:`opscope_nb.io.open_source` input).
    plan_path : str
        ``plan.json`` from ``profile --out`` / ``allocate --out``.
    out_path : str
        Target ``.safetensors`` (atomic replace), or ``.gguf``: a GGUF file
        from a ``.gguf`` source and a plan of ggml types / dense only
        (:func:`opscope_nb.io.gguf_export.export_gguf`; its report is returned,
        with ``method`` and ``format: "gguf"``).
    method : str or None
        Allocator whose plan to use (default ``exact`` when present, else the first).
    make_progress : callable or None
        ``make_progress(n_tensors, total_elements)`` -> a bar with ``show(i, name)``
        / ``advance(work)`` / ``close()`` (the CLI's stderr bar).
    grams : dict of str -> ndarray, optional
        Calibration grams by tensor name (:func:`opscope_nb.profile.calib.load_grams`),
        needed by planned ``+gptq`` layers; or any object with ``get`` (e.g.
        :class:`opscope_nb.profile.calib.StreamedGrams`; with an ``order_key(name)``
        the tensors are packed in that order).
    force : bool
        Apply even when a planned tensor's stored bytes differ from the
        fingerprint the plan records (``PlanError`` otherwise).
    requantize : bool or None
        Re-quantise a tensor planned in the ggml type it is stored in (from
        its dequantised values, as llama-quantize's ``--allow-requantize``)
        instead of copying its stored blocks.  ``None``: as the plan records
        (``profile --requantize``), else copy.
    over_budget : bool
        Write a plan whose layers take more bytes than its recorded budget
        (``PlanError`` otherwise).
    measure : collection of str
        Planned tensors whose packed option's error is measured on every row
        as it is written (``full_errors`` of the result: ``{name: {"rel_err",
        "out_err"}}``, ``out_err`` with a gram): the tensors a row-sampled
        profile gave estimates for.

    Returns
    -------
    dict
        ``method``, ``layers`` (packed count), ``dense_layers`` (planned dense),
        ``as_stored`` (planned in their stored ggml type, copied),
        ``tensors`` (copied byte for byte as the source stores them, GGUF
        block types and integer tensors included), ``skipped`` (always empty;
        kept for callers), ``source_bytes`` (as stored), ``out_bytes`` (arrays
        written), ``plan_bytes`` (the plan's bytes for its layers),
        ``written_plan_bytes`` (what was written for them), ``plan_weights``,
        ``path``.

    Raises
    ------
    ValueError
        Bad plan; a planned layer missing from the source or of another shape
        (the plan was made for another model); a plan over its budget; bytes
        written for the planned layers more than :data:`BYTES_RTOL` away from
        the plan's.
    """
    method, plan, doc = read_plan(plan_path, method)
    summary = plan_summary(doc, method)
    if requantize is None:
        requantize = summary["requantize"]
    summary["requantize"] = bool(requantize)          # what the file records
    budget = summary["budget_bytes"]
    if budget is not None and summary["bytes"] > int(budget) and not over_budget:
        nw = summary["weights"]
        bpw = (f" ({8 * summary['bytes'] / nw:.3f} vs {8 * int(budget) / nw:.3f} bits per "
               f"weight)" if nw else "")
        raise PlanError(f"{plan_path}: the {method} plan's layers take {summary['bytes']} "
                        f"bytes, over its budget of {int(budget)} bytes{bpw}; re-plan at a "
                        f"budget it meets ('opscope-nb allocate PROFILE.json --budget ...'), "
                        f"or pass --over-budget to write it anyway.")
    src = tio.open_source(source)
    by_name = {e.name: e for e in src.entries}
    expect = 0          # bytes apply writes for the planned layers
    for name, (d, nbytes) in plan.items():
        e = by_name.get(name)
        if e is None:
            raise PlanError(f"{plan_path}: planned layer {name!r} is not in {src.path}; "
                             f"the plan was made for another model.")
        if e.ndim != 2:
            raise PlanError(f"{plan_path}: planned layer {name!r} has shape {e.shape} in "
                             f"{src.path}, not a 2-D weight; the plan is for another model.")
        pb = packed_bytes(e.shape[0], e.shape[1], d)
        copied = d.kind == "dense" or (_same_type(d, e) and not requantize)
        stored = int(e.raw().size) if copied else None
        # dense is priced as stored (plans of before priced it at float32 bytes)
        ok = (pb,) if not copied else (stored, pb)
        if nbytes is not None and int(nbytes) not in ok:
            raise PlanError(f"{plan_path}: planned layer {name!r} ({d.label}, {nbytes} "
                             f"bytes) does not match its shape {e.shape} in {src.path}; the "
                             f"plan was made for another model.")
        expect += stored if copied else pb
    if plan and all(b is not None for _, b in plan.values()) and not _close(
            expect, summary["bytes"]):
        raise PlanError(f"{plan_path}: the {method} plan records {summary['bytes']} bytes "
                        f"for its layers, but they would be written in {expect} bytes (a "
                        f"plan made before dense was priced as stored); re-plan it with "
                        f"'opscope-nb allocate PROFILE.json' and apply that.")
    if os.fspath(out_path).lower().endswith(".gguf"):
        from opscope_nb.io.gguf_export import _check_ggml_plan   # what can go to GGUF, before anything else
        _check_ggml_plan({n: d for n, (d, _) in plan.items()}, f"writing {out_path}")
    recorded = (doc.get("source") or {}).get("sha256")
    if not force:
        # a tensor the plan holds no fingerprint for fails before any work
        lacking = [n for n in plan if (recorded or {}).get(n) is None]
        if lacking:
            _check_fingerprint(lacking[0], "", recorded, plan_path)
    if os.fspath(out_path).lower().endswith(".gguf"):
        if not force:
            hashes = _HashAhead([by_name[n] for n in plan])
            try:
                for n in plan:
                    _check_fingerprint(n, hashes[n], recorded, plan_path)
            finally:
                hashes.close()
        # the GGUF writer checks names, shapes and bytes once more as it writes
        from opscope_nb.io.gguf_export import export_gguf
        r = export_gguf(source, {n: d for n, (d, _) in plan.items()}, out_path,
                        grams=grams, make_progress=make_progress,
                        plan_bytes={n: b for n, (_, b) in plan.items() if b is not None},
                        requantize=bool(requantize), tool_kv=_tool_kv(summary, method),
                        measure=frozenset(measure))
        r.update(method=method, format="gguf", plan_bytes=summary["bytes"],
                 written_plan_bytes=r["plan_tensor_bytes"], requantize=bool(requantize))
        _check_written(r, summary, plan_path, out_path)
        return r
    # grams streamed on demand (calib.StreamedGrams) come block by block: go in that order
    entries = sorted(src.entries, key=lambda e: grams.order_key(e.name)) \
        if hasattr(grams, "order_key") else src.entries
    # every tensor's stored bytes hashed once, on background threads in the
    # order they are written (hashlib releases the GIL): the hashing overlaps
    # the packing, and the fingerprint check and the written record share them
    hashes = _HashAhead(entries)
    try:
        return _write_checkpoint(source, src, entries, plan, doc, summary, method, hashes,
                                 None if force else recorded, plan_path, out_path, grams,
                                 make_progress, requantize, measure)
    finally:
        hashes.close()


def _check_fingerprint(name, sha, recorded, plan_path) -> None:
    """PlanError unless planned tensor ``name``'s stored bytes hash to the
    fingerprint the plan records (:func:`check_fingerprints`' message)."""
    try:
        check_fingerprints([_Hashed(name, sha)], recorded, plan_path)
    except FingerprintError as exc:
        raise PlanError(f"{exc}; apply it to the source it was made from, or pass "
                        f"--force.") from None


def _write_checkpoint(source, src, entries, plan, doc, summary, method, hashes, recorded,
                      plan_path, out_path, grams, make_progress, requantize, measure):
    """The safetensors half of :func:`apply_plan`: ``entries`` packed or copied
    in order into ``out_path``; a planned tensor is checked against
    ``recorded`` (None: ``--force``) before it is packed."""
    w = CheckpointWriter(out_path, reserve=_header_reserve(src.entries, doc))
    sha = {}
    skipped, dense_layers, stored_bytes, kept_as_stored = [], 0, 0, 0
    full_errors = {}
    written = weights = 0
    total = float(sum(e.numel for e in src.entries)) or 1.0
    progress = None if make_progress is None else make_progress(len(src.entries), total)
    # the writer (file writes, its SHA-256 of every array) runs on one thread
    # behind the packing, in order; at most two tensors wait for it
    wq = _WriteQueue()
    scratch = _Scratch()
    try:
        for i, e in enumerate(entries):
            if progress is not None:
                progress.show(i, e.name)
            sha[e.name] = hashes[e.name]   # the stored bytes, as profile.json keys them
            stored_bytes += int(e.raw().size)
            ent = plan.get(e.name)
            if ent is not None and recorded is not None:
                _check_fingerprint(e.name, sha[e.name], recorded, plan_path)
            if ent is not None:
                weights += int(e.numel)
            if ent is not None and _same_type(ent[0], e) and not requantize:
                # planned in the ggml type it is stored in: its stored blocks, unchanged
                raw = np.ascontiguousarray(e.raw()).view(np.uint8).reshape(e.shape[0], -1)
                lin = PackedLinear(ent[0], {"blocks": raw}, e.shape)
                wq.put(w.add_layer, e.name, lin)
                kept_as_stored += 1
                written += int(raw.nbytes)
            elif ent is not None and ent[0].kind != "dense":
                g = None if grams is None or not ent[0].reads_gram else grams.get(e.name)
                lin, err = _pack_one(e, ent[0], g, scratch, src.kind, e.name in measure)
                if err is not None:
                    full_errors[e.name] = err
                wq.put(w.add_layer, e.name, lin)
                written += int(sum(x.nbytes for x in lin.arrays.values()))
                del lin
            else:
                # unplanned (or planned dense): byte for byte as the source stores it
                dense_layers += ent is not None
                if ent is not None:
                    written += int(e.raw().size)
                wq.put(w.add_stored, e, sha[e.name])   # the same bytes: hashed once
            if progress is not None:
                progress.advance(e.numel)
        wq.drain()
        scratch = None
        meta = {"source": {"file": os.path.basename(os.fspath(source)),
                           "kind": src.kind, "n_tensors": len(src.entries)},
                "source_sha256": sha, "source_fingerprint": FINGERPRINT,
                "plan": {"file": os.path.basename(os.fspath(plan_path)), "method": method,
                         "budget": doc.get("budget")}}
        n_layers, n_tensors = len(w.layers), len(w.tensors)
        out_bytes = w._offset
        w.finish(meta)
    except BaseException:
        wq.close()                 # let a write in flight end before the file goes
        w.abort()
        raise
    finally:
        if progress is not None:
            progress.close()
    r = {"method": method, "layers": n_layers, "dense_layers": dense_layers,
         "as_stored": kept_as_stored, "tensors": n_tensors, "skipped": skipped,
         "source_bytes": int(stored_bytes), "out_bytes": int(out_bytes),
         "plan_bytes": summary["bytes"], "written_plan_bytes": written,
         "plan_weights": weights, "requantize": bool(requantize),
         "path": os.fspath(out_path), "full_errors": full_errors}
    _check_written(r, summary, plan_path, out_path)
    return r


class _Hashed:
    """A tensor's name and its already computed fingerprint, as
    :func:`check_fingerprints` reads an entry."""

    __slots__ = ("name", "_sha")

    def __init__(self, name, sha):
        self.name, self._sha = name, sha

    def sha256(self) -> str:
        return self._sha


class _HashAhead:
    """The SHA-256 of every entry's stored bytes (:meth:`TensorEntry.sha256`),
    computed on background threads in the order of ``entries``: by the time
    the writer reaches a tensor its hash is usually done.  ``self[name]``
    waits for one; :meth:`close` cancels what is not started."""

    def __init__(self, entries, workers=None):
        from opscope_nb._threads import worker_count
        entries = list(entries)
        k = max(1, min(worker_count() if workers is None else int(workers), len(entries)))
        self._ex = ThreadPoolExecutor(max_workers=k, thread_name_prefix="opscope-sha")
        self._f = {e.name: self._ex.submit(e.sha256) for e in entries}

    def __getitem__(self, name) -> str:
        return self._f[name].result()

    def close(self) -> None:
        for f in self._f.values():
            f.cancel()
        self._ex.shutdown(wait=True)


class _WriteQueue:
    """Calls run in order on one background thread (file writes and hashing
    release the GIL, so they overlap the next tensor's packing); at most
    ``depth`` calls wait.  A call's exception comes back from the next
    :meth:`put` or :meth:`drain`."""

    def __init__(self, depth=2):
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opscope-write")
        self._q = collections.deque()
        self._depth = depth

    def put(self, fn, *args):
        self._q.append(self._ex.submit(fn, *args))
        while len(self._q) > self._depth:
            self._q.popleft().result()

    def drain(self):
        while self._q:
            self._q.popleft().result()
        self._ex.shutdown(wait=True)

    def close(self):
        for f in self._q:
            f.cancel()
        self._ex.shutdown(wait=True)
        self._q.clear()


class _Scratch:
    """One reusable buffer for the float32 values of the tensor being packed
    (a fresh array per tensor costs its page faults every time)."""

    def __init__(self):
        self._buf = np.empty(0, np.uint32)

    def get(self, shape) -> np.ndarray:
        n = int(np.prod(shape))
        if self._buf.size < n:
            self._buf = np.empty(n, np.uint32)
        return self._buf[:n].reshape(shape)


#: Stored dtypes :func:`_values` widens itself (the stored bytes are the values).
_PLAIN_FLOATS = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def _values(e, scratch, kind):
    """``(w, finite)``: ``e``'s values as float32 ``[rows, cols]`` in ``scratch``
    (one pass over the stored bytes, no temporaries) and whether all are
    finite; ``(None, None)`` for a source the loader must convert."""
    from opscope_nb.formats import ggml as G
    from opscope_nb.kernels import _ggml_quant as K
    dt = _PLAIN_FLOATS.get(str(e.dtype).upper())
    if dt is None or not kind.startswith("safetensors") or e.ndim != 2:
        return None, None
    raw = e.raw()
    item = np.dtype(dt).itemsize
    if raw.size != e.numel * item:
        return None, None
    raw = np.asarray(raw).view(dt).reshape(e.shape)
    buf = scratch.get(e.shape)
    if dt is np.uint16:
        bad = K.widen_bf16_rows(raw, buf)
        return buf.view(np.float32), bad == 0
    w = buf.view(np.float32)
    np.copyto(w, raw, casting="unsafe" if dt is np.float16 else "no")
    return w, G.count_nonfinite(w) == 0


def _pack_one(e, d, gram, scratch, kind, measure):
    """``(PackedLinear, full errors or None)`` of planned tensor ``e`` as ``d``.

    A ggml type from a plain float source takes one pass: the stored bytes
    widened into a reused buffer with the finiteness check, ggml's quantiser
    (the bytes :func:`opscope_nb.formats.pack` gives), and -- when measured,
    without a gram -- the error sums of :func:`option_errors` from the decoded
    rows, a chunk of rows at a time.  Anything else goes through
    :meth:`PackedLinear.pack` and :func:`option_errors` as loaded."""
    w = finite = None
    if d.kind == "ggml" and d.lr is None and d.rounding is None:
        w, finite = _values(e, scratch, kind)
    if w is None or not finite:      # not finite: pack's own check raises its error
        a = e.load()
        lin = PackedLinear.pack(a, d, gram=gram)
        err = option_errors(a, unpack(lin.arrays, d, a.shape), gram) if measure else None
        return lin, err
    from opscope_nb.formats import ggml as G, ggml_importance
    imp = None
    if gram is not None:
        from opscope_nb.formats.gptq import check_gram
        imp = ggml_importance(check_gram(gram, w.shape[1]))
    blocks = G.quantize(w, d.qtype, importance=imp, checked_finite=True)
    lin = PackedLinear(d, {"blocks": blocks}, e.shape)
    if not measure:
        return lin, None
    if gram is not None:
        return lin, option_errors(w, unpack(lin.arrays, d, w.shape), gram)
    return lin, _ggml_errors(w, blocks, d.qtype)


def _ggml_errors(w, blocks, qtype) -> dict:
    """:func:`option_errors` (no gram) of ggml ``blocks`` against ``w``
    (:func:`opscope_nb.formats.ggml.error_sums`: the same float64 sums, each
    row decoded on its own)."""
    from opscope_nb.formats import ggml as G
    from opscope_nb.formats.gptq import output_ratio
    return {"rel_err": output_ratio(*G.error_sums(w, blocks, qtype)), "out_err": None}

def _same_type(d, entry) -> bool:
    """``d`` is the ggml block type ``entry`` is stored in."""
    return d.kind == "ggml" and d.rounding is None and str(entry.dtype).upper() == d.qtype


def _close(got, want) -> bool:
    return abs(int(got) - int(want)) <= BYTES_RTOL * max(int(want), 1)


def _check_written(r, summary, plan_path, out_path):
    """The bytes written for the planned layers against the plan's (within
    :data:`BYTES_RTOL`); PlanError naming both otherwise."""
    if summary["bytes"] and not _close(r["written_plan_bytes"], summary["bytes"]):
        raise PlanError(f"{out_path}: the planned layers were written in "
                        f"{r['written_plan_bytes']} bytes, the plan {plan_path} says "
                        f"{summary['bytes']} (more than {BYTES_RTOL:.1%} apart).")


def check_made_from(source, record: dict) -> None:
    """Raise :class:`opscope_nb.profile.checkpoint.FingerprintError` unless the compressed
    checkpoint whose metadata ``record`` is given was made from ``source`` (every
    source tensor's stored bytes match ``source_sha256``)."""
    if record.get("source_fingerprint") != FINGERPRINT:
        raise FingerprintError("the compressed file records no stored-bytes fingerprint "
                               "of its source (made by an older opscope-nb)")
    src = tio.open_source(source)
    recorded = record.get("source_sha256") or {}
    extra = sorted(set(recorded) - {e.name for e in src.entries})
    if extra:
        raise FingerprintError(f"the compressed file was made from a source with tensor "
                               f"{extra[0]}, which {src.path} lacks")
    check_fingerprints([e for e in src.entries if e.name in recorded] , recorded,
                       "the compressed file")
