"""llama.cpp as a peer runtime: logits, speed and ``llama_model_quantize``
through the optional ``llama-cpp-python`` package (``pip install -e ".[llama]"``).

Used by ``opscope-nb eval SOURCE.gguf --compressed OUT.gguf --runtime
llama.cpp`` (:func:`opscope_nb.models.evaluate.evaluate`) and
``benchmarks/bench_gguf.py``; nothing else in the package needs it.

* :func:`load` / :func:`logits` / :func:`speed` -- llama.cpp's own forward of
  a GGUF file on token ids this package's tokenizer made (both models of a
  comparison see the same ids).  llama.cpp quantises the activations inside
  its quantised matmuls (Q8_0 / Q8_K blocks), so its logits differ from a
  float forward of the same weights by that much too.
* :func:`quantize` -- ``llama_model_quantize`` with a base type (a preset such
  as ``Q4_K_M``), per-tensor type overrides (the ``--tensor-type`` patterns),
  output / token-embedding types and an importance matrix.

Layer: models (imports :mod:`opscope_nb.formats.ggml` for the type ids).
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from .loader import ModelError

__all__ = ["LlamaCppError", "available", "load", "logits", "speed", "quantize",
           "tokenize", "FTYPES"]

#: llama-quantize's base types (``llama_ftype``) by their command-line names.
FTYPES = {
    "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15,
    "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32,
    "TQ1_0": 36, "TQ2_0": 37,
}


class LlamaCppError(ModelError):
    """llama-cpp-python is missing, or llama.cpp refused a file or a request."""


def available() -> bool:
    """True when ``llama_cpp`` (llama-cpp-python) imports."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:      # ImportError, or a broken shared library (OSError)
        return False
    return True


def _lib():
    try:
        import llama_cpp
    except Exception as exc:
        raise LlamaCppError(
            f"the llama.cpp runtime needs llama-cpp-python ({type(exc).__name__}: {exc}); "
            f"pip install -e \".[llama]\" (it builds llama.cpp from source, about 12 "
            f"minutes on 2 cores the first time).") from None
    return llama_cpp


def load(path, *, n_ctx: int, n_threads=None):
    """A ``llama_cpp.Llama`` over the GGUF file ``path`` that keeps every
    position's logits (``logits_all=True``), ``n_ctx`` positions, CPU only.

    Parameters
    ----------
    path : str
    n_ctx : int
        Longest token sequence one :func:`logits` / :func:`speed` call feeds.
    n_threads : int or None
        Threads for both single-token and batch evaluation (default: all cores).
    """
    lib = _lib()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LlamaCppError(f"{path}: no such file.")
    nt = int(n_threads or os.cpu_count() or 1)
    try:
        return lib.Llama(model_path=path, n_ctx=int(n_ctx), n_batch=int(n_ctx),
                         n_ubatch=int(n_ctx), n_threads=nt, n_threads_batch=nt,
                         logits_all=True, n_gpu_layers=0, verbose=False)
    except Exception as exc:
        raise LlamaCppError(f"{path}: llama.cpp cannot load it ({type(exc).__name__}: "
                            f"{exc}).") from None


def tokenize(path, text) -> list:
    """llama.cpp's own token ids of ``text`` for the GGUF file ``path`` (its
    vocabulary only is loaded), with BOS first when the file's vocabulary adds
    one.  For architectures or vocabularies this package's loader does not
    read: ``eval --runtime llama.cpp`` runs whatever llama.cpp loads.

    Parameters
    ----------
    path : str
    text : str

    Returns
    -------
    list of int
    """
    lib = _lib()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LlamaCppError(f"{path}: no such file.")
    try:
        voc = lib.Llama(model_path=path, vocab_only=True, verbose=False)
    except Exception as exc:
        raise LlamaCppError(f"{path}: llama.cpp cannot load it ({type(exc).__name__}: "
                            f"{exc}).") from None
    try:
        return [int(t) for t in voc.tokenize(str(text).encode("utf-8"), add_bos=True,
                                             special=False)]
    finally:
        voc.close()


def logits(llm, ids) -> np.ndarray:
    """llama.cpp's logits for every position of ``ids`` (a fresh context).

    Parameters
    ----------
    llm : llama_cpp.Llama
        From :func:`load`, with ``n_ctx >= len(ids)``.
    ids : sequence of int
        Token ids, BOS included when the model wants one.

    Returns
    -------
    ndarray of float32, shape (len(ids), n_vocab)
    """
    ids = [int(t) for t in ids]
    if len(ids) > llm.n_ctx():
        raise LlamaCppError(f"{len(ids)} tokens do not fit the context of {llm.n_ctx()}; "
                            f"load with a larger n_ctx.")
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32, copy=True)


def speed(llm, prompt, decode_steps: int) -> tuple:
    """Warm prefill and greedy decode rates: ``(prefill tokens/s, decode tokens/s)``.

    One untimed warm-up pass first; then the prompt in one batch, then
    ``decode_steps`` tokens one at a time (argmax of the last logits).
    """
    prompt = [int(t) for t in prompt]
    if len(prompt) + decode_steps + 2 > llm.n_ctx():
        raise LlamaCppError(f"a {len(prompt)}-token prompt and {decode_steps} decode steps "
                            f"do not fit the context of {llm.n_ctx()}.")
    for _ in range(2):                      # warm-up (allocations, thread pool)
        llm.reset()
        llm.eval(prompt[:8])
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    t_pre = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(int(decode_steps)):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    t_dec = time.perf_counter() - t
    return len(prompt) / max(t_pre, 1e-12), int(decode_steps) / max(t_dec, 1e-12)


def _ggml_type_id(name) -> int:
    from opscope_nb.formats.ggml import GGML_TYPES
    t = GGML_TYPES.get(str(name).upper())
    if t is None:
        if str(name).upper() == "F32":
            return 0
        raise LlamaCppError(f"unknown ggml type {name!r}; one of {['F32', *GGML_TYPES]}.")
    return t.id


def quantize(source, out, ftype: str, *, tensor_types=None, imatrix=None,
             output_tensor_type=None, token_embedding_type=None, nthread=None,
             allow_requantize=False) -> None:
    """Run ``llama_model_quantize(source, out, params)`` -- llama-quantize's
    library entry point.

    Parameters
    ----------
    source, out : str
        Input GGUF (F16/BF16/F32 tensors unless ``allow_requantize``) and output.
    ftype : str
        Base type, a key of :data:`FTYPES` (``"Q4_K_M"``, ``"Q8_0"``, ...).
    tensor_types : sequence of (pattern, ggml type) or None
        ``--tensor-type`` overrides, in order (first match wins); patterns are
        regular expressions searched in the GGUF tensor names.
    imatrix : dict of str -> ndarray or None
        Importance per tensor name: a float32 vector of its input width
        (llama.cpp's ``in_sum2 / counts``).
    output_tensor_type, token_embedding_type : str or None
        ``--output-tensor-type`` / ``--token-embedding-type``.
    nthread : int or None
        Quantisation threads (default: all cores); the bytes do not depend on it.

    Raises
    ------
    LlamaCppError
        Unknown ftype or type name, or llama.cpp returned an error.
    """
    if ftype not in FTYPES:
        raise LlamaCppError(f"unknown llama-quantize type {ftype!r}; one of {list(FTYPES)}.")
    lib = _lib()
    p = lib.llama_model_quantize_default_params()
    p.nthread = int(nthread or os.cpu_count() or 1)
    p.ftype = FTYPES[ftype]
    p.allow_requantize = bool(allow_requantize)
    if output_tensor_type is not None:
        p.output_tensor_type = _ggml_type_id(output_tensor_type)
    if token_embedding_type is not None:
        p.token_embedding_type = _ggml_type_id(token_embedding_type)
    keep = []                      # ctypes buffers must outlive the call
    if tensor_types:
        tt = list(tensor_types)
        arr = (lib.llama_model_tensor_override * (len(tt) + 1))()
        for i, (pat, typ) in enumerate(tt):
            b = str(pat).lower().encode()
            keep.append(b)
            arr[i].pattern = b
            arr[i].type = _ggml_type_id(typ)
        arr[len(tt)].pattern = None
        keep.append(arr)
        p.tt_overrides = ctypes.cast(arr, ctypes.POINTER(lib.llama_model_tensor_override))
    if imatrix:
        items = sorted(imatrix.items())
        arr = (lib.llama_model_imatrix_data * (len(items) + 1))()
        for i, (name, v) in enumerate(items):
            v = np.ascontiguousarray(v, dtype=np.float32)
            b = str(name).encode()
            keep += [b, v]
            arr[i].name = b
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = v.size
        arr[len(items)].name = None
        keep.append(arr)
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(lib.llama_model_imatrix_data))
    rc = lib.llama_model_quantize(os.fspath(source).encode(), os.fspath(out).encode(),
                                  ctypes.byref(p))
    if rc != 0:
        raise LlamaCppError(f"llama_model_quantize({source} -> {out}, {ftype}) returned {rc}.")
