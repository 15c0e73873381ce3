"""``opscope-nb eval SOURCE [--compressed OUT.safetensors|OUT.gguf] [--runtime
numba|llama.cpp] [--text FILE] [--act auto|f32|int8] [--max-tokens N] [--json FILE]``: run the model in this package's
own forward pass (numpy + ``PackedLinear`` for every linear layer) and report
what the compressed checkpoint costs and gains against the dense source on the
same tokens: encoders the cosine of the pooled sentence embeddings, decoders
KL(dense || compressed), top-1 agreement and perplexity; both the weight bytes
held, peak RSS and the warm speed (decoders: decode tokens/s at m = 1 with a KV
cache, and the prefill rate).  ``--compressed OUT.gguf`` runs a GGUF file's
ggml-typed layers from their own blocks; ``--runtime llama.cpp`` scores both
GGUF files with llama.cpp's logits instead (the ``[llama]`` extra).  See
:mod:`opscope_nb.models.evaluate`."""
from __future__ import annotations

import argparse
import math

from ._common import (
    CliError,
    Progress,
    fmt_bytes,
    json_text,
    positive_int,
    progress_enabled,
    write,
    first_run_notice,
)

NAME = "eval"


def _max_tokens(text: str) -> int:
    v = positive_int(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2; got {v}")
    return v


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="run the model: dense vs compressed outputs, size, speed")
    p.add_argument("source", metavar="SOURCE",
                   help="the original checkpoint (safetensors with config.json, or GGUF)")
    p.add_argument("--compressed", metavar="OUT.safetensors|OUT.gguf", default=None,
                   help="checkpoint written by 'opscope-nb apply' for SOURCE, or a GGUF "
                        "file of the same model (apply SOURCE.gguf PLAN -o OUT.gguf, "
                        "llama-quantize output)")
    p.add_argument("--runtime", choices=("numba", "llama.cpp"), default="numba",
                   help="numba: this package's forward (default); llama.cpp: score both "
                        "GGUF files with llama.cpp's own logits (pip install -e \".[llama]\")")
    p.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text, one passage per line (default: built-in English sample)")
    p.add_argument("--act", choices=("f32", "auto", "int8"), default="f32",
                   help="activation path of every linear layer in the quality runs "
                        "(default f32: the score is the plan's weight error alone)")
    p.add_argument("--act-quant", choices=("none", "ggml"), default="none",
                   help="ggml: in the quality runs every linear layer reads its input as "
                        "llama.cpp's CPU matmul does for the type its file stores it in "
                        "(Q8_0 / Q8_K blocks, F16 rounding), so KL and perplexity estimate "
                        "llama.cpp's without it; none (default): float activations")
    p.add_argument("--speed-act", choices=("auto", "f32", "int8"), default="auto",
                   help="activation path of the timed runs (default auto: the fastest "
                        "path of each kind)")
    p.add_argument("--max-tokens", type=_max_tokens, default=None, metavar="N",
                   help="evaluate at most N tokens (default: the whole text)")
    p.add_argument("--decode-steps", type=positive_int, default=64, metavar="N",
                   help="decoders: greedy tokens timed one at a time (default 64)")
    p.add_argument("--prompt-tokens", type=positive_int, default=64, metavar="N",
                   help="decoders: prompt length of the speed run (default 64)")
    p.add_argument("--window", type=positive_int, default=256, metavar="N",
                   help="decoders: perplexity/KL window in tokens (default 256)")
    p.add_argument("--force", action="store_true",
                   help="evaluate even when --compressed was not made from SOURCE (its "
                        "recorded fingerprints differ)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every figure here")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _f(v, fmt="{:.4f}"):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) \
        else fmt.format(v)


def run(args) -> int:
    from opscope_nb.runtime.checkpoint import CheckpointError
    from opscope_nb.models import ModelError
    from opscope_nb.models.evaluate import evaluate
    show = progress_enabled(args)
    from opscope_nb.models.loader import is_gguf
    # a GGUF file carries no fingerprint record; its tensor shapes are checked on load
    if args.compressed and not args.force and not is_gguf(args.compressed):
        from opscope_nb.plan.apply import check_made_from
        from opscope_nb.runtime.checkpoint import read_record
        from opscope_nb.profile.checkpoint import FingerprintError
        try:
            check_made_from(args.source, read_record(args.compressed)[2])
        except FingerprintError as exc:
            raise CliError(f"{args.compressed}: {exc}; evaluate it against the source it was "
                           f"made from, or pass --force.") from None
    if args.act_quant == "ggml" and args.runtime == "llama.cpp":
        raise CliError("--act-quant ggml emulates llama.cpp in this package's forward; with "
                       "--runtime llama.cpp llama.cpp quantises its activations itself: drop "
                       "one of them.")
    first_run_notice(args)
    try:
        r = evaluate(args.source, args.compressed, text=args.text, act=args.act, speed_act=args.speed_act,
                     max_tokens=args.max_tokens, decode_steps=args.decode_steps,
                     prompt_tokens=args.prompt_tokens, window=args.window,
                     make_progress=lambda n, w: Progress(n, w, show), runtime=args.runtime,
                     act_quant=args.act_quant)
    except (ModelError, CheckpointError) as exc:
        raise CliError(str(exc)) from None
    comp = r["compressed"] is not None
    if args.runtime == "llama.cpp":
        print(f"{r['arch']} {r['family']}, {r['tokens']} tokens, llama.cpp's forward "
              f"(weight bytes as stored in the files)")
    else:
        aq = ", llama.cpp's activations (--act-quant ggml)" if r["act_quant"] == "ggml" else ""
        print(f"{r['arch']} {r['family']}, {r['tokens']} tokens, act={r['act']}{aq} "
              f"(speed: act={r['speed_act']})")
    rows = [("weight bytes", fmt_bytes(r["dense_weight_bytes"]),
             fmt_bytes(r["compressed_weight_bytes"]) if comp else "-")]
    if r["family"] == "decoder":
        rows += [("perplexity", _f(r["ppl_dense"], "{:.3f}"), _f(r["ppl_compressed"], "{:.3f}")),
                 ("decode tokens/s (m=1)", _f(r["dense_tokens_per_s"], "{:.1f}"),
                  _f(r["compressed_tokens_per_s"], "{:.1f}")),
                 ("prefill tokens/s", _f(r["dense_prefill_tokens_per_s"], "{:.1f}"),
                  _f(r["compressed_prefill_tokens_per_s"], "{:.1f}"))]
    else:
        rows += [("tokens/s (batch)", _f(r["dense_tokens_per_s"], "{:.1f}"),
                  _f(r["compressed_tokens_per_s"], "{:.1f}"))]
    w = max(len(a) for a, _, _ in rows)
    print(f"{'':<{w}}  {'dense':>12}  {'compressed':>12}")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>12}  {c:>12}")
    if comp and r["family"] == "decoder":
        print(f"KL(dense||compressed) mean {r['kl_mean']:.6g} (max {r['kl_max']:.4g}), "
              f"top-1 agreement {r['top1_agree']:.4f}")
    elif comp:
        print(f"cosine of the sentence embeddings: mean {r['cosine_mean']:.6f}, "
              f"min {r['cosine_min']:.6f} over {r['texts']} texts")
    if r["peak_rss_mb"] is not None:
        print(f"peak RSS {r['peak_rss_mb']:.0f} MiB")
    if args.json:
        write(args.json, json_text(r))
        print(f"wrote {args.json}")
    return 0
