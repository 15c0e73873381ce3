"""``python -m opscope_nb.bench`` = ``python bench.py``."""
import sys

from .runner import main

sys.exit(main())
