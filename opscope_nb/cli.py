"""The ``opscope-nb`` command line (also ``python -m opscope_nb``).

Sub-commands
------------
``profile [SOURCE]``
    Mine every compression option of every selected weight matrix
    (:func:`opscope_nb.mining.profile_layer`), solve the byte budget with the
    greedy, DADO and exact allocators, print the plan; ``--out DIR`` writes
    ``profile.json``, ``plan.json`` and ``options.csv``.
``allocate PROFILE.json``
    Re-solve a saved profile at another budget without touching the weights.
``quant [SOURCE]``
    The upstream ``--quant`` sweep: int8/int4/int3 errors per layer, the
    depth trend, a by-kind table, outlier hotspots and a mixed int4/int8 recipe.
``plot PROFILE.json -o rd.png``
    Per-layer error-vs-bytes points with their lower convex hull, and the
    model-level error-vs-budget frontier of the three allocators.

SOURCE is a ``.safetensors`` / ``.gguf`` / ``.tensor`` file or a directory
of shards / dumps (see :mod:`opscope_nb.io`); without SOURCE the upstream's
seven-layer synthetic model is used (its ``lm_head`` counts as one of its
layers, so ``--include-embeddings`` is not needed for it).

Errors a user can cause (missing or corrupt file, unsupported dtype, bad
regular expression, budget outside (0, 1], missing optional package) print one
line on stderr and exit with status 2; a tensor holding NaN/Inf is reported
and skipped.  Output files are written atomically (temporary file in the same
directory, then :func:`os.replace`), and ``profile.json`` is rewritten after
every layer so an interrupted run keeps its work (``--resume`` continues it).
"""
from __future__ import annotations

import os

# One BLAS thread unless the user says otherwise, set before numpy/scipy load
# OpenBLAS (it reads this once, at load).  The profile runs one layer at a time
# on small-to-medium matrices, partly from numba's parallel threads; OpenBLAS's
# own spinning threads on top of those oversubscribe the cores.  Measured on
# MiniLM here (2 cores, busy machine): 2.6/1.6/4.3 s per 384x384 / 1536x384 /
# 384x1536 layer with the default threads vs 0.25/0.39/0.39 s with one.  Only
# effective when the CLI is the process entry point (numpy not imported yet).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import io as _stdio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from . import __version__
from . import io as tio

__all__ = ["main", "build_parser", "CliError"]

PROG = "opscope-nb"
METHODS = ("greedy", "dado", "exact")
#: Error a "best option" must stay within in the per-layer table (the upstream's 2 %).
TIGHT_ERR = 0.02
PROFILE_FORMAT = 1


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line (exit 2) instead of usage + line."""

    def error(self, message):  # noqa: D401 - argparse API
        raise CliError(f"{message} (see {self.prog} --help)")


# --------------------------------------------------------------------------- #
# small utilities
# --------------------------------------------------------------------------- #
def _budget(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a number in (0, 1]; got {text!r}")
    if not (math.isfinite(v) and 0.0 < v <= 1.0):
        raise argparse.ArgumentTypeError(
            f"budget must lie in (0, 1] (a fraction of the dense size, e.g. 0.35); got {text}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {v}")
    return v


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regular expression ({exc})")
    return text


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (``getrusage``), NaN if unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return float("nan")
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return kb / (1024.0 * 1024.0) if sys.platform == "darwin" else kb / 1024.0


def _umask_mode() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return 0o666 & ~old


_FILE_MODE = _umask_mode()


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory + rename.

    A reader (or a crash) never sees a half-written file: ``os.replace`` is atomic
    on POSIX and Windows when source and target share a file system.
    """
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        os.chmod(tmp, _FILE_MODE)  # mkstemp makes 0600; give the usual umask mode
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _json_text(obj) -> str:
    return json.dumps(obj, indent=1, allow_nan=False, default=_json_default) + "\n"


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return _finite(float(o))
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(v):
    v = float(v)
    return v if math.isfinite(v) else None


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"  # pragma: no cover


def _fmt_err(e) -> str:
    return "-" if e is None or not math.isfinite(e) else f"{e:.4f}"


def _ensure_outdir(path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{path}: cannot create output directory ({exc.strerror or exc}).")
    if not os.access(path, os.W_OK):
        raise CliError(f"{path}: output directory is not writable.")
    return path


def _write(path: str, text: str) -> None:
    try:
        atomic_write(path, text)
    except OSError as exc:
        raise CliError(f"{path}: cannot write ({exc.strerror or exc}).")


def _tabulate(rows, headers, **kw) -> str:
    from tabulate import tabulate
    return tabulate(rows, headers=headers, **kw)


class Progress:
    """One-line progress bar on stderr: ``[####....] i/n name  ETA 12s``.

    ETA extrapolates elapsed time per element processed (layers differ in size).
    Disabled when ``enabled`` is False (``--quiet``, or stderr not a terminal).
    """

    def __init__(self, total_items: int, total_work: float, enabled: bool, stream=None):
        self.n = total_items
        self.work = max(float(total_work), 1.0)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.done_work = 0.0
        self.width = 0

    def show(self, i: int, name: str) -> None:
        if not self.enabled:
            return
        frac = self.done_work / self.work
        el = time.perf_counter() - self.t0
        eta = "ETA  --" if self.done_work <= 0 else \
            f"ETA {el * (1 - frac) / max(frac, 1e-9):5.0f}s"
        bar = "#" * int(20 * frac)
        short = name if len(name) <= 48 else "..." + name[-45:]
        line = f"[{bar:<20}] {i}/{self.n} {short}  {eta}"
        pad = max(self.width - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self.width = len(line)

    def advance(self, work: float) -> None:
        self.done_work += float(work)

    def close(self) -> None:
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- #
# allocation helpers
# --------------------------------------------------------------------------- #
def _methods(arg: str) -> tuple:
    return METHODS if arg == "all" else (arg,)


def run_allocators(layers, budget: float, methods) -> dict:
    """Run each named allocator; returns ``{method: (Allocation, seconds)}``."""
    from . import allocate as al
    fns = {"greedy": al.greedy_allocate, "dado": al.dado_allocate,
           "exact": al.exact_allocate}
    out = {}
    for m in methods:
        t = time.perf_counter()
        a = fns[m](layers, budget)
        out[m] = (a, time.perf_counter() - t)
    return out


def plan_table(layers, allocs: dict) -> str:
    """Per-layer table: shape, best option within 2 %, each method's choice."""
    headers = ["layer", "shape", "dense", f"best <= {TIGHT_ERR:.0%} (err)"]
    for m in allocs:
        headers += [f"{m} (err)", "bytes"]
    rows = []
    for i, lp in enumerate(layers):
        best = lp.best_within(TIGHT_ERR)
        row = [lp.name, f"{lp.rows}x{lp.cols}", _fmt_bytes(lp.dense_bytes),
               f"{best.decomp.label} ({best.rel_err:.4f})"]
        for m, (a, _) in allocs.items():
            o = lp.options[a.choice[i]]
            row += [f"{o.decomp.label} ({_fmt_err(o.rel_err)})", _fmt_bytes(o.bytes)]
        rows.append(row)
    return _tabulate(rows, headers, disable_numparse=True)


def totals_table(allocs: dict, n_layers: int) -> str:
    headers = ["method", "total err", "mean err", "bytes", "budget", "compression",
               "feasible", "lower bound", "gap", "time"]
    rows = []
    for m, (a, sec) in allocs.items():
        rows.append([m, _fmt_err(a.total_err), _fmt_err(a.total_err / max(n_layers, 1)),
                     _fmt_bytes(a.total_bytes), _fmt_bytes(a.budget_bytes),
                     f"{a.compression():.2f}x", "yes" if a.feasible else "NO",
                     _fmt_err(a.lower_bound),
                     "-" if not math.isfinite(a.gap) else f"{a.gap:.2%}",
                     f"{sec * 1e3:.0f} ms"])
    return _tabulate(rows, headers, disable_numparse=True)


def plan_dict(layers, allocs: dict, budget: float, source=None) -> dict:
    """The ``plan.json`` document."""
    dense = int(sum(int(lp.dense_bytes) for lp in layers))
    doc = {"tool": PROG, "version": __version__, "budget": budget,
           "dense_bytes": dense, "n_layers": len(layers), "methods": {}}
    if source is not None:
        doc["source"] = source
    for m, (a, sec) in allocs.items():
        d = a.to_dict()
        d["layers"] = [{"name": lp.name, "option": int(c), "label": lp.options[c].decomp.label,
                        "rel_err": float(lp.options[c].rel_err),
                        "bytes": int(lp.options[c].bytes),
                        "flops": int(lp.options[c].flops)}
                       for lp, c in zip(layers, a.choice)]
        d["seconds"] = sec
        doc["methods"][m] = d
    return doc


OPTIONS_CSV_COLUMNS = ("layer", "index", "kind", "rows", "cols", "option", "label",
                       "decomp", "rel_err", "bytes", "flops", "dense_bytes", "bytes_frac")


def options_csv(layers) -> str:
    """Tidy CSV: one row per layer x option (loads into pandas as is)."""
    from .mining import parse_layer_kind
    buf = _stdio.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(OPTIONS_CSV_COLUMNS)
    for lp in layers:
        idx, kind = parse_layer_kind(lp.name)
        for j, o in enumerate(lp.options):
            kd = o.decomp.to_dict()
            w.writerow([lp.name, "" if idx is None else idx, kind, lp.rows, lp.cols, j,
                        o.decomp.label, kd.get("kind", ""),
                        repr(float(o.rel_err)), int(o.bytes), int(o.flops),
                        int(lp.dense_bytes), repr(o.bytes / max(lp.dense_bytes, 1))])
    return buf.getvalue()


def _timing_split(layer_timings) -> dict:
    """Sum the per-layer ``LayerProfile.timings`` dicts phase by phase."""
    tot: dict = {}
    for t in layer_timings:
        for k, v in (t or {}).items():
            try:
                tot[k] = tot.get(k, 0.0) + float(v)
            except (TypeError, ValueError):
                continue
    return tot


# --------------------------------------------------------------------------- #
# profile.json
# --------------------------------------------------------------------------- #
def _load_profile_doc(path: str) -> dict:
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file.")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise CliError(f"{path}: cannot read ({exc.strerror or exc}).")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"{path}: not valid JSON ({exc}); is it an opscope-nb profile.json?")
    if not (isinstance(doc, dict) and doc.get("tool") == PROG
            and isinstance(doc.get("layers"), list)):
        raise CliError(f"{path}: not an opscope-nb profile.json (write one with "
                       f"'{PROG} profile SOURCE --out DIR').")
    return doc


def _layers_from_doc(doc: dict, path: str) -> list:
    from .mining import LayerProfile
    out = []
    for i, rec in enumerate(doc["layers"]):
        try:
            lp = LayerProfile.from_dict(rec["profile"])
            if not lp.options:
                raise ValueError("no options")
        except (KeyError, TypeError, ValueError) as exc:
            raise CliError(f"{path}: layer {i} is malformed ({type(exc).__name__}: {exc}).")
        out.append(lp)
    if not out:
        raise CliError(f"{path}: the profile holds no layers.")
    return out


def _allocate_saved(layers, budget, methods, path) -> dict:
    """run_allocators on layers read from a user's file: bad numbers are user errors."""
    try:
        return run_allocators(layers, budget, methods)
    except (ValueError, TypeError) as exc:
        raise CliError(f"{path}: cannot allocate this profile ({exc}).")


def _profile_doc(source, settings, records, skipped, t_start, complete) -> dict:
    timings = _timing_split(r["profile"].get("timings") for r in records)
    return {
        "tool": PROG, "version": __version__, "format": PROFILE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source, "settings": settings, "complete": complete,
        "n_layers": len(records),
        "dense_bytes": int(sum(r["profile"]["dense_bytes"] for r in records)),
        "layers": records, "skipped": skipped,
        "timings": {"wall_seconds": time.perf_counter() - t_start,
                    "profile_seconds": sum(r.get("seconds", 0.0) for r in records),
                    "load_seconds": sum(r.get("load_seconds", 0.0) for r in records),
                    "phases": timings},
        "peak_rss_mb": _finite(peak_rss_mb()),
    }


def _source_info(src: tio.TensorSource) -> dict:
    path = src.path if src.kind == "synthetic" else os.path.abspath(src.path)
    return {"path": path, "kind": src.kind, "n_tensors": len(src.entries)}


# --------------------------------------------------------------------------- #
# commands
# --------------------------------------------------------------------------- #
def _open_and_select(args):
    src = tio.open_source(args.source)
    chosen, skipped = tio.select(src, include=args.include, exclude=args.exclude,
                                 include_embeddings=args.include_embeddings)
    if not chosen:
        raise CliError(f"{src.path}: no 2-D weight matrices selected out of "
                       f"{len(src.entries)} tensors (check --include/--exclude, or "
                       f"--include-embeddings).")
    return src, chosen, skipped


def _load_checked(entry):
    """Load one tensor; return (w, None) or (None, reason) when it holds NaN/Inf."""
    w = entry.load()
    finite = np.isfinite(w)
    if not finite.all():
        bad = int(w.size - np.count_nonzero(finite))
        return None, f"{bad} NaN/Inf value(s) out of {w.size}"
    return w, None


def cmd_profile(args) -> int:
    src, chosen, skipped_sel = _open_and_select(args)
    from .mining import LayerProfile, profile_layer
    settings = {"rank_cap": args.rank_cap, "seed": args.seed, "budget": args.budget,
                "include": args.include, "exclude": args.exclude,
                "include_embeddings": args.include_embeddings}
    source = _source_info(src)
    out = _ensure_outdir(args.out) if args.out else None
    if args.resume and not out:
        raise CliError("--resume needs --out DIR (it continues DIR/profile.json).")
    prof_path = os.path.join(out, "profile.json") if out else None

    previous = {}
    if args.resume and os.path.exists(prof_path):
        doc = _load_profile_doc(prof_path)
        old = doc.get("settings", {})
        if (old.get("rank_cap"), old.get("seed")) != (args.rank_cap, args.seed):
            _warn(f"{prof_path} was made with rank_cap={old.get('rank_cap')}, "
                  f"seed={old.get('seed')}; re-profiling every layer.")
        else:
            for rec in doc["layers"]:
                try:
                    previous[(rec["name"], tuple(rec["shape"]))] = rec
                except (KeyError, TypeError):
                    continue

    skipped = [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "reason": r}
               for e, r in skipped_sel]
    records, layers = [], []
    t_start = time.perf_counter()
    show = (not args.quiet) and sys.stderr.isatty()
    bar = Progress(len(chosen), sum(e.numel for e in chosen), show)
    reused = 0
    try:
        for i, e in enumerate(chosen, 1):
            bar.show(i, e.name)
            key = (e.name, tuple(e.shape))
            if key in previous:
                rec = previous[key]
                try:
                    lp = LayerProfile.from_dict(rec["profile"])
                except (KeyError, TypeError, ValueError):
                    lp = None
                if lp is not None:
                    records.append(rec)
                    layers.append(lp)
                    reused += 1
                    bar.advance(e.numel)
                    continue
            t0 = time.perf_counter()
            w, why = _load_checked(e)
            t_load = time.perf_counter() - t0
            if w is None:
                bar.close()
                _warn(f"skipping {e.name}: {why}.")
                skipped.append({"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
                                "reason": why})
                bar.advance(e.numel)
                continue
            t1 = time.perf_counter()
            lp = profile_layer(e.name, w, rank_cap=args.rank_cap, seed=args.seed)
            del w
            rec = {"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
                   "file": os.path.abspath(e.path) if e.path != "synthetic" else e.path,
                   "load_seconds": t_load, "seconds": time.perf_counter() - t1,
                   "profile": lp.to_dict()}
            records.append(rec)
            layers.append(lp)
            bar.advance(e.numel)
            if prof_path:
                # keep the still-valid saved layers not reached yet, so an interrupt
                # during a resumed run loses nothing either
                later = [previous[k] for k in ((x.name, tuple(x.shape)) for x in chosen[i:])
                         if k in previous]
                _write(prof_path, _json_text(_profile_doc(source, settings,
                                                          records + later, skipped,
                                                          t_start, False)))
    finally:
        bar.close()

    if not layers:
        raise CliError(f"{src.path}: every selected tensor was skipped (NaN/Inf); "
                       f"nothing to allocate.")
    allocs = run_allocators(layers, args.budget, _methods(args.method))
    rss = peak_rss_mb()
    wall = time.perf_counter() - t_start

    print(plan_table(layers, allocs))
    print()
    print(totals_table(allocs, len(layers)))
    dense = sum(int(lp.dense_bytes) for lp in layers)
    phases = _timing_split(r["profile"].get("timings") for r in records)
    split = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(phases.items(),
                                                         key=lambda kv: -kv[1]))
    print()
    print(f"{len(layers)} layers ({reused} resumed, {len(skipped)} tensors skipped), "
          f"dense {_fmt_bytes(dense)}, budget {args.budget:g} = "
          f"{_fmt_bytes(math.floor(args.budget * dense))}; "
          f"wall {wall:.1f}s, peak RSS {rss:.0f} MiB")
    if split:
        print(f"profile time split: {split}")

    if out:
        _write(prof_path, _json_text(_profile_doc(source, settings, records, skipped,
                                                  t_start, True)))
        _write(os.path.join(out, "plan.json"),
               _json_text(plan_dict(layers, allocs, args.budget, source)))
        _write(os.path.join(out, "options.csv"), options_csv(layers))
        print(f"wrote {prof_path}, plan.json, options.csv")
    return 0


def cmd_allocate(args) -> int:
    doc = _load_profile_doc(args.profile)
    layers = _layers_from_doc(doc, args.profile)
    allocs = _allocate_saved(layers, args.budget, _methods(args.method), args.profile)
    print(plan_table(layers, allocs))
    print()
    print(totals_table(allocs, len(layers)))
    if args.out:
        out = _ensure_outdir(args.out)
        p = os.path.join(out, "plan.json")
        _write(p, _json_text(plan_dict(layers, allocs, args.budget, doc.get("source"))))
        print(f"wrote {p}")
    return 0


def _depth_verdict(early: float, late: float) -> str:
    if late > early * 1.05:
        return "late layers quantise worse (> +5 %)"
    if late < early * 0.95:
        return "late layers quantise better (< -5 %)"
    return "flat (within +-5 %)"


def cmd_quant(args) -> int:
    src, chosen, _ = _open_and_select(args)
    from .mining import parse_layer_kind, quant_stat
    show = (not args.quiet) and sys.stderr.isatty()
    bar = Progress(len(chosen), sum(e.numel for e in chosen), show)
    stats = []   # (entry, idx, kind, QuantStat)
    try:
        for i, e in enumerate(chosen, 1):
            bar.show(i, e.name)
            w, why = _load_checked(e)
            bar.advance(e.numel)
            if w is None:
                bar.close()
                _warn(f"skipping {e.name}: {why}.")
                continue
            idx, kind = parse_layer_kind(e.name)
            stats.append((e, idx, kind, quant_stat(e.name, w, args.bits_budget)))
            del w
    finally:
        bar.close()
    if not stats:
        raise CliError(f"{src.path}: every selected tensor was skipped (NaN/Inf).")

    def bits(b):
        return "-" if b is None else str(int(b))

    rows = [[e.name, "" if idx is None else idx, kind, f"{e.shape[0]}x{e.shape[1]}",
             _fmt_err(q.int8_pt), _fmt_err(q.int8_pc), _fmt_err(q.int4_pc),
             _fmt_err(q.int3_pc), f"{q.outlier:.1f}", bits(q.best_bits)]
            for e, idx, kind, q in stats]
    print(_tabulate(rows, ["layer", "idx", "kind", "shape", "int8/tensor", "int8/chan",
                           "int4/chan", "int3/chan", "outlier", "best bits"],
                    disable_numparse=True))
    print(f"(best bits: fewest of 3/4/6/8 with per-channel error < {args.bits_budget:g}; "
          f"outlier: max/median column max-abs)")

    # depth trend: early third vs late third of the block indices
    idxs = sorted({idx for _, idx, _, _ in stats if idx is not None})
    print()
    if len(idxs) >= 3:
        n = idxs[-1] + 1
        early = [q.int4_pc for _, idx, _, q in stats if idx is not None and idx < n / 3]
        late = [q.int4_pc for _, idx, _, q in stats if idx is not None and idx >= 2 * n / 3]
        by_depth = []
        for d in idxs:
            qs = [q for _, idx, _, q in stats if idx == d]
            by_depth.append([d, len(qs), _fmt_err(np.mean([q.int8_pc for q in qs])),
                             _fmt_err(np.mean([q.int4_pc for q in qs]))])
        print(_tabulate(by_depth, ["block", "layers", "mean int8/chan", "mean int4/chan"],
                        disable_numparse=True))
        e_m, l_m = float(np.mean(early)), float(np.mean(late))
        print(f"depth trend: int4/chan early third {e_m:.4f} vs late third {l_m:.4f} "
              f"({(l_m / max(e_m, 1e-12) - 1):+.1%}): {_depth_verdict(e_m, l_m)}")
    else:
        print("depth trend: fewer than 3 block indices in the names; no trend.")

    # by kind, weighted by parameter count
    kinds: dict = {}
    for e, _, kind, q in stats:
        kinds.setdefault(kind, []).append((e.numel, q))
    krows = []
    for kind, items in kinds.items():
        p = np.array([n for n, _ in items], dtype=np.float64)
        wavg = lambda f: float(np.dot(p, [f(q) for _, q in items]) / p.sum())  # noqa: E731
        krows.append((p.sum(), [kind, len(items), f"{int(p.sum()):,}",
                                _fmt_err(wavg(lambda q: q.int8_pc)),
                                _fmt_err(wavg(lambda q: q.int4_pc)),
                                _fmt_err(wavg(lambda q: q.int3_pc)),
                                f"{max(q.outlier for _, q in items):.1f}"]))
    krows.sort(key=lambda t: -t[0])
    print()
    print(_tabulate([r for _, r in krows],
                    ["kind", "layers", "params", "int8/chan", "int4/chan", "int3/chan",
                     "max outlier"], disable_numparse=True))
    print("(errors weighted by parameter count)")

    # outlier hotspots
    top = sorted(stats, key=lambda t: -t[3].outlier)[:5]
    print()
    print(_tabulate([[e.name, f"{q.outlier:.1f}", _fmt_err(q.int8_pc), _fmt_err(q.int4_pc)]
                     for e, _, _, q in top],
                    ["outlier hotspot", "max/median", "int8/chan", "int4/chan"],
                    disable_numparse=True))

    # mixed int4/int8 recipe; bytes are honest: packed codes + one float32 scale per row
    n4 = n8 = 0
    size = dense = 0
    err_w = 0.0
    params = 0
    for e, _, _, q in stats:
        r, c = e.shape
        dense += 4 * r * c
        params += r * c
        if q.int4_pc <= args.budget:
            n4 += 1
            size += r * ((c + 1) // 2) + 4 * r
            err_w += r * c * q.int4_pc
        else:
            n8 += 1
            size += r * c + 4 * r
            err_w += r * c * q.int8_pc
    print()
    print(f"mixed recipe (int4/chan where its error <= {args.budget:g}, else int8/chan): "
          f"{n4} layers int4, {n8} int8; {_fmt_bytes(size)} vs {_fmt_bytes(dense)} f32 "
          f"({dense / max(size, 1):.2f}x smaller, {size / max(dense, 1):.1%} of dense), "
          f"parameter-weighted error {err_w / max(params, 1):.4f}")
    print(f"peak RSS {peak_rss_mb():.0f} MiB")
    return 0


def lower_hull(points):
    """Lower-left convex hull of (bytes, err) points: the Pareto-efficient convex frontier.

    Returns the hull vertices sorted by bytes with strictly decreasing error.
    """
    pts = sorted(set((float(b), float(e)) for b, e in points))
    hull = []
    for p in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    # keep the decreasing part (points past the minimum error are dominated)
    out = []
    for p in hull:
        if out and p[1] >= out[-1][1]:
            break
        out.append(p)
    return out


def cmd_plot(args) -> int:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("plot needs the optional 'matplotlib' package: "
                       "pip install 'opscope-nb[plot]' (or pip install matplotlib).")
    doc = _load_profile_doc(args.profile)
    layers = _layers_from_doc(doc, args.profile)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"{args.output}: directory {out_dir} does not exist.")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    cmap = plt.get_cmap("viridis")
    for i, lp in enumerate(layers):
        col = cmap(i / max(len(layers) - 1, 1))
        pts = [(o.bytes / lp.dense_bytes, o.rel_err) for o in lp.options]
        ax1.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color=col, alpha=0.7,
                    linewidths=0)
        h = lower_hull(pts)
        ax1.plot([p[0] for p in h], [p[1] for p in h], color=col, lw=0.8, alpha=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("bytes / dense bytes (log scale; hulls taken in linear bytes)")
    ax1.set_ylabel("relative Frobenius error")
    ax1.set_title(f"{len(layers)} layers: options and lower convex hulls")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, max(len(layers) - 1, 1)))
    fig.colorbar(sm, ax=ax1, label="layer (profile order)")
    ax1.grid(True, which="both", alpha=0.3)

    budgets = [round(b, 2) for b in np.arange(0.10, 1.0001, 0.05)]
    styles = {"greedy": ("o-", "tab:orange"), "dado": ("s--", "tab:green"),
              "exact": ("^-", "tab:blue")}
    n = len(layers)
    for m in METHODS:
        xs, ys = [], []
        for b in budgets:
            a = _allocate_saved(layers, b, (m,), args.profile)[m][0]
            if a.feasible:
                xs.append(b)
                ys.append(a.total_err / n)
        mk, col = styles[m]
        ax2.plot(xs, ys, mk, color=col, ms=4, lw=1.2, label=m)
    ax2.set_xlabel("budget (fraction of dense bytes)")
    ax2.set_ylabel("mean relative error per layer")
    ax2.set_title("model frontier: error vs budget")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    src = (doc.get("source") or {}).get("path", "")
    fig.suptitle(f"opscope-nb rate-distortion: {os.path.basename(str(src)) or src}")
    fig.tight_layout()
    # atomic: render to a temp file in the target dir, then rename
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".plot.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=args.dpi, format="png")
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, args.output)
    except OSError as exc:
        raise CliError(f"{args.output}: cannot write ({exc.strerror or exc}).")
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {args.output}")
    return 0


# --------------------------------------------------------------------------- #
# parser and entry point
# --------------------------------------------------------------------------- #
def _add_source_args(p):
    p.add_argument("source", nargs="?", default=None, metavar="SOURCE",
                   help="a .safetensors / .gguf / .tensor file or a directory of "
                        "shards or dumps; omitted: the built-in 7-layer synthetic model")
    p.add_argument("--include", type=_regex, metavar="REGEX",
                   help="only tensors whose name matches (re.search)")
    p.add_argument("--exclude", type=_regex, metavar="REGEX",
                   help="drop tensors whose name matches (re.search)")
    p.add_argument("--include-embeddings", action="store_true",
                   help="also profile embedding tables and lm_head / output.weight")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _add_method(p):
    p.add_argument("--method", choices=(*METHODS, "all"), default="all",
                   help="allocator(s) to run (default: all)")


def build_parser() -> argparse.ArgumentParser:
    """The ``opscope-nb`` argument parser."""
    p = _Parser(prog=PROG, description="Which compression fits each weight matrix, and "
                "which mix fits a memory budget.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    pr = sub.add_parser("profile", help="mine every option per layer and solve a budget")
    _add_source_args(pr)
    pr.add_argument("--budget", type=_budget, default=0.35,
                    help="byte budget as a fraction of dense (0, 1] (default 0.35)")
    _add_method(pr)
    pr.add_argument("--rank-cap", type=_positive_int, default=48,
                    help="top singular values computed per layer (default 48)")
    pr.add_argument("--seed", type=_nonneg_int, default=0, help="randomised SVD seed")
    pr.add_argument("--out", metavar="DIR",
                    help="write profile.json, plan.json and options.csv here")
    pr.add_argument("--resume", action="store_true",
                    help="reuse layers already in DIR/profile.json (same name and shape)")
    pr.set_defaults(func=cmd_profile)

    al = sub.add_parser("allocate", help="re-solve a saved profile.json at a budget")
    al.add_argument("profile", metavar="PROFILE.json")
    al.add_argument("--budget", type=_budget, default=0.35,
                    help="byte budget as a fraction of dense (0, 1] (default 0.35)")
    _add_method(al)
    al.add_argument("--out", metavar="DIR", help="write plan.json here")
    al.set_defaults(func=cmd_allocate)

    qu = sub.add_parser("quant", help="int8/int4/int3 sweep with a mixed-precision recipe")
    _add_source_args(qu)
    qu.add_argument("--budget", type=_budget, default=0.1,
                    help="int4/chan error allowed in the mixed recipe (default 0.1)")
    qu.add_argument("--bits-budget", type=_budget, default=0.03,
                    help="error target of the 'best bits' column (default 0.03)")
    qu.set_defaults(func=cmd_quant)

    pl = sub.add_parser("plot", help="rate-distortion plot of a saved profile.json")
    pl.add_argument("profile", metavar="PROFILE.json")
    pl.add_argument("-o", "--output", default="rd.png", metavar="PNG",
                    help="output image (default rd.png)")
    pl.add_argument("--dpi", type=_positive_int, default=110)
    pl.set_defaults(func=cmd_plot)
    return p


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 user error, 130 interrupted)."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (CliError, tio.SourceError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted (profile.json keeps the layers done; "
              f"rerun with --resume)", file=sys.stderr)
        return 130
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BrokenPipeError:  # e.g. `opscope-nb profile | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
