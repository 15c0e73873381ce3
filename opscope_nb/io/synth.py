"""Synthetic weight matrices: the upstream's seven test distributions.

:func:`sample` re-creates rlx-opscope's ``sample(dist, rows, cols, seed)``
stream for stream, so a matrix generated here equals the Rust tool's dump of
the same ``(dist, rows, cols, seed)``:

* the generator is rlx_ir's **Philox4x32-10 variant** (first multiplier
  ``0xD2561A75``, not Random123's ``0xD2511F53``), key = seed, counter from 0,
  output words consumed in order;
* two streams: ``rng = Philox(seed)`` and ``mask = Philox(seed ^
  0x9E3779B97F4A7C15)``;
* ``rng`` always produces ``rows * cols`` normals first (``base``), whatever
  the distribution, and later draws of ``rng`` continue after them;
* a normal is Box–Muller on two words, float32 throughout
  (:func:`opscope_nb.kernels.box_muller`); ``u01 = float32(word) /
  float32(2^32 - 1)``.

The Philox words and the normals are computed by ``@njit`` cores (counter
based, so in parallel and independent of the thread count).  The two steps
where upstream does a float32 multiply followed by an add (the rank-4 product
and the random walk) run as separate NumPy float32 operations, because the
package's fastmath set allows LLVM to fuse them into an FMA, which would round
differently from Rust.
"""
from __future__ import annotations

import enum

import numpy as np

from opscope_nb._validation import check_int
from opscope_nb.kernels._rng import box_muller, philox_words

__all__ = ["Dist", "sample"]

_MASK_XOR = 0x9E3779B97F4A7C15
_U32_MAX_F32 = np.float32(4294967295.0)   # == 2^32 after float32 rounding, as in Rust


class Dist(enum.Enum):
    """The upstream's synthetic weight distributions (``Dist::ALL`` order).

    Each member's value (also :attr:`label`) is upstream's ``name()``.
    """

    GAUSSIAN = "gaussian"      #: N(0, 1)
    UNIFORM = "uniform"        #: U(-1, 1)
    SPARSE90 = "sparse90"      #: Gaussian with ~90 % zeros
    LOWRANK = "lowrank"        #: rank-4 product / sqrt(4)
    OUTLIER = "outlier"        #: Gaussian, ~1 % of entries x30
    QUANTIZED = "quantized"    #: Gaussian snapped to a 0.5 grid
    COHERENT = "coherent"      #: random walk over rows, step 0.15

    @property
    def label(self) -> str:
        """Upstream's ``name()``: ``'gaussian'``, ``'uniform'``, ..."""
        return self.value

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, dist) -> "Dist":
        """A :class:`Dist` from a member or its name (case-insensitive)."""
        if isinstance(dist, cls):
            return dist
        if isinstance(dist, str):
            key = dist.strip().lower()
            for d in cls:
                if d.value == key:
                    return d
            raise ValueError(f"dist must be one of {[d.value for d in cls]}; got "
                             f"{dist!r}. Pass a Dist member or one of these names.")
        raise TypeError(f"dist must be a Dist or its name (str); got {dist!r} "
                        f"({type(dist).__name__}).")


def _keys(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def _normals(keys, start_word: int, count: int) -> np.ndarray:
    """``count`` normals drawn from word ``start_word`` of a stream."""
    return box_muller(philox_words(keys[0], keys[1], start_word, 2 * count))


def sample(dist, rows, cols, seed=0) -> np.ndarray:
    """A ``rows x cols`` float32 matrix from ``dist``, bit-compatible with upstream.

    Parameters
    ----------
    dist : Dist or str
        A :class:`Dist` member or its label (``"gaussian"``, ``"lowrank"``...).
    rows, cols : int
        Shape, ``>= 0`` (a zero gives an empty array).
    seed : int
        ``0 <= seed < 2**64``; the same seed gives the same array.

    Returns
    -------
    ndarray of shape (rows, cols), float32, C-contiguous (row-major)

    Notes
    -----
    With ``base`` = the first ``rows*cols`` normals of ``rng`` (row-major):

    * ``GAUSSIAN``: ``base``.
    * ``UNIFORM``: ``2*u01(rng) - 1`` per element (draws after ``base``).
    * ``SPARSE90``: ``base`` where ``mask.next_u32() % 10 == 0``, else 0.
    * ``LOWRANK``: ``(U @ V) / sqrt(4)``, ``U[rows, 4]`` normals of ``rng``
      (after ``base``), ``V[4, cols]`` normals of ``mask``; float32 sums in
      ``k`` order.
    * ``OUTLIER``: ``30*base`` where ``mask.next_u32() % 100 == 0``, else ``base``.
    * ``QUANTIZED``: ``round_half_away(2*base) / 2`` (a 0.5 grid).
    * ``COHERENT``: row 0 = ``cols`` normals of ``rng`` (after ``base``); row i
      = row i-1 + ``0.15 * step`` with ``step`` = ``cols`` normals of ``mask``.

    Bit-exactness with the Rust tool holds where both use the same float32
    ``logf``/``cosf`` (glibc on Linux); another libm may differ in the last
    bit of a few normals.

    Examples
    --------
    >>> from opscope_nb.io.synth import Dist, sample
    >>> w = sample(Dist.LOWRANK, 64, 48, seed=1)
    >>> w.shape, w.dtype
    ((64, 48), dtype('float32'))
    """
    d = Dist.parse(dist)
    rows = check_int(rows, "rows", 0)
    cols = check_int(cols, "cols", 0)
    seed = check_int(seed, "seed", 0, 2**64 - 1)
    n = rows * cols
    if n == 0:
        return np.zeros((rows, cols), dtype=np.float32)
    rng = _keys(seed)
    mask = _keys(seed ^ _MASK_XOR)
    after_base = 2 * n            # rng word index once ``base`` is drawn

    if d is Dist.UNIFORM:
        w = philox_words(rng[0], rng[1], after_base, n)
        u = w.astype(np.float32) / _U32_MAX_F32
        return (np.float32(2.0) * u - np.float32(1.0)).reshape(rows, cols)
    if d is Dist.LOWRANK:
        r = 4
        u = _normals(rng, after_base, rows * r).reshape(rows, r)
        v = _normals(mask, 0, r * cols).reshape(r, cols)
        acc = np.zeros((rows, cols), dtype=np.float32)
        for k in range(r):   # separate float32 ops: no FMA, same rounding as Rust
            acc += u[:, k:k + 1] * v[k:k + 1, :]
        acc *= np.float32(1.0 / np.sqrt(r))
        return acc
    if d is Dist.COHERENT:
        out = np.empty((rows, cols), dtype=np.float32)
        out[0] = _normals(rng, after_base, cols)
        if rows > 1:
            out[1:] = np.float32(0.15) * _normals(mask, 0, (rows - 1) * cols).reshape(
                rows - 1, cols)
            np.add.accumulate(out, axis=0, dtype=np.float32, out=out)
        return out

    base = _normals(rng, 0, n)
    if d is Dist.GAUSSIAN:
        return base.reshape(rows, cols)
    if d is Dist.SPARSE90:
        keep = philox_words(mask[0], mask[1], 0, n) % np.uint32(10) == 0
        return np.where(keep, base, np.float32(0.0)).reshape(rows, cols)
    if d is Dist.OUTLIER:
        spike = philox_words(mask[0], mask[1], 0, n) % np.uint32(100) == 0
        return np.where(spike, base * np.float32(30.0), base).reshape(rows, cols)
    if d is Dist.QUANTIZED:
        two = base * np.float32(2.0)
        r = np.floor(np.abs(two))
        r = np.where(np.abs(two) - r >= 0.5, r + np.float32(1.0), r)
        return (np.copysign(r, two) / np.float32(2.0)).astype(np.float32).reshape(rows, cols)
    raise AssertionError(d)  # pragma: no cover - every member handled above
