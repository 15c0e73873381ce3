"""`python bench.py --quick --json FILE` runs and reports every section.

No timing assertions: only that the run succeeds and every figure is a
finite number (``None`` marks a vendor figure this platform lacks).
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _numbers(obj, path="$"):
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, (int, float)):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--quick",
                           "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as fh:
        return proc.stdout, json.load(fh)


def test_every_section_present(quick_run):
    stdout, res = quick_run
    for sec in ("1", "2", "3", "4", "5", "6", "7"):
        assert sec in res, f"section {sec} missing from the JSON"
        assert f"## {sec}." in stdout
    assert res["7"]["verdict"], "the verdict must say something"
    assert len(res["4"]["rows"]) == 6 and len(res["5"]["rows"]) == 3
    assert len(res["6"]["rows"]) == 2
    assert res["machine"]["cpu"] and res["machine"]["vendor"]
    assert res["first_call_ms"]


def test_every_number_finite(quick_run):
    _, res = quick_run
    nums = list(_numbers(res))
    assert len(nums) > 50
    bad = [(p, v) for p, v in nums if not math.isfinite(v)]
    assert not bad, bad


def test_errors_within_bounds(quick_run):
    _, res = quick_run
    for r in res["4"]["rows"]:
        assert r["err_f32"] < 1e-5
        assert r["err_w8a16"] <= 0.01
        assert r["err_w8a8"] <= 0.02
    assert res["1"]["exact_vs_dense"] is True


def test_sections_flag_subset(tmp_path):
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--quick",
                           "--sections", "1", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "1" in res and "4" not in res and "7" not in res
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--sections",
                          "9"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--sections" in (bad.stderr + bad.stdout)
