"""Fill the on-disk kernel cache ahead of use: ``opscope-nb warmup``.

numba compiles a kernel on its first call and (``cache=True``) stores the
machine code on disk, so only the first process pays.  This module compiles
everything a command will call, or one group of it, in several processes at
once, so the first real run (``opscope-nb profile``, a
:class:`~opscope_nb.runtime.PackedLinear`, ``python bench.py``) loads from
the cache.

Groups (:data:`GROUPS`)
-----------------------
``profile``
    What ``opscope-nb profile`` (without ``--latency``) calls: the packers
    and error probes of every option family, the truncated SVD, Monarch,
    Tucker, TT, the ggml block types, the allocators; then the command itself
    on the built-in model (after the rest, so it mostly loads from the cache
    and compiles whatever the items missed).  A command warms only the items
    its menu calls (:func:`profile_items`).
``runtime``
    One :class:`~opscope_nb.runtime.PackedLinear` call per compiled forward
    entry: each quantised kind with float (``act="f32"``) and int8
    activations, decode (``m = 1``) and prefill (``m = 5``: the quantised
    kinds compile the two apart), the int4 and int8 panels of int8
    activations (``m = 16``) and the W8A8 row split (``m = 32``); each float
    kind (the factor kinds on random factors: the forward alone).
``bench``
    Each section of ``python bench.py --quick``.

Every item runs in a worker process (:func:`warm_item`), which reports its
wall and CPU time and how many of the package's compiled functions it
compiled versus loaded from the cache (numba's dispatcher statistics).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass

__all__ = ["GROUPS", "ITEMS", "items", "warm_item", "warm", "default_jobs", "warm_first",
           "warm_bench", "startable", "is_warm", "mark_warm", "warmed", "can_autowarm",
           "profile_items"]

#: Warm-up groups, in the order ``warm`` runs them.
GROUPS = ("profile", "runtime", "bench")


@dataclass(frozen=True)
class Item:
    """One unit of warm-up work: ``name`` (unique), ``group``, ``phase`` (items
    of phase 1 run only after every phase-0 item of the run finished), ``fn``
    (name of the function of this module doing it), ``arg`` and ``after``
    (names of items that must finish first when they are part of the run:
    an item whose kernels call another item's kernels waits for them, so two
    processes never compile the same chain at once and the later one loads it
    from the cache)."""

    name: str
    group: str
    phase: int
    fn: str
    arg: object = None
    after: tuple = ()


def _w(rows=64, cols=64, seed=0):
    import numpy as np
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


# ───────────────────────────── profile items ─────────────────────────────

def _profile_labels(labels):
    """Pack, unpack and measure ``labels`` as ``profile_layer`` does."""
    import numpy as np
    from . import formats
    from .kernels._quant_probe import abs_diff_sums, gram_stats, rel_err, residual_rows
    w = _w()
    for lab in labels:
        d = formats.Decomp.from_label(lab)
        packed = formats._pack(w, d)
        recon = formats.unpack(packed, d, w.shape)
        float(rel_err(w, recon))
    residual_rows(w, np.array(recon, dtype=np.float32), np.empty(w.shape[0]))   # sampled rows
    h = np.eye(4)                                    # a calibration gram's validation
    gram_stats(h, 64)
    abs_diff_sums(h, h, np.zeros(4), np.zeros(4))


def _profile_ggml(types):
    """Quantise and decode ``types`` as ``profile --menu ggml`` does (rows of
    256: every K-quant's super-block)."""
    from . import formats
    from .kernels._quant_probe import rel_err
    import numpy as np
    from .formats.ggml import GPTQ_TYPES, quantize_gptq
    w = _w(16, 256)
    for t in types:
        d = formats.Decomp.ggml(t)
        recon = formats.unpack(formats._pack(w, d), d, w.shape)
        float(rel_err(w, recon))
    # the +gptq twins' grid, sweep and code store (one compile serves every type)
    gptq = [t for t in types if str(t).upper() in GPTQ_TYPES]
    if gptq:
        quantize_gptq(w, gptq[0], np.eye(256))
    # llama.cpp's input rounding per activation type (profile --calib's
    # act_err, refine / eval --act-quant)
    from .formats.ggml import runtime_activations
    for t in ("Q8_0", "Q4_K", "F16", "BF16"):
        runtime_activations(w, t)


def _profile_svd(_):
    from . import formats
    from .kernels import truncated_svd
    from .kernels._quant_probe import rel_err
    w = _w()
    svd = truncated_svd(w, 48, 0)
    d = formats.Decomp.lowrank(8, svd_rank=48, seed=0)
    recon = formats.unpack(formats._pack(w, d, svd), d, w.shape)
    float(rel_err(w, recon))


def _profile_family(kind):
    from . import formats
    from .kernels._quant_probe import rel_err
    w = _w()
    rows, cols = w.shape
    if kind == "monarch":
        d = formats.Decomp.monarch()
    elif kind == "tucker":
        c1, c2 = formats.balanced_factor(cols)
        d = formats.Decomp.tucker((rows, c1, c2), (32, c1 // 2, c2 // 2))
    else:
        r1, r2 = formats.balanced_factor(rows)
        c1, c2 = formats.balanced_factor(cols)
        d = formats.Decomp.tt((r1, r2, c1, c2), 16)
    recon = formats.unpack(formats._pack(w, d), d, w.shape)
    float(rel_err(w, recon))


def _profile_synth(_):
    """The built-in model's weight generators (the RNG kernels), as
    ``opscope-nb profile`` without a source draws them."""
    from .io import synth
    from .io import SYNTHETIC_LAYERS
    for _name, dist, _rows, _cols, seed in SYNTHETIC_LAYERS:
        synth.sample(getattr(synth.Dist, dist), 8, 8, seed=seed)


def _profile_allocate(_):
    from . import formats
    from .profile import mining
    from .plan.allocate import dado_allocate, exact_allocate, greedy_allocate
    D = formats.Decomp
    layers = []
    for i in range(3):
        opts = [mining.DecompOption(D.dense(), 0.0, 4096 * 4, 4096),
                mining.DecompOption(D.int8(), 0.004 + i * 1e-3, 4096 + 256, 4096),
                mining.DecompOption(D.int4(), 0.08 + i * 1e-2, 2048 + 256, 4096)]
        layers.append(mining.LayerProfile(f"l{i}", 64, 64, 4096 * 4, opts))
    greedy_allocate(layers, 0.4)
    dado_allocate(layers, 0.4)
    exact_allocate(layers, 0.4, time_limit=10.0)


def _profile_cli(_):
    """``opscope-nb profile`` on the built-in model (output discarded), in a
    child process: the command layer sits above this module (it warms through
    it), so it is run, not imported."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "opscope_nb", "profile", "--out", tmp,
                              "--no-warmup"], capture_output=True, text=True)
    if out.returncode:
        tail = (out.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"opscope-nb profile exited with status {out.returncode}: {tail}")


# ───────────────────────────── runtime items ─────────────────────────────

def _spec(arg):
    """``(label, act, m)`` of a runtime item's argument (``m`` defaults to 1)."""
    return (tuple(arg) + (1,))[:3]


def _runtime_kind(spec):
    """One ``PackedLinear`` call of ``label`` with ``act`` on ``m`` rows (default
    1: decode).  Prefill items run at ``m = 5`` (the dot tiles, every kind);
    the int4 and int8 panels of int8 activations at ``m = 16`` and the W8A8
    row split at ``m = 32`` are variants of their own.  The factor kinds wrap
    random factors, as bench section 8 does (the forward alone; fitting them
    is the profile group's SVD / Tucker / TT items)."""
    import numpy as np
    from .bench.formats import FACTOR_KINDS, _random_factors
    from .formats import Decomp
    from .runtime import PackedLinear
    label, act, m = _spec(spec)
    rows, cols = (64, 64) if label == "monarch" else (64, 256)
    if label == "tucker":
        d = Decomp.tucker((64, 16, 16), (16, 8, 8))
    elif label == "tt":
        d = Decomp.tt((8, 8, 16, 16), 8)
    else:
        d = Decomp.from_label(label)
    if d.kind in FACTOR_KINDS:
        arrays = _random_factors(rows, cols, d, np.random.default_rng(0))
        lin = PackedLinear(d, arrays, (rows, cols))
    else:
        lin = PackedLinear.pack(_w(rows, cols), d)
    lin(np.ones((m, cols), np.float32), act)


#: Rows of the prefill items (the dot tiles of every kind) and of the panel
#: items (int8 activations on int4 / int8 weights take an outer-product panel
#: from :data:`kernels.W4_PANEL_MIN_M` / :data:`kernels.I8_PANEL_MIN_M` rows on).
_M_PREFILL = 5
_M_PANEL = 16


# ────────────────────────────── bench items ──────────────────────────────

def _bench_section(sec):
    """Section ``sec`` of ``python bench.py --quick`` (output discarded)."""
    from .bench import runner
    with contextlib.redirect_stdout(io.StringIO()):
        runner.run(runner.QUICK, [sec] + ([7] if sec in runner.VERDICT_FROM else []))


#: The warm-up item of the ggml block types (``--menu ggml`` / ``mixed``).
_GGML_ITEM = "profile ggml types"
#: The profile items a ``--menu ggml`` run calls (no SVD, Tucker, TT, intN ...).
_GGML_MENU_ITEMS = ("profile allocators", _GGML_ITEM)


def profile_items(menu="default", synthetic=True) -> list:
    """The phase-0 ``profile`` items a ``profile --menu menu`` run calls, for
    :func:`warm_first`: ``ggml`` the allocators and the ggml types only;
    ``default`` every other item; ``mixed`` all of them.  ``synthetic``: the
    run profiles the built-in model (its weight generators are an item)."""
    if menu not in ("default", "ggml", "mixed"):
        raise ValueError(f"menu must be 'default', 'ggml' or 'mixed'; got {menu!r}.")
    synth = "profile built-in model weights"
    out = []
    for it in items("profile"):
        if it.phase != 0 or (it.name == synth and not synthetic):
            continue
        if menu == "ggml" and it.name not in _GGML_MENU_ITEMS + (synth,):
            continue
        if menu == "default" and it.name == _GGML_ITEM:
            continue
        out.append(it.name)
    return out


def _build_items():
    out = []

    def add(name, group, fn, arg=None, phase=0, after=()):
        out.append(Item(name, group, phase, fn, arg, tuple(after)))

    # longest first inside a group, so N workers finish together; Tucker and TT
    # call the truncated SVD (the longest compile), so they wait for it
    svd = "profile svd + lowrank"
    add(svd, "profile", "_profile_svd")
    add("profile allocators", "profile", "_profile_allocate")
    add("profile intN (int6/int5/int3/int2)", "profile", "_profile_labels",
        ("int6/chan", "int6/g32", "int5/chan", "int5/g32", "int3/chan", "int3/g32",
         "int2/g32"))
    add("profile monarch", "profile", "_profile_family", "monarch")
    add("profile tucker", "profile", "_profile_family", "tucker", after=(svd,))
    add("profile tt", "profile", "_profile_family", "tt", after=(svd,))
    add("profile ternary / sparse2:4", "profile", "_profile_labels", ("ternary", "sparse2:4"))
    add("profile int8 / int4", "profile", "_profile_labels",
        ("dense", "int8/chan", "int4/chan", "int4/g32"))
    add("profile built-in model weights", "profile", "_profile_synth")
    add(_GGML_ITEM, "profile", "_profile_ggml",
        ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS",
         "Q3_K", "Q2_K", "F16", "BF16"))
    add("profile command (built-in model)", "profile", "_profile_cli", phase=1)
    for label in ("int6/g128", "int5/g32", "int3/g128", "int2/g32", "int4/chan", "int4/g32",
                  "ternary", "int8/chan"):
        for act in ("f32", "int8"):
            add(f"runtime {label} act={act}", "runtime", "_runtime_kind", (label, act))
            add(f"runtime {label} act={act} prefill", "runtime", "_runtime_kind",
                (label, act, _M_PREFILL))
    for label in ("int4/chan", "int4/g32", "int8/chan"):
        add(f"runtime {label} act=int8 prefill (panel)", "runtime", "_runtime_kind",
            (label, "int8", _M_PANEL))
    # int8 activations at m = 32 on 2+ threads take the W8A8 row split, a
    # variant of its own (kernels.w8a8_prefill_kw)
    add("runtime int8/chan act=int8 prefill (row split)", "runtime", "_runtime_kind",
        ("int8/chan", "int8", 32))
    for label in ("dense", "sparse2:4", "lowrank(r=8)", "monarch", "tucker", "tt"):
        add(f"runtime {label}", "runtime", "_runtime_kind", (label, "auto"))
    # section 8 runs every PackedLinear kind: one kind per item (the runtime
    # items, spread over the workers) first, then the section loads them
    kinds = tuple(it.name for it in out if it.group == "runtime")
    for sec in (8, 4, 9, 5, 3, 2, 1, 6):
        add(f"bench section {sec}", "bench", "_bench_section", sec,
            after=kinds if sec == 8 else ())
    return tuple(out)


#: Every warm-up item, by group.
ITEMS = _build_items()


def items(only=None):
    """The items of group ``only`` (one of :data:`GROUPS`), or of all groups.

    Raises
    ------
    ValueError
        An unknown group.
    """
    if only is None:
        return list(ITEMS)
    if only not in GROUPS:
        raise ValueError(f"unknown warm-up group {only!r}; expected one of {GROUPS}.")
    return [it for it in ITEMS if it.group == only]


def _cache_counts():
    """(compiled, loaded): summed numba cache misses / hits of every dispatcher
    of this package imported so far."""
    from numba.extending import is_jitted
    miss = hit = 0
    for name, mod in list(sys.modules.items()):
        if not (name == "opscope_nb" or name.startswith("opscope_nb.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if is_jitted(obj) and obj.__module__ == name:
                st = obj.stats
                miss += sum(st.cache_misses.values())
                hit += sum(st.cache_hits.values())
    return miss, hit


def warm_item(name):
    """Compile (or load from the cache) the kernels of item ``name`` in this
    process.

    Returns
    -------
    dict
        ``name``, ``seconds`` (wall), ``cpu`` (this process's CPU seconds),
        ``compiled`` / ``loaded`` (functions of the package compiled / loaded
        from the cache during the item) and ``error`` (``None``, or the
        exception as one line).
    """
    it = next((i for i in ITEMS if i.name == name), None)
    if it is None:
        raise ValueError(f"unknown warm-up item {name!r}.")
    m0, h0 = _cache_counts()
    t0, c0 = time.perf_counter(), time.process_time()
    err = None
    try:
        globals()[it.fn](it.arg)
    except Exception as exc:  # reported, the other items go on
        err = f"{type(exc).__name__}: {exc}".splitlines()[0]
    m1, h1 = _cache_counts()
    return {"name": name, "group": it.group, "seconds": time.perf_counter() - t0,
            "cpu": time.process_time() - c0, "compiled": m1 - m0, "loaded": h1 - h0,
            "error": err}


def default_jobs() -> int:
    """Worker processes by default: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def startable(waiting, todo, finished, free):
    """The items of ``waiting`` (in order) to start now on ``free`` idle workers.

    An item may start once every item it waits for has finished: those of an
    earlier phase and its ``after`` names, among the items of the run
    (``todo``).  ``finished``: names done so far.  Only what can start now is
    returned, so an item never queues behind one waiting for its
    dependencies; with nothing running and nothing ready (cannot happen with
    the items here) the first waiting item starts, so a run always ends.
    """
    run = {it.name for it in todo}

    def ready(it):
        if any(o.phase < it.phase and o.name not in finished for o in todo):
            return False
        return all(a in finished or a not in run for a in it.after)

    out = [it for it in waiting if ready(it)]
    if not out and free > 0 and len(finished) + len(waiting) == len(todo):
        out = list(waiting[:1])     # nothing running: never wait forever
    return out[:max(0, free)]


def _worker_init():
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def warm(only=None, jobs=None, on_result=None, names=None):
    """Compile every item of group ``only`` (default: all) in ``jobs`` processes.

    Parameters
    ----------
    only : str, optional
        One of :data:`GROUPS`.
    jobs : int, optional
        Worker processes (default :func:`default_jobs`); ``1`` still uses one
        worker process, so the caller's process stays free of numba.
    on_result : callable, optional
        Called with each item's :func:`warm_item` dict as it finishes.
    names : sequence of str, optional
        Only these items (by :attr:`Item.name`), instead of a group.

    Returns
    -------
    dict
        ``results`` (list of item dicts, completion order), ``seconds`` (wall
        time of the whole run), ``jobs``, ``failed`` (names of items that
        raised).
    """
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    todo = items(only)
    if names is not None:
        unknown = set(names) - {it.name for it in todo}
        if unknown:
            raise ValueError(f"unknown warm-up items {sorted(unknown)}.")
        todo = [it for it in todo if it.name in set(names)]
    jobs = default_jobs() if jobs is None else int(jobs)
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1; got {jobs}.")
    t0 = time.perf_counter()
    results = []
    ctx = multiprocessing.get_context("spawn")
    finished = set()
    with ProcessPoolExecutor(max_workers=min(jobs, max(len(todo), 1)), mp_context=ctx,
                             initializer=_worker_init) as pool:
        waiting = list(todo)        # longest first: the order of ITEMS
        pending = {}
        while waiting or pending:
            # submit only what a worker can start now, so a later item never
            # queues behind one that is waiting for its dependencies
            for it in startable(waiting, todo, finished, jobs - len(pending)):
                waiting.remove(it)
                pending[pool.submit(warm_item, it.name)] = it
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                it = pending.pop(fut)
                try:
                    r = fut.result()
                except Exception as exc:  # a worker died
                    r = {"name": it.name, "group": it.group, "seconds": float("nan"),
                         "cpu": float("nan"), "compiled": 0, "loaded": 0,
                         "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                finished.add(it.name)
                results.append(r)
                if on_result is not None:
                    on_result(r)
    failed = [r["name"] for r in results if r["error"]]
    mark_warm([r["name"] for r in results if not r["error"]])
    return {"results": results, "seconds": time.perf_counter() - t0, "jobs": jobs,
            "failed": failed}


# ─────────────────────── warm stamps and the first run ───────────────────────

def _stamp():
    from .kernels import _jit as _config
    return _config.STATE_DIR / "opscope_warm.json"


def can_autowarm() -> bool:
    """Whether a command may warm its kernels first (:func:`warm_first`): the
    kernels are cached on disk (a forced ``OPSCOPE_I8_PATH`` caches elsewhere
    and is left alone), the cache directory is writable, and
    ``OPSCOPE_AUTOWARM`` is not ``0``."""
    from .kernels import _jit as _config
    if os.environ.get("OPSCOPE_AUTOWARM", "1").strip() == "0":
        return False
    if not _config.CACHE:
        return False
    if _config.SOURCES_DIGEST is None:
        return False
    return _config._writable(_config.STATE_DIR)


def warmed() -> set:
    """Names of the items warmed for the current sources: a record next to the
    cache (``opscope_warm.json``) holding the sources' digest; any edit of
    the package makes it stale, as it drops the cache."""
    import json
    from .kernels import _jit as _config
    try:
        rec = json.loads(_stamp().read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(rec, dict) or rec.get("digest") != _config.SOURCES_DIGEST:
        return set()
    return {n for n in rec.get("items", ()) if isinstance(n, str)}


def _phase0(group):
    return [it.name for it in items(group) if it.phase == 0]


def is_warm(group=None, names=None) -> bool:
    """Whether the items ``names`` (default: every phase-0 item of ``group``,
    the kernels a command calls; the command itself is phase 1) are warm."""
    want = set(_phase0(group) if names is None else names)
    return want <= warmed()


def mark_warm(names) -> None:
    """Record items as warmed for the current sources (best effort; the
    record's read-modify-write runs under the cache lock, so concurrent
    warm-ups keep each other's names)."""
    import json
    from .kernels import _jit as _config
    names = list(names)
    if _config.SOURCES_DIGEST is None or not names:
        return
    try:
        with _config._locked(_config.CACHE_LOCK):
            done = warmed() | set(names)
            p = _stamp()
            tmp = p.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"digest": _config.SOURCES_DIGEST,
                                       "items": sorted(done)}) + "\n")
            tmp.replace(p)
    except OSError:
        pass


def warm_first(group, jobs=None, log=None, names=None) -> bool:
    """Before a command runs: compile the kernels of its warm-up items in
    ``jobs`` processes (default: every core), unless they are warm already.

    A cold ``opscope-nb profile`` or ``python bench.py`` compiles one kernel
    after another in one process; spread over the cores first, the command
    then loads them from the cache.  ``names``: the items (default: every
    phase-0 item of ``group``; the command itself is phase 1); only those not
    yet warm run.  Returns whether a warm-up ran.  ``log``: called with a
    first line, one per item and a last one (progress off a terminal too).  A
    failed item is reported and the command goes on (it compiles what it
    needs itself); it stays unwarmed, so the next run tries again.
    """
    if not can_autowarm():
        return False
    todo = [n for n in (_phase0(group) if names is None else names) if n not in warmed()]
    if not todo:
        return False
    jobs = default_jobs() if jobs is None else int(jobs)
    say = log or (lambda line: None)
    say(f"first run: compiling the {group} kernels in {jobs} processes "
        f"({len(todo)} items; once per install and version, later runs load them; "
        f"OPSCOPE_AUTOWARM=0 skips this)")
    n = [0]

    def line(r):
        n[0] += 1
        status = f"FAILED: {r['error']}" if r["error"] else f"compiled {r['compiled']}"
        say(f"first run: [{n[0]}/{len(todo)}] {r['name']} {r['seconds']:.1f} s ({status})")

    out = warm(jobs=jobs, on_result=line, names=todo)
    say(f"first run: {group} kernels compiled in {out['seconds']:.1f} s")
    return True


def _rows_of(it):
    """Rows ``m`` a runtime item calls with."""
    return int(_spec(it.arg)[2])


def warm_bench(sections, log=None, quick=False) -> bool:
    """:func:`warm_first` for ``python bench.py --sections ...``: the items of
    those sections, and for section 8 (every ``PackedLinear`` kind) the
    per-kind runtime items, spread over the workers -- with ``quick`` only
    those of the rows and activation paths ``--quick`` runs (decode and the
    dot tiles of int8 activations; its section 8 never reaches the panels).
    ``log`` defaults to printing (the bench output).  Returns whether a
    warm-up ran."""
    secs = set(sections)
    names = [it.name for it in items("bench") if int(it.name.rsplit(" ", 1)[1]) in secs]
    if 8 in secs:
        from .bench.runner import QUICK
        top = max(QUICK["s8_m"]) if quick else None
        # the float kinds' items run act="auto" (they have one path)
        acts = QUICK["s8_acts"] + ("auto",) if quick else None
        names = [it.name for it in items("runtime")
                 if (top is None or _rows_of(it) <= top)
                 and (acts is None or _spec(it.arg)[1] in acts)] + names
    return warm_first("bench", names=names,
                      log=log or (lambda line: print(line, flush=True)))
