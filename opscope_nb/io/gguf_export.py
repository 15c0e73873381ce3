"""GGUF output of a ggml plan: the GGUF writer behind ``apply SOURCE.gguf PLAN
-o OUT.gguf``, and the ``--tensor-type-file`` for ``llama-quantize``.

Layer 3 (imports :mod:`opscope_nb.formats`, :mod:`opscope_nb.formats.ggml`,
:mod:`opscope_nb.io._fs` and the optional ``gguf`` package; :mod:`opscope_nb.plan.apply` calls it).

* :func:`export_gguf` -- every key-value and tensor of a ``.gguf`` source, in
  the source's order; planned tensors in their planned ggml type (bytes of
  :func:`opscope_nb.formats.pack`, i.e. :func:`opscope_nb.formats.ggml.quantize`),
  planned-dense and unplanned tensors copied byte for byte as stored.  Written
  to a temporary file next to the target, read back with ``io.gguf_reader``
  and checked (key-values, every tensor's type, shape and bytes), then
  renamed over the target.
* :func:`tensor_type_text` / :func:`quantize_command` /
  :func:`write_tensor_type_file` -- one escaped, anchored ``PATTERN=type`` per
  planned tensor (GGUF names; Hugging Face Llama / Qwen2 / Mistral names are
  mapped, :func:`gguf_name`) and the ``llama-quantize`` command that uses it.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex

import numpy as np

from opscope_nb.formats import ggml
from ._fs import atomic_path, atomic_write
from opscope_nb.formats import Decomp, pack, packed_bytes
from . import gguf_dequantize, gguf_reader

__all__ = ["GGUFExportError", "export_gguf", "gguf_name", "ggml_type_name",
           "tensor_type_text", "quantize_command", "write_tensor_type_file",
           "LLAMA_QUANTIZE_FTYPE"]


class GGUFExportError(ValueError):
    """A plan that cannot become a GGUF file / tensor-type file, or a written
    file that does not read back as planned."""


# ───────────────────────────── names and type spellings ─────────────────────────────

#: Hugging Face Llama-family per-block module -> GGUF per-block name.
_HF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_HF_GLOBAL = {"model.embed_tokens": "token_embd", "lm_head": "output",
              "model.norm": "output_norm"}
_HF_BLK = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_GGUF_NAME = re.compile(r"^(?:blk\.\d+\.[a-z0-9_]+|[a-z0-9_]+)\.(?:weight|bias)$")

#: llama-quantize's base type argument per ggml type (K-quants as their _M mix).
LLAMA_QUANTIZE_FTYPE = {
    "Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K": "Q5_K_M", "Q5_1": "Q5_1", "Q5_0": "Q5_0",
    "Q4_K": "Q4_K_M", "Q4_1": "Q4_1", "Q4_0": "Q4_0", "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS", "Q3_K": "Q3_K_M", "Q2_K": "Q2_K", "TQ2_0": "TQ2_0",
    "TQ1_0": "TQ1_0",
}


def gguf_name(name: str) -> str:
    """The GGUF (llama.cpp) name of a tensor name.

    GGUF names (``blk.12.ffn_down.weight``, ``token_embd.weight``) are returned
    as they are; Hugging Face Llama / Qwen2 / Mistral names are mapped:
    ``model.layers.N.self_attn.{q,k,v,o}_proj`` -> ``blk.N.attn_{q,k,v,output}``,
    ``model.layers.N.mlp.{gate,up,down}_proj`` -> ``blk.N.ffn_{gate,up,down}``,
    ``input_layernorm`` / ``post_attention_layernorm`` -> ``attn_norm`` /
    ``ffn_norm``, ``model.embed_tokens`` -> ``token_embd``, ``lm_head`` ->
    ``output``, ``model.norm`` -> ``output_norm`` (``.weight`` / ``.bias`` kept).

    Raises
    ------
    GGUFExportError
        A name of another architecture (the message names it).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}.")
    m = _HF_BLK.match(name)
    if m and m[2] in _HF_BLOCK:
        return f"blk.{m[1]}.{_HF_BLOCK[m[2]]}.{m[3]}"
    base, _, suf = name.rpartition(".")
    if base in _HF_GLOBAL and suf in ("weight", "bias"):
        return f"{_HF_GLOBAL[base]}.{suf}"
    if _GGUF_NAME.match(name) and not name.startswith("model."):
        return name
    raise GGUFExportError(
        f"tensor {name!r} has no GGUF name: only GGUF names (blk.N.attn_q.weight, "
        f"token_embd.weight, output.weight) and Hugging Face Llama/Qwen2/Mistral names "
        f"(model.layers.N.self_attn.q_proj.weight, ...) are mapped.")


def ggml_type_name(d) -> str:
    """ggml's own spelling (``ggml_type_name``) of a ggml Decomp's type, ``f32``
    for dense: ``q4_K``, ``q8_0``, ``iq4_xs``, ``bf16`` -- what llama-quantize's
    ``--tensor-type`` expects."""
    if isinstance(d, Decomp):
        if d.kind == "dense":
            return "f32"
        if d.kind != "ggml":
            raise GGUFExportError(f"{d.label} is not a ggml type; only ggml types and "
                                  f"dense have a llama.cpp tensor type.")
        d = d.qtype
    t = ggml.GGML_TYPES[str(d).upper()].name.lower()
    return t[:-2] + "_K" if t.endswith("_k") else t


def _check_ggml_plan(plan, what):
    bad = sorted(n for n, d in plan.items() if d.kind not in ("ggml", "dense"))
    if bad:
        raise GGUFExportError(
            f"{what} needs a plan whose layers are all ggml types or dense (profile with "
            f"--menu ggml); {len(bad)} layer(s) are not, e.g. {bad[0]} = "
            f"{plan[bad[0]].label}.")


# ───────────────────────────── tensor-type file ─────────────────────────────

def tensor_type_text(plan, stored=None) -> str:
    """The ``--tensor-type-file`` of a plan: one ``^escaped\\.name$=type`` line
    per planned tensor, in the plan's order.

    Parameters
    ----------
    plan : dict of str -> Decomp
        Tensor name (GGUF or mapped Hugging Face, :func:`gguf_name`) -> its
        ggml or dense Decomp.
    stored : dict of str -> str, optional
        The source's stored type per tensor name (``F16``, ``Q4_1``, ...): a
        dense tensor keeps it (llama-quantize converts an F16 tensor to F16
        exactly, as ``apply`` copies it); without it, or for a type llama.cpp
        cannot be asked for, dense -> ``f32``.

    Returns
    -------
    str
        Whitespace-separated tokens, no comments (llama-quantize allows none);
        every pattern escaped (``.`` -> ``\\.``) and anchored (``^...$``) so
        ``blk.1.`` never matches ``blk.10.``.
    """
    _check_ggml_plan(plan, "a tensor-type file")
    lines = []
    for name, d in plan.items():
        t = ggml_type_name(d)
        if d.kind == "dense" and stored and str(stored.get(name, "")).upper() in ggml.GGML_TYPES:
            t = ggml_type_name(stored[name])
        lines.append(f"^{re.escape(gguf_name(name))}$={t}")
    return "\n".join(lines) + "\n"


def quantize_command(plan, type_file, *, source=None, output=None, imatrix=None,
                     requantize=False) -> str:
    """The ``llama-quantize`` command line that applies ``plan`` through ``type_file``.

    The base type is the quantised ggml type planned for the most tensors
    (Q8_0 when none is quantised: llama-quantize ignores
    ``--tensor-type`` for an F16/BF16/F32 base), as llama-quantize's preset name
    (``Q4_K`` -> ``Q4_K_M``); it decides only the unplanned tensors.
    ``--output-tensor-type`` / ``--token-embedding-type`` (which win over
    patterns) are added when ``output.weight`` / ``token_embd.weight`` are
    planned, ``--imatrix`` when the plan used one, ``--allow-requantize`` for a
    quantised source.
    """
    _check_ggml_plan(plan, "a llama-quantize command")
    counts = {}
    for d in plan.values():
        if d.kind == "ggml" and d.qtype in LLAMA_QUANTIZE_FTYPE:
            counts[d.qtype] = counts.get(d.qtype, 0) + 1
    base = LLAMA_QUANTIZE_FTYPE[max(counts, key=counts.get)] if counts else "Q8_0"
    args = ["llama-quantize"]
    if requantize:
        args.append("--allow-requantize")
    if imatrix:
        args += ["--imatrix", os.fspath(imatrix)]
    gnames = {gguf_name(n): d for n, d in plan.items()}
    if "output.weight" in gnames:
        args += ["--output-tensor-type", ggml_type_name(gnames["output.weight"])]
    if "token_embd.weight" in gnames:
        args += ["--token-embedding-type", ggml_type_name(gnames["token_embd.weight"])]
    args += ["--tensor-type-file", os.fspath(type_file),
             os.fspath(source) if source else "MODEL-F16.gguf",
             os.fspath(output) if output else "OUT.gguf", base]
    return " ".join(shlex.quote(a) for a in args)


def write_tensor_type_file(path, plan, *, source=None, imatrix=None, requantize=False,
                           note=None, stored=None) -> tuple:
    """Write :func:`tensor_type_text` to ``path`` and the llama-quantize
    command (:func:`quantize_command`) to ``path + ".cmd"``, both atomically.

    ``source``: the ``.gguf`` to quantise (``None``: a placeholder, convert the
    checkpoint with llama.cpp's ``convert_hf_to_gguf.py`` first); the output is
    ``path`` with ``.txt`` replaced by ``.gguf``.  ``note``: an extra comment
    line for the command file.  ``stored``: the source's stored types, for
    dense tensors (:func:`tensor_type_text`).

    Returns
    -------
    (str, str, str)
        The tensor-type text, the command, and the command file's path.
    """
    path = os.fspath(path)
    text = tensor_type_text(plan, stored)
    out = (path[:-4] if path.endswith(".txt") else path) + ".gguf"
    cmd = quantize_command(plan, path, source=source, output=out, imatrix=imatrix,
                           requantize=requantize)
    head = ["#!/bin/sh",
            f"# {len(plan)} planned tensor(s) get their type from {os.path.basename(path)} "
            f"(first matching pattern wins; unplanned tensors follow the base type's "
            f"rules)."]
    if source is None:
        head.append("# MODEL-F16.gguf: convert the checkpoint with llama.cpp's "
                    "convert_hf_to_gguf.py first.")
    if note:
        head.append(f"# {note}")
    cmd_path = path + ".cmd"
    atomic_write(path, text)
    atomic_write(cmd_path, "\n".join(head) + "\n" + cmd + "\n")
    return text, cmd, cmd_path


# ───────────────────────────── GGUF export ─────────────────────────────

def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFExportError("writing .gguf files needs the optional 'gguf' package: "
                              "pip install 'opscope-nb[gguf]' (or pip install gguf).") \
            from None
    return gguf


def export_gguf(source, plan, out_path, *, grams=None, make_progress=None,
                plan_bytes=None) -> dict:
    """Write ``source`` (a ``.gguf``) with the planned tensors re-quantised to
    ``out_path`` (a ``.gguf``).

    Parameters
    ----------
    source : str
        The GGUF file the plan was made from (its tensor names).
    plan : dict of str -> Decomp
        Tensor name -> ggml Decomp (written in that type, packed from the
        source tensor dequantised to float32) or dense (the source tensor kept
        as stored).  Any other kind -> :class:`GGUFExportError`.
    out_path : str
        Target; written to a temporary file next to it, checked, then renamed.
    grams : dict of str -> ndarray, optional
        Calibration grams by tensor name: their diagonal is ggml's importance
        for that tensor (:func:`opscope_nb.formats.ggml_importance`).
    make_progress : callable, optional
        ``make_progress(n_tensors, total_elements)`` -> a bar with
        ``show(i, name)`` / ``advance(work)`` / ``close()``.
    plan_bytes : dict of str -> int, optional
        The bytes the plan recorded per tensor; a tensor whose packed size
        differs -> :class:`GGUFExportError` (the plan is for another model).

    Returns
    -------
    dict
        ``tensors`` (count), ``planned`` (tensors written in a ggml type),
        ``planned_dense`` (planned dense, kept), ``planned_bytes`` (their ggml
        bytes), ``kept_bytes`` (bytes of every other tensor as stored),
        ``file_bytes``, ``header_bytes`` (``file_bytes`` minus tensor bytes:
        header, key-values, tensor infos, alignment padding), ``kv`` (count),
        ``types`` ({ggml type: tensors}), ``path``.

    Raises
    ------
    GGUFExportError
        A non-ggml plan, a source that is not GGUF, a planned tensor missing or
        not 2-D, a block that does not divide its rows, or a read-back that
        differs from the plan (the target is then left untouched).
    """
    gguf = _import_gguf()
    source, out_path = os.fspath(source), os.fspath(out_path)
    _check_ggml_plan(plan, "a GGUF export")
    if not source.lower().endswith(".gguf"):
        raise GGUFExportError(f"{source}: a .gguf output needs a .gguf source (its "
                              f"key-values and unplanned tensors are copied); convert the "
                              f"checkpoint with llama.cpp's convert_hf_to_gguf.py first.")
    try:
        reader = gguf_reader(source)
    except Exception as exc:
        raise GGUFExportError(f"{source}: not a readable GGUF file ({type(exc).__name__}: "
                              f"{exc}).") from None
    tensors = list(reader.tensors)
    by_name = {t.name: t for t in tensors}
    for name, d in plan.items():
        t = by_name.get(name)
        if t is None:
            raise GGUFExportError(f"planned tensor {name!r} is not in {source}; the plan "
                                  f"was made for another model.")
        if len(t.shape) != 2:
            raise GGUFExportError(f"planned tensor {name!r} has shape "
                                  f"{tuple(int(x) for x in t.shape)} in {source}, not 2-D.")
        cols, rows = int(t.shape[0]), int(t.shape[1])
        try:
            nb = packed_bytes(rows, cols, d)
        except ValueError as exc:
            raise GGUFExportError(f"planned tensor {name!r} [{rows}x{cols}]: {exc}") from None
        want_nb = None if plan_bytes is None else plan_bytes.get(name)
        if want_nb is not None and int(want_nb) != nb:
            raise GGUFExportError(f"planned tensor {name!r} ({d.label}, {want_nb} bytes) "
                                  f"does not match its shape ({rows}, {cols}) in {source}; "
                                  f"the plan was made for another model.")

    progress = None
    try:
        with atomic_path(out_path) as tmp:
            arch = reader.fields.get("general.architecture")
            arch = arch.contents() if arch is not None else "llama"
            writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
            align = reader.fields.get("general.alignment")
            if align is not None:
                writer.data_alignment = int(align.contents())
            order = []
            for f in reader.fields.values():
                if f.name.startswith("GGUF."):
                    continue
                order.append(f.name)
                if f.name == "general.architecture":
                    continue                  # the writer's constructor added it
                vt = f.types[0]
                sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(f.name, f.contents(), vt, sub_type=sub)
            # the writer puts general.architecture first; keep the source's order
            writer.kv_data[0] = {k: writer.kv_data[0][k] for k in order}
            want = {}
            for t in tensors:
                d = plan.get(t.name)
                if d is not None and d.kind == "ggml":
                    cols, rows = int(t.shape[0]), int(t.shape[1])
                    nb = rows * ggml.row_bytes(d.qtype, cols)
                    qt = gguf.GGMLQuantizationType[d.qtype]
                    writer.add_tensor_info(t.name, (rows, ggml.row_bytes(d.qtype, cols)),
                                           np.dtype(np.uint8), nb, raw_dtype=qt)
                    want[t.name] = (qt, nb)
                else:
                    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                                           t.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            total = float(sum(int(t.n_elements) for t in tensors)) or 1.0
            progress = None if make_progress is None else make_progress(len(tensors), total)
            digests = {}
            for i, t in enumerate(tensors):
                if progress is not None:
                    progress.show(i, t.name)
                if t.name in want:
                    d = plan[t.name]
                    cols, rows = int(t.shape[0]), int(t.shape[1])
                    w = gguf_dequantize(t.data, t.tensor_type, (rows, cols))
                    g = None if grams is None else grams.get(t.name)
                    blocks = pack(w, d, gram=g)["blocks"]
                    del w
                    digests[t.name] = hashlib.sha256(blocks.data).hexdigest()
                    writer.write_tensor_data(blocks)
                else:
                    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
                if progress is not None:
                    progress.advance(int(t.n_elements))
            writer.close()
            report = _verify(reader, tmp, plan, want, digests)
    finally:
        if progress is not None:
            progress.close()
    report["path"] = out_path
    return report


def _verify(src, path, plan, want, digests) -> dict:
    """Read ``path`` back and compare it with the source and the plan (a parse
    of the written file, kept for a later open of it in this process)."""
    out = gguf_reader(path)
    sk = [f for f in src.fields.values() if not f.name.startswith("GGUF.")]
    ok = [f for f in out.fields.values() if not f.name.startswith("GGUF.")]
    if [f.name for f in sk] != [f.name for f in ok]:
        raise GGUFExportError(f"{path}: key-values read back as {[f.name for f in ok][:5]}... "
                              f"instead of the source's {[f.name for f in sk][:5]}...")
    for a, b in zip(sk, ok):
        if a.raw != b.raw:
            raise GGUFExportError(f"{path}: key-value {a.name!r} differs from the source.")
    st = list(src.tensors)
    ot = list(out.tensors)
    if [t.name for t in st] != [t.name for t in ot]:
        raise GGUFExportError(f"{path}: tensors read back in another order or number "
                              f"({len(ot)} vs {len(st)} in the source).")
    planned_bytes = kept = 0
    types = {}
    for s, o in zip(st, ot):
        shape_s = [int(x) for x in s.shape]
        shape_o = [int(x) for x in o.shape]
        if shape_s != shape_o:
            raise GGUFExportError(f"{path}: tensor {o.name!r} reads back with shape "
                                  f"{shape_o}, the source has {shape_s}.")
        if o.name in want:
            qt, nb = want[o.name]
            got = np.ascontiguousarray(o.data).view(np.uint8)
            if (o.tensor_type != qt or int(o.n_bytes) != nb
                    or hashlib.sha256(got.data).hexdigest() != digests[o.name]):
                raise GGUFExportError(
                    f"{path}: planned tensor {o.name!r} reads back as "
                    f"{o.tensor_type.name}, {int(o.n_bytes)} bytes; the plan says "
                    f"{qt.name}, {nb} bytes of the packed blocks.")
            planned_bytes += nb
        else:
            if (o.tensor_type != s.tensor_type or int(o.n_bytes) != int(s.n_bytes)
                    or not np.array_equal(np.asarray(o.data).view(np.uint8),
                                          np.asarray(s.data).view(np.uint8))):
                raise GGUFExportError(f"{path}: tensor {o.name!r} is not a byte-for-byte "
                                      f"copy of the source's.")
            kept += int(o.n_bytes)
        types[o.tensor_type.name] = types.get(o.tensor_type.name, 0) + 1
    size = os.path.getsize(path)
    return {"tensors": len(ot), "planned": len(want),
            "planned_dense": sum(d.kind == "dense" for d in plan.values()),
            "planned_bytes": planned_bytes, "kept_bytes": kept, "file_bytes": size,
            "header_bytes": size - planned_bytes - kept, "kv": len(ok), "types": types}
