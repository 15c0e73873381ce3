"""Shared pieces of the command line: errors, argument types, output files, tables,
the progress bar and the checkpoint/profile readers every command uses.

Nothing here prints except :func:`warn` and :class:`Progress`; commands format
their own tables with :func:`tabulate_rows`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import numpy as np

from opscope_nb import __version__
from opscope_nb.io._fs import atomic_write, peak_rss_mb  # noqa: F401  (used by the commands)
from opscope_nb.profile.checkpoint import PROFILE_FORMAT, TOOL, load_checked, timing_split  # noqa: F401
from opscope_nb import io as tio

PROG = TOOL


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line (exit 2) instead of usage + line."""

    def error(self, message):  # noqa: D401 - argparse API
        raise CliError(f"{message} (see {self.prog} --help)")


# --------------------------------------------------------------------------- #
# argument types
# --------------------------------------------------------------------------- #
def budget_arg(text: str) -> float:
    """A fraction in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a number in (0, 1]; got {text!r}")
    if not (math.isfinite(v) and 0.0 < v <= 1.0):
        raise argparse.ArgumentTypeError(
            f"budget must lie in (0, 1] (a fraction of the dense size, e.g. 0.35); got {text}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    if not (math.isfinite(v) and v > 0.0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0; got {text}")
    return v


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}")
    if not (math.isfinite(v) and v >= 0.0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0; got {text}")
    return v


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {v}")
    return v


def nonneg_int(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {v}")
    return v


def int_list(text: str) -> tuple:
    """Comma-separated positive integers, e.g. ``1,32`` -> ``(1, 32)``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,32; got {text!r}")
    out = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected positive integers like 1,32; got {text!r}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"every value must be >= 1; got {v} in {text!r}")
        out.append(v)
    return tuple(sorted(set(out)))


def regex_arg(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regular expression ({exc})")
    return text


def add_source_args(p) -> None:
    """SOURCE plus --include/--exclude/--include-embeddings/--quiet."""
    p.add_argument("source", nargs="?", default=None, metavar="SOURCE",
                   help="a .safetensors / .gguf / .tensor file or a directory of "
                        "shards or dumps; omitted: the built-in 7-layer synthetic model")
    p.add_argument("--include", type=regex_arg, metavar="REGEX",
                   help="only tensors whose name matches (re.search)")
    p.add_argument("--exclude", type=regex_arg, metavar="REGEX",
                   help="drop tensors whose name matches (re.search)")
    p.add_argument("--include-embeddings", action="store_true",
                   help="also profile embedding tables and lm_head / output.weight")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


# --------------------------------------------------------------------------- #
# process facts, files, formatting
# --------------------------------------------------------------------------- #


def json_text(obj) -> str:
    """Indented strict JSON (non-finite floats are an error, numpy scalars converted)."""
    return json.dumps(obj, indent=1, allow_nan=False, default=_json_default) + "\n"


_LIST_MARK = "\x00opscope-list\x00"


def json_text_reusing(obj: dict, key: str, cache: dict) -> str:
    """:func:`json_text` of ``obj``, byte for byte, with the items of its
    top-level list ``obj[key]`` encoded once per object: ``cache`` (a dict the
    caller keeps between calls) maps ``id(item)`` to ``(item, text)``.

    ``profile`` rewrites ``profile.json`` after every layer (an interrupt loses
    nothing) and the indented encoder is pure Python: re-encoding every
    earlier layer each time grew with the square of the layer count.  Items
    must not change after their first encoding."""
    items = obj[key]
    if not items:
        return json_text(obj)
    head = json.dumps(dict(obj, **{key: _LIST_MARK}), indent=1, allow_nan=False,
                      default=_json_default)
    parts = []
    for it in items:
        hit = cache.get(id(it))
        if hit is None or hit[0] is not it:
            text = json.dumps(it, indent=1, allow_nan=False, default=_json_default)
            # a list item of a top-level key sits two levels deep (JSON strings
            # hold no raw newline, so every line is a line of the layout)
            hit = cache[id(it)] = (it, "\n".join("  " + ln for ln in text.split("\n")))
        parts.append(hit[1])
    body = "[\n" + ",\n".join(parts) + "\n ]"
    return head.replace(json.dumps(_LIST_MARK), body, 1) + "\n"


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return finite(float(o))
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def finite(v):
    """``float(v)`` or ``None`` when it is not finite (JSON has no NaN)."""
    v = float(v)
    return v if math.isfinite(v) else None


def fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_err(e) -> str:
    return "-" if e is None or not math.isfinite(e) else f"{e:.4f}"


def fmt_us(v) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.1f} us"


def ensure_outdir(path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{path}: cannot create output directory ({exc.strerror or exc}).")
    if not os.access(path, os.W_OK):
        raise CliError(f"{path}: output directory is not writable.")
    return path


def write(path: str, text: str) -> None:
    """:func:`atomic_write`, with an OS failure turned into a one-line user error."""
    try:
        atomic_write(path, text)
    except OSError as exc:
        raise CliError(f"{path}: cannot write ({exc.strerror or exc}).")


def tabulate_rows(rows, headers, **kw) -> str:
    from tabulate import tabulate
    return tabulate(rows, headers=headers, disable_numparse=True, **kw)


def warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


class Progress:
    """Progress on stderr: a one-line bar ``[####....] i/n name  ETA 12s`` on a
    terminal; off a terminal (``| tee``, CI, ``nohup``) one flushed line per
    item, ``[i/n] name  12.3s, ETA 40s``.

    ETA extrapolates elapsed time per element processed (layers differ in
    size), from the end of the last item during which the package's kernels
    compiled (or loaded from numba's cache: :func:`jit_signatures` grew) and
    only once an item after it compiled nothing -- a first run's compile
    minutes say nothing about the rest (``ETA --`` until then).
    ``enabled``: ``"bar"`` (or True), ``"lines"``, or False (``--quiet``); see
    :func:`progress_enabled`.
    """

    def __init__(self, total_items: int, total_work: float, enabled: bool, stream=None):
        self.n = total_items
        self.work = max(float(total_work), 1.0)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.done_work = 0.0
        self.width = 0
        # the ETA's base: time and work at the end of the last compiling item
        self.t_base, self.work_base = self.t0, 0.0
        self.eta_ok = False
        self._sigs = jit_signatures() if enabled else 0

    def eta(self):
        """Seconds left, or None while no item since the last compile is done."""
        if not self.eta_ok or self.done_work <= self.work_base:
            return None
        rate = (time.perf_counter() - self.t_base) / (self.done_work - self.work_base)
        return rate * max(self.work - self.done_work, 0.0)

    def show(self, i: int, name: str) -> None:
        if not self.enabled:
            return
        frac = self.done_work / self.work
        el = time.perf_counter() - self.t0
        left = self.eta()
        eta = "ETA  --" if left is None else f"ETA {left:5.0f}s"
        if self.enabled == "lines":
            self.stream.write(f"[{i}/{self.n}] {name}  {el:.1f}s, {eta.replace('  ', ' ')}\n")
            self.stream.flush()
            return
        bar = "#" * int(20 * frac)
        short = name if len(name) <= 48 else "..." + name[-45:]
        line = f"[{bar:<20}] {i}/{self.n} {short}  {eta}"
        pad = max(self.width - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self.width = len(line)

    def advance(self, work: float) -> None:
        self.done_work += float(work)
        if not self.enabled:
            return
        sigs = jit_signatures()
        if sigs != self._sigs:        # this item compiled: the ETA starts after it
            self._sigs = sigs
            self.t_base, self.work_base = time.perf_counter(), self.done_work
            self.eta_ok = False
        else:
            self.eta_ok = True

    def close(self) -> None:
        if self.enabled is not False and self.enabled != "lines" and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def jit_signatures() -> int:
    """Compiled signatures (numba's public ``Dispatcher.signatures``) of every
    jitted function of the package's imported modules: grows whenever a
    kernel compiles or loads from the cache."""
    from numba.extending import is_jitted
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "opscope_nb" or name.startswith("opscope_nb.")):
            continue
        for obj in list(vars(mod).values()):
            if is_jitted(obj) and getattr(obj, "__module__", None) == name:
                n += len(obj.signatures)
    return n


def progress_enabled(args):
    """``"bar"`` on a terminal, ``"lines"`` off one (one flushed line per item),
    False with ``--quiet``."""
    if getattr(args, "quiet", False):
        return False
    return "bar" if sys.stderr.isatty() else "lines"


def first_run_notice(args) -> None:
    """One line on stderr before a first run compiles the numba kernels, so a
    silent minute off a terminal is not taken for a hang.

    A run is a first one when the warm-up record
    (:func:`opscope_nb.warmup.warmed`) holds nothing for these sources and no
    cached machine code exists (no ``*.nbi`` index: installs whose cache
    never saw a warm-up, or a read-only one)."""
    if getattr(args, "quiet", False):
        return
    import pathlib

    import numba

    from opscope_nb import warmup as wu
    if wu.warmed():
        return
    roots = [pathlib.Path(__file__).resolve().parents[1]]
    if numba.config.CACHE_DIR:
        roots.append(pathlib.Path(numba.config.CACHE_DIR))
    for r in roots:
        if any(True for _ in r.rglob("*.nbi")):
            return
    print(f"{PROG}: first run: compiling the numba kernels this command uses (a few "
          f"minutes on 2 cores; later runs load them from the cache; "
          f"'{PROG} warmup' precompiles)", file=sys.stderr, flush=True)


def warm_first(args, group, names=None) -> bool:
    """:func:`opscope_nb.warmup.warm_first` for a command: compile ``group``'s
    kernels (or only the items ``names``) on every core before a cold first
    run, one stderr line per item (none with ``--quiet``).  Returns whether it
    ran."""
    from opscope_nb import warmup as wu
    log = None if getattr(args, "quiet", False) else (
        lambda line: print(f"{PROG}: {line}", file=sys.stderr, flush=True))
    return wu.warm_first(group, log=log, names=names)


# --------------------------------------------------------------------------- #
# checkpoints
# --------------------------------------------------------------------------- #
def open_and_select(args):
    """Open ``args.source`` and apply the selection flags; returns (source, chosen, skipped)."""
    src = tio.open_source(args.source)
    chosen, skipped = tio.select(src, include=args.include, exclude=args.exclude,
                                 include_embeddings=args.include_embeddings)
    if not chosen:
        raise CliError(f"{src.path}: no 2-D weight matrices selected out of "
                       f"{len(src.entries)} tensors (check --include/--exclude, or "
                       f"--include-embeddings).")
    return src, chosen, skipped


def source_info(src) -> dict:
    from opscope_nb.profile.checkpoint import source_files
    path = src.path if src.kind == "synthetic" else os.path.abspath(src.path)
    return {"path": path, "kind": src.kind, "n_tensors": len(src.entries),
            "files": source_files(src)}


# --------------------------------------------------------------------------- #
# profile.json
# --------------------------------------------------------------------------- #
def load_profile_doc(path: str) -> dict:
    """Read and sanity-check a ``profile.json`` written by ``opscope-nb profile``."""
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


def layers_from_doc(doc: dict, path: str) -> list:
    """The ``LayerProfile`` list of a profile document."""
    from opscope_nb.profile.mining import LayerProfile
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


__all__ = [
    "PROG", "PROFILE_FORMAT", "CliError", "Parser", "budget_arg", "positive_float", "nonneg_float",
    "positive_int", "nonneg_int", "int_list", "regex_arg", "add_source_args",
    "peak_rss_mb", "atomic_write", "json_text", "finite", "fmt_bytes",
    "fmt_err", "fmt_us", "ensure_outdir", "write", "tabulate_rows", "warn", "Progress",
    "progress_enabled", "first_run_notice", "warm_first", "open_and_select", "load_checked", "source_info",
    "load_profile_doc", "layers_from_doc", "timing_split", "__version__",
]
