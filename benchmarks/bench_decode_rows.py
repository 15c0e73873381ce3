#!/usr/bin/env python
"""Decode tile width of the intN 128-column modes: 1 x 1 against 1 x 4 tiles.

``python benchmarks/bench_decode_rows.py [--kinds int6/g128,int3/g32] [--n 4096]
[--layers 6] [--rounds 8] [--json FILE]``

The evidence behind ``kernels._packed_quant.DEC_ONE_ROW`` (AVX2 hosts decode
the int2/3/5/6 128-column modes one weight row per tile).  For each kind a
stack of ``--layers`` packed ``[n, n]`` weights (layer ``i`` = layer 0's rows
rolled by ``i``; together larger than the L3 cache) is cycled call after
call at ``m = 1``, so the weights stream from DRAM, through two parallel
loops that differ only in the tile: ``lowbit_tile_1x1`` (prefetch 4 rows
ahead, as the kernel) and ``lowbit_tile_1x4`` (prefetch 8 rows ahead, as the
generic decode).  Both loops split the rows in two halves over numba's
threads and call the tile with constant ``fmt`` / ``mode``; rounds alternate,
the figure is the best per-call time of ``--rounds`` rounds.  A plain parallel
sum of a float32 array (the bench's streaming read) is timed in the same
rounds.  Both loops give the same outputs bit for bit (checked).

Columns: kind, tile, µs per call, GB/s of packed bytes (codes + scales), its
fraction of the streaming read.  ``--json``: rows loadable with pandas.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import njit, prange

from opscope_nb import kernels as K
from opscope_nb.bench.machine import machine_info, stream_reader
from opscope_nb.kernels import _packed_quant as PQ
from opscope_nb.formats import Decomp
from opscope_nb.runtime import PackedLinear
from opscope_nb.io.synth import Dist, sample

_FMT = {2: 2, 3: 3, 5: 4, 6: 5}


def _loop(tile, width, pf_rows, fmt, mode):
    """A parallel m = 1 decode over all rows through ``tile`` (``width`` rows
    per call); ``fmt`` / ``mode`` are constants of the compiled loop."""
    @njit(parallel=True)
    def run(xp, corr, lo, hi, sf, ss, nunits, upf, out):
        rows = lo.shape[0]
        wb = lo.shape[1]
        w2b = hi.shape[1]
        lof = lo.ravel()
        hif = hi.ravel()
        for half in prange(2):
            r0 = half * rows // 2 // width * width
            r1 = rows if half else rows // 2 // width * width
            for j in range(r0, r1, width):
                t = tile(xp, 0, 0, corr, 0, 0, lof, j * wb, wb, hif, j * w2b, w2b, sf,
                         j * ss, ss, nunits, upf, fmt, mode, pf_rows * wb, pf_rows * w2b)
                for c in range(width):
                    out[j + c] = t[c]
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="int6/g128,int5/g32,int3/g32,int2/g32")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    info = machine_info()
    print(f"# CPU: {info.get('cpu', '?')}; LLVM target {K.target_cpu_name()}; low-bit path "
          f"{K.LOWBIT_PATH}; one-row decode in the kernels: {PQ.DEC_ONE_ROW}")
    n = a.n
    x = sample(Dist.GAUSSIAN, 1, n, 2)
    xq, _ = K.quantize_rows_i8(x)
    reader = None
    rows_out = []
    for label in a.kinds.split(","):
        d = Decomp.from_label(label)
        if d.kind != "intn":
            raise SystemExit(f"--kinds takes intN labels (int2/3/5/6); got {label!r}")
        base = PackedLinear.pack(sample(Dist.GAUSSIAN, n, n, 1), d).arrays
        stack = [{k: np.ascontiguousarray(np.roll(v, i, axis=0)) for k, v in base.items()}
                 for i in range(a.layers)]
        nbytes = sum(v.nbytes for v in base.values())
        if reader is None:
            reader = stream_reader(nbytes * a.layers)
        fmt = _FMT[d.bits]
        g = d.group if d.group and d.group < n else n
        mode, nunits, upf = PQ._plan(n, max(1, n // g), g, fmt, True)
        if mode < 4:
            raise SystemExit(f"{label} at n = {n} does not run 128-column units (mode {mode})")
        xp, corr = PQ._arrange(xq, nunits, fmt, upf, mode)
        xp, corr = xp.ravel(), corr.ravel()
        loops = {"1x1": _loop(K.lowbit_tile_1x1, 1, 4, fmt, mode),
                 "1x4": _loop(K.lowbit_tile_1x4, 4, 8, fmt, mode)}
        outs = {}
        for name, fn in loops.items():
            outs[name] = np.zeros(n)
            s = stack[0]
            fn(xp, corr, s["lo"], s.get("hi", s["lo"]), s["scales"].ravel(), s["scales"].shape[1], nunits,
               upf, outs[name])
        if not np.array_equal(outs["1x1"], outs["1x4"]):
            raise SystemExit(f"{label}: 1x1 and 1x4 decode differ")
        best = {name: np.inf for name in loops}
        best["stream"] = np.inf
        for _ in range(a.rounds):
            for name, fn in loops.items():
                t0 = time.perf_counter()
                for s in stack:
                    fn(xp, corr, s["lo"], s.get("hi", s["lo"]), s["scales"].ravel(), s["scales"].shape[1],
                       nunits, upf, outs[name])
                best[name] = min(best[name], (time.perf_counter() - t0) / len(stack))
            t0 = time.perf_counter()
            for _ in range(4):
                reader[0]()
            best["stream"] = min(best["stream"], (time.perf_counter() - t0) / 4)
        bw = reader[2] / best["stream"] / 1e9
        for name in loops:
            gbs = nbytes / best[name] / 1e9
            rows_out.append({"kind": label, "tile": name, "n": n, "us": best[name] * 1e6,
                             "gb_s": gbs, "stream_gb_s": bw, "frac_of_stream": gbs / bw,
                             "path": K.LOWBIT_PATH})
            print(f"{label:10s} {name}  {best[name] * 1e6:8.1f} us  {gbs:6.1f} GB/s  "
                  f"{gbs / bw:5.2f} of the stream ({bw:.1f} GB/s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
