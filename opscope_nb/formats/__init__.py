"""The packed formats: what each compression option stores and how.

Layer 1 of the package (it imports only :mod:`opscope_nb.kernels`,
:mod:`opscope_nb._validation`, the GPTQ rounding of :mod:`opscope_nb.formats.gptq` and
the ggml block types of :mod:`opscope_nb.formats.ggml`):

* :class:`Decomp` -- one compression choice (frozen, hashable, JSON-able);
* :func:`layout` -- **the one layout table**: the arrays (names, dtypes,
  shapes) a ``[rows, cols]`` weight packs into; :func:`packed_bytes`,
  :func:`opscope_nb.runtime.expected_arrays` and the checkpoint reader
  derive from it;
* :func:`flops` -- multiply-adds per input row;
* :func:`pack` / :func:`unpack` / :func:`approximate` -- the arrays, the dense
  reconstruction, and ``unpack(pack(w))``.

A new kind (the ggml block types, say) plugs in here and nowhere else.
:mod:`opscope_nb.profile.mining` re-exports these names (``mining.Decomp``,
``mining.pack``, ... keep working).

Packed layouts (all C-contiguous, row = output channel)
--------------------------------------------------------
===================  ==========================================================
label                arrays
===================  ==========================================================
``dense``            ``w`` f32 [rows, cols]
``int8/chan``        ``codes`` i8 [rows, cols]; ``scales`` f32 [rows]
``int4/chan``        ``codes`` u8 [rows, ceil(cols/2)] (two's-complement nibbles,
                     even column in the low nibble); ``scales`` f32 [rows]
``int4/g{g}``        ``codes`` as int4/chan; ``scales`` f32 [rows, ceil(cols/g)]
                     (groups along the row, the last one may be short)
``<q>+gptq``         any quantised label above with GPTQ-chosen codes
                     (``Decomp.rounding == "gptq"``): the same arrays as
                     ``<q>``, so the same kernels run it
``<q>+lr{r}``        any quantised label above (``int8``, ``int4``, ``int4g``,
                     ``intn``, with or without ``+gptq``) plus a rank-``r``
                     correction of its residual (``Decomp.lr == r``): the
                     ``<q>`` arrays, then ``lr_u`` i8 [rows, r] (column
                     ``k`` symmetric int8), ``lr_v`` i8 [r, cols] (row ``k``
                     symmetric int8) and ``lr_s`` f32 [r] (the product of the
                     two scales of rank ``k``): ``W ~ Q + (lr_u * lr_s) @
                     lr_v`` (:func:`correction_factors`)
``int6/chan``        ``lo`` u8 [rows, ceil(cols/2)] (nibble plane: bits 0-3 of
                     ``u``); ``hi`` u8 [rows, ceil(cols/4)] (crumb plane: bits
                     4-5 of ``u``); ``scales`` f32 [rows]
``int6/g{g}``        ``lo``, ``hi`` as int6/chan; ``scales`` f32
                     [rows, ceil(cols/g)]
``int5/chan``        ``lo`` u8 [rows, ceil(cols/2)] (nibble plane: bits 0-3);
                     ``hi`` u8 [rows, ceil(cols/8)] (bit plane: bit 4);
                     ``scales`` f32 [rows]
``int5/g{g}``        ``lo``, ``hi`` as int5/chan; ``scales`` f32
                     [rows, ceil(cols/g)]
``int3/chan``        ``lo`` u8 [rows, ceil(cols/4)] (crumb plane: bits 0-1);
                     ``hi`` u8 [rows, ceil(cols/8)] (bit plane: bit 2);
                     ``scales`` f32 [rows]
``int3/g{g}``        ``lo``, ``hi`` as int3/chan; ``scales`` f32
                     [rows, ceil(cols/g)]
``int2/g{g}``        ``lo`` u8 [rows, ceil(cols/4)] (crumb plane: bits 0-1; no
                     ``hi``); ``scales`` f32 [rows, ceil(cols/g)]
                     (``int2/chan``: ``scales`` f32 [rows]; not in the menu)
``ternary``          ``codes`` u8 [rows, ceil(cols/4)] (2-bit: 0 -> 0, +1 -> 1,
                     -1 -> 3); ``alpha`` f32 [1]
``sparse2:4``        ``values`` f32 [rows, nv]; ``indices`` u8 [rows, ceil(nv/4)]
                     (2-bit slot inside each group of 4), ``nv = 2*(cols//4) +
                     min(2, cols%4)``
``lowrank(r=R)``     ``a`` f32 [rows, R] (= U); ``b`` f32 [R, cols] (= S Vt)
``monarch``          ``w1``, ``w2`` f32 [m, m, m] (``rows = cols = m*m``)
``tucker(...)``      ``core`` f32 [r0, r1, r2]; ``u0`` [d0, r0], ``u1`` [d1, r1],
                     ``u2`` [d2, r2]  (view ``w.reshape(d0, d1, d2)``, d0 = rows)
``tt(...)``          ``core0`` .. ``core{n-1}`` f32 [r_prev, d_k, r_next]
                     (view ``w.reshape(*modes)``)
``Q4_K``, ``Q8_0``,  ``blocks`` u8 [rows, ggml.row_bytes(qtype, cols)]: the ggml
... (kind ``ggml``)  bytes of each row, exactly as ``ggml_quantize_chunk``
                     writes them and a GGUF file stores them (F16 / BF16: 2
                     bytes per weight, little-endian); ``cols`` must be a
                     multiple of the type's block (:mod:`opscope_nb.formats.ggml`)
===================  ==========================================================

intN planes (``int2/3/5/6``, kind ``intn``): the ``b``-bit symmetric code
``c = clamp(round_half_away(w / scale), -L, L)``, ``L = 2**(b-1) - 1``, is
stored offset binary ``u = c + 2**(b-1)`` (unsigned, ``1 <= u <= 2**b - 1``),
split into ``lo`` (the low 2 bits for b = 2, 3; the low 4 bits for b = 5, 6)
and ``hi`` (the remaining 1 or 2 bits).  In a plane of field width ``f``
(1, 2 or 4 bits) column ``j`` sits in byte ``j // (8 // f)`` at bit
``f * (j % (8 // f))`` (lowest column in the lowest bits, as the int4 nibbles
and ternary crumbs); unused fields of a row's last byte are 0.  Decode:
``u = lo_field | (hi_field << lo_bits)``, weight ``(u - 2**(b-1)) * scale``.
Per row ``lo`` + ``hi`` take at most ``ceil(b * cols / 8) + 1`` bytes.
Cores: :func:`opscope_nb.kernels.pack_intn`,
:func:`~opscope_nb.kernels.unpack_intn`,
:func:`~opscope_nb.kernels.dequantize_intn`."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from . import ggml as _ggml
from opscope_nb._validation import as_matrix, check_int
from opscope_nb.kernels._pack import (
    dequantize_groups,
    dequantize_intn,
    dequantize_nibbles,
    nm_prune,
    nm_unprune,
    pack_crumbs,
    pack_intn,
    pack_nibbles,
    quantize_groups_sym,
    ternary_decode,
    ternary_twn,
    unpack_crumbs,
)

__all__ = [
    "Decomp",
    "KINDS",
    "INTN_BITS",
    "ROUNDINGS",
    "layout",
    "packed_bytes",
    "flops",
    "pack",
    "unpack",
    "approximate",
    "nbytes",
    "balanced_factor",
    "check_applicable",
    "GramRequiredError",
    "ggml_importance",
    "LR_KINDS",
    "LR_SKETCH",
    "LR_DAMP",
    "correction_factors",
    "correction_basis",
    "correction_metric",
    "correction_slice",
    "correction_product",
]

KINDS = ("dense", "int8", "int4", "int4g", "intn", "ternary", "sparse24", "lowrank",
          "monarch", "tucker", "tt", "ggml")

#: Bit widths of the ``intn`` kind (int4 and int8 keep their own kinds).
INTN_BITS = (2, 3, 5, 6)
#: Data-aware roundings a quantised Decomp may name (None = round to nearest).
ROUNDINGS = ("gptq",)
#: Kinds that take a low-rank correction of their residual (``Decomp.lr``).
LR_KINDS = ("int8", "int4", "int4g", "intn")
#: Rank of the one truncated SVD a correction of rank ``lr <= LR_SKETCH`` is cut
#: from (its leading ``lr`` triplets), so ``+lr8``, ``+lr16`` and ``+lr32`` of
#: one quantisation share a single SVD and nest.
LR_SKETCH = 32
#: Ridge of the correction's output-space metric, relative to the mean input
#: energy: ``H / mean(diag H) + LR_DAMP * I``.  0.1 rather than GPTQ's 0.01:
#: on all-MiniLM-L6-v2 (int3/g128, int3/g128+gptq, int4/chan+gptq of 12
#: layers, rank 8, fitted on the sample text's grams, measured on 3000
#: tokens of the builtin text) the held-out output error was 0.917x the
#: bare codes' at 0.1 against 0.923x at 0.01, 0.920x at 1.0 and 0.933x for
#: a diagonal metric (``python benchmarks/bench_lr_damp.py DIR/calib.npz``):
#: a fit that follows the calibration gram too closely loses on new text.
LR_DAMP = 0.1


class GramRequiredError(ValueError):
    """A ``+gptq`` option was packed without the calibration gram it needs."""


def _tuple_of_ints(v, name):
    try:
        t = tuple(int(x) for x in v)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints; got {v!r}.") from None
    if not t or any(x < 1 for x in t):
        raise ValueError(f"{name} must be non-empty positive ints; got {v!r}.")
    return t


@dataclass(frozen=True)
class Decomp:
    """One compression choice for a weight (frozen, hashable, JSON-able).

    Build it with the class-method constructors: ``Decomp.dense()``,
    ``Decomp.int8()``, ``Decomp.int4()``, ``Decomp.int4(group=128)``,
    ``Decomp.intn(5)``, ``Decomp.intn(6, group=128)``, ``Decomp.ternary()``, ``Decomp.sparse24()``, ``Decomp.lowrank(12)``,
    ``Decomp.monarch()``, ``Decomp.tucker((1024, 48, 64), (32, 24, 32))``,
    ``Decomp.ggml("Q4_K")``,
    ``Decomp.tt((32, 32, 48, 64), 16)``; or from ``Decomp.from_label(s)`` /
    ``Decomp.from_dict(d)``.

    Attributes
    ----------
    kind : str
        One of ``dense, int8, int4, int4g, intn, ternary, sparse24, lowrank,
        monarch, tucker, tt, ggml``.
    r : int or None
        Low-rank rank.
    group : int or None
        Group length along a row (``int4g``, required; ``intn``, optional:
        ``None`` is one scale per row).
    dims, ranks : tuple of int or None
        Tucker view ``(rows, c1, c2)`` and multilinear ranks.
    modes : tuple of int or None
        TT mode sizes (their product is ``rows * cols``; leading modes
        multiply to ``rows``).
    cap : int or None
        TT bond-rank cap.
    bits : int or None
        Code width of ``intn``: 2, 3, 5 or 6 (int4 / int8 are their own kinds).
    qtype : str or None
        ggml type name of the ``ggml`` kind (canonical upper-case spelling of
        :data:`opscope_nb.formats.ggml.GGML_TYPES`: ``Q4_K``, ``IQ4_XS``, ``BF16``,
        ...); the label is the type name.
    rounding : str or None
        ``None`` is round-to-nearest; ``"gptq"`` (quantised kinds ``int8``,
        ``int4``, ``int4g``, ``intn`` only) chooses the codes with GPTQ's
        error compensation from a calibration gram
        (:func:`opscope_nb.formats.gptq.gptq_quantize`).  Same kind, same packed
        arrays and kernels as the round-to-nearest twin; the label gains
        ``+gptq`` (e.g. ``int4/g128+gptq``).  :func:`pack` /
        :func:`approximate` need ``gram=`` for it.
    lr : int or None
        Rank of a low-rank correction of the quantisation residual (quantised
        kinds :data:`LR_KINDS` only, ``1 <= lr <= min(rows, cols)``): the
        packed arrays gain ``lr_u`` / ``lr_v`` (int8) and ``lr_s`` (float32
        [lr]) and the weight is ``Q + (lr_u * lr_s) @ lr_v``
        (:func:`correction_factors`; fitted in output
        space from ``gram=`` when given, in weight space otherwise).  Label
        suffix ``+lr{lr}`` after any ``+gptq`` (``int3/g32+gptq+lr16``);
        build with :meth:`with_correction`.
    svd_rank, seed : int
        How a low-rank option is computed: the leading ``r`` triplets of one
        ``truncated_svd(w, svd_rank, seed)`` (``svd_rank=None`` means ``r``);
        ``seed`` is also the sketch seed of a ``+lr`` correction.
        Provenance only: not part of equality, hash or label.
    """

    kind: str
    r: int | None = None
    group: int | None = None
    dims: tuple | None = None
    ranks: tuple | None = None
    modes: tuple | None = None
    cap: int | None = None
    bits: int | None = None
    rounding: str | None = None
    qtype: str | None = None
    lr: int | None = None
    svd_rank: int | None = field(default=None, compare=False)
    seed: int = field(default=0, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Decomp kind must be one of {KINDS}; got {self.kind!r}.")
        need = {"lowrank": ("r",), "int4g": ("group",), "tucker": ("dims", "ranks"),
                "tt": ("modes", "cap"), "intn": ("bits",),
                "ggml": ("qtype",)}.get(self.kind, ())
        optional = ("group",) if self.kind == "intn" else ()
        for f in ("r", "group", "dims", "ranks", "modes", "cap", "bits", "qtype"):
            v = getattr(self, f)
            if f in need and v is None:
                raise ValueError(f"Decomp kind {self.kind!r} needs {f!r}.")
            if f not in need and f not in optional and v is not None:
                raise ValueError(f"Decomp kind {self.kind!r} takes no {f!r}; got {v!r}.")
        if self.qtype is not None:
            t = _ggml.GGML_TYPES.get(self.qtype.upper()) if isinstance(self.qtype, str) \
                else None
            if t is None:
                raise ValueError(f"ggml qtype must be one of {list(_ggml.GGML_TYPES)} "
                                 f"(case-insensitive); got {self.qtype!r}.")
            object.__setattr__(self, "qtype", t.name)
        if self.bits is not None:
            b = check_int(self.bits, "bits", 1)
            if b not in INTN_BITS:
                raise ValueError(f"intn bits must be one of {INTN_BITS} (int4 and int8 are "
                                 f"the kinds 'int4'/'int4g'/'int8'); got {self.bits!r}.")
            object.__setattr__(self, "bits", b)
        for f in ("r", "group", "cap"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, check_int(getattr(self, f), f, 1))
        for f in ("dims", "ranks", "modes"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, _tuple_of_ints(getattr(self, f), f))
        if self.kind == "tucker":
            if len(self.dims) != 3 or len(self.ranks) != 3:
                raise ValueError(f"Tucker needs 3 dims and 3 ranks; got dims={self.dims}, "
                                 f"ranks={self.ranks}.")
            if any(r > d for r, d in zip(self.ranks, self.dims)):
                raise ValueError(f"Tucker ranks must be <= dims; got dims={self.dims}, "
                                 f"ranks={self.ranks}.")
        if self.kind == "tt" and len(self.modes) < 2:
            raise ValueError(f"TT needs at least 2 modes; got {self.modes}.")
        if self.rounding is not None:
            if self.rounding not in ROUNDINGS:
                raise ValueError(f"Decomp rounding must be None (round to nearest) or one of "
                                 f"{ROUNDINGS}; got {self.rounding!r}.")
            if self.kind == "ggml":
                if self.qtype not in _ggml.GPTQ_TYPES:
                    raise ValueError(f"rounding={self.rounding!r} applies to the ggml types "
                                     f"{', '.join(_ggml.GPTQ_TYPES)}; got {self.qtype}.")
            elif self.kind not in ("int8", "int4", "int4g", "intn"):
                raise ValueError(f"rounding={self.rounding!r} applies to the quantised kinds "
                                 f"int8/int4/int4g/intn and the ggml block types only; got "
                                 f"kind {self.kind!r}.")
        if self.lr is not None:
            if self.kind not in LR_KINDS:
                raise ValueError(f"lr (a low-rank correction of the quantisation residual) "
                                 f"applies to the kinds {LR_KINDS} only; got kind "
                                 f"{self.kind!r}. Use Decomp.lowrank(r) for a plain "
                                 f"low-rank weight.")
            object.__setattr__(self, "lr", check_int(self.lr, "lr", 1))
        if self.svd_rank is not None:
            object.__setattr__(self, "svd_rank", check_int(self.svd_rank, "svd_rank", 1))
        object.__setattr__(self, "seed", check_int(self.seed, "seed", 0))

    # -- constructors ------------------------------------------------------
    @classmethod
    def dense(cls):
        """Full float32 weights."""
        return cls("dense")

    @classmethod
    def int8(cls):
        """Symmetric int8, one float32 scale per row (output channel)."""
        return cls("int8")

    @classmethod
    def int4(cls, group=None):
        """Symmetric int4, nibble-packed; one scale per row, or per ``group``
        consecutive values of a row when ``group`` is given."""
        return cls("int4") if group is None else cls("int4g", group=group)

    @classmethod
    def intn(cls, bits, group=None):
        """Symmetric ``bits``-bit codes (2, 3, 5 or 6) in offset-binary bit
        planes; one float32 scale per row, or per ``group`` consecutive values
        of a row when ``group`` is given.  Labels ``int{bits}/chan`` and
        ``int{bits}/g{group}``."""
        return cls("intn", bits=bits, group=group)

    @classmethod
    def ternary(cls):
        """TWN ternary ``alpha * {-1, 0, +1}``, 2-bit codes, one float32 alpha."""
        return cls("ternary")

    @classmethod
    def sparse24(cls):
        """2:4 structured sparsity along each row (keep 2 of every 4)."""
        return cls("sparse24")

    @classmethod
    def lowrank(cls, r, *, svd_rank=None, seed=0):
        """``W ~ A B`` with ``A = U[:, :r]``, ``B = diag(S[:r]) Vt[:r]``."""
        return cls("lowrank", r=r, svd_rank=svd_rank, seed=seed)

    @classmethod
    def ggml(cls, qtype):
        """A ggml (llama.cpp / GGUF) block type, e.g. ``Decomp.ggml("Q4_K")``:
        bit-identical to ``ggml_quantize_chunk`` (:func:`opscope_nb.formats.ggml.quantize`).
        Label: the type name (``Q4_K``)."""
        return cls("ggml", qtype=qtype)

    @classmethod
    def monarch(cls):
        """Monarch factors (square weights with a perfect-square side)."""
        return cls("monarch")

    @classmethod
    def tucker(cls, dims, ranks):
        """3-way HOSVD Tucker of the view ``w.reshape(dims)``."""
        return cls("tucker", dims=dims, ranks=ranks)

    @classmethod
    def tt(cls, modes, cap):
        """TT-SVD of the view ``w.reshape(modes)`` with bond ranks ``<= cap``."""
        return cls("tt", modes=modes, cap=cap)

    # -- naming ------------------------------------------------------------
    @property
    def label(self) -> str:
        """Stable short name, e.g. ``int4/g128``, ``int4/g128+gptq``,
        ``lowrank(r=12)``, ``tucker(1024x48x64->32,24,32)``,
        ``tt(32x32x48x64,cap=16)``."""
        base = self._base_label()
        if self.rounding is not None:
            base = f"{base}+{self.rounding}"
        return base if self.lr is None else f"{base}+lr{self.lr}"

    def with_rounding(self, rounding) -> "Decomp":
        """The same decomposition with another ``rounding`` (None: to nearest)."""
        import dataclasses
        return dataclasses.replace(self, rounding=rounding)

    def with_correction(self, lr) -> "Decomp":
        """The same quantisation with a rank-``lr`` residual correction
        (``None``: without one)."""
        import dataclasses
        return dataclasses.replace(self, lr=lr)

    @property
    def reads_gram(self) -> bool:
        """Whether :func:`pack` uses a calibration gram when given one:
        ``+gptq`` needs it, a ggml type takes its diagonal as importance, a
        ``+lr`` correction is fitted in output space with it."""
        return self.rounding is not None or self.kind == "ggml" or self.lr is not None

    def _base_label(self) -> str:
        k = self.kind
        if k == "dense":
            return "dense"
        if k == "int8":
            return "int8/chan"
        if k == "int4":
            return "int4/chan"
        if k == "int4g":
            return f"int4/g{self.group}"
        if k == "intn":
            return f"int{self.bits}/" + ("chan" if self.group is None else f"g{self.group}")
        if k == "ternary":
            return "ternary"
        if k == "sparse24":
            return "sparse2:4"
        if k == "lowrank":
            return f"lowrank(r={self.r})"
        if k == "monarch":
            return "monarch"
        if k == "ggml":
            return self.qtype
        if k == "tucker":
            return ("tucker(" + "x".join(map(str, self.dims)) + "->"
                    + ",".join(map(str, self.ranks)) + ")")
        return "tt(" + "x".join(map(str, self.modes)) + f",cap={self.cap})"

    def __str__(self):
        return self.label

    _LABEL_RES = (
        (re.compile(r"^int4/g(\d+)$"), lambda m: Decomp.int4(int(m[1]))),
        (re.compile(r"^int([2356])/chan$"), lambda m: Decomp.intn(int(m[1]))),
        (re.compile(r"^int([2356])/g(\d+)$"), lambda m: Decomp.intn(int(m[1]), int(m[2]))),
        (re.compile(r"^lowrank\(r=(\d+)\)$"), lambda m: Decomp.lowrank(int(m[1]))),
        (re.compile(r"^tucker\((\d+)x(\d+)x(\d+)->(\d+),(\d+),(\d+)\)$"),
         lambda m: Decomp.tucker(tuple(map(int, m.groups()[:3])),
                                 tuple(map(int, m.groups()[3:])))),
        (re.compile(r"^tt\((\d+(?:x\d+)+),cap=(\d+)\)$"),
         lambda m: Decomp.tt(tuple(map(int, m[1].split("x"))), int(m[2]))),
    )

    @classmethod
    def from_label(cls, s: str) -> "Decomp":
        """Inverse of :attr:`label` (provenance fields take their defaults)."""
        simple = {"dense": "dense", "int8/chan": "int8", "int4/chan": "int4",
                  "ternary": "ternary", "sparse2:4": "sparse24", "monarch": "monarch"}
        if not isinstance(s, str):
            raise TypeError(f"label must be a str; got {type(s).__name__}.")
        m = re.match(r"^(.+)\+lr(\d+)$", s)
        if m:
            return cls.from_label(m[1]).with_correction(int(m[2]))
        for rnd in ROUNDINGS:
            if s.endswith("+" + rnd):
                return cls.from_label(s[:-len(rnd) - 1]).with_rounding(rnd)
        if s in simple:
            return cls(simple[s])
        if s.upper() in _ggml.GGML_TYPES:
            return cls.ggml(s)
        for rx, make in cls._LABEL_RES:
            m = rx.match(s)
            if m:
                return make(m)
        raise ValueError(f"unknown decomposition label {s!r}; expected e.g. 'dense', "
                         f"'int8/chan', 'int4/g128', 'int{{2,3,5,6}}/chan', 'int5/g32', "
                         f"'lowrank(r=12)', 'int3/g32+gptq+lr16', a ggml type such as 'Q4_K', "
                         f"'tucker(64x8x8->32,4,4)', 'tt(8x8x8x8,cap=16)'.")

    def to_dict(self) -> dict:
        """JSON-ready dict: ``kind``, ``label`` and the kind's parameters."""
        d = {"kind": self.kind, "label": self.label}
        for f in ("r", "group", "cap", "bits", "qtype", "lr"):
            if getattr(self, f) is not None:
                d[f] = getattr(self, f)
        for f in ("dims", "ranks", "modes"):
            if getattr(self, f) is not None:
                d[f] = list(getattr(self, f))
        if self.rounding is not None:
            d["rounding"] = self.rounding
        if self.kind == "lowrank":
            d["svd_rank"] = self.svd_rank
        if self.kind == "lowrank" or self.lr is not None:
            d["seed"] = self.seed
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Decomp":
        """Inverse of :meth:`to_dict` (``label`` is ignored if present)."""
        if not isinstance(d, dict) or "kind" not in d:
            raise ValueError(f"Decomp.from_dict needs a dict with a 'kind' key; got {d!r}.")
        kw = {k: v for k, v in d.items() if k != "label"}
        for f in ("dims", "ranks", "modes"):
            if kw.get(f) is not None:
                kw[f] = tuple(kw[f])
        if kw.get("seed") is None:
            kw.pop("seed", None)
        try:
            return cls(**kw)
        except TypeError as exc:
            raise ValueError(f"bad Decomp dict {d!r}: {exc}") from None


# ───────────────────────────── shapes, layouts, sizes ─────────────────────────────

def balanced_factor(n: int) -> tuple:
    """``(a, n // a)`` with ``a`` the largest divisor of ``n`` that is
    ``<= sqrt(n)`` (``(1, n)`` for primes and 1)."""
    a = max(math.isqrt(n), 1)
    while a > 1 and n % a:
        a -= 1
    return a, n // a


def _tt_ranks(modes, cap):
    """Bond ranks TT-SVD produces: ``r_k = clamp(cap, 1, min(r_{k-1} d_k,
    prod(d_{k+1:})))``."""
    ranks = []
    rp = 1
    for k in range(len(modes) - 1):
        rows = rp * modes[k]
        cols = int(np.prod(modes[k + 1:]))
        rk = max(1, min(cap, rows, cols))
        ranks.append(rk)
        rp = rk
    return ranks


def _tt_params(modes, cap):
    bond = [1] + _tt_ranks(modes, cap) + [1]
    return sum(bond[k] * modes[k] * bond[k + 1] for k in range(len(modes)))


def _tt_flops(modes, cap, rows):
    """MACs to apply the TT operator to one input vector: contract the input
    modes right to left, then expand the output modes."""
    bond = [1] + _tt_ranks(modes, cap) + [1]
    n = len(modes)
    split = next((k for k in range(1, n) if int(np.prod(modes[:k])) == rows), None)
    if split is None:
        return _tt_params(modes, cap)
    fl = 0
    for t in range(n - 1, split - 1, -1):  # input cores
        fl += int(np.prod(modes[split:t + 1])) * bond[t] * bond[t + 1]
    for t in range(split - 1, -1, -1):      # output cores
        fl += bond[t] * bond[t + 1] * int(np.prod(modes[t:split]))
    return fl


def check_applicable(rows, cols, d: Decomp):
    k = d.kind
    if d.lr is not None and d.lr > min(rows, cols):
        raise ValueError(f"the correction rank lr must be <= min(rows, cols) = "
                         f"{min(rows, cols)}; got {d.label} for a {rows}x{cols} weight.")
    if k == "lowrank":
        if d.r > min(rows, cols):
            raise ValueError(f"lowrank r must be <= min(rows, cols) = {min(rows, cols)}; "
                             f"got r={d.r}.")
        if d.svd_rank is not None and not d.r <= d.svd_rank <= min(rows, cols):
            raise ValueError(f"lowrank svd_rank must lie in [r, min(rows, cols)] = "
                             f"[{d.r}, {min(rows, cols)}]; got {d.svd_rank}.")
    elif k == "monarch":
        m = math.isqrt(rows)
        if rows != cols or m * m != rows:
            raise ValueError(f"monarch needs a square weight with a perfect-square side; "
                             f"got {rows}x{cols}.")
    elif k == "tucker":
        if d.dims[0] != rows or d.dims[1] * d.dims[2] != cols:
            raise ValueError(f"tucker dims must be (rows, c1, c2) with c1*c2 = cols for a "
                             f"{rows}x{cols} weight; got {d.dims}.")
    elif k == "ggml":
        blk = _ggml.GGML_TYPES[d.qtype].block
        if cols % blk:
            raise ValueError(f"{d.qtype} needs rows that are a multiple of {blk} values; got "
                             f"cols={cols} (llama-quantize would use "
                             f"{_ggml.fallback_type(d.qtype, cols)} instead).")
    elif k == "tt":
        if int(np.prod(d.modes)) != rows * cols:
            raise ValueError(f"tt modes must multiply to rows*cols = {rows * cols}; got "
                             f"{d.modes}.")


def layout(rows: int, cols: int, decomp: Decomp) -> dict:
    """The packed-array layout of a ``[rows, cols]`` weight as ``decomp``:
    ``{name: (dtype, shape)}`` in the order :func:`pack` returns them.

    The one table of the package's layouts (the module docstring in code):
    :func:`packed_bytes`, :func:`opscope_nb.runtime.expected_arrays`, the
    checkpoint reader and the runtime's checks all derive from it, so a new
    kind plugs in here and nowhere else.

    Parameters
    ----------
    rows, cols : int
        ``[out_features, in_features]``.
    decomp : Decomp

    Returns
    -------
    dict of str -> (numpy.dtype, tuple of int)

    Raises
    ------
    ValueError
        ``decomp`` does not apply to the shape (e.g. Monarch of a non-square
        weight).
    """
    check_applicable(rows, cols, decomp)
    if decomp.lr is not None:
        i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
        out = layout(rows, cols, decomp.with_correction(None))
        out["lr_u"] = (i8, (rows, decomp.lr))
        out["lr_v"] = (i8, (decomp.lr, cols))
        out["lr_s"] = (f32, (decomp.lr,))
        return out
    f32, u8, i8 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int8)
    d = decomp
    k = d.kind
    if k == "dense":
        return {"w": (f32, (rows, cols))}
    if k == "int8":
        return {"codes": (i8, (rows, cols)), "scales": (f32, (rows,))}
    if k == "int4":
        return {"codes": (u8, (rows, (cols + 1) // 2)), "scales": (f32, (rows,))}
    if k == "int4g":
        return {"codes": (u8, (rows, (cols + 1) // 2)),
                "scales": (f32, (rows, -(-cols // d.group)))}
    if k == "intn":
        # lo plane: 2-bit fields (b = 2, 3) or 4-bit (b = 5, 6); hi plane: the
        # remaining 1 bit (b = 3, 5), 2 bits (b = 6) or none (b = 2).
        lo_bits = 2 if d.bits <= 3 else 4
        out = {"lo": (u8, (rows, -(-cols * lo_bits // 8)))}
        hi_bits = d.bits - lo_bits
        if hi_bits:
            out["hi"] = (u8, (rows, -(-cols * hi_bits // 8)))
        out["scales"] = ((f32, (rows,)) if d.group is None
                         else (f32, (rows, -(-cols // d.group))))
        return out
    if k == "ternary":
        return {"codes": (u8, (rows, (cols + 3) // 4)), "alpha": (f32, (1,))}
    if k == "sparse24":
        nv = 2 * (cols // 4) + min(2, cols % 4)
        return {"values": (f32, (rows, nv)), "indices": (u8, (rows, (nv + 3) // 4))}
    if k == "lowrank":
        return {"a": (f32, (rows, d.r)), "b": (f32, (d.r, cols))}
    if k == "monarch":
        m = math.isqrt(rows)
        return {"w1": (f32, (m, m, m)), "w2": (f32, (m, m, m))}
    if k == "ggml":
        return {"blocks": (u8, (rows, _ggml.row_bytes(d.qtype, cols)))}
    if k == "tucker":
        out = {"core": (f32, tuple(d.ranks))}
        for i, (dd, rr) in enumerate(zip(d.dims, d.ranks)):
            out[f"u{i}"] = (f32, (dd, rr))
        return out
    b = [1] + _tt_ranks(d.modes, d.cap) + [1]
    return {f"core{i}": (f32, (b[i], dm, b[i + 1])) for i, dm in enumerate(d.modes)}


def packed_bytes(rows: int, cols: int, d: Decomp) -> int:
    """Bytes of :func:`pack` for a ``[rows, cols]`` weight, without packing:
    the sum over :func:`layout`'s arrays.

    Equals ``sum(a.nbytes for a in pack(w, d).values())``.
    """
    return sum(dt.itemsize * math.prod(shape) for dt, shape in layout(rows, cols, d).values())


def flops(rows: int, cols: int, d: Decomp) -> int:
    """Multiply-adds per input row of the ``d`` operator of a ``[rows, cols]`` weight."""
    n = rows * cols
    k = d.kind
    if d.lr is not None:
        return flops(rows, cols, d.with_correction(None)) + (rows + cols) * d.lr
    if k in ("dense", "int8", "int4", "int4g", "intn", "ggml"):
        return n
    if k == "ternary":
        return n // 2  # upstream: adds/subtracts only, counted as half a MAC
    if k == "sparse24":
        return rows * (2 * (cols // 4) + min(2, cols % 4))
    if k == "lowrank":
        return (rows + cols) * d.r
    if k == "monarch":
        return 2 * math.isqrt(rows) ** 3
    if k == "tucker":
        (d0, d1, d2), (r0, r1, r2) = d.dims, d.ranks
        return d1 * d2 * r2 + d1 * r1 * r2 + r0 * r1 * r2 + d0 * r0
    return _tt_flops(d.modes, d.cap, rows)


# ───────────────────────────── pack / unpack ─────────────────────────────

def _kern():
    from opscope_nb import kernels
    return kernels


def _quant_codes(w, bits, group, d, gram, factor=None, pick=None):
    """Codes/scales of ``w``: round to nearest, or ``d.rounding`` from ``gram``
    (``factor``: its :func:`~opscope_nb.formats.gptq.gram_factor`, for GPTQ's
    choice of scales; ``pick``: :func:`~opscope_nb.formats.gptq.gptq_validated`'s)."""
    if d.rounding is None:
        return quantize_groups_sym(w, bits, group)
    if gram is None:
        raise GramRequiredError(f"{d.label} chooses its codes from calibration data: pass gram= "
                         f"(H = X.T @ X of the layer's inputs, [cols, cols] or its diagonal; "
                         f"see opscope_nb.profile.calib), or use {d.with_rounding(None).label}.")
    from opscope_nb.formats.gptq import gptq_validated
    codes, scales = gptq_validated(w, gram, bits, group, factor=factor, pick=pick)
    return codes, np.ascontiguousarray(scales.reshape(w.shape[0], -1))


def ggml_importance(gram):
    """The importance vector a ``ggml`` Decomp is packed with: ``diag(gram)``
    as float32 (a ``[cols]`` gram is its own diagonal), ``None`` without a gram.

    ggml's imatrix is the per-column mean of ``x**2`` (``diag(H) / n``); the
    gram does not carry the token count ``n``, so ``diag(H)`` is passed
    unscaled.  ggml's weighted fits (``sum w x l / sum w l**2``, weighted
    error minima) are invariant to a constant factor of the weights, so only
    float32 rounding can differ from passing ``diag(H) / n`` (measured on a
    16x512 Gaussian, importance x1000: Q4_K, Q6_K, Q3_K, Q2_K, IQ4_XS, Q4_1
    byte-identical; Q4_0 1 byte and Q5_K 15 bytes of the codes differ); pass
    :func:`opscope_nb.formats.ggml.quantize`'s ``importance=`` directly for
    bit-identity with a given imatrix.
    """
    if gram is None:
        return None
    g = np.asarray(gram)
    return np.ascontiguousarray(np.diagonal(g) if g.ndim == 2 else g, dtype=np.float32)


def correction_factors(residual, lr, gram=None, *, seed=0) -> tuple:
    """Rank-``lr`` factors ``(u, v)`` with ``u @ v ~ residual`` in the output
    space of ``gram``: the correction a ``+lr`` Decomp stores.

    With ``H = gram / mean(diag gram) + LR_DAMP * I`` and its Cholesky
    factor ``H = L Lᵀ``,
    ``‖(E − u v) L‖_F`` is minimised over rank ``lr`` by the truncated SVD of
    ``E L = P Σ Qᵀ`` (Eckart–Young in the ``L``-weighted norm):
    ``u = P √Σ``, ``v = √Σ Qᵀ L⁻¹``.  That is the calibration inputs' output
    error ``‖(E − u v) Xᵀ‖`` up to the damping, which keeps ``L`` invertible
    and pulls the fit toward the weight-space one on directions the
    calibration text barely excites (held-out text may).  A diagonal gram
    gives ``L = diag(√h)``; no gram (or one that saw no input) ``L = I``, the
    plain truncated SVD of ``E``.  The SVD is
    :func:`opscope_nb.kernels.truncated_svd` at rank ``max(lr, LR_SKETCH)``
    (clamped to ``min(rows, cols)``) with ``seed``; the factors are its
    leading ``lr`` triplets, so corrections of one residual at several ranks
    nest exactly (:func:`correction_basis` computes them once).

    Thread count: without a gram (or with a diagonal one) the factors are the
    same for any thread count (the SVD kernel's exact path; its Krylov path
    for short sides above ``max(128, 4 lr)`` follows
    :func:`opscope_nb.kernels.truncated_svd`); with a full gram the product
    ``E L`` and the triangular solve run in the vendor BLAS, whose rounding
    may move with its thread count (in the last digits; not pinned by a test).

    Parameters
    ----------
    residual : ndarray of shape (rows, cols)
        ``E = W − Q(W)``, finite.
    lr : int
        ``1 <= lr <= min(rows, cols)``.
    gram : ndarray of float64, optional
        Validated (:func:`opscope_nb.formats.gptq.check_gram`): ``[cols, cols]`` or
        its diagonal ``[cols]``.
    seed : int
        Sketch seed of the truncated SVD.

    Returns
    -------
    u : ndarray of int8, shape (rows, lr)
    v : ndarray of int8, shape (lr, cols)
    s : ndarray of float32, shape (lr,)
        ``(u * s) @ v`` is the correction: column ``k`` of the float factor
        ``P √Σ`` and row ``k`` of ``√Σ Qᵀ L⁻¹`` quantised symmetric int8 with
        one scale each (round half away from zero,
        :func:`opscope_nb.kernels.quantize_groups_sym`), ``s[k]`` the product
        of the two scales.  Half the bytes of float16 factors; the int8
        rounding moves the correction by about 0.5 % of its size, two orders
        below what it removes from the residual.
    """
    basis = correction_basis(residual, lr, gram, seed=seed)
    return correction_slice(basis, lr)


def correction_metric(gram):
    """The output-space metric :func:`correction_basis` fits in, once per
    weight: ``("chol", L, float32(L))`` with ``L Lᵀ = gram / mean(diag) + LR_DAMP * I``,
    ``("diag", √(h / mean(h) + LR_DAMP))`` for a diagonal gram, or ``None``
    (weight space: no gram, or one whose diagonal is all zero)."""
    if gram is None:
        return None
    g = np.asarray(gram, dtype=np.float64)
    diag = g if g.ndim == 1 else np.diagonal(g)
    mean = float(diag.mean()) if diag.size else 0.0
    if not mean > 0.0:          # no input ever reached this layer: weight space
        return None
    if g.ndim == 1:
        return ("diag", np.sqrt(g / mean + LR_DAMP))
    h = g / mean
    h[np.diag_indices(h.shape[0])] += LR_DAMP
    chol = np.linalg.cholesky(h)
    return ("chol", chol, chol.astype(np.float32))


def correction_basis(residual, lr, gram=None, *, seed=0, metric=None) -> tuple:
    """The float64 factors ``(u, v)`` of :func:`correction_factors` for every
    triplet of its SVD (rank ``min(max(lr, LR_SKETCH), rows, cols)``): slice
    them with :func:`correction_slice` for any rank ``<= lr`` (the same
    values :func:`correction_factors` gives for that rank).  ``metric``:
    :func:`correction_metric` of ``gram`` when already computed."""
    e = np.ascontiguousarray(residual, dtype=np.float64)
    rows, cols = e.shape
    k = min(max(int(lr), LR_SKETCH), rows, cols)
    if metric is None:
        metric = correction_metric(gram)
    if metric is None:
        a = e
    elif metric[0] == "diag":
        a = e * metric[1]
    else:       # the SVD runs in float32 anyway: so does the product feeding it
        a = e.astype(np.float32) @ metric[2]
    u, s, vt = _kern().truncated_svd(np.ascontiguousarray(a, dtype=np.float32), k, seed)
    root = np.sqrt(np.asarray(s, dtype=np.float64))
    uf = np.asarray(u, dtype=np.float64) * root
    vf = root[:, None] * np.asarray(vt, dtype=np.float64)
    if metric is not None and metric[0] == "diag":
        vf = vf / metric[1]
    elif metric is not None:
        from scipy.linalg import solve_triangular
        # v L = √Σ Qᵀ  <=>  Lᵀ vᵀ = Q √Σ (all k rows at once: slices stay identical)
        vf = solve_triangular(metric[1], vf.T, lower=True, trans="T").T
    return uf, vf


def correction_slice(basis, lr) -> tuple:
    """The leading ``lr`` factors of a :func:`correction_basis`, packed:
    ``(u int8 [rows, lr], v int8 [lr, cols], s float32 [lr])``."""
    uf, vf = basis
    ucodes, uscale = quantize_groups_sym(
        np.ascontiguousarray(uf[:, :lr].T, dtype=np.float32), 8, uf.shape[0])
    vcodes, vscale = quantize_groups_sym(
        np.ascontiguousarray(vf[:lr], dtype=np.float32), 8, vf.shape[1])
    s = (uscale[:, 0].astype(np.float64) * vscale[:, 0]).astype(np.float32)
    return np.ascontiguousarray(ucodes.T), vcodes, s


def _pack(w, d: Decomp, svd=None, gram=None, factor=None, pick=None):
    """Pack a validated ``w``; ``svd`` optionally supplies ``(U, S, Vt)``;
    ``gram`` is the calibration gram a ``rounding="gptq"`` Decomp needs (and
    a ``+lr`` correction is fitted with); ``factor`` its low-rank factor
    (:func:`~opscope_nb.formats.gptq.gram_factor`) when known; ``pick`` GPTQ's
    clipping choice (:func:`~opscope_nb.formats.gptq.gptq_validated`)."""
    if d.lr is not None:
        base = d.with_correction(None)
        out = _pack(w, base, svd, gram)
        resid = w.astype(np.float64) - unpack(out, base, w.shape)
        out["lr_u"], out["lr_v"], out["lr_s"] = correction_factors(resid, d.lr, gram,
                                                                   seed=d.seed)
        return out
    rows, cols = w.shape
    k = d.kind
    if k == "dense":
        return {"w": w.copy()}
    if k in ("int8", "int4", "int4g"):
        bits = 8 if k == "int8" else 4
        group = d.group if k == "int4g" else cols
        codes, scales = _quant_codes(w, bits, group, d, gram, factor, pick)
        if k != "int4g":
            scales = np.ascontiguousarray(scales[:, 0])
        if bits == 4:
            codes = pack_nibbles(codes)
        return {"codes": codes, "scales": scales}
    if k == "intn":
        group = cols if d.group is None else d.group
        codes, scales = _quant_codes(w, d.bits, group, d, gram, factor, pick)
        if d.group is None:
            scales = np.ascontiguousarray(scales[:, 0])
        lo, hi = pack_intn(codes, d.bits)
        if d.bits == 2:
            return {"lo": lo, "scales": scales}
        return {"lo": lo, "hi": hi, "scales": scales}
    if k == "ternary":
        codes, alpha = ternary_twn(w)
        crumbs = (codes.view(np.uint8) & np.uint8(3))  # -1 -> 3, 0 -> 0, 1 -> 1
        return {"codes": pack_crumbs(np.ascontiguousarray(crumbs)),
                "alpha": np.array([alpha], dtype=np.float32)}
    if k == "sparse24":
        values, slots = nm_prune(w, 2, 4)
        return {"values": values, "indices": pack_crumbs(slots)}
    if k == "lowrank":
        if svd is None:
            rr = d.svd_rank or d.r
            svd = _kern().truncated_svd(w, rr, d.seed)
        u, s, vt = svd
        a = np.ascontiguousarray(u[:, :d.r], dtype=np.float32)
        b = np.ascontiguousarray(s[:d.r, None] * vt[:d.r], dtype=np.float32)
        return {"a": a, "b": b}
    if k == "ggml":
        if d.rounding is not None:
            if gram is None:
                raise GramRequiredError(
                    f"{d.label} chooses its codes from calibration data: pass gram= (H = "
                    f"X.T @ X of the layer's inputs, [cols, cols]; see "
                    f"opscope_nb.profile.calib), or use {d.with_rounding(None).label}.")
            return {"blocks": _ggml._gptq_blocks(w, d.qtype, gram)}
        return {"blocks": _ggml.quantize(w, d.qtype, importance=ggml_importance(gram))}
    if k == "monarch":
        w1, w2 = _kern().monarch_project(w)
        return {"w1": np.ascontiguousarray(w1, dtype=np.float32),
                "w2": np.ascontiguousarray(w2, dtype=np.float32)}
    if k == "tucker":
        x3 = np.ascontiguousarray(w.reshape(d.dims))
        core, facs = _kern().tucker_hosvd(x3, np.asarray(d.ranks, dtype=np.int64))
        out = {"core": np.ascontiguousarray(core, dtype=np.float32)}
        for i, u in enumerate(facs):
            out[f"u{i}"] = np.ascontiguousarray(u, dtype=np.float32)
        return out
    flat, shapes = _kern().tt_svd_flat(np.ascontiguousarray(w.reshape(-1), dtype=np.float32),
                                       np.asarray(d.modes, dtype=np.int64), d.cap)
    return {f"core{i}": c for i, c in enumerate(_kern()._tt._split_cores(flat, shapes))}


def unpack(packed: dict, d: Decomp, shape) -> np.ndarray:
    """Dense ``[rows, cols]`` float32 reconstruction from :func:`pack` arrays.

    Parameters
    ----------
    packed : dict of str -> ndarray
        As returned by :func:`pack` for the same ``d``.
    d : Decomp
    shape : tuple of int
        ``(rows, cols)`` of the original weight.

    Returns
    -------
    ndarray of shape (rows, cols), float32, C-contiguous
    """
    rows, cols = (int(shape[0]), int(shape[1]))
    k = d.kind
    if d.lr is not None:
        out = unpack(packed, d.with_correction(None), shape)
        out += correction_product(packed["lr_u"], packed["lr_v"], packed["lr_s"])
        return out
    if k == "dense":
        out = packed["w"]
    elif k == "int8":
        out = dequantize_groups(packed["codes"], packed["scales"].reshape(rows, 1), cols)
    elif k in ("int4", "int4g"):
        group = d.group if k == "int4g" else cols
        out = dequantize_nibbles(packed["codes"], packed["scales"].reshape(rows, -1),
                                 group, cols)
    elif k == "intn":
        group = cols if d.group is None else d.group
        lo = packed["lo"]
        hi = packed["hi"] if d.bits != 2 else np.zeros((rows, 0), dtype=np.uint8)
        out = dequantize_intn(lo, hi, packed["scales"].reshape(rows, -1), d.bits,
                              max(group, 1), cols)
    elif k == "ternary":
        out = ternary_decode(packed["codes"], packed["alpha"][0], cols)
    elif k == "sparse24":
        nv = packed["values"].shape[1]
        out = nm_unprune(packed["values"], unpack_crumbs(packed["indices"], nv), cols, 2, 4)
    elif k == "lowrank":
        out = packed["a"] @ packed["b"]
    elif k == "monarch":
        out = _kern().monarch_reconstruct(packed["w1"], packed["w2"])
    elif k == "ggml":
        out = _ggml.dequantize(packed["blocks"], d.qtype, (rows, cols))
    elif k == "tucker":
        facs = (packed["u0"], packed["u1"], packed["u2"])
        out = _kern().tucker_reconstruct(packed["core"], facs).reshape(rows, cols)
    else:
        cores = [packed[f"core{i}"] for i in range(len(d.modes))]
        out = _kern().tt_reconstruct_flat(*_kern()._tt._join_cores(cores)).reshape(rows, cols)
    return np.ascontiguousarray(out, dtype=np.float32)


def correction_product(u, v, s) -> np.ndarray:
    """``(u * s) @ v`` of packed correction factors (int8 ``u`` [rows, r],
    int8 ``v`` [r, cols], float32 ``s`` [r]) in float32: ``[rows, cols]``.

    NumPy's own ``einsum`` loop rather than BLAS: a threaded sgemm may round
    differently with the thread count, and :func:`unpack` / the profile's
    errors must not (``rows * cols * r`` MACs, ``r <= 32``)."""
    return np.einsum("ik,kj->ij", np.asarray(u, dtype=np.float32) * s,
                     np.asarray(v, dtype=np.float32), optimize=False)


def pack(w, decomp: Decomp, *, gram=None) -> dict:
    """The arrays a kernel would hold for ``decomp`` of ``w`` (see the module
    docstring for every layout).

    Parameters
    ----------
    w : array_like of shape (rows, cols)
        ``[out_features, in_features]``; converted to float32, must be finite.
    decomp : Decomp
    gram : array_like, optional
        ``[cols, cols]`` (or ``[cols]`` diagonal) second moment of the layer's
        inputs; required by ``+gptq`` decompositions (``ValueError`` without);
        a ``ggml`` Decomp takes its diagonal as ggml's importance vector
        (:func:`ggml_importance`; without a gram ggml's reference quantiser
        runs); a ``+lr`` correction is fitted in its output space
        (:func:`correction_factors`; weight space without); ignored by the
        others.

    Returns
    -------
    dict of str -> ndarray
        Their total ``nbytes`` is the option's ``bytes``.
    """
    w = as_matrix(w, "w")
    if not isinstance(decomp, Decomp):
        raise TypeError(f"decomp must be a Decomp; got {type(decomp).__name__}. "
                        f"Use e.g. Decomp.int8() or Decomp.from_label('int8/chan').")
    check_applicable(*w.shape, decomp)
    if gram is not None and decomp.reads_gram:
        from opscope_nb.formats.gptq import check_gram
        gram = check_gram(gram, w.shape[1])
    return _pack(w, decomp, gram=gram)


def approximate(w, decomp: Decomp, *, gram=None) -> np.ndarray:
    """``unpack(pack(w, decomp))``: the weight the compressed kernel computes with.

    Parameters
    ----------
    w : array_like of shape (rows, cols)
        ``[out_features, in_features]``.
    decomp : Decomp
    gram : array_like, optional
        As for :func:`pack` (required by ``+gptq`` decompositions).

    Returns
    -------
    ndarray of shape (rows, cols), float32
    """
    w = as_matrix(w, "w")
    return unpack(pack(w, decomp, gram=gram), decomp, w.shape)


def nbytes(packed: dict) -> int:
    """Total ``nbytes`` of a dict of packed arrays."""
    return int(sum(a.nbytes for a in packed.values()))
