"""Process and file-system facts every layer needs: one helper per idea.

* :func:`atomic_writer` / :func:`atomic_write` -- the package's only way to
  write a result file: a temporary file in the target's directory, flushed
  and ``fsync``-ed, given the mode a plain ``open`` would give (or the one
  asked for), then renamed over the target; on any error the temporary file
  is removed and the target is untouched.
* :func:`peak_rss_mb` / :func:`reset_peak_rss` -- this process's peak
  resident set size.

Layer 0: imports nothing from the package.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

__all__ = ["umask_mode", "atomic_writer", "atomic_write", "peak_rss_mb", "reset_peak_rss"]


def umask_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask."""
    old = os.umask(0o022)
    os.umask(old)
    return 0o666 & ~old


@contextlib.contextmanager
def atomic_path(path, *, file_mode: int | None = None):
    """Context manager yielding a temporary path next to ``path`` that replaces
    ``path`` atomically (after an ``fsync``) when the block ends without an
    exception, and is removed when it raises: for writers that open the file
    themselves (gguf-py's ``GGUFWriter``).  The package's one atomic-write
    sequence; :func:`atomic_writer` is built on it.

    Parameters
    ----------
    path : str or PathLike
        Target; its directory must exist.
    file_mode : int, optional
        Permission bits of the result (default: what the umask gives a new
        file, not ``mkstemp``'s 0600).

    Yields
    ------
    str
        ``.<name>.<random>.tmp`` in ``path``'s directory (created, empty).
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, umask_mode() if file_mode is None else file_mode)
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextlib.contextmanager
def atomic_writer(path, mode: str = "wb", *, file_mode: int | None = None, **open_kw):
    """Context manager yielding a file object whose content replaces ``path``
    atomically when the block ends without an exception (:func:`atomic_path`).

    Parameters
    ----------
    path : str or PathLike
        Target; its directory must exist.
    mode : {"wb", "w"}
        Binary or text (``open_kw`` such as ``encoding`` go to :func:`open`).
    file_mode : int, optional
        Permission bits of the result (default: what the umask gives a new
        file).

    Yields
    ------
    file object
        Open on a temporary file ``.<name>.<random>.tmp`` next to ``path``.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_writer mode must be 'wb' or 'w'; got {mode!r}.")
    if mode == "w":
        open_kw.setdefault("encoding", "utf-8")
        open_kw.setdefault("newline", "")
    with atomic_path(path, file_mode=file_mode) as tmp:
        with open(tmp, mode, **open_kw) as f:
            yield f


def atomic_write(path, data, *, file_mode: int | None = None) -> None:
    """Write ``data`` (``str`` as UTF-8 text, or bytes-like) to ``path`` atomically
    (see :func:`atomic_writer`)."""
    with atomic_writer(path, "w" if isinstance(data, str) else "wb",
                       file_mode=file_mode) as f:
        f.write(data)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5, so a later
    :func:`peak_rss_mb` ``(since_reset=True)`` covers only what follows);
    False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb(since_reset: bool = False) -> float:
    """Peak resident set size of this process in MiB, NaN if unknown.

    ``since_reset``: read Linux's ``VmHWM`` (which :func:`reset_peak_rss`
    resets) instead of ``getrusage``'s lifetime maximum.
    """
    if since_reset:
        try:
            with open("/proc/self/status") as f:
                for ln in f:
                    if ln.startswith("VmHWM:"):
                        return int(ln.split()[1]) / 1024.0
        except (OSError, ValueError, IndexError):
            pass
    try:
        import resource
    except ImportError:  # Windows
        return float("nan")
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return kb / (1024.0 * 1024.0) if sys.platform == "darwin" else kb / 1024.0
