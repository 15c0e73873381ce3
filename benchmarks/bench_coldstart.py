#!/usr/bin/env python
"""Cold-start (empty kernel cache) vs warm times of the first things a user runs.

Copies the package (and ``bench.py``) into a temporary directory, so its
in-tree numba cache starts empty, then times each step in a fresh process:
cold (first process, compiles) and warm (second process, loads the cache):

* ``import opscope_nb`` and ``import opscope_nb.runtime``;
* ``opscope-nb profile`` on the built-in seven-layer model;
* ``profile_layer`` on one 384 x 384 matrix;
* one ``PackedLinear`` call (1 x 384 x 384) per kind and activation path,
  each cold one with a cache of its own (a fresh copy's cache), so it counts
  everything that kind compiles;
* ``python bench.py --quick``;
* optionally ``opscope-nb warmup`` (``--warmup``): everything, from empty,
  then ``opscope-nb profile`` on that cache.

Every cold step gets a fresh copy of its own, so it counts everything it
compiles; its warm run is a second process on that copy.

Prints a table naming the CPU, the core count and the load average before
and after every step (cold compiles are CPU-bound: on a shared machine the
figures move with the load; the CPU-seconds column moves less).

Usage: ``python benchmarks/bench_coldstart.py [--kinds int4/chan:f32,ternary:int8]
[--skip bench,profile] [--warmup]``.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

KINDS = ("int6/g128:f32", "int4/chan:f32", "ternary:f32", "int8/chan:f32", "int4/g32:f32",
         "int4/g32:int8", "int6/g128:int8", "int3/g128:f32", "int2/g32:int8", "ternary:int8",
         "int8/chan:int8", "dense:f32", "lowrank(r=8):f32", "sparse2:4:f32")

_KIND = """
import sys, numpy as np
from opscope_nb.formats import Decomp
from opscope_nb.runtime import PackedLinear
label, act = sys.argv[1].rsplit(":", 1)
w = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
import time
t = time.perf_counter()
lin = PackedLinear.pack(w, Decomp.from_label(label))
print("PACK", time.perf_counter() - t)
x = np.ones((1, 384), np.float32)
t = time.perf_counter()
lin(x, act)
print("CALL", time.perf_counter() - t)
"""

_LAYER = """
import numpy as np
from opscope_nb.profile.mining import profile_layer
w = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
profile_layer("w", w)
"""


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load():
    try:
        return "{:.2f}".format(os.getloadavg()[0])
    except OSError:
        return "n/a"


def copy_tree(dst):
    shutil.copytree(ROOT / "opscope_nb", dst / "opscope_nb",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    shutil.copy2(ROOT / "bench.py", dst / "bench.py")


def timed(cmd, cwd):
    """(wall seconds, child CPU seconds, output tail) of one process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE_DIR")}
    env["PYTHONPATH"] = str(cwd)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return wall, cpu, out.stdout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="comma-separated label:act list (act f32 or int8)")
    ap.add_argument("--skip", default="", help="comma-separated of: import,profile,layer,"
                                               "kinds,bench")
    ap.add_argument("--warmup", action="store_true", help="also time opscope-nb warmup")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    py = sys.executable
    rows = []

    counter = [0]

    def fresh():
        """A new copy of the package: its in-tree cache starts empty."""
        counter[0] += 1
        d = pathlib.Path(tmp) / f"c{counter[0]}"
        copy_tree(d)
        return d

    def step(name, cmd, cwd=None, warm=True):
        """Time ``cmd`` cold in a fresh copy (or ``cwd``), then warm there."""
        cwd = fresh() if cwd is None else cwd
        l0 = load()
        cw, cc, out = timed(cmd, cwd)
        # the kinds' own split: pack (the quantiser) and the first call
        parts = dict(ln.split() for ln in out.splitlines()
                     if ln.startswith(("PACK ", "CALL ")))
        split = (f"{float(parts['PACK']):.1f} + {float(parts['CALL']):.1f}"
                 if len(parts) == 2 else "")
        row = [name, f"{cw:.1f}", f"{cc:.1f}", split]
        if warm:
            ww, wc, _ = timed(cmd, cwd)
            row += [f"{ww:.2f}", f"{wc:.2f}"]
        else:
            row += ["", ""]
        row.append(f"{l0} / {load()}")
        rows.append(row)
        if warm:
            shutil.rmtree(cwd, ignore_errors=True)
        print("  ".join(row), flush=True)

    print(f"# cold start: {cpu_name()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="opscope-cold-") as tmp:
        if "import" not in skip:
            step("import opscope_nb", [py, "-c", "import opscope_nb"])
            step("import opscope_nb.runtime", [py, "-c", "import opscope_nb.runtime"])
        if "profile" not in skip:
            step("opscope-nb profile (built-in model)", [py, "-m", "opscope_nb", "profile"])
        if "layer" not in skip:
            step("profile_layer 384x384", [py, "-c", _LAYER])
        if "kinds" not in skip:
            for spec in filter(None, args.kinds.split(",")):
                step(f"PackedLinear {spec} (1x384x384)", [py, "-c", _KIND, spec])
        if "bench" not in skip:
            step("python bench.py --quick", [py, "bench.py", "--quick"])
        if args.warmup:
            d = fresh()
            step("opscope-nb warmup (everything)", [py, "-m", "opscope_nb", "warmup"], d,
                 warm=False)
            step("  then opscope-nb profile", [py, "-m", "opscope_nb", "profile"], d, warm=False)

    try:
        from tabulate import tabulate
        print()
        print(tabulate(rows, headers=["step", "cold s", "cold cpu s", "cold pack + call s",
                                      "warm s", "warm cpu s",
                                      "load 1m before / after"], tablefmt="github"))
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
