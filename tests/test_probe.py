"""Tests of opscope_nb.profile.probe and its @njit cores against the NumPy twins."""
import struct

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import naive_probe as N
from opscope_nb import kernels
from opscope_nb.profile import probe
from opscope_nb.io.synth import Dist, sample

SHAPES = [(1, 1), (1, 17), (17, 1), (7, 13), (33, 64)]
RTOL = 1e-6        # float64 sums in both; only the summation order differs


def _close(a, b, rtol=RTOL):
    assert a == pytest.approx(b, rel=rtol, abs=1e-12)


def _check_all(x):
    """Every probe vs its naive twin on one matrix."""
    _close(probe.frob(x), N.naive_frob(x))
    y = x * np.float32(0.9) + np.float32(0.01)
    _close(probe.rel_err(x, y), N.naive_rel_err(x, y))
    _close(probe.sigma_max(x), N.naive_sigma_max(x), 1e-5)
    _close(probe.stable_rank(x), N.naive_stable_rank(x), 1e-5)
    for bits in (2, 3, 4, 8, 16):
        _close(probe.quant_error(x, bits), N.naive_quant_error(x, bits))
        _close(probe.per_channel_quant_error(x, bits),
               N.naive_per_channel_quant_error(x, bits))
    for n, m in ((2, 4), (1, 3), (4, 8), (3, 4), (5, 20), (17, 17)):   # m > 16: quickselect path
        _close(probe.nm_sparsity_error(x, n, m), N.naive_nm_sparsity_error(x, n, m))
    _close(probe.ternary_error(x), N.naive_ternary_error(x))
    for ratio in (1.5, 5.0):
        c, r = probe.outlier_channels(x, ratio)
        c2, r2 = N.naive_outlier_channels(x, ratio)
        assert c == c2
        _close(r, r2)
    for budget in (0.005, 0.05, 0.3):
        assert probe.best_bitwidth(x, budget) == N.naive_best_bitwidth(x, budget)
    for rt in (1.0, 100.0, 1e4):
        assert probe.cardinality(x, rt) == N.naive_cardinality(x, rt)
    for bits in (2, 4, 8):
        c, s = kernels.quantize_rows_sym(x, bits)
        c2, s2 = N.naive_quantize_rows_sym(x, bits)
        np.testing.assert_array_equal(c, c2)
        np.testing.assert_array_equal(s, s2)
        c, s = kernels.quantize_tensor_sym(x, bits)
        c2, s2 = N.naive_quantize_tensor_sym(x, bits)
        np.testing.assert_array_equal(c, c2)
        assert s == s2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dist", list(Dist))
def test_probes_match_naive(dist, shape):
    _check_all(sample(dist, *shape, seed=7))


@pytest.mark.slow
@pytest.mark.parametrize("dist", [Dist.GAUSSIAN, Dist.QUANTIZED])
def test_probes_match_naive_big(dist):
    x = sample(dist, 1024, 3072, seed=1)
    _close(probe.frob(x), N.naive_frob(x))
    _close(probe.sigma_max(x), N.naive_sigma_max(x), 1e-6)
    _close(probe.quant_error(x, 8), N.naive_quant_error(x, 8))
    _close(probe.per_channel_quant_error(x, 4), N.naive_per_channel_quant_error(x, 4))
    _close(probe.nm_sparsity_error(x), N.naive_nm_sparsity_error(x))
    _close(probe.ternary_error(x), N.naive_ternary_error(x))
    assert probe.outlier_channels(x, 3.0)[0] == N.naive_outlier_channels(x, 3.0)[0]
    assert probe.best_bitwidth(x, 0.02) == N.naive_best_bitwidth(x, 0.02)
    assert probe.cardinality(x, 1000.0) == N.naive_cardinality(x, 1000.0)
    c, s = kernels.quantize_rows_sym(x, 8)
    c2, s2 = N.naive_quantize_rows_sym(x, 8)
    np.testing.assert_array_equal(c, c2)
    np.testing.assert_array_equal(s, s2)


def test_zero_matrix_conventions():
    z = np.zeros((4, 6), np.float32)
    assert probe.frob(z) == 0.0
    assert probe.rel_err(z, np.ones_like(z)) == 0.0      # all-zero reference -> 0
    assert probe.sigma_max(z) == 0.0 and probe.stable_rank(z) == 0.0
    assert probe.quant_error(z, 4) == 0.0
    assert probe.per_channel_quant_error(z, 4) == 0.0
    assert probe.nm_sparsity_error(z) == 0.0 and probe.ternary_error(z) == 0.0
    assert probe.outlier_channels(z, 5.0) == (0, 0.0)       # 0 / floored median
    assert probe.best_bitwidth(z, 0.01) == 3
    assert probe.cardinality(z, 10.0) == 1
    codes, scales = kernels.quantize_rows_sym(z, 8)
    assert not codes.any() and (scales == 1).all()       # scale 1 for all-zero rows
    _, s = kernels.quantize_tensor_sym(z, 8)
    assert s == 1.0


def test_return_types():
    x = sample(Dist.GAUSSIAN, 8, 8, seed=1)
    for v in (probe.frob(x), probe.rel_err(x, x), probe.sigma_max(x), probe.stable_rank(x),
              probe.quant_error(x, 4), probe.per_channel_quant_error(x, 4),
              probe.nm_sparsity_error(x), probe.ternary_error(x)):
        assert type(v) is float
    c, r = probe.outlier_channels(x, 2.0)
    assert type(c) is int and type(r) is float
    assert type(probe.best_bitwidth(x, 0.5)) is int
    assert probe.best_bitwidth(x, 1e-9) is None
    assert type(probe.cardinality(x, 10.0)) is int


# ---------------------------------------------------------------- rounding

def test_round_half_away_scalar():
    vals = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997,
                     8388609.0, -8388609.0, 3.0, 0.0, 1e-30], np.float32)
    want = np.array([1, 2, 3, -1, -3, 0, 0, 8388609, -8388609, 3, 0, 0], np.float32)
    got = np.array([kernels.round_half_away(v) for v in vals], np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(np.round(vals), want)      # half-to-even differs
    for v in (2.5, -3.5, 0.5000000001):
        assert kernels.round_half_away(v) == N.naive_round_half_away(np.float64(v))


def test_quant_codes_round_half_away():
    # bits=8, amax=127 -> scale 1: x / scale hits exact .5 ties
    x = np.array([[2.5, 0.5, -1.5, -2.5, 127.0, 126.5]], np.float32)
    codes, scales = kernels.quantize_rows_sym(x, 8)
    assert scales[0] == 1.0
    np.testing.assert_array_equal(codes[0], [3, 1, -2, -3, 127, 127])
    assert not np.array_equal(np.round(x[0]), codes[0])
    codes_t, s = kernels.quantize_tensor_sym(x, 8)
    np.testing.assert_array_equal(codes_t, codes)
    # per-tensor error from these codes: |0.5| on five entries
    want = np.sqrt(5 * 0.25 / np.sum(x.astype(np.float64) ** 2))
    _close(probe.quant_error(x, 8), want)
    _close(probe.per_channel_quant_error(x, 8), want)


def test_cardinality_round_half_away():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5], np.float32)
    # half away: {1, 2, 3, -1, -2} -> 5; half-to-even would give {0, 2, -2} -> 3
    assert probe.cardinality(x, 1.0) == 5
    assert len(np.unique(np.round(x))) == 3


def test_quantized_dist_snaps_half_away():
    g = sample(Dist.GAUSSIAN, 300, 300, seed=9)
    q = sample(Dist.QUANTIZED, 300, 300, seed=9)
    np.testing.assert_array_equal(q, N.naive_round_half_away(2 * g) / np.float32(2))


# ---------------------------------------------------------------- known values

def test_nm_ties_and_short_group():
    # equal |v| everywhere: 2:4 drops two of each four whatever the tie order
    x = np.array([[1, -1, 1, -1, 1, 1]], np.float32)     # last group short (2 <= n)
    _close(probe.nm_sparsity_error(x, 2, 4), np.sqrt(2 / 6))
    y = np.array([[3, 1, 2, 2, 5, 0]], np.float32)        # ties between the 2s
    _close(probe.nm_sparsity_error(y, 2, 4), np.sqrt((1 + 4) / 43))
    _close(probe.nm_sparsity_error(y, 1, 1), 0.0)
    _close(probe.nm_sparsity_error(y, 3, 3), 0.0)
    _close(probe.nm_sparsity_error(y, 1, 6), np.sqrt(1 - 25 / 43))
    for n, m in ((2, 4), (1, 2), (2, 3)):
        _close(probe.nm_sparsity_error(y, n, m), N.naive_nm_sparsity_error(y, n, m))


def test_nm_large_groups_with_ties():
    # the quantised dist has many equal |v|: the quickselect path (m > 16) must
    # keep the lowest-index ties exactly like the stable sort
    x = sample(Dist.QUANTIZED, 9, 130, seed=4)
    for n, m in ((1, 17), (7, 32), (31, 32), (40, 100), (3, 130)):
        _close(probe.nm_sparsity_error(x, n, m), N.naive_nm_sparsity_error(x, n, m))


def test_ternary_known_value():
    x = np.array([[1.0, -1.0, 0.1, 0.0]], np.float32)
    # mean|x| = 0.525, delta = 0.3675, alpha = 1, t = [1, -1, 0, 0]
    x64 = x.astype(np.float64)
    _close(probe.ternary_error(x), float(np.sqrt(x64[0, 2] ** 2 / np.sum(x64 ** 2))))


def test_outlier_channels_planted():
    x = np.ones((16, 64), np.float32)
    x[3, 5] = -20.0
    x[7, 40] = 9.0
    assert probe.outlier_channels(x, 5.0) == (2, 20.0)
    assert probe.outlier_channels(x, 10.0) == (1, 20.0)
    # upper median: sorted(cmax)[cols // 2]
    y = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    assert probe.outlier_channels(y, 1.0) == (1, 4.0 / 3.0)


def test_stable_rank_planted():
    rng = np.random.default_rng(0)
    u = np.linalg.qr(rng.standard_normal((40, 3)))[0]
    v = np.linalg.qr(rng.standard_normal((30, 3)))[0]
    x = (u * [3.0, 2.0, 1.0]) @ v.T
    _close(probe.sigma_max(x, 200), 3.0, 1e-5)
    _close(probe.stable_rank(x), (9 + 4 + 1) / 9, 1e-3)


def test_cardinality_cap_and_saturation():
    x = np.arange(200_000, dtype=np.float32)
    assert probe.cardinality(x, 1.0) == 100_001
    assert probe.cardinality(x[:100_000], 1.0) == 100_000
    assert probe.cardinality(x[:100_001], 1.0) == 100_001
    huge = np.array([1e38, 3e38, -3e38, 1.0], np.float32)  # v*round_to overflows
    assert probe.cardinality(huge, 1e6) == N.naive_cardinality(huge, 1e6) == 3
    # a huge key span takes the hash-set path instead of the byte map
    wide = np.array([0.0, 1e15, -1e15, 5.0, -0.4, 0.3], np.float32)
    assert probe.cardinality(wide, 1.0) == 4                 # -0.4 and 0.3 -> 0
    many = np.concatenate([[1e15, -1e15], np.arange(-500, 1000), np.arange(150_000)])
    many = many.astype(np.float32)
    assert probe.cardinality(many[:1502], 1.0) == N.naive_cardinality(many[:1502], 1.0) == 1502
    assert probe.cardinality(many, 1.0) == 100_001


def test_best_bitwidth_order():
    x = sample(Dist.GAUSSIAN, 32, 64, seed=3)
    errs = {b: probe.per_channel_quant_error(x, b) for b in (3, 4, 6, 8)}
    assert errs[3] > errs[4] > errs[6] > errs[8]
    assert probe.best_bitwidth(x, errs[4] * 1.0001) == 4
    assert probe.best_bitwidth(x, errs[4]) == 6        # strict <
    assert probe.best_bitwidth(x, 1e-9) is None
    assert kernels.best_bitwidth(x, 1e-9) == -1


# ---------------------------------------------------------------- input handling

def test_dtypes_and_layouts_equivalent():
    x = sample(Dist.OUTLIER, 24, 40, seed=2)
    want = probe.per_channel_quant_error(x, 4)
    assert probe.per_channel_quant_error(x.astype(np.float64), 4) == want
    big = np.asfortranarray(x)
    assert probe.per_channel_quant_error(big, 4) == want
    wide = np.zeros((24, 80), np.float32)
    wide[:, ::2] = x
    assert probe.per_channel_quant_error(wide[:, ::2], 4) == want   # non-contiguous
    assert probe.nm_sparsity_error(x.T.copy()) == probe.nm_sparsity_error(x.T)
    h = x.astype(np.float16)
    assert probe.ternary_error(h) == probe.ternary_error(h.astype(np.float32))
    ro = x.copy()
    ro.flags.writeable = False                     # e.g. a memmap / np.frombuffer view
    assert probe.per_channel_quant_error(ro, 4) == want
    assert probe.frob(ro) == probe.frob(x)
    i = np.arange(-12, 12, dtype=np.int32).reshape(4, 6)
    assert probe.quant_error(i, 3) == probe.quant_error(i.astype(np.float32), 3)


def test_any_ndim_tensor_probes():
    x = sample(Dist.GAUSSIAN, 6, 20, seed=4)
    t3 = x.reshape(2, 3, 20)
    flat = x.ravel()
    for f in (probe.frob, probe.ternary_error, lambda a: probe.quant_error(a, 4),
              lambda a: probe.cardinality(a, 100.0)):
        assert f(t3) == f(x) and f(flat) == pytest.approx(f(x), rel=1e-12)
    assert probe.rel_err(t3, t3 * 2) == pytest.approx(1.0)


def _bad_inputs():
    nan = np.ones((3, 4), np.float32)
    nan[1, 2] = np.nan
    inf = np.ones((3, 4), np.float64)
    inf[0, 0] = np.inf
    return [
        (nan, ValueError, "finite"),
        (inf, ValueError, "finite"),
        (np.ones((3, 4)) * 1e300, ValueError, "finite"),       # overflows float32
        (np.zeros((0, 4), np.float32), ValueError, "empty"),
        (np.ones((3, 4), bool), TypeError, "dtype"),
        (np.ones((3, 4), complex), TypeError, "dtype"),
        (np.array([["a", "b"]]), TypeError, "dtype"),
        (np.array([[1, 2], [3]], dtype=object), TypeError, "dtype"),
    ]


MATRIX_PROBES = [
    ("sigma_max", lambda x: probe.sigma_max(x)),
    ("stable_rank", lambda x: probe.stable_rank(x)),
    ("per_channel_quant_error", lambda x: probe.per_channel_quant_error(x, 4)),
    ("nm_sparsity_error", lambda x: probe.nm_sparsity_error(x)),
    ("outlier_channels", lambda x: probe.outlier_channels(x, 5.0)),
    ("best_bitwidth", lambda x: probe.best_bitwidth(x, 0.1)),
]
TENSOR_PROBES = [
    ("frob", lambda x: probe.frob(x)),
    ("rel_err", lambda x: probe.rel_err(x, x)),
    ("quant_error", lambda x: probe.quant_error(x, 4)),
    ("ternary_error", lambda x: probe.ternary_error(x)),
    ("cardinality", lambda x: probe.cardinality(x, 10.0)),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("name,f", MATRIX_PROBES + TENSOR_PROBES)
def test_bad_values_and_dtypes(name, f):
    for x, exc, msg in _bad_inputs():
        with pytest.raises(exc, match=msg):
            f(x)


@pytest.mark.parametrize("name,f", MATRIX_PROBES)
def test_matrix_probes_need_2d(name, f):
    with pytest.raises(ValueError, match="2-D"):
        f(np.ones(5, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        f(np.ones((2, 3, 4), np.float32))


def test_scalar_rejected_by_tensor_probes():
    with pytest.raises(ValueError, match="at least 1 dimension"):
        probe.frob(np.float32(3.0))


def test_bad_scalar_arguments():
    x = np.ones((4, 8), np.float32)
    for bits in (0, 1, 17):
        with pytest.raises(ValueError, match="bits"):
            probe.quant_error(x, bits)
        with pytest.raises(ValueError, match="bits"):
            probe.per_channel_quant_error(x, bits)
    with pytest.raises(TypeError, match="bits"):
        probe.quant_error(x, 4.0)
    with pytest.raises(ValueError, match="n must be <= m"):
        probe.nm_sparsity_error(x, 5, 4)
    for n, m in ((0, 4), (2, 0), (-1, 4)):
        with pytest.raises(ValueError):
            probe.nm_sparsity_error(x, n, m)
    with pytest.raises(TypeError):
        probe.nm_sparsity_error(x, 2.0, 4)
    with pytest.raises(ValueError, match="iters"):
        probe.sigma_max(x, -1)
    for bad in (np.nan, -1.0, 0.0, np.inf, 1e39):   # 1e39 overflows float32
        with pytest.raises(ValueError, match="ratio"):
            probe.outlier_channels(x, bad)
        with pytest.raises(ValueError, match="round_to"):
            probe.cardinality(x, bad)
    with pytest.raises(ValueError, match="budget"):
        probe.best_bitwidth(x, np.nan)
    with pytest.raises(TypeError, match="budget"):
        probe.best_bitwidth(x, "0.1")
    with pytest.raises(ValueError, match="same shape"):
        probe.rel_err(x, x[:, :4])
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        kernels.quantize_rows_sym(x, 9)


# ---------------------------------------------------------------- .tensor files

def test_save_load_round_trip(tmp_path):
    x = sample(Dist.GAUSSIAN, 5, 7, seed=1)
    p = tmp_path / "w.tensor"
    probe.save_tensor(p, x)
    raw = p.read_bytes()
    assert len(raw) == 8 + 4 * 35
    assert struct.unpack("<II", raw[:8]) == (5, 7)
    assert raw[8:] == x.astype("<f4").tobytes()
    y = probe.load_tensor(str(p))
    assert y.dtype == np.float32 and y.shape == (5, 7) and y.flags.writeable
    np.testing.assert_array_equal(y, x)
    # float64, non-contiguous input is stored as float32 row-major
    z = np.arange(12.0).reshape(3, 4)[:, ::2]
    probe.save_tensor(p, z)
    np.testing.assert_array_equal(probe.load_tensor(p), z.astype(np.float32))
    probe.save_tensor(p, np.zeros((0, 3), np.float32))
    assert probe.load_tensor(p).shape == (0, 3)


def test_load_file_written_by_hand(tmp_path):
    vals = [1.5, -2.0, 0.25, 3.0, 1e-3, -7.0]
    p = tmp_path / "rust.tensor"
    p.write_bytes(struct.pack("<II", 2, 3) + struct.pack("<6f", *vals))
    np.testing.assert_array_equal(probe.load_tensor(p),
                                  np.array(vals, np.float32).reshape(2, 3))


def test_load_truncated_and_oversized(tmp_path):
    x = sample(Dist.UNIFORM, 4, 4, seed=1)
    p = tmp_path / "w.tensor"
    probe.save_tensor(p, x)
    raw = p.read_bytes()
    p.write_bytes(raw[:-3])
    with pytest.raises(ValueError, match=r"truncated.*72 bytes.*69 bytes"):
        probe.load_tensor(p)
    p.write_bytes(raw + b"\0\0\0\0")
    with pytest.raises(ValueError, match=r"longer.*72 bytes.*76 bytes"):
        probe.load_tensor(p)
    p.write_bytes(raw[:5])
    with pytest.raises(ValueError, match="header"):
        probe.load_tensor(p)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="2-D"):
        probe.save_tensor(tmp_path / "a.tensor", np.ones(3))
    with pytest.raises(TypeError):
        probe.save_tensor(tmp_path / "a.tensor", np.ones((2, 2), complex))


# ---------------------------------------------------------------- determinism, njit use

def test_thread_count_independent():
    x = sample(Dist.OUTLIER, 300, 257, seed=8)
    fns = [lambda: probe.frob(x), lambda: probe.sigma_max(x),
           lambda: probe.quant_error(x, 4), lambda: probe.per_channel_quant_error(x, 3),
           lambda: probe.nm_sparsity_error(x), lambda: probe.ternary_error(x)]
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = [f() for f in fns]
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = [f() for f in fns]
    finally:
        numba.set_num_threads(before)
    assert one == many


def test_cores_callable_from_user_njit():
    @numba.njit
    def user_probe(w, bits):
        codes, scales = kernels.quantize_rows_sym(w, 8)
        return (kernels.quant_error(w, bits), kernels.per_channel_quant_error(w, bits),
                kernels.nm_sparsity_error(w, 2, 4), kernels.best_bitwidth(w, 0.05),
                kernels.round_half_away(np.float32(-2.5)), codes.sum(), scales.shape[0])

    x = sample(Dist.LOWRANK, 16, 24, seed=5)
    qe, pc, nm, bb, r, csum, ns = user_probe(x, 4)
    assert qe == probe.quant_error(x, 4)
    assert pc == probe.per_channel_quant_error(x, 4)
    assert nm == probe.nm_sparsity_error(x)
    assert bb == probe.best_bitwidth(x, 0.05)
    assert r == -3.0 and ns == 16
    assert csum == N.naive_quantize_rows_sym(x, 8)[0].astype(np.int64).sum()


# ---------------------------------------------------------------- hypothesis

_floats = st.floats(-1e3, 1e3, width=32, allow_nan=False, allow_infinity=False)
_matrices = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1,
                                                     max_side=12), elements=_floats)


@settings(max_examples=25, deadline=None)
@given(x=_matrices, bits=st.integers(2, 16))
def test_hyp_quant(x, bits):
    _close(probe.quant_error(x, bits), N.naive_quant_error(x, bits))
    _close(probe.per_channel_quant_error(x, bits), N.naive_per_channel_quant_error(x, bits))


@settings(max_examples=25, deadline=None)
@given(x=_matrices, data=st.data())
def test_hyp_nm_ternary_card(x, data):
    m = data.draw(st.integers(1, 24))
    n = data.draw(st.integers(1, m))
    _close(probe.nm_sparsity_error(x, n, m), N.naive_nm_sparsity_error(x, n, m))
    _close(probe.ternary_error(x), N.naive_ternary_error(x))
    assert probe.cardinality(x, 3.0) == N.naive_cardinality(x, 3.0)
    c, s = kernels.quantize_rows_sym(x, 4)
    np.testing.assert_array_equal(c, N.naive_quantize_rows_sym(x, 4)[0])


@settings(max_examples=25, deadline=None)
@given(x=_matrices, ratio=st.floats(0.5, 10.0))
def test_hyp_outlier_relerr(x, ratio):
    c, r = probe.outlier_channels(x, ratio)
    c2, r2 = N.naive_outlier_channels(x, ratio)
    assert c == c2
    _close(r, r2)
    y = np.flip(x, axis=1).copy()
    _close(probe.rel_err(x, y), N.naive_rel_err(x, y))


def test_zero_scale_threshold_compared_in_float32():
    """A row whose ``max|x|`` is float32(1e-20) -- just below the float64
    1e-20 -- is not "all zero": every quantiser compares the threshold in
    float32, as its NumPy twin does (a float64 comparison gave scale 1 and
    codes 0 where the twins give 7; found by ``test_hyp_nm_ternary_card``),
    and the next float32 below it is."""
    import naive_matmul as NM
    t = np.float32(1e-20)
    for v, zero in ((t, False), (np.nextafter(t, np.float32(0)), True)):
        x = np.array([[v, -v / 2]], np.float32)
        c, s = kernels.quantize_rows_sym(x, 4)
        cn, sn = N.naive_quantize_rows_sym(x, 4)
        np.testing.assert_array_equal(c, cn)
        np.testing.assert_array_equal(s, sn)
        assert bool(s[0] == 1.0) == zero
        q, sx = kernels.quantize_rows_i8(x)
        qn, sxn = NM.naive_quantize_rows_i8(x)
        np.testing.assert_array_equal(q, qn)
        np.testing.assert_array_equal(sx, sxn)
        assert bool(sx[0] == 1.0) == zero
        cg, sg = kernels.quantize_groups_sym(x, 4, 32)
        cgn, sgn = N.naive_quantize_groups_sym(x, 4, 32)
        np.testing.assert_array_equal(cg, cgn)
        np.testing.assert_array_equal(sg, sgn)
        lv = NM.naive_a16_levels(2)
        q16, s16 = kernels.quantize_rows_i16(x, lv)
        q16n, s16n = NM.naive_quantize_rows_i16(x, lv)
        np.testing.assert_array_equal(q16, q16n)
        np.testing.assert_array_equal(s16, s16n)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1), (37, 129)])
def test_residual_rows_matches_numpy(shape):
    """``kernels.residual_rows``: the residual in float32 (the float64
    difference rounded once) and each row's float64 squared error, against
    the obvious NumPy twin; exact zeros, a ±0 pair, a subnormal and a wide
    ratio (int2-like: recon 3x the weight) included."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal(shape).astype(np.float32)
    r = (w * np.float32(0.9)).astype(np.float32)
    if w.size:
        r.flat[0] = 0.0
        w.flat[-1], r.flat[-1] = -0.0, 0.0
    if w.size > 3:
        w.flat[1], r.flat[1] = np.float32(1e-40), np.float32(0.0)
        r.flat[2] = np.float32(3.0) * w.flat[2]
    e64 = w.astype(np.float64) - r.astype(np.float64)
    y = np.full(shape[0], np.nan)
    got = r.copy()
    kernels.residual_rows(w, got, y)
    assert np.array_equal(got, e64.astype(np.float32))
    assert np.allclose(y, np.einsum("ij,ij->i", e64, e64), rtol=1e-13, atol=0)


@pytest.mark.parametrize("n,tile", [(0, 64), (1, 64), (70, 16), (130, 64), (129, 7)])
def test_gram_stats_matches_numpy(n, tile):
    """``kernels.gram_stats``: max |g|, max |g - gᵀ| and the NaN/Inf count of a
    square float64 matrix in one tiled pass, against NumPy (tiles that do
    not divide n, an asymmetric pair, NaN and Inf included)."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((n, n))
    g = a @ a.T
    if n > 5:
        g[2, 5] += 1e-3
        g[4, 1] = -50.0
    am, asym, bad = kernels.gram_stats(g, tile)
    assert bad == 0
    assert am == (np.abs(g).max() if n else 0.0)
    assert asym == (np.abs(g - g.T).max() if n else 0.0)
    if n > 5:
        g[0, 3], g[3, 3], g[n - 1, 0] = np.nan, np.inf, -np.inf
        am, asym, bad = kernels.gram_stats(g, tile)
        fin = np.isfinite(g)
        both = fin & fin.T
        assert bad == 3
        assert am == np.abs(g[fin]).max()
        assert asym == np.abs(np.where(both, g - g.T, 0.0)).max()


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (1, 1), (37, 300), (513, 17)])
def test_abs_diff_sums_matches_numpy(shape):
    """``kernels.abs_diff_sums``: row sums set and column sums accumulated of
    |a - b|, against NumPy."""
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    rs = np.full(shape[0], np.nan)
    cs = np.full(shape[1], 2.0)
    kernels.abs_diff_sums(a, b, rs, cs)
    d = np.abs(a - b)
    np.testing.assert_allclose(rs, d.sum(axis=1), rtol=1e-13, atol=0)
    np.testing.assert_allclose(cs, 2.0 + d.sum(axis=0), rtol=1e-13, atol=0)
