"""The ``opscope-nb`` command line (also ``python -m opscope_nb``).

Sub-commands
------------
``profile [SOURCE]``
    Mine every compression option of every selected weight matrix
    (:func:`opscope_nb.profile.mining.profile_layer`), solve the byte budget (``--budget``
    fraction or ``--bpw`` bits per weight, optionally ``--latency-budget``) with
    the greedy, DADO and exact allocators, print the plan; ``--out DIR`` writes
    ``profile.json``, ``plan.json`` and ``options.csv``.
``allocate PROFILE.json``
    Re-solve a saved profile at another budget without touching the weights.
``refine PROFILE.json --out DIR``
    Start from the exact plan at a budget and search for a plan of the same
    bytes whose measured KL (decoders) or cosine (encoders) is lower; kept
    only when it also wins on a held-out split (``allocate --refine`` too).
``quant [SOURCE]``
    The upstream ``--quant`` sweep: int8/int4/int3 errors per layer, the
    depth trend, a by-kind table, outlier hotspots and a mixed int4/int8 recipe.
``plot PROFILE.json -o rd.png``
    Per-layer error-vs-bytes points with their lower convex hull, and the
    model-level error-vs-budget frontier of the three allocators.
``warmup [--jobs N] [--only profile|runtime|bench]``
    Compile the kernels now, in N processes (fills the on-disk cache).

SOURCE is a ``.safetensors`` / ``.gguf`` / ``.tensor`` file or a directory
of shards / dumps (see :mod:`opscope_nb.io`); without SOURCE the upstream's
seven-layer synthetic model is used (its ``lm_head`` counts as one of its
layers, so ``--include-embeddings`` is not needed for it).

Errors a user can cause (missing or corrupt file, bad regular expression,
budget outside (0, 1], missing optional package) print one line on stderr and
exit with status 2; a tensor holding NaN/Inf or stored in a non-float dtype
(an integer ``qweight``, an ``I8`` buffer) is reported and skipped.  Output
files are written atomically (temporary file in the same directory, then
:func:`os.replace`), and ``profile.json`` is rewritten after every layer so an
interrupted run keeps its work (``--resume`` continues it).

Adding a command
----------------
One module per command in this package, listed in :data:`COMMANDS`.  The module
defines

* ``add_parser(subparsers)`` - ``p = subparsers.add_parser(NAME, help=...)``,
  its arguments, and ``p.set_defaults(func=run)``;
* ``run(args) -> int`` - the command; exit status 0.  Raise
  :class:`CliError` (one line, exit 2) for anything the user can fix.

Shared pieces live in :mod:`._common` (argument types, ``add_source_args``,
``open_and_select`` / ``load_checked``, atomic ``write`` / ``json_text``,
``tabulate_rows``, ``Progress``, ``warn``, profile.json readers) and
:mod:`._plan` (budget flags, allocator runs, plan tables, ``plan.json``).
Import numpy and the heavy package modules at the top of the command module
or inside ``run``: this package's ``__init__`` imports neither, so
``main()`` can set ``OPENBLAS_NUM_THREADS`` before numpy loads.
"""
from __future__ import annotations

import importlib
import os
import sys

__all__ = ["main", "build_parser", "CliError", "COMMANDS"]

PROG = "opscope-nb"

#: Command modules of this package, in ``--help`` order.  A module that does not
#: exist yet is skipped (so a command can land in its own commit).
COMMANDS = ("profile", "allocate", "refine", "quant", "plot", "apply", "eval", "warmup")
#: What an interrupt leaves behind, per command (Ctrl-C's message).
_INTERRUPTED = {
    "profile": " (with --out, profile.json keeps the layers done; rerun with --resume)",
    "apply": " (no output written: the target file is untouched)",
    "allocate": " (no output written)",
    "refine": " (refine_state.json keeps the search; rerun to continue)",
    "plot": " (no output written)",
}
#: Commands that pin OpenBLAS to one thread (see :func:`main`).
_PIN_BLAS = ("profile", "quant", "eval", "refine")

# Re-exported from the helper modules on first access (keeps `import` cheap).
_LAZY = {
    "CliError": "_common", "atomic_write": "_common", "Progress": "_common",
    "peak_rss_mb": "_common", "fmt_bytes": "_common", "fmt_err": "_common",
    "METHODS": "_budget", "TIGHT_ERR": "_budget", "OPTIONS_CSV_COLUMNS": "_budget",
    "run_allocators": "_budget", "plan_table": "_budget", "totals_table": "_budget",
    "plan_dict": "_budget", "options_csv": "_budget", "best_bound": "_budget",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


def _command_modules():
    mods = []
    for name in COMMANDS:
        try:
            mods.append(importlib.import_module(f"{__name__}.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    return mods


def build_parser():
    """The ``opscope-nb`` argument parser (every module of :data:`COMMANDS`)."""
    from opscope_nb import __version__
    from ._common import Parser
    p = Parser(prog=PROG, description="Which compression fits each weight matrix, and "
               "which mix fits a memory budget.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for mod in _command_modules():
        mod.add_parser(sub)
    return p


def _retains_memory(cmd, words) -> bool:
    """Whether the command keeps freed memory (:mod:`opscope_nb._memory`):
    ``profile --calib``, whose grams, factors and calibration batches are
    gigabytes allocated again per block, and ``apply``, which allocates each
    tensor's float32 values and packed blocks afresh (Llama-7B shapes, 2
    blocks: 5.41 / 5.51 s with it against 5.94 / 6.08 s without, half the page
    faults, the same 0.62 GB peak; Xeon, 2 cores)."""
    return cmd == "apply" or (
        cmd == "profile" and any(a == "--calib" or a.startswith("--calib=") for a in words))


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 user error, 130 interrupted).

    Sets ``OPENBLAS_NUM_THREADS=1`` for ``profile``, ``quant`` and ``eval``
    unless the user set it (only here, never at import): after each BLAS call
    OpenBLAS's threads keep spinning on the cores numba's parallel loops need
    next, so a kernel waits for a scheduler time slice.  Measured on MiniLM (2
    cores, busy machine): 2.6/1.6/4.3 s per 384x384 / 1536x384 / 384x1536
    layer profiled with the default threads vs 0.25/0.39/0.39 s with one.
    ``eval`` interleaves NumPy's attention matmuls with ``PackedLinear``
    calls the same way (Zen 4, 2 cores, one BLAS thread against the default):
    SmolLM2 at 1024 tokens 6.2 s against 10.1 s in all, prefill 509 against
    207 tokens/s, decode 45.1 against 42.9, the same perplexity; MiniLM
    compressed at 35 % 902-967 against 439-712 tokens/s, dense 659-719
    against 703-736.  OpenBLAS reads it once, at load, so it takes effect when
    the CLI is the process entry point.

    As the process entry point (``argv`` None), ``profile --calib`` and
    ``apply`` also keep freed memory in the process
    (:func:`opscope_nb._memory.retain_freed_memory`, see :func:`_retains_memory`):
    the large arrays they allocate again and again are reused instead of being
    faulted in again.
    """
    words = sys.argv[1:] if argv is None else [str(a) for a in argv]
    cmd = next((a for a in words if not a.startswith("-")), None)
    if cmd in _PIN_BLAS:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if argv is None and _retains_memory(cmd, words):
        from opscope_nb._memory import retain_freed_memory
        retain_freed_memory()
    from opscope_nb import io as tio
    from ._common import CliError as _CliError
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (_CliError, tio.SourceError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted{_INTERRUPTED.get(cmd or '', '')}", file=sys.stderr)
        return 130
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BrokenPipeError:  # e.g. `opscope-nb profile | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
