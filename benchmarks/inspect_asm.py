"""Which SIMD instructions the matmul kernels became on this machine.

Compiles ``matmul_w8a8``, ``matmul_w8a16`` and ``matmul_f32`` afresh (the
on-disk cache holds no assembly to inspect) and counts the vector
instructions that matter in their machine code (``vpdpbusd`` on AVX-512 VNNI /
AVX-VNNI hosts, ``vpmaddubsw``/``vpmaddwd`` on AVX2)::

    python benchmarks/inspect_asm.py
"""
from __future__ import annotations

import collections
import re

import numpy as np
from numba.core.caching import NullCache

from opscope_nb import kernels as K

WATCH = ("vpdpbusd", "vpdpwssd", "vpxord", "vpxor", "vpmaddubsw", "vpmaddwd", "vpsignb", "vpabsb",
         "vpmovsxbw", "vpaddd", "vpsubd",
         "vfmadd231ps", "vpmulld", "vcvtdq2ps", "sdot", "smull", "fmla")


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    xq, sx = K.quantize_rows_i8(x)
    wtq, sc = K.quantize_cols_t(w)
    wt = K.transpose(w)
    kernels = (K.matmul_w8a8, K.matmul_w8a16, K.matmul_f32)
    for f in kernels:
        f._cache = NullCache()  # compile in-process so the assembly is kept
    K.matmul_w8a8(xq, sx, wtq, sc)
    K.matmul_w8a16(x, wtq, sc)
    K.matmul_f32(x, wt)
    print(f"int8 path: {K.simd_path()}")
    for f in kernels:
        asm = "".join(f.inspect_asm().values())
        count = collections.Counter(re.findall(r"\b([a-z][a-z0-9]+)\b", asm))
        seen = {k: count[k] for k in WATCH if count[k]}
        print(f"{f.__name__:14s} {seen}")


if __name__ == "__main__":
    main()
