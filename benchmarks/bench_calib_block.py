"""One Llama-7B block's seven layers through profile_layer with --calib's grams
(q/k/v and gate/up share theirs), as the CLI runs them: wall and CPU seconds
per layer and in all, the rows each option's sample grew to (the calibration
forwards and the sensitivity probe are not included).

Grams: 512 Gaussian calibration rows per input (default), or with ``--source
DIR`` the grams of block 0 of a checkpoint (:func:`opscope_nb.profile.calib.
calibrate` on ``--tokens`` tokens of the built-in text, timed apart) and its
own block-0 weights -- e.g. ``bench_scale.py``'s Llama-7B-shaped checkpoint
(``--workdir W --keep``: ``W/llama7b-shapes-2``), whose activations give
grams of low rank with uneven rows, as real models do.  ``--json FILE`` keeps
every option's estimate and standard error.

Usage: ``python benchmarks/bench_calib_block.py [--source DIR] [--tokens 512]
[--json FILE]``."""
import argparse, json, os, time
import numpy as np
from opscope_nb.profile.mining import profile_layer

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--source", help="checkpoint directory: its block 0 and its grams")
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--json", help="write every option's estimate here")
args = ap.parse_args()
H, F, T = 4096, 11008, args.tokens
rng = np.random.default_rng(0)
ROLES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
xs = rng.standard_normal((64, 256))
profile_layer("warm", xs.astype(np.float32), gram=xs.T @ xs, sample_rows="auto",
              stored_dtype="BF16")
if args.source:
    from opscope_nb.io import open_source
    from opscope_nb.profile.calib import calibrate
    t0 = time.perf_counter()
    cal = calibrate(args.source, max_tokens=T, sensitivity=False, keep_grams=True)
    print(f"calibration of {args.source}: {time.perf_counter() - t0:.1f} s", flush=True)
    by = {e.name: e for e in open_source(args.source).entries}
    layers = []
    for role in ROLES:
        name = next(n for n in by if ".layers.0." in n and n.endswith(role + ".weight"))
        layers.append((name, lambda n=name: by[n].load(), cal.grams[name]))
    del cal
else:
    def gram(cols):
        x = rng.standard_normal((T, cols)); return x.T @ x
    g_attn, g_o, g_mlp, g_down = gram(H), gram(H), gram(H), gram(F)
    shapes = dict(zip(ROLES, [(H, g_attn), (H, g_attn), (H, g_attn), (H, g_o), (F, g_mlp),
                              (F, g_mlp), (H, g_down)]))
    layers = [(role, lambda r=rows, c=g.shape[0]: (rng.standard_normal((r, c)) * 0.02)
               .astype(np.float32), g) for role, (rows, g) in shapes.items()]
out = {}
tw, tc = time.perf_counter(), time.process_time()
for name, load, g in layers:
    w = load()
    t0, c0 = time.perf_counter(), time.process_time()
    lp = profile_layer(name, w, gram=g, sample_rows="auto", stored_dtype="BF16")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    grown = (lp.sample or {}).get("grown") or {}
    rows = lp.sample["rows"] if lp.sample else "all"
    print(f"{name.split('.')[-2] if '.' in name else name:10s} {w.shape[0]}x{w.shape[1]} "
          f"wall {wall:6.1f} cpu {cpu:6.1f} rows {rows}"
          + (f", {len(grown)} options grown to {sorted(set(grown.values()))}" if grown else "")
          + f" load {os.getloadavg()[0]:.1f}", flush=True)
    out[name] = {"wall": wall, "cpu": cpu, "timings": lp.timings, "sample": lp.sample,
                 "options": {o.decomp.label: [o.rel_err, o.out_err, o.rel_err_se, o.out_err_se]
                             for o in lp.options}}
print(f"block: wall {time.perf_counter()-tw:.1f} s, cpu {time.process_time()-tc:.1f} s")
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f)
