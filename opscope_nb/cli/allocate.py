"""``opscope-nb allocate PROFILE.json``: re-solve a saved profile at another budget
(bytes as a fraction or in bits per weight, optionally a latency budget) without
touching the weights; ``--out DIR`` writes ``plan.json``."""
from __future__ import annotations

import os

from ._ggml import add_tensor_type_arg, write_type_file
from ._common import ensure_outdir, json_text, layers_from_doc, load_profile_doc, write
from ._plan import (add_budget_args, allocate_checked, budget_spec, budget_text, methods_of,
                    plan_dict, print_plan)

NAME = "allocate"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="re-solve a saved profile.json at a budget")
    p.add_argument("profile", metavar="PROFILE.json")
    add_budget_args(p)
    p.add_argument("--out", metavar="DIR", help="write plan.json here")
    add_tensor_type_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    spec = budget_spec(args)
    doc = load_profile_doc(args.profile)
    layers = layers_from_doc(doc, args.profile)
    allocs = allocate_checked(layers, spec, methods_of(args.method), args.profile,
                              args.time_limit)
    print_plan(layers, allocs)
    print(f"{len(layers)} layers, {budget_text(spec, layers)}")
    if args.out:
        out = ensure_outdir(args.out)
        p = os.path.join(out, "plan.json")
        write(p, json_text(plan_dict(layers, allocs, spec, doc.get("source"),
                                            (doc.get("settings") or {}).get("calib"))))
        print(f"wrote {p}")
    if args.tensor_type_file:
        m = "exact" if "exact" in allocs else next(iter(allocs))
        a = allocs[m][0]
        plan = {lp.name: lp.options[a.choice[i]].decomp for i, lp in enumerate(layers)}
        write_type_file(args.tensor_type_file, plan, doc)
    return 0
