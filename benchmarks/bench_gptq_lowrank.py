#!/usr/bin/env python
"""GPTQ's low-rank path against its dense path on one layer shape.

Prints the CPU seconds of the per-gram preparation (the low-rank arrays, or
the Cholesky factor of the inverse Hessian) and of two options on the same
rows, and the share of equal codes.  CPU seconds, because they move less
than wall time on a shared machine.

Usage: ``python benchmarks/bench_gptq_lowrank.py ROWS COLS [TOKENS]`` (e.g.
``1024 11008``: 1024 sampled rows of a Llama-7B down_proj, 512 Gaussian
calibration rows by default).
"""
import os
import platform
import sys
import time

import numpy as np

from opscope_nb.formats import gptq as G


def main():
    rows, cols = int(sys.argv[1]), int(sys.argv[2])
    t = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x = rng.standard_normal((t, cols))
    h = G.check_gram(x.T @ x, cols)
    f = G.gram_factor(h, max_rank=min(cols // 2, 1024))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{rows} x {cols}, {t} calibration rows; load {os.getloadavg()[0]:.1f}")
    G.gptq_validated(w[:8], h, 4, 32, factor=f)      # compile
    codes = {}
    for mode in ("lowrank", "dense"):
        G._CACHE.clear()
        if mode == "dense":
            G.LOWRANK_FRACTION = 10 ** 9
        c0 = time.process_time()
        G.gptq_validated(w[:8], h, 4, 32, factor=f)
        print(f"{mode:8s} per-gram preparation: {time.process_time() - c0:7.1f} CPU s")
        for bits, grp in ((4, 32), (3, cols)):
            c0 = time.process_time()
            c, _ = G.gptq_validated(w, h, bits, grp, factor=f)
            print(f"{mode:8s} int{bits}/{'chan' if grp == cols else f'g{grp}'}: "
                  f"{time.process_time() - c0:7.1f} CPU s")
            codes.setdefault((bits, grp), []).append(c)
    for k, (a, b) in codes.items():
        print(f"int{k[0]}: equal codes {np.mean(a == b):.6f}")


if __name__ == "__main__":
    main()
