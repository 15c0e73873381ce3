"""Shared helpers of the bench sections: errors, timing, formatting.

Every time is wall-clock milliseconds from :func:`time_group` (best-block
median of interleaved candidates); every error is a relative L2 error against a
float64 reference.
"""
from __future__ import annotations

import math
import time

import numpy as np
from tabulate import tabulate

#: Interleaved-block timing settings: rounds of blocks per candidate and the
#: pause (s) before each block.
TIMING = {"full": {"rounds": 5, "gap": 0.1}, "quick": {"rounds": 2, "gap": 0.005}}


def rel_l2(ref, approx) -> float:
    """||ref - approx||_F / ||ref||_F in float64 (0 for an all-zero ref)."""
    ref = np.asarray(ref, np.float64)
    den = float(np.sum(ref * ref))
    if den < 1e-20:
        return 0.0
    d = ref - np.asarray(approx, np.float64)
    return math.sqrt(float(np.sum(d * d)) / den)


def truth(x, w):
    """float64 reference product of float32 inputs."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def time_group(fns: dict, reps: int, timing: dict | None = None) -> dict:
    """Wall time (ms) of each zero-argument callable: best block median.

    Each candidate runs in blocks (one untimed call, then ``reps`` timed
    back-to-back calls); the candidates alternate block by block for
    ``timing["rounds"]`` rounds, and each candidate keeps the median of its
    best block.  Before each block the loop sleeps ``timing["gap"]`` seconds:
    that lets the other thread pool's spinning workers (OpenBLAS spins ~0.1 s
    after a call, OpenMP briefly) go idle, so one library's threads never
    steal the cores the other is timed on.  On a shared machine another
    process can hold a core for a whole block -- a parallel kernel then waits
    a time slice per call -- so the best round is the one measured on the
    machine we asked for; every candidate gets the same treatment.  Interleaving single calls instead
    would make the numba and OpenBLAS thread pools fight over the cores.
    """
    timing = TIMING["full"] if timing is None else timing
    rounds, gap = int(timing["rounds"]), float(timing["gap"])
    blocks = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(gap)
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            blocks[name].append(float(np.median(ts)))
    return {name: 1e3 * min(v) for name, v in blocks.items()}


class Compile:
    """Records the first-call time of each kernel (compile or cache load)."""

    def __init__(self):
        self.first = {}

    def warm(self, name, fn):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self.first.setdefault(name, 1e3 * dt)
        return out


def fmt(v, spec=".3f"):
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return "n/a"
    return format(v, spec)


def ratio(a, b):
    """a / b, or None when either is missing."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def table(title, headers, rows):
    print(f"\n## {title}")
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))


