"""Section 8 of ``python bench.py``: every menu format through ``PackedLinear``,
streamed like a real decode.

For one real-sized layer shape ``[rows, cols]`` (PyTorch Linear layout
``[out, in]``; 4096 x 4096 in the full run) each kind of ``profile_layer``'s
menu runs as :class:`opscope_nb.runtime.PackedLinear` at ``m = 1`` (decode)
and ``m = 32`` (prefill) against the vendor f32 product (``x[m, cols] @
W^T``, OpenBLAS sgemv / sgemm) on the same shape.

**Streaming.** Each candidate owns a *stack* of different layers whose packed
bytes together exceed ``cfg["s8_l3_mult"]`` x the L3 cache, and every timed
call uses the next layer of the stack (cyclically), so the weights come from
DRAM as they do when a model decodes one token through all its layers --
timing one small matrix over and over would measure the cache.  Layer 0 of
the quantised / sparse / dense stacks is ``formats.pack`` of a Gaussian weight;
the others are its rows rotated (a different, equally valid packed matrix at
its own address).  The factor kinds (low-rank, Monarch, Tucker, TT) are their
factors: their stacks are random Gaussian factors in ``mining``'s layout
(packing a 4096 x 4096 weight by SVD many times would only add set-up time;
the kernel's work and bytes depend on the layout, not on the values).

Reported per kind and ``m``: µs per call, × vendor f32 (vendor time / ours),
GB/s of packed weight bytes read per call (and its fraction of the streaming
read bandwidth, the header's plain parallel sum timed again inside the same
interleaved rounds as the kernels), and the rel-L2 error of layer 0's output
against ``x @ W_hat^T`` in float64 (``W_hat = lin.dense()``).  Kinds with
integer-activation paths are timed with ``act="f32"`` and ``act="int8"``
(``cfg["s8_acts"]``; ``--quick`` times ``int8`` alone); a kind without a
runtime kernel yet is listed as such.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from opscope_nb.runtime import accel
from opscope_nb import formats
from opscope_nb.formats import Decomp, balanced_factor
from opscope_nb.io.synth import Dist, sample

from ._util import fmt, rel_l2, table, time_group
from .machine import stream_reader

__all__ = ["section8", "menu", "build_stack", "stack_caller"]

#: Kinds with an integer-activation path (timed with both ``act`` values).
QUANT_KINDS = ("int8", "int4", "int4g", "ternary", "intn")
#: Kinds whose stack is random factors in the packed layout.
FACTOR_KINDS = ("lowrank", "monarch", "tucker", "tt")


#: The int2/3/5/6 options section 8 times (one of each bit-width; the
#: targets of the issue that added them): int6/g128, int5/g32, int3/g32, int2/g32.
LOWBIT_MENU = ((6, 128), (5, 32), (3, 32), (2, 32))


def menu(rows, cols, r, group=32, lowbit=LOWBIT_MENU):
    """The menu of ``profile_layer`` for one shape (one low-rank ``r``).

    Returns
    -------
    list of Decomp : dense, int8/chan, int6/g128, int5/g32, int4/chan,
    int4/g``group``, int3/g32, int2/g32 (``lowbit``: ``(bits, group)`` pairs,
    kept where ``cols > group``), ternary, sparse2:4, lowrank(r), Monarch
    (square with a perfect-square side), Tucker and TT with the shapes and
    ranks ``profile_layer`` uses.
    """
    low = [Decomp.intn(b, g) for b, g in lowbit if cols > g]
    out = ([Decomp.dense(), Decomp.int8()] + [d for d in low if d.bits > 4]
           + [Decomp.int4(), Decomp.int4(group)] + [d for d in low if d.bits < 4]
           + [Decomp.ternary(), Decomp.sparse24(), Decomp.lowrank(r)])
    m = math.isqrt(rows)
    if rows == cols and m * m == rows and rows > 1:
        out.append(Decomp.monarch())
    c1, c2 = balanced_factor(cols)
    if c1 > 1 and c2 > 1:
        tr = (max(min(rows // 2, 32, cols), 1), max(c1 // 2, 1), max(c2 // 2, 1))
        out.append(Decomp.tucker((rows, c1, c2), tr))
    r1, r2 = balanced_factor(rows)
    if r1 > 1 and r2 > 1 and c1 > 1 and c2 > 1:
        out.append(Decomp.tt((r1, r2, c1, c2), 16))
    return out


def _random_factors(rows, cols, d, rng):
    from opscope_nb.runtime import expected_arrays

    out = {}
    for name, (dt, shp) in expected_arrays(rows, cols, d).items():
        fan = max(1, int(np.prod(shp[:-1]) if len(shp) > 1 else 1))
        a = rng.standard_normal(shp).astype(dt) / np.float32(math.sqrt(min(fan, 4096)))
        out[name] = np.ascontiguousarray(a)
    return out


def build_stack(rows, cols, d, target_bytes, seed=0, max_layers=4096):
    """A list of ``PackedLinear`` layers of kind ``d`` whose bytes together
    exceed ``target_bytes`` (at least 2 layers, at most ``max_layers``).

    Layer 0 is ``PackedLinear.pack`` of a Gaussian ``[rows, cols]`` weight
    (quantised, sparse and dense kinds) or random factors in the packed
    layout (factor kinds); layer ``i`` has the arrays of layer 0 with the
    rows rolled by ``i`` (copies, so each layer has its own memory).
    """
    from opscope_nb.runtime import PackedLinear

    rng = np.random.default_rng(seed)
    if d.kind in FACTOR_KINDS:
        first = PackedLinear(d, _random_factors(rows, cols, d, rng), (rows, cols))
    else:
        first = PackedLinear.pack(sample(Dist.GAUSSIAN, rows, cols, seed), d)
    count = int(min(max_layers, max(2, math.ceil(target_bytes / first.nbytes) + 1)))
    stack = [first]
    base = first.arrays
    for i in range(1, count):
        if d.kind in FACTOR_KINDS:
            arrays = _random_factors(rows, cols, d, rng)
        else:
            arrays = {n: np.ascontiguousarray(np.roll(a, i, axis=0)) for n, a in base.items()}
        stack.append(PackedLinear(d, arrays, (rows, cols)))
    return stack


def _cycle(calls):
    """A zero-argument callable that runs the next of ``calls`` each time."""
    state = [0]
    n = len(calls)

    def step():
        i = state[0]
        state[0] = i + 1 if i + 1 < n else 0
        return calls[i]()
    return step


def stack_caller(stack, x, act):
    """A zero-argument callable: each call runs the next layer of ``stack`` as
    ``layer(x, act)`` (arguments bound now, so loop variables cannot leak)."""
    return _cycle([functools.partial(lin, x, act) for lin in stack])


def section8(cfg, comp, res):
    """Every menu kind through ``PackedLinear``, streamed, vs vendor f32."""
    try:
        from opscope_nb import runtime
    except ImportError as exc:                      # pragma: no cover - in-tree
        why = f"opscope_nb.runtime does not import ({exc})"
        print(f"\n## 8. Every format: SKIPPED -- {why}")
        res["skipped"].append(f"8: {why}")
        res["8"] = {"skipped": why}
        return
    rows, cols = cfg["s8_shape"]
    l3 = res.get("machine", {}).get("l3_bytes") or (32 << 20)
    target = max(int(cfg["s8_l3_mult"] * l3), int(cfg["s8_min_bytes"]))
    bwinfo = res.get("bandwidth", {})
    bw0 = bwinfo.get("gb_s")
    decomps = menu(rows, cols, cfg["s8_rank"])
    missing = [d.label for d in decomps if not runtime.has_kernel(d.kind)]
    runnable = [d for d in decomps if runtime.has_kernel(d.kind)]

    stacks = {d.label: build_stack(rows, cols, d, target, seed=60 + i)
              for i, d in enumerate(runnable)}
    dense0 = {lbl: st[0].dense().astype(np.float64) for lbl, st in stacks.items()}
    vendor = None
    if accel.available():
        vrng = np.random.default_rng(59)
        nv = int(max(2, math.ceil(target / (4 * rows * cols)) + 1))
        vendor = [np.ascontiguousarray(vrng.standard_normal((cols, rows), np.float32))
                  for _ in range(nv)]
    # the streaming read joins every timing group, so each fraction compares
    # rounds taken side by side (the header's figure, measured minutes
    # earlier, moved by +-20 % between runs on a shared host)
    reader = None
    if bwinfo.get("bytes"):
        reader = stream_reader(bwinfo["bytes"], bwinfo.get("chunk_bytes", 16 << 20))
    out_rows, printed, bws = [], [], []
    for m in cfg["s8_m"]:
        x = sample(Dist.GAUSSIAN, m, cols, 70 + m)
        fns, meta = {}, {}
        if reader is not None:
            fns["stream read"] = reader[0]
        if vendor is not None:
            calls = [accel.sgemm_prepared(x, v) for v in vendor]
            comp.warm("vendor sgemm", calls[0])
            fns["vendor f32"] = _cycle(calls)
            meta["vendor f32"] = ("vendor", None, 4 * rows * cols, len(vendor), None)
        for d in runnable:
            stack = stacks[d.label]
            ref = np.asarray(x, np.float64) @ dense0[d.label].T
            acts = cfg.get("s8_acts", ("f32", "int8")) if d.kind in QUANT_KINDS else ("auto",)
            for act in acts:
                name = d.label if act == "auto" else f"{d.label} act={act}"
                y0 = comp.warm(f"PackedLinear {name}", lambda: stack[0](x, act))
                err = rel_l2(ref, y0)
                fns[name] = stack_caller(stack, x, act)
                meta[name] = (d.label, act, stack[0].nbytes, len(stack), err)
        # one interleaved group; every call uses the next layer of its stack, so
        # a block never re-reads a layer the cache could still hold
        t = time_group(fns, cfg["s8_reps"], cfg["timing"])
        tv = t.get("vendor f32")
        bw = (reader[2] / (t.pop("stream read") * 1e-3) / 1e9) if reader else bw0
        fns.pop("stream read", None)
        bws.append({"m": m, "gb_s": bw})
        for name in fns:
            label, act, nbytes, nlayers, err = meta[name]
            us = 1e3 * t[name]
            gbs = nbytes / (t[name] * 1e-3) / 1e9
            d = None if label == "vendor" else Decomp.from_label(label)
            flops = rows * cols if d is None else formats.flops(rows, cols, d)
            r = {"kind": "vendor f32" if d is None else label, "act": act, "m": m,
                 "rows": rows, "cols": cols, "us": us,
                 "x_vs_vendor": (tv / t[name]) if tv else None,
                 "weight_bytes": nbytes, "stack_layers": nlayers,
                 "stack_bytes": nbytes * nlayers, "gb_s": gbs,
                 "frac_of_stream_bw": (gbs / bw) if bw else None,
                 "flops_frac_of_dense": flops / (rows * cols),
                 "rel_err_vs_f64": err}
            out_rows.append(r)
            printed.append([f"{m}", name if d is not None else "vendor f32 (sgemv/sgemm)",
                            f"{nlayers} x {nbytes / 2**20:.2f}", fmt(us, ".1f"),
                            fmt(r["x_vs_vendor"], ".2f"), fmt(gbs, ".1f"),
                            fmt(r["frac_of_stream_bw"], ".2f"),
                            fmt(r["flops_frac_of_dense"], ".4f"),
                            "-" if err is None else fmt(err, ".1e")])
    where = ("weights stream from DRAM" if target > l3 else
             "NOT larger than L3 in this config: weights may come from cache")
    table(f"8. Every format through PackedLinear, {rows}x{cols} ([out, in]), each "
          f"candidate cycling through a stack of different layers > "
          f"{target / 2**20:.0f} MiB ({where}); x = vendor time / "
          f"ours; GB/s of packed weight bytes"
          + ("; stream fraction vs the streaming read timed in the same rounds ("
             + ", ".join(f"m={b['m']}: {b['gb_s']:.1f} GB/s" for b in bws) + ")"
             if reader else (f"; stream fraction vs {bw0:.1f} GB/s" if bw0 else "")),
          ["m", "format", "stack (layers x MiB)", "µs", "x vendor f32", "GB/s",
           "of stream BW", "flops / dense", "rel-L2 vs f64"], printed)
    if missing:
        print(f"  no runtime kernel yet: {', '.join(missing)}")
        res["skipped"].append(f"8: no PackedLinear kernel yet for {', '.join(missing)}")
    res["8"] = {"shape": [rows, cols], "stack_target_bytes": target, "l3_bytes": l3,
                "stream_gb_s": bws,
                "streamed": target > l3, "rows": out_rows, "no_kernel": missing,
                "verdict": _verdict(out_rows, missing, target > l3)}


def _verdict(rows, missing, streamed):
    lines = []
    if not any(r["x_vs_vendor"] for r in rows):
        return ["Formats: no vendor f32 to compare with."] if rows else []
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m and r["kind"] != "vendor f32"
              and r["x_vs_vendor"] is not None]
        if not at:
            continue
        best = {}
        for r in at:
            if r["kind"] not in best or r["x_vs_vendor"] > best[r["kind"]]["x_vs_vendor"]:
                best[r["kind"]] = r
        order = sorted(best.values(), key=lambda r: -r["x_vs_vendor"])
        parts = [f"{r['kind']}{'' if r['act'] in (None, 'auto') else ' (' + r['act'] + ')'}"
                 f" {r['x_vs_vendor']:.2f}x" for r in order]
        phase = "decode" if m == 1 else "prefill"
        how = "weights streamed" if streamed else "stacks fit L3"
        lines.append(f"Formats at m={m} ({phase}, {how}), speed vs vendor f32: "
                     + ", ".join(parts) + ".")
        slow = [r["kind"] for r in order if r["x_vs_vendor"] < 1.0]
        if slow:
            lines.append(f"At m={m} slower than the vendor's dense product: "
                         f"{', '.join(slow)}.")
        cheap = [r for r in order if r["kind"].startswith(("tucker", "tt"))
                 and r["flops_frac_of_dense"] < 0.10]
        for r in cheap:
            lines.append(f"{r['kind']} needs {100 * r['flops_frac_of_dense']:.2f} % of the "
                         f"dense flops and runs {r['x_vs_vendor']:.2f}x the vendor at m={m}"
                         + (" (faster, as its flop count promises)." if r["x_vs_vendor"] > 1
                            else " -- slower than dense despite the flop count."))
    if missing:
        lines.append(f"Formats without a PackedLinear kernel yet (not timed): "
                     f"{', '.join(missing)}.")
    return lines
