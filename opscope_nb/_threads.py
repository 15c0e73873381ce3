"""Fixed row blocks across a thread pool, one BLAS thread each.

The calibrated parts of a profile (``out_err`` GEMMs, GPTQ) are sums or maps
over a weight's output rows.  :func:`map_row_blocks` cuts the rows into
blocks of a fixed length -- independent of the thread count -- and runs them
on Python threads (NumPy's matmul and the package's ``nogil`` kernels release
the GIL), with every BLAS library limited to one thread for the duration of
the call (``threadpoolctl``, scoped: the previous limits come back after).

Why not BLAS's own threads: after each call OpenBLAS's idle threads spin on
the cores that numba's parallel loops need next (see ``opscope_nb.cli.main``);
blocks on threads keep one BLAS thread per core and nothing spinning.  Why
fixed blocks: each block's arithmetic is the same for any thread count, so
the results are identical on 1 or 64 cores.

The thread count is :func:`numba.get_num_threads` (the user's
``NUMBA_NUM_THREADS`` / ``numba.set_num_threads``, read, never changed).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["worker_count", "map_row_blocks", "blas_threads", "ROW_BLOCK"]

#: Rows per block (fixed: the blocks do not depend on the thread count).
ROW_BLOCK = 64

_CONTROLLER = []
_LOCK = threading.Lock()


def worker_count() -> int:
    """Threads the package's thread-pool parts use: numba's current thread count."""
    import numba
    return max(1, int(numba.get_num_threads()))


def _controller():
    """The process's threadpoolctl controller, or None without threadpoolctl."""
    with _LOCK:
        if not _CONTROLLER:
            try:
                from threadpoolctl import ThreadpoolController
                _CONTROLLER.append(ThreadpoolController())
            except ImportError:          # an optional speed-up, not a correctness need
                _CONTROLLER.append(None)
    return _CONTROLLER[0]


def _blas_limit(n):
    ctl = _controller()
    if ctl is None:
        import contextlib
        return contextlib.nullcontext()
    return ctl.limit(limits=int(n), user_api="blas")


def _one_blas_thread():
    """A context manager limiting every loaded BLAS to one thread (no-op
    without threadpoolctl)."""
    return _blas_limit(1)


def blas_threads(n: int | None = None):
    """A context manager letting every loaded BLAS use ``n`` threads (default
    :func:`worker_count`) for one large LAPACK/BLAS call, whatever
    ``OPENBLAS_NUM_THREADS`` the command line pinned; the previous limits come
    back on exit."""
    return _blas_limit(worker_count() if n is None else max(1, int(n)))


def map_row_blocks(fn, rows: int, block: int = ROW_BLOCK, threads: int | None = None) -> list:
    """``[fn(r0, r1) for each block]`` over ``range(rows)`` in blocks of ``block``.

    Parameters
    ----------
    fn : callable ``(r0, r1) -> object``
        Work on rows ``r0:r1``; called from worker threads (it must not rely
        on the GIL being held for long; NumPy GEMMs and ``nogil`` kernels
        release it).
    rows : int
        Number of rows (``>= 0``).
    block : int
        Rows per block (``>= 1``); the blocking, hence every result, does not
        depend on ``threads``.
    threads : int, optional
        Worker threads (default :func:`worker_count`); 1 runs in the caller.

    Returns
    -------
    list
        The results in block order.
    """
    blocks = [(r0, min(r0 + block, rows)) for r0 in range(0, rows, max(1, int(block)))]
    k = min(worker_count() if threads is None else max(1, int(threads)), len(blocks))
    with _one_blas_thread():
        if k <= 1:
            return [fn(a, b) for a, b in blocks]
        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="opscope-rows") as ex:
            return list(ex.map(lambda ab: fn(*ab), blocks))
