"""int8 dot-product paths of kernels/_simd.py, each compared bit for bit with
NumPy's int32 product (tests/naive_matmul.py), on every path this CPU runs."""
import numba
import numpy as np
import pytest

from naive_matmul import naive_i8i8_i32
from opscope_nb import kernels as K
from opscope_nb.kernels import _simd as S


_RUNNERS = {}


def _runner(path, R):
    """An @njit function computing an R x 4 block of int32 dot products with the
    ``path``'s R x 4 tile plus a scalar tail (no cache: built per test run).
    R = 1 exercises the sign trick (``|x| * w sign(x)``), R = 2 on the VNNI
    paths the +128 offset with its correction term."""
    if (path, R) in _RUNNERS:
        return _RUNNERS[path, R]
    tile = S.make_i8_tile(R, 4, path)
    step = S.I8_STEP[path]

    @numba.njit
    def run(xq, wtq):
        k = xq.shape[1]
        nch = k // step
        xf = xq.ravel()
        wf = wtq.ravel()
        t = tile(xf, 0, k, wf, 0, k, nch)
        out = np.empty((R, 4), dtype=np.int32)
        for r in range(R):
            for c in range(4):
                a = t[r * 4 + c]
                for p in range(nch * step, k):
                    a += np.int32(xq[r, p]) * np.int32(wtq[c, p])
                out[r, c] = a
        return out

    _RUNNERS[path, R] = run
    return run


def _skip_unless(path):
    if not S.path_supported(path):
        pytest.skip(f"host CPU lacks {S._PATH_NEEDS[path]} for the {path} path")


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("path", S.I8_PATHS)
def test_i8_path_bit_exact(path, R):
    _skip_unless(path)
    run = _runner(path, R)
    rng = np.random.default_rng(7)
    for k in (1, 63, 64 * 3 + 5, 512):
        xq = rng.integers(-127, 128, (R, k)).astype(np.int8)
        wtq = rng.integers(-127, 128, (4, k)).astype(np.int8)
        np.testing.assert_array_equal(run(xq, wtq), naive_i8i8_i32(xq, wtq))
    # extremes: every product +-127*127, the largest sums the lanes see
    for sx, sw in ((127, 127), (-127, 127), (-127, -127)):
        xq = np.full((R, 256), sx, np.int8)
        wtq = np.full((4, 256), sw, np.int8)
        np.testing.assert_array_equal(run(xq, wtq), naive_i8i8_i32(xq, wtq))


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("path", S.I8_PATHS)
def test_i8_path_minus128(path, R):
    """-128 is outside the contract; what each path gives is documented in
    i8_dot_accumulate: an activation -128 is exact against weights in
    [-127, 127]; a weight -128 is exact on the portable path and in the offset
    (R >= 2 VNNI) tiles, and negated against negative activations with the
    sign trick (vpsignb cannot negate -128)."""
    _skip_unless(path)
    run = _runner(path, R)
    k = 128
    xq = np.full((R, k), -128, np.int8)
    xq[0, 1::2] = 5                      # half the products have x > 0
    wtq = np.full((4, k), 127, np.int8)
    wtq[1] = -127
    wtq[2] = 0
    wtq[3, :] = -128
    got = run(xq, wtq)
    ref = naive_i8i8_i32(xq, wtq)
    np.testing.assert_array_equal(got[:, :3], ref[:, :3])
    if path == "portable" or (R >= 2 and path in S.I8_OFFSET_PATHS):
        np.testing.assert_array_equal(got, ref)
    else:  # each (x < 0) x (-128) product comes out negated
        neg = (xq.astype(np.int64) < 0) * xq.astype(np.int64) * -128
        expect = ref[:, 3].astype(np.int64) - 2 * neg.sum(1)
        np.testing.assert_array_equal(got[:, 3], expect)


def test_host_path_and_text():
    assert S.HOST_I8_PATH in S.I8_PATHS
    assert S.path_supported(S.HOST_I8_PATH)
    assert S.I8_CHUNK == S.I8_STEP[S.HOST_I8_PATH]
    assert S.simd_path().startswith(S.HOST_I8_PATH)
    for p in S.I8_PATHS:
        assert S.simd_path(p).startswith(p)
    with pytest.raises(ValueError, match="unknown int8 path"):
        S.make_i8_tile(1, 1, "sse9")
    with pytest.raises(ValueError, match="unknown int8 path"):
        S.path_supported("sse9")


_RAW_RUNNERS = {}


def _raw_runner(path):
    if path not in _RAW_RUNNERS:
        tile = S.make_i8_raw_tile(path)

        @numba.njit
        def run(xq, wtq, nch):
            k = xq.shape[1]
            return tile(xq.ravel(), 0, k, wtq.ravel(), 0, k, nch)

        _RAW_RUNNERS[path] = run
    return _RAW_RUNNERS[path]


@pytest.mark.parametrize("path", S.I8_PATHS)
def test_raw_tile_offset_contract(path):
    """The raw 4 x 4 tile returns sum (x + 128) w (wrapping int32) on the
    offset paths, sum x w elsewhere, over the first nch * step elements --
    exactly, for codes in [-127, 127] (the contract of every path; rows of
    +-127 give the largest sums the lanes see)."""
    _skip_unless(path)
    rng = np.random.default_rng(5)
    step = S.I8_STEP[path]
    k = 3 * step + 7
    xq = rng.integers(-127, 128, (4, k)).astype(np.int8)
    wtq = rng.integers(-127, 128, (4, k)).astype(np.int8)
    xq[0] = -127
    xq[1] = 127
    wtq[1] = -127
    wtq[2] = 127
    kv = 3 * step
    got = np.array(_raw_runner(path)(xq, wtq, 3), np.int64).reshape(4, 4)
    ref = naive_i8i8_i32(xq[:, :kv], wtq[:, :kv]).astype(np.int64)
    if path in S.I8_OFFSET_PATHS:
        ref = ref + 128 * wtq[:, :kv].astype(np.int64).sum(1)[None, :]
    ref = ((ref + 2**31) % 2**32) - 2**31
    np.testing.assert_array_equal(got, ref)


def test_raw_tile_host_flag():
    """The public host raw tile is the host path's, offset as I8_RAW_OFFSET says."""
    assert S.I8_RAW_OFFSET == (S.HOST_I8_PATH in S.I8_OFFSET_PATHS)
    rng = np.random.default_rng(6)
    k = 2 * S.I8_CHUNK
    xq = rng.integers(-127, 128, (4, k)).astype(np.int8)
    wtq = rng.integers(-127, 128, (4, k)).astype(np.int8)
    got = np.array(_host_raw44(xq, wtq, 2), np.int64)
    np.testing.assert_array_equal(got, np.array(_raw_runner(S.HOST_I8_PATH)(xq, wtq, 2)))
    with pytest.raises(ValueError, match="unknown int8 path"):
        S.make_i8_raw_tile("sse9")


@numba.njit
def _host_raw44(xq, wtq, nch):
    k = xq.shape[1]
    return K.i8dot_raw_tile_4x4(xq.ravel(), 0, k, wtq.ravel(), 0, k, nch)


# --------------------------------------------------------------------------
# outer-product panel tiles (W8A8 prefill)
# --------------------------------------------------------------------------
_PANEL_RUNNERS = {}


def _panel_runner(path, rows):
    """@njit: pack ``rows`` activation rows into a panel, run the ``path``'s
    panel tile against 6 weight rows, return the raw offset sums [rows, 6]."""
    if (path, rows) in _PANEL_RUNNERS:
        return _PANEL_RUNNERS[path, rows]
    tile = S.make_i8_panel_tile(rows, path)
    L = S._PANEL_LANES[path]
    J = S.I8_PANEL_J
    # pack_i8_panel lays out the host path's panel (x ^ 0x80 on the offset
    # paths, signed codes on avx2): flip it for a path of the other kind
    flip = S._PANEL_OFFSET[path] != bool(K.I8_PANEL_CORR)

    @numba.njit
    def run(xq, wtq):
        k4 = xq.shape[1] // 4
        P = np.empty(rows * k4, dtype=np.int32)
        K.pack_i8_panel(xq, 0, rows, k4, P, 0)
        if flip:
            for t in range(P.size):
                P[t] ^= np.int32(-2139062144)
        buf = np.empty(rows * J, dtype=np.int32)
        tile(P, 0, wtq.ravel(), 0, wtq.shape[1], k4, buf, 0)
        out = np.empty((rows, J), dtype=np.int32)
        for r in range(rows):
            for j in range(J):
                out[r, j] = buf[((r // L) * J + j) * L + r % L]
        return out

    _PANEL_RUNNERS[path, rows] = run
    return run


@pytest.mark.parametrize("path", S.I8_PATHS)
def test_i8_panel_tile_bit_exact(path):
    """Every panel tile returns sum (x + 128) w (the offset paths; sum x w on
    avx2, whose panel holds the signed codes) over the first 4 * (k // 4)
    elements (wrapping int32), bit for bit with NumPy, on every path the CPU
    runs -- the padded rows (past m) hold code 0.  -128 is outside the
    contract on the avx2 panel (sign trick), so it is only planted on the
    offset paths."""
    _skip_unless(path)
    L = S._PANEL_LANES[path]
    off = 128 if S._PANEL_OFFSET[path] else 0
    lo = -128 if off else -127
    rng = np.random.default_rng(11)
    for rows in (2 * L, 4 * L) if L == 8 else (L, 2 * L):
        run = _panel_runner(path, rows)
        for m, k in ((rows, 4), (rows, 1024 + 3), (rows - 3, 37)):
            xq = rng.integers(lo, 128, (m, k)).astype(np.int8)
            wtq = rng.integers(lo, 128, (S.I8_PANEL_J, k)).astype(np.int8)
            xq[0] = lo
            wtq[1] = lo
            got = run(xq, wtq).astype(np.int64)
            kv = k // 4 * 4
            xp = np.zeros((rows, kv), np.int64)
            xp[:m] = xq[:, :kv]
            ref = (xp + off) @ wtq[:, :kv].astype(np.int64).T
            ref = ((ref + 2**31) % 2**32) - 2**31
            np.testing.assert_array_equal(got, ref)
        # extremes: the offset lanes wrap, the difference is exact
        k = 4096
        xq = np.full((rows, k), 127, np.int8)
        wtq = np.full((S.I8_PANEL_J, k), -127, np.int8)
        got = run(xq, wtq).astype(np.int64)
        corr = off * wtq.astype(np.int64).sum(1)
        exact = ((got - corr[None, :] + 2**31) % 2**32) - 2**31
        np.testing.assert_array_equal(exact, naive_i8i8_i32(xq, wtq))


def test_i8_panel_tile_rejects():
    with pytest.raises(ValueError, match="unknown int8 path"):
        S.make_i8_panel_tile(32, "sse9")
    with pytest.raises(ValueError, match="multiple of"):
        S.make_i8_panel_tile(12, "avx512vnni256")


@pytest.mark.parametrize("path", S.I8_PATHS)
def test_i8_panel_finishing_tile(path):
    """The panel tile that finishes in registers writes
    ``(float32(sum - 128 * ws) * sx) * scale`` output-major, bit for bit with
    NumPy's float32 in that order (no reassociation), on every path the CPU runs."""
    _skip_unless(path)
    L = S._PANEL_LANES[path]
    rows = 2 * L
    tile = S.make_i8_panel_tile(rows, path).finish_t
    J = S.I8_PANEL_J
    flip = S._PANEL_OFFSET[path] != bool(K.I8_PANEL_CORR)

    @numba.njit
    def run(xq, wtq, ws, sx, sc):
        k4 = xq.shape[1] // 4
        P = np.empty(rows * k4, dtype=np.int32)
        K.pack_i8_panel(xq, 0, rows, k4, P, 0)
        if flip:
            for t in range(P.size):
                P[t] ^= np.int32(-2139062144)
        yt = np.full(J * rows + 3, np.float32(-1.0))
        tile(P, 0, wtq.ravel(), 0, wtq.shape[1], k4, ws, sx, 0, sc, 0, yt, 3, rows)
        return yt

    rng = np.random.default_rng(12)
    k = 516
    xq = rng.integers(-127, 128, (rows, k)).astype(np.int8)
    wtq = rng.integers(-127, 128, (J, k)).astype(np.int8)
    ws = wtq.astype(np.int64).sum(1).astype(np.int32)
    sx = rng.random(rows).astype(np.float32)
    sc = rng.random(J).astype(np.float32)
    yt = run(xq, wtq, ws, sx, sc)
    exact = (xq.astype(np.int64) @ wtq.astype(np.int64).T).astype(np.float32)
    want = (exact * sx[:, None]) * sc[None, :]           # float32, this order
    np.testing.assert_array_equal(yt[3:].reshape(J, rows), want.T)
    assert (yt[:3] == -1).all()


def test_f32_transpose8():
    @numba.njit
    def run(src, dst):
        S.f32_transpose8(src, 5, 11, dst, 2, 9)
        return dst

    src = np.arange(100, dtype=np.float32)
    dst = run(src, np.zeros(80, np.float32))
    want = np.zeros(80, np.float32)
    for q in range(8):
        for r in range(8):
            want[2 + r * 9 + q] = src[5 + q * 11 + r]
    np.testing.assert_array_equal(dst, want)


# ------------------------------------------------------------ OPSCOPE_I8_PATH
# The switch is read once at import, so each forced path runs in a subprocess:
# it reports the path it took and computes small W8A8 / W4A8 / intN-A8
# products (decode and prefill shapes, k and n tails) that must equal the
# default process's bit for bit.
_SWITCH_SCRIPT = r"""
import json, sys
import numpy as np
import numba
from opscope_nb import kernels as K
from opscope_nb.kernels import _jit as _config

def products():
    rng = np.random.default_rng(11)
    out = {}
    for m in (1, 5, 37):
        k, n = 262, 14
        x = rng.standard_normal((m, k)).astype(np.float32)
        wtq = rng.integers(-127, 128, (n, k)).astype(np.int8)
        sc = rng.random(n).astype(np.float32)
        out[f"w8a8_{m}"] = K.dynamic_matmul_w8a8(x, wtq, sc, 1)
        out[f"w8a8s_{m}"] = K.dynamic_matmul_w8a8(x, wtq, sc, 1, K.i8_row_sums(wtq))
        xq = rng.integers(-127, 128, (m, 320)).astype(np.int8)
        sx = rng.random(m).astype(np.float32)
        codes = rng.integers(0, 256, (n, 160)).astype(np.uint8)
        # power-of-two scales: exact float sums, so the W4A8 panel (m >= 9 on
        # panel paths) and the dot tiles (portable) agree bit for bit too
        for g in (32,):
            s = (2.0 ** rng.integers(-3, 4, (n, 10) if g else n)).astype(np.float32)
            out[f"w4a8_{m}_{g}"] = K.w4a8_matmul(xq, sx, codes, s, 320, g, 1)
        # int3 (2+1 bit planes): 320 columns run 64-column units, 256 the
        # 128-column units (m = 1: the one-row decode of AVX2 hosts).  Through
        # the entry PackedLinear calls, with its one-path flags: only int3
        # compiles (intn_matmul_a8 from Python compiles all four formats; the
        # others' tiles on each path are checked in-process,
        # test_packed_quant.py::test_lowbit_paths_agree)
        xf = rng.standard_normal((m, 320)).astype(np.float32)
        flags = {"prefill": None} if m < 4 else {"decode": None}
        for bits, kk, g in ((3, 320, 32), (3, 256, 32)):
            lb = 2 if bits <= 3 else 4
            lo = rng.integers(0, 256, (n, kk * lb // 8)).astype(np.uint8)
            hi = rng.integers(0, 256, (n, kk * (bits - lb) // 8)).astype(np.uint8)
            s = (2.0 ** rng.integers(-3, 4, (n, kk // g))).astype(np.float32)
            xk = np.ascontiguousarray(xf[:, :kk])
            out[f"int{bits}_{kk}_{m}"] = K.intn_linear_entry(bits, True)(
                xk, lo, hi, s, kk, g, 1, **flags)
    return out

if __name__ == "__main__":
    if sys.argv[2] == "products":
        np.savez(sys.argv[1], **products())
    print(json.dumps({"path": K.HOST_I8_PATH, "forced": bool(K.I8_PATH_FORCED),
                      "lowbit": K.LOWBIT_PATH, "cache_dir": numba.config.CACHE_DIR,
                      "cache": _config.CACHE}))
"""


def _run_switch(tmp_path, value, name="out", products=True):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "switch.py"
    script.write_text(_SWITCH_SCRIPT)
    env = dict(os.environ)
    env.pop(S.I8_PATH_ENV, None)
    # the subprocess imports the package this process tests (not another install)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(K.__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in (env.get("PYTHONPATH"),) if p])
    if value is not None:
        env[S.I8_PATH_ENV] = value
        # a forced run compiles uncached; at LLVM level 0 (a third less
        # compile; the products are exact sums, equal at every level -- the
        # tiles' own code is checked in-process above).  NUMBA_CACHE_DIR of
        # this test's: it must come back unchanged
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
        env["NUMBA_OPT"] = "0"
    out = tmp_path / f"{name}.npz"
    r = subprocess.run([sys.executable, str(script), str(out),
                        "products" if products else "info"], env=env,
                       capture_output=True, text=True, timeout=1200)
    return r, out, (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0
                    else None)


_SWITCH_DEFAULT = {}


@pytest.mark.slow
@pytest.mark.parametrize("path", S.I8_PATHS)
def test_forced_path_bit_identical(path, tmp_path):
    """``OPSCOPE_I8_PATH=<path>`` runs that path (reported, compiled uncached) and
    gives the default path's results bit for bit.  The products (a cold
    compile of every kernel they call at LLVM level 0, uncached) run for one forced path per host -- ``avx2`` on a
    VNNI host (the path this switch exists to test there), ``portable`` on an
    AVX2 host; the other paths are checked for the report only (their tiles
    are checked bit for bit in-process by the ``make_i8_*`` tests above)."""
    _skip_unless(path)
    host = S._host_i8_path()
    other = "avx2" if host != "avx2" and S.path_supported("avx2") else "portable"
    report_only = path != other
    r, out, info = _run_switch(tmp_path, path, path, products=not report_only)
    assert r.returncode == 0, r.stderr[-3000:]
    assert info["path"] == path and info["forced"]
    assert info["lowbit"] == {"avx512vnni": "vnni256", "avx512vnni256": "vnni256"}.get(
        path, path)
    # compiled uncached; numba's cache directory is left as the user set it
    assert info["cache"] is False
    assert info["cache_dir"] == str(tmp_path / "numba-cache"), info
    if report_only:
        return
    if "default" not in _SWITCH_DEFAULT:   # one default run for every path
        _SWITCH_DEFAULT["default"] = _run_switch(tmp_path, None, "default")
    r0, out0, info0 = _SWITCH_DEFAULT["default"]
    assert r0.returncode == 0, r0.stderr[-3000:]
    assert not info0["forced"] and info0["path"] == S._host_i8_path()
    got, ref = np.load(out), np.load(out0)
    assert sorted(got.files) == sorted(ref.files)
    for key in ref.files:
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


@pytest.mark.parametrize("value, match", [
    ("sse9", "is not an int8 path"),
    *[(p, "this host cannot run") for p in S.I8_PATHS if not S.path_supported(p)]])
def test_forced_path_rejected(value, match):
    """A value that is no path, or a path the host cannot run, fails at import
    with a message naming the variable, the value, the host's paths and the fix."""
    with pytest.raises(ValueError, match=match) as ei:
        S._chosen_i8_path({S.I8_PATH_ENV: value})
    msg = str(ei.value)
    assert S.I8_PATH_ENV in msg and repr(value) in msg and "portable" in msg
    assert "unset" in msg


def test_forced_path_rejected_at_import(tmp_path):
    """The same error ends the import of the package (subprocess)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{S.I8_PATH_ENV: "sse9"})
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "nc")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(K.__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in (env.get("PYTHONPATH"),) if p])
    r = subprocess.run([sys.executable, "-c", "import opscope_nb.kernels"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "ValueError" in r.stderr and f"{S.I8_PATH_ENV}='sse9'" in r.stderr
    # no cache directory is made for a name that is no path
    assert (tmp_path / "nc").is_dir() and not list((tmp_path / "nc").rglob("i8path-*"))


def test_forced_path_choice():
    assert S._chosen_i8_path({}) == (S._host_i8_path(), False)
    assert S._chosen_i8_path({S.I8_PATH_ENV: " "}) == (S._host_i8_path(), False)
    assert S._chosen_i8_path({S.I8_PATH_ENV: "portable"}) == ("portable", True)


def test_host_path_width_by_cpu():
    """A CPU that runs 512-bit ``vpdpbusd`` at full width (Zen 5) takes the
    512-bit tiles; any other VNNI CPU the 256-bit ones; hosts without AVX-512
    VNNI never get a 512-bit path whatever the name."""
    assert "znver5" in S.WIDE_512_CPUS and "znver4" not in S.WIDE_512_CPUS
    wide, other = S._host_i8_path("znver5"), S._host_i8_path("znver4")
    if S.path_supported("avx512vnni"):
        assert (wide, other) == ("avx512vnni", "avx512vnni256")
    else:
        assert wide == other != "avx512vnni"
    assert S._host_i8_path() == S._host_i8_path(K.target_cpu_name())
