"""Mining and allocation speed (prints; never part of pytest).

    python benchmarks/bench_mining.py [--rows 1024 --cols 3072] [--layers 200]

* ``profile_layer`` on a ``rows x cols`` float32 Gaussian weight (the hard,
  flat-spectrum case): cold (first call, includes JIT compile or cache load)
  and warm (best of 3), with the per-part split from ``LayerProfile.timings``.
* ``greedy_allocate`` / ``dado_allocate`` (default ``DadoConfig``) /
  ``exact_allocate`` on ``--layers`` layers with ~12 options each (option
  tables shaped like real profiles, fixed seed): cold and warm (best of 5).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np


def synthetic_layers(n_layers, seed=0):
    """LayerProfiles shaped like real ones: dense, int8, int4, two int4/g,
    ternary, 2:4, three low-rank, Tucker, TT (12 options), random errors."""
    from opscope_nb.formats import Decomp, packed_bytes
    from opscope_nb.profile.mining import DecompOption, LayerProfile

    rng = np.random.default_rng(seed)
    shapes = [(1024, 1024), (1024, 3072), (3072, 1024), (512, 2048), (2048, 512)]
    out = []
    for i in range(n_layers):
        rows, cols = shapes[i % len(shapes)]
        q = rng.uniform(0.6, 1.6)  # how hard this layer is to quantise
        lr = rng.uniform(0.2, 1.0)  # how far from low-rank
        specs = [
            (Decomp.dense(), 0.0),
            (Decomp.int8(), 0.006 * q),
            (Decomp.int4(), 0.11 * q),
            (Decomp.int4(32), 0.08 * q),
            (Decomp.int4(128), 0.095 * q),
            (Decomp.ternary(), 0.45 * q),
            (Decomp.sparse24(), 0.55 + 0.1 * rng.random()),
        ]
        for r, e in ((16, 0.9), (64, 0.7), (256, 0.4)):
            specs.append((Decomp.lowrank(r), min(1.0, e * lr + 0.05 * rng.random())))
        c1 = 32
        specs.append((Decomp.tucker((rows, c1, cols // c1), (32, 16, cols // c1 // 2)),
                      min(1.0, 0.95 * lr + 0.05)))
        specs.append((Decomp.tt((32, rows // 32, 32, cols // 32), 16),
                      min(1.0, 0.97 * lr + 0.03)))
        opts = [DecompOption(d, float(e), packed_bytes(rows, cols, d), 1) for d, e in specs]
        out.append(LayerProfile(f"blk.{i}.w", rows, cols, 4 * rows * cols, opts))
    return out


def timed(fn, reps):
    """(result of the fastest warm run, cold seconds, fastest warm seconds)."""
    t0 = time.perf_counter()
    res = fn()
    cold = time.perf_counter() - t0
    best, best_res = math.inf, res
    for _ in range(reps):
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best, best_res = dt, res
    return best_res, cold, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--budget", type=float, default=0.3)
    args = ap.parse_args()

    import numba

    from opscope_nb.plan.allocate import dado_allocate, exact_allocate, greedy_allocate
    from opscope_nb.profile.mining import profile_layer

    blas = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"threads: numba {numba.get_num_threads()}, OPENBLAS_NUM_THREADS={blas}, "
          f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    print("  (on a shared, oversubscribed machine multi-threaded BLAS can slow the SVD/"
          "Tucker/TT parts 10x; OPENBLAS_NUM_THREADS=1 gives stable numbers)")
    w = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    prof, cold, warm = timed(lambda: profile_layer("w", w), 3)
    print(f"\nprofile_layer {args.rows}x{args.cols}: cold {cold:.3f} s, warm {warm:.3f} s "
          f"(best of 3), {len(prof.options)} options")
    tot = sum(prof.timings.values())
    for k, v in sorted(prof.timings.items(), key=lambda kv: -kv[1]):
        print(f"  {k:8s} {v * 1e3:8.1f} ms  {v / max(tot, 1e-12):6.1%}")
    print(f"  {'other':8s} {(warm - tot) * 1e3:8.1f} ms  (dense option, validation)")
    for o in prof.options:
        print(f"    {o.label:32s} err {o.rel_err:.4f}  bytes {o.bytes:>10d}")

    layers = synthetic_layers(args.layers)
    nopt = sum(len(lp.options) for lp in layers) / len(layers)
    print(f"\nallocators on {len(layers)} layers x {nopt:.1f} options, budget "
          f"{args.budget}:")
    for name, fn, reps in (("greedy", greedy_allocate, 5), ("dado", dado_allocate, 5),
                           ("exact", exact_allocate, 5)):
        a, cold, warm = timed(lambda: fn(layers, args.budget), reps)
        print(f"  {name:6s} cold {cold * 1e3:8.1f} ms  warm {warm * 1e3:8.1f} ms  "
              f"err {a.total_err:.5f}  bytes/budget {a.total_bytes / a.budget_bytes:.4f}  "
              f"gap {a.gap:.2e}  feasible {a.feasible}")


if __name__ == "__main__":
    main()
