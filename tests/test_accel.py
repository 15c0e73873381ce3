"""The vendor-BLAS shim: sgemm vs the reference, threads, and a missing library."""
import importlib
import sys

import numpy as np
import pytest

from naive_matmul import naive_dense_matmul, naive_rel_l2
from opscope_nb.runtime import accel

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


def test_int8_fc_only_on_macos():
    assert (accel.int8_fc is None) == (sys.platform != "darwin")
    if sys.platform != "darwin" and accel.available():
        with pytest.raises(RuntimeError, match="needs Accelerate"):
            accel.bnns_matmul_f32(np.ones((1, 2)), np.ones((2, 1)))


def test_cdefs_parse_on_every_platform():
    """The cffi declarations (Accelerate's too) parse here, and the BNNS
    descriptor has the C layout of 64-bit ``bnns_structures.h``."""
    cffi = pytest.importorskip("cffi")
    ffi = cffi.FFI()
    ffi.cdef(accel._CDEF_ACCELERATE)
    if ffi.sizeof("void *") == 8:
        assert ffi.offsetof("BNNSNDArrayDescriptor", "size") == 8
        assert ffi.offsetof("BNNSNDArrayDescriptor", "stride") == 72
        assert ffi.offsetof("BNNSNDArrayDescriptor", "data") == 136
        assert ffi.offsetof("BNNSNDArrayDescriptor", "table_data") == 152
        assert ffi.offsetof("BNNSNDArrayDescriptor", "data_bias") == 168
        assert ffi.sizeof("BNNSNDArrayDescriptor") == 176
        assert ffi.offsetof("BNNSLayerParametersFullyConnected", "activation") == 4 * 176
    d = ffi.new("BNNSNDArrayDescriptor *")
    d.size[7] = 5
    assert d.size[7] == 5 and d.data == ffi.NULL
    ffi2 = cffi.FFI()
    ffi2.cdef(accel._CDEF_OPENBLAS)      # parses; symbols resolve at dlopen


@pytest.mark.parametrize("plat", ["win32", "linux"])
def test_openblas_path_picks_the_loadable_library(tmp_path, plat):
    lib = tmp_path / "lib"
    lib.mkdir()
    for f in ("libscipy_openblas.lib", "libscipy_openblas.a", "libscipy_openblas.so",
              "libscipy_openblas.dll", "libgfortran-5.dll"):
        (lib / f).write_bytes(b"")
    want = {"win32": "libscipy_openblas.dll", "linux": "libscipy_openblas.so"}[plat]
    assert accel.openblas_path(str(lib), plat) == str(lib / want)


def test_openblas_path_windows_bin_and_missing(tmp_path):
    lib, bindir = tmp_path / "lib", tmp_path / "bin"
    lib.mkdir()
    bindir.mkdir()
    (lib / "libscipy_openblas.lib").write_bytes(b"")     # import library only
    with pytest.raises(FileNotFoundError, match="no loadable libscipy_openblas"):
        accel.openblas_path(str(lib), "win32")
    (bindir / "libscipy_openblas64_.dll").write_bytes(b"")
    assert accel.openblas_path(str(lib), "win32") == str(bindir / "libscipy_openblas64_.dll")
    with pytest.raises(FileNotFoundError, match="platform linux"):
        accel.openblas_path(str(lib), "linux")


@needs_vendor
def test_sgemm_prepared_matches_reference_and_validates():
    rng = np.random.default_rng(3)
    for m in (1, 4):
        x = rng.standard_normal((m, 19)).astype(np.float64)      # converted once
        w = np.asfortranarray(rng.standard_normal((19, 7)).astype(np.float32))
        fn = accel.sgemm_prepared(x, w)
        y1, y2 = fn(), fn()
        assert y1.shape == (m, 7) and y1.dtype == np.float32
        assert naive_rel_l2(naive_dense_matmul(x.astype(np.float32), w), y1) < 1e-5
        np.testing.assert_array_equal(y1, y2)
    with pytest.raises(ValueError, match="equal k"):
        accel.sgemm_prepared(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match="finite"):
        accel.sgemm_prepared(np.full((1, 3), np.inf), np.ones((3, 2), np.float32))


def test_missing_library_degrades_to_none(monkeypatch):
    before = (accel.backend(), accel.available())

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
    # the real loader comes back after the reset
    assert (accel.backend(), accel.available()) == before


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
