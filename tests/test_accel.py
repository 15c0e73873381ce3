"""The vendor-BLAS shim: sgemm vs the reference, threads, and a missing library."""
import importlib
import sys

import numpy as np
import pytest

from naive_matmul import naive_dense_matmul, naive_rel_l2
from opscope_nb import accel

needs_vendor = pytest.mark.skipif(not accel.available(),
                                  reason=f"no vendor BLAS: {accel.why_unavailable()}")


def test_backend_is_a_name():
    name = accel.backend()
    assert isinstance(name, str) and name
    if sys.platform != "darwin" and name != "none":
        assert name.startswith("openblas ")
    assert (name == "none") == (not accel.available())
    assert (accel.why_unavailable() == "") == accel.available()


@needs_vendor
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 64, 33), (5, 17, 3), (32, 256, 96)])
def test_sgemm_matches_reference(m, k, n):
    rng = np.random.default_rng(m * 100 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    y = accel.sgemm(x, w)
    assert y.shape == (m, n) and y.dtype == np.float32
    assert naive_rel_l2(naive_dense_matmul(x, w), y) < 1e-5
    # float64 and non-contiguous input are converted, not rejected.
    y2 = accel.sgemm(x.astype(np.float64), np.asfortranarray(w))
    np.testing.assert_allclose(y2, y, rtol=1e-5, atol=1e-5)


@needs_vendor
def test_sgemm_validates():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="equal k"):
        accel.sgemm(x, np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match="finite"):
        accel.sgemm(np.full((2, 3), np.nan, np.float32), np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        accel.sgemm(np.ones(3, np.float32), np.ones((3, 2), np.float32))
    with pytest.raises(TypeError):
        accel.sgemm(np.ones((2, 3), bool), np.ones((3, 2), np.float32))


@needs_vendor
def test_threads_roundtrip():
    before = accel.get_threads()
    try:
        accel.set_threads(1)
        assert accel.get_threads() == 1
        x = np.ones((4, 8), np.float32)
        np.testing.assert_allclose(accel.sgemm(x, np.ones((8, 2), np.float32)), 8.0)
    finally:
        accel.set_threads(before or 1)
    with pytest.raises(ValueError):
        accel.set_threads(0)
    info = accel.core_info()
    assert info["available"] and "threads" in info


def test_int8_fc_is_none_off_macos():
    if sys.platform != "darwin":
        assert accel.int8_fc is None


def test_missing_library_degrades_to_none(monkeypatch):
    def broken():
        raise OSError("cannot open shared object file: libscipy_openblas.so")

    monkeypatch.setattr(accel, "_loaders", lambda: [("openblas", broken)])
    accel._reset()
    try:
        assert accel.backend() == "none"
        assert not accel.available()
        assert "cannot open" in accel.why_unavailable()
        assert accel.get_threads() is None
        assert accel.core_info()["available"] is False
        with pytest.raises(RuntimeError, match="no vendor BLAS"):
            accel.sgemm(np.ones((1, 1)), np.ones((1, 1)))
        # Re-importing the package and the module still works.
        importlib.import_module("opscope_nb")
        importlib.reload(accel)
    finally:
        monkeypatch.undo()
        accel._reset()
    assert accel.backend() != "none" or not accel.available()


def test_import_without_scipy_openblas(monkeypatch):
    # Simulate an environment where the wheel is not installed at all.
    monkeypatch.setitem(sys.modules, "scipy_openblas32", None)
    accel._reset()
    try:
        if sys.platform != "darwin":
            assert accel.backend() == "none"
            assert "scipy_openblas32" in accel.why_unavailable()
    finally:
        monkeypatch.undo()
        accel._reset()
