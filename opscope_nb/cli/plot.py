"""``opscope-nb plot PROFILE.json -o rd.png``: per-layer error-vs-bytes points with
their lower convex hull, and the model-level error-vs-budget frontier of the
three allocators.

:func:`plot_data` computes everything drawn (tests compare it with the profile);
:func:`render` only draws it.
"""
from __future__ import annotations

import os

import numpy as np

from opscope_nb.io._fs import atomic_writer
from ._common import CliError, layers_from_doc, load_profile_doc, positive_int
from ._budget import METHODS, allocate_checked

NAME = "plot"
#: Budgets (fractions of dense bytes) of the frontier panel.
BUDGETS = tuple(round(float(b), 2) for b in np.arange(0.10, 1.0001, 0.05))


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="rate-distortion plot of a saved profile.json")
    p.add_argument("profile", metavar="PROFILE.json")
    p.add_argument("-o", "--output", default="rd.png", metavar="PNG",
                   help="output image (default rd.png)")
    p.add_argument("--dpi", type=positive_int, default=110)
    p.set_defaults(func=run)


def plot_data(layers, budgets=BUDGETS, methods=METHODS, path="profile") -> dict:
    """Everything the plot draws.

    Returns
    -------
    dict
        ``layers``: per layer ``{"name", "points": [(bytes/dense, rel_err), ...]
        (one per option, profile order), "hull": [...] (the vertices of the lower
        convex hull, from :func:`opscope_nb.plan.allocate.lower_hull` on linear
        bytes)}``; ``frontier``: per method ``{"budget": [...], "mean_err":
        [...]}`` over the budgets where that method's plan is feasible.
    """
    from opscope_nb.plan.allocate import lower_hull
    out = {"layers": [], "frontier": {}}
    for lp in layers:
        x = [o.bytes / lp.dense_bytes for o in lp.options]
        y = [float(o.rel_err) for o in lp.options]
        h = lower_hull(x, y)
        out["layers"].append({"name": lp.name, "points": list(zip(x, y)),
                              "hull": [(x[j], y[j]) for j in h]})
    n = len(layers)
    for m in methods:
        xs, ys = [], []
        for b in budgets:
            # the frontier is in the seed's units (sum of rel_err), like the hull
            a = allocate_checked(layers, {"budget_frac": b, "objective": "weight",
                                          "flag_damage": False}, (m,), path)[m][0]
            if a.feasible:
                xs.append(b)
                ys.append(a.total_err / n)
        out["frontier"][m] = {"budget": xs, "mean_err": ys}
    return out


def render(data: dict, title: str = ""):
    """Draw :func:`plot_data`'s dict; returns the matplotlib figure.

    Axis 0: one scatter per layer (its option points) and one line per layer
    (its hull), in layer order; axis 1: one line per method of the frontier.
    """
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    cmap = plt.get_cmap("viridis")
    nl = len(data["layers"])
    for i, d in enumerate(data["layers"]):
        col = cmap(i / max(nl - 1, 1))
        pts = d["points"]
        ax1.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color=col, alpha=0.7,
                    linewidths=0)
        h = d["hull"]
        ax1.plot([p[0] for p in h], [p[1] for p in h], color=col, lw=0.8, alpha=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("bytes / dense bytes (log scale; hulls taken in linear bytes)")
    ax1.set_ylabel("relative Frobenius error")
    ax1.set_title(f"{nl} layers: options and lower convex hulls")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, max(nl - 1, 1)))
    fig.colorbar(sm, ax=ax1, label="layer (profile order)")
    ax1.grid(True, which="both", alpha=0.3)
    styles = {"greedy": ("o-", "tab:orange"), "dado": ("s--", "tab:green"),
              "exact": ("^-", "tab:blue")}
    for m, f in data["frontier"].items():
        mk, col = styles.get(m, ("x-", None))
        ax2.plot(f["budget"], f["mean_err"], mk, color=col, ms=4, lw=1.2, label=m)
    ax2.set_xlabel("budget (fraction of dense bytes)")
    ax2.set_ylabel("mean relative error per layer")
    ax2.set_title("model frontier: error vs budget")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def run(args) -> int:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("plot needs the optional 'matplotlib' package: "
                       "pip install 'opscope-nb[plot]' (or pip install matplotlib).")
    doc = load_profile_doc(args.profile)
    layers = layers_from_doc(doc, args.profile)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"{args.output}: directory {out_dir} does not exist.")
    data = plot_data(layers, path=args.profile)
    src = (doc.get("source") or {}).get("path", "")
    fig = render(data, f"opscope-nb rate-distortion: {os.path.basename(str(src)) or src}")
    try:
        with atomic_writer(args.output, "wb") as f:
            fig.savefig(f, dpi=args.dpi, format="png")
    except OSError as exc:
        raise CliError(f"{args.output}: cannot write ({exc.strerror or exc}).")
    finally:
        plt.close(fig)
    print(f"wrote {args.output}")
    return 0
