"""The fast ggml quantiser paths stay bit for bit ggml's (issue 55, item 4).

* The lane-parallel scale searches (one sub-block per SIMD lane:
  ``make_qx_quants`` of Q6_K, ``make_qkx_quants`` of Q4_K/Q5_K/Q2_K, the
  block scales of IQ4_XS/IQ4_NL with a branch-free ``best_index``) equal the
  scalar ports they replace, on adversarial super-blocks
  (zeros, one outlier, denormals, ties, half steps, huge values, zero
  weights) -- no libggml needed.
* Every type's bytes equal libggml's ``ggml_quantize_chunk`` (the
  ``llama_cpp`` wheel's ``libggml-base``, skipped without it) on Gaussian
  rows at bf16 precision and on odd rows, with and without importance.
* Output is the same for 1 and 2 numba threads.
* ``apply``'s fused pass (bf16 read, quantise, error sums) writes the bytes
  of the unfused path and reports the same errors.
"""
from __future__ import annotations

import ctypes
import os

import numba
import numpy as np
import pytest

from opscope_nb.formats import ggml
from opscope_nb.kernels import _ggml_quant as K

F = np.float32
TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS",
         "Q3_K", "Q2_K", "TQ2_0", "TQ1_0"]


def _odd_rows(cols, rng):
    """Rows that take ggml's corner branches."""
    rows = []
    z = np.zeros(cols, F)
    rows.append(z.copy())                                   # all zero
    r = z.copy(); r[17] = 3.0; rows.append(r)                # one outlier in zeros
    r = rng.standard_normal(cols).astype(F); r[5] = -40; rows.append(r)
    rows.append(np.full(cols, 1e-39, F))                     # denormals
    rows.append(np.full(cols, 0.75, F))                      # all equal
    rows.append(np.full(cols, -0.75, F))
    rows.append((rng.standard_normal(cols) * 1e-6).astype(F))
    rows.append((rng.standard_normal(cols) * 3e3).astype(F))
    rows.append(-np.abs(rng.standard_normal(cols)).astype(F))
    rows.append((np.abs(rng.standard_normal(cols)) + 2).astype(F))
    r = rng.standard_normal(cols).astype(F); r[256:512] = 0; rows.append(r)
    rows.append((np.round(rng.standard_normal(cols) * 8) / 2).astype(F))   # half steps
    r = rng.standard_normal(cols).astype(F); r[::16] = 0; r[1::16] *= 1e-12; rows.append(r)
    r = (rng.integers(-3, 4, cols) * 0.125).astype(F); rows.append(r)      # many ties
    return np.stack(rows)


def _weights(cols, rng):
    imp = (rng.gamma(2.0, 1.0, cols) * 100).astype(F)
    imp[rng.random(cols) < 0.15] = 0
    imp[:16] = 0                                             # a sub-block of zero weight
    return imp


@numba.njit(cache=False)
def _scalar_qx16(xs, ws, nmax, L, scales):
    for sb in range(16):
        scales[sb] = K._make_qx_quants(16, nmax, xs[16 * sb:16 * sb + 16],
                                       L[16 * sb:16 * sb + 16], ws[16 * sb:16 * sb + 16])


@numba.njit(cache=False)
def _lanes_qx16(xs, ws, nmax, L, scales):
    xt = np.empty((16, 16), np.float32)
    wt = np.empty((16, 16), np.float32)
    wxt = np.empty((16, 16), np.float32)
    v = np.empty((6, 16), np.float32)
    bt = np.empty(16, np.int64)
    K._make_qx_quants_x16(xs, ws, nmax, xt, wt, wxt, v[0], v[1], v[2], v[3], v[4], v[5], bt,
                          L, scales)


@pytest.mark.parametrize("nmax", [32, 4])
def test_lane_search_equals_scalar_make_qx_quants(nmax):
    rng = np.random.default_rng(55)
    x = np.concatenate([_odd_rows(256, rng),
                        (rng.standard_normal((200, 256)) * 0.02).astype(F)])
    x = (x.view(np.uint32) & np.uint32(0xFFFFFFFF)).view(F)
    imp = _weights(256, rng)
    n_diff_weights = 0
    for row in x:
        for ws in (row * row, imp, np.ones(256, F)):
            ws = np.ascontiguousarray(ws, F)
            L0, s0 = np.zeros(256, np.int64), np.zeros(16, F)
            L1, s1 = np.full(256, -7, np.int64), np.full(16, F(np.nan))
            _scalar_qx16(row, ws, nmax, L0, s0)
            _lanes_qx16(row, ws, nmax, L1, s1)
            assert np.array_equal(L0, L1), (nmax, row[:4])
            assert np.array_equal(s0.view(np.uint32), s1.view(np.uint32)), (nmax, s0, s1)
            n_diff_weights += 1
    assert n_diff_weights == 3 * len(x)



@numba.njit(cache=False)
def _scalar_qkx(xs, ws, n, nl, nmax, rmin, rdelta, nstep, use_mad, L, scales, mins):
    Laux = np.empty(n, np.int64)
    for j in range(nl):
        s, m = K._make_qkx_quants(n, nmax, xs[n * j:n * j + n], ws[n * j:n * j + n],
                                  L[n * j:n * j + n], Laux, rmin, rdelta, nstep, use_mad)
        scales[j] = s
        mins[j] = m


@numba.njit(cache=False)
def _lanes_qkx(xs, ws, n, nl, nmax, rmin, rdelta, nstep, use_mad, L, scales, mins):
    xt = np.empty((n, nl), np.float32)
    wt = np.empty((n, nl), np.float32)
    lb = np.empty((n, nl), np.int64)
    la = np.empty((n, nl), np.int64)
    st = np.empty((12, nl), np.float32)
    K._make_qkx_quants_lanes(xs, ws, n, nmax, rmin, rdelta, nstep, use_mad, xt, wt, lb, la, st,
                             L, scales, mins)


# (n, sub-blocks, nmax, rmin, rdelta, nstep, mad): Q4_K ref, Q5_K ref, Q4_K/Q5_K
# importance, Q2_K ref, Q2_K importance
QKX = [(32, 8, 15, -1.0, 0.1, 20, False), (32, 8, 31, -0.5, 0.1, 15, False),
       (32, 8, 31, -0.9, 0.05, 36, False), (16, 16, 3, -0.5, 0.1, 15, True),
       (16, 16, 3, -0.9, 0.05, 36, False)]


@pytest.mark.parametrize("cfg", QKX)
def test_lane_search_equals_scalar_make_qkx_quants(cfg):
    n, nl, nmax, rmin, rdelta, nstep, mad = cfg
    rng = np.random.default_rng(56)
    x = np.concatenate([_odd_rows(256, rng),
                        (rng.standard_normal((150, 256)) * 0.02).astype(F),
                        (np.abs(rng.standard_normal((30, 256))) + 0.5).astype(F),
                        (-np.abs(rng.standard_normal((30, 256))) - 0.3).astype(F)])
    imp = _weights(256, rng)
    for row in x:
        for ws in (np.abs(row) if mad else row * row + F(1e-3), imp):
            ws = np.ascontiguousarray(ws, F)
            L0, s0, m0 = np.zeros(256, np.int64), np.zeros(nl, F), np.zeros(nl, F)
            L1, s1, m1 = np.full(256, -9, np.int64), np.full(nl, F(7)), np.full(nl, F(7))
            _scalar_qkx(row, ws, n, nl, nmax, F(rmin), F(rdelta), nstep, mad, L0, s0, m0)
            _lanes_qkx(row, ws, n, nl, nmax, F(rmin), F(rdelta), nstep, mad, L1, s1, m1)
            assert np.array_equal(L0, L1), (cfg, row[:4])
            assert np.array_equal(s0.view(np.uint32), s1.view(np.uint32)), (cfg, s0, s1)
            assert np.array_equal(m0.view(np.uint32), m1.view(np.uint32)), (cfg, m0, m1)


@numba.njit(cache=False)
def _scalar_iq4(xs, ws, ds, oks):
    Lb = np.empty(32, np.int64)
    for j in range(8):
        d, ok = K._iq4_block_scale(xs[32 * j:32 * j + 32], ws[32 * j:32 * j + 32], Lb, 7)
        ds[j] = d
        oks[j] = ok


@numba.njit(cache=False)
def _lanes_iq4(xs, ws, ds, oks):
    xt = np.empty((32, 8), np.float32)
    wt = np.empty((32, 8), np.float32)
    st = np.empty((6, 8), np.float32)
    K._iq4_scales_lanes(xs, ws, 7, xt, wt, st, ds, oks)


@numba.njit(cache=False)
def _best_index_vs_branch_free(vals):
    bad = 0
    for v in vals:
        i = K._best_index(v)
        if K._KVF[i] != K._iq4_q(v) or K._iq4_index(v) != i:
            bad += 1
    return bad


def test_iq4_branch_free_lookup_and_lane_search_equal_ggml_order():
    rng = np.random.default_rng(57)
    kv = K._KVF
    mids = (kv[:-1] + kv[1:]) / 2
    vals = np.concatenate([rng.uniform(-140, 140, 100000), kv, mids,
                           np.nextafter(mids, np.float32(-200)),
                           np.nextafter(mids, np.float32(200))]).astype(F)
    assert _best_index_vs_branch_free(vals) == 0
    x = np.concatenate([_odd_rows(256, rng), (rng.standard_normal((200, 256)) * 0.02).astype(F)])
    imp = _weights(256, rng)
    for row in x:
        for ws in (row * row, imp):
            ws = np.ascontiguousarray(ws, F)
            d0, o0 = np.zeros(8, F), np.zeros(8, np.bool_)
            d1, o1 = np.full(8, F(9)), np.ones(8, np.bool_)
            _scalar_iq4(row, ws, d0, o0)
            _lanes_iq4(row, ws, d1, o1)
            assert np.array_equal(d0.view(np.uint32), d1.view(np.uint32)) and \
                np.array_equal(o0, o1), (row[:4], d0, d1)

def _libggml():
    try:
        import llama_cpp
    except Exception:          # pragma: no cover - the wheel is optional
        return None
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(20261206)
    cols = 1024
    g = (rng.standard_normal((48, cols), dtype=np.float32) * F(0.02))
    g = (g.view(np.uint32) & np.uint32(0xFFFF0000)).view(F)        # bf16 values
    g[3, rng.choice(cols, 8, replace=False)] *= 20
    x = np.ascontiguousarray(np.concatenate([g, _odd_rows(cols, rng)]))
    return x, _weights(cols, rng)


@pytest.mark.parametrize("t", TYPES + ["IQ4_NL/544", "Q8_0/544", "Q5_0/544"])
def test_bytes_equal_libggml_on_many_rows(rows, t):
    lib = _libggml()
    if lib is None:
        pytest.skip("no llama_cpp wheel (libggml-base) here")
    x, imp = rows
    if "/" in t:       # rows of 17 blocks of 32 (IQ4_NL's lanes take 8 at a time)
        t, cols = t.split("/")
        x, imp = np.ascontiguousarray(x[:, :int(cols)]), np.ascontiguousarray(imp[:int(cols)])
    n, cols = x.shape
    info = ggml.GGML_TYPES[t]
    lib.ggml_quantize_init(info.id)
    for qw in (None, imp):
        ref = np.zeros((n, ggml.row_bytes(t, cols)), np.uint8)
        lib.ggml_quantize_chunk(info.id, x.ctypes.data, ref.ctypes.data, 0, n, cols,
                                None if qw is None else qw.ctypes.data)
        ours = ggml.quantize(x, t, qw)
        bad = np.argwhere(ours != ref)
        assert bad.size == 0, (f"{t} {'imp' if qw is not None else 'ref'}: {len(bad)} bytes "
                               f"differ, first (row, byte) {bad[:3].tolist()}")


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="numba has one thread here")
@pytest.mark.parametrize("t", ["Q6_K", "Q8_0", "Q4_K", "IQ4_XS"])
def test_same_bytes_for_one_and_two_threads(rows, t):
    x, imp = rows
    keep = numba.get_num_threads()
    try:
        out = []
        for n in (1, 2):
            numba.set_num_threads(n)
            out.append((ggml.quantize(x, t), ggml.quantize(x, t, imp)))
    finally:
        numba.set_num_threads(keep)
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("t", TYPES)
def test_error_sums_equal_decoded_float64_sums(rows, t):
    """The fused decode-and-sum kernel decodes each type as ``dequantize``
    does (a wrong type code or block offset would not match)."""
    x, imp = rows
    q = ggml.quantize(x, t, imp)
    e2, x2 = K.ggml_error_sums(x, q, K.GGML_CODES[ggml._name_key(ggml.GGML_TYPES[t])])
    d = x.astype(np.float64) - ggml.dequantize(q, t, x.shape).astype(np.float64)
    np.testing.assert_allclose(e2, (d * d).sum(axis=1), rtol=1e-12, atol=0)
    np.testing.assert_allclose(x2, (x.astype(np.float64) ** 2).sum(axis=1), rtol=1e-12, atol=0)


def _st_source(path, tensors, bf16):
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_io import write_st
    write_st(path, tensors, bf16=bf16)


@pytest.mark.parametrize("stored", ["BF16", "F16", "F32"])
def test_apply_one_pass_writes_packs_bytes_and_option_errors(tmp_path, stored):
    """``apply``'s one pass over a safetensors source (stored bytes widened in
    a reused buffer, quantised, errors summed from each decoded row) writes
    the bytes of :func:`opscope_nb.formats.pack` on the loaded tensor and
    reports :func:`option_errors`' figures."""
    import json
    from opscope_nb.formats import Decomp, pack, packed_bytes, unpack
    from opscope_nb.formats.gptq import option_errors
    from opscope_nb.io import open_source
    from opscope_nb.plan.apply import apply_plan
    from opscope_nb.runtime import checkpoint
    rng = np.random.default_rng(3)
    labels = {"a.weight": "Q6_K", "b.weight": "Q8_0", "c.weight": "IQ4_XS", "d.weight": "Q4_K"}
    ten = {n: (rng.standard_normal((40 + 8 * i, 512)) * 0.03).astype(
        np.float16 if stored == "F16" else np.float32) for i, n in enumerate(labels)}
    ten["norm.weight"] = np.ones(512, ten["a.weight"].dtype)
    src = str(tmp_path / "m.safetensors")
    _st_source(src, ten, bf16=tuple(ten) if stored == "BF16" else ())
    layers = [{"name": n, "option": 0, "label": lab,
               "bytes": packed_bytes(ten[n].shape[0], 512, Decomp.from_label(lab))}
              for n, lab in labels.items()]
    doc = {"tool": "opscope-nb", "budget": 0.5, "methods": {"exact": {"layers": layers}},
           "source": {"sha256": {e.name: e.sha256() for e in open_source(src).entries}}}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    out = str(tmp_path / "c.safetensors")
    r = apply_plan(src, str(plan), out, measure=set(labels))
    got, _ = checkpoint.load(out)[:2]
    by = {e.name: e for e in open_source(src).entries}
    for n, lab in labels.items():
        d = Decomp.from_label(lab)
        a = by[n].load()
        want = pack(a, d)["blocks"]
        assert np.array_equal(got[n].arrays["blocks"], want), n
        ref = option_errors(a, unpack({"blocks": want}, d, a.shape))
        assert r["full_errors"][n]["out_err"] is None
        assert abs(r["full_errors"][n]["rel_err"] / ref["rel_err"] - 1) < 1e-12, n


def test_apply_one_pass_still_rejects_non_finite(tmp_path):
    import json
    from opscope_nb.formats import Decomp, packed_bytes
    from opscope_nb.io import open_source
    from opscope_nb.plan.apply import apply_plan
    w = np.ones((8, 256), np.float32)
    w[3, 7] = np.inf
    src = str(tmp_path / "m.safetensors")
    _st_source(src, {"a.weight": w}, bf16=("a.weight",))
    doc = {"methods": {"exact": {"layers": [
        {"name": "a.weight", "option": 0, "label": "Q6_K",
         "bytes": packed_bytes(8, 256, Decomp.from_label("Q6_K"))}]}},
        "source": {"sha256": {e.name: e.sha256() for e in open_source(src).entries}}}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="finite"):
        apply_plan(src, str(plan), str(tmp_path / "c.safetensors"))
    assert not os.path.exists(tmp_path / "c.safetensors")
