"""``opscope-nb profile [SOURCE]``: mine every option of every selected weight
(:func:`opscope_nb.mining.profile_layer`), solve the budget with the greedy, DADO
and exact allocators and print the plan; ``--out DIR`` writes ``profile.json``
(rewritten after every layer, so ``--resume`` continues an interrupted run),
``plan.json`` and ``options.csv``."""
from __future__ import annotations

import inspect
import os
import sys
import time

from ._common import (PROFILE_FORMAT, PROG, CliError, __version__, add_source_args,
                      ensure_outdir, finite, fmt_bytes, int_list, json_text, load_checked,
                      load_profile_doc, nonneg_int, open_and_select, peak_rss_mb,
                      positive_int, Progress, progress_enabled, source_info, timing_split,
                      warn, write)
from ._plan import (add_budget_args, budget_spec, budget_text, check_latencies, methods_of,
                    options_csv, plan_dict, print_plan, run_allocators)

NAME = "profile"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="mine every option per layer and solve a budget")
    add_source_args(p)
    add_budget_args(p)
    p.add_argument("--rank-cap", type=positive_int, default=48,
                   help="top singular values computed per layer (default 48)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="randomised SVD seed")
    p.add_argument("--latency", type=int_list, default=None, metavar="M[,M...]",
                   help="measure each option's latency at these activation rows, e.g. "
                        "1,32 (stored in profile.json; needed by --latency-budget)")
    p.add_argument("--out", metavar="DIR",
                   help="write profile.json, plan.json and options.csv here")
    c = p.add_argument_group("calibration (data-aware menu and objectives)")
    c.add_argument("--calib", action="store_true",
                   help="run the dense model on calibration text: per-layer input grams "
                        "H = sum x x^T (out_err per option, +gptq options), per-layer "
                        "sensitivity; grams saved to DIR/calib.npz for 'apply'")
    c.add_argument("--calib-text", metavar="FILE", default=None,
                   help="calibration text, one passage per line (default: the built-in "
                        "sample: 2545 MiniLM tokens in its sentences)")
    c.add_argument("--calib-tokens", type=positive_int, default=None, metavar="N",
                   help="cap on calibration tokens (default: all of the text)")
    c.add_argument("--imatrix", metavar="FILE", default=None,
                   help="llama.cpp importance matrix (GGUF imatrix or legacy .dat) as "
                        "diag(H) per tensor (out_err only; no +gptq, no sensitivity)")
    p.add_argument("--resume", action="store_true",
                   help="reuse layers already in DIR/profile.json (same name, shape and "
                        "settings)")
    d = p.add_argument_group("distributed (Dask; pip install -e \".[distributed]\")")
    d.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="profile on a local Dask cluster of N worker processes "
                        "(127.0.0.1), one task per weight matrix")
    d.add_argument("--threads-per-worker", type=positive_int, default=None, metavar="T",
                   help="numba and BLAS threads per worker (default: cores / N; with "
                        "--scheduler: as each worker was started)")
    d.add_argument("--scheduler", metavar="ADDRESS",
                   help="use a running Dask cluster: tcp://host:8786, tls://..., or a "
                        "scheduler file; every worker must see SOURCE at the same path")
    p.set_defaults(func=run)


def profile_entry(e, kw):
    """Load, check and profile one selected tensor (the serial loop's and a Dask task's body).

    Returns ``(record, LayerProfile, None)``, or ``(None, None, reason)`` when the
    tensor is skipped (NaN/Inf, non-float dtype; see ``load_checked``).
    """
    from .. import mining
    if callable(kw):
        kw = kw(e.name)
    t0 = time.perf_counter()
    w, why = load_checked(e)
    t_load = time.perf_counter() - t0
    if w is None:
        return None, None, why
    t1 = time.perf_counter()
    lp = mining.profile_layer(e.name, w, **kw)
    del w
    rec = {"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
           "file": os.path.abspath(e.path) if e.path != "synthetic" else e.path,
           "load_seconds": t_load, "seconds": time.perf_counter() - t1,
           "profile": lp.to_dict()}
    return rec, lp, None


def profile_doc(source, settings, records, skipped, t_start, complete) -> dict:
    """The ``profile.json`` document."""
    timings = timing_split(r["profile"].get("timings") for r in records)
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
        "peak_rss_mb": finite(peak_rss_mb()),
    }


def _profile_kwargs(args) -> dict:
    from .. import mining
    kw = {"rank_cap": args.rank_cap, "seed": args.seed}
    if args.latency:
        if "latency" not in inspect.signature(mining.profile_layer).parameters:
            raise CliError("--latency needs a profile_layer that measures latency "
                           "(this build has none); drop --latency.")
        kw["latency"] = tuple(args.latency)
    return kw


def _calibration(args, src, chosen, kw, dist):
    """Run --calib / read --imatrix; returns (settings record or None, kw or kw(name))."""
    if not args.calib and not args.imatrix:
        if args.calib_text or args.calib_tokens:
            raise CliError("--calib-text/--calib-tokens need --calib.")
        if getattr(args, "objective", "weight") != "weight":
            warn(f"--objective {args.objective} without --calib/--imatrix: no layer has "
                 f"out_err, every layer uses its squared weight error (sum of rel_err^2).")
        return None, kw
    if dist is not None:
        raise CliError("--calib/--imatrix run in this process; drop --workers/--scheduler.")
    grams, sens, rec = {}, {}, {}
    names = {e.name for e in chosen}
    if args.calib:
        from ..calib import calibrate, save_grams
        from ..models import ModelError, UnsupportedModelError
        t = time.perf_counter()
        try:
            show = progress_enabled(args)
            cal = calibrate(args.source, text=args.calib_text, max_tokens=args.calib_tokens,
                            log=(lambda m: print(m, file=sys.stderr, flush=True)) if show
                            else (lambda m: None))
        except (ModelError, UnsupportedModelError) as exc:
            raise CliError(f"--calib: {exc}")
        grams.update(cal.grams)
        sens.update(cal.sensitivity)
        rec = {"text": args.calib_text, "max_tokens": args.calib_tokens,
               **cal.summary(), "wall_seconds": time.perf_counter() - t}
        print(f"calibration: {cal.tokens} tokens, {len(cal.grams)} linear layers "
              f"({rec['full_grams']} full grams, {rec['diag_grams']} diagonal), "
              f"sensitivity on {cal.sens_tokens} tokens ({cal.metric}), "
              f"{rec['wall_seconds']:.1f}s")
        if args.out:
            save_grams(os.path.join(ensure_outdir(args.out), "calib.npz"), cal.grams, rec)
    if args.imatrix:
        from ..imatrix import ImatrixError, read_imatrix
        try:
            im = read_imatrix(args.imatrix, names=sorted(names))
        except ImatrixError as exc:
            raise CliError(str(exc))
        if im.unknown:
            warn(f"{args.imatrix}: {len(im.unknown)} imatrix tensor(s) match no profiled "
                 f"weight: {', '.join(im.unknown[:5])}{' ...' if len(im.unknown) > 5 else ''}")
        for n, d in im.diag.items():
            grams.setdefault(n, d)
        rec["imatrix"] = {"file": os.path.abspath(args.imatrix), "layers": len(im.diag),
                          "unknown": im.unknown, "chunks": im.chunks}
    missing = sorted(names - set(grams))
    if missing:
        warn(f"{len(missing)} profiled tensor(s) have no calibration data (e.g. "
             f"{missing[0]}); they get no out_err and fall back to weight error.")

    def per_layer(name):
        k = dict(kw)
        if name in grams:
            k["gram"] = grams[name]
        if name in sens:
            k["sensitivity"] = sens[name]
        return k

    return rec, per_layer


def run(args) -> int:
    spec = budget_spec(args)
    dist = None
    if args.workers is not None or args.scheduler is not None:
        if args.workers is not None and args.scheduler is not None:
            raise CliError("give --workers N (a local cluster) or --scheduler ADDRESS "
                           "(a running one), not both.")
        from .. import distributed as dist
        try:
            dist.require_dask()
        except dist.DaskMissingError as exc:
            raise CliError(str(exc))
    elif args.threads_per_worker is not None:
        raise CliError("--threads-per-worker needs --workers N or --scheduler ADDRESS.")
    src, chosen, skipped_sel = open_and_select(args)
    from ..mining import LayerProfile
    kw = _profile_kwargs(args)
    calib_settings, kw = _calibration(args, src, chosen, kw, dist)
    latency = list(args.latency) if args.latency else None
    settings = {"rank_cap": args.rank_cap, "seed": args.seed,
                "budget": spec.get("budget_frac"), "bpw": spec.get("budget_bpw"),
                "latency": latency,
                "include": args.include, "exclude": args.exclude,
                "include_embeddings": args.include_embeddings}
    if calib_settings is not None:
        settings["calib"] = calib_settings
    source = source_info(src)
    out = ensure_outdir(args.out) if args.out else None
    if args.resume and not out:
        raise CliError("--resume needs --out DIR (it continues DIR/profile.json).")
    prof_path = os.path.join(out, "profile.json") if out else None

    previous = {}
    if args.resume and os.path.exists(prof_path):
        doc = load_profile_doc(prof_path)
        old = doc.get("settings", {})
        if ((old.get("rank_cap"), old.get("seed"), old.get("latency"), old.get("calib"))
                != (args.rank_cap, args.seed, latency, calib_settings)):
            warn(f"{prof_path} was made with rank_cap={old.get('rank_cap')}, "
                 f"seed={old.get('seed')}, latency={old.get('latency')}; "
                 f"re-profiling every layer.")
        else:
            for rec in doc["layers"]:
                try:
                    previous[(rec["name"], tuple(rec["shape"]))] = rec
                except (KeyError, TypeError):
                    continue

    skipped = [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "reason": r}
               for e, r in skipped_sel]
    n_skip_load = 0
    records, layers = [], []
    t_start = time.perf_counter()
    bar = Progress(len(chosen), sum(e.numel for e in chosen), progress_enabled(args))
    reused = 0
    try:
        if dist is not None:
            # Dask: same records, skips, progress and atomic profile.json saves
            def save(recs, skips):
                if prof_path:
                    write(prof_path, json_text(profile_doc(source, settings, recs,
                                                           skipped + skips, t_start, False)))
            records, layers, reused, skips = dist.profile_cli(
                args, src, chosen, previous, kw, settings, bar, save, warn)
            skipped += skips
            n_skip_load = len(skips)
        for i, e in enumerate(chosen if dist is None else (), 1):
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
            rec, lp, why = profile_entry(e, kw)
            if rec is None:
                bar.close()
                warn(f"skipping {e.name}: {why}.")
                skipped.append({"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
                                "reason": why})
                n_skip_load += 1
                bar.advance(e.numel)
                continue
            records.append(rec)
            layers.append(lp)
            bar.advance(e.numel)
            if prof_path:
                # keep the still-valid saved layers not reached yet, so an interrupt
                # during a resumed run loses nothing either
                later = [previous[k] for k in ((x.name, tuple(x.shape)) for x in chosen[i:])
                         if k in previous]
                write(prof_path, json_text(profile_doc(source, settings, records + later,
                                                       skipped, t_start, False)))
    finally:
        bar.close()

    if not layers:
        raise CliError(f"{src.path}: every selected tensor was skipped (NaN/Inf or a "
                       f"non-float dtype); nothing to allocate.")
    check_latencies(layers, spec, src.path)
    allocs = run_allocators(layers, spec, methods_of(args.method), args.time_limit)
    rss = peak_rss_mb()
    wall = time.perf_counter() - t_start

    print_plan(layers, allocs)
    dense = sum(int(lp.dense_bytes) for lp in layers)
    phases = timing_split(r["profile"].get("timings") for r in records)
    split = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(phases.items(),
                                                         key=lambda kv: -kv[1]))
    print()
    print(f"{len(layers)} layers ({reused} resumed, {len(skipped)} tensors skipped), "
          f"dense {fmt_bytes(dense)}, {budget_text(spec, layers)}; "
          f"wall {wall:.1f}s, peak RSS {rss:.0f} MiB")
    if n_skip_load:
        print("skipped while loading: " + "; ".join(
            f"{s['name']} ({s['reason']})" for s in skipped[-n_skip_load:]))
    if split:
        print(f"profile time split: {split}")

    if out:
        write(prof_path, json_text(profile_doc(source, settings, records, skipped,
                                               t_start, True)))
        write(os.path.join(out, "plan.json"),
              json_text(plan_dict(layers, allocs, spec, source)))
        write(os.path.join(out, "options.csv"), options_csv(layers))
        print(f"wrote {prof_path}, plan.json, options.csv")
    return 0
