"""The on-disk kernel cache stays correct: stale sources invalidate it (also in
the per-user directory), concurrent processes never delete each other's files,
and a read-only install caches in a per-user directory instead of recompiling.
"""
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from opscope_nb.kernels import _jit as _config

PKG = pathlib.Path(__file__).resolve().parents[1] / "opscope_nb"


def _fake_pkg(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    return root


def test_stale_check_covers_numba_cache_dir(tmp_path, monkeypatch):
    """Under ``NUMBA_CACHE_DIR`` numba keeps the files under
    ``<dir>/<dirname>_<sha1>`` per source directory; the stamp lives there,
    and a changed source drops the package's files there, and only those."""
    pkg = _fake_pkg(tmp_path / "pkg")
    base = tmp_path / "base"
    monkeypatch.setattr(_config.numba.config, "CACHE_DIR", str(base))
    _config._drop_stale_cache(pkg)
    stamp_dir, dirs = _config.cache_dirs(pkg)
    assert (stamp_dir / "opscope_sources.sha256").exists()
    assert all(d.parent == base for d in dirs) and len(dirs) == 2
    cached = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        cached += [d / "m.f-1.py311.nbi", d / "m.f-1.py311.1.nbc"]
    for f in cached:
        f.write_bytes(b"x")
    other = base / "unrelated_0123" / "u.g-1.py311.nbi"     # another package's cache
    other.parent.mkdir()
    other.write_bytes(b"x")
    _config._drop_stale_cache(pkg)
    assert all(f.exists() for f in cached)
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    _config._drop_stale_cache(pkg)
    assert not any(f.exists() for f in cached)
    assert other.exists()
    assert not list((pkg).rglob("*.nbi"))


def test_cache_dirs_follow_numba(tmp_path, monkeypatch):
    """The directories are numba's own choice: ``NUMBA_CACHE_DIR`` (numba's
    ``<dirname>_<sha1>`` sub-path, checked against numba's locator), else the
    writable ``__pycache__``; a read-only install has none of the package's
    (numba's per-user cache, keyed on each file's stamp)."""
    from numba.core.caching import UserProvidedCacheLocator
    pkg = _fake_pkg(tmp_path / "pkg")
    monkeypatch.setattr(_config.numba.config, "CACHE_DIR", "")
    stamp_dir, dirs = _config.cache_dirs(pkg)
    assert stamp_dir == pkg / "__pycache__"
    assert sorted(dirs) == sorted([pkg / "__pycache__", pkg / "sub" / "__pycache__"])
    monkeypatch.setattr(_config.numba.config, "CACHE_DIR", str(tmp_path / "nc"))
    stamp_dir, dirs = _config.cache_dirs(pkg)
    want = UserProvidedCacheLocator.get_suitable_cache_subpath(str(pkg / "sub" / "b.py"))
    assert tmp_path / "nc" / want in dirs
    assert stamp_dir.parent == tmp_path / "nc"
    monkeypatch.setattr(_config.numba.config, "CACHE_DIR", "")
    monkeypatch.setattr(_config, "_writable", lambda d: "__pycache__" not in str(d))
    assert _config.cache_dirs(pkg) == (None, [])


_RACER = textwrap.dedent("""
    import os, pathlib, sys, time
    from opscope_nb.kernels import _jit as _config
    pkg, go = pathlib.Path(sys.argv[1]), float(sys.argv[2])
    while time.time() < go:
        pass
    _config._drop_stale_cache(pkg)
    mine = pkg / "sub" / "__pycache__" / f"k{os.getpid()}.f-1.py311.nbi"
    mine.parent.mkdir(exist_ok=True)
    mine.write_bytes(b"x")
    time.sleep(1.0)
    print("KEPT" if mine.exists() else "LOST")
""")


def test_concurrent_stale_checks_keep_each_others_files(tmp_path):
    """Processes starting together after a source change: exactly one drops the
    stale files; a file another process wrote after that survives."""
    import time
    pkg = _fake_pkg(tmp_path / "pkg")
    (pkg / "sub" / "__pycache__").mkdir()
    (pkg / "sub" / "__pycache__" / "old.f-1.py311.nbi").write_bytes(b"x")
    go = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(pkg), str(go)],
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == ["KEPT"] * 6, outs
    assert not (pkg / "sub" / "__pycache__" / "old.f-1.py311.nbi").exists()
    assert len(list((pkg / "sub" / "__pycache__").glob("k*.nbi"))) == 6


_RO_WORKLOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import opscope_nb
    from opscope_nb.kernels import _jit as _config
    from opscope_nb.kernels._quant_probe import rel_err
    a = np.ones((8, 8), np.float32)
    rel_err(a, a)
    st = rel_err.stats
    json.dump({"file": opscope_nb.__file__, "state": str(_config.STATE_DIR),
               "path": st.cache_path, "hits": sum(st.cache_hits.values()),
               "misses": sum(st.cache_misses.values())}, sys.stdout)
""")


@pytest.mark.slow
def test_read_only_install_caches_per_user(tmp_path):
    """A copy of the package whose ``__pycache__`` directories cannot be created
    (non-root: read-only files and directories; root, which writes anyway: each
    ``__pycache__`` is a plain file) compiles into
    numba's per-user cache (``$XDG_CACHE_HOME/numba``) once, and a second process loads from
    there (numba's dispatcher stats: hits, no misses; no file in the package)."""
    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False
    top = tmp_path / "site"
    shutil.copytree(PKG, top / "opscope_nb",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    xdg = tmp_path / "xdg"
    dirs = [top / "opscope_nb", *(p for p in (top / "opscope_nb").rglob("*") if p.is_dir())]
    for d in dirs:
        (d / "__pycache__").write_text("not a directory\n")
    if not root:
        for p in [*dirs, *(top / "opscope_nb").rglob("*")]:
            os.chmod(p, os.stat(p).st_mode & ~0o222)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env.update(XDG_CACHE_HOME=str(xdg), PYTHONPATH=str(top), PYTHONDONTWRITEBYTECODE="1")
    try:
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", _RO_WORKLOAD], env=env, cwd=str(top),
                                 capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stderr[-2000:]
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        if not root:
            for p in [*dirs, *(top / "opscope_nb").rglob("*")]:
                os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR)
    first, second = runs
    assert first["file"].startswith(str(top))
    assert first["state"] == str(xdg / "opscope-nb")
    assert first["path"].startswith(str(xdg / "numba"))    # numba's per-user cache
    assert first["misses"] >= 1
    assert second["misses"] == 0 and second["hits"] >= 1
    assert list((xdg / "numba").rglob("*.nbi"))
    assert not list((top / "opscope_nb").rglob("*.nbi"))
