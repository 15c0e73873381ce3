"""Tensor sources: checkpoints read lazily, one weight matrix at a time.

A *source* lists its tensors (name, shape, dtype) from the file headers alone;
each :class:`TensorEntry` loads its data only when :meth:`TensorEntry.load` is
called, through a memory map that is released as soon as the ``float32`` copy
exists.  So profiling holds one tensor in memory at a time and a checkpoint
larger than RAM still profiles.

Supported sources (see :func:`open_source`):

* a ``.safetensors`` file, parsed here (8-byte little-endian header length,
  JSON header with ``dtype`` / ``shape`` / ``data_offsets``, raw data) so
  ``F32``, ``F16``, ``BF16`` and ``F64`` load without torch; bfloat16 is the high
  half of a float32, so its raw ``uint16`` words are shifted into place.
* a directory of ``*.safetensors`` shards (a Hugging Face
  ``model.safetensors.index.json`` ``weight_map`` is honoured when present) or
  of upstream ``*.tensor`` dumps (``u32 LE rows, u32 LE cols, f32 LE`` data);
* a ``.gguf`` file through the optional ``gguf`` package; quantised tensors
  are dequantised to float32 and GGUF's reversed dimension order is undone, so
  a weight comes out as ``[out, in]`` like a PyTorch ``Linear`` weight;
* ``None``: the built-in synthetic model of the upstream ``opscope-layers``.

Every loaded weight is ``float32``, C-contiguous, ``[rows, cols]`` =
``[out_features, in_features]`` as stored by the checkpoint.  Problems with a
file raise :class:`SourceError` (a ``ValueError``) naming the file, the rule
and the fix.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from opscope_nb.formats import ggml
from ._gguf_header import GGUFFile

__all__ = [
    "SourceError",
    "UnsupportedDtypeError",
    "MissingDependencyError",
    "TensorEntry",
    "TensorSource",
    "open_source",
    "gguf_reader",
    "gguf_dequantize",
    "select",
    "is_embedding",
    "synthetic_model",
    "SYNTHETIC_LAYERS",
    "read_safetensors_header",
    "read_tensor_header",
    "read_tensor_file",
    "natural_key",
    "bf16_to_float32",
]

#: Largest safetensors JSON header accepted (the format itself caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024

#: safetensors dtype -> (numpy dtype of the stored words, bytes per element).
#: ``BF16`` is read as raw little-endian ``uint16`` and widened by a shift.
_ST_FLOAT = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "F64": (np.dtype("<f8"), 8),
}
#: Sizes of the other safetensors dtypes, only to validate ``data_offsets``.
_ST_OTHER_SIZES = {"I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2, "I32": 4,
                   "U32": 4, "I64": 8, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


class SourceError(ValueError):
    """A checkpoint cannot be read: missing, truncated, corrupt or unsupported."""


class UnsupportedDtypeError(SourceError):
    """A selected tensor has a dtype that cannot be turned into float32 weights."""


class MissingDependencyError(SourceError):
    """An optional package (``gguf``) needed for this source is not installed."""


def natural_key(name: str):
    """Sort key comparing digit runs as numbers (``layer.2`` before ``layer.10``)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t)
            for t in re.split(r"(\d+)", name) if t]


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 words (``uint16``) to float32 (exact: bf16 is f32's top half).

    Parameters
    ----------
    raw : ndarray of uint16
        The bfloat16 bit patterns, any shape.

    Returns
    -------
    ndarray of float32, same shape, C-contiguous.
    """
    # one pass into a plain array (the temporaries of ``astype(...) << 16`` on a
    # memmap'd source cost 50x more: 2.4 s against 0.04 s for 45 M weights)
    raw = np.asarray(raw)
    out = np.empty(raw.shape, dtype=np.uint32)
    np.left_shift(raw, np.uint32(16), out=out, dtype=np.uint32)
    return out.view(np.float32)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a source, described by its header; data loads on demand.

    Attributes
    ----------
    name : str
        Checkpoint key, e.g. ``model.layers.0.self_attn.q_proj.weight``.
    shape : tuple of int
        Logical shape; for a 2-D weight ``(rows, cols)`` = ``(out, in)``.
    dtype : str
        Storage dtype as the format names it (``F32``, ``BF16``, ``Q8_0`` ...).
    path : str
        File the data lives in (``"synthetic"`` for the built-in model).
    """

    name: str
    shape: tuple
    dtype: str
    path: str
    _loader: Callable[[], np.ndarray] = field(repr=False, compare=False)
    _raw: Callable[[], np.ndarray] | None = field(default=None, repr=False, compare=False)

    def raw(self) -> np.ndarray:
        """The tensor's bytes exactly as the source stores them: a 1-D uint8
        array (a read-only map of the file where there is one).  For the
        synthetic model, the float32 bytes of :meth:`load`."""
        if self._raw is None:
            return self.load().reshape(-1).view(np.uint8)
        return self._raw()

    def sha256(self) -> str:
        """SHA-256 of :meth:`raw` -- the stored bytes, streamed in 16 MiB pieces
        (one tensor's fingerprint; the file's other tensors are not read)."""
        import hashlib
        h = hashlib.sha256()
        a = self.raw()
        step = 16 << 20
        for o in range(0, a.size, step):
            h.update(a[o:o + step])
        del a
        return h.hexdigest()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    def load(self) -> np.ndarray:
        """Read the tensor as a C-contiguous float32 array of shape :attr:`shape`.

        Raises
        ------
        UnsupportedDtypeError
            The stored dtype is not a float format (e.g. ``I64``).
        SourceError
            The file changed or is unreadable.
        """
        arr = np.ascontiguousarray(self._loader(), dtype=np.float32)
        if not arr.flags.writeable:
            # never hand out a view of a read-only map: numba would compile a
            # separate read-only specialisation of every kernel for it
            arr = arr.copy()
        return arr.reshape(self.shape)


@dataclass
class TensorSource:
    """A checkpoint's tensor list (headers only) plus how to describe it.

    Attributes
    ----------
    kind : str
        ``safetensors``, ``safetensors-dir``, ``tensor-dir``, ``gguf`` or ``synthetic``.
    path : str
        The path given (``"synthetic"`` for the built-in model).
    entries : list of TensorEntry
        Every tensor, in natural name order.
    filter_embeddings : bool
        Whether :func:`select` drops embeddings / ``lm_head`` unless asked; False
        for the synthetic model, whose ``lm_head`` is one of its seven layers.
    """

    kind: str
    path: str
    entries: list
    filter_embeddings: bool = True


def _short(value, limit=120) -> str:
    """``repr(value)`` cut to ``limit`` characters (messages stay one short line)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _one_line(exc) -> str:
    return _short(str(exc).replace("\n", " "), 200)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _header_entry(path, name, info):
    """``(dtype, shape, (begin, end))`` of one safetensors header entry, or a
    one-line :class:`SourceError` naming the entry and the rule it breaks."""
    def bad(rule):
        return SourceError(
            f"{path}: malformed header entry for tensor {_short(name)}: {rule}; got "
            f"{_short(info)}. Entries must be {{\"dtype\": str, \"shape\": [int >= 0, "
            f"...], \"data_offsets\": [begin, end]}}; the file is corrupt.")
    if not isinstance(info, dict):
        raise bad("not a JSON object")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("dtype must be a string")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape must be a list of integers >= 0")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(v) for v in offs):
        raise bad("data_offsets must be a list of two integers")
    return dtype, list(shape), (offs[0], offs[1])


# --------------------------------------------------------------------------- #
# safetensors
# --------------------------------------------------------------------------- #
def read_safetensors_header(path: str) -> tuple[int, dict]:
    """Parse and validate a ``.safetensors`` header.

    Parameters
    ----------
    path : str
        File path.

    Returns
    -------
    data_start : int
        Byte offset of the data section (``8 + header length``).
    tensors : dict
        ``name -> {"dtype": str, "shape": [int], "data_offsets": [begin, end]}``
        (``__metadata__`` removed), in file order.

    Raises
    ------
    SourceError
        Truncated file, header that is not a JSON object, malformed entries, or
        ``data_offsets`` beyond the end of the file / inconsistent with the shape.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(f"{path}: truncated safetensors file ({size} bytes; "
                                  f"a header needs at least 8). Re-download or re-save it.")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SourceError(
                    f"{path}: truncated or corrupt safetensors file (header length "
                    f"{n} bytes, file {size} bytes). Re-download or re-save it.")
            raw = f.read(n)
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc.strerror or exc}).") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"{path}: safetensors header is not valid JSON ({_one_line(exc)}). "
                          f"The file is corrupt or not a safetensors file.") from None
    except RecursionError:
        raise SourceError(f"{path}: safetensors header nests JSON too deeply to be a "
                          f"safetensors header. The file is corrupt or hostile.") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path}: safetensors header must be a JSON object; got "
                          f"{type(header).__name__}.")
    data_start = 8 + n
    data_len = size - data_start
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = _header_entry(path, name, info)
        if not 0 <= begin <= end:
            raise SourceError(f"{path}: tensor {_short(name)} has bad data_offsets "
                              f"[{begin}, {end}].")
        if end > data_len:
            raise SourceError(
                f"{path}: truncated file: tensor {_short(name)} ends at byte {end} of the "
                f"data section but only {data_len} bytes are present. Re-download it.")
        item = _ST_FLOAT.get(dtype, (None, _ST_OTHER_SIZES.get(dtype)))[1]
        if item is not None:
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * item:
                raise SourceError(
                    f"{path}: tensor {_short(name)} ({dtype}, shape {shape}) needs "
                    f"{numel * item} bytes but data_offsets span {end - begin}.")
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    return data_start, out


def _safetensors_loader(path: str, name: str, dtype: str, shape: Sequence[int],
                        offset: int, nbytes: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if dtype not in _ST_FLOAT:
            raise UnsupportedDtypeError(
                f"{path}: tensor {name!r} has dtype {dtype}; only F32, F16, BF16 and "
                f"F64 weights can be profiled. Exclude it with --exclude.")
        np_dtype, item = _ST_FLOAT[dtype]
        count = nbytes // item
        if count == 0:
            return np.zeros(tuple(shape), np.float32)
        try:
            # A map per tensor, dropped right after the copy: RSS holds one tensor.
            mm = np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=(count,))
        except (OSError, ValueError) as exc:
            raise SourceError(f"{path}: cannot map tensor {name!r} ({exc}).") from None
        try:
            if dtype == "BF16":
                out = bf16_to_float32(mm)
            else:
                out = np.array(mm, dtype=np.float32)
        finally:
            del mm
        return out.reshape(tuple(shape))
    return load


def _byte_range(path: str, offset: int, nbytes: int) -> Callable[[], np.ndarray]:
    """``raw()`` of a tensor stored as ``nbytes`` bytes at ``offset`` of ``path``."""
    def raw() -> np.ndarray:
        if nbytes == 0:
            return np.zeros(0, np.uint8)
        try:
            return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
        except (OSError, ValueError) as exc:
            raise SourceError(f"{path}: cannot map {nbytes} bytes at {offset} "
                              f"({exc}).") from None
    return raw


def _safetensors_entries(path: str, names: Iterable[str] | None = None) -> list:
    data_start, header = read_safetensors_header(path)
    if names is not None:
        missing = [n for n in names if n not in header]
        if missing:
            raise SourceError(f"{path}: the shard index lists {missing[0]!r} but the "
                              f"shard does not contain it.")
        header = {n: header[n] for n in names}
    entries = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        entries.append(TensorEntry(
            name, tuple(info["shape"]), info["dtype"], path,
            _safetensors_loader(path, name, info["dtype"], info["shape"],
                                data_start + begin, end - begin),
            _byte_range(path, data_start + begin, end - begin)))
    return entries


# --------------------------------------------------------------------------- #
# upstream .tensor dumps
# --------------------------------------------------------------------------- #
def read_tensor_header(path) -> tuple:
    """``(rows, cols)`` of an upstream ``.tensor`` dump, checked against its size.

    The one ``.tensor`` parser of the package (:func:`read_tensor_file`,
    the ``.tensor`` sources and :func:`opscope_nb.profile.probe.load_tensor` use it).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    rows, cols : int

    Raises
    ------
    SourceError
        Unreadable file, shorter than the 8-byte header (``u32 LE rows, u32 LE
        cols``), or not exactly ``8 + 4 * rows * cols`` bytes (the message gives
        both sizes).
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc.strerror or exc}).") from None
    if len(head) < 8:
        raise SourceError(f"{path}: truncated .tensor file ({size} bytes; the header "
                          f"(u32 LE rows, u32 LE cols) alone is 8). Re-dump it.")
    rows, cols = struct.unpack("<II", head)
    need = 8 + 4 * rows * cols
    if size != need:
        what = "truncated" if size < need else "oversized (longer than its header says)"
        raise SourceError(f"{path}: {what} .tensor file: header says {rows}x{cols} "
                          f"float32 ({need} bytes) but the file has {size} bytes.")
    return rows, cols


def _read_tensor_data(path: str, rows: int, cols: int) -> np.ndarray:
    if rows * cols == 0:
        return np.zeros((rows, cols), np.float32)
    try:
        mm = np.memmap(path, dtype="<f4", mode="r", offset=8, shape=(rows, cols))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path}: cannot map the .tensor data ({exc}).") from None
    try:
        return np.array(mm, dtype=np.float32)
    finally:
        del mm


def read_tensor_file(path) -> np.ndarray:
    """Read an upstream ``.tensor`` dump (``u32 LE rows, u32 LE cols``, then
    ``rows * cols`` float32 LE, row-major).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    ndarray of shape (rows, cols), float32, C-contiguous, writable

    Raises
    ------
    SourceError
        As :func:`read_tensor_header` (a ``ValueError``).
    """
    path = os.fspath(path)
    rows, cols = read_tensor_header(path)
    return _read_tensor_data(path, rows, cols)


def _tensor_file_entry(path: str) -> TensorEntry:
    rows, cols = read_tensor_header(path)
    name = os.path.basename(path)[: -len(".tensor")]
    return TensorEntry(name, (rows, cols), "F32", path,
                       lambda: _read_tensor_data(path, rows, cols),
                       _byte_range(path, 8, 4 * rows * cols))


# --------------------------------------------------------------------------- #
# GGUF
# --------------------------------------------------------------------------- #
def _import_gguf():
    try:
        import gguf  # noqa: F401
        import gguf.quants  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "reading .gguf files needs the optional 'gguf' package: "
            "pip install 'opscope-nb[gguf]' (or pip install gguf).") from None
    return gguf


#: Parsed GGUF readers of this process, newest last (see :func:`gguf_reader`).
_READERS: dict = {}
_READERS_KEEP = 4


def gguf_reader(path):
    """The parsed header of the GGUF file ``path`` over a read-only map
    (:class:`opscope_nb.io._gguf_header.GGUFFile`: ``gguf.GGUFReader``'s ``fields``,
    ``tensors`` and ``endianess``), parsed once per file version in this process.

    ``gguf.GGUFReader`` took 2--4 s per parse of SmolLM2's 49 k-token
    vocabulary (Zen 4), :class:`~opscope_nb.io._gguf_header.GGUFFile` 0.07 s; an
    ``apply`` then ``eval`` in one process opened the file seven times
    (tensor list, detection, metadata, tokenizer).  A file is
    known by its device, inode, size and modification time (not its name: an
    export's read-back of its temporary file serves the renamed result), so a
    rewritten file is parsed again; the last :data:`_READERS_KEEP` stay open.
    Errors are the parser's own ``ValueError`` / ``OSError`` (callers word them)."""
    path = os.path.abspath(os.fspath(path))
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    reader = _READERS.pop(key, None)
    if reader is None:
        _import_gguf()                   # its type tables; the one-line error if missing
        reader = GGUFFile(path)
    _READERS[key] = reader
    while len(_READERS) > _READERS_KEEP:
        _READERS.pop(next(iter(_READERS)))
    return reader


def _gguf_entries(path: str) -> list:
    _import_gguf()                       # the one-line error when gguf is missing
    try:
        reader = gguf_reader(path)
        tensors = list(reader.tensors)
    except Exception as exc:  # the parser raises ValueError (OSError) on bad files
        raise SourceError(f"{path}: not a readable GGUF file ({type(exc).__name__}: "
                          f"{_one_line(exc)}). Re-download it.") from None
    entries = []
    for t in tensors:
        # GGUF lists dims innermost first (ne[0] = in_features); PyTorch order is reversed.
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        qtype = t.tensor_type
        entries.append(TensorEntry(t.name, shape, qtype.name, path,
                                   _gguf_loader(path, t.name, t.data, qtype, shape),
                                   _gguf_raw(t.data)))
    return entries


def _gguf_raw(data):
    """``raw()`` of a GGUF tensor: the reader's map of its data, as bytes."""
    def raw() -> np.ndarray:
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return raw


#: ggml block types :func:`opscope_nb.formats.ggml.dequantize` decodes (the float types
#: stay NumPy conversions).
_GGML_DECODED = frozenset(ggml.GGML_TYPES) - {"F16", "BF16"}


def _gguf_loader(path, name, data, qtype, shape):
    def load() -> np.ndarray:
        tname = qtype.name
        if tname == "F64":
            return np.array(data, dtype=np.float32, copy=True).reshape(shape)
        if tname.startswith(("I", "U")) and tname[1:].isdigit():
            raise UnsupportedDtypeError(
                f"{path}: tensor {name!r} has integer type {tname}; only float and "
                f"quantised float weights can be profiled. Exclude it with --exclude.")
        try:
            return gguf_dequantize(data, qtype, shape)
        except NotImplementedError:
            raise UnsupportedDtypeError(
                f"{path}: tensor {name!r} has type {tname}, which this gguf package "
                f"cannot dequantise. Upgrade gguf or exclude it with --exclude.") from None
    return load


def gguf_dequantize(data, qtype, shape) -> np.ndarray:
    """A GGUF tensor's stored data as a new float32 array of ``shape``.

    Parameters
    ----------
    data : ndarray
        The tensor's data as :func:`gguf_reader` maps it (uint8 bytes in
        gguf's byte shape for block types, elements for float types).
    qtype : gguf.GGMLQuantizationType
    shape : tuple of int
        PyTorch order (``shape[-1]`` = GGUF's ``ne[0]``).

    Returns
    -------
    ndarray of float32, writable, of ``shape``.  The block types of
    :mod:`opscope_nb.formats.ggml` decode with its numba decoders (bit for bit
    ``gguf.quants.dequantize``, tests/test_ggml.py; Q4_1 1.1 against 7.2 ns a
    weight on SmolLM2, Zen 4: minutes on a 70 B checkpoint), every other type
    with gguf-py.

    Raises
    ------
    NotImplementedError
        gguf-py cannot decode ``qtype``.
    """
    shape = tuple(int(s) for s in shape)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if qtype.name in _GGML_DECODED and shape and rows >= 1:
        return ggml.dequantize(np.asarray(data).reshape(-1), qtype.name,
                               (rows, shape[-1])).reshape(shape)
    out = _import_gguf().quants.dequantize(data, qtype)
    # F32 "dequantisation" is a view of the reader's read-only map: copy it
    return np.array(out, dtype=np.float32, copy=True).reshape(shape)


# --------------------------------------------------------------------------- #
# synthetic model
# --------------------------------------------------------------------------- #
#: The upstream ``opscope-layers`` synthetic model: (name, Dist name, rows, cols, seed).
SYNTHETIC_LAYERS = (
    ("model.layers.0.self_attn.q_proj.weight", "LOWRANK", 256, 256, 1),
    ("model.layers.0.self_attn.k_proj.weight", "LOWRANK", 256, 128, 2),
    ("model.layers.0.self_attn.o_proj.weight", "GAUSSIAN", 256, 256, 3),
    ("model.layers.0.mlp.gate_proj.weight", "QUANTIZED", 256, 512, 4),
    ("model.layers.0.mlp.up_proj.weight", "GAUSSIAN", 256, 512, 5),
    ("model.layers.0.mlp.down_proj.weight", "LOWRANK", 512, 256, 6),
    ("lm_head.weight", "OUTLIER", 256, 400, 7),
)


def synthetic_model() -> TensorSource:
    """The upstream's seven synthetic layers (``opscope-layers`` with no directory).

    Each weight is ``opscope_nb.io.synth.sample(Dist.<kind>, rows, cols, seed)``,
    generated when loaded.  ``lm_head`` is part of this model, so
    :attr:`TensorSource.filter_embeddings` is False.
    """
    def loader(dist_name, rows, cols, seed):
        def load():
            from . import synth
            return np.asarray(synth.sample(getattr(synth.Dist, dist_name), rows, cols,
                                           seed=seed), dtype=np.float32).reshape(rows, cols)
        return load
    entries = [TensorEntry(n, (r, c), "F32", "synthetic", loader(d, r, c, s))
               for n, d, r, c, s in SYNTHETIC_LAYERS]
    return TensorSource("synthetic", "synthetic", entries, filter_embeddings=False)


# --------------------------------------------------------------------------- #
# opening and selecting
# --------------------------------------------------------------------------- #
def _sorted(entries: list) -> list:
    return sorted(entries, key=lambda e: natural_key(e.name))


def _read_shard_index(index: str, root: str) -> dict:
    """``shard file -> [tensor names]`` from a ``model.safetensors.index.json``.

    The index is untrusted: every shard must be a relative path without
    ``..`` that resolves (symlinks included) inside ``root``; anything else
    raises a one-line :class:`SourceError` naming the entry.
    """
    bad_index = (f"{index}: not a valid shard index (needs a JSON object with a "
                 f"'weight_map' of tensor name -> shard file name).")
    try:
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise SourceError(f"{index}: cannot read ({exc.strerror or exc}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise SourceError(bad_index) from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict):
        raise SourceError(bad_index)
    real_root = os.path.realpath(root)
    by_shard: dict = {}
    for name, shard in wmap.items():
        _check_shard_name(index, real_root, name, shard)
        by_shard.setdefault(shard, []).append(name)
    return by_shard


def _check_shard_name(index, real_root, name, shard) -> None:
    def bad(rule):
        return SourceError(f"{index}: weight_map entry {_short(name)} -> {_short(shard)}: "
                           f"{rule}. Each shard must be a file inside the model directory "
                           f"(a relative path without '..'); fix or regenerate the index.")
    if not isinstance(shard, str) or not shard:
        raise bad("the shard must be a non-empty string")
    if "\x00" in shard:
        raise bad("the shard name contains a NUL byte")
    parts = re.split(r"[/\\]", shard)
    if os.path.isabs(shard) or shard[:1] in ("/", "\\") or os.path.splitdrive(shard)[0]:
        raise bad("absolute paths are not allowed")
    if ".." in parts:
        raise bad("'..' is not allowed")
    real = os.path.realpath(os.path.join(real_root, shard))
    if os.path.commonpath([real_root, real]) != real_root:
        raise bad(f"it resolves to {real}, outside {real_root} (a symlink?)")


def _open_dir(path: str) -> TensorSource:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        by_shard = _read_shard_index(index, path)
        entries = []
        for shard in sorted(by_shard, key=natural_key):
            spath = os.path.join(path, shard)
            if not os.path.isfile(spath):
                raise SourceError(f"{index}: shard {_short(shard)} is listed but "
                                  f"{spath} does not exist.")
            entries += _safetensors_entries(spath, by_shard[shard])
        return TensorSource("safetensors-dir", path, _sorted(entries))
    try:
        files = sorted(os.listdir(path), key=natural_key)
    except OSError as exc:
        raise SourceError(f"{path}: cannot list directory ({exc.strerror or exc}).") from None
    shards = [f for f in files if f.endswith(".safetensors")]
    if shards:
        entries = []
        seen = {}
        for s in shards:
            for e in _safetensors_entries(os.path.join(path, s)):
                if e.name in seen:
                    raise SourceError(f"{path}: tensor {e.name!r} appears in both "
                                      f"{seen[e.name]} and {s}.")
                seen[e.name] = s
                entries.append(e)
        return TensorSource("safetensors-dir", path, _sorted(entries))
    dumps = [f for f in files if f.endswith(".tensor")]
    if dumps:
        return TensorSource("tensor-dir", path,
                            _sorted([_tensor_file_entry(os.path.join(path, f))
                                     for f in dumps]))
    raise SourceError(f"{path}: directory holds no *.safetensors or *.tensor files.")


def open_source(path: str | os.PathLike | None) -> TensorSource:
    """Open a checkpoint (headers only) or, for ``None``, the synthetic model.

    Parameters
    ----------
    path : str, PathLike or None
        A ``.safetensors`` file, a ``.gguf`` file, a ``.tensor`` file, a
        directory of ``*.safetensors`` shards or ``*.tensor`` dumps, or None.

    Returns
    -------
    TensorSource
        Entries in natural name order (digit runs compared as numbers).

    Raises
    ------
    SourceError
        Missing path, unknown file type, unreadable/truncated/corrupt file.
    MissingDependencyError
        A ``.gguf`` file without the ``gguf`` package installed.
    """
    if path is None:
        return synthetic_model()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise SourceError(f"{path}: no such file or directory.")
    if os.path.isdir(path):
        return _open_dir(path)
    low = path.lower()
    if low.endswith(".safetensors"):
        return TensorSource("safetensors", path, _sorted(_safetensors_entries(path)))
    if low.endswith(".gguf"):
        return TensorSource("gguf", path, _sorted(_gguf_entries(path)))
    if low.endswith(".tensor"):
        return TensorSource("tensor", path, [_tensor_file_entry(path)])
    raise SourceError(f"{path}: unknown checkpoint type; expected a .safetensors, "
                      f".gguf or .tensor file, or a directory of them.")


_EMBED_PARTS = ("wte", "wpe", "lm_head", "token_embd")


def is_embedding(name: str) -> bool:
    """Whether ``name`` is an embedding table or an output head (``lm_head``).

    Matches a dotted component containing ``embed`` (``embed_tokens``,
    ``word_embeddings``), or equal to ``wte``, ``wpe``, ``lm_head`` or
    ``token_embd``, and GGUF's top-level ``output.weight``.
    """
    if name == "output.weight":
        return True
    for part in name.lower().split("."):
        if "embed" in part or part in _EMBED_PARTS:
            return True
    return False


def _compile(pattern, what):
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{what} {pattern!r} is not a valid regular expression "
                         f"({exc}).") from None


def select(source: TensorSource, *, include=None, exclude=None,
           include_embeddings: bool = False) -> tuple[list, list]:
    """Pick the weights to profile.

    Rules, in order: not 2-D -> skipped (1-D never profiles); rows < 2 or
    cols < 2 -> skipped; an embedding / ``lm_head`` (:func:`is_embedding`) ->
    skipped unless ``include_embeddings`` or the source is the synthetic model;
    ``include`` given and ``re.search`` finds no match -> skipped; ``exclude``
    matches -> skipped.

    Parameters
    ----------
    source : TensorSource
    include, exclude : str or re.Pattern, optional
        Regular expressions searched in the tensor name.
    include_embeddings : bool
        Keep embedding tables and output heads.

    Returns
    -------
    chosen : list of TensorEntry
    skipped : list of (TensorEntry, reason str)

    Raises
    ------
    ValueError
        A pattern is not a valid regular expression.
    """
    inc = _compile(include, "--include")
    exc = _compile(exclude, "--exclude")
    chosen, skipped = [], []
    for e in source.entries:
        if e.ndim != 2:
            skipped.append((e, f"{e.ndim}-D"))
        elif e.shape[0] < 2 or e.shape[1] < 2:
            skipped.append((e, "rows or cols < 2"))
        elif (source.filter_embeddings and not include_embeddings
              and is_embedding(e.name)):
            skipped.append((e, "embedding (use --include-embeddings)"))
        elif inc is not None and not inc.search(e.name):
            skipped.append((e, "not matched by --include"))
        elif exc is not None and exc.search(e.name):
            skipped.append((e, "matched by --exclude"))
        else:
            chosen.append(e)
    return chosen, skipped
