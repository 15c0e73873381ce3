"""Boundary checks shared by every public function.

Public functions validate and coerce once, here, so the ``@njit`` cores in
:mod:`opscope_nb.kernels` only ever see C-contiguous, finite ``float32`` arrays
and in-range integers.  Every error names the rule, the value received and the
fix.
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "as_float32",
    "as_matrix",
    "check_int",
    "check_bits",
    "check_fraction",
]


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"ndarray(shape={x.shape}, dtype={x.dtype})"
    return f"{type(x).__name__}"


def as_float32(x, name: str = "x", *, ndim: int | None = None,
               allow_empty: bool = False, check_finite: bool = True) -> np.ndarray:
    """Coerce ``x`` to a C-contiguous ``float32`` ndarray, or raise.

    Integer and floating inputs (float16/float64 included) are accepted and
    converted to float32; booleans, complex, object and string dtypes raise
    ``TypeError``.  A non-contiguous view is copied.

    Parameters
    ----------
    x : array_like
        Input values.
    name : str
        Argument name used in error messages.
    ndim : int, optional
        Required number of dimensions.
    allow_empty : bool
        Whether a zero-size array is acceptable.
    check_finite : bool
        Reject NaN / Inf.

    Returns
    -------
    ndarray of float32, C-contiguous
    """
    if isinstance(x, np.ndarray):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"{name} must be a numeric array; got {_describe(x)} "
                            f"({exc}). Pass a numpy array of floats.") from None
    kind = arr.dtype.kind
    if kind not in "fiu":
        raise TypeError(
            f"{name} must have a real numeric dtype (float or int); got dtype "
            f"{arr.dtype}. Convert it first, e.g. np.asarray({name}, dtype=np.float32).")
    if ndim is not None and arr.ndim != ndim:
        fix = f" Reshape it, e.g. {name}.reshape(rows, -1)." if ndim == 2 else ""
        raise ValueError(f"{name} must be {ndim}-D; got {arr.ndim}-D with shape "
                         f"{arr.shape}.{fix}")
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name} must not be empty; got shape {arr.shape}. "
                         f"Pass at least one element along every axis.")
    with np.errstate(over="ignore"):  # overflow is reported just below, as an error
        out = np.ascontiguousarray(arr, dtype=np.float32)
    if check_finite and out.size and not np.isfinite(out).all():
        bad = int(out.size - np.count_nonzero(np.isfinite(out)))
        what = "NaN/Inf"
        if arr.dtype.kind == "f" and np.isfinite(arr).all():
            what = "values that overflow float32"
        raise ValueError(f"{name} must be finite; it holds {bad} {what} "
                         f"element(s) out of {out.size}. Clean or mask them first "
                         f"(e.g. np.nan_to_num).")
    return out


def as_matrix(x, name: str = "w", *, allow_empty: bool = False,
              check_finite: bool = True) -> np.ndarray:
    """:func:`as_float32` for a 2-D ``[rows, cols]`` matrix."""
    return as_float32(x, name, ndim=2, allow_empty=allow_empty,
                      check_finite=check_finite)


def check_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as a Python int after checking ``lo <= value <= hi``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {value!r} "
                        f"({type(value).__name__}). Pass e.g. {name}=int(...).")
    v = int(value)
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"{name} must lie in {rng}; got {v}.")
    return v


def check_bits(bits) -> int:
    """Quantisation bit-width: an integer in 2..16."""
    return check_int(bits, "bits", 2, 16)


def check_fraction(value, name: str, *, lo_open: float = 0.0, hi: float = 1.0) -> float:
    """A real number in the half-open interval ``(lo_open, hi]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r}.")
    v = float(value)
    if not np.isfinite(v) or not (lo_open < v <= hi):
        raise ValueError(f"{name} must lie in ({lo_open}, {hi}]; got {value!r}. "
                         f"It is a fraction of the dense size, e.g. 0.35.")
    return v
