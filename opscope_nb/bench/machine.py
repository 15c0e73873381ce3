"""What the bench ran on: CPU, SIMD features, caches, threads, vendor BLAS."""
from __future__ import annotations

import os
import platform

import numba
import numpy as np
from numba import prange

import opscope_nb
from opscope_nb.runtime import accel
from opscope_nb import kernels as K
from opscope_nb.kernels._jit import njit, njit_parallel

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
        "llvm_cpu": K.target_cpu_name(),
        "simd_features": simd,
        "int8_path": K.simd_path(),
        "int8_path_forced": K.I8_PATH_FORCED,
        "lowbit_path": K.LOWBIT_PATH,
        "int8_prefill": (f"W8A8 m >= 16: outer-product panel tiles (32/16 rows x "
                         f"{K.I8_PANEL_J} outputs, {K.I8_PANEL_LANES}-lane "
                         f"{'vpdpbusd' if K.I8_PANEL_CORR else 'vpmaddubsw sign-trick'}, "
                         f"broadcast weights; weights <= {K.I8_ROWSPLIT_MAX_W >> 20} MiB with sums: row split, each thread quantises and packs its own rows); W4A8 m >= {K.W4_PANEL_MIN_M}: panel tiles "
                         f"({K.W4_PANEL_ROWS} rows x {K.W4_PANEL_J} outputs, int4 unpacked "
                         f"once per tile, per-group float32 scaling)" if K.I8_PANEL else
                         "W8A8 / W4A8 prefill: dot tiles (no VNNI: no panel tiles)"),
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




@njit
def _row_sum(r):
    """Sum of a float32 1-D C-contiguous array (vectorised: reassociation is
    in the package's fastmath set)."""
    acc = np.float32(0.0)
    for i in range(r.shape[0]):
        acc += r[i]
    return acc


@njit_parallel
def _stream_sum(a2):
    """Sum of a float32 ``[rows, n]`` C-contiguous array, one row per
    parallel iteration (each row read once, front to back).

    The row is handed to a serial helper as a C-contiguous 1-D view: a loop
    written directly in the ``prange`` body ran about 7x slower here (the
    parallel body does not vectorise the float reduction).

    Returns
    -------
    float64 : the sum (keeps the reads from being optimised away).
    """
    part = np.zeros(a2.shape[0], np.float64)
    for c in prange(a2.shape[0]):
        part[c] = _row_sum(a2[c])
    return part.sum()


#: Rows of each streamed chunk (parallel iterations per call).
_STREAM_ROWS = 64


def stream_reader(nbytes: int, chunk_bytes: int = 16 << 20):
    """A streaming read to time: ``(step, array_bytes, chunk_bytes)``.

    ``step()`` sums the next ``chunk_bytes`` slice of a float32 array of about
    ``nbytes`` bytes (cyclically, every page resident), as 64 rows spread over
    numba's threads -- the plain parallel sum of :func:`stream_bandwidth`,
    callable inside another :func:`time_group` so a fraction of it is taken
    from the same rounds as the kernels it is compared with.
    """
    if nbytes < 4 * _STREAM_ROWS:
        raise ValueError(f"stream_bandwidth needs nbytes >= {4 * _STREAM_ROWS}; got "
                         f"{nbytes}")
    per = min(int(nbytes), int(chunk_bytes)) // 4 // _STREAM_ROWS * _STREAM_ROWS
    per = max(per, _STREAM_ROWS)
    nchunk = max(1, int(nbytes) // 4 // per)
    a = np.ones(nchunk * per, np.float32)
    views = [a[i * per:(i + 1) * per].reshape(_STREAM_ROWS, -1) for i in range(nchunk)]
    _stream_sum(views[0])
    state = [0]

    def step():
        i = state[0]
        state[0] = (i + 1) % len(views)
        return _stream_sum(views[i])

    return step, int(a.nbytes), int(views[0].nbytes)


def stream_bandwidth(nbytes: int, reps: int = 5, timing: dict | None = None,
                     chunk_bytes: int = 16 << 20) -> dict:
    """Measured streaming read bandwidth: a plain parallel sum, from DRAM.

    The array (float32, about ``nbytes`` bytes, filled so every page is
    resident) should be much larger than the last-level cache.  Each timed
    call sums the next ``chunk_bytes`` slice of it (cyclically, like the
    weight stacks of section 8), so no call finds its data in cache while a
    call stays short enough for a best-block median to dodge a busy
    machine's time slices.  A chunk is read as 64 rows spread over numba's
    threads (:func:`stream_reader`).

    Returns
    -------
    dict : ``{"bytes": array bytes, "chunk_bytes": bytes per call, "ms": per
    call, "gb_s": chunk_bytes / ms}`` (GB = 1e9 bytes; ms is the best-block
    median from :func:`time_group`).
    """
    step, total, nb = stream_reader(nbytes, chunk_bytes)
    # a block at least one cycle through the array
    ms = time_group({"read": step}, max(reps, total // nb), timing)["read"]
    return {"bytes": total, "chunk_bytes": nb, "ms": ms,
            "gb_s": nb / (ms * 1e-3) / 1e9}
