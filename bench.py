#!/usr/bin/env python
"""Speed + precision table of the opscope-nb matmul kernels (``python bench.py``).

Thin entry point: the sections live in :mod:`opscope_nb.bench` (importable,
called directly by the tests); this file only runs :func:`opscope_nb.bench.main`.

Re-creates the upstream ``opscope-kernels`` benchmark: for each structured
input the matching kernel runs against dense (ours and the vendor BLAS), with
times, speed-ups and relative L2 errors, then f32 / W8A16 / W8A8 on the
qwen-0.6B layer shapes, the vendor comparison, cache vs DRAM, and a verdict
written from this run's numbers.

Sections::

  1  sparse activations (90 % zeros) -> skip-zeros vs dense
  2  low-rank weight -> factorize r=8 + factored matmul vs dense
  3  per-channel int8 weights (quant_matmul)
  4  f32 vs W8A16 vs W8A8 on qwen shapes, decode (m=1) and prefill (m=32)
  5  vendor comparison k=n=1024, m = 1, 32, 128 (+ vendor 1 thread vs all)
  6  cache vs DRAM at m=1: 2048^2 vs 6144^2
  7  verdict

The header also reports the streaming read bandwidth (a parallel sum over an
array much larger than L3).

Options: ``--quick`` (small sizes, seconds; CI smoke), ``--json FILE`` (every
figure, machine-readable), ``--sections 4,5`` (a subset; 7 is always added
when any of 4-6 runs).  Timing: warm-up calls first (compile / cache-load time
reported apart), then the candidates of one comparison are timed in
alternating blocks of back-to-back calls (a short pause before each block
lets the other library's spinning threads go idle); each candidate keeps the
median of its best block.
"""
import sys

from opscope_nb.bench import main
from opscope_nb.warmup import warm_bench

if __name__ == "__main__":
    sys.exit(main(warm=warm_bench))
