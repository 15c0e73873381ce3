"""Choose one decomposition option per layer under a global byte budget.

The problem is a multiple-choice knapsack: layer ``i`` picks option ``j`` with
error ``e_ij`` and size ``b_ij``; minimise ``sum_i weight_i * e_ij`` subject to
``sum_i b_ij <= B``.  Three solvers share one contract:

* :func:`greedy_allocate` - the upstream greedy Lagrangian sweep,
* :func:`dado_allocate`   - the upstream DADO cross-entropy search (greedy warm
  start, ``@njit`` sampling/elite loop),
* :func:`exact_allocate`  - the true optimum (HiGHS MILP via
  :func:`scipy.optimize.milp`), certified by its dual bound.

Budget convention (used everywhere, including the feasibility flag):
``B = floor(budget_frac * sum_i dense_bytes_i)`` bytes, an integer; a plan is
feasible when its total bytes are ``<= B``.

When even the smallest configuration (every layer on its fewest-bytes option)
exceeds ``B``, every solver returns that smallest configuration with
``feasible=False``, ``lower_bound=inf`` and ``gap=nan`` - never an over-budget
plan presented as fitting.

Every result carries ``lower_bound``, the Lagrangian dual of the knapsack (= its
LP relaxation, computed exactly from each layer's lower convex hull), or for
``exact`` the MILP's own dual bound, and ``gap = (total_err - lower_bound) /
max(total_err, 1e-12)``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ._validation import check_fraction, check_int
from .kernels._dado import dado_core, greedy_core, mckp_lp_bound

__all__ = [
    "Allocation",
    "DadoConfig",
    "greedy_allocate",
    "dado_allocate",
    "exact_allocate",
    "budget_bytes",
]


@dataclass(frozen=True)
class DadoConfig:
    """Parameters of :func:`dado_allocate` (upstream defaults).

    Attributes
    ----------
    iters : int
        Cross-entropy iterations.
    pop : int
        Configurations sampled per iteration.
    elite_frac : float
        Fraction of the population refitted to; the elite has
        ``max(floor(pop * elite_frac), 1)`` members.
    penalty : float
        Weight of the relative budget overshoot in the sampling loss.
    seed : int
        xorshift64 seed (the state starts at ``seed | 1``).
    """

    iters: int = 60
    pop: int = 200
    elite_frac: float = 0.2
    penalty: float = 50.0
    seed: int = 0xDAD00501


@dataclass
class Allocation:
    """One option index per layer, and what it costs.

    Attributes
    ----------
    choice : list of int
        Index into ``layers[i].options`` for every layer.
    total_err : float
        ``sum_i weight_i * rel_err_i`` of the chosen options.
    total_bytes : int
        Bytes of the chosen options.
    dense_bytes : int
        Bytes of the all-dense model.
    feasible : bool
        ``total_bytes <= budget_bytes``.
    lower_bound : float
        A valid lower bound on the optimal objective (``inf`` if infeasible).
    gap : float
        ``(total_err - lower_bound) / max(total_err, 1e-12)`` (``nan`` if
        infeasible).
    method : str
        ``"greedy"``, ``"dado"`` or ``"exact"``.
    budget_bytes : int
        ``floor(budget_frac * dense_bytes)``.
    budget_frac : float
        The requested fraction.
    """

    choice: list
    total_err: float
    total_bytes: int
    dense_bytes: int
    feasible: bool
    lower_bound: float
    gap: float
    method: str = ""
    budget_bytes: int = 0
    budget_frac: float = 1.0
    extra: dict = field(default_factory=dict)

    def compression(self) -> float:
        """``dense_bytes / total_bytes`` (``total_bytes`` floored at 1)."""
        return self.dense_bytes / max(self.total_bytes, 1)

    def to_dict(self, layers=None) -> dict:
        """JSON-ready dict; non-finite floats become ``None``.

        Parameters
        ----------
        layers : sequence of LayerProfile, optional
            When given, adds a ``layers`` list with each layer's name and the
            chosen option's label, rel_err, bytes and flops.
        """
        def fin(v):
            v = float(v)
            return v if math.isfinite(v) else None

        d = {
            "method": self.method,
            "budget_frac": float(self.budget_frac),
            "budget_bytes": int(self.budget_bytes),
            "choice": [int(c) for c in self.choice],
            "total_err": fin(self.total_err),
            "total_bytes": int(self.total_bytes),
            "dense_bytes": int(self.dense_bytes),
            "compression": fin(self.compression()),
            "feasible": bool(self.feasible),
            "lower_bound": fin(self.lower_bound),
            "gap": fin(self.gap),
        }
        if self.extra:
            d["extra"] = dict(self.extra)
        if layers is not None:
            rows = []
            for lp, c in zip(layers, self.choice):
                o = lp.options[c]
                rows.append({"name": lp.name, "option": int(c), "label": o.decomp.label,
                             "rel_err": float(o.rel_err), "bytes": int(o.bytes),
                             "flops": int(o.flops)})
            d["layers"] = rows
        return d


def budget_bytes(layers, budget_frac) -> int:
    """``floor(budget_frac * sum_i layers[i].dense_bytes)`` (the one budget rule)."""
    frac = check_fraction(budget_frac, "budget_frac")
    dense = sum(int(lp.dense_bytes) for lp in layers)
    return int(math.floor(frac * dense))


# ─────────────────────────────── internals ───────────────────────────────

class _Problem:
    """Validated, padded option tables shared by the three solvers."""

    def __init__(self, layers, budget_frac, weights):
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__"):
            raise TypeError(f"layers must be a sequence of LayerProfile; got "
                            f"{type(layers).__name__}.")
        layers = list(layers)
        if not layers:
            raise ValueError("layers must not be empty; got 0 layers. Profile at "
                             "least one weight with profile_layer().")
        self.frac = check_fraction(budget_frac, "budget_frac")
        nl = len(layers)
        if weights is None:
            wts = np.ones(nl)
        else:
            try:
                wts = np.asarray(weights, dtype=np.float64)
            except (TypeError, ValueError):
                raise TypeError(f"weights must be a sequence of {nl} non-negative "
                                f"numbers; got {weights!r}.") from None
            if wts.ndim != 1 or wts.shape[0] != nl:
                raise ValueError(f"weights must have one entry per layer ({nl}); got "
                                 f"shape {wts.shape}.")
            if not np.isfinite(wts).all() or (wts < 0).any():
                raise ValueError(f"weights must be finite and >= 0; got min "
                                 f"{np.nanmin(wts) if wts.size else 'n/a'} "
                                 f"({np.count_nonzero(~np.isfinite(wts))} non-finite).")
        kmax = 0
        for i, lp in enumerate(layers):
            opts = getattr(lp, "options", None)
            if not opts:
                raise ValueError(f"layers[{i}] ({getattr(lp, 'name', '?')!r}) has no "
                                 f"options; option 0 must be the dense baseline.")
            kmax = max(kmax, len(opts))
        cost = np.zeros((nl, kmax))
        nbytes = np.zeros((nl, kmax), dtype=np.int64)
        nopt = np.fromiter((len(lp.options) for lp in layers), dtype=np.int64, count=nl)
        errs = [o.rel_err for lp in layers for o in lp.options]
        sizes = [o.bytes for lp in layers for o in lp.options]
        flat_e = np.asarray(errs, dtype=np.float64)
        flat_b = np.asarray(sizes)
        if flat_b.dtype.kind not in "iu" or (flat_b < 0).any():
            bad = next(v for v in sizes if isinstance(v, bool) or not isinstance(
                v, numbers.Integral) or v < 0)
            raise ValueError(f"option bytes must be ints >= 0; got {bad!r}.")
        if not np.isfinite(flat_e).all() or (flat_e < 0).any():
            bad = flat_e[~(np.isfinite(flat_e) & (flat_e >= 0))][0]
            raise ValueError(f"option rel_err must be finite and >= 0; got {bad}.")
        col = np.concatenate([np.arange(k) for k in nopt])
        row = np.repeat(np.arange(nl), nopt)
        cost[row, col] = wts[row] * flat_e
        nbytes[row, col] = flat_b
        self.layers = layers
        self.weights = wts
        self.cost = cost
        self.nbytes = nbytes
        self.nopt = nopt
        self.dense = sum(int(lp.dense_bytes) for lp in layers)
        self.budget = int(math.floor(self.frac * self.dense))
        self.min_bytes = int(sum(int(nbytes[i, :nopt[i]].min()) for i in range(nl)))
        self.feasible = self.min_bytes <= self.budget

    def smallest(self):
        """Fewest-bytes option per layer; ties: lowest cost, then first index."""
        ch = []
        for i in range(len(self.layers)):
            k = self.nopt[i]
            b = self.nbytes[i, :k]
            cand = np.flatnonzero(b == b.min())
            ch.append(int(cand[np.argmin(self.cost[i, cand])]))
        return ch

    def evaluate(self, choice):
        err = 0.0
        tb = 0
        for i, c in enumerate(choice):
            err += float(self.cost[i, c])
            tb += int(self.nbytes[i, c])
        return err, tb

    def lp_bound(self) -> float:
        return float(mckp_lp_bound(self.cost, self.nbytes, self.nopt, self.budget))

    def result(self, choice, method, lower_bound=None, extra=None):
        choice = [int(c) for c in choice]
        err, tb = self.evaluate(choice)
        feasible = tb <= self.budget
        if not self.feasible:
            lb, gap = math.inf, math.nan
        else:
            lb = self.lp_bound() if lower_bound is None else float(lower_bound)
            lb = max(lb, 0.0)  # every cost is >= 0; clears -1e-17 round-off
            gap = (err - lb) / max(err, 1e-12)
        return Allocation(choice=choice, total_err=err, total_bytes=tb,
                          dense_bytes=self.dense, feasible=feasible,
                          lower_bound=lb, gap=gap, method=method,
                          budget_bytes=self.budget, budget_frac=self.frac,
                          extra=dict(extra or {}))


# ─────────────────────────────── solvers ───────────────────────────────

def greedy_allocate(layers, budget_frac, *, weights=None) -> Allocation:
    """Greedy Lagrangian allocation (the upstream rule).

    Start with every layer dense (option 0); while the plan exceeds the
    budget, apply the one swap to a smaller option with the least
    ``max(weight * d_err, 0) / bytes_saved`` (ties: first layer, first option).

    Parameters
    ----------
    layers : sequence of LayerProfile
        Profiled layers; ``options[0]`` is dense.
    budget_frac : float
        Budget as a fraction of the dense bytes, in (0, 1].
    weights : sequence of float, optional
        Per-layer non-negative weights of the objective (default 1).

    Returns
    -------
    Allocation
    """
    pb = _Problem(layers, budget_frac, weights)
    if not pb.feasible:
        return pb.result(pb.smallest(), "greedy")
    ch = greedy_core(pb.cost, pb.nbytes, pb.nopt, np.int64(pb.budget))
    return pb.result(ch, "greedy")


def dado_allocate(layers, budget_frac, cfg: DadoConfig = DadoConfig(), *,
                  weights=None) -> Allocation:
    """DADO allocation: greedy warm start refined by cross-entropy search.

    Per-layer categorical marginals start at ``0.4/K`` plus ``0.6`` on the
    greedy choice; each of ``cfg.iters`` iterations samples ``cfg.pop``
    plans with xorshift64, keeps the best strictly feasible one, and refits
    the marginals to the elite with Laplace smoothing (see
    :func:`opscope_nb.kernels.dado_core`).  The greedy plan is the initial
    incumbent, so the result is never worse than greedy.

    Parameters
    ----------
    layers : sequence of LayerProfile
    budget_frac : float
        In (0, 1].
    cfg : DadoConfig
    weights : sequence of float, optional

    Returns
    -------
    Allocation
    """
    if not isinstance(cfg, DadoConfig):
        raise TypeError(f"cfg must be a DadoConfig; got {type(cfg).__name__}.")
    iters = check_int(cfg.iters, "cfg.iters", 0)
    pop = check_int(cfg.pop, "cfg.pop", 1)
    ef = check_fraction(cfg.elite_frac, "cfg.elite_frac")
    pen = float(cfg.penalty)
    if not math.isfinite(pen) or pen < 0:
        raise ValueError(f"cfg.penalty must be finite and >= 0; got {cfg.penalty!r}.")
    seed = check_int(cfg.seed, "cfg.seed", 0) & 0xFFFFFFFFFFFFFFFF
    pb = _Problem(layers, budget_frac, weights)
    if not pb.feasible:
        return pb.result(pb.smallest(), "dado")
    g = greedy_core(pb.cost, pb.nbytes, pb.nopt, np.int64(pb.budget))
    n_elite = min(max(int(math.floor(pop * ef)), 1), pop)
    ch, _ = dado_core(pb.cost, pb.nbytes, pb.nopt, np.int64(pb.budget), g,
                      iters, pop, n_elite, pen, np.uint64(seed))
    return pb.result(ch, "dado")


def _pareto_reduce(pb):
    """Per layer, the options not dominated by another (fewer-or-equal bytes and
    lower-or-equal cost, strictly better in one or earlier on a full tie).
    Dropping them cannot change the optimum value."""
    keep = []
    for i in range(len(pb.layers)):
        k = pb.nopt[i]
        b = pb.nbytes[i, :k]
        c = pb.cost[i, :k]
        order = np.lexsort((np.arange(k), c, b))  # bytes, then cost, then index
        kept = []
        best_c = math.inf
        for j in order:
            if c[j] < best_c:
                kept.append(int(j))
                best_c = c[j]
        keep.append(kept)
    return keep


def exact_allocate(layers, budget_frac, *, weights=None, time_limit=60.0) -> Allocation:
    """The optimal plan, from a MILP solved by HiGHS (:func:`scipy.optimize.milp`).

    Binaries ``x_ij`` (one per non-dominated option), ``sum_j x_ij = 1`` per
    layer and ``sum_ij b_ij x_ij <= B``, minimising ``sum_ij w_i e_ij x_ij``
    with a zero relative MIP gap.  The greedy plan is the fallback if HiGHS
    stops early (time limit), in which case ``gap`` tells the truth.

    Parameters
    ----------
    layers : sequence of LayerProfile
    budget_frac : float
        In (0, 1].
    weights : sequence of float, optional
    time_limit : float
        Seconds for HiGHS.

    Returns
    -------
    Allocation
        ``lower_bound`` is the larger of the LP (Lagrangian) bound and HiGHS's
        dual bound, capped by ``total_err`` when HiGHS proved optimality.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

    pb = _Problem(layers, budget_frac, weights)
    if not pb.feasible:
        return pb.result(pb.smallest(), "exact")
    lp = pb.lp_bound()
    greedy = [int(c) for c in greedy_core(pb.cost, pb.nbytes, pb.nopt,
                                          np.int64(pb.budget))]
    g_err, _ = pb.evaluate(greedy)
    keep = _pareto_reduce(pb)
    nl = len(keep)
    var_layer, var_opt = [], []
    for i, ks in enumerate(keep):
        var_layer += [i] * len(ks)
        var_opt += ks
    var_layer = np.asarray(var_layer)
    var_opt = np.asarray(var_opt)
    nv = var_layer.size
    c = pb.cost[var_layer, var_opt]
    b = pb.nbytes[var_layer, var_opt].astype(np.float64)
    # Bytes are integers, so ``<= B + 0.25`` admits exactly the plans that
    # fit; the slack absorbs HiGHS' feasibility tolerance.  The row is scaled
    # by B so that tolerance is relative.  The rounded plan is re-checked in
    # exact integer bytes below.
    scale = max(float(pb.budget), 1.0)
    a_eq = csr_matrix((np.ones(nv), (var_layer, np.arange(nv))), shape=(nl, nv))
    cons = [LinearConstraint(a_eq, 1.0, 1.0),
            LinearConstraint(b[None, :] / scale, -np.inf,
                             (pb.budget + 0.25) / scale)]
    best, dual, status = greedy, -math.inf, "greedy-fallback"
    best_err = g_err
    # HiGHS keeps an absolute MIP gap of 1e-6 that scipy does not expose;
    # scaling the objective to a max of 1e4 makes it 1e-10 relative.
    cmax = float(c.max()) if nv else 0.0
    cscale = 1e4 / cmax if cmax > 1e-8 else 1e12  # (tiny costs: any plan is ~optimal)
    res = milp(c * cscale, constraints=cons, integrality=np.ones(nv), bounds=Bounds(0, 1),
               options={"mip_rel_gap": 0.0, "time_limit": float(time_limit),
                        "disp": False})
    if res.x is not None:
        x = np.rint(res.x).astype(np.int64)
        ch = [0] * nl
        ok = True
        for i in range(nl):
            sel = np.flatnonzero((var_layer == i) & (x == 1))
            if sel.size != 1:
                ok = False
                break
            ch[i] = int(var_opt[sel[0]])
        if ok:
            err, tb = pb.evaluate(ch)
            if tb <= pb.budget and err <= best_err:
                best, best_err = ch, err
                status = "optimal" if res.status == 0 else f"highs-status-{res.status}"
    db = getattr(res, "mip_dual_bound", None)
    if db is not None and math.isfinite(db):
        dual = float(db) / cscale
    # Both bounds are valid; a bound above a plan we hold can only come from
    # solver tolerances, and when HiGHS proved optimality (gap 0) the optimum
    # is that plan's value.
    lb = min(max(lp, dual), best_err)
    return pb.result(best, "exact", lower_bound=lb,
                     extra={"solver": "highs", "status": status,
                            "variables": int(nv)})
