"""The platform's vendor BLAS as a yardstick, through cffi (ABI mode).

* **Linux / Windows / other**: the CBLAS shipped by the ``scipy-openblas32``
  wheel (``scipy_cblas_sgemm``; ``scipy_cblas_sgemv`` for ``m == 1``, which a
  GEMM call handles badly), loaded with ``ffi.dlopen`` from
  ``scipy_openblas32.get_lib_dir()`` (:func:`openblas_path`).  On Windows
  ``get_library(fullname=True)`` names the *import library* (``.lib``), which
  cannot be loaded: the shim opens the wheel's ``libscipy_openblas*.dll``
  from its ``lib`` directory (or a sibling ``bin``) instead.  Only the Linux
  path is exercised here (CI runs Linux); the Windows file lookup is unit
  tested on a fake wheel layout.  OpenBLAS has no int8 GEMM, so
  :data:`int8_fc` is ``None``.
* **macOS**: Accelerate's ``cblas_sgemm`` (on AMX where present),
  ``BNNSMatMul`` (float32) as an ABI probe, and the BNNS int8 fully-connected
  layer (``BNNSFilterCreateLayerFullyConnected`` / ``BNNSFilterApplyBatch``)
  as the vendor int8 path.  The BNNS structures follow ``bnns_structures.h``
  as the upstream benchmark declares them.  **The macOS code is untested**
  (written from the upstream declarations; this project's CI runs on Linux).

Importing this module never fails because a library is missing: the library
is opened lazily on first use, :func:`backend` then says ``"none"`` and
:func:`why_unavailable` gives the reason.

Layouts: ``x[m, k] @ w[k, n] -> y[m, n]``, all float32 row-major.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

from opscope_nb._validation import as_matrix

__all__ = [
    "backend",
    "why_unavailable",
    "available",
    "sgemm",
    "sgemm_prepared",
    "set_threads",
    "get_threads",
    "int8_fc",
    "bnns_matmul_f32",
    "core_info",
    "openblas_path",
]

_ROW_MAJOR, _NO_TRANS = 101, 111

_CDEF_OPENBLAS = """
void scipy_cblas_sgemm(int order, int transa, int transb, int m, int n, int k,
                       float alpha, const float *a, int lda, const float *b, int ldb,
                       float beta, float *c, int ldc);
void scipy_cblas_sgemv(int order, int trans, int m, int n, float alpha,
                       const float *a, int lda, const float *x, int incx,
                       float beta, float *y, int incy);
void scipy_openblas_set_num_threads(int n);
int scipy_openblas_get_num_threads(void);
char *scipy_openblas_get_config(void);
char *scipy_openblas_get_corename(void);
"""

# Accelerate: CBLAS plus the BNNS declarations of the upstream benchmark
# (enums are uint32_t; a row-major matrix descriptor has size[0] = #cols,
# size[1] = #rows).
_CDEF_ACCELERATE = """
void cblas_sgemm(int order, int transa, int transb, int m, int n, int k,
                 float alpha, const float *a, int lda, const float *b, int ldb,
                 float beta, float *c, int ldc);
typedef struct {
    uint32_t flags; uint32_t layout;
    size_t size[8]; size_t stride[8];
    void *data; uint32_t data_type;
    void *table_data; uint32_t table_data_type;
    float data_scale; float data_bias;
} BNNSNDArrayDescriptor;
typedef struct {
    uint32_t function; float alpha; float beta;
    int32_t iscale; int32_t ioffset; int32_t ishift;
    const int32_t *iscale_per_channel; const int32_t *ioffset_per_channel;
    const int32_t *ishift_per_channel;
} BNNSActivation;
typedef struct {
    BNNSNDArrayDescriptor i_desc; BNNSNDArrayDescriptor w_desc;
    BNNSNDArrayDescriptor o_desc; BNNSNDArrayDescriptor bias;
    BNNSActivation activation;
} BNNSLayerParametersFullyConnected;
int BNNSMatMul(bool transA, bool transB, float alpha,
               const BNNSNDArrayDescriptor *a, const BNNSNDArrayDescriptor *b,
               const BNNSNDArrayDescriptor *c, void *workspace, const void *params);
void *BNNSFilterCreateLayerFullyConnected(const BNNSLayerParametersFullyConnected *p,
                                          const void *filter_params);
int BNNSFilterApplyBatch(void *filter, size_t batch, const void *in, size_t in_stride,
                         void *out, size_t out_stride);
void BNNSFilterDestroy(void *filter);
"""

_BNNS_INT8 = 0x20008      # BNNSDataTypeInt8
_BNNS_F32 = 0x10020       # BNNSDataTypeFloat32
_BNNS_ROWMAJOR = 0x20000  # BNNSDataLayoutRowMajorMatrix
_BNNS_VECTOR = 0x10000    # BNNSDataLayoutVector

_ACCELERATE_PATH = "/System/Library/Frameworks/Accelerate.framework/Accelerate"


class _State:
    """What was loaded (filled once, lazily, under a lock)."""
    loaded = False
    kind = "none"        # "openblas" | "accelerate" | "none"
    ffi = None
    lib = None
    name = "none"
    reason = "not loaded yet"
    threads = None


_lock = threading.Lock()


def openblas_path(libdir: str, platform: str | None = None) -> str:
    """Path of the loadable OpenBLAS library inside the ``scipy-openblas32`` wheel.

    Parameters
    ----------
    libdir : str
        ``scipy_openblas32.get_lib_dir()`` (the wheel's ``lib`` directory).
    platform : str, optional
        ``sys.platform`` by default (a parameter so tests can check the
        Windows rule on any OS).

    Returns
    -------
    str : on POSIX the ``libscipy_openblas*`` shared object in ``libdir``
    (``.so`` / ``.dylib``, never a static ``.a``); on Windows the
    ``libscipy_openblas*.dll`` in ``libdir`` or in a sibling ``bin``
    directory -- not the ``.lib`` import library that
    ``get_library(fullname=True)`` names there.

    Raises
    ------
    FileNotFoundError
        When no such file exists (the message lists the directories searched).
    """
    platform = sys.platform if platform is None else platform
    if platform == "win32":
        dirs = [libdir, os.path.join(os.path.dirname(libdir), "bin")]
        ok = lambda f: f.lower().endswith(".dll")  # noqa: E731
    else:
        dirs = [libdir]
        ok = lambda f: ".so" in f or f.endswith(".dylib")  # noqa: E731
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        hits = [f for f in names if f.startswith("libscipy_openblas") and ok(f)]
        if hits:
            return os.path.join(d, hits[0])
    raise FileNotFoundError(f"no loadable libscipy_openblas library in "
                            f"{' or '.join(dirs)} (platform {platform}); reinstall "
                            f"the wheel: pip install --force-reinstall scipy-openblas32")


def _load_openblas():
    import cffi
    import scipy_openblas32 as so

    libdir = so.get_lib_dir()
    path = openblas_path(libdir)
    if sys.platform == "win32" and hasattr(os, "add_dll_directory"):
        # the DLL's own dependencies (libgfortran etc.) sit next to it
        os.add_dll_directory(os.path.dirname(path))
    ffi = cffi.FFI()
    ffi.cdef(_CDEF_OPENBLAS)
    lib = ffi.dlopen(path)
    lib.scipy_cblas_sgemm  # resolve now: a missing symbol fails here, not later
    core = ffi.string(lib.scipy_openblas_get_corename()).decode()
    config = ffi.string(lib.scipy_openblas_get_config()).decode()
    version = config.split()[1] if config.startswith("OpenBLAS") else "?"
    # "0.3.34.481.3" -> "0.3.34": the wheel appends its build numbers.
    version = ".".join(version.split(".")[:3])
    return ffi, lib, f"openblas {version} {core}"


def _load_accelerate():
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(_CDEF_ACCELERATE)
    lib = ffi.dlopen(_ACCELERATE_PATH)
    lib.cblas_sgemm
    return ffi, lib, "accelerate"


def _loaders():
    """Loader list for this platform (monkeypatched by tests)."""
    if sys.platform == "darwin":
        return [("accelerate", _load_accelerate)]
    return [("openblas", _load_openblas)]


def _ensure():
    if _State.loaded:
        return _State
    with _lock:
        if _State.loaded:
            return _State
        reasons = []
        for kind, loader in _loaders():
            try:
                ffi, lib, name = loader()
            except Exception as exc:  # missing wheel, library or symbol
                reasons.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            _State.kind, _State.ffi, _State.lib, _State.name = kind, ffi, lib, name
            _State.reason = ""
            break
        else:
            _State.kind, _State.ffi, _State.lib, _State.name = "none", None, None, "none"
            _State.reason = "; ".join(reasons) or "no vendor BLAS known for this platform"
        _State.loaded = True
    return _State


def _reset():
    """Forget what was loaded (tests use it with a monkeypatched loader)."""
    with _lock:
        _State.loaded = False
        _State.kind, _State.ffi, _State.lib = "none", None, None
        _State.name, _State.reason, _State.threads = "none", "not loaded yet", None


def backend() -> str:
    """Name of the vendor backend: ``"openblas 0.3.34 Haswell"``,
    ``"accelerate"`` or ``"none"``."""
    return _ensure().name


def available() -> bool:
    """Whether a vendor BLAS was loaded."""
    return _ensure().kind != "none"


def why_unavailable() -> str:
    """Why no vendor BLAS is loaded (empty string when one is)."""
    return _ensure().reason


def core_info() -> dict:
    """What the vendor library says about itself (config string, core, threads)."""
    st = _ensure()
    info = {"backend": st.name, "available": st.kind != "none"}
    if st.kind == "openblas":
        info["config"] = st.ffi.string(st.lib.scipy_openblas_get_config()).decode()
        info["core"] = st.ffi.string(st.lib.scipy_openblas_get_corename()).decode()
        info["threads"] = int(st.lib.scipy_openblas_get_num_threads())
        info["env"] = {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")}
    elif st.kind == "accelerate":
        info["threads"] = get_threads()
        info["env"] = {k: v for k, v in os.environ.items() if k.startswith("VECLIB")}
    else:
        info["reason"] = st.reason
    return info


def _require():
    st = _ensure()
    if st.kind == "none":
        raise RuntimeError(f"no vendor BLAS available: {st.reason}. "
                           f"Install scipy-openblas32 (pip install scipy-openblas32).")
    return st


def set_threads(n: int) -> None:
    """Set the vendor library's thread count.

    OpenBLAS: ``scipy_openblas_set_num_threads``.  Accelerate: sets
    ``VECLIB_MAXIMUM_THREADS`` (honoured by Accelerate for later calls on
    recent macOS; untested here).
    """
    from opscope_nb._validation import check_int
    n = check_int(n, "n", 1, 4096)
    st = _require()
    if st.kind == "openblas":
        st.lib.scipy_openblas_set_num_threads(n)
    else:
        os.environ["VECLIB_MAXIMUM_THREADS"] = str(n)
    st.threads = n


def get_threads() -> int | None:
    """The vendor library's thread count (``None`` when unknown)."""
    st = _ensure()
    if st.kind == "openblas":
        return int(st.lib.scipy_openblas_get_num_threads())
    if st.kind == "accelerate":
        v = os.environ.get("VECLIB_MAXIMUM_THREADS")
        return int(v) if v and v.isdigit() else st.threads
    return None


def sgemm(x, w) -> np.ndarray:
    """``y[m, n] = x[m, k] @ w[k, n]`` with the vendor's float32 GEMM.

    ``m == 1`` goes to ``sgemv`` on OpenBLAS (the GEMM path is slow for a
    single row).

    Parameters
    ----------
    x : array_like, shape (m, k)
        Converted to float32 C-contiguous; must be finite.
    w : array_like, shape (k, n)

    Returns
    -------
    ndarray of float32, shape (m, n)

    Raises
    ------
    RuntimeError
        When no vendor BLAS is available (see :func:`why_unavailable`).
    """
    x = as_matrix(x, "x")
    w = as_matrix(w, "w")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"sgemm needs x[m, k] and w[k, n] with equal k; got x "
                         f"{x.shape} and w {w.shape}.")
    st = _require()
    return _sgemm_raw(st, x, w)


def _sgemm_raw(st, x, w):
    """Unvalidated call (bench uses it through :func:`sgemm_prepared`)."""
    m, k = x.shape
    n = w.shape[1]
    y = np.empty((m, n), dtype=np.float32)
    ffi, lib = st.ffi, st.lib
    px = ffi.from_buffer("float[]", x)
    pw = ffi.from_buffer("float[]", w)
    py = ffi.from_buffer("float[]", y)
    if st.kind == "openblas":
        if m == 1:
            # y[n] = W[k, n]^T x  : row-major W, transposed.
            lib.scipy_cblas_sgemv(_ROW_MAJOR, 112, k, n, 1.0, pw, n, px, 1, 0.0, py, 1)
        else:
            lib.scipy_cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0,
                                  px, k, pw, n, 0.0, py, n)
    else:
        lib.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0,
                        px, k, pw, n, 0.0, py, n)
    return y


def sgemm_prepared(x, w):
    """A zero-argument callable computing ``x @ w`` on validated copies
    (for timing loops: validation happens once, here)."""
    x = as_matrix(x, "x")
    w = as_matrix(w, "w")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"sgemm needs equal k; got x {x.shape} and w {w.shape}.")
    st = _require()
    return lambda: _sgemm_raw(st, x, w)


# ----------------------------------------------------------------------------
# macOS-only BNNS paths (untested: written from the upstream declarations)
# ----------------------------------------------------------------------------
def _bnns_desc(ffi, data, rows, cols, dtype, scale, keep):
    d = ffi.new("BNNSNDArrayDescriptor *")
    d.layout = _BNNS_ROWMAJOR
    d.size[0] = cols
    d.size[1] = rows
    d.data = ffi.from_buffer(data) if data is not None else ffi.NULL
    d.data_type = dtype
    d.data_scale = scale
    keep.append(d)
    return d


def bnns_matmul_f32(x, w):
    """``x[m, k] @ w[k, n]`` via ``BNNSMatMul`` (float32) -- an ABI probe.

    Returns ``(y, rc)``; ``rc == 0`` on success.  macOS only, untested.
    """
    st = _require()
    if st.kind != "accelerate":
        raise RuntimeError("bnns_matmul_f32 needs Accelerate (macOS); backend is "
                           f"{st.name!r}.")
    x = as_matrix(x, "x")
    w = as_matrix(w, "w")
    m, k = x.shape
    n = w.shape[1]
    y = np.zeros((m, n), dtype=np.float32)
    keep = []
    a = _bnns_desc(st.ffi, x, m, k, _BNNS_F32, 1.0, keep)
    b = _bnns_desc(st.ffi, w, k, n, _BNNS_F32, 1.0, keep)
    c = _bnns_desc(st.ffi, y, m, n, _BNNS_F32, 1.0, keep)
    rc = st.lib.BNNSMatMul(False, False, 1.0, a, b, c, st.ffi.NULL, st.ffi.NULL)
    return y, int(rc)


def _bnns_fc_i8(xq, sx, wtq, sw):
    """int8 fully-connected layer: ``y[m, n] = (xq * sx) @ (wtq * sw).T``.

    ``xq[m, k]`` int8 activations with one per-tensor scale ``sx``; ``wtq[n,
    k]`` int8 weights, output-major (BNNS FC stores ``Weight(o, i)`` at
    ``i + o * k``), per-tensor scale ``sw``.  Returns ``(y, rc)``; ``rc == -2``
    when the filter cannot be created.  macOS only, untested.
    """
    st = _require()
    ffi, lib = st.ffi, st.lib
    xq = np.ascontiguousarray(xq, dtype=np.int8)
    wtq = np.ascontiguousarray(wtq, dtype=np.int8)
    m, k = xq.shape
    n = wtq.shape[0]
    p = ffi.new("BNNSLayerParametersFullyConnected *")
    p.i_desc.layout = _BNNS_VECTOR
    p.i_desc.size[0] = k
    p.i_desc.data_type = _BNNS_INT8
    p.i_desc.data_scale = float(sx)
    wbuf = ffi.from_buffer(wtq)
    p.w_desc.layout = _BNNS_ROWMAJOR
    p.w_desc.size[0] = k
    p.w_desc.size[1] = n
    p.w_desc.data = wbuf
    p.w_desc.data_type = _BNNS_INT8
    p.w_desc.data_scale = float(sw)
    p.o_desc.layout = _BNNS_VECTOR
    p.o_desc.size[0] = n
    p.o_desc.data_type = _BNNS_F32
    p.o_desc.data_scale = 1.0
    filt = lib.BNNSFilterCreateLayerFullyConnected(p, ffi.NULL)
    y = np.zeros((m, n), dtype=np.float32)
    if filt == ffi.NULL:
        return y, -2
    try:
        rc = lib.BNNSFilterApplyBatch(filt, m, ffi.from_buffer(xq), k,
                                      ffi.from_buffer(y), n)
    finally:
        lib.BNNSFilterDestroy(filt)
    return y, int(rc)


def _int8_fc_or_none():
    if sys.platform != "darwin":
        return None
    return _bnns_fc_i8


#: The vendor int8 fully-connected path, ``int8_fc(xq, sx, wtq, sw) -> (y, rc)``,
#: or ``None`` where the platform has none (OpenBLAS has no int8 GEMM).
int8_fc = _int8_fc_or_none()
