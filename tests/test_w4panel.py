"""W4A8 outer-product panel (prefill, ``m >= W4_PANEL_MIN_M`` on VNNI hosts).

The panel kernel itself runs on every host (its tile lowers to portable
vector IR without VNNI), so it is tested everywhere; only the dispatch test
needs a host that picks it.

Compared with the NumPy twins of ``naive_packed_quant``: integer sums bit for
bit (unit scales), scaled results against the float64 twin, the tile on every
int8 path this CPU runs, the panel/unpack layouts, and the dispatch from the
public W4A8 entry points.
"""
import numba
import numpy as np
import pytest

import naive_packed_quant as nq
from opscope_nb import kernels as K
from opscope_nb.kernels import _simd as S
from opscope_nb.kernels import _w4panel as W

RNG = np.random.default_rng(4321)


def _codes(rows, cols, lo=-8, hi=8):
    c = RNG.integers(lo, hi, (rows, cols)).astype(np.int8)
    return c, nq.pack_nibbles(c)


def _panel(xq, codes, scales, cols, group, min_parallel=1 << 60):
    m, n = xq.shape[0], codes.shape[0]
    y = np.full((m, n), np.nan, np.float32)
    sf = scales.ravel()
    W.w4a8_panel_matmul(xq, np.ones(m, np.float32), codes, sf, sf.size // n, cols, group,
                        min_parallel, y)
    return y


# (m, n, cols, group); group 0 = per channel
SHAPES = [
    (16, 6, 32, 32),          # one chunk, one panel
    (17, 12, 1024, 32),       # padded second panel
    (40, 13, 300, 128),       # short last group (rem chunks) + 12-column tail
    (9, 7, 96, 64),           # 1.5 groups, n % 6 outputs from an overlapping tile
    (33, 18, 2064, 0),        # per channel: pseudo-groups + 16-column tail
    (16, 6, 1056, 96),        # group of 3 chunks, 11 full groups
    (48, 24, 4136, 32),       # three panels, long rows, 40-column tail
]


@pytest.mark.parametrize("m,n,cols,group", SHAPES)
def test_panel_integer_sums_exact(m, n, cols, group):
    """Unit scales: every output is the exact integer product (|sum| < 2**24),
    including code -8 and activation -128, the n % 6 last outputs too."""
    c, packed = _codes(n, cols)
    xq = RNG.integers(-128, 128, (m, cols)).astype(np.int8)
    xq[0] = -128
    c[1] = -8
    packed = nq.pack_nibbles(c)
    ng = 1 if group == 0 else -(-cols // group)
    y = _panel(xq, packed, np.ones((n, ng), np.float32), cols, group)
    want = xq.astype(np.int64) @ c.astype(np.int64).T
    np.testing.assert_array_equal(y.astype(np.int64), want)


def test_panel_extremes():
    """All codes +-8/7 against x = +-127 over 4096 columns: no lane overflows."""
    m, n, cols = 16, 6, 4096
    c = np.where(RNG.random((n, cols)) < 0.5, -8, 7).astype(np.int8)
    xq = np.where(RNG.random((m, cols)) < 0.5, -127, 127).astype(np.int8)
    xq[3] = -128
    y = _panel(xq, nq.pack_nibbles(c), np.ones((n, 1), np.float32), cols, 0)
    np.testing.assert_array_equal(y.astype(np.int64), xq.astype(np.int64) @ c.astype(np.int64).T)


@pytest.mark.parametrize("m,n,cols,group", [(16, 12, 1024, 32), (33, 13, 300, 128),
                                            (20, 7, 2064, None), (64, 30, 520, 64)])
def test_w4a8_prefill_vs_twin(m, n, cols, group):
    """The public W4A8 entry points with real scales against the float64 twin
    of the same integer math (panel on VNNI hosts, dot tiles elsewhere)."""
    w = RNG.standard_normal((n, cols)).astype(np.float32)
    codes, scales = nq.quant_sym(w, 4, group)
    packed = nq.pack_nibbles(codes)
    sc = scales[:, 0].copy() if group is None else scales
    x = RNG.standard_normal((m, cols)).astype(np.float32)
    xq, sx = nq.quant_rows_i8(x)
    ref = (xq.astype(np.float64) * sx[:, None]) @ nq.int4_dense(packed, sc, cols, group).T
    g = 0 if group is None else group
    y = K.packed_int4_linear(x, packed, sc, cols, g, True)
    assert y.dtype == np.float32 and y.shape == (m, n)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-6
    y2 = K.lowbit_matmul_a8(xq, sx, packed, packed, sc.ravel(), sc.size // n, cols, g,
                            K.FMT_INT4)
    np.testing.assert_array_equal(y, y2)


@pytest.mark.skipif(not W.W4_PANEL, reason="the dispatch takes the panel on vpdpbusd hosts only")
def test_dispatch_uses_panel():
    """``w4a8_matmul`` at m >= W4_PANEL_MIN_M returns the panel's bits for
    every output, the n % 6 last ones too (one more tile on the last 6)."""
    n, cols = 13, 512
    w = RNG.standard_normal((n, cols)).astype(np.float32)
    codes, scales = nq.quant_sym(w, 4, 32)
    packed = nq.pack_nibbles(codes)
    for m in (K.W4_PANEL_MIN_M, 40):
        xq, sx = nq.quant_rows_i8(RNG.standard_normal((m, cols)).astype(np.float32))
        y = K.w4a8_matmul(xq, sx, packed, scales, cols, 32)
        yp = np.empty((m, n), np.float32)
        W.w4a8_panel_matmul(xq, sx, packed, scales.ravel(), scales.shape[1], cols, 32,
                            1 << 60, yp)
        np.testing.assert_array_equal(y, yp)


def test_parallel_equals_serial():
    """Below ``min_parallel`` the prange loops run on one thread (the
    thread count set to 1 and back): the same bits, the count restored."""
    import numba
    m, n, cols = 40, 60, 1024
    c, packed = _codes(n, cols)
    sc = RNG.random((n, cols // 32)).astype(np.float32)
    xq = RNG.integers(-127, 128, (m, cols)).astype(np.int8)
    before = numba.get_num_threads()
    np.testing.assert_array_equal(_panel(xq, packed, sc, cols, 32, 0),
                                  _panel(xq, packed, sc, cols, 32, 1 << 60))
    assert numba.get_num_threads() == before


def test_pack_and_unpack_layouts():
    """Panel words, offset corrections and unpacked offset codes against NumPy."""
    m, cols, rows = 13, 320, 16
    nch, cpg = cols // 32, 3
    xq = RNG.integers(-128, 128, (m, cols)).astype(np.int8)
    ngt = -(-nch // cpg)
    P = np.zeros(rows * 8 * nch, np.int32)
    C = np.zeros(rows * ngt, np.int32)
    K.pack_w4_panel(xq, 0, rows, nch, cpg, P, 0, C, 0)
    xp = np.zeros((rows, cols), np.int8)
    xp[:m] = xq
    words = xp.view(np.int32)                       # [rows, 8 * nch], first byte lowest
    np.testing.assert_array_equal(P.reshape(8 * nch, rows), words.T)
    sums = xp.astype(np.int64).reshape(rows, ngt, -1).sum(2) if nch % cpg == 0 else np.stack(
        [xp[:, 32 * g * cpg:32 * min(nch, (g + 1) * cpg)].astype(np.int64).sum(1)
         for g in range(ngt)], 1)
    np.testing.assert_array_equal(C.reshape(ngt, rows), -8 * sums.T)
    c, packed = _codes(8, cols)
    U = np.zeros(6 * cols, np.uint8)
    K.unpack_w4_tile(packed, 2, nch, U)
    np.testing.assert_array_equal(U.reshape(6, cols), (c[2:8].astype(np.int64) + 8))


_RUNNERS = {}


def _tile_runner(path):
    """@njit: panel + unpack + the ``path``'s tile over ``ng`` groups of ``gkk``
    steps; returns the float32 results [rows, 6]."""
    if path in _RUNNERS:
        return _RUNNERS[path]
    tile = W.make_w4_panel_tile(path)
    L = S._PANEL_LANES[path]
    R = W._panel_rows(path)

    @numba.njit
    def run(xq, packed, sf, cpg):
        nch = xq.shape[1] // 32
        ng = nch // cpg
        P = np.empty(R * 8 * nch, dtype=np.int32)
        C = np.empty(R * ng, dtype=np.int32)
        K.pack_w4_panel(xq, 0, R, nch, cpg, P, 0, C, 0)
        U = np.empty(6 * 32 * nch, dtype=np.uint8)
        K.unpack_w4_tile(packed, 0, nch, U)
        out = np.empty(R * 6, dtype=np.float32)
        tile(P, 0, C, 0, U, 0, 32 * nch, sf, 0, ng, 1, ng, 8 * cpg, out, 0)
        res = np.empty((R, 6), dtype=np.float32)
        for r in range(R):
            for j in range(6):
                res[r, j] = out[((r // L) * 6 + j) * L + r % L]
        return res

    _RUNNERS[path] = run
    return run


@pytest.mark.parametrize("path", S.I8_PATHS)
def test_tile_every_path(path):
    """The tile on every int8 path this CPU runs: integer group sums times
    power-of-two scales are exact in float32, so the results match NumPy bit
    for bit."""
    if not S.path_supported(path):
        pytest.skip(f"{path} cannot run on this CPU")
    R = W._panel_rows(path)
    cols, cpg = 512, 2
    ng = cols // 32 // cpg
    xq = RNG.integers(-128, 128, (R - 3, cols)).astype(np.int8)
    c, packed = _codes(6, cols)
    sf = (2.0 ** RNG.integers(-3, 4, (6, ng))).astype(np.float32)
    got = _tile_runner(path)(xq, packed, sf.ravel(), cpg)
    xp = np.zeros((R, cols), np.int64)
    xp[:R - 3] = xq
    gs = np.einsum("rgp,jgp->rjg", xp.reshape(R, ng, -1), c.astype(np.int64).reshape(6, ng, -1))
    want = (gs * sf[None].astype(np.float64)).sum(2)
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_make_tile_rejects_unknown_path():
    with pytest.raises(ValueError, match="unknown int8 path"):
        W.make_w4_panel_tile("sse9")


def test_njit_caller():
    """The panel core is callable from user @njit code."""
    @numba.njit
    def user(xq, sx, packed, sf, cols, y):
        K.w4a8_panel_matmul(xq, sx, packed, sf, sf.size // packed.shape[0], cols, 32, 1 << 60, y)
        return y

    m, n, cols = 16, 6, 64
    c, packed = _codes(n, cols)
    xq = RNG.integers(-127, 128, (m, cols)).astype(np.int8)
    y = user(xq, np.ones(m, np.float32), packed, np.ones(n * 2, np.float32), cols,
             np.zeros((m, n), np.float32))
    np.testing.assert_array_equal(y.astype(np.int64), xq.astype(np.int64) @ c.astype(np.int64).T)
