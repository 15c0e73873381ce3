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

from opscope_nb.kernels import _jit as _config

PKG = pathlib.Path(__file__).resolve().parents[1] / "opscope_nb"


def test_fastmath_keeps_nan_and_inf_semantics():
    assert "nnan" not in _config.FASTMATH and "ninf" not in _config.FASTMATH
    assert {"reassoc", "contract"} <= _config.FASTMATH
    assert _config.JIT["cache"] is True
    assert _config.JIT_PARALLEL["parallel"] is True


def test_no_literal_jit_flags_outside_config():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "_jit.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(fastmath|cache)\s*=", line) and "jit" in line:
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert not offenders, "jit flags must come from opscope_nb.kernels._jit:\n" + "\n".join(offenders)


_WORKLOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from opscope_nb.io.synth import Dist, sample
    from opscope_nb import kernels
    from opscope_nb.profile import probe, svd
    from opscope_nb.profile.mining import profile_layer
    from opscope_nb.plan.allocate import greedy_allocate, dado_allocate

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
    from opscope_nb.kernels import _jit as _config
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
    from opscope_nb.kernels._quant_probe import absmax_f32
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


def _no_parallel_loop(a):
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i] * i
    return s


def test_parallel_warning_filter_scoped_to_package_files():
    """numba's "parallel=True ... no transformation" warning is filtered only
    where numba locates it in one of the package's files (a one-path variant
    of a parallel entry); a user's function jitted the same way still warns."""
    import warnings

    import numba
    from numba.core.errors import NumbaPerformanceWarning
    a = np.ones(5)
    msg = ("The keyword argument 'parallel=True' was specified but no transformation for "
           "parallel execution was possible.")
    with warnings.catch_warnings(record=True) as w:
        _config._filter_parallel_warning()
        for where in (PKG / "kernels" / "_packed_quant.py", "opscope_nb/kernels/_rng.py"):
            warnings.warn(NumbaPerformanceWarning(f"{msg}\n\nFile \"{where}\", line 3:\n"))
        assert numba.njit(parallel=True, cache=False)(_no_parallel_loop)(a) == 10.0
    hits = [x for x in w if issubclass(x.category, NumbaPerformanceWarning)
            and "parallel=True" in str(x.message)]
    assert len(hits) == 1 and "test_config.py" in str(hits[0].message)
