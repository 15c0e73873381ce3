"""The ggml menu (issue 22): ``Decomp.ggml`` in the formats table, the
``menu="ggml"`` profile, the runtime kernel and ``profile --menu ggml``."""
from __future__ import annotations

import math

import numpy as np
import pytest

from opscope_nb import formats
from opscope_nb.formats import ggml
from opscope_nb.profile import mining
from opscope_nb.formats import Decomp
from opscope_nb.runtime import PackedLinear

ALL = mining.GGML_MENU_TYPES + ("TQ2_0", "TQ1_0")


def _w(rows=6, cols=512, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


@pytest.mark.parametrize("qt", ALL)
def test_decomp_round_trip_and_layout(qt):
    d = Decomp.ggml(qt.lower())
    assert d.kind == "ggml" and d.qtype == qt and d.label == qt
    assert Decomp.from_label(qt) == d and Decomp.from_label(qt.lower()) == d
    assert Decomp.from_dict(d.to_dict()) == d
    assert hash(Decomp.from_dict(d.to_dict())) == hash(d)
    rows, cols = 3, 512
    lay = formats.layout(rows, cols, d)
    assert list(lay) == ["blocks"]
    assert lay["blocks"] == (np.dtype(np.uint8), (rows, ggml.row_bytes(qt, cols)))
    assert formats.packed_bytes(rows, cols, d) == rows * ggml.row_bytes(qt, cols)
    assert formats.flops(rows, cols, d) == rows * cols


def test_pack_bytes_are_ggml_and_unpack_decodes():
    w = _w()
    for qt in ("Q4_K", "Q8_0", "IQ4_NL", "F16", "BF16"):
        d = Decomp.ggml(qt)
        p = formats.pack(w, d)
        assert formats.nbytes(p) == formats.packed_bytes(*w.shape, d)
        np.testing.assert_array_equal(p["blocks"], ggml.quantize(w, qt))
        np.testing.assert_array_equal(formats.unpack(p, d, w.shape),
                                      ggml.dequantize(p["blocks"], qt, w.shape))


def test_pack_with_gram_uses_its_diagonal():
    w = _w()
    x = np.random.default_rng(1).standard_normal((64, w.shape[1])) * np.linspace(0.1, 3, 512)
    h = x.T @ x
    d = Decomp.ggml("Q4_K")
    got = formats.pack(w, d, gram=h)["blocks"]
    want = ggml.quantize(w, "Q4_K", importance=np.diag(h).astype(np.float32))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(formats.pack(w, d, gram=np.diag(h))["blocks"], want)


def test_applicability():
    with pytest.raises(ValueError, match="multiple of 256.*Q5_0"):
        formats.layout(4, 576, Decomp.ggml("Q4_K"))
    with pytest.raises(ValueError, match="multiple of 32.*F16"):
        formats.pack(_w(2, 48), Decomp.ggml("Q8_0"))
    assert formats.packed_bytes(4, 576, Decomp.ggml("Q4_0")) == 4 * 18 * 18
    with pytest.raises(ValueError, match="ggml qtype must be one of"):
        Decomp.ggml("Q7_K")
    with pytest.raises(ValueError, match="takes no 'qtype'"):
        Decomp("int8", qtype="Q8_0")


def test_ggml_menu():
    labels = [d.label for d, _ in mining.ggml_menu(576)]
    assert labels == ["dense", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "IQ4_NL", "F16",
                      "BF16"]
    labels = [d.label for d, _ in mining.ggml_menu(1536)]
    assert labels == ["dense", *mining.GGML_MENU_TYPES]
    assert [d.label for d, _ in mining.ggml_menu(1536, ["q6_k", "TQ2_0", "Q6_K"])] == \
        ["dense", "Q6_K", "TQ2_0"]
    assert [d.label for d, _ in mining.ggml_menu(48)] == ["dense", "F16", "BF16"]
    with pytest.raises(ValueError, match="unknown ggml type 'Q7'.*Q4_K"):
        mining.ggml_menu(256, ["Q7"])


def test_profile_layer_ggml_menu_with_gram():
    w = _w(8, 512)
    x = np.random.default_rng(2).standard_normal((100, 512))
    h = x.T @ x
    lp = mining.profile_layer("blk.0.ffn_down.weight", w, menu="ggml",
                              ggml_types=("Q8_0", "Q4_K", "Q2_K"), gram=h, gptq="all")
    # asked for, with a 2-D gram, each type is followed by its +gptq twin (same bytes)
    assert [o.label for o in lp.options] == ["dense", "Q8_0", "Q8_0+gptq", "Q4_K",
                                             "Q4_K+gptq", "Q2_K", "Q2_K+gptq"]
    assert lp.options[0].decomp.kind == "dense" and lp.options[0].bytes == 4 * w.size
    for o in lp.options[1:]:
        assert o.bytes == 8 * ggml.row_bytes(o.decomp.qtype, 512)
        approx = formats.approximate(w, o.decomp, gram=h)
        err = np.linalg.norm(approx.astype(np.float64) - w) / np.linalg.norm(w)
        assert math.isclose(o.rel_err, err, rel_tol=1e-5)
        dw = (approx - w).astype(np.float64)
        want = math.sqrt(np.trace(dw @ h @ dw.T) / np.trace(w @ h @ w.T))
        assert math.isclose(o.out_err, want, rel_tol=1e-6)
    errs = [o.rel_err for o in lp.options[1::2]]
    assert errs == sorted(errs)
    # GPTQ's codes on the same scales: a lower output error on this random gram
    for rtn, twin in zip(lp.options[1::2], lp.options[2::2]):
        assert twin.decomp == rtn.decomp.with_rounding("gptq")
        assert twin.out_err < rtn.out_err
    assert lp.timings["ggml"] > 0 and lp.timings["gptq"] > 0
    for g in (True, "int", False, "none"):     # the default ("int") has no ggml twins
        assert [o.label for o in mining.profile_layer(
            "x", w, menu="ggml", ggml_types=("Q8_0",), gram=h, gptq=g).options] == \
            ["dense", "Q8_0"]
    with pytest.raises(ValueError, match="gptq must be one of .*'all' adds"):
        mining.profile_layer("x", w, menu="ggml", gram=h, gptq="ggml")
    lp2 = mining.LayerProfile.from_dict(lp.to_dict())
    assert [o.decomp for o in lp2.options] == [o.decomp for o in lp.options]
    with pytest.raises(ValueError, match="menu must be one of"):
        mining.profile_layer("x", w, menu="gguf")


def test_profile_layer_mixed_menu():
    """menu="mixed": the default menu, then the ggml types it lacks, each once;
    every option measured as in its own menu."""
    w = _w(8, 512)
    x = np.random.default_rng(3).standard_normal((64, 512))
    h = x.T @ x
    kw = dict(rank_cap=4, lr_ranks=(), gram=h, gptq=False)
    base = mining.profile_layer("x", w, **kw)
    mix = mining.profile_layer("x", w, menu="mixed", ggml_types=("Q4_K", "F16", "Q3_K"),
                               **kw)
    labels = [o.label for o in mix.options]
    assert labels == [o.label for o in base.options] + ["Q4_K", "Q3_K"]
    assert len(set(labels)) == len(labels)
    for a, b in zip(base.options, mix.options):
        assert (a.rel_err, a.bytes, a.out_err) == (b.rel_err, b.bytes, b.out_err)
    gm = {o.label: o for o in mining.profile_layer("x", w, menu="ggml", gram=h,
                                                    ggml_types=("Q4_K", "Q3_K")).options}
    for o in mix.options[-2:]:
        assert (o.rel_err, o.bytes, o.out_err) == (gm[o.label].rel_err, gm[o.label].bytes,
                                                   gm[o.label].out_err)
        assert o.bytes == 8 * ggml.row_bytes(o.label, 512)


def test_cli_types_needs_a_ggml_menu(tmp_path, capsys):
    from opscope_nb.cli import main
    assert main(["profile", "--types", "Q4_K", "--out", str(tmp_path / "a")]) != 0
    assert "add --menu ggml (or --menu mixed)" in capsys.readouterr().err


@pytest.mark.parametrize("qt,rows", [("Q4_K", 5), ("Q5_0", 700), ("BF16", 3)])
def test_packed_linear_ggml(qt, rows):
    cols = 512 if qt != "Q5_0" else 416
    w = _w(rows, cols, seed=rows)
    lin = PackedLinear.pack(w, Decomp.ggml(qt))
    assert lin.nbytes == rows * ggml.row_bytes(qt, cols)
    wd = ggml.dequantize(lin.arrays["blocks"], qt, (rows, cols))
    for m in (1, 7):
        x = np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32)
        want = x.astype(np.float64) @ wd.T.astype(np.float64)
        np.testing.assert_allclose(lin(x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="finite"):
        lin(np.full((1, cols), np.nan, np.float32))
