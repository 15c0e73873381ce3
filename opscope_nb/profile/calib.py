"""Calibration: the inputs every linear layer sees, and how much each layer matters.

:func:`calibrate` (and the :class:`CalibrationStream` behind it) opens a model
lazily with :func:`opscope_nb.models.open_model` and runs its dense forward
pass **one block at a time** (the :func:`opscope_nb.models.bert.block` /
:func:`opscope_nb.models.llama.block` of ``opscope-nb eval``): the
calibration activations of every chunk of text go through block ``i``, then
block ``i``'s weights are dropped and block ``i + 1`` is read.  Peak memory is
one block's weights (float32), that block's grams and the activations of the
calibration tokens -- independent of the number of blocks, so a 7 B model
calibrates in a few GB.  For every linear layer the stream accumulates the
second moment of its inputs

    ``H = sum_t x_t x_tᵀ``  (``[cols, cols]``, float64 at any width)

Float64 because ``H`` is a sum over thousands of tokens whose small
eigenvalues GPTQ's Cholesky and the ``out_err`` differences need; a
14336-input gram is 1.6 GB in float64, held only while its block is profiled.
Layers that receive the very same input array (q/k/v, gate/up) share one
accumulator; padding rows of an encoder batch are left out.  ``diag(H)``
instead of ``H`` above ``full_max_cols`` inputs is an explicit choice
(default: never).

Sensitivity (``d metric / d out_err**2``, one layer at a time): for each layer
asked for, its weight gets a Gaussian perturbation ``s Z`` (``Z`` from an
explicit seed, the same for every token), ``s`` making the output error
``||x (sZ)ᵀ|| / ||x Wᵀ|| = eps`` on the sensitivity tokens; the model's final
output is compared with the clean one and ``sensitivity = metric / eps**2`` -- encoders: mean over texts of ``1 - cos`` of the pooled
embeddings; decoders: mean next-token ``KL(clean || perturbed)``.  For a small
error both metrics are quadratic in the output error, so ``sensitivity *
out_err**2`` predicts the metric a quantised layer costs.  A perturbed forward
starts from the cached clean input of its block and runs in the same sweep
over the blocks as the grams: a layer of block ``b`` costs ``n_blocks - b``
block forwards over at most ``sens_tokens`` tokens (:attr:`CalibrationStream.
sens_block_forwards`), and each pending perturbed activation is held until the
head (``sens_tokens x hidden`` float32 each).

A token-embedding table (a decoder's, tied to its head or not; an encoder's
word embeddings) is also read as a lookup: its quantised rows enter the
residual stream before the first block.  For that role the stream counts the
rows the calibration tokens look up (:meth:`CalibrationStream.lookup`) and
probes a perturbation ``s Z`` of the looked-up rows (``Z`` per table row from
an explicit seed, ``||s Z[ids]|| = eps ||T[ids]||`` over the sensitivity
tokens) from the embedding on: :attr:`Calibration.lookup_sensitivity`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Calibration", "CalibrationStream", "StreamedGrams", "calibrate", "FULL_MAX_COLS", "save_grams",
           "load_grams", "GramsError", "GramsWriter"]

#: Sensitivity tokens of ``sens_tokens="auto"`` when the work allows.
SENS_TOKENS = 256
#: Fewest sensitivity tokens ``"auto"`` goes down to.
SENS_MIN_TOKENS = 32
#: ``"auto"``'s budget for the perturbed forwards, in multiply-add flops of the
#: linear layers (about 3-4 min on 2 cores at the stacked sweep's 156 Gflop/s:
#: SmolLM2-135M keeps 256 tokens and the held-out probe; a Llama-3.2-1B shape
#: gets 160 tokens, a Llama-7B 32, both without the held-out probe).
SENS_WORK = 30e12
#: Rows of the perturbed runs stacked into one block call (:meth:`CalibrationStream.
#: _sens_stage`): OpenBLAS is at full speed from a few hundred rows (279 Gflop/s
#: at 512 rows of a 4096 x 11008 layer, 291 at 2048; Xeon, 2 cores), and 512 rows
#: of a 7B FFN are 23 MB per intermediate (2048 rows raised a 7B calib run's
#: peak RSS by 1.1 GB).
SENS_BATCH_ROWS = 512
#: Logits (rows x vocabulary) of the perturbed runs at a decoder's head per call.
SENS_BATCH_LOGITS = 2 ** 21
#: Suffix of a lookup probe's run name (``"token_embd.weight#lookup"``): a tied
#: table's head probe runs under the table's own name.
LOOKUP = "#lookup"

#: Default ``full_max_cols``: ``None`` keeps the full gram at every width (the
#: diagonal-only fallback is an explicit choice, never silent).
FULL_MAX_COLS = None


@dataclass
class Calibration:
    """What :func:`calibrate` measured.

    Attributes
    ----------
    grams : dict of str -> ndarray of float64
        Per linear weight name: ``[cols, cols]`` (full) or ``[cols]`` (diagonal).
        Layers sharing an input share the same array object.  Empty when the
        stream handed them to a callback instead (``keep_grams=False``).
    tokens : int
        Token rows accumulated into every gram.
    sensitivity : dict of str -> float
        ``metric / eps**2`` per weight name (empty when not measured).
    metric : str
        ``"1-cos"`` (encoders) or ``"kl"`` (decoders).
    eps : float
    sens_tokens : int
        Tokens the sensitivity forwards ran on.
    seconds : dict of str -> float
        ``load`` (weights read), ``grams`` (block forwards and grams),
        ``sensitivity`` (perturbed block forwards and the head).
    blocks : int
        Blocks streamed.
    peak_block_bytes : int
        Largest float32 weights held at once: the stem (embeddings and norms)
        while the chunks are embedded, then the norms plus one block (or the
        head).
    layers, full_grams : int
        Grams recorded (by layer name) and how many of them are full.
    validation : dict of str -> dict
        Per plan given to the stream: ``metric`` (``"1-cos"`` / ``"kl"``),
        ``measured`` (its mean on the validation part), ``cosine`` or
        ``top1``, ``tokens``.
    val_tokens : int
        Tokens held out for validation (none of them in the grams or the
        sensitivity forwards).
    sensitivity_val : dict of str -> float
        The same probe (same perturbation, rescaled to ``eps`` there) measured
        on the held-out part: how far each layer's sensitivity carries over to
        text it was not measured on (empty without a held-out part).
    sens_val_tokens : int
        Held-out tokens those forwards ran on.
    lookup_sensitivity : dict of str -> float
        Per token-embedding table profiled: ``metric / eps**2`` of a
        perturbation of the rows the sensitivity tokens look up (relative
        size ``eps``), run from the embedding on.  With the rows' relative
        error weighted by how often each is looked up
        (:attr:`opscope_nb.profile.mining.LayerProfile.lookup`) it predicts
        what the quantised table costs as a lookup; a tied table's head role
        is in :attr:`sensitivity`.
    lookup_sensitivity_val : dict of str -> float
        The same probe on the held-out part.
    """

    grams: dict
    tokens: int
    sensitivity: dict = field(default_factory=dict)
    metric: str = ""
    eps: float = 0.0
    sens_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    blocks: int = 0
    peak_block_bytes: int = 0
    layers: int = 0
    full_grams: int = 0
    validation: dict = field(default_factory=dict)
    val_tokens: int = 0
    sensitivity_val: dict = field(default_factory=dict)
    sens_val_tokens: int = 0
    lookup_sensitivity: dict = field(default_factory=dict)
    lookup_sensitivity_val: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """JSON-ready facts (no arrays)."""
        return {"tokens": int(self.tokens), "layers": int(self.layers),
                "full_grams": int(self.full_grams),
                "diag_grams": int(self.layers - self.full_grams),
                "metric": self.metric, "eps": float(self.eps),
                "sens_tokens": int(self.sens_tokens), "blocks": int(self.blocks),
                "sens_layers": len(self.sensitivity),
                "sens_val_tokens": int(self.sens_val_tokens),
                "peak_block_bytes": int(self.peak_block_bytes),
                "seconds": {k: float(v) for k, v in self.seconds.items()}}


class _Recorder:
    def __init__(self, full_max_cols, want=None, split=False, weighting=False):
        self.full_max_cols = full_max_cols
        self.want = want     # layer names whose grams are needed (None: all)
        # ``weighting``: each token's input row is weighted by 1 / the divisor
        # of the norm the layer's sublayer output goes through next (the
        # model's ``norm_scale`` hook); inputs wait for it in ``waiting``
        self.weighting = weighting
        self.waiting = []    # [(group key, input, real rows)] until the next norm
        self.ywait = []      # [(layer name, per-row output energies, real rows)]
        self.energy = {}     # group key -> [sum |x|², weighted]
        self.energy_y = {}   # layer name -> [sum |y|², weighted]
        self.taken_energy = {}  # layer name -> (tr H, tr H_w, |Y|², |Y|²_w) of the last take
        # ``split``: a full gram also accumulates its held-out half (every
        # other sequence), which the +gptq twins are priced on
        self.split = split
        self.seq = None      # token rows per sequence of the current chunk
        self.units = {}      # group key -> sequences seen (the halves alternate)
        self.acc_b = {}      # group key -> held-out half's accumulator
        self.heldout = {}    # layer name -> held-out half of its last taken gram
        self.pending = None  # (group key, input, real rows): accumulated on the next input
        self.acc = {}        # group key -> float64 accumulator
        self.alias = {}      # layer name -> group key
        self.rows = None     # bool mask of real token rows (encoder padding)
        self.prev_x = None
        self.prev_name = None
        self.on = True
        self.perturb = ()    # (name, eps, rng, state, r0, r1, last chunk): see _Tap
        self.spare = []      # the last stage's full accumulators, reused once free
        # group key -> {activation type: sum_t w_t (x̂_t - x_t)² per input}: the
        # rounding llama.cpp's matmul applies to the input (:func:`_act_sq`)
        self.act_acc = {}
        self.taken_act = {}  # layer name -> its group's act_acc entry of the last take

    def observe(self, name, x):
        if not self.on:
            return
        same = x is self.prev_x
        prev = self.prev_name
        self.prev_x, self.prev_name = x, name
        if name not in self.alias:
            self.alias[name] = self.alias[prev] if same and prev in self.alias else name
        key = self.alias[name]
        if same and self.alias.get(prev) == key:
            return  # this input is already pending for the group
        if not self.weighting:
            self.flush()
        elif self.pending is not None:
            self.waiting.append(self.pending)      # until the norm its output meets
            self.pending = None
        # accumulated once the group is known (q, then k and v with the same
        # input): only a group with a wanted member costs a gram
        self.pending = (key, x, self.rows)

    def output(self, name, y):
        """A tapped layer's output ``y``: its per-token energy, for the
        token-weighted output energy (the sensitivity's rescaling)."""
        if not (self.on and self.weighting) or (self.want is not None and name not in self.want):
            return
        y2 = y.reshape(-1, y.shape[-1]).astype(np.float64)
        self.ywait.append((name, np.einsum("ij,ij->i", y2, y2), self.rows))

    def norm_scale(self, d):
        """The model's ``norm_scale`` hook: ``d`` (float64 ``[rows]``) divides
        the sublayer's output at each token before anything downstream reads
        it, so the inputs waiting since the last norm are accumulated with
        token weights ``1 / d²``."""
        if not (self.on and self.weighting):
            return
        if self.pending is not None:
            self.waiting.append(self.pending)
            self.pending = None
        inv = 1.0 / np.square(np.asarray(d, dtype=np.float64))
        for key, x, rows in self.waiting:
            self._add(key, x, rows, inv)
        self.waiting = []
        self._outputs(inv)
        self.prev_x = None      # the next input starts a new group's wait

    def _outputs(self, inv):
        """Sum the waiting per-token output energies, plain and weighted."""
        for name, e, rows in self.ywait:
            w = inv if inv is not None and inv.shape[0] == e.shape[0] else None
            sel = rows if rows is not None and rows.shape[0] == e.shape[0] else slice(None)
            acc = self.energy_y.setdefault(name, [0.0, 0.0])
            acc[0] += float(e[sel].sum())
            acc[1] += float((e if w is None else e * w)[sel].sum())
        self.ywait = []

    def flush(self):
        """Accumulate the pending input and any waiting ones unweighted (no
        norm follows them: a decoder's head, an architecture without the hook)."""
        todo = self.waiting + ([self.pending] if self.pending is not None else [])
        self.pending, self.waiting = None, []
        for key, x, rows in todo:
            self._add(key, x, rows, None)
        self._outputs(None)

    def _add(self, key, x, rows, inv):
        """``H[key] += xᵀ diag(inv) x`` over the real rows (``inv`` None: 1)."""
        if self.want is not None and not any(
                k == key and n in self.want for n, k in self.alias.items()):
            return
        x2 = x.reshape(-1, x.shape[-1])
        if inv is not None and inv.shape[0] != x2.shape[0]:
            inv = None
        if self.weighting:
            n2 = np.einsum("ij,ij->i", x2, x2, dtype=np.float64)
            sel = rows if rows is not None and rows.shape[0] == x2.shape[0] else slice(None)
            acc = self.energy.setdefault(key, [0.0, 0.0])
            acc[0] += float(n2[sel].sum())
            acc[1] += float((n2 if inv is None else n2 * inv)[sel].sum())
        full = self.full_max_cols is None or x2.shape[1] <= self.full_max_cols
        odd = None
        if self.split and full:
            # sequences alternate between the halves, counted over the chunks
            # (one decoder window per chunk: the chunks alternate)
            seq = self.seq if self.seq else x2.shape[0]
            base = self.units.get(key, 0)
            odd = (np.arange(x2.shape[0]) // seq + base) % 2 == 1
            self.units[key] = base + -(-x2.shape[0] // seq)
        if rows is not None and rows.shape[0] == x2.shape[0]:
            x2 = x2[rows]
            odd = None if odd is None else odd[rows]
            inv = None if inv is None else inv[rows]
        sq = _act_sq(x2, inv)
        acc_a = self.act_acc.setdefault(key, {})
        for a, v in sq.items():
            if a in acc_a:
                acc_a[a] += v
            else:
                acc_a[a] = v
        x64 = x2.astype(np.float64)
        if inv is not None:
            x64 *= np.sqrt(inv)[:, None]
        cols = x64.shape[1]
        if full:
            # H += xᵀx in place, upper triangle (BLAS syrk): no [cols, cols]
            # temporary next to the accumulator (0.97 GB at 11008 inputs)
            from scipy.linalg.blas import dsyrk
            from opscope_nb._threads import blas_threads
            acc = self.acc.get(key)
            if acc is None:
                acc = self.acc[key] = self._zeroed(cols)
            # every core: OpenBLAS splits the output, never the sum over tokens,
            # so the gram is the same for any thread count
            with blas_threads():
                dsyrk(1.0, x64, beta=1.0, c=acc, trans=1, lower=0, overwrite_c=1)
                if odd is not None:
                    b = self.acc_b.get(key)
                    if b is None:
                        b = self.acc_b[key] = self._zeroed(cols)
                    if odd.any():
                        dsyrk(1.0, np.ascontiguousarray(x64[odd]), beta=1.0, c=b, trans=1,
                              lower=0, overwrite_c=1)
        else:
            g = np.einsum("ij,ij->j", x64, x64)
            if key in self.acc:
                self.acc[key] += g
            else:
                self.acc[key] = g

    def _zeroed(self, cols):
        """A zeroed F-order ``[cols, cols]`` float64 accumulator: one of the
        previous stage's once nothing else holds it or a view of it (the
        profile of that block is done), else a new one (and the spares of
        that shape, still held elsewhere, are let go).  A 7B FFN gram is 1 GB
        per block: reusing it saves the page faults of a fresh gigabyte, which
        cost up to 7.6 s per GB on a virtual machine that returns freed pages to its
        host (the 2-core Xeon this project is timed on)."""
        for i in range(len(self.spare)):
            a = self.spare[i]
            if a.shape != (cols, cols):
                continue
            # references: the list's, ``a`` and the call's own
            if sys.getrefcount(a) <= 3:
                del self.spare[i]
                a.fill(0.0)
                return a
        # the spares of this shape are still in use: not kept alive from here
        # on (the memory then is what it was without the reuse)
        self.spare = [a for a in self.spare if a.shape != (cols, cols)]
        return np.zeros((cols, cols), dtype=np.float64, order="F")

    def take(self, names) -> dict:
        """The finished grams of ``names`` (shared arrays stay shared); forgets them.
        The full ones are made symmetric (their lower triangle copied from the
        upper one, a few rows at a time) and handed out C-contiguous."""
        self.flush()
        spare = []
        for acc in (self.acc, self.acc_b):
            for key, a in list(acc.items()):
                if a.ndim == 2:
                    acc[key] = _symmetric(a)
                    spare.append(a)
        out = {n: self.acc[self.alias[n]] for n in names
               if n in self.alias and self.alias[n] in self.acc}
        self.heldout = {n: self.acc_b[self.alias[n]] for n in out
                        if self.alias[n] in self.acc_b}
        self.taken_energy = {n: tuple(self.energy[self.alias[n]]) + tuple(self.energy_y[n])
                             for n in out if self.alias[n] in self.energy and n in self.energy_y}
        self.taken_act = {n: self.act_acc[self.alias[n]] for n in out
                          if self.alias[n] in self.act_acc}
        self.acc, self.alias, self.acc_b, self.units = {}, {}, {}, {}
        self.energy, self.energy_y, self.act_acc = {}, {}, {}
        self.prev_x = self.prev_name = None
        self.spare = spare
        return out


#: llama.cpp's activation types (:data:`opscope_nb.formats.ggml.ACTIVATION_TYPES`;
#: Q8_1 decodes to Q8_0's values) -> a weight type that reads them, and the
#: block the input's length must be a multiple of.
ACT_TYPES = {"F16": ("F16", 1), "BF16": ("BF16", 1), "Q8_0": ("Q8_0", 32),
             "Q8_K": ("Q4_K", 256)}


def _act_sq(x, inv=None) -> dict:
    """The rounding llama.cpp's CPU matmul applies to the input rows ``x``
    (float ``[tokens, cols]``), per activation type of :data:`ACT_TYPES` that
    ``cols`` allows: ``sum_t inv_t (x̂_tc - x_tc)²`` (float64 ``[cols]``; ``inv``
    float64 ``[tokens]`` token weights, None: 1), summed in token order.  With
    the weight's column norms it gives the output error the rounding adds
    (:func:`opscope_nb.profile.mining.activation_errors`)."""
    from opscope_nb.formats.ggml import runtime_activations
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = {}
    if x.ndim != 2 or x.shape[0] == 0:
        return out
    w = None if inv is None else np.sqrt(inv).astype(np.float32)[:, None]
    for a, (wt, block) in ACT_TYPES.items():
        if x.shape[1] % block:
            continue
        # float32 differences (the two are close: a few ulps of rounding at
        # most), squares summed in float64; no [tokens, cols] float64 copy
        d = runtime_activations(x, wt)       # a new array for every type here
        d -= x
        if w is not None:
            d *= w
        out[a] = np.einsum("ij,ij->j", d, d, dtype=np.float64)
    return out


def _seq_rows(c):
    """Token rows per sequence of a calibration chunk: an encoder batch's
    padded length, else None (a decoder chunk is one window)."""
    mask = c.get("mask")
    return None if mask is None else int(mask.shape[1])


def _symmetric(a):
    """The symmetric gram of an F-order accumulator whose upper triangle holds
    it (BLAS syrk's): the lower triangle copied from the upper one, a few rows
    at a time, in place; returns its C-order view (no copy)."""
    n = a.shape[0]
    for i0 in range(0, n, 256):
        i1 = min(n, i0 + 256)
        a[i1:, i0:i1] = a[i0:i1, i1:].T      # below the diagonal block
        blk = a[i0:i1, i0:i1]
        a[i0:i1, i0:i1] = np.triu(blk) + np.triu(blk, 1).T
    return a.T


class _Tap:
    """Wraps a ``PackedLinear``: records its input, optionally perturbs its weight.

    The sensitivity probe adds ``s Z`` to the weight (``Z`` ``[out, in]``
    standard normal from the layer's generator, one draw for every token and
    chunk), ``s`` set on the first chunk so that the output error is ``eps``
    of the output (``||x (sZ)ᵀ|| = eps ||x Wᵀ||`` over its real rows):
    ``out_err = eps`` measured on the sensitivity tokens.  A weight error,
    like a quantisation error, moves every token's output the same way; iid
    noise on the outputs instead averages away under mean pooling and makes
    the last layers look harmless (review finding 6a).
    """

    def __init__(self, inner, name, rec):
        self._inner, self._name, self._rec = inner, name, rec

    def __getattr__(self, a):
        return getattr(self._inner, a)

    def __call__(self, x, act="auto"):
        self._rec.observe(self._name, x)
        y = _blas_dense(self._inner, x)
        if y is None:
            y = self._inner(x, act=act)
        self._rec.output(self._name, y)
        mine = [p for p in self._rec.perturb if p[0] == self._name]
        if not mine:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])      # a fresh array: perturbed in place
        for _, eps, rng, state, r0, r1, last in mine:
            xs, ys = x2[r0:r1], y2[r0:r1]
            if "z" not in state:
                state["z"] = rng.standard_normal((y2.shape[1], x2.shape[1]),
                                                 dtype=np.float32)
            from opscope_nb._threads import blas_threads
            with blas_threads():
                dy = xs @ state["z"].T
            if "s" not in state:
                rows = self._rec.rows
                sel = rows if rows is not None and rows.shape[0] == xs.shape[0] else slice(None)
                num = float(np.linalg.norm(ys[sel].astype(np.float64)))
                den = float(np.linalg.norm(dy[sel].astype(np.float64)))
                state["s"] = eps * num / den if den > 0 else 0.0
            ys += np.float32(state["s"]) * dy
            if last:
                # Z (weight-sized) serves every chunk of the run, then never
                # again: one is held at a time, not one per run of the batch
                del state["z"]
        return y2.reshape(y.shape)


def _blas_dense(lin, x):
    """``x @ Wᵀ`` of a dense, uncorrected ``PackedLinear`` through BLAS on every
    core for a finite 2-D float32 ``x``, else None.  The calibration's
    forwards run 512-token windows and batches of perturbed runs: there
    OpenBLAS's sgemm makes 217-291 Gflop/s on 2 cores against the
    weight-stationary kernel's 81-85 (4096 x 11008 weights, 224 to 2048 rows;
    Xeon AVX-512), and it gives a row the same value whatever the thread count
    (for these shapes, whatever the other rows of the call too)."""
    d = lin.decomp
    if (d.kind != "dense" or d.lr is not None or x.ndim != 2 or x.dtype != np.float32
            or not np.isfinite(x).all()):
        return None     # (the layer's own call raises on NaN/Inf with its message)
    from opscope_nb._threads import blas_threads
    with blas_threads():
        return x @ lin.arrays["w"].T


def _stderr_log(s):
    print(s, file=sys.stderr, flush=True)


class CalibrationStream:
    """Block-by-block calibration of a dense checkpoint (see the module docstring).

    Parameters
    ----------
    source : str
        A checkpoint :func:`opscope_nb.models.open_model` reads (BERT-style
        encoder or a decoder of the Llama family, see
        :data:`opscope_nb.models.SUPPORTED`).
    text : str, optional
        Text file, one passage per line; ``None`` = the built-in English
        sample (:func:`opscope_nb.models.evaluate.load_passages`): encoders use
        its sentences, decoders its token stream.
    max_tokens : int, optional
        Cap on calibration tokens (encoders: whole sentences while within the
        cap, at least one).
    full_max_cols : int or None
        Keep ``diag(H)`` instead of ``H`` for layers with more inputs
        (``None``: the full gram at every width).
    sensitivity : bool or iterable of str
        Measure sensitivity for every linear layer (``True``), none
        (``False``), or the named ones.
    eps, seed, sens_tokens, act, batch, window, log
        As :func:`calibrate`.
    validate : float
        Fraction of the text held out (seeded by ``split_seed``): encoder
        sentences or passages, decoder passages; the grams and sensitivities
        come from the rest.  ``max_tokens`` caps each part.
    split_seed : int
    grams_for : iterable of str, optional
        Only these layers' grams are accumulated (and returned); ``None``:
        every linear layer's.  The forwards are the same.
    plans : dict of str -> dict of str -> Decomp, optional
        Plans to measure on the held-out part (needs ``validate > 0``): in the
        same sweep, each block's planned layers are packed as the plan says
        (``+gptq`` from that block's grams) and the plan's activations go
        through them next to the dense ones; :attr:`validation` (and
        :attr:`Calibration.validation`) get each plan's metric.
    act_quant : {"none", "ggml"}
        ``"ggml"``: each plan's ggml-type layers read their inputs as
        llama.cpp's CPU matmul does (:class:`opscope_nb.models.ggml_acts.RunAs`:
        Q8_0 / Q8_K blocks), so the measured metric is what the plan costs in
        llama.cpp (the dense layers, the reference's included, read floats:
        F16 rounding is a thousandth of it).
    heldout_grams : bool
        Also accumulate each full gram's held-out half (:meth:`heldout`):
        the sequences alternate between the halves (the first one in the
        fitting half), so ``+gptq`` twins can be fitted on one half and
        priced on the other (:func:`opscope_nb.profile.mining.profile_layer`'s
        ``gram_heldout``).  Costs a second gram per full input while its
        block is profiled, and a second ``syrk`` over half the tokens.
    token_weights : bool
        Weight each token's input row by ``1 / d_t²`` in every gram, ``d_t``
        the divisor of the norm the layer's sublayer output meets next at
        token ``t`` (BERT: the LayerNorm's ``sqrt(var + eps)`` after the
        sublayer; Llama family: the residual stream's RMS after the
        sublayer's output is added; the models' ``norm_scale`` hook).  A
        norm divides an error at that token by ``d_t``: tokens with massive
        activations (MPNet's FFN-down: ``d_t`` up to 20x the median) dominate
        a plain gram but hardly move what the next block sees.  ``out_err``,
        GPTQ and the ggml importance then follow the normalised stream, and
        each sensitivity is rescaled by ``(tr H / tr H_w) (|Y|²_w / |Y|²)``
        (the probe's plain output error is ``eps``; for its Gaussian
        direction the weighted one follows from these sums, taken on the
        calibration tokens).  A decoder's head and architectures whose
        sublayers normalise their own output (``post_norms``) stay unweighted.

    Attributes
    ----------
    stages : list of list of str
        Linear names finished by each stage: blocks ``0 .. n_blocks - 1``,
        then the head stage (a decoder's output projection; empty for encoders).
    tokens, sens_tokens : int
    sens_block_forwards : int
        Perturbed stage runs (blocks and the head) the sensitivity sweep does.

    Notes
    -----
    Call :meth:`next_stage` (or iterate) until it returns ``None``, then
    :meth:`result`; or :meth:`gram` for a layer, which advances as far as
    needed.  The grams of a stage are released when the next one runs.
    """

    def __init__(self, source, *, text=None, max_tokens=None, full_max_cols=FULL_MAX_COLS,
                 sensitivity=True, eps=0.05, seed=0, sens_tokens=256, act="f32",
                 batch=32, window=256, log=None, validate=0.0, split_seed=0, plans=None,
                 grams_for=None, heldout_grams=False, token_weights=False,
                 act_quant="none"):
        from opscope_nb.data import TEXT_KEYWORDS
        from opscope_nb.models import open_model
        from opscope_nb.models.evaluate import load_passages
        if not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a finite number > 0; got {eps!r}.")
        if full_max_cols is not None and int(full_max_cols) < 1:
            raise ValueError(f"full_max_cols must be >= 1 or None; got {full_max_cols!r}.")
        if max_tokens is not None and int(max_tokens) < 2:
            raise ValueError(f"max_tokens must be >= 2; got {max_tokens!r}.")
        auto_sens = isinstance(sens_tokens, str) and sens_tokens == "auto"
        if not auto_sens and (isinstance(sens_tokens, (bool, str)) or int(sens_tokens) < 2):
            raise ValueError(f"sens_tokens must be an int >= 2 or 'auto'; got "
                             f"{sens_tokens!r}.")
        if not (isinstance(validate, (int, float)) and 0.0 <= float(validate) < 1.0):
            raise ValueError(f"validate must be a fraction in [0, 1); got {validate!r}.")
        self.validate, self.split_seed = float(validate), int(split_seed)
        self.plans = {str(k): dict(v) for k, v in (plans or {}).items()}
        if act_quant not in ("none", "ggml"):
            raise ValueError(f"act_quant must be 'none' or 'ggml'; got {act_quant!r}.")
        self.act_quant = act_quant
        if self.plans and not self.validate:
            raise ValueError("plans are measured on the validation part: give validate > 0.")
        self.log = log if log is not None else (_stderr_log if sys.stderr.isatty()
                                                else (lambda s: None))
        t0 = time.perf_counter()
        self.model = m = open_model(source, lazy=True)
        self.family = m.family
        self.act, self.eps, self.seed = act, float(eps), int(seed)
        self.rec = _Recorder(None if full_max_cols is None else int(full_max_cols),
                             None if grams_for is None else set(grams_for),
                             split=bool(heldout_grams), weighting=bool(token_weights))
        self._sens_scale = {}            # layer -> sensitivity factor (token weights)
        self.n_blocks = int(m.config["n_layers"])
        blocks = [m.block_tensors(i) for i in range(self.n_blocks)]
        in_blocks = {n for lin, oth in blocks for n in lin + oth}
        self._head = None
        if self.family == "decoder":
            nm = m.config["names"]
            self._head = nm["embed"] if m.config.get("tied") else nm["head"]
        # the stem (embeddings, norms) stays loaded; an untied head waits for its stage
        stem = [n for n in m.entries if n not in in_blocks
                and (m.config.get("tied") or n != self._head)]
        self._stage_names = [lin + oth for lin, oth in blocks]
        self.stages = [list(lin) for lin, _ in blocks] + [[self._head] if self._head else []]
        self._order = {n: k for k, names in enumerate(self.stages) for n in names}
        all_lin = [n for names in self.stages for n in names]
        if sensitivity is True:
            sens = all_lin
        elif sensitivity is False or sensitivity is None:
            sens = []
        else:
            want = set(sensitivity)
            sens = [n for n in all_lin if n in want]
        self._sens_index = {n: all_lin.index(n) for n in sens}
        #: the token-embedding table the forward looks rows up in (None: none)
        self.lookup_table = lk = self._lookup_name(m)
        #: the lookup probe's run name
        self._lookup_key = (lk or "") + LOOKUP
        if lk is not None and lk in m.entries and (
                sensitivity is True or (sensitivity not in (False, None)
                                        and lk in set(sensitivity))):
            self._sens_index[self._lookup_key] = len(all_lin)
        #: the held-out sensitivity probe was left out to keep the work in budget
        self.sens_val_dropped = False
        sens = list(sens) + [n for n in self._sens_index if n.endswith(LOOKUP)]
        if auto_sens:
            sens_tokens, drop = self._auto_sens_tokens(m, blocks, sens, validate)
            self.sens_val_dropped = drop
        #: the layers whose sensitivity the sweep measures, in block order
        self.sens_layers = [n for n in sens if not n.endswith(LOOKUP)]
        #: ``on_stage(stage, grams)`` after each stage (e.g. a :class:`GramsWriter`)
        self.on_stage = None
        self.metric = "1-cos" if self.family == "encoder" else "kl"
        self._peak = m.load(stem)
        passages = load_passages(text)
        if self.family == "encoder":
            # the built-in texts are prose passages: encoders take their sentences
            self._setup_encoder(passages, text is None or text in TEXT_KEYWORDS, max_tokens,
                                sens_tokens, batch)
        else:
            self._setup_decoder(passages, max_tokens, sens_tokens, window)
        if self.sens_val_dropped:
            self._sens_val_chunks = []
            self.sens_val_tokens = 0
        # every chunk is embedded: the embedding tables leave memory (a tied
        # head reads the table again at the last stage); the norms stay
        tables = [n for n in stem if m.tensors[n].ndim == 2]
        m.drop(tables)
        self._stem = sum(int(m.tensors[n].nbytes) for n in stem if n in m.tensors)
        # every stage from the layer's own to the head (included)
        self.sens_block_forwards = sum(self.n_blocks + 1 - self._order.get(n, 0) for n in sens)
        if self._sens_val_chunks:
            self.sens_block_forwards *= 2
        self._val_dense = None           # dense validation activations per chunk
        self._val_states = {}            # plan -> its validation activations per chunk
        #: plan -> measured metric on the validation part (after the head stage)
        self.validation = {}
        self._sens = {}
        self._sens_val = {}
        # the probe's parts: the fitting text (the objective's sensitivities) and
        # the held-out text (how well they carry over); each keeps its clean and
        # per-layer perturbed activations per chunk while they are in flight
        self._sparts = [{"chunks": ch, "clean": None, "states": {}, "out": out}
                        for ch, out in ((self._sens_chunks, self._sens),
                                        (self._sens_val_chunks, self._sens_val)) if ch]
        self._pending = set(sens)
        self.stage = -1                  # last finished stage
        self.current = {}                # grams of the last finished stage
        self.current_heldout = {}        # their held-out halves (heldout_grams=True)
        self.current_act = {}            # their inputs' activation rounding (_act_sq)
        self.seconds = {"load": time.perf_counter() - t0, "grams": 0.0, "sensitivity": 0.0}
        self.n_layers = 0
        self.n_full = 0

    def _lookup_name(self, m):
        """The table the forward looks token rows up in: a decoder's token
        embedding (tied to the head or not), an encoder's word embeddings."""
        if self.family == "decoder":
            return m.config["names"].get("embed")
        return m.config.get("prefix", "") + "embeddings.word_embeddings.weight"

    def _lookup_setup(self, cal_ids, sens_parts):
        """Count the rows the calibration tokens ``cal_ids`` (1-D arrays of
        real tokens) look up; with the lookup probe on, give each sensitivity
        chunk of ``sens_parts`` (``[(chunk, ids [rows], real rows or None)]``
        per part) its perturbed embedding ``x_lookup`` (the table is still
        loaded here)."""
        ids = np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in cal_ids]) \
            if cal_ids else np.zeros(0, np.int64)
        r, c = np.unique(ids, return_counts=True)
        self._lookup_counts = (r, c.astype(np.float64))
        key = self._lookup_key
        if key not in self._sens_index:
            return
        from opscope_nb.models import bert, llama
        m, name = self.model, self.lookup_table
        table = m.tensors[name]
        for part in sens_parts:
            if not part:
                continue
            flat = [np.asarray(i, np.int64).reshape(-1) for _, i, _ in part]
            uniq, inv = np.unique(np.concatenate(flat), return_inverse=True)
            rows = np.asarray(table[uniq], dtype=np.float32)
            # Z per table row, from the row's own seed: a row looked up in two
            # chunks or parts moves the same way (as a quantisation error does)
            z = np.stack([np.random.default_rng([self.seed, self._sens_index[key], int(u)])
                          .standard_normal(rows.shape[1], dtype=np.float32) for u in uniq])
            real = np.concatenate([np.ones(len(f), bool) if rr is None else np.asarray(rr, bool)
                                   for f, (_, _, rr) in zip(flat, part)])
            num = float(np.linalg.norm(rows[inv[real]].astype(np.float64)))
            den = float(np.linalg.norm(z[inv[real]].astype(np.float64)))
            sc = np.float32(self.eps * num / den if den > 0 else 0.0)
            off = 0
            try:
                m.tensors[name] = rows + sc * z        # compact table: ids remapped
                for (c, i, _), f in zip(part, flat):
                    loc = inv[off:off + len(f)].reshape(np.shape(i))
                    off += len(f)
                    c["x_lookup"] = (bert.embed_tokens(m, loc) if self.family == "encoder"
                                     else llama.embed_tokens(m, loc))
            finally:
                m.tensors[name] = table

    def _lookup_plans(self):
        """Each plan's validation chunks embedded with its own type of the
        lookup table (``_val_x0``; the table is still loaded here).  The rows
        are quantised without a gram: an imatrix-weighted or ``+gptq`` type of
        a tied table is looked up at its plain rounding here (its head role
        runs the gram's, as ``apply`` writes it for both)."""
        self._val_x0 = {}
        name, m = self.lookup_table, self.model
        if not self._val_chunks or name is None or name not in m.tensors:
            return
        import dataclasses
        from opscope_nb.formats import approximate
        from opscope_nb.models import bert, llama
        table = m.tensors[name]
        flat = [np.asarray(c["ids"], np.int64).reshape(-1) for c in self._val_chunks]
        uniq, inv = np.unique(np.concatenate(flat), return_inverse=True)
        rows = None
        for p, plan in self.plans.items():
            d = plan.get(name)
            if d is None or d.kind == "dense":
                continue
            if rows is None:
                rows = np.asarray(table[uniq], dtype=np.float32)
            if d.rounding is not None:
                d = dataclasses.replace(d, rounding=None)
            xs, off = [], 0
            try:
                m.tensors[name] = np.asarray(approximate(rows, d), dtype=np.float32)
                for c, f in zip(self._val_chunks, flat):
                    loc = inv[off:off + len(f)].reshape(np.shape(c["ids"]))
                    off += len(f)
                    xs.append(bert.embed_tokens(m, loc) if self.family == "encoder"
                              else llama.embed_tokens(m, loc))
            finally:
                m.tensors[name] = table
            self._val_x0[p] = xs

    def lookup(self, name):
        """``(rows, counts)``: the rows of token-embedding table ``name`` that
        the calibration tokens (the fitting part) look up, int64 ``[k]``
        ascending, and how often, float64 ``[k]``; None for another name."""
        if name != self.lookup_table:
            return None
        return self._lookup_counts

    def _auto_sens_tokens(self, m, blocks, sens, validate) -> tuple:
        """``(tokens, drop_heldout)`` for ``sens_tokens="auto"``: 256 tokens (and
        the held-out probe) while the perturbed forwards' work stays within
        :data:`SENS_WORK`; else the held-out probe is dropped (it is reported,
        never used by the objective) and the tokens cut to fit (a multiple of
        32, at least :data:`SENS_MIN_TOKENS`)."""
        def numel(n):
            e = m.entries.get(n)
            return int(np.prod(e.shape)) if e is not None else 0
        order = {n: k for k, (lin, _) in enumerate(blocks) for n in lin}
        nb = len(blocks)
        per_block = [2.0 * sum(numel(n) for n in lin) for lin, _ in blocks]
        head = 2.0 * (numel(self._head) if self._head else 0)
        # the lookup probe runs from the embedding on: every block and the head
        per_tok = sum(sum(per_block[order.get(n, 0 if n.endswith(LOOKUP) else nb):]) + head
                      for n in sens)
        if per_tok <= 0:
            return SENS_TOKENS, False
        runs = 2 if validate else 1
        if per_tok * SENS_TOKENS * runs <= SENS_WORK:
            return SENS_TOKENS, False
        t = int(SENS_WORK / per_tok) // 32 * 32
        return max(SENS_MIN_TOKENS, min(SENS_TOKENS, t)), bool(validate)

    # ---- per family ------------------------------------------------------ #
    def _split(self, items):
        """``(fit, validation)``: a seeded choice of ``ceil(validate * n)`` items
        (at least one, leaving at least one) held out, both in text order."""
        n = len(items)
        if not self.validate or n < 2:
            return list(items), []
        k = min(n - 1, max(1, int(np.ceil(self.validate * n))))
        held = set(np.random.default_rng(self.split_seed).choice(n, k, replace=False).tolist())
        return ([x for i, x in enumerate(items) if i not in held],
                [x for i, x in enumerate(items) if i in held])

    def _setup_encoder(self, passages, builtin, max_tokens, sens_tokens, batch):
        from opscope_nb.models import bert
        from opscope_nb.models.evaluate import _sentences
        m = self.model
        fit_texts, val_texts = self._split(_sentences(passages) if builtin else list(passages))

        def cap(texts, n):
            lens = [min(len(m.tokenizer.encode(t).ids), m.config["max_seq_len"])
                    for t in texts]
            if n is None:
                return list(texts), sum(lens)
            keep, tot = [], 0
            for t, k in zip(texts, lens):
                if keep and tot + k > n:
                    break
                keep.append(t)
                tot += k
            return keep, tot

        cal, ntok = cap(fit_texts, max_tokens)
        scap = int(sens_tokens) if max_tokens is None else min(int(sens_tokens),
                                                               int(max_tokens))
        sens_texts, nsens = cap(fit_texts, scap)
        val, nval = cap(val_texts, max_tokens)
        sval, nsval = cap(val_texts, scap)

        def chunks(ts):
            out = []
            for s in range(0, len(ts), batch):
                ids, mask = bert.tokenize_batch(m, ts[s:s + batch])
                out.append({"x": bert.embed_tokens(m, ids), "bias": bert.attention_bias(mask),
                            "mask": mask, "rows": mask.reshape(-1) > 0, "ids": ids})
            return out

        self._cal = chunks(cal)
        self._sens_chunks = chunks(sens_texts) if self._sens_index else []
        self._sens_val_chunks = chunks(sval) if self._sens_index and sval else []
        self._val_chunks = chunks(val) if self.plans else []
        self.tokens, self.sens_tokens, self.val_tokens = int(ntok), int(nsens), int(nval)
        self.sens_val_tokens = int(nsval) if self._sens_val_chunks else 0
        self._lookup_setup([c["ids"][c["mask"] > 0] for c in self._cal],
                           [[(c, c["ids"], c["rows"]) for c in ch]
                            for ch in (self._sens_chunks, self._sens_val_chunks)])
        self._lookup_plans()

    def _setup_decoder(self, passages, max_tokens, sens_tokens, window):
        from opscope_nb.models import llama
        m = self.model
        cfg = m.config

        def tokens(ps):
            ids = list(m.tokenizer.encode("\n".join(ps)).ids) if ps else []
            if ids and cfg.get("add_bos") and cfg.get("bos") is not None:
                ids = [int(cfg["bos"])] + ids
            if max_tokens is not None:
                ids = ids[:int(max_tokens)]
            return np.asarray(ids, dtype=np.int64)

        fit_p, val_p = self._split(list(passages))
        ids, vids = tokens(fit_p), tokens(val_p)
        window = int(min(window, cfg.get("context", window)))
        sens_ids = ids[:max(2, min(int(sens_tokens), len(ids), window))]
        sval_ids = vids[:max(2, min(int(sens_tokens), len(vids), window))]
        self._cal = [{"x": llama.embed_tokens(m, ids[s:s + window]), "rows": None}
                     for s in range(0, len(ids), window)]
        self._sens_chunks = [{"x": llama.embed_tokens(m, sens_ids), "rows": None}] \
            if self._sens_index else []
        self._val_chunks = [{"x": llama.embed_tokens(m, vids[s:s + window]), "rows": None,
                             "ids": vids[s:s + window]}
                            for s in range(0, len(vids), window)] if self.plans else []
        self._sens_val_chunks = [{"x": llama.embed_tokens(m, sval_ids), "rows": None}] \
            if self._sens_index and len(sval_ids) >= 2 else []
        self.sens_val_tokens = int(len(sval_ids)) if self._sens_val_chunks else 0
        self.tokens, self.sens_tokens, self.val_tokens = (int(len(ids)), int(len(sens_ids)),
                                                          int(len(vids)))
        self._lookup_setup([ids], [[(ch[0], i, None)] if ch else [] for ch, i in
                                   ((self._sens_chunks, sens_ids),
                                    (self._sens_val_chunks, sval_ids))])
        self._lookup_plans()
        self._ctx = {}

    def _block(self, i, c, x, n=1):
        """Block ``i`` on chunk ``c``'s activations ``x``; ``n`` runs of the
        chunk stacked (``[n * rows, hidden]``) go through as one batch, each
        attending within itself."""
        from opscope_nb.models import bert, llama
        hook = self.rec.norm_scale if self.rec.weighting else None
        if self.family == "encoder":
            bias = c["bias"] if n == 1 else np.concatenate([c["bias"]] * n)
            return bert.block(self.model, i, x, bias, act=self.act, norm_scale=hook)
        T = x.shape[0] // n
        ctx = self._ctx.get(T)
        if ctx is None:
            ctx = self._ctx[T] = llama.rope_context(self.model.config, 0, T)
        return llama.block(self.model, i, x, None, None, 0, ctx, act=self.act, seqs=n,
                           norm_scale=hook)

    def _final(self, c, x, n=1):
        """The model output of chunk ``c`` from the last block's ``x`` (``n``
        runs stacked as in :meth:`_block`): pooled embeddings (encoder) or
        logits (decoder), ``n`` times as many rows as one run's."""
        from opscope_nb.models import bert, llama
        m = self.model
        if self.family == "encoder":
            B, L = c["mask"].shape
            mask = c["mask"] if n == 1 else np.concatenate([c["mask"]] * n)
            return bert.pool(m, x.reshape(n * B, L, m.config["hidden"]), mask)
        return llama.logits(m, x, act=self.act)

    def _reference(self, clean):
        """What :meth:`_reduce` compares with, made once per chunk at the head:
        the clean output (encoders), or its log-probabilities and
        probabilities (decoders: one log-softmax of the clean logits for every
        perturbed run, not one per run)."""
        if self.family == "encoder":
            return clean
        from opscope_nb.models.evaluate import _kl_reference
        return _kl_reference(clean)

    def _reduce(self, ref, out):
        """One run's head output on one chunk, kept until :meth:`_distance`:
        its next-token KLs against ``ref`` (decoders, float64 ``[T]``: the
        logits are dropped at once) or its pooled embeddings (encoders)."""
        if self.family == "encoder":
            return out
        from opscope_nb.models.evaluate import _kl_to, _log_softmax
        return _kl_to(ref, _log_softmax(out))

    def _distance(self, clean, outs) -> float:
        """Mean ``1 - cos`` (encoders) or next-token KL (decoders) of one
        perturbed run from its :meth:`_reduce` d chunks; the same float64
        figures as :func:`~opscope_nb.models.evaluate.kl_stats`."""
        if self.family == "encoder":
            from opscope_nb.models.evaluate import cosine
            return float(np.mean(1.0 - cosine(np.concatenate(clean), np.concatenate(outs))))
        return float(np.concatenate(outs).mean())

    def _runs_per_call(self, rows, head) -> int:
        """Runs of one chunk (``rows`` rows each) stacked into one call: up to
        :data:`SENS_BATCH_ROWS` rows, and at the head of a decoder at most
        :data:`SENS_BATCH_LOGITS` logits."""
        per = max(1, SENS_BATCH_ROWS // max(1, rows))
        if head and self.family == "decoder":
            vocab = int(self.model.config.get("vocab") or 0) or 1
            per = min(per, max(1, SENS_BATCH_LOGITS // (vocab * max(1, rows))))
        return per

    # ---- the sweep ------------------------------------------------------- #
    def _run_chunks(self, fn, chunks, xs):
        out = []
        for c, x in zip(chunks, xs):
            self.rec.rows = c["rows"]
            self.rec.seq = _seq_rows(c)
            self.rec.prev_x = None
            out.append(fn(c, x))
        self.rec.rows = None
        return out

    def next_stage(self):
        """Run the next stage; returns ``(stage, {name: gram})`` or ``None`` when done."""
        k = self.stage + 1
        if k > self.n_blocks:
            return None
        m = self.model
        self.current, self.current_heldout, self.current_act = {}, {}, {}
        t0 = time.perf_counter()
        names = self._stage_names[k] if k < self.n_blocks else (
            [self._head] if self._head else [])
        if k == self.n_blocks:
            # the head's arrays (its float32 matrix, the logits) fit none of
            # the blocks' freed holes: hand those back before it (only where
            # the command line keeps freed memory)
            from opscope_nb._memory import release_freed_memory
            release_freed_memory()
        nb = m.load(names)
        self._peak = max(self._peak, self._stem + nb)
        t1 = time.perf_counter()
        self.seconds["load"] += t1 - t0
        lin = self.stages[k]
        tied = k == self.n_blocks and m.config.get("tied")
        if tied:
            # the tied head wraps the (stem) embedding; llama.head_linear reads extras
            from opscope_nb.models.loader import dense_linear
            m.extras["head"] = _Tap(dense_linear(m.tensors[self._head]), self._head, self.rec)
        else:
            for n in lin:
                m.tensors[n] = _Tap(m.tensors[n], n, self.rec)
        if k < self.n_blocks:
            def fn(c, x):
                return self._block(k, c, x)
        else:
            fn = self._final
        self.rec.on = True
        want = self.rec.want
        if k < self.n_blocks:
            outs = self._run_chunks(fn, self._cal, [c["x"] for c in self._cal])
            for c, x in zip(self._cal, outs):
                c["x"] = x
        else:
            # the head stage runs the calibration chunks only for the head's
            # gram (an encoder has none), which needs the head's input alone:
            # the logits of every calibration token (tokens x vocab floats) are
            # never formed
            if lin and (want is None or any(n in want for n in lin)):
                from opscope_nb.models import llama
                for c in self._cal:
                    self.rec.rows, self.rec.prev_x = c["rows"], None
                    self.rec.seq = _seq_rows(c)
                    self.rec.observe(self._head, llama.final_norm(m, c["x"]))
                self.rec.rows = None
            for c in self._cal:
                c["x"] = None
        grams = self.rec.take(lin)
        heldout, self.rec.heldout = self.rec.heldout, {}
        for n, (tr, tr_w, den, den_w) in self.rec.taken_energy.items():
            # the probe sets the plain output error to eps; measured with the
            # token weights its error is eps² (tr H_w / tr H) (|Y|² / |Y|²_w)
            # (a Gaussian Z: E|x Zᵀ|² = rows |x|²), so damage / weighted
            # error² is the plain sensitivity times the inverse
            if tr_w > 0 and den > 0:
                self._sens_scale[n] = (tr / tr_w) * (den_w / den)
        self.rec.on = False
        t2 = time.perf_counter()
        self.seconds["grams"] += t2 - t1
        if self._sparts:
            self._sens_stage(k, fn, lin)
        t3 = time.perf_counter()
        self.seconds["sensitivity"] += t3 - t2
        if self._val_chunks:
            self._val_stage(k, fn, lin, grams, tied)
            self.seconds["validation"] = self.seconds.get("validation", 0.0) + \
                time.perf_counter() - t3
        if tied:
            m.extras.pop("head", None)
        else:
            for n in lin:
                m.tensors[n] = m.tensors[n]._inner
        m.drop(names)
        self.stage = k
        self.current, self.current_heldout = grams, heldout
        self.current_act, self.rec.taken_act = self.rec.taken_act, {}
        self.n_layers += len(grams)
        self.n_full += sum(1 for g in grams.values() if g.ndim == 2)
        if self.on_stage is not None:
            self.on_stage(k, grams)
        where = f"block {k + 1}/{self.n_blocks}" if k < self.n_blocks else "head"
        fly = self._in_flight()
        extra = f", {fly} perturbed forwards in flight" if fly else ""
        self.log(f"calibration: {where}, {len(grams)} grams, "
                 f"{time.perf_counter() - t0:.1f}s{extra}")
        return k, grams

    def _sens_stage(self, k, fn, lin):
        """Advance the clean and every pending perturbed sensitivity activation
        through stage ``k``; start the perturbed runs of this stage's layers;
        at the head, turn each into its sensitivity.

        The runs of a chunk go through the stage together, stacked up to
        :meth:`_runs_per_call` at a time: every weight is read once per batch
        and the GEMMs are large (a 7B model's 32-token runs: 512 rows a call
        instead of 32).  Every op is per row or per run, so a run's values do
        not depend on the batch it is in, up to float32 rounding where OpenBLAS
        picks another kernel for another row count (tiny layers: 1e-6 relative;
        a 4096-input layer gave the same bits)."""
        head = k == self.n_blocks
        starts = [n for n in lin if n in self._pending]
        lk = self._lookup_key if k == 0 and self._lookup_key in self._pending else None
        for part in self._sparts:
            ch, states = part["chunks"], part["states"]
            if part["clean"] is None:
                part["clean"] = [c["x"] for c in ch]
            xin = part["clean"]
            # the clean run, the perturbed runs in flight, one new run per layer
            # of this stage (its Z from a generator seeded by the layer alone),
            # and at the first stage the lookup probe (its input perturbed)
            runs = [None] + list(states) + starts + ([lk] if lk else [])
            inputs = [xin] + [states[n] for n in states] + [xin] * len(starts) + (
                [[c["x_lookup"] for c in ch]] if lk else [])
            first = 1 + len(states)
            probes = {n: (np.random.default_rng([self.seed, self._sens_index[n]]), {})
                      for n in starts + ([lk] if lk else [])}
            outs = [[None] * len(ch) for _ in runs]
            for j, c in enumerate(ch):
                rows = xin[j].shape[0]
                per = self._runs_per_call(rows, head)
                ref = None
                for g0 in range(0, len(runs), per):
                    grp = range(g0, min(len(runs), g0 + per))
                    x = (np.concatenate([inputs[i][j] for i in grp]) if len(grp) > 1
                         else inputs[g0][j])
                    self.rec.perturb = tuple(
                        (runs[i], self.eps, *probes[runs[i]], (i - g0) * rows,
                         (i - g0 + 1) * rows, j == len(ch) - 1) for i in grp if i >= first)
                    self.rec.rows, self.rec.prev_x = c["rows"], None
                    try:
                        y = (self._final(c, x, len(grp)) if head
                             else self._block(k, c, x, len(grp)))
                    finally:
                        self.rec.perturb = ()
                    del x
                    for i, yi in zip(grp, np.split(y, len(grp)) if len(grp) > 1 else [y]):
                        if not head:
                            outs[i][j] = yi
                            continue
                        if i == 0:
                            ref = self._reference(yi)
                        outs[i][j] = self._reduce(ref, yi)
                    del y
                del ref
            self.rec.rows = None
            if head:
                for i in range(1, len(runs)):
                    part["out"][runs[i]] = self._distance(outs[0], outs[i]) / self.eps ** 2
                states.clear()
            else:
                for i in range(1, len(runs)):
                    states[runs[i]] = outs[i]
            part["clean"] = outs[0]
        self._pending.difference_update(lin + ([lk] if lk else []))
        if lk:
            for part in self._sparts:
                for c in part["chunks"]:
                    c.pop("x_lookup", None)

    def _in_flight(self) -> int:
        return sum(len(p["states"]) for p in self._sparts)

    def _val_stage(self, k, fn, lin, grams, tied):
        """Advance the dense and every plan's validation activations through
        stage ``k``; each plan runs with its layers of this stage packed as it
        says (``+gptq`` from this stage's grams).  At the head, the metrics."""
        from opscope_nb.runtime._packed import PackedLinear
        from opscope_nb.models.evaluate import cosine, kl_stats
        m = self.model
        if self._val_dense is None:
            self._val_dense = [c["x"] for c in self._val_chunks]
            # a plan's own lookup table type embeds its chunks (_lookup_plans)
            self._val_states = {p: list(self._val_x0.get(p, self._val_dense))
                                for p in self.plans}
        # a decoder's head is scored chunk by chunk: the logits of every held-out
        # token at once (tokens x vocab floats, twice) would not fit in memory
        stream_kl = k == self.n_blocks and self.family == "decoder"
        if stream_kl:
            from opscope_nb.models import llama
            dense_head = llama.head_linear(m)

            def logits(head, x):
                return llama.logits(m, x, act=self.act, head=head)
        packed = {}
        for p, plan in self.plans.items():
            swaps = {}
            for n in lin:
                d = plan.get(n)
                if d is None or d.kind == "dense":
                    continue
                key = (n, repr(d))
                if key not in packed:
                    lay = m.extras["head"] if tied else m.tensors[n]
                    w = np.asarray(lay._inner.arrays["w"], dtype=np.float32)
                    packed[key] = PackedLinear.pack(w, d, gram=grams.get(n))
                swaps[n] = packed[key]
                if self.act_quant == "ggml" and d.kind == "ggml":
                    from opscope_nb.models.ggml_acts import RunAs
                    swaps[n] = RunAs(packed[key], d.qtype)
            saved = {}
            for n, lay in swaps.items():
                if tied:
                    saved[n], m.extras["head"] = m.extras["head"], lay
                else:
                    saved[n], m.tensors[n] = m.tensors[n], lay
            try:
                if stream_kl:
                    plan_head = llama.head_linear(m)
                    st = [kl_stats(logits(dense_head, xd), logits(plan_head, xp))
                          for xd, xp in zip(self._val_dense, self._val_states[p])]
                    self.validation[p] = {
                        "metric": "kl", "measured": float(np.concatenate([x[0] for x in st]).mean()),
                        "top1": float(np.concatenate([x[1] for x in st]).mean()),
                        "tokens": self.val_tokens, "act_quant": self.act_quant}
                else:
                    self._val_states[p] = self._run_chunks(fn, self._val_chunks,
                                                           self._val_states[p])
            finally:
                for n, lay in saved.items():
                    if tied:
                        m.extras["head"] = lay
                    else:
                        m.tensors[n] = lay
        if stream_kl:
            self._val_states, self._val_dense = {}, None
            return
        self._val_dense = self._run_chunks(fn, self._val_chunks, self._val_dense)
        if k == self.n_blocks:          # encoders: pooled embeddings are small
            for p, outs in self._val_states.items():
                cos = cosine(np.concatenate(self._val_dense), np.concatenate(outs))
                self.validation[p] = {"metric": "1-cos", "measured": float(np.mean(1 - cos)),
                                      "cosine": float(np.mean(cos)), "tokens": self.val_tokens,
                                      "act_quant": self.act_quant}
            self._val_states = {}

    def __iter__(self):
        while True:
            r = self.next_stage()
            if r is None:
                return
            yield r

    def stage_of(self, name):
        """Stage index whose run finishes ``name``'s gram (``None``: not a linear layer)."""
        return self._order.get(name)

    def gram(self, name):
        """``name``'s gram, running stages up to the one that finishes it (the
        grams of earlier stages are gone by then); ``None`` for a name no stage
        records or one whose stage has already passed."""
        k = self._order.get(name)
        if k is None or k < self.stage:
            return None
        while self.stage < k:
            self.next_stage()
        return self.current.get(name)

    def heldout(self, name):
        """The held-out half of ``name``'s full gram (``heldout_grams=True``):
        the part of :meth:`gram`'s sum from every other calibration sequence
        (encoder sentences, decoder windows), float64 ``[cols, cols]``; None
        without it.  Call after :meth:`gram` of the same name."""
        return self.current_heldout.get(name)

    def act_sq(self, name):
        """What llama.cpp's rounding of ``name``'s input costs, per activation
        type (``{"F16": [cols], "Q8_0": [cols], ...}``, float64, summed over
        the calibration tokens with the gram's token weights; :func:`_act_sq`);
        None without it.  Call after :meth:`gram` of the same name."""
        return self.current_act.get(name)

    def result(self, grams=None, *, rest=True) -> Calibration:
        """Run the remaining stages (``rest=False``: only while a sensitivity
        sweep still needs them -- the caller wants no more grams); the
        :class:`Calibration` with ``grams`` as given."""
        while self.stage < self.n_blocks and (rest or self._pending or self._in_flight()
                                              or self._val_chunks):
            self.next_stage()
        sc = self._sens_scale

        def lookups(d):
            return {n[:-len(LOOKUP)]: v for n, v in d.items() if n.endswith(LOOKUP)}

        return Calibration(grams if grams is not None else {}, self.tokens,
                           {n: v * sc.get(n, 1.0) for n, v in self._sens.items()
                            if not n.endswith(LOOKUP)},
                           self.metric, self.eps,
                           self.sens_tokens if self._sens_index else 0,
                           dict(self.seconds), self.n_blocks, int(self._peak),
                           self.n_layers, self.n_full, dict(self.validation),
                           self.val_tokens if self.validate else 0,
                           {n: v * sc.get(n, 1.0) for n, v in self._sens_val.items()
                            if not n.endswith(LOOKUP)},
                           self.sens_val_tokens, lookups(self._sens), lookups(self._sens_val))


class StreamedGrams:
    """Grams on demand from a :class:`CalibrationStream`: ``get(name)`` runs the
    stream up to the block that finishes ``name`` and hands the gram over
    (each gram once; the grams of wanted layers in blocks already passed wait
    until taken, all others are dropped as the stream goes).  What ``apply``
    uses when no ``calib.npz`` was kept.

    Parameters
    ----------
    stream : CalibrationStream
        A fresh stream (its ``on_stage`` is taken over).
    want : iterable of str
        The layer names whose grams will be asked for.
    """

    def __init__(self, stream, want):
        self.stream, self.want, self.kept = stream, set(want), {}
        stream.on_stage = self._keep

    def _keep(self, k, grams):
        self.kept.update({n: g for n, g in grams.items() if n in self.want})

    def get(self, name, default=None):
        if name not in self.want:
            return default
        st = self.stream
        while name not in self.kept and st.stage < st.n_blocks:
            st.next_stage()
        return self.kept.pop(name, default)

    def order_key(self, name):
        """Sort key putting names in the stream's block order (others last)."""
        k = self.stream.stage_of(name)
        return (k is None, k if k is not None else 0)


def calibrate(source, *, text=None, max_tokens=None, full_max_cols=FULL_MAX_COLS,
              sensitivity=True, eps=0.05, seed=0, sens_tokens=256, act="f32",
              batch=32, window=256, log=None, keep_grams=True, on_stage=None) -> Calibration:
    """Accumulate every linear layer's input gram (and sensitivity) on calibration
    text, streaming the model one block at a time (:class:`CalibrationStream`).

    Parameters
    ----------
    source, text, max_tokens, full_max_cols, sensitivity
        As :class:`CalibrationStream`.
    eps : float
        Relative output error of the sensitivity probe's weight perturbation (> 0).
    seed : int
        Seed of the probe (one generator per layer: ``[seed, index]``, the
        layer's index in block order).
    sens_tokens : int or "auto"
        Token cap for the sensitivity forwards (also capped by ``max_tokens``).
        ``"auto"``: 256 while the perturbed forwards' work (``2 x`` the weights
        of every block from a layer's own to the head, per layer and token) stays
        within :data:`SENS_WORK`; beyond it the held-out probe is left out and the
        tokens are cut to fit, down to :data:`SENS_MIN_TOKENS`
        (:attr:`CalibrationStream.sens_val_dropped`).
    act : {"f32", "auto", "int8"}
        Activation mode of the dense ``PackedLinear`` calls.
    batch : int
        Encoder sentences per forward.
    window : int
        Decoder tokens per forward (each window attends only within itself).
    log : callable, optional
        ``log(str)`` progress lines, one per block (default: stderr when it is
        a terminal).
    keep_grams : bool
        Return every gram in :attr:`Calibration.grams` (``False``: only
        ``on_stage`` sees them, so memory holds one block's grams).
    on_stage : callable, optional
        ``on_stage(stage, grams)`` after each block (and the head stage).

    Returns
    -------
    Calibration
    """
    st = CalibrationStream(source, text=text, max_tokens=max_tokens,
                           full_max_cols=full_max_cols, sensitivity=sensitivity, eps=eps,
                           seed=seed, sens_tokens=sens_tokens, act=act, batch=batch,
                           window=window, log=log)
    grams = {}
    for k, g in st:
        if on_stage is not None:
            on_stage(k, g)
        if keep_grams:
            grams.update(g)
    return st.result(grams)


class GramsError(ValueError):
    """A calibration-grams file (or mapping) breaks the :func:`save_grams` schema."""


def _check_gram_array(name, g, where):
    """float64 C-contiguous copy of one gram: 1-D ``[cols]`` or square ``[cols, cols]``,
    a float dtype, finite; else :class:`GramsError`."""
    a = np.asarray(g)
    if a.dtype.kind != "f":
        raise GramsError(f"{where}: gram of {name!r} must be a float array; got dtype "
                         f"{a.dtype}. Re-run the calibration.")
    if a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[0] != a.shape[1]):
        raise GramsError(f"{where}: gram of {name!r} must be [cols] or square "
                         f"[cols, cols]; got shape {a.shape}. Re-run the calibration.")
    if not np.isfinite(a).all():
        raise GramsError(f"{where}: gram of {name!r} has "
                         f"{int(np.count_nonzero(~np.isfinite(a)))} NaN/Inf entries. "
                         f"Re-run the calibration.")
    return np.ascontiguousarray(a, dtype=np.float64)


class GramsWriter:
    """Write a :func:`load_grams` file one stage at a time (a streamed
    calibration never holds every gram): ``add`` grams as they finish, then
    ``close(meta)``; the file appears atomically at ``close`` and an error or
    :meth:`abort` leaves no file (and the old one, if any, untouched).

    Parameters
    ----------
    path : str or os.PathLike

    Attributes
    ----------
    bytes : int
        Array bytes written so far.

    Notes
    -----
    Layout: arrays ``g0, g1, ...``; ``names``, a JSON list of ``[name, key]``
    string pairs; ``meta``, a JSON object.  Names sharing one array object
    within one :meth:`add` are stored once and share it again after
    :func:`load_grams`.  Usable as a context manager (an exception aborts).
    """

    def __init__(self, path):
        import os
        import zipfile
        from opscope_nb.io._fs import atomic_writer          # the package's one atomic writer
        self.path = os.fspath(path)
        self._cm = atomic_writer(self.path, "wb")
        f = self._cm.__enter__()
        self._z = zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._pairs, self._seen, self._n, self.bytes = [], set(), 0, 0

    def _entry(self, key, arr):
        with self._z.open(key + ".npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array(fh, arr, allow_pickle=False)

    def add(self, grams) -> None:
        """Append ``grams`` (mapping name -> ``[cols]`` / ``[cols, cols]`` float,
        finite); :class:`GramsError` on a bad name or array (the file is then
        aborted)."""
        try:
            if not hasattr(grams, "items"):
                raise GramsError(f"{self.path}: grams must be a mapping name -> array; got "
                                 f"{type(grams).__name__}.")
            keys = {}
            for n, g in grams.items():
                if not isinstance(n, str):
                    raise GramsError(f"{self.path}: gram names must be strings; got {n!r}.")
                if n in self._seen:
                    raise GramsError(f"{self.path}: gram {n!r} was added twice.")
                k = keys.get(id(g))
                if k is None:
                    k = keys[id(g)] = f"g{self._n}"
                    self._n += 1
                    a = _check_gram_array(n, g, self.path)
                    self._entry(k, a)
                    self.bytes += int(a.nbytes)
                self._seen.add(n)
                self._pairs.append([n, k])
        except BaseException as exc:
            self.abort(exc)
            raise

    def close(self, meta=None) -> None:
        """Write ``names`` and ``meta`` (JSON-serialisable) and commit the file."""
        import json
        try:
            meta_json = json.dumps(meta or {})
        except (TypeError, ValueError) as exc:
            err = GramsError(f"{self.path}: meta must be JSON-serialisable ({exc}).")
            self.abort(err)
            raise err from None
        try:
            self._entry("names", np.array(json.dumps(self._pairs)))
            self._entry("meta", np.array(meta_json))
            self._z.close()
        except BaseException as exc:
            self.abort(exc)
            raise
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def abort(self, exc=None) -> None:
        """Drop the temporary file (idempotent)."""
        cm, self._cm = self._cm, None
        if cm is None:
            return
        try:
            self._z.close()
        except Exception:
            pass
        err = exc if isinstance(exc, BaseException) else GramsError("aborted")
        try:
            cm.__exit__(type(err), err, None)
        except BaseException:
            pass

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if ev is not None:
            self.abort(ev)
        else:
            self.abort()        # left without close(): nothing is written
        return False


def save_grams(path, grams, meta=None) -> None:
    """Write calibration grams to an ``.npz`` file (atomic replace; see
    :class:`GramsWriter` for the layout).

    Parameters
    ----------
    path : str or os.PathLike
    grams : mapping of str -> ndarray
        ``[cols]`` or ``[cols, cols]``, float, finite.  Names sharing one array
        object are stored once and share it again after :func:`load_grams`.
    meta : dict, optional
        JSON-serialisable facts stored beside the arrays.

    Raises
    ------
    GramsError
        A name that is not a string, or an array breaking the rules above.
    """
    w = GramsWriter(path)
    w.add(grams)
    w.close(meta)


def _short(value, limit=80):
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def load_grams(path) -> tuple:
    """Read a :func:`save_grams` file, validating it (the file is untrusted).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    grams : dict of str -> ndarray of float64, C-contiguous
        A name sharing a key with another shares the array object.
    meta : dict

    Raises
    ------
    GramsError
        Unreadable or not an ``.npz``; ``names`` not a JSON list of ``[name,
        key]`` string pairs (names unique, keys stored in the file); ``meta``
        not a JSON object; an array not float, not ``[cols]`` / square
        ``[cols, cols]``, or not finite.  Every message is one line.
    """
    import json
    import os
    import zipfile
    path = os.fspath(path)
    fix = "Re-run the calibration (opscope-nb profile --calib) to rewrite it."
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise GramsError(f"{path}: no such file.") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise GramsError(f"{path}: not a calibration-grams .npz file "
                         f"({type(exc).__name__}). {fix}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise GramsError(f"{path}: not a calibration-grams .npz file (a single array). "
                         f"{fix}")

    def text(entry):
        if entry not in z.files:
            raise GramsError(f"{path}: the {entry!r} entry is missing. {fix}")
        try:
            a = z[entry]
            if a.ndim != 0 or a.dtype.kind != "U":
                raise ValueError
            return json.loads(str(a))
        except (ValueError, RecursionError, OSError, zipfile.BadZipFile, EOFError):
            raise GramsError(f"{path}: the {entry!r} entry must be a JSON string. "
                             f"{fix}") from None

    with z:
        pairs = text("names")
        meta = text("meta")
        if not isinstance(meta, dict):
            raise GramsError(f"{path}: 'meta' must be a JSON object; got "
                             f"{type(meta).__name__}. {fix}")
        if not isinstance(pairs, list):
            raise GramsError(f"{path}: 'names' must be a JSON list of [name, key] pairs; "
                             f"got {type(pairs).__name__}. {fix}")
        cache, out = {}, {}
        for p in pairs:
            if not (isinstance(p, list) and len(p) == 2
                    and all(isinstance(v, str) for v in p)):
                raise GramsError(f"{path}: 'names' must hold [name, key] string pairs; "
                                 f"got {_short(p)}. {fix}")
            n, k = p
            if n in out:
                raise GramsError(f"{path}: gram name {_short(n)} is listed twice. {fix}")
            if k in ("names", "meta") or k not in z.files:
                raise GramsError(f"{path}: gram {_short(n)} refers to array {_short(k)}, "
                                 f"which the file does not hold. {fix}")
            if k not in cache:
                try:
                    arr = z[k]
                except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
                    raise GramsError(f"{path}: array {_short(k)} cannot be read "
                                     f"({type(exc).__name__}). {fix}") from None
                cache[k] = _check_gram_array(n, arr, path)
            out[n] = cache[k]
    return out, meta
