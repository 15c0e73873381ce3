"""The one place that owns numba's compilation flags.

Every ``@njit`` in the package takes its options from here (never a literal
``fastmath=`` / ``cache=`` elsewhere), so a policy change is one edit.

* ``FASTMATH`` is fastmath *without* ``nnan``/``ninf``: reassociation and
  contraction let LLVM vectorise reductions, while NaN/Inf keep their IEEE
  meaning so finiteness checks inside kernels still work.  It also leaves out
  ``arcp``: with it LLVM rewrites ``x / scale`` as ``x * (1/scale)``, which is
  one ulp off for about a third of quotients and moves round-half-away
  decisions, so quantisation codes would no longer equal ``x / scale`` as
  NumPy, Rust and the tests compute it.  A correctly rounded division per
  element costs far less than the memory traffic of the same loop.
* ``cache=True`` everywhere numba allows it, so a second process loads the
  compiled machine code from ``__pycache__`` instead of recompiling.
* ``error_model="numpy"``: float division by zero gives inf/NaN as in NumPy
  instead of a Python exception, so divisions carry no zero check and loops
  with them vectorise (kernels assume validated input anyway).
* The cache is dropped when any source file of the package changes
  (:func:`_drop_stale_cache`): numba keys it on each function's own file only.
* Parallel kernels are cached too (numba supports caching ``parallel=True``
  functions); a test checks that a second process does not recompile.

Thresholds are never module globals read by kernels (numba freezes globals at
compile time): they are function arguments.
"""
from __future__ import annotations

import numba
from numba.np.ufunc.parallel import _launch_threads


def _drop_stale_cache(root=None) -> None:
    """Delete the package's numba cache files when any of its sources changed.

    numba keys a cached function on the content of *its own* file, but a
    kernel inlines intrinsics and callees from other files (``_simd*.py``,
    ``_matmul.py``): after editing one of those, a caller in an unchanged file
    would silently load stale machine code.  A fingerprint of every source
    file of the package (and numba's version) is kept next to the cache; on a
    mismatch every ``*.nbi``/``*.nbc`` of the package is removed, so the next
    call compiles afresh.  Costs one read of the sources (~1 MB) per process;
    an installed package whose files never change keeps its cache.  Best
    effort: a read-only install (numba then caches elsewhere) is left alone.
    ``root`` (tests): the package directory to check, default this package.
    """
    import hashlib
    import os
    import pathlib

    root = pathlib.Path(root or pathlib.Path(__file__).resolve().parent)
    try:
        files = sorted(root.rglob("*.py"))
        h = hashlib.sha256(numba.__version__.encode())
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        digest = h.hexdigest()
        stamp = root / "__pycache__" / "opscope_sources.sha256"
        if stamp.exists() and stamp.read_text().strip() == digest:
            return
        for pat in ("*.nbi", "*.nbc"):
            for f in root.rglob(f"__pycache__/{pat}"):
                f.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        tmp.replace(stamp)
    except OSError:
        pass


_drop_stale_cache()


def _forced_path_cache() -> bool:
    """A forced int8 path (``OPSCOPE_I8_PATH``, see ``kernels._simd``) caches in
    its own ``__pycache__/i8path-<path>`` (numba keys the cache on CPU
    features, not on our path, so the shared cache would hand it another
    path's machine code).  That directory keeps a copy of the source stamp
    and is emptied when the stamp changed, as :func:`_drop_stale_cache` does
    for the shared one.  Returns whether to cache (False if that is not
    possible, e.g. a read-only install: forced runs then compile)."""
    import os
    import pathlib
    import shutil

    path = os.environ.get("OPSCOPE_I8_PATH", "").strip()
    if not path:
        return True
    if not path.isalnum():  # kernels._simd raises the ValueError
        return False
    pyc = pathlib.Path(__file__).resolve().parent / "__pycache__"
    d = pyc / f"i8path-{path}"
    try:
        stamp = (pyc / "opscope_sources.sha256").read_text()
        if not (d / "sources.sha256").exists() or (d / "sources.sha256").read_text() != stamp:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, exist_ok=True)
            (d / "sources.sha256").write_text(stamp)
    except OSError:
        return False
    numba.config.CACHE_DIR = str(d)
    return True

# Start numba's thread pool now.  A serial @njit function loaded from the
# on-disk cache that calls a parallel kernel does not start it by itself, and
# the first such call in a fresh process would crash; every kernel module
# imports this one, so the pool is up before any kernel runs.
_launch_threads()

#: LLVM fast-math flags: everything except ``nnan``, ``ninf`` and ``arcp``.
FASTMATH = frozenset({"nsz", "contract", "afn", "reassoc"})

#: Cache compiled kernels on disk (``__pycache__``) for later processes.
CACHE = _forced_path_cache()

#: Options for serial kernels.
JIT = dict(nogil=True, cache=CACHE, fastmath=set(FASTMATH), error_model="numpy")

#: Options for kernels with ``prange`` loops.
JIT_PARALLEL = dict(JIT, parallel=True)


def njit(fn=None, **overrides):
    """``numba.njit`` with the package's serial options (overridable).

    Usable bare (``@njit``) or with keyword overrides (``@njit(parallel=True)``).
    """
    opts = dict(JIT)
    opts.update(overrides)
    if fn is None:
        return lambda f: numba.njit(**opts)(f)
    return numba.njit(**opts)(fn)


def njit_parallel(fn=None, **overrides):
    """``numba.njit`` with the package's parallel options (``prange`` loops)."""
    opts = dict(JIT_PARALLEL)
    opts.update(overrides)
    if fn is None:
        return lambda f: numba.njit(**opts)(f)
    return numba.njit(**opts)(fn)
