"""Tokenisers for the eval forward passes, built with the ``tokenizers`` package.

* A checkpoint directory with ``tokenizer.json`` -> ``Tokenizer.from_file``.
* A BERT directory with only ``vocab.txt`` -> a WordPiece tokenizer with BERT's
  normaliser (lower-casing when ``do_lower_case``), pre-tokeniser and
  ``[CLS] ... [SEP]`` post-processor.
* A GGUF file whose ``tokenizer.ggml.model`` is ``gpt2`` -> a byte-level BPE
  built from ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges``; control
  tokens (``token_type`` 3) are registered as special tokens.  The
  pre-tokeniser follows llama.cpp's ``tokenizer.ggml.pre``: ``smollm`` /
  ``starcoder``-style vocabularies split digits one by one before the GPT-2
  byte-level regex; anything else uses the plain GPT-2 regex.
* A GGUF file whose ``tokenizer.ggml.model`` is ``llama`` (SentencePiece, as
  Llama 2, Mistral, Gemma and Phi-3 files have) -> a BPE whose merges are every
  split of a normal token into two tokens, ranked by the merged token's score
  (``tokenizer.ggml.scores``), as llama.cpp's SPM tokenizer merges the
  best-scoring adjacent pair first; spaces become ``▁``, one is prepended
  unless ``tokenizer.ggml.add_space_prefix`` is false, and characters outside
  the vocabulary fall back to the ``<0xXX>`` byte tokens.

Every builder returns a ``tokenizers.Tokenizer``; :func:`encode_ids` turns a
string into an ``int64`` id vector.
"""
from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["from_dir", "from_gguf_fields", "wordpiece_from_vocab", "encode_ids"]

#: llama.cpp pre-tokeniser names that split every digit on its own.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r",
                    "exaone", "minerva")


def from_dir(path: str, *, lower_case: bool = True):
    """Tokenizer of a checkpoint directory: ``tokenizer.json``, else ``vocab.txt``.

    Parameters
    ----------
    path : str
        Directory holding ``tokenizer.json`` or a WordPiece ``vocab.txt``.
    lower_case : bool
        For ``vocab.txt`` only: lower-case and strip accents (uncased BERT).

    Returns
    -------
    tokenizers.Tokenizer or None
        None when the directory has neither file.
    """
    from tokenizers import Tokenizer
    tj = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tj):
        tok = Tokenizer.from_file(tj)
        tok.no_padding()
        tok.no_truncation()
        return tok
    vt = os.path.join(path, "vocab.txt")
    if os.path.isfile(vt):
        return wordpiece_from_vocab(vt, lower_case=lower_case)
    return None


def wordpiece_from_vocab(vocab_path: str, *, lower_case: bool = True):
    """BERT WordPiece tokenizer from a ``vocab.txt`` (one token per line).

    Returns
    -------
    tokenizers.Tokenizer
        Adds ``[CLS]`` / ``[SEP]`` around each encoded text.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    with open(vocab_path, encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None if lower_case else False,
                                                lowercase=lower_case)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab.get("[CLS]"), vocab.get("[SEP]")
    if cls is not None and sep is not None:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def from_gguf_fields(fields: dict):
    """Byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata.

    Parameters
    ----------
    fields : dict
        ``{"model": str, "pre": str or None, "tokens": list[str],
        "merges": list[str], "token_type": list[int] or None}`` as read from
        the GGUF header (see :func:`opscope_nb.models.loader.gguf_metadata`);
        SentencePiece vocabularies also ``"scores": list[float]``,
        ``"add_space_prefix": bool or None``, ``"unk": int or None``.

    Returns
    -------
    tokenizers.Tokenizer

    Raises
    ------
    ValueError
        The vocabulary is neither ``gpt2`` (byte-level BPE) nor ``llama``
        (SentencePiece).
    """
    from tokenizers import Tokenizer, AddedToken, decoders, models, pre_tokenizers
    model = fields.get("model")
    if model == "llama":
        return _spm_from_gguf_fields(fields)
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; byte-level BPE "
                         f"('gpt2') and SentencePiece ('llama') vocabularies can be rebuilt.")
    tokens = list(fields["tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for m in fields["merges"]:
        a, _, b = m.partition(" ")
        merges.append((a, b))
    bpe = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = (fields.get("pre") or "").lower()
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = fields.get("token_type")
    if types is not None:
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if int(t) == 3]
        if special:
            tok.add_special_tokens(special)
    return tok


def _spm_from_gguf_fields(fields):
    """SentencePiece (``tokenizer.ggml.model = llama``) vocabulary as a BPE (see
    the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    tokens = [str(t) for t in fields["tokens"]]
    n = len(tokens)
    scores = list(fields.get("scores") or [0.0] * n)
    types = list(fields.get("token_type") or [1] * n)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked = []
    for i, piece in enumerate(tokens):
        if int(types[i]) != 1 or len(piece) < 2 or vocab[piece] != i:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[i]), vocab[a], vocab[b], a, b))
    ranked.sort()
    unk = fields.get("unk")
    unk_tok = tokens[int(unk)] if unk is not None and 0 <= int(unk) < n else None
    bpe = models.BPE(vocab, [(a, b) for *_, a, b in ranked], unk_token=unk_tok,
                     fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    norm = [normalizers.Replace(" ", "\u2581")]
    if fields.get("add_space_prefix", True) is not False:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if fields.get("add_space_prefix", True) is not False:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    added = [AddedToken(tokens[i], special=int(t) == 3, normalized=False)
             for i, t in enumerate(types) if int(t) in (3, 4)]
    if added:
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
    return tok


def encode_ids(tok, text: str) -> np.ndarray:
    """Token ids of ``text`` (int64 vector; special tokens as the tokenizer adds them)."""
    return np.asarray(tok.encode(text).ids, dtype=np.int64)


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)
