"""Choose one decomposition option per layer under a global byte budget (and
optionally a latency budget).

The problem is a multiple-choice knapsack: layer ``i`` picks option ``j`` with
error ``e_ij`` and size ``b_ij``; minimise ``sum_i weight_i * e_ij`` subject to
``sum_i b_ij <= B`` and, when a latency budget is given, ``sum_i t_ij <= T``
(``t_ij`` = the option's measured latency at ``m = latency_m``,
``DecompOption.latency_us[m]``).  Three solvers share one contract:

* :func:`greedy_allocate` - the upstream greedy Lagrangian sweep (with two
  budgets: the greedy descent on the summed relative overshoot,
  :func:`opscope_nb.kernels.greedy2_core`),
* :func:`dado_allocate`   - the upstream DADO cross-entropy search (greedy warm
  start, ``@njit`` sampling/elite loop),
* :func:`exact_allocate`  - the true optimum (HiGHS MILP via
  :func:`scipy.optimize.milp`), certified by its dual bound.

Budget convention (used everywhere, including the feasibility flag): exactly
one of

* ``budget_frac`` - ``B = floor(budget_frac * sum_i dense_bytes_i)``,
* ``budget_bpw``  - ``B = floor(budget_bpw / 8 * sum_i rows_i * cols_i)``
  (bits per weight, as llama.cpp users count),

both evaluated in exact rational arithmetic on the number's shortest decimal
form (``repr``), so ``0.29 * 100`` is 29 bytes and ``budget_frac=0.2`` on
float32 layers gives the same ``B`` as ``budget_bpw=6.4``.  A plan is
feasible when its total bytes are ``<= B`` (integers) and, with
``latency_frac``, its total latency is ``<= T = latency_frac * sum_i t_i0``
(the all-dense latency) up to a relative ``1e-9`` for float round-off.

When even the smallest configuration (every layer on its fewest-bytes option)
exceeds ``B`` (or every layer on its fastest option exceeds ``T``), every
solver returns the fewest-bytes configuration with ``feasible=False``,
``lower_bound=inf`` and ``gap=nan`` - never an over-budget plan presented as
fitting.  With two budgets greedy and DADO may also fail on a feasible
problem; they then return ``feasible=False`` with the valid bound and
``gap=nan``.

Every result carries ``lower_bound`` and names it in ``bound``: ``"lp"`` - the
LP relaxation (one budget: the Lagrangian dual of the knapsack, computed
exactly from each layer's lower convex hull; two budgets: the Lagrangian
evaluated in exact arithmetic at the multipliers HiGHS's LP returns, a valid
bound for any multipliers), ``"milp-dual"`` - HiGHS's dual bound when it is
higher, ``"optimum"`` - the exact solver proved its plan optimal.  ``gap =
(total_err - lower_bound) / max(total_err, 1e-12)``.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from opscope_nb._validation import check_fraction, check_int
from opscope_nb.kernels._dado import (
    dado_core,
    greedy2_core,
    greedy_core,
    lower_hull_core,
    mckp_lp_bound,
)

__all__ = [
    "Allocation",
    "DadoConfig",
    "greedy_allocate",
    "dado_allocate",
    "exact_allocate",
    "budget_bytes",
    "lower_hull",
    "option_latency",
    "LATENCY_RTOL",
    "silence_native_output",
]

#: Relative tolerance of the latency budget (float sums of microseconds).
LATENCY_RTOL = 1e-9
#: Largest divisor of the MILP's byte row: HiGHS's MIP feasibility tolerance
#: (1e-6) times this stays below 0.15 byte, so with the row's +0.25 byte slack
#: no plan one byte over the budget is ever accepted (see exact_allocate).
_BYTE_ROW_SCALE_MAX = float(2 ** 17)
#: Re-solves of the MILP after cutting off a plan that is over budget in exact bytes.
_MAX_CUTS = 25


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


def option_latency(opt, m):
    """``opt.latency_us[m]`` in microseconds, or ``None`` when not measured.

    Accepts integer keys (in memory) and string keys (as JSON writes them).
    """
    d = getattr(opt, "latency_us", None) or {}
    try:
        keys = (int(m), str(int(m)))
    except (TypeError, ValueError):
        return None
    for key in keys:
        if key in d:
            try:
                return float(d[key])
            except (TypeError, ValueError):
                return None
    return None


def _fin(v):
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


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
        ``total_bytes <= budget_bytes`` (and the latency budget holds).
    lower_bound : float
        A valid lower bound on the optimal objective (``inf`` if the problem
        is proven infeasible).
    gap : float
        ``(total_err - lower_bound) / max(total_err, 1e-12)`` (``nan`` if the
        plan is infeasible).
    method : str
        ``"greedy"``, ``"dado"`` or ``"exact"``.
    budget_bytes : int
        ``B`` (see the module docstring).
    budget_frac : float or None
        The requested fraction (``None`` when ``budget_bpw`` was given).
    extra : dict
        Solver details (``exact``: ``solver``, ``status``, ``variables``).
    budget_bpw : float or None
        The requested bits per weight (``None`` when ``budget_frac`` was given).
    n_weights : int
        ``sum_i rows_i * cols_i``.
    bound : str
        Which bound ``lower_bound`` is: ``"lp"``, ``"milp-dual"``,
        ``"optimum"`` or ``"none"`` (infeasible).
    latency_m : int or None
        The ``m`` of the latency budget (``None``: no latency budget).
    latency_frac : float or None
    latency_budget_us : float or None
        ``T = latency_frac * dense_latency_us``.
    total_latency_us : float or None
        Latency of the chosen options at ``latency_m``.
    dense_latency_us : float or None
        All-dense latency at ``latency_m``.
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
    budget_frac: float | None = 1.0
    extra: dict = field(default_factory=dict)
    budget_bpw: float | None = None
    n_weights: int = 0
    bound: str = "lp"
    latency_m: int | None = None
    latency_frac: float | None = None
    latency_budget_us: float | None = None
    total_latency_us: float | None = None
    dense_latency_us: float | None = None

    def compression(self) -> float:
        """``dense_bytes / total_bytes`` (``total_bytes`` floored at 1)."""
        return self.dense_bytes / max(self.total_bytes, 1)

    @property
    def bits_per_weight(self) -> float:
        """Achieved ``8 * total_bytes / n_weights`` (``nan`` without weights)."""
        return 8.0 * self.total_bytes / self.n_weights if self.n_weights else math.nan

    @property
    def status(self) -> str:
        """The exact solver's status (``"optimal"``, ``"time limit"``,
        ``"fallback to greedy (...)"``, ``"infeasible"``); ``""`` for heuristics."""
        return str(self.extra.get("status", ""))

    def to_dict(self, layers=None) -> dict:
        """JSON-ready dict; non-finite floats become ``None``.

        Parameters
        ----------
        layers : sequence of LayerProfile, optional
            When given, adds a ``layers`` list with each layer's name and the
            chosen option's label, full ``decomp`` (``Decomp.to_dict``: rank,
            sketch rank, seed -- what ``apply`` rebuilds), rel_err, bytes, flops and measured
            ``latency_us`` (``{"m": us}``, empty when not measured), and
            ``total_latency_us`` / ``dense_latency_us`` (``{"m": us}`` for
            every ``m`` measured on all layers).
        """
        d = {
            "method": self.method,
            "budget_frac": _fin(self.budget_frac),
            "budget_bpw": _fin(self.budget_bpw),
            "budget_bytes": int(self.budget_bytes),
            "choice": [int(c) for c in self.choice],
            "total_err": _fin(self.total_err),
            "total_bytes": int(self.total_bytes),
            "dense_bytes": int(self.dense_bytes),
            "n_weights": int(self.n_weights),
            "bits_per_weight": _fin(self.bits_per_weight),
            "compression": _fin(self.compression()),
            "feasible": bool(self.feasible),
            "lower_bound": _fin(self.lower_bound),
            "bound": self.bound,
            "gap": _fin(self.gap),
        }
        if self.latency_m is not None:
            d.update({"latency_m": int(self.latency_m),
                      "latency_frac": _fin(self.latency_frac),
                      "latency_budget_us": _fin(self.latency_budget_us),
                      "total_latency_us_at_m": _fin(self.total_latency_us),
                      "dense_latency_us_at_m": _fin(self.dense_latency_us)})
        if self.extra:
            d["extra"] = dict(self.extra)
        if layers is not None:
            rows = []
            ms = None
            for lp, c in zip(layers, self.choice):
                o = lp.options[c]
                lat = {str(k): float(v) for k, v in
                       (getattr(o, "latency_us", None) or {}).items()}
                keys = set(lat) & {str(k) for k in
                                   (getattr(lp.options[0], "latency_us", None) or {})}
                ms = keys if ms is None else ms & keys
                dec = o.decomp.to_dict()
                rows.append({"name": lp.name, "option": int(c), "label": o.decomp.label,
                             "decomp": dec,
                             "rel_err": float(o.rel_err), "bytes": int(o.bytes),
                             "flops": int(o.flops), "latency_us": lat})
            d["layers"] = rows
            ms = sorted(ms or (), key=int)
            d["total_latency_us"] = {m: sum(r["latency_us"][m] for r in rows) for m in ms}
            d["dense_latency_us"] = {
                m: sum(option_latency(lp.options[0], m) for lp in layers) for m in ms}
        return d


#: Objectives the allocators minimise (see the solvers' ``objective`` parameter).
OBJECTIVES = ("weight", "output", "sensitivity")
#: A plan whose :func:`predicted_damage` is above this multiple of the best
#: plan of the run at the same budget is flagged.
DAMAGE_FLAG_RATIO = 2.0


#: ``act_quant`` settings of the output objectives (see :func:`act_quant_mode`).
ACT_QUANT = ("auto", "ggml", "none")


def act_quant_mode(flag, layers) -> str:
    """Resolve an ``act_quant`` setting: ``"auto"`` is ``"ggml"`` when every
    option of every layer is a ggml type or dense (a plan for llama.cpp),
    else ``"none"``; ``"ggml"`` / ``"none"`` are returned as given."""
    if flag not in ACT_QUANT:
        raise ValueError(f"act_quant must be one of {ACT_QUANT}; got {flag!r}.")
    if flag != "auto":
        return flag
    ok = all(o.decomp.kind in ("ggml", "dense") for lp in layers for o in lp.options)
    return "ggml" if ok else "none"


def option_act_type(lp, o):
    """The key of ``lp.act_err`` that option ``o`` reads its input at in
    llama.cpp: its ggml type's activation type, the stored type's for dense
    (kept as stored), None for float32 inputs and the package's own formats."""
    from opscope_nb.formats.ggml import ACTIVATION_TYPES
    from opscope_nb.models.ggml_acts import run_type
    d = o.decomp
    if d.kind == "ggml":
        t = d.qtype
    elif d.kind == "dense":
        t = run_type(getattr(lp, "stored_dtype", "F32"))
    else:
        return None
    a = ACTIVATION_TYPES.get(t)
    return None if a in (None, "F32") else "Q8_0" if a == "Q8_1" else a


def _objective_errors(layers, flat_e, objective, act_quant="auto"):
    """Per-option objective terms (flattened like ``flat_e``) and ``extra`` facts."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}; got {objective!r}.")
    act = act_quant_mode(act_quant, layers) == "ggml"
    if objective == "weight":
        return flat_e, {}
    sens = [getattr(lp, "sensitivity", None) for lp in layers]
    cal = [s for s, lp in zip(sens, layers)
           if s is not None and all(getattr(o, "out_err", None) is not None
                                    for o in lp.options)]
    mean_s = float(np.mean(cal)) if cal else 1.0
    out, fallback, n_act, n_look = [], 0, 0, 0
    for lp, s in zip(layers, sens):
        oe = [getattr(o, "out_err", None) for o in lp.options]
        has_out = all(v is not None for v in oe)
        ae = (getattr(lp, "act_err", None) or {}) if act and has_out else {}
        n_act += bool(ae)
        prior = float(getattr(lp, "prior_weight", 1.0))
        lk = getattr(lp, "lookup", None) or None
        ls = None if lk is None else lk.get("sensitivity")
        if ls is not None and not (math.isfinite(float(ls)) and float(ls) >= 0):
            raise ValueError(f"layer {lp.name!r} lookup sensitivity must be finite and "
                             f">= 0; got {ls!r}.")
        n_look += lk is not None
        if objective == "output":
            fb = not has_out and lk is None
            scale = prior
            lscale = 1.0 if has_out else prior
        else:
            fb = (not has_out or s is None) and (lk is None or ls is None)
            scale = mean_s * prior if (not has_out or s is None) else float(s)
            lscale = float(ls) if ls is not None else mean_s * (1.0 if has_out else prior)
            if s is not None and not (math.isfinite(float(s)) and float(s) >= 0):
                raise ValueError(f"layer {lp.name!r} sensitivity must be finite and >= 0; "
                                 f"got {s!r}.")
        fallback += fb
        for j, (o, v) in enumerate(zip(lp.options, oe)):
            e = float(v) if has_out else float(o.rel_err)
            if not (math.isfinite(e) and e >= 0):
                raise ValueError(f"layer {lp.name!r} option {o.label}: out_err must be "
                                 f"finite and >= 0; got {e}.")
            # llama.cpp's rounding of the input: an error of its own, about
            # uncorrelated with the weight's (their squares add)
            a = float(ae.get(option_act_type(lp, o), 0.0)) if ae else 0.0
            t = scale * (e * e + a * a)
            if lk is not None:
                # the table read as a lookup: added to a tied head's term; an
                # untied table has no other output, its lookup replaces the
                # weight-error fallback
                le = lk["err"][j]
                le = float(o.rel_err) if le is None else float(le)
                t = (t if has_out else 0.0) + lscale * le * le
            out.append(t)
    return np.asarray(out, dtype=np.float64), {
        "objective": objective, "objective_fallback_layers": int(fallback),
        **({"act_quant_layers": int(n_act)} if n_act else {}),
        **({"lookup_layers": int(n_look)} if n_look else {})}


def output_objective(layers) -> str:
    """The objective that follows the model's output for these layers:
    ``"sensitivity"`` (sensitivity x out_err**2) when any layer was calibrated
    with a sensitivity, else ``"output"`` (out_err**2 where measured, the
    squared weight error rel_err**2 elsewhere; each layer's term times its
    data-free ``prior_weight``)."""
    for lp in layers:
        if getattr(lp, "sensitivity", None) is not None and all(
                getattr(o, "out_err", None) is not None for o in lp.options):
            return "sensitivity"
    return "output"


def predicted_damage(layers, choice, objective=None, act_quant="auto") -> float:
    """The plan's predicted output damage: the sum over layers of the chosen
    option's ``objective`` term (default :func:`output_objective`; ``act_quant``
    as the allocators'), e.g. ``sum rel_err**2`` without calibration.  What a
    plan chosen under another objective (``weight``: ``sum rel_err``) is
    judged by."""
    objective = objective or output_objective(layers)
    flat = np.asarray([float(o.rel_err) for lp in layers for o in lp.options])
    terms, _ = _objective_errors(layers, flat, objective, act_quant)
    starts = np.cumsum([0] + [len(lp.options) for lp in layers[:-1]])
    return float(sum(terms[s + int(c)] for s, c in zip(starts, choice)))


def _decimal(value) -> Fraction:
    """The exact rational of a float's shortest decimal form (``0.2`` -> 1/5)."""
    return Fraction(repr(float(value)))


def _check_bpw(value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"budget_bpw must be a real number of bits per weight; got "
                        f"{value!r}.")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"budget_bpw must be a finite number of bits per weight > 0 "
                         f"(e.g. 6.4); got {value!r}.")
    return v


def _resolve_budget(budget_frac, budget_bpw, dense, n_weights):
    """(frac or None, bpw or None, B) under the one budget rule."""
    if (budget_frac is None) == (budget_bpw is None):
        which = "both" if budget_frac is not None else "neither"
        raise ValueError(f"give exactly one byte budget: budget_frac (a fraction of the "
                         f"dense bytes, e.g. 0.2) or budget_bpw (bits per weight, e.g. "
                         f"6.4); got {which}.")
    if budget_frac is not None:
        f = check_fraction(budget_frac, "budget_frac")
        return f, None, int(math.floor(_decimal(f) * dense))
    b = _check_bpw(budget_bpw)
    return None, b, int(math.floor(_decimal(b) * n_weights / 8))


def budget_bytes(layers, budget_frac=None, *, budget_bpw=None) -> int:
    """The byte budget ``B`` (the one budget rule, see the module docstring).

    Parameters
    ----------
    layers : sequence of LayerProfile
    budget_frac : float, optional
        Fraction of the dense bytes in (0, 1].
    budget_bpw : float, optional
        Bits per weight (> 0).  Exactly one of the two.

    Returns
    -------
    int
    """
    dense = sum(int(lp.dense_bytes) for lp in layers)
    nw = sum(int(lp.rows) * int(lp.cols) for lp in layers)
    return _resolve_budget(budget_frac, budget_bpw, dense, nw)[2]


def lower_hull(x, y):
    """Vertices of the lower-left convex hull of the points ``(x[j], y[j])``.

    The convex Pareto frontier of a layer's (bytes, error) options: the same
    routine (:func:`opscope_nb.kernels.lower_hull_core`) the LP bound uses.

    Parameters
    ----------
    x, y : array_like of shape (k,), ``k >= 1``
        Finite coordinates (e.g. bytes and relative error).

    Returns
    -------
    ndarray of shape (h,), int64
        Indices into ``x``/``y`` of the hull vertices, ``x`` increasing and
        ``y`` strictly decreasing.
    """
    xa = np.ascontiguousarray(x, dtype=np.float64)
    ya = np.ascontiguousarray(y, dtype=np.float64)
    if xa.ndim != 1 or ya.shape != xa.shape or xa.size == 0:
        raise ValueError(f"x and y must be 1-D of the same non-zero length; got shapes "
                         f"{xa.shape} and {ya.shape}.")
    if not (np.isfinite(xa).all() and np.isfinite(ya).all()):
        raise ValueError("x and y must be finite; got NaN/Inf. Drop those points first.")
    return lower_hull_core(xa, ya)


_NATIVE_QUIET_LOCK = threading.Lock()
_NATIVE_QUIET = {"depth": 0, "saved": [], "devnull": None}


@contextlib.contextmanager
def silence_native_output():
    """Point file descriptors 1 and 2 of the *whole process* at ``os.devnull``.

    For command-line front ends only: :func:`exact_allocate` never does this
    itself (it asks HiGHS for no console log, ``disp=False``).  HiGHS still
    writes a few lines with a bare C ``printf`` (e.g.
    ``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``)
    that no solver option reaches; a program that owns its terminal may wrap
    its solves in this block to hide them.  While any such block is open,
    *every* thread's output to fds 1 and 2 is discarded.

    Blocks may be nested or open in several threads at once: the first to
    enter redirects, the last to leave restores the original descriptors
    (reference-counted under a lock), also when the body raises.
    """
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (AttributeError, OSError, ValueError):
            pass
    st = _NATIVE_QUIET
    with _NATIVE_QUIET_LOCK:
        if st["depth"] == 0:
            try:
                st["devnull"] = os.open(os.devnull, os.O_WRONLY)
            except OSError:
                st["devnull"] = None
            st["saved"] = []
            if st["devnull"] is not None:
                for fd in (1, 2):
                    try:
                        st["saved"].append((fd, os.dup(fd)))
                    except OSError:
                        continue
                    os.dup2(st["devnull"], fd)
        st["depth"] += 1
    try:
        yield
    finally:
        with _NATIVE_QUIET_LOCK:
            st["depth"] -= 1
            if st["depth"] == 0:
                try:  # C stdio buffers written during the solve go to devnull too
                    import ctypes
                    ctypes.CDLL(None).fflush(None)
                except (OSError, AttributeError, TypeError):
                    pass
                for fd, copy in st["saved"]:
                    os.dup2(copy, fd)
                    os.close(copy)
                if st["devnull"] is not None:
                    os.close(st["devnull"])
                st["saved"], st["devnull"] = [], None


# ─────────────────────────────── internals ───────────────────────────────

class _Problem:
    """Validated, padded option tables shared by the three solvers."""

    def __init__(self, layers, budget_frac, weights, budget_bpw=None, latency_frac=None,
                 latency_m=1, objective="weight", act_quant="auto"):
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__"):
            raise TypeError(f"layers must be a sequence of LayerProfile; got "
                            f"{type(layers).__name__}.")
        layers = list(layers)
        if not layers:
            raise ValueError("layers must not be empty; got 0 layers. Profile at "
                             "least one weight with profile_layer().")
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
        flat_e, self.obj_extra = _objective_errors(layers, flat_e, objective, act_quant)
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
        self.n_weights = sum(int(lp.rows) * int(lp.cols) for lp in layers)
        self.frac, self.bpw, self.budget = _resolve_budget(budget_frac, budget_bpw,
                                                           self.dense, self.n_weights)
        self.min_bytes = int(sum(int(nbytes[i, :nopt[i]].min()) for i in range(nl)))
        self.feasible = self.min_bytes <= self.budget
        # latency (second resource)
        self.lat = np.zeros((nl, kmax))
        self.use_lat = latency_frac is not None
        self.lat_frac = self.lat_m = None
        self.lat_cap = self.lat_budget = math.inf
        self.dense_lat = None
        self.index = None        # compact option index -> option index (latency only)
        self.unmeasured = 0
        if self.use_lat:
            self.lat_frac = check_fraction(latency_frac, "latency_frac")
            self.lat_m = check_int(latency_m, "latency_m", 1)
            index = []
            for i, lp in enumerate(layers):
                keep = []
                for j, o in enumerate(lp.options):
                    t = option_latency(o, self.lat_m)
                    if t is None:
                        if j == 0:
                            raise ValueError(
                                f"layers[{i}] ({lp.name!r}) dense option has no latency at "
                                f"m={self.lat_m}; profile with latency=({self.lat_m},) "
                                f"(CLI: --latency {self.lat_m}) or drop the latency budget.")
                        self.unmeasured += 1
                        continue  # an option nobody timed cannot be planned under it
                    if not (math.isfinite(t) and t >= 0):
                        raise ValueError(f"layers[{i}] ({lp.name!r}) option {j} latency "
                                         f"must be finite and >= 0 us; got {t}.")
                    self.lat[i, len(keep)] = t
                    keep.append(j)
                index.append(keep)
            if self.unmeasured:
                # compact the tables to the timed options (dense stays column 0)
                c2 = np.zeros_like(cost)
                b2 = np.zeros_like(nbytes)
                for i, keep in enumerate(index):
                    c2[i, :len(keep)] = cost[i, keep]
                    b2[i, :len(keep)] = nbytes[i, keep]
                    self.nopt[i] = len(keep)
                self.cost, self.nbytes = c2, b2
                self.index = index
                self.min_bytes = int(sum(int(b2[i, :self.nopt[i]].min())
                                         for i in range(nl)))
                self.feasible = self.min_bytes <= self.budget
            self.dense_lat = float(sum(self.lat[i, 0] for i in range(nl)))
            if not self.dense_lat > 0:
                raise ValueError(f"the all-dense latency at m={self.lat_m} is "
                                 f"{self.dense_lat} us; a latency budget needs a positive "
                                 f"dense latency.")
            self.lat_cap = self.lat_frac * self.dense_lat
            self.lat_budget = self.lat_cap * (1.0 + LATENCY_RTOL)
            min_lat = sum(float(self.lat[i, :nopt[i]].min()) for i in range(nl))
            self.feasible = self.feasible and min_lat <= self.lat_budget

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

    def latency(self, choice) -> float:
        return float(sum(self.lat[i, c] for i, c in enumerate(choice)))

    def fits(self, choice) -> bool:
        _, tb = self.evaluate(choice)
        return tb <= self.budget and (not self.use_lat
                                      or self.latency(choice) <= self.lat_budget)

    def greedy(self):
        if self.use_lat:
            return [int(c) for c in greedy2_core(self.cost, self.nbytes, self.lat,
                                                 self.nopt, np.int64(self.budget),
                                                 float(self.lat_budget))]
        return [int(c) for c in greedy_core(self.cost, self.nbytes, self.nopt,
                                            np.int64(self.budget))]

    def lagrangian(self, lam_b, lam_t) -> float:
        """``sum_i min_j (c_ij + lam_b b_ij + lam_t t_ij) - lam_b B - lam_t T``:
        a valid lower bound for any ``lam_b, lam_t >= 0``."""
        val = 0.0
        for i in range(len(self.layers)):
            k = self.nopt[i]
            v = (self.cost[i, :k] + lam_b * self.nbytes[i, :k].astype(np.float64)
                 + lam_t * self.lat[i, :k])
            val += float(v.min())
        val -= lam_b * float(self.budget)
        if self.use_lat:
            val -= lam_t * float(self.lat_budget)
        return val

    def lp_bound(self) -> float:
        """The LP relaxation's value as a valid bound (``inf``: proven infeasible)."""
        if not self.use_lat:
            return float(mckp_lp_bound(self.cost, self.nbytes, self.nopt, self.budget))
        from scipy.optimize import linprog
        from scipy.sparse import csr_matrix
        nl = len(self.layers)
        li = np.repeat(np.arange(nl), self.nopt)
        oj = np.concatenate([np.arange(k) for k in self.nopt])
        nv = li.size
        sb = min(max(float(self.budget), 1.0), _BYTE_ROW_SCALE_MAX)
        st = 1e4 / self.lat_budget
        a_ub = np.vstack([self.nbytes[li, oj] / sb, self.lat[li, oj] * st])
        b_ub = np.array([self.budget / sb, self.lat_budget * st])
        a_eq = csr_matrix((np.ones(nv), (li, np.arange(nv))), shape=(nl, nv))
        res = linprog(self.cost[li, oj], A_ub=a_ub, b_ub=b_ub, A_eq=a_eq,
                      b_eq=np.ones(nl), bounds=(0, 1), method="highs",
                      options={"disp": False})
        if res.status == 2:
            return math.inf
        lam_b = lam_t = 0.0
        if res.status == 0:
            marg = np.asarray(res.ineqlin.marginals, dtype=np.float64)
            lam_b = max(-float(marg[0]), 0.0) / sb
            lam_t = max(-float(marg[1]), 0.0) * st
        return self.lagrangian(lam_b, lam_t)

    def result(self, choice, method, lower_bound=None, extra=None, bound="lp"):
        choice = [int(c) for c in choice]
        err, tb = self.evaluate(choice)
        feasible = self.fits(choice)
        lat_total = self.latency(choice) if self.use_lat else None
        if self.index is not None:
            choice = [self.index[i][c] for i, c in enumerate(choice)]
            extra = dict(extra or {})
            extra["options_without_latency"] = int(self.unmeasured)
        if not self.feasible:
            lb, gap, bound = math.inf, math.nan, "none"
        else:
            lb = self.lp_bound() if lower_bound is None else float(lower_bound)
            if math.isinf(lb):
                bound = "none"
            else:
                lb = max(lb, 0.0)  # every cost is >= 0; clears -1e-17 round-off
            if feasible and math.isinf(lb):  # LP tolerance said infeasible; a plan fits
                lb, bound = max(self.lagrangian(0.0, 0.0), 0.0), "lp"
            gap = (err - lb) / max(err, 1e-12) if feasible else math.nan
        a = Allocation(choice=choice, total_err=err, total_bytes=tb,
                       dense_bytes=self.dense, feasible=feasible,
                       lower_bound=lb, gap=gap, method=method,
                       budget_bytes=self.budget, budget_frac=self.frac,
                       extra={**self.obj_extra, **(extra or {})}, budget_bpw=self.bpw,
                       n_weights=self.n_weights, bound=bound)
        if self.use_lat:
            a.latency_m = self.lat_m
            a.latency_frac = self.lat_frac
            a.latency_budget_us = self.lat_cap
            a.total_latency_us = lat_total
            a.dense_latency_us = self.dense_lat
        return a


# ─────────────────────────────── solvers ───────────────────────────────

_COMMON_PARAMS = """budget_frac : float, optional
        Byte budget as a fraction of the dense bytes, in (0, 1].
    budget_bpw : float, optional
        Byte budget in bits per weight (> 0).  Exactly one of ``budget_frac``
        and ``budget_bpw``.
    weights : sequence of float, optional
        Per-layer non-negative weights of the objective (default 1).
    latency_frac : float, optional
        Latency budget as a fraction of the all-dense latency at ``latency_m``,
        in (0, 1]; needs ``DecompOption.latency_us[latency_m]`` on every dense
        option (``ValueError`` naming the first layer without).  Options with
        no latency at ``latency_m`` are left out of the plan (counted in
        ``extra["options_without_latency"]``).
    latency_m : int
        Rows of the activation the latency budget is measured at (default 1).
    objective : {"weight", "output", "sensitivity"}
        What is summed over layers (times ``weights``): ``"weight"`` the
        weight-space ``rel_err`` (default); ``"output"`` the squared output
        error ``out_err**2`` on calibration data; ``"sensitivity"``
        ``LayerProfile.sensitivity * out_err**2`` (predicted model-output
        metric).  A layer profiled without calibration (``out_err`` None)
        falls back to ``rel_err**2`` (``"output"``) or ``rel_err**2`` times the
        mean sensitivity of the calibrated layers (``"sensitivity"``; a layer
        with ``out_err`` but no sensitivity uses that mean too); the number of
        such layers is in ``extra["objective_fallback_layers"]``.  Every
        ``"output"`` term, and every ``"sensitivity"`` term without a measured
        sensitivity, is multiplied by ``LayerProfile.prior_weight``.  ``total_err``,
        ``lower_bound`` and ``gap`` are all in the chosen objective.
    act_quant : {"auto", "ggml", "none"}
        ``"ggml"``: an ``"output"`` / ``"sensitivity"`` term adds the error
        llama.cpp's CPU matmul makes by rounding the layer's input to the
        option's activation type (Q8_0 blocks for Q4_0 ... Q8_0, Q8_K for the
        K-quants, F16 for F16; :data:`opscope_nb.formats.ggml.ACTIVATION_TYPES`),
        ``out_err**2 + act_err**2`` from ``LayerProfile.act_err`` (layers
        calibrated with it; others unchanged; their number is in
        ``extra["act_quant_layers"]``).  ``"auto"`` (default): ``"ggml"``
        when every option is a ggml type or dense (:func:`act_quant_mode`)."""


def greedy_allocate(layers, budget_frac=None, *, budget_bpw=None, weights=None,
                    latency_frac=None, latency_m=1, objective="weight",
                    act_quant="auto") -> Allocation:
    """Greedy Lagrangian allocation (the upstream rule).

    Start with every layer dense (option 0); while the plan exceeds the
    budget, apply the one swap to a smaller option with the least
    ``max(weight * d_err, 0) / bytes_saved`` (ties: first layer, first option).
    With a latency budget the swap minimises ``d_err`` per unit of summed
    relative overshoot removed (:func:`opscope_nb.kernels.greedy2_core`) and
    may end infeasible (``feasible=False``).

    Parameters
    ----------
    layers : sequence of LayerProfile
        Profiled layers; ``options[0]`` is dense.
    {params}

    Returns
    -------
    Allocation
    """
    pb = _Problem(layers, budget_frac, weights, budget_bpw, latency_frac, latency_m,
                  objective, act_quant)
    if not pb.feasible:
        return pb.result(pb.smallest(), "greedy")
    return pb.result(pb.greedy(), "greedy")


def dado_allocate(layers, budget_frac=None, cfg: DadoConfig = DadoConfig(), *,
                  budget_bpw=None, weights=None, latency_frac=None,
                  latency_m=1, objective="weight", act_quant="auto") -> Allocation:
    """DADO allocation: greedy warm start refined by cross-entropy search.

    Per-layer categorical marginals start at ``0.4/K`` plus ``0.6`` on the
    greedy choice; each of ``cfg.iters`` iterations samples ``cfg.pop``
    plans with xorshift64, keeps the best strictly feasible one, and refits
    the marginals to the elite with Laplace smoothing (see
    :func:`opscope_nb.kernels.dado_core`).  The greedy plan is the initial
    incumbent when it fits, so the result is never worse than greedy.

    Parameters
    ----------
    layers : sequence of LayerProfile
    cfg : DadoConfig
    {params}

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
    pb = _Problem(layers, budget_frac, weights, budget_bpw, latency_frac, latency_m,
                  objective, act_quant)
    if not pb.feasible:
        return pb.result(pb.smallest(), "dado")
    g = np.asarray(pb.greedy(), dtype=np.int64)
    n_elite = min(max(int(math.floor(pop * ef)), 1), pop)
    ch, _ = dado_core(pb.cost, pb.nbytes, pb.lat, pb.nopt, np.int64(pb.budget),
                      float(pb.lat_budget), g, iters, pop, n_elite, pen, np.uint64(seed))
    return pb.result(ch, "dado")


def _pareto_reduce(pb):
    """Per layer, the options not dominated by another (no more bytes, no more
    cost and - with a latency budget - no more latency; strictly better in one,
    or earlier on a full tie).  Dropping them cannot change the optimum value."""
    keep = []
    for i in range(len(pb.layers)):
        k = pb.nopt[i]
        b = pb.nbytes[i, :k]
        c = pb.cost[i, :k]
        if not pb.use_lat:
            order = np.lexsort((np.arange(k), c, b))  # bytes, then cost, then index
            kept = []
            best_c = math.inf
            for j in order:
                if c[j] < best_c:
                    kept.append(int(j))
                    best_c = c[j]
            keep.append(kept)
            continue
        t = pb.lat[i, :k]
        kept = []
        for j in range(k):
            dominated = False
            for q in range(k):
                if q == j or b[q] > b[j] or c[q] > c[j] or t[q] > t[j]:
                    continue
                if b[q] < b[j] or c[q] < c[j] or t[q] < t[j] or q < j:
                    dominated = True
                    break
            if not dominated:
                kept.append(j)
        keep.append(kept)
    return keep


def exact_allocate(layers, budget_frac=None, *, budget_bpw=None, weights=None,
                   time_limit=60.0, latency_frac=None, latency_m=1,
                   objective="weight", act_quant="auto") -> Allocation:
    """The optimal plan, from a MILP solved by HiGHS (:func:`scipy.optimize.milp`).

    Binaries ``x_ij`` (one per non-dominated option), ``sum_j x_ij = 1`` per
    layer, ``sum_ij b_ij x_ij <= B`` and, with a latency budget,
    ``sum_ij t_ij x_ij <= T``, minimising ``sum_ij w_i e_ij x_ij`` with a zero
    relative MIP gap.  HiGHS's console log is off (``disp=False``); its few
    bare-printf lines are not redirected here (a command-line front end may
    wrap the call in :func:`silence_native_output`).

    The byte row is divided by ``s = min(B, 2**17)`` with right-hand side
    ``(B + 0.25) / s``, so HiGHS's nominal feasibility tolerance (1e-6 on the
    scaled row) is below 0.15 byte at any budget (a row scaled by ``B``
    itself would let a 300 GB budget drift by 300 kB).  HiGHS's internal
    scaling can still let a plan a few bytes over ``B`` through at budgets of
    hundreds of GB, so the rounded plan is re-checked in exact integer bytes
    (and float latency); a plan over budget is cut off with a no-good
    constraint and the MILP re-solved (at most 25 times, within the same time
    limit; ``extra["cuts"]`` counts them).  The cut removes only that one
    plan, so the first plan that fits is still the optimum.

    ``extra["status"]`` says how the plan was found: ``"optimal"``;
    ``"time limit"`` (HiGHS's best plan when the limit stopped it; ``gap``
    against its dual bound tells how far from optimal it may be);
    ``"fallback to greedy (...)"`` (HiGHS returned no usable plan; the greedy
    plan is reported with an honest gap); ``"infeasible"`` (HiGHS proved no
    plan meets both budgets).

    Parameters
    ----------
    layers : sequence of LayerProfile
    {params}
    time_limit : float
        Seconds for HiGHS (finite, > 0).

    Returns
    -------
    Allocation
        ``lower_bound`` is the larger of the LP bound and HiGHS's dual bound,
        capped by ``total_err`` when HiGHS proved optimality (``bound`` says
        which).
    """
    if isinstance(time_limit, (bool, np.bool_)) or not isinstance(time_limit,
                                                                   numbers.Real):
        raise TypeError(f"time_limit must be a number of seconds; got {time_limit!r}.")
    if not (math.isfinite(float(time_limit)) and float(time_limit) > 0):
        raise ValueError(f"time_limit must be a finite number of seconds > 0; got "
                         f"{time_limit!r}.")
    pb = _Problem(layers, budget_frac, weights, budget_bpw, latency_frac, latency_m,
                  objective, act_quant)
    if not pb.feasible:
        return pb.result(pb.smallest(), "exact",
                         extra={"solver": "highs", "status": "infeasible"})
    model = _milp_model(pb)
    res, cuts = _solve_with_cuts(pb, model, float(time_limit))
    return _exact_result(pb, model, res, cuts, float(time_limit))


@dataclass
class _MilpModel:
    """The MILP of :func:`exact_allocate` over the non-dominated options."""

    var_layer: np.ndarray   # layer of each binary
    var_opt: np.ndarray     # option index (in the layer's table) of each binary
    cost: np.ndarray        # objective coefficients, scaled by ``cscale``
    cscale: float           # objective scale (HiGHS's absolute MIP gap -> relative)
    constraints: list       # LinearConstraint rows; no-good cuts are appended
    n_layers: int

    @property
    def n_vars(self) -> int:
        return int(self.var_layer.size)


def _milp_model(pb) -> _MilpModel:
    """Binaries, one-per-layer rows, the scaled byte row (and latency row)."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import csr_matrix
    keep = _pareto_reduce(pb)
    nl = len(keep)
    var_layer, var_opt = [], []
    for i, ks in enumerate(keep):
        var_layer += [i] * len(ks)
        var_opt += ks
    var_layer = np.asarray(var_layer, dtype=np.int64)
    var_opt = np.asarray(var_opt, dtype=np.int64)
    nv = var_layer.size
    c = pb.cost[var_layer, var_opt]
    b = pb.nbytes[var_layer, var_opt].astype(np.float64)
    # Bytes are integers, so ``<= B + 0.25`` admits exactly the plans that fit
    # once the tolerance (< 0.15 byte after this scaling) is added.
    sb = min(max(float(pb.budget), 1.0), _BYTE_ROW_SCALE_MAX)
    a_eq = csr_matrix((np.ones(nv), (var_layer, np.arange(nv))), shape=(nl, nv))
    cons = [LinearConstraint(a_eq, 1.0, 1.0),
            LinearConstraint(b[None, :] / sb, -np.inf, (pb.budget + 0.25) / sb)]
    if pb.use_lat:
        # relative tolerance 1e-6 / 1e4 = 1e-10, inside LATENCY_RTOL
        st = 1e4 / pb.lat_budget
        cons.append(LinearConstraint(pb.lat[var_layer, var_opt][None, :] * st,
                                     -np.inf, 1e4))
    # HiGHS keeps an absolute MIP gap of 1e-6 that scipy does not expose;
    # scaling the objective to a max of 1e4 makes it 1e-10 relative.
    cmax = float(c.max()) if nv else 0.0
    cscale = 1e4 / cmax if cmax > 1e-8 else 1e12  # (tiny costs: any plan is ~optimal)
    return _MilpModel(var_layer, var_opt, c * cscale, cscale, cons, nl)


def _plan_of(model, x):
    """The per-layer choice encoded by a 0/1 vector ``x``, or None when ``x`` is
    not exactly one option per layer."""
    nl = model.n_layers
    if np.count_nonzero(x) != nl or np.bincount(model.var_layer[x == 1],
                                                minlength=nl).max(initial=0) != 1:
        return None
    ch = [0] * nl
    for v in np.flatnonzero(x == 1):
        ch[int(model.var_layer[v])] = int(model.var_opt[v])
    return ch


def _solve_with_cuts(pb, model, time_limit):
    """Solve the MILP; cut off (no-good row) and re-solve any rounded plan that
    is over budget in exact bytes.  Returns ``(res, cuts)``: HiGHS's last result."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    # HiGHS may still accept a plan a few bytes over B (its tolerances are
    # applied after its own internal scaling).  Such a plan is cut off with a
    # no-good constraint (sum of its x_ij <= L - 1, excluding that plan only)
    # and the MILP re-solved: every plan that fits survives, so the first
    # returned plan that fits in exact integer bytes is optimal.
    nv, nl = model.n_vars, model.n_layers
    t_end = time.monotonic() + float(time_limit)
    cuts = 0
    while True:
        left = max(t_end - time.monotonic(), 1e-3)
        # disp=False: no HiGHS console log.  Its few bare-printf lines are left
        # alone here (see silence_native_output, for command-line front ends).
        res = milp(model.cost, constraints=model.constraints, integrality=np.ones(nv),
                   bounds=Bounds(0, 1),
                   options={"mip_rel_gap": 0.0, "time_limit": float(left),
                            "disp": False})
        if res.x is None or res.status == 2 or cuts >= _MAX_CUTS:
            break
        x = np.rint(res.x).astype(np.int64)
        ch = _plan_of(model, x)
        if ch is None or pb.fits(ch):
            break
        model.constraints.append(LinearConstraint((x == 1).astype(np.float64)[None, :],
                                                  -np.inf, nl - 1.0))
        cuts += 1
    return res, cuts


def _exact_result(pb, model, res, cuts, time_limit):
    """HiGHS's plan (or the greedy fallback), its status and the best valid bound."""
    lp = pb.lp_bound()
    greedy = pb.greedy()
    g_err, _ = pb.evaluate(greedy)
    g_fits = pb.fits(greedy)
    best, best_err, dual = greedy, (g_err if g_fits else math.inf), -math.inf
    why = ("time limit, no plan" if res.status == 1 else
           f"HiGHS status {res.status}: {res.message}")
    if res.status == 2 and not g_fits:
        status = "infeasible"
    else:
        status = f"fallback to greedy ({why})"
    if res.x is not None and res.status != 2:
        ch = _plan_of(model, np.rint(res.x).astype(np.int64))
        if ch is None:
            status = "fallback to greedy (HiGHS plan is not one option per layer)"
        elif not pb.fits(ch):
            status = "fallback to greedy (HiGHS plan over budget after rounding)"
        else:
            err, _ = pb.evaluate(ch)
            if err <= best_err:
                best, best_err = ch, err
                status = ("optimal" if res.status == 0 else
                          "time limit" if res.status == 1 else
                          f"HiGHS status {res.status}")
            else:
                status = "fallback to greedy (greedy beat HiGHS's plan at the limit)"
    db = getattr(res, "mip_dual_bound", None)
    if db is not None and math.isfinite(db) and res.status != 2:
        dual = float(db) / model.cscale
    extra = {"solver": "highs", "status": status, "variables": model.n_vars,
             "time_limit": float(time_limit), "cuts": int(cuts)}
    if status == "infeasible" or not math.isfinite(best_err):
        # HiGHS proved infeasibility (or found nothing, and greedy does not fit)
        lb = math.inf if status == "infeasible" else lp
        return pb.result(best, "exact", lower_bound=lb, extra=extra)
    # Both bounds are valid; a bound above a plan we hold can only come from
    # solver tolerances, and when HiGHS proved optimality (gap 0) the optimum
    # is that plan's value.
    lb = min(max(lp, dual), best_err)
    kind = ("optimum" if status == "optimal" else
            "milp-dual" if dual > lp else "lp")
    return pb.result(best, "exact", lower_bound=lb, extra=extra, bound=kind)


for _f in (greedy_allocate, dado_allocate, exact_allocate):
    if _f.__doc__:  # (python -OO strips docstrings)
        _f.__doc__ = _f.__doc__.replace("{params}", _COMMON_PARAMS)
del _f
