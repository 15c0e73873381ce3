"""refine's paired acceptance test (issue 59): a move is kept only when its gain
on the search tokens is spread over them, not carried by a few."""
from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest

from naive_models import write_tiny_llama

from opscope_nb.cli import main
from opscope_nb.models import open_model
from opscope_nb.plan import refine as rf
from opscope_nb.plan.allocate import exact_allocate

from test_refine import OBJ, _layers


def _z_twin(new, old, batch):
    """Loops: the mean of old - new over the standard error of its batch means."""
    d = [o - n for n, o in zip(new, old)]
    means = []
    for s in range(0, len(d), batch):
        part = d[s:s + batch]
        means.append(sum(part) / len(part))
    mu = sum(d) / len(d)
    m = sum(means) / len(means)
    var = sum((x - m) ** 2 for x in means) / (len(means) - 1)
    return mu / math.sqrt(var / len(means))


@pytest.mark.parametrize("n,batch", [(1000, 1), (1000, 16), (1003, 16), (37, 5)])
def test_paired_z_equals_a_loop_twin(n, batch):
    rng = np.random.default_rng(n + batch)
    old = rng.gamma(0.5, 0.02, n)
    new = old * rng.uniform(0.8, 1.1, n)
    z = rf.paired_z(new, old, batch)
    assert z == pytest.approx(_z_twin(new.tolist(), old.tolist(), batch), rel=1e-9)
    assert rf.paired_z(old, new, batch) == pytest.approx(-z, rel=1e-12)


def test_paired_z_edges_and_bad_input():
    a = np.linspace(0.0, 1.0, 64)
    assert rf.paired_z(a, a, 16) == 0.0
    assert rf.paired_z(a - 0.5, a, 64) == math.inf          # one batch, lower
    assert rf.paired_z(a + 0.5, a, 64) == -math.inf
    assert rf.paired_z(np.zeros(0), np.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="1-D of one length"):
        rf.paired_z(a, a[:-1])
    with pytest.raises(ValueError, match="batch must be"):
        rf.paired_z(a, a, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_paired"))
    W = write_tiny_llama(d, seed=3, n_layers=2)
    layers = _layers(W)
    sc = rf.PlanScorer.from_text(open_model(d), layers, text="sample", tokens=96,
                                 held_out_tokens=64, window=48)
    a = exact_allocate(layers, 0.2, objective=OBJ)
    return layers, sc, a


def test_last_rows_are_the_per_token_kl_whose_mean_is_the_score(tiny):
    layers, sc, a = tiny
    v = sc.adopt(a.choice)
    rows = sc.last_rows
    n_tok = sum(len(c) for c in sc.splits["search"].chunks)
    assert rows.shape == (n_tok,) and rows.dtype == np.float64 and (rows >= 0).all()
    assert float(rows.mean()) == v
    other = [len(lp.options) - 1 for lp in layers]
    w = sc.score(other)
    assert float(sc.last_rows.mean()) == w and not np.array_equal(sc.last_rows, rows)
    assert sc.score(a.choice) == v                  # the cache's plan: no forward ...
    np.testing.assert_array_equal(sc.last_rows, rows)   # ... and its rows


def _rigged(sc, start, gain, n=160):
    """Search rows 1.0 per token for the start plan; every other plan gains
    ``gain(rows)`` on them.  A screen split (a prefix of the search split)
    gets the first of those rows."""
    class Rigged(rf.PlanScorer):
        def score(self, choice, split="search", **kw):
            v = super().score(choice, split, **kw)
            if split not in ("search", "screen"):
                return v
            rows = np.ones(n)
            if list(choice) != list(start):
                rows = gain(rows)
            if split == "screen":
                rows = rows[:self.units("screen")]
            self.last_rows = rows
            return float(rows.mean())
    r = Rigged.__new__(Rigged)
    r.__dict__.update(sc.__dict__)
    for s in r.splits.values():
        s.cache = s.cache_key = s.cache_score = s.cache_rows = None
    return r


def _one_token(rows):
    rows = rows.copy()
    rows[0] = 0.0
    return rows


@pytest.mark.parametrize("gain,z,moves", [
    (lambda r: r * 0.99, 2.0, 1),          # spread over every token: kept
    (_one_token, 2.0, 0),                  # one token: z ~ 1, not kept
    (_one_token, 0.0, 1),                  # without the test: kept
    (_one_token, 0.9, 1),
])
def test_a_move_is_kept_only_when_its_gain_is_spread(tiny, gain, z, moves):
    layers, sc, a = tiny
    r = rf.refine(_rigged(sc, a.choice, gain), a.choice, a.budget_bytes, objective=OBJ,
                  evals=6, seed=2, table=0, accept_z=z)
    assert r.accepted == moves
    assert (r.best != list(a.choice)) == (moves > 0)
    assert r.scores["accept_z"] == z
    if moves:
        assert r.scores["best"]["search"] < r.scores["start"]["search"]
        assert r.scores["held_out_z"] is not None
    else:
        assert r.scores["held_out_z"] == 0.0


def test_bad_accept_z(tiny):
    layers, sc, a = tiny
    for bad in (-1.0, math.inf, math.nan, "2", True):
        with pytest.raises(ValueError, match="accept_z must be"):
            rf.refine(sc, a.choice, a.budget_bytes, objective=OBJ, evals=1, accept_z=bad)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["refine", "profile.json", "--bpw", "4", "--out", "x", "--accept-z", "-1"])
    assert rc == 2 and "--accept-z" in err.getvalue() and ">= 0" in err.getvalue()


def test_a_screened_candidate_is_judged_on_the_tokens_the_screen_did_not_see(tiny):
    layers, sc0, a = tiny
    sc = rf.PlanScorer(sc0.model, layers, sc0.splits["search"].chunks,
                       sc0.splits["held_out"].chunks, screen_tokens=32)
    n, k = sc.units("search"), sc.units("screen")
    assert (n, k) == (96, 32)
    sc.adopt(a.choice)
    full = sc.last_rows.copy()
    sc.score(a.choice, "screen")
    assert sc.last_rows.shape == (k,)                   # the screen is the search prefix
    np.testing.assert_allclose(sc.last_rows, full[:k], rtol=1e-4, atol=1e-9)

    def on_screen(rows):                   # a gain on the screen's tokens alone
        rows = rows.copy()
        rows[:k] *= 0.5
        return rows

    def everywhere(rows):
        return rows * 0.99
    for gain, moves in ((on_screen, 0), (everywhere, 1)):
        r = rf.refine(_rigged(sc, a.choice, gain, n), a.choice, a.budget_bytes, objective=OBJ,
                      evals=6, seed=2, table=0, accept_z=0.0)
        assert r.accepted == moves, gain.__name__
    # without a screen, the same gain is judged on all search tokens: kept
    sc1 = rf.PlanScorer(sc0.model, layers, sc0.splits["search"].chunks,
                        sc0.splits["held_out"].chunks)
    r = rf.refine(_rigged(sc1, a.choice, on_screen, n), a.choice, a.budget_bytes,
                  objective=OBJ, evals=6, seed=2, table=0, accept_z=0.0)
    assert r.accepted == 1
