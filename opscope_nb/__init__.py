"""opscope-nb: per-layer compression mining, budget allocation and kernels.

Submodules are imported lazily so ``import opscope_nb`` stays cheap:

* :mod:`opscope_nb.synth`     - synthetic weight distributions (``Dist``, ``sample``)
* :mod:`opscope_nb.probe`     - quantisation / sparsity / rank probes
* :mod:`opscope_nb.svd`       - truncated SVD
* :mod:`opscope_nb.decompose` - validated low-rank, Monarch, Tucker and TT wrappers
* :mod:`opscope_nb.mining`    - ``profile_layer`` and the option catalogue
* :mod:`opscope_nb.allocate`  - greedy, DADO and exact budget allocators
* :mod:`opscope_nb.kernels`   - the ``@njit`` cores, callable from your numba code
* :mod:`opscope_nb.accel`     - the platform's vendor BLAS (cffi)
* :mod:`opscope_nb.cli`       - the ``opscope-nb`` command line
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("synth", "probe", "svd", "decompose", "mining", "allocate",
               "kernels", "accel", "cli", "io")

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
