"""Tests of opscope_nb.io.synth: the Philox stream, every Dist, validation."""
import numpy as np
import pytest

from naive_probe import (DIST_LABELS, naive_box_muller, naive_philox_words,
                         naive_round_half_away, naive_sample)
from opscope_nb import kernels
from opscope_nb.io.synth import Dist, sample

SHAPES = [(1, 1), (1, 17), (17, 1), (7, 13), (40, 33)]


# Bit patterns of sample(dist, 3, 4, seed=42), printed by a Rust (rustc 1.95,
# x86-64 Linux, glibc libm) transcription of upstream's rlx_ir::Philox4x32 and
# rlx-opscope's sample().  They pin the cross-language stream; the normals go
# through logf/cosf, so a few ulp of slack are allowed for other libms.
RUST_3x4_SEED42 = {
    "gaussian": [0x3E2A55FD, 0x3ECBAFF7, 0x3F752524, 0xBF310B6A, 0xBE019A9C, 0x3F33A978,
                 0xBF92B75F, 0x3F88FDAD, 0x3E379C07, 0xBF1EF6E7, 0x3F6EB7C6, 0xBE9A910E],
    "uniform": [0x3F580A08, 0xBE1F66E8, 0x3F441A10, 0xBEA0950E, 0xBD9627A8, 0xBE44E7A8,
                0x3F420B02, 0xBF1E3724, 0x3F09CEE4, 0x3F47CA50, 0x3F63BB3E, 0x3F77EA12],
    "sparse90": [0x3E2A55FD] + [0] * 11,
    "lowrank": [0x3ED53740, 0x3EE8A826, 0xBE78C010, 0x3F29D0AE, 0x3F896F02, 0x3FC5C42C,
                0x3EA683C8, 0x3F117C4B, 0x3F333E42, 0x3F816930, 0xBE37F06F, 0x3F2F675A],
    "outlier": [0x3E2A55FD, 0x3ECBAFF7, 0x3F752524, 0xBF310B6A, 0xBE019A9C, 0x3F33A978,
                0xBF92B75F, 0x3F88FDAD, 0x3E379C07, 0xBF1EF6E7, 0x3F6EB7C6, 0xBE9A910E],
    "quantized": [0x00000000, 0x3F000000, 0x3F800000, 0xBF000000, 0x80000000, 0x3F000000,
                  0xBF800000, 0x3F800000, 0x00000000, 0xBF000000, 0x3F800000, 0xBF000000],
    "coherent": [0xBEB6372B, 0xBE8D226B, 0xBF82ABBB, 0x3E3C75B8, 0xBEA8C012, 0xBDDD303C,
                 0xBF7B3F5D, 0x3D276388, 0xBE2DB716, 0x3D1D6CA0, 0xBF3998E0, 0x3D2AD841],
}


def test_dist_members_and_labels():
    assert [d.label for d in Dist] == list(DIST_LABELS)
    assert Dist.SPARSE90.label == "sparse90" and str(Dist.LOWRANK) == "lowrank"
    for d in Dist:
        assert Dist.parse(d.label.upper()) is d
        np.testing.assert_array_equal(sample(d.label, 3, 5, 9), sample(d, 3, 5, 9))


@pytest.mark.parametrize("dist", list(Dist))
def test_matches_rust_transcription(dist):
    got = sample(dist, 3, 4, seed=42)
    ref = np.array(RUST_3x4_SEED42[dist.label], dtype=np.uint32).view(np.float32).reshape(3, 4)
    np.testing.assert_array_max_ulp(got, ref, maxulp=4)


@pytest.mark.parametrize("seed", [0, 1, 42, 0x9E3779B97F4A7C15, 2**64 - 1])
@pytest.mark.parametrize("start,count", [(0, 1), (0, 9), (3, 10), (5, 3), (2, 0), (1001, 37)])
def test_philox_words_equal_naive(seed, start, count):
    got = kernels.philox_words(seed & 0xFFFFFFFF, seed >> 32, start, count)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, naive_philox_words(seed, count, start))


def test_philox_block_counter_carry():
    # block 2^32 needs counter word 1: compare the kernel's block with the twin's
    k0, k1 = 7, 11
    got = kernels.philox_words(k0, k1, 4 * 2**32, 4)
    np.testing.assert_array_equal(got, naive_philox_words(k0 | (k1 << 32), 4, 4 * 2**32))
    assert not np.array_equal(got, kernels.philox_words(k0, k1, 0, 4))


def test_box_muller_matches_naive():
    w = naive_philox_words(123, 2 * 5000)
    w[:2] = 0                              # u1 = 0 -> clamped to FLT_MIN, finite
    got = kernels.box_muller(w)
    assert got.dtype == np.float32 and got.shape == (5000,) and np.isfinite(got).all()
    # NumPy's SIMD logf/cosf may differ from libm in the last bit
    np.testing.assert_allclose(got, naive_box_muller(w), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dist", list(Dist))
def test_sample_matches_naive(dist, shape):
    got = sample(dist, *shape, seed=5)
    ref = naive_sample(dist.label, *shape, seed=5)
    assert got.dtype == np.float32 and got.shape == shape and got.flags.c_contiguous
    atol = 1e-4 if dist is Dist.COHERENT else 2e-5     # walk accumulates ulps
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=atol)
    # masks are integer decisions: exact
    np.testing.assert_array_equal(got == 0, ref == 0)


@pytest.mark.slow
def test_sample_big_matches_naive():
    got = sample(Dist.COHERENT, 1024, 3072, seed=3)
    ref = naive_sample("coherent", 1024, 3072, seed=3)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    g = sample(Dist.GAUSSIAN, 1024, 3072, seed=3)
    np.testing.assert_allclose(g, naive_sample("gaussian", 1024, 3072, seed=3),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dist", list(Dist))
def test_deterministic(dist):
    a = sample(dist, 31, 17, seed=77)
    b = sample(dist, 31, 17, seed=77)
    assert a.tobytes() == b.tobytes()
    c = sample(dist, 31, 17, seed=78)
    assert a.tobytes() != c.tobytes()


def test_base_stream_shared():
    """Every dist draws the same ``base`` first: Sparse90/Outlier/Quantized are
    functions of the Gaussian sample of the same seed."""
    g = sample(Dist.GAUSSIAN, 64, 80, seed=11)
    sp = sample(Dist.SPARSE90, 64, 80, seed=11)
    np.testing.assert_array_equal(sp[sp != 0], g[sp != 0])
    out = sample(Dist.OUTLIER, 64, 80, seed=11)
    spike = out != g
    np.testing.assert_array_equal(out[spike], g[spike] * np.float32(30))
    q = sample(Dist.QUANTIZED, 64, 80, seed=11)
    np.testing.assert_array_equal(q, naive_round_half_away(g * np.float32(2)) / np.float32(2))


def test_gaussian_and_uniform_stats():
    g = sample(Dist.GAUSSIAN, 256, 256, seed=1).astype(np.float64)
    assert abs(g.mean()) < 0.02 and abs(g.std() - 1) < 0.02
    u = sample(Dist.UNIFORM, 256, 256, seed=1).astype(np.float64)
    assert u.min() >= -1 and u.max() <= 1
    assert u.min() < -0.999 and u.max() > 0.999
    assert abs(u.mean()) < 0.01 and abs(u.var() - 1 / 3) < 0.01


def test_sparse90_density():
    x = sample(Dist.SPARSE90, 256, 256, seed=2)
    density = np.count_nonzero(x) / x.size
    assert 0.09 < density < 0.11


def test_lowrank_is_rank4():
    x = sample(Dist.LOWRANK, 64, 48, seed=1)
    assert np.linalg.matrix_rank(x.astype(np.float64), tol=1e-3) == 4
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    assert s[4] < 1e-5 * s[0]
    # entries of (U V)/2 with U, V ~ N(0,1): variance 4/4 = 1
    big = sample(Dist.LOWRANK, 200, 200, seed=3).astype(np.float64)
    assert 0.5 < big.var() < 2.0


def test_outlier_fraction():
    g = sample(Dist.GAUSSIAN, 256, 256, seed=4)
    o = sample(Dist.OUTLIER, 256, 256, seed=4)
    frac = np.count_nonzero(o != g) / o.size
    assert 0.008 < frac < 0.012


def test_quantized_grid():
    x = sample(Dist.QUANTIZED, 128, 128, seed=5).astype(np.float64)
    np.testing.assert_array_equal(2 * x, np.round(2 * x))
    assert len(np.unique(x)) > 8


def test_coherent_walk():
    x = sample(Dist.COHERENT, 200, 300, seed=6).astype(np.float64)
    steps = np.diff(x, axis=0)
    assert abs(steps.std() - 0.15) < 0.005
    assert abs(x[0].std() - 1) < 0.15
    # adjacent rows are much closer than rows far apart
    assert np.linalg.norm(steps[0]) < 0.2 * np.linalg.norm(x[199] - x[0])


@pytest.mark.parametrize("rows,cols", [(0, 5), (5, 0), (0, 0)])
def test_empty_shapes(rows, cols):
    for d in Dist:
        x = sample(d, rows, cols)
        assert x.shape == (rows, cols) and x.dtype == np.float32


def test_bad_arguments():
    with pytest.raises(ValueError, match="rows"):
        sample(Dist.GAUSSIAN, -1, 3)
    with pytest.raises(TypeError, match="cols"):
        sample(Dist.GAUSSIAN, 3, 2.5)
    with pytest.raises(TypeError, match="rows"):
        sample(Dist.GAUSSIAN, True, 2)
    with pytest.raises(ValueError, match="seed"):
        sample(Dist.GAUSSIAN, 3, 3, seed=2**64)
    with pytest.raises(ValueError, match="seed"):
        sample(Dist.GAUSSIAN, 3, 3, seed=-1)
    with pytest.raises(ValueError, match="gaussian"):
        sample("gauss", 3, 3)
    with pytest.raises(TypeError, match="Dist"):
        sample(3, 3, 3)
    # the largest seed is fine
    assert sample(Dist.UNIFORM, 2, 2, seed=2**64 - 1).shape == (2, 2)
