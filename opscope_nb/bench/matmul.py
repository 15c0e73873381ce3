"""Sections 1-6 of ``python bench.py``: the matmul kernels against dense and
the vendor BLAS.

Each ``sectionN(cfg, comp, res)`` takes a config dict (``FULL`` / ``QUICK`` in
:mod:`opscope_nb.bench.main`), a :class:`~opscope_nb.bench._util.Compile`
recorder and the result dict, prints its table and stores its figures under
``res[str(N)]``.  Matmul layouts: ``x[m, k] @ w[k, n] -> y[m, n]`` (float32),
int8 weights output-major ``wt[n, k]``.
"""
from __future__ import annotations

import numba
import numpy as np

from opscope_nb.runtime import accel
from opscope_nb import kernels as K
from opscope_nb.io.synth import Dist, sample

from ._util import fmt, ratio, rel_l2, table, time_group, truth

__all__ = ["section1", "section2", "section3", "section4", "section5", "section6"]


def section1(cfg, comp, res):
    m, k, n = cfg["s1"]
    x = sample(Dist.SPARSE90, m, k, 1)
    w = sample(Dist.GAUSSIAN, k, n, 2)
    density = float(np.count_nonzero(x)) / x.size
    ref = truth(x, w)
    dense = comp.warm("dense_matmul", lambda: K.dense_matmul(x, w))
    skip = comp.warm("sparse_skip_matmul", lambda: K.sparse_skip_matmul(x, w))
    fns = {"dense (ours)": lambda: K.dense_matmul(x, w),
           "skip-zeros": lambda: K.sparse_skip_matmul(x, w)}
    vend = None
    if accel.available():
        vf = accel.sgemm_prepared(x, w)
        vend = vf()
        fns["dense (vendor sgemm)"] = vf
    t = time_group(fns, cfg["reps_mid"], cfg["timing"])
    exact = bool(np.array_equal(skip, dense))
    rows, out = [], []
    for name in fns:
        y = {"dense (ours)": dense, "skip-zeros": skip,
             "dense (vendor sgemm)": vend}[name]
        r = {"kernel": name, "ms": t[name],
             "speedup_vs_dense_ours": t["dense (ours)"] / t[name],
             "speedup_vs_vendor": ratio(t.get("dense (vendor sgemm)"), t[name]),
             "rel_err": rel_l2(ref, y)}
        out.append(r)
        rows.append([name, fmt(r["ms"]), fmt(r["speedup_vs_dense_ours"], ".2f"),
                     fmt(r["speedup_vs_vendor"], ".2f"), fmt(r["rel_err"], ".1e")])
    table(f"1. Sparse activations (density {100 * density:.1f} %) -> skip zeros, "
          f"{m}x{k}x{n}  [skip == dense bit for bit: {exact}]",
          ["kernel", "ms", "x vs dense ours", "x vs vendor", "rel-L2 vs f64"], rows)
    res["1"] = {"shape": [m, k, n], "density": density, "exact_vs_dense": exact,
                "rows": out}


def section2(cfg, comp, res):
    m, k, n = cfg["s1"]
    try:
        factorize = K.factorize
    except AttributeError:
        res["skipped"].append("2: opscope_nb.kernels.factorize is not available in "
                              "this checkout")
        print("\n## 2. Low-rank weight: SKIPPED (opscope_nb.kernels.factorize missing)")
        res["2"] = {"skipped": "factorize missing"}
        return
    from opscope_nb.profile.probe import stable_rank
    w = sample(Dist.LOWRANK, k, n, 3)
    x = sample(Dist.GAUSSIAN, m, k, 4)
    r = 8
    sr = float(stable_rank(w))
    u, v = comp.warm("factorize", lambda: factorize(w, r, 0))
    u = np.ascontiguousarray(u, np.float32)
    v = np.ascontiguousarray(v, np.float32)
    recon = rel_l2(w, K.dense_matmul(u, v))
    ref = truth(x, w)
    dense = comp.warm("dense_matmul", lambda: K.dense_matmul(x, w))
    fac = comp.warm("factored_matmul", lambda: K.factored_matmul(x, u, v))
    fns = {"dense (ours)": lambda: K.dense_matmul(x, w),
           f"factored r={u.shape[1]}": lambda: K.factored_matmul(x, u, v)}
    if accel.available():
        fns["dense (vendor sgemm)"] = accel.sgemm_prepared(x, w)
    t = time_group(fns, cfg["reps_mid"], cfg["timing"])
    tf = t[f"factored r={u.shape[1]}"]
    rows = [["dense (ours)", fmt(t["dense (ours)"]), "1.00", fmt(rel_l2(ref, dense), ".1e")],
            [f"factored r={u.shape[1]}", fmt(tf), fmt(t["dense (ours)"] / tf, ".2f"),
             fmt(rel_l2(ref, fac), ".1e")]]
    if "dense (vendor sgemm)" in t:
        rows.append(["dense (vendor sgemm)", fmt(t["dense (vendor sgemm)"]),
                     fmt(t["dense (ours)"] / t["dense (vendor sgemm)"], ".2f"), "-"])
    params = (k * n, u.size + v.size)
    table(f"2. Low-rank weight (stable rank {sr:.2f}) -> factorize r={r} + factored "
          f"matmul, {m}x{k}x{n}; reconstruction error {recon:.1e}; params "
          f"{params[0]} -> {params[1]}",
          ["kernel", "ms", "x vs dense ours", "rel-L2 vs f64"], rows)
    res["2"] = {"shape": [m, k, n], "rank": int(u.shape[1]), "stable_rank": sr,
                "recon_err": recon, "ms_dense": t["dense (ours)"], "ms_factored": tf,
                "ms_vendor": t.get("dense (vendor sgemm)"),
                "speedup_vs_dense": t["dense (ours)"] / tf,
                "err_dense": rel_l2(ref, dense), "err_factored": rel_l2(ref, fac),
                "params_dense": params[0], "params_factored": params[1]}


def section3(cfg, comp, res):
    from opscope_nb.profile.probe import per_channel_quant_error
    m, k, n = cfg["s1"]
    w = sample(Dist.GAUSSIAN, k, n, 5)
    x = sample(Dist.GAUSSIAN, m, k, 6)
    ref = truth(x, w)
    # Per output column = per row of w.T (the probe quantises rows).
    pcq = float(per_channel_quant_error(np.ascontiguousarray(w.T), 8))
    yq = comp.warm("quant_matmul", lambda: K.quant_matmul(x, w))
    wtq, sc = K.quantize_cols_t(w)
    comp.warm("matmul_w8a16", lambda: K.matmul_w8a16(x, wtq, sc))
    dense = K.dense_matmul(x, w)
    fns = {"dense f32 (ours)": lambda: K.dense_matmul(x, w),
           "quant_matmul (quantise + W8A16)": lambda: K.quant_matmul(x, w),
           "W8A16, weights pre-quantised": lambda: K.matmul_w8a16(x, wtq, sc)}
    t = time_group(fns, cfg["reps_mid"], cfg["timing"])
    wbytes = (k * n * 4, k * n + n * 4)
    rows = [[name, fmt(t[name]), fmt(t["dense f32 (ours)"] / t[name], ".2f"),
             fmt(rel_l2(ref, dense if name.startswith("dense") else yq), ".1e")]
            for name in fns]
    table(f"3. Per-channel int8 weights ({m}x{k}x{n}); weight error (q8/chan) "
          f"{pcq:.4f}; weight bytes {wbytes[0]} -> {wbytes[1]} "
          f"({wbytes[0] / wbytes[1]:.2f}x smaller)",
          ["kernel", "ms", "x vs dense ours", "rel-L2 vs f64"], rows)
    res["3"] = {"shape": [m, k, n], "weight_err_q8_chan": pcq,
                "err_quant_matmul": rel_l2(ref, yq), "err_dense": rel_l2(ref, dense),
                "bytes_f32": wbytes[0], "bytes_int8": wbytes[1],
                "ms": {name: t[name] for name in fns}}


def _matmul_case(k, n, m, seed_w, seed_x, comp, reps, timing, extra_vendor_1t=False):
    """Time vendor f32, our f32, W8A16, W8A8 for one shape; errors vs f64."""
    w = sample(Dist.GAUSSIAN, k, n, seed_w)
    x = sample(Dist.GAUSSIAN, m, k, seed_x)
    wt = K.transpose(w)
    wtq, sc = K.quantize_cols_t(w)
    xq, sx = K.quantize_rows_i8(x)
    ws = K.i8_row_sums(wtq)              # once per weight matrix
    pre = K.w8a8_prefill_kw(m, k, n)     # only the path this shape takes
    ref = truth(x, w)
    y = {"f32": comp.warm("matmul_f32", lambda: K.matmul_f32(x, wt)),
         "w8a16": comp.warm("matmul_w8a16", lambda: K.matmul_w8a16(x, wtq, sc)),
         "w8a8": comp.warm("matmul_w8a8", lambda: K.matmul_w8a8(xq, sx, wtq, sc, wsum=ws,
                                                                 **pre))}
    fns = {"f32": lambda: K.matmul_f32(x, wt),
           "w8a16": lambda: K.matmul_w8a16(x, wtq, sc),
           "w8a8": lambda: K.matmul_w8a8(xq, sx, wtq, sc, wsum=ws, **pre)}
    if accel.available():
        vf = accel.sgemm_prepared(x, w)
        y["vendor"] = vf()
        fns["vendor"] = vf
    t = time_group(fns, reps, timing)
    row = {"m": m, "k": k, "n": n}
    for name in fns:
        row[f"ms_{name}"] = t[name]
        row[f"err_{name}"] = rel_l2(ref, y[name])
    for name in ("f32", "w8a16", "w8a8"):
        row[f"x_{name}_vs_vendor"] = ratio(t.get("vendor"), t[name])
        row[f"x_{name}_vs_f32"] = t["f32"] / t[name]
    if extra_vendor_1t and accel.available():
        before = accel.get_threads()
        try:
            accel.set_threads(1)
            t1 = time_group({"v1": fns["vendor"]}, reps, timing)["v1"]
        finally:
            accel.set_threads(before or 1)
        row["ms_vendor_1thread"] = t1
        row["x_vendor_threads"] = t1 / t["vendor"]
    return row


def section4(cfg, comp, res):
    rows, out = [], []
    for (k, n, label) in cfg["qwen"]:
        for m in cfg["s4_m"]:
            reps = cfg["reps_fast"] if m == 1 else cfg["reps_mid"]
            r = _matmul_case(k, n, m, 7, 8, comp, reps, cfg["timing"])
            r["label"] = f"{label}-{'decode' if m == 1 else 'prefill'}"
            out.append(r)
            rows.append([r["label"], f"{m}x{k}x{n}", fmt(r.get("ms_vendor")),
                         fmt(r["ms_f32"]), fmt(r["x_f32_vs_vendor"], ".2f"),
                         fmt(r["ms_w8a16"]), fmt(r["x_w8a16_vs_vendor"], ".2f"),
                         fmt(r["x_w8a16_vs_f32"], ".2f"), fmt(r["err_w8a16"], ".4f"),
                         fmt(r["ms_w8a8"]), fmt(r["x_w8a8_vs_vendor"], ".2f"),
                         fmt(r["x_w8a8_vs_f32"], ".2f"), fmt(r["err_w8a8"], ".4f")])
    table("4. f32 vs W8A16 vs W8A8 on qwen-0.6B shapes (x = speed-up; err = rel-L2 "
          "vs f64)",
          ["layer", "m x k x n", "vendor f32 ms", "f32 ms", "x vendor",
           "W8A16 ms", "x vendor", "x f32", "err", "W8A8 ms", "x vendor", "x f32",
           "err"], rows)
    res["4"] = {"rows": out}


def section5(cfg, comp, res):
    k = n = cfg["s5_kn"]
    rows, out = [], []
    int8_note = ("vendor int8: " + ("BNNS int8 FC (Accelerate)" if accel.int8_fc
                 else f"none on this platform ({accel.backend()} has no int8 GEMM)"))
    for m in cfg["s5_m"]:
        reps = cfg["reps_fast"] if m == 1 else cfg["reps_mid"] if m <= 32 else cfg["reps_slow"]
        r = _matmul_case(k, n, m, 7, 8, comp, reps, cfg["timing"],
                         extra_vendor_1t=True)
        r["ms_vendor_int8"] = None
        if accel.int8_fc is not None and accel.available():
            r.update(_vendor_int8(k, n, m, reps, cfg["timing"]))
        out.append(r)
        rows.append([m, fmt(r["ms_f32"]), fmt(r.get("ms_vendor")),
                     fmt(ratio(r["ms_f32"], r.get("ms_vendor")), ".2f"),
                     fmt(r.get("ms_vendor_1thread")), fmt(r.get("x_vendor_threads"), ".2f"),
                     fmt(r["ms_w8a8"]), fmt(r["x_w8a8_vs_vendor"], ".2f"),
                     fmt(r["ms_vendor_int8"]),
                     fmt(ratio(r.get("ms_vendor"), r["ms_vendor_int8"]), ".2f")])
    table(f"5. Vendor comparison k=n={k} ({accel.backend()}, {numba.get_num_threads()} "
          f"numba threads; {int8_note})",
          ["m", "our f32 ms", "vendor f32 ms", "vendor x over ours",
           "vendor 1-thread ms", "all-threads x", "our W8A8 ms", "W8A8 x vendor",
           "vendor int8 ms", "vendor int8 x vendor f32"], rows)
    res["5"] = {"k": k, "n": n, "vendor_int8": int8_note, "rows": out}


def _vendor_int8(k, n, m, reps, timing):
    """macOS only (untested): BNNS int8 FC with per-tensor scales."""
    w = sample(Dist.GAUSSIAN, k, n, 7)
    x = sample(Dist.GAUSSIAN, m, k, 8)
    wtq, swt = K.quantize_row_i8(K.transpose(w))
    xq, sxt = K.quantize_row_i8(x)
    y, rc = accel.int8_fc(xq, sxt, wtq, swt)
    if rc != 0:
        return {"ms_vendor_int8": None, "vendor_int8_rc": rc}
    t = time_group({"i8": lambda: accel.int8_fc(xq, sxt, wtq, swt)}, reps,
                   timing)["i8"]
    return {"ms_vendor_int8": t, "err_vendor_int8": rel_l2(truth(x, w), y),
            "vendor_int8_rc": rc}


def section6(cfg, comp, res):
    rows, out = [], []
    l3 = res["machine"].get("l3_bytes")
    for kn in cfg["s6"]:
        reps = cfg["reps_dram"] if kn > 2048 else cfg["reps_fast"]
        r = _matmul_case(kn, kn, 1, 7, 8, comp, reps, cfg["timing"])
        mb = kn * kn * 4 / 1e6
        where = "?" if l3 is None else ("fits L3" if kn * kn * 4 <= l3 else "spills to DRAM")
        r["f32_weight_mb"] = mb
        r["where"] = where
        # weight bytes read per call / time, and its fraction of the streaming
        # read bandwidth measured in the header
        bw = res.get("bandwidth", {}).get("gb_s")
        for name, nbytes in (("f32", 4 * kn * kn), ("vendor", 4 * kn * kn),
                             ("w8a16", kn * kn + 4 * kn), ("w8a8", kn * kn + 4 * kn)):
            if r.get(f"ms_{name}"):
                r[f"gb_s_{name}"] = nbytes / (r[f"ms_{name}"] * 1e-3) / 1e9
                r[f"frac_bw_{name}"] = r[f"gb_s_{name}"] / bw if bw else None
        out.append(r)
        rows.append([f"{kn}x{kn}", f"{mb:.0f} MB ({where})", fmt(r["ms_f32"]),
                     fmt(r.get("ms_vendor")), fmt(r["ms_w8a16"]),
                     fmt(r["x_w8a16_vs_f32"], ".2f"), fmt(r["ms_w8a8"]),
                     fmt(r["x_w8a8_vs_f32"], ".2f"),
                     fmt(r.get("gb_s_f32"), ".1f"), fmt(r.get("gb_s_w8a8"), ".1f"),
                     fmt(r.get("frac_bw_w8a8"), ".2f"),
                     fmt(r["err_w8a16"], ".4f"), fmt(r["err_w8a8"], ".4f")])
    l3s = "unknown" if l3 is None else f"{l3 / 2**20:.0f} MiB"
    table(f"6. Cache vs DRAM at m=1 (L3 {l3s}): does the int8 byte saving become speed?",
          ["shape", "f32 weights", "f32 ms", "vendor ms", "W8A16 ms", "x f32",
           "W8A8 ms", "x f32", "f32 GB/s", "W8A8 GB/s", "W8A8 of stream BW",
           "err W8A16", "err W8A8"], rows)
    res["6"] = {"rows": out}


