"""``python -m opscope_nb.bench`` = ``python bench.py``."""
import sys

from opscope_nb.warmup import warm_bench
from .runner import main

sys.exit(main(warm=warm_bench))
