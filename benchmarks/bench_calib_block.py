"""One Llama-7B block's seven layers through profile_layer with --calib's grams
(512 Gaussian calibration rows per input; q/k/v and gate/up share theirs), as
the CLI runs them: wall and CPU seconds per layer and in all (the calibration
forwards and the sensitivity probe are not included).

Usage: ``python benchmarks/bench_calib_block.py``."""
import os, sys, time, numpy as np
from opscope_nb.profile.mining import profile_layer
H, F, T = 4096, 11008, 512
rng = np.random.default_rng(0)
def gram(cols):
    x = rng.standard_normal((T, cols)); return x.T @ x
xs = rng.standard_normal((64, 256)); profile_layer("warm", rng.standard_normal((64, 256)).astype(np.float32), gram=xs.T @ xs, sample_rows="auto", stored_dtype="BF16")
g_attn, g_o, g_mlp, g_down = gram(H), gram(H), gram(H), gram(F)
layers = [("q_proj", H, g_attn), ("k_proj", H, g_attn), ("v_proj", H, g_attn), ("o_proj", H, g_o),
          ("gate_proj", F, g_mlp), ("up_proj", F, g_mlp), ("down_proj", H, g_down)]
tw, tc = time.perf_counter(), time.process_time()
for name, rows, g in layers:
    w = (rng.standard_normal((rows, g.shape[0])) * 0.02).astype(np.float32)
    t0, c0 = time.perf_counter(), time.process_time()
    lp = profile_layer(name, w, gram=g, sample_rows="auto", stored_dtype="BF16")
    print(f"{name:10s} {rows}x{g.shape[0]} wall {time.perf_counter()-t0:6.1f} cpu {time.process_time()-c0:6.1f} rows {lp.sample['rows'] if lp.sample else 'all'} load {os.getloadavg()[0]:.1f}", flush=True)
print(f"block: wall {time.perf_counter()-tw:.1f} s, cpu {time.process_time()-tc:.1f} s")
