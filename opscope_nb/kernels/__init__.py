"""The ``@njit`` cores, importable into your own numba code.

Every name here is a numba dispatcher (or a plain Python helper where noted)
that **assumes valid input**: C-contiguous ``float32`` arrays of the documented
shape, finite values, in-range integers.  The validating public twins live in
:mod:`opscope_nb.profile.probe`, :mod:`opscope_nb.profile.svd`, :mod:`opscope_nb.profile.decompose`, etc.

Example
-------
>>> import numba, numpy as np
>>> from opscope_nb.kernels import quant_error, factorize
>>> @numba.njit
... def my_probe(w):
...     u, v = factorize(w, 4, 0)
...     return quant_error(w, 8), u.shape[1]
"""
from ._coerce import *        # noqa: F401,F403
from ._quant_probe import *         # noqa: F401,F403
from ._rng import *           # noqa: F401,F403
from ._sort import *          # noqa: F401,F403
from ._pack import *          # noqa: F401,F403
from ._krylov import *           # noqa: F401,F403
from ._lowrank import *       # noqa: F401,F403
from ._monarch import *       # noqa: F401,F403
from ._tucker import *        # noqa: F401,F403
from ._tt import *            # noqa: F401,F403
from ._w8a8 import *        # noqa: F401,F403
from ._simd import *          # noqa: F401,F403
from ._dado import *          # noqa: F401,F403
from ._packed_float import *  # noqa: F401,F403
from ._simd_lowbit import *   # noqa: F401,F403
from ._w4panel import *       # noqa: F401,F403
from ._packed_quant import *  # noqa: F401,F403
from ._gptq_round import *          # noqa: F401,F403
from ._ggml_quant import *          # noqa: F401,F403
from ._ggml_gptq import *           # noqa: F401,F403
from ._ggml_act import *            # noqa: F401,F403

from . import (
    _coerce,
    _quant_probe as _probe,
    _rng,
    _sort,
    _pack,
    _krylov as _svd,
    _lowrank,
    _monarch,
    _tucker,
    _tt,
    _w8a8 as _matmul,
    _simd,
    _dado,
    _packed_float,
    _simd_lowbit,
    _w4panel,
    _packed_quant,
    _gptq_round as _gptq,
    _ggml_quant as _ggml,
    _ggml_gptq,
    _ggml_act,
)

__all__ = sorted(set().union(*(m.__all__ for m in (
    _coerce, _probe, _rng, _sort, _pack, _svd, _lowrank, _monarch, _tucker, _tt, _matmul, _simd,
    _dado, _packed_float, _simd_lowbit, _w4panel, _packed_quant, _gptq, _ggml, _ggml_gptq, _ggml_act))))
