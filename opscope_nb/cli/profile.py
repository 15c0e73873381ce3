"""``opscope-nb profile [SOURCE]``: mine every option of every selected weight
(:func:`opscope_nb.profile.mining.profile_layer`), solve the budget with the greedy, DADO
and exact allocators and print the plan; ``--out DIR`` writes ``profile.json``
(rewritten after every layer, so ``--resume`` continues an interrupted run),
``plan.json`` and ``options.csv``."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from opscope_nb.profile.mining import LayerProfile
from opscope_nb.models.loader import HEAD_PRIOR_PER_BLOCK, output_head, word_embedding
from opscope_nb.profile.checkpoint import (
    FingerprintError,
    check_fingerprints,
    profile_doc,
    profile_entry,
    result_settings,
    timing_split,
)
from ._common import (
    CliError,
    add_source_args,
    ensure_outdir,
    fmt_bytes,
    int_list,
    first_run_notice,
    warm_first,
    json_text,
    json_text_reusing,
    load_profile_doc,
    nonneg_int,
    open_and_select,
    peak_rss_mb,
    positive_int,
    Progress,
    progress_enabled,
    source_info,
    warn,
    write,
)
from ._budget import (
    add_budget_args,
    budget_spec,
    budget_text,
    check_latencies,
    checked_budget,
    methods_of,
    sensitivity_transfer_line,
    options_csv,
    plan_dict,
    print_plan,
    run_allocators,
    validate_plans,
)

NAME = "profile"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="mine every option per layer and solve a budget")
    add_source_args(p)
    add_budget_args(p)
    p.add_argument("--rank-cap", type=positive_int, default=48,
                   help="top singular values computed per layer (default 48)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="randomised SVD seed")
    p.add_argument("--latency", type=int_list, default=None, metavar="M[,M...]",
                   help="measure each option's latency at these activation rows, e.g. "
                        "1,32 (stored in profile.json; needed by --latency-budget)")
    p.add_argument("--lr-ranks", type=_lr_ranks, default=None, metavar="R[,R...]|none",
                   help="ranks of the quantised + low-rank-correction composites "
                        "(int4/g32+lr16: the codes plus an int8 rank-r fit of their "
                        "residual, in output space with --calib); default 8,16,32; "
                        "'none' leaves them out")
    p.add_argument("--sample-rows", type=_sample_rows, default="auto", metavar="auto|all|N",
                   help="estimate the row-wise options' errors (ints, +gptq, ggml types, "
                        "2:4) from a stratified sample of each weight's rows: 'auto' "
                        "(default: >= 256 rows, enough for a 95%% interval within +-1%% of "
                        "each error, every row under 1M weights), N rows, or 'all' (every "
                        "row; the +lr composites need it)")
    p.add_argument("--out", metavar="DIR",
                   help="write profile.json, plan.json and options.csv here")
    p.add_argument("--menu", choices=("default", "ggml", "mixed"), default="default",
                   help="options per layer: the package's formats (default), or dense + "
                        "the ggml (llama.cpp / GGUF) block types whose block divides the "
                        "row length (plans export with 'apply ... -o OUT.gguf'), or both "
                        "(mixed: runs in this package; K-quants suit quantised sources)")
    p.add_argument("--types", metavar="T[,T...]", default=None,
                   help="with --menu ggml/mixed: only these ggml types, e.g. Q8_0,Q6_K,Q4_K "
                        "(default: Q8_0 Q6_K Q5_K Q5_1 Q5_0 Q4_K Q4_1 Q4_0 IQ4_NL IQ4_XS "
                        "Q3_K Q2_K F16 BF16)")
    p.add_argument("--requantize", action="store_true",
                   help="measure a tensor's own stored ggml type (Q4_K for a Q4_K tensor) "
                        "as a re-quantisation of its dequantised values, which 'apply' "
                        "then writes (as llama-quantize's --allow-requantize); default: "
                        "that option is the stored blocks as they are, error 0 at the "
                        "stored bytes, copied unchanged by 'apply'")
    c = p.add_argument_group("calibration (data-aware menu and objectives)")
    c.add_argument("--calib", action="store_true",
                   help="run the dense model on calibration text: per-layer input grams "
                        "H = sum x x^T (out_err per option, +gptq options), per-layer "
                        "sensitivity; grams saved to DIR/calib.npz for 'apply'")
    c.add_argument("--calib-text", metavar="FILE|sample|builtin", default=None,
                   help="calibration text: a file, one passage per line; 'builtin' (the "
                        "default: ~400 k characters of prose from this Python's "
                        "standard-library docstrings, no download; its first "
                        f"{BUILTIN_CALIB_TOKENS} tokens unless --calib-tokens); 'sample' "
                        "(2545 MiniLM tokens of 19th-century prose)")
    c.add_argument("--calib-tokens", type=positive_int, default=None, metavar="N",
                   help="cap on calibration tokens (default: all of the text; "
                        f"{BUILTIN_CALIB_TOKENS} for the built-in text)")
    c.add_argument("--sensitivity", action=argparse.BooleanOptionalAction, default=None,
                   help="with --calib: measure each profiled layer's sensitivity (one "
                        "perturbed forward from its block on; default: on for --objective "
                        "sensitivity/auto, off for output/weight)")
    c.add_argument("--sens-tokens", type=_sens_tokens, default="auto", metavar="N|auto",
                   help="with --calib: tokens each layer's sensitivity probe runs on (default "
                        "auto: 256, fewer -- down to 32, without the held-out probe -- when "
                        "the perturbed forwards of a large model would take longer)")
    c.add_argument("--validate", type=float, default=None, metavar="FRAC",
                   help="with --calib: hold out FRAC of the calibration text (sentences / "
                        "passages, seeded by --seed; default 0.25, 0 for models of more "
                        "than 2 B profiled weights; 0 = none); grams and "
                        "sensitivities come from the rest, and each plan is then run on "
                        "the held-out part: its predicted and measured metric (1-cos / KL) "
                        "are printed and stored in plan.json")
    c.add_argument("--keep-grams", action=argparse.BooleanOptionalAction, default=None,
                   help="with --calib --out: write the profiled layers' grams to "
                        "DIR/calib.npz for 'apply' (default: when they take at most "
                        f"{KEEP_GRAMS_MAX >> 30} GiB; otherwise 'apply' re-runs the "
                        "calibration, streamed, for the +gptq layers it packs)")
    c.add_argument("--gptq", choices=("int", "all", "none"), default="int",
                   help="with --calib (full grams): which +gptq twins to offer -- 'int' "
                        "(default) those of int8 ... int2; 'all' also each ggml type's "
                        "(GPTQ's codes on llama.cpp's scales, same GGUF bytes; their gain "
                        "is measured on the calibration text and shrinks on other text); "
                        "'none' no twins (a shorter profile)")
    c.add_argument("--token-weights", choices=("none", "norm"), default="none",
                   help="with --calib: weight each token's input by 1/d^2, d the divisor "
                        "of the norm its layer's output meets next (LayerNorm / RMSNorm "
                        "of the residual stream), so out_err, GPTQ and the importance "
                        "follow what the next block sees ('norm'); 'none' (default): "
                        "every token alike")
    c.add_argument("--twin-holdout", action=argparse.BooleanOptionalAction, default=None,
                   help="with --calib: fit each +gptq twin on every other calibration "
                        "sequence and price its out_err on the rest (default: on while "
                        f"the widest full gram takes at most {TWIN_HOLDOUT_MAX >> 20} MiB; "
                        "it adds two such grams per input while a layer is profiled)")
    c.add_argument("--calib-diag-above", type=positive_int, default=None, metavar="COLS",
                   help="with --calib: keep only diag(H) for layers with more than COLS "
                        "inputs (less memory, no +gptq there; default: full grams at "
                        "every width)")
    c.add_argument("--imatrix", metavar="FILE", default=None,
                   help="llama.cpp importance matrix (GGUF imatrix or legacy .dat) as "
                        "diag(H) per tensor (out_err only; no +gptq, no sensitivity)")
    p.add_argument("--resume", action="store_true",
                   help="reuse layers already in DIR/profile.json (same name, shape and "
                        "settings)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="on a cold kernel cache, compile the profile kernels in one "
                        "process per core first (once per install; also off with "
                        "OPSCOPE_AUTOWARM=0)")
    d = p.add_argument_group("distributed (Dask; pip install -e \".[distributed]\")")
    d.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="profile on a local Dask cluster of N worker processes "
                        "(127.0.0.1), one task per weight matrix")
    d.add_argument("--threads-per-worker", type=positive_int, default=None, metavar="T",
                   help="numba and BLAS threads per worker (default: cores / N; with "
                        "--scheduler: as each worker was started)")
    d.add_argument("--scheduler", metavar="ADDRESS",
                   help="use a running Dask cluster: tcp://host:8786, tls://..., or a "
                        "scheduler file; every worker must see SOURCE at the same path")
    p.set_defaults(func=run)


#: Default ``--validate``: the held-out fraction of the calibration text.
VALIDATE_DEFAULT = 0.25
#: Above this many profiled weights ``--validate`` defaults to 0: running the
#: plans re-packs every planned tensor (GPTQ on every row) and runs the model
#: again, about as long as the profile itself at 7B (a 2-block Llama-7B-shaped
#: checkpoint: 280 s of plan runs after 273 s of profile); ``apply`` + ``eval``
#: measure the one plan the user keeps.
VALIDATE_MAX_WEIGHTS = 2_000_000_000

#: Default ``--calib-tokens`` of the built-in text (the default ``--calib-text``).
#: all-MiniLM-L6-v2, exact plans, cosine on 4012 tokens of numpy / scipy
#: docstring prose (in neither set), calibrated on the built-in text's first
#: 8192 tokens against the 1891 fitting tokens of the shipped sample: 0.99920 /
#: 0.99275 / 0.97837 against 0.99800 / 0.98221 / 0.95003 at budgets 0.2 /
#: 0.15 / 0.125, profile --calib 209 s against 206 s (Zen 3, 2 cores;
#: ``benchmarks/bench_heldout.py``).  Grams grow with the tokens, sensitivity
#: (fixed token count) and the option sweep do not.
BUILTIN_CALIB_TOKENS = 8192

#: Largest calib.npz (float64 grams of the profiled layers) written by default.
KEEP_GRAMS_MAX = 2 << 30
#: Largest full gram (float64 bytes) for which ``--twin-holdout`` is on by
#: default: the held-out half and the fitting half are two more arrays of that
#: size while a layer is profiled (a 7B FFN-down gram is 0.97 GB).
TWIN_HOLDOUT_MAX = 512 << 20


def _ggml_types(args):
    """``--types`` as canonical ggml type names (None: the menu's default)."""
    if args.types is None:
        return None
    if args.menu not in ("ggml", "mixed"):
        raise CliError("--types narrows the ggml menu; add --menu ggml (or --menu mixed).")
    from opscope_nb.profile.mining import ggml_types_checked
    names = [t.strip() for t in args.types.split(",") if t.strip()]
    if not names:
        raise CliError(f"--types needs ggml type names like Q8_0,Q4_K; got {args.types!r}.")
    try:
        return list(ggml_types_checked(names))
    except ValueError as exc:
        raise CliError(f"--types: {exc}") from None


def _lr_ranks(text):
    """``--lr-ranks``: ``none`` or comma-separated positive ranks (:func:`int_list`)."""
    return [] if text.strip().lower() in ("none", "") else list(int_list(text))


def _sample_line(layers) -> str:
    """One line on the tensors whose errors are row-sample estimates ('' if none)."""
    hit = [lp for lp in layers if lp.sample and lp.sample.get("rows", 0) < lp.sample.get("of", 0)]
    if not hit:
        return ""
    from opscope_nb.profile.sampling import NEGLIGIBLE
    hw = 0.0
    for lp in hit:
        for o in lp.options:
            for v, se in ((o.rel_err, o.rel_err_se), (o.out_err, o.out_err_se)):
                if se is not None and v and v >= NEGLIGIBLE:
                    hw = max(hw, 1.96 * se / v)
    fr = [lp.sample["rows"] / lp.sample["of"] for lp in hit]
    return (f"row samples: {len(hit)} tensor(s) estimated from {min(fr):.0%}-{max(fr):.0%} of "
            f"their rows (widest 95% interval +-{hw:.1%} of an error >= {NEGLIGIBLE:g}; "
            f"'apply' prints the "
            f"full errors of the plan; --sample-rows all measures every row)")


def _sens_tokens(text):
    """``--sens-tokens``: ``auto`` or a number of tokens >= 2."""
    import argparse
    if text.strip().lower() == "auto":
        return "auto"
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 2:
        raise argparse.ArgumentTypeError(f"expected auto or a number of tokens >= 2; got {text!r}")
    return v


def _sample_rows(text):
    """``--sample-rows``: ``auto``, ``all`` or a number of rows >= 2."""
    import argparse
    from opscope_nb.profile.sampling import check_sample_rows
    try:
        return check_sample_rows(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected auto, all or a number of rows >= 2; got "
                                         f"{text!r}") from None


def _lr_list(args) -> list:
    from opscope_nb.profile.mining import LR_RANKS
    return list(LR_RANKS) if args.lr_ranks is None else list(args.lr_ranks)


def _profile_kwargs(args) -> dict:
    kw = {"rank_cap": args.rank_cap, "seed": args.seed, "lr_ranks": tuple(_lr_list(args)),
          "sample_rows": args.sample_rows}
    if args.latency:
        kw["latency"] = tuple(args.latency)
    if getattr(args, "requantize", False):
        kw["requantize"] = True
    if getattr(args, "gptq", "int") != "int":
        kw["gptq"] = args.gptq
    if args.menu != "default":
        kw["menu"] = args.menu
        kw["ggml_types"] = _ggml_types(args)
    elif args.types is not None:
        _ggml_types(args)
    return kw


def _calibration(args, src, chosen, kw, dist):
    """Start the --calib stream / read --imatrix.

    Returns ``(settings record or None, kw or kw(name), stream or None)``.
    With ``--calib`` the calibration runs lazily, one block at a time, as the
    profile loop asks for grams (``chosen`` is put in block order): the grams
    of a block live while its layers are profiled, then go to
    ``DIR/calib.npz`` (:class:`~opscope_nb.profile.calib.GramsWriter`) and out of
    memory.  Sensitivities come at the end (:func:`_finish_calibration`)."""
    if not args.calib and not args.imatrix:
        if args.calib_text or args.calib_tokens or args.sensitivity is not None \
                or args.token_weights != "none" or args.twin_holdout is not None \
                or args.sens_tokens != "auto" \
                or args.calib_diag_above is not None or args.keep_grams is not None \
                or args.validate is not None:
            raise CliError("--calib-text/--calib-tokens/--sensitivity/--sens-tokens/--token-weights/"
                           "--twin-holdout/"
                           "--calib-diag-above/--keep-grams/--validate need --calib.")
        if getattr(args, "objective", "auto") not in ("weight", "auto"):
            warn(f"--objective {args.objective} without --calib/--imatrix: no layer has "
                 f"out_err, every layer uses its squared weight error (sum of rel_err^2).")
        return None, kw, None
    if dist is not None:
        raise CliError("--calib/--imatrix run in this process; drop --workers/--scheduler.")
    grams, rec, stream = {}, {}, None
    names = {e.name for e in chosen}
    if args.calib:
        from opscope_nb.profile.calib import CalibrationStream
        from opscope_nb.models import ModelError, UnsupportedModelError
        objective = getattr(args, "objective", "auto")
        sens_on = args.sensitivity if args.sensitivity is not None else \
            objective in ("sensitivity", "auto")
        if objective == "sensitivity" and not sens_on:
            raise CliError("--objective sensitivity needs the sensitivities: drop "
                           "--no-sensitivity (or use --objective output).")
        show = progress_enabled(args)
        if args.validate is None:
            n_w = sum(int(e.numel) for e in chosen)
            args.validate = VALIDATE_DEFAULT if n_w <= VALIDATE_MAX_WEIGHTS else 0.0
            if not args.validate:
                print(f"calibration: {n_w / 1e9:.1f} B weights: the plans are not run on "
                      f"held-out text (it re-packs every planned tensor and runs the model "
                      f"again, about as long as the profile); --validate "
                      f"{VALIDATE_DEFAULT:g} runs them, 'eval' measures a plan after "
                      f"'apply'.", flush=True)
        if not 0.0 <= args.validate < 1.0:
            raise CliError(f"--validate is the held-out fraction of the calibration text, "
                           f"in [0, 1); got {args.validate}.")
        if args.calib_text is None:
            args.calib_text = "builtin"
        if args.calib_text == "builtin" and args.calib_tokens is None:
            args.calib_tokens = BUILTIN_CALIB_TOKENS
        # +gptq twins on the menu: fitted on half the sequences, priced on the other
        menu_twins = args.gptq != "none" and (args.menu != "ggml" or args.gptq == "all")
        twins = menu_twins
        if twins:
            widest = max((int(e.shape[1]) for e in chosen if len(e.shape) == 2), default=0)
            if args.calib_diag_above:
                widest = min(widest, int(args.calib_diag_above))
            big = 8 * widest * widest
            if args.twin_holdout is None and big > TWIN_HOLDOUT_MAX:
                print(f"calibration: +gptq twins priced on their own tokens (a held-out "
                      f"half would add two {fmt_bytes(big)} grams per input; "
                      f"--twin-holdout forces it)", flush=True)
            twins = args.twin_holdout if args.twin_holdout is not None \
                else big <= TWIN_HOLDOUT_MAX
        try:
            stream = CalibrationStream(
                args.source, text=args.calib_text, max_tokens=args.calib_tokens,
                full_max_cols=args.calib_diag_above, validate=args.validate,
                split_seed=args.seed, sensitivity=sorted(names) if sens_on else False,
                grams_for=names, sens_tokens=args.sens_tokens, heldout_grams=twins,
                token_weights=args.token_weights == "norm",
                log=(lambda m: print(m, file=sys.stderr, flush=True)) if show
                else (lambda m: None))
        except (ModelError, UnsupportedModelError, ValueError) as exc:
            raise CliError(f"--calib: {exc}")
        ns = len(stream.sens_layers)
        held = (f" + {stream.sens_val_tokens} held-out tokens"
                if getattr(stream, "sens_val_tokens", 0) else "")
        cut = (f" (--sens-tokens auto: fewer tokens{', no held-out probe' if stream.sens_val_dropped else ''} "
               f"to keep the perturbed forwards within budget; --sens-tokens 256 for more)"
               if ns and args.sens_tokens == "auto" and stream.sens_tokens < 256
               and stream.sens_tokens < stream.tokens else "")
        sens_text = (f"sensitivity of {ns} layer(s): {stream.sens_block_forwards} perturbed "
                     f"block forwards on {stream.sens_tokens} tokens{held}{cut}" if ns else
                     "no sensitivity")
        print(f"calibration: {stream.n_blocks} blocks streamed one at a time, "
              f"{stream.tokens} tokens; {sens_text}", flush=True)
        from opscope_nb.data import TEXT_KEYWORDS
        rec = {"text": os.path.abspath(args.calib_text)
               if args.calib_text and args.calib_text not in TEXT_KEYWORDS else args.calib_text,
               "max_tokens": args.calib_tokens, "tokens": stream.tokens, "metric": stream.metric, "eps": stream.eps,
               "sens_tokens": stream.sens_tokens if ns else 0, "sensitivity": bool(ns),
               "sens_val_tokens": stream.sens_val_tokens if ns else 0,
               "full_max_cols": args.calib_diag_above, "validate": args.validate,
               "split_seed": args.seed}
        if menu_twins:
            # priced on the held-out half (profile_layer's gram_heldout) or on their own
            rec["twins"] = "held-out" if twins else "in-sample"
        if args.token_weights == "norm":
            rec["token_weights"] = "norm"
        # profile in block order: each block's grams are needed once, then dropped
        chosen.sort(key=lambda e: (stream.stage_of(e.name) is None,
                                   stream.stage_of(e.name) or 0))
        stream.writer = None
        # float64 bytes of the grams to keep (shared q/k/v inputs counted per layer:
        # an upper bound)
        cols = {e.name: int(e.shape[1]) for e in chosen if len(e.shape) == 2
                and stream.stage_of(e.name) is not None}
        est = sum(8 * (c if args.calib_diag_above and c > args.calib_diag_above else c * c)
                  for c in cols.values())
        keep = args.keep_grams if args.keep_grams is not None else est <= KEEP_GRAMS_MAX
        if args.out and not keep:
            print(f"calibration: grams not kept (up to {fmt_bytes(est)}; --keep-grams keeps "
                  f"them): 'apply' re-runs the calibration for the +gptq layers it packs",
                  flush=True)
        if args.out and keep:
            from opscope_nb.profile.calib import GramsWriter
            stream.writer = GramsWriter(os.path.join(ensure_outdir(args.out), "calib.npz"))
            stream.on_stage = lambda k, g: stream.writer.add(
                {n: v for n, v in g.items() if n in names})
    if args.imatrix:
        from opscope_nb.io.imatrix import ImatrixError, read_imatrix
        try:
            im = read_imatrix(args.imatrix, names=sorted(names))
        except ImatrixError as exc:
            raise CliError(str(exc))
        if im.unknown:
            warn(f"{args.imatrix}: {len(im.unknown)} imatrix tensor(s) match no profiled "
                 f"weight: {', '.join(im.unknown[:5])}{' ...' if len(im.unknown) > 5 else ''}")
        cols = {e.name: int(e.shape[1]) for e in chosen if len(e.shape) == 2}
        for n, d in im.diag.items():
            if n in cols and np.shape(d) != (cols[n],):
                raise CliError(f"{args.imatrix}: the vector for {im.raw_names.get(n, n)} has "
                               f"{np.size(d)} values but {n} has {cols[n]} input columns; "
                               f"the imatrix was made for another model.")
            grams.setdefault(n, d)
        rec["imatrix"] = {"file": os.path.abspath(args.imatrix), "layers": len(im.diag),
                          "unknown": im.unknown, "chunks": im.chunks}
    covered = set(grams) | ({n for n in names if stream.stage_of(n) is not None}
                            if stream is not None else set())
    missing = sorted(names - covered)
    if missing:
        warn(f"{len(missing)} profiled tensor(s) have no calibration data (e.g. "
             f"{missing[0]}); they get no out_err and fall back to weight error.")

    def per_layer(name):
        k = dict(kw)
        g = stream.gram(name) if stream is not None else None
        if g is None:
            g = grams.get(name)
        if g is not None:
            k["gram"] = g
            h = stream.heldout(name) if stream is not None else None
            if h is not None:
                k["gram_heldout"] = h
            a = stream.act_sq(name) if stream is not None else None
            if a:
                k["act_sq"] = a
        lk = stream.lookup(name) if stream is not None else None
        if lk is not None:
            k["lookup"] = lk
        return k

    return rec, per_layer, stream


def _finish_calibration(st, records, layers):
    """Run the stream's remaining blocks, give every profiled layer its
    sensitivity (record and LayerProfile), commit ``calib.npz``."""
    stream = st.get("stream")
    if stream is None:
        return
    cal = stream.result(rest=False)     # later blocks only for pending sensitivities
    for rec, lp in zip(records, layers):
        s = cal.sensitivity.get(lp.name)
        if s is not None:
            lp.sensitivity = float(s)
            rec["profile"]["sensitivity"] = float(s)
        sv = cal.sensitivity_val.get(lp.name)
        if sv is not None:
            lp.sensitivity_val = float(sv)
            rec["profile"]["sensitivity_val"] = float(sv)
        if lp.lookup is not None:
            for key, got in (("sensitivity", cal.lookup_sensitivity),
                             ("sensitivity_val", cal.lookup_sensitivity_val)):
                if got.get(lp.name) is not None:
                    lp.lookup[key] = float(got[lp.name])
            rec["profile"]["lookup"] = lp.to_dict()["lookup"]
    summ = cal.summary()
    st["settings"]["calib"].update(wall_seconds=sum(summ["seconds"].values()),
                                   seconds=summ["seconds"])
    print(f"calibration: {cal.tokens} tokens through {min(stream.stage + 1, cal.blocks)} of "
          f"{cal.blocks} blocks, "
          f"{summ['full_grams']} full / {summ['diag_grams']} diagonal grams, sensitivity "
          f"of {len(cal.sensitivity)} layers ({cal.metric}); load "
          f"{cal.seconds['load']:.1f}s, grams {cal.seconds['grams']:.1f}s, sensitivity "
          f"{cal.seconds['sensitivity']:.1f}s; largest block + stem "
          f"{fmt_bytes(cal.peak_block_bytes)} float32")
    line = sensitivity_transfer_line(layers)
    if line:
        print(line)
    w = getattr(stream, "writer", None)
    if w is not None:
        w.close(st["settings"]["calib"])
        stream.writer = None
        print(f"wrote {w.path} ({fmt_bytes(w.bytes)} of grams)")


def _setup(args):
    """Validate the flags, open and select the source, calibrate, read a resumable
    ``profile.json``; returns the run's state as a dict."""
    spec = budget_spec(args)
    if spec.get("latency_frac") is not None and args.latency is None:
        raise CliError(f"--latency-budget needs measured latencies: add --latency "
                       f"{spec['latency_m']} (the --latency-m the budget is at).")
    if (spec.get("latency_frac") is not None and args.latency is not None
            and spec["latency_m"] not in args.latency):
        raise CliError(f"--latency-budget is at m={spec['latency_m']} (--latency-m) but "
                       f"--latency measures {','.join(map(str, args.latency))}; add "
                       f"{spec['latency_m']} to --latency.")
    dist = None
    if args.workers is not None or args.scheduler is not None:
        if args.workers is not None and args.scheduler is not None:
            raise CliError("give --workers N (a local cluster) or --scheduler ADDRESS "
                           "(a running one), not both.")
        from opscope_nb import distributed as dist
        try:
            dist.require_dask()
        except dist.DaskMissingError as exc:
            raise CliError(str(exc))
    elif args.threads_per_worker is not None:
        raise CliError("--threads-per-worker needs --workers N or --scheduler ADDRESS.")
    kw = _profile_kwargs(args)
    src, chosen, skipped_sel = open_and_select(args)
    kw_types = kw.get("ggml_types")
    calib_settings, kw, stream = _calibration(args, src, chosen, kw, dist)
    latency = list(args.latency) if args.latency else None
    settings = {"rank_cap": args.rank_cap, "seed": args.seed,
                "budget": spec.get("budget_frac"), "bpw": spec.get("budget_bpw"),
                "latency": latency,
                "include": args.include, "exclude": args.exclude,
                "include_embeddings": args.include_embeddings,
                "menu": args.menu, "ggml_types": kw_types, "lr_ranks": _lr_list(args),
                "sample_rows": args.sample_rows}
    if args.requantize:      # only when set: profiles of before resume as they are
        settings["requantize"] = True
    if args.gptq != "int":   # only when set: profiles of before resume as they are
        settings["gptq"] = args.gptq
    if calib_settings is not None:
        settings["calib"] = calib_settings
    out = ensure_outdir(args.out) if args.out else None
    if args.resume and not out:
        raise CliError("--resume needs --out DIR (it continues DIR/profile.json).")
    prof_path = os.path.join(out, "profile.json") if out else None
    previous = {}
    if args.resume and os.path.exists(prof_path):
        previous = _resumable(prof_path, settings, chosen)
    skipped = [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "reason": r}
               for e, r in skipped_sel]
    return {"spec": spec, "dist": dist, "src": src, "chosen": chosen, "kw": kw,
            "settings": settings, "source": source_info(src), "out": out,
            "prof_path": prof_path, "previous": previous, "skipped": skipped,
            "stream": stream}


def _resumable(prof_path, settings, chosen) -> dict:
    """``{(name, shape): record}`` of a ``profile.json`` to continue: only when it
    was made with the same result-changing settings and every saved layer
    still has the stored bytes it was profiled from (CliError naming what
    differs otherwise)."""
    doc = load_profile_doc(prof_path)
    old, new = result_settings(doc.get("settings")), result_settings(settings)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        k = diff[0]
        raise CliError(f"--resume: {prof_path} was made with {k}={old.get(k)!r}, this run "
                       f"has {k}={new.get(k)!r} (differing: {', '.join(diff)}); use the "
                       f"same settings, or another --out (or drop --resume) to start over.")
    by_name = {e.name: e for e in chosen}
    previous, mine = {}, []
    for rec in doc["layers"]:
        try:
            key = (rec["name"], tuple(rec["shape"]))
        except (KeyError, TypeError):
            continue
        e = by_name.get(rec["name"])
        if e is not None and tuple(e.shape) == key[1]:
            previous[key] = rec
            mine.append(e)
    try:
        check_fingerprints(mine, {r["name"]: r.get("sha256") for r in previous.values()},
                           prof_path)
    except FingerprintError as exc:
        raise CliError(f"--resume: {exc}; profile into another --out (or drop --resume) "
                       f"to start over.")
    return previous


def _reuse(rec):
    """The LayerProfile of a resumed record, or None when it does not parse."""
    try:
        return LayerProfile.from_dict(rec["profile"])
    except (KeyError, TypeError, ValueError):
        return None


def _serial_loop(st, bar, save):
    """Profile every chosen tensor in this process; returns
    ``(records, layers, reused, skipped while loading)``."""
    chosen, previous = st["chosen"], st["previous"]
    records, layers, skips = [], [], []
    reused = 0
    for i, e in enumerate(chosen, 1):
        bar.show(i, e.name)
        rec = previous.get((e.name, tuple(e.shape)))
        lp = None if rec is None else _reuse(rec)
        if lp is not None:
            records.append(rec)
            layers.append(lp)
            reused += 1
            bar.advance(e.numel)
            continue
        rec, lp, why = profile_entry(e, st["kw"])
        bar.advance(e.numel)
        if rec is None:
            bar.close()
            warn(f"skipping {e.name}: {why}.")
            skips.append({"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
                          "reason": why})
            continue
        records.append(rec)
        layers.append(lp)
        # keep the still-valid saved layers not reached yet, so an interrupt
        # during a resumed run loses nothing either
        later = [previous[k] for k in ((x.name, tuple(x.shape)) for x in chosen[i:])
                 if k in previous]
        save(records + later, skips)
    return records, layers, reused, skips


def _dask_loop(args, st, bar, save):
    """The per-tensor loop on a Dask cluster (:mod:`opscope_nb.distributed`):
    same records, skips, progress and atomic saves as :func:`_serial_loop`."""
    dist = st["dist"]
    chosen, previous, src = st["chosen"], st["previous"], st["src"]
    n = len(chosen)
    slots = [None] * n          # (record, LayerProfile) per source index
    skips = {}                  # source index -> skipped-tensor dict
    reused = 0
    for i, e in enumerate(chosen):
        rec = previous.get((e.name, tuple(e.shape)))
        lp = None if rec is None else _reuse(rec)
        if lp is not None:
            slots[i] = (rec, lp)
            reused += 1
            bar.advance(e.numel)
    jobs = [(i, e) for i, e in enumerate(chosen) if slots[i] is None]

    def ordered():
        return ([s[0] for s in slots if s is not None], [skips[i] for i in sorted(skips)])

    src_path = None if src.kind == "synthetic" else os.path.abspath(src.path)
    done = [reused]

    def on_result(i, e, res):
        done[0] += 1
        if "skip" in res:
            bar.close()
            warn(f"skipping {e.name}: {res['skip']}.")
            skips[i] = {"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
                        "reason": res["skip"]}
        else:
            rec = res["record"]
            slots[i] = (rec, LayerProfile.from_dict(rec["profile"]))
        bar.advance(e.numel)
        bar.show(done[0], e.name)
        save(*ordered())

    # Dask's own logging would print tracebacks when a cluster dies; the command
    # reports one line instead.
    with dist.quiet_logging():
        try:
            cluster = dist.connect(workers=args.workers,
                                   threads_per_worker=args.threads_per_worker,
                                   scheduler=args.scheduler, timeout=dist.CONNECT_TIMEOUT)
        except OSError as exc:
            raise CliError(str(exc))
        st["settings"]["distributed"] = cluster.describe()
        with cluster:
            if jobs:
                bar.show(reused, jobs[0][1].name)
            t_run = time.perf_counter()
            try:
                dist.run_profile(cluster, src_path, jobs, st["kw"], on_result,
                                 lost_after=dist.LOST_AFTER)
            except dist.ClusterLost as exc:
                n_ok = sum(s is not None for s in slots)
                where = (f"{n_ok} of {n} layers are in "
                         f"{os.path.join(args.out, 'profile.json')}; rerun with --resume "
                         f"to continue" if args.out else
                         f"{n_ok} of {n} layers were done (use --out DIR to keep them)")
                raise CliError(f"{exc}; {where}.") from None
            t_run = time.perf_counter() - t_run
    recs = [s[0] for s in slots if s is not None]
    ran = [r["worker"] for r in recs if isinstance(r.get("worker"), dict)
           and r is not previous.get((r["name"], tuple(r["shape"])))]
    if ran:
        peak = max(w["peak_rss_mb"] for w in ran)
        # the profile part alone (tasks submitted to last result), without the
        # cluster's start: what --workers N against 1 compares
        st["settings"]["distributed"]["profile_seconds"] = round(t_run, 3)
        print(f"dask: {len(ran)} task(s) on {len({(w['host'], w['pid']) for w in ran})} "
              f"worker process(es) at {cluster.address}, "
              f"{sorted({w['numba_threads'] for w in ran})} numba thread(s) each, "
              f"{t_run:.1f}s from submission to the last result; "
              f"peak worker RSS {peak:.0f} MiB")
    return recs, [s[1] for s in slots if s is not None], reused, [skips[i] for i in sorted(skips)]


def _data_free_priors(st, records, layers) -> None:
    """Give a decoder's output head (:func:`opscope_nb.models.loader.output_head`)
    and, without calibration, an encoder's word embedding
    (:func:`opscope_nb.models.loader.word_embedding`) their data-free weight in
    the output objective when they are profiled."""
    src = st["src"]
    if src.kind not in ("gguf", "safetensors", "safetensors-dir"):
        return
    names = [e.name for e in src.entries]
    got = [("output head", output_head(src.path, names),
            f"({HEAD_PRIOR_PER_BLOCK:g} x blocks; a measured sensitivity replaces it)")]
    if st["stream"] is None:
        got.append(("word embedding", word_embedding(src.path, names),
                    "(every block reads it; without --calib only)"))
    for what, item, why in got:
        if item is None:
            continue
        name, weight = item
        for rec, lp in zip(records, layers):
            if lp.name == name:
                lp.prior_weight = weight
                rec["profile"]["prior_weight"] = weight
                print(f"{what}: {name} weighs {weight:g}x in the output objective {why}")


def _validate_plans(st, layers, allocs, args) -> dict:
    """The plans measured on the held-out calibration text
    (:func:`~opscope_nb.cli._budget.validate_plans`)."""
    if st.get("stream") is None:
        return {}
    return validate_plans(args.source, st["settings"].get("calib"), layers, allocs,
                          progress_enabled(args))


def _report(st, records, layers, reused, skipped, n_skip_load, t_start, args):
    """Allocate, print the plan and the run's summary, write the output files."""
    spec, src = st["spec"], st["src"]
    out, prof_path = st["out"], st["prof_path"]
    check_latencies(layers, spec, src.path)
    try:
        spec = checked_budget(layers, spec)
    except CliError as exc:
        if not out:
            raise
        # the measured profile is kept: 'allocate' re-plans it at a budget it meets
        write(prof_path, json_text(profile_doc(st["source"], st["settings"], records,
                                               skipped, t_start, True)))
        write(os.path.join(out, "options.csv"), options_csv(layers))
        raise CliError(f"{exc} (the profile is in {prof_path}: 'opscope-nb allocate "
                       f"{prof_path} --budget ...' re-plans it)") from None
    allocs = run_allocators(layers, spec, methods_of(args.method), args.time_limit)
    rss = peak_rss_mb()
    wall = time.perf_counter() - t_start
    print_plan(layers, allocs)
    dense = sum(int(lp.dense_bytes) for lp in layers)
    phases = timing_split(r["profile"].get("timings") for r in records)
    split = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(phases.items(),
                                                         key=lambda kv: -kv[1]))
    print()
    print(f"{len(layers)} layers ({reused} resumed, {len(skipped)} tensors skipped), "
          f"dense {fmt_bytes(dense)}, {budget_text(spec, layers)}; "
          f"wall {wall:.1f}s, peak RSS {rss:.0f} MiB")
    if n_skip_load:
        print("skipped while loading: " + "; ".join(
            f"{s['name']} ({s['reason']})" for s in skipped[-n_skip_load:]))
    if split:
        print(f"profile time split: {split}")
    sampled = _sample_line(layers)
    if sampled:
        print(sampled)
    validation = _validate_plans(st, layers, allocs, args)
    if out:
        write(prof_path, json_text(profile_doc(st["source"], st["settings"], records,
                                               skipped, t_start, True)))
        fp = {r["name"]: r["sha256"] for r in records if r.get("sha256")}
        write(os.path.join(out, "plan.json"),
              json_text(plan_dict(layers, allocs, spec, dict(st["source"], sha256=fp),
                                 st["settings"].get("calib"), validation,
                                 requantize=bool(st["settings"].get("requantize")))))
        write(os.path.join(out, "options.csv"), options_csv(layers))
        print(f"wrote {prof_path}, plan.json, options.csv")


def run(args) -> int:
    st = _setup(args)
    from opscope_nb.warmup import profile_items
    # only the kernels this menu calls (a --menu ggml run needs no SVD / Tucker / TT)
    names = profile_items(args.menu, synthetic=args.source is None)
    if not (args.warmup and args.scheduler is None and warm_first(args, "profile", names)):
        first_run_notice(args)
    chosen, skipped = st["chosen"], st["skipped"]
    t_start = time.perf_counter()

    encoded = {}                     # each layer's record encoded once (json_text_reusing)

    def save(recs, skips):
        if st["prof_path"]:
            write(st["prof_path"], json_text_reusing(profile_doc(
                st["source"], st["settings"], recs, skipped + skips, t_start, False),
                "layers", encoded))

    bar = Progress(len(chosen), sum(e.numel for e in chosen), progress_enabled(args))
    try:
        loop = _serial_loop if st["dist"] is None else (
            lambda st_, bar_, save_: _dask_loop(args, st_, bar_, save_))
        records, layers, reused, skips = loop(st, bar, save)
        bar.close()
        _data_free_priors(st, records, layers)
        _finish_calibration(st, records, layers)
    finally:
        bar.close()
        w = getattr(st.get("stream"), "writer", None)
        if w is not None:
            w.abort()     # interrupted: no half-written calib.npz
    skipped += skips
    if not layers:
        raise CliError(f"{st['src'].path}: every selected tensor was skipped (NaN/Inf or a "
                       f"non-float dtype); nothing to allocate.")
    _report(st, records, layers, reused, skipped, len(skips), t_start, args)
    return 0
