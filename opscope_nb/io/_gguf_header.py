"""A fast read-only parse of a GGUF file's header: key/values and tensor table.

``gguf.GGUFReader`` builds a NumPy view per array element of every
key/value; SmolLM2's 49 k-token vocabulary, its merges and token types cost
about 2--4 s per parse (Zen 4), a Llama-3 vocabulary (128 k tokens, 280 k
merges) several times that, on every open of a model.  :class:`GGUFFile` reads the same
header with ``struct`` and ``np.frombuffer`` in a fraction of that time and
offers the reader's names: ``fields`` (name -> field with ``contents()``,
``types``, ``name``, ``offset``), ``tensors`` (``name``, ``tensor_type``,
``shape``, ``n_elements``, ``n_bytes``, ``data_offset``, ``data``: a view of
the read-only map, in the reader's shape and dtype), ``endianess``,
``alignment`` and ``data_offset``.  Each field also keeps its record's bytes
as stored (``raw``).  The types, sizes and byte shapes come from the
``gguf`` package (``gguf.constants``, ``gguf.quants``), which still writes
and dequantises.

GGUF versions 2 and 3, little- or big-endian, as ``GGUFReader`` accepts.
Malformed input raises ``ValueError`` (callers word it): a bad magic or
version, a record or tensor running past the end of the file, an unknown
value or tensor type, a duplicate key or tensor name, a bad alignment.
"""
from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GGUFFile", "GGUFField", "GGUFTensor"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType): scalar ones as (struct code, numpy dtype)
_STRING, _ARRAY = 8, 9
_SCALARS = {0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
            4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
            10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64)}

# tensor types stored as elements (the others as bytes in gguf's byte shape)
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                   "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFField(NamedTuple):
    """One key/value: ``types`` is ``[type]`` or ``[ARRAY, item type]`` (nested
    arrays: one ``ARRAY`` per level, typed by the first item), ``value`` the
    Python value (a list for arrays; nested lists for nested arrays, which
    ``GGUFReader`` flattens), ``raw`` the record's bytes as stored (key length
    to value end)."""
    offset: int
    name: str
    types: list
    value: Any
    raw: bytes

    def contents(self):
        """The value as ``GGUFReader``'s field gives it (a fresh list for arrays)."""
        return list(self.value) if isinstance(self.value, list) else self.value


class GGUFTensor(NamedTuple):
    """One tensor of the table; ``shape`` in GGUF order (``ne[0]`` first), ``data`` a
    read-only view of its bytes in ``GGUFReader``'s shape and dtype."""
    name: str
    tensor_type: Any
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The parsed header of the GGUF file at ``path`` over a read-only map.

    Parameters
    ----------
    path : str or os.PathLike

    Raises
    ------
    ValueError
        A malformed or truncated file (the message says where).
    OSError
        The file cannot be opened or mapped.
    ImportError
        The ``gguf`` package is missing (its type tables are used).
    """

    def __init__(self, path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, \
            GGUFValueType
        from gguf.quants import quant_shape_to_byte_shape

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        size = len(buf)
        if size < 24 or bytes(buf[:4]) != _MAGIC:
            raise ValueError("GGUF magic invalid (not a GGUF file, or truncated)")
        version = struct.unpack_from("<I", buf, 4)[0]
        e = "<"
        if version & 0xFFFF == 0:          # written on a big-endian host
            e, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self.endianess = GGUFEndian.BIG if e == ">" else GGUFEndian.LITTLE
        vtype = GGUFValueType
        u32, u64 = struct.Struct(e + "I"), struct.Struct(e + "Q")

        def need(offs, n, what):
            if n < 0 or offs + n > size:
                raise ValueError(f"{what} at byte {offs} runs past the end of the file "
                                 f"({size} bytes): truncated")

        def string(offs, what):
            need(offs, 8, what)
            n = u64.unpack_from(buf, offs)[0]
            need(offs + 8, n, what)
            return str(buf[offs + 8:offs + 8 + n], "utf-8"), offs + 8 + n

        def value(offs, t, what):
            """(python value, type list, end offset) of one value of type ``t``."""
            if t == _STRING:
                s, offs = string(offs, what)
                return s, [vtype.STRING], offs
            if t in _SCALARS:
                code, _ = _SCALARS[t]
                n = struct.calcsize(code)
                need(offs, n, what)
                v = struct.unpack_from(e + code, buf, offs)[0]
                return v, [vtype(t)], offs + n
            if t == _ARRAY:
                need(offs, 12, what)
                it, count = u32.unpack_from(buf, offs)[0], u64.unpack_from(buf, offs + 4)[0]
                offs += 12
                if it in _SCALARS:
                    dt = np.dtype(_SCALARS[it][1]).newbyteorder(e)
                    need(offs, count * dt.itemsize, what)
                    v = np.frombuffer(buf, dt, count, offs).tolist()
                    return v, [vtype.ARRAY, vtype(it)], offs + count * dt.itemsize
                if it == _STRING:
                    v = []
                    for _ in range(count):
                        s, offs = string(offs, what)
                        v.append(s)
                    return v, [vtype.ARRAY, vtype.STRING], offs
                if it == _ARRAY:
                    v, sub = [], [vtype.ARRAY]
                    for i in range(count):
                        x, types, offs = value(offs, it, what)
                        v.append(x)
                        if i == 0:
                            sub = types
                    return v, [vtype.ARRAY] + sub, offs
                raise ValueError(f"{what}: unknown array item type {it}")
            raise ValueError(f"{what}: unknown value type {t}")

        need(8, 16, "the tensor and key/value counts")
        n_tensors, n_kv = u64.unpack_from(buf, 8)[0], u64.unpack_from(buf, 16)[0]
        self.fields = {}
        for name, t, v in (("GGUF.version", 4, version), ("GGUF.tensor_count", 10, n_tensors),
                           ("GGUF.kv_count", 10, n_kv)):
            self.fields[name] = GGUFField(0, name, [vtype(t)], v, b"")
        offs = 24
        for i in range(n_kv):
            start = offs
            key, offs = string(offs, f"key/value {i}")
            need(offs, 4, f"key/value {key!r}")
            t = u32.unpack_from(buf, offs)[0]
            v, types, offs = value(offs + 4, t, f"key/value {key!r}")
            if key in self.fields:
                raise ValueError(f"duplicate key {key!r} at byte {start}")
            self.fields[key] = GGUFField(start, key, types, v, bytes(buf[start:offs]))
        align = self.fields.get("general.alignment")
        self.alignment = _DEFAULT_ALIGNMENT
        if align is not None:
            a = align.value
            if align.types != [vtype.UINT32] or a == 0 or a & (a - 1):
                raise ValueError(f"invalid alignment {a!r}: must be a non-zero power of two "
                                 f"(uint32)")
            self.alignment = a
        infos = []
        for i in range(n_tensors):
            name, offs = string(offs, f"tensor info {i}")
            need(offs, 4, f"tensor {name!r}")
            nd = u32.unpack_from(buf, offs)[0]
            need(offs + 4, 8 * nd + 12, f"tensor {name!r}")
            dims = np.frombuffer(buf, np.dtype(np.uint64).newbyteorder(e), nd, offs + 4).copy()
            offs += 4 + 8 * nd
            raw_type, rel = u32.unpack_from(buf, offs)[0], u64.unpack_from(buf, offs + 4)[0]
            offs += 12
            infos.append((name, dims, raw_type, rel))
        pad = offs % self.alignment
        self.data_offset = offs + (self.alignment - pad if pad else 0)
        self.tensors = []
        seen = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r}")
            seen.add(name)
            try:
                qt = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r}: unknown tensor type {raw_type}") from None
            n = math.prod(int(d) for d in dims)      # Python ints: no overflow
            block, type_size = GGML_QUANT_SIZES[qt]
            if n % block:
                raise ValueError(f"tensor {name!r}: {n} elements are not whole {qt.name} "
                                 f"blocks of {block}")
            n_bytes = n * type_size // block
            start = self.data_offset + rel
            need(start, n_bytes, f"tensor {name!r}'s data")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            dt = _ELEMENT_DTYPES.get(qt.name)
            if dt is None:
                dt, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, qt)
            dt = np.dtype(dt).newbyteorder(e)
            arr = self.data[start:start + n_bytes].view(dt).reshape(np_dims)
            self.tensors.append(GGUFTensor(name, qt, dims, n, n_bytes, start, arr))
