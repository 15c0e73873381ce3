"""Compressed checkpoints: packed layers + plain tensors in one ``.safetensors`` file.

File layout (a standard safetensors file, readable by any safetensors reader):

* each packed layer ``N`` (a :class:`~opscope_nb.runtime.PackedLinear`) stores
  its arrays as tensors ``N.<array>`` (e.g. ``encoder.layer.0.attention.self.
  query.weight.codes`` int8 ``[rows, cols]`` and ``....scales`` float32
  ``[rows]``), with the dtypes and shapes of :func:`opscope_nb.formats.layout`;
* every other tensor is stored under its own name, unchanged;
* ``__metadata__["opscope_nb"]`` is a JSON record::

      {"format": "opscope-nb-packed", "format_version": 1,
       "layers":  {N: {"decomp": Decomp.to_dict(), "shape": [rows, cols],
                       "arrays": {a: {"dtype", "shape", "sha256"}}}},
       "tensors": {T: {"dtype", "shape", "sha256"}},
       ...caller metadata (``opscope-nb apply`` adds "source", "source_sha256",
          "plan")}

  ``sha256`` is the SHA-256 of the stored array's C-order bytes; ``apply``'s
  ``source_sha256`` maps every source tensor to the SHA-256 of its float32
  C-order bytes as :mod:`opscope_nb.io` loads it (the weights the plan was
  applied to).

Writing is streaming and atomic: arrays are appended one at a time to a
temporary file next to the target, after ``reserve`` bytes left for the
header; :meth:`CheckpointWriter.finish` writes the header into that space
(padded with spaces, as the safetensors format allows), ``fsync``-s the file
and renames it over the target -- the data is written once.  A header that
outgrows its space (or ``reserve=0``) falls back to copying header and data
into a new temporary file (:func:`opscope_nb.io._fs.atomic_writer`).
:func:`opscope_nb.plan.apply.apply_plan` re-reads source tensors one at a time, so
a checkpoint larger than RAM can be compressed.

Reading treats the file as untrusted: the metadata record is checked
against a schema (every malformation is a one-line :class:`CheckpointError`
naming the entry), and arrays are checked against the record.

Layer 3 (imports :mod:`opscope_nb.runtime`, :mod:`opscope_nb.formats`,
:mod:`opscope_nb.io`); ``opscope_nb.runtime.save`` / ``load`` resolve here.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile

import numpy as np

from opscope_nb.io._fs import atomic_writer, umask_mode
from opscope_nb.formats import Decomp
from opscope_nb.io import SourceError, read_safetensors_header
from ._packed import PackedLinear

__all__ = ["save", "load", "read_record", "FORMAT", "FORMAT_VERSION",
           "CheckpointWriter", "CheckpointError"]

FORMAT = "opscope-nb-packed"
FORMAT_VERSION = 1
_META_KEY = "opscope_nb"
_RESERVED = ("format", "format_version", "layers", "tensors")

_NP2ST = {"float32": "F32", "float16": "F16", "float64": "F64", "int8": "I8",
          "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32",
          "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL"}
_ST2NP = {v: k for k, v in _NP2ST.items()}
#: Stored dtypes copied as they are (bytes per element); ``BF16`` words are
#: uint16 bit patterns in memory.
_STORED_PLAIN = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4,
                 "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


#: Bytes appended between two writeback requests (:meth:`CheckpointWriter._start_writeback`).
WRITEBACK_STEP = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint's arrays disagree with its metadata, or its metadata record
    is malformed (the message names the tensor / entry)."""


def _bytes(a: np.ndarray) -> np.ndarray:
    """The C-order bytes of ``a`` as a 1-D uint8 view (any shape, 0-d and empty too)."""
    return np.ascontiguousarray(a.reshape(-1)).view(np.uint8)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(_bytes(a)).hexdigest()


class CheckpointWriter:
    """Append arrays one at a time, then :meth:`finish` writes the file atomically.

    Parameters
    ----------
    path : str
        Target ``.safetensors`` path (its directory must exist).
    reserve : int, optional
        Bytes kept free at the start of the file for the 8-byte length and
        the JSON header (rounded up to a multiple of 8).  When the header fits,
        :meth:`finish` writes it there and renames the file: the data is not
        copied again (the file then carries up to ``reserve`` bytes of header
        padding).  0 (default) or a header too large: the data is copied once
        more behind an exact header.
    """

    def __init__(self, path, *, reserve: int = 0):
        if isinstance(reserve, bool) or not isinstance(reserve, (int, np.integer)) \
                or reserve < 0:
            raise ValueError(f"reserve must be an int >= 0 (bytes kept for the header); "
                             f"got {reserve!r}.")
        self.path = os.fspath(path)
        d = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(d):
            raise ValueError(f"output directory {d} does not exist; create it first.")
        self._dir = d
        fd, self._data_path = tempfile.mkstemp(
            dir=d, prefix="." + os.path.basename(self.path) + ".", suffix=".data.tmp")
        self._data = os.fdopen(fd, "wb")
        # space for the length word and the header; a multiple of 8 keeps the
        # data 8-byte aligned, as an exact header padded to 8 does
        self._reserve = int(reserve) + (-int(reserve) % 8)
        if self._reserve:
            self._data.seek(self._reserve)
        self._header = {}
        self._offset = 0
        self._flushed = self._reserve     # bytes handed to the kernel's writeback
        self.layers = {}
        self.tensors = {}

    def _add(self, name, a):
        if name in self._header:
            raise ValueError(f"tensor {name!r} written twice; names must be unique.")
        if not a.flags.c_contiguous:
            a = a.copy(order="C")   # (ascontiguousarray would turn 0-d into 1-d)
        st = _NP2ST.get(a.dtype.name)
        if st is None:
            raise TypeError(f"tensor {name!r}: dtype {a.dtype} has no safetensors code; "
                            f"use one of {sorted(_NP2ST)}.")
        if not a.dtype.isnative or (a.dtype.byteorder == ">"):
            a = a.astype(a.dtype.newbyteorder("<"))
        self._data.write(_bytes(a))
        n = a.nbytes
        self._header[name] = {"dtype": st, "shape": [int(s) for s in a.shape],
                              "data_offsets": [self._offset, self._offset + n]}
        self._offset += n
        self._start_writeback()
        return {"dtype": a.dtype.name, "shape": [int(s) for s in a.shape], "sha256": _sha(a)}

    def add_layer(self, name: str, lin) -> None:
        """Store a ``PackedLinear``'s arrays as ``name.<array>`` and record its Decomp."""
        arrays = {}
        for an, a in lin.arrays.items():
            arrays[an] = self._add(f"{name}.{an}", a)
        self.layers[name] = {"decomp": lin.decomp.to_dict(),
                             "shape": [int(lin.shape[0]), int(lin.shape[1])],
                             "arrays": arrays}

    def add_stored(self, entry, sha256=None) -> None:
        """Copy a source tensor byte for byte as the source stores it
        (:meth:`opscope_nb.io.TensorEntry.raw`): safetensors dtypes keep their
        code (``BF16`` included); a GGUF block type (``Q8_0`` ...) is stored as
        its ``U8`` blocks ``[rows, row bytes]`` with ``stored_as`` and the
        logical ``shape`` in the record, which :func:`load` decodes.

        ``sha256``: the hex SHA-256 of those bytes when the caller already has
        it (:meth:`~opscope_nb.io.TensorEntry.sha256`, as ``apply`` computes
        for every source tensor); recorded as is instead of hashing them again
        (a 7B model's embedding and output tables: 2.2 GB)."""
        if sha256 is not None and not (isinstance(sha256, str) and len(sha256) == 64):
            raise ValueError(f"sha256 must be a 64-digit hex string or None; got {sha256!r}.")
        src = entry.raw()
        # a file's byte range with its hash known: the kernel copies it
        # (copy_file_range), no pass through this process's memory
        span = (src.filename, int(src.offset)) if sha256 is not None and \
            isinstance(src, np.memmap) and getattr(src, "filename", None) else None
        raw = np.ascontiguousarray(src).reshape(-1)
        code = str(entry.dtype).upper()
        shape = [int(s) for s in entry.shape]
        if code in _STORED_PLAIN:
            item = _STORED_PLAIN[code]
            if raw.size != item * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"tensor {entry.name!r}: {raw.size} stored bytes for "
                                      f"{code} {shape}; the source is inconsistent.")
            info = self._add_bytes(entry.name, raw, code, shape, sha256, span)
        else:
            rows = shape[0] if len(shape) == 2 else 1
            info = self._add_bytes(entry.name, raw, "U8", [rows, raw.size // max(rows, 1)],
                                   sha256, span)
            info["stored_as"] = code
            info["logical_shape"] = shape
        self.tensors[entry.name] = info

    def _add_bytes(self, name, raw, code, shape, sha256=None, span=None):
        if name in self._header:
            raise ValueError(f"tensor {name!r} written twice; names must be unique.")
        if span is None or not self._copy_range(span[0], span[1], int(raw.size)):
            self._data.write(raw)
        n = int(raw.size)
        self._header[name] = {"dtype": code, "shape": shape,
                              "data_offsets": [self._offset, self._offset + n]}
        self._offset += n
        self._start_writeback()
        return {"dtype": _ST2NP.get(code, code.lower()), "shape": shape,
                "sha256": sha256 if sha256 is not None else hashlib.sha256(raw).hexdigest()}

    def _start_writeback(self) -> None:
        """Every :data:`WRITEBACK_STEP` bytes appended, ask the kernel to start
        writing them out (Linux's ``POSIX_FADV_DONTNEED`` starts writeback of
        dirty pages without waiting for it), so that :meth:`finish`'s ``fsync``
        waits for the last piece only instead of the whole file.  Advisory: a
        system without it, or one that refuses, only syncs at the end."""
        end = self._reserve + self._offset
        if end - self._flushed < WRITEBACK_STEP or not hasattr(os, "posix_fadvise"):
            return
        self._data.flush()
        try:
            os.posix_fadvise(self._data.fileno(), self._flushed, end - self._flushed,
                             os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        self._flushed = end

    def _copy_range(self, path, offset, n) -> bool:
        """Append ``n`` bytes of ``path`` from ``offset`` with
        ``os.copy_file_range``; False (nothing written) where the system
        cannot, and the caller writes them itself."""
        if n == 0 or not hasattr(os, "copy_file_range"):
            return n == 0
        self._data.flush()
        dst = self._data.fileno()
        start = self._data.tell()
        done = 0
        try:
            with open(path, "rb") as f:
                while done < n:
                    k = os.copy_file_range(f.fileno(), dst, n - done, offset + done,
                                           start + done)
                    if k <= 0:
                        raise OSError("copy_file_range copied nothing")
                    done += k
        except OSError:
            self._data.seek(start)     # the bytes copied so far are overwritten
            return False
        self._data.seek(start + n)
        return True

    def add_tensor(self, name: str, a) -> None:
        """Store a plain tensor under ``name``."""
        if not isinstance(a, np.ndarray):
            raise TypeError(f"tensor {name!r} must be a numpy ndarray; got "
                            f"{type(a).__name__}.")
        self.tensors[name] = self._add(name, a)

    def abort(self) -> None:
        try:
            self._data.close()
        finally:
            try:
                os.unlink(self._data_path)
            except OSError:
                pass

    def finish(self, metadata=None) -> str:
        """Write header + data to ``path`` atomically; returns ``path``."""
        try:
            record = {"format": FORMAT, "format_version": FORMAT_VERSION,
                      "layers": self.layers, "tensors": self.tensors}
            for k, v in (metadata or {}).items():
                if k in _RESERVED:
                    raise ValueError(f"metadata key {k!r} is reserved "
                                     f"({', '.join(_RESERVED)}); rename it.")
                record[k] = v
            header = dict(self._header)
            header["__metadata__"] = {_META_KEY: json.dumps(record, allow_nan=False)}
            raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
            raw += b" " * (-len(raw) % 8)
            self._data.flush()
            if self._reserve and 8 + len(raw) <= self._reserve:
                # the header goes into the space kept for it; padding with
                # spaces is valid safetensors (readers strip JSON whitespace)
                raw += b" " * (self._reserve - 8 - len(raw))
                self._data.seek(0)
                self._data.write(struct.pack("<Q", len(raw)))
                self._data.write(raw)
                self._data.flush()
                os.fsync(self._data.fileno())
                self._data.close()
                os.chmod(self._data_path, umask_mode())   # not mkstemp's 0600
                os.replace(self._data_path, self.path)
                self._data_path = None
            else:
                self._data.close()
                with atomic_writer(self.path, "wb") as f:
                    f.write(struct.pack("<Q", len(raw)))
                    f.write(raw)
                    with open(self._data_path, "rb") as src:
                        src.seek(self._reserve)
                        shutil.copyfileobj(src, f, 16 << 20)
        finally:
            try:
                self._data.close()
            except Exception:
                pass
            if self._data_path is not None:
                try:
                    os.unlink(self._data_path)
                except OSError:
                    pass
        return self.path


def save(path, layers: dict, tensors: dict, metadata: dict | None = None) -> str:
    """Write packed layers and plain tensors to one ``.safetensors`` file (atomic).

    Parameters
    ----------
    path : str or PathLike
        Target file; its directory must exist.  Replaced atomically.
    layers : dict of str -> PackedLinear
        Packed linear layers; layer ``N``'s arrays are stored as ``N.<array>``.
    tensors : dict of str -> ndarray
        Plain tensors (embeddings, norms, biases, dense layers), stored as given
        (any dtype in the safetensors set, C-order).
    metadata : dict or None
        Extra JSON-able entries merged into the file's ``opscope_nb`` record
        (the keys ``format``, ``format_version``, ``layers``, ``tensors`` are
        reserved).

    Returns
    -------
    str
        ``path``, so ``load(save(...))`` round-trips.

    Raises
    ------
    ValueError, TypeError
        A name used twice (a layer array colliding with a tensor), a
        non-PackedLinear layer, a non-ndarray tensor, a reserved metadata key.
    """
    if not isinstance(layers, dict) or not isinstance(tensors, dict):
        raise TypeError("layers and tensors must be dicts of name -> PackedLinear / ndarray.")
    for n, lin in layers.items():
        if not isinstance(lin, PackedLinear):
            raise TypeError(f"layers[{n!r}] must be a PackedLinear; got "
                            f"{type(lin).__name__}. Put plain arrays in tensors.")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict or None; got {type(metadata).__name__}.")
        json.dumps(metadata, allow_nan=False)  # JSON-able or raise here, before writing
    w = CheckpointWriter(path)
    try:
        for n, lin in layers.items():
            w.add_layer(str(n), lin)
        for n, a in tensors.items():
            w.add_tensor(str(n), a)
    except BaseException:
        w.abort()
        raise
    return w.finish(metadata)


def read_record(path) -> tuple:
    """``(data_start, header, record)`` of a checkpoint written by :func:`save`.

    Raises
    ------
    opscope_nb.io.SourceError
        Not a (readable) opscope-nb checkpoint.
    CheckpointError
        The record does not follow the schema (one line naming the entry).
    """
    path = os.fspath(path)
    data_start, header = read_safetensors_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            meta = json.loads(f.read(n).decode("utf-8")).get("__metadata__") or {}
        except (ValueError, AttributeError):
            meta = {}
    if not isinstance(meta, dict) or _META_KEY not in meta:
        raise SourceError(f"{path}: not an opscope-nb checkpoint (no '{_META_KEY}' record "
                          f"in the safetensors metadata); write it with 'opscope-nb apply'.")
    try:
        record = json.loads(meta[_META_KEY])
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError
        version = record.get("format_version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError
    except (ValueError, TypeError, RecursionError):
        raise SourceError(f"{path}: the '{_META_KEY}' metadata record is not a valid "
                          f"{FORMAT} record.") from None
    if version > FORMAT_VERSION:
        raise SourceError(f"{path}: format version {version} is newer "
                          f"than this opscope-nb reads ({FORMAT_VERSION}); upgrade.")
    _check_record(path, record)
    return data_start, header, record


def _bad(path, where, what):
    return CheckpointError(f"{path}: metadata record: {where} {what}; the file is not a "
                           f"valid {FORMAT} checkpoint (re-create it with apply).")


def _check_array_info(path, where, info):
    if not isinstance(info, dict):
        raise _bad(path, where, "must be an object with dtype, shape and sha256")
    if not isinstance(info.get("dtype"), str):
        raise _bad(path, where, f"has no dtype string (got {info.get('dtype')!r})")
    shp = info.get("shape")
    if not isinstance(shp, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shp):
        raise _bad(path, where, f"shape must be a list of non-negative ints (got {shp!r})")
    if "sha256" in info and not isinstance(info["sha256"], str):
        raise _bad(path, where, "sha256 must be a hex string")
    if "stored_as" in info:
        ls = info.get("logical_shape")
        if not isinstance(info["stored_as"], str) or not isinstance(ls, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ls):
            raise _bad(path, where, "stored_as needs a type name and a logical_shape list")


def _check_record(path, record):
    """Schema of the ``opscope_nb`` record (:func:`load` relies on it)."""
    layers = record.get("layers", {})
    tensors = record.get("tensors", {})
    if not isinstance(layers, dict):
        raise _bad(path, "'layers'", "must be an object")
    if not isinstance(tensors, dict):
        raise _bad(path, "'tensors'", "must be an object")
    for ln, li in layers.items():
        where = f"layer {ln!r}"
        if not isinstance(li, dict):
            raise _bad(path, where, "must be an object with decomp, shape and arrays")
        if not isinstance(li.get("decomp"), dict):
            raise _bad(path, where, "has no decomp object")
        shp = li.get("shape")
        if not (isinstance(shp, list) and len(shp) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shp)):
            raise _bad(path, where, f"shape must be [rows, cols] (got {shp!r})")
        arrays = li.get("arrays")
        if not isinstance(arrays, dict):
            raise _bad(path, where, "has no arrays object")
        for an, info in arrays.items():
            _check_array_info(path, f"array {an!r} of {where}", info)
    for tn, info in tensors.items():
        _check_array_info(path, f"tensor {tn!r}", info)


def _decode_stored(path, name, a, want):
    """The array a reader gets for a tensor copied as stored: ``BF16`` words as
    float32 (exact), GGUF blocks dequantised to float32 of the logical shape."""
    if want is None:
        return a
    if want.get("dtype") == "bf16":
        from opscope_nb.io import bf16_to_float32
        return bf16_to_float32(a)
    qt = want.get("stored_as")
    if qt is None:
        return a
    shape = tuple(int(s) for s in want.get("logical_shape", ()))
    from opscope_nb.formats import ggml
    try:
        if qt in ggml.GGML_TYPES and len(shape) == 2:
            return ggml.dequantize(a.reshape(shape[0], -1), qt, shape)
        import gguf
        return np.asarray(gguf.quants.dequantize(a.reshape(-1), gguf.GGMLQuantizationType[qt]),
                          np.float32).reshape(shape)
    except (ImportError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} is stored as {qt}, which cannot be "
                              f"decoded here ({exc}).") from None


def _read(path, data_start, name, info, want, verify) -> np.ndarray:
    st = info["dtype"]
    dt = "uint16" if st == "BF16" else _ST2NP.get(st)
    if dt is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {st}, which opscope-nb does "
                         f"not read.")
    if want is not None:
        if want.get("dtype") not in (dt, "bf16" if st == "BF16" else None) or \
                [int(s) for s in want.get("shape", [])] != \
                [int(s) for s in info["shape"]]:
            raise CheckpointError(f"{path}: tensor {name!r} is {dt} {info['shape']} but the "
                             f"metadata records {want.get('dtype')} {want.get('shape')}; "
                             f"the file is inconsistent, re-create it with apply.")
    begin, end = info["data_offsets"]
    dtype = np.dtype(dt).newbyteorder("<")
    count = (end - begin) // dtype.itemsize
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        a = np.fromfile(f, dtype=dtype, count=count)
    a = a.astype(np.dtype(dt), copy=False).reshape(info["shape"])
    if verify and want is not None and "sha256" in want and _sha(a) != want["sha256"]:
        raise CheckpointError(f"{path}: tensor {name!r}: its bytes do not match the SHA-256 in "
                         f"the metadata (corrupt or modified file).")
    return _decode_stored(path, name, a, want)


def load(path, *, verify: bool = True) -> tuple:
    """Read a checkpoint written by :func:`save` / ``opscope-nb apply``.

    Parameters
    ----------
    path : str or PathLike
    verify : bool
        Check every array's SHA-256 against the metadata (default True).

    Returns
    -------
    tensors : dict of str -> PackedLinear or ndarray
        Packed layers as ``PackedLinear`` under the layer name, plain tensors as
        ndarrays (C-contiguous, writeable, the stored dtype) under theirs.
    metadata : dict
        The file's ``opscope_nb`` record (``format``, ``format_version``,
        ``layers``, ``tensors`` and whatever the writer added, e.g. ``source``,
        ``source_sha256``, ``plan``).

    Raises
    ------
    ValueError
        An array whose dtype/shape/bytes disagree with the metadata, a packed
        array missing, a tensor the metadata does not list, or arrays a
        ``PackedLinear`` rejects; the message names the tensor.
    opscope_nb.io.SourceError
        Not a (readable) opscope-nb checkpoint.
    """
    path = os.fspath(path)
    data_start, header, record = read_record(path)
    layers = record.get("layers", {})
    plain = record.get("tensors", {})
    owned = {}
    for ln, li in layers.items():
        for an in (li.get("arrays") or {}):
            owned[f"{ln}.{an}"] = (ln, an)
    for name in header:
        if name not in owned and name not in plain:
            raise CheckpointError(f"{path}: tensor {name!r} is in the file but not in the "
                             f"metadata record; the file is inconsistent.")
    out = {}
    for ln, li in layers.items():
        arrays = {}
        for an, want in li["arrays"].items():
            tn = f"{ln}.{an}"
            if tn not in header:
                raise CheckpointError(f"{path}: packed array {tn!r} of layer {ln!r} is missing "
                                 f"from the file.")
            arrays[an] = _read(path, data_start, tn, header[tn], want, verify)
        try:
            d = Decomp.from_dict(li["decomp"])
            out[ln] = PackedLinear(d, arrays, tuple(li["shape"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{path}: layer {ln!r}: {exc}") from None
    for tn, want in plain.items():
        if tn not in header:
            raise CheckpointError(f"{path}: tensor {tn!r} listed in the metadata is missing "
                             f"from the file.")
        out[tn] = _read(path, data_start, tn, header[tn], want, verify)
    return out, record


