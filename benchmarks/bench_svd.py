"""Benchmark: truncated SVD vs LAPACK, plus the decompositions mining calls.

Run:  python benchmarks/bench_svd.py [--repeat N] [--no-subprocess]

Prints, measured in one run on the same 1024x3072 float32 Gaussian matrix:
* ``scipy.linalg.svd(w, full_matrices=False)`` vs ``truncated_svd(w, 48)``
  (median wall time, ratio, and the accuracy criteria of issue 2);
* cold import + first call in a fresh process with an empty numba cache
  (compilation), and in a second process that loads the cache;
* warm times of the calls ``profile_layer`` makes on a 1024x3072 weight:
  ``tucker_hosvd`` on the view [1024, 32, 96] at ranks (32, 16, 48) and
  ``tt_svd`` on dims [32, 32, 32, 96] at max_rank 16, and ``monarch_project``
  on a 1024x1024 weight.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def _median_time(fn, repeat):
    fn()                                            # warm-up (compile/cache load)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


_CHILD = """
import time
t0 = time.perf_counter()
import numpy as np
from opscope_nb.profile.svd import truncated_svd
t1 = time.perf_counter()
w = np.random.default_rng(0).standard_normal((1024, 3072)).astype(np.float32)
t2 = time.perf_counter()
truncated_svd(w, 48)
t3 = time.perf_counter()
print(f"{t1 - t0:.3f} {t3 - t2:.3f}")
"""


def _child_run(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-subprocess", action="store_true",
                    help="skip the cold/cached process measurements")
    args = ap.parse_args(argv)

    import numba
    import scipy.linalg
    from opscope_nb.profile.svd import truncated_svd
    from opscope_nb.profile import decompose as D

    print(f"numba {numba.__version__}, numba threads {numba.get_num_threads()}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
          f"cpus {os.cpu_count()}")
    w = np.random.default_rng(0).standard_normal((1024, 3072)).astype(np.float32)

    if not args.no_subprocess:
        with tempfile.TemporaryDirectory() as cache:
            imp_c, call_c = _child_run(cache)
            imp_w, call_w = _child_run(cache)
        print(f"cold process (empty numba cache): import {imp_c:.2f} s + first call "
              f"{call_c:.2f} s (compilation)")
        print(f"second process (cache loaded):    import {imp_w:.2f} s + first call "
              f"{call_w:.2f} s")

    t_lapack = _median_time(lambda: scipy.linalg.svd(w, full_matrices=False),
                            max(1, args.repeat // 2))
    t_ours = _median_time(lambda: truncated_svd(w, 48), args.repeat)
    print(f"scipy.linalg.svd 1024x3072 f32 (full_matrices=False): {t_lapack * 1e3:8.1f} ms")
    print(f"truncated_svd(w, 48)                                : {t_ours * 1e3:8.1f} ms")
    print(f"speed-up vs LAPACK                                  : {t_lapack / t_ours:8.1f}x "
          f"(target >= 5x)")

    s_ref = scipy.linalg.svd(w.astype(np.float64), compute_uv=False)
    for r in (16, 48):
        u, s, vt = truncated_svd(w, r)
        rel = np.abs(s - s_ref[:r]) / s_ref[:r]
        err = np.linalg.norm(w.astype(np.float64) - (u * s).astype(np.float64) @ vt)
        opt = np.sqrt(np.sum(s_ref[r:] ** 2))
        print(f"  accuracy r={r:2d}: sigma_1 rel {rel[0]:.1e} (<= 1e-3), max sigma_i rel "
              f"{rel.max():.1e} (<= 3e-2), error / Eckart-Young {err / opt:.5f} (<= 1.01)")

    x3 = w.reshape(1024, 32, 96)
    t_tucker = _median_time(lambda: D.tucker_hosvd(x3, (32, 16, 48)), args.repeat)
    t_tt = _median_time(lambda: D.tt_svd(w, (32, 32, 32, 96), 16), args.repeat)
    wsq = np.ascontiguousarray(w[:, :1024])
    t_mon = _median_time(lambda: D.monarch_project(wsq), args.repeat)
    print("profile_layer's decompositions of a 1024x3072 weight (warm, median):")
    print(f"  truncated_svd(w, 48)                         {t_ours * 1e3:8.1f} ms")
    print(f"  tucker_hosvd([1024,32,96], (32,16,48))       {t_tucker * 1e3:8.1f} ms")
    print(f"  tt_svd(dims [32,32,32,96], max_rank 16)      {t_tt * 1e3:8.1f} ms")
    print(f"  sum                                          "
          f"{(t_ours + t_tucker + t_tt) * 1e3:8.1f} ms")
    print(f"  monarch_project(1024x1024) (square only)     {t_mon * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
