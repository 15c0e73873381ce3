"""llama.cpp importance matrices (``llama-imatrix`` output) as ``diag(H)`` per weight.

Two on-disk formats (llama.cpp ``tools/imatrix``):

* **GGUF** (``general.type = "imatrix"``): per weight ``<tensor>.in_sum2``
  float32 ``[nmat, n]`` (ggml ``ne = (n, nmat)``; ``nmat = 1`` for a dense 2-D
  weight, experts for MoE) holding ``sum_t x_t**2`` over the ``counts`` rows
  seen, and ``<tensor>.counts`` float32 ``[nmat, 1]``.  ``diag(H)`` is
  ``in_sum2`` itself (the sum of squares, :data:`Imatrix.kind` ``"sum"``).
* **legacy .dat** (all little-endian): ``int32 n_entries``; per entry
  ``int32 len``, ``len`` bytes of name, ``int32 ncall``, ``int32 nval``,
  ``float32[nval]`` = ``mean_t(x_t**2) * ncall``; then optionally ``int32
  last_chunk`` and ``int32 len`` + dataset name.  ``diag(H)`` is read as
  ``values / ncall`` (the per-token mean; a constant factor does not change
  ``out_err``, a ratio).

Names: GGUF tensor names (``blk.3.attn_q.weight``) are used as is; for a
safetensors Llama-family checkpoint they are mapped through
:data:`GGUF_TO_HF` (``model.layers.3.self_attn.q_proj.weight``).  Entries that
match none of the requested names are listed in :attr:`Imatrix.unknown`;
MoE entries (``nmat > 1``) are listed there too.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

import numpy as np

from ._gguf_header import GGUFFile

__all__ = ["Imatrix", "ImatrixError", "read_imatrix", "gguf_to_hf", "GGUF_TO_HF"]


class ImatrixError(ValueError):
    """An imatrix file that cannot be read (message names the file and the problem)."""


#: llama.cpp (GGUF) per-block tensor name -> Hugging Face Llama name.
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"output.weight": "lm_head.weight", "token_embd.weight": "model.embed_tokens.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def gguf_to_hf(name: str):
    """The Hugging Face Llama name of a GGUF tensor name, or ``None``."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if m and m[2] in GGUF_TO_HF:
        return f"model.layers.{m[1]}.{GGUF_TO_HF[m[2]]}.weight"
    return None


@dataclass
class Imatrix:
    """A read importance matrix.

    Attributes
    ----------
    diag : dict of str -> ndarray of float64, shape (cols,)
        ``diag(H)`` per matched weight name (the checkpoint's names).
    unknown : list of str
        imatrix entries no requested name matched (or MoE entries).
    format : str
        ``"gguf"`` or ``"dat"``.
    chunks : int or None
        Chunks the matrix was computed over (when the file says).
    raw_names : dict of str -> str
        Checkpoint name -> the imatrix entry it came from.
    """

    diag: dict
    unknown: list
    format: str
    chunks: int | None = None
    raw_names: dict = field(default_factory=dict)


def _read_gguf(path):
    try:
        import gguf  # noqa: F401  (its type tables)
    except ImportError:  # pragma: no cover - gguf is a dependency of the io extra
        raise ImatrixError(f"{path}: reading GGUF imatrix files needs the 'gguf' package "
                           f"(pip install gguf).") from None
    try:
        r = GGUFFile(path)
    except Exception as exc:
        raise ImatrixError(f"{path}: not a readable GGUF file ({exc}).") from None
    tens = {t.name: t for t in r.tensors}
    chunks = None
    f = r.fields.get("imatrix.chunk_count")
    if f is not None:
        v = f.contents()
        try:
            chunks = int(v[0] if isinstance(v, list) else v)
        except Exception:
            chunks = None
    out, moe = {}, []
    for n, t in tens.items():
        if not n.endswith(".in_sum2"):
            continue
        base = n[:-len(".in_sum2")]
        if base + ".counts" not in tens:
            raise ImatrixError(f"{path}: {n} has no matching {base}.counts tensor.")
        a = np.asarray(t.data, dtype=np.float64)
        cnt = np.asarray(tens[base + ".counts"].data, dtype=np.float64).reshape(-1)
        if a.ndim == 2 and a.shape[0] > 1 or cnt.size > 1:
            moe.append(base)
            continue
        a = a.reshape(-1)
        if not np.isfinite(a).all() or (a < 0).any():
            raise ImatrixError(f"{path}: {n} holds negative or non-finite sums of squares.")
        out[base] = a
    if not out and not moe:
        raise ImatrixError(f"{path}: GGUF file with no '<tensor>.in_sum2' tensors; not an "
                           f"imatrix.")
    return out, moe, chunks


def _read_dat(path):
    with open(path, "rb") as fh:
        buf = fh.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(buf):
            raise ImatrixError(f"{path}: truncated legacy imatrix (.dat) at byte {pos}.")
        v = struct.unpack_from(fmt, buf, pos)
        pos += size
        return v

    (n,) = take("<i")
    if n < 1:
        raise ImatrixError(f"{path}: legacy imatrix with {n} entries; nothing to read.")
    out = {}
    for i in range(n):
        (ln,) = take("<i")
        if not 0 < ln < 4096:
            raise ImatrixError(f"{path}: entry {i}: bad name length {ln}; not a legacy "
                               f"imatrix file.")
        name = bytes(take(f"<{ln}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise ImatrixError(f"{path}: entry {name!r}: {nval} values.")
        if pos + 4 * nval > len(buf):   # checked before frombuffer reads past the end
            raise ImatrixError(f"{path}: truncated legacy imatrix (.dat) inside the values "
                               f"of {name!r} ({nval} float32 values from byte {pos}, the "
                               f"file ends at byte {len(buf)}); write the imatrix again.")
        vals = np.frombuffer(buf, dtype="<f4", count=nval, offset=pos).astype(np.float64)
        pos += 4 * nval
        if not np.isfinite(vals).all() or (vals < 0).any():
            raise ImatrixError(f"{path}: entry {name!r} holds negative or non-finite values.")
        out[name] = vals / max(int(ncall), 1)
    chunks = None
    if pos + 4 <= len(buf):
        (chunks,) = take("<i")
    return out, [], chunks


def read_imatrix(path, names=None) -> Imatrix:
    """Read a llama.cpp imatrix file (GGUF or legacy .dat, told apart by the magic).

    Parameters
    ----------
    path : str
    names : iterable of str, optional
        The checkpoint's weight names to match (GGUF names directly, else through
        :func:`gguf_to_hf`).  ``None``: keep the file's own names.

    Returns
    -------
    Imatrix

    Raises
    ------
    ImatrixError
        Missing, truncated or malformed file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ImatrixError(f"{path}: no such imatrix file.")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        raw, moe, chunks = _read_gguf(path)
        fmt = "gguf"
    else:
        raw, moe, chunks = _read_dat(path)
        fmt = "dat"
    unknown = list(moe)
    if names is None:
        return Imatrix(dict(raw), unknown, fmt, chunks, {k: k for k in raw})
    want = set(names)
    diag, src = {}, {}
    for k, v in raw.items():
        tgt = k if k in want else gguf_to_hf(k)
        if tgt is None or tgt not in want:
            unknown.append(k)
            continue
        diag[tgt] = v
        src[tgt] = k
    return Imatrix(diag, sorted(unknown), fmt, chunks, src)
