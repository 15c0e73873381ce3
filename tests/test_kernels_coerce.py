"""The decomposition cores in ``opscope_nb.kernels`` accept what Python callers
have: float64 / integer / non-contiguous arrays, dims and ranks as tuples, lists
or arrays, and the documented default seed."""
import numba
import numpy as np
import pytest

from opscope_nb import kernels as K

# Python lists reach numba as "reflected lists", which numba warns about; the
# call still works, and that is what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::numba.NumbaPendingDeprecationWarning")


def _rank2(rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 2)) @ rng.standard_normal((2, cols))


def test_as_f32c_is_identity_for_float32_c_and_converts_the_rest():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)

    @numba.njit
    def same(x):
        return K.as_f32c(x)

    assert same(a) is a or np.shares_memory(same(a), a)
    for b in (a.astype(np.float64), a.astype(np.int32), a.T, a[:, ::2]):
        out = same(b)
        assert out.dtype == np.float32 and out.flags.c_contiguous
        np.testing.assert_array_equal(out, np.asarray(b, dtype=np.float32))


@pytest.mark.parametrize("seq", [(4, 5, 3), [4, 5, 3], np.array([4, 5, 3], dtype=np.int32)])
def test_as_i64_vector(seq):
    out = K.as_i64_vector(seq)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [4, 5, 3])


def test_factorize_and_svd_default_seed_and_float64():
    w64 = _rank2(24, 18)
    u, v = K.factorize(w64, 2)                     # default seed, float64 in
    assert u.dtype == np.float32 and u.shape == (24, 2) and v.shape == (2, 18)
    assert np.linalg.norm(w64 - u @ v) / np.linalg.norm(w64) < 1e-3
    u2, v2 = K.factorize(w64.astype(np.float32), 2, 0)
    np.testing.assert_array_equal(u, u2)           # same as float32 input, seed 0
    uu, s, vt = K.truncated_svd(np.asfortranarray(w64), 2)
    assert s.dtype == np.float32
    assert np.linalg.norm(w64 - (uu * s) @ vt) / np.linalg.norm(w64) < 1e-3


def test_monarch_accepts_float64_and_views():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 16))
    w1, w2 = K.monarch_project(w)
    w1b, w2b = K.monarch_project(np.ascontiguousarray(w, dtype=np.float32))
    np.testing.assert_array_equal(w1, w1b)
    dense = K.monarch_reconstruct(w1.astype(np.float64), w2)
    x = rng.standard_normal((3, 16))
    np.testing.assert_allclose(K.monarch_matmul(x, w1, w2), x @ dense, rtol=1e-4, atol=1e-4)
    y_view = K.monarch_matmul(np.asfortranarray(x), w1, w2)
    np.testing.assert_allclose(y_view, x @ dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ranks", [(2, 2, 2), [2, 2, 2], np.array([2, 2, 2])])
def test_tucker_ranks_any_sequence_and_float64(ranks):
    rng = np.random.default_rng(2)
    core = rng.standard_normal((2, 2, 2))
    us = [np.linalg.qr(rng.standard_normal((d, 2)))[0] for d in (6, 5, 4)]
    x = np.einsum("abc,ia,jb,kc->ijk", core, *us)
    g, facs = K.tucker_hosvd(x, ranks)
    rec = K.tucker_reconstruct(g, list(facs))
    assert np.linalg.norm(rec - x) / np.linalg.norm(x) < 1e-3


@pytest.mark.parametrize("dims", [(4, 5, 3, 4), [4, 5, 3, 4], np.array([4, 5, 3, 4])])
def test_tt_svd_any_shape_any_dims(dims):
    rng = np.random.default_rng(3)
    g = [rng.standard_normal(s) for s in ((1, 4, 2), (2, 5, 2), (2, 3, 2), (2, 4, 1))]
    x = np.einsum("aib,bjc,ckd,dle->ijkl", *g)     # float64, shape (4, 5, 3, 4)
    cores = K.tt_svd(x, dims, 3)
    assert [c.shape[1] for c in cores] == [4, 5, 3, 4]
    rec = K.tt_reconstruct(cores).reshape(x.shape)
    assert np.linalg.norm(rec - x) / np.linalg.norm(x) < 1e-3


def test_entries_from_user_njit_with_float64_and_tuples():
    @numba.njit
    def user(w, x4):
        u, v = K.factorize(w, 2)                    # default seed inside numba too
        uu, s, vt = K.truncated_svd(w, 2, 0)
        cores = K.tt_svd(x4, (4, 5, 3, 4), 3)
        g, facs = K.tucker_hosvd(x4[0], (2, 2, 2))
        return u @ v, (uu * s) @ vt, len(cores), K.as_i64_vector((3, 4)), g.shape

    w64 = _rank2(20, 16, seed=4)
    x4 = np.random.default_rng(5).standard_normal((4, 5, 3, 4))
    uv, usv, ncores, vec, gshape = user(w64, x4)
    for rec in (uv, usv):
        assert rec.dtype == np.float32
        assert np.linalg.norm(w64 - rec) / np.linalg.norm(w64) < 1e-3
    assert ncores == 4 and gshape == (2, 2, 2)
    np.testing.assert_array_equal(vec, [3, 4])
