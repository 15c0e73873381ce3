"""``@njit`` allocator cores of the mining and allocation layer (no input validation).

* **Allocator cores** on padded option tables.  A problem with ``L`` layers is
  held as ``cost[L, K]`` (float64, the *weighted* error ``w_i * rel_err_ij``),
  ``nbytes[L, K]`` (int64) and ``nopt[L]`` (int64, how many of the ``K``
  columns of row ``i`` are real options; the rest is padding and never read).
  Option 0 of every layer is the dense baseline.  With a latency budget a
  third table ``lat[L, K]`` (float64, microseconds at the planned ``m``) is a
  second resource; ``lat_budget = inf`` switches it off.
* :func:`lower_hull_core` - the one lower-convex-hull routine of the project
  (the LP bound below and the CLI's rate-distortion plot both call it).

The packing / quantisation cores of the menu options live in
:mod:`opscope_nb.kernels._pack`.

Every function assumes valid, C-contiguous input of the documented dtype; the
validating wrappers are :mod:`opscope_nb.plan.allocate` and :mod:`opscope_nb.profile.mining`.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit
from ._sort import argsort_stable

__all__ = [
    "xorshift64_step",
    "lower_hull_core",
    "greedy_core",
    "greedy2_core",
    "dado_core",
    "mckp_lp_bound",
]


# ───────────────────────────── allocator cores ─────────────────────────────


@njit
def xorshift64_step(s):
    """One xorshift64 step (Marsaglia 13/7/17) on a ``uint64`` state.

    Parameters
    ----------
    s : uint64
        Current state (must be non-zero).

    Returns
    -------
    s : uint64
        Next state.  ``float(s >> 11) / 2**53`` is the uniform draw in [0, 1).
    """
    s ^= s << np.uint64(13)
    s ^= s >> np.uint64(7)
    s ^= s << np.uint64(17)
    return s


@njit
def lower_hull_core(x, y):
    """Lower-left convex hull of the points ``(x[j], y[j])``: the vertices of
    the convex Pareto frontier (fewer ``x`` and lower ``y`` are better).

    Points are taken in ``(x, y, index)`` order; a point with ``y`` not below
    the last kept vertex is dominated and skipped, and a kept middle vertex on
    or above the chord of its neighbours is dropped (collinear points are not
    vertices).  Used by :func:`mckp_lp_bound` on each layer's (bytes, cost)
    options and by the CLI's plot.

    Parameters
    ----------
    x, y : ndarray of shape (k,), float64, ``k >= 1``
        Coordinates (bytes and error), finite.

    Returns
    -------
    idx : ndarray of shape (h,), int64
        Indices of the hull vertices, ``x`` increasing and ``y`` strictly
        decreasing; ``idx[0]`` is the fewest-``x`` point (lowest ``y`` among
        ties), ``idx[-1]`` a lowest-``y`` point.
    """
    k = x.shape[0]
    key = np.empty(k)
    for j in range(k):
        key[j] = y[j]
    o1 = argsort_stable(key)
    for t in range(k):
        key[t] = x[o1[t]]
    o2 = argsort_stable(key)
    hx = np.empty(k)
    hy = np.empty(k)
    hi = np.empty(k, dtype=np.int64)
    h = 0
    for t in range(k):
        j = o1[o2[t]]
        b = x[j]
        c = y[j]
        if h > 0 and c >= hy[h - 1]:
            continue  # dominated: no fewer x, no lower y
        while h >= 2:
            x1 = hx[h - 2]
            y1 = hy[h - 2]
            x2 = hx[h - 1]
            y2 = hy[h - 1]
            # drop the middle point if it lies on/above the chord
            if (y2 - y1) * (b - x1) >= (c - y1) * (x2 - x1):
                h -= 1
            else:
                break
        hx[h] = b
        hy[h] = c
        hi[h] = j
        h += 1
    return hi[:h].copy()


@njit
def greedy2_core(cost, nbytes, lat, nopt, budget, lat_budget):
    """Greedy descent from all-dense under a byte **and** a latency budget.

    The violation of a plan is ``V = max(bytes - budget, 0) / max(budget, 1)
    + max(latency - lat_budget, 0) / lat_budget``.  While ``V > 0``, apply the
    single swap (layer ``i`` to any other option) that lowers ``V`` with the
    least ``max(cost_new - cost_cur, 0) / (V - V_new)``; ties keep the first
    pair found (layers in order, options in order).  Stops when ``V == 0`` or
    no swap lowers ``V`` (then the plan is infeasible).

    Parameters
    ----------
    cost, nbytes, nopt
        Padded option tables, see the module docstring.
    lat : ndarray of shape (L, K), float64
        Latency of each option.
    budget : int
        Byte budget.
    lat_budget : float
        Latency budget (``> 0``, finite).

    Returns
    -------
    choice : ndarray of shape (L,), int64
        Option index per layer.
    """
    nl = cost.shape[0]
    choice = np.zeros(nl, dtype=np.int64)
    tb = np.int64(0)
    tl = 0.0
    for i in range(nl):
        tb += nbytes[i, 0]
        tl += lat[i, 0]
    fb = float(max(budget, 1))
    while True:
        vb = float(tb - budget) / fb if tb > budget else 0.0
        vl = (tl - lat_budget) / lat_budget if tl > lat_budget else 0.0
        v = vb + vl
        if v <= 0.0:
            break
        best = np.inf
        bi = -1
        bj = -1
        for i in range(nl):
            c = choice[i]
            for j in range(nopt[i]):
                if j == c:
                    continue
                nb = tb + nbytes[i, j] - nbytes[i, c]
                nlat = tl + lat[i, j] - lat[i, c]
                wb = float(nb - budget) / fb if nb > budget else 0.0
                wl = (nlat - lat_budget) / lat_budget if nlat > lat_budget else 0.0
                dv = v - (wb + wl)
                if dv <= 0.0:
                    continue
                d = cost[i, j] - cost[i, c]
                if d < 0.0:
                    d = 0.0
                score = d / dv
                if bi < 0 or score < best:
                    best = score
                    bi = i
                    bj = j
        if bi < 0:
            break
        tb += nbytes[bi, bj] - nbytes[bi, choice[bi]]
        tl += lat[bi, bj] - lat[bi, choice[bi]]
        choice[bi] = bj
    return choice


@njit
def greedy_core(cost, nbytes, nopt, budget):
    """Greedy Lagrangian descent from all-dense (the upstream rule).

    While the total bytes exceed ``budget``, apply the single swap (layer ``i``
    from its current option to any option with strictly fewer bytes) whose
    ``max(cost_new - cost_cur, 0) / bytes_saved`` is smallest; ties keep the
    first pair found (layers in order, options in order).  Stops when the
    budget is met or no swap saves bytes.

    Parameters
    ----------
    cost : ndarray of shape (L, K), float64, C-contiguous
        Weighted error of option ``j`` of layer ``i``.
    nbytes : ndarray of shape (L, K), int64, C-contiguous
        Bytes of option ``j`` of layer ``i``.
    nopt : ndarray of shape (L,), int64
        Number of real options per layer (``1 <= nopt[i] <= K``).
    budget : int
        Byte budget.

    Returns
    -------
    choice : ndarray of shape (L,), int64
        Option index per layer.
    """
    nl = cost.shape[0]
    choice = np.zeros(nl, dtype=np.int64)
    total = np.int64(0)
    for i in range(nl):
        total += nbytes[i, 0]
    while total > budget:
        best = np.inf
        bi = -1
        bj = -1
        for i in range(nl):
            c = choice[i]
            cb = nbytes[i, c]
            cc = cost[i, c]
            for j in range(nopt[i]):
                if nbytes[i, j] >= cb:
                    continue
                d = cost[i, j] - cc
                if d < 0.0:
                    d = 0.0
                score = d / float(cb - nbytes[i, j])
                if bi < 0 or score < best:
                    best = score
                    bi = i
                    bj = j
        if bi < 0:
            break
        total += nbytes[bi, bj] - nbytes[bi, choice[bi]]
        choice[bi] = bj
    return choice


@njit
def dado_core(cost, nbytes, lat, nopt, budget, lat_budget, init_choice, iters, pop,
              n_elite, penalty, seed):
    """DADO cross-entropy search over per-layer categorical marginals.

    The upstream algorithm: marginals start at ``0.4/K_i`` on every option
    plus ``0.6`` on ``init_choice[i]`` (the greedy plan); each iteration draws
    ``pop`` configurations (layers in order, one xorshift64 draw per layer,
    ``u = (s >> 11) / 2**53``, the first option whose cumulative probability
    is ``>= u``), keeps the best *strictly feasible* configuration seen
    (``bytes <= budget``, ``latency <= lat_budget`` and ``err < best``),
    stable-sorts the population by ``loss = err + penalty * (max((bytes -
    budget) / budget, 0) + max((latency - lat_budget) / lat_budget, 0))`` (the
    latency term only when ``lat_budget`` is finite), and refits every
    marginal to ``(1 + elite count) / (K_i + n_elite)``.

    Parameters
    ----------
    cost, nbytes, nopt
        Padded option tables, see the module docstring.
    lat : ndarray of shape (L, K), float64
        Latency of each option (any values when ``lat_budget`` is ``inf``).
    budget : int
        Byte budget (feasible means ``bytes <= budget``; the loss divides by
        ``max(budget, 1)``).
    lat_budget : float
        Latency budget (``inf``: no latency constraint; must be ``> 0``).
    init_choice : ndarray of shape (L,), int64
        Warm start; the initial incumbent when it is feasible (otherwise the
        incumbent starts empty at ``err = inf``).
    iters, pop, n_elite : int
        Iterations, population size, elite size (``1 <= n_elite <= pop``).
    penalty : float
        Weight of the relative budget overshoot in the loss.
    seed : uint64
        RNG seed; the state starts at ``seed | 1``.

    Returns
    -------
    choice : ndarray of shape (L,), int64
        Best feasible configuration found (``init_choice`` if none beat it).
    err : float
        Its total weighted error (``inf`` when no feasible plan was seen).
    """
    nl = cost.shape[0]
    kmax = cost.shape[1]
    use_lat = lat_budget < np.inf
    p = np.zeros((nl, kmax))
    for i in range(nl):
        k = nopt[i]
        for j in range(k):
            p[i, j] = 0.4 / k
        p[i, init_choice[i]] += 0.6
    best_choice = init_choice.copy()
    best_err = 0.0
    ib = np.int64(0)
    il = 0.0
    for i in range(nl):
        best_err += cost[i, init_choice[i]]
        ib += nbytes[i, init_choice[i]]
        il += lat[i, init_choice[i]]
    if ib > budget or (use_lat and il > lat_budget):
        best_err = np.inf
    fbudget = float(max(budget, 1))  # loss denominator only

    s = seed | np.uint64(1)
    inv53 = 1.0 / 9007199254740992.0
    cum = np.empty((nl, kmax))
    samples = np.empty((pop, nl), dtype=np.int64)
    loss = np.empty(pop)
    counts = np.empty(kmax)
    for _ in range(iters):
        for i in range(nl):
            acc = 0.0
            for j in range(nopt[i]):
                acc += p[i, j]
                cum[i, j] = acc
        for q in range(pop):
            err = 0.0
            tb = np.int64(0)
            tl = 0.0
            for i in range(nl):
                s = xorshift64_step(s)
                # (s >> 11) < 2**53 fits int64: a single signed conversion
                u = float(np.int64(s >> np.uint64(11))) * inv53
                k = nopt[i]
                # first j with cum >= u == number of cum entries below u
                # (cum is non-decreasing); branch-free, so no mispredictions
                c = 0
                for j in range(k):
                    c += cum[i, j] < u
                if c > k - 1:
                    c = k - 1
                samples[q, i] = c
                err += cost[i, c]
                tb += nbytes[i, c]
                if use_lat:
                    tl += lat[i, c]
            if tb <= budget and (not use_lat or tl <= lat_budget) and err < best_err:
                best_err = err
                for i in range(nl):
                    best_choice[i] = samples[q, i]
            over = (float(tb) - fbudget) / fbudget
            if over < 0.0:
                over = 0.0
            if use_lat:
                ol = (tl - lat_budget) / lat_budget
                if ol > 0.0:
                    over += ol
            loss[q] = err + penalty * over
        order = argsort_stable(loss)
        for i in range(nl):
            k = nopt[i]
            for j in range(k):
                counts[j] = 1.0
            for e in range(n_elite):
                counts[samples[order[e], i]] += 1.0
            den = float(k + n_elite)
            for j in range(k):
                p[i, j] = counts[j] / den
    return best_choice, best_err


@njit
def mckp_lp_bound(cost, nbytes, nopt, budget):
    """LP relaxation = Lagrangian dual of the multiple-choice knapsack.

    ``max_{lambda >= 0} sum_i min_j (cost_ij + lambda * nbytes_ij) -
    lambda * budget``, evaluated exactly through the lower convex hull of each
    layer's (bytes, cost) points: start every layer at its cheapest-in-bytes
    hull vertex, then buy hull segments in order of decreasing efficiency
    (cost saved per byte) until the budget is spent, the last one
    fractionally.  The result is a valid lower bound on the integer optimum.

    Parameters
    ----------
    cost, nbytes, nopt
        Padded option tables, see the module docstring.
    budget : int
        Byte budget.

    Returns
    -------
    bound : float
        The bound; ``+inf`` when even the smallest configuration exceeds the
        budget (the problem is infeasible).
    """
    nl = cost.shape[0]
    kmax = cost.shape[1]
    seg_eff = np.empty(nl * kmax)
    seg_db = np.empty(nl * kmax)
    seg_dc = np.empty(nl * kmax)
    nseg = 0
    base_c = 0.0
    base_b = 0.0
    xb = np.empty(kmax)
    for i in range(nl):
        k = nopt[i]
        for j in range(k):
            xb[j] = float(nbytes[i, j])
        hv = lower_hull_core(xb[:k], cost[i, :k])
        h = hv.shape[0]
        hb = np.empty(h)
        hc = np.empty(h)
        for t in range(h):
            hb[t] = xb[hv[t]]
            hc[t] = cost[i, hv[t]]
        base_b += hb[0]
        base_c += hc[0]
        for t in range(1, h):
            db = hb[t] - hb[t - 1]
            dc = hc[t - 1] - hc[t]
            seg_db[nseg] = db
            seg_dc[nseg] = dc
            seg_eff[nseg] = dc / db
            nseg += 1
    fb = float(budget)
    if base_b > fb:
        return np.inf
    rem = fb - base_b
    val = base_c
    order = argsort_stable(-seg_eff[:nseg])
    for t in range(nseg):
        g = order[t]
        if seg_db[g] <= rem:
            rem -= seg_db[g]
            val -= seg_dc[g]
        else:
            val -= seg_eff[g] * rem
            break
    return val
