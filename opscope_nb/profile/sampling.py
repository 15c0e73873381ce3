"""Row-sampled error estimates: every error a profile measures is a sum over
output rows, so a stratified sample of rows estimates it.

For a weight ``W`` ``[rows, cols]`` and an option that quantises each row on
its own (round to nearest, GPTQ given ``H``, the ggml block types, 2:4
pruning), the squared errors ``||W - Ŵ||²``, ``sum_j h_j (W - Ŵ)²_rj`` and
``tr((W - Ŵ) H (W - Ŵ)ᵀ)`` are sums of one term ``y_r`` per row.

Design (stratified, one row per stratum): the rows are cut into ``n``
contiguous strata of sizes ``N_h`` (``bounds = floor(h * rows / n)``, so
attention heads and other row groups are covered evenly) and one row is
drawn uniformly in each, seeded by the profile's seed and the tensor's name.
The total is estimated by the regression estimator ``T = sum_h N_h y_h + b
(X - sum_h N_h x_h)`` with ``x_r`` the row's own energy (``||w_r||²``, or
``w_r H w_rᵀ`` for the output error; ``X`` their exact sum over all rows) and
``b`` the sample's least-squares slope of ``y`` on ``x``: where a row's
relative error varies less than its error (weight error, round to nearest)
``b`` takes the ratio's part, and where the error hardly follows the row's
energy (GPTQ's output error on a low-rank gram: correlation 0.02-0.2 at a
7B block's shapes) it costs nothing, unlike the ratio estimator ``X sum N_h
y_h / sum N_h x_h``, which then adds ``x``'s own spread.  Its variance comes
from the residuals ``y - b x`` by collapsing neighbouring strata in pairs (a
final triple when ``n`` is odd), ``V = sum_g m/(m-1) sum_(h in g) (z_h -
mean_g)²`` with ``z_h = N_h (y_h - b x_h)`` (conservative; ``b`` taken as
known, as usual for a regression estimator at these sample sizes).  A
relative error ``sqrt(T / D)`` (``D`` exact) gets the standard error
``sqrt(V) / (2 sqrt(T D))`` (delta method).

Rows taken with certainty (:func:`certain_rows`): a row whose own ``x``
holds more than one stratum's share of the total (``x_r > X' / n``, ``X'``
the total of the rows not yet taken, repeated) is measured exactly and left
out of the strata, the slope and the variance.  A massive-activation output
channel holds 94.6 % of MPNet's FFN-down ``tr(W H Wᵀ)``: stratified with the
rest, the slope of ordinary rows was extrapolated to its energy and the
layer's ``out_err`` came out 20-25x too large.

``"auto"`` sizing: a pilot of :data:`AUTO_MIN_ROWS` strata, then the
smallest ``n = pilot * 2**L`` at which every option's 95 % interval is
within ±1 % of its error (:data:`TARGET`; errors under :data:`NEGLIGIBLE`
excepted), from the pilot's variances;
strata are nested (each splits in two), so the pilot's rows stay in the
sample and only the new rows are measured, and only for the options whose
pilot interval was too wide (the others keep the pilot's estimate).  When
that ``n`` reaches half the rows, every row is measured instead (exact,
standard error 0).  Tensors
under :data:`AUTO_MIN_WEIGHTS` weights or :data:`AUTO_MIN_ROWS` x 2 rows
always use every row.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

__all__ = ["AUTO_MIN_ROWS", "AUTO_MIN_WEIGHTS", "TARGET", "NEGLIGIBLE", "check_sample_rows", "sample_size",
           "strata_bounds", "certain_rows", "draw", "refine", "estimate", "relative", "rows_for_target"]

#: Rows of the pilot sample, and the least sample ``"auto"`` uses.
AUTO_MIN_ROWS = 256
#: Tensors with fewer weights are measured on every row under ``"auto"``.
AUTO_MIN_WEIGHTS = 1 << 20
#: ``"auto"``'s target: 95 % interval half-width / error.
TARGET = 0.01
#: Relative errors below this do not size ``"auto"``'s sample (their interval is
#: far below any difference between options that matters to a plan).
NEGLIGIBLE = 1e-3
_Z95 = 1.959963984540054


def check_sample_rows(value):
    """``"all"``, ``"auto"`` or a positive int; ``ValueError`` / ``TypeError`` otherwise."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("all", "auto"):
            return v
        try:
            value = int(v)
        except ValueError:
            raise ValueError(f"sample_rows must be 'auto', 'all' or a number of rows >= 2; got "
                             f"{value!r}. Pass e.g. sample_rows='auto'.") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"sample_rows must be 'auto', 'all' or an int >= 2; got "
                        f"{type(value).__name__} {value!r}.")
    if int(value) < 2:
        raise ValueError(f"sample_rows must be >= 2 rows (a variance needs two strata); got "
                         f"{value}. Pass 'all' to measure every row.")
    return int(value)


def sample_size(spec, rows: int, cols: int):
    """Strata of the first sample for ``spec`` (:func:`check_sample_rows`), or
    None for every row."""
    if spec == "all":
        return None
    if spec == "auto":
        if rows * cols < AUTO_MIN_WEIGHTS or rows < 2 * AUTO_MIN_ROWS:
            return None
        return AUTO_MIN_ROWS
    return None if spec * 2 > rows else int(spec)


def strata_bounds(rows: int, n: int) -> np.ndarray:
    """``floor(h * rows / n)`` for ``h = 0..n`` (int64 ``[n + 1]``)."""
    return (np.arange(n + 1, dtype=np.int64) * rows) // n


def _rng(seed: int, name: str, n: int):
    return np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8")), int(n)])


def certain_rows(aux, n: int) -> np.ndarray:
    """Rows taken with certainty: sorted int64 indices of the rows whose own
    auxiliary term is more than one stratum's share of what the strata hold.

    A row holding more than ``1/n`` of a total (a massive-activation output
    channel: 94.6 % of ``tr(W H Wᵀ)`` in one of MPNet's 768 FFN-down rows)
    would dominate the regression estimator through ``b (X - sum N_h x_h)``
    whether it is drawn or not (drawn: it sets the slope alone; missed: the
    slope of ordinary rows is extrapolated to its energy: 20-25x MPNet's out_err).
    Such rows are measured exactly, the rest stratified: repeatedly, a row is
    certain when its term exceeds ``(total - certain rows') / n`` in any of
    ``aux`` (probability-proportional-to-size design's rule), at most ``n // 2``
    rows (the largest shares first).

    Parameters
    ----------
    aux : sequence of ndarray of float64, shape (rows,) each, or None
        The auxiliary terms known on every row (None entries are skipped).
    n : int
        Strata of the sample.
    """
    xs = [np.asarray(x, np.float64) for x in aux if x is not None]
    if not xs:
        return np.zeros(0, np.int64)
    rows = xs[0].size
    take = np.zeros(rows, dtype=bool)
    cap = max(n // 2, 0)
    while True:
        share = np.zeros(rows)
        for x in xs:
            rest = float(x[~take].sum())
            if rest > 0.0:
                share = np.maximum(share, np.where(take, 0.0, x) * n / rest)
        new = share > 1.0
        if not new.any() or take.sum() >= cap:
            break
        room = cap - int(take.sum())
        cand = np.flatnonzero(new)
        if cand.size > room:
            cand = cand[np.argsort(-share[cand], kind="stable")[:room]]
        take[cand] = True
    return np.flatnonzero(take).astype(np.int64)


def _rest(rows: int, certain) -> np.ndarray:
    if certain is None or len(certain) == 0:
        return np.arange(rows, dtype=np.int64)
    keep = np.ones(rows, dtype=bool)
    keep[np.asarray(certain, np.int64)] = False
    return np.flatnonzero(keep).astype(np.int64)


def draw(rows: int, n: int, seed: int, name: str, certain=None) -> tuple:
    """One row per stratum: ``(idx, sizes)`` int64.

    Without ``certain`` (or an empty one), ``[n]`` each (``2 n <= rows``).  With
    ``certain`` (:func:`certain_rows`, ``k`` sorted rows), ``[k + n]``: the
    certain rows first (stratum size 1), then one row of each of ``n`` strata
    of the other rows (``n <= rows - k``)."""
    rest = _rest(rows, certain)
    b = strata_bounds(rest.size, n)
    sizes = np.diff(b)
    pos = b[:-1] + np.floor(_rng(seed, name, n).random(n) * sizes).astype(np.int64)
    k = rows - rest.size
    if k == 0:
        return pos, sizes
    return (np.concatenate([np.asarray(certain, np.int64), rest[pos]]),
            np.concatenate([np.ones(k, np.int64), sizes]))


def refine(rows: int, idx: np.ndarray, n: int, seed: int, name: str, certain: int = 0) -> tuple:
    """Nested refinement of a sample drawn with ``len(idx) - certain`` strata to
    ``n`` (a power-of-two multiple): ``(idx_n, sizes_n, home)`` where ``home[i]``
    is the new position of the old row ``idx[i]`` (the other strata hold fresh
    rows); the first ``certain`` rows (:func:`draw`'s certain rows) stay first."""
    k = int(certain)
    rest = _rest(rows, idx[:k])
    b = strata_bounds(rest.size, n)
    sizes = np.diff(b)
    fresh = b[:-1] + np.floor(_rng(seed, name, n).random(n) * sizes).astype(np.int64)
    pos = np.searchsorted(rest, idx[k:])                       # old rows among the rest
    home = np.searchsorted(b, pos, side="right") - 1          # each old row's new stratum
    out = fresh.copy()
    out[home] = pos
    if k == 0:
        return rest[out], sizes, home
    return (np.concatenate([idx[:k], rest[out]]), np.concatenate([np.ones(k, np.int64), sizes]),
            np.concatenate([np.arange(k, dtype=np.int64), k + home]))


def _collapsed_var(z: np.ndarray) -> float:
    """Collapsed-strata variance of ``sum z`` (one draw per stratum): pairs of
    neighbouring strata, a final triple when their number is odd."""
    n = z.size
    if n < 2:
        return 0.0
    starts = list(range(0, n, 2))
    if n % 2:
        starts = starts[:-1]                 # the last stratum joins the last pair
    var = 0.0
    for g in [z[s:s + 2] for s in starts[:-1]] + [z[starts[-1]:]]:
        m = g.size
        var += m / (m - 1) * float(((g - g.mean()) ** 2).sum())
    return var


def estimate(y: np.ndarray, sizes: np.ndarray, x: np.ndarray | None = None,
             x_total: float | None = None, exact: int = 0) -> tuple:
    """``(total, variance)`` of ``sum_r y_r`` from one row per stratum.

    Parameters
    ----------
    y : ndarray of float64, shape (n,)
        The sampled rows' terms, in stratum order.
    sizes : ndarray of int, shape (n,)
        Stratum sizes ``N_h``.
    x, x_total : optional
        An auxiliary term known on every row (``x`` on the sampled rows,
        ``x_total`` its exact sum over all rows): the **regression
        estimator** ``sum N_h y_h + b (x_total - sum N_h x_h)`` is used, ``b``
        the ``N_h``-weighted least-squares slope of ``y`` on ``x`` (exact
        when ``y`` is proportional to ``x``, the plain expansion estimator
        when they are unrelated), whose variance comes from the residuals
        ``y - b x``.  For a quantisation error ``x`` is the row's own energy
        ``||w_r||²`` (or ``w_r H w_rᵀ``).
    exact : int
        The first ``exact`` entries are rows taken with certainty
        (:func:`certain_rows`): summed as they are, left out of the slope and
        the variance, their ``x`` taken off ``x_total``.

    Returns
    -------
    (float, float)
        The estimated total and its estimated variance (0 when every row is
        in the sample).
    """
    nh = np.asarray(sizes, np.float64)
    y = np.asarray(y, np.float64)
    full = bool(np.all(nh == 1))
    k = int(exact)
    if k and not full:
        xk = None if x is None else np.asarray(x, np.float64)
        tot, var = estimate(y[k:], nh[k:], None if xk is None else xk[k:],
                            None if xk is None else float(x_total) - float(xk[:k].sum()))
        return float(y[:k].sum()) + tot, var
    if x is None:
        z = nh * y
        return float(z.sum()), (0.0 if full else _collapsed_var(z))
    x = np.asarray(x, np.float64)
    if full:
        return float((nh * y).sum()), 0.0
    wsum = float(nh.sum())
    xm = float((nh * x).sum()) / wsum
    ym = float((nh * y).sum()) / wsum
    sxx = float((nh * (x - xm) ** 2).sum())
    b = float((nh * (x - xm) * (y - ym)).sum()) / sxx if sxx > 0.0 else 0.0
    total = float((nh * y).sum()) + b * (float(x_total) - float((nh * x).sum()))
    return total, _collapsed_var(nh * (y - b * x))


def relative(total: float, var: float, den: float) -> tuple:
    """``(sqrt(total / den), standard error)``: the relative error and its
    delta-method standard error (0 when ``total`` or ``den`` is not positive)."""
    total = max(total, 0.0)
    if den <= 0.0:
        return (0.0 if total == 0.0 else math.inf), 0.0
    rel = math.sqrt(total / den)
    se = math.sqrt(max(var, 0.0)) / (2.0 * math.sqrt(total * den)) if total > 0 else 0.0
    return rel, se


def rows_for_target(rel: float, se: float, n: int, rows: int) -> int:
    """Strata needed for a 95 % half-width of :data:`TARGET` x ``rel`` given a
    sample of ``n`` strata with standard error ``se`` (variance ∝ ``1/n - 1/rows``).

    Errors below :data:`NEGLIGIBLE` do not size the sample (e.g. F16 of a BF16
    weight: a few subnormal rounding errors, wildly uneven across rows, at
    1e-5): they are still estimated, with their standard error."""
    if rel < NEGLIGIBLE or se <= 0.0:
        return n
    hw = _Z95 * se / rel
    if hw <= TARGET:
        return n
    inv = 1.0 / rows + (TARGET / hw) ** 2 * (1.0 / n - 1.0 / rows)
    return int(math.ceil(1.0 / inv)) if inv > 0 else rows
