"""Session setup: one compute thread per core across the xdist workers.

``pytest -n auto`` starts one worker per core, and each worker's numba
(OpenMP) and BLAS (OpenBLAS) pools would start a thread per core too: two
workers on two cores ran four busy threads, and a parallel region waits for
its slowest thread -- a test running three 2-second ``opscope-nb profile``
commands took 4.6 s alone, 13.1 s beside one busy pytest and 37-62 s in the
suite (Zen 4, 2 cores).  Each worker gets the Dask workers' rule,
:func:`opscope_nb.distributed.default_threads` (``cores // workers``, at
least 1); a test that needs another count sets it itself
(``numba.set_num_threads``), and subprocesses keep numba's default pool.
"""
import os

# opscope_nb.distributed imports neither numpy nor numba at import
from opscope_nb.distributed import default_threads, thread_env

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
THREADS = default_threads(_WORKERS) if _WORKERS > 1 else None

if THREADS is not None:
    # read by OpenBLAS when numpy loads it: set before any test module imports
    # numpy; numba's pool keeps its size (tests ask for 2 threads)
    for _var, _val in thread_env(THREADS).items():
        if _var != "NUMBA_NUM_THREADS":
            os.environ.setdefault(_var, _val)

try:
    from hypothesis import settings as _hyp_settings
except ImportError:     # (the property tests skip without it)
    pass
else:
    # every random choice from an explicit seed: the property tests draw the
    # same examples in every run (a random draw found a float32 threshold edge
    # once; test_zero_scale_threshold_compared_in_float32 now pins it)
    _hyp_settings.register_profile("opscope", derandomize=True)
    _hyp_settings.load_profile("opscope")


def pytest_configure(config):
    if THREADS is not None:
        import numba
        numba.set_num_threads(min(THREADS, numba.config.NUMBA_NUM_THREADS))
