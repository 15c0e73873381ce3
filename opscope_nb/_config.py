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
  (:func:`_drop_stale_cache`, under a file lock so concurrent processes
  never delete each other's files): numba keys it on each function's own
  file only.
* Where the cache lives is decided by :func:`cache_base`: ``NUMBA_CACHE_DIR``
  if set, else the package's ``__pycache__``, else (read-only install) a
  per-user directory, ``$XDG_CACHE_HOME/opscope-nb/numba``.
* Parallel kernels are cached too (numba supports caching ``parallel=True``
  functions); a test checks that a second process does not recompile.
* ``njit(opt=...)`` compiles a kernel at its own LLVM level (:data:`OPT`,
  :data:`OPT_HOT`), ``njit(link="late")`` links a large kernel into its
  callers after their optimisation (its code is optimised once, in its own
  compile, not again in every caller and theirs: :func:`_finalize`), and
  ``njit(vectorize=False)`` compiles explicit-SIMD tiles without LLVM's
  loop vectoriser.  All three cut compile time, never the kernels' speed.
* Machine code is emitted on demand (:func:`_emit`): a function compiled
  only as a callee runs inside its callers' modules, so its own library is
  emitted only if Python (or a pointer lookup) calls it; until then it is
  cached as LLVM bitcode, and as object code once it runs.
* Its module is optimised on demand too (:func:`_optimise`): a callee's code
  is optimised inside each caller's module, so its own optimisation waits
  until its own machine code (or an inspection of its IR) is asked for.

Thresholds are never module globals read by kernels (numba freezes globals at
compile time): they are function arguments.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import warnings
import weakref

import numba
from numba.core import codegen as _ncodegen
from numba.core import config as _nconfig
from numba.core import cpu as _ncpu
from numba.core import dispatcher as _ndispatcher
from numba.core import errors as _nerrors
from numba.core.environment import lookup_environment
from numba.core.compiler_lock import global_compiler_lock
from numba.np.ufunc.parallel import _launch_threads


_ROOT = pathlib.Path(__file__).resolve().parent


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
    """The per-user cache directory: ``$XDG_CACHE_HOME/opscope-nb/numba``
    (``~/.cache/opscope-nb/numba`` without ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "opscope-nb" / "numba"


def cache_base(root=None):
    """The directory the package's kernels are cached under, or ``None`` for
    numba's own choice.

    * ``NUMBA_CACHE_DIR`` set: ``None`` (numba caches there, as the user asked);
    * the package's ``__pycache__`` is writable: ``None`` (numba's in-tree
      cache, next to the sources);
    * otherwise (a read-only install): :func:`user_cache_dir`, when writable.

    This is the one function deciding where compiled kernels live; a variant
    that must not share them (e.g. a forced SIMD path) returns a
    subdirectory of its own here, and :class:`_PackageLocator` plus the stale
    check follow.  ``root``: the package directory (tests), default this one.
    """
    root = pathlib.Path(root or _ROOT)
    if numba.config.CACHE_DIR:
        return None
    if _writable(root / "__pycache__"):
        return None
    user = user_cache_dir()
    return user if _writable(user) else None


def _subpath(d) -> str:
    """numba's cache subdirectory for sources in directory ``d`` under a
    base directory (``<dirname>_<sha1 of its absolute path>``)."""
    from numba.core.caching import _CacheLocator
    return _CacheLocator.get_suitable_cache_subpath(os.path.join(os.path.abspath(d), "x.py"))


def _cache_dirs(root, base):
    """``(stamp directory, [directories holding the package's cache files])``."""
    srcdirs = sorted({f.parent for f in root.rglob("*.py")} | {root})
    if base is None and numba.config.CACHE_DIR:
        base = pathlib.Path(numba.config.CACHE_DIR)
    if base is None:     # in-tree: each source directory's __pycache__
        return root / "__pycache__", [d / "__pycache__" for d in srcdirs]
    base = pathlib.Path(base)
    return base / _subpath(root), [base / _subpath(d) for d in srcdirs]


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


def _drop_stale_cache(root=None, base=None) -> None:
    """Delete the package's numba cache files when any of its sources changed.

    numba keys a cached function on the content of *its own* file, but a
    kernel inlines intrinsics and callees from other files (``_simd*.py``,
    ``_matmul.py``): after editing one of those, a caller in an unchanged file
    would silently load stale machine code.  A fingerprint of every source
    file of the package (and numba's version) is kept next to the cache; on a
    mismatch every ``*.nbi``/``*.nbc`` of the package is removed, so the next
    call compiles afresh.  Costs one read of the sources (~1 MB) per process;
    an installed package whose files never change keeps its cache.

    The cache checked is wherever the kernels are cached (:func:`cache_base`
    ``base``: numba's in-tree ``__pycache__``, ``NUMBA_CACHE_DIR``, or the
    per-user directory of a read-only install).  Check and delete run under
    an exclusive lock on ``opscope.lock`` in the stamp's directory, so
    processes starting together (warm-up jobs, Dask workers) never delete
    each other's fresh files: the first one drops the stale files and writes
    the new fingerprint, the others then find it matching.  Best effort: a
    cache that cannot be written is left alone.
    ``root`` (tests): the package directory to check, default this package.
    """
    import hashlib

    root = pathlib.Path(root or _ROOT)
    try:
        files = sorted(root.rglob("*.py"))
        h = hashlib.sha256(numba.__version__.encode())
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        digest = h.hexdigest()
        if root == _ROOT:
            global SOURCES_DIGEST
            SOURCES_DIGEST = digest
        stamp_dir, dirs = _cache_dirs(root, base)
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


#: SHA-256 of the package's sources and numba's version (set by
#: :func:`_drop_stale_cache` at import; ``None`` if the sources could not be read).
SOURCES_DIGEST = None


try:
    from numba.core.caching import UserProvidedCacheLocator as _UserLocator
    from numba.core.caching import CacheImpl as _CacheImpl
except ImportError:  # older numba: private names
    from numba.core.caching import _UserProvidedCacheLocator as _UserLocator
    from numba.core.caching import _CacheImpl


class _PackageLocator(_UserLocator):
    """numba cache locator for this package's sources when :func:`cache_base`
    chose a directory (read-only install): files go to
    ``<base>/<dirname>_<sha1>`` as with ``NUMBA_CACHE_DIR``, but only for this
    package (numba's global ``CACHE_DIR`` and other libraries are untouched).
    Any other function falls through to numba's locators."""

    base = None

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(str(self.base), self.get_suitable_cache_subpath(py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        if cls.base is None:
            return None
        try:
            pathlib.Path(py_file).resolve().relative_to(_ROOT)
        except (ValueError, OSError):
            return None
        return super(_UserLocator, cls).from_function(py_func, py_file)


_PackageLocator.base = cache_base()
if _PackageLocator not in _CacheImpl._locator_classes:
    _CacheImpl._locator_classes.insert(0, _PackageLocator)
_drop_stale_cache(base=_PackageLocator.base)

_STAMP_DIR, _DIRS = _cache_dirs(_ROOT, _PackageLocator.base)
#: Lock file of the package's cache (stale check and index updates).
CACHE_LOCK = _STAMP_DIR / "opscope.lock"
_OUR_DIRS = frozenset(os.path.abspath(d) for d in _DIRS)


def _install_index_lock():
    """Serialise numba's cache-index updates of this package's files.

    ``IndexDataCacheFile.save`` reads the index, picks the first free data
    file number and rewrites the index: two processes adding *different*
    signatures of one function at once (parallel warm-up jobs compiling two
    formats of ``_run``) could pick the same ``.nbc`` name, and one index entry
    would then point at the other's machine code.  Under :data:`CACHE_LOCK`
    (this package's cache directories only) the read-modify-write is atomic.
    """
    from numba.core.caching import IndexDataCacheFile
    orig = IndexDataCacheFile.save
    if getattr(orig, "_opscope_locked", False):
        return

    def save(self, key, data):
        if os.path.abspath(self._cache_path) not in _OUR_DIRS:
            return orig(self, key, data)
        try:
            lock = _locked(CACHE_LOCK)
            lock.__enter__()
        except OSError:
            return orig(self, key, data)
        try:
            return orig(self, key, data)
        finally:
            lock.__exit__(None, None, None)

    save._opscope_locked = True
    IndexDataCacheFile.save = save


_install_index_lock()


#: The int8 dot-product paths ``OPSCOPE_I8_PATH`` may name (``kernels._simd``
#: describes each and picks the host's).
I8_PATHS = ("avx512vnni", "avx512vnni256", "avxvnni", "avx2", "portable")


def _forced_path_cache() -> bool:
    """A forced int8 path (``OPSCOPE_I8_PATH``, see ``kernels._simd``) caches in
    a directory of its own, ``i8path-<path>`` next to the cache's source stamp
    (the package's ``__pycache__``, under ``NUMBA_CACHE_DIR`` when that is set,
    or in the per-user directory of a read-only install: :func:`cache_base`):
    numba keys the cache on CPU features, not on our path, so the shared cache
    would hand it another path's machine code.  That directory keeps a copy of
    the source stamp and is emptied when the stamp changed, as
    :func:`_drop_stale_cache` does for the shared one.  Returns whether to
    cache (False if that is not possible: forced runs then compile)."""
    import shutil

    path = os.environ.get("OPSCOPE_I8_PATH", "").strip()
    if not path:
        return True
    if path not in I8_PATHS:  # kernels._simd raises the ValueError (no directory made)
        return False
    d = _STAMP_DIR / f"i8path-{path}"
    try:
        stamp = (_STAMP_DIR / "opscope_sources.sha256").read_text()
        if not (d / "sources.sha256").exists() or (d / "sources.sha256").read_text() != stamp:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, exist_ok=True)
            (d / "sources.sha256").write_text(stamp)
    except OSError:
        return False
    if _PackageLocator.base is not None:
        # a read-only install: only the package's locator moves
        _PackageLocator.base = d
    else:
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


#: LLVM optimisation level the package's kernels compile at (numba's own
#: default is 3).  ``-O2`` compiles a cold low-bit prefill about a fifth
#: faster (int6/g128, 64 x 256 at m = 16: 11.5 -> 9.0 s; the bench's warm-up
#: 177.9 -> 146.1 s) and runs the kernels within noise of ``-O3`` (in-cache
#: 1024 x 1024 calls at m = 1 and 32, every kind: 0.76-1.08x the time; Zen 4),
#: except the W4A8 panel (6-19 % slower) and the 2:4 product (9 % at m = 1),
#: which ask for :data:`OPT_HOT`.
#: A user's ``NUMBA_OPT`` wins over both (every kernel then compiles at it).
OPT = 2

#: Level of the kernels measured slower at :data:`OPT` (``njit(..., opt=OPT_HOT)``).
OPT_HOT = 3


#: numba's warning for a ``parallel=True`` function without a parallel loop.
_NO_PARFOR_WARNING = r"\s*The keyword argument 'parallel=True' was specified but no transformation"


def _at_opt(disp, level, late=False, vectorize=True):
    """``disp`` compiling at LLVM level ``level``: numba reads ``config.OPT``
    when it builds each pass pipeline, so it is set for the duration of this
    dispatcher's compile (and of its callees', unless they set their own)
    under numba's global compiler lock, then restored -- other code in the
    process keeps its level.  A callee's code linked into a caller is
    optimised once more at the caller's level there, unless the callee links
    late (``late``: :func:`_finalize`): then its own level is the only one
    its code sees, so a hot late kernel asks for :data:`OPT_HOT` itself.
    ``vectorize=False``
    turns LLVM's loop vectoriser off the same way (``config.LOOP_VECTORIZE``),
    for kernels whose loops are explicit SIMD tiles: it found nothing to do
    there and took about a tenth of their compile.  The settings do not key
    numba's on-disk cache; a change of them is a change of a source file,
    which drops the cache.  A user's ``NUMBA_OPT`` leaves the level alone.
    A parallel dispatcher's compile does not warn that it found no loop to
    run in parallel: a one-path variant of an entry (``PackedLinear``'s
    decode, ``prefill=None``) has none by design, its product's prange loops
    being in the kernel it calls."""
    want = None if "NUMBA_OPT" in os.environ else _nconfig._OptLevel(str(level))
    quiet = bool(disp.targetoptions.get("parallel"))
    if want is None and not late and vectorize and not quiet:
        return disp
    orig = disp.compile

    def compile(sig):
        with global_compiler_lock:
            old = _nconfig.OPT, _nconfig.LOOP_VECTORIZE
            if want is not None:
                _nconfig.OPT = want
            if not vectorize:
                _nconfig.LOOP_VECTORIZE = False
            try:
                if quiet:
                    # (under numba's global lock: no other compile shares the filter)
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", _NO_PARFOR_WARNING,
                                                _nerrors.NumbaPerformanceWarning)
                        out = orig(sig)
                else:
                    out = orig(sig)
            finally:
                _nconfig.OPT, _nconfig.LOOP_VECTORIZE = old
            if late:
                # (cache loads too: a loaded library links late as well)
                for cres in disp.overloads.values():
                    setattr(cres.library, _LATE, True)
            return out

    disp.compile = compile
    return disp


# ── late linking ────────────────────────────────────────────────────────────
# numba links every callee's LLVM module into its caller's module and runs
# the whole optimisation pipeline over the result, so the code of a large
# kernel is optimised again in each function that calls it, and in theirs
# (an entry -> its parallel loop body -> the k-blocked tiles: three more
# times).  A function compiled with ``link="late"`` is linked into its callers
# *after* their optimisation: its code is optimised once, in its own compile,
# and only machine code is emitted again.  For kernels called a few times
# per product (a block of outputs per call), never for small helpers in a
# hot loop, which LLVM must inline -- and only where the kernel measured no
# slower: the low-bit tile blocks and the activation arrangement of
# ``_packed_quant`` ran int2 / ternary prefill 3-8 % slower late-linked
# (1024 x 1024, m = 32, Zen 4), so they stay early.
_LATE = "_opscope_link_late"
_EARLY = "_opscope_early_module"
_LATE_SET = "_opscope_late_libs"


def _linkable(mod):
    """A copy of ``mod`` as numba's ``_get_module_for_linking`` makes it:
    external definitions become ``linkonce_odr`` (many copies may meet)."""
    import llvmlite.binding as ll
    mod = mod.clone()
    for fn in mod.functions:
        if not fn.is_declaration and fn.linkage == ll.Linkage.external:
            fn.linkage = "linkonce_odr"
    return mod


def _early_part(lib):
    """What a caller links before its optimisation: a library that linked
    late callees gives its module without them, else numba's module."""
    early = getattr(lib, _EARLY, None)
    return early if early is not None else lib._get_module_for_linking()


def _late_closure(libs):
    """Every late library reachable from ``libs``: the late ones among them
    and the late callees their early parts leave out, each listed before the
    libraries it calls (so linking in this order always finds the caller's
    reference first: LLVM links a ``linkonce_odr`` function only when the
    module it goes into refers to it)."""
    order, seen = [], set()

    def visit(lib):
        if id(lib) in seen:
            return
        seen.add(id(lib))
        for sub in getattr(lib, _LATE_SET, ()):
            visit(sub)
        order.append(lib)

    for lib in libs:
        if getattr(lib, _LATE, False):
            visit(lib)
        else:
            for sub in getattr(lib, _LATE_SET, ()):
                visit(sub)
    return order[::-1]


def _link_late(mod, late):
    """Link the early parts of ``late`` (callers first) into ``mod``.

    Raises
    ------
    RuntimeError
        A function a late part defines is still only declared in ``mod``:
        the module would run here (the symbol resolves to the callee's own
        compile) and crash when loaded from the cache in another process.
    """
    parts = [_early_part(lib) for lib in late]
    for part in parts:
        mod.link_in(part, preserve=True)
    undefined = {f.name for f in mod.functions if f.is_declaration}
    left = [f.name for part in parts for f in part.functions
            if not f.is_declaration and f.name in undefined]
    if left:
        raise RuntimeError(f"late linking left {left[0]!r} undefined (link order)")


def _finalize(self):
    """``CPUCodeLibrary.finalize`` with late linking and deferred optimisation
    (numba's own when neither applies): link the early callees, optimise (now,
    or when the library's own code is needed: :func:`_optimise`), keep that
    module for callers (:func:`_early_part`), link the late ones, drop what
    nothing calls; the emission waits for the first pointer (:func:`_emit`)."""
    late = _late_closure(self._linking_libraries)
    defer = _defers_optimisation(self)
    if not late and not defer:
        return _orig_finalize(self)
    from numba.core.compiler_lock import require_global_compiler_lock

    require_global_compiler_lock()
    self._codegen._check_llvm_bugs()
    self._raise_if_finalized()
    late_ids = {id(lib) for lib in late}
    seen = set()
    for lib in self._linking_libraries:
        if id(lib) in late_ids or id(lib) in seen:
            continue
        seen.add(id(lib))
        self._reload_init.update(lib._reload_init)
        self._final_module.link_in(_early_part(lib), preserve=True)
    if late:
        setattr(self, _LATE_SET, tuple(late))
        for lib in late:
            self._reload_init.update(lib._reload_init)
    if defer:
        if late:    # (callers link the early part unoptimised, as any deferred module)
            setattr(self, _EARLY, _linkable(self._final_module))
        setattr(self, _OPT_LATER, (int(_nconfig.OPT), bool(_nconfig.LOOP_VECTORIZE),
                                   bool(_nconfig.SLP_VECTORIZE)))
    else:
        _optimise_then_link_late(self, keep_early=True)
    self._final_module.verify()
    self._finalize_final_module()


def _optimise_then_link_late(lib, keep_early):
    """Optimise ``lib``'s module, then (``keep_early``: keep it for callers)
    link its late callees and drop what nothing calls."""
    import llvmlite.binding as ll

    lib._optimize_final_module()
    late = getattr(lib, _LATE_SET, ())
    if not late:
        return
    if keep_early:
        setattr(lib, _EARLY, _linkable(lib._final_module))
    _link_late(lib._final_module, late)
    # the late modules bring their Python wrappers and unused helpers along
    pm = ll.ModulePassManager()
    pm.add_global_dead_code_eliminate_pass()
    pm.run(lib._final_module, lib._codegen._pass_builder())


_orig_finalize = _ncodegen.CPUCodeLibrary.finalize
_ncodegen.CPUCodeLibrary.finalize = _finalize


# ── optimisation on demand ─────────────────────────────────────────────────
# A library whose code only ever runs inside its callers' modules (most
# callees: the block functions, the parfor bodies, numba's own helpers) was
# optimised once on its own and then again in every caller, where its code is
# linked; the first optimisation served only a Python call of it, which most
# callees never get.  So a library is optimised when its own machine code is
# first needed (:func:`_emit`), or when its IR is inspected; its callers always link its unoptimised module
# (also after it has been optimised, and from the cache: the module for
# linking is fixed at the first request), so their code never depends on
# which call came first.  A deferred library keeps the settings it was
# compiled at (level, vectorisers) for its own optimisation.  Not deferred:
# late-linked functions (their code is linked after their callers'
# optimisation) and functions with a level or vectoriser setting of their own
# (``njit(opt=..., vectorize=False)``: their callers would optimise their code
# at the callers' settings only); callees compiled inside them are.
_OPT_LATER = "_opscope_opt_later"
#: Cache kind of a library cached before it was optimised (bitcode + settings).
_KIND_UNOPTIMISED = "opscope-unoptimised-bitcode"
#: Qualified names of the functions whose libraries are optimised in their
#: own compile: late-linked ones and those with settings of their own.
_EAGER_NAMES = set()
#: Switch (tests): defer the optimisation of eligible libraries.
DEFER_OPTIMISATION = True


def _defers_optimisation(lib) -> bool:
    return (DEFER_OPTIMISATION and isinstance(lib, _ncodegen.JITCodeLibrary)
            and lib.name not in _EAGER_NAMES)


def _optimise(lib):
    """Run a deferred library's module optimisation (once), at the settings
    it was compiled with; its module for linking stays the unoptimised one."""
    if getattr(lib, _OPT_LATER, None) is None:
        return
    with global_compiler_lock:
        state = getattr(lib, _OPT_LATER, None)
        if state is None:
            return
        if getattr(lib, _EARLY, None) is None:
            lib._get_module_for_linking()   # (fixed now, before the module changes)
        old = _nconfig.OPT, _nconfig.LOOP_VECTORIZE, _nconfig.SLP_VECTORIZE
        _nconfig.OPT = _nconfig._OptLevel(str(state[0]))
        _nconfig.LOOP_VECTORIZE, _nconfig.SLP_VECTORIZE = state[1], state[2]
        try:
            _optimise_then_link_late(lib, keep_early=False)
        finally:
            _nconfig.OPT, _nconfig.LOOP_VECTORIZE, _nconfig.SLP_VECTORIZE = old
        lib._final_module.verify()
        setattr(lib, _OPT_LATER, None)


def _get_llvm_str(self):
    _optimise(self)
    return _orig_get_llvm_str(self)


def _get_asm_str(self):
    _optimise(self)
    return _orig_get_asm_str(self)


_orig_get_llvm_str = _ncodegen.CPUCodeLibrary.get_llvm_str
_orig_get_asm_str = _ncodegen.CPUCodeLibrary.get_asm_str
_ncodegen.CPUCodeLibrary.get_llvm_str = _get_llvm_str
_ncodegen.CPUCodeLibrary.get_asm_str = _get_asm_str


# ── machine code on demand ──────────────────────────────────────────────────
# numba emits a function's machine code as soon as its module is optimised,
# to make the Python entry of every compiled function, callee or not.  But a
# callee's code reaches the machine through its callers' modules (numba links
# callees into callers): its own emission serves only a Python call of it,
# which most callees never get.  A cold intN W8A8 public core (four bit
# widths, Zen 4) spent 10.3 of its 34.1 s emitting, 1.6 s of it for the
# library Python called.  So a library is emitted when a pointer into it is
# first asked for (the first call from Python, a ufunc or gufunc wrapper,
# numba's runtime); the entry of a compiled function is a stand-in
# (:class:`_PendingEntry`) that numba's lowering keys its callers on, and
# the dispatcher gets the real entry on the first call from Python.  A
# library cached before it was emitted is cached as LLVM bitcode (numba's
# own ``bitcode`` kind: a later process emits it only if it calls it), and
# cached again as object code once a call emits it.
_PENDING = "_opscope_pending"
_BITCODE = "_opscope_cached_bitcode"


def _finalize_final_module(self):
    """Defer ``CPUCodeLibrary._finalize_final_module`` (adding the module to
    the JIT engine, which emits it) for JIT libraries: :func:`_emit`."""
    if isinstance(self, _ncodegen.JITCodeLibrary):
        setattr(self, _PENDING, True)
        self._finalized = True
        return
    _orig_finalize_final_module(self)


def _emit(lib):
    """Emit a deferred library's machine code (once), then point its
    environment globals (its own and its callees') at their objects, as an
    eager compile or numba's cache loader would have."""
    if not getattr(lib, _PENDING, False):
        return
    with global_compiler_lock:      # (the JIT engine is shared; the lock is reentrant)
        if not getattr(lib, _PENDING, False):
            return
        _optimise(lib)
        setattr(lib, _PENDING, False)
        _orig_finalize_final_module(lib)
        for gv in lib._final_module.global_variables:
            if gv.name.startswith("_ZN08NumbaEnv"):
                env = lookup_environment(gv.name)
                if env is not None:
                    lib.codegen.set_env(gv.name, env)
        # (a library loaded as object code: its final module is empty)
        for name, env in list(_ENVS.items()):
            if lib.codegen._engine.get_global_value_address(name):
                del _ENVS[name]
                _orig_set_env(lib.codegen, name, env)


#: Environments whose global was not in the engine yet when numba set it (a
#: cache load of a deferred library): set when that library is emitted (weak:
#: one whose function is gone is never needed).
_ENVS = weakref.WeakValueDictionary()


def _set_env(self, env_name, env):
    if not self._engine.get_global_value_address(env_name):
        _ENVS[env_name] = env
        return
    _orig_set_env(self, env_name, env)


def _get_pointer_to_function(self, name):
    self._ensure_finalized()    # (the optimisation and emission may wait ...)
    _emit(self)                 # (... until here)
    return _orig_get_pointer(self, name)


def _serialize_using_object_code(self):
    if getattr(self, _PENDING, False):
        setattr(self, _BITCODE, True)
        opt = getattr(self, _OPT_LATER, None)
        if opt is not None and not getattr(self, _LATE_SET, ()):
            # bitcode a later process optimises before emitting it
            return (self.name, _KIND_UNOPTIMISED, (self._final_module.as_bitcode(), opt))
        _optimise(self)     # (its late callees are linked after the optimisation)
        return self.serialize_using_bitcode()
    return _orig_serialize(self)


def _unserialize(cls, codegen, state):
    if state[1] == _KIND_UNOPTIMISED:
        import llvmlite.binding as ll

        name, _, (data, opt) = state
        lib = codegen.create_library(name)
        lib._final_module = ll.parse_bitcode(data)
        setattr(lib, _OPT_LATER, tuple(opt))
        setattr(lib, _BITCODE, True)
        lib._finalize_final_module()
        return lib
    lib = _orig_unserialize(cls, codegen, state)
    if state[1] == "bitcode":
        setattr(lib, _BITCODE, True)
    return lib


class _PendingEntry:
    """The Python entry of a compiled function whose library is not emitted
    yet: numba keys its callers' lowering on it; calling it (or
    :meth:`resolve`) emits the library and makes the real entry."""

    __slots__ = ("_args", "cfunc", "__weakref__")

    def __init__(self, ctx, library, fndesc, env):
        self._args = (ctx, library, fndesc, env)
        self.cfunc = None

    @property
    def library(self):
        return self._args[1]

    def resolve(self):
        if self.cfunc is None:
            self.cfunc = _orig_get_executable(*self._args)
        return self.cfunc

    def __call__(self, *args, **kws):
        return self.resolve()(*args, **kws)


def _get_executable(self, library, fndesc, env):
    library._ensure_finalized()
    if getattr(library, _PENDING, False):
        return _PendingEntry(self, library, fndesc, env)
    return _orig_get_executable(self, library, fndesc, env)


def _add_overload(self, cres):
    entry = cres.entry_point
    if not isinstance(entry, _PendingEntry):
        return _orig_add_overload(self, cres)
    args = tuple(cres.signature.args)
    if entry.cfunc is not None:     # (already emitted: its real entry goes in the table)
        self._insert([a._code for a in args], entry.cfunc, cres.objectmode)
    # else no entry for Python calls yet: _compile_for_args makes it on the first
    self.overloads[args] = cres


def _compile_for_args(self, *args, **kws):
    out = _orig_compile_for_args(self, *args, **kws)
    if isinstance(out, _PendingEntry):
        out = _enter(self, out)
    return out


def _disable_compile(self, val=True):
    # a dispatcher compiled for explicit signatures (``njit("f8(f8)")``) takes
    # no new ones: its Python calls only look in its entry table, so every
    # entry goes in now
    if val:
        for cres in list(self.overloads.values()):
            if isinstance(cres.entry_point, _PendingEntry):
                _enter(self, cres.entry_point)
    _orig_disable_compile(self, val)


def _enter(disp, pending):
    """Emit ``pending``, give ``disp`` its entry for Python calls, and cache
    it again as object code if it was cached as bitcode."""
    lib = pending.library
    with global_compiler_lock:
        bitcode = getattr(lib, _BITCODE, False)
        if bitcode and getattr(lib, _PENDING, False):
            lib.enable_object_caching()     # keep the object code the emission makes
        cfunc = pending.resolve()
        for args, cres in list(disp.overloads.items()):
            if cres.entry_point is pending:
                disp._insert([a._code for a in args], cfunc, cres.objectmode)
                cache = getattr(disp, "_cache", None)
                if (bitcode and cache is not None
                        and getattr(lib, "_compiled_object", None) is not None):
                    setattr(lib, _BITCODE, False)
                    cache.save_overload(args, cres)
                break
    return cfunc


_orig_finalize_final_module = _ncodegen.CPUCodeLibrary._finalize_final_module
_orig_get_pointer = _ncodegen.JITCodeLibrary.get_pointer_to_function
_orig_serialize = _ncodegen.CPUCodeLibrary.serialize_using_object_code
_orig_unserialize = _ncodegen.CPUCodeLibrary._unserialize.__func__
_ncodegen.CPUCodeLibrary._finalize_final_module = _finalize_final_module
_ncodegen.JITCodeLibrary.get_pointer_to_function = _get_pointer_to_function
_ncodegen.CPUCodeLibrary.serialize_using_object_code = _serialize_using_object_code
_ncodegen.CPUCodeLibrary._unserialize = classmethod(_unserialize)
_orig_set_env = _ncodegen.JITCPUCodegen.set_env
_ncodegen.JITCPUCodegen.set_env = _set_env

_orig_get_executable = _ncpu.CPUContext.get_executable
_ncpu.CPUContext.get_executable = _get_executable
_orig_add_overload = _ndispatcher._DispatcherBase.add_overload
_ndispatcher._DispatcherBase.add_overload = _add_overload
_orig_compile_for_args = _ndispatcher._DispatcherBase._compile_for_args
_ndispatcher._DispatcherBase._compile_for_args = _compile_for_args
_orig_disable_compile = _ndispatcher._DispatcherBase.disable_compile
_ndispatcher._DispatcherBase.disable_compile = _disable_compile


def _jit(opts, fn, overrides):
    opts = dict(opts)
    opts.update(overrides)
    level = opts.pop("opt", OPT)
    link = opts.pop("link", "early")
    if link not in ("early", "late"):
        raise ValueError(f"link must be 'early' or 'late'; got {link!r}")
    late = link == "late"
    vec = bool(opts.pop("vectorize", True))

    def make(f):
        if late or level != OPT or not vec:     # (see _defers_optimisation)
            _EAGER_NAMES.add(f.__qualname__)
        return _at_opt(numba.njit(**opts)(f), level, late, vec)

    return make if fn is None else make(fn)


def njit(fn=None, **overrides):
    """``numba.njit`` with the package's serial options (overridable), compiled
    at LLVM level :data:`OPT` (``opt=`` overrides it).

    Usable bare (``@njit``) or with keyword overrides (``@njit(parallel=True)``).
    """
    return _jit(JIT, fn, overrides)


def njit_parallel(fn=None, **overrides):
    """``numba.njit`` with the package's parallel options (``prange`` loops),
    at LLVM level :data:`OPT` (``opt=`` overrides it)."""
    return _jit(JIT_PARALLEL, fn, overrides)


#: Options of kernels that must reproduce another library bit for bit (the
#: ggml quantisers): IEEE float32 arithmetic, no reassociation, no FMA
#: contraction (``fastmath`` off).
JIT_EXACT = dict(JIT, fastmath=False)


def njit_exact(fn=None, **overrides):
    """``numba.njit`` with :data:`JIT_EXACT` (serial)."""
    return njit(fn, **dict(JIT_EXACT, **overrides)) if fn is not None else \
        njit(**dict(JIT_EXACT, **overrides))


def njit_parallel_exact(fn=None, **overrides):
    """``numba.njit`` with :data:`JIT_EXACT` and ``parallel=True``."""
    return njit_parallel(fn, **dict(fastmath=False, **overrides)) if fn is not None else \
        njit_parallel(**dict(fastmath=False, **overrides))

