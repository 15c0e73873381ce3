"""Profile a checkpoint on a Dask cluster: one task per weight matrix.

``opscope-nb profile SOURCE --workers N`` starts a
:class:`dask.distributed.LocalCluster` of ``N`` worker processes on this
machine (scheduler and workers bound to ``127.0.0.1``);
``--scheduler ADDRESS`` (``tcp://host:8786``, ``tls://...`` or the path of a
scheduler file) uses a cluster that is already running.  This module is only
imported when one of those flags is given, and imports Dask itself only inside
its functions, so the serial path never loads Dask.

Work split
----------
One task per selected weight matrix.  The task carries only the checkpoint
*path* and the tensor's name and shape; the worker opens the checkpoint by path
(:func:`opscope_nb.io.open_source`, cached per worker process), memory-maps and
loads just that tensor (:meth:`opscope_nb.io.TensorEntry.load`), checks it is
finite, runs :func:`opscope_nb.profile.mining.profile_layer` and returns the layer's
JSON record (``LayerProfile.to_dict`` inside).  No weights travel through the
scheduler, so every worker must see the checkpoint at the same path (a local
disk on one machine, a shared file system across machines).

Threads
-------
A worker runs one profile at a time (a per-process lock, so a worker started
with several Dask threads does not launch two numba parallel regions at once)
with ``threads`` numba threads, and BLAS limited to the same count.  For a
:class:`LocalCluster` the thread counts are put into the worker processes'
environment *before they start* (``NUMBA_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` via Dask's
``distributed.nanny.pre-spawn-environ``), because numba and OpenBLAS read them
once at import; each task also calls :func:`numba.set_num_threads` (the setting
is per calling thread) and, when the process's OpenBLAS exports it,
``openblas_set_num_threads``, which is what makes ``--threads-per-worker``
effective on an external cluster too.  Every record carries what the worker
actually ran with (``worker.numba_threads``, ``worker.blas_threads``).

Results
-------
The same profile as the serial run: same layers in source order, labels,
bytes and flops exactly.  In one process, 1 vs 2 threads, every option's
relative error is bit-identical but Tucker's (its HOSVD runs LAPACK on
multi-threaded BLAS: up to 2.6e-9 relative measured,
``tests/test_determinism.py``).  A worker process runs with its own BLAS
thread setting, so ``tests/test_distributed.py`` compares with the serial run
at 1e-6 relative and requires at least 80 % of the errors bit-identical.  One task
per matrix: Dask's overhead (~8 ms per task measured here) is ~2 % of the
smallest SmolLM2 matrix's profile, so batching small matrices would not pay.

Security
--------
The local cluster binds scheduler, workers and their HTTP endpoints to
127.0.0.1.  A cluster spanning machines runs whatever pickled task it is sent:
start it with TLS (``dask scheduler --protocol tls --tls-ca-file ...``) and give
the client the matching ``distributed.comm.tls.*`` configuration, which the
:class:`distributed.Client` made here reads through Dask's ``Security``.

Faults
------
A worker that dies mid-task loses nothing: the scheduler reschedules the task
on another worker, and the client writes each layer once (keyed by its source
index).  If the scheduler or every worker goes away, :func:`run_profile` raises
:class:`ClusterLost`; the layers already received are in ``profile.json``
and ``--resume`` continues the run on a new cluster.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings

from .io._fs import peak_rss_mb, reset_peak_rss

__all__ = [
    "INSTALL_LINE",
    "DaskMissingError",
    "ClusterLost",
    "Cluster",
    "require_dask",
    "default_threads",
    "thread_env",
    "connect",
    "run_profile",
    "profile_task",
    "quiet_logging",
    "worker_threads",
    "blas_threads",
]

#: How to install the optional dependency (printed when it is missing).
INSTALL_LINE = 'pip install -e ".[distributed]"'
#: Seconds the CLI waits for a scheduler, and with no scheduler or no worker mid-run.
CONNECT_TIMEOUT = 30.0
LOST_AFTER = 20.0


class DaskMissingError(ImportError):
    """``--workers`` / ``--scheduler`` asked for, but ``dask.distributed`` is not installed."""


class ClusterLost(RuntimeError):
    """The scheduler, or every worker, went away before the run finished."""


def require_dask():
    """Import and return ``dask.distributed``, or raise :class:`DaskMissingError`.

    The message names the install line (:data:`INSTALL_LINE`).
    """
    try:
        import dask  # noqa: F401
        import distributed
    except ImportError as exc:
        raise DaskMissingError(
            f"--workers/--scheduler need the optional Dask package ({exc}); install it "
            f"with: {INSTALL_LINE}") from None
    return distributed


def default_threads(n_workers: int, cores: int | None = None) -> int:
    """Numba/BLAS threads per worker when ``--threads-per-worker`` is not given.

    ``max(1, cores // n_workers)`` with ``cores`` = the CPUs this process may
    use (``os.sched_getaffinity`` where available, else ``os.cpu_count()``).
    """
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, int(cores) // max(1, int(n_workers)))


def thread_env(threads: int) -> dict:
    """Environment that fixes numba's and BLAS's thread pools at ``threads``.

    Must be in a process's environment before numba / numpy are imported there.
    """
    t = str(int(threads))
    return {"NUMBA_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "OMP_NUM_THREADS": t,
            "MKL_NUM_THREADS": t}


# --------------------------------------------------------------------------- #
# BLAS thread count through the loaded OpenBLAS (no threadpoolctl dependency)
# --------------------------------------------------------------------------- #
_BLAS_FUNCS = None


def _openblas_funcs():
    """(get, set) pairs of every OpenBLAS mapped into this process (Linux), cached."""
    global _BLAS_FUNCS
    if _BLAS_FUNCS is not None:
        return _BLAS_FUNCS
    import ctypes
    funcs = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = sorted({ln.split()[-1] for ln in f
                            if "openblas" in ln.lower() and ln.split()[-1].startswith("/")})
    except OSError:
        paths = []
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        for pre, suf in (("scipy_openblas_", "64_"), ("scipy_openblas_", ""),
                         ("openblas_", "64_"), ("openblas_", "")):
            g = getattr(lib, f"{pre}get_num_threads{suf}", None)
            s = getattr(lib, f"{pre}set_num_threads{suf}", None)
            if g is not None and s is not None:
                g.restype = ctypes.c_int
                s.argtypes = [ctypes.c_int]
                funcs.append((g, s))
                break
    _BLAS_FUNCS = funcs
    return funcs


def blas_threads(set_to: int | None = None):
    """Threads of the OpenBLAS libraries loaded in this process (list, may be empty).

    With ``set_to``, first sets each of them to that many threads.
    """
    out = []
    for g, s in _openblas_funcs():
        if set_to is not None:
            s(int(set_to))
        out.append(int(g()))
    return out


def worker_threads() -> dict:
    """What this process runs with: numba's pool, this thread's numba count, BLAS."""
    import numba
    return {"numba_pool": int(numba.config.NUMBA_NUM_THREADS),
            "numba_threads": int(numba.get_num_threads()),
            "blas_threads": blas_threads(),
            "env": {k: os.environ.get(k) for k in thread_env(1)}}


def _apply_threads(threads):
    import numba
    if threads is not None:
        numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
        _openblas_funcs()
        blas_threads(set_to=int(threads))


# --------------------------------------------------------------------------- #
# worker side
# --------------------------------------------------------------------------- #
_LOCK = threading.Lock()
_SOURCES: dict = {}


def _source_key(path):
    if path is None:
        return ("synthetic",)
    st = os.stat(path)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


def _open_cached(path):
    """:func:`opscope_nb.io.open_source` once per (path, mtime, size) in this process."""
    from . import io as tio
    key = _source_key(path)
    hit = _SOURCES.get(key)
    if hit is None:
        _SOURCES.clear()  # one checkpoint at a time; drop old maps
        src = tio.open_source(path)
        hit = (src, {e.name: e for e in src.entries})
        _SOURCES[key] = hit
    return hit


def profile_task(source_path, name, shape, profile_kwargs=None, threads=None) -> dict:
    """Profile one tensor of a checkpoint; runs on a worker.

    Parameters
    ----------
    source_path : str or None
        The checkpoint as given to :func:`opscope_nb.io.open_source` (absolute
        path; None is the built-in synthetic model).
    name : str
        Tensor name in that checkpoint.
    shape : tuple of int
        Its shape as the client saw it (checked: the file must not have changed).
    profile_kwargs : dict, optional
        Keyword arguments of :func:`opscope_nb.profile.mining.profile_layer`
        (``rank_cap``, ``seed`` ...).
    threads : int, optional
        Numba and BLAS threads for this task; None: the Dask worker's own
        ``nthreads`` (``dask worker`` sets it to cores / ``--nworkers``), or the
        process's settings outside a worker.

    Returns
    -------
    dict
        ``{"record": rec}`` with the same record the serial run writes into
        ``profile.json`` plus ``rec["worker"]`` (pid, host, peak RSS of this task,
        thread counts), or ``{"skip": reason}`` when the tensor holds NaN/Inf.
    """
    import platform

    from .profile.checkpoint import profile_entry
    if threads is None:
        try:
            from distributed import get_worker
            threads = int(get_worker().state.nthreads)
        except (ImportError, ValueError, AttributeError):
            threads = None
    with _LOCK:
        _apply_threads(threads)
        src, by_name = _open_cached(source_path)
        e = by_name.get(name)
        if e is None or tuple(e.shape) != tuple(shape):
            from .io import SourceError
            got = None if e is None else tuple(e.shape)
            raise SourceError(f"{source_path}: tensor {name!r} is {got} on worker pid "
                              f"{os.getpid()}, expected shape {tuple(shape)}; every worker "
                              f"must see the same checkpoint at the same path.")
        exact = reset_peak_rss()
        rec, _, why = profile_entry(e, profile_kwargs or {})
        info = worker_threads()
        peak = peak_rss_mb(exact)
    if rec is None:
        return {"skip": why}
    rec["worker"] = {"host": platform.node(), "pid": os.getpid(), "peak_rss_mb": peak,
                     "numba_pool": info["numba_pool"],
                     "numba_threads": info["numba_threads"],
                     "blas_threads": info["blas_threads"]}
    return {"record": rec}


# --------------------------------------------------------------------------- #
# client side
# --------------------------------------------------------------------------- #
class Cluster:
    """A connected client (and the local cluster it owns, if any).

    Attributes
    ----------
    client : distributed.Client
    local : distributed.LocalCluster or None
        Owned by this object (closed by :meth:`close`); None for ``--scheduler``.
    threads : int or None
        Numba/BLAS threads each task uses (None: the worker's own setting).
    address : str
        The scheduler's address.
    """

    def __init__(self, client, local, threads, address):
        self.client = client
        self.local = local
        self.threads = threads
        self.address = address

    def n_workers(self) -> int:
        return len(self.client.scheduler_info(n_workers=-1).get("workers", {}))

    def describe(self) -> dict:
        """For ``profile.json``'s settings: how the run was distributed."""
        return {"scheduler": None if self.local is not None else self.address,
                "local_workers": None if self.local is None else len(self.local.workers),
                "threads_per_worker": self.threads}

    def close(self) -> None:
        for obj in (self.client, self.local):
            if obj is None:
                continue
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - closing a dead cluster must not mask the error
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(workers: int | None = None, threads_per_worker: int | None = None,
            scheduler: str | None = None, *, timeout: float = 30.0) -> Cluster:
    """Start a local cluster (``workers``) or connect to one (``scheduler``).

    Parameters
    ----------
    workers : int, optional
        Worker processes of a new :class:`distributed.LocalCluster` on
        ``127.0.0.1`` (no dashboard).  Each worker runs one task at a time.
    threads_per_worker : int, optional
        Numba and BLAS threads per worker; default :func:`default_threads`
        ``(workers)`` for a local cluster, and for an external one each
        worker's own Dask ``nthreads`` (``dask worker`` defaults it to cores /
        ``--nworkers``), capped by the worker's numba pool
        (``NUMBA_NUM_THREADS`` when it started).
    scheduler : str, optional
        ``tcp://host:port`` / ``tls://host:port`` address, or the path of a
        scheduler file written by ``dask scheduler --scheduler-file``.
    timeout : float
        Seconds to wait for the scheduler.

    Raises
    ------
    DaskMissingError
        Dask is not installed.
    ValueError
        Neither or both of ``workers`` and ``scheduler``, or a count < 1.
    OSError
        The scheduler cannot be reached (message names the address).
    """
    if (workers is None) == (scheduler is None):
        raise ValueError("give exactly one of workers= (a local cluster) or scheduler= "
                         "(an existing one); got "
                         f"workers={workers!r}, scheduler={scheduler!r}.")
    if workers is not None and int(workers) < 1:
        raise ValueError(f"workers must be >= 1; got {workers}.")
    if threads_per_worker is not None and int(threads_per_worker) < 1:
        raise ValueError(f"threads_per_worker must be >= 1; got {threads_per_worker}.")
    distributed = require_dask()
    import logging

    import dask

    if scheduler is not None:
        kw = ({"scheduler_file": scheduler} if os.path.isfile(scheduler)
              else {"address": scheduler})
        try:
            client = distributed.Client(timeout=timeout, set_as_default=False, **kw)
        except (OSError, TimeoutError, ValueError) as exc:
            raise OSError(f"cannot reach the Dask scheduler at {scheduler} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                          ) from None
        return Cluster(client, None, threads_per_worker, client.scheduler.address)

    threads = int(threads_per_worker or default_threads(workers))
    env = thread_env(threads)
    saved = dict(os.environ)
    pre = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    # Dask's default MALLOC_TRIM_THRESHOLD_ also switches off glibc's dynamic mmap
    # threshold, so every temporary array > 128 KiB of a profile becomes a fresh
    # mmap + page faults; measured 25-45 % slower per task here (2 A/B pairs,
    # busy 2-core machine).  The serial run does not have it either.
    pre.pop("MALLOC_TRIM_THRESHOLD_", None)
    pre.update(env)
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": pre}), \
                warnings.catch_warnings():
            # the scheduler's health/metrics HTTP server binds 127.0.0.1:8787, or a
            # free port when another cluster has it (a warning we do not print)
            warnings.filterwarnings("ignore", message="Port .* is already in use")
            local = distributed.LocalCluster(
                n_workers=int(workers), threads_per_worker=1, processes=True,
                host="127.0.0.1", scheduler_port=0, dashboard_address=None,
                silence_logs=logging.ERROR)
    finally:
        # the nannies exported the worker environment into this process too: undo it
        for k in [k for k in os.environ if k not in saved]:
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
    try:
        client = distributed.Client(local, timeout=timeout, set_as_default=False)
    except BaseException:
        local.close()
        raise
    return Cluster(client, local, threads, local.scheduler_address)


def _lost(exc) -> bool:
    """Whether an exception from a future means the cluster (not the task) failed."""
    from distributed import KilledWorker
    if isinstance(exc, KilledWorker):
        return True
    name = type(exc).__name__
    return name in ("CancelledError", "CommClosedError", "FutureCancelledError",
                    "TimeoutError", "StreamClosedError") or isinstance(exc, OSError)


def run_profile(cluster: Cluster, source_path, jobs, profile_kwargs, on_result, *,
                poll: float = 0.5, lost_after: float = 20.0) -> None:
    """Submit one task per job and hand each result to ``on_result`` as it completes.

    Parameters
    ----------
    cluster : Cluster
    source_path : str or None
        Absolute checkpoint path (every worker opens it), None for synthetic.
    jobs : list of (int, TensorEntry)
        Source index and entry of every tensor to profile (already-resumed
        layers are simply not in this list).
    profile_kwargs : dict
        Keyword arguments of :func:`opscope_nb.profile.mining.profile_layer`.
    on_result : callable(index, entry, result)
        Called in completion order, exactly once per job, in this thread;
        ``result`` is :func:`profile_task`'s dict.
    poll : float
        Seconds between checks that the cluster is still there.
    lost_after : float
        Seconds with no scheduler or no worker before giving up.

    Raises
    ------
    ClusterLost
        The scheduler or every worker disappeared; ``on_result`` has been
        called for every layer that finished before.
    Exception
        A task's own error (e.g. an unreadable tensor) is re-raised as is.
    """
    from distributed import as_completed
    client = cluster.client
    by_key = {}
    futures = []
    # largest tensors first (ties in source order): the last task to finish is
    # then a small one, so no worker idles through a big tail
    for i, e in jobs:
        f = client.submit(profile_task, source_path, e.name, tuple(int(d) for d in e.shape),
                          dict(profile_kwargs), cluster.threads, pure=False,
                          key=f"opscope-profile-{i}-{os.getpid()}-{time.monotonic_ns()}",
                          priority=int(e.numel))
        by_key[f.key] = (i, e)
        futures.append(f)
    pending = set(futures)
    ac = as_completed(futures, loop=client.loop)
    unhealthy_since = None
    last_check = time.monotonic()

    def fetch(f):
        # a finished future's result still crosses the network: a connection
        # that closes during that gather is the cluster going away, not the task
        try:
            return f.result()
        except Exception as exc:  # noqa: BLE001 - classified just below
            if _lost(exc) or not _healthy(client):
                raise ClusterLost(_lost_message(cluster, exc, len(pending) + 1)) from None
            raise

    try:
        while pending:
            try:
                done = ac.next_batch(block=False) if ac.has_ready() else []
            except Exception as exc:  # noqa: BLE001
                if _lost(exc) or not _healthy(client):
                    raise ClusterLost(_lost_message(cluster, exc, len(pending))) from None
                raise
            if not done:
                time.sleep(min(poll, 0.05))
            for f in sorted(done, key=lambda f: by_key[f.key][0]):
                pending.discard(f)
                i, e = by_key[f.key]
                if f.status == "finished":
                    on_result(i, e, fetch(f))
                    continue
                if f.status in ("lost", "pending"):
                    # finished on a worker that died before we read the result:
                    # we still hold the future, so the scheduler recomputes it
                    # on a live worker -- wait for it again
                    pending.add(f)
                    ac.add(f)
                    continue
                try:
                    exc = f.exception() if f.status == "error" else None
                except Exception as gone:  # noqa: BLE001 - fetching the error failed
                    exc = gone
                if exc is not None and not _lost(exc):
                    raise exc
                raise ClusterLost(_lost_message(cluster, exc, len(pending) + 1))
            if pending and time.monotonic() - last_check >= poll:
                last_check = time.monotonic()
                if _healthy(client):
                    unhealthy_since = None
                elif unhealthy_since is None:
                    unhealthy_since = time.monotonic()
                elif time.monotonic() - unhealthy_since > lost_after:
                    raise ClusterLost(_lost_message(cluster, None, len(pending)))
    finally:
        for f in pending:
            try:
                f.cancel()
            except Exception:  # noqa: BLE001
                pass


def _healthy(client) -> bool:
    """Client connected and the scheduler knows at least one worker (cached view)."""
    if client.status != "running":
        return False
    try:
        info = client.scheduler_info(n_workers=-1)
    except Exception:  # noqa: BLE001
        return False
    return bool(info.get("workers"))


def _lost_message(cluster, exc, n_left) -> str:
    why = "" if exc is None else f": {type(exc).__name__} {str(exc).splitlines()[0] if str(exc) else ''}".rstrip()
    return (f"the Dask cluster at {cluster.address} went away with {n_left} layer(s) "
            f"unfinished{why}")


@contextlib.contextmanager
def quiet_logging():
    """Silence Dask's own loggers inside the block (a dying cluster makes them
    print tracebacks; callers report one line instead), restoring the levels."""
    import logging
    loggers = [logging.getLogger(n) for n in
               ["distributed", *[n for n in list(logging.root.manager.loggerDict)
                                 if n.startswith("distributed.")]]]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)
