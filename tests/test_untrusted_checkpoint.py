"""Review findings of issue 23: a compressed checkpoint is untrusted input (a
malformed metadata record is a one-line CheckpointError, never an
AttributeError / KeyError traceback), and ``apply`` reads calibration grams
only for a plan with ``+gptq`` layers."""
from __future__ import annotations

import contextlib
import io
import json
import struct

import numpy as np
import pytest

from opscope_nb import runtime
from opscope_nb.runtime.checkpoint import CheckpointError, load
from opscope_nb.formats import Decomp
from opscope_nb.io import SourceError
from opscope_nb.runtime import PackedLinear


def _rewrite_record(src, dst, edit):
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
        data = f.read()
    rec = json.loads(head["__metadata__"]["opscope_nb"])
    rec = edit(rec)
    head["__metadata__"]["opscope_nb"] = json.dumps(rec)
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _edits():
    def layers_list(r):
        r["layers"] = list(r["layers"]); return r
    def no_arrays(r):
        del r["layers"]["l.weight"]["arrays"]; return r
    def arrays_entry_str(r):
        r["layers"]["l.weight"]["arrays"]["codes"] = "x"; return r
    def shape_strings(r):
        r["layers"]["l.weight"]["shape"] = ["8", "12"]; return r
    def decomp_missing(r):
        del r["layers"]["l.weight"]["decomp"]; return r
    def tensor_shape_float(r):
        r["tensors"]["norm"]["shape"] = [12.0]; return r
    def tensors_null(r):
        r["tensors"] = None; return r
    def layer_is_int(r):
        r["layers"]["l.weight"] = 3; return r
    return [layers_list, no_arrays, arrays_entry_str, shape_strings, decomp_missing,
            tensor_shape_float, tensors_null, layer_is_int]


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_malformed_record_is_one_line_checkpoint_error(tmp_path, edit):
    w = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    p = runtime.save(str(tmp_path / "c.safetensors"),
                     {"l.weight": PackedLinear.pack(w, Decomp.int8())},
                     {"norm": np.ones(12, np.float32)})
    bad = tmp_path / "bad.safetensors"
    _rewrite_record(p, bad, edit)
    with pytest.raises((CheckpointError, SourceError)) as ei:
        load(str(bad))
    assert "\n" not in str(ei.value) and "bad.safetensors" in str(ei.value)


def test_apply_without_gptq_layers_never_reads_grams(tmp_path):
    """A plan without +gptq layers applies even when the calib.npz next to it
    is unreadable (it used to be loaded, all of it, for every plan)."""
    from opscope_nb.cli import main
    from test_io import write_st
    rng = np.random.default_rng(1)
    p = tmp_path / "m.safetensors"
    write_st(p, {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((24, 32)).astype(np.float32)})
    d = tmp_path / "o"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["profile", str(p), "--rank-cap", "4", "--method", "greedy",
                     "--out", str(d), "-q"]) == 0
        (d / "calib.npz").write_bytes(b"not a zip file")
        rc = main(["apply", str(p), str(d / "plan.json"), "-o", str(tmp_path / "c.safetensors"),
                   "-q"])
    assert rc == 0, err.getvalue()
