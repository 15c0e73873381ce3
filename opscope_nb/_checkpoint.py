"""Compressed checkpoints: packed layers + plain tensors in one ``.safetensors`` file.

File layout (a standard safetensors file, readable by any safetensors reader):

* each packed layer ``N`` (a :class:`~opscope_nb.runtime.PackedLinear`) stores
  its arrays as tensors ``N.<array>`` (e.g. ``encoder.layer.0.attention.self.
  query.weight.codes`` int8 ``[rows, cols]`` and ``....scales`` float32
  ``[rows]``), with the dtypes and shapes of ``mining``'s layout table;
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
temporary data file, then the header and the data are copied into a
temporary file in the target directory, which is renamed over the target
(``os.replace``).  :func:`apply_plan` re-reads source tensors one at a time,
so a checkpoint larger than RAM can be compressed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile

import numpy as np

__all__ = ["save", "load", "apply_plan", "read_plan", "FORMAT", "FORMAT_VERSION",
           "CheckpointWriter", "CheckpointError", "PlanError"]

FORMAT = "opscope-nb-packed"
FORMAT_VERSION = 1
_META_KEY = "opscope_nb"
_RESERVED = ("format", "format_version", "layers", "tensors")

_NP2ST = {"float32": "F32", "float16": "F16", "float64": "F64", "int8": "I8",
          "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32",
          "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL"}
_ST2NP = {v: k for k, v in _NP2ST.items()}


class CheckpointError(ValueError):
    """A checkpoint's arrays disagree with its metadata (the message names the tensor)."""


class PlanError(ValueError):
    """A plan.json is missing, malformed, or made for another model."""


def _bytes(a: np.ndarray) -> np.ndarray:
    """The C-order bytes of ``a`` as a 1-D uint8 view (any shape, 0-d and empty too)."""
    return np.ascontiguousarray(a.reshape(-1)).view(np.uint8)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(_bytes(a)).hexdigest()


def _umask_mode() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return 0o666 & ~old


class CheckpointWriter:
    """Append arrays one at a time, then :meth:`finish` writes the file atomically.

    Parameters
    ----------
    path : str
        Target ``.safetensors`` path (its directory must exist).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        d = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(d):
            raise ValueError(f"output directory {d} does not exist; create it first.")
        self._dir = d
        fd, self._data_path = tempfile.mkstemp(
            dir=d, prefix="." + os.path.basename(self.path) + ".", suffix=".data.tmp")
        self._data = os.fdopen(fd, "wb")
        self._header = {}
        self._offset = 0
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
        return {"dtype": a.dtype.name, "shape": [int(s) for s in a.shape], "sha256": _sha(a)}

    def add_layer(self, name: str, lin) -> None:
        """Store a ``PackedLinear``'s arrays as ``name.<array>`` and record its Decomp."""
        arrays = {}
        for an, a in lin.arrays.items():
            arrays[an] = self._add(f"{name}.{an}", a)
        self.layers[name] = {"decomp": lin.decomp.to_dict(),
                             "shape": [int(lin.shape[0]), int(lin.shape[1])],
                             "arrays": arrays}

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
            self._data.close()
            fd, tmp = tempfile.mkstemp(dir=self._dir,
                                       prefix="." + os.path.basename(self.path) + ".",
                                       suffix=".tmp")
            try:
                os.chmod(tmp, _umask_mode())
                with os.fdopen(fd, "wb") as f:
                    f.write(struct.pack("<Q", len(raw)))
                    f.write(raw)
                    with open(self._data_path, "rb") as src:
                        shutil.copyfileobj(src, f, 16 << 20)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        finally:
            try:
                self._data.close()
            except Exception:
                pass
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
    from .runtime import PackedLinear
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
    """``(data_start, header, record)`` of a checkpoint written by :func:`save`."""
    from .io import read_safetensors_header, SourceError
    path = os.fspath(path)
    data_start, header = read_safetensors_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n).decode("utf-8")).get("__metadata__") or {}
    if _META_KEY not in meta:
        raise SourceError(f"{path}: not an opscope-nb checkpoint (no '{_META_KEY}' record "
                          f"in the safetensors metadata); write it with 'opscope-nb apply'.")
    try:
        record = json.loads(meta[_META_KEY])
        if record.get("format") != FORMAT:
            raise ValueError
    except (ValueError, AttributeError, TypeError):
        raise SourceError(f"{path}: the '{_META_KEY}' metadata record is not a valid "
                          f"{FORMAT} record.") from None
    if int(record.get("format_version", 0)) > FORMAT_VERSION:
        raise SourceError(f"{path}: format version {record.get('format_version')} is newer "
                          f"than this opscope-nb reads ({FORMAT_VERSION}); upgrade.")
    return data_start, header, record


def _read(path, data_start, name, info, want, verify) -> np.ndarray:
    st = info["dtype"]
    dt = _ST2NP.get(st)
    if dt is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {st}, which opscope-nb does "
                         f"not read.")
    if want is not None:
        if want.get("dtype") != dt or [int(s) for s in want.get("shape", [])] != \
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
    return a


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
    from .runtime import PackedLinear
    from .mining import Decomp
    path = os.fspath(path)
    data_start, header, record = read_record(path)
    layers = record.get("layers") or {}
    plain = record.get("tensors") or {}
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


# --------------------------------------------------------------------------- #
# apply a plan
# --------------------------------------------------------------------------- #
def read_plan(plan_path, method=None) -> tuple:
    """``(method, {layer name: Decomp}, plan doc)`` from a ``plan.json``.

    ``method`` None picks ``exact`` when present, else the first method.  Decomp
    parameters come from the ``profile.json`` next to the plan when it lists the
    same layer and option (keeps low-rank provenance: SVD rank and seed), else
    from the option's label.

    Raises
    ------
    ValueError
        Missing/unreadable plan, unknown method, malformed layer entries.
    """
    from .mining import Decomp
    plan_path = os.fspath(plan_path)
    if not os.path.isfile(plan_path):
        raise PlanError(f"{plan_path}: no such plan file; write one with "
                         f"'opscope-nb profile SOURCE --out DIR' (DIR/plan.json).")
    try:
        with open(plan_path, encoding="utf-8") as f:
            doc = json.load(f)
        methods = doc["methods"]
        if not isinstance(methods, dict) or not methods:
            raise KeyError
    except OSError as exc:
        raise PlanError(f"{plan_path}: cannot read ({exc.strerror or exc}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise PlanError(f"{plan_path}: not an opscope-nb plan.json (needs a 'methods' "
                         f"object from 'profile --out' or 'allocate --out').") from None
    if method is None:
        method = "exact" if "exact" in methods else next(iter(methods))
    if method not in methods:
        raise PlanError(f"{plan_path}: method {method!r} not in the plan; it has "
                         f"{sorted(methods)}.")
    prof_opts = {}
    prof_path = os.path.join(os.path.dirname(os.path.abspath(plan_path)), "profile.json")
    if os.path.isfile(prof_path):
        try:
            with open(prof_path, encoding="utf-8") as f:
                pdoc = json.load(f)
            for ent in pdoc.get("layers", []):
                p = ent.get("profile", ent)
                prof_opts[p["name"]] = [o["decomp"] for o in p["options"]]
        except Exception:  # a stray/old profile.json only loses provenance
            prof_opts = {}
    out = {}
    for ent in methods[method].get("layers", []):
        try:
            name, label = str(ent["name"]), str(ent["label"])
            d = Decomp.from_label(label)
            opts = prof_opts.get(name)
            oi = ent.get("option")
            if opts is not None and oi is not None and 0 <= int(oi) < len(opts):
                dd = Decomp.from_dict(opts[int(oi)])
                if dd == d:
                    d = dd
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{plan_path}: bad layer entry {ent!r} in method "
                             f"{method!r} ({exc}).") from None
        out[name] = (d, ent.get("bytes"))
    if not out:
        raise PlanError(f"{plan_path}: method {method!r} lists no layers.")
    return method, out, doc


def apply_plan(source, plan_path, out_path, *, method=None, make_progress=None,
               grams=None) -> dict:
    """Compress ``source`` as ``plan.json`` says and write the checkpoint to ``out_path``.

    Parameters
    ----------
    source : str
        The checkpoint the plan was made from (any :func:`opscope_nb.io.open_source` input).
    plan_path : str
        ``plan.json`` from ``profile --out`` / ``allocate --out``.
    out_path : str
        Target ``.safetensors`` (atomic replace).
    method : str or None
        Allocator whose plan to use (default ``exact`` when present, else the first).
    make_progress : callable or None
        ``make_progress(n_tensors, total_elements)`` -> a bar with ``show(i, name)``
        / ``advance(work)`` / ``close()`` (the CLI's stderr bar).
    grams : dict of str -> ndarray, optional
        Calibration grams by tensor name (:func:`opscope_nb.calib.load_grams`),
        needed by planned ``+gptq`` layers.

    Returns
    -------
    dict
        ``method``, ``layers`` (packed count), ``dense_layers`` (planned dense),
        ``tensors`` (written plain), ``skipped`` (non-float tensors not copied),
        ``source_bytes`` (float32), ``out_bytes`` (arrays written), ``path``.

    Raises
    ------
    ValueError
        Bad plan; a planned layer missing from the source or of another shape
        (the plan was made for another model).
    """
    from . import io as tio
    from .runtime import PackedLinear
    from .mining import packed_bytes
    method, plan, doc = read_plan(plan_path, method)
    src = tio.open_source(source)
    by_name = {e.name: e for e in src.entries}
    for name, (d, nbytes) in plan.items():
        e = by_name.get(name)
        if e is None:
            raise PlanError(f"{plan_path}: planned layer {name!r} is not in {src.path}; "
                             f"the plan was made for another model.")
        if e.ndim != 2:
            raise PlanError(f"{plan_path}: planned layer {name!r} has shape {e.shape} in "
                             f"{src.path}, not a 2-D weight; the plan is for another model.")
        if nbytes is not None and packed_bytes(e.shape[0], e.shape[1], d) != int(nbytes):
            raise PlanError(f"{plan_path}: planned layer {name!r} ({d.label}, {nbytes} "
                             f"bytes) does not match its shape {e.shape} in {src.path}; the "
                             f"plan was made for another model.")
    w = CheckpointWriter(out_path)
    sha = {}
    skipped, dense_layers = [], 0
    total = float(sum(e.numel for e in src.entries)) or 1.0
    progress = None if make_progress is None else make_progress(len(src.entries), total)
    try:
        for i, e in enumerate(src.entries):
            if progress is not None:
                progress.show(i, e.name)
            try:
                a = e.load()
            except tio.UnsupportedDtypeError:
                skipped.append(e.name)
                continue
            sha[e.name] = _sha(a)
            ent = plan.get(e.name)
            if ent is not None and ent[0].kind != "dense":
                g = None if grams is None or ent[0].rounding is None else grams.get(e.name)
                w.add_layer(e.name, PackedLinear.pack(a, ent[0], gram=g))
            else:
                dense_layers += ent is not None
                w.add_tensor(e.name, a)
            del a
            if progress is not None:
                progress.advance(e.numel)
        meta = {"source": {"file": os.path.basename(os.fspath(source)),
                           "kind": src.kind, "n_tensors": len(src.entries)},
                "source_sha256": sha,
                "plan": {"file": os.path.basename(os.fspath(plan_path)), "method": method,
                         "budget": doc.get("budget")}}
        n_layers, n_tensors = len(w.layers), len(w.tensors)
        out_bytes = w._offset
        w.finish(meta)
    except BaseException:
        w.abort()
        raise
    finally:
        if progress is not None:
            progress.close()
    return {"method": method, "layers": n_layers, "dense_layers": dense_layers,
            "tensors": n_tensors, "skipped": skipped, "source_bytes": int(total) * 4,
            "out_bytes": int(out_bytes), "path": os.fspath(out_path)}
