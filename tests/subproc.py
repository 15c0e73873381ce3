"""Run a snippet of Python in a fresh interpreter (tests of per-process state:
what numba compiles or loads there)."""
import os
import subprocess
import sys


def run_code(code: str, timeout: float = 900, env=None, cwd=None) -> str:
    """``python -c code`` in a new process (``env``: variables set on top of
    this process's; ``cwd``: its directory, first on its ``sys.path``); its
    stdout (the test fails with the stderr tail if the process does)."""
    full = dict(os.environ, **(env or {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=full, cwd=None if cwd is None else str(cwd))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def run_cold(code: str, cache_dir, env=None, timeout: float = 900) -> str:
    """:func:`run_code` with an empty numba cache of its own (``cache_dir``), for
    tests of what a process compiles (a caller loaded from the cache carries its
    callees' code without touching their dispatchers, so only a cold compile
    shows what is typed).  At LLVM level 0 (``NUMBA_OPT=0``): typing, which
    these tests observe, does not depend on the level, and the compile takes
    about a third less (numba then declines to cache some functions -- a
    warning on stderr, and this cache is thrown away)."""
    return run_code(code, timeout=timeout,
                    env=dict({"NUMBA_CACHE_DIR": str(cache_dir), "NUMBA_OPT": "0"}, **(env or {})))
