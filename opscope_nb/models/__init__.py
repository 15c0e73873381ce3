"""Model forward passes for ``opscope-nb eval``: BERT-style encoders and
Llama-style decoders in numpy, every linear layer a
:class:`opscope_nb.runtime.PackedLinear`.

* :func:`open_model` (:mod:`.loader`) - recognise the architecture, read the
  config and tokenizer, hold the tensors (dense or from a compressed checkpoint).
* :mod:`.bert` - ``embed(model, texts)`` sentence embeddings.
* :mod:`.llama` - ``forward(model, ids, cache)`` next-token logits with a KV cache.
* :mod:`.evaluate` - ``evaluate(...)`` dense vs compressed metrics.
"""
from .loader import Model, ModelError, UnsupportedModelError, open_model, detect, SUPPORTED

__all__ = ["Model", "ModelError", "UnsupportedModelError", "open_model", "detect",
           "SUPPORTED"]
