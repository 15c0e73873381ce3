"""GPTQ core: error-compensating symmetric quantisation, column by column.

The Python entry point (validation, Hessian dampening, the column order, the
Cholesky factor and the choice between clipped and unclipped scales) is
:func:`opscope_nb.formats.gptq.gptq_quantize`; this module holds the ``@njit`` cores
that assume valid input.

Layout: ``w`` is the PyTorch Linear weight ``[rows, cols]`` = ``[out, in]``;
the Hessian and its factor are ``[cols, cols]`` (input features).  Codes and
scales come out exactly as :func:`opscope_nb.kernels.quantize_groups_sym`
lays them out (``codes`` int8 ``[rows, cols]``, ``scales`` float32
``[rows, ceil(cols / group)]``), so the packers and kernels of the
round-to-nearest twins run them unchanged.

Columns may be processed in any order (act-order: largest ``H[i, i]`` first)
because the group scales are fixed before the sweep (static groups): a
group's scale never depends on the order, so the layout stays the
round-to-nearest one.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit
from ._quant_probe import ZERO_AMAX, div_f32, round_half_away

__all__ = ["gptq_core", "gptq_group_scales", "gptq_block_sweep"]


@njit(nogil=True)
def gptq_group_scales(w, imp, bits, group, steps):
    """Static group scales for GPTQ: per row and group, the scale among
    ``steps + 1`` clipping candidates with the least importance-weighted
    round-to-nearest error.

    Candidate ``k`` (``0..steps``) is ``div_f32(float32(amax) *
    float32(1 - 0.5 * k / steps), levels)`` (``k = 0``: the unclipped
    ``amax / levels``); its error is ``sum_j imp[j] * (w[r, j] - float64(q *
    s))**2`` over the group's columns in order, ``q = clamp(round_half_away(
    div_f32(float32(w[r, j]), s)), -levels, levels)``; the first minimum
    wins.  ``amax < 1e-20`` gives scale 1.0.  ``steps = 0`` is the plain
    ``amax / levels``.

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float64
        ``[out, in]`` weights (not modified).
    imp : ndarray of shape (cols,), float64
        Per-column importance ``>= 0`` (``diag(H)``).
    bits : int
        2..8.
    group : int
        Group length along a row, ``>= 1``.
    steps : int
        Clipping candidates beyond the unclipped one (down to ``0.5 * amax``).

    Returns
    -------
    ndarray of shape (rows, ceil(cols / group)), float32
    """
    rows, cols = w.shape
    ng = (cols + group - 1) // group
    levels = max((1 << (bits - 1)) - 1, 1)
    flev = np.float32(levels)
    scales = np.empty((rows, ng), dtype=np.float32)
    for r in range(rows):
        for g in range(ng):
            j0 = g * group
            j1 = min(j0 + group, cols)
            amax = np.float32(0.0)
            for j in range(j0, j1):
                a = abs(np.float32(w[r, j]))
                if a > amax:
                    amax = a
            if amax < ZERO_AMAX:
                scales[r, g] = np.float32(1.0)
                continue
            best_s = div_f32(amax, flev)
            best_e = np.inf
            for k in range(steps + 1):
                f = np.float32(1.0 - 0.5 * k / steps) if steps > 0 else np.float32(1.0)
                s = div_f32(amax * f, flev)
                e = 0.0
                for j in range(j0, j1):
                    q = round_half_away(div_f32(np.float32(w[r, j]), s))
                    if q > flev:
                        q = flev
                    elif q < -flev:
                        q = -flev
                    d = w[r, j] - np.float64(q * s)
                    e += imp[j] * d * d
                if e < best_e:
                    best_e = e
                    best_s = s
            scales[r, g] = best_s
    return scales


@njit(nogil=True)
def gptq_core(w, u, perm, scales, bits, group, block):
    """Quantise ``w``'s columns in the order ``perm``, pushing each column's
    rounding error onto the columns not yet quantised (GPTQ, Frantar et al.
    2022), with fixed group scales.

    Sweep position ``i`` (0..cols-1) is original column ``c = perm[i]``, group
    ``g = c // group``: ``code = clamp(round_half_away(div_f32(float32(w[r, i]),
    scales[r, g])), -levels, levels)``; ``e_r = (w[r, i] - code * scale) /
    u[i, i]``; ``w[r, j] -= e_r * u[i, j]`` for ``j > i``.  Updates to
    positions beyond the current block of ``block`` columns are applied
    lazily at the block's end as one matrix product (same result up to
    float64 summation order).

    Parameters
    ----------
    w : ndarray of shape (rows, cols), float64, C-contiguous
        ``[out, in]`` weights with their columns already in sweep order
        (``w_orig[:, perm]``); **overwritten** (the error-updated weights).
    u : ndarray of shape (cols, cols), float64, C-contiguous
        Upper Cholesky factor of the (dampened) inverse Hessian *in sweep
        order*, ``H[perm][:, perm]^-1 = uᵀ u``; ``u[i, i] > 0``.
    perm : ndarray of shape (cols,), int64
        Sweep position -> original column (a permutation).
    scales : ndarray of shape (rows, ceil(cols / group)), float32
        Group scales in layout order (:func:`gptq_group_scales`), ``> 0``.
    bits : int
        2..8 (``levels = 2**(bits-1) - 1``).
    group : int
        Group length along a row in the original layout.
    block : int
        Lazy-update block width, ``>= 1``.

    Returns
    -------
    codes : ndarray of shape (rows, cols), int8
        In the original column order.
    """
    rows, cols = w.shape
    levels = max((1 << (bits - 1)) - 1, 1)
    flev = np.float32(levels)
    codes = np.empty((rows, cols), dtype=np.int8)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        nb = b1 - b0
        err = np.empty((rows, nb), dtype=np.float64)
        for i in range(b0, b1):
            c = perm[i]
            g = c // group
            d = u[i, i]
            for r in range(rows):
                sc = scales[r, g]
                q = round_half_away(div_f32(np.float32(w[r, i]), sc))
                if q > flev:
                    q = flev
                elif q < -flev:
                    q = -flev
                codes[r, c] = np.int8(q)
                e = (w[r, i] - np.float64(q * sc)) / d
                err[r, i - b0] = e
                for j in range(i + 1, b1):
                    w[r, j] -= e * u[i, j]
        if b1 < cols:
            w[:, b1:] -= err @ np.ascontiguousarray(u[b0:b1, b1:])
    return codes



@njit(nogil=True)
def gptq_block_sweep(wt, c, perm, b0, scales_t, bits, group, codes_t, err_t):
    """One column block of the low-rank GPTQ sweep
    (:func:`opscope_nb.formats.gptq.gptq_validated` with a low-rank gram), in
    the transposed layout (columns by rows: the loops over rows are unit
    stride and vectorise).

    Sweep positions ``b0 .. b0 + nb - 1`` (``nb = wt.shape[0]``): position
    ``b0 + i`` is original column ``perm[b0 + i]``; ``code = clamp(
    round_half_away(div_f32(float32(wt[i, r]), scale)), -levels, levels)``
    (as :func:`gptq_core`), ``err_t[i, r] = wt[i, r] - code * scale`` (not
    divided: the low-rank path's update vectors carry the Hessian), and the
    later positions of the block get ``wt[j, r] += err_t[i, r] * c[i, j]``.

    Parameters
    ----------
    wt : ndarray of shape (nb, rows), float64, C-contiguous
        The block's weights (transposed) with every update of earlier blocks
        applied; **overwritten**.
    c : ndarray of shape (>= nb, >= nb), float64
        In-block update coefficients, ``c[i, j]`` for ``j > i``.
    perm : ndarray of shape (cols,), int64
        Sweep position -> original column.
    b0 : int
        Sweep position of the block's first column.
    scales_t : ndarray of shape (ceil(cols / group), rows), float32
        Group scales, transposed.
    bits : int
        2..8.
    group : int
        Group length along a row in the original layout.
    codes_t : ndarray of shape (cols, rows), int8
        Receives the block's codes (transposed, original column order).
    err_t : ndarray of shape (>= nb, rows), float64
        Receives the rounding errors.
    """
    nb, rows = wt.shape
    levels = max((1 << (bits - 1)) - 1, 1)
    flev = np.float32(levels)
    for i in range(nb):
        col = perm[b0 + i]
        g = col // group
        for r in range(rows):
            sc = scales_t[g, r]
            q = round_half_away(div_f32(np.float32(wt[i, r]), sc))
            q = min(max(q, -flev), flev)
            codes_t[col, r] = np.int8(q)
            err_t[i, r] = wt[i, r] - np.float64(q * sc)
        for j in range(i + 1, nb):
            cij = c[i, j]
            for r in range(rows):
                wt[j, r] += err_t[i, r] * cij
