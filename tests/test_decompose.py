"""factorize, Monarch, Tucker and TT against their NumPy twins (naive_decomp)."""
from __future__ import annotations

import numba
import numpy as np
import pytest

import naive_decomp as nv
from subproc import run_code
from opscope_nb.profile import decompose as D
from opscope_nb import kernels
from opscope_nb.io.synth import Dist, sample


def rel(a, b):
    return nv.naive_rel_err(a, b)


# --------------------------------------------------------------------- factorize
def test_factorize_planted_rank2():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 2)) @ rng.standard_normal((2, 48))).astype(np.float32)
    u, v = D.factorize(w, 4)
    assert u.shape == (64, 4) and v.shape == (4, 48) and u.dtype == np.float32
    assert rel(w, u @ v) < 1e-3
    np.testing.assert_allclose(u.T @ u, np.eye(4), atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (13, 9), (40, 90)])
@pytest.mark.parametrize("dist", list(Dist))
def test_factorize_close_to_optimum(shape, dist):
    w = sample(dist, *shape, seed=1)
    r = max(1, min(shape) // 3)
    u, v = D.factorize(w, r, seed=2)
    err = np.linalg.norm(w - u @ v)
    opt = nv.naive_rank_r_error(w, r)
    assert err >= opt - 1e-4 * np.linalg.norm(w)        # cannot beat Eckart-Young
    assert err <= 1.15 * opt + 1e-5 * np.linalg.norm(w)


def test_factorize_deterministic_and_validates():
    w = sample(Dist.COHERENT, 30, 50, seed=3)
    a, b = D.factorize(w, 5, seed=9), D.factorize(w, 5, seed=9)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="r must lie"):
        D.factorize(w, 0)
    with pytest.raises(ValueError, match="r must lie"):
        D.factorize(w, 31)
    with pytest.raises(ValueError, match="finite"):
        D.factorize(np.full((3, 3), np.nan), 1)
    with pytest.raises(ValueError, match="2-D"):
        D.factorize(np.ones(3), 1)
    with pytest.raises(TypeError, match="dtype"):
        D.factorize(np.ones((3, 3), bool), 1)
    u, v = D.factorize(np.asfortranarray(w.astype(np.float64)), 5, seed=9)
    np.testing.assert_allclose(u @ v, a[0] @ a[1], atol=1e-5)


def test_factorize_from_user_njit():
    @numba.njit
    def user(w):
        u, v = kernels.factorize(w, 2, 0)
        return u, v

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((20, 2)) @ rng.standard_normal((2, 30))).astype(np.float32)
    u, v = user(w)
    assert rel(w, u @ v) < 1e-4


# ----------------------------------------------------------------------- Monarch
@pytest.mark.parametrize("n, m", [(0, None), (1, 1), (2, None), (15, None), (16, 4),
                                  (1024, 32), (1025, None), (4096, 64)])
def test_monarch_blocks(n, m):
    assert D.monarch_blocks(n) == m
    assert kernels.monarch_blocks(n) == m


def test_monarch_params():
    assert D.monarch_params(32) == 2 * 32 ** 3 == kernels.monarch_params(32)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_monarch_reconstruct_and_matmul(m):
    rng = np.random.default_rng(m)
    w1 = rng.standard_normal((m, m, m)).astype(np.float32)
    w2 = rng.standard_normal((m, m, m)).astype(np.float32)
    dense = D.monarch_reconstruct(w1, w2)
    np.testing.assert_allclose(dense, nv.naive_monarch_reconstruct(w1, w2), rtol=1e-6)
    for batch in (1, 7):
        x = rng.standard_normal((batch, m * m)).astype(np.float32)
        y = D.monarch_matmul(x, w1, w2)
        assert y.shape == (batch, m * m) and y.dtype == np.float32
        np.testing.assert_allclose(y, nv.naive_monarch_matmul(x, w1, w2),
                                   rtol=1e-4, atol=1e-4 * m)
        np.testing.assert_allclose(y, x @ dense, rtol=1e-4, atol=1e-4 * m)
    np.testing.assert_allclose(D.monarch_matmul(x[0], w1, w2), y[0], rtol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_monarch_project_planted(m):
    rng = np.random.default_rng(10 + m)
    w1 = rng.standard_normal((m, m, m))
    w2 = rng.standard_normal((m, m, m))
    dense = nv.naive_monarch_reconstruct(w1, w2).astype(np.float32)
    p1, p2 = D.monarch_project(dense)
    assert p1.shape == p2.shape == (m, m, m) and p1.dtype == np.float32
    assert rel(dense, D.monarch_reconstruct(p1, p2)) < 1e-3


@pytest.mark.parametrize("dist", list(Dist))
def test_monarch_project_matches_naive(dist):
    w = sample(dist, 36, 36, seed=4)
    p1, p2 = D.monarch_project(w)
    n1, n2 = nv.naive_monarch_project(w)
    # sign-invariant: compare the implied dense matrices
    np.testing.assert_allclose(D.monarch_reconstruct(p1, p2),
                               nv.naive_monarch_reconstruct(n1, n2),
                               atol=2e-4 * np.abs(w).max())


def test_monarch_project_clustered_spectrum_is_exact():
    # identity blocks: every rank-1 choice of a block with equal singular values
    # is optimal; the error must equal the optimum (power iteration would not
    # matter here, but a block 2*I + tiny would break a fixed-step iteration).
    m = 4
    w = np.kron(np.ones((m, m)), np.diag([1.0, 1.0, 0.999, 0.2])).astype(np.float32)
    p1, p2 = D.monarch_project(w)
    n1, n2 = nv.naive_monarch_project(w)
    ours = rel(w, D.monarch_reconstruct(p1, p2))
    best = rel(w, nv.naive_monarch_reconstruct(n1, n2))
    assert abs(ours - best) < 1e-5


def test_monarch_bad_input():
    with pytest.raises(ValueError, match="square"):
        D.monarch_project(np.ones((4, 9)))
    with pytest.raises(ValueError, match="perfect square"):
        D.monarch_project(np.ones((5, 5)))
    with pytest.raises(ValueError, match="finite"):
        D.monarch_project(np.full((4, 4), np.inf))
    with pytest.raises(ValueError, match="2-D"):
        D.monarch_project(np.ones((4, 4, 4)))
    with pytest.raises(ValueError, match=r"\(m, m, m\)"):
        D.monarch_reconstruct(np.ones((2, 2, 2)), np.ones((3, 3, 3)))
    with pytest.raises(ValueError, match="columns"):
        D.monarch_matmul(np.ones((2, 5)), np.ones((2, 2, 2)), np.ones((2, 2, 2)))
    with pytest.raises(ValueError, match="n must lie"):
        D.monarch_blocks(-1)
    with pytest.raises(TypeError, match="integer"):
        D.monarch_blocks(4.0)


# ------------------------------------------------------------------------ Tucker
def _planted_tucker(dims, ranks, seed):
    rng = np.random.default_rng(seed)
    core = rng.standard_normal(ranks)
    fs = [np.linalg.qr(rng.standard_normal((d, r)))[0] for d, r in zip(dims, ranks)]
    return nv.naive_tucker_reconstruct(core, fs).astype(np.float32)


def test_tucker_planted_222():
    x = _planted_tucker((6, 5, 4), (2, 2, 2), 0)
    core, fs = D.tucker_hosvd(x, (3, 3, 3))
    assert core.shape == (3, 3, 3)
    assert [f.shape for f in fs] == [(6, 3), (5, 3), (4, 3)]
    assert rel(x, D.tucker_reconstruct(core, fs)) < 1e-3
    u0, u1, u2 = fs                                    # unpacks like a list
    for f in fs:
        np.testing.assert_allclose(f.T @ f, np.eye(3), atol=1e-5)


@pytest.mark.parametrize("dims, ranks", [
    ((1, 1, 1), (1, 1, 1)), ((1, 5, 3), (1, 2, 2)), ((7, 1, 4), (3, 1, 9)),
    ((9, 7, 5), (3, 4, 2)), ((5, 6, 7), (5, 6, 7)),
    ((300, 12, 40), (16, 6, 20)),       # mode 0 on the randomized path
])
def test_tucker_matches_naive_hosvd(dims, ranks):
    x = sample(Dist.COHERENT, dims[0], dims[1] * dims[2], seed=2).reshape(dims)
    core, fs = D.tucker_hosvd(x, ranks)
    ncore, nfs = nv.naive_hosvd(x, ranks)
    assert core.shape == ncore.shape
    ours = D.tucker_reconstruct(core, fs)
    ref = nv.naive_tucker_reconstruct(ncore, nfs)
    np.testing.assert_allclose(ours, nv.naive_tucker_reconstruct(core, fs),
                               atol=1e-5 * np.abs(x).max())
    assert rel(x, ours) <= 1.01 * rel(x, ref) + 1e-6
    # sign-invariant subspace check: |U^T U_ref| has singular values ~1
    for f, nf in zip(fs, nfs):
        if f.shape[1] < f.shape[0] and dims != (300, 12, 40):
            sv = np.linalg.svd(f.T.astype(np.float64) @ nf, compute_uv=False)
            np.testing.assert_allclose(sv, 1.0, atol=1e-3)


def test_tucker_mode_grams_are_float64():
    """Mode-1 spectrum 1, 1e-4, 1e-6...: the 2nd direction's Gram eigenvalue
    (1e-8 of the top one) is below float32 rounding of the Gram's entries, so
    float32 slice Grams tilt the rank-2 factor (smallest principal cosine 0.62
    in a NumPy simulation and with the float32-Gram kernel); float64 keeps it
    (> 0.99999)."""
    rng = np.random.default_rng(0)
    d0, d1, d2 = 16, 8, 16
    v = np.linalg.qr(rng.standard_normal((d1, d1)))[0]
    s = np.array([1.0, 1e-4] + [1e-6] * 6)
    a = rng.standard_normal((d1, d0, d2))
    x = np.ascontiguousarray(np.einsum("k,kab,jk->ajb", s, a, v).astype(np.float32))
    _, (u0, u1, u2) = kernels.tucker_hosvd(x, (4, 2, 4))
    cos = np.linalg.svd(u1.astype(np.float64).T @ v[:, :2], compute_uv=False)
    assert cos.min() > 0.999, cos


def test_tucker_params_and_bad_input():
    assert D.tucker_params((1024, 32, 96), (32, 16, 48)) == \
        nv.naive_tucker_params((1024, 32, 96), (32, 16, 48)) == \
        kernels.tucker_params((1024, 32, 96), (32, 16, 48))
    x = np.ones((3, 4, 5), np.float32)
    with pytest.raises(ValueError, match="3-D"):
        D.tucker_hosvd(np.ones((3, 4)), (1, 1, 1))
    with pytest.raises(ValueError, match="3 positive"):
        D.tucker_hosvd(x, (1, 1))
    with pytest.raises(ValueError, match=r"ranks\[1\] must lie"):
        D.tucker_hosvd(x, (1, 0, 1))
    with pytest.raises(TypeError, match="integer"):
        D.tucker_hosvd(x, (1, 1.5, 1))
    with pytest.raises(ValueError, match="finite"):
        D.tucker_hosvd(np.full((2, 2, 2), np.nan), (1, 1, 1))
    core, fs = D.tucker_hosvd(x[:, ::2], (9, 9, 9))        # non-contiguous, clamped
    assert core.shape == (3, 2, 5)
    with pytest.raises(ValueError, match="columns"):
        D.tucker_reconstruct(core, (fs[0], fs[1], fs[1]))


@pytest.mark.slow
def test_tucker_mining_shape():
    # the mining helper's view of a 1024x3072 weight
    w = sample(Dist.LOWRANK, 1024, 3072, seed=5) + \
        0.01 * sample(Dist.GAUSSIAN, 1024, 3072, seed=6)
    x = w.reshape(1024, 32, 96)
    core, fs = D.tucker_hosvd(x, (32, 16, 48))
    ncore, nfs = nv.naive_hosvd(x, (32, 16, 48))
    ours = rel(x, D.tucker_reconstruct(core, fs))
    assert ours <= 1.01 * rel(x, nv.naive_tucker_reconstruct(ncore, nfs)) + 1e-6


# --------------------------------------------------------------------------- TT
def _planted_tt(dims, bond, seed):
    rng = np.random.default_rng(seed)
    ranks = [1] + [bond] * (len(dims) - 1) + [1]
    cores = [rng.standard_normal((ranks[k], d, ranks[k + 1])) for k, d in enumerate(dims)]
    return nv.naive_tt_reconstruct(cores).astype(np.float32)


def test_tt_planted_bond2():
    dims = (4, 5, 3, 4)
    x = _planted_tt(dims, 2, 0)
    cores = D.tt_svd(x, dims, 3)
    assert isinstance(cores, list)
    assert [c.shape for c in cores] == [(1, 4, 3), (3, 5, 3), (3, 3, 3), (3, 4, 1)]
    out = D.tt_reconstruct(cores)
    assert out.shape == dims
    assert rel(x, out) < 1e-3
    assert D.tt_params(cores) == nv.naive_tt_params(cores) == 12 + 45 + 27 + 12


@pytest.mark.parametrize("dims, cap", [
    ((1,), 3), ((7,), 1), ((1, 1, 1), 2), ((3, 1, 4), 2), ((5, 7), 2),
    ((4, 6, 5, 3), 4), ((2, 3, 2, 3, 2), 100), ((32, 32, 48), 16),
])
def test_tt_matches_naive(dims, cap):
    x = np.random.default_rng(len(dims)).standard_normal(dims).astype(np.float32)
    cores = D.tt_svd(x, dims, cap)
    ref = nv.naive_tt_svd(x, dims, cap)
    assert [c.shape for c in cores] == [c.shape for c in ref]
    assert all(c.dtype == np.float32 for c in cores)
    ours = D.tt_reconstruct(cores)
    np.testing.assert_allclose(ours, nv.naive_tt_reconstruct(cores), rtol=1e-4,
                               atol=1e-5)
    assert rel(x, ours) <= 1.01 * rel(x, nv.naive_tt_reconstruct(ref)) + 1e-5
    assert D.tt_params(cores) == nv.naive_tt_params(ref)


def test_tt_flat_kernels_equal_the_list_kernels():
    """The flat forms Python callers use hold the typed-List kernels' cores,
    and their reconstruction matches the NumPy twin."""
    dims = np.array([4, 6, 5], dtype=np.int64)
    x = np.random.default_rng(3).standard_normal(120).astype(np.float32)
    flat, shapes = kernels.tt_svd_flat(x, dims, 3)
    lst = kernels.tt_svd(x, dims, 3)
    cores = [np.asarray(c) for c in lst]
    assert shapes.tolist() == [list(c.shape) for c in cores]
    np.testing.assert_array_equal(flat, np.concatenate([c.ravel() for c in cores]))
    np.testing.assert_allclose(kernels.tt_reconstruct_flat(flat, shapes),
                               nv.naive_tt_reconstruct(cores).ravel(), rtol=1e-5, atol=1e-6)


def test_tt_from_python_compiles_no_typed_list_accessors():
    """A typed List crossing into Python compiles its accessors (uncached,
    ~0.6 s per process): the public TT functions and the tt format keep it
    inside the compiled code."""
    code = (
        "import numpy as np\n"
        "from numba.typed import typedlist as T\n"
        "from opscope_nb import formats as F\n"
        "from opscope_nb.profile import decompose as D\n"
        "x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)\n"
        "D.tt_reconstruct(D.tt_svd(x, (4, 4, 4, 4), 3))\n"
        "d = F.Decomp.tt((4, 4, 4, 4), 3)\n"
        "F.unpack(F.pack(x, d), d, x.shape)\n"
        "used = [n for n in ('_make_list', '_getitem', '_append', '_length')\n"
        "        if getattr(T, n).signatures]\n"
        "print('USED', used)\n")
    out = run_code(code, timeout=600)
    assert "USED []" in out, out


def test_tt_flat_input_and_bad_input():
    x = _planted_tt((3, 4, 5), 2, 1)
    a = D.tt_reconstruct(D.tt_svd(x.ravel(), [3, 4, 5], 2))
    b = D.tt_reconstruct(D.tt_svd(x.reshape(12, 5), (3, 4, 5), 2))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="prod"):
        D.tt_svd(x, (3, 4, 6), 2)
    with pytest.raises(ValueError, match=r"dims\[1\] must lie"):
        D.tt_svd(x, (3, 0, 5), 2)
    with pytest.raises(ValueError, match="max_rank"):
        D.tt_svd(x, (3, 4, 5), 0)
    with pytest.raises(ValueError, match="non-empty"):
        D.tt_svd(x, (), 2)
    with pytest.raises(ValueError, match="finite"):
        D.tt_svd(np.full(6, np.nan), (2, 3), 2)
    with pytest.raises(TypeError, match="dtype"):
        D.tt_svd(np.ones(6, bool), (2, 3), 2)
    with pytest.raises(ValueError, match="r_prev"):
        D.tt_reconstruct([np.ones((1, 2, 2)), np.ones((3, 2, 1))])
    with pytest.raises(ValueError, match="r_next = 1"):
        D.tt_reconstruct([np.ones((1, 2, 2))])
