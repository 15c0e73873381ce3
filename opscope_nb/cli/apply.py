"""``opscope-nb apply SOURCE PLAN [--method M] -o OUT.safetensors``: compress the
source checkpoint as ``plan.json`` says and write one safetensors file (packed
layers as ``<tensor>.<array>``, every other tensor copied, a JSON record with
each layer's Decomp and shape and a SHA-256 of each source tensor in the
metadata; see :mod:`opscope_nb.runtime.checkpoint`).  Source tensors are read one at a
time and the file is written atomically.

``-o OUT.gguf`` (from a ``.gguf`` SOURCE and a ``profile --menu ggml`` plan)
writes a GGUF file instead: every key-value and tensor of SOURCE in its order,
planned tensors in their ggml type, the others copied byte for byte; read back
and checked before it replaces OUT (:mod:`opscope_nb.io.gguf_export`).
``--tensor-type-file OUT.txt`` writes the plan as llama-quantize patterns and
the command (``OUT.txt.cmd``)."""
from __future__ import annotations

import os
import sys

from ._common import (CliError, Progress, first_run_notice, fmt_bytes, progress_enabled,
                      tabulate_rows)
from ._tensor_types import add_tensor_type_arg, imatrix_of, profile_doc_near, write_type_file

NAME = "apply"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="write the compressed checkpoint a plan.json describes")
    p.add_argument("source", metavar="SOURCE",
                   help="the checkpoint the plan was made from (.safetensors, .gguf, dir)")
    p.add_argument("plan", metavar="PLAN", help="plan.json from 'profile --out' / "
                   "'allocate --out'")
    p.add_argument("--method", default=None, metavar="M",
                   help="allocator whose plan to apply (default: exact when present, "
                        "else the first)")
    p.add_argument("-o", "--output", default=None, metavar="OUT.safetensors",
                   help="compressed checkpoint to write; OUT.gguf writes a GGUF file "
                        "(a .gguf SOURCE and a plan of ggml types / dense only)")
    p.add_argument("--grams", metavar="calib.npz", default=None,
                   help="calibration grams for +gptq layers (default: calib.npz next to "
                        "PLAN, written by 'profile --calib --out')")
    p.add_argument("--force", action="store_true",
                   help="apply even when the source's planned tensors differ from the "
                        "fingerprints (SHA-256 of the stored bytes) the plan records")
    p.add_argument("--requantize", action="store_true", default=None,
                   help="re-quantise a tensor planned in the ggml type it is stored in "
                        "(from its dequantised values, as llama-quantize's "
                        "--allow-requantize) instead of copying its stored blocks "
                        "(default: as the plan records, 'profile --requantize'; else copy)")
    p.add_argument("--over-budget", action="store_true",
                   help="write a plan whose layers take more bytes than the budget it "
                        "records (refused otherwise)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_tensor_type_arg(p)
    p.set_defaults(func=run)


def _restream(args, calib, want):
    """The plan's calibration run again (same text and token cap, no
    sensitivity), streamed block by block, handing each wanted gram to
    ``apply`` as its block finishes -- for profiles that kept no calib.npz."""
    from opscope_nb.profile.calib import CalibrationStream, StreamedGrams
    from opscope_nb.models import ModelError, UnsupportedModelError
    from opscope_nb.data import TEXT_KEYWORDS
    text = calib.get("text")
    if text is not None and text not in TEXT_KEYWORDS and not os.path.exists(text):
        raise CliError(f"{args.plan}: its calibration text {text} is gone and there is no "
                       f"calib.npz; give --grams FILE or restore the text.")
    show = progress_enabled(args)
    try:
        st = CalibrationStream(args.source, text=text, max_tokens=calib.get("max_tokens"),
                               full_max_cols=calib.get("full_max_cols"), sensitivity=False,
                               validate=float(calib.get("validate") or 0.0),
                               grams_for=want,
                               split_seed=int(calib.get("split_seed") or 0),
                               token_weights=calib.get("token_weights") == "norm",
                               log=(lambda m: print(m, file=sys.stderr, flush=True)) if show
                               else (lambda m: None))
    except (ModelError, UnsupportedModelError, ValueError) as exc:
        raise CliError(f"{args.plan}: cannot re-run its calibration on {args.source}: "
                       f"{exc}") from None
    if calib.get("tokens") is not None and int(calib["tokens"]) != st.tokens:
        raise CliError(f"{args.plan}: calibrated on {calib['tokens']} tokens, the text now "
                       f"gives {st.tokens}; give --grams FILE (the profile's calib.npz).")
    print(f"no calib.npz: re-running the calibration ({st.n_blocks} blocks, {st.tokens} "
          f"tokens, streamed) for the grams of {len(want)} layer(s)", flush=True)
    return StreamedGrams(st, want)


def _imatrix_grams(plan_path, names):
    """diag(H) per tensor from the imatrix the plan's profile used (GGUF export
    importance), or None."""
    path = imatrix_of(profile_doc_near(plan_path))
    if not path or not os.path.isfile(path):
        return None
    from opscope_nb.io.imatrix import ImatrixError, read_imatrix
    try:
        return dict(read_imatrix(path, names=sorted(names)).diag)
    except ImatrixError as exc:
        raise CliError(str(exc)) from None


def run(args) -> int:
    from opscope_nb.plan.apply import PlanError, apply_plan, read_plan
    from opscope_nb.formats import GramRequiredError
    from opscope_nb.io.gguf_export import GGUFExportError
    if args.output is None and not args.tensor_type_file:
        raise CliError("give -o OUT.safetensors / OUT.gguf, --tensor-type-file OUT.txt, "
                       "or both.")
    if args.tensor_type_file:
        try:
            _, plan, _ = read_plan(args.plan, args.method)
        except PlanError as exc:
            raise CliError(str(exc)) from None
        write_type_file(args.tensor_type_file, {n: d for n, (d, _) in plan.items()},
                        profile_doc_near(args.plan), source=args.source)
        if args.output is None:
            return 0
    out = args.output
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise CliError(f"{out}: directory {d} does not exist; create it first.")
    if os.path.isdir(out):
        raise CliError(f"{out}: is a directory; give a file name such as model.opscope.safetensors.")
    show = progress_enabled(args)
    first_run_notice(args)
    gpath = args.grams or os.path.join(os.path.dirname(os.path.abspath(args.plan)),
                                       "calib.npz")
    try:
        _, plan, pdoc = read_plan(args.plan, args.method)
    except PlanError as exc:
        raise CliError(str(exc)) from None
    need = sorted(n for n, (d, _) in plan.items() if d.rounding is not None)
    calib = pdoc.get("calib") if isinstance(pdoc.get("calib"), dict) else None
    # ggml types take the gram's diagonal as importance and +lr corrections
    # are fitted in its output space when there is one (as profile did)
    want = sorted(n for n, (d, _) in plan.items() if d.rounding is not None
                  or (d.reads_gram and (os.path.exists(gpath) or calib)))
    grams = None
    if want and not os.path.exists(gpath) and args.grams is None and calib is not None:
        grams = _restream(args, calib, want)
    elif want:        # only a plan with +gptq (or ggml) layers reads grams, only theirs
        if need and not os.path.exists(gpath):
            raise CliError(f"{args.plan}: {len(need)} +gptq layer(s) (e.g. {need[0]}) need "
                           f"calibration grams; no {gpath} (give --grams FILE).")
        from opscope_nb.profile.calib import GramsError, load_grams
        try:
            allg, gmeta = load_grams(gpath)
        except (OSError, GramsError) as exc:
            raise CliError(f"{gpath}: cannot read calibration grams ({exc}).") from None
        tw_plan = (calib or {}).get("token_weights") or "none"
        tw_file = (gmeta or {}).get("token_weights") or "none"
        if calib is not None and tw_plan != tw_file:
            raise CliError(f"{gpath}: grams made with --token-weights {tw_file}, but the plan "
                           f"was profiled with --token-weights {tw_plan}; give --grams FILE "
                           f"(that profile's calib.npz) or remove {gpath} to re-run the "
                           f"calibration.")
        grams = {n: allg[n] for n in want if n in allg}
        del allg
    elif args.grams and not os.path.exists(args.grams):
        raise CliError(f"{args.grams}: no such file.")
    if grams is None and out.lower().endswith(".gguf"):
        try:
            names = read_plan(args.plan, args.method)[1]
        except PlanError as exc:
            raise CliError(str(exc)) from None
        grams = _imatrix_grams(args.plan, names)
    estimates = _sampled_estimates(args.plan, plan)
    try:
        r = apply_plan(args.source, args.plan, out, method=args.method,
                       make_progress=lambda n, w: Progress(n, w, show), grams=grams,
                       force=args.force, requantize=args.requantize,
                       over_budget=args.over_budget, measure=set(estimates))
    except (PlanError, GGUFExportError) as exc:
        raise CliError(str(exc)) from None
    except GramRequiredError as exc:
        raise CliError(f"{args.plan}: a +gptq layer needs calibration grams: {exc} "
                       f"(looked for {gpath}).") from None
    if r.get("format") == "gguf":
        types = ", ".join(f"{k} x{v}" for k, v in sorted(r["types"].items()))
        print(f"{r['method']}: {r['planned']} tensors re-quantised, {r['as_stored']} planned "
              f"in their stored type and {r['planned_dense']} planned dense (kept as "
              f"stored), {r['tensors']} tensors, {r['kv']} key-values ({types}); "
              f"general.file_type {_ftype_text(r)}")
        print(f"wrote {out}: {fmt_bytes(r['file_bytes'])} = planned {r['planned_bytes']} B "
              f"+ kept {r['kept_bytes']} B + header/padding {r['header_bytes']} B "
              f"({8 * r['file_bytes'] / max(r['weights'], 1):.3f} bits/weight over all "
              f"{r['weights']} weights of the file); read back and checked")
        print(_plan_bytes_line(r))
        _print_estimates(estimates, r.get("full_errors") or {})
        return 0
    print(f"{r['method']}: {r['layers']} layers packed, {r['dense_layers']} planned dense, "
          f"{r['tensors']} tensors stored plain"
          + (f", {len(r['skipped'])} non-float tensors not copied ({', '.join(r['skipped'][:3])}"
             f"{', ...' if len(r['skipped']) > 3 else ''})" if r["skipped"] else ""))
    print(f"wrote {out}: {fmt_bytes(r['out_bytes'])} of arrays "
          f"(source {fmt_bytes(r['source_bytes'])} as stored)")
    print(_plan_bytes_line(r))
    _print_estimates(estimates, r.get("full_errors") or {})
    return 0


def _sampled_estimates(plan_path, plan) -> dict:
    """``{name: option record}`` of the planned tensors whose errors the profile
    next to ``plan_path`` estimated from a row sample (``profile --sample-rows``)."""
    out = {}
    for rec in profile_doc_near(plan_path).get("layers") or []:
        prof = rec.get("profile") if isinstance(rec, dict) else None
        if not isinstance(prof, dict):
            continue
        smp, name = prof.get("sample") or {}, prof.get("name")
        if name not in plan or not smp or smp.get("rows", 0) >= smp.get("of", 0):
            continue
        label = plan[name][0].label
        for o in prof.get("options") or []:
            if o.get("label") == label and o.get("rel_err_se") is not None:
                out[name] = o
    return out


def _print_estimates(estimates, full) -> None:
    """The row-sample estimates of the written tensors beside their full errors."""
    rows, worst = [], 0.0
    for name, o in estimates.items():
        f = full.get(name)
        if f is None:
            continue
        cells = [name, o["label"]]
        for key in ("rel_err", "out_err"):
            est, se, got = o.get(key), o.get(key + "_se"), f.get(key)
            if est is None or got is None:
                cells += ["-", "-"]
                continue
            cells += [f"{est:.5f} +-{1.96 * (se or 0.0):.5f}", f"{got:.5f}"]
            if got > 0:
                worst = max(worst, abs(est / got - 1.0))
        rows.append(cells)
    if not rows:
        return
    print(f"\nrow-sampled estimates of {len(rows)} tensor(s) against their full errors "
          f"(largest difference {worst:.2%}):")
    shown = sorted(rows, key=lambda c: c[0])
    print(tabulate_rows(shown[:12], ["tensor", "option", "rel_err est (95%)", "rel_err full",
                                     "out_err est (95%)", "out_err full"]))
    if len(shown) > 12:
        print(f"... {len(shown) - 12} more")


def _plan_bytes_line(r) -> str:
    """The planned layers' bytes and bits per weight as written and as planned
    (apply_plan has checked them within 0.1 %)."""
    nw = r.get("plan_weights") or 0
    got, want = r["written_plan_bytes"], r["plan_bytes"]
    bpw = (lambda b: f"{8 * b / nw:.3f}") if nw else (lambda b: "-")
    return (f"planned layers: {got} B written = {bpw(got)} bits/weight over {nw} weights "
            f"(plan: {want} B = {bpw(want)} bits/weight; checked within 0.1 %)")


def _ftype_text(r) -> str:
    """``general.file_type`` as llama.cpp names it (``15 = MOSTLY_Q4_K_M``)."""
    from opscope_nb.io.gguf_export import FTYPE_GUESSED
    ft = int(r["file_type"])
    try:
        import gguf
        name = gguf.LlamaFileType(ft & ~FTYPE_GUESSED).name
    except (ImportError, ValueError):
        name = "?"
    kept = " (the source's, no tensor changed type)" if r.get("file_type_kept") else ""
    return f"{ft} = {name}{' | GUESSED' if ft & FTYPE_GUESSED else ''}{kept}"
