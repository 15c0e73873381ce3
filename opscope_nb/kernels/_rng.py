"""``@njit`` cores of the synthetic data generator (:mod:`opscope_nb.io.synth`):
rlx_ir's Philox4x32-10 variant and its Box-Muller normals.

**No input validation**; the validating public twin is :mod:`opscope_nb.io.synth`.
Counter-based: blocks are computed in parallel (``prange``) and every result is
independent of the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import njit, njit_parallel

__all__ = [
    "philox4x32_block",
    "philox_words",
    "box_muller",
]


# --------------------------------------------------------------------------
# synthetic data: rlx_ir's Philox4x32-10 variant
# --------------------------------------------------------------------------

@njit
def philox4x32_block(c0, c1, k0, k1):
    """One Philox4x32-10 block of rlx_ir's variant.

    Parameters
    ----------
    c0, c1 : uint32-valued ints
        Low two words of the 128-bit counter (the high two are 0 for any
        stream shorter than 2^66 words).
    k0, k1 : uint32-valued ints
        Key = (seed low 32 bits, seed high 32 bits).

    Returns
    -------
    (uint64, uint64, uint64, uint64)
        The four output words (each < 2^32), consumed in this order.

    Notes
    -----
    Round: ``p0 = s0 * 0xD2561A75``, ``p1 = s2 * 0xCD9E8D57`` (64-bit),
    ``s = (hi(p1)^s1^k0, lo(p1), hi(p0)^s3^k1, lo(p0))``, then the key is
    bumped by ``(0x9E3779B9, 0xBB67AE85)``; 10 rounds.  The first multiplier
    is **not** Random123's 0xD2511F53, so Random123/JAX streams differ.
    """
    mask = np.uint64(0xFFFFFFFF)
    s0 = np.uint64(c0)
    s1 = np.uint64(c1)
    s2 = np.uint64(0)
    s3 = np.uint64(0)
    a = np.uint64(k0)
    b = np.uint64(k1)
    m0 = np.uint64(0xD2561A75)
    m1 = np.uint64(0xCD9E8D57)
    w0 = np.uint64(0x9E3779B9)
    w1 = np.uint64(0xBB67AE85)
    sh = np.uint64(32)
    for _ in range(10):
        p0 = s0 * m0
        p1 = s2 * m1
        n0 = (p1 >> sh) ^ s1 ^ a
        n1 = p1 & mask
        n2 = (p0 >> sh) ^ s3 ^ b
        n3 = p0 & mask
        s0 = n0
        s1 = n1
        s2 = n2
        s3 = n3
        a = (a + w0) & mask
        b = (b + w1) & mask
    return s0, s1, s2, s3


@njit_parallel
def philox_words(k0, k1, start, count):
    """Words ``start .. start+count`` of a Philox4x32 stream.

    Parameters
    ----------
    k0, k1 : int
        Key words (seed low / high 32 bits).
    start : int
        Index of the first word (word ``w`` is lane ``w % 4`` of block
        ``w // 4``; the stream's counter starts at block 0).
    count : int
        Number of words.

    Returns
    -------
    ndarray of shape (count,), uint32

    Notes
    -----
    Counter-based, so blocks are computed in parallel and the result does not
    depend on the thread count.  Block indices must stay below 2^64.
    """
    out = np.empty(count, dtype=np.uint32)
    if count == 0:
        return out
    b0 = start // 4
    b1 = (start + count - 1) // 4
    for b in prange(b0, b1 + 1):
        bb = np.uint64(b)
        r0, r1, r2, r3 = philox4x32_block(bb & np.uint64(0xFFFFFFFF),
                                          bb >> np.uint64(32), k0, k1)
        base = b * 4 - start
        for lane in range(4):
            t = base + lane
            if t >= 0 and t < count:
                if lane == 0:
                    out[t] = np.uint32(r0)
                elif lane == 1:
                    out[t] = np.uint32(r1)
                elif lane == 2:
                    out[t] = np.uint32(r2)
                else:
                    out[t] = np.uint32(r3)
    return out


@njit_parallel
def box_muller(words):
    """Standard normals from consecutive word pairs, rlx_ir's ``normal()``.

    Parameters
    ----------
    words : ndarray of shape (2*n,), uint32

    Returns
    -------
    ndarray of shape (n,), float32

    Notes
    -----
    All float32: ``u = (w >> 8) / 2^24``; ``u1 = max(u(words[2i]),
    FLT_MIN)``, ``u2 = u(words[2i+1])``; ``sqrt(-2 ln u1) * cos(2pi * u2)``
    with ``2pi`` the float32 product ``2 * float32(pi)``.  The sine half is
    discarded (two words per normal).
    """
    n = words.shape[0] // 2
    out = np.empty(n, dtype=np.float32)
    inv24 = np.float32(1.0 / 16777216.0)
    tiny = np.float32(1.1754943508222875e-38)
    two_pi = np.float32(2.0) * np.float32(np.pi)
    m2 = np.float32(-2.0)
    for i in prange(n):
        u1 = np.float32(words[2 * i] >> np.uint32(8)) * inv24
        u2 = np.float32(words[2 * i + 1] >> np.uint32(8)) * inv24
        if u1 < tiny:
            u1 = tiny
        r = np.sqrt(m2 * np.log(u1))
        out[i] = r * np.cos(two_pi * u2)
    return out
