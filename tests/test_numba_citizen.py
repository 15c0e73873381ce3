"""The package is a good numba citizen (issue 56): it uses numba's public API,
changes nothing for other numba code in the process, and imports without JIT.

Each scenario runs in fresh interpreters, since what is checked is process
state (numba's configuration, classes, thread count) and the user's own
on-disk cache.
"""
import json
import pathlib
import re
import textwrap

import pytest
from subproc import run_code

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "opscope_nb"

_USER_MODULE = textwrap.dedent("""
    import numba

    @numba.njit(cache=True)
    def callee(x):
        return x * 2.0 + 1.0

    @numba.njit(cache=True)
    def caller(x):
        return callee(x) + 3.0
""")


def _py(code, cwd, env=None, timeout=900):
    """The last stdout line of ``code`` run in a fresh interpreter in ``cwd``."""
    return run_code(textwrap.dedent(code), timeout=timeout, env=env,
                    cwd=cwd).strip().splitlines()[-1]


def _user_dir(tmp_path):
    d = tmp_path / "user"
    d.mkdir()
    (d / "usermod.py").write_text(_USER_MODULE)
    return d


@pytest.mark.slow
def test_user_cache_written_beside_the_package_loads_without_it(tmp_path):
    """A user's ``cache=True`` caller and callee compiled in a process that
    imported the package: the callee alone, in a process that never imports
    it, loads from the user's cache and gives the right answer."""
    d = _user_dir(tmp_path)
    assert _py("""
        import opscope_nb.kernels, opscope_nb.runtime, usermod
        print(usermod.caller(2.0))
    """, d) == "8.0"
    out = _py("""
        import json, sys, usermod
        v = usermod.callee(2.0)
        st = usermod.callee.stats
        print(json.dumps([v, sum(st.cache_hits.values()), "opscope_nb" in sys.modules]))
    """, d)
    v, hits, imported = json.loads(out)
    assert v == 5.0 and hits >= 1 and not imported


@pytest.mark.slow
def test_user_cache_written_without_the_package_loads_beside_it(tmp_path):
    """The reverse: compiled without the package, loaded in a process that
    imported every package module first, and again in a plain process."""
    d = _user_dir(tmp_path)
    assert _py("import usermod; print(usermod.caller(2.0))", d) == "8.0"
    out = _py("""
        import json, importlib, pkgutil
        import opscope_nb
        for m in pkgutil.walk_packages(opscope_nb.__path__, "opscope_nb."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
        import usermod
        v = [usermod.callee(2.0), usermod.caller(2.0)]
        hits = sum(usermod.caller.stats.cache_hits.values())
        print(json.dumps([v, hits]))
    """, d)
    v, hits = json.loads(out)
    assert v == [5.0, 8.0] and hits >= 1
    assert _py("import usermod; print(usermod.callee(1.0), usermod.caller(1.0))", d) == "3.0 6.0"


@pytest.mark.slow
def test_user_cached_caller_of_a_parallel_kernel_loads_in_a_later_process(tmp_path):
    """A user's ``cache=True`` function calling a parallel kernel, loaded from
    the user's cache in a fresh process: numba does not start its threading
    layer for it (numba issue 8578: "Symbol not found: allocate_sched"); the
    package's import does, so it runs."""
    d = tmp_path / "user"
    d.mkdir()
    (d / "usercall.py").write_text(textwrap.dedent("""
        import numba
        import numpy as np
        from opscope_nb.kernels import i8_row_sums

        @numba.njit(cache=True)
        def sums(x):
            return i8_row_sums(x)
    """))
    code = ("import numpy as np, usercall\n"
            "print(int(usercall.sums(np.ones((8, 16), np.int8)).sum()), "
            "sum(usercall.sums.stats.cache_hits.values()))")
    assert _py(code, d).split()[0] == "128"
    total, hits = _py(code, d).split()
    assert total == "128" and int(hits) >= 1


#: Every ``PackedLinear`` kind and activation path a user meets (the cold-start
#: bench's list).
KINDS = ("int6/g128:f32", "int4/chan:f32", "ternary:f32", "int8/chan:f32", "int4/g32:f32",
         "int4/g32:int8", "int6/g128:int8", "int3/g128:f32", "int2/g32:int8", "ternary:int8",
         "int8/chan:int8", "dense:f32", "lowrank(r=8):f32", "sparse2:4:f32")

_STATE = """
import importlib, json, pkgutil, sys, tempfile
import numba, numpy as np
from numba.core import caching, codegen, cpu, registry

numba.set_num_threads(1)                # the user's choice

def snap():
    classes = [*registry.CPUDispatcher.__mro__, codegen.CPUCodeLibrary,
               codegen.JITCodeLibrary, codegen.JITCPUCodegen, cpu.CPUContext,
               caching.IndexDataCacheFile, caching.Cache]
    # (dunder caches such as copyreg's __slotnames__ appear on first pickling)
    meths = {f"{c.__module__}.{c.__qualname__}.{k}": repr(v) for c in classes
             for k, v in vars(c).items() if not k.startswith("__")}
    conf = {k: repr(getattr(numba.config, k)) for k in dir(numba.config) if k.isupper()}
    locs = [c.__qualname__ for c in getattr(caching, "CacheImpl",
                                            getattr(caching, "_CacheImpl", None))._locator_classes]
    return {"methods": meths, "config": conf, "locators": locs,
            "threads": numba.get_num_threads()}

before = snap()
import opscope_nb
for m in pkgutil.walk_packages(opscope_nb.__path__, "opscope_nb."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
imported = snap()

from opscope_nb.cli import main
from opscope_nb.formats import Decomp
from opscope_nb.runtime import PackedLinear
from opscope_nb import kernels
with tempfile.TemporaryDirectory() as d:
    assert main(["profile", "--out", d, "--no-warmup"]) == 0
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 128)).astype(np.float32)
for kind in KINDS:
    label, act = kind.rsplit(":", 1)
    lin = PackedLinear.pack(w, Decomp.from_label(label))
    for m in (1, 16):
        y = lin(rng.standard_normal((m, 128)).astype(np.float32), act)
        assert y.shape == (m, 64) and np.isfinite(y).all()
# an exception raised inside a parallel kernel: a flag that does not fit the call
wtq, sc = kernels.quantize_cols_t(np.ascontiguousarray(w.T))
try:
    kernels.dynamic_matmul_w8a8(rng.standard_normal((2, 128)).astype(np.float32), wtq, sc, 0,
                                kernels.i8_row_sums(wtq), tiles=None)
    raised = False
except ValueError:
    raised = True
after = snap()
print(json.dumps({"before": before, "imported": imported, "after": after, "raised": raised}))
"""


def _diff(a, b):
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


@pytest.mark.slow
def test_numba_state_untouched_by_imports_and_calls(tmp_path):
    """numba's configuration, its dispatcher / code-library / cache classes'
    methods, its cache locators and the user's thread count are identical
    before and after importing every package module and running one profile
    and one ``PackedLinear`` call of each kind (and an exception raised in a
    parallel kernel)."""
    code = f"KINDS = {KINDS!r}\n" + _STATE
    out = json.loads(_py(code, tmp_path, env={"OPSCOPE_AUTOWARM": "0"}, timeout=1800))
    before = out["before"]
    assert out["raised"]
    for stage in ("imported", "after"):
        got = out[stage]
        assert _diff(before["config"], got["config"]) == {}, stage
        assert _diff(before["methods"], got["methods"]) == {}, stage
        assert got["locators"] == before["locators"], stage
        assert got["threads"] == 1, stage


_FORBIDDEN = ("numba.core.codegen", "_DispatcherBase", "IndexDataCacheFile", "_CacheImpl",
              "_OptLevel", "_launch_threads", "numba.core.config", "_locator_classes",
              "compiler_lock")


def test_package_uses_no_numba_internals():
    """No patched or private numba class in the package's sources, and no
    write to numba's configuration."""
    bad = []
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        for name in _FORBIDDEN:
            if name in text:
                bad.append(f"{p.relative_to(ROOT)}: {name}")
        for m in re.finditer(r"numba\.config\.[A-Z_]+\s*=[^=]", text):
            bad.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, bad


def test_supported_numba_range_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"numba>=0.64,<0.69"' in text
    assert '"llvmlite>=0.46,<0.51"' in text


def test_thread_count_intrinsic_follows_numba():
    """The one numba detail the kernels use beyond the extension API: an
    intrinsic reading the threading layer's ``get_num_threads`` symbol.  It
    must equal ``numba.get_num_threads()`` (fails if numba drops or changes
    the symbol)."""
    import numba
    from opscope_nb.kernels._w8a8 import _num_threads

    @numba.njit(cache=False)
    def read():
        return _num_threads()

    old = numba.get_num_threads()
    try:
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            assert read() == n == numba.get_num_threads()
    finally:
        numba.set_num_threads(old)


def test_imports_and_runs_without_jit(tmp_path):
    """``NUMBA_DISABLE_JIT=1``: the package imports, its pure-Python paths give
    the NumPy answer on a small input, and a kernel that runs only compiled
    raises an error naming the setting."""
    out = _py("""
        import json
        import numpy as np
        import opscope_nb.kernels, opscope_nb.runtime
        from opscope_nb.profile import probe
        from opscope_nb.formats import Decomp
        from opscope_nb.profile.mining import profile_layer
        from opscope_nb.runtime import PackedLinear
        w = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
        err = probe.quant_error(w, 8)
        s = np.abs(w).max() / 127
        ref = np.linalg.norm(w - np.clip(np.trunc(np.abs(w / s) + 0.5) * np.sign(w), -127, 127)
                             * s) / np.linalg.norm(w)
        res = profile_layer("w", w)
        try:
            PackedLinear.pack(w, Decomp.from_label("int8/chan"))(np.ones((1, 32), np.float32))
            msg = ""
        except NotImplementedError as e:
            msg = str(e)
        print(json.dumps([float(err), float(ref), msg]))
    """, tmp_path, env={"NUMBA_DISABLE_JIT": "1"})
    err, ref, msg = json.loads(out)
    assert err == pytest.approx(ref, rel=1e-5)
    assert "NUMBA_DISABLE_JIT" in msg


def test_forced_int8_path_leaves_numba_cache_dir_alone(tmp_path):
    """``OPSCOPE_I8_PATH`` compiles the package's kernels uncached instead of
    moving numba's cache directory (the user's cache stays where it was)."""
    out = _py("""
        import json, numba
        before = numba.config.CACHE_DIR
        from opscope_nb.kernels import _jit as _config
        print(json.dumps([before, numba.config.CACHE_DIR, _config.CACHE]))
    """, tmp_path, env={"OPSCOPE_I8_PATH": "portable"})
    before, after, cache = json.loads(out)
    assert before == after and cache is False
