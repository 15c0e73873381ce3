"""Per-layer decomposition mining: every compression option, its true error and
its honest size.

A weight ``w`` is a PyTorch ``Linear`` weight, ``[out_features, in_features]``
= ``[rows, cols]``, float32; a *channel* is a row.  :func:`profile_layer`
evaluates each applicable :class:`Decomp` and records a :class:`DecompOption`:

* ``rel_err`` is the true relative Frobenius error of the reconstruction
  ``approximate(w, decomp)`` (float64 sums, 0 for an all-zero ``w``);
* ``bytes`` is exactly the total ``nbytes`` of the arrays :func:`pack` returns,
  i.e. everything a kernel holds at run time (codes, float32 scales, indices,
  factors);
* ``flops`` is multiply-adds per input row (one ``x[cols] -> y[rows]`` product).

:func:`approximate` is ``unpack(pack(w, d))``, the same code path
:func:`profile_layer` measures, so a reported ``rel_err`` can always be
re-checked.

The option data model and packed layouts (:class:`Decomp`, :func:`pack`,
:func:`unpack`, :func:`approximate`, :func:`packed_bytes`, the layout table)
live in :mod:`opscope_nb.formats` and are re-exported here.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import re
import time
from dataclasses import dataclass, field

import numpy as np

from opscope_nb._validation import as_matrix, check_int
from opscope_nb.formats import (
    INTN_BITS,
    KINDS,
    ROUNDINGS,
    Decomp,
    approximate,
    balanced_factor,
    check_applicable,
    flops,
    layout,
    nbytes,
    pack,
    packed_bytes,
    unpack,
)
from opscope_nb.formats import (
    LR_KINDS,
    LR_SKETCH,
    _pack,
    correction_basis,
    correction_metric,
    correction_product,
    correction_slice,
)
from opscope_nb.formats.ggml import GGML_TYPES, row_bytes
from opscope_nb.formats.gptq import (check_gram, output_energy, output_error, output_ratio,
                                     pinned_gram)
from opscope_nb.kernels._quant_probe import rel_err as _rel_err
from opscope_nb.kernels._krylov import truncated_svd
from opscope_nb.runtime._packed import PackedLinear, check_ms, measure_latency

__all__ = [
    "stored_bytes",
    "LR_RANKS",
    "quant_menu",
    "structured_menu",
    "lowrank_ranks",
    "DecompOption",
    "LayerProfile",
    "QuantStat",
    "profile_layer",
    "ggml_menu",
    "quant_stat",
    "parse_layer_kind",
]


#: Ranks of the ``+lr`` corrections :func:`profile_layer` offers by default.
LR_RANKS = (8, 16, 32)
#: Most columns of the gram factor a sampled profile computes ``out_err`` with
#: (a gram of more calibration rows than this uses ``H`` itself).
FACTOR_MAX_RANK = 1024


@dataclass(frozen=True)
class DecompOption:
    """One measured option: decomposition, true error, honest bytes, MACs/row.

    ``latency_us`` maps a batch size ``m`` to the measured wall time (µs) of
    the option's :class:`~opscope_nb.runtime.PackedLinear` call on ``[m, cols]``
    input on this machine (``profile_layer(..., latency=(1, 32))``); empty when
    not measured.  Not part of equality or hash.  In JSON its keys are strings;
    :meth:`from_dict` restores int keys.

    ``out_err`` is the relative output error on calibration inputs,
    ``sqrt(tr(dW H dWᵀ) / tr(W H Wᵀ))`` (:func:`opscope_nb.formats.gptq.output_error`);
    ``None`` when the layer was profiled without a gram.  Not part of
    equality or hash.

    ``rel_err_se`` / ``out_err_se`` are the standard errors of ``rel_err`` /
    ``out_err`` when they are estimates from a row sample
    (:mod:`opscope_nb.profile.sampling`, ``LayerProfile.sample``); ``None``
    when every row was measured.  Not part of equality or hash.
    """

    decomp: Decomp
    rel_err: float
    bytes: int
    flops: int
    latency_us: dict = field(default_factory=dict, compare=False)
    out_err: float | None = field(default=None, compare=False)
    rel_err_se: float | None = field(default=None, compare=False)
    out_err_se: float | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return self.decomp.label

    def to_dict(self) -> dict:
        return {"decomp": self.decomp.to_dict(), "label": self.decomp.label,
                "rel_err": float(self.rel_err), "bytes": int(self.bytes),
                "flops": int(self.flops),
                "latency_us": {str(int(k)): float(v) for k, v in
                               sorted(self.latency_us.items())},
                "out_err": None if self.out_err is None else float(self.out_err),
                **({} if self.rel_err_se is None else {"rel_err_se": float(self.rel_err_se)}),
                **({} if self.out_err_se is None else {"out_err_se": float(self.out_err_se)})}

    @classmethod
    def from_dict(cls, d: dict) -> "DecompOption":
        lat = {int(k): float(v) for k, v in (d.get("latency_us") or {}).items()}
        oe, se, ose = d.get("out_err"), d.get("rel_err_se"), d.get("out_err_se")
        return cls(Decomp.from_dict(d["decomp"]), float(d["rel_err"]), int(d["bytes"]),
                   int(d["flops"]), lat, None if oe is None else float(oe),
                   None if se is None else float(se), None if ose is None else float(ose))


@dataclass
class LayerProfile:
    """Every applicable option of one weight.

    Attributes
    ----------
    name : str
    rows, cols : int
        ``[out_features, in_features]``.
    dense_bytes : int
        Bytes of the weight **as the source stores it**
        (:func:`stored_bytes` of ``stored_dtype``): the reference of budget
        fractions, ``compression`` and the plan tables.  The float32 figure
        is :attr:`f32_bytes`.
    options : list of DecompOption
        ``options[0]`` is dense: the weight as stored, priced at
        ``dense_bytes`` (what ``apply`` writes for it).
    timings : dict of str -> float
        Seconds spent per part of :func:`profile_layer` (``quant``,
        ``ternary``, ``sparse``, ``svd``, ``lowrank``, ``monarch``,
        ``tucker``, ``tt``).
    sensitivity : float or None
        How much the model's final output moves per unit of this layer's
        squared relative output error (``d metric / d out_err**2``, measured
        by :func:`opscope_nb.profile.calib.layer_sensitivity`); ``None`` without
        calibration.
    stored_dtype : str
        How the source stores the weight: ``F32``, ``F16``, ``BF16`` or a
        GGUF block type (``Q8_0``, ``Q4_1`` ...).
    sensitivity_val : float or None
        The same probe on the calibration text's held-out part (``profile
        --calib --validate``): how well :attr:`sensitivity` carries over to
        text it was not measured on.  Reported, never used by the objective.
    prior_weight : float
        Data-free weight of this layer's term in the output objective
        (``allocate``'s ``output`` objective, and layers the ``sensitivity``
        objective has no measured sensitivity for); 1 for most layers.  The
        command line sets it for a decoder's output head (the logits
        projection, or the token embedding when the head is tied to it):
        :func:`opscope_nb.models.loader.output_head`; and, without
        calibration, for an encoder's word embedding:
        :func:`opscope_nb.models.loader.word_embedding`.  A measured
        :attr:`sensitivity` replaces it.
    sample : dict or None
        The row sample the row-wise options' errors were estimated from
        (``{"rows": n, "of": rows, "seed": s, "design": "stratified"}``;
        ``"grown": {label: n_label}`` names the options that ``"auto"``
        measured on more rows than ``n``; ``"certain": k`` the rows measured
        besides the ``n`` strata, each holding more than a stratum's share of
        the weight's or output's energy; :mod:`opscope_nb.profile.sampling`),
        None when every row was measured.
    act_err : dict or None
        The relative output error llama.cpp's CPU matmul adds by rounding this
        layer's input to each activation type (``{"F16": ..., "BF16": ...,
        "Q8_0": ..., "Q8_K": ...}``, the types the row length allows;
        :func:`activation_errors`), measured on the calibration tokens; None
        without calibration.  The allocators' ``act_quant="ggml"`` adds the
        option's type's value to its ``out_err`` (as squares).
    lookup : dict or None
        A token-embedding table's role as a lookup (its rows enter the
        residual stream), measured on the calibration tokens: ``err`` (per
        option, in order: the relative error of the looked-up rows, each row
        weighted by how often it is looked up,
        ``sqrt(sum_r c_r |w_r - ŵ_r|² / sum_r c_r |w_r|²)``; None for an
        option that is not row-wise), ``tokens`` and ``rows`` (looked-up
        tokens, distinct rows), ``sensitivity`` (and ``sensitivity_val``):
        the lookup probe's (:attr:`opscope_nb.profile.calib.Calibration.lookup_sensitivity`),
        None when not measured.  The output objectives add
        ``sensitivity x err²`` to the layer's term (a tied head's error and
        its lookup's are about independent: on Gemma 3 270M at IQ4_NL the
        two alone cost KL 0.052 and 0.068, both together 0.116).  None for
        every other layer.
    """

    name: str
    rows: int
    cols: int
    dense_bytes: int
    options: list
    timings: dict = field(default_factory=dict)
    sensitivity: float | None = None
    stored_dtype: str = "F32"
    sensitivity_val: float | None = None
    prior_weight: float = 1.0
    sample: dict | None = None
    act_err: dict | None = None
    lookup: dict | None = None

    @property
    def f32_bytes(self) -> int:
        """``4 * rows * cols``: the weight in float32 (the ``dense`` option)."""
        return 4 * int(self.rows) * int(self.cols)

    def dense(self) -> DecompOption:
        """The dense baseline (``options[0]``)."""
        return self.options[0]

    def best_within(self, err_budget: float) -> DecompOption:
        """Fewest bytes among options with ``rel_err <= err_budget`` (first
        wins ties); the dense option when none qualifies."""
        best = None
        for o in self.options:
            if o.rel_err <= err_budget and (best is None or o.bytes < best.bytes):
                best = o
        return self.options[0] if best is None else best

    def to_dict(self) -> dict:
        return {"name": self.name, "rows": int(self.rows), "cols": int(self.cols),
                "dense_bytes": int(self.dense_bytes),
                "options": [o.to_dict() for o in self.options],
                "timings": {k: float(v) for k, v in self.timings.items()},
                "sensitivity": None if self.sensitivity is None else float(self.sensitivity),
                "stored_dtype": self.stored_dtype, "f32_bytes": self.f32_bytes,
                **({} if self.sensitivity_val is None
                   else {"sensitivity_val": float(self.sensitivity_val)}),
                **({} if self.prior_weight == 1.0
                   else {"prior_weight": float(self.prior_weight)}),
                **({} if self.sample is None else {"sample": dict(self.sample)}),
                **({} if not self.act_err else
                   {"act_err": {k: float(v) for k, v in self.act_err.items()}}),
                **({} if not self.lookup else {"lookup": _lookup_json(self.lookup)})}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerProfile":
        """The profile of :meth:`to_dict`.  A profile written before dense was
        priced as stored (its dense option at float32 bytes, ``dense_bytes``
        smaller) gets its dense option re-priced at ``dense_bytes``: what
        ``apply`` writes for it."""
        sens, sv = d.get("sensitivity"), d.get("sensitivity_val")
        opts = [DecompOption.from_dict(o) for o in d["options"]]
        rows, cols, db = int(d["rows"]), int(d["cols"]), int(d["dense_bytes"])
        if (opts and opts[0].decomp.kind == "dense" and opts[0].bytes == 4 * rows * cols
                and db < opts[0].bytes):
            import dataclasses
            opts[0] = dataclasses.replace(opts[0], bytes=db)
        return cls(str(d["name"]), rows, cols, db,
                   opts,
                   {k: float(v) for k, v in d.get("timings", {}).items()},
                   None if sens is None else float(sens), str(d.get("stored_dtype", "F32")),
                   None if sv is None else float(sv),
                   check_prior_weight(d.get("prior_weight", 1.0)),
                   dict(d["sample"]) if d.get("sample") else None,
                   {str(k): float(v) for k, v in d["act_err"].items()}
                   if d.get("act_err") else None,
                   _lookup_json(d["lookup"], len(opts)) if d.get("lookup") else None)


def _lookup_json(lk, n_options=None) -> dict:
    """:attr:`LayerProfile.lookup` with plain JSON types (``n_options``: the
    count its ``err`` must have)."""
    def f(v):
        return None if v is None else float(v)
    if n_options is not None and len(lk["err"]) != n_options:
        raise ValueError(f"lookup err has {len(lk['err'])} values for {n_options} options: "
                         f"the profile is damaged; profile the layer again.")
    out = {"err": [f(v) for v in lk["err"]], "tokens": int(lk["tokens"]),
           "rows": int(lk["rows"])}
    for k in ("sensitivity", "sensitivity_val"):
        if lk.get(k) is not None:
            out[k] = float(lk[k])
    return out


def check_prior_weight(value) -> float:
    """``value`` as a :attr:`LayerProfile.prior_weight`: a finite float ``> 0``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"prior_weight must be a real number; got {type(value).__name__} "
                        f"{value!r}.")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"prior_weight must be finite and > 0 (1 leaves the layer as it "
                         f"is); got {value!r}.")
    return v


# ───────────────────────────── profiling ─────────────────────────────

#: Bytes per element of the plain stored dtypes (safetensors names).
_PLAIN_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def stored_bytes(dtype: str, rows: int, cols: int) -> int:
    """Bytes a ``[rows, cols]`` weight takes as the source stores it.

    Parameters
    ----------
    dtype : str
        ``F32``, ``F16``, ``BF16``, ``F64`` or a GGUF block type name
        (``Q8_0``, ``Q4_K`` ...: whole blocks per row,
        :func:`opscope_nb.formats.ggml.row_bytes`).

    Raises
    ------
    ValueError
        An unknown dtype, or a block type whose block does not divide ``cols``.
    """
    d = str(dtype).upper()
    if d in _PLAIN_BYTES:
        return _PLAIN_BYTES[d] * int(rows) * int(cols)
    if d in GGML_TYPES:
        return int(rows) * row_bytes(d, int(cols))
    try:  # other GGUF types (IQ2_XXS ...): gguf-py's size table
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        block, nb = GGML_QUANT_SIZES[GGMLQuantizationType[d]]
        if int(cols) % block == 0:
            return int(rows) * (int(cols) // block) * nb
    except (ImportError, KeyError):
        pass
    raise ValueError(f"stored dtype {dtype!r} is not one of {sorted(_PLAIN_BYTES)} or a GGUF "
                     f"block type ({', '.join(GGML_TYPES)}); pass the dtype the source "
                     f"stores the weight in (TensorEntry.dtype).")


def _int_seq(v, name, what, example):
    """Deduplicated list of positive ints from a sequence (order kept)."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints ({what}); got {v!r}. "
                        f"Pass e.g. {example} or {name}=().")
    out = []
    for x in v:
        x = check_int(x, f"{name}[i]", 1)
        if x not in out:
            out.append(x)
    return out


def profile_layer(name, w, *, rank_cap=48, groups=(32, 128), seed=0,
                  latency=None, intn_bits=(6, 5, 3), int2_groups=(32,), gram=None,
                  gptq=True, sensitivity=None, stored_dtype="F32", menu="default",
                  ggml_types=None, lr_ranks=LR_RANKS, prior_weight=1.0,
                  requantize=False, sample_rows="all", gram_heldout=None,
                  act_sq=None, lookup=None) -> LayerProfile:
    """Measure every applicable compression option of one weight.

    Options, in order: dense (the weight as the source stores it, at its
    stored bytes: what ``apply`` writes for it); BF16, F16 and the stored ggml
    block type (:func:`quant_menu`; *as stored*, see ``requantize``); then the quantisation ladder by decreasing bits
    -- int8/chan; int6/chan, int6/g{g}; int5/chan, int5/g{g}; int4/chan,
    int4/g{g}; int3/chan, int3/g{g}; int2/g{g2} -- where ``g`` runs over
    ``groups`` and ``g2`` over ``int2_groups`` in the given order, a group
    option only when ``cols > g`` (at least two groups; a short last group is
    packed with its own scale), and int6/int5/int3 only for the widths in
    ``intn_bits``; each quantised option (and each ``+gptq`` twin) followed
    by its ``+lr{r}`` composites for ``r`` in ``lr_ranks`` -- the codes plus
    a rank-``r`` int8 correction of the residual, fitted in the gram's
    output space (weight space without a gram;
    :func:`opscope_nb.formats.correction_factors`) -- when ``r <= min(rows,
    cols)`` and the composite takes fewer bytes than the stored weight; then
    ternary; sparse2:4; low-rank at the smallest ranks holding 90 / 99 / 99.9
    % of the energy of the top ``min(rank_cap, rows, cols)`` singular values (one truncated SVD serves
    all; deduplicated; only when ``(rows + cols) r < rows cols``); Monarch when
    square with a perfect-square side; Tucker of the view ``[rows, c1, c2]``
    (``c1 * c2 = cols`` balanced) with ranks ``(min(rows // 2, 32, cols),
    c1 // 2, c2 // 2)`` clamped to ``>= 1``, when it compresses; TT over
    ``[r1, r2, c1, c2]`` (balanced factors of rows and cols, all ``> 1``), bond
    cap 16, when it compresses.

    Parameters
    ----------
    name : str
    w : array_like of shape (rows, cols)
        ``[out_features, in_features]`` (PyTorch Linear layout); float16/64
        are computed in float32; must be finite.
    rank_cap : int
        Rank of the one truncated SVD (``>= 1``).
    groups : sequence of int
        Group lengths for group-wise int4, int3, int5 and int6.
    seed : int
        Seed of the truncated SVD sketch.
    latency : sequence of int, optional
        Batch sizes ``m`` at which to time each option's
        :class:`~opscope_nb.runtime.PackedLinear` call on this machine (warm,
        best block median: :func:`opscope_nb.runtime.measure_latency`), stored
        in ``DecompOption.latency_us`` as ``{m: µs}``.  ``None``: not measured
        (empty dicts).
    intn_bits : sequence of int
        Which of the ``intn`` widths 3, 5, 6 to offer (per channel and per
        group); ``()`` gives the int8/int4-only menu.
    int2_groups : sequence of int
        Group lengths of the group-wise int2 options (``()``: none).
    gram : array_like, optional
        Calibration second moment of the layer's inputs, ``H = X.T @ X``
        ``[cols, cols]`` float64, or its diagonal ``[cols]``
        (:func:`opscope_nb.formats.gptq.check_gram`: shape, finite, symmetric PSD
        within 1e-6 relative, else ``ValueError``).  With it every option gets
        ``out_err`` and, when ``gram`` is 2-D and ``gptq`` is true, each
        quantised option (int8/chan, int6/int5/int4/int3 per channel and per
        group, int2/g) is followed by its ``+gptq`` twin (same layout and
        bytes, codes from :func:`opscope_nb.formats.gptq.gptq_quantize`).  A diagonal
        gram gives no ``+gptq`` options (GPTQ with a diagonal Hessian is round
        to nearest).
    gptq : {"int", "all", "none"} or bool
        Which ``+gptq`` twins to offer when a 2-D ``gram`` is given: ``"int"``
        (or True, the default) those of int8 ... int2; ``"all"`` those and
        each ggml type's (:func:`ggml_menu`); ``"none"`` (or False) none.
        The ggml twins are asked for: their measured gain holds on text like
        the calibration text and shrinks on other text, and the allocator
        trusts it fully (docs/performance.md, "GPTQ codes in the ggml types").
    gram_heldout : array_like, optional
        The part of a 2-D ``gram`` summed over held-out calibration tokens
        (:meth:`opscope_nb.profile.calib.CalibrationStream.heldout`: every
        other sequence), ``[cols, cols]`` float64.  The ``+gptq`` twins (and
        their ``+lr`` composites) are then fitted on ``gram - gram_heldout``
        and their ``out_err`` is measured on ``gram_heldout``, tokens their
        codes never saw; every other option is measured on ``gram``.  GPTQ
        minimises the error on its own tokens, so priced there a twin looks
        better than it is on new text.  ``apply`` fits the twin on all of
        ``gram`` (more tokens: its error on new text is not above the price,
        in expectation).  Ignored (twins priced on ``gram``) when either half
        holds no token.
    sensitivity : float, optional
        Stored as ``LayerProfile.sensitivity`` (finite, ``>= 0``).
    stored_dtype : str
        How the source stores ``w`` (``F32``, ``F16``, ``BF16`` or a GGUF
        block type): ``LayerProfile.dense_bytes`` is :func:`stored_bytes` of
        it, and structured options are offered only when they take fewer
        bytes than that.  The dense option is priced at these bytes (``apply``
        copies a planned-dense tensor as stored), not at float32's.  A ggml
        block type this package packs (``Q4_K``, ``Q4_1`` ...) whose block
        divides ``cols`` is also offered in every menu under its own name
        *as stored*: error exactly 0 (``out_err`` 0 with a gram) at the
        stored bytes, and ``apply`` copies the stored blocks unchanged
        (llama-quantize's rule for a tensor already in its target type).
    menu : {"default", "ggml", "mixed"}
        ``"default"``: the menu above.  ``"ggml"``: dense, then the ggml
        (llama.cpp / GGUF) block types of :func:`ggml_menu` (``ggml_types``);
        the other menu arguments are ignored.  ``"mixed"``: the default menu,
        then the ggml types it does not hold yet (every one runs in
        :class:`~opscope_nb.runtime.PackedLinear`; only a plan of ggml types
        exports to GGUF).  The asymmetric K-quants help most on a quantised
        source: on SmolLM2's Q4_1 weights, Q4_K (4.5 bits) keeps a relative
        error of 0.018 where int4/chan has 0.16.  With a ``gram`` each ggml type
        is packed with its diagonal as ggml's importance
        (:func:`opscope_nb.formats.ggml_importance`) and gets ``out_err``.
    ggml_types : sequence of str, optional
        The ggml types :func:`ggml_menu` may offer (``None``: its default set).
    lr_ranks : sequence of int
        Ranks of the ``+lr`` composites (default :data:`LR_RANKS` = 8, 16,
        32; ``()``: none).  Ignored by ``menu="ggml"``.
    prior_weight : float
        Stored as ``LayerProfile.prior_weight`` (finite, ``> 0``; default 1).
    requantize : bool
        Measure the stored ggml block type as a re-quantisation of the
        dequantised weight (its true error; ``apply`` then re-quantises, as
        llama-quantize's ``--allow-requantize``) instead of offering it as
        stored; it is then offered only when the menu holds the type.  The
        dense option stays the as-stored copy.
    sample_rows : {"all", "auto"} or int
        ``"all"`` (default): every option measured on every row.  ``"auto"``
        or a number of rows ``n``: the options that quantise each row on its
        own (dense, BF16/F16, int8 .. int2 with their ``+gptq`` twins, the
        ggml types, 2:4) get ``rel_err`` and ``out_err`` estimated from a
        stratified row sample (:mod:`opscope_nb.profile.sampling`; ``"auto"``:
        at least 256 rows, enough for a 95 % interval within ±1 % of each
        error, every row for tensors under 1 M weights), with their standard
        errors in ``rel_err_se`` / ``out_err_se`` and the sample in
        ``LayerProfile.sample`` (``n`` of at least half the rows: every row); ``out_err`` then comes from a low-rank factor
        of the gram when it has one (:func:`opscope_nb.formats.gptq.gram_factor`:
        ``rows x cols x t`` float32 GEMMs instead of ``rows x cols²``).  The
        other options (ternary's one scale, low-rank, Monarch, Tucker, TT) are
        fitted to every row and their ``rel_err`` is exact (``rel_err_se``
        0); with that factor their ``out_err`` comes from the sample's rows
        too (``"auto"``: from every row when its interval is wider than the
        target, both standard errors then None).  The ``+lr`` composites are
        not offered on a sampled tensor (their correction is fitted to every
        row of the residual).  A ``+gptq`` option's choice between clipped and
        unclipped scales is made on the pilot's rows and kept for the rows a
        grown sample adds (``apply`` chooses on every row: the two differ only
        where the candidates' errors nearly tie).  Bytes and flops are exact
        either way.  ``latency`` still
        packs every row of each option to time it.
    act_sq : dict of str -> array_like, optional
        Per llama.cpp activation type (``"F16"``, ``"BF16"``, ``"Q8_0"``,
        ``"Q8_K"``), the input rounding summed over the calibration tokens of
        ``gram`` (float64 ``[cols]``,
        :meth:`opscope_nb.profile.calib.CalibrationStream.act_sq`): gives
        :attr:`LayerProfile.act_err`.  Needs ``gram``.
    lookup : (array_like, array_like), optional
        For a token-embedding table: the rows the calibration tokens look up
        (int ``[k]``, distinct, in ``[0, rows)``) and how often (float
        ``[k]``, > 0; :meth:`opscope_nb.profile.calib.CalibrationStream.lookup`).
        Each row-wise option's rows are quantised as for the weight (same
        gram, same GPTQ choices) to give :attr:`LayerProfile.lookup` (its
        ``sensitivity`` is set later, from the whole model's sweep).

    Returns
    -------
    LayerProfile
        ``timings`` holds seconds per part (``lr`` for the composites'
        fits, ``latency`` when measured, ``gptq`` and ``out_err`` with a gram).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}.")
    w = as_matrix(w, "w")
    rank_cap = check_int(rank_cap, "rank_cap", 1)
    seed = check_int(seed, "seed", 0)
    gs = _int_seq(groups, "groups", "group lengths along a row", "groups=(32, 128)")
    g2s = _int_seq(int2_groups, "int2_groups", "int2 group lengths", "int2_groups=(32,)")
    nbits = _int_seq(intn_bits, "intn_bits", "intn code widths", "intn_bits=(6, 5, 3)")
    lrs = _int_seq(lr_ranks, "lr_ranks", "ranks of the low-rank corrections",
                   "lr_ranks=(8, 16, 32) or lr_ranks=()")
    for b in nbits:
        if b not in (3, 5, 6):
            raise ValueError(f"intn_bits entries must be 3, 5 or 6 (int4/int8 are always in "
                             f"the menu, int2 is set by int2_groups); got {b}. Pass e.g. "
                             f"intn_bits=(6, 5, 3) or intn_bits=().")
    lat_ms = None if latency is None else check_ms(latency)
    rows, cols = w.shape
    pin = contextlib.ExitStack()
    try:
        if gram is not None:
            # a float64 C-contiguous gram (what calibration hands out) is the very
            # array measured below: pinned from its check on, it is hashed once
            if (isinstance(gram, np.ndarray) and gram.ndim == 2 and gram.dtype == np.float64
                    and gram.flags.c_contiguous):
                pin.enter_context(pinned_gram(gram))
            gram = check_gram(gram, cols)
        split = None
        if gram_heldout is not None:
            if gram is None or gram.ndim != 2:
                raise ValueError(f"gram_heldout is a part of a full gram: pass gram= as the "
                                 f"[{cols}, {cols}] gram of every calibration token too; got "
                                 f"gram={'None' if gram is None else 'a diagonal'}.")
            hb = check_gram(gram_heldout, cols)
            if hb.ndim != 2:
                raise ValueError(f"gram_heldout must be [{cols}, {cols}] like gram; got a "
                                 f"diagonal of shape {hb.shape}.")
            ha = gram - hb
            # both halves must hold tokens (and H_b must be a part of H)
            tb, ta = float(np.trace(hb)), float(np.trace(ha))
            if ta < -1e-9 * float(np.trace(gram)):
                raise ValueError(f"gram_heldout must be a part of gram (gram - gram_heldout "
                                 f"PSD); its trace {tb:.6g} exceeds gram's "
                                 f"{float(np.trace(gram)):.6g}. Pass the held-out half of "
                                 f"the same calibration run.")
            if tb > 0 and ta > 0:
                split = (ha, hb)
                pin.enter_context(pinned_gram(ha))
                pin.enter_context(pinned_gram(hb))
        if sensitivity is not None:
            sensitivity = float(sensitivity)
            if not math.isfinite(sensitivity) or sensitivity < 0:
                raise ValueError(f"sensitivity must be finite and >= 0; got {sensitivity!r}.")
        prior_weight = check_prior_weight(prior_weight)
        gptq = check_gptq(gptq)
        with_gptq = gptq != "none" and gram is not None and gram.ndim == 2
        ggml_gptq = with_gptq and gptq == "all"
        ref = stored_bytes(stored_dtype, rows, cols)
        if menu not in MENUS:
            raise ValueError(f"menu must be one of {MENUS}; got {menu!r}.")
        if not isinstance(requantize, (bool, np.bool_)):
            raise TypeError(f"requantize must be True or False (True: measure the stored ggml "
                            f"type as a re-quantisation); got {requantize!r}.")
        # the stored ggml block type, kept as stored unless re-quantisation is asked for
        own = None if requantize else _stored_block_type(stored_dtype, cols)

        from . import sampling
        spec = sampling.check_sample_rows(sample_rows)
        n0 = sampling.sample_size(spec, rows, cols)
        meas = _Measure(w, gram, lat_ms, seed, split if with_gptq else None)
        # the gram is not modified below: its cached factors are found by identity.
        # BLAS on one thread, as the CLI pins it (scoped: the caller's limits come
        # back): numba's parallel loops follow every BLAS call here, and OpenBLAS's
        # idle threads spin on their cores (a 4096 x 11008 Tucker HOSVD under load:
        # 10.9 CPU s with the default threads, 1.8 with one); the big LAPACK calls
        # raise it themselves (``blas_threads``), the row blocks run on every core.
        act_sq = _check_act_sq(act_sq, cols, gram)
        lookup = _check_lookup(lookup, rows)
        from opscope_nb._threads import _one_blas_thread
        with pinned_gram(gram), _one_blas_thread():
            lp = _measure_menu(name, meas, menu, ggml_types, own, n0, spec, ref, rows, cols,
                               gs, nbits, g2s, with_gptq, stored_dtype, lrs, rank_cap, seed,
                               sensitivity, prior_weight, ggml_gptq)
            if act_sq:
                lp.act_err = activation_errors(w, act_sq, meas.den())
            if lookup is not None:
                lp.lookup = _lookup_errors(meas, lp, own, *lookup)
            return lp
    finally:
        pin.close()


def _check_lookup(lookup, rows):
    """``profile_layer``'s ``lookup`` validated: ``(rows int64 [k], counts
    float64 [k])`` or None."""
    if lookup is None:
        return None
    try:
        r, c = lookup
    except (TypeError, ValueError):
        raise TypeError("lookup must be a pair (rows, counts) "
                        "(CalibrationStream.lookup) or None.") from None
    r, c = np.asarray(r), np.asarray(c, dtype=np.float64)
    if r.ndim != 1 or c.shape != r.shape or not np.issubdtype(r.dtype, np.integer):
        raise ValueError(f"lookup: rows must be a 1-D integer array and counts the same "
                         f"shape; got {r.dtype} {r.shape} and {c.shape}.")
    if r.size == 0 or (r < 0).any() or (r >= rows).any() or np.unique(r).size != r.size:
        raise ValueError(f"lookup: rows must be distinct indices in [0, {rows}) (at least "
                         f"one); got {r.size} value(s) in [{r.min() if r.size else 0}, "
                         f"{r.max() if r.size else 0}].")
    if not np.isfinite(c).all() or (c <= 0).any():
        raise ValueError("lookup: counts must be finite and > 0 (how often each row is "
                         "looked up).")
    return r.astype(np.int64), c


def _lookup_errors(meas, lp, own, idx, counts) -> dict:
    """:attr:`LayerProfile.lookup` without its sensitivity: each option's
    relative error over the looked-up rows, weighted by ``counts``."""
    w = meas.w
    den = float(counts @ np.einsum("ij,ij->i", w[idx], w[idx], dtype=np.float64))
    items = [(o.decomp, None) for o in lp.options
             if o.decomp.kind in ROW_KINDS and o.decomp.lr is None
             and o.decomp.kind != "dense" and (own is None or o.decomp != Decomp.ggml(own))]
    per = {}
    meas._rows(items, idx, per, outputs=False)     # the weight errors only
    err = []
    for o in lp.options:
        d = o.decomp
        if d.kind == "dense" or (own is not None and d == Decomp.ggml(own)):
            err.append(0.0)        # the rows as stored
            continue
        got = per.get(d.label)
        if not got:
            err.append(None)       # not row-wise (or not representable there)
            continue
        num = float(counts @ got[0][0])
        err.append(math.sqrt(num / den) if den > 0 else 0.0)
    return {"err": err, "tokens": int(round(float(counts.sum()))), "rows": int(idx.size)}


def _check_act_sq(act_sq, cols, gram):
    """``profile_layer``'s ``act_sq`` validated: a dict of activation type ->
    float64 ``[cols]`` (finite, >= 0), or None."""
    if act_sq is None:
        return None
    from .calib import ACT_TYPES
    if not isinstance(act_sq, dict):
        raise TypeError(f"act_sq must be a dict of activation type -> [cols] array "
                        f"(CalibrationStream.act_sq) or None; got {type(act_sq).__name__}.")
    if gram is None:
        raise ValueError("act_sq needs gram= from the same calibration tokens: the "
                         "activation error is relative to the output energy tr(W H Wᵀ).")
    out = {}
    for a, v in act_sq.items():
        if a not in ACT_TYPES:
            raise ValueError(f"act_sq: unknown activation type {a!r}; use keys of "
                             f"{sorted(ACT_TYPES)}.")
        v = np.asarray(v, dtype=np.float64)
        if v.shape != (cols,) or not np.isfinite(v).all() or (v < 0).any():
            raise ValueError(f"act_sq[{a!r}] must be {cols} finite values >= 0 (one per input "
                             f"column); got shape {v.shape}.")
        out[a] = v
    return out


def activation_errors(w, act_sq, den) -> dict:
    """The relative output error llama.cpp's rounding of a layer's input adds,
    per activation type: ``sqrt(sum_c e_c |W[:, c]|² / den)``.

    ``(X̂ - X) Wᵀ`` has squared norm ``sum_c e_c |W[:, c]|²`` when the rounding
    errors of different inputs are uncorrelated (each block's rounding is
    about uniform, independent of its neighbours' digits); cross terms are
    left out.  The column norms are the weight's, not each option's decoded
    weight's (they differ by the weight error, a few percent of a few
    percent).

    Parameters
    ----------
    w : ndarray of float32, shape (rows, cols)
    act_sq : dict of str -> ndarray of float64, shape (cols,)
        ``e_c = sum_t w_t (x̂_tc - x_tc)²`` per activation type
        (:meth:`opscope_nb.profile.calib.CalibrationStream.act_sq`).
    den : float
        ``tr(W H Wᵀ)`` with the gram of the same tokens and token weights.

    Returns
    -------
    dict of str -> float
        Per activation type; 0.0 when ``den`` is 0.
    """
    cn = np.einsum("ij,ij->j", w, w, dtype=np.float64)
    return {a: (math.sqrt(max(float(v @ cn), 0.0) / den) if den > 0 else 0.0)
            for a, v in sorted(act_sq.items())}


def _measure_menu(name, meas, menu, ggml_types, own, n0, spec, ref, rows, cols, gs, nbits,
                  g2s, with_gptq, stored_dtype, lrs, rank_cap, seed, sensitivity,
                  prior_weight, ggml_gptq=False):
    """:func:`profile_layer`'s measurements on validated arguments."""
    if menu == "ggml":
        menu_list = ggml_menu(cols, ggml_types, ggml_gptq)
        if own is not None and Decomp.ggml(own) not in [d for d, _ in menu_list]:
            menu_list.insert(1, (Decomp.ggml(own), "ggml"))
        if n0 is not None:
            meas.sample(name, [it for it in menu_list if own is None or it[0] != Decomp.ggml(own)],
                        n0, spec == "auto")
        for d, part in menu_list:
            if own is not None and d == Decomp.ggml(own):
                meas.as_stored(d, ref)
            else:
                meas(d, part, ref_dense=ref)
        return LayerProfile(name, rows, cols, ref, meas.options, meas.timings, sensitivity,
                            str(stored_dtype).upper(), prior_weight=prior_weight,
                            sample=meas.sample_info)
    qmenu = quant_menu(cols, groups=gs, intn_bits=nbits, int2_groups=g2s, gptq=with_gptq,
                       stored=stored_dtype)
    if n0 is not None:
        lrs = []                      # a correction is fitted to every row of the residual
        extra = structured_menu(rows, cols, ref)
        if menu == "mixed":
            extra = extra + ggml_menu(cols, ggml_types, ggml_gptq)[1:]
        meas.sample(name, [it for it in qmenu + extra
                           if own is None or it[0] != Decomp.ggml(own)], n0, spec == "auto")
    for d, part in qmenu:
        if own is not None and d == Decomp.ggml(own):
            meas.as_stored(d, ref)       # its residual is 0: no +lr composites
            continue
        got = meas(d, part, ref_dense=ref)
        if got is not None and lrs and d.kind in LR_KINDS:
            meas.corrections(d, *got, lrs, ref)
    svd, ranks = meas.spectrum(rank_cap, ref)
    for r in ranks:
        meas(Decomp.lowrank(r, svd_rank=min(rows, cols, rank_cap), seed=seed), "lowrank", svd)
    for d, part in structured_menu(rows, cols, ref):
        meas(d, part)
    if menu == "mixed":
        have = {o.decomp.label for o in meas.options}
        for d, part in ggml_menu(cols, ggml_types, ggml_gptq)[1:]:
            if d.label not in have:
                meas(d, part)
    return LayerProfile(name, rows, cols, ref, meas.options, meas.timings, sensitivity,
                        str(stored_dtype).upper(), prior_weight=prior_weight,
                        sample=meas.sample_info)


#: Options measured row by row (a row's codes depend on that row only, and on
#: the gram): the kinds a row sample estimates (:meth:`_Measure.sample`).
ROW_KINDS = frozenset({"dense", "int8", "int4", "int4g", "intn", "sparse24", "ggml"})

#: Parts of :attr:`LayerProfile.timings` that every profile reports.
_PARTS = ("quant", "ternary", "sparse", "svd", "lowrank", "monarch", "tucker", "tt", "lr")


def quant_menu(cols, *, groups=(32, 128), intn_bits=(6, 5, 3), int2_groups=(32,),
               gptq=False, stored=None) -> list:
    """The data-independent head of :func:`profile_layer`'s menu, in order.

    Dense; bf16 and f16 (ggml ``BF16`` / ``F16``: 2 bytes per weight); the
    source's own ggml block type when ``stored`` names one whose block
    divides ``cols`` (``Q4_K`` for a Q4_K GGUF tensor; :func:`profile_layer`
    offers it as stored: error 0 at its stored bytes, copied by ``apply``);
    int8/chan;
    then for 6, 5, 4, 3 bits (4 always, the others when in
    ``intn_bits``) per channel and per group of each ``groups`` length shorter
    than ``cols``; int2 per group of ``int2_groups``; ternary; 2:4.  With
    ``gptq`` each quantised option is followed by its ``+gptq`` twin.

    Returns
    -------
    list of (Decomp, str or None)
        The option and the :attr:`LayerProfile.timings` part it is timed in.
    """
    # half-width floats next to dense: 2 bytes per weight, honest error (exactly
    # 0 for the option equal to how a bf16 / f16 source stores the weight)
    out = [(Decomp.dense(), None), (Decomp.ggml("BF16"), "quant"), (Decomp.ggml("F16"), "quant")]
    own = _stored_block_type(stored, cols)
    if own is not None:
        out.append((Decomp.ggml(own), "quant"))

    def q(d):
        out.append((d, "quant"))
        if gptq:
            out.append((d.with_rounding("gptq"), "gptq"))

    q(Decomp.int8())
    for b in (6, 5, 4, 3):
        if b != 4 and b not in intn_bits:
            continue
        q(Decomp.int4() if b == 4 else Decomp.intn(b))
        for g in groups:
            if cols > g:
                q(Decomp.int4(g) if b == 4 else Decomp.intn(b, g))
    for g in int2_groups:
        if cols > g:
            q(Decomp.intn(2, g))
    out += [(Decomp.ternary(), "ternary"), (Decomp.sparse24(), "sparse")]
    return out


#: :func:`profile_layer`'s ``gptq`` choices: which ``+gptq`` twins a full gram adds.
GPTQ_CHOICES = ("int", "all", "none")


def check_gptq(gptq) -> str:
    """``gptq`` as one of :data:`GPTQ_CHOICES` (True -> ``"int"``, False ->
    ``"none"``); ``ValueError`` naming the choices otherwise."""
    if gptq is True or gptq is False or isinstance(gptq, np.bool_):
        return "int" if gptq else "none"
    if gptq not in GPTQ_CHOICES:
        raise ValueError(f"gptq must be one of {GPTQ_CHOICES} (or True / False); got "
                         f"{gptq!r}. 'all' adds the ggml types' +gptq twins.")
    return gptq


def _stored_block_type(stored, cols):
    """``stored`` as a ggml block type this package packs (not F16 / BF16,
    already in every menu) whose block divides ``cols``; else None."""
    from opscope_nb.formats.ggml import GGML_TYPES
    t = None if stored is None else str(stored).upper()
    if t in GGML_TYPES and GGML_TYPES[t].block > 1 and cols % GGML_TYPES[t].block == 0:
        return t
    return None


#: :func:`profile_layer`'s ``menu`` choices.
MENUS = ("default", "ggml", "mixed")
#: The types :func:`ggml_menu` offers by default, most bits first (TQ1_0 /
#: TQ2_0, for ternary-trained models only, only when asked for).
GGML_MENU_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0",
                   "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K", "F16", "BF16")


def ggml_types_checked(types) -> tuple:
    """Canonical ggml type names (deduplicated, order kept) from ``types``
    (``None``: :data:`GGML_MENU_TYPES`); ``ValueError`` naming the valid ones
    on an unknown name."""
    from opscope_nb.formats.ggml import GGML_TYPES
    if types is None:
        return GGML_MENU_TYPES
    if isinstance(types, str) or not hasattr(types, "__iter__"):
        raise TypeError(f"ggml types must be a sequence of type names, e.g. "
                        f"('Q8_0', 'Q4_K'); got {types!r}.")
    out = []
    for t in types:
        c = GGML_TYPES.get(str(t).upper())
        if c is None:
            raise ValueError(f"unknown ggml type {t!r}; valid types: "
                             f"{', '.join(GGML_TYPES)}.")
        if c.name not in out:
            out.append(c.name)
    return tuple(out)


def ggml_menu(cols, types=None, gptq=False) -> list:
    """The ``menu="ggml"`` options of a weight with ``cols`` inputs, in order.

    Dense, then each type of ``types`` (default :data:`GGML_MENU_TYPES`:
    Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0, IQ4_NL, IQ4_XS, Q3_K,
    Q2_K, F16, BF16) whose block divides ``cols`` -- the types llama.cpp keeps
    for that row length (llama-quantize replaces the others by a fallback,
    :func:`opscope_nb.formats.ggml.fallback_type`, which is then offered under its
    own name when it is in ``types``).  With ``gptq`` each type of
    :data:`opscope_nb.formats.ggml.GPTQ_TYPES` is followed by its ``+gptq``
    twin: the same scales and bytes, GPTQ's codes from the calibration gram
    (:func:`opscope_nb.formats.ggml.quantize_gptq`).

    Returns
    -------
    list of (Decomp, str or None)
        As :func:`quant_menu`: the option and its timings part (``"ggml"``,
        ``"gptq"`` for the twins).
    """
    from opscope_nb.formats.ggml import GGML_TYPES, GPTQ_TYPES
    cols = check_int(cols, "cols", 1)
    out = [(Decomp.dense(), None)]
    for t in ggml_types_checked(types):
        if cols % GGML_TYPES[t].block == 0:
            out.append((Decomp.ggml(t), "ggml"))
            if gptq and t in GPTQ_TYPES:
                out.append((Decomp.ggml(t).with_rounding("gptq"), "gptq"))
    return out


def structured_menu(rows, cols, ref_bytes=None) -> list:
    """The tail of the menu: Monarch (square, perfect-square side), Tucker and
    TT over balanced factors, Tucker and TT only when they take fewer than
    ``ref_bytes`` (default the float32 weight's); as :func:`quant_menu`'s
    ``(Decomp, part)`` pairs."""
    ref = 4 * rows * cols if ref_bytes is None else int(ref_bytes)
    out = []
    m = math.isqrt(rows)
    if rows == cols and m * m == rows and rows > 1:
        out.append((Decomp.monarch(), "monarch"))
    c1, c2 = balanced_factor(cols)
    if c1 > 1 and c2 > 1:
        tr = (max(min(rows // 2, 32, cols), 1), max(c1 // 2, 1), max(c2 // 2, 1))
        d = Decomp.tucker((rows, c1, c2), tr)
        if packed_bytes(rows, cols, d) < ref:
            out.append((d, "tucker"))
    r1, r2 = balanced_factor(rows)
    if r1 > 1 and r2 > 1 and c1 > 1 and c2 > 1:
        d = Decomp.tt((r1, r2, c1, c2), 16)
        if packed_bytes(rows, cols, d) < ref:
            out.append((d, "tt"))
    return out


def lowrank_ranks(s, rows, cols, rcap, ref_bytes=None) -> list:
    """Ranks reaching 90 / 99 / 99.9 % of the spectral energy of the singular
    values ``s`` (first ``rcap``), deduplicated, only those whose factors take
    fewer bytes than ``ref_bytes`` (default the float32 weight's)."""
    ref = 4 * rows * cols if ref_bytes is None else int(ref_bytes)
    e = np.asarray(s, dtype=np.float64) ** 2
    cum = np.cumsum(e)
    energy = max(float(cum[-1]), 1e-30)
    ranks = []
    for frac in (0.90, 0.99, 0.999):
        hit = np.flatnonzero(cum >= frac * energy)
        r = int(hit[0]) + 1 if hit.size else rcap
        r = min(max(r, 1), rcap)
        if r not in ranks and 4 * (rows + cols) * r < ref:
            ranks.append(r)
    return ranks


class _Measure:
    """Measures options of one validated weight: error, bytes, flops, and
    (with a gram / latency sizes) output error and latency; collects
    :class:`DecompOption` s and seconds per part."""

    def __init__(self, w, gram, lat_ms, seed, split=None):
        self.w, self.gram, self.lat_ms, self.seed = w, gram, lat_ms, seed
        # (fitting gram, held-out gram): the +gptq twins are fitted on the
        # first and their out_err measured on the second (None: on ``gram``)
        self.split = split
        self.options = []
        self.timings = {k: 0.0 for k in _PARTS}
        self._den = None
        self._den_b = None
        self._metric = {}
        self._eh = None
        self.est = None              # label -> (rel, se, out, out_se) from a row sample
        self._factor = None          # low-rank factor of a 2-D gram (sampled tensors)
        self._pilot = None           # (rows, strata sizes, row output energies, auto,
        #                               rows taken with certainty: the first k)
        self._picks = {}             # GPTQ option -> its pilot's clipping choice
        self._factor_b = None        # low-rank factor of the held-out gram (sampled)
        self.sample_info = None

    def _tick(self, part, t0):
        self.timings[part] = self.timings.get(part, 0.0) + time.perf_counter() - t0

    def den(self):
        """``tr(W H Wᵀ)``, once per weight (every option's ``out_err`` divides by it)."""
        if self._den is None:
            self._den = output_energy(self.w, self.gram)
        return self._den

    def den_b(self):
        """``tr(W H_b Wᵀ)`` of the held-out gram (a split's twins divide by it)."""
        if self._den_b is None:
            self._den_b = output_energy(self.w, self.split[1])
        return self._den_b

    def twin(self, d):
        """Whether ``d`` is fitted on the split's first gram, priced on its second."""
        return self.split is not None and d.rounding is not None

    def fit_gram(self, d):
        """The gram ``d`` is packed with: the split's fitting half for a twin."""
        return self.split[0] if self.twin(d) else self.gram

    def __call__(self, d, part, svd=None, ref_dense=None):
        """Measure ``d``; returns ``(packed, recon)``, or None when ``d`` cannot
        represent the weight.  ``ref_dense``: the stored bytes the dense option
        is priced at (what ``apply`` writes for it; default float32's)."""
        w = self.w
        if self.est is not None and d.label in self.est:
            st = self.est[d.label]
            if st is None:
                return None           # not representable
            t0 = time.perf_counter()
            packed = _pack(w, d, svd, self.gram) if self.lat_ms is not None else None
            if part and packed is not None:
                self._tick(part, t0)
            self._record(d, packed, st[0], st[2],
                         nb=ref_dense if d.kind == "dense" and ref_dense is not None else None,
                         se=(st[1], st[3]))
            return None
        t0 = time.perf_counter()
        packed = _pack(w, d, svd, self.fit_gram(d))
        recon = unpack(packed, d, w.shape)
        err = float(_rel_err(w, recon))
        if part:
            self._tick(part, t0)
        if not math.isfinite(err):
            return None   # not representable (f16 past 65504): not an option here
        oerr = None
        se = (None, None)
        self._eh = None
        if self.gram is not None:
            t0 = time.perf_counter()
            if self.twin(d):
                # priced on tokens its codes never saw: GPTQ minimises the
                # error on its own tokens, so measured there it is flattered
                e = w.astype(np.float64) - recon
                oerr = output_ratio(float(np.einsum("ij,ij->", e @ self.split[1], e)),
                                    self.den_b())
            elif self._factor is not None:
                oerr, se = self._out_sampled(recon)
            elif self.gram.ndim == 2:
                # keep E H for the +lr composites of this option (same product)
                e = w.astype(np.float64) - recon
                self._eh = e @ self.gram
                oerr = output_ratio(float(np.einsum("ij,ij->", self._eh, e)), self.den())
            else:
                oerr = output_error(w, recon, self.gram, den=self.den())
            self._tick("out_err", t0)
        self._record(d, packed, err, oerr,
                     nb=ref_dense if d.kind == "dense" and ref_dense is not None else None,
                     se=se)
        return packed, recon

    def _out_sampled(self, recon):
        """``(out_err, (rel_err_se, out_err_se))`` of a reconstruction of every
        row on a sampled tensor (ternary, low-rank, Monarch, Tucker, TT: fitted
        to every row, so ``rel_err`` is exact, standard error 0): the output
        error from the pilot's rows (:func:`opscope_nb.profile.sampling.estimate`),
        or, under ``"auto"``, from every row (standard errors None) when its
        95 % interval is wider than the sample's target."""
        from opscope_nb.formats.gptq import row_output_energy
        from . import sampling as smp
        w, g, f = self.w, self.gram, self._factor
        idx, sizes, xo, auto, k = self._pilot
        den = self.den()
        e = w[idx].astype(np.float64) - recon[idx]
        tot, var = smp.estimate(row_output_energy(e, g, f), sizes, xo[idx], den, exact=k)
        rel, se = smp.relative(tot, var, den)
        n = len(idx) - k
        if not auto or smp.rows_for_target(rel, se, n, w.shape[0] - k) <= n:
            return rel, (0.0, se)
        num = float(row_output_energy(w.astype(np.float64) - recon, g, f).sum())
        return output_ratio(num, den), (None, None)

    def as_stored(self, d, nb):
        """Record ``d`` (the source's own ggml block type) as the stored blocks
        kept unchanged: error exactly 0 (``out_err`` 0 with a gram) at the
        stored bytes ``nb``; the latency is timed on a re-pack (same layout)."""
        t0 = time.perf_counter()
        packed = _pack(self.w, d, None, None) if self.lat_ms is not None else None
        self._tick("quant", t0)
        self._record(d, packed, 0.0, None if self.gram is None else 0.0, nb=int(nb))

    def _record(self, d, packed, err, oerr, nb=None, se=(None, None)):
        lat = {}
        if self.lat_ms is not None and packed is not None:
            t0 = time.perf_counter()
            lat = measure_latency(PackedLinear(d, packed, self.w.shape), self.lat_ms,
                                  seed=self.seed)
            self._tick("latency", t0)
        if nb is None:
            nb = nbytes(packed) if packed is not None else packed_bytes(*self.w.shape, d)
        self.options.append(DecompOption(d, err, int(nb), flops(*self.w.shape, d), lat, oerr,
                                         se[0], se[1]))

    def _rows(self, items, idx, per, outputs=True):
        """Per-row squared errors of each row-wise option on rows ``idx``:
        ``per[label]`` gets ``(weight, output)`` float64 ``[len(idx)]`` arrays
        appended (output None without a gram or with ``outputs=False``; None
        for the option when it cannot represent these rows)."""
        from opscope_nb.formats.gptq import row_output_energy
        from opscope_nb.kernels import residual_rows
        ws = np.ascontiguousarray(self.w[idx], dtype=np.float32)
        g = self.gram
        for d, part in items:
            if per.get(d.label, 0) is None:
                continue
            t0 = time.perf_counter()
            # GPTQ chooses clipped or unclipped scales on the pilot's rows; more
            # rows of the same option run only that choice (one sweep, not two)
            pick = self._picks.setdefault(d.label, {"clipped": None}) \
                if d.rounding is not None else None
            twin = self.twin(d)
            e = unpack(_pack(ws, d, None, self.split[0] if twin else g,
                             None if twin else self._factor, pick), d, ws.shape)
            if e.dtype != np.float32 or not e.flags.writeable or not e.flags.c_contiguous \
                    or np.may_share_memory(e, ws):
                e = np.array(e, dtype=np.float32)     # (dense: the weight itself)
            y = np.empty(ws.shape[0], np.float64)
            residual_rows(ws, e, y)          # e: the float32 residual, y its row sums
            self._tick(part or "quant", t0)
            if not np.isfinite(y).all():
                per[d.label] = None
                continue
            oy = None
            if g is not None and outputs:
                t0 = time.perf_counter()
                oy = (row_output_energy(e, self.split[1], self._factor_b) if twin
                      else row_output_energy(e, g, self._factor))
                self._tick("out_err", t0)
            per.setdefault(d.label, []).append((y, oy))

    def sample(self, name, items, n0, auto):
        """Estimate every row-wise option among ``items`` (``[(Decomp, part)]``)
        from a stratified sample of ``n0`` rows (``auto``: grown by nested
        halving of the strata until every 95 % interval is within ±1 %, for
        the options whose pilot interval is wider only;
        :mod:`opscope_nb.profile.sampling`); later calls of the options use
        the estimates."""
        from opscope_nb.formats.gptq import gram_factor, row_output_energy
        from . import sampling as smp
        w, g = self.w, self.gram
        rows, cols = w.shape
        seen, todo = set(), []
        for d, part in items:
            if d.kind in ROW_KINDS and d.lr is None and d.label not in seen:
                seen.add(d.label)
                todo.append((d, part))
        self._factor = None
        if g is not None and g.ndim == 2:
            t0 = time.perf_counter()
            self._factor = gram_factor(g, max_rank=min(cols // 2, FACTOR_MAX_RANK))
            self._tick("out_err", t0)
        xw = row_output_energy(w, None)              # each row's energy: the ratio's x
        den_w = float(xw.sum())
        den_o = xo = None
        if g is not None:
            t0 = time.perf_counter()
            xo = row_output_energy(w, g, self._factor)
            den_o = float(xo.sum())
            self._den = den_o
            self._tick("out_err", t0)
        # a split's twins: their own rows' energies and factor on the held-out gram
        twins = {d.label for d, _ in todo if self.twin(d)}
        xo_b = den_b = None
        if twins:
            t0 = time.perf_counter()
            hb = self.split[1]
            self._factor_b = gram_factor(hb, max_rank=min(cols // 2, FACTOR_MAX_RANK))
            xo_b = row_output_energy(w, hb, self._factor_b)
            den_b = self._den_b = float(xo_b.sum())
            self._tick("out_err", t0)
        # Every option, GPTQ twins included, is estimated from the sample with
        # the rows' own energies as the regression's auxiliary.  (Measuring a
        # GPTQ option's round-to-nearest twin on every row as its auxiliary cost
        # a quarter of a 7B layer's profile and hardly helped: the two rows'
        # output errors correlate at 0.02-0.2 on a calibration gram.)
        # rows holding more than a stratum's share of either energy (a massive
        # activation's output channel) are measured with certainty
        cert = smp.certain_rows([xw, xo] + ([xo_b] if twins else []), n0)
        k = int(cert.size)
        idx, sizes = smp.draw(rows, n0, self.seed, name, cert)
        self._pilot = (idx, sizes, xo, auto, k)
        per = {}
        self._rows(todo, idx, per)

        def stats(lab, pairs, smp_of):
            idx_s, sizes_s, order_s = smp_of
            y = np.concatenate([p[0] for p in pairs])[order_s]
            out = smp.relative(*smp.estimate(y, sizes_s, xw[idx_s], den_w, exact=k), den_w)
            if pairs[0][1] is None:
                return out + (None, None)
            oy = np.concatenate([p[1] for p in pairs])[order_s]
            xs, dn = (xo_b, den_b) if lab in twins else (xo, den_o)
            return out + smp.relative(*smp.estimate(oy, sizes_s, xs[idx_s], dn, exact=k), dn)

        pilot = (idx, sizes, np.arange(idx.size))
        of = {}                # label -> its grown sample (the others keep the pilot)
        n = n0
        if auto:
            need = {}
            for lab, pairs in per.items():
                if pairs is None:
                    continue
                st = stats(lab, pairs, pilot)
                m = smp.rows_for_target(st[0], st[1], n0, rows - k)
                if st[2] is not None:
                    m = max(m, smp.rows_for_target(st[2], st[3], n0, rows - k))
                if m > n0:
                    need[lab] = m
            if need:
                # only the options whose interval is too wide get the fresh rows
                # (at 7B shapes with real grams: 7-24 of ~40, mostly +gptq out_err)
                grow = [it for it in todo if it[0].label in need]
                n = n0 * 2 ** int(math.ceil(math.log2(max(need.values()) / n0)))
                if 2 * n > rows:          # as dear as every row: measure them all
                    rest = np.setdiff1d(np.arange(rows, dtype=np.int64), idx)
                    self._rows(grow, rest, per)
                    allidx = np.concatenate([idx, rest])
                    order = np.argsort(allidx, kind="stable")
                    big, n = (allidx[order], np.ones(rows, np.int64), order), rows
                else:
                    idx_n, sizes_n, home = smp.refine(rows, idx, n, self.seed, name, k)
                    fresh = np.ones(idx_n.size, dtype=bool)
                    fresh[home] = False
                    self._rows(grow, idx_n[fresh], per)
                    # measured order: old rows (stratum `home`), then the fresh strata
                    pos = np.concatenate([home, np.flatnonzero(fresh)])
                    order = np.empty(idx_n.size, np.int64)
                    order[pos] = np.arange(idx_n.size)
                    big = (idx_n, sizes_n, order)
                of = {lab: big for lab in need}
        self.est = {lab: (None if pairs is None else stats(lab, pairs, of.get(lab, pilot)))
                    for lab, pairs in per.items()}
        sampled = [lab for lab, pairs in per.items() if pairs is not None]
        if of and len(of) < len(sampled):
            # some options grew their sample, the others kept the pilot's rows
            self.sample_info = {"rows": int(n0), "of": int(rows), "seed": int(self.seed),
                                "design": "stratified",
                                "grown": {lab: int(n) for lab in sorted(of)}}
        else:
            self.sample_info = {"rows": int(n), "of": int(rows), "seed": int(self.seed),
                                "design": "stratified" if n < rows else "every row"}
        if k and self.sample_info["design"] == "stratified":
            self.sample_info["certain"] = k      # rows measured besides the strata

    def corrections(self, d, packed, recon, ranks, ref_bytes):
        """The ``+lr{r}`` options of the measured quantisation ``d`` for each
        ``r`` in ``ranks`` that fits the weight and takes fewer than
        ``ref_bytes``: one :func:`~opscope_nb.formats.correction_basis` serves
        every rank, and ``out_err`` comes from the base residual's output
        energy by expanding ``tr((E − UV) H (E − UV)ᵀ)`` (exact, float64, on
        the packed int8 factors) instead of one ``rows x cols x cols`` product per
        rank; it leaves out the float32 rounding of the dense reconstruction
        (``rel_err`` includes it), ~1e-7 of the weight's output."""
        import dataclasses
        w = self.w
        rows, cols = w.shape
        todo = [r for r in ranks if r <= min(rows, cols)
                and packed_bytes(rows, cols, d.with_correction(r)) < ref_bytes]
        if not todo:
            return
        t0 = time.perf_counter()
        e = w.astype(np.float64) - recon
        fit = self.fit_gram(d)      # a twin's correction: fitted and priced as the twin
        bases = {}          # one SVD per sketch rank (LR_SKETCH for every r <= it)
        for r in todo:
            k = min(max(r, LR_SKETCH), rows, cols)
            if k not in bases:
                if id(fit) not in self._metric:
                    self._metric[id(fit)] = correction_metric(fit)
                bases[k] = correction_basis(e, k, fit, seed=self.seed,
                                            metric=self._metric[id(fit)])
        g, den = (self.split[1], self.den_b()) if self.twin(d) else (self.gram, None)
        if g is not None and g.ndim == 2:
            eh = self._eh if self._eh is not None and not self.twin(d) else e @ g
            num0 = float(np.einsum("ij,ij->", eh, e))
        self._tick("lr", t0)
        for r in todo:
            t0 = time.perf_counter()
            dr = dataclasses.replace(d, lr=r, seed=self.seed)
            u, v, sc = correction_slice(bases[min(max(r, LR_SKETCH), rows, cols)], r)
            out = dict(packed)
            out["lr_u"], out["lr_v"], out["lr_s"] = u, v, sc
            rec = recon + correction_product(u, v, sc)
            err = float(_rel_err(w, rec))
            self._tick("lr", t0)
            if not math.isfinite(err):
                continue
            oerr = None
            if g is not None:
                t0 = time.perf_counter()
                if g.ndim == 1:
                    oerr = output_error(w, rec, g, den=self.den())
                else:
                    u64, v64 = u.astype(np.float64) * sc, v.astype(np.float64)
                    num = (num0 - 2.0 * float(np.einsum("ij,ij->", u64, eh @ v64.T))
                           + float(np.einsum("ij,ij->", u64.T @ u64, (v64 @ g) @ v64.T)))
                    oerr = output_ratio(num, den if den is not None else self.den())
                self._tick("out_err", t0)
            self._record(dr, out, err, oerr)

    def spectrum(self, rank_cap, ref_bytes):
        """``((U, S, Vt), ranks)`` of the one truncated SVD, or ``(None, [])``
        when no rank takes fewer than ``ref_bytes``."""
        rows, cols = self.w.shape
        if 4 * (rows + cols) >= ref_bytes:
            return None, []
        rcap = min(rows, cols, rank_cap)
        t0 = time.perf_counter()
        svd = truncated_svd(self.w, rcap, self.seed)
        self._tick("svd", t0)
        return svd, lowrank_ranks(svd[1], rows, cols, rcap, ref_bytes)


# ───────────────────────────── quant sweep ─────────────────────────────

@dataclass(frozen=True)
class QuantStat:
    """Cheap per-weight quantisation metrics (no SVD).

    Attributes
    ----------
    name : str
    layer : int or None
        Block index parsed by :func:`parse_layer_kind`.
    kind : str
        Projection kind parsed by :func:`parse_layer_kind`.
    numel : int
    int8_pt : float
        Per-tensor int8 relative error.
    int8_pc, int4_pc, int3_pc : float
        Per-channel (per-row) relative errors.
    int5_pc, int6_pc : float
        Per-channel relative errors of int5 / int6 (the ``int5/chan`` /
        ``int6/chan`` menu options use the same quantiser).
    outlier : float
        Max / upper-median of the column max-abs (``outlier_channels(w, 5.0)``).
    outlier_count : int
        Columns whose max-abs exceeds 5x the median.
    best_bits : int or None
        First of 3, 4, 6, 8 whose per-channel error is ``< budget``.
    """

    name: str
    layer: int | None
    kind: str
    numel: int
    int8_pt: float
    int8_pc: float
    int4_pc: float
    int3_pc: float
    int5_pc: float
    int6_pc: float
    outlier: float
    outlier_count: int
    best_bits: int | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def quant_stat(name, w, budget) -> QuantStat:
    """The upstream quant sweep for one weight ``[out, in]``.

    Parameters
    ----------
    name : str
    w : array_like of shape (rows, cols)
    budget : float
        Per-channel error ceiling for ``best_bits`` (``> 0``).

    Returns
    -------
    QuantStat
    """
    from . import probe

    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}.")
    w = as_matrix(w, "w")
    b = float(budget)
    if not math.isfinite(b) or b <= 0:
        raise ValueError(f"budget must be a finite positive error ceiling; got {budget!r}.")
    layer, kind = parse_layer_kind(name)
    cnt, ratio = probe.outlier_channels(w, 5.0)
    bb = probe.best_bitwidth(w, b)
    return QuantStat(name=name, layer=layer, kind=kind, numel=int(w.size),
                     int8_pt=float(probe.quant_error(w, 8)),
                     int8_pc=float(probe.per_channel_quant_error(w, 8)),
                     int4_pc=float(probe.per_channel_quant_error(w, 4)),
                     int3_pc=float(probe.per_channel_quant_error(w, 3)),
                     outlier=float(ratio), outlier_count=int(cnt),
                     best_bits=None if bb is None else int(bb),
                     int5_pc=float(probe.per_channel_quant_error(w, 5)),
                     int6_pc=float(probe.per_channel_quant_error(w, 6)))


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blk|blocks|block)\.(\d+)\.(.+)$")


def parse_layer_kind(name: str) -> tuple:
    """Split a checkpoint tensor name into ``(block index or None, kind)``.

    ``kind`` is the dotted path *after* the block index with a trailing
    ``.weight`` removed, so kinds stay distinct across a block (BERT has three
    ``...dense`` weights):

    ===============================================  ==================================
    name                                             result
    ===============================================  ==================================
    ``model.layers.3.self_attn.q_proj.weight``       ``(3, "self_attn.q_proj")``
    ``encoder.layer.0.attention.self.query.weight``  ``(0, "attention.self.query")``
    ``h.5.attn.c_attn.weight`` (or ``transformer.``)  ``(5, "attn.c_attn")``
    ``blk.2.attn_q.weight`` (GGUF)                   ``(2, "attn_q")``
    ``lm_head.weight``                               ``(None, "lm_head")``
    ===============================================  ==================================

    Block containers recognised: ``layers``, ``layer``, ``h``, ``blk``,
    ``blocks``, ``block`` followed by an integer.  Without one the index is
    ``None`` and the kind is the whole name minus ``.weight``.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}.")
    m = _LAYER_RE.search(name)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
    else:
        idx, rest = None, name
    if rest.endswith(".weight"):
        rest = rest[: -len(".weight")]
    return idx, rest
