"""This package's forward with llama.cpp's activations.

llama.cpp's CPU matmul converts each input row to the weight type's
activation type before its block dot products (Q8_0 / Q8_1 / Q8_K blocks, F16
rounding: :func:`opscope_nb.formats.ggml.runtime_activations`).
:func:`llamacpp_activations` makes a loaded model's linear layers read their
inputs that way, so its logits carry the error llama.cpp adds on top of the
weights' own (``eval --act-quant ggml``; ``refine --act-quant``).

Layer: models (imports formats and io).
"""
from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["RunAs", "run_type", "stored_types", "wrap_linears", "llamacpp_activations"]


class RunAs:
    """A linear layer that reads its input as llama.cpp's CPU matmul does for
    weights of the ggml type ``qtype``: ``lin(runtime_activations(x, qtype))``.

    Parameters
    ----------
    lin : callable
        ``lin(x, act=...) -> y``, e.g. a ``PackedLinear``.
    qtype : str
        A key of :data:`opscope_nb.formats.ggml.ACTIVATION_TYPES`.
    """

    __slots__ = ("lin", "qtype")

    def __init__(self, lin, qtype):
        self.lin, self.qtype = lin, str(qtype)

    @property
    def shape(self):
        return self.lin.shape

    def __call__(self, x, act="auto"):
        from opscope_nb.formats.ggml import runtime_activations
        return self.lin(runtime_activations(np.ascontiguousarray(x, np.float32), self.qtype),
                        act=act)


def run_type(dtype) -> str:
    """The ggml type a stored tensor of ``dtype`` (a GGUF type name such as
    ``"Q4_K"``, or a safetensors / numpy dtype name) runs at in llama.cpp;
    ``"F32"`` (no conversion) for anything else."""
    from opscope_nb.formats.ggml import ACTIVATION_TYPES
    d = str(dtype).upper()
    d = {"FLOAT16": "F16", "FLOAT32": "F32", "BFLOAT16": "BF16"}.get(d, d)
    return d if d in ACTIVATION_TYPES else "F32"


def stored_types(path) -> dict:
    """name -> :func:`run_type` of every tensor the checkpoint ``path`` stores
    (its header only); ``{}`` when it cannot be read."""
    if not path:
        return {}
    from opscope_nb import io as tio
    try:
        return {e.name: run_type(e.dtype) for e in tio.open_source(path).entries}
    except (OSError, ValueError):
        return {}


def wrap_linears(model, types) -> dict:
    """Wrap ``model``'s linear layers in place in :class:`RunAs` at their
    ``types`` (name -> ggml type; missing or ``"F32"``: left as they are), and
    a tied head at the token embedding's type.  Returns the replaced
    tensors (name -> original); the caller puts them back."""
    from .loader import is_linear
    from .llama import head_linear
    saved = {}
    for n, t in list(model.tensors.items()):
        q = types.get(n)
        if q not in (None, "F32") and is_linear(t):
            saved[n] = t
            model.tensors[n] = RunAs(t, q)
    cfg = model.config
    emb = cfg.get("names", {}).get("embed")
    if model.family == "decoder" and cfg.get("tied") and types.get(emb) not in (None, "F32"):
        model.extras["head"] = RunAs(head_linear(model), types[emb])
    return saved


@contextlib.contextmanager
def llamacpp_activations(model, types):
    """Within the block, ``model``'s linear layers (and a tied head) read their
    inputs as llama.cpp does for their ggml types; put back on exit.

    Parameters
    ----------
    model : opscope_nb.models.Model
        A loaded model; its ``tensors`` are swapped in place.
    types : mapping of str -> str
        Tensor name -> ggml type it runs at (:func:`stored_types`); a layer
        missing here or at ``"F32"`` reads float32.  For a tied head the token
        embedding's type applies.
    """
    had_head = "head" in model.extras
    old_head = model.extras.get("head")
    saved = {}
    try:
        saved = wrap_linears(model, types)
        yield model
    finally:
        model.tensors.update(saved)
        if had_head:
            model.extras["head"] = old_head
        else:
            model.extras.pop("head", None)
