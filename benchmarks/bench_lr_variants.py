#!/usr/bin/env python
"""Would other ``+lr`` composites be chosen more often?  Two variants, tested
on a calibrated profile.

The ``+lr{r}`` composites in the menu quantise first, then fit a rank-``r``
int8 correction of the residual in the gram's output space
(:func:`opscope_nb.formats.correction_factors`).  This script measures two
alternatives for every ``+gptq`` base option of each calibrated layer at
ranks 8 / 16 / 32.  The alternatives are measured here only; they are not in
the menu.

* ``int4``: the same fit, but with the factors quantised to 4 bits instead
  of 8 (one scale per vector; bytes counted as packed nibbles plus one
  float32 scale per rank).
* ``joint`` (fit the low rank first, in the manner of CALDERA):
  1. ``L`` = the rank-``r`` fit of ``W`` itself;
  2. GPTQ of ``W − L``;
  3. a fresh rank-``r`` fit of ``W − Q``, with int8 and with int4 factors.
  This costs one GPTQ run per rank.

Each variant's options are added to the profiled menu. The script then runs
the exact plan (``sensitivity`` objective) at each budget and prints:
* the predicted damage;
* how many layers take a composite, and how many of those are the new kind;
* the same plan with no composite at all (the ablation).

Input is a directory written by ``opscope-nb profile MODEL --calib --keep-grams
--out DIR`` (``profile.json`` + ``calib.npz``), for example one of
``benchmarks/bench_heldout.py``'s work directories.  The model weights are
read again from the profile's recorded source.  On all-MiniLM-L6-v2 (37
layers), this takes about 20 minutes on 2 cores.

Usage: ``python benchmarks/bench_lr_variants.py DIR [--bpw 6.4,4.8,4.0]
[--ranks 8,16,32] [--layers REGEX]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import time

import numpy as np

from opscope_nb import io as tio
from opscope_nb.plan.allocate import exact_allocate
from opscope_nb.profile.calib import load_grams
from opscope_nb.formats import approximate, correction_basis, correction_metric
from opscope_nb.formats.gptq import output_error
from opscope_nb.kernels import quantize_groups_sym
from opscope_nb.profile.mining import DecompOption, LayerProfile


def _factors(uf, vf, r, bits):
    """Dequantised ``U V`` of the leading ``r`` factors, each vector
    symmetric ``bits``-bit with one scale (as the menu's int8 factors)."""
    def q(x):
        codes, sc = quantize_groups_sym(np.ascontiguousarray(x, dtype=np.float32), bits,
                                        x.shape[1])
        return codes.astype(np.float64) * sc[:, :1]
    return q(uf[:, :r].T).T @ q(vf[:r])


def _variants(w, lay, g, ranks, seed=0):
    """Extra options ``(tag, DecompOption)`` for the ``+gptq`` bases of one layer."""
    rows, cols = w.shape
    metric = correction_metric(g)
    w64 = w.astype(np.float64)
    out = []
    for o in lay.options:
        d = o.decomp
        if d.lr is not None or d.rounding != "gptq":
            continue
        base = approximate(w, d, gram=g)
        ub, vb = correction_basis(w64 - base, max(ranks), g, seed=seed, metric=metric)
        ul, vl = correction_basis(w64, max(ranks), g, seed=seed, metric=metric)
        for r in ranks:
            if r > min(rows, cols):
                continue
            lw = _factors(ul, vl, r, 8)
            q2 = approximate((w64 - lw).astype(np.float32), d, gram=g)
            uj, vj = correction_basis(w64 - q2, r, g, seed=seed, metric=metric)
            for tag, rec, bits in (("int4", base + _factors(ub, vb, r, 4), 4),
                                   ("joint", q2 + _factors(uj, vj, r, 8), 8),
                                   ("joint+int4", q2 + _factors(uj, vj, r, 4), 4)):
                nb = o.bytes + (r * (rows + cols) * bits + 7) // 8 + 4 * r
                if nb >= lay.dense_bytes:
                    continue
                rel = float(np.linalg.norm(w64 - rec) / np.linalg.norm(w64))
                # a distinct Decomp per variant (the seed field only tells them apart here)
                dd = dataclasses.replace(d, lr=r, seed=1000 + len(tag) + bits)
                out.append((tag, DecompOption(dd, rel, int(nb), o.flops, {},
                                              float(output_error(w, rec, g)))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--bpw", default="6.4,4.8,4.0")
    ap.add_argument("--ranks", default="8,16,32")
    ap.add_argument("--layers", default=None, metavar="REGEX",
                    help="measure variants only for the layers matching REGEX")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    prof = json.load(open(os.path.join(args.dir, "profile.json")))
    grams, _ = load_grams(os.path.join(args.dir, "calib.npz"))
    src = tio.open_source(prof["source"]["path"])
    ent = {e.name: e for e in src.entries}
    layers = [LayerProfile.from_dict(x["profile"]) for x in prof["layers"]]
    print(f"# bench_lr_variants on {platform.machine()}, {os.cpu_count()} cores; "
          f"{prof['source']['path']}; ranks {ranks}")
    t0 = time.perf_counter()
    extra = {}
    for lay in layers:
        g = grams.get(lay.name)
        if g is not None and (args.layers is None or re.search(args.layers, lay.name)):
            w = np.asarray(ent[lay.name].load(), dtype=np.float32)
            extra[lay.name] = _variants(w, lay, g, ranks)
    print(f"variants measured in {time.perf_counter() - t0:.0f} s")
    # each variant's out_err against the menu's composite of the same base and rank
    menu_err = {(lay.name, o.decomp.with_correction(None).label, o.decomp.lr): o.out_err
                for lay in layers for o in lay.options if o.decomp.lr is not None}
    print("out_err / the menu's composite of the same base and rank, geometric mean "
          "(range) over layers and bases, by the base's bits:")
    for tag in ("int4", "joint", "joint+int4"):
        for r in ranks:
            by_bits = {}
            for name, opts in extra.items():
                for t, o in opts:
                    lab = o.decomp.with_correction(None).label
                    ref = menu_err.get((name, lab, r))
                    if t == tag and o.decomp.lr == r and ref:
                        by_bits.setdefault(int(re.match(r"int(\d)", lab).group(1)),
                                           []).append(o.out_err / ref)
            cells = [f"int{b} {np.exp(np.mean(np.log(v))):.3f} ({min(v):.2f}–{max(v):.2f})"
                     for b, v in sorted(by_bits.items())]
            print(f"  {tag:>10} r={r:<3} " + "  ".join(cells))

    def menu(keep_lr, tags):
        return [dataclasses.replace(lay, options=[
            o for o in lay.options if keep_lr or o.decomp.lr is None]
            + [o for t, o in extra.get(lay.name, []) if t in tags]) for lay in layers]

    menus = {"as profiled": menu(True, ()), "no composite": menu(False, ()),
             "+ int4 factors": menu(True, ("int4",)), "+ joint": menu(True, ("joint",)),
             "+ joint, int4": menu(True, ("joint+int4",))}
    print(f"{'bpw':>5} {'menu':>16} {'damage':>10} {'+lr layers':>11} {'new kind':>9}")
    for bpw in (float(x) for x in args.bpw.split(",")):
        for name, lays in menus.items():
            al = exact_allocate(lays, budget_bpw=bpw, objective="sensitivity")
            ds = [lay.options[j].decomp for lay, j in zip(lays, al.choice)]
            n_lr = sum(d.lr is not None for d in ds)
            n_new = sum(d.lr is not None and d.seed >= 1000 for d in ds)
            print(f"{bpw:>5.2f} {name:>16} {al.total_err:>10.6g} {n_lr:>5}/{len(lays):<5} "
                  f"{n_new:>9}", flush=True)


if __name__ == "__main__":
    main()
