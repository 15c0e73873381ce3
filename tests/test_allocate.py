"""Allocators: greedy / DADO / exact against brute force and plain-Python twins."""
import json
import math
import os

import numpy as np
import pytest

from naive_alloc import (naive_brute_force, naive_brute_force2, naive_budget_bpw,
                         naive_budget_exact, naive_dado, naive_greedy,
                         naive_lagrangian_bound)
from opscope_nb.plan.allocate import (
    Allocation,
    DadoConfig,
    budget_bytes,
    dado_allocate,
    exact_allocate,
    greedy_allocate,
    silence_native_output,
)
from opscope_nb.kernels import dado_core, greedy2_core, greedy_core, lower_hull_core, mckp_lp_bound
from opscope_nb.formats import Decomp
from opscope_nb.profile.mining import DecompOption, LayerProfile

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


def check_alloc(a, layers, budget, weights=None, *, latency=False):
    costs, sizes = tables(layers, weights)
    e = sum(costs[i][c] for i, c in enumerate(a.choice))
    b = sum(sizes[i][c] for i, c in enumerate(a.choice))
    assert a.total_bytes == b
    assert a.total_err == pytest.approx(e, rel=1e-12, abs=1e-12)
    assert a.budget_bytes == budget
    assert a.dense_bytes == sum(lp.dense_bytes for lp in layers)
    if latency:
        assert not a.feasible or b <= budget
    else:
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
    budget = naive_budget_exact([lp.dense_bytes for lp in layers], frac)
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
    budget = naive_budget_exact([lp.dense_bytes for lp in layers], frac)
    costs, sizes = tables(layers)
    if sum(min(s) for s in sizes) > budget:
        return
    assert greedy_allocate(layers, frac).choice == naive_greedy(costs, sizes, budget)


@pytest.mark.parametrize("seed", range(6))
def test_dado_core_matches_naive_loop(seed):
    rng = np.random.default_rng(200 + seed)
    layers = random_layers(rng, int(rng.integers(2, 7)), 6)
    costs, sizes = tables(layers)
    budget = naive_budget_exact([lp.dense_bytes for lp in layers], 0.3)
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
        budget = naive_budget_exact([lp.dense_bytes for lp in layers], float(rng.uniform(0.05, 1)))
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

    @numba.njit
    def solve2(cost, nb, lat, nopt, budget, tbudget):
        return (greedy2_core(cost, nb, lat, nopt, budget, tbudget),
                lower_hull_core(nb[0].astype(np.float64), cost[0]))

    lat = np.array([[10.0, 4.0, 6.0], [10.0, 4.0, 6.0]])
    g2, h = solve2(cost, nb, lat, np.array([3, 3], dtype=np.int64), 200, 10.0)
    assert list(g2) == [1, 1]              # 100 bytes, 8 us: both budgets met
    assert list(h) == [2, 1, 0]


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
    budget = naive_budget_exact([lp.dense_bytes for lp in layers], frac)
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


# ─────────── bits per weight, latency budget, exact solver status ───────────

def lat_layers(rng, nl, kmax, m=1):
    """Random layers whose options carry a latency at ``m`` (some slower than dense)."""
    layers = []
    for i in range(nl):
        rows, cols = int(rng.integers(2, 40)), int(rng.integers(2, 40))
        dense = 4 * rows * cols
        k = int(rng.integers(1, kmax + 1))
        opts = [DecompOption(Decomp.dense(), 0.0, dense, 1,
                             latency_us={m: float(rng.uniform(5, 10))})]
        for j in range(k - 1):
            opts.append(DecompOption(KINDS[j], float(rng.random()),
                                     int(rng.integers(1, dense + dense // 4)), 1,
                                     latency_us={m: float(rng.uniform(1, 12))}))
        layers.append(LayerProfile(f"l{i}", rows, cols, dense, opts))
    return layers


def lat_tables(layers, m=1):
    return [[o.latency_us[m] for o in lp.options] for lp in layers]


def test_two_budgets_against_brute_force():
    feasible = infeasible = 0
    for seed in range(40):
        rng = np.random.default_rng(900 + seed)
        layers = lat_layers(rng, int(rng.integers(1, 6)), 5)
        frac = float(rng.choice([0.1, 0.25, 0.4, 0.7, 1.0]))
        lfrac = float(rng.choice([0.3, 0.5, 0.7, 0.9, 1.0]))
        costs, sizes = tables(layers)
        lats = lat_tables(layers)
        budget = naive_budget_exact([lp.dense_bytes for lp in layers], frac)
        cap = lfrac * sum(t[0] for t in lats)
        best, _ = naive_brute_force2(costs, sizes, lats, budget, cap)
        kw = dict(latency_frac=lfrac, latency_m=1)
        g = greedy_allocate(layers, frac, **kw)
        d = dado_allocate(layers, frac, DadoConfig(iters=10, pop=40), **kw)
        x = exact_allocate(layers, frac, **kw)
        for a in (g, d, x):
            check_alloc(a, layers, budget, latency=True)
            t = sum(lats[i][c] for i, c in enumerate(a.choice))
            assert a.total_latency_us == pytest.approx(t, rel=1e-12)
            assert a.latency_budget_us == pytest.approx(cap, rel=1e-12)
            assert a.feasible == (a.total_bytes <= budget and t <= cap * (1 + 1e-9))
            if best is None:
                assert not a.feasible
            elif a.feasible:
                assert a.total_err >= best - 1e-9
                assert a.lower_bound <= best + 1e-9
                assert a.gap >= -1e-9
            else:
                assert math.isnan(a.gap)
        if best is None:
            infeasible += 1
            assert x.extra["status"] == "infeasible" and math.isinf(x.lower_bound)
            continue
        feasible += 1
        assert x.feasible and x.total_err == pytest.approx(best, abs=1e-9)
        assert x.extra["status"] == "optimal" and x.bound == "optimum"
        if g.feasible:
            assert d.feasible and d.total_err <= g.total_err + 1e-12
        # the LP bound with both rows is valid
        lp_only = greedy_allocate(layers, frac, **kw).lower_bound
        assert lp_only <= best + 1e-9
    assert feasible >= 10 and infeasible >= 3


def test_two_budget_lp_bound_is_tighter_than_bytes_alone():
    """A binding latency row raises the bound (the second row is really in the LP)."""
    lay = [LayerProfile("a", 4, 4, 64, [
        DecompOption(Decomp.dense(), 0.0, 64, 1, latency_us={1: 10.0}),
        DecompOption(Decomp.int8(), 0.1, 20, 1, latency_us={1: 10.0}),
        DecompOption(Decomp.lowrank(1), 0.5, 30, 1, latency_us={1: 2.0})])] * 2
    plain = greedy_allocate(lay, 1.0)
    both = greedy_allocate(lay, 1.0, latency_frac=0.6)
    x = exact_allocate(lay, 1.0, latency_frac=0.6)
    assert plain.lower_bound == pytest.approx(0.0)
    # 12 us allowed of 20: one layer must take lowrank(1); LP: fraction 0.5 of each
    assert both.lower_bound == pytest.approx(0.5, abs=1e-7)
    assert x.total_err == pytest.approx(0.5) and x.total_latency_us == pytest.approx(12.0)


def test_latency_budget_input_errors_and_untimed_options():
    rng = np.random.default_rng(3)
    layers = random_layers(rng, 3, 4)                   # no latencies at all
    with pytest.raises(ValueError, match="no latency at m=1"):
        greedy_allocate(layers, 0.5, latency_frac=0.5)
    lay = lat_layers(np.random.default_rng(4), 3, 4, m=32)
    with pytest.raises(ValueError, match="no latency at m=1"):
        exact_allocate(lay, 0.5, latency_frac=0.5)       # measured at 32, asked at 1
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="latency_frac"):
            dado_allocate(lay, 0.5, latency_frac=bad, latency_m=32)
    with pytest.raises(ValueError, match="latency_m"):
        greedy_allocate(lay, 0.5, latency_frac=0.5, latency_m=0)
    # an option nobody timed is never chosen under a latency budget
    fast = DecompOption(Decomp.int4(), 0.0, 1, 1)       # best in every way, but untimed
    lay2 = [LayerProfile(lp.name, lp.rows, lp.cols, lp.dense_bytes, lp.options + [fast])
            for lp in lay]
    for f in (greedy_allocate, dado_allocate, exact_allocate):
        a = f(lay2, 0.5, latency_frac=0.9, latency_m=32)
        assert all(c != len(lp.options) - 1 for c, lp in zip(a.choice, lay2))
        assert a.extra["options_without_latency"] == 3
        assert f(lay2, 0.5).total_err == 0.0              # no latency row: it is usable


def test_plan_dict_reports_latency():
    layers = lat_layers(np.random.default_rng(5), 3, 4)
    a = exact_allocate(layers, 0.6, latency_frac=0.9)
    d = json.loads(json.dumps(a.to_dict(layers), allow_nan=False))
    per = [r["latency_us"]["1"] for r in d["layers"]]
    assert per == [layers[i].options[c].latency_us[1] for i, c in enumerate(a.choice)]
    assert d["total_latency_us"]["1"] == pytest.approx(sum(per))
    assert d["dense_latency_us"]["1"] == pytest.approx(
        sum(lp.options[0].latency_us[1] for lp in layers))
    assert d["latency_m"] == 1 and d["latency_frac"] == 0.9


def test_bpw_budget():
    rng = np.random.default_rng(6)
    layers = lat_layers(rng, 5, 6)                       # dense = 4 bytes per weight
    nw = sum(lp.rows * lp.cols for lp in layers)
    for f in (greedy_allocate, dado_allocate, exact_allocate):
        a = f(layers, budget_bpw=6.4)
        b = f(layers, 0.2)
        assert a.budget_bytes == b.budget_bytes == naive_budget_bpw([nw], 6.4)
        assert a.budget_bytes == (64 * nw) // 80        # exact: 0.8 bytes per weight
        assert a.choice == b.choice
        assert a.budget_bpw == 6.4 and a.budget_frac is None and b.budget_bpw is None
        assert a.bits_per_weight == pytest.approx(8 * a.total_bytes / nw)
        assert a.n_weights == nw
        if a.feasible:
            assert a.bits_per_weight <= 6.4
        with pytest.raises(ValueError, match="exactly one"):
            f(layers, 0.2, budget_bpw=6.4)
        with pytest.raises(ValueError, match="neither"):
            f(layers)
        for bad in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="budget_bpw"):
                f(layers, budget_bpw=bad)
        with pytest.raises(TypeError, match="budget_bpw"):
            f(layers, budget_bpw="6")
    assert budget_bytes(layers, budget_bpw=6.4) == (64 * nw) // 80
    # the decimal rule: 0.29 of 100 bytes is 29 (float 0.29 * 100 = 28.999...)
    lp = LayerProfile("a", 5, 5, 100, [DecompOption(Decomp.dense(), 0.0, 100, 1)])
    assert budget_bytes([lp], 0.29) == 29 and math.floor(0.29 * 100) == 28


def test_exact_budget_of_hundreds_of_gb():
    """HiGHS's feasibility tolerance must not admit a plan one byte over a huge budget
    (a budget row scaled by B would: tolerance 1e-6 x 3e11 = 3e5 bytes)."""
    d = 4 * 158_113 * 158_113                           # ~100 GB per layer
    lay_a = LayerProfile("a", 158_113, 158_113, d, [
        DecompOption(Decomp.dense(), 0.0, d, 1),
        DecompOption(Decomp.int8(), 0.30, d // 2, 1),
        DecompOption(Decomp.int4(), 0.05, d // 2 + 1, 1),      # better, one byte more
        DecompOption(Decomp.ternary(), 0.90, d // 8, 1)])
    lay_b = LayerProfile("b", 158_113, 158_113, d, [
        DecompOption(Decomp.dense(), 0.0, d, 1),
        DecompOption(Decomp.int8(), 0.20, d // 2, 1),
        DecompOption(Decomp.ternary(), 0.95, d // 8, 1)])
    layers = [lay_a, lay_a, lay_b]
    frac = 0.5
    budget = naive_budget_exact([lp.dense_bytes for lp in layers], frac)
    assert budget > 1e11
    costs, sizes = tables(layers)
    best, arg = naive_brute_force(costs, sizes, budget)
    x = exact_allocate(layers, frac)
    assert x.extra["status"] == "optimal", x.extra
    assert x.total_bytes <= budget and x.choice == arg
    assert x.total_err == pytest.approx(best, abs=1e-12)


def _fake_milp(monkeypatch, mutate):
    import scipy.optimize
    real = scipy.optimize.milp

    def fake(*a, **kw):
        r = real(*a, **kw)
        mutate(r)
        return r

    monkeypatch.setattr(scipy.optimize, "milp", fake)


def test_exact_time_limit_without_a_plan_falls_back_to_greedy(monkeypatch):
    rng = np.random.default_rng(21)
    layers = random_layers(rng, 6, 6)
    g = greedy_allocate(layers, 0.9)
    assert g.feasible and g.total_err > 0

    def stop(r):
        r.x, r.status, r.message, r.mip_dual_bound = None, 1, "Time limit reached.", None

    _fake_milp(monkeypatch, stop)
    x = exact_allocate(layers, 0.9, time_limit=0.5)
    assert x.extra["status"] == "fallback to greedy (time limit, no plan)"
    assert x.extra["time_limit"] == 0.5
    assert x.choice == g.choice and x.feasible
    assert x.bound == "lp" and x.lower_bound == pytest.approx(g.lower_bound)
    assert x.gap == pytest.approx(g.gap)


def test_exact_time_limit_with_a_plan_reports_time_limit(monkeypatch):
    rng = np.random.default_rng(22)
    layers = random_layers(rng, 6, 6)
    opt = exact_allocate(layers, 0.9)
    assert opt.feasible and opt.total_err > 0

    def stop(r):
        r.status, r.message = 1, "Time limit reached."
        r.mip_dual_bound = r.mip_dual_bound * 0.5            # not proven yet

    _fake_milp(monkeypatch, stop)
    x = exact_allocate(layers, 0.9, time_limit=1.0)
    assert x.extra["status"] == "time limit"
    assert x.choice == opt.choice
    assert x.bound in ("lp", "milp-dual") and x.lower_bound < x.total_err
    assert x.gap > 0


def test_exact_rejects_a_rounded_plan_over_budget(monkeypatch):
    rng = np.random.default_rng(23)
    layers = random_layers(rng, 4, 5)

    def dense(r):                                        # all-dense: over any budget < 1
        x = np.zeros_like(r.x)
        r.x = x
    # the first variable of every layer is its fewest-bytes non-dominated option;
    # an all-zero x is "not one option per layer"
    _fake_milp(monkeypatch, dense)
    x = exact_allocate(layers, 0.7)
    assert x.extra["status"].startswith("fallback to greedy (HiGHS plan is not one option")
    assert x.choice == greedy_allocate(layers, 0.7).choice


def test_exact_time_limit_validation():
    layers = random_layers(np.random.default_rng(0), 2, 3)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time_limit"):
            exact_allocate(layers, 0.5, time_limit=bad)
    with pytest.raises(TypeError, match="time_limit"):
        exact_allocate(layers, 0.5, time_limit="5")


def test_exact_silences_native_solver_output(monkeypatch, capfd):
    """HiGHS writes some lines from C++ straight to fd 2; inside
    silence_native_output none reach the user."""
    import scipy.optimize
    real = scipy.optimize.milp

    def noisy(*a, **kw):
        os.write(2, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        os.write(1, b"solver chatter on stdout\n")
        return real(*a, **kw)

    monkeypatch.setattr(scipy.optimize, "milp", noisy)
    layers = random_layers(np.random.default_rng(8), 4, 4)
    capfd.readouterr()
    print("before")
    with silence_native_output():      # what the command line does (review finding 2)
        x = exact_allocate(layers, 0.9)
    print("after")
    out, err = capfd.readouterr()
    assert err == "" and out == "before\nafter\n"
    assert x.extra["status"] == "optimal"



# --------------------------------------------------------------------------- #
# review finding 2: exact_allocate leaves the process's stdout/stderr alone
# --------------------------------------------------------------------------- #
def _blocking_milp(monkeypatch, hook):
    """scipy.optimize.milp that calls ``hook()`` (in the solving thread) before
    the real solve, on each thread's first call."""
    import threading
    import scipy.optimize
    real = scipy.optimize.milp
    seen = set()
    lock = threading.Lock()

    def fake(*a, **kw):
        with lock:
            first = threading.get_ident() not in seen
            seen.add(threading.get_ident())
        if first:
            hook()
        return real(*a, **kw)

    monkeypatch.setattr(scipy.optimize, "milp", fake)


def test_exact_thread_printing_during_a_solve_is_not_lost(monkeypatch, capfd):
    import threading
    solving, printed = threading.Event(), threading.Event()

    def hook():
        solving.set()
        assert printed.wait(10)

    _blocking_milp(monkeypatch, hook)
    layers = random_layers(np.random.default_rng(31), 5, 5)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("x", exact_allocate(layers, 0.8)))
    capfd.readouterr()
    t.start()
    assert solving.wait(60)
    print("printed while solving", flush=True)
    os.write(2, b"stderr while solving\n")
    printed.set()
    t.join(60)
    o, e = capfd.readouterr()
    assert o == "printed while solving\n" and e == "stderr while solving\n"
    assert out["x"].extra["status"] == "optimal"


def test_exact_two_concurrent_solves_leave_stdout_working(monkeypatch, capfd):
    """Solve A starts, solve B starts while A is inside HiGHS, A finishes first:
    an fd redirect that saved/restored per call would leave fd 1 on /dev/null."""
    import threading
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    order = []

    def hook():
        name = threading.current_thread().name
        order.append(name)
        if name == "A":
            a_in.set()
            assert b_in.wait(20)
        else:
            b_in.set()
            assert a_done.wait(20)

    _blocking_milp(monkeypatch, hook)
    layers = random_layers(np.random.default_rng(32), 5, 5)
    res = {}

    def run(name):
        res[name] = exact_allocate(layers, 0.8)
        if name == "A":
            a_done.set()

    ta = threading.Thread(target=run, args=("A",), name="A")
    tb = threading.Thread(target=run, args=("B",), name="B")
    capfd.readouterr()
    ta.start()
    assert a_in.wait(60)
    tb.start()
    ta.join(60)
    tb.join(60)
    print("after both solves", flush=True)
    os.write(2, b"stderr after\n")
    o, e = capfd.readouterr()
    assert o == "after both solves\n" and e == "stderr after\n"
    assert order == ["A", "B"]
    assert res["A"].choice == res["B"].choice and res["A"].extra["status"] == "optimal"


def test_silence_native_output_nests_across_threads_and_restores_on_error(capfd):
    import threading
    capfd.readouterr()
    with pytest.raises(RuntimeError):
        with silence_native_output():
            os.write(1, b"hidden\n")
            raise RuntimeError("boom")
    os.write(1, b"visible 1\n")
    inside, release = threading.Event(), threading.Event()

    def other():
        with silence_native_output():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with silence_native_output():
        t.start()
        assert inside.wait(10)
    os.write(1, b"hidden while the other thread is inside\n")   # still one open block
    release.set()
    t.join(10)
    os.write(1, b"visible 2\n")
    assert capfd.readouterr().out == "visible 1\nvisible 2\n"


def test_stable_argsort_equals_numpy_mergesort():
    """The kernels' hand-written stable argsort (the allocators' and the SVD's;
    numba's mergesort costs ~2 s of a cold compile) orders exactly as NumPy's
    stable sort: ties keep their order, -0.0 == 0.0, inf at the end, NaN after
    everything; float32 keys too (the SVD sorts -s)."""
    from opscope_nb.kernels import argsort_stable
    rng = np.random.default_rng(3)
    cases = [np.zeros(0), np.array([1.5]), np.array([0.0, -0.0, 0.0, -0.0]),
             np.array([np.nan, 1.0, np.inf, -np.inf, np.nan, 1.0, -2.0]),
             rng.integers(0, 5, 257).astype(np.float64),      # many ties
             rng.standard_normal(1000),
             -np.repeat(rng.standard_normal(20), 3).astype(np.float32)]
    for a in cases:
        got = argsort_stable(a)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.argsort(a, kind="stable"), err_msg=str(a[:8]))
