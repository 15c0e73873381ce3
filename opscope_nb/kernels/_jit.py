"""The one place that owns the package's numba options and its cache stamp.

Every ``@njit`` in the package takes its options from here (never a literal
``fastmath=`` / ``cache=`` elsewhere), so a policy change is one edit.  Only
numba's public API is used: options go through ``numba.njit(...)`` arguments;
numba's configuration, classes, caches of other code and thread count are
never changed (``tests/test_numba_citizen.py`` checks it).

* ``FASTMATH`` is fastmath *without* ``nnan``/``ninf``: reassociation and
  contraction let LLVM vectorise reductions, while NaN/Inf keep their IEEE
  meaning so finiteness checks inside kernels still work.  It also leaves out
  ``arcp``: with it LLVM rewrites ``x / scale`` as ``x * (1/scale)``, which is
  one ulp off for about a third of quotients and moves round-half-away
  decisions, so quantisation codes would no longer equal ``x / scale`` as
  NumPy and the tests compute it.
* ``cache=True`` everywhere numba allows it, so a later process loads the
  compiled machine code instead of recompiling.  Where numba puts it is
  numba's choice (``NUMBA_CACHE_DIR``, the package's ``__pycache__``, or
  numba's per-user directory for a read-only install).
* ``error_model="numpy"``: float division by zero gives inf/NaN as in NumPy
  instead of a Python exception, so divisions carry no zero check and loops
  with them vectorise (kernels assume validated input anyway).
* The package's own cache files are dropped when any source file of the
  package changes (:func:`_drop_stale_cache`, under a file lock): numba keys
  a cached function on its own file only, while a kernel inlines intrinsics
  and callees from other files.  Only files of this package's directories
  are touched.
* A forced int8 path (``OPSCOPE_I8_PATH``) compiles without the disk cache:
  numba keys the cache on the CPU, not on our path choice, so a cached kernel
  of another path would be loaded.

Thresholds are never module globals read by kernels (numba freezes globals at
compile time): they are function arguments.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import tempfile
import warnings

import numba
from numba.core.errors import NumbaPerformanceWarning

# the package directory (this file lives in its kernels/ folder)
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _writable(d: pathlib.Path) -> bool:
    """Whether files can be created in ``d`` (created if missing); an actual
    write, not ``os.access`` (which says yes to root on a read-only mount
    and ignores ACLs)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=d).close()
        return True
    except OSError:
        return False


def user_cache_dir() -> pathlib.Path:
    """The package's per-user directory: ``$XDG_CACHE_HOME/opscope-nb``
    (``~/.cache/opscope-nb`` without ``XDG_CACHE_HOME``).  Holds the warm-up
    record of a read-only install; numba's own cache stays numba's."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "opscope-nb"


def _subpath(d) -> str:
    """The cache subdirectory numba uses under a base directory for sources in
    directory ``d``: ``<dirname>_<sha1 of its absolute path>`` (numba's
    layout; ``tests/test_numba_citizen.py`` checks it against numba's)."""
    d = os.path.abspath(d)
    return "_".join([os.path.split(d)[-1], hashlib.sha1(d.encode()).hexdigest()])


def cache_dirs(root=None):
    """Where numba caches this package's kernels, as it decides it.

    Returns
    -------
    (stamp_dir, dirs) : (pathlib.Path or None, list of pathlib.Path)
        The directory of the package's source stamp and the directories
        holding its cache files: under ``NUMBA_CACHE_DIR`` when set, else
        each source directory's ``__pycache__`` when the package's is
        writable; ``(None, [])`` for a read-only install (numba's per-user
        cache, whose files numba keys on each source file's stamp).
    """
    root = pathlib.Path(root or _ROOT)
    srcdirs = sorted({f.parent for f in root.rglob("*.py")} | {root})
    base = numba.config.CACHE_DIR
    if base:
        base = pathlib.Path(base)
        return base / _subpath(root), [base / _subpath(d) for d in srcdirs]
    if _writable(root / "__pycache__"):
        return root / "__pycache__", [d / "__pycache__" for d in srcdirs]
    return None, []


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """Hold an exclusive lock on the file ``path`` (created if missing):
    ``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows; the lock goes
    with the file handle, so a killed process never leaves it held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:  # Windows
            import msvcrt
            import time
            f.seek(0)
            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:  # LK_LOCK gives up after ~10 s: keep waiting
                    time.sleep(0.1)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def sources_digest(root=None) -> str:
    """SHA-256 of every source file of the package (path and bytes) and
    numba's version."""
    root = pathlib.Path(root or _ROOT)
    h = hashlib.sha256(numba.__version__.encode())
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _drop_stale_cache(root=None, where=None) -> None:
    """Delete the package's numba cache files when any of its sources changed.

    numba keys a cached function on the content of *its own* file, but a
    kernel inlines intrinsics and callees from other files: after editing one
    of those, a caller in an unchanged file would silently load stale machine
    code.  A fingerprint of every source file of the package (and numba's
    version) is kept next to the cache; on a mismatch every ``*.nbi``/``*.nbc``
    in the package's own cache directories (:func:`cache_dirs`) is removed.
    Check and delete run under an exclusive lock, so processes starting
    together never delete each other's fresh files.  Best effort: a cache
    that cannot be written is left alone.  ``where``: :func:`cache_dirs` of
    ``root`` when the caller has it.
    """
    root = pathlib.Path(root or _ROOT)
    try:
        digest = sources_digest(root)
        if root == _ROOT:
            global SOURCES_DIGEST
            SOURCES_DIGEST = digest
        stamp_dir, dirs = cache_dirs(root) if where is None else where
        if stamp_dir is None:
            return
        stamp = stamp_dir / "opscope_sources.sha256"
        if stamp.exists() and stamp.read_text().strip() == digest:
            return
        with _locked(stamp_dir / "opscope.lock"):
            if stamp.exists() and stamp.read_text().strip() == digest:
                return      # another process dropped them while we waited
            for d in dirs:
                for pat in ("*.nbi", "*.nbc"):
                    for f in d.glob(pat):
                        f.unlink(missing_ok=True)
            tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest + "\n")
            tmp.replace(stamp)
    except OSError:
        pass


#: SHA-256 of the package's sources and numba's version (set at import;
#: ``None`` if the sources could not be read).
SOURCES_DIGEST = None

_CACHE_DIRS = cache_dirs()
_drop_stale_cache(where=_CACHE_DIRS)

_STAMP_DIR = _CACHE_DIRS[0]
#: Directory of the package's own state next to the cache (source stamp, lock,
#: warm-up record): the cache's stamp directory, or the per-user directory of
#: a read-only install.
STATE_DIR = _STAMP_DIR if _STAMP_DIR is not None else user_cache_dir()
#: Lock file of the package's cache state (stale check, warm-up record).
CACHE_LOCK = STATE_DIR / "opscope.lock"


#: The int8 dot-product paths ``OPSCOPE_I8_PATH`` may name (``kernels._simd``
#: describes each and picks the host's).
I8_PATHS = ("avx512vnni", "avx512vnni256", "avxvnni", "avx2", "portable")

#: LLVM fast-math flags: everything except ``nnan``, ``ninf`` and ``arcp``.
FASTMATH = frozenset({"nsz", "contract", "afn", "reassoc"})

#: Cache compiled kernels on disk for later processes (off while an int8 path
#: is forced: the cache would hand that run another path's machine code).
CACHE = not os.environ.get("OPSCOPE_I8_PATH", "").strip()

#: Options for serial kernels.
JIT = dict(nogil=True, cache=CACHE, fastmath=set(FASTMATH), error_model="numpy")

#: Options for kernels with ``prange`` loops.
JIT_PARALLEL = dict(JIT, parallel=True)

#: Options of kernels that must reproduce another library bit for bit (the
#: ggml quantisers): IEEE float32 arithmetic, no reassociation, no FMA
#: contraction (``fastmath`` off).
JIT_EXACT = dict(JIT, fastmath=False)

def _filter_parallel_warning():
    """Ignore numba's "parallel=True ... no transformation" warning for this
    package's kernels: a one-path variant of a parallel entry
    (``PackedLinear``'s decode, ``prefill=None``) has no parallel loop by
    design.  numba names the function's source file in the message, and the
    filter matches only files of this package, so a user's function still
    warns."""
    warnings.filterwarnings(
        "ignore", r"(?s).*The keyword argument 'parallel=True' was specified but no "
        r"transformation.*File \"([^\"]*[/\\])?opscope_nb[/\\][^\"]*\.py\", line",
        NumbaPerformanceWarning)


_filter_parallel_warning()


def _jit(opts, fn, overrides):
    opts = dict(opts, **overrides)
    return numba.njit(**opts) if fn is None else numba.njit(**opts)(fn)


def njit(fn=None, **overrides):
    """``numba.njit`` with the package's serial options (overridable).

    Usable bare (``@njit``) or with keyword overrides (``@njit(inline="always")``).
    """
    return _jit(JIT, fn, overrides)


def njit_parallel(fn=None, **overrides):
    """``numba.njit`` with the package's parallel options (``prange`` loops)."""
    return _jit(JIT_PARALLEL, fn, overrides)


def njit_exact(fn=None, **overrides):
    """``numba.njit`` with :data:`JIT_EXACT` (serial)."""
    return _jit(JIT_EXACT, fn, overrides)


def njit_parallel_exact(fn=None, **overrides):
    """``numba.njit`` with :data:`JIT_EXACT` and ``parallel=True``."""
    return _jit(dict(JIT_EXACT, parallel=True), fn, overrides)


#: The error of a kernel part that runs only compiled (an ``@overload`` stand-in
#: or an intrinsic) when Python calls it: numba is off (``NUMBA_DISABLE_JIT=1``).
NO_JIT = ("opscope_nb: this kernel part runs only compiled (from @njit code), and "
          "NUMBA_DISABLE_JIT=1 is set; unset NUMBA_DISABLE_JIT to run this function")


def intrinsic(fn=None, *, py=None, **options):
    """``numba.extending.intrinsic``, with a pure-Python stand-in under
    ``NUMBA_DISABLE_JIT=1``: ``py`` (the intrinsic's Python twin) when given,
    else a function raising ``NotImplementedError`` that names the setting
    (numba's own stand-in does not), so a JIT-less run gets a slow but correct
    answer or a clear error.  Usable as ``@intrinsic``, ``@intrinsic(py=...)``,
    ``@intrinsic(prefer_literal=True)`` or ``intrinsic(typer)``."""
    def make(f):
        if not numba.config.DISABLE_JIT:
            from numba.extending import intrinsic as _intrinsic
            return _intrinsic(**options)(f) if options else _intrinsic(f)
        if py is not None:
            return py
        name = getattr(f, "__name__", "intrinsic")

        def nojit(*args, **kwargs):
            raise NotImplementedError(f"{NO_JIT} ({name})")
        nojit.__name__ = name
        return nojit

    return make if fn is None else make(fn)


# numba issue 8578: a function loaded from numba's disk cache whose code
# includes a parallel kernel's (a user's ``cache=True`` caller of one of these
# kernels, in a later process) does not start numba's threading layer, and the
# process aborts with "LLVM ERROR: Symbol not found: allocate_sched".  So the
# layer is started when the kernels are imported, through the public
# ``numba.get_num_threads()``: the thread count and the configuration are
# untouched; a threading layer of the user's choice must be chosen before
# this import (``NUMBA_THREADING_LAYER``, or ``numba.config.THREADING_LAYER``).
numba.get_num_threads()
