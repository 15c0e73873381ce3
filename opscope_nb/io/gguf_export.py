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
from opscope_nb.formats import Decomp, pack, packed_bytes, unpack
from opscope_nb.formats.gptq import option_errors
from . import gguf_dequantize, gguf_reader

__all__ = ["GGUFExportError", "export_gguf", "gguf_name", "ggml_type_name",
           "tensor_type_text", "quantize_command", "write_tensor_type_file",
           "LLAMA_QUANTIZE_FTYPE", "guess_file_type", "TOOL_KEY_PREFIX", "FTYPE_GUESSED"]


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


#: llama.cpp's ``llama_ftype`` a loader guesses from the most common tensor type
#: (``llama_model_loader``: K-quants as their ``_M`` preset); other types -> ALL_F32.
_FTYPE_OF_TYPE = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
    "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19,
    "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ2_S": 28,
    "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37,
}
#: ``LLAMA_FTYPE_GUESSED``: the bit llama.cpp sets on a file type it guessed
#: (``llama_model_ftype_name`` then appends " (guessed)").
FTYPE_GUESSED = 1024
#: The prefix of the key-values the export adds (the plan that made the file).
TOOL_KEY_PREFIX = "opscope."


def guess_file_type(types) -> tuple:
    """llama.cpp's file type of a file whose tensors have these ggml types.

    ``llama_model_loader`` counts the tensors of each type (every tensor, 1-D
    norms included) in name order and takes the first type to reach the
    largest count; K-quants map to their ``_M`` preset (``Q4_K`` ->
    ``MOSTLY_Q4_K_M`` = 15), a type it has no file type for to ``ALL_F32``.

    Parameters
    ----------
    types : dict of str -> (str, int)
        Tensor name -> (ggml type name, number of dimensions).

    Returns
    -------
    (int, str, bool)
        The ``general.file_type`` value, the type it was guessed from, and
        whether the file is mixed (its weights of two or more dimensions hold
        more than one type); for a mixed file the value carries
        :data:`FTYPE_GUESSED`, as llama.cpp marks a file type it guessed.
    """
    counts, best, top = {}, 0, "F32"
    for name in sorted(types, key=lambda n: n.encode()):   # std::map<std::string> order
        t = str(types[name][0]).upper()
        counts[t] = counts.get(t, 0) + 1
        if best < counts[t]:
            best, top = counts[t], t
    mixed = len({str(t).upper() for t, nd in types.values() if nd >= 2}) > 1
    ftype = _FTYPE_OF_TYPE.get(top, 0)
    return (ftype | FTYPE_GUESSED if mixed else ftype), top, mixed


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
                plan_bytes=None, requantize=False, tool_kv=None, measure=()) -> dict:
    """Write ``source`` (a ``.gguf``) with the planned tensors re-quantised to
    ``out_path`` (a ``.gguf``).

    Every key-value of the source is copied in its order, except
    ``general.file_type`` when a tensor changes type: it then follows
    llama.cpp's guess from the written tensor types (:func:`guess_file_type`;
    ``| GUESSED`` for a mixed file).  ``tool_kv`` is appended after them.
    With no tensor re-typed or re-quantised (every planned tensor dense or in
    its stored type) the output is the source byte for byte except the
    ``opscope.`` key-values.

    Parameters
    ----------
    source : str
        The GGUF file the plan was made from (its tensor names).
    plan : dict of str -> Decomp
        Tensor name -> ggml Decomp (written in that type, packed from the
        source tensor dequantised to float32; a tensor already stored in that
        type is copied byte for byte unless ``requantize``) or dense (the
        source tensor kept as stored).  Any other kind -> :class:`GGUFExportError`.
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
    requantize : bool
        Re-quantise a tensor planned in the type it is stored in (from its
        dequantised values, as llama-quantize's ``--allow-requantize``)
        instead of copying its stored blocks.
    tool_kv : dict of str -> str, bool, int or float, optional
        Key-values to record the plan under (every key starts with
        :data:`TOOL_KEY_PREFIX`; a source's own ``opscope.`` keys are
        replaced): strings, booleans, ints (UINT64) and floats (FLOAT64).

    Returns
    -------
    dict
        ``tensors`` (count), ``planned`` (tensors written in a ggml type),
        ``as_stored`` (planned in their stored type, copied), ``planned_dense``
        (planned dense, kept), ``planned_bytes`` (bytes of the re-quantised
        tensors), ``kept_bytes`` (bytes of every other tensor as stored),
        ``plan_tensor_bytes`` (bytes of every planned tensor as written),
        ``plan_weights`` (their weights), ``weights`` (of every tensor),
        ``file_bytes``, ``header_bytes``
        (``file_bytes`` minus tensor bytes: header, key-values, tensor infos,
        alignment padding), ``kv`` (count), ``types`` ({ggml type: tensors}),
        ``file_type`` (the ``general.file_type`` written), ``file_type_kept``
        (the source's, unchanged), ``path``.

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
    tool_kv = dict(tool_kv or {})
    for k, v in tool_kv.items():
        if not (isinstance(k, str) and k.startswith(TOOL_KEY_PREFIX)):
            raise GGUFExportError(f"tool key-value {k!r} must start with "
                                  f"{TOOL_KEY_PREFIX!r} (the source's own keys are copied).")
        if not isinstance(v, (str, bool, int, float)):
            raise GGUFExportError(f"tool key-value {k!r} must be a str, bool, int or "
                                  f"float; got {type(v).__name__}.")
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
        if d.kind == "dense" and want_nb is not None and int(want_nb) == int(t.n_bytes):
            continue                      # dense priced as stored: what is copied
        if want_nb is not None and int(want_nb) != nb:
            raise GGUFExportError(f"planned tensor {name!r} ({d.label}, {want_nb} bytes) "
                                  f"does not match its shape ({rows}, {cols}) in {source}; "
                                  f"the plan was made for another model.")

    # planned in the type it is stored in: copied unless re-quantisation is asked for
    as_stored = {n for n, d in plan.items() if d.kind == "ggml" and d.rounding is None
                 and not requantize
                 and by_name[n].tensor_type.name == d.qtype}
    written = {t.name: ((plan[t.name].qtype if t.name in plan and plan[t.name].kind == "ggml"
                         else t.tensor_type.name), len(t.shape)) for t in tensors}
    retyped = any(written[t.name][0] != t.tensor_type.name for t in tensors)
    ft_field = reader.fields.get("general.file_type")
    if retyped or ft_field is None:
        file_type, _, _ = guess_file_type(written)
        ft_kept = False
    else:
        file_type, ft_kept = int(ft_field.contents()), True

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
            vts = gguf.GGUFValueType
            for f in reader.fields.values():
                if f.name.startswith("GGUF.") or f.name.startswith(TOOL_KEY_PREFIX):
                    continue
                order.append(f.name)
                if f.name == "general.architecture":
                    continue                  # the writer's constructor added it
                if f.name == "general.file_type" and not ft_kept:
                    writer.add_key_value(f.name, file_type, vts.UINT32)
                    continue
                vt = f.types[0]
                sub = f.types[-1] if vt == vts.ARRAY else None
                writer.add_key_value(f.name, f.contents(), vt, sub_type=sub)
            if ft_field is None:
                writer.add_key_value("general.file_type", file_type, vts.UINT32)
                order.append("general.file_type")
            for k, v in tool_kv.items():
                vt = (vts.STRING if isinstance(v, str) else vts.BOOL if isinstance(v, bool)
                      else vts.UINT64 if isinstance(v, int) and v >= 0
                      else vts.INT64 if isinstance(v, int) else vts.FLOAT64)
                writer.add_key_value(k, v, vt)
                order.append(k)
            # the writer puts general.architecture first; keep the source's order
            writer.kv_data[0] = {k: writer.kv_data[0][k] for k in order}
            want = {}
            for t in tensors:
                d = plan.get(t.name)
                if d is not None and d.kind == "ggml" and t.name not in as_stored:
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
            digests, full_errors = {}, {}
            for i, t in enumerate(tensors):
                if progress is not None:
                    progress.show(i, t.name)
                if t.name in want:
                    d = plan[t.name]
                    cols, rows = int(t.shape[0]), int(t.shape[1])
                    w = gguf_dequantize(t.data, t.tensor_type, (rows, cols))
                    g = None if grams is None else grams.get(t.name)
                    blocks, err = _quantize_one(w, d, g, t.name in measure)
                    if err is not None:
                        full_errors[t.name] = err
                    del w
                    digests[t.name] = hashlib.sha256(blocks.data).hexdigest()
                    writer.write_tensor_data(blocks)
                else:
                    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
                if progress is not None:
                    progress.advance(int(t.n_elements))
            writer.close()
            report = _verify(reader, tmp, plan, want, digests, tool_kv,
                             None if ft_kept else file_type)
    finally:
        if progress is not None:
            progress.close()
    report.update(path=out_path, as_stored=len(as_stored), file_type=int(file_type),
                  file_type_kept=ft_kept, full_errors=full_errors)
    return report



def _quantize_one(w, d, gram, measure) -> tuple:
    """``(blocks, full errors or None)`` of the float32 ``w`` as ggml Decomp
    ``d``: the bytes of :func:`opscope_nb.formats.pack` (one finiteness scan
    instead of pack's two) and, when measured without a gram,
    :func:`option_errors`' figures from each row decoded on its own."""
    from opscope_nb.formats import ggml_importance
    from opscope_nb.formats.gptq import check_gram, output_ratio
    if d.lr is not None or d.rounding is not None or ggml.count_nonfinite(w):
        blocks = pack(w, d, gram=gram)["blocks"]       # raises pack's error if not finite
    else:
        imp = None if gram is None else ggml_importance(check_gram(gram, w.shape[1]))
        blocks = ggml.quantize(w, d.qtype, importance=imp, checked_finite=True)
    if not measure:
        return blocks, None
    if gram is not None or d.lr is not None:
        return blocks, option_errors(w, unpack({"blocks": blocks}, d, w.shape), gram)
    return blocks, {"rel_err": output_ratio(*ggml.error_sums(w, blocks, d.qtype)),
                    "out_err": None}


def _verify(src, path, plan, want, digests, tool_kv, file_type) -> dict:
    """Read ``path`` back and compare it with the source and the plan (a parse
    of the written file, kept for a later open of it in this process):
    the source's key-values (``general.file_type`` = ``file_type`` when not
    None), then ``tool_kv``; every tensor as planned or byte for byte."""
    out = gguf_reader(path)
    sk = [f for f in src.fields.values() if not f.name.startswith(("GGUF.", TOOL_KEY_PREFIX))]
    ok = [f for f in out.fields.values() if not f.name.startswith("GGUF.")]
    want_names = [f.name for f in sk]
    if file_type is not None and "general.file_type" not in want_names:
        want_names.append("general.file_type")
    want_names += list(tool_kv)
    if want_names != [f.name for f in ok]:
        raise GGUFExportError(f"{path}: key-values read back as {[f.name for f in ok][:5]}... "
                              f"instead of the source's {want_names[:5]}...")
    got = {f.name: f for f in ok}
    for a in sk:
        b = got[a.name]
        if a.name == "general.file_type" and file_type is not None:
            continue
        if a.raw != b.raw:
            raise GGUFExportError(f"{path}: key-value {a.name!r} differs from the source.")
    if file_type is not None and int(got["general.file_type"].contents()) != int(file_type):
        raise GGUFExportError(f"{path}: general.file_type reads back as "
                              f"{got['general.file_type'].contents()!r}, not {file_type}.")
    for k, v in tool_kv.items():
        r = got[k].contents()
        if (r != v) if not isinstance(v, float) else not (r == v or (r != r and v != v)):
            raise GGUFExportError(f"{path}: key-value {k!r} reads back as {r!r}, not {v!r}.")
    st = list(src.tensors)
    ot = list(out.tensors)
    if [t.name for t in st] != [t.name for t in ot]:
        raise GGUFExportError(f"{path}: tensors read back in another order or number "
                              f"({len(ot)} vs {len(st)} in the source).")
    planned_bytes = kept = plan_bytes = plan_weights = 0
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
        if o.name in plan:
            plan_bytes += int(o.n_bytes)
            plan_weights += int(o.n_elements)
    size = os.path.getsize(path)
    return {"tensors": len(ot), "planned": len(want),
            "planned_dense": sum(d.kind == "dense" for d in plan.values()),
            "planned_bytes": planned_bytes, "kept_bytes": kept, "file_bytes": size,
            "plan_tensor_bytes": plan_bytes, "plan_weights": plan_weights,
            "weights": int(sum(int(o.n_elements) for o in ot)),
            "header_bytes": size - planned_bytes - kept, "kv": len(ok), "types": types}
