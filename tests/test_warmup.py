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


_ITEMS = ["runtime dense", "runtime lowrank(r=8)", "profile allocators"]

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
