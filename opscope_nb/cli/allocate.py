"""``opscope-nb allocate PROFILE.json``: re-solve a saved profile at another budget
(bytes as a fraction or in bits per weight, optionally a latency budget) without
touching the weights; ``--out DIR`` writes ``plan.json``.  A profile made with
``--calib --validate FRAC`` has its plans measured on the held-out text again
(one streamed pass over the source, which must still be where the profile
read it; ``--no-validate`` skips it).  ``--refine`` then searches for a plan
of the same budget that measures better (``opscope-nb refine``, needs ``--out``)."""
from __future__ import annotations

import argparse
import os

from ._tensor_types import add_tensor_type_arg, write_type_file
from ._common import (
    CliError,
    ensure_outdir,
    json_text,
    layers_from_doc,
    load_profile_doc,
    progress_enabled,
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
    validate_plans,
)

NAME = "allocate"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="re-solve a saved profile.json at a budget")
    p.add_argument("profile", metavar="PROFILE.json")
    add_budget_args(p)
    p.add_argument("--out", metavar="DIR", help="write plan.json here")
    p.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the plans on the profile's held-out calibration text "
                        "(default when the profile has one; re-reads the source model)")
    add_tensor_type_arg(p)
    p.add_argument("--refine", action="store_true",
                   help="then refine the exact plan by measuring candidates, as "
                        "'opscope-nb refine' (needs --out; the flags below)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    from .refine import add_refine_args
    add_refine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.refine and not args.out:
        raise CliError("--refine needs --out DIR (plan.json and the search's state go there).")
    spec = budget_spec(args)
    doc = load_profile_doc(args.profile)
    layers = layers_from_doc(doc, args.profile)
    spec = checked_budget(layers, spec, args.profile)
    allocs = allocate_checked(layers, spec, methods_of(args.method), args.profile,
                              args.time_limit)
    print_plan(layers, allocs)
    print(f"{len(layers)} layers, {budget_text(spec, layers)}")
    cal = (doc.get("settings") or {}).get("calib")
    validation = {}
    if args.validate and isinstance(cal, dict) and cal.get("validate"):
        src = (doc.get("source") or {}).get("path")
        if not src or not os.path.exists(src):
            warn(f"--validate: the profiled model {src} is not there; plans not measured "
                 f"(--no-validate silences this).")
        else:
            validation = validate_plans(src, cal, layers, allocs, progress_enabled(args))
    res = None
    if args.refine:
        from .refine import refine_allocation
        allocs, res = refine_allocation(args, doc, layers, spec, allocs,
                                        ensure_outdir(args.out))
    if args.out:
        out = ensure_outdir(args.out)
        p = os.path.join(out, "plan.json")
        d = plan_dict(layers, allocs, spec, doc.get("source"), cal, validation,
                      requantize=bool((doc.get("settings") or {}).get("requantize")))
        if res is not None:
            d["refine"] = res.to_dict()
        write(p, json_text(d))
        print(f"wrote {p}")
    if args.tensor_type_file:
        m = next((k for k in ("refined", "exact") if k in allocs), next(iter(allocs)))
        a = allocs[m][0]
        plan = {lp.name: lp.options[a.choice[i]].decomp for i, lp in enumerate(layers)}
        write_type_file(args.tensor_type_file, plan, doc)
    return 0
