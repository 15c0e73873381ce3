"""Budget flags, allocator runs, the plan tables and ``plan.json`` / ``options.csv``
(shared by ``profile`` and ``allocate``)."""
from __future__ import annotations

import csv
import io as _stdio
import math
import os
import time

import numpy as np

from ._common import (
    PROG,
    CliError,
    __version__,
    budget_arg,
    fmt_bytes,
    fmt_err,
    fmt_us,
    positive_float,
    positive_int,
    tabulate_rows,
    warn,
)

METHODS = ("greedy", "dado", "exact")
#: Error a "best option" must stay within in the per-layer table (the upstream's 2 %).
TIGHT_ERR = 0.02
#: Where the default budget lies between the smallest plan the menu can reach
#: (0) and the weights as stored (1) when neither ``--budget`` nor ``--bpw``
#: is given (:func:`default_budget`).
DEFAULT_BUDGET = 0.35
#: Relative error above which a layer counts as badly damaged, and the share of
#: such layers that flags a plan (:func:`flag_extreme`).
EXTREME_ERR = 0.3
EXTREME_SHARE = 0.5

#: How each kind of bound is named in the tables.
BOUND_NAMES = {"optimum": "exact optimum (proven by HiGHS)",
               "milp-dual": "HiGHS MILP dual bound",
               "lp": "LP relaxation", "none": "none (infeasible)"}

OPTIONS_CSV_COLUMNS = ("layer", "index", "kind", "rows", "cols", "option", "label",
                       "decomp", "rel_err", "bytes", "flops", "dense_bytes", "bytes_frac",
                       "out_err", "sensitivity")


def add_budget_args(p) -> None:
    """--budget/--bpw, --latency-budget/--latency-m, --method, --time-limit."""
    p.add_argument("--budget", type=budget_arg, default=None,
                   help=f"byte budget as a fraction (0, 1] of the planned weights' bytes "
                        f"as stored (default, unless --bpw is given: {DEFAULT_BUDGET:g} of "
                        f"the way from the smallest plan the menu can reach to the stored "
                        f"size, rounded up to 4 decimals -- always reachable; printed and "
                        f"recorded in plan.json). A budget below the smallest plan is an "
                        f"error naming the smallest feasible budget (see --fit)")
    p.add_argument("--bpw", type=positive_float, default=None, metavar="BITS",
                   help="byte budget in bits per weight instead of --budget "
                        "(bytes <= BITS/8 x weights of the planned layers)")
    p.add_argument("--fit", action="store_true",
                   help="when the budget cannot be met, plan at the smallest feasible "
                        "budget (in the same unit) with a warning instead of exit 2")
    p.add_argument("--latency-budget", type=budget_arg, default=None, metavar="FRAC",
                   help="also keep the plan's latency at --latency-m within FRAC of the "
                        "all-dense latency (needs a profile made with --latency)")
    p.add_argument("--latency-m", type=positive_int, default=1, metavar="M",
                   help="activation rows the latency budget is measured at (default 1)")
    p.add_argument("--objective", choices=("auto", "output", "sensitivity", "weight"),
                   default="auto",
                   help="what the plan minimises. auto (default): the one that follows the "
                        "model's output -- sensitivity x squared output error with --calib, "
                        "else the squared output error where calibrated and squared weight "
                        "error elsewhere; output, sensitivity: those explicitly; weight: "
                        "the seed's sum of weight-space rel_err (can spend int2/int3 where "
                        "a few layers break the model)")
    p.add_argument("--method", choices=(*METHODS, "all"), default="all",
                   help="allocator(s) to run (default: all)")
    p.add_argument("--time-limit", type=positive_float, default=60.0, metavar="SEC",
                   help="seconds for the exact (HiGHS) solver (default 60); when it "
                        "stops early the table says so")


def budget_spec(args) -> dict:
    """The allocator keyword arguments of the budget flags (CliError on a bad mix)."""
    if args.budget is not None and args.bpw is not None:
        raise CliError("give either --budget (a fraction of dense bytes) or --bpw (bits "
                       "per weight), not both.")
    spec = {"budget_frac": args.budget, "budget_bpw": args.bpw}
    if args.budget is None and args.bpw is None:
        spec["budget_default"] = DEFAULT_BUDGET      # resolved by checked_budget
    spec["fit"] = bool(getattr(args, "fit", False))
    if args.latency_budget is not None:
        spec["latency_frac"] = args.latency_budget
        spec["latency_m"] = args.latency_m
    spec["objective"] = getattr(args, "objective", "auto")
    return spec


def check_latencies(layers, spec, path) -> None:
    """One-line user error when a latency budget meets a profile without latencies
    (no dense latency at ``--latency-m``); a warning counting the options left out
    of the plan because nobody timed them."""
    if spec.get("latency_frac") is None:
        return
    from opscope_nb.plan.allocate import option_latency
    m = spec["latency_m"]
    missing = 0
    for lp in layers:
        if option_latency(lp.options[0], m) is None:
            raise CliError(f"{path}: layer {lp.name} has no latency at m={m}; re-run "
                           f"'profile --latency {m}' or drop --latency-budget.")
        missing += sum(option_latency(o, m) is None for o in lp.options)
    if missing:
        warn(f"{missing} option(s) have no latency at m={m} (no kernel timed them); "
             f"they are left out of the latency-budgeted plan.")


def _ceil_dec(num: int, den: int, places: int) -> float:
    """``num / den`` rounded up to ``places`` decimals (exact rationals)."""
    from fractions import Fraction
    q = 10 ** places
    v = Fraction(int(num) * q, max(int(den), 1))
    return float(Fraction(-(-v.numerator // v.denominator), q))


def reachable(layers) -> dict:
    """What a budget can reach on these layers: ``min_bytes`` (every layer on
    its fewest-bytes option), ``dense`` (the bytes as stored), ``weights``,
    and the smallest feasible ``frac`` (4 decimals, rounded up) and ``bpw``
    (3 decimals, rounded up)."""
    mn = int(sum(min(int(o.bytes) for o in lp.options) for lp in layers))
    dense = int(sum(int(lp.dense_bytes) for lp in layers))
    nw = int(sum(int(lp.rows) * int(lp.cols) for lp in layers))
    return {"min_bytes": mn, "dense": dense, "weights": nw,
            "frac": min(_ceil_dec(mn, dense, 4), 1.0) if mn <= dense else None,
            "bpw": _ceil_dec(8 * mn, nw, 3)}


def default_budget(layers, where=DEFAULT_BUDGET) -> float:
    """The default ``--budget``: ``where`` of the way from the smallest plan
    (:func:`reachable`) to the stored bytes, as a fraction of the stored
    bytes rounded up to 4 decimals (at most 1)."""
    r = reachable(layers)
    from fractions import Fraction
    target = Fraction(r["min_bytes"]) + Fraction(repr(float(where))) * max(
        r["dense"] - r["min_bytes"], 0)
    return min(_ceil_dec(target.numerator, target.denominator * max(r["dense"], 1), 4), 1.0)


def checked_budget(layers, spec: dict, path=None) -> dict:
    """``spec`` with the default budget resolved and the byte budget checked
    against the smallest plan: a budget below it is a :class:`CliError`
    naming the smallest feasible budget in the same unit, or -- with
    ``spec["fit"]`` -- that budget with a warning (``spec["fitted_from"]``
    keeps the asked one)."""
    from opscope_nb.plan.allocate import budget_bytes
    spec = dict(spec)
    if spec.get("budget_frac") is None and spec.get("budget_bpw") is None:
        where = spec.get("budget_default", DEFAULT_BUDGET)
        spec["budget_frac"] = default_budget(layers, where)
        spec["budget_default"] = where
    r = reachable(layers)
    b = budget_bytes(layers, spec.get("budget_frac"), budget_bpw=spec.get("budget_bpw"))
    if b >= r["min_bytes"]:
        return spec
    bpw = spec.get("budget_bpw") is not None
    asked = (f"--bpw {spec['budget_bpw']:g}" if bpw else f"--budget {spec['budget_frac']:g}")
    smallest = f"--bpw {r['bpw']:g}" if bpw else f"--budget {r['frac']:g}"
    where = f"{path}: " if path else ""
    if not spec.get("fit"):
        raise CliError(
            f"{where}{asked} ({b} bytes) is below the smallest plan the menu can reach "
            f"({r['min_bytes']} bytes = {8 * r['min_bytes'] / max(r['weights'], 1):.3f} "
            f"bits/weight, every layer on its fewest-bytes option); the smallest feasible "
            f"budget is {smallest}. Give it (or more), or pass --fit to plan there.")
    warn(f"{asked} ({b} bytes) cannot be met; --fit plans at the smallest feasible budget, "
         f"{smallest} ({r['min_bytes']} bytes).")
    spec["fitted_from"] = spec.get("budget_bpw") if bpw else spec.get("budget_frac")
    if bpw:
        spec["budget_bpw"] = r["bpw"]
    else:
        spec["budget_frac"] = r["frac"]
    return spec


def flag_extreme(layers, allocs, spec) -> None:
    """Flag (stderr and ``extra["extreme_damage"]``) each feasible plan that
    leaves more than :data:`EXTREME_SHARE` of its layers above
    :data:`EXTREME_ERR` relative error, with the budget at which every layer
    can stay within it (each layer's fewest-bytes option within the error)."""
    n = len(layers)
    need = sum(min(int(o.bytes) for o in lp.options if o.rel_err <= EXTREME_ERR)
               if any(o.rel_err <= EXTREME_ERR for o in lp.options) else int(lp.dense_bytes)
               for lp in layers)
    r = reachable(layers)
    frac = min(_ceil_dec(need, r["dense"], 4), 1.0)
    bpw = _ceil_dec(8 * need, r["weights"], 3)
    flagged = []
    for m, (a, _) in allocs.items():
        if not a.feasible:
            continue
        above = sum(float(lp.options[int(c)].rel_err) > EXTREME_ERR
                    for lp, c in zip(layers, a.choice))
        if above > EXTREME_SHARE * n:
            a.extra["extreme_damage"] = {"layers_above": int(above), "layers": n,
                                         "rel_err_above": EXTREME_ERR,
                                         "avoid_budget": frac, "avoid_bpw": bpw,
                                         "avoid_bytes": int(need)}
            flagged.append((m, above))
    if flagged:
        which = ", ".join(f"{m} ({k} of {n})" for m, k in flagged)
        unit = (f"--bpw {bpw:g}" if spec.get("budget_bpw") is not None
                else f"--budget {frac:g} ({bpw:g} bits/weight)")
        warn(f"extreme damage predicted: the plans leave most layers above {EXTREME_ERR:g} "
             f"relative error -- {which}; expect a broken model. Every layer can stay "
             f"within {EXTREME_ERR:g} at {unit}.")


def methods_of(arg: str) -> tuple:
    return METHODS if arg == "all" else (arg,)


def run_allocators(layers, spec: dict, methods, time_limit: float = 60.0) -> dict:
    """Run each named allocator; returns ``{method: (Allocation, seconds)}``.

    ``spec`` holds the keyword arguments shared by the three allocators
    (``budget_frac`` or ``budget_bpw``, optionally ``latency_frac``/``latency_m``);
    a bare float is taken as ``budget_frac``.
    """
    from opscope_nb.plan import allocate as al
    if not isinstance(spec, dict):
        spec = {"budget_frac": float(spec)}
    spec = {k: v for k, v in spec.items() if k not in ("fit", "fitted_from",
                                                        "budget_default")}
    if spec.get("budget_frac") is None and spec.get("budget_bpw") is None:
        spec["budget_frac"] = default_budget(layers)
    flag = spec.pop("flag_damage", True)
    if spec.get("objective", "auto") == "auto":
        spec["objective"] = al.output_objective(layers)
    fns = {"greedy": al.greedy_allocate, "dado": al.dado_allocate,
           "exact": al.exact_allocate}
    out = {}
    for m in methods:
        kw = dict(spec)
        if m == "exact":
            kw["time_limit"] = time_limit
        t = time.perf_counter()
        if m == "exact":
            # HiGHS can print a line from C++ past its own log switch: the
            # command (never the library) points fds 1/2 away for the solve
            with al.silence_native_output():
                a = fns[m](layers, **kw)
        else:
            a = fns[m](layers, **kw)
        out[m] = (a, time.perf_counter() - t)
    if flag:
        _flag_damage(layers, spec, out, al)
        flag_extreme(layers, out, spec)
    return out


def _flag_damage(layers, spec, allocs, al):
    """Record each plan's predicted output damage (``extra``) and flag (stderr
    and plan.json) any plan far above the run's best at the same budget; under
    ``--objective weight`` the reference includes a greedy plan of the
    output-following objective."""
    if not allocs:
        return
    ref_obj = al.output_objective(layers)
    dmg = {m: al.predicted_damage(layers, a.choice, ref_obj) for m, (a, _) in allocs.items()
           if a.feasible}
    best = min(dmg.values(), default=math.inf)
    if spec.get("objective") == "weight":
        kw = {k: v for k, v in spec.items() if k != "objective"}
        ref = al.greedy_allocate(layers, objective=ref_obj, **kw)
        if ref.feasible:
            best = min(best, al.predicted_damage(layers, ref.choice, ref_obj))
    for m, (a, _) in allocs.items():
        if m not in dmg:
            continue
        a.extra["predicted_damage"] = dmg[m]
        a.extra["damage_objective"] = ref_obj
        if best > 0 and dmg[m] > al.DAMAGE_FLAG_RATIO * best:
            a.extra["damage_flag"] = dmg[m] / best
            warn(f"the {m} plan's predicted output damage ({ref_obj}: {dmg[m]:.4g}) is "
                 f"{dmg[m] / best:.1f}x the best plan's at this budget ({best:.4g}); "
                 f"{'drop --objective weight' if spec.get('objective') == 'weight' else 'prefer the exact plan'}.")


def allocate_checked(layers, spec, methods, path, time_limit=60.0) -> dict:
    """run_allocators on layers read from a user's file: bad numbers are user errors.
    ``spec`` should have passed :func:`checked_budget` (the budget is checked
    against the smallest plan there)."""
    check_latencies(layers, spec, path)
    try:
        return run_allocators(layers, spec, methods, time_limit)
    except (ValueError, TypeError) as exc:
        raise CliError(f"{path}: cannot allocate this profile ({exc}).")


def best_bound(allocs: dict):
    """The best (largest) valid lower bound of the run: ``(value, kind, method)``.

    The exact solver's proven optimum beats every LP bound; ``(nan, "none",
    None)`` when no method has a finite bound (infeasible).
    """
    best = (math.nan, "none", None)
    for m, (a, _) in allocs.items():
        lb = a.lower_bound
        if not math.isfinite(lb):
            continue
        if not math.isfinite(best[0]) or lb > best[0] or (
                lb == best[0] and a.bound == "optimum"):
            best = (float(lb), a.bound, m)
    return best


def gap_vs(a, bound: float) -> float:
    """``(total_err - bound) / max(total_err, 1e-12)``; ``nan`` if infeasible or no bound."""
    if not a.feasible or not math.isfinite(bound):
        return math.nan
    return max(a.total_err - bound, 0.0) / max(a.total_err, 1e-12)


def plan_table(layers, allocs: dict) -> str:
    """Per-layer table: shape, best option within 2 %, each method's choice."""
    headers = ["layer", "shape", "stored", f"best <= {TIGHT_ERR:.0%} (err)"]
    for m in allocs:
        headers += [f"{m} (err)", "bytes"]
    rows = []
    for i, lp in enumerate(layers):
        best = lp.best_within(TIGHT_ERR)
        row = [lp.name, f"{lp.rows}x{lp.cols}",
               f"{fmt_bytes(lp.dense_bytes)} {lp.stored_dtype}",
               f"{best.decomp.label} ({best.rel_err:.4f})"]
        for m, (a, _) in allocs.items():
            o = lp.options[a.choice[i]]
            row += [f"{o.decomp.label} ({fmt_err(o.rel_err)})", fmt_bytes(o.bytes)]
        rows.append(row)
    return tabulate_rows(rows, headers)


def totals_table(allocs: dict, n_layers: int) -> str:
    """Per-method totals; gaps against the best bound of the run (see :func:`best_bound`).

    A ``status`` column appears when the exact solver did not prove optimality,
    and latency columns when a latency budget was set.
    """
    bound, _, _ = best_bound(allocs)
    show_status = any(a.status and a.status != "optimal" for a, _ in allocs.values())
    show_lat = any(a.latency_m is not None for a, _ in allocs.values())
    headers = ["method", "total err", "mean err", "bytes", "budget", "bits/weight",
               "compression", "feasible"]
    if show_lat:
        headers += ["latency", "latency budget"]
    headers += ["gap", "time"]
    if show_status:
        headers.append("status")
    rows = []
    for m, (a, sec) in allocs.items():
        g = gap_vs(a, bound)
        row = [m, fmt_err(a.total_err), fmt_err(a.total_err / max(n_layers, 1)),
               fmt_bytes(a.total_bytes), fmt_bytes(a.budget_bytes),
               f"{a.bits_per_weight:.2f}" if math.isfinite(a.bits_per_weight) else "-",
               f"{a.compression():.2f}x", "yes" if a.feasible else "NO"]
        if show_lat:
            row += [fmt_us(a.total_latency_us), fmt_us(a.latency_budget_us)]
        row += ["-" if not math.isfinite(g) else f"{g:.2%}", f"{sec * 1e3:.0f} ms"]
        if show_status:
            row.append(a.status or "-")
        rows.append(row)
    return tabulate_rows(rows, headers)


def bound_line(allocs: dict) -> str:
    """The sentence naming the bound the gaps are measured against."""
    value, kind, m = best_bound(allocs)
    if m is None:
        return "gap: no finite lower bound (no plan meets the budget)."
    return (f"gap = (err - bound) / err against the best bound of this run: "
            f"{BOUND_NAMES.get(kind, kind)} = {value:.6g} (from {m}).")


def budget_text(spec: dict, layers) -> str:
    """``budget 0.35 = 1.2 MiB`` / ``budget 6.4 bits/weight = ...`` for the summary."""
    from opscope_nb.plan.allocate import budget_bytes
    b = budget_bytes(layers, spec.get("budget_frac"), budget_bpw=spec.get("budget_bpw"))
    nw = sum(int(lp.rows) * int(lp.cols) for lp in layers)
    if spec.get("budget_bpw") is not None:
        head = f"budget {spec['budget_bpw']:g} bits/weight"
        text = f"{head} = {fmt_bytes(b)}"
    else:
        head = f"budget {spec['budget_frac']:g}"
        if spec.get("budget_default") is not None:
            head += (f" (default: {spec['budget_default']:g} of the way from the smallest "
                     f"plan to the stored size)")
        text = f"{head} = {fmt_bytes(b)} = {8 * b / max(nw, 1):.2f} bits/weight"
    if spec.get("fitted_from") is not None:
        text += f" (--fit: {spec['fitted_from']:g} asked)"
    if spec.get("latency_frac") is not None:
        text += f", latency budget {spec['latency_frac']:g} of dense at m={spec['latency_m']}"
    return text


def plan_dict(layers, allocs: dict, spec, source=None, calib=None, validation=None,
              requantize=False) -> dict:
    """The ``plan.json`` document: each method's :meth:`Allocation.to_dict` (with
    per-layer rows, latencies and totals), its seconds and its gap against the
    run's best bound; ``calib`` (the profile's calibration settings) lets
    ``apply`` re-run the calibration when no ``calib.npz`` was kept;
    ``validation`` (per method) is each plan's measured metric on held-out
    text (``profile --calib --validate``); ``requantize``: the profile measured
    each tensor's stored ggml type as a re-quantisation, which ``apply`` then
    writes (``profile --requantize``)."""
    if not isinstance(spec, dict):
        spec = {"budget_frac": float(spec)}
    dense = int(sum(int(lp.dense_bytes) for lp in layers))
    value, kind, from_m = best_bound(allocs)
    doc = {"tool": PROG, "version": __version__,
           "budget": spec.get("budget_frac"), "budget_bpw": spec.get("budget_bpw"),
           "budget_default": spec.get("budget_default"),
           "budget_fitted_from": spec.get("fitted_from"),
           "latency_budget": spec.get("latency_frac"),
           "latency_m": spec.get("latency_m") if spec.get("latency_frac") is not None
           else None,
           "objective": spec.get("objective", "auto"),
           "objective_used": (next(iter(allocs.values()))[0].extra.get("objective", "weight")
                              if allocs else None),
           "dense_bytes": dense,                 # as the source stores the weights
           "f32_bytes": int(sum(int(lp.f32_bytes) for lp in layers)),
           "stored_dtypes": sorted({lp.stored_dtype for lp in layers}),
           "n_weights": int(sum(int(lp.rows) * int(lp.cols) for lp in layers)),
           "n_layers": len(layers),
           "requantize": bool(requantize),
           "best_bound": {"value": value if math.isfinite(value) else None,
                          "kind": kind, "method": from_m},
           "methods": {}}
    if source is not None:
        doc["source"] = source
    if calib:
        doc["calib"] = {k: calib.get(k) for k in ("text", "max_tokens", "tokens",
                                                   "full_max_cols", "validate", "split_seed",
                                                   "token_weights")
                        if k in calib}
    for m, (a, sec) in allocs.items():
        d = a.to_dict(layers)
        d["seconds"] = sec
        g = gap_vs(a, value)
        d["gap_vs_best_bound"] = g if math.isfinite(g) else None
        if validation and m in validation:
            d["validation"] = validation[m]
        doc["methods"][m] = d
    return doc


def options_csv(layers) -> str:
    """Tidy CSV: one row per layer x option (loads into pandas as is).

    :data:`OPTIONS_CSV_COLUMNS`, then one ``latency_us_m{m}`` column per ``m``
    measured anywhere in the profile (empty where an option was not timed).
    """
    from opscope_nb.plan.allocate import option_latency
    from opscope_nb.profile.mining import parse_layer_kind
    ms = sorted({int(k) for lp in layers for o in lp.options
                 for k in (getattr(o, "latency_us", None) or {})})
    buf = _stdio.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(OPTIONS_CSV_COLUMNS + tuple(f"latency_us_m{m}" for m in ms))
    for lp in layers:
        idx, kind = parse_layer_kind(lp.name)
        for j, o in enumerate(lp.options):
            kd = o.decomp.to_dict()
            lat = [option_latency(o, m) for m in ms]
            w.writerow([lp.name, "" if idx is None else idx, kind, lp.rows, lp.cols, j,
                        o.decomp.label, kd.get("kind", ""),
                        repr(float(o.rel_err)), int(o.bytes), int(o.flops),
                        int(lp.dense_bytes), repr(o.bytes / max(lp.dense_bytes, 1)),
                        "" if getattr(o, "out_err", None) is None else repr(float(o.out_err)),
                        "" if getattr(lp, "sensitivity", None) is None
                        else repr(float(lp.sensitivity))]
                       + ["" if t is None else repr(t) for t in lat])
    return buf.getvalue()


def plan_line(layers, allocs) -> str:
    """One line per run: each plan's bytes and bits per weight."""
    nw = sum(int(lp.rows) * int(lp.cols) for lp in layers)
    parts = [f"{m} {fmt_bytes(a.total_bytes)} = {a.bits_per_weight:.3f} bits/weight"
             + ("" if a.feasible else " (over budget)") for m, (a, _) in allocs.items()]
    return f"plans over {nw} weights: " + "; ".join(parts)


def print_plan(layers, allocs) -> None:
    print(plan_table(layers, allocs))
    print()
    print(totals_table(allocs, len(layers)))
    print(bound_line(allocs))
    print(plan_line(layers, allocs))


__all__ = ["METHODS", "TIGHT_ERR", "DEFAULT_BUDGET", "BOUND_NAMES", "OPTIONS_CSV_COLUMNS",
           "add_budget_args", "budget_spec", "check_latencies", "methods_of",
           "run_allocators", "allocate_checked", "best_bound", "gap_vs", "plan_table",
           "reachable", "default_budget", "checked_budget", "flag_extreme", "plan_line",
           "EXTREME_ERR", "EXTREME_SHARE",
           "totals_table", "bound_line", "budget_text", "plan_dict", "options_csv",
           "print_plan"]


def sensitivity_transfer_line(layers) -> str:
    """How the sensitivities measured on the fitting text compare with the same
    probe on the held-out text (``LayerProfile.sensitivity_val``): one line,
    or ``""`` when fewer than two layers carry both."""
    pairs = np.asarray([(lp.sensitivity, lp.sensitivity_val) for lp in layers
                        if getattr(lp, "sensitivity_val", None) is not None
                        and lp.sensitivity is not None and lp.sensitivity > 0], dtype=np.float64)
    if len(pairs) < 2:
        return ""
    r = pairs[:, 1] / pairs[:, 0]
    lo, med, hi = np.percentile(r, [10, 50, 90])
    ranks = np.argsort(np.argsort(pairs, axis=0), axis=0).astype(np.float64)
    rho = float(np.corrcoef(ranks[:, 0], ranks[:, 1])[0, 1]) if np.ptp(ranks[:, 0]) else 1.0
    return (f"sensitivity on the held-out text: {len(pairs)} layers, held-out / fit ratio "
            f"median {med:.2f} (10-90 %: {lo:.2f}-{hi:.2f}), rank correlation {rho:.2f}")


def _held_out_prediction(layers, choice):
    """The plan's predicted damage with each layer's held-out sensitivity where
    measured (the fitting one elsewhere); None when no layer has one."""
    import dataclasses
    from opscope_nb.plan import allocate as al
    if not any(getattr(lp, "sensitivity_val", None) is not None for lp in layers):
        return None
    swapped = [dataclasses.replace(lp, sensitivity=lp.sensitivity_val)
               if getattr(lp, "sensitivity_val", None) is not None else lp for lp in layers]
    return al.predicted_damage(swapped, choice, "sensitivity")


def validate_plans(source, cal, layers, allocs, show=False) -> dict:
    """Each distinct plan of ``allocs`` run on the held-out part of the
    calibration text recorded in ``cal`` (a profile's ``settings.calib``: same
    text, token cap, diagonal threshold, split and seed): one streamed pass of
    :class:`~opscope_nb.profile.calib.CalibrationStream` with ``plans``.

    Returns ``{method: {metric, measured, cosine|top1, tokens, predicted}}``
    (``predicted``: the plan's sum of sensitivity x out_err**2, same units,
    when the layers carry sensitivities; ``predicted_heldout_sens``: the same
    sum with the sensitivities measured on the held-out text, when the
    profile has them) and prints one line per method; ``{}``
    (with a warning) when there is nothing to hold out or the model cannot run.
    """
    import sys
    if not cal or not cal.get("validate") or not allocs:
        return {}
    from opscope_nb.plan import allocate as al
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.data import TEXT_KEYWORDS
    from opscope_nb.models import ModelError, UnsupportedModelError
    text = cal.get("text")
    if text is not None and text not in TEXT_KEYWORDS and not os.path.exists(text):
        warn(f"--validate: the calibration text {text} is gone; nothing measured.")
        return {}
    keyed, names = {}, {}
    for m, (a, _) in allocs.items():
        plan = {lp.name: lp.options[int(c)].decomp for lp, c in zip(layers, a.choice)}
        key = tuple(sorted((n, repr(d)) for n, d in plan.items()))
        keyed.setdefault(key, plan)
        names.setdefault(key, []).append(m)
    plans = {"/".join(ms): keyed[k] for k, ms in names.items()}
    try:
        vs = CalibrationStream(source, text=text, max_tokens=cal.get("max_tokens"),
                               full_max_cols=cal.get("full_max_cols"),
                               validate=float(cal["validate"]),
                               split_seed=int(cal.get("split_seed") or 0),
                               token_weights=cal.get("token_weights") == "norm", sensitivity=False,
                               plans=plans, act_quant=al.act_quant_mode("auto", layers),
                               grams_for={
                                   n for plan in plans.values() for n, d in plan.items()
                                   if d.reads_gram},
                               log=(lambda s: print(s, file=sys.stderr, flush=True)) if show
                               else (lambda s: None))
        res = vs.result(rest=False)
    except (ModelError, UnsupportedModelError, ValueError, OSError) as exc:
        warn(f"--validate: the plans could not be measured ({exc}).")
        return {}
    if not res.validation:
        warn("--validate: the text has too few passages to hold any out; nothing measured.")
        return {}
    predict = al.output_objective(layers) == "sensitivity"
    out = {}
    for label, meas in res.validation.items():
        for m in label.split("/"):
            a = allocs[m][0]
            pred = al.predicted_damage(layers, a.choice, "sensitivity") if predict else None
            pv = _held_out_prediction(layers, a.choice) if predict else None
            out[m] = dict(meas, predicted=pred, predicted_heldout_sens=pv)
            extra = (f"cosine {meas['cosine']:.5f}" if "cosine" in meas
                     else f"top-1 {meas['top1']:.3f}")
            ptxt = (f"predicted {pred:.4g}" + (f" ({pv:.4g} with the held-out "
                                               f"sensitivities)" if pv is not None else "")
                    + ", " if pred is not None else "")
            ratio = (f" ({meas['measured'] / pred:.2f}x the prediction)"
                     if pred and pred > 0 else "")
            acts = ", llama.cpp's activations" if meas.get("act_quant") == "ggml" else ""
            print(f"validation ({meas['tokens']} held-out tokens, {meas['metric']}{acts}): {m}: "
                  f"{ptxt}measured {meas['measured']:.4g}{ratio} ({extra})")
    return out
