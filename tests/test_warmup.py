"""``opscope-nb warmup``: the item table, the command line, and concurrent runs
sharing one cache (no crash, and a later process loads everything)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from opscope_nb import warmup as wu
from opscope_nb.cli import main


def test_items_cover_every_group_with_unique_names():
    names = [it.name for it in wu.ITEMS]
    assert len(names) == len(set(names))
    for g in wu.GROUPS:
        assert wu.items(g), g
    assert all(callable(getattr(wu, it.fn)) for it in wu.ITEMS)
    assert len(wu.items()) == len(wu.ITEMS)
    with pytest.raises(ValueError, match="unknown warm-up group"):
        wu.items("nope")
    with pytest.raises(ValueError, match="unknown warm-up items"):
        wu.warm(names=["nope"])


def test_cli_prints_a_line_per_item_and_the_total(monkeypatch, capsys):
    seen = {}

    def fake(only, jobs, on_result=None):
        seen.update(only=only, jobs=jobs)
        res = [{"name": n, "group": "runtime", "seconds": 1.5, "cpu": 1.0, "compiled": 3,
                "loaded": 1, "error": None} for n in ("a", "b")]
        for r in res:
            on_result(r)
        return {"results": res, "seconds": 2.0, "jobs": 2, "failed": []}

    monkeypatch.setattr(wu, "warm", fake)
    assert main(["warmup", "--jobs", "2", "--only", "runtime"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == {"only": "runtime", "jobs": 2}
    lines = [ln for ln in out if ln.startswith("[")]
    assert len(lines) == 2 and "compiled 3, loaded 1" in lines[0]
    assert out[-1].startswith("total 2.0 s wall")


def test_cli_failures_and_bad_arguments(monkeypatch, capsys):
    def fake(only, jobs, on_result=None):
        r = {"name": "x", "group": "bench", "seconds": 0.1, "cpu": 0.1, "compiled": 0,
             "loaded": 0, "error": "RuntimeError: boom"}
        on_result(r)
        return {"results": [r], "seconds": 0.1, "jobs": 1, "failed": ["x"]}

    monkeypatch.setattr(wu, "warm", fake)
    assert main(["warmup", "-j", "1"]) == 1
    assert "FAILED: RuntimeError: boom" in capsys.readouterr().out
    assert main(["warmup", "--jobs", "0"]) == 2
    assert main(["warmup", "--only", "nope"]) == 2


_ITEMS = ["runtime dense", "runtime tucker", "profile allocators"]

_RUN = textwrap.dedent("""
    import json, sys
    from opscope_nb import warmup as wu
    if sys.argv[1] == "warm":
        out = wu.warm(jobs=2, names=json.loads(sys.argv[2]))
        json.dump({"failed": out["failed"], "n": len(out["results"])}, sys.stdout)
    else:
        json.dump([wu.warm_item(n) for n in json.loads(sys.argv[2])], sys.stdout)
""")


@pytest.mark.slow
def test_concurrent_warmups_share_one_cache(tmp_path):
    """Two warm-ups at once on one empty cache (4 worker processes compiling the
    same kernels) both succeed, and a third process then compiles nothing."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    arg = json.dumps(_ITEMS)
    procs = [subprocess.Popen([sys.executable, "-c", _RUN, "warm", arg], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=1200)
        assert p.returncode == 0, err[-2000:]
        res = json.loads(out.strip().splitlines()[-1])
        assert res == {"failed": [], "n": len(_ITEMS)}
    out = subprocess.run([sys.executable, "-c", _RUN, "check", arg], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    checks = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(c["error"] is None for c in checks), checks
    assert all(c["compiled"] == 0 and c["loaded"] > 0 for c in checks), checks


def _names(its):
    return [it.name for it in its]


def test_startable_waits_for_dependencies_and_phases():
    """Tucker and TT wait for the SVD item (they call its kernels: two processes
    would compile the same chain), the profile command waits for every phase-0
    item, and no more items start than there are idle workers."""
    todo = wu.items("profile")
    svd = "profile svd + lowrank"
    assert {"profile tucker", "profile tt"} <= {it.name for it in todo
                                                 if svd in it.after}
    first = _names(wu.startable(todo, todo, set(), 9))
    assert svd in first and "profile tucker" not in first and "profile tt" not in first
    assert "profile command (built-in model)" not in first
    assert _names(wu.startable(todo, todo, set(), 2)) == first[:2]
    assert wu.startable(todo, todo, set(), 0) == []
    rest = [it for it in todo if it.name != svd]
    assert {"profile tucker", "profile tt"} <= set(_names(wu.startable(rest, todo, {svd}, 9)))
    phase0 = {it.name for it in todo if it.phase == 0}
    last = [it for it in todo if it.phase == 1]
    assert wu.startable(last, todo, phase0 - {svd}, 9) == []
    assert _names(wu.startable(last, todo, phase0, 9)) == _names(last)
    # an item whose dependency is not part of the run starts at once
    tucker = [it for it in todo if it.name == "profile tucker"]
    assert wu.startable(tucker, tucker, set(), 1) == tucker


@pytest.fixture
def stamp_dir(tmp_path, monkeypatch):
    """Warm stamps in a temporary directory, for sources with digest 'd1'."""
    from opscope_nb.kernels import _jit as _config
    monkeypatch.setattr(_config, "CACHE_LOCK", tmp_path / "opscope.lock")
    monkeypatch.setattr(_config, "STATE_DIR", tmp_path)
    monkeypatch.setattr(_config, "SOURCES_DIGEST", "d1")
    monkeypatch.setattr(_config, "CACHE", True)
    monkeypatch.delenv("OPSCOPE_AUTOWARM", raising=False)
    monkeypatch.delenv("OPSCOPE_I8_PATH", raising=False)
    return tmp_path


def test_warm_record_follows_the_sources(stamp_dir, monkeypatch):
    from opscope_nb.kernels import _jit as _config
    assert not wu.is_warm("profile") and wu.warmed() == set()
    phase0 = [it.name for it in wu.items("profile") if it.phase == 0]
    wu.mark_warm(phase0[:2])
    assert not wu.is_warm("profile") and wu.is_warm(names=phase0[:2])
    wu.mark_warm(phase0[2:])                 # merged with what was there
    assert wu.is_warm("profile") and not wu.is_warm("runtime")
    rec = json.loads((stamp_dir / "opscope_warm.json").read_text())
    assert rec["digest"] == "d1" and set(rec["items"]) == set(phase0)
    monkeypatch.setattr(_config, "SOURCES_DIGEST", "d2")     # an edited package
    assert not wu.is_warm("profile") and wu.warmed() == set()
    (stamp_dir / "opscope_warm.json").write_text("{not json")
    assert wu.warmed() == set()


def _fake_warm(calls, fail=()):
    def fake(only=None, jobs=None, on_result=None, names=None):
        calls.append({"only": only, "jobs": jobs, "names": list(names or ())})
        res = [{"name": n, "group": "profile", "seconds": 0.5, "cpu": 0.5, "compiled": 1,
                "loaded": 0, "error": "RuntimeError: boom" if n in fail else None}
               for n in names or ()]
        for r in res:
            on_result(r)
        wu.mark_warm([r["name"] for r in res if not r["error"]])    # as warm() does
        return {"results": res, "seconds": 1.0, "jobs": jobs,
                "failed": [r["name"] for r in res if r["error"]]}
    return fake


def test_warm_first_runs_once_then_the_stamp_holds(stamp_dir, monkeypatch):
    calls, lines = [], []
    monkeypatch.setattr(wu, "warm", _fake_warm(calls))
    assert wu.warm_first("profile", jobs=2, log=lines.append)
    phase0 = [it.name for it in wu.items("profile") if it.phase == 0]
    assert calls == [{"only": None, "jobs": 2, "names": phase0}]
    assert lines[0].startswith("first run: compiling the profile kernels in 2 processes")
    assert len(lines) == len(phase0) + 2 and all(ln.startswith("first run: ") for ln in lines)
    assert wu.is_warm("profile")         # the fake records as the real warm() does
    assert not wu.warm_first("profile", jobs=2, log=lines.append)     # warm now
    assert len(calls) == 1
    # only the items not warm yet run
    assert wu.warm_first("bench", jobs=1, names=["bench section 1"], log=lines.append)
    assert calls[-1]["names"] == ["bench section 1"]


def test_warm_first_off_switches_and_failures(stamp_dir, monkeypatch):
    from opscope_nb.kernels import _jit as _config
    calls = []
    monkeypatch.setattr(wu, "warm", _fake_warm(calls, fail={"profile tt"}))
    monkeypatch.setenv("OPSCOPE_AUTOWARM", "0")
    assert not wu.warm_first("profile") and calls == []
    monkeypatch.setattr(_config, "CACHE", False)        # a forced path: uncached
    monkeypatch.setenv("OPSCOPE_AUTOWARM", "1")
    assert not wu.warm_first("profile") and calls == []
    monkeypatch.setattr(_config, "CACHE", True)
    lines = []
    assert wu.warm_first("profile", jobs=1, log=lines.append)    # an item failed:
    assert any("FAILED: RuntimeError: boom" in ln for ln in lines)
    assert not wu.is_warm("profile")        # unmarked: the next run tries again
    rest = [n for n in wu._phase0("profile") if n != "profile tt"]
    assert wu.is_warm(names=rest)
    lines.clear()
    assert wu.warm_first("profile", jobs=1, log=lines.append)    # only the failed one
    assert calls[-1]["names"] == ["profile tt"]


def test_real_warm_records_only_the_items_that_succeeded(stamp_dir, monkeypatch):
    """``warm()`` in real worker processes: an item that fails there (here a name
    the fresh worker does not know) is reported and not recorded; the one
    that compiled is."""
    # the worker imports warmup afresh, without this monkeypatched item: it fails
    # on the name ("unknown warm-up item") before any function or argument is used
    broken = wu.Item("test broken item", "runtime", 0, "_runtime_kind", None)
    monkeypatch.setattr(wu, "ITEMS", wu.ITEMS + (broken,))
    seen = []
    out = wu.warm(jobs=2, names=["runtime dense", broken.name], on_result=seen.append)
    assert out["failed"] == [broken.name]
    assert {r["name"] for r in seen} == {"runtime dense", broken.name}
    err = next(r["error"] for r in seen if r["name"] == broken.name)
    assert "unknown warm-up item" in err
    assert wu.warmed() == {"runtime dense"}


def test_cli_profile_warms_first_unless_told_not_to(stamp_dir, monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(wu, "warm", _fake_warm(calls))
    assert main(["profile", "--out", str(tmp_path / "a"), "--no-warmup", "-q"]) == 0
    assert calls == []
    assert main(["profile", "--out", str(tmp_path / "b")]) == 0
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert "opscope-nb: first run: compiling the profile kernels" in err
    assert main(["profile", "--out", str(tmp_path / "c")]) == 0      # warm: no second time
    assert len(calls) == 1


def test_warm_bench_names_the_sections_items(stamp_dir, monkeypatch):
    """``python bench.py --sections 1,8`` warms section 1's item and section 8's
    kinds one per item (then section 8 itself, which waits for them)."""
    calls = []
    monkeypatch.setattr(wu, "warm", _fake_warm(calls))
    kinds = [it.name for it in wu.items("runtime")]
    # --quick: the runtime items of its rows and activation path only (its
    # section 8 runs m = 1 and 5 with int8 activations: decode and the dot
    # tiles, never the int8-activation panels nor the float-activation path)
    assert wu.warm_bench([8], log=lambda line: None, quick=True)
    quick = calls[0]["names"]
    panels = [n for n in kinds if "(panel)" in n or "(row split)" in n]
    assert len(panels) == 4
    floats = [n for n in kinds if "act=f32" in n]
    assert len(floats) == 16 and "runtime dense" not in floats
    rest = [n for n in kinds if n in panels or n in floats]
    assert quick == [n for n in kinds if n not in rest] + ["bench section 8"]
    assert "runtime dense" in quick and "runtime tt" in quick
    # the full bench: every runtime item; the warm ones (above) are not redone
    assert wu.warm_bench([1, 7, 8], log=lambda line: None)
    assert calls[1]["names"] == rest + ["bench section 1"]
    sec8 = next(it for it in wu.ITEMS if it.name == "bench section 8")
    assert set(sec8.after) == set(kinds)
    assert wu.warm_bench([3], log=lambda line: None)
    assert calls[-1]["names"] == ["bench section 3"]


def test_runtime_items_reach_each_prefill_variant():
    """The prefill items run below both int8-activation panels (the dot tiles
    every kind has), the panel items at or above them."""
    from opscope_nb import kernels as K
    from opscope_nb.bench.runner import QUICK
    panel_m = (K.W4_PANEL_MIN_M, K.I8_PANEL_MIN_M)
    assert wu._M_PREFILL < min(panel_m) <= max(panel_m) <= wu._M_PANEL
    assert max(QUICK["s8_m"]) <= wu._M_PREFILL
    by = {it.name: it for it in wu.items("runtime")}
    assert wu._rows_of(by["runtime int4/g32 act=int8 prefill"]) == wu._M_PREFILL
    assert wu._rows_of(by["runtime int4/g32 act=int8 prefill (panel)"]) == wu._M_PANEL
    assert wu._rows_of(by["runtime int8/chan act=int8"]) == 1


def test_first_run_notice_asks_the_warm_record(stamp_dir, monkeypatch, capsys):
    """Commands without a warm-up group print one line before a first run: not
    once the warm-up record holds items for these sources, and not when a
    cache index exists (installs that never ran a warm-up)."""
    import argparse
    import pathlib
    from opscope_nb.cli._common import first_run_notice
    monkeypatch.setattr(pathlib.Path, "rglob", lambda self, pat: iter([self / "f.nbi"]))
    first_run_notice(argparse.Namespace(quiet=False))
    assert capsys.readouterr().err == ""                 # a cache index: not a first run
    monkeypatch.setattr(pathlib.Path, "rglob", lambda self, pat: iter(()))   # no cache
    first_run_notice(argparse.Namespace(quiet=False))
    assert "first run: compiling the numba kernels" in capsys.readouterr().err
    first_run_notice(argparse.Namespace(quiet=True))
    assert capsys.readouterr().err == ""
    wu.mark_warm(["runtime dense"])
    first_run_notice(argparse.Namespace(quiet=False))
    assert capsys.readouterr().err == ""


def test_profile_items_follow_the_menu():
    """Issue 58: a --menu ggml run warms the allocators and the ggml types only
    (no SVD, Tucker, TT, intN ...); default warms everything but the ggml types."""
    phase0 = [it.name for it in wu.items("profile") if it.phase == 0]
    assert wu.profile_items("mixed") == phase0
    assert wu.profile_items("ggml", synthetic=False) == ["profile allocators",
                                                         "profile ggml types"]
    assert wu.profile_items("ggml") == ["profile allocators", "profile built-in model weights",
                                        "profile ggml types"]
    default = wu.profile_items("default", synthetic=False)
    assert default == [n for n in phase0 if n not in ("profile ggml types",
                                                      "profile built-in model weights")]
    assert {"profile svd + lowrank", "profile tucker", "profile tt"} <= set(default)
    with pytest.raises(ValueError, match="menu"):
        wu.profile_items("nope")


def test_cli_profile_warms_only_its_menu(monkeypatch, tmp_path):
    """``profile --menu ggml`` hands warm_first the ggml items, not the default menu's."""
    import numpy as np
    from opscope_nb.cli import main
    from test_io import write_st
    calls = []
    monkeypatch.setattr(wu, "warm_first", lambda group, log=None, names=None, jobs=None:
                        calls.append((group, names)) or False)
    p = tmp_path / "m.safetensors"
    write_st(p, {"a.weight": np.random.default_rng(0).standard_normal((8, 256))
                 .astype(np.float32)})
    assert main(["profile", str(p), "--menu", "ggml", "--types", "Q8_0", "-q",
                 "--method", "greedy"]) == 0
    assert calls == [("profile", ["profile allocators", "profile ggml types"])]
