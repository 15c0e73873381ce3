"""GPTQ core: error-compensating symmetric quantisation, column by column.

The Python entry point (validation, Hessian dampening and the Cholesky factor)
is :func:`opscope_nb.gptq.gptq_quantize`; this module holds the ``@njit`` core
that assumes valid input.

Layout: ``w`` is the PyTorch Linear weight ``[rows, cols]`` = ``[out, in]``;
the Hessian and its factor are ``[cols, cols]`` (input features).  Codes and
scales come out exactly as :func:`opscope_nb.kernels.quantize_groups_sym`
lays them out (``codes`` int8 ``[rows, cols]``, ``scales`` float32
``[rows, ceil(cols / group)]``), so the packers and kernels of the
round-to-nearest twins run them unchanged.
"""
from __future__ import annotations

import numpy as np

from .._config import njit
from ._probe import div_f32, round_half_away

__all__ = ["gptq_core"]


@njit
def gptq_core(w, u, bits, group, block):
    """Quantise ``w`` column by column, pushing each column's rounding error
    onto the columns not yet quantised (GPTQ, Frantar et al. 2022).

    For column ``i`` (in order 0..cols-1): the group's scale is fixed when its
    first column is reached, from the *current* (error-updated) values of the
    group's columns: ``scale = div_f32(float32(amax), levels)`` (1.0 when
    ``amax < 1e-20``); ``code = clamp(round_half_away(div_f32(float32(w_ri),
    scale)), -levels, levels)``; ``e_r = (w_ri - code * scale) / u[i, i]``;
    ``w[r, j] -= e_r * u[i, j]`` for ``j > i``.  Updates to columns beyond the
    current block of ``block`` columns are applied lazily at the block's end
    as one matrix product (same result up to float64 summation order).

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float64, C-contiguous
        ``[out, in]`` weights; **overwritten** (the error-updated weights).
    u : ndarray of shape (cols, cols), float64, C-contiguous
        Upper Cholesky factor of the (dampened) inverse Hessian,
        ``H^-1 = uᵀ u``; ``u[i, i] > 0``.
    bits : int
        2..8 (``levels = 2**(bits-1) - 1``).
    group : int
        Group length along a row (``cols`` for one scale per row).
    block : int
        Lazy-update block width; a multiple of ``group`` unless
        ``group >= cols``.

    Returns
    -------
    codes : ndarray of shape (rows, cols), int8
    scales : ndarray of shape (rows, ceil(cols / group)), float32
    """
    rows, cols = w.shape
    ng = (cols + group - 1) // group
    levels = max((1 << (bits - 1)) - 1, 1)
    flev = np.float32(levels)
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, ng), dtype=np.float32)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        nb = b1 - b0
        err = np.empty((rows, nb), dtype=np.float64)
        for i in range(b0, b1):
            if i % group == 0:
                g = i // group
                g1 = min(i + group, cols)
                for r in range(rows):
                    amax = np.float32(0.0)
                    for j in range(i, g1):
                        a = abs(np.float32(w[r, j]))
                        if a > amax:
                            amax = a
                    scales[r, g] = (div_f32(amax, flev) if amax >= np.float32(1e-20)
                                    else np.float32(1.0))
            g = i // group
            d = u[i, i]
            for r in range(rows):
                sc = scales[r, g]
                q = round_half_away(div_f32(np.float32(w[r, i]), sc))
                if q > flev:
                    q = flev
                elif q < -flev:
                    q = -flev
                codes[r, i] = np.int8(q)
                e = (w[r, i] - np.float64(q * sc)) / d
                err[r, i - b0] = e
                for j in range(i + 1, b1):
                    w[r, j] -= e * u[i, j]
        if b1 < cols:
            w[:, b1:] -= err @ np.ascontiguousarray(u[b0:b1, b1:])
    return codes, scales
