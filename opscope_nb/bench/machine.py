"""What the bench ran on: CPU, SIMD features, caches, threads, vendor BLAS."""
from __future__ import annotations

import os
import platform

import numba
import numpy as np
from numba import prange

import opscope_nb
from opscope_nb import accel
from opscope_nb import kernels as K
from opscope_nb._config import njit_parallel

from ._util import time_group


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_bytes(level: int) -> int | None:
    """Size of the CPU cache of the given level (Linux sysfs), if known."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            path = os.path.join(base, entry)
            with open(os.path.join(path, "level")) as fh:
                if int(fh.read().strip()) != level:
                    continue
            with open(os.path.join(path, "type")) as fh:
                if fh.read().strip() == "Instruction":
                    continue
            with open(os.path.join(path, "size")) as fh:
                s = fh.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError):
        return None
    return None


def machine_info() -> dict:
    import llvmlite.binding as llb

    try:
        feats = llb.get_host_cpu_features().flatten().split(",")
    except Exception:
        feats = []
    simd = sorted(f[1:] for f in feats if f.startswith("+") and any(
        f[1:].startswith(p) for p in ("sse", "ssse", "avx", "fma", "neon", "dotprod",
                                      "i8mm", "sve", "f16c", "bf16")))
    l3 = cache_bytes(3)
    info = {
        "cpu": cpu_model(),
        "llvm_cpu": numba.config.CPU_NAME or llb.get_host_cpu_name(),
        "simd_features": simd,
        "int8_path": K.simd_path(),
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
        "threading_layer": numba.config.THREADING_LAYER,
        "cpu_count": os.cpu_count(),
        "l2_bytes": cache_bytes(2),
        "l3_bytes": l3,
        "vendor": accel.backend(),
        "vendor_info": accel.core_info(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "opscope_nb": opscope_nb.__version__,
    }
    return info




@njit_parallel
def _stream_sum(a, nchunks):
    """Sum of a float32 1-D array read once, in ``nchunks`` parallel chunks.

    Parameters
    ----------
    a : float32[N], C-contiguous
    nchunks : int, >= 1

    Returns
    -------
    float64 : the sum (the result only keeps the reads from being optimised
    away).
    """
    n = a.shape[0]
    step = (n + nchunks - 1) // nchunks
    part = np.zeros(nchunks, np.float64)
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        acc = np.float32(0.0)
        for i in range(lo, hi):
            acc += a[i]
        part[c] = acc
    return part.sum()


def stream_bandwidth(nbytes: int, reps: int = 5, timing: dict | None = None,
                     chunk_bytes: int = 16 << 20) -> dict:
    """Measured streaming read bandwidth: a plain parallel sum, from DRAM.

    The array (float32, ``nbytes // 4`` elements, filled so every page is
    resident) should be much larger than the last-level cache.  Each timed
    call sums the next ``chunk_bytes`` slice of it (cyclically, like the
    weight stacks of section 8), so no call finds its data in cache while a
    call stays short enough for a best-block median to dodge a busy
    machine's time slices.  The sum runs on numba's threads, 8 chunks per
    thread.

    Returns
    -------
    dict : ``{"bytes": array bytes, "chunk_bytes": bytes per call, "ms": per
    call, "gb_s": chunk_bytes / ms}`` (GB = 1e9 bytes; ms is the best-block
    median from :func:`time_group`).
    """
    if nbytes < 4:
        raise ValueError(f"stream_bandwidth needs nbytes >= 4; got {nbytes}")
    a = np.ones(nbytes // 4, np.float32)
    per = max(1, min(a.size, int(chunk_bytes) // 4))
    views = [a[i:i + per] for i in range(0, a.size - per + 1, per)] or [a]
    nchunks = 8 * numba.get_num_threads()
    _stream_sum(views[0], nchunks)
    state = [0]

    def step():
        i = state[0]
        state[0] = (i + 1) % len(views)
        return _stream_sum(views[i], nchunks)

    ms = time_group({"read": step}, max(reps, len(views)), timing)["read"]
    nb = int(views[0].nbytes)
    return {"bytes": int(a.nbytes), "chunk_bytes": nb, "ms": ms,
            "gb_s": nb / (ms * 1e-3) / 1e9}
