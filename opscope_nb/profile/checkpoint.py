"""The per-tensor profiling pipeline that the serial ``profile`` command and
the Dask workers both run, and the ``profile.json`` document it fills.

* :func:`load_checked` -- load one selected tensor, or say why it is skipped;
* :func:`profile_entry` -- load, check and :func:`~opscope_nb.profile.mining.profile_layer`
  one tensor into its ``profile.json`` record;
* :func:`profile_doc` -- the whole ``profile.json`` document.

Layer 3 (imports :mod:`opscope_nb.profile.mining`, :mod:`opscope_nb.io`,
:mod:`opscope_nb.io._fs`); :mod:`opscope_nb.distributed` and :mod:`opscope_nb.cli`
build on it.
"""
from __future__ import annotations

import os
import time

import numpy as np

from opscope_nb import __version__
from opscope_nb import io as tio
from . import mining
from opscope_nb.io._fs import peak_rss_mb

__all__ = ["TOOL", "PROFILE_FORMAT", "load_checked", "profile_entry", "profile_doc",
           "timing_split", "source_files", "result_settings", "FingerprintError",
           "check_fingerprints"]

#: ``profile.json``'s ``tool`` field (the command's name).
TOOL = "opscope-nb"
#: ``profile.json``'s ``format`` version.
PROFILE_FORMAT = 1


def load_checked(entry):
    """Load one tensor; returns ``(w, None)``, or ``(None, reason)`` to skip it.

    Skipped (not fatal): a tensor whose stored dtype is not a float format (an
    integer ``qweight`` / ``I8`` buffer, an undecodable GGUF type) and a tensor
    holding NaN/Inf.  A truncated or unreadable file stays a fatal error.
    """
    try:
        w = entry.load()
    except tio.UnsupportedDtypeError:
        return None, f"dtype {entry.dtype} is not a float weight format"
    finite_mask = np.isfinite(w)
    if not finite_mask.all():
        bad = int(w.size - np.count_nonzero(finite_mask))
        return None, f"{bad} NaN/Inf value(s) out of {w.size}"
    return w, None


def profile_entry(e, kw):
    """Load, check and profile one selected tensor.

    Parameters
    ----------
    e : opscope_nb.io.TensorEntry
    kw : dict or callable(name) -> dict
        :func:`opscope_nb.profile.mining.profile_layer` keyword arguments (a callable
        gives per-layer ones, e.g. the layer's calibration gram).

    Returns
    -------
    (record, LayerProfile, None), or (None, None, reason) when the tensor is
    skipped (NaN/Inf, non-float dtype; see :func:`load_checked`).
    """
    if callable(kw):
        kw = kw(e.name)
    t0 = time.perf_counter()
    w, why = load_checked(e)
    t_load = time.perf_counter() - t0
    if w is None:
        return None, None, why
    sha = e.sha256()          # the stored bytes' fingerprint (resume/apply/eval check it)
    t1 = time.perf_counter()
    kw = dict(kw)
    kw.setdefault("stored_dtype", e.dtype)
    lp = mining.profile_layer(e.name, w, **kw)
    del w
    rec = {"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
           "file": os.path.abspath(e.path) if e.path != "synthetic" else e.path,
           "sha256": sha, "load_seconds": t_load, "seconds": time.perf_counter() - t1,
           "profile": lp.to_dict()}
    return rec, lp, None


def timing_split(layer_timings) -> dict:
    """Sum the per-layer ``LayerProfile.timings`` dicts phase by phase."""
    tot: dict = {}
    for t in layer_timings:
        for k, v in (t or {}).items():
            try:
                tot[k] = tot.get(k, 0.0) + float(v)
            except (TypeError, ValueError):
                continue
    return tot


def profile_doc(source, settings, records, skipped, t_start, complete) -> dict:
    """The ``profile.json`` document.

    Parameters
    ----------
    source : dict
        ``path``, ``kind``, ``n_tensors`` of the checkpoint.
    settings : dict
        The run's settings (what a resume compares).
    records : list of dict
        :func:`profile_entry` records in source order.
    skipped : list of dict
        Skipped tensors (``name``, ``shape``, ``dtype``, ``reason``).
    t_start : float
        ``time.perf_counter()`` at the start of the run.
    complete : bool
        Whether every selected tensor is in ``records``.
    """
    timings = timing_split(r["profile"].get("timings") for r in records)
    rss = peak_rss_mb()
    source = dict(source)
    source["sha256"] = {r["name"]: r["sha256"] for r in records if r.get("sha256")}
    return {
        "tool": TOOL, "version": __version__, "format": PROFILE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source, "settings": settings, "complete": complete,
        "n_layers": len(records),
        "dense_bytes": int(sum(r["profile"]["dense_bytes"] for r in records)),  # as stored
        "f32_bytes": int(sum(4 * r["profile"]["rows"] * r["profile"]["cols"] for r in records)),
        "layers": records, "skipped": skipped,
        "timings": {"wall_seconds": time.perf_counter() - t_start,
                    "profile_seconds": sum(r.get("seconds", 0.0) for r in records),
                    "load_seconds": sum(r.get("load_seconds", 0.0) for r in records),
                    "phases": timings},
        "peak_rss_mb": rss if np.isfinite(rss) else None,
    }


class FingerprintError(ValueError):
    """A result does not belong to this source (a tensor's stored bytes differ
    from the fingerprint recorded with it)."""


def source_files(src) -> list:
    """``[{path, size, mtime_ns}]`` of the files a source reads (none for the
    synthetic model), for ``profile.json`` / ``plan.json``."""
    out = []
    for p in sorted({e.path for e in src.entries if e.path != "synthetic"}):
        st = os.stat(p)
        out.append({"path": os.path.abspath(p), "size": int(st.st_size),
                    "mtime_ns": int(st.st_mtime_ns)})
    return out


#: Settings keys that are run facts, not choices that change results.
_RUN_FACTS = ("wall_seconds", "seconds", "load_seconds", "distributed")


def result_settings(settings: dict) -> dict:
    """The part of a run's settings that changes the profiled results: every
    key but the budget (it only steers allocation), the selection (resume
    matches layers one by one) and run facts such as timings."""
    skip = {"budget", "bpw", "include", "exclude", "include_embeddings", *_RUN_FACTS}

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k not in _RUN_FACTS}
        return v
    return {k: clean(v) for k, v in (settings or {}).items() if k not in skip}


def check_fingerprints(entries, recorded: dict, what: str) -> None:
    """Raise :class:`FingerprintError` naming the first tensor whose stored bytes
    (:meth:`opscope_nb.io.TensorEntry.sha256`) differ from ``recorded[name]``
    (or that ``recorded`` lacks); ``what`` names the result being checked."""
    for e in entries:
        want = (recorded or {}).get(e.name)
        if want is None:
            raise FingerprintError(f"{what} has no fingerprint for {e.name}; it was made "
                                   f"from another source or by an older opscope-nb")
        if e.sha256() != want:
            raise FingerprintError(f"{e.name} differs from the tensor {what} was made "
                                   f"from (SHA-256 of its stored bytes)")
