"""Explicit SIMD building blocks lowered through llvmlite (numba ``@intrinsic``).

Why hand-written IR: numba widens integer arithmetic to int64, so a plain
``acc += a[p] * b[p]`` over int8 vectorises into 64-bit lanes
(``vpmovsxbq``/``vpmuldq``) and loses to float32.  The int8 dot tiles below
emit the vector loop themselves, keeping int32 accumulators:

* on x86 with AVX2 each 16-element step loads ``<16 x i8>``, sign-extends to
  ``<16 x i16>`` (``vpmovsxbw``) and multiplies-and-pairwise-adds with
  ``llvm.x86.avx2.pmadd.wd`` (``vpmaddwd``: 16 int8 MACs per instruction into
  eight int32 lanes), then ``vpaddd`` into the accumulator;
* elsewhere (Arm NEON, SSE-only x86, ...) the same step is written as portable
  vector IR (sign-extend to ``<16 x i32>``, ``mul``, add even and odd lanes)
  which LLVM lowers to the target's widening multiply-accumulate.

The int32 sums are exact as long as ``k * 127 * 127 < 2**31`` (``k <= 133144``).

Tile kinds (``<kind>dot_tile_<R>x<C>``):

* ``i8``  -- int8 x int8 (W8A8) through :func:`i8_dot_accumulate`, on the
  int8 path chosen from the host at import (:data:`HOST_I8_PATH`, one of
  :data:`I8_PATHS`; the environment variable ``OPSCOPE_I8_PATH`` forces any
  path the host can run, see :data:`I8_PATH_ENV`): ``vpdpbusd`` (AVX-512 VNNI at 256 or 512 bits, or
  AVX-VNNI), the AVX2 ``vpmaddubsw`` idiom (``|x|`` as unsigned times ``w *
  sign(x)`` via ``vpsignb``; the i16 pair sums, at most 2 * 128 * 127, never
  saturate, then ``vpmaddwd`` by ones into int32), or portable IR;
* ``w16`` -- int16 activation codes x int8 weights (W8A16): ``vpmovsxbw`` +
  ``vpmaddwd``, int32 lanes, final reduction in float64;
* ``f32`` -- float32 x float32 with ``llvm.fmuladd`` (``vfmadd`` on FMA hosts).

A tile ``R x C`` computes ``R`` activation rows against ``C`` weight rows
(output-major ``wt[n, k]`` layout) in one pass over ``k``, so each loaded
vector is reused ``C`` (resp. ``R``) times from registers -- the register
blocking that turns the kernel from load-bound into multiply-bound.
"""
from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from ._jit import intrinsic

# (one list of path names, shared with _config)
from ._jit import I8_PATHS

__all__ = [
    "I8_CHUNK",
    "i8dot_tile_1x1",
    "i8dot_tile_1x4",
    "i8dot_tile_2x1",
    "i8dot_tile_2x4",
    "i8dot_tile_4x4",
    "i8dot_raw_tile_4x4",
    "i8dot_rawc_tile_4x4",
    "I8_RAW_OFFSET",
    "I8_OFFSET_PATHS",
    "make_i8_raw_tile",
    "i8_dot_accumulate",
    "i8_abs",
    "make_i8_tile",
    "make_i8_panel_tile",
    "I8_PANEL",
    "I8_PANEL_J",
    "I8_PANEL_LANES",
    "I8_PANEL_CORR",
    "i8panel_tile_32",
    "i8panel_tile_16",
    "i8panel_ttile_32",
    "i8panel_ttile_16",
    "f32_transpose8",
    "panel_pack8",
    "path_supported",
    "I8_PATHS",
    "target_cpu_name",
    "I8_STEP",
    "I8_LANES",
    "HOST_I8_PATH",
    "I8_PATH_ENV",
    "I8_PATH_FORCED",
    "f32dot_tile_1x1",
    "f32dot_tile_1x4",
    "f32dot_tile_2x4",
    "w8dot_tile_1x1",
    "w8dot_tile_1x4",
    "w16dot_tile_1x1",
    "w16dot_tile_1x4",
    "w16dot_tile_2x1",
    "w16dot_tile_2x4",
    "W16_CHUNK",
    "F32_CHUNK",
    "simd_path",
]

#: int16 x int8 elements consumed per step of a ``w16dot_tile_*``.
W16_CHUNK = 16
#: float32 elements consumed per step of an ``f32dot_tile_*`` / ``w8dot_tile_*``.
F32_CHUNK = 8

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _target_features() -> str:
    """Feature string numba compiles for (``NUMBA_CPU_FEATURES`` or the host's)."""
    feats = numba.config.CPU_FEATURES
    if feats:
        return feats
    if numba.config.CPU_NAME:  # e.g. NUMBA_CPU_NAME=generic for portable caches
        return ""
    try:
        import llvmlite.binding as llb
        return llb.get_host_cpu_features().flatten()
    except Exception:  # pragma: no cover - exotic hosts
        return ""


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_FEATS = frozenset(f[1:] for f in _target_features().split(",") if f.startswith("+"))
#: Whether the host has AVX2 (``vpmaddwd`` for the w16 tiles and the AVX2
#: int8 path).  Decided once, at import, from the features numba targets; the
#: on-disk cache is keyed on the same CPU name and features, so a cached
#: kernel always matches this choice.
USE_AVX2_PMADDWD = _X86 and "avx2" in _FEATS

# I8_PATHS: the int8 dot-product paths, fastest first.  ``i8_dot_accumulate``
# and the ``i8dot_tile_*`` intrinsics lower to one of them:
#
# * ``avx512vnni``    -- ``vpdpbusd`` on 512-bit vectors (AVX-512 VNNI + BW);
# * ``avx512vnni256`` -- ``vpdpbusd`` on 256-bit vectors (AVX-512 VNNI + VL);
# * ``avxvnni``       -- the VEX ``vpdpbusd`` of AVX-VNNI (Alder Lake, Zen 5),
#   same IR as ``avx512vnni256``;
# * ``avx2``          -- ``vpmaddubsw`` + ``vpmaddwd`` by ones;
# * ``portable``      -- widen to int32, multiply, add lane groups.

#: Features each path needs (``portable`` needs none).
_PATH_NEEDS = {
    "avx512vnni": ("avx512vnni", "avx512bw", "avx2"),
    "avx512vnni256": ("avx512vnni", "avx512vl", "avx512bw", "avx2"),
    "avxvnni": ("avxvnni", "avx2"),
    "avx2": ("avx2",),
    "portable": (),
}
#: int8 elements per step and int32 accumulator lanes of each path.
I8_STEP = {"avx512vnni": 64, "avx512vnni256": 32, "avxvnni": 32, "avx2": 32,
           "portable": 16}
I8_LANES = {"avx512vnni": 16, "avx512vnni256": 8, "avxvnni": 8, "avx2": 8,
            "portable": 8}


def path_supported(path: str) -> bool:
    """Whether the int8 ``path`` (one of :data:`I8_PATHS`) can be compiled and
    run on the target numba compiles for (plain Python)."""
    if path not in _PATH_NEEDS:
        raise ValueError(f"unknown int8 path {path!r}; expected one of {I8_PATHS}")
    if path == "portable":
        return True
    return _X86 and all(f in _FEATS for f in _PATH_NEEDS[path])


def target_cpu_name() -> str:
    """LLVM CPU name numba compiles for (``NUMBA_CPU_NAME`` or the host's),
    e.g. ``"znver5"``; it picks the host's int8 path."""
    if numba.config.CPU_NAME:
        return numba.config.CPU_NAME
    try:
        import llvmlite.binding as llb
        return llb.get_host_cpu_name()
    except Exception:  # pragma: no cover - exotic hosts
        return ""


#: LLVM CPU names whose cores execute 512-bit ``vpdpbusd`` at full width, so
#: the 512-bit tiles come first.  Zen 5, ``bench.py`` sections 5 and 9 forced
#: each way on 2 cores: W8A8 m = 32 / 128, k = n = 1024: 0.065 / 0.211 ms at
#: 512 bits against 0.092 / 0.343 ms at 256; m = 32 at 4096 x 4096: 0.790 against
#: 1.473 ms; the 1 x 4 decode tile (m = 1, k = 4096, n = 1024, one thread,
#: ``bench_int8.py --paths``) 75.9 against 85.7 us.  Intel server cores are not
#: measured, so they keep the 256-bit default.
WIDE_512_CPUS = frozenset({"znver5"})


def _host_i8_path(cpu: str | None = None) -> str:
    """The host's int8 path; ``cpu`` (an LLVM CPU name) defaults to the one
    numba compiles for."""
    # 256-bit vpdpbusd before 512-bit where a 512-bit op is two 256-bit halves:
    # on Zen 4 the 256-bit tiles measured as fast or faster (4 x 4 tile, m = 32,
    # k = 4096, one thread: 353 vs 347 GOP/s; decode equal) and need half the
    # k-step, so less scalar tail.  benchmarks/bench_int8.py --paths compares.
    cpu = target_cpu_name() if cpu is None else cpu
    if cpu in WIDE_512_CPUS:
        order = ("avx512vnni", "avx512vnni256", "avxvnni", "avx2")
    else:
        order = ("avx512vnni256", "avxvnni", "avx512vnni", "avx2")
    for p in order:
        if path_supported(p):
            return p
    return "portable"


#: Environment variable that forces the int8 path (one of :data:`I8_PATHS`
#: the host can run), read once at import; unset or empty: the host's choice.
I8_PATH_ENV = "OPSCOPE_I8_PATH"


def _chosen_i8_path(environ=None) -> tuple[str, bool]:
    """``(path, forced)``: :data:`I8_PATH_ENV` when set, else the host's pick.

    A value that is not a path, or a path this host cannot run, raises a
    ValueError naming the variable, the value, the supported paths and the fix
    (the kernels would otherwise fail to compile or die of SIGILL).  Forced
    runs compile without the disk cache (``_config.CACHE``): numba keys its
    on-disk cache on the CPU features, which do not change with the forced
    path.
    """
    import os

    value = (os.environ if environ is None else environ).get(I8_PATH_ENV, "").strip()
    if not value:
        return _host_i8_path(), False
    ok = [p for p in I8_PATHS if path_supported(p)]
    if value not in I8_PATHS:
        raise ValueError(f"{I8_PATH_ENV}={value!r} is not an int8 path; expected one of "
                         f"{I8_PATHS} (this host runs {tuple(ok)}); set one of those or "
                         f"unset {I8_PATH_ENV} for the host's choice ({_host_i8_path()!r})")
    if value not in ok:
        raise ValueError(f"{I8_PATH_ENV}={value!r}: this host cannot run the {value} int8 "
                         f"path (it needs CPU features {_PATH_NEEDS[value]}); the host runs "
                         f"{tuple(ok)}; set one of those or unset {I8_PATH_ENV} for the "
                         f"host's choice ({_host_i8_path()!r})")
    return value, True


#: The int8 path the package's kernels use on this machine: the host's best
#: (:func:`_host_i8_path`) unless :data:`I8_PATH_ENV` forces another.
#: :data:`I8_PATH_FORCED` says whether it was forced.
HOST_I8_PATH, I8_PATH_FORCED = _chosen_i8_path()
#: int8 elements consumed per step of an ``i8dot_tile_*`` on the host path.
I8_CHUNK = I8_STEP[HOST_I8_PATH]

_PATH_TEXT = {
    "avx512vnni": "avx512vnni: vpdpbusd zmm (512-bit; multi-row tiles: x^0x80 offset + "
                  "correction, 1-row tiles: vpabsb + sign-select; int32 accumulators)",
    "avx512vnni256": "avx512vnni256: vpdpbusd ymm (256-bit EVEX; multi-row tiles: x^0x80 "
                     "offset + correction, 1-row tiles: vpabsb/vpsignb; int32 accumulators)",
    "avxvnni": "avxvnni: {vex} vpdpbusd ymm (multi-row tiles: x^0x80 offset + correction, "
               "1-row tiles: vpabsb/vpsignb; int32 accumulators)",
    "avx2": "avx2: vpabsb/vpsignb + vpmaddubsw + vpmaddwd(ones) (int32 accumulators)",
    "portable": "portable vector IR: sext i8->i32, mul, lane-group add (int32 accumulators)",
}


def simd_path(path: str | None = None) -> str:
    """Describe an int8 dot path (default: the one compiled on this machine)."""
    return _PATH_TEXT[path or HOST_I8_PATH]


def _const_vec(n, idx):
    return ir.Constant(ir.VectorType(_I32, n), [ir.Constant(_I32, i) for i in idx])


def prefetch(builder, ptr, locality=2):
    """Emit a read prefetch of the byte ``ptr`` points at (any pointer type;
    never faults).  ``locality`` 2 = into L2 (``prefetcht1``: the streaming
    decode tiles use it -- into L1 the next tile's lines were evicted before
    use), 3 = into L1."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_I32, 0),
                      ir.Constant(_I32, locality), ir.Constant(_I32, 1)])


def _shuffle(builder, v, idx):
    return builder.shuffle_vector(v, v, _const_vec(len(idx), idx))


def _madd16(builder, a16, b16):
    """``<16 x i16> x <16 x i16> -> <8 x i32>``: lane i = a[2i]b[2i] + a[2i+1]b[2i+1]."""
    v8i32 = ir.VectorType(_I32, 8)
    v16i16 = ir.VectorType(_I16, 16)
    if USE_AVX2_PMADDWD:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8i32, [v16i16, v16i16]),
            "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [a16, b16])
    even, odd = list(range(0, 16, 2)), list(range(1, 16, 2))
    ae = builder.sext(_shuffle(builder, a16, even), v8i32)
    ao = builder.sext(_shuffle(builder, a16, odd), v8i32)
    be = builder.sext(_shuffle(builder, b16, even), v8i32)
    bo = builder.sext(_shuffle(builder, b16, odd), v8i32)
    return builder.add(builder.mul(ae, be), builder.mul(ao, bo))


def _abs_i8x32(builder, v):
    """``|v|`` lane-wise for ``<32 x i8>`` (``vpabsb``)."""
    v32 = ir.VectorType(_I8, 32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v32, [v32, ir.IntType(1)]), "llvm.abs.v32i8")
    return builder.call(fn, [v, ir.Constant(ir.IntType(1), 0)])


def _madd_sign32(builder, xabs, x, w):
    """AVX2 ``vpmaddubsw`` idiom: 32 int8 products summed into ``<8 x i32>``.

    ``vpmaddubsw`` multiplies unsigned by signed bytes, so the activation's
    sign moves onto the weight: ``|x| * (w * sign(x))`` (``vpsignb``).  The
    adjacent-pair i16 sums are at most ``2 * 127 * 127 = 32258``, so they
    never saturate for codes in [-127, 127]; ``vpmaddwd`` by ones widens the
    pairs to int32.
    """
    v32 = ir.VectorType(_I8, 32)
    v16 = ir.VectorType(_I16, 16)
    v8 = ir.VectorType(_I32, 8)
    mod = builder.module
    psign = cgutils.get_or_insert_function(
        mod, ir.FunctionType(v32, [v32, v32]), "llvm.x86.avx2.psign.b")
    maddubs = cgutils.get_or_insert_function(
        mod, ir.FunctionType(v16, [v32, v32]), "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(
        mod, ir.FunctionType(v8, [v16, v16]), "llvm.x86.avx2.pmadd.wd")
    ws = builder.call(psign, [w, x])
    p16 = builder.call(maddubs, [xabs, ws])
    ones = ir.Constant(v16, [ir.Constant(_I16, 1)] * 16)
    return builder.call(maddwd, [p16, ones])


def _vpdpbusd(builder, acc, u8, s8):
    """``acc + vpdpbusd(u8, s8)`` (unsigned x signed bytes, groups of four
    products into each int32 lane, no saturation); 256 or 512 bits."""
    lanes = acc.type.count
    vi32 = ir.VectorType(_I32, lanes)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vi32, [vi32, vi32, vi32]),
        f"llvm.x86.avx512.vpdpbusd.{32 * lanes}")
    return builder.call(fn, [acc, builder.bitcast(u8, vi32), builder.bitcast(s8, vi32)])


def _abs_i8(builder, v):
    """``|v|`` lane-wise for ``<N x i8>`` (``vpabsb``; ``|-128|`` is 0x80 = 128
    read as unsigned)."""
    vt = v.type
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vt, [vt, ir.IntType(1)]),
        f"llvm.abs.v{vt.count}i8")
    return builder.call(fn, [v, ir.Constant(ir.IntType(1), 0)])


def _sign_onto(builder, w, x):
    """``w * sign(x)`` lane-wise for int8 vectors (``vpsignb`` on 256 bits;
    compare + masked negate on 512 bits, which have no ``vpsignb``)."""
    n = w.type.count
    if n == 32 and USE_AVX2_PMADDWD:
        v32 = ir.VectorType(_I8, 32)
        psign = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v32, [v32, v32]), "llvm.x86.avx2.psign.b")
        return builder.call(psign, [w, x])
    zero = ir.Constant(w.type, None)
    neg = builder.icmp_signed("<", x, zero)
    return builder.select(neg, builder.sub(zero, w), w)


def i8_dot_accumulate(builder, acc, xv, wv, path=None, xabs=None):
    """Add int8 x int8 products into an int32 vector accumulator (llvmlite IR).

    The shared building block of every int8 dot product: lane ``i`` of the
    result is ``acc[i] + sum_{t < g} xv[g*i + t] * wv[g*i + t]`` with
    ``g = len(xv) // len(acc)`` (four on every path but ``portable``'s
    16-element step, where ``g = 2``), computed exactly in int32.

    Parameters
    ----------
    builder : llvmlite.ir.IRBuilder
    acc : llvmlite value ``<L x i32>``
        ``L`` = ``I8_LANES[path]``: 16 for ``avx512vnni``, else 8.
    xv, wv : llvmlite values ``<I8_STEP[path] x i8>``
        Signed int8 codes (activations and weights; the roles are symmetric
        except that ``xabs`` belongs to ``xv``).
    path : str, optional
        One of :data:`I8_PATHS`; default :data:`HOST_I8_PATH`.  The caller
        must only pick a path :func:`path_supported` accepts.
    xabs : llvmlite value, optional
        ``|xv|`` computed once by the caller (:func:`i8_abs`) to share it
        across several ``wv`` (register tiles); computed here when omitted.

    Returns
    -------
    llvmlite value ``<L x i32>``

    Notes
    -----
    ``vpdpbusd`` and ``vpmaddubsw`` multiply *unsigned* by signed bytes, so the
    VNNI and AVX2 paths compute ``|x| * (w * sign(x))``.

    **Contract (every path):** for codes in [-127, 127] on both operands -- the
    symmetric range every quantiser of the package emits -- the result is the
    exact int32 sum, bit-identical on every path.  ``-128`` is outside the
    contract: an ``xv`` byte of ``-128`` is still exact on every path unless
    its ``wv`` byte is ``-128`` too, but a ``wv`` byte of ``-128`` paired with a
    negative ``xv`` byte comes out negated on the sign-trick paths (``vpsignb``
    cannot negate ``-128``), while the portable path and the VNNI offset tiles
    (``R >= 2``) stay exact.  The validating entry points
    (:mod:`opscope_nb.runtime.matmul`) reject ``-128``; user numba code calling the
    tiles directly must keep its codes in range.  (The int16 pair sums of
    ``vpmaddubsw`` never saturate: ``2 * 128 * 127 < 2**15``.)  For int4 codes
    (nibbles unpacked to int8 in [-8, 7]) every path is exact.
    """
    path = path or HOST_I8_PATH
    if path in ("avx512vnni", "avx512vnni256", "avxvnni"):
        xa = xabs if xabs is not None else _abs_i8(builder, xv)
        return _vpdpbusd(builder, acc, xa, _sign_onto(builder, wv, xv))
    if path == "avx2":
        xa = xabs if xabs is not None else _abs_i8(builder, xv)
        return builder.add(acc, _madd_sign32(builder, xa, xv, wv))
    # portable: widen, multiply, add groups of g consecutive products.
    vn = ir.VectorType(_I32, xv.type.count)
    return _add_groups(builder, acc, builder.mul(builder.sext(xv, vn), builder.sext(wv, vn)))


def _add_groups(builder, acc, prod):
    """``acc[i] + sum_t prod[g*i + t]`` with ``g = len(prod) // len(acc)``
    (the portable lowering of the grouped int8 products)."""
    lanes = acc.type.count
    g = prod.type.count // lanes
    out = acc
    for t in range(g):
        out = builder.add(out, _shuffle(builder, prod, [g * i + t for i in range(lanes)]))
    return out


def i8_abs(builder, xv, path=None):
    """``|xv|`` for :func:`i8_dot_accumulate`'s ``xabs`` (``None`` on the
    portable path, which does not use it)."""
    if (path or HOST_I8_PATH) == "portable":
        return None
    return _abs_i8(builder, xv)


def _hsum(builder, v, n, add):
    """Horizontal sum of an ``n``-lane vector by halving (tree order)."""
    while n > 1:
        n //= 2
        v = add(_shuffle(builder, v, list(range(n))),
                _shuffle(builder, v, list(range(n, 2 * n))))
    return builder.extract_element(v, ir.Constant(_I32, 0))


#: Per tile kind: (x dtype, w dtype, lanes per step, elements per step).
_KINDS = {
    "i8": (types.int8, types.int8, I8_LANES[HOST_I8_PATH], I8_CHUNK),
    "f32": (types.float32, types.float32, 8, 8),
    "w8": (types.float32, types.int8, 8, 8),
    "w16": (types.int16, types.int8, 8, 16),
}


#: Rows ahead that the one-row (decode) tiles prefetch their weights.
_PF_ROWS = 8


def _make_tile(R: int, C: int, kind: str, path: str | None = None, raw: bool = False,
               corr_out: bool = False):
    """Build the intrinsic for an ``R x C`` dot tile of the given kind
    (``path``: the int8 path of an ``i8`` tile, default the host's)."""
    xdt, wdt, lanes, step = _KINDS[kind]
    path = path or HOST_I8_PATH
    if kind == "i8":
        lanes, step = I8_LANES[path], I8_STEP[path]
    # VNNI tiles with several rows use the +128 offset: vpdpbusd((x ^ 0x80),
    # w) = sum (x + 128) w, minus 128 * sum w (one extra vpdpbusd per weight
    # row, shared by the R rows) -- one xor per activation vector instead of a
    # sign fix-up per (row, column) pair.  Exact for every int8 code (-128
    # included) while the true sum fits int32: the wrap-around of the
    # intermediate lanes cancels in the final subtraction.
    offset = kind == "i8" and R >= 2 and path in ("avx512vnni", "avx512vnni256", "avxvnni")
    # raw: leave the correction to the caller (who computes 128 * sum w once
    # per weight row instead of once per tile call).
    inline_corr = offset and not raw
    # corr_out (raw tiles only): also return 128 * sum w of each weight row
    # (C more results; zeros when the path has no offset), so the first row
    # group of a column block yields the correction the later raw calls need.
    nout = R * C + (C if corr_out else 0)
    want_corr = offset and (inline_corr or corr_out)
    is_int = kind in ("i8", "w16")
    # w16 sums can exceed int32 across lanes: the final reduction is in f64.
    rdt = {"i8": types.int32, "w16": types.float64}.get(kind, types.float32)
    # Independent accumulator sets: enough chains for ~8 in flight.
    U = max(1, min(4, 8 // (R * C)))

    @intrinsic
    def tile(typingctx, xq, xoff, xstride, wq, woff, wstride, nchunk):
        if not (isinstance(xq, types.Array) and xq.dtype == xdt
                and isinstance(wq, types.Array) and wq.dtype == wdt):
            return None
        sig = types.UniTuple(rdt, nout)(
            xq, types.intp, types.intp, wq, types.intp, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            xa = context.make_array(sig.args[0])(context, builder, args[0])
            wa = context.make_array(sig.args[3])(context, builder, args[3])
            xoff, xstride, woff, wstride, nch = [
                context.cast(builder, args[i], sig.args[i], types.intp)
                for i in (1, 2, 4, 5, 6)]
            intp = context.get_value_type(types.intp)
            f32 = ir.FloatType()
            accty = ir.VectorType(_I32 if is_int else f32, lanes)
            fvec = ir.VectorType(f32, step)
            fmuladd = None
            if not is_int:
                fmuladd = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(fvec, [fvec, fvec, fvec]),
                    "llvm.fmuladd.v8f32")
            # Accumulators live in allocas in the entry block; mem2reg/SROA
            # promote them to vector registers across the loop.
            # U independent accumulator sets: a 1 x 4 tile has only four
            # dependency chains, too few to hide the FMA latency; unrolling
            # by U gives 4U chains.  Accumulators live in entry-block allocas
            # that mem2reg/SROA promote to vector registers.
            accs = []
            for _ in range(U * R * C):
                a = cgutils.alloca_once(builder, accty)
                builder.store(ir.Constant(accty, None), a)
                accs.append(a)
            corrs = []  # offset mode: 128 * sum w per weight row and set
            for _ in range(U * C if want_corr else 0):
                a = cgutils.alloca_once(builder, accty)
                builder.store(ir.Constant(accty, None), a)
                corrs.append(a)
            v8step = ir.VectorType(_I8, step) if kind == "i8" else None
            c80 = ir.Constant(v8step, [ir.Constant(_I8, -128)] * step) if offset else None
            xrow = [builder.gep(xa.data, [builder.add(
                xoff, builder.mul(xstride, ir.Constant(intp, r)))], inbounds=True)
                for r in range(R)]
            wrow = [builder.gep(wa.data, [builder.add(
                woff, builder.mul(wstride, ir.Constant(intp, c)))], inbounds=True)
                for c in range(C)]

            # Decode tiles (one activation row) stream their weights once:
            # every 64-byte line of a weight row is prefetched into L2
            # (prefetcht1) _PF_ROWS rows ahead, i.e. two 1 x 4 tiles ahead --
            # the lines the next calls will read.  Prefetches never fault.
            pfd = builder.mul(wstride, ir.Constant(intp, _PF_ROWS)) if R == 1 else None
            elbytes = {"i8": 1, "w16": 1, "w8": 1, "f32": 4}[kind]
            per_line = max(1, 64 // (step * elbytes))

            def step_at(chunk, aset):
                """One step over elements [chunk*step, (chunk+1)*step)."""
                off = builder.mul(chunk, ir.Constant(intp, step))
                if pfd is not None and aset % per_line == 0:
                    for b in wrow:
                        prefetch(builder, builder.gep(b, [builder.add(off, pfd)]))

                def load(base, elty, widen):
                    vty = ir.VectorType(elty, step)
                    p = builder.gep(base, [off], inbounds=True)
                    v = builder.load(builder.bitcast(p, vty.as_pointer()), align=1)
                    return widen(v) if widen else v

                if offset:
                    xu = [builder.xor(load(b, _I8, None), c80) for b in xrow]
                    wv = [load(b, _I8, None) for b in wrow]
                    for c in range(C if want_corr else 0):
                        cp = corrs[aset * C + c]
                        builder.store(_vpdpbusd(builder, builder.load(cp), c80, wv[c]), cp)
                    for r in range(R):
                        for c in range(C):
                            acc = accs[aset * R * C + r * C + c]
                            builder.store(_vpdpbusd(builder, builder.load(acc), xu[r], wv[c]),
                                          acc)
                    return
                if kind == "i8":
                    xv = [load(b, _I8, None) for b in xrow]
                    wv = [load(b, _I8, None) for b in wrow]
                    xabs = [i8_abs(builder, v, path) for v in xv]
                elif kind == "w16":
                    v16 = ir.VectorType(_I16, 16)
                    xv = [load(b, _I16, None) for b in xrow]
                    wv = [load(b, _I8, lambda v: builder.sext(v, v16)) for b in wrow]
                elif kind == "f32":
                    xv = [load(b, f32, None) for b in xrow]
                    wv = [load(b, f32, None) for b in wrow]
                else:  # int8 codes widened to float32 (exact)
                    xv = [load(b, f32, None) for b in xrow]
                    wv = [load(b, _I8, lambda v: builder.sitofp(v, fvec)) for b in wrow]
                for r in range(R):
                    for c in range(C):
                        acc = accs[aset * R * C + r * C + c]
                        old = builder.load(acc)
                        if kind == "i8":
                            new = i8_dot_accumulate(builder, old, xv[r], wv[c],
                                                    path, xabs[r])
                        elif is_int:
                            new = builder.add(old, _madd16(builder, xv[r], wv[c]))
                        else:
                            new = builder.call(fmuladd, [xv[r], wv[c], old])
                        builder.store(new, acc)

            uconst = ir.Constant(intp, U)
            nmain = builder.udiv(nch, uconst) if U > 1 else nch
            with cgutils.for_range(builder, nmain) as loop:
                base = builder.mul(loop.index, uconst) if U > 1 else loop.index
                for u in range(U):
                    step_at(builder.add(base, ir.Constant(intp, u)), u)
            if U > 1:
                done = builder.mul(nmain, uconst)
                with cgutils.for_range(builder, builder.sub(nch, done)) as loop:
                    step_at(builder.add(done, loop.index), 0)
            # Fold the accumulator sets (exact for int32; a fixed order for
            # float32) into set 0.
            opadd = builder.add if is_int else builder.fadd
            for u in range(1, U):
                for t in range(R * C):
                    a0 = accs[t]
                    builder.store(opadd(builder.load(a0),
                                        builder.load(accs[u * R * C + t])), a0)
            for u in range(1, U if want_corr else 1):
                for c in range(C):
                    builder.store(builder.add(builder.load(corrs[c]),
                                              builder.load(corrs[u * C + c])), corrs[c])
            if inline_corr:
                for r in range(R):
                    for c in range(C):
                        a = accs[r * C + c]
                        builder.store(builder.sub(builder.load(a), builder.load(corrs[c])), a)
            accs = accs[:R * C]
            if kind == "w16":
                f64v = ir.VectorType(ir.DoubleType(), lanes)
                sums = [_hsum(builder, builder.sitofp(builder.load(a), f64v), lanes,
                              builder.fadd) for a in accs]
            else:
                add = builder.add if is_int else builder.fadd
                sums = [_hsum(builder, builder.load(a), lanes, add) for a in accs]
            if corr_out:
                if want_corr:
                    sums += [_hsum(builder, builder.load(corrs[c]), lanes, builder.add)
                             for c in range(C)]
                else:
                    sums += [ir.Constant(_I32, 0)] * C
            return context.make_tuple(builder, sig.return_type, sums)

        return sig, codegen

    what = {"i8": "int8 x int8 -> exact int32 sums",
            "f32": "float32 x float32 -> float32 sums (8 lanes, fused multiply-add)",
            "w8": "float32 activations x int8 weight codes -> float32 sums",
            "w16": "int16 activation codes x int8 weight codes -> exact sums "
                   "(int32 lanes, reduced in float64)"}[kind]
    tile.__doc__ = f"""Dot tile ({what}): {R} activation row(s) x {C} weight row(s).

    Call from ``@njit`` code as
    ``t = tile(x, xoff, xstride, w, woff, wstride, nchunk)``.

    Parameters
    ----------
    x : ndarray of {xdt}, C-contiguous (any ndim; addressed flat)
        Activations ``x[m, k]``.
    xoff, xstride : int
        Flat element offset of the tile's first activation row, and the
        distance between rows (``k`` for a C-contiguous ``[m, k]``).
    w : ndarray of {wdt}, C-contiguous (addressed flat)
        Output-major weights ``wt[n, k]``.
    woff, wstride : int
        As for ``x``, for the tile's first weight row.
    nchunk : int
        Number of {step}-element steps; the tile covers elements
        ``[0, nchunk * {step})`` of every row. The caller adds the tail.

    Returns
    -------
    tuple of {R * C} {rdt}
        ``t[r * {C} + c] = sum_p x[row r, p] * w[row c, p]`` over the covered
        elements{" (exact for k <= 133144)" if kind == "i8" else ""}{
        " (exact while every int32 lane stays in range: |x| * 127 * k / 8 < 2**31)"
        if kind == "w16" else ""}.

    Notes
    -----
    No bounds or input validation.
    """
    return tile


def make_i8_tile(R: int, C: int, path: str):
    """An ``i8dot_tile_{R}x{C}`` intrinsic lowered on an explicit int8 ``path``
    (one of :data:`I8_PATHS`; each step covers ``I8_STEP[path]`` elements).

    For tests and benchmarks that compare the paths; the package's kernels
    use the host path.  Running a path :func:`path_supported` rejects fails
    at compile time or raises SIGILL.
    """
    if path not in I8_PATHS:
        raise ValueError(f"unknown int8 path {path!r}; expected one of {I8_PATHS}")
    return _make_tile(R, C, "i8", path)


i8dot_tile_1x1 = _make_tile(1, 1, "i8")
i8dot_tile_1x4 = _make_tile(1, 4, "i8")
i8dot_tile_2x1 = _make_tile(2, 1, "i8")
i8dot_tile_2x4 = _make_tile(2, 4, "i8")
i8dot_tile_4x4 = _make_tile(4, 4, "i8")

#: The int8 paths whose multi-row tiles use the ``x + 128`` offset.
I8_OFFSET_PATHS = ("avx512vnni", "avx512vnni256", "avxvnni")
#: Whether :data:`i8dot_raw_tile_4x4` returns offset sums ``sum (x + 128) w``
#: (the VNNI paths) -- the caller then subtracts ``128 * sum w`` per weight
#: row -- or plain ``sum x w`` (AVX2, portable).  Either way exact for codes in
#: [-127, 127] (see :func:`i8_dot_accumulate`'s contract).
I8_RAW_OFFSET = HOST_I8_PATH in I8_OFFSET_PATHS


def make_i8_raw_tile(path: str, corr_out: bool = False):
    """The ``i8dot_raw_tile_4x4`` (``corr_out``: ``i8dot_rawc_tile_4x4``)
    intrinsic lowered on an explicit int8 ``path``; offset sums exactly when
    ``path in I8_OFFSET_PATHS``.  For tests and benchmarks, as
    :func:`make_i8_tile`."""
    if path not in I8_PATHS:
        raise ValueError(f"unknown int8 path {path!r}; expected one of {I8_PATHS}")
    return _make_tile(4, 4, "i8", path, raw=True, corr_out=corr_out)
i8dot_raw_tile_4x4 = _make_tile(4, 4, "i8", raw=True)
i8dot_rawc_tile_4x4 = _make_tile(4, 4, "i8", raw=True, corr_out=True)
i8dot_rawc_tile_4x4.__doc__ = (
    "As :data:`i8dot_raw_tile_4x4`, returning 20 values: the 16 raw sums, then "
    "``128 * sum_p w[c, p]`` (wrapping int32) for each of the 4 weight rows "
    "when :data:`I8_RAW_OFFSET` is true (zeros otherwise).")
i8dot_raw_tile_4x4.__doc__ = (
    "As ``i8dot_tile_4x4`` but, when :data:`I8_RAW_OFFSET` is true, each result "
    "is ``sum_p (x[r, p] + 128) * w[c, p]`` (int32, wrapping): subtract ``128 * "
    "sum_p w[c, p]`` over the same elements (wrapping int32 arithmetic) for the "
    "exact product.  Saves the four correction ``vpdpbusd`` per step when the "
    "caller reuses the weight sums across many row groups.\n\n"
    + i8dot_tile_4x4.__doc__.split("\n", 1)[1])
f32dot_tile_1x1 = _make_tile(1, 1, "f32")
f32dot_tile_1x4 = _make_tile(1, 4, "f32")
f32dot_tile_2x4 = _make_tile(2, 4, "f32")
w8dot_tile_1x1 = _make_tile(1, 1, "w8")
w8dot_tile_1x4 = _make_tile(1, 4, "w8")
w16dot_tile_1x1 = _make_tile(1, 1, "w16")
w16dot_tile_1x4 = _make_tile(1, 4, "w16")
w16dot_tile_2x1 = _make_tile(2, 1, "w16")
w16dot_tile_2x4 = _make_tile(2, 4, "w16")


# --------------------------------------------------------------------------
# outer-product int8 tile (prefill): broadcast weights x activation panel
# --------------------------------------------------------------------------
#: Weight rows (outputs) per panel tile.  At 32 x 4096 x 4096 on Zen 4
#: (2 threads), 32 rows x 6 outputs took about 1.35 ms; 32 x 4 1.41 ms; 16 x 12
#: twice as long (twelve weight streams; L1 set conflicts suspected, not
#: measured); 16 x 8 was level with 32 x 6.
I8_PANEL_J = 6
#: Whether the host's int8 path runs the panel tiles: ``vpdpbusd`` (the u8
#: operand of a VNNI product carries the offset activations for free) or the
#: AVX2 sign-trick panel (``vpmaddubsw`` on ``|x|`` and ``w * sign(x)``).
I8_PANEL = HOST_I8_PATH in ("avx512vnni", "avx512vnni256", "avxvnni", "avx2")
#: Per int8 path: whether its panel tiles sum ``(x + 128) * w`` (the panel
#: holds ``x ^ 0x80``; the caller subtracts ``128 * sum w``) -- every path but
#: ``avx2``, whose panel holds the signed codes and sums ``x * w`` directly:
#: ``(x + 128) * w`` pairs would saturate ``vpmaddubsw``'s int16 sums.
_PANEL_OFFSET = {"avx512vnni": True, "avx512vnni256": True, "avxvnni": True, "avx2": False,
                 "portable": True}
#: The host panel's offset (see :data:`_PANEL_OFFSET`): 128 when its sums
#: carry ``128 * sum w``, else 0 -- what the callers subtract per weight sum.
I8_PANEL_CORR = 128 if _PANEL_OFFSET[HOST_I8_PATH] else 0
#: int32 lanes (activation rows) per panel vector of each int8 path.
_PANEL_LANES = {"avx512vnni": 16, "avx512vnni256": 8, "avxvnni": 8, "avx2": 8, "portable": 8}
#: Lanes of the host's panel vectors.
I8_PANEL_LANES = _PANEL_LANES[HOST_I8_PATH]


def _dpbusd(builder, acc, u8, s8, path):
    """``acc + vpdpbusd(u8, s8)`` on a VNNI path; widen-multiply-add elsewhere
    (bit for bit the same int32 result, wrapping)."""
    if path in ("avx512vnni", "avx512vnni256", "avxvnni"):
        return _vpdpbusd(builder, acc, u8, s8)
    lanes = acc.type.count
    v8 = ir.VectorType(_I8, 4 * lanes)
    vn = ir.VectorType(_I32, 4 * lanes)
    return _add_groups(builder, acc, builder.mul(builder.zext(builder.bitcast(u8, v8), vn),
                                                 builder.sext(builder.bitcast(s8, v8), vn)))


def _dpbusd_small(builder, acc, u8, s8, path):
    """:func:`_dpbusd` for operands whose adjacent-pair sums ``u0 s0 + u1 s1``
    fit int16 (e.g. ``u <= 15`` against any int8 ``s``: ``2 * 15 * 128``): on
    ``avx2`` ``vpmaddubsw`` + ``vpmaddwd`` by ones, exact there; elsewhere
    :func:`_dpbusd`."""
    if path != "avx2":
        return _dpbusd(builder, acc, u8, s8, path)
    v32 = ir.VectorType(_I8, 32)
    return builder.add(acc, _madd16_ones(builder, _maddubs(builder, builder.bitcast(u8, v32),
                                                           builder.bitcast(s8, v32))))


def _maddubs(builder, u, s):
    """``vpmaddubsw``: ``<32 x i8>`` unsigned x signed -> ``<16 x i16>``
    adjacent-pair sums (saturating)."""
    v32, v16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v32, v32]),
                                        "llvm.x86.avx2.pmadd.ub.sw")
    return builder.call(fn, [u, s])


def _madd16_ones(builder, p16):
    """``vpmaddwd`` by ones: ``<16 x i16>`` -> ``<8 x i32>`` pair sums (exact)."""
    v16, v8 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v16, v16]),
                                        "llvm.x86.avx2.pmadd.wd")
    return builder.call(fn, [p16, ir.Constant(v16, [ir.Constant(_I16, 1)] * 16)])


def make_i8_panel_tile(rows: int, path: str | None = None):
    """Build the outer-product int8 tile for ``rows`` activation rows x
    :data:`I8_PANEL_J` outputs on an int8 ``path`` (default the host's).

    The returned intrinsic is called from ``@njit`` code as
    ``tile(P, poff, w, woff, wstride, nkk, out, ooff)`` and returns 0:

    * ``P`` int32, C-contiguous: an activation panel from
      :func:`opscope_nb.kernels.pack_i8_panel` -- for each group of four k-elements ``kk``,
      ``rows`` int32 words, word ``r`` holding the four int8 codes
      ``x[r, 4kk:4kk+4] ^ 0x80`` (i.e. ``x + 128`` as unsigned bytes) on
      the offset paths (:data:`_PANEL_OFFSET`: all but ``avx2``), the signed
      codes ``x[r, 4kk:4kk+4]`` on ``avx2``; ``poff`` is the word offset of
      the tile's first ``kk``.
    * ``w`` int8, C-contiguous: output-major weights ``wt[n, k]``; ``woff``
      the flat offset of output ``j0`` at ``k = 4 * kk0``, ``wstride`` the
      distance between outputs (``k``).
    * ``nkk``: number of four-element groups.
    * ``out`` int32, C-contiguous: receives ``rows * I8_PANEL_J`` sums at
      ``ooff``; sum ``(v * J + j) * L + l`` (``L`` lanes per vector) is
      ``sum_kk sum_t (x[v*L + l, 4kk+t] + 128) * w[j0 + j, 4kk+t]`` in
      wrapping int32 -- subtract ``128 * sum_p w[j0 + j, p]`` over the same
      ``p`` for the exact product (``avx2``: the sum without the ``+ 128``,
      exact for codes in [-127, 127]; nothing to subtract).

    Each step loads ``rows / L`` panel vectors and broadcasts four weight
    bytes per output (``vpbroadcastd``), then issues ``rows / L *
    I8_PANEL_J`` ``vpdpbusd`` -- no horizontal sums, every lane is an
    output.  On ``avx2`` (16 vector registers) the tile runs one pass over k
    per 8-row panel vector with 6 accumulators, each product as
    ``vpmaddwd(vpmaddubsw(|x|, vpsignb(w, x)), 1)`` (the sign trick of
    :func:`i8_dot_accumulate`: int16 pair sums at most ``2 * 127 * 127``, no
    saturation).  No bounds or input validation.
    """
    path = path or HOST_I8_PATH
    if path not in I8_PATHS:
        raise ValueError(f"unknown int8 path {path!r}; expected one of {I8_PATHS}")
    lanes = _PANEL_LANES[path]
    if rows % lanes:
        raise ValueError(f"rows must be a multiple of {lanes} on path {path!r}, got {rows}")
    RV, J = rows // lanes, I8_PANEL_J
    offset = _PANEL_OFFSET[path]

    def accumulate_avx2(context, builder, accs, wrow, pbase, nkk):
        """AVX2: one pass over k per 8-row panel vector (``J`` accumulators
        live, 16 ymm registers), ``|x| * (w * sign(x))`` by ``vpmaddubsw``
        (pair sums at most ``2 * 127 * 127``: no saturation for codes in
        [-127, 127]) and ``vpmaddwd`` by ones."""
        intp = context.get_value_type(types.intp)
        vt = ir.VectorType(_I32, lanes)
        v32 = ir.VectorType(_I8, 32)
        splat = _const_vec(lanes, [0] * lanes)
        for v in range(RV):
            with cgutils.for_range(builder, nkk) as loop:
                kk = loop.index
                p = builder.gep(pbase, [builder.add(builder.mul(kk, ir.Constant(intp, rows)),
                                                    ir.Constant(intp, v * lanes))],
                                inbounds=True)
                xv = builder.bitcast(builder.load(builder.bitcast(p, vt.as_pointer()), align=4),
                                     v32)
                xa = _abs_i8(builder, xv)
                wo = builder.mul(kk, ir.Constant(intp, 4))
                for j in range(J):
                    p = builder.gep(wrow[j], [wo], inbounds=True)
                    s32 = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1)
                    b = builder.insert_element(ir.Constant(vt, None), s32, ir.Constant(_I32, 0))
                    b = builder.bitcast(builder.shuffle_vector(b, b, splat), v32)
                    a = accs[v * J + j]
                    builder.store(builder.add(builder.load(a),
                                              _madd_sign32(builder, xa, xv, b)), a)

    def accumulate(context, builder, pa, wa, poff, woff, wst, nkk):
        """The k loop: ``RV * J`` int32 accumulators (loaded values)."""
        intp = context.get_value_type(types.intp)
        vt = ir.VectorType(_I32, lanes)
        accs = []
        for _ in range(RV * J):
            a = cgutils.alloca_once(builder, vt)
            builder.store(ir.Constant(vt, None), a)
            accs.append(a)
        wrow = [builder.gep(wa.data, [builder.add(
            woff, builder.mul(wst, ir.Constant(intp, j)))], inbounds=True)
            for j in range(J)]
        pbase = builder.gep(pa.data, [poff], inbounds=True)
        if not offset:
            accumulate_avx2(context, builder, accs, wrow, pbase, nkk)
            return [builder.load(a) for a in accs]
        splat = _const_vec(lanes, [0] * lanes)
        with cgutils.for_range(builder, nkk) as loop:
            kk = loop.index
            po = builder.mul(kk, ir.Constant(intp, rows))
            xv = []
            for v in range(RV):
                p = builder.gep(pbase, [builder.add(po, ir.Constant(intp, v * lanes))],
                                inbounds=True)
                xv.append(builder.load(builder.bitcast(p, vt.as_pointer()), align=4))
            wo = builder.mul(kk, ir.Constant(intp, 4))
            for j in range(J):
                p = builder.gep(wrow[j], [wo], inbounds=True)
                s32 = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1)
                b = builder.insert_element(ir.Constant(vt, None), s32, ir.Constant(_I32, 0))
                b = builder.shuffle_vector(b, b, splat)
                for v in range(RV):
                    a = accs[v * J + j]
                    builder.store(_dpbusd(builder, builder.load(a), xv[v], b, path), a)
        return [builder.load(a) for a in accs]

    @intrinsic
    def tile(typingctx, P, poff, w, woff, wstride, nkk, out, ooff):
        if not (isinstance(P, types.Array) and P.dtype == types.int32
                and isinstance(w, types.Array) and w.dtype == types.int8
                and isinstance(out, types.Array) and out.dtype == types.int32):
            return None
        sig = types.int32(P, types.intp, w, types.intp, types.intp, types.intp,
                          out, types.intp)

        def codegen(context, builder, sig, args):
            pa = context.make_array(sig.args[0])(context, builder, args[0])
            wa = context.make_array(sig.args[2])(context, builder, args[2])
            oa = context.make_array(sig.args[6])(context, builder, args[6])
            poff, woff, wst, nkk, ooff = [
                context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 3, 4, 5, 7)]
            intp = context.get_value_type(types.intp)
            vt = ir.VectorType(_I32, lanes)
            accs = accumulate(context, builder, pa, wa, poff, woff, wst, nkk)
            ob = builder.gep(oa.data, [ooff], inbounds=True)
            for t in range(RV * J):
                p = builder.gep(ob, [ir.Constant(intp, t * lanes)], inbounds=True)
                builder.store(accs[t], builder.bitcast(p, vt.as_pointer()), align=4)
            return ir.Constant(_I32, 0)

        return sig, codegen

    @intrinsic
    def tile_t(typingctx, P, poff, w, woff, wstride, nkk, ws, sx, sxoff, sc, scoff, yt, ytoff,
               ytstride):
        if not (isinstance(P, types.Array) and P.dtype == types.int32
                and isinstance(w, types.Array) and w.dtype == types.int8
                and isinstance(ws, types.Array) and ws.dtype == types.int32
                and isinstance(sx, types.Array) and sx.dtype == types.float32
                and isinstance(sc, types.Array) and sc.dtype == types.float32
                and isinstance(yt, types.Array) and yt.dtype == types.float32):
            return None
        ip = types.intp
        sig = types.int32(P, ip, w, ip, ip, ip, ws, sx, ip, sc, ip, yt, ip, ip)

        def codegen(context, builder, sig, args):
            pa, wa, wsa, sxa, sca, ya = [
                context.make_array(sig.args[i])(context, builder, args[i])
                for i in (0, 2, 6, 7, 9, 11)]
            poff, woff, wst, nkk, sxoff, scoff, yoff, yst = [
                context.cast(builder, args[i], sig.args[i], types.intp)
                for i in (1, 3, 4, 5, 8, 10, 12, 13)]
            intp = context.get_value_type(types.intp)
            vt = ir.VectorType(_I32, lanes)
            vf = ir.VectorType(ir.FloatType(), lanes)
            fence = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf]), f"llvm.arithmetic.fence.v{lanes}f32")
            accs = accumulate(context, builder, pa, wa, poff, woff, wst, nkk)

            def c(v):
                return ir.Constant(intp, v)

            def splat(val, ty):
                e = builder.insert_element(ir.Constant(ty, None), val, ir.Constant(_I32, 0))
                return builder.shuffle_vector(e, e, _const_vec(lanes, [0] * lanes))

            for j in range(J):
                wj = builder.load(builder.gep(wsa.data, [c(j)], inbounds=True))
                corr = splat(builder.mul(wj, ir.Constant(_I32, 128 if offset else 0)), vt)
                scl = splat(builder.load(builder.gep(sca.data, [builder.add(scoff, c(j))],
                                                     inbounds=True)), vf)
                yrow = builder.gep(ya.data, [builder.add(yoff, builder.mul(yst, c(j)))],
                                   inbounds=True)
                for v in range(RV):
                    p = builder.gep(sxa.data, [builder.add(sxoff, c(v * lanes))], inbounds=True)
                    sxv = builder.load(builder.bitcast(p, vf.as_pointer()), align=4)
                    # (float(sum - 128 * wsum) * sx) * scale in this order, as
                    # the scalar finish; the fence stops numba's fast-math pass
                    # from reassociating it into float(.) * (sx * scale)
                    f = builder.call(fence, [builder.fmul(builder.sitofp(
                        builder.sub(accs[v * J + j], corr), vf), sxv)])
                    f = builder.fmul(f, scl)
                    p = builder.gep(yrow, [c(v * lanes)], inbounds=True)
                    builder.store(f, builder.bitcast(p, vf.as_pointer()), align=4)
            return ir.Constant(_I32, 0)

        return sig, codegen

    tile.finish_t = tile_t

    return tile


def _sh(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)),
                                                   [ir.Constant(_I32, i) for i in idx]))


def _transpose8(builder, r):
    """8 x 8 transpose of eight 8-element vectors (any element type): output
    ``q`` holds element ``q`` of every input (unpack lo/hi of 32-bit then
    64-bit pairs, then 128-bit lane permutes)."""
    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    p20, p31 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    t = []
    for h in (0, 4):
        t += [_sh(builder, r[h], r[h + 1], lo32), _sh(builder, r[h], r[h + 1], hi32),
              _sh(builder, r[h + 2], r[h + 3], lo32), _sh(builder, r[h + 2], r[h + 3], hi32)]
    u = []
    for h in (0, 4):
        u += [_sh(builder, t[h], t[h + 2], lo64), _sh(builder, t[h], t[h + 2], hi64),
              _sh(builder, t[h + 1], t[h + 3], lo64), _sh(builder, t[h + 1], t[h + 3], hi64)]
    return ([_sh(builder, u[q], u[q + 4], p20) for q in range(4)]
            + [_sh(builder, u[q], u[q + 4], p31) for q in range(4)])


@intrinsic
def panel_pack8(
typingctx, xq, xoff, xstride, nch, P, poff, prows, S, soff, flip):
    """Transpose 8 activation rows into panel words, 32 columns per step
    (the panel packing of the W8A8 and W4A8 outer-product tiles).

    ``xq`` int8 (flat, C order), ``P`` and ``S`` int32.  For ``c < nch`` and
    ``q < 8``: ``P[poff + (8c + q) * prows + r]`` = the int32 word of bytes
    ``xq[xoff + r * xstride + 32c + 4q .. +4]`` (``r < 8``, first byte lowest),
    XORed with ``0x80808080`` when ``flip`` is nonzero (``x + 128`` as
    unsigned bytes), and ``S[soff + 8c + r]`` = the sum of those 32 signed
    bytes (before the flip).  Per step: eight 32-byte loads, an 8 x 8 dword
    transpose (unpack lo/hi 32 and 64, lane permutes), eight 32-byte stores,
    and the row sums as ``vpdpbusd`` of ones by the transposed words.  No
    bounds checks."""
    if not (isinstance(xq, types.Array) and xq.dtype == types.int8
            and isinstance(P, types.Array) and P.dtype == types.int32
            and isinstance(S, types.Array) and S.dtype == types.int32):
        return None
    ip = types.intp
    sig = types.int32(xq, ip, ip, ip, P, ip, ip, S, ip, ip)

    def codegen(context, builder, sig, args):
        xa = context.make_array(sig.args[0])(context, builder, args[0])
        pa = context.make_array(sig.args[4])(context, builder, args[4])
        sa = context.make_array(sig.args[7])(context, builder, args[7])
        xoff, xst, nch, poff, prows, soff, flip = [
            context.cast(builder, args[i], sig.args[i], types.intp)
            for i in (1, 2, 3, 5, 6, 8, 9)]
        intp = context.get_value_type(types.intp)
        vi = ir.VectorType(_I32, 8)
        ones = ir.Constant(vi, [ir.Constant(_I32, 0x01010101)] * 8)
        fl = builder.select(builder.icmp_signed("!=", flip, ir.Constant(intp, 0)),
                            ir.Constant(_I32, -2139062144), ir.Constant(_I32, 0))
        fv = builder.shuffle_vector(builder.insert_element(ir.Constant(vi, None), fl,
                                                           ir.Constant(_I32, 0)),
                                    ir.Constant(vi, None), _const_vec(8, [0] * 8))

        def c(v):
            return ir.Constant(intp, v)

        rowp = [builder.gep(xa.data, [builder.add(xoff, builder.mul(xst, c(r)))],
                            inbounds=True) for r in range(8)]
        with cgutils.for_range(builder, nch) as loop:
            o = builder.mul(loop.index, c(32))
            r = [builder.load(builder.bitcast(builder.gep(rowp[t], [o], inbounds=True),
                                              vi.as_pointer()), align=1) for t in range(8)]
            cols = _transpose8(builder, r)
            kk0 = builder.mul(loop.index, c(8))
            acc = ir.Constant(vi, None)
            for q in range(8):
                pi = builder.add(poff, builder.mul(builder.add(kk0, c(q)), prows))
                p = builder.gep(pa.data, [pi], inbounds=True)
                builder.store(builder.xor(cols[q], fv), builder.bitcast(p, vi.as_pointer()),
                              align=4)
                acc = _dpbusd_small(builder, acc, ones, cols[q], HOST_I8_PATH)
            p = builder.gep(sa.data, [builder.add(soff, kk0)], inbounds=True)
            builder.store(acc, builder.bitcast(p, vi.as_pointer()), align=4)
        return ir.Constant(_I32, 0)

    return sig, codegen


#: Host panel tiles: 32 activation rows (the prefill block) and 16 (the last
#: block of 16..31 rows) x :data:`I8_PANEL_J` outputs.
i8panel_tile_32 = make_i8_panel_tile(32)
i8panel_tile_16 = make_i8_panel_tile(16)
#: The same tiles finishing the W8A8 result in registers: ``tile(P, poff, w,
#: woff, wstride, nkk, ws, sx, sxoff, sc, scoff, yt, ytoff, ytstride)`` writes
#: ``yt[ytoff + j * ytstride + r] = (float(sum - 128 * ws[j]) * sx[sxoff + r])
#: * sc[scoff + j]`` (float32) for the tile's rows ``r`` and 6 outputs ``j``:
#: output-major, one vector store per 8 (16) rows; ``ws`` int32 [6] holds the
#: weight rows' code sums over the same k.
i8panel_ttile_32 = i8panel_tile_32.finish_t
i8panel_ttile_16 = i8panel_tile_16.finish_t


@intrinsic
def f32_transpose8(typingctx, src, soff, sstride, dst, doff, dstride):
    """``dst[doff + r * dstride + q] = src[soff + q * sstride + r]`` for
    ``q, r < 8`` (float32 flat arrays): eight 32-byte loads, the 8 x 8
    register transpose, eight 32-byte stores.  No bounds checks."""
    if not (isinstance(src, types.Array) and src.dtype == types.float32
            and isinstance(dst, types.Array) and dst.dtype == types.float32):
        return None
    ip = types.intp
    sig = types.int32(src, ip, ip, dst, ip, ip)

    def codegen(context, builder, sig, args):
        sa = context.make_array(sig.args[0])(context, builder, args[0])
        da = context.make_array(sig.args[3])(context, builder, args[3])
        soff, sst, doff, dst_ = [context.cast(builder, args[i], sig.args[i], types.intp)
                                 for i in (1, 2, 4, 5)]
        intp = context.get_value_type(types.intp)
        vf = ir.VectorType(ir.FloatType(), 8)
        r = []
        for q in range(8):
            p = builder.gep(sa.data, [builder.add(soff, builder.mul(sst, ir.Constant(intp, q)))],
                            inbounds=True)
            r.append(builder.load(builder.bitcast(p, vf.as_pointer()), align=4))
        cols = _transpose8(builder, r)
        for q in range(8):
            p = builder.gep(da.data, [builder.add(doff, builder.mul(dst_, ir.Constant(intp, q)))],
                            inbounds=True)
            builder.store(cols[q], builder.bitcast(p, vf.as_pointer()), align=4)
        return ir.Constant(_I32, 0)

    return sig, codegen
