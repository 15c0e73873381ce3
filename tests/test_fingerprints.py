"""Issue 21 item 3: results are tied to their source by the SHA-256 of each
tensor's stored bytes -- resume, apply and eval refuse another source (exit 2,
one line naming the tensor, ``--force`` where it makes sense), resume compares
only the settings that change results, and a plan carries each row's full
decomp so it applies the same from any directory."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import numpy as np
from naive_models import write_tiny_llama
from opscope_nb.cli import main
from opscope_nb.profile.checkpoint import result_settings
from test_io import write_st


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


NAMES = ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.self_attn.q_proj.weight")


def _ckpt(path, bump=None):
    rng = np.random.default_rng(11)
    t = {NAMES[0]: rng.standard_normal((48, 32)).astype(np.float32),
         NAMES[1]: rng.standard_normal((32, 48)).astype(np.float32),
         NAMES[2]: rng.standard_normal((32, 32)).astype(np.float32)}
    if bump is not None:                      # one ulp of one element
        a = t[bump]
        a.reshape(-1)[7] = np.nextafter(a.reshape(-1)[7], np.float32(np.inf))
    write_st(path, t)
    return path


def _interrupt_at(monkeypatch, n):
    """Make the n-th profile_layer call raise KeyboardInterrupt (Ctrl-C mid-run);
    returns the real function to restore."""
    from opscope_nb.profile import mining
    real, calls = mining.profile_layer, []

    def flaky(name, w, **kw):
        calls.append(name)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(name, w, **kw)
    monkeypatch.setattr(mining, "profile_layer", flaky)
    return real


def test_profile_records_fingerprints(tmp_path):
    p = _ckpt(tmp_path / "m.safetensors")
    d = tmp_path / "o"
    assert run(["profile", p, "--rank-cap", "4", "--out", d, "-q", "--method", "greedy"])[0] == 0
    prof = json.load(open(d / "profile.json"))
    plan = json.load(open(d / "plan.json"))
    from opscope_nb.io import open_source
    sha = {e.name: e.sha256() for e in open_source(str(p)).entries}
    assert prof["source"]["sha256"] == sha == plan["source"]["sha256"]
    f = prof["source"]["files"][0]
    assert f["size"] == os.path.getsize(p) and f["mtime_ns"] == os.stat(p).st_mtime_ns
    for row in plan["methods"]["greedy"]["layers"]:
        assert row["decomp"]["label"] == row["label"]


def test_resume_against_a_changed_tensor_is_refused(tmp_path, monkeypatch):
    from opscope_nb.profile import mining
    p = _ckpt(tmp_path / "m.safetensors")
    d = tmp_path / "o"
    real = _interrupt_at(monkeypatch, 3)
    assert run(["profile", p, "--rank-cap", "4", "--out", d, "-q"])[0] == 130
    monkeypatch.setattr(mining, "profile_layer", real)
    saved = json.load(open(d / "profile.json"))["layers"]
    assert len(saved) == 2
    before = (d / "profile.json").read_bytes()
    _ckpt(p, bump=saved[1]["name"])           # a fine-tuned copy: one ulp apart
    rc, o, e = run(["profile", p, "--rank-cap", "4", "--out", d, "-q", "--resume"])
    assert rc == 2 and e.count("\n") == 1 and saved[1]["name"] in e, e
    assert (d / "profile.json").read_bytes() == before          # nothing touched
    # other result-changing settings are refused by name; the budget is not one
    rc, o, e = run(["profile", _ckpt(p), "--rank-cap", "5", "--out", d, "-q", "--resume"])
    assert rc == 2 and "rank_cap" in e
    rc, o, e = run(["profile", p, "--rank-cap", "4", "--budget", "0.2", "--out", d, "-q",
                    "--resume"])
    assert rc == 0, e
    assert "2 resumed" in o


def test_result_settings_ignore_run_facts():
    a = {"rank_cap": 4, "seed": 0, "budget": 0.3, "calib": {"tokens": 10, "wall_seconds": 3.0},
         "distributed": {"local_workers": 2}}
    b = {"rank_cap": 4, "seed": 0, "budget": 0.5, "calib": {"tokens": 10, "wall_seconds": 9.1}}
    assert result_settings(a) == result_settings(b)
    b["calib"]["tokens"] = 11
    assert result_settings(a) != result_settings(b)


def test_resume_with_calib_after_an_interrupt_resumes(tmp_path, monkeypatch):
    from opscope_nb.profile import mining
    d0 = str(tmp_path / "tiny")
    os.makedirs(d0)
    write_tiny_llama(d0, seed=3)
    out = tmp_path / "o"
    args = ["profile", d0, "--calib", "--calib-tokens", "48", "--rank-cap", "4",
            "--include", "layers.0.", "--out", out, "-q", "--method", "greedy"]
    real = _interrupt_at(monkeypatch, 3)
    assert run(args)[0] == 130
    monkeypatch.setattr(mining, "profile_layer", real)
    n_saved = len(json.load(open(out / "profile.json"))["layers"])
    assert n_saved == 2
    rc, o, e = run(args + ["--resume"])
    assert rc == 0, e
    assert f"{n_saved} resumed" in o


def test_apply_refuses_a_tensor_changed_late_and_leaves_nothing(tmp_path):
    """The fingerprints are checked as the tensors are written (their hashes
    computed ahead, in the background): a change in the last planned tensor
    still fails with exit 2 after the others were packed, and neither the
    target nor a temporary file is left."""
    from safetensors.numpy import load_file, save_file
    d0 = str(tmp_path / "tiny")
    write_tiny_llama(d0, seed=5)
    prof = tmp_path / "p"
    assert run(["profile", d0, "--rank-cap", "4", "--include", "mlp", "--out", prof, "-q",
                "--method", "greedy", "--budget", "0.4"])[0] == 0
    planned = [x["name"] for x in json.load(open(prof / "plan.json"))["methods"]["greedy"]["layers"]
               if x["decomp"]["kind"] != "dense"]
    changed = str(tmp_path / "changed")
    shutil.copytree(d0, changed)
    ts = load_file(os.path.join(changed, "model.safetensors"))
    order = list(ts)                                   # the order apply writes them
    last = max(planned, key=order.index)
    assert order.index(last) > order.index(min(planned, key=order.index))
    ts[last] = ts[last].copy()
    ts[last][0, 0] += 1.0
    save_file(ts, os.path.join(changed, "model.safetensors"))
    out = tmp_path / "c.safetensors"
    rc, o, e = run(["apply", changed, prof / "plan.json", "-o", out, "-q"])
    assert rc == 2 and e.count("\n") == 1 and last in e and "--force" in e, e
    assert not out.exists()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_apply_and_eval_refuse_another_source(tmp_path):
    d0 = str(tmp_path / "tiny")
    os.makedirs(d0)
    write_tiny_llama(d0, seed=5)
    other = str(tmp_path / "other")
    os.makedirs(other)
    write_tiny_llama(other, seed=6)                # same architecture, other weights
    prof = tmp_path / "p"
    assert run(["profile", d0, "--rank-cap", "4", "--include", "mlp", "--out", prof, "-q",
                "--method", "greedy", "--budget", "0.4"])[0] == 0
    out = tmp_path / "c.safetensors"
    rc, o, e = run(["apply", other, prof / "plan.json", "-o", out, "-q"])
    assert rc == 2 and e.count("\n") == 1 and "--force" in e and not out.exists()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert run(["apply", other, prof / "plan.json", "-o", out, "-q", "--force"])[0] == 0
    # that file was made from `other`: eval against d0 is refused, against other runs
    rc, o, e = run(["eval", d0, "--compressed", out, "--max-tokens", "16",
                    "--decode-steps", "1", "--prompt-tokens", "2", "-q"])
    assert rc == 2 and e.count("\n") == 1 and "--force" in e
    rc, o, e = run(["eval", other, "--compressed", out, "--max-tokens", "16",
                    "--decode-steps", "1", "--prompt-tokens", "2", "-q"])
    assert rc == 0, e


def test_plan_resolved_elsewhere_applies_bit_identically(tmp_path):
    """A plan re-solved by ``allocate`` in another directory (no profile.json
    beside it) rebuilds low-rank options with the same sketch rank and seed."""
    from opscope_nb.runtime.checkpoint import load
    d0 = str(tmp_path / "tiny")
    os.makedirs(d0)
    write_tiny_llama(d0, seed=7)
    prof = tmp_path / "p"
    assert run(["profile", d0, "--rank-cap", "6", "--seed", "3", "--include", "mlp",
                "--out", prof, "-q", "--method", "greedy", "--budget", "0.3"])[0] == 0
    other = tmp_path / "elsewhere"
    assert run(["allocate", prof / "profile.json", "--budget", "0.3", "--method", "greedy",
                "--out", other])[0] == 0
    moved = tmp_path / "moved"
    os.makedirs(moved)
    shutil.move(str(other / "plan.json"), str(moved / "plan.json"))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert run(["apply", d0, prof / "plan.json", "-o", a, "-q"])[0] == 0
    assert run(["apply", d0, moved / "plan.json", "-o", b, "-q"])[0] == 0
    ta, _ = load(str(a))
    tb, _ = load(str(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        if hasattr(ta[k], "arrays"):
            assert ta[k].decomp == tb[k].decomp
            for n, arr in ta[k].arrays.items():
                np.testing.assert_array_equal(arr, tb[k].arrays[n])
        else:
            np.testing.assert_array_equal(ta[k], tb[k])
    rows = json.load(open(moved / "plan.json"))["methods"]["greedy"]["layers"]
    assert all(r["decomp"]["kind"] != "lowrank" or r["decomp"]["seed"] == 3 for r in rows)
