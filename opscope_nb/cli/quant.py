"""``opscope-nb quant [SOURCE]``: the upstream ``--quant`` sweep - int8/int4/int3
(and int5/int6 when :class:`opscope_nb.profile.mining.QuantStat` has them) errors per
layer, the depth trend, a by-kind table, outlier hotspots and a mixed int4/int8
recipe under an int4 error ceiling (``--err-budget``)."""
from __future__ import annotations

import argparse

import numpy as np

from ._common import (
    CliError,
    Progress,
    add_source_args,
    budget_arg,
    fmt_bytes,
    fmt_err,
    load_checked,
    open_and_select,
    peak_rss_mb,
    progress_enabled,
    first_run_notice,
    tabulate_rows,
    warn,
)

NAME = "quant"
DEFAULT_ERR_BUDGET = 0.1
#: Optional per-channel columns shown when QuantStat carries them.
EXTRA_BITS = ("int5_pc", "int6_pc")


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="int8/int6/int5/int4/int3 sweep with a mixed-precision "
                                          "recipe")
    add_source_args(p)
    p.add_argument("--err-budget", type=budget_arg, default=None, metavar="ERR",
                   help=f"int4/chan relative error allowed in the mixed recipe "
                        f"(default {DEFAULT_ERR_BUDGET})")
    p.add_argument("--budget", type=budget_arg, default=None, dest="budget_deprecated",
                   help=argparse.SUPPRESS)  # old spelling of --err-budget
    p.add_argument("--bits-budget", type=budget_arg, default=0.03,
                   help="error target of the 'best bits' column (default 0.03)")
    p.set_defaults(func=run)


def err_budget(args) -> float:
    if args.budget_deprecated is not None:
        if args.err_budget is not None:
            raise CliError("quant: give --err-budget only (--budget is its deprecated "
                           "spelling).")
        warn("quant --budget is deprecated (it is an int4 error ceiling, not a byte "
             "fraction as in 'profile --budget'); use --err-budget.")
        return args.budget_deprecated
    return DEFAULT_ERR_BUDGET if args.err_budget is None else args.err_budget


def depth_split(idxs):
    """Early and late thirds of the block-index *range* (not of ``0..max``).

    Returns ``(early_max, late_min)``: index ``d`` is early when ``d < early_max``
    and late when ``d >= late_min``.  With three or more distinct indices both
    thirds are non-empty (the lowest index is early, the highest late).
    """
    lo, hi = min(idxs), max(idxs)
    span = hi - lo + 1
    return lo + span / 3.0, lo + 2.0 * span / 3.0


def depth_verdict(early: float, late: float) -> str:
    if late > early * 1.05:
        return "late layers quantise worse (> +5 %)"
    if late < early * 0.95:
        return "late layers quantise better (< -5 %)"
    return "flat (within +-5 %)"


def run(args) -> int:
    budget = err_budget(args)
    src, chosen, _ = open_and_select(args)
    from opscope_nb.profile.mining import parse_layer_kind, quant_stat
    first_run_notice(args)
    bar = Progress(len(chosen), sum(e.numel for e in chosen), progress_enabled(args))
    stats = []   # (entry, idx, kind, QuantStat)
    try:
        for i, e in enumerate(chosen, 1):
            bar.show(i, e.name)
            w, why = load_checked(e)
            bar.advance(e.numel)
            if w is None:
                bar.close()
                warn(f"skipping {e.name}: {why}.")
                continue
            idx, kind = parse_layer_kind(e.name)
            stats.append((e, idx, kind, quant_stat(e.name, w, args.bits_budget)))
            del w
    finally:
        bar.close()
    if not stats:
        raise CliError(f"{src.path}: every selected tensor was skipped (NaN/Inf or a "
                       f"non-float dtype).")
    extra = list(EXTRA_BITS)                 # QuantStat always has them

    def bits(b):
        return "-" if b is None else str(int(b))

    rows = [[e.name, "" if idx is None else idx, kind, f"{e.shape[0]}x{e.shape[1]}",
             fmt_err(q.int8_pt), fmt_err(q.int8_pc)]
            + [fmt_err(getattr(q, f)) for f in reversed(extra)]
            + [fmt_err(q.int4_pc), fmt_err(q.int3_pc), f"{q.outlier:.1f}",
               bits(q.best_bits)]
            for e, idx, kind, q in stats]
    print(tabulate_rows(rows, ["layer", "idx", "kind", "shape", "int8/tensor", "int8/chan"]
                        + [f.replace("_pc", "/chan") for f in reversed(extra)]
                        + ["int4/chan", "int3/chan", "outlier", "best bits"]))
    print(f"(best bits: fewest of 3/4/6/8 with per-channel error < {args.bits_budget:g}; "
          f"outlier: max/median column max-abs)")

    # depth trend: early third vs late third of the block-index range
    idxs = sorted({idx for _, idx, _, _ in stats if idx is not None})
    print()
    if len(idxs) >= 3:
        early_max, late_min = depth_split(idxs)
        early = [q.int4_pc for _, idx, _, q in stats if idx is not None and idx < early_max]
        late = [q.int4_pc for _, idx, _, q in stats if idx is not None and idx >= late_min]
        by_depth = []
        for d in idxs:
            qs = [q for _, idx, _, q in stats if idx == d]
            by_depth.append([d, len(qs), fmt_err(np.mean([q.int8_pc for q in qs])),
                             fmt_err(np.mean([q.int4_pc for q in qs]))])
        print(tabulate_rows(by_depth, ["block", "layers", "mean int8/chan",
                                       "mean int4/chan"]))
        e_m, l_m = float(np.mean(early)), float(np.mean(late))
        print(f"depth trend: int4/chan early third {e_m:.4f} vs late third {l_m:.4f} "
              f"({(l_m / max(e_m, 1e-12) - 1):+.1%}): {depth_verdict(e_m, l_m)}")
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
                                fmt_err(wavg(lambda q: q.int8_pc)),
                                fmt_err(wavg(lambda q: q.int4_pc)),
                                fmt_err(wavg(lambda q: q.int3_pc)),
                                f"{max(q.outlier for _, q in items):.1f}"]))
    krows.sort(key=lambda t: -t[0])
    print()
    print(tabulate_rows([r for _, r in krows],
                        ["kind", "layers", "params", "int8/chan", "int4/chan", "int3/chan",
                         "max outlier"]))
    print("(errors weighted by parameter count)")

    # outlier hotspots
    top = sorted(stats, key=lambda t: -t[3].outlier)[:5]
    print()
    print(tabulate_rows([[e.name, f"{q.outlier:.1f}", fmt_err(q.int8_pc), fmt_err(q.int4_pc)]
                         for e, _, _, q in top],
                        ["outlier hotspot", "max/median", "int8/chan", "int4/chan"]))

    # mixed int4/int8 recipe; bytes are honest: packed codes + one float32 scale per row
    from opscope_nb.profile.mining import stored_bytes
    n4 = n8 = 0
    size = dense = stored = 0
    err_w = 0.0
    params = 0
    dtypes = set()
    for e, _, _, q in stats:
        r, c = e.shape
        dense += 4 * r * c
        try:
            stored += stored_bytes(e.dtype, r, c)
        except ValueError:            # a dtype without a size rule: its bytes as read
            stored += int(e.raw().size)
        dtypes.add(str(e.dtype).upper())
        params += r * c
        if q.int4_pc <= budget:
            n4 += 1
            size += r * ((c + 1) // 2) + 4 * r
            err_w += r * c * q.int4_pc
        else:
            n8 += 1
            size += r * c + 4 * r
            err_w += r * c * q.int8_pc
    print()
    # against the bytes the weights take now (as stored), not float32's
    versus = (f"{stored / max(size, 1):.2f}x smaller" if size < stored else
              f"{size / max(stored, 1):.2f}x the stored bytes: no saving")
    print(f"mixed recipe (int4/chan where its error <= {budget:g}, else int8/chan): "
          f"{n4} layers int4, {n8} int8; {fmt_bytes(size)} vs {fmt_bytes(stored)} as stored "
          f"({'/'.join(sorted(dtypes))}; {versus}, {size / max(stored, 1):.1%} of the "
          f"stored bytes, {8 * size / max(params, 1):.2f} bits/weight; {fmt_bytes(dense)} "
          f"in float32), parameter-weighted error {err_w / max(params, 1):.4f}")
    print(f"peak RSS {peak_rss_mb():.0f} MiB")
    return 0
