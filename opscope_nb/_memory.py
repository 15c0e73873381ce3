"""Keeping freed memory inside the process (the command line's allocator policy).

glibc's ``malloc`` serves every block above 32 MB with its own ``mmap`` and
gives it back with ``munmap`` on ``free``.  A profile allocates and frees
gigabyte arrays per block (grams, their permuted copies and factors, a
layer's float32 weights), so each one is faulted in page by page again.  On
a virtual machine that hands freed guest pages back to its host (a virtio
balloon's free-page reporting) that costs seconds per GB: measured on the
2-core Xeon this project is timed on, a fresh 1 GB ``np.ones`` five seconds
after the previous one was freed took 7.6, 2.8, 0.2 and 1.8 s in four
rounds, and 0.15-0.22 s with :func:`retain_freed_memory` (``python``
one-off).

:func:`retain_freed_memory` makes every block come from the heap
(``M_MMAP_MAX = 0``) and never trims it (``M_TRIM_THRESHOLD`` at its
maximum): freed arrays are reused by the next allocation of their size.  The
process keeps its peak memory until it exits -- what a command line wants,
not what a library may impose on its host process, so only ``opscope-nb``'s
entry point calls it, and only for ``profile --calib`` and ``apply`` (which
allocates every tensor's float32 values and packed blocks afresh: Llama-7B
shapes, 2 blocks, 5.41 / 5.51 s with it against 5.94 / 6.08 s without, half
the page faults, the same 0.62 GB peak).  The workers of
``--workers`` do not: with it the profile part of ``--menu ggml`` on 4
Llama-7B-shaped blocks took 18.7 / 18.0 s on one worker and 11.2 / 10.6 s on
two, without it 16.7 / 16.9 and 9.7 / 10.9 s (Xeon, 2 cores).

On the calibrated profile of 4 Llama-7B-shaped blocks (``bench_scale.py
--runs calib``) the command took 380 s with the policy (``7e92ae5``) and 465 s
without it (``6e4f84d``, which differs only by also reusing the gram
accumulators); the peak RSS rises with it (3319 / 3698 MiB on 2 / 4 blocks
at ``015d18d``).
"""
from __future__ import annotations

import ctypes
import sys

__all__ = ["retain_freed_memory", "release_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_DONE = []


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the process (see the module docstring).

    Returns
    -------
    bool
        Whether the policy is in effect (``False`` off Linux/glibc, where the
        call does nothing).  Idempotent.
    """
    if _DONE:
        return _DONE[0]
    ok = False
    if sys.platform.startswith("linux"):
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):       # musl and others: no mallopt
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    _DONE.append(ok)
    return ok


def release_freed_memory() -> bool:
    """Give the memory freed so far back to the system where
    :func:`retain_freed_memory` is in effect (glibc ``malloc_trim(0)``: free
    pages anywhere in the heap are returned); nothing otherwise, so a host
    process that never asked for the policy is left alone.

    Called before a stage whose arrays have other sizes than the ones before
    it: the calibration's head (a float32 output matrix, 500 MiB for a 7B
    model) found no hole of its size in the kept heap and grew it instead.

    Returns
    -------
    bool
        Whether memory was handed back.
    """
    if not (_DONE and _DONE[0]):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
