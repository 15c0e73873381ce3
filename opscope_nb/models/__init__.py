"""Model forward passes for ``opscope-nb eval``: BERT-style encoders and
the Llama family of decoders (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3;
GGUF and Hugging Face safetensors) in numpy, every linear layer a
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
