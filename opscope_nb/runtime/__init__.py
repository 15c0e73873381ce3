"""Run a packed compression option as a linear layer -- the public face of
:mod:`opscope_nb.runtime._packed` (``PackedLinear``, ``measure_latency``,
``expected_arrays``, ...) together with the compressed-checkpoint
``save`` / ``load`` of :mod:`opscope_nb.runtime.checkpoint`.

The layer itself lives in ``_runtime`` (layer 2), which the checkpoint format
builds on; this module sits above both, so ``opscope_nb.runtime.save`` keeps
working without the runtime importing the checkpoint (no import loop).
"""
from ._packed import *  # noqa: F401,F403
from ._packed import _FORWARD, __all__ as _RT_ALL, __doc__ as _RT_DOC
from .checkpoint import load, save  # noqa: F401

__all__ = [*_RT_ALL, "save", "load"]
__doc__ = (__doc__ or "") + "\n" + (_RT_DOC or "")
