"""Allocators: greedy / DADO / exact against brute force and plain-Python twins."""
import json
import math

import numpy as np
import pytest

from naive_alloc import (naive_brute_force, naive_budget, naive_dado, naive_greedy,
                         naive_lagrangian_bound)
from opscope_nb.allocate import (Allocation, DadoConfig, budget_bytes, dado_allocate,
                                 exact_allocate, greedy_allocate)
from opscope_nb.kernels import dado_core, greedy_core, mckp_lp_bound
from opscope_nb.mining import Decomp, DecompOption, LayerProfile

KINDS = [Decomp.int8(), Decomp.int4(), Decomp.int4(32), Decomp.ternary(),
         Decomp.sparse24(), Decomp.lowrank(4), Decomp.lowrank(8), Decomp.lowrank(16),
         Decomp.monarch(), Decomp.lowrank(2), Decomp.lowrank(1)]


def random_layers(rng, nl, kmax, *, ties=False):
    layers = []
    for i in range(nl):
        dense = int(rng.integers(64, 5000)) * 4
        k = int(rng.integers(1, kmax + 1))
        opts = [DecompOption(Decomp.dense(), 0.0, dense, 1)]
        for j in range(k - 1):
            if ties and rng.random() < 0.3 and len(opts) > 1:
                prev = opts[int(rng.integers(1, len(opts)))]
                e, b = prev.rel_err, prev.bytes
            else:
                e = float(np.round(rng.random(), 3 if ties else 12))
                b = int(rng.integers(1, dense + dense // 4))  # some > dense
            opts.append(DecompOption(KINDS[j], e, b, 1))
        layers.append(LayerProfile(f"l{i}", 1, 1, dense, opts))
    return layers


def tables(layers, weights=None):
    w = np.ones(len(layers)) if weights is None else np.asarray(weights, float)
    costs = [[w[i] * o.rel_err for o in lp.options] for i, lp in enumerate(layers)]
    sizes = [[o.bytes for o in lp.options] for lp in layers]
    return costs, sizes


def check_alloc(a, layers, budget, weights=None):
    costs, sizes = tables(layers, weights)
    e = sum(costs[i][c] for i, c in enumerate(a.choice))
    b = sum(sizes[i][c] for i, c in enumerate(a.choice))
    assert a.total_bytes == b
    assert a.total_err == pytest.approx(e, rel=1e-12, abs=1e-12)
    assert a.budget_bytes == budget
    assert a.dense_bytes == sum(lp.dense_bytes for lp in layers)
    assert a.feasible == (b <= budget)
    if a.feasible:
        assert a.lower_bound <= a.total_err + 1e-9
        assert a.gap == pytest.approx((a.total_err - a.lower_bound) / max(a.total_err, 1e-12))


@pytest.mark.parametrize("seed", range(40))
def test_exact_equals_brute_force_and_ordering(seed):
    rng = np.random.default_rng(seed)
    nl = int(rng.integers(1, 7))
    layers = random_layers(rng, nl, 6, ties=seed % 3 == 0)
    frac = float(rng.choice([0.05, 0.2, 0.35, 0.5, 0.8, 1.0]))
    weights = None if seed % 2 else rng.random(nl) * 3
    budget = naive_budget([lp.dense_bytes for lp in layers], frac)
    costs, sizes = tables(layers, weights)
    best, _ = naive_brute_force(costs, sizes, budget)
    g = greedy_allocate(layers, frac, weights=weights)
    d = dado_allocate(layers, frac, DadoConfig(iters=10, pop=40), weights=weights)
    x = exact_allocate(layers, frac, weights=weights)
    for a in (g, d, x):
        check_alloc(a, layers, budget, weights)
    if best is None:  # infeasible: all return the smallest configuration
        for a in (g, d, x):
            assert not a.feasible
            assert a.total_bytes == sum(min(s) for s in sizes)
            assert math.isinf(a.lower_bound)
        return
    assert x.feasible and g.feasible and d.feasible
    assert x.total_err == pytest.approx(best, abs=1e-9)
    assert x.total_err <= d.total_err + 1e-9
    assert d.total_err <= g.total_err + 1e-12
    lag = naive_lagrangian_bound(costs, sizes, budget)
    assert g.lower_bound == pytest.approx(lag, rel=1e-9, abs=1e-9)
    assert lag <= best + 1e-9
    assert x.lower_bound <= best + 1e-9
    assert x.gap <= 1e-6


@pytest.mark.parametrize("seed", range(15))
def test_greedy_matches_naive(seed):
    rng = np.random.default_rng(100 + seed)
    layers = random_layers(rng, int(rng.integers(1, 9)), 8, ties=seed % 2 == 0)
    frac = float(rng.uniform(0.02, 1.0))
    budget = naive_budget([lp.dense_bytes for lp in layers], frac)
    costs, sizes = tables(layers)
    if sum(min(s) for s in sizes) > budget:
        return
    assert greedy_allocate(layers, frac).choice == naive_greedy(costs, sizes, budget)


@pytest.mark.parametrize("seed", range(6))
def test_dado_core_matches_naive_loop(seed):
    rng = np.random.default_rng(200 + seed)
    layers = random_layers(rng, int(rng.integers(2, 7)), 6)
    costs, sizes = tables(layers)
    budget = naive_budget([lp.dense_bytes for lp in layers], 0.3)
    if sum(min(s) for s in sizes) > budget:
        budget = sum(min(s) for s in sizes) + 100
    init = naive_greedy(costs, sizes, budget)
    k = max(len(c) for c in costs)
    cost = np.zeros((len(costs), k))
    nb = np.zeros((len(costs), k), dtype=np.int64)
    for i, (c, s) in enumerate(zip(costs, sizes)):
        cost[i, :len(c)] = c
        nb[i, :len(s)] = s
    nopt = np.array([len(c) for c in costs], dtype=np.int64)
    ch, err = dado_core(cost, nb, np.zeros_like(cost), nopt, budget, np.inf,
                        np.array(init, dtype=np.int64),
                        7, 30, 6, 50.0, np.uint64(0xDAD00501 + seed))
    ref_ch, ref_err = naive_dado(costs, sizes, budget, init, 7, 30, 6, 50.0,
                                 0xDAD00501 + seed)
    assert list(ch) == ref_ch
    assert err == pytest.approx(ref_err, rel=1e-12)


def test_lp_bound_matches_naive_and_is_valid():
    rng = np.random.default_rng(7)
    for _ in range(30):
        layers = random_layers(rng, int(rng.integers(1, 6)), 6, ties=True)
        costs, sizes = tables(layers)
        budget = naive_budget([lp.dense_bytes for lp in layers], float(rng.uniform(0.05, 1)))
        k = max(len(c) for c in costs)
        cost = np.zeros((len(costs), k))
        nb = np.zeros((len(costs), k), dtype=np.int64)
        for i, (c, s) in enumerate(zip(costs, sizes)):
            cost[i, :len(c)] = c
            nb[i, :len(s)] = s
        nopt = np.array([len(c) for c in costs], dtype=np.int64)
        got = mckp_lp_bound(cost, nb, nopt, budget)
        ref = naive_lagrangian_bound(costs, sizes, budget)
        if math.isinf(ref):
            assert math.isinf(got)
            continue
        assert got == pytest.approx(ref, rel=1e-9, abs=1e-12)
        best, _ = naive_brute_force(costs, sizes, budget)
        assert got <= best + 1e-12


def test_dado_improves_on_greedy_somewhere():
    """A negative control: on some instance DADO must strictly beat greedy
    (otherwise the search would be a no-op and tests could not tell)."""
    better = 0
    for seed in range(30):
        rng = np.random.default_rng(500 + seed)
        layers = random_layers(rng, 6, 6)
        g = greedy_allocate(layers, 0.3)
        d = dado_allocate(layers, 0.3)
        if g.feasible and d.total_err < g.total_err - 1e-9:
            better += 1
    assert better > 0


def test_budget_floor_and_boundaries():
    lp = LayerProfile("a", 1, 1, 10, [DecompOption(Decomp.dense(), 0.0, 10, 1),
                                       DecompOption(Decomp.int8(), 0.1, 3, 1)])
    lp2 = LayerProfile("b", 1, 1, 11, [DecompOption(Decomp.dense(), 0.0, 11, 1),
                                        DecompOption(Decomp.int8(), 0.2, 3, 1)])
    # 0.65 * 21 = 13.65 -> floor 13: a dense (10) + b int8 (3) fits exactly
    for f in (greedy_allocate, dado_allocate, exact_allocate):
        a = f([lp, lp2], 0.65)
        assert a.budget_bytes == 13 == budget_bytes([lp, lp2], 0.65)
        assert a.feasible and a.total_bytes <= 13
    x = exact_allocate([lp, lp2], 0.65)
    assert x.choice == [0, 1] and x.total_err == pytest.approx(0.2)
    # full budget keeps everything dense
    for f in (greedy_allocate, dado_allocate, exact_allocate):
        a = f([lp, lp2], 1.0)
        assert a.choice == [0, 0] and a.total_err == 0 and a.compression() == 1.0


def test_infeasible_budget_returns_smallest_marked_infeasible():
    lp = LayerProfile("a", 1, 1, 100, [DecompOption(Decomp.dense(), 0.0, 100, 1),
                                        DecompOption(Decomp.int8(), 0.3, 40, 1),
                                        DecompOption(Decomp.int4(), 0.5, 40, 1),
                                        DecompOption(Decomp.ternary(), 0.2, 40, 1)])
    for f in (greedy_allocate, dado_allocate, exact_allocate):
        a = f([lp, lp], 0.1)
        assert not a.feasible
        assert a.total_bytes == 80
        assert a.choice == [3, 3]  # smallest bytes, then least error
        assert math.isinf(a.lower_bound) and math.isnan(a.gap)
        d = a.to_dict(layers=[lp, lp])
        json.dumps(d, allow_nan=False)
        assert d["lower_bound"] is None and d["feasible"] is False


def test_weights_change_the_plan():
    a = LayerProfile("a", 1, 1, 100, [DecompOption(Decomp.dense(), 0.0, 100, 1),
                                       DecompOption(Decomp.int8(), 0.1, 25, 1)])
    b = LayerProfile("b", 1, 1, 100, [DecompOption(Decomp.dense(), 0.0, 100, 1),
                                       DecompOption(Decomp.int8(), 0.2, 25, 1)])
    for f in (greedy_allocate, dado_allocate, exact_allocate):
        assert f([a, b], 0.7).choice == [1, 0]
        r = f([a, b], 0.7, weights=[10.0, 1.0])
        assert r.choice == [0, 1] and r.total_err == pytest.approx(0.2)


def test_to_dict_json():
    rng = np.random.default_rng(3)
    layers = random_layers(rng, 4, 5)
    a = exact_allocate(layers, 0.5)
    d = json.loads(json.dumps(a.to_dict(layers=layers), allow_nan=False))
    assert d["method"] == "exact" and d["choice"] == a.choice
    assert [r["label"] for r in d["layers"]] == [
        layers[i].options[c].decomp.label for i, c in enumerate(a.choice)]
    assert d["compression"] == pytest.approx(a.compression())
    assert isinstance(a, Allocation)


@pytest.mark.parametrize("f", [greedy_allocate, dado_allocate, exact_allocate])
def test_bad_input(f):
    rng = np.random.default_rng(0)
    layers = random_layers(rng, 3, 4)
    for frac in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="budget_frac"):
            f(layers, frac)
    with pytest.raises(TypeError):
        f(layers, "0.5")
    with pytest.raises(ValueError, match="empty"):
        f([], 0.5)
    with pytest.raises(ValueError, match="one entry per layer"):
        f(layers, 0.5, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=">= 0"):
        f(layers, 0.5, weights=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        f(layers, 0.5, weights=[1.0, np.nan, 1.0])
    with pytest.raises(ValueError, match="no options"):
        f([LayerProfile("x", 1, 1, 4, [])], 0.5)


def test_bad_dado_config():
    layers = random_layers(np.random.default_rng(0), 2, 3)
    with pytest.raises(ValueError):
        dado_allocate(layers, 0.5, DadoConfig(pop=0))
    with pytest.raises(ValueError):
        dado_allocate(layers, 0.5, DadoConfig(elite_frac=0.0))
    with pytest.raises(ValueError):
        dado_allocate(layers, 0.5, DadoConfig(penalty=-1.0))
    with pytest.raises(TypeError):
        dado_allocate(layers, 0.5, cfg={"pop": 3})


def test_kernels_callable_from_user_njit():
    import numba

    @numba.njit
    def solve(cost, nb, nopt, budget):
        g = greedy_core(cost, nb, nopt, budget)
        return g, mckp_lp_bound(cost, nb, nopt, budget)

    cost = np.array([[0.0, 0.1, 0.3], [0.0, 0.2, 0.4]])
    nb = np.array([[100, 50, 10], [100, 50, 10]], dtype=np.int64)
    g, lb = solve(cost, nb, np.array([3, 3], dtype=np.int64), 100)
    assert list(g) == [1, 1]
    assert lb <= 0.3 + 1e-12


from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def instances(draw):
    nl = draw(st.integers(1, 5))
    layers = []
    for i in range(nl):
        dense = draw(st.integers(1, 400))
        k = draw(st.integers(1, 5))
        opts = [DecompOption(Decomp.dense(), 0.0, dense, 1)]
        for j in range(k - 1):
            e = draw(st.floats(0.0, 2.0, allow_nan=False))
            b = draw(st.integers(0, dense + 10))
            opts.append(DecompOption(KINDS[j], e, b, 1))
        layers.append(LayerProfile(f"l{i}", 1, 1, dense, opts))
    frac = draw(st.floats(0.01, 1.0))
    weights = draw(st.one_of(st.none(), st.lists(st.floats(0.0, 5.0), min_size=nl,
                                                  max_size=nl)))
    return layers, frac, weights


@settings(max_examples=25, deadline=None)
@given(instances())
def test_hypothesis_exact_is_optimal_and_plans_fit(inst):
    layers, frac, weights = inst
    budget = naive_budget([lp.dense_bytes for lp in layers], frac)
    costs, sizes = tables(layers, weights)
    best, _ = naive_brute_force(costs, sizes, budget)
    res = [f(layers, frac, weights=weights) for f in (greedy_allocate, exact_allocate)]
    res.append(dado_allocate(layers, frac, DadoConfig(iters=5, pop=20), weights=weights))
    for a in res:
        check_alloc(a, layers, budget, weights)
        assert a.feasible == (best is not None)
    if best is not None:
        g, x, d = res
        assert x.total_err == pytest.approx(best, abs=1e-9)
        assert x.total_err <= d.total_err + 1e-9 and d.total_err <= g.total_err + 1e-12
        assert x.lower_bound <= best + 1e-9 and g.lower_bound <= best + 1e-9
