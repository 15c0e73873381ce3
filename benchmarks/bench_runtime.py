"""Every packed format through ``PackedLinear``, streamed like a real decode,
against the vendor float32 product (prints a table; never part of pytest).

    python benchmarks/bench_runtime.py [--size 4096] [--m 1,32] [--kinds ...]
                                       [--json FILE]

For each kind a **stack** of distinct ``[size, size]`` layers is built whose
packed bytes exceed ``2 x L3`` (L3 read from ``/sys`` or ``lscpu``; at least 3
layers), and the timed loop calls every layer of the stack in turn, so the
weights stream from DRAM as they do when a model decodes one token through all
its layers.  The vendor yardstick is ``opscope_nb.runtime.accel``'s float32 GEMM/GEMV
on its own stack of dense weights of the same shape.  Timing (``time_stack``):
per round one untimed pass over the stack, then ``reps`` passes timing every
call on its own; the best round's median call is the figure (robust to time
slices lost on a shared machine).

Columns: ``us`` (per layer call), ``x_vendor`` (vendor us / kind us),
``GB/s`` (packed weight bytes read per second), ``rel_err`` (rel-L2 of the
output of one layer vs the float64 product with that layer's ``dense()``).

Packed arrays: dense / int* / ternary / 2:4 are ``mining.pack`` of a Gaussian
weight (then copied for the other layers of the stack); low-rank, Monarch,
Tucker and TT use random factors of the menu's shapes (their SVD/HOSVD at
4096^2 would take minutes and the time of a product does not depend on the
values).  Kinds without a registered kernel are listed as skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np


def l3_bytes() -> int:
    """Last-level cache size in bytes (``/sys``, then ``lscpu``; 32 MiB if
    neither says)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for idx in os.listdir(base):
            p = os.path.join(base, idx)
            try:
                level = int(open(os.path.join(p, "level")).read())
                size = open(os.path.join(p, "size")).read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            val = int(re.sub(r"\D", "", size)) * mult
            if level >= 3:
                best = max(best, val)
    except OSError:
        pass
    if best:
        return best
    try:
        out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True).stdout
        m = re.search(r"L3 cache:\s*(\d+)", out)
        if m:
            return int(m.group(1))
    except OSError:
        pass
    return 32 << 20


def menu(size):
    """The kinds to time, with a maker of one packed layer each."""
    from opscope_nb.formats import Decomp, balanced_factor

    c1, c2 = balanced_factor(size)
    r1, r2 = balanced_factor(size)
    ds = [
        Decomp.dense(), Decomp.int8(), Decomp.int4(), Decomp.int4(32), Decomp.int4(128),
        Decomp.ternary(), Decomp.sparse24(), Decomp.lowrank(min(256, size)),
    ]
    m = math.isqrt(size)
    if m * m == size:
        ds.append(Decomp.monarch())
    ds.append(Decomp.tucker((size, c1, c2),
                            (max(min(size // 2, 32), 1), max(c1 // 2, 1), max(c2 // 2, 1))))
    ds.append(Decomp.tt((r1, r2, c1, c2), 16))
    return ds


def random_arrays(d, rows, cols, rng):
    """Random arrays of ``d``'s layout (factor kinds), scaled like a unit
    Gaussian weight's factors."""
    from opscope_nb.runtime import expected_arrays

    out = {}
    for name, (dt, shp) in expected_arrays(rows, cols, d).items():
        a = rng.standard_normal(shp).astype(np.float32)
        a /= np.float32(math.sqrt(max(shp[-1], 1)))
        out[name] = a
    return out


def one_layer(d, size, rng):
    from opscope_nb.formats import pack
    if d.kind in ("lowrank", "monarch", "tucker", "tt"):
        return random_arrays(d, size, size, rng)
    w = rng.standard_normal((size, size)).astype(np.float32)
    return pack(w, d)


def time_stack(calls, reps, rounds, gap, clock=time.perf_counter):
    """Per-call seconds cycling through ``calls`` (the stack): per round one
    untimed pass, then ``reps`` passes with every call timed on its own; the
    round's figure is the median call, the result the best round's.  Timing
    calls one by one keeps a time slice lost to another process (this
    machine is shared) out of the median without ever calling the same
    layer twice in a row."""
    best = math.inf
    for _ in range(rounds):
        time.sleep(gap)
        for c in calls:
            c()
        ts = []
        for _ in range(reps):
            for c in calls:
                t0 = clock()
                c()
                ts.append(clock() - t0)
        best = min(best, float(np.median(ts)))
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--m", default="1,32")
    ap.add_argument("--kinds", default="",
                    help="comma-separated Decomp kinds, e.g. dense,sparse24,lowrank "
                         "(default: all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true",
                    help="one thread for numba and the vendor, timed with the calling "
                         "thread's CPU clock (time.thread_time): per-core figures that a "
                         "busy shared machine does not inflate")
    args = ap.parse_args(argv)

    from opscope_nb.runtime import accel
    from opscope_nb.runtime import PackedLinear, has_kernel

    size = args.size
    ms = [int(v) for v in args.m.split(",") if v]
    clock = time.perf_counter
    if args.cpu:
        import numba
        numba.set_num_threads(1)
        if accel.available():
            accel.set_threads(1)
        clock = time.thread_time
    l3 = l3_bytes()
    need = 2 * l3
    rng = np.random.default_rng(0)
    kinds = menu(size)
    if args.kinds:
        want = set(args.kinds.split(","))
        kinds = [d for d in kinds if d.kind in want]
    print(f"# size {size}x{size}, L3 {l3 >> 20} MiB, stacks > {need >> 20} MiB, "
          f"vendor {accel.backend()}, m = {ms}, "
          f"{'1 thread, CPU clock' if args.cpu else 'all threads, wall clock'}", flush=True)

    def nstack(nbytes):
        return max(3, -(-int(1.1 * need) // nbytes))

    rows = []
    vendor = {}
    if accel.available():
        nv = nstack(4 * size * size)
        wv = [rng.standard_normal((size, size)).astype(np.float32) for _ in range(nv)]
        for m in ms:
            x = rng.standard_normal((m, size)).astype(np.float32)
            calls = [accel.sgemm_prepared(x, w) for w in wv]
            t = time_stack(calls, args.reps, args.rounds, 0.1, clock)
            vendor[m] = t
            gbs = 4 * size * size / t / 1e9
            print(f"vendor_f32      m={m:<3d} layers={nv:<4d} us={1e6 * t:9.1f} "
                  f"GB/s={gbs:6.1f}", flush=True)
            rows.append(dict(kind="vendor_f32", m=m, layers=nv, us=1e6 * t,
                             x_vendor=1.0, gbs=gbs, rel_err=None))
        del wv
    for d in kinds:
        if not has_kernel(d.kind):
            print(f"{d.label:<15s} skipped: no kernel registered", flush=True)
            continue
        t0 = time.perf_counter()
        first = PackedLinear(d, one_layer(d, size, rng), (size, size))
        nb = first.nbytes
        n = nstack(nb)
        stack = [first] + [PackedLinear(d, {k: v.copy() for k, v in first.arrays.items()},
                                        (size, size)) for _ in range(n - 1)]
        build = time.perf_counter() - t0
        wd = first.dense().astype(np.float64)
        for m in ms:
            x = rng.standard_normal((m, size)).astype(np.float32)
            y = first(x)
            ref = x.astype(np.float64) @ wd.T
            err = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300))
            calls = [(lambda lin=lin: lin(x)) for lin in stack]
            t = time_stack(calls, args.reps, args.rounds, 0.1, clock)
            xv = vendor[m] / t if m in vendor else float("nan")
            gbs = nb / t / 1e9
            print(f"{d.label:<15s} m={m:<3d} layers={n:<4d} us={1e6 * t:9.1f} "
                  f"x_vendor={xv:6.2f} GB/s={gbs:6.1f} rel_err={err:.2e} "
                  f"(MB/layer {nb / 1e6:.2f}, build {build:.1f}s)", flush=True)
            rows.append(dict(kind=d.label, m=m, layers=n, us=1e6 * t, x_vendor=xv,
                             gbs=gbs, rel_err=err, bytes=nb))
        del stack, first, wd
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "l3_bytes": l3, "cpu_clock_1_thread": bool(args.cpu),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
