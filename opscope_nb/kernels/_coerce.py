"""Input coercion usable inside ``@njit`` code (resolved at compile time).

The decomposition cores are called both from Python (where a caller may hand
over float64, integer or non-contiguous arrays, or dims as a tuple / list) and
from other numba code.  These helpers make every such input the
float32 C-contiguous array (or int64 vector) the algorithms assume; for input
that already is one they compile to nothing (no copy).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .._config import njit

__all__ = ["as_f32c", "as_i64_vector"]


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


@njit
def as_i64_vector(seq):
    """A tuple, list or 1-D integer array as a new int64 vector.

    Parameters
    ----------
    seq : homogeneous tuple, list or 1-D array of ints

    Returns
    -------
    ndarray of shape (len(seq),), int64
    """
    out = np.empty(len(seq), dtype=np.int64)
    for i in range(len(seq)):
        out[i] = seq[i]
    return out
