"""Input coercion usable inside ``@njit`` code (resolved at compile time).

The decomposition cores are called both from Python (where a caller may hand
over float64, integer or non-contiguous arrays, or dims as a tuple / list) and
from other numba code.  These helpers make every such input the
float32 C-contiguous array (or int64 vector) the algorithms assume; for input
that already is one they compile to nothing (no copy).
"""
from __future__ import annotations

import inspect

import numpy as np
from numba import types
from numba.extending import overload

from ._jit import JIT

__all__ = ["as_f32c", "as_i64_vector"]


def njit_entry(impl):
    """Make the Python function ``impl`` also callable from ``@njit`` code.

    ``impl`` coerces its inputs with :func:`as_f32c` and calls a jitted core.
    From Python it runs as plain Python (the coercion is NumPy's, nothing extra
    to compile); inside numba code the same body is compiled through
    ``numba.extending.overload``, where :func:`as_f32c` costs nothing for
    float32 C-contiguous input.  An njit wrapper would instead re-optimise the
    core's whole call graph once more on every first call.
    """
    def typer(*args, **kwargs):
        return impl
    typer.__signature__ = inspect.signature(impl)
    overload(impl, jit_options=dict(JIT))(typer)
    return impl


def as_f32c(a):
    """``a`` as a float32 C-contiguous array (the same array when it is one).

    Parameters
    ----------
    a : ndarray of a real dtype, any layout

    Returns
    -------
    ndarray of float32, C-contiguous, same shape
    """
    return np.ascontiguousarray(a, dtype=np.float32)


@overload(as_f32c)
def _as_f32c_overload(a):
    if not isinstance(a, types.Array):
        return None
    if a.dtype == types.float32:
        if a.layout == "C":
            return lambda a: a
        return lambda a: np.ascontiguousarray(a)
    return lambda a: np.ascontiguousarray(a.astype(np.float32))


def as_i64_vector(seq):
    """A tuple, list or 1-D integer array as a new int64 vector.

    Parameters
    ----------
    seq : homogeneous tuple, list or 1-D array of ints

    Returns
    -------
    ndarray of shape (len(seq),), int64
    """
    return np.array(seq, dtype=np.int64).reshape(-1)


@overload(as_i64_vector)
def _as_i64_vector_overload(seq):
    def impl(seq):
        out = np.empty(len(seq), dtype=np.int64)
        for i in range(len(seq)):
            out[i] = seq[i]
        return out
    return impl
