"""``--tensor-type-file`` of ``allocate`` and ``apply``: the plan's ggml types as
llama-quantize patterns plus the command (:mod:`opscope_nb.io.gguf_export`)."""
from __future__ import annotations

import json
import os

from ._common import CliError

_FLOAT = ("F32", "F16", "BF16", "F64", "float32", "float16", "bfloat16")


def add_tensor_type_arg(p) -> None:
    p.add_argument("--tensor-type-file", metavar="OUT.txt", default=None,
                   help="write the plan's ggml types as llama-quantize --tensor-type-file "
                        "patterns (one anchored GGUF name per planned tensor) and the "
                        "llama-quantize command to OUT.txt.cmd (plans of --menu ggml only)")


def profile_doc_near(plan_path):
    """The profile.json next to a plan.json, or ``{}``."""
    p = os.path.join(os.path.dirname(os.path.abspath(plan_path)), "profile.json")
    try:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def imatrix_of(doc):
    """The imatrix file a profile was made with (``settings.calib.imatrix``), or None."""
    im = ((doc.get("settings") or {}).get("calib") or {}).get("imatrix") or {}
    return im.get("file")


def write_type_file(path, plan, doc, source=None) -> None:
    """Write ``path`` and ``path.cmd`` for ``plan`` ({name: Decomp}); ``doc`` is the
    profile the plan came from (source, imatrix, stored dtypes)."""
    from opscope_nb.io.gguf_export import GGUFExportError, write_tensor_type_file
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise CliError(f"{path}: directory {d} does not exist; create it first.")
    src = doc.get("source") or {}
    if source is None and src.get("kind") == "gguf":
        source = src.get("path")
    if source is not None and not str(source).lower().endswith(".gguf"):
        source = None
    requant = any(str(r.get("dtype")) not in _FLOAT for r in doc.get("layers", [])
                  if isinstance(r, dict) and r.get("name") in plan)
    stored = {r["name"]: str(r.get("dtype")) for r in doc.get("layers", [])
              if isinstance(r, dict) and r.get("name") in plan}
    calib = ((doc.get("settings") or {}).get("calib") or {})
    note = None
    if calib and not imatrix_of(doc):
        note = ("the plan's errors were measured with calibration grams (calib.npz), "
                "which llama-quantize cannot read: add --imatrix of the same text for "
                "matching importance weights")
    try:
        _, cmd, cmd_path = write_tensor_type_file(path, plan, source=source,
                                                  imatrix=imatrix_of(doc),
                                                  requantize=requant, note=note,
                                                  stored=stored)
    except GGUFExportError as exc:
        raise CliError(f"--tensor-type-file: {exc}") from None
    except OSError as exc:
        raise CliError(f"{path}: cannot write ({exc.strerror or exc}).") from None
    print(f"wrote {path} ({len(plan)} patterns) and {cmd_path}:")
    print(f"  {cmd}")
