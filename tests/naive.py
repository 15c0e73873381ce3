"""Plain NumPy twins of every kernel, for the tests to compare against.

This module (and the ``naive_*`` files it gathers) never imports
``opscope_nb``: each twin is the obvious loop / NumPy formula, written from the
definition, so a test compares the kernel with an independent statement of it.
"""
from naive_probe import *    # noqa: F401,F403
from naive_decomp import *   # noqa: F401,F403
from naive_matmul import *   # noqa: F401,F403
from naive_alloc import *    # noqa: F401,F403
