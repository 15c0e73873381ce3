"""Issue 21 items 6 and 7: the CLI fails early with one line (exit 2, no output
file half-written) and shows progress off a terminal too."""
from __future__ import annotations

import contextlib
import io
import os

import numpy as np

from opscope_nb.cli import main
from test_imatrix import _write_dat
from test_io import write_st


def run(argv):
    out, err = io.StringIO(), io.StringIO()        # stderr is not a terminal here
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def _ckpt(tmp_path):
    rng = np.random.default_rng(3)
    p = tmp_path / "m.safetensors"
    write_st(p, {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((24, 32)).astype(np.float32),
                 "model.layers.0.mlp.down_proj.weight": rng.standard_normal((32, 24)).astype(np.float32)})
    return p


def _no_outputs(d):
    return not os.path.exists(d) or not [f for f in os.listdir(d)
                                         if f.endswith((".json", ".csv", ".tmp"))]


def test_latency_budget_without_latency_exits_2_before_profiling(tmp_path):
    p = _ckpt(tmp_path)
    out = tmp_path / "o"
    rc, o, e = run(["profile", p, "--latency-budget", "0.5", "--out", out])
    assert rc == 2 and e.count("\n") == 1 and "--latency" in e
    assert _no_outputs(out)
    rc, o, e = run(["profile", p, "--latency-budget", "0.5", "--latency-m", "32",
                    "--latency", "1", "--out", out])
    assert rc == 2 and e.count("\n") == 1 and "m=32" in e
    assert _no_outputs(out)


def test_imatrix_of_wrong_length_exits_2_naming_the_tensor(tmp_path):
    p = _ckpt(tmp_path)
    im = tmp_path / "im.dat"
    _write_dat(im, {"model.layers.0.mlp.up_proj.weight": (np.ones(31, np.float32), 4)})
    out = tmp_path / "o"
    rc, o, e = run(["profile", p, "--imatrix", im, "--out", out])
    assert rc == 2 and e.count("\n") == 1, e
    assert "model.layers.0.mlp.up_proj.weight" in e and "31" in e and "32" in e
    assert _no_outputs(out)


def test_truncated_imatrix_exits_2(tmp_path):
    p = _ckpt(tmp_path)
    im = tmp_path / "im.dat"
    _write_dat(im, {"model.layers.0.mlp.up_proj.weight": (np.ones(32, np.float32), 4)})
    im.write_bytes(im.read_bytes()[:30])
    out = tmp_path / "o"
    rc, o, e = run(["profile", p, "--imatrix", im, "--out", out])
    assert rc == 2 and e.count("\n") == 1 and "truncated" in e
    assert _no_outputs(out)


def test_progress_lines_off_a_terminal(tmp_path):
    p = _ckpt(tmp_path)
    rc, o, e = run(["profile", p, "--rank-cap", "4", "--method", "greedy"])
    assert rc == 0, e
    lines = [ln for ln in e.splitlines() if ln.startswith("[")]
    assert [ln.split()[0] for ln in lines] == ["[1/2]", "[2/2]"], e
    assert {ln.split()[1] for ln in lines} == {"model.layers.0.mlp.up_proj.weight",
                                               "model.layers.0.mlp.down_proj.weight"}
    assert "\r" not in e
    rc, o, e = run(["profile", p, "--rank-cap", "4", "--method", "greedy", "-q"])
    assert rc == 0 and not [ln for ln in e.splitlines() if ln.startswith("[")]


def test_interrupt_message_fits_the_command(tmp_path, monkeypatch):
    from opscope_nb.plan import apply as ap
    p = _ckpt(tmp_path)
    d = tmp_path / "o"
    assert run(["profile", p, "--rank-cap", "4", "--method", "greedy", "--out", d, "-q"])[0] == 0

    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ap, "apply_plan", stop)
    rc, o, e = run(["apply", p, d / "plan.json", "-o", tmp_path / "c.safetensors", "-q"])
    assert rc == 130 and "untouched" in e and "--resume" not in e


def test_dat_imatrix_cut_inside_its_values_exits_2(tmp_path):
    """Issue 58: a legacy .dat cut inside an entry's float32 values was a
    traceback (numpy's 'buffer is smaller than requested size')."""
    p = _ckpt(tmp_path)
    im = tmp_path / "im.dat"
    _write_dat(im, {"model.layers.0.mlp.up_proj.weight": (np.ones(32, np.float32), 4)})
    head = 4 + 4 + len("model.layers.0.mlp.up_proj.weight") + 8   # count, name, ncall/nval
    im.write_bytes(im.read_bytes()[:head + 50])                     # 12.5 of 32 values
    out = tmp_path / "o"
    rc, o, e = run(["profile", p, "--imatrix", im, "--out", out])
    assert rc == 2 and e.count("\n") == 1, e
    assert "truncated" in e and "inside the values" in e and "Traceback" not in e
    assert _no_outputs(out)
