"""A stable argsort for the kernels: one small merge sort instead of numba's
``np.argsort(kind="mergesort")``, whose cold compile costs seconds in each caller
(the allocators and the truncated SVD)."""
from __future__ import annotations

import numpy as np

from ._jit import njit

__all__ = ["argsort_stable"]


@njit(inline="always")
def _lt(a, b):
    """``a < b`` with NaN after every number (NumPy's sort order)."""
    return a < b or (b != b and a == a)


@njit
def argsort_stable(a):
    """``np.argsort(a, kind="stable")`` of a 1-D float array: a bottom-up
    merge sort (equal keys keep their order, ``-0.0 == 0.0``, NaN last).

    numba's own ``np.argsort(kind="mergesort")`` costs ~2 s of a cold
    compile in every caller; this one a fraction of it.

    Parameters
    ----------
    a : ndarray of float32 or float64, shape (n,)

    Returns
    -------
    ndarray of int64, shape (n,)
    """
    n = a.shape[0]
    idx = np.empty(n, dtype=np.int64)
    for t in range(n):
        idx[t] = t
    tmp = np.empty(n, dtype=np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i = lo
            j = mid
            k = lo
            while i < mid and j < hi:
                if _lt(a[idx[j]], a[idx[i]]):     # strictly less: stable
                    tmp[k] = idx[j]
                    j += 1
                else:
                    tmp[k] = idx[i]
                    i += 1
                k += 1
            while i < mid:
                tmp[k] = idx[i]
                i += 1
                k += 1
            while j < hi:
                tmp[k] = idx[j]
                j += 1
                k += 1
        idx, tmp = tmp, idx
        width *= 2
    return idx
