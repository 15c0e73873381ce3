"""``python bench.py`` / ``python -m opscope_nb.bench``: configs, options, the run.

:func:`run` executes a list of sections on a config dict and returns every
figure (the dict ``--json`` writes); :func:`main` parses the command line,
prints the header and calls :func:`run`.  Tests call :func:`run` or a single
section with :data:`QUICK` (or smaller) configs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numba
import numpy as np
from tabulate import tabulate

from opscope_nb.runtime import accel
from opscope_nb import kernels as K

from ._util import TIMING, Compile
from .machine import machine_info, stream_bandwidth
from .matmul import section1, section2, section3, section4, section5, section6
from .formats import section8
from .peers import section9
from .verdict import section7

#: Section number -> function ``(cfg, comp, res)``; 7 (the verdict) runs last.
SECTIONS = {1: section1, 2: section2, 3: section3, 4: section4, 5: section5,
            6: section6, 8: section8, 9: section9}
ALL_SECTIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
#: Sections whose figures feed the verdict (asking for one adds 7).
VERDICT_FROM = (4, 5, 6, 8, 9)

FULL = {
    "s1": (64, 512, 512),
    "qwen": [(1024, 1024, "attn"), (1024, 3072, "mlp-up"), (3072, 1024, "mlp-down")],
    "s4_m": (1, 32),
    "s5_kn": 1024,
    "s5_m": (1, 32, 128),
    "s6": (2048, 6144),
    "reps_fast": 30, "reps_mid": 10, "reps_slow": 6, "reps_dram": 5,
    "timing": TIMING["full"],
    # streaming read: max(8 x L3, 256 MiB)
    "stream_l3_mult": 8, "stream_min_bytes": 256 << 20,
    # section 9, ONNX Runtime: (k, n) at each m
    "peer_shapes": [(1024, 1024), (1024, 3072), (3072, 1024), (4096, 4096)],
    "peer_m": (1, 32),
    # section 8, every format streamed: layer [out, in], low-rank r, stacks of
    # different layers > s8_l3_mult x L3 (at least s8_min_bytes) per candidate
    "s8_shape": (4096, 4096), "s8_rank": 256, "s8_m": (1, 32),
    # activation paths of the quantised kinds: float (int16 codes) and int8
    "s8_acts": ("f32", "int8"),
    "s8_l3_mult": 2.5, "s8_min_bytes": 64 << 20, "s8_reps": 8,
}
QUICK = {
    "s1": (16, 96, 72),
    "qwen": [(96, 64, "attn"), (64, 160, "mlp-up"), (160, 64, "mlp-down")],
    "s4_m": (1, 5),
    "s5_kn": 96,
    "s5_m": (1, 5, 9),
    "s6": (128, 320),
    "reps_fast": 3, "reps_mid": 3, "reps_slow": 2, "reps_dram": 2,
    "timing": TIMING["quick"],
    "stream_l3_mult": 2, "stream_min_bytes": 16 << 20,
    "peer_shapes": [(96, 64), (64, 160)],
    "peer_m": (1, 5),
    "s8_shape": (256, 256), "s8_rank": 32, "s8_m": (1, 5),
    # the int8-activation path alone: the float path's kernels are a second
    # compile of every quantised kind (cold --quick 115 -> 78 s without them,
    # Zen 4, 2 cores)
    "s8_acts": ("int8",),
    "s8_l3_mult": 0, "s8_min_bytes": 2 << 20, "s8_reps": 3,
}


def parse_sections(text):
    """``"4,5"`` -> ``[4, 5, 7]`` (the verdict is added when a section it
    quotes runs)."""
    try:
        secs = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--sections takes comma-separated numbers from "
                         f"{ALL_SECTIONS}; got {text!r}") from None
    bad = [s for s in secs if s not in ALL_SECTIONS]
    if bad or not secs:
        raise SystemExit(f"--sections takes numbers from {ALL_SECTIONS}; got {text!r}")
    if any(s in secs for s in VERDICT_FROM) and 7 not in secs:
        secs.append(7)
    return sorted(secs)


def stream_bytes(cfg, l3):
    """Size of the streaming-read array: ``stream_l3_mult`` x L3, at least
    ``stream_min_bytes``."""
    return max(int(cfg["stream_min_bytes"]), int(cfg["stream_l3_mult"]) * (l3 or 0))


def run(cfg, secs, res=None, comp=None):
    """Run ``secs`` (section numbers) on config ``cfg``; return the figures.

    ``res`` may carry ``"machine"`` (from :func:`machine_info`) and
    ``"bandwidth"``; missing ones are measured here.  The verdict (7) runs
    after every other section (so it can quote 8 and 9).
    """
    res = {} if res is None else res
    res.setdefault("skipped", [])
    if "machine" not in res:
        res["machine"] = machine_info()
    if "bandwidth" not in res:
        res["bandwidth"] = stream_bandwidth(stream_bytes(cfg, res["machine"]["l3_bytes"]),
                                            cfg["reps_dram"], cfg["timing"])
    comp = Compile() if comp is None else comp
    for s in secs:
        if s in SECTIONS:
            SECTIONS[s](cfg, comp, res)
    if 7 in secs:
        section7(cfg, res)
    res["first_call_ms"] = comp.first
    return res


def _header(quick, res, cfg):
    mi = res["machine"]
    print("# opscope-nb kernel benchmark" + (" (--quick)" if quick else ""))
    print(f"CPU: {mi['cpu']}  |  LLVM target: {mi['llvm_cpu']}  |  SIMD: "
          f"{' '.join(mi['simd_features']) or 'n/a'}")
    forced = (f"forced by {K.I8_PATH_ENV}={K.HOST_I8_PATH}" if mi.get("int8_path_forced")
              else f"the host's choice; {K.I8_PATH_ENV} forces another")
    print(f"int8 dot path: {mi['int8_path']}  [{forced}]  |  low-bit tiles: "
          f"{mi.get('lowbit_path', '?')}")
    print(f"int8 prefill: {mi['int8_prefill']}")
    print(f"threads: numba {mi['numba_threads']} ({mi['threading_layer']} layer), "
          f"{mi['cpu_count']} CPUs  |  numba {mi['numba']}, Python {mi['python']}")
    vi = mi["vendor_info"]
    if vi.get("available"):
        print(f"vendor: {mi['vendor']}  |  {vi.get('config', '')}  |  core "
              f"{vi.get('core', '?')}, {vi.get('threads')} threads"
              + (f"  |  env {vi['env']}" if vi.get("env") else ""))
    else:
        print(f"vendor: none ({accel.why_unavailable()}) -- vendor columns are n/a")
        res["skipped"].append(f"vendor comparisons: {accel.why_unavailable()}")
    if accel.int8_fc is None:
        res["skipped"].append(f"vendor int8: {accel.backend()} offers no int8 GEMM "
                              f"on this platform")
    bw = res["bandwidth"]
    l3 = mi.get("l3_bytes")
    print(f"streaming read bandwidth: {bw['gb_s']:.1f} GB/s (parallel sum, "
          f"{bw['chunk_bytes'] / 2**20:.0f} MiB per call cycling through "
          f"{bw['bytes'] / 2**20:.0f} MiB"
          + (f" = {bw['bytes'] / l3:.0f}x L3" if l3 else "") + ", "
          f"{mi['numba_threads']} threads)")
    if mi["load_avg_1m"] is not None:
        busy = mi["load_avg_1m"] > 0.5
        print(f"load average (1 min) at start: {mi['load_avg_1m']:.2f}"
              + (" -- the machine is busy: parallel timings will be noisy" if busy else ""))
    print(f"Times: ms, median of a block of back-to-back calls after a warm-up "
          f"call, best of {cfg['timing']['rounds']} alternating rounds per "
          f"candidate; compile / cache-load time reported apart.")


def main(argv=None, warm=None):
    """Command line of ``python bench.py``; returns the exit code.

    ``warm``: called with the section numbers (and ``quick=``) before they run, unless
    ``--no-warmup`` (the entry points pass :func:`opscope_nb.warmup.warm_bench`;
    this module cannot import the warm-up, which runs its sections)."""
    ap = argparse.ArgumentParser(
        prog="bench.py",
        description="Speed + precision table of the opscope-nb matmul kernels.")
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--sections", default=",".join(map(str, ALL_SECTIONS)),
                    help="comma-separated subset, e.g. 4,5")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for our kernels and the vendor alike "
                         "(default: numba's default, all cores)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="on a cold kernel cache, do not compile the sections' kernels "
                         "in one process per core first (also OPSCOPE_AUTOWARM=0)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            raise SystemExit(f"--threads must lie in [1, "
                             f"{numba.config.NUMBA_NUM_THREADS}]; got {args.threads}")
        numba.set_num_threads(args.threads)
        if accel.available():
            accel.set_threads(args.threads)
    secs = parse_sections(args.sections)
    cfg = QUICK if args.quick else FULL

    t_start = time.perf_counter()
    if warm is not None and not args.no_warmup:
        # a cold cache: the entry point compiles the sections' kernels on every
        # core first (opscope_nb.warmup.warm_bench; the first-call table below
        # then shows cache loads; the warm-up's time counts in the wall time)
        warm(secs, quick=args.quick)
    res = {"config": {"quick": args.quick, "sections": secs, "threads": args.threads},
           "machine": machine_info(), "skipped": []}
    res["bandwidth"] = stream_bandwidth(stream_bytes(cfg, res["machine"]["l3_bytes"]),
                                        cfg["reps_dram"], cfg["timing"])
    _header(args.quick, res, cfg)
    comp = Compile()
    run(cfg, secs, res, comp)

    print("\n## First-call time per kernel (JIT compile, or load from the on-disk cache)")
    print(tabulate([[k, f"{v:.1f}"] for k, v in comp.first.items()],
                   headers=["kernel", "first call ms"], tablefmt="github"))
    if res["skipped"]:
        print("\nSkipped: " + "; ".join(res["skipped"]))
    res["wall_s"] = time.perf_counter() - t_start
    print(f"\nwall time {res['wall_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=_json_default)
    return 0


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
