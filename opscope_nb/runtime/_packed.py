"""Run a packed compression option as a linear layer: :class:`PackedLinear`.

``PackedLinear`` holds the arrays :func:`opscope_nb.formats.pack` returns for
one weight ``w`` (PyTorch Linear layout ``[out, in]`` = ``[rows, cols]``) and
one :class:`~opscope_nb.formats.Decomp`, and computes ``y = x @ W_hat.T``
(``W_hat = unpack(...)``) **from those arrays** with the njit kernel of its
kind (nibbles, crumbs, 2:4 values + slots, factors and cores are read inside
the kernel; ``__call__`` never builds the dense ``W_hat``).

>>> import numpy as np
>>> from opscope_nb.formats import Decomp
>>> from opscope_nb.runtime import PackedLinear
>>> w = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
>>> lin = PackedLinear.pack(w, Decomp.lowrank(8))
>>> y = lin(np.ones((3, 48), np.float32))          # [3, 64] float32
>>> lin.nbytes == 4 * (64 + 48) * 8
True

Kernels per kind (``act`` choices)
----------------------------------
Each kind's forward function is an entry of :data:`_FORWARD` (``kind ->
fn(lin, x2d, act) -> y``, ``x2d`` float32 C-contiguous ``[m, cols]``
already validated, ``act`` in ``{"auto", "f32", "int8"}``, ``y`` float32
``[m, rows]``).  Float-weight kinds (dense, sparse2:4, low-rank, Monarch,
Tucker, TT) and the ggml block types (decoded per call, chunk by chunk of
rows, then a float32 matmul) have no integer-activation path: every ``act`` computes in
float32 (``"auto"`` = ``"f32"``).  The quantised kinds register their own
entries (see their module).  A kind without a registered kernel raises
``NotImplementedError`` on call (never a silent densification).

A ``+lr`` option (quantised codes plus a rank-``lr`` int8 correction,
``Decomp.lr``) runs its quantised kind's kernel with ``act`` as above, then
adds ``((x @ lr_vᵀ) * lr_s) @ lr_uᵀ`` in float32 in the same call.
"""
from __future__ import annotations

import math

import numpy as np

from opscope_nb import formats
from opscope_nb.formats import ggml as _ggml
from opscope_nb.formats import Decomp
from opscope_nb import kernels as _k
from opscope_nb.kernels._jit import njit as _njit
from opscope_nb.kernels._w8a8 import PAR_MIN as _PAR_MIN, _prefill_kw
from opscope_nb.kernels._quant_probe import absmax_f32 as _absmax_f32

__all__ = ["PackedLinear", "expected_arrays", "measure_latency", "has_kernel", "check_ms",
           "ACTS"]

#: Accepted ``act`` values of :meth:`PackedLinear.__call__`.
ACTS = ("auto", "f32", "int8")


# ─────────────────────────── packed-array layouts ───────────────────────────

def expected_arrays(rows: int, cols: int, decomp: Decomp) -> dict:
    """``{name: (dtype, shape)}`` a ``[rows, cols]`` weight packed as
    ``decomp`` must have: :func:`opscope_nb.formats.layout` (kept under this
    name for existing callers)."""
    return formats.layout(rows, cols, decomp)


def _as_decomp(decomp):
    if isinstance(decomp, Decomp):
        return decomp
    if isinstance(decomp, str):
        return Decomp.from_label(decomp)
    if isinstance(decomp, dict):
        return Decomp.from_dict(decomp)
    raise TypeError(f"decomp must be a Decomp (or its label / to_dict()); got "
                    f"{type(decomp).__name__}. Use e.g. Decomp.int8().")


def _as_shape(shape):
    try:
        rows, cols = (int(shape[0]), int(shape[1]))
        if len(shape) != 2:
            raise ValueError
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"shape must be (rows, cols); got {shape!r}.") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"shape must be positive (rows, cols); got {shape!r}.")
    return rows, cols


# ─────────────────────────── the layer ───────────────────────────

class PackedLinear:
    """A linear layer stored in one packed compression format.

    Parameters
    ----------
    decomp : Decomp (or its label str / ``to_dict()`` dict)
    arrays : dict of str -> ndarray
        Exactly the arrays of the layout table for ``decomp`` and ``shape``
        (:func:`opscope_nb.formats.layout`), dtype and shape as listed;
        float arrays finite.  Non-contiguous arrays are copied; others are
        kept as given (no copy: do not modify them afterwards -- derived data
        such as the int8 row sums is computed here, once), except TT cores,
        which are gathered into one buffer the kernel walks.
    shape : (int, int)
        ``(rows, cols)`` = ``[out_features, in_features]`` of the weight.

    Raises
    ------
    ValueError
        A missing, extra, wrongly typed, wrongly shaped or non-finite array
        (the message names the array, the expected and the received
        dtype/shape), or a layout this runtime cannot run.

    Attributes
    ----------
    decomp : Decomp
    shape : (int, int)
    arrays : dict of str -> ndarray
        Read-only views, element-for-element equal to
        ``formats.pack(w, decomp)``.
    nbytes : int
        ``sum(a.nbytes)`` == ``formats.packed_bytes(rows, cols, decomp)``.
    """

    __slots__ = ("_decomp", "_shape", "_arrays", "_kind", "_aux")

    def __init__(self, decomp, arrays, shape):
        d = _as_decomp(decomp)
        rows, cols = _as_shape(shape)
        if not isinstance(arrays, dict):
            raise TypeError(f"arrays must be a dict of name -> ndarray; got "
                            f"{type(arrays).__name__}.")
        want = expected_arrays(rows, cols, d)
        missing = [n for n in want if n not in arrays]
        extra = [n for n in arrays if n not in want]
        if missing or extra:
            raise ValueError(
                f"{d.label} [{rows}x{cols}] needs arrays {sorted(want)}; missing "
                f"{missing}, unexpected {extra}.")
        got = {}
        for name, (dt, shp) in want.items():
            a = arrays[name]
            if not isinstance(a, np.ndarray):
                raise ValueError(f"array {name!r} of {d.label}: expected ndarray {dt} "
                                 f"{shp}; got {type(a).__name__}.")
            if a.dtype != dt or tuple(a.shape) != tuple(shp):
                raise ValueError(
                    f"array {name!r} of {d.label} [{rows}x{cols}]: expected dtype {dt} "
                    f"shape {tuple(shp)}; got dtype {a.dtype} shape {tuple(a.shape)}.")
            if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
                raise ValueError(f"array {name!r} of {d.label} must be finite; it holds "
                                 f"{int(a.size - np.isfinite(a).sum())} NaN/Inf.")
            got[name] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        self._decomp = d
        self._shape = (rows, cols)
        self._kind = d.kind
        self._aux = None
        if d.kind == "tt":
            got, self._aux = _tt_prepare(got, d, rows)
        elif d.kind == "int8":
            # per-output code sums for the W8A8 prefill's offset correction,
            # computed here once (4 bytes per output, not part of the format):
            # never from a cache that an edit of the codes could leave stale
            self._aux = _k.i8_row_sums(got["codes"])
        self._arrays = got

    @classmethod
    def pack(cls, w, decomp, *, gram=None) -> "PackedLinear":
        """Pack ``w`` (``[out, in]``, converted to float32, finite) as ``decomp``
        with :func:`opscope_nb.formats.pack` and wrap the arrays (``gram``: the
        calibration gram a ``+gptq`` decomp needs)."""
        d = _as_decomp(decomp)
        arrays = formats.pack(w, d, gram=gram)
        w_shape = np.shape(w)
        return cls(d, arrays, w_shape)

    # -- attributes --------------------------------------------------------
    @property
    def decomp(self) -> Decomp:
        return self._decomp

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def arrays(self) -> dict:
        # read-only views: the kernels keep the writable buffers (numba types
        # a read-only array apart, so handing those to them would compile
        # every kernel twice)
        return {n: _frozen(a) for n, a in self._arrays.items()}

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self._arrays.values()))

    def dense(self) -> np.ndarray:
        """float32 ``[rows, cols]`` reconstruction (``formats.unpack``); for
        inspection only -- calls never use it."""
        return formats.unpack(self._arrays, self._decomp, self._shape)

    def __repr__(self):
        return (f"PackedLinear({self._decomp.label}, shape={self._shape}, "
                f"nbytes={self.nbytes})")

    # -- forward -----------------------------------------------------------
    def __call__(self, x, act="auto"):
        """``y = x @ W_hat.T``.

        Parameters
        ----------
        x : array_like, shape (m, cols) or (cols,)
            Real values (float64 / float16 / int converted to float32), finite.
            A 1-D ``x`` is one row and gives a 1-D ``y`` of length ``rows``;
            ``m = 0`` gives an empty ``[0, rows]``.
        act : {"auto", "f32", "int8"}
            Activation path (see the module docstring per kind).

        Returns
        -------
        ndarray of float32, shape (m, rows) (or (rows,) for 1-D ``x``)
        """
        if act not in ACTS:
            raise ValueError(f"act must be one of {ACTS}; got {act!r}.")
        if (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2
                and x.flags.c_contiguous):
            x2 = x
            one = False
        else:
            x2, one = _coerce_x(x)
        cols = self._shape[1]
        if x2.shape[1] != cols:
            raise ValueError(f"x must have {cols} columns (in_features of this "
                             f"{self._shape[0]}x{cols} layer); got shape {np.shape(x)}.")
        if x2.shape[0] == 0:
            return np.zeros((0, self._shape[0]), np.float32)
        fn = _FORWARD.get(self._kind)
        if fn is None:
            raise NotImplementedError(
                f"no kernel registered for {self._decomp.label} yet "
                f"(runtime._FORWARD has {sorted(_FORWARD)}).")
        if self._kind in _CHECKED:
            # the compiled forward checks finiteness itself (None, or for the
            # low-bit kinds an empty array, if not): one dispatch instead of
            # two, about 1 us of a decode call
            y = fn(self, x2, act)
        elif math.isfinite(_absmax_f32(x2.reshape(-1), 0, x2.size)):
            # one vectorised max over the |x| bit patterns (NaN sorts above
            # inf): np.isfinite(x2).all() built a bool array first, 1.5 us of
            # a 1 x 1024 decode and 12 us at 32 x 4096
            y = fn(self, x2, act)
        else:
            y = None
        if y is None or y.shape[0] != x2.shape[0]:
            raise ValueError(f"x must be finite; it holds "
                             f"{int(x2.size - np.isfinite(x2).sum())} NaN/Inf element(s).")
        if self._decomp.lr is not None:
            y = _add_correction(self._arrays, x2, y)
        return y[0] if one else y


def _add_correction(arrays, x2, y):
    """``y + ((x2 @ lr_vᵀ) * lr_s) @ lr_uᵀ`` of a ``+lr`` layer, in float32.

    The int8 factors are widened per call (``(rows + cols) * lr`` values,
    a few per cent of the quantised product's reads at ``lr <= 32``) rather
    than kept as float32 copies, so the layer holds exactly its packed bytes.
    """
    v = arrays["lr_v"].astype(np.float32)
    u = arrays["lr_u"].astype(np.float32)
    t = x2 @ v.T
    t *= arrays["lr_s"]
    y = np.ascontiguousarray(y, dtype=np.float32)
    y += t @ u.T
    return y


def _frozen(a):
    """A read-only view of ``a`` (the layer's arrays cannot be edited through it)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _coerce_x(x):
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"x must be a numeric array; got {type(x).__name__} "
                            f"({exc}).") from None
    if a.dtype.kind not in "fiu":
        raise TypeError(f"x must have a real numeric dtype; got {a.dtype}. Pass float32.")
    if a.ndim not in (1, 2):
        raise ValueError(f"x must be 1-D (one row) or 2-D [m, cols]; got {a.ndim}-D with "
                         f"shape {a.shape}. Reshape it to (-1, cols).")
    one = a.ndim == 1
    if one:
        a = a[None, :]
    with np.errstate(over="ignore"):
        x2 = np.ascontiguousarray(a, dtype=np.float32)
    return x2, one


# ─────────────────────────── per-kind forward table ───────────────────────────

def _tt_prepare(arrays, d, rows):
    n = len(d.modes)
    shapes = np.array([arrays[f"core{i}"].shape for i in range(n)], dtype=np.int64)
    split = int(_k.tt_split(shapes, rows))
    if split < 1:
        raise ValueError(f"{d.label}: no leading modes multiply to rows={rows}, so the "
                         f"TT operator has no input/output split and cannot run as a "
                         f"layer; choose modes whose first ones multiply to rows.")
    sizes = [int(np.prod(s)) for s in shapes]
    flat = np.empty(sum(sizes), np.float32)
    out = {}
    o = 0
    for i in range(n):
        c = arrays[f"core{i}"]
        flat[o:o + sizes[i]] = c.ravel()
        out[f"core{i}"] = flat[o:o + sizes[i]].reshape(c.shape)
        o += sizes[i]
    return out, (flat, shapes, split)


def _fwd_dense(lin, x, act):
    # kernels.dense_linear is this call; calling matmul_f32 directly saves a
    # dispatch and a per-process compile (see kernels/_packed_float.py).
    return _k.matmul_f32(x, lin._arrays["w"])


def _fwd_sparse24(lin, x, act):
    a = lin._arrays
    return _k.sparse24_linear(x, a["values"], a["indices"])


def _fwd_lowrank(lin, x, act):
    a = lin._arrays
    return _k.matmul_f32(_k.matmul_f32(x, a["b"]), a["a"])   # = kernels.lowrank_linear


def _fwd_monarch(lin, x, act):
    a = lin._arrays
    return _k.monarch_linear(x, a["w1"], a["w2"])


def _fwd_tucker(lin, x, act):
    a = lin._arrays
    return _k.tucker_linear(x, a["core"], a["u0"], a["u1"], a["u2"])


def _fwd_tt(lin, x, act):
    flat, shapes, split = lin._aux
    return _k.tt_linear(x, flat, shapes, split)


# Quantised kinds (kernels in ``kernels/_packed_quant.py``).
# ``act="auto"`` per kind = the faster path on the benchmark machine
# (benchmarks/bench_packed_quant.py): see _AUTO_INT8.
#: Kinds whose ``act="auto"`` runs the int8-activation path.
_AUTO_INT8 = frozenset({"int8", "int4", "int4g", "ternary", "intn"})


def _act8(lin, act):
    return act == "int8" or (act == "auto" and lin._kind in _AUTO_INT8)


@_njit
def _finite(x):
    return math.isfinite(_absmax_f32(x.ravel(), 0, x.size))


# One compiled entry per kind and activation path (``act8`` picks it here, in
# Python), so a layer compiles only its own kernel: an njit entry taking
# ``act8`` as an argument compiles both paths.
@_njit
def _int8_checked_a8(x, codes, scales, wsum, prefill=True, rowsplit=True, outsplit=True,
                     tiles=True):
    """W8A8 ``packed_int8_linear`` after the finiteness check, or ``None``
    (the flags as :func:`~opscope_nb.kernels.w8a8_prefill_kw` gives them)."""
    if not _finite(x):
        return None
    return _k.dynamic_matmul_w8a8(x, codes, scales, np.int64(_PAR_MIN), wsum, prefill,
                                  rowsplit, outsplit, tiles)


@_njit
def _int8_checked_a16(x, codes, scales):
    """W8A16 ``packed_int8_linear`` after the finiteness check, or ``None``."""
    if not _finite(x):
        return None
    return _k.matmul_w8a16(x, codes, scales, np.int64(_PAR_MIN))


def _lowbit_path(lin, x) -> dict:
    """Keyword flags for the low-bit kernels: the path this call's shape takes
    stays at its default, the other is ``None`` so it is not compiled (about
    half the code: a cold first int4/g32 act=int8 decode at 1 x 384 x 384
    took 51.4 s with both paths, 25.8 s with one; Zen 3, int8 path avx2).
    The rule is the kernels' own:
    prefill when ``m >= 4`` and ``rows >= 4``.  The other flag is omitted,
    not ``True``: an explicit ``bool`` would compile a second specialisation
    of the same code.  (A prefill-only entry prunes its decode branch through
    the raise the kernels put under ``decode is None``: numba prunes ``x is
    None`` only for an ``x`` typed None.)"""
    if x.shape[0] >= 4 and lin._shape[0] >= 4:
        return _PREFILL_ONLY
    return _DECODE_ONLY


_PREFILL_ONLY = {"decode": None}
_DECODE_ONLY = {"prefill": None}


def _fwd_int8(lin, x, act):
    a = lin._arrays
    if _act8(lin, act):
        # the one W8A8 path this shape takes, so only that path compiles
        return _int8_checked_a8(x, a["codes"], a["scales"], lin._aux,
                                **_prefill_kw(x.shape[0], x.shape[1], lin._shape[0], _PAR_MIN,
                                              True))
    return _int8_checked_a16(x, a["codes"], a["scales"])


def _scales2d(lin):
    # int4 / intN scales as a 2-D array, per-channel ones as their (rows, 1)
    # view (no byte more): a channel and a group layer of one kind then share
    # one compiled entry (numba types a 1-D and a 2-D array apart)
    return lin._arrays["scales"].reshape(lin._shape[0], -1)


def _fwd_int4(lin, x, act):
    a = lin._arrays
    g = lin._decomp.group if lin._kind == "int4g" else 0
    if not _act8(lin, act):
        return _k.int4_linear_checked_a16(x, a["codes"], _scales2d(lin), lin._shape[1], g,
                                          **_lowbit_path(lin, x))
    kw = _lowbit_path(lin, x)
    if kw is _PREFILL_ONLY:
        # a shape the W4A8 panel takes whole compiles no dot-tile core
        kw = {**kw, **_k.w4a8_tiles_kw(x.shape[0], lin._shape[0], lin._shape[1], g)}
    return _k.int4_linear_checked_a8(x, a["codes"], _scales2d(lin), lin._shape[1], g, **kw)


def _fwd_ternary(lin, x, act):
    a = lin._arrays
    fn = _k.ternary_linear_checked_a8 if _act8(lin, act) else _k.ternary_linear_checked_a16
    # (min_parallel omitted, as for int4: the entry's default, one specialisation)
    return fn(x, a["codes"], a["alpha"], lin._shape[1], **_lowbit_path(lin, x))


def _fwd_intn(lin, x, act):
    a = lin._arrays
    d = lin._decomp
    lo = a["lo"]
    fn = _k.intn_linear_entry(d.bits, _act8(lin, act))
    return fn(x, lo, a.get("hi", lo), _scales2d(lin), lin._shape[1], d.group or 0, _PAR_MIN,
              **_lowbit_path(lin, x))


#: Weights decoded per chunk of rows by the ggml forward (float32 elements).
_GGML_CHUNK = 1 << 18


def _fwd_ggml(lin, x, act):
    # Per call, chunks of rows are decoded with ggml's decoders
    # (opscope_nb.formats.ggml.dequantize: the parallel njit cores, bit-identical to
    # gguf-py) into a float32 buffer of at most _GGML_CHUNK weights and
    # multiplied with the f32 kernel: y = x @ dequantize(blocks).T.  No
    # integer-activation path and no decoded cache (the layer holds only the
    # ggml bytes; a call pays the decode, which is what the latency shows).
    blocks = lin._arrays["blocks"]
    rows, cols = lin._shape
    qt = lin._decomp.qtype
    step = max(1, _GGML_CHUNK // cols)
    if step >= rows:
        return _k.matmul_f32(x, _ggml.dequantize(blocks, qt, (rows, cols)))
    y = np.empty((x.shape[0], rows), np.float32)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        wc = _ggml.dequantize(blocks[r0:r1], qt, (r1 - r0, cols))
        y[:, r0:r1] = _k.matmul_f32(x, wc)
    return y


#: Forward function per ``Decomp.kind``: ``fn(lin, x2d, act) -> y`` with
#: ``x2d`` float32 C-contiguous finite ``[m >= 1, cols]`` and ``y`` float32
#: ``[m, rows]`` (kinds in :data:`_CHECKED` get ``x2d`` unchecked and return
#: ``None`` or an empty ``[0, rows]`` when it is not finite).  Quantised kinds ("int8", "int4", "int4g", "ternary",
#: "intn", ...) are registered by their kernel module below.
_FORWARD = {
    "dense": _fwd_dense,
    "sparse24": _fwd_sparse24,
    "lowrank": _fwd_lowrank,
    "monarch": _fwd_monarch,
    "tucker": _fwd_tucker,
    "tt": _fwd_tt,
    # -- quantised kinds --
    "int8": _fwd_int8,
    "int4": _fwd_int4,
    "int4g": _fwd_int4,
    "ternary": _fwd_ternary,
    "intn": _fwd_intn,
    "ggml": _fwd_ggml,
}


#: Kinds whose forward checks finiteness inside its compiled call.
_CHECKED = frozenset({"int8", "int4", "int4g", "ternary", "intn"})


# ─────────────────────────── latency measurement ───────────────────────────

def has_kernel(kind: str) -> bool:
    """Whether :data:`_FORWARD` has a kernel for ``Decomp.kind`` ``kind``."""
    return kind in _FORWARD


def measure_latency(lin, ms=(1, 32), *, act="auto", seed=0, rounds=3,
                    block_s=0.002, max_reps=64, quantile=0.5) -> dict:
    """Warm wall time (µs) of ``lin(x, act)`` for each batch size ``m`` in ``ms``.

    Like ``bench.py``'s ``time_group``: per round, one untimed call, then a
    block of back-to-back timed calls (as many as fit in ``block_s`` seconds,
    3 to ``max_reps``); the figure is the median of the best round's block.
    ``x`` is standard normal ``[m, cols]`` float32 from ``seed``.
    ``quantile`` replaces the block median by another quantile of the block's
    calls: on an oversubscribed machine a parallel kernel waits a whole time
    slice for its worker threads on many calls (measured here, 2 cores, load
    12: half the calls of a 384x1536 dense layer took 20-24 ms instead of
    21 µs), and ``quantile=0.25`` keeps those out.  The weights
    are whatever cache level they fit in after the warm call (a small layer is
    timed from cache, as it runs when a model is decoded layer after layer
    only if the whole model fits).

    Parameters
    ----------
    lin : PackedLinear
    ms : sequence of int
        Batch sizes (``>= 1``).
    act : {"auto", "f32", "int8"}
    seed : int
    rounds : int
    block_s : float
    max_reps : int
    quantile : float
        In ``(0, 1]``; 0.5 = the block median.

    Returns
    -------
    dict of int -> float
        ``{m: microseconds}``; empty when ``lin``'s kind has no kernel yet.
    """
    import time

    if not isinstance(lin, PackedLinear):
        raise TypeError(f"lin must be a PackedLinear; got {type(lin).__name__}.")
    ms = check_ms(ms)
    quantile = float(quantile)
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must lie in (0, 1]; got {quantile!r}.")
    if not has_kernel(lin._kind):
        return {}
    rng = np.random.default_rng(seed)
    out = {}
    for m in ms:
        x = rng.standard_normal((m, lin.shape[1])).astype(np.float32)
        lin(x, act)                                  # warm (compile / cache load)
        t0 = time.perf_counter()
        lin(x, act)
        one = max(time.perf_counter() - t0, 1e-7)
        reps = int(min(max_reps, max(3, block_s / one)))
        best = math.inf
        for _ in range(max(1, int(rounds))):
            lin(x, act)
            ts = np.empty(reps)
            for r in range(reps):
                t0 = time.perf_counter()
                lin(x, act)
                ts[r] = time.perf_counter() - t0
            best = min(best, float(np.quantile(ts, quantile)))
        out[int(m)] = 1e6 * best
    return out


def check_ms(ms) -> tuple:
    """Validated latency batch sizes: a tuple of distinct positive ints."""
    if isinstance(ms, (int, np.integer)):
        ms = (ms,)
    try:
        vals = [int(v) for v in ms]
    except (TypeError, ValueError):
        raise TypeError(f"latency batch sizes must be a sequence of ints, e.g. (1, 32); "
                        f"got {ms!r}.") from None
    if not vals or any(v < 1 for v in vals) or any(v != float(w) for v, w in zip(vals, ms)):
        raise ValueError(f"latency batch sizes must be positive ints, e.g. (1, 32); "
                         f"got {ms!r}.")
    return tuple(dict.fromkeys(vals))

