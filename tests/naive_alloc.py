"""NumPy / plain-Python twins for mining and allocation (never imports opscope_nb).

Allocation instances are given as ``costs[i][j]`` (weighted error of option j
of layer i) and ``sizes[i][j]`` (bytes), with a byte budget ``B``.
"""
import itertools
import math

import numpy as np

__all__ = [
    "naive_budget",
    "naive_brute_force",
    "naive_greedy",
    "naive_dado",
    "naive_lagrangian_bound",
    "naive_round_half_away",
    "naive_group_quant",
    "naive_ternary",
    "naive_nm_prune",
    "naive_rel_err",
    "naive_lowrank",
]


def naive_budget(dense_bytes, frac):
    """floor(frac * sum dense bytes)."""
    return int(math.floor(frac * sum(dense_bytes)))


def naive_brute_force(costs, sizes, budget):
    """Enumerate every plan; return (best cost, choice) or (None, None)."""
    best, arg = None, None
    for ch in itertools.product(*[range(len(c)) for c in costs]):
        b = sum(sizes[i][j] for i, j in enumerate(ch))
        if b > budget:
            continue
        e = sum(costs[i][j] for i, j in enumerate(ch))
        if best is None or e < best - 1e-15:
            best, arg = e, list(ch)
    return best, arg


def naive_greedy(costs, sizes, budget):
    """Start all at option 0; take the swap with least max(dc,0)/db saved."""
    ch = [0] * len(costs)
    while sum(sizes[i][c] for i, c in enumerate(ch)) > budget:
        best = None
        for i in range(len(costs)):
            cb, cc = sizes[i][ch[i]], costs[i][ch[i]]
            for j in range(len(costs[i])):
                if sizes[i][j] >= cb:
                    continue
                score = max(costs[i][j] - cc, 0.0) / (cb - sizes[i][j])
                if best is None or score < best[0]:
                    best = (score, i, j)
        if best is None:
            break
        ch[best[1]] = best[2]
    return ch


def naive_dado(costs, sizes, budget, init, iters, pop, n_elite, penalty, seed):
    """The DADO loop written plainly in Python (same RNG stream)."""
    mask = (1 << 64) - 1
    nl = len(costs)
    p = []
    for i in range(nl):
        k = len(costs[i])
        d = [0.4 / k] * k
        d[init[i]] += 0.6
        p.append(d)
    best_ch = list(init)
    best = sum(costs[i][c] for i, c in enumerate(init))
    s = (seed | 1) & mask

    def rnd():
        nonlocal s
        s ^= (s << 13) & mask
        s ^= s >> 7
        s ^= (s << 17) & mask
        return (s >> 11) / float(1 << 53)

    for _ in range(iters):
        popl = []
        for _q in range(pop):
            ch = []
            for i in range(nl):
                u = rnd()
                acc, c = 0.0, len(p[i]) - 1
                for j, pj in enumerate(p[i]):
                    acc += pj
                    if u <= acc:
                        c = j
                        break
                ch.append(c)
            e = sum(costs[i][c] for i, c in enumerate(ch))
            b = sum(sizes[i][c] for i, c in enumerate(ch))
            if b <= budget and e < best:
                best, best_ch = e, list(ch)
            loss = e + penalty * max((b - budget) / budget, 0.0)
            popl.append((loss, ch))
        popl.sort(key=lambda t: t[0])  # stable
        elite = popl[:n_elite]
        for i in range(nl):
            k = len(p[i])
            cnt = [1.0] * k
            for _, ch in elite:
                cnt[ch[i]] += 1.0
            p[i] = [c / (k + n_elite) for c in cnt]
    return best_ch, best


def naive_lagrangian_bound(costs, sizes, budget):
    """max over lambda >= 0 of sum_i min_j (c_ij + lambda b_ij) - lambda B,
    evaluated at every candidate breakpoint (pairwise slopes within a layer)."""
    if sum(min(s) for s in sizes) > budget:
        return math.inf
    lams = {0.0}
    for c, s in zip(costs, sizes):
        for a in range(len(c)):
            for b in range(len(c)):
                if s[a] < s[b] and c[a] > c[b]:
                    lams.add((c[a] - c[b]) / (s[b] - s[a]))

    def g(lam):
        return sum(min(ci + lam * bi for ci, bi in zip(c, s))
                   for c, s in zip(costs, sizes)) - lam * budget

    return max(g(lam) for lam in lams)


def naive_round_half_away(v):
    """Round half away from zero, exact for float32 ``v``: ``trunc(v +
    copysign(0.5, v))`` in float64 (``floor(|v| + 0.5)`` in float32 maps
    0.49999997 to 1)."""
    v = np.asarray(v, dtype=np.float32)
    return np.trunc(v.astype(np.float64) + np.copysign(0.5, v)).astype(np.float32)


def naive_group_quant(w, bits, group):
    """Symmetric quantise/dequantise with one scale per `group` values of a row."""
    w = np.asarray(w, dtype=np.float32)
    levels = max(2 ** (bits - 1) - 1, 1)
    out = np.empty_like(w)
    rows, cols = w.shape
    for i in range(rows):
        for lo in range(0, cols, group):
            seg = w[i, lo:lo + group]
            amax = np.float32(np.abs(seg).max())
            scale = np.float32(amax / np.float32(levels)) if amax >= 1e-20 else np.float32(1.0)
            q = np.clip(naive_round_half_away(seg / scale), -levels, levels)
            out[i, lo:lo + group] = q.astype(np.float32) * scale
    return out


def naive_ternary(w):
    """TWN reconstruction (delta = 0.7 mean|w|, alpha = mean |w| above delta)."""
    w = np.asarray(w, dtype=np.float32)
    a = np.abs(w.astype(np.float64))
    delta = np.float32(0.7 * a.mean())
    big = np.abs(w) > delta
    alpha = np.float32(a[big].mean()) if big.any() else np.float32(0.0)
    t = np.zeros_like(w)
    t[w > delta] = alpha
    t[w < -delta] = -alpha
    return t


def naive_nm_prune(w, n=2, m=4):
    """Keep the n largest |v| of every m consecutive values of a row (ties: lower
    index; a short last group keeps min(n, len))."""
    w = np.asarray(w, dtype=np.float32)
    out = np.zeros_like(w)
    rows, cols = w.shape
    for i in range(rows):
        for lo in range(0, cols, m):
            seg = w[i, lo:lo + m]
            order = sorted(range(len(seg)), key=lambda q: (-abs(float(seg[q])), q))
            for q in order[:n]:
                out[i, lo + q] = seg[q]
    return out


def naive_rel_err(ref, approx):
    ref = np.asarray(ref, dtype=np.float64)
    approx = np.asarray(approx, dtype=np.float64)
    den = (ref ** 2).sum()
    if den < 1e-20:
        return 0.0
    return float(np.sqrt(((ref - approx) ** 2).sum() / den))


def naive_lowrank(w, r):
    """Best rank-r approximation from LAPACK's SVD."""
    u, s, vt = np.linalg.svd(np.asarray(w, dtype=np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


# ---- appended by helper A: exact budget rule, two-budget brute force, lower hull ----

def naive_budget_exact(dense_bytes, frac):
    """floor(frac * sum dense bytes) on the shortest decimal of ``frac`` (exact)."""
    from fractions import Fraction
    return int(math.floor(Fraction(repr(float(frac))) * sum(dense_bytes)))


def naive_budget_bpw(n_weights, bpw):
    """floor(bpw / 8 * total weights) on the shortest decimal of ``bpw`` (exact)."""
    from fractions import Fraction
    return int(math.floor(Fraction(repr(float(bpw))) * sum(n_weights) / 8))


def naive_brute_force2(costs, sizes, lats, budget, lat_budget):
    """Enumerate every plan under a byte and a latency budget (latency <= budget
    with relative slack 1e-9); return (best cost, choice) or (None, None)."""
    best, arg = None, None
    for ch in itertools.product(*[range(len(c)) for c in costs]):
        b = sum(sizes[i][j] for i, j in enumerate(ch))
        t = sum(lats[i][j] for i, j in enumerate(ch))
        if b > budget or t > lat_budget * (1 + 1e-9):
            continue
        e = sum(costs[i][j] for i, j in enumerate(ch))
        if best is None or e < best - 1e-15:
            best, arg = e, list(ch)
    return best, arg


def naive_lower_hull(points):
    """Vertices of the lower-left convex hull, by definition: a point is a vertex
    when no other point is at most as large in both coordinates (earlier index wins
    exact duplicates) and no chord between two other points passes on or below it.
    Returned sorted by x."""
    pts = [(float(x), float(y)) for x, y in points]
    out = []
    for k, (x, y) in enumerate(pts):
        bad = False
        for q, (a, b) in enumerate(pts):
            if q != k and a <= x and b <= y and ((a, b) != (x, y) or q < k):
                bad = True
                break
        if not bad:
            for p1, (x1, y1) in enumerate(pts):
                for p2, (x2, y2) in enumerate(pts):
                    if p1 in (k,) or p2 in (k,) or not (x1 < x < x2):
                        continue
                    if y1 + (y2 - y1) * (x - x1) / (x2 - x1) <= y:
                        bad = True
                        break
                if bad:
                    break
        if not bad:
            out.append((x, y))
    return sorted(out)
