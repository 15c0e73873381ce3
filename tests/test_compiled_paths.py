"""Issue 25: a kernel compiles only the path a call takes.

The low-bit cores take ``decode`` / ``prefill`` and the W8A8 core ``prefill``:
``None`` leaves that path out of the compiled function (numba prunes ``is
None`` tests of arguments by type).  Each variant must give the exact integer
sums of the NumPy twin (tests/naive_packed_quant.py), the variants must agree
bit for bit, a prefill-only core must refuse a decode shape, and
``PackedLinear`` must call the variant of its shape.
"""
import numpy as np
import pytest
from numba import types

import naive_packed_quant as nq
from opscope_nb.runtime import _packed as _runtime
from opscope_nb import kernels as K
from opscope_nb.kernels._w8a8 import PAR_MIN
from opscope_nb.formats import Decomp
from opscope_nb.runtime import PackedLinear

RNG = np.random.default_rng(25)


def _int4(rows, cols, group):
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    codes, scales = nq.quant_sym(w, 4, group)
    return nq.pack_nibbles(codes), scales


@pytest.mark.parametrize("m,rows,cols,group", [
    (1, 9, 256, 32),        # mode 3 decode
    (2, 3, 131, None),      # rows < 4: per-output decode calls, tail columns
    (6, 13, 200, 32),       # prefill tiles (m >= 4), tail group
    (12, 14, 256, 32),      # the W4A8 panel's m on a VNNI / AVX2 host
])
def test_w4a8_variants_exact_and_equal(m, rows, cols, group):
    packed, _ = _int4(rows, cols, group)
    x = RNG.standard_normal((m, cols)).astype(np.float32)
    xq, _ = nq.quant_rows_i8(x)
    ones = np.ones(m, np.float32)
    g = 0 if group is None else group
    sc = np.ones((rows, 1 if group is None else -(-cols // group)), np.float32)
    want = xq.astype(np.int64) @ nq.unpack_nibbles(packed, cols).T
    full = K.w4a8_matmul(xq, ones, packed, sc, cols, g)
    dec = K.w4a8_matmul(xq, ones, packed, sc, cols, g, PAR_MIN, True, None)
    np.testing.assert_array_equal(full.astype(np.int64), want)
    np.testing.assert_array_equal(dec.astype(np.int64), want)
    if m >= 4 and rows >= 4:
        pre = K.w4a8_matmul(xq, ones, packed, sc, cols, g, PAR_MIN, None, True)
        np.testing.assert_array_equal(pre, full)
    else:
        with pytest.raises(ValueError, match="decode=None"):
            K.w4a8_matmul(xq, ones, packed, sc, cols, g, PAR_MIN, None, True)


@pytest.mark.parametrize("bits", [3, 6])
@pytest.mark.parametrize("m", [1, 5])
def test_intn_entry_variants_equal(bits, m):
    rows, cols, group = 11, 384, 128
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    lin = PackedLinear.pack(w, Decomp.from_label(f"int{bits}/g{group}"))
    # writable copies: numba types a read-only array (``lin.arrays``' views)
    # apart, and every entry would compile once more for this test alone
    a = {k: v.copy() for k, v in lin.arrays.items()}
    x = RNG.standard_normal((m, cols)).astype(np.float32)
    for act8 in (True, False):
        fn = K.intn_linear_entry(bits, act8)
        args = (x, a["lo"], a["hi"], a["scales"], cols, group, PAR_MIN)
        full = fn(*args)
        # the flags as PackedLinear passes them (the other one omitted): an
        # explicit bool would compile a specialisation nothing else runs
        np.testing.assert_array_equal(fn(*args, prefill=None), full)
        if m >= 4:
            np.testing.assert_array_equal(fn(*args, decode=None), full)
        # the twin: the packed planes unpacked in NumPy times the activations
        ref = x.astype(np.float64) @ nq.intn_dense(a["lo"], a["hi"], a["scales"], bits,
                                                   cols, group).T
        assert np.linalg.norm(full - ref) <= 0.02 * np.linalg.norm(ref)


@pytest.mark.parametrize("m", [1, 3, 20, 40])
def test_w8a8_without_prefill_paths_bit_equal(m):
    n, k = 30, 256
    wtq = RNG.integers(-127, 128, (n, k)).astype(np.int8)
    scale = (RNG.random(n) + 0.5).astype(np.float32)
    x = RNG.standard_normal((m, k)).astype(np.float32)
    ws = K.i8_row_sums(wtq)
    full = K.dynamic_matmul_w8a8(x, wtq, scale, 1, ws)
    dec = K.dynamic_matmul_w8a8(x, wtq, scale, 1, ws, None)
    np.testing.assert_array_equal(dec, full)
    xq, sx = nq.quant_rows_i8(x)
    acc = xq.astype(np.int64) @ wtq.astype(np.int64).T
    ref = (acc.astype(np.float32) * sx[:, None]) * scale[None, :]
    np.testing.assert_allclose(full, ref, rtol=1e-6, atol=0)
    # the pre-quantised entry: the same product with and without its prefill paths
    full8 = K.matmul_w8a8(xq, sx, wtq, scale, 1, ws)
    np.testing.assert_array_equal(K.matmul_w8a8(xq, sx, wtq, scale, 1, ws, None), full8)
    np.testing.assert_allclose(full8, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("label,m,kw", [
    ("int4/g32", 1, {"prefill": None}), ("int4/g32", 3, {"prefill": None}),
    ("int4/g32", 4, {"decode": None}), ("int4/chan", 9, {"decode": None}),
])
def test_packed_linear_calls_the_variant_of_its_shape(label, m, kw):
    w = RNG.standard_normal((12, 128)).astype(np.float32)
    lin = PackedLinear.pack(w, Decomp.from_label(label))
    x = RNG.standard_normal((m, 128)).astype(np.float32)
    assert _runtime._lowbit_path(lin, x) == kw
    y = lin(x, "int8")
    if m < 9:       # (from m = 9 the int4 panel adds the groups in another order)
        np.testing.assert_array_equal(y, np.concatenate(
            [lin(x[i:i + 1], "int8") for i in range(m)]))
    # the None flag reached the compiled entry as None, the other as its
    # default; a prefill the W4A8 panel takes whole also passes tiles=None
    # (arguments ..., decode, prefill, tiles: positions 6, 7, 8)
    pos, other = (6, 7) if "decode" in kw else (7, 6)
    tiles = K.w4a8_tiles_kw(m, 12, 128, 0 if label == "int4/chan" else 32)
    assert tiles == ({"tiles": None} if m >= K.W4_PANEL_MIN_M and K.W4_PANEL
                     else {"panel": None})
    # (a prefill passes one of tiles=None / panel=None: positions 8, 9)
    assert any(s[pos] == types.none and isinstance(s[other], types.Omitted)
               and (s[8] == types.none) == ("decode" in kw and "tiles" in tiles)
               and (s[9] == types.none) == ("decode" in kw and "panel" in tiles)
               for s in K.int4_linear_checked_a8.signatures)
    # a 3-row layer is decode-only whatever m is (the prefill tiles need 4 rows)
    small = PackedLinear.pack(w[:3], Decomp.from_label(label))
    assert _runtime._lowbit_path(small, x) == {"prefill": None}


def test_njit_caller_then_decode_entry():
    """A user's njit function compiling the public int4 kernels first, then the
    runtime's decode-only entry: its result must still be right (a None flag
    once passed into a parallel loop gave wrong results after such a history)."""
    import numba
    packed, scales = _int4(6, 100, 32)
    x2 = RNG.standard_normal((2, 100)).astype(np.float32)

    @numba.njit
    def user(x, packed, sc, cols, group):
        xq, sx = K.quantize_rows_i8(x)
        return (K.w4a8_matmul(xq, sx, packed, sc, cols, group),
                K.packed_int4_linear(x, packed, sc, cols, group, False))

    user(x2, packed, scales, 100, 32)
    w = RNG.standard_normal((9, 299)).astype(np.float32)
    lin = PackedLinear.pack(w, Decomp.int4())
    x = RNG.standard_normal((1, 299)).astype(np.float32)
    codes, sc = nq.quant_sym(w, 4)
    ref = x.astype(np.float64) @ nq.dequant_groups(codes, sc[:, 0], 299).T
    assert np.linalg.norm(lin(x, "f32") - ref) <= 3e-4 * np.linalg.norm(ref)


def test_packed_linear_int8_prefill_flag(monkeypatch):
    """``PackedLinear``'s int8 forward passes exactly the flags
    ``w8a8_prefill_kw`` gives for its shape (recorded at the call: the
    entry's signature list depends on what earlier tests compiled)."""
    w = RNG.standard_normal((24, 64)).astype(np.float32)
    lin = PackedLinear.pack(w, Decomp.int8())
    real, seen = _runtime._int8_checked_a8, []

    def spy(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(_runtime, "_int8_checked_a8", spy)
    for m in (1, K.I8_PANEL_MIN_M):
        x = RNG.standard_normal((m, 64)).astype(np.float32)
        y = lin(x, "int8")
        assert seen[-1] == K.w8a8_prefill_kw(m, 64, 24, PAR_MIN), m
        a = lin._arrays                  # the kernels' own (writable) buffers
        assert np.array_equal(y, real(x, a["codes"], a["scales"], lin._aux, prefill=None))
    assert seen[0] == {"prefill": None} and len(seen) == 2


def test_w8a8_prefill_kw_names_one_path_and_each_compiles_alone(tmp_path):
    """With the shape, ``w8a8_prefill_kw`` names the one W8A8 path a call
    takes and the others are not compiled: a panel-sized prefill types
    neither the row split nor the dot-tile core ``_w8a8_run`` (it calls the
    panel directly), a row-split prefill not the output split; both equal the dot tiles bit for bit, and a flag that
    does not fit the call raises.  A fresh process, 2 numba threads, an
    empty cache of its own (a caller loaded from the cache shows no
    signatures)."""
    from subproc import run_cold
    code = (
        "import numpy as np\n"
        "import opscope_nb.kernels as K\n"
        "from opscope_nb.kernels import _w8a8 as KM\n"
        "rng = np.random.default_rng(0)\n"
        "wq = rng.integers(-127, 128, (64, 256)).astype(np.int8)\n"
        "sc = np.full(64, 0.5, np.float32)\n"
        "ws = K.i8_row_sums(wq)\n"
        "x16, x32 = (rng.standard_normal((m, 256)).astype(np.float32) for m in (16, 32))\n"
        "kw16, kw32 = K.w8a8_prefill_kw(16, 256, 64), K.w8a8_prefill_kw(32, 256, 64)\n"
        "print('KW', sorted(kw16), sorted(kw32), K.I8_PANEL)\n"
        "y16 = K.dynamic_matmul_w8a8(x16, wq, sc, wsum=ws, **kw16)\n"
        "print('P', len(KM._w8a8_rowsplit.signatures), len(KM._w8a8_blocks.signatures),\n"
        "      len(KM._w8a8_run.signatures))\n"
        "y32 = K.dynamic_matmul_w8a8(x32, wq, sc, wsum=ws, **kw32)\n"
        "print('R', len(KM._w8a8_run.signatures), len(KM._w8a8_rowsplit.signatures),\n"
        "      len(KM._w8a8_panel.signatures))\n"
        "for kw, x, w in ((kw16, x16, wq[:4]), (kw32, x32 * 1, wq)):\n"
        "    try:\n"
        "        K.dynamic_matmul_w8a8(x, w, sc[:w.shape[0]], np.int64(10**9),\n"
        "                              K.i8_row_sums(w), **kw)\n"
        "        print('NO RAISE')\n"
        "    except ValueError as e:\n"
        "        print('RAISE', 'w8a8_prefill_kw' in str(e))\n"
        "eq = [bool((K.dynamic_matmul_w8a8(x, wq, sc, wsum=ws, prefill=None) == y).all())\n"
        "      for x, y in ((x16, y16), (x32, y32))]\n"
        "print('EQ', eq)\n")
    out = run_cold(code, tmp_path, env={"NUMBA_NUM_THREADS": "2"})
    assert "EQ [True, True]" in out, out
    if not K.I8_PANEL:                  # no panel tiles on this host: the dot tiles only
        assert "KW ['prefill'] ['prefill'] False" in out, out
        return
    assert "KW ['rowsplit', 'tiles'] ['outsplit'] True" in out, out
    assert "P 0 0 0" in out and "R 0 1 1" in out, out
    assert out.count("RAISE True") == 2, out


@pytest.mark.parametrize("m,rows,cols,group", [
    (1, 9, 256, 32),        # decode, mode 3 with int8 activations
    (3, 2, 131, None),      # rows < 4: one tile per output row, tail columns
    (6, 13, 200, 32),       # prefill tiles, tail group
    (12, 14, 256, 32),      # the W4A8 panel's m
])
def test_checked_entries_equal_the_public_cores(m, rows, cols, group):
    """The one-function entries ``PackedLinear`` calls give bit for bit the
    public cores' result in every variant, and an empty ``(0, rows)`` array
    for NaN / Inf input."""
    packed, sc = _int4(rows, cols, group)
    g = group or 0
    x = RNG.standard_normal((m, cols)).astype(np.float32)
    tern = RNG.integers(0, 256, (rows, -(-cols // 4))).astype(np.uint8)
    al = np.array([0.37], np.float32)
    pairs = [(K.int4_linear_checked_a8, K.packed_int4_linear_a8, (packed, sc, cols, g)),
             (K.int4_linear_checked_a16, K.packed_int4_linear_a16, (packed, sc, cols, g)),
             (K.ternary_linear_checked_a8, K.packed_ternary_linear_a8, (tern, al, cols)),
             (K.ternary_linear_checked_a16, K.packed_ternary_linear_a16, (tern, al, cols))]
    for checked, core, args in pairs:
        kws = [{}, {"prefill": None}] + ([{"decode": None}] if m >= 4 and rows >= 4 else [])
        for kw in kws:
            want = core(x, *args, **kw)
            assert want.shape == (m, rows)
            np.testing.assert_array_equal(checked(x, *args, **kw), want)
            if checked is K.int4_linear_checked_a8 and "decode" in kw:
                # the panel-only variant where the panel takes the shape, else
                # the tiles-only one
                tiles = K.w4a8_tiles_kw(m, rows, cols, g)
                assert ("tiles" in tiles) == (K.W4_PANEL and m >= K.W4_PANEL_MIN_M)
                np.testing.assert_array_equal(checked(x, *args, **kw, **tiles), want)
        for bad in (np.nan, np.inf, -np.inf):
            xb = x.copy()
            xb[m - 1, cols // 2] = bad
            assert checked(xb, *args).shape == (0, rows)
            assert checked(xb, *args, prefill=None).shape == (0, rows)


def test_kinds_compile_only_the_decode_variants_they_reach(tmp_path):
    """int4 and ternary never reach the 128-column intN modes, and only int4
    with int8 activations reaches the mode-3 int4 decode: a kind compiles
    neither variant it cannot reach.  A fresh process with an empty cache of
    its own: a caller loaded from the cache carries its callees' code without
    touching their dispatchers, so only a cold compile shows what is typed."""
    from subproc import run_cold
    code = (
        "import warnings\n"
        "import numpy as np\n"
        "from numba.core.errors import NumbaPerformanceWarning\n"
        # a decode entry has no parallel loop of its own: no warning about it
        "warnings.simplefilter('error', NumbaPerformanceWarning)\n"
        "from opscope_nb.kernels import _packed_quant as PQ\n"
        "from opscope_nb.formats import Decomp\n"
        "from opscope_nb.runtime import PackedLinear\n"
        "w = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)\n"
        "x = np.ones((1, 256), np.float32)\n"
        "for lab, act in (('int4/chan', 'f32'), ('ternary', 'int8')):\n"
        "    PackedLinear.pack(w, Decomp.from_label(lab))(x, act)\n"
        "print('A', len(PQ._decode_rows1.signatures), len(PQ._decode_i4m3.signatures))\n"
        "PackedLinear.pack(w, Decomp.from_label('int4/g32'))(x, 'int8')\n"
        "print('B', len(PQ._decode_rows1.signatures), len(PQ._decode_i4m3.signatures))\n")
    out = run_cold(code, tmp_path)
    assert "A 0 0" in out and "B 0 1" in out, out


def test_w8a8_prefill_kw_fresh_dict_and_thread_count():
    """The public helper returns a dict of its own (editing it does not
    change what later calls get, though the runtime shares one per path),
    and the path it names follows ``numba.set_num_threads`` in this thread."""
    import numba
    from opscope_nb.kernels import _w8a8 as KM
    kw = K.w8a8_prefill_kw(16, 256, 64)
    kw["prefill"] = "edited"
    assert "prefill" not in K.w8a8_prefill_kw(16, 256, 64)
    assert KM._prefill_kw(16, 256, 64, PAR_MIN, True) == K.w8a8_prefill_kw(16, 256, 64)
    assert KM._prefill_kw(3, 256, 64, PAR_MIN, True) == {"prefill": None}
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        # one thread: a parallel-sized call the row split would take on two
        # threads goes to the panel (the row plan needs 2+ threads)
        one = {"rowsplit": None, "tiles": None} if KM.I8_PANEL else {"prefill": None}
        assert K.w8a8_prefill_kw(32, 256, 64) == one
    finally:
        numba.set_num_threads(before)
    if KM.I8_PANEL and before >= 2:
        assert K.w8a8_prefill_kw(32, 256, 64) == {"outsplit": None}


def test_w8a8_decode_from_python_compiles_no_prefill_path(tmp_path):
    """``opscope_nb.runtime.matmul.matmul_w8a8`` / ``dynamic_matmul_w8a8`` below
    ``I8_PANEL_MIN_M`` rows call the cores with ``prefill=None``: a decode
    compiles neither the panel nor the row split (about two thirds of the
    W8A8 compile), and still equals the exact integer product.  A fresh
    process with an empty cache of its own (a caller loaded from the cache
    shows no signatures at all)."""
    assert K.w8a8_prefill_kw(K.I8_PANEL_MIN_M - 1) == {"prefill": None}
    assert K.w8a8_prefill_kw(K.I8_PANEL_MIN_M) == {}
    from subproc import run_cold
    code = (
        "import numpy as np\n"
        "from opscope_nb.runtime import matmul as M\n"
        "from opscope_nb.kernels import _w8a8 as KM\n"
        "rng = np.random.default_rng(0)\n"
        "xq = rng.integers(-127, 128, (3, 96)).astype(np.int8)\n"
        "wq = rng.integers(-127, 128, (40, 96)).astype(np.int8)\n"
        "sx, sc = np.full(3, 0.5, np.float32), np.full(40, 0.25, np.float32)\n"
        "y = M.matmul_w8a8(xq, sx, wq, sc)\n"
        "ref = (xq.astype(np.int64) @ wq.astype(np.int64).T).astype(np.float32) / 8\n"
        "M.dynamic_matmul_w8a8(np.ones((2, 96), np.float32), wq, sc)\n"
        "print('EQ', bool((y == ref).all()))\n"
        "print('D', len(KM._w8a8_panel.signatures), len(KM._w8a8_rowsplit.signatures))\n"
        "M.matmul_w8a8(np.ones((16, 96), np.int8), np.ones(16, np.float32), wq, sc)\n"
        "print('P', len(KM._w8a8_panel.signatures) + len(KM._w8a8_rowsplit.signatures))\n")
    out = run_cold(code, tmp_path)
    assert "EQ True" in out and "D 0 0" in out, out
    # a prefill does reach them: the counts above can tell the two apart
    assert "P 0" not in out, out


def test_block_functions_compile_once_for_serial_and_parallel_calls(tmp_path):
    """A core's serial path and its ``prange`` path call the same block
    function with the same argument types (``np.int64(0)``, not a literal 0 or
    a ``uint64`` prange index), and ``PackedLinear``'s int8 forward shares the
    public ``dynamic_matmul_w8a8``'s cores, called with ``min_parallel`` or
    without (no literal ``PAR_MIN``): each compiles once.  A fresh process with an empty cache of its own."""
    from subproc import run_cold
    code = (
        "import numpy as np\n"
        "from opscope_nb import kernels as K\n"
        "from opscope_nb.runtime import matmul as M\n"
        "from opscope_nb.kernels import _w8a8 as KM\n"
        "from opscope_nb.formats import Decomp\n"
        "from opscope_nb.runtime import PackedLinear\n"
        "rng = np.random.default_rng(0)\n"
        "wq = rng.integers(-127, 128, (64, 256)).astype(np.int8)\n"
        "sc = np.full(64, 0.5, np.float32)\n"
        "for m in (2, 3):\n"
        "    x = rng.standard_normal((m, 256)).astype(np.float32)\n"
        "    y = M.dynamic_matmul_w8a8(x, wq, sc, min_parallel=0 if m == 3 else 10**9)\n"
        "    ref = M.dynamic_matmul_w8a8(x, wq, sc)\n"
        # the kernel itself with min_parallel omitted (a literal default), on
        # the decode path opscope_nb.runtime.matmul picks for these m
        "    ref2 = K.dynamic_matmul_w8a8(x, wq, sc, prefill=None)\n"
        "    print('EQ', bool((y == ref).all() and (y == ref2).all()))\n"
        "w = rng.standard_normal((64, 256)).astype(np.float32)\n"
        "PackedLinear.pack(w, Decomp.int8())(x, 'int8')\n"
        "print('B', len(KM._w8a8_blocks.signatures), len(KM._w8a8_decode.signatures),\n"
        "      len(KM._q8_rows.signatures), len(KM._w8a8_run.signatures),\n"
        "      len(KM._quantize_rows_into.signatures))\n")
    out = run_cold(code, tmp_path)
    # (dynamic_matmul_w8a8 itself is inlined into its callers: the cores below
    # it are where a literal PAR_MIN made a second specialisation)
    assert out.count("EQ True") == 2 and "B 1 1 1 1 1" in out, out


def test_prefill_variants_compile_no_decode_tiles_and_no_foreign_panel(tmp_path):
    """A prefill-only low-bit entry (``decode=None``) compiles no decode tiles
    (numba cannot prune ``prefill is None`` when ``prefill`` is an omitted
    ``True``; the raise under ``decode is None`` ends that branch), only int4
    compiles the W4A8 panel, and an int4 prefill the panel takes whole
    (``tiles=None``) compiles no dot-tile core.  ``tiles=None`` on a shape the
    panel does not take raises.  A fresh process with an empty cache; the
    second print shows the counts can move (a decode does reach them)."""
    from subproc import run_cold
    code = (
        "import numpy as np\n"
        "from opscope_nb import kernels as K\n"
        "from opscope_nb.kernels import _packed_quant as PQ\n"
        "from opscope_nb.formats import Decomp\n"
        "from opscope_nb.runtime import PackedLinear\n"
        "rng = np.random.default_rng(0)\n"
        "w = rng.standard_normal((64, 256)).astype(np.float32)\n"
        "x = rng.standard_normal((16, 256)).astype(np.float32)\n"
        "lin = PackedLinear.pack(w, Decomp.from_label('int4/g32'))\n"
        "lin(x, 'int8')\n"
        "print('I', len(PQ._blocks_dec.signatures), len(PQ._run.signatures))\n"
        "n = len(PQ.w4a8_panel_matmul.signatures)\n"
        "PackedLinear.pack(w, Decomp.from_label('ternary'))(x, 'int8')\n"
        "print('T', len(PQ._blocks_dec.signatures), len(PQ.w4a8_panel_matmul.signatures) - n)\n"
        "a = lin._arrays\n"
        "try:\n"
        "    K.int4_linear_checked_a8(x[:5], a['codes'], a['scales'], 256, 32, decode=None,\n"
        "                             tiles=None)\n"
        "except ValueError as e:\n"
        "    print('R', 'w4a8_tiles_kw' in str(e))\n"
        "lin(x[:1], 'int8')\n"
        "print('D', len(PQ._blocks_dec.signatures))\n"
        "lin(x[:5], 'int8')\n"
        "print('P', len(PQ._run_a8.signatures))\n")
    out = run_cold(code, tmp_path)
    # ternary (after int4): its prefill entry typed neither the decode tiles
    # nor a panel of its own
    assert "T 0 0" in out, out
    # int4/g32: no decode tiles; on a panel host no dot-tile core either
    assert ("I 0 0" if K.W4_PANEL else "I 0 1") in out, out
    assert "R True" in out and "D 1" in out, out
    # int4 below the panel's rows: the dot tiles alone, never the mixed core
    # (_run_a8: the panel and the tiles behind a run-time test)
    assert "P 0\n" in out, out
