"""Run a snippet of Python in a fresh interpreter (tests of per-process state:
what numba compiles or loads there)."""
import os
import subprocess
import sys


def run_code(code: str, timeout: float = 900, env=None) -> str:
    """``python -c code`` in a new process (``env``: variables set on top of
    this process's); its stdout (the test fails with the stderr tail if the
    process does)."""
    full = dict(os.environ, **(env or {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=full)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
