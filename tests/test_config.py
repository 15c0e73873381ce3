"""The njit policy: one place owns the flags, and a second process does not recompile."""
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from opscope_nb import _config

PKG = pathlib.Path(__file__).resolve().parents[1] / "opscope_nb"


def test_fastmath_keeps_nan_and_inf_semantics():
    assert "nnan" not in _config.FASTMATH and "ninf" not in _config.FASTMATH
    assert {"reassoc", "contract"} <= _config.FASTMATH
    assert _config.JIT["cache"] is True
    assert _config.JIT_PARALLEL["parallel"] is True


def test_no_literal_jit_flags_outside_config():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "_config.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(fastmath|cache)\s*=", line) and "jit" in line:
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert not offenders, "jit flags must come from opscope_nb._config:\n" + "\n".join(offenders)


_WORKLOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from opscope_nb.synth import Dist, sample
    from opscope_nb import probe, svd, kernels
    from opscope_nb.mining import profile_layer
    from opscope_nb.allocate import greedy_allocate, dado_allocate

    w = sample(Dist.LOWRANK, 64, 96, seed=1)
    probe.per_channel_quant_error(w, 4); probe.nm_sparsity_error(w, 2, 4)
    probe.ternary_error(w); probe.stable_rank(w)
    svd.truncated_svd(w, 8)
    layers = [profile_layer("a", w), profile_layer("b", sample(Dist.GAUSSIAN, 36, 36, seed=2))]
    greedy_allocate(layers, 0.4); dado_allocate(layers, 0.4)
    x = sample(Dist.GAUSSIAN, 4, 96, seed=3)
    wt = kernels.transpose(np.ascontiguousarray(w.T))
    wtq, sc = kernels.quantize_cols_t(np.ascontiguousarray(w.T))
    xq, sx = kernels.quantize_rows_i8(x)
    kernels.matmul_f32(x, wt); kernels.matmul_w8a16(x, wtq, sc); kernels.matmul_w8a8(xq, sx, wtq, sc)
    # the fused W8A8 (row split on a VNNI host: reads the thread count)
    kernels.dynamic_matmul_w8a8(sample(Dist.GAUSSIAN, 32, 96, seed=4), wtq, sc, 0,
                                kernels.i8_row_sums(wtq))

    hits = misses = 0
    compiled, recompiled = [], []
    for name in dir(kernels):
        obj = getattr(kernels, name)
        st = getattr(obj, "stats", None)
        if st is None or not getattr(obj, "signatures", None):
            continue
        h, m = sum(st.cache_hits.values()), sum(st.cache_misses.values())
        hits += h; misses += m
        compiled.append(name)
        if m:
            recompiled.append(name)
    json.dump({"hits": hits, "misses": misses, "compiled": compiled,
               "recompiled": recompiled}, sys.stdout)
""")


@pytest.mark.slow
def test_second_process_loads_from_cache():
    """The package's own cache (the one users get, shared with the other
    tests: an empty one of its own made this test recompile the whole profile
    path, 75 s): whatever the first process compiles or loads, the second
    loads every kernel it calls and compiles none."""
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _WORKLOAD], check=True,
                             capture_output=True, text=True, timeout=900)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["hits"] + first["misses"] > 0
    assert second["compiled"], "the workload touched no kernel"
    assert second["misses"] == 0, f"second process recompiled: {second['recompiled']}"
    assert second["hits"] >= len(second["compiled"])


def test_drop_stale_cache_on_source_change(tmp_path):
    """A changed source file removes every numba cache file under the package
    root (and only then); the fingerprint is rewritten, so a second call with
    unchanged sources keeps the cache."""
    from opscope_nb import _config
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    _config._drop_stale_cache(pkg)
    cached = [pkg / "sub" / "__pycache__" / "b.f-1.py311.nbi",
              pkg / "sub" / "__pycache__" / "b.f-1.py311.1.nbc"]
    for f in cached:
        f.write_bytes(b"x")
    _config._drop_stale_cache(pkg)          # nothing changed: cache kept
    assert all(f.exists() for f in cached)
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    _config._drop_stale_cache(pkg)          # a source changed: cache dropped
    assert not any(f.exists() for f in cached)
    assert (pkg / "sub" / "b.py").exists()


def test_absmax_f32_matches_numpy():
    """The int32-bit-pattern max equals max |x| (signed zeros, inf, subnormals,
    empty ranges) and refuses non-float32 arrays at compile time."""
    import numba
    from opscope_nb.kernels._probe import absmax_f32
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(np.float32) * 1e3
    x[[5, 9]] = [-0.0, np.float32(1e-42)]
    assert absmax_f32(x, 0, 1000) == np.abs(x).max()
    assert absmax_f32(x, 3, 17) == np.abs(x[3:17]).max()
    assert absmax_f32(x, 4, 4) == 0.0
    x[700] = -np.inf
    assert absmax_f32(x, 0, 1000) == np.inf
    assert absmax_f32(np.array([-0.0, -1e-42], np.float32), 0, 2) == np.float32(1e-42)
    with pytest.raises(numba.core.errors.TypingError):
        absmax_f32(np.ones(4), 0, 4)


def _opt_spy(seen):
    """A fresh intrinsic that records numba's ``config.OPT`` when it is typed
    (typing runs inside the compile of the function calling it)."""
    import numba
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def spy(typingctx):
        seen.append(int(numba.core.config.OPT))

        def codegen(context, builder, sig, args):
            return context.get_constant(types.intp, 0)
        return types.intp(), codegen
    return spy


@pytest.mark.skipif("NUMBA_OPT" in os.environ, reason="NUMBA_OPT set: every kernel compiles at it")
def test_njit_opt_level_scoped_to_its_compile():
    """``_config.njit(opt=...)`` compiles at that LLVM level, a callee with a
    level of its own at that one (nested inside its caller's compile), the
    package default at :data:`_config.OPT`, and numba's global level is
    restored after each compile (other code keeps its own)."""
    import numba
    from opscope_nb import _config
    before = numba.core.config.OPT
    seen = []
    s_in, s_out, s_def = _opt_spy(seen), _opt_spy(seen), _opt_spy(seen)
    inner = _config.njit(cache=False, opt=3)(lambda: s_in())

    def outer_py():
        a = inner()
        return a + s_out()
    outer = _config.njit(cache=False, opt=1)(outer_py)
    assert outer() == 0
    assert seen == [3, 1]
    assert numba.core.config.OPT == before
    plain = _config.njit(cache=False)(lambda: s_def())
    assert plain() == 0
    assert seen == [3, 1, _config.OPT]
    assert numba.core.config.OPT == before


def _no_parallel_loop(a):
    s = 0.0
    for i in range(a.shape[0]):      # range, not prange: nothing to parallelise
        s += a[i] * i
    return s


def test_parallel_kernel_without_parallel_loop_compiles_quietly():
    """A package ``parallel=True`` function whose variant has no parallel loop
    (``PackedLinear``'s decode entries) compiles without numba's "no
    transformation for parallel execution" warning; the same function jitted
    by plain numba (a user's) still warns, and other warnings of the package's
    compile are not hidden."""
    import warnings

    import numba
    from numba.core.errors import NumbaPerformanceWarning
    from opscope_nb import _config
    a = np.ones(5)

    def caught(fn):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert fn(a) == 10.0
        return [x for x in w if issubclass(x.category, NumbaPerformanceWarning)
                and "parallel=True" in str(x.message)]

    assert caught(_config.njit_parallel(cache=False)(_no_parallel_loop)) == []
    assert len(caught(numba.njit(parallel=True, cache=False)(_no_parallel_loop))) == 1
    # the filter is scoped to the compile: a warning raised after it shows
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _config.njit_parallel(cache=False)(_no_parallel_loop)(a)
        warnings.warn(NumbaPerformanceWarning(
            "The keyword argument 'parallel=True' was specified but no transformation"))
    assert len(w) == 1


def _defined(mod, name):
    try:
        fn = mod.get_function(name)
    except NameError:
        return False
    return not fn.is_declaration


def test_link_late_callee_optimised_alone_and_linked_after():
    """``njit(link="late")``: the callee's code is linked into each caller after
    the caller's optimisation (the module a caller's own callers link holds
    only a declaration of it), through two levels, and every level computes
    the same as plain Python; a non-late helper is not linked late."""
    def big_py(a):
        s = 0.0
        for v in a:
            s += v * v
        return s

    def helper_py(x):
        return x + 1.0

    big = _config.njit(cache=False, link="late")(big_py)
    helper = _config.njit(cache=False)(helper_py)

    def mid_py(a):
        return helper(big(a)) * 2.0
    mid = _config.njit(cache=False)(mid_py)

    def top_py(a):
        return mid(a) - 3.0
    top = _config.njit(cache=False)(top_py)

    a = np.arange(7.0)
    assert top(a) == (np.sum(a * a) + 1.0) * 2.0 - 3.0
    lib = {f: f.overloads[f.signatures[0]].library for f in (big, helper, mid, top)}
    name = {f: f.overloads[f.signatures[0]].fndesc.mangled_name for f in (big, helper)}
    assert getattr(lib[big], _config._LATE) is True
    assert not getattr(lib[helper], _config._LATE, False)
    early = getattr(lib[mid], _config._EARLY)
    assert early.get_function(name[big]).is_declaration
    # mid ran only inside top: its own optimisation, and the late linking
    # after it, wait until its code is needed (optimisation on demand)
    assert getattr(lib[mid], _config._OPT_LATER) is not None
    assert not _defined(lib[mid]._final_module, name[big])
    _config._optimise(lib[mid])
    assert getattr(lib[mid], _config._OPT_LATER) is None
    assert getattr(lib[mid], _config._EARLY) is early      # callers' part unchanged
    for f in (mid, top):
        assert _defined(lib[f]._final_module, name[big]), f
    assert getattr(lib[mid], _config._LATE_SET) == (lib[big],)
    # top linked mid's early part and big after its own optimisation
    assert getattr(lib[top], _config._LATE_SET) == (lib[big],)


def _sq_py(a):
    return (a * a).sum()


def _sum_py(a):
    return a.sum()


def _max_py(a):
    return a.max()


def _tail_py(a):
    return a[-1]


@pytest.mark.parametrize("defer", [True, False])
def test_callee_optimised_when_its_own_code_is_needed(monkeypatch, defer):
    """A callee's module is optimised only inside its callers until its own
    code is needed (a Python call, an IR inspection); the module its callers
    link stays the one they linked; functions with settings of their own
    (``opt=``, ``vectorize=False``, ``link="late"``) are optimised in their
    own compile.  ``DEFER_OPTIMISATION = False`` optimises every library at
    once (numba's way)."""
    monkeypatch.setattr(_config, "DEFER_OPTIMISATION", defer)
    sq = _config.njit(cache=False)(_sq_py)
    hot = _config.njit(cache=False, opt=_config.OPT_HOT)(_sum_py)
    tiles = _config.njit(cache=False, vectorize=False)(_max_py)
    late = _config.njit(cache=False, link="late")(_tail_py)

    def top_py(a):
        return sq(a) + hot(a) + tiles(a) + late(a)
    top = _config.njit(cache=False)(top_py)

    def lib(f):
        return f.overloads[f.signatures[0]].library

    def waiting(f):
        return getattr(lib(f), _config._OPT_LATER, None) is not None

    a = np.arange(5.0)
    assert top(a) == 30.0 + 10.0 + 4.0 + 4.0
    assert not waiting(top)                         # emitted, so optimised
    assert waiting(sq) is defer
    assert not any(waiting(f) for f in (hot, tiles, late))
    linked = lib(sq)._get_module_for_linking()
    assert sq(a) == 30.0                            # its own code: optimised now
    assert not waiting(sq)
    assert lib(sq)._get_module_for_linking() is linked

    # an inspection shows the optimised module
    sq2 = _config.njit(cache=False)(_sq_py)
    top2 = _config.njit(cache=False)(lambda a: sq2(a) * 2.0)
    assert top2(a) == 60.0
    assert waiting(sq2) is defer
    assert "define" in sq2.inspect_llvm(sq2.signatures[0])
    assert not waiting(sq2)


def test_link_option_checked():
    with pytest.raises(ValueError, match="link must be 'early' or 'late'"):
        _config.njit(cache=False, link="never")(lambda: 0)


def test_link_late_callee_reached_only_through_another_late_callee():
    """A late callee the caller itself calls only in a branch LLVM removes
    (numba cannot see the constant), and again inside another late callee:
    its code must still end up in the caller's module, defined -- a module
    that only declares it runs in this process (the symbol resolves to the
    callee's own compile) and crashes when loaded from the cache elsewhere."""
    def leaf_py(a):
        return a.sum() * 3.0

    leaf = _config.njit(cache=False, link="late")(leaf_py)

    def mid_py(a):
        return leaf(a) + 1.0
    mid = _config.njit(cache=False, link="late")(mid_py)

    def top_py(a):
        c = np.int64(2) * np.int64(3)
        r = 0.0
        if c == 7:
            r = leaf(a)
        return mid(a) + r
    top = _config.njit(cache=False)(top_py)

    a = np.arange(5.0)
    assert top(a) == 31.0
    lib = top.overloads[top.signatures[0]].library
    names = [f.overloads[f.signatures[0]].fndesc.mangled_name for f in (leaf, mid)]
    for name in names:
        assert _defined(lib._final_module, name), name
    late = getattr(lib, _config._LATE_SET)
    # callers before callees: mid (which calls leaf) first
    assert late.index(mid.overloads[mid.signatures[0]].library) < \
        late.index(leaf.overloads[leaf.signatures[0]].library)


def test_callee_machine_code_deferred_until_python_calls_it():
    """A function compiled only as a callee is not emitted (its code runs in
    its caller's module): its library stays pending and its entry is a
    stand-in until Python calls it; then it runs, and errors raised in it
    (constant and run-time message) reach Python through the caller."""
    def callee_py(a):
        if a.size == 0:
            raise ValueError("empty input")
        if a.size > 9:
            raise ValueError("too long", a.size)
        return a.sum() * 2.0

    callee = _config.njit(cache=False)(callee_py)
    caller = _config.njit(cache=False)(lambda a: callee(a) + 1.0)
    a = np.arange(4.0)
    assert caller(a) == 13.0
    cres = callee.overloads[callee.signatures[0]]
    assert getattr(cres.library, _config._PENDING) is True
    assert isinstance(cres.entry_point, _config._PendingEntry)
    assert getattr(caller.overloads[caller.signatures[0]].library, _config._PENDING) is False
    with pytest.raises(ValueError, match="empty input"):
        caller(np.zeros(0))
    with pytest.raises(ValueError, match="too long"):
        caller(np.zeros(12))
    assert getattr(cres.library, _config._PENDING) is True
    assert callee(a) == 12.0            # the first Python call emits it
    assert getattr(cres.library, _config._PENDING) is False
    assert callee(a) == 12.0 and cres.entry_point(a) == 12.0
    with pytest.raises(ValueError, match="too long"):
        callee(np.zeros(12))
    # an emitted result added to another dispatcher puts its real entry in
    # that one's table (a stand-in there would be called as a C function)
    other = _config.njit(cache=False)(callee_py)
    other.add_overload(cres)
    assert other(a) == 12.0 and other.signatures == callee.signatures


def test_explicit_signatures_callable_with_deferred_code():
    """A dispatcher compiled for explicit signatures (user code too: the
    deferral is process-wide) takes no new signatures, so its entries are
    made when compiling is disabled: exact and converted arguments both run."""
    import numba
    f = numba.njit("float64(float64)", cache=False)(lambda x: x * 2.0)
    assert f(1.5) == 3.0 and f(2) == 4.0
    g = numba.njit("int64(int64)", cache=False)(lambda n: n + 1)
    h = numba.njit(cache=False)(lambda n: g(n) * 3)
    assert h(4) == 15 and g(4) == 5


def test_numba_features_run_with_deferred_code():
    """The deferral is process-wide, so user numba code meets it too: every
    way numba hands out a pointer or an entry (ufunc and gufunc loops, a C
    callback, jitclass methods and properties, an object-mode block, a
    first-class function, a generator, a prange loop) still runs and
    computes what NumPy does."""
    import numba
    from numba.experimental import jitclass

    v = numba.vectorize(["float64(float64)"])(lambda x: x * 3.0)
    vp = numba.vectorize(["float64(float64)"], target="parallel")(lambda x: x * 3.0)
    dv = numba.vectorize(lambda x: x + 1)
    a = np.arange(5.0)
    np.testing.assert_array_equal(v(a), a * 3.0)
    np.testing.assert_array_equal(vp(a), a * 3.0)
    np.testing.assert_array_equal(dv(np.arange(4)), np.arange(4) + 1)

    @numba.guvectorize(["void(float64[:], float64[:])"], "(n)->()")
    def row_sum(r, out):
        out[0] = r.sum()
    np.testing.assert_array_equal(row_sum(a.reshape(1, 5)), [10.0])

    cb = numba.cfunc("float64(float64)")(lambda x: x * 5.0)
    assert cb.ctypes(2.0) == 10.0

    @jitclass([("a", numba.float64)])
    class Box:
        def __init__(self, a):
            self.a = a

        def twice(self):
            return self.a * 2.0

        @property
        def plus(self):
            return self.a + 1.0

    b = Box(3.0)
    assert b.twice() == 6.0 and b.plus == 4.0

    @numba.njit
    def obj(x):
        with numba.objmode(y="float64"):
            y = float(np.sqrt(x))
        return y + 1.0
    assert obj(16.0) == 5.0

    sq = numba.njit(lambda x: x * x)
    call = numba.njit(lambda f, x: f(x))
    assert call(sq, 3.0) == 9.0

    @numba.njit
    def gen(n):
        for i in range(n):
            yield i * i
    assert list(gen(4)) == [0, 1, 4, 9]

    @numba.njit(parallel=True)
    def total(x):
        s = 0.0
        for i in numba.prange(x.size):
            s += x[i]
        return s
    assert total(a) == 10.0


_DEFERRED_MOD = '''
import numpy as np
from opscope_nb._config import njit


@njit
def callee(a):
    if a.size == 0:
        raise ValueError("empty input")
    return a.sum() * 2.0


@njit
def caller(a):
    return callee(a) + 1.0
'''

_DEFERRED_RUN = '''
import sys
import numpy as np
import deferred_mod as M
from opscope_nb import _config as C
seen = []
enter = C._enter


def spy(disp, pending):   # (function, bitcode, not optimised yet) per first Python call
    lib = pending.library
    seen.append((disp.py_func.__name__, bool(getattr(lib, C._BITCODE, False)),
                 getattr(lib, C._OPT_LATER, None) is not None))
    return enter(disp, pending)


C._enter = spy
a = np.arange(4.0)
for step in sys.argv[1:]:
    fn = getattr(M, step)
    print(step, fn(a), sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values()),
          len(M.callee.signatures))
try:
    M.caller(np.zeros(0))
except ValueError as e:
    print("raised", e)
print("seen", seen)
'''


def test_deferred_callee_cached_as_bitcode_then_as_object(tmp_path):
    """Across processes: a callee compiled only through its caller is cached
    as bitcode; a later process running the caller loads the caller's object
    code and never touches the callee; one calling the callee loads its
    bitcode, emits it and caches it again as object code, which the next
    process loads as such.  Results and errors equal every time."""
    from subproc import run_code
    (tmp_path / "deferred_mod.py").write_text(_DEFERRED_MOD)
    script = tmp_path / "run.py"
    script.write_text(_DEFERRED_RUN)
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.path.dirname(os.path.dirname(os.path.abspath(_config.__file__)))])}

    def run(*steps):
        return run_code(f"import runpy, sys; sys.argv = ['run.py', *{list(steps)!r}]; "
                        f"runpy.run_path({str(script)!r}, run_name='__main__')", env=env)

    out = run("caller")            # cold: both compiled, the callee never emitted
    assert "caller 13.0 0 1 1" in out and "raised empty input" in out, out
    assert "seen [('caller', True, True)]" in out, out
    out = run("caller")            # the caller from its object code alone
    assert "caller 13.0 1 0 0" in out and "raised empty input" in out, out
    assert "seen [('caller', False, False)]" in out, out
    # the callee's bitcode, cached before its optimisation: optimised, emitted,
    # cached again
    out = run("callee")
    assert "callee 12.0 1 0 1" in out, out
    assert "seen [('callee', True, True), ('caller', False, False)]" in out, out
    out = run("callee", "caller")  # now object code
    assert "callee 12.0 1 0 1" in out and "caller 13.0 1 0 1" in out, out
    assert "seen [('callee', False, False), ('caller', False, False)]" in out, out
