"""Session setup: one compute thread per core across the xdist workers.

``pytest -n auto`` starts one worker per core, and each worker's numba
(OpenMP) and BLAS (OpenBLAS) pools would start a thread per core too: two
workers on two cores ran four busy threads, and a parallel region waits for
its slowest thread -- a 2-second ``opscope-nb profile`` inside one test took
13 s beside a busy worker and 37-62 s in the suite.  Each worker gets
``cores // workers`` threads instead (at least 1); a test that needs another
count sets it itself (``numba.set_num_threads``), and subprocesses keep the
defaults but the BLAS pool size.
"""
import os

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
THREADS = max(1, (_CORES or 1) // _WORKERS) if _WORKERS > 1 else None

if THREADS is not None:
    # read by OpenBLAS when numpy loads it: set before any test module imports numpy
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(THREADS))


def pytest_configure(config):
    if THREADS is not None:
        import numba
        numba.set_num_threads(min(THREADS, numba.config.NUMBA_NUM_THREADS))
