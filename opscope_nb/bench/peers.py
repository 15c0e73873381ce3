"""Section 9 of ``python bench.py``: ONNX Runtime side by side (optional).

What a user would pick instead of our int8 kernels on a CPU is ONNX Runtime
(MLAS).  For each weight ``w`` (PyTorch Linear layout ``[n, k]`` = ``[out,
in]``) the section builds three one-node graphs in memory with
``onnx.helper`` (no model files) and times them against our kernels on the
same activations ``x[m, k]``, in the same interleaved best-block loop:

=====================================  ==========================================
ONNX Runtime                           ours
=====================================  ==========================================
``MatMul`` f32, ``W = w.T [k, n]``     ``matmul_f32(x, w)`` (output-major)
``DynamicQuantizeMatMul`` (int8 B      W8A8: ``dynamic_matmul_w8a8`` (=
``[k, n]`` = our int8/chan codes,      ``quantize_rows_i8`` + ``matmul_w8a8``,
per-column ``b_scale [n]``)            fused) -- the activation quantisation
                                       is inside the timed call;
                                       the weight code sums (``i8_row_sums``)
                                       are computed once, as ORT pre-packs B
``MatMulNBits`` bits=4, block 32,      W4A8: ``PackedLinear`` int4/g32,
``accuracy_level=4`` (int8 compute),   ``act="int8"`` -- only when the runtime
B = our int4/g32 nibbles + 8,          has an int4/g32 kernel
scales ``[n * k/32]``, zero point 8
=====================================  ==========================================

Both libraries get the same weights (``formats.pack`` codes and scales) and
the same thread count: ONNX Runtime's intra-op pool = numba's thread count,
inter-op 1.  Errors are rel-L2 vs the float64 product with the float weight.
Without ``onnxruntime``/``onnx`` the section prints how to enable it
(``pip install -e ".[peers]"``) and is skipped.
"""
from __future__ import annotations

import numba
import numpy as np

from opscope_nb import kernels as K
from opscope_nb import formats
from opscope_nb.formats import Decomp
from opscope_nb.io.synth import Dist, sample

from ._util import fmt, rel_l2, table, time_group

__all__ = ["section9", "ort_sessions", "peers_available"]

ENABLE = 'pip install -e ".[peers]"'


def peers_available() -> str:
    """``""`` when onnxruntime and onnx import, else why not."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or 'onnxruntime'} is not installed ({ENABLE})"
    return ""


def ort_sessions(w, threads, *, packed8=None, packed4=None):
    """ONNX Runtime sessions for ``y = x @ w.T`` in three formats.

    Parameters
    ----------
    w : float32 [n, k]
        Linear layout ``[out, in]``; ``k`` a multiple of 32 for MatMulNBits.
    threads : int
        ONNX Runtime intra-op threads.
    packed8, packed4 : dict, optional
        ``formats.pack(w, Decomp.int8())`` / ``Decomp.int4(32)`` (computed when
        omitted).

    Returns
    -------
    dict : ``{"MatMul f32": sess, "DynamicQuantizeMatMul": sess,
    "MatMulNBits 4b/32": sess}``; each ``sess.run(["Y"], {"X": x})`` takes
    ``x`` float32 ``[m, k]`` and returns ``[y]`` with ``y`` float32 ``[m, n]``.
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    p8 = formats.pack(w, Decomp.int8()) if packed8 is None else packed8
    p4 = formats.pack(w, Decomp.int4(32)) if packed4 is None else packed4

    def session(node, inits):
        g = helper.make_graph(
            [node], "layer",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])],
            initializer=[numpy_helper.from_array(np.ascontiguousarray(a), nm)
                         for nm, a in inits.items()])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 9          # readable by every onnxruntime >= 1.17
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])

    out = {"MatMul f32": session(helper.make_node("MatMul", ["X", "W"], ["Y"]),
                                 {"W": np.ascontiguousarray(w.T)})}
    out["DynamicQuantizeMatMul"] = session(
        helper.make_node("DynamicQuantizeMatMul", ["X", "B", "S"], ["Y"],
                         domain="com.microsoft"),
        {"B": p8["codes"].T, "S": p8["scales"]})
    if k % 32 == 0:
        # two's-complement nibble t holds v; MatMulNBits wants v + 8 = t ^ 8
        b4 = (p4["codes"] ^ np.uint8(0x88)).reshape(n, k // 32, 16)
        out["MatMulNBits 4b/32"] = session(
            helper.make_node("MatMulNBits", ["X", "B", "S"], ["Y"], domain="com.microsoft",
                             K=k, N=n, bits=4, block_size=32, accuracy_level=4),
            {"B": b4, "S": p4["scales"].reshape(-1)})
    return out


def _w4a8(w, p4):
    """Our W4A8 callable ``f(x) -> y`` or ``None`` when the runtime has no
    int4/g32 kernel yet."""
    try:
        from opscope_nb import runtime
    except ImportError:
        return None
    if not runtime.has_kernel("int4g"):
        return None
    lin = runtime.PackedLinear(Decomp.int4(32), p4, w.shape)
    return lambda x: lin(x, act="int8")


def section9(cfg, comp, res):
    """ONNX Runtime vs ours on ``cfg["peer_shapes"]`` (k, n) at ``cfg["peer_m"]``."""
    why = peers_available()
    if why:
        print(f"\n## 9. Peers (ONNX Runtime): SKIPPED -- {why}")
        res["skipped"].append(f"9: {why}")
        res["9"] = {"skipped": why}
        return
    import onnxruntime as ort

    threads = numba.get_num_threads()
    rows, out = [], []
    w4a8_missing = False
    for i, (k, n) in enumerate(cfg["peer_shapes"]):
        w = sample(Dist.GAUSSIAN, n, k, 40 + i)               # [out, in]
        p8 = formats.pack(w, Decomp.int8())
        p4 = formats.pack(w, Decomp.int4(32))
        sess = ort_sessions(w, threads, packed8=p8, packed4=p4)
        codes8, sc8 = p8["codes"], p8["scales"]
        ws8 = K.i8_row_sums(codes8)      # once per weight, like ORT's PrePack
        w4 = _w4a8(w, p4)
        w4a8_missing |= w4 is None
        for m in cfg["peer_m"]:
            x = sample(Dist.GAUSSIAN, m, k, 50 + i)
            feed = {"X": x}
            pre = K.w8a8_prefill_kw(m, k, n)     # only the path this shape takes
            fns = {"ours f32": lambda: K.matmul_f32(x, w),
                   "ours W8A8": lambda: K.dynamic_matmul_w8a8(x, codes8, sc8, wsum=ws8,
                                                              **pre)}
            if w4 is not None:
                fns["ours W4A8"] = lambda: w4(x)
            for name, s in sess.items():
                fns[f"ORT {name}"] = (lambda s=s: s.run(["Y"], feed))
            ys = {}
            for name, fn in fns.items():
                y = comp.warm(name, fn)
                ys[name] = y[0] if isinstance(y, list) else y
            reps = cfg["reps_fast"] if m == 1 else cfg["reps_mid"]
            t = time_group(fns, reps, cfg["timing"])
            ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
            r = {"m": m, "k": k, "n": n,
                 "ms": dict(t), "err": {nm: rel_l2(ref, y) for nm, y in ys.items()}}
            r["x_f32_vs_ort"] = t["ORT MatMul f32"] / t["ours f32"]
            r["x_w8a8_vs_ort"] = t["ORT DynamicQuantizeMatMul"] / t["ours W8A8"]
            r["x_w4a8_vs_ort"] = (t["ORT MatMulNBits 4b/32"] / t["ours W4A8"]
                                  if "ours W4A8" in t and "ORT MatMulNBits 4b/32" in t
                                  else None)
            out.append(r)
            rows.append([f"{m}x{k}x{n}", fmt(t["ours f32"]), fmt(t["ORT MatMul f32"]),
                         fmt(r["x_f32_vs_ort"], ".2f"), fmt(t["ours W8A8"]),
                         fmt(t["ORT DynamicQuantizeMatMul"]), fmt(r["x_w8a8_vs_ort"], ".2f"),
                         fmt(t.get("ours W4A8")), fmt(t.get("ORT MatMulNBits 4b/32")),
                         fmt(r["x_w4a8_vs_ort"], ".2f"),
                         fmt(r["err"]["ours W8A8"], ".4f"),
                         fmt(r["err"]["ORT DynamicQuantizeMatMul"], ".4f"),
                         fmt(r["err"].get("ours W4A8"), ".4f"),
                         fmt(r["err"].get("ORT MatMulNBits 4b/32"), ".4f")])
    table(f"9. Peers: ONNX Runtime {ort.__version__} (MLAS, {threads} intra-op threads = "
          f"our {threads} numba threads) vs ours; x = ORT time / our time (> 1: ours "
          f"faster); W8A8 = dynamic_matmul_w8a8 (activation quantisation included); same int8 / int4-g32 codes for both",
          ["m x k x n", "our f32 ms", "ORT MatMul ms", "x", "our W8A8 ms",
           "ORT DQMatMul ms", "x", "our W4A8 ms", "ORT NBits ms", "x",
           "err W8A8", "err ORT DQ", "err W4A8", "err ORT NBits"], rows)
    verdict = _verdict(out, w4a8_missing)
    note = _peer_precision_note(out)
    if note:
        print(note)
        verdict.append(note)
    res["9"] = {"onnxruntime": ort.__version__, "threads": threads, "rows": out,
                "verdict": verdict}
    if w4a8_missing:
        res["skipped"].append("9: our W4A8 (no int4/g32 kernel in opscope_nb.runtime yet)")


#: Relative error above which ORT's DynamicQuantizeMatMul is called out.
_ORT_DQ_NOTE_ERR = 0.02


def _peer_precision_note(rows):
    """A finding about ONNX Runtime's own W8A8 precision (``None`` when it is
    as precise as ours).  Without VNNI, MLAS's u8 x s8 kernel sums adjacent
    products with ``vpmaddubsw``, whose int16 pair sums saturate for an
    asymmetric u8 activation (up to 255) times int8 weights (up to 127):
    2 * 255 * 127 > 32767.  Our W8A8 keeps the activation symmetric (|x| <= 127
    on the unsigned side), so its pair sums never saturate."""
    errs = [r["err"]["ORT DynamicQuantizeMatMul"] for r in rows]
    ours = [r["err"]["ours W8A8"] for r in rows]
    if not errs or max(errs) <= _ORT_DQ_NOTE_ERR:
        return None
    return (f"Peers precision: ORT DynamicQuantizeMatMul error {min(errs):.4f}-"
            f"{max(errs):.4f} (ours W8A8 {min(ours):.4f}-{max(ours):.4f}) -- MLAS's "
            f"non-VNNI u8s8 kernel saturates int16 pair sums (vpmaddubsw: "
            f"2 x 255 x 127 > 32767); a property of the peer, not of our kernels.")


def _verdict(rows, w4a8_missing):
    lines = []
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]

        def span(key):
            v = [r[key] for r in at if r[key] is not None]
            if not v:
                return None
            a, b = f"{min(v):.2f}", f"{max(v):.2f}"
            return f"{a}x" if a == b else f"{a}-{b}x"

        wins = sum(r["x_w8a8_vs_ort"] >= 1.0 for r in at)
        s = (f"Peers at m={m}: our W8A8 (activation quantisation included) runs "
             f"{span('x_w8a8_vs_ort')} the speed of ONNX Runtime DynamicQuantizeMatMul "
             f"(ours faster on {wins} of {len(at)} shapes); our f32 {span('x_f32_vs_ort')} "
             f"ORT MatMul f32")
        s += (f"; our W4A8 {span('x_w4a8_vs_ort')} ORT MatMulNBits (4-bit, block 32)."
              if span("x_w4a8_vs_ort") else ".")
        lines.append(s)
    if w4a8_missing:
        lines.append("Peers: W4A8 not timed -- opscope_nb.runtime has no int4/g32 "
                     "kernel yet (ORT MatMulNBits timed alone).")
    return lines
