"""Section 7 of ``python bench.py``: verdict sentences computed from the run."""
from __future__ import annotations

from opscope_nb.runtime import accel

__all__ = ["section7"]


def _span(vals, spec=".2f"):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    a, b = format(lo, spec), format(hi, spec)
    return f"{a}x" if a == b else f"{a}-{b}x"


def section7(cfg, res):
    lines = []
    have_vendor = accel.available()
    s4 = res.get("4", {}).get("rows", [])
    names = {"vendor": "vendor f32", "f32": "our f32", "w8a16": "W8A16", "w8a8": "W8A8"}
    for phase, pick in (("decode (m=1)", lambda r: r["m"] == 1),
                        ("prefill (m>1)", lambda r: r["m"] > 1)):
        rows = [r for r in s4 if pick(r)]
        if not rows:
            continue
        winners = []
        for r in rows:
            cands = {nm: r[f"ms_{nm}"] for nm in names if f"ms_{nm}" in r}
            winners.append(min(cands, key=cands.get))
        tally = {w: winners.count(w) for w in set(winners)}
        best = max(tally, key=tally.get)
        s = (f"At {phase} {names[best]} is fastest on {tally[best]} of {len(rows)} "
             f"qwen shapes")
        if have_vendor:
            s += (f"; W8A8 runs {_span([r['x_w8a8_vs_vendor'] for r in rows])} the vendor "
                  f"f32, W8A16 {_span([r['x_w8a16_vs_vendor'] for r in rows])}, our f32 "
                  f"{_span([r['x_f32_vs_vendor'] for r in rows])}")
        s += (f" (W8A8 err {_span([r['err_w8a8'] for r in rows], '.4f').rstrip('x')}, "
              f"W8A16 err {_span([r['err_w8a16'] for r in rows], '.4f').rstrip('x')}).")
        lines.append(s)
        footprint = [r for r in rows if r["x_w8a16_vs_f32"] < 1.1]
        if footprint:
            lines.append(
                f"At {phase} W8A16 is no faster than our f32 (< 1.1x) on "
                f"{', '.join(r['label'] for r in footprint)}: there int8 weights buy "
                f"footprint (4x fewer bytes), not speed.")
    s5 = res.get("5", {}).get("rows", [])
    if s5 and have_vendor:
        xs = [(r["m"], r["x_w8a8_vs_vendor"]) for r in s5]
        wins = [m for m, x in xs if x >= 1.0]
        losses = [m for m, x in xs if x < 1.0]
        if wins and losses:
            lines.append(f"Crossover at k=n={res['5']['k']}: our W8A8 beats the vendor "
                         f"f32 at m in {wins} but loses at m in {losses}.")
        else:
            who = "our W8A8" if wins else "the vendor f32"
            lines.append(f"No crossover at k=n={res['5']['k']} over m in "
                         f"{[m for m, _ in xs]}: {who} wins throughout "
                         f"(W8A8 / vendor speed-up {_span([x for _, x in xs])}).")
        thr = [r.get("x_vendor_threads") for r in s5 if r.get("x_vendor_threads")]
        if thr:
            lines.append(f"Vendor threading: all threads vs one thread gives "
                         f"{_span(thr)} across m (the rest of its speed is the "
                         f"kernel, not the cores).")
    s6 = res.get("6", {}).get("rows", [])
    if len(s6) >= 2:
        a, b = s6[0], s6[-1]
        lines.append(
            f"Cache vs DRAM at m=1: W8A16 over our f32 goes from "
            f"{a['x_w8a16_vs_f32']:.2f}x ({a['n']}^2, {a['where']}) to "
            f"{b['x_w8a16_vs_f32']:.2f}x ({b['n']}^2, {b['where']}); W8A8 from "
            f"{a['x_w8a8_vs_f32']:.2f}x to {b['x_w8a8_vs_f32']:.2f}x"
            + (" -- the byte saving becomes speed once the weights stream from DRAM."
               if b["x_w8a16_vs_f32"] > a["x_w8a16_vs_f32"] else "."))
    s1 = res.get("1", {})
    if s1.get("rows"):
        sk = [r for r in s1["rows"] if r["kernel"] == "skip-zeros"][0]
        lines.append(f"Sparse activations ({100 * s1['density']:.0f} % non-zero): "
                     f"skip-zeros is {sk['speedup_vs_dense_ours']:.2f}x our dense"
                     + (f" and {sk['speedup_vs_vendor']:.2f}x the vendor sgemm"
                        if sk["speedup_vs_vendor"] is not None else "")
                     + (", bit-identical to dense." if s1["exact_vs_dense"] else "."))
    for key in ("8", "9"):
        # sections 8 (every packed format) and 9 (ONNX Runtime) write their
        # own sentences from their own figures
        lines.extend(res.get(key, {}).get("verdict", []))
    if not have_vendor:
        lines.append(f"No vendor comparison: {accel.why_unavailable()}")
    print("\n## 7. Verdict (generated from this run)")
    for s in lines:
        print(f"  - {s}")
    res["7"] = {"verdict": lines}


