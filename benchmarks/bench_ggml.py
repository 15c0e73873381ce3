"""Speed of the ggml quantisers: seconds per thread on a 4096 x 11008 tensor.

    PYTHONPATH=. python benchmarks/bench_ggml.py [--rows 4096] [--cols 11008] [--types Q4_K,Q6_K]
                                    [--importance] [--libggml /path/libggml-base.so]

Reports, per type, the cold first call (compile or cache load, on a 1-row
tensor), the warm wall time on the full tensor with all numba threads, and
that time x threads (seconds per thread, comparable to a single-threaded C
run).  With ``--libggml`` (a ``libggml-base.so`` built as described in
``tests/test_ggml.py``) it also times ``ggml_quantize_chunk`` single-threaded
on the same tensor and checks the bytes agree.  11008 is not a multiple of
256, so the 256-block types are timed on the first 10752 columns (42 blocks).
Keep runs short on shared machines: ``--rows 512`` gives the same per-weight
figures.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numba
import numpy as np

from opscope_nb.formats import ggml

TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS",
         "Q3_K", "Q2_K", "TQ2_0", "TQ1_0"]


def _libggml(path):
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=11008)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--importance", action="store_true")
    ap.add_argument("--libggml", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    w_full = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    imp_full = rng.random(a.cols).astype(np.float32) if a.importance else None
    lib = _libggml(a.libggml) if a.libggml else None
    nt = numba.get_num_threads()
    print(f"{a.rows} x {a.cols}, numba threads {nt}, importance {a.importance}")
    print(f"{'type':7} {'cold s':>7} {'warm s':>8} {'s/thread':>9} {'libggml 1T s':>13} same")
    for t in a.types.split(","):
        info = ggml.GGML_TYPES[t.upper()]
        cols = a.cols - a.cols % info.block
        w = np.ascontiguousarray(w_full[:, :cols])
        imp = None if imp_full is None else np.ascontiguousarray(imp_full[:cols])
        t0 = time.perf_counter()
        ggml.quantize(w[:1], t, imp)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        q = ggml.quantize(w, t, imp)
        warm = time.perf_counter() - t0
        ref_s, same = "", ""
        if lib is not None:
            out = np.empty_like(q)
            t0 = time.perf_counter()
            lib.ggml_quantize_chunk(info.id, w.ctypes.data, out.ctypes.data, 0, w.shape[0], cols,
                                    None if imp is None else imp.ctypes.data)
            ref_s = f"{time.perf_counter() - t0:13.2f}"
            same = str(bool(np.array_equal(out, q)))
        print(f"{t:7} {cold:7.2f} {warm:8.2f} {warm * nt:9.2f} {ref_s:>13} {same}", flush=True)


if __name__ == "__main__":
    main()
