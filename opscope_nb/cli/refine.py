"""``opscope-nb refine PROFILE.json --out DIR``: start from the exact plan at a
budget and search for a plan of the same budget whose **measured** score is
lower (decoders: next-token KL against the dense model; encoders: 1 - cosine
of the embeddings), on held-in calibration tokens; the refined plan is kept
only when it also measures lower on a held-out split
(:func:`opscope_nb.plan.refine.refine`).  ``DIR/plan.json`` gets the start
plan and, when kept, a ``refined`` method (what ``apply`` then uses by
default); ``DIR/refine_state.json`` lets a rerun continue the search.
``allocate --refine`` runs the same search after allocating."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
import time

from ._common import (
    CliError,
    budget_arg,
    ensure_outdir,
    json_text,
    layers_from_doc,
    load_profile_doc,
    positive_float,
    positive_int,
    progress_enabled,
    nonneg_float,
    nonneg_int,
    tabulate_rows,
    warn,
    write,
)
from ._budget import (
    add_budget_args,
    allocate_checked,
    budget_spec,
    budget_text,
    checked_budget,
    methods_of,
    plan_dict,
    print_plan,
)

NAME = "refine"
DESCRIPTION = (
    "Start from the exact plan at a budget (--method picks another allocator; all = "
    "exact) and search for a plan of at most the same bytes whose measured score is "
    "lower: decoders, the next-token KL against the dense model; encoders, 1 - cosine "
    "of the embeddings; on held-in calibration tokens. The refined plan is kept only "
    "when it also measures lower on a held-out split. DIR/plan.json gets the start "
    "plan and, when kept, a 'refined' method (what 'apply' uses by default); "
    "DIR/refine_state.json lets a rerun with the same settings continue the search.")
#: The state file written next to ``plan.json`` (a rerun continues from it).
STATE_FILE = "refine_state.json"
#: Nearby budgets whose exact plans seed the search (fractions of the budget).
SEED_BUDGETS = (0.995, 0.98, 0.96)


def add_refine_args(p, flag_prefix="") -> None:
    """The search's flags (shared by ``refine`` and ``allocate --refine``)."""
    g = p.add_argument_group("refinement (measured search)")
    g.add_argument("--evals", type=positive_int, default=200, metavar="N",
                   help="candidate plans to score in all, resumed runs included (default 200)")
    g.add_argument("--minutes", type=positive_float, default=None, metavar="M",
                   help="stop this run's search after M minutes (the held-out check follows)")
    g.add_argument("--search", choices=("local", "evo"), default="local",
                   help="local: first-improvement hill climb, one candidate per step "
                        "(default); evo: (1 + lambda) evolution in EvoPress's manner, "
                        "--offspring candidates of 1-3 mutations per generation")
    g.add_argument("--offspring", type=positive_int, default=16, metavar="N",
                   help="candidates per generation of --search evo (default 16)")
    g.add_argument("--survivors", type=positive_int, default=2, metavar="K",
                   help="candidates per generation that pass the screen to the search "
                        "tokens (default 2)")
    g.add_argument("--preselect", type=positive_int, default=4, metavar="K",
                   help="propose K times the candidates a step measures and measure those of "
                        "least predicted damage (a free first stage; default 4; 1: none)")
    g.add_argument("--screen-tokens", type=nonneg_int, default=128, metavar="N",
                   help="score every candidate on the first N search tokens first and only "
                        "the best (--survivors) on all --tokens (multi-stage selection; "
                        "default 128; 0: every candidate on all search tokens)")
    g.add_argument("--table", type=nonneg_int, default=1, metavar="W",
                   help="first measure each layer alone (every other layer at its best "
                        "option) at its start option and W ladder steps either side, "
                        "solve the exact allocator on those measured terms, re-measure "
                        "around its plan (up to 4 rounds) and score those plans first "
                        "(default 1; 0: off; this package's forward only)")
    g.add_argument("--table-tokens", type=nonneg_int, default=512, metavar="N",
                   help="tokens of the first search windows the table is measured on "
                        "(default 512; 0: all search tokens)")
    g.add_argument("--accept-z", type=nonneg_float, default=None, metavar="Z",
                   help="keep a move only when it lowers the search score by at least Z "
                        "standard errors of the paired per-token (per-sentence) difference "
                        "(default 2, opscope_nb.plan.refine.ACCEPT_Z; 0: any lower score, "
                        "which fits the search text's noise)")
    g.add_argument("--refine-seed", type=int, default=0, metavar="S",
                   help="seed of the moves (default 0)")
    g.add_argument("--text", metavar="FILE|sample|builtin", default=None,
                   help="text the candidates are scored on (default: the profile's "
                        "calibration text, else builtin); split into a search part and a "
                        "held-out part unless --held-out-text is given")
    g.add_argument("--held-out-text", metavar="FILE|sample|builtin", default=None,
                   help="held-out text of the never-worse check (default: the held-out "
                        "split of --text: the profile's --validate passages)")
    g.add_argument("--split", type=budget_arg, default=None, metavar="FRAC",
                   help="share of --text held out (default: the profile's --validate "
                        "fraction, else 0.25; seeded by the profile's split seed)")
    g.add_argument("--tokens", type=positive_int, default=2048, metavar="N",
                   help="search tokens (decoders) or token cap of the search sentences "
                        "(encoders); default 2048 (the screen takes most candidates; "
                        "512 let plans fit the search text that lost on held-out text)")
    g.add_argument("--held-out-tokens", type=positive_int, default=2048, metavar="N",
                   help="held-out tokens of the never-worse check (default 2048: per-token "
                        "KL is heavy-tailed, and on 512 a few tokens decided it)")
    g.add_argument("--window", type=positive_int, default=256, metavar="T",
                   help="decoder window (tokens per forward, fresh context each; default 256)")
    g.add_argument("--runtime", choices=("numba", "llama.cpp"), default="numba",
                   help="whose forward scores the candidates: this package's (default); "
                        "llama.cpp: a GGUF decoder's candidates are written as GGUF files "
                        "(from blocks packed once) and scored by llama.cpp's logits against "
                        "the source file's, on the search and held-out tokens (the screen "
                        "stays on this package's forward); needs llama-cpp-python and a "
                        "--menu ggml profile")
    g.add_argument("--act-quant", choices=("auto", "ggml", "none"), default="auto",
                   help="ggml: every linear layer of this package's forward reads its input "
                        "as llama.cpp's CPU matmul does for the layer's type (Q8_0 / Q8_K "
                        "blocks, F16 rounding), so plans are scored by the error they add "
                        "in llama.cpp; none: float activations (the weights' error alone); "
                        "auto (default): ggml when every option of the profile is a ggml "
                        "type or dense")
    g.add_argument("--restart", action="store_true",
                   help="ignore DIR/refine_state.json and start the search over")


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="refine a plan by measuring candidates (KL / cosine)",
                       description=DESCRIPTION)
    p.add_argument("profile", metavar="PROFILE.json")
    add_budget_args(p)
    p.add_argument("--source", metavar="SRC", default=None,
                   help="the profiled model (default: the path profile.json records)")
    p.add_argument("--out", metavar="DIR", required=True,
                   help="write plan.json and refine_state.json here (a rerun with the "
                        "same settings continues the search)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    add_refine_args(p)
    p.set_defaults(func=run)


def _source_of(args, doc) -> str:
    src = getattr(args, "source", None) or (doc.get("source") or {}).get("path")
    if not src:
        raise CliError(f"{args.profile}: the profile records no source path; give --source.")
    if not os.path.exists(src):
        raise CliError(f"{src}: the profiled model is not there; give --source.")
    return src


def _grams(args, doc, layers, src):
    """Calibration grams for the options that read one: ``calib.npz`` next to
    the profile, else the calibration re-run (as ``apply`` does), else none."""
    want = sorted({lp.name for lp in layers for o in lp.options if o.decomp.reads_gram})
    cal = (doc.get("settings") or {}).get("calib")
    if not want or not isinstance(cal, dict):
        return {}
    gpath = os.path.join(os.path.dirname(os.path.abspath(args.profile)), "calib.npz")
    from opscope_nb.profile.calib import GramsError, load_grams
    if os.path.exists(gpath):
        try:
            g, _ = load_grams(gpath)
        except (OSError, GramsError) as exc:
            raise CliError(f"{gpath}: cannot read calibration grams ({exc}).") from None
        return {n: g[n] for n in want if n in g}
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.models import ModelError
    try:
        st = CalibrationStream(src, text=cal.get("text"), max_tokens=cal.get("max_tokens"),
                               full_max_cols=cal.get("full_max_cols"), sensitivity=False,
                               validate=float(cal.get("validate") or 0.0), grams_for=want,
                               split_seed=int(cal.get("split_seed") or 0),
                               token_weights=cal.get("token_weights") == "norm",
                               log=lambda s: None)
        out = {}
        for _k, g in st:
            out.update({n: a for n, a in g.items() if n in want})
        return out
    except (ModelError, ValueError, OSError) as exc:
        raise CliError(f"{args.profile}: no calib.npz and the calibration cannot be re-run "
                       f"({exc}); give the profile's calib.npz.") from None


def _check_llamacpp(src, layers) -> None:
    """``--runtime llama.cpp``'s preconditions, each a one-line CliError: a GGUF
    decoder source, ggml / dense options only, llama-cpp-python importable."""
    from opscope_nb.models import llamacpp
    from opscope_nb.plan.refine_llamacpp import check_options, check_source
    try:
        check_source(src)
        check_options(layers)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not llamacpp.available():
        try:
            llamacpp._lib()
            why = "it does not import"
        except llamacpp.LlamaCppError as exc:
            why = str(exc).split(";")[0]
        raise CliError(f"--runtime llama.cpp needs llama-cpp-python, and {why}: pip install "
                       f"-e \".[llama]\" (builds llama.cpp), or use --runtime numba.")


def _state_key(args, doc_path, budget, start, spec) -> str:
    with open(doc_path, "rb") as f:
        h = hashlib.sha256(f.read()).hexdigest()
    parts = [h, str(budget), ",".join(map(str, start)), str(spec.get("objective")),
             args.search, str(args.offspring), str(args.survivors), str(args.screen_tokens),
             str(args.preselect),
             str(args.refine_seed), str(args.text),
             str(args.held_out_text), str(args.split), str(args.tokens),
             str(args.held_out_tokens), str(args.window),
             str(getattr(args, "table", 0)), str(getattr(args, "table_tokens", 0)),
             f"accept_z={float(getattr(args, 'accept_z', 0.0))!r}"]
    aq = getattr(args, "act_quant_resolved", "none")
    if aq != "none":
        parts.append("act_quant=" + aq)     # other scores: a float-activation state is not continued
    if getattr(args, "runtime", "numba") != "numba":
        parts.append(args.runtime)          # other scores: a numba state is not continued
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _fmt_eta(s):
    if s is None or not math.isfinite(s):
        return "ETA --"
    return f"ETA {s / 60:.1f} min" if s >= 90 else f"ETA {s:.0f}s"


def _logger(enabled, metric):
    """Progress: a rewritten line on a terminal, a line every 10 candidates (and
    at each new best) off one."""
    if not enabled:
        return None
    last = {"best": None}

    def log(n, total, best, start, el, eta):
        rel = best / start if start else float("nan")
        line = (f"refine: {n}/{total} candidates, best {metric} {best:.5g} ({rel:.3f}x the "
                f"start), {el:.0f}s, {_fmt_eta(eta)}")
        if enabled == "bar":
            sys.stderr.write("\r" + line + " " * 4)
        elif n % 10 == 0 or best != last["best"] or n == total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        last["best"] = best
    return log


def _table_logger(enabled):
    """Progress of the measured table: a rewritten line on a terminal, a line
    every 25 layer runs off one."""
    if not enabled:
        return None

    def log(rd, k, m, el):
        eta = (m - k) * el / k if k else None
        line = (f"refine: table round {rd}, layer run {k}/{m}, {el:.0f}s, "
                f"{_fmt_eta(eta)}")
        if enabled == "bar":
            sys.stderr.write("\r" + line + " " * 4)
            if k == m:
                sys.stderr.write("\n")
        elif k % 25 == 0 or k == m:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return log


def refine_allocation(args, doc, layers, spec, allocs, out_dir):
    """Run the search from ``allocs``' exact (or first) plan; returns
    ``(allocs with "refined" when kept, result dict)`` and prints the report."""
    from opscope_nb.plan import allocate as al
    from opscope_nb.plan import refine as rf
    from opscope_nb.models import ModelError, UnsupportedModelError, open_model
    from opscope_nb import io as tio
    if spec.get("latency_frac") is not None:
        raise CliError("refine keeps the byte budget only; drop --latency-budget.")
    if getattr(args, "accept_z", None) is None:
        args.accept_z = rf.ACCEPT_Z
    m0 = "exact" if "exact" in allocs else next(iter(allocs))
    a0 = allocs[m0][0]
    if not a0.feasible:
        raise CliError(f"the {m0} plan does not meet the budget; nothing to refine.")
    src = _source_of(args, doc)
    cal = (doc.get("settings") or {}).get("calib") or {}
    text = args.text or (cal.get("text") if isinstance(cal, dict) else None) or "builtin"
    split = args.split if args.split is not None else float(cal.get("validate") or 0.25)
    if not 0.0 < split < 1.0:
        raise CliError(f"--split must be a fraction in (0, 1); got {split:g}.")
    objective = a0.extra.get("objective") or al.output_objective(layers)
    if args.runtime == "llama.cpp":
        _check_llamacpp(src, layers)
    show = progress_enabled(args)
    args.act_quant_resolved = al.act_quant_mode(args.act_quant, layers)
    t0 = time.perf_counter()
    grams = _grams(args, doc, layers, src)
    kw = dict(text=text, held_out_text=args.held_out_text, split=split,
              split_seed=int(cal.get("split_seed") or 0) if isinstance(cal, dict) else 0,
              tokens=args.tokens, held_out_tokens=args.held_out_tokens, window=args.window,
              grams=grams, screen_tokens=args.screen_tokens or None,
              **({"table_tokens": args.table_tokens or None}
                 if args.table and args.runtime == "numba" else {}),
              requantize=bool((doc.get("settings") or {}).get("requantize")),
              act_quant=args.act_quant_resolved)
    try:
        model = open_model(src)
        kw["stored"] = {e.name: e for e in tio.open_source(src).entries}
        if args.runtime == "llama.cpp":
            from opscope_nb.plan.refine_llamacpp import LlamaCppScorer
            scorer = LlamaCppScorer.from_text(src, model, layers, **kw)
        else:
            scorer = rf.PlanScorer.from_text(model, layers, **kw)
    except (ModelError, UnsupportedModelError, ValueError) as exc:
        raise CliError(f"refine: cannot score plans on {src} ({exc}).") from None
    t_setup = time.perf_counter() - t0
    # seeds: the exact plans of nearby budgets and of the other objectives
    seeds = []
    B = int(a0.budget_bytes)
    with al.silence_native_output():
        for f in SEED_BUDGETS:
            try:
                a = al.exact_allocate(layers, budget_bpw=8.0 * math.floor(f * B) / max(
                                          a0.n_weights, 1),
                                      objective=objective, time_limit=args.time_limit)
            except (ValueError, TypeError):
                continue
            if a.feasible:
                seeds.append(a.choice)
        for obj in ("output", "weight"):
            if obj == objective:
                continue
            try:
                a = al.exact_allocate(layers, budget_bpw=8.0 * B / max(a0.n_weights, 1),
                                      objective=obj, time_limit=args.time_limit)
            except (ValueError, TypeError):
                continue
            if a.feasible:
                seeds.append(a.choice)
    state_path = os.path.join(out_dir, STATE_FILE)
    key = _state_key(args, args.profile, B, a0.choice, {"objective": objective})
    state = None if args.restart else rf.load_state(state_path, key)
    if state is not None:
        print(f"refine: continuing {state_path} ({state['evals']} candidates scored, best "
              f"{state['best_score']:.5g})", flush=True)
    log = _logger(show, scorer.metric)
    tlog = _table_logger(show)

    def on_state(st):
        st["key"] = key
        rf.save_state(state_path, st)
    try:
        res = rf.refine(scorer, a0.choice, B, objective=objective, evals=args.evals,
                        minutes=args.minutes, search=args.search, offspring=args.offspring,
                        survivors=args.survivors, preselect=args.preselect,
                        seed=args.refine_seed, seeds=seeds, table=args.table,
                        accept_z=args.accept_z, state=state, on_state=on_state, table_log=tlog,
                        log=log)
    except ValueError as exc:
        raise CliError(f"refine: {exc}") from None
    finally:
        if show == "bar":
            sys.stderr.write("\n")
        if hasattr(scorer, "close"):
            scorer.close()
    res.seconds["setup"] = t_setup
    _print_report(res, scorer, m0, objective)
    out = dict(allocs)
    if res.kept:
        c = [int(x) for x in res.best]
        nb = rf.plan_bytes(layers, c)
        err = al.predicted_damage(layers, c, objective)
        lb = a0.lower_bound
        gap = max(err - lb, 0.0) / max(err, 1e-12) if math.isfinite(lb) else math.nan
        extra = {"objective": objective, "refined_from": m0,
                 "measured": res.scores["best"],
                 "act_quant": getattr(scorer, "act_quant", None) or
                 getattr(getattr(scorer, "_ps", None), "act_quant", "none")}
        out["refined"] = (dataclasses.replace(a0, choice=c, total_err=err, total_bytes=nb,
                                              feasible=nb <= B, gap=gap, method="refined",
                                              extra=extra), res.seconds.get("total", 0.0))
    return out, res


def _print_report(res, scorer, m0, objective):
    sc = res.scores
    name = "KL" if res.metric == "kl" else "1-cos"
    rows = []
    for tag, lab in (("start", m0), ("best", "refined")):
        s = sc[tag]
        row = [lab, f"{s['bytes']}", f"{s['predicted']:.5g}", f"{s['search']:.5g}",
               f"{s['held_out']:.5g}"]
        row.append("-" if s.get("ppl") is None else f"{s['ppl']:.3f}")
        if res.metric == "1-cos":
            row[-1] = f"{1 - s['held_out']:.5f}"
        rows.append(row)
    last = "held-out PPL" if res.metric == "kl" else "held-out cosine"
    aq = getattr(scorer, "act_quant", None) or getattr(getattr(scorer, "_ps", None),
                                                        "act_quant", "none")
    if aq == "ggml":
        print("activations: as llama.cpp's CPU matmul reads them (Q8_0 / Q8_K blocks, F16 "
              "rounding; --act-quant ggml)")
    print(tabulate_rows(rows, ["plan", "bytes", f"predicted ({objective})",
                               f"{name} search ({sc['search_tokens']} tok)",
                               f"{name} held-out ({sc['held_out_tokens']} tok)", last]))
    if sc.get("ppl_dense") is not None and res.metric == "kl":
        print(f"dense held-out PPL {sc['ppl_dense']:.3f}")
    tb = sc.get("table") or {}
    if tb.get("rounds"):
        print(f"table: {tb['singletons']} layers-alone runs this run ({tb.get('entries', 0)} "
              f"in all) on {tb['split']} tokens in {tb['rounds']} round(s), "
              f"{tb['seconds']:.1f}s; {tb['plans']} plan(s) solved on the measured terms "
              f"scored first{'' if tb.get('complete') else ' (stopped by the time limit)'}")
    hs, hb = sc["start"]["held_out"], sc["best"]["held_out"]
    ratio = hb / hs if hs > 0 else float("nan")
    verdict = ("kept: the refined plan" if res.kept else
               "not kept: the start plan" if res.best != res.start else
               "no better plan found: the start plan")
    z = sc.get("held_out_z")
    zs = "" if res.best == res.start or z is None else f", paired z {z:+.2f}"
    print(f"refine: {res.evals} candidates ({res.run_evals} this run, stopped: {res.stopped}), "
          f"{res.accepted} moves kept (each >= {sc.get('accept_z', 0.0):g} standard errors "
          f"lower); held-out {name} {ratio:.3f}x the {m0} plan's{zs} -- {verdict}")
    sec = res.seconds
    tot = max(sec.get("search", 0.0), 1e-9)
    fps = res.forwards_per_second()
    parts = ", ".join(f"{k} {sec.get(k, 0.0) / tot:.0%}" for k in
                      ("forward", "head", "kl", "pack", "propose"))
    scr = sc.get("screen_tokens")
    llama = res.runtime == "llama.cpp"
    if llama:
        parts = ", ".join(f"{k} {sec.get(k, 0.0) / tot:.0%}" for k in
                          ("llama", "load", "assemble", "forward", "head", "kl", "pack",
                           "propose"))
    print(f"search {sec.get('search', 0.0):.1f}s: {res.run_evals / tot:.2f} candidates/s, "
          f"{fps:.2f} full-forward equivalents/s ({res.forwards:.1f} forwards of "
          f"{sc['search_tokens']} tokens x {scorer.n_blocks + 1} stages"
          f"{f'; screen {scr} tokens' if scr else ''}); time: {parts}; setup "
          f"{sec.get('setup', 0.0):.1f}s, held-out check {sec.get('held_out', 0.0):.1f}s")
    if llama:
        rates = scorer.rates() if hasattr(scorer, "rates") else {}
        per = "; ".join(
            f"{k} {v['runs']} {'candidate files' if k == 'llama.cpp' else 'stage runs'}, "
            f"{v['forwards_per_s']:.3f} forwards/s" for k, v in rates.items()
            if v.get("forwards_per_s"))
        screen = ("this package's forward" if "numba" in rates else "llama.cpp") if scr \
            else None
        print(f"runtime llama.cpp ({scorer.n_threads} thread"
              f"{'' if scorer.n_threads == 1 else 's'}): search split and held-out "
              f"check scored by llama.cpp's logits against {os.path.basename(scorer.source)}"
              f"{f'; screen by {screen}' if screen else ''}"
              f"{f' ({per})' if per else ''}")


def run(args) -> int:
    spec = budget_spec(args)
    doc = load_profile_doc(args.profile)
    layers = layers_from_doc(doc, args.profile)
    spec = checked_budget(layers, spec, args.profile)
    methods = ("exact",) if args.method == "all" else methods_of(args.method)
    allocs = allocate_checked(layers, spec, methods, args.profile, args.time_limit)
    print_plan(layers, allocs)
    print(f"{len(layers)} layers, {budget_text(spec, layers)}")
    out = ensure_outdir(args.out)
    allocs, res = refine_allocation(args, doc, layers, spec, allocs, out)
    cal = (doc.get("settings") or {}).get("calib")
    d = plan_dict(layers, allocs, spec, doc.get("source"), cal, None, requantize=bool(
        (doc.get("settings") or {}).get("requantize")))
    d["refine"] = res.to_dict()
    p = os.path.join(out, "plan.json")
    write(p, json_text(d))
    print(f"wrote {p}")
    if not res.kept:
        warn("the refined plan did not beat the start plan on the held-out split; plan.json "
             "holds the start plan only.")
    return 0
