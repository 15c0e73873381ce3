"""opscope-nb: which compression fits each weight matrix, which mix fits a
memory budget, and how fast it runs -- numba-compiled.

The folders are the layers, lowest first (a module imports only from its
layer or below):

* :mod:`opscope_nb.kernels`  - the ``@njit`` cores, callable from your numba code
* :mod:`opscope_nb.formats`  - the option model (``Decomp``) and the ggml type table
* :mod:`opscope_nb.io`       - safetensors / GGUF reading, GGUF export, imatrix files
* :mod:`opscope_nb.runtime`  - ``PackedLinear``, compressed checkpoints, W8A8 matmul, vendor BLAS
* :mod:`opscope_nb.profile`  - mining (``profile_layer``), probes, SVD, decompositions,
  calibration, GPTQ
* :mod:`opscope_nb.plan`     - the allocators and plan application
* :mod:`opscope_nb.models`   - forward passes, loaders, evaluation
* :mod:`opscope_nb.distributed` - profiling on Dask
* :mod:`opscope_nb.cli`, :mod:`opscope_nb.bench`, :mod:`opscope_nb.warmup` - commands,
  the bench, ahead-of-time compilation

Everything is imported lazily, so ``import opscope_nb`` stays cheap; the
public names below are reachable from here too (``opscope_nb.profile_layer``).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public names reachable from the top level, and the module that defines each.
_NAMES = {
    "Decomp": "opscope_nb.formats",
    "open_source": "opscope_nb.io",
    "PackedLinear": "opscope_nb.runtime",
    "save": "opscope_nb.runtime",
    "load": "opscope_nb.runtime",
    "profile_layer": "opscope_nb.profile.mining",
    "LayerProfile": "opscope_nb.profile.mining",
    "DecompOption": "opscope_nb.profile.mining",
    "calibrate": "opscope_nb.profile.calib",
    "truncated_svd": "opscope_nb.profile.svd",
    "Dist": "opscope_nb.io.synth",
    "sample": "opscope_nb.io.synth",
    "greedy_allocate": "opscope_nb.plan.allocate",
    "dado_allocate": "opscope_nb.plan.allocate",
    "exact_allocate": "opscope_nb.plan.allocate",
    "apply_plan": "opscope_nb.plan.apply",
}

#: Modules reachable as attributes (``opscope_nb.probe`` is
#: :mod:`opscope_nb.profile.probe`).
_MODULES = {
    "kernels": "opscope_nb.kernels", "formats": "opscope_nb.formats", "io": "opscope_nb.io",
    "runtime": "opscope_nb.runtime", "profile": "opscope_nb.profile",
    "plan": "opscope_nb.plan", "models": "opscope_nb.models", "cli": "opscope_nb.cli",
    "probe": "opscope_nb.profile.probe", "svd": "opscope_nb.profile.svd",
    "decompose": "opscope_nb.profile.decompose", "mining": "opscope_nb.profile.mining",
    "allocate": "opscope_nb.plan.allocate", "synth": "opscope_nb.io.synth",
    "accel": "opscope_nb.runtime.accel",
}

__all__ = ["__version__", *_NAMES, *_MODULES]


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
