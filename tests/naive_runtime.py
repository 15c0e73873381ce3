"""Obvious NumPy twins for the packed-layer runtime (never imports opscope_nb).

``unpack(arrays, kind, shape, **params)`` rebuilds the dense ``[rows, cols]``
weight from the packed arrays following the layout table in the mining
module docstring, written independently; ``linear`` is the float64 product
``x @ W.T`` a packed layer must reproduce.
"""
from __future__ import annotations

import numpy as np


def nibbles(codes, cols):
    """uint8 ``[rows, ceil(cols/2)]`` two's-complement nibbles (even column
    low) -> int ``[rows, cols]``."""
    lo = (codes & 0x0F).astype(np.int64)
    hi = (codes >> 4).astype(np.int64)
    out = np.empty((codes.shape[0], 2 * codes.shape[1]), np.int64)
    out[:, 0::2] = lo
    out[:, 1::2] = hi
    out = np.where(out >= 8, out - 16, out)
    return out[:, :cols]


def fields(plane, width, n):
    """uint8 plane of ``width``-bit fields (column ``j`` in byte ``j // (8 //
    width)`` at bit ``width * (j % (8 // width))``) -> ints ``[rows, n]``."""
    per = 8 // width
    mask = (1 << width) - 1
    parts = [(plane.astype(np.int64) >> (width * q)) & mask for q in range(per)]
    return np.stack(parts, axis=-1).reshape(plane.shape[0], -1)[:, :n]


def crumbs(codes, n):
    """uint8 ``[rows, ceil(n/4)]`` -> 2-bit values ``[rows, n]`` (value
    ``4t+q`` in bits ``2q`` of byte ``t``)."""
    parts = [(codes >> (2 * q)) & 3 for q in range(4)]
    out = np.stack(parts, axis=-1).reshape(codes.shape[0], -1)
    return out[:, :n].astype(np.int64)


def unpack(a, kind, shape, group=None, modes=None, bits=None, qtype=None):
    """The dense weight; a ``+lr`` layer's arrays (``lr_u`` int8 [rows, r],
    ``lr_v`` int8 [r, cols], ``lr_s`` f32 [r]) add ``(lr_u * lr_s) @ lr_v``."""
    w = _unpack_base(a, kind, shape, group, modes, bits, qtype)
    if "lr_u" in a:
        w = w + (a["lr_u"].astype(np.float64) * a["lr_s"].astype(np.float64)) \
            @ a["lr_v"].astype(np.float64)
    return w


def _unpack_base(a, kind, shape, group, modes, bits, qtype):
    rows, cols = shape
    if kind == "dense":
        return a["w"].astype(np.float64)
    if kind == "int8":
        return a["codes"].astype(np.float64) * a["scales"].astype(np.float64)[:, None]
    if kind in ("int4", "int4g"):
        q = nibbles(a["codes"], cols).astype(np.float64)
        sc = a["scales"].astype(np.float64).reshape(rows, -1)
        g = cols if kind == "int4" else group
        return q * sc[:, np.arange(cols) // g]
    if kind == "intn":
        lo_bits = 2 if bits <= 3 else 4
        u = fields(a["lo"], lo_bits, cols)
        if "hi" in a:
            u = u | (fields(a["hi"], bits - lo_bits, cols) << lo_bits)
        q = (u - 2 ** (bits - 1)).astype(np.float64)
        sc = a["scales"].astype(np.float64).reshape(rows, -1)
        g = cols if group is None else group
        return q * sc[:, np.arange(cols) // g]
    if kind == "ternary":
        c = crumbs(a["codes"], cols)
        t = np.select([c == 1, c == 3], [1.0, -1.0], 0.0)
        return t * float(a["alpha"][0])
    if kind == "sparse24":
        v = a["values"].astype(np.float64)
        nv = v.shape[1]
        slots = crumbs(a["indices"], nv)
        w = np.zeros((rows, cols))
        t = np.arange(nv)
        colidx = 4 * (t // 2)[None, :] + slots
        for r in range(rows):
            w[r, colidx[r]] = v[r]
        return w
    if kind == "lowrank":
        return a["a"].astype(np.float64) @ a["b"].astype(np.float64)
    if kind == "monarch":
        w1 = a["w1"].astype(np.float64)
        w2 = a["w2"].astype(np.float64)
        m = w1.shape[0]
        # W[ri*m + j, l*m + s] = w1[ri, j, l] * w2[l, s, ri]
        return np.einsum("rjl,lsr->rjls", w1, w2).reshape(m * m, m * m)
    if kind == "tucker":
        g = a["core"].astype(np.float64)
        u = [a[f"u{i}"].astype(np.float64) for i in range(3)]
        return np.einsum("pqr,ip,aq,br->iab", g, *u).reshape(rows, cols)
    if kind == "tt":
        n = len(modes)
        acc = np.ones((1, 1))
        for k in range(n):
            c = a[f"core{k}"].astype(np.float64)
            rp, d, rn = c.shape
            acc = (acc @ c.reshape(rp, d * rn)).reshape(-1, rn)
        return acc.reshape(rows, cols)
    if kind == "ggml" and qtype in ("F16", "BF16"):
        # the blocks are the little-endian half-width words of each weight
        words = a["blocks"].reshape(rows, cols * 2).view("<u2")
        if qtype == "F16":
            return words.view("<f2").astype(np.float64)
        return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if kind == "ggml":        # block types: gguf-py's decoder, not ours
        import gguf
        return np.asarray(gguf.quants.dequantize(a["blocks"], gguf.GGMLQuantizationType[qtype]),
                          np.float64).reshape(rows, cols)
    raise ValueError(kind)


def linear(x, w):
    """float64 ``x @ w.T`` (x ``[m, cols]`` or ``[cols]``)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def rel(y, ref):
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / den) if den else float(np.linalg.norm(y))
