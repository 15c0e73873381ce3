"""llama.cpp imatrix reader: GGUF (written with gguf's writer) and legacy .dat (byte by byte)."""
import struct

import numpy as np
import pytest

from opscope_nb.io.imatrix import ImatrixError, gguf_to_hf, read_imatrix


def _write_gguf(path, entries, moe=None):
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch="")
    w.add_string("general.type", "imatrix")
    w.add_uint32("imatrix.chunk_count", 7)
    for name, (vals, count) in entries.items():
        w.add_tensor(name + ".in_sum2", np.asarray(vals, np.float32).reshape(1, -1))
        w.add_tensor(name + ".counts", np.array([[count]], np.float32))
    for name, vals in (moe or {}).items():
        w.add_tensor(name + ".in_sum2", np.asarray(vals, np.float32))
        w.add_tensor(name + ".counts", np.ones((vals.shape[0], 1), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_dat(path, entries, last_chunk=5, dataset=b"wiki.txt"):
    b = struct.pack("<i", len(entries))
    for name, (vals, ncall) in entries.items():
        nb = name.encode()
        b += struct.pack("<i", len(nb)) + nb + struct.pack("<ii", ncall, len(vals))
        b += np.asarray(vals, "<f4").tobytes()
    b += struct.pack("<i", last_chunk) + struct.pack("<i", len(dataset)) + dataset
    path.write_bytes(b)


def test_gguf_imatrix_gguf_names_and_hf_names(tmp_path):
    rng = np.random.default_rng(0)
    q = rng.random(8).astype(np.float32)
    d = rng.random(16).astype(np.float32)
    p = tmp_path / "im.gguf"
    _write_gguf(p, {"blk.0.attn_q.weight": (q, 100), "blk.1.ffn_down.weight": (d, 100),
                    "blk.0.mystery.weight": (q, 100)},
                moe={"blk.0.ffn_up_exps.weight": rng.random((4, 8))})
    im = read_imatrix(p, names=["blk.0.attn_q.weight", "blk.1.ffn_down.weight"])
    assert im.format == "gguf" and im.chunks == 7
    np.testing.assert_array_equal(im.diag["blk.0.attn_q.weight"], q.astype(np.float64))
    np.testing.assert_array_equal(im.diag["blk.1.ffn_down.weight"], d.astype(np.float64))
    assert im.unknown == ["blk.0.ffn_up_exps.weight", "blk.0.mystery.weight"]
    hf = read_imatrix(p, names=["model.layers.0.self_attn.q_proj.weight",
                                "model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(hf.diag["model.layers.1.mlp.down_proj.weight"],
                                  d.astype(np.float64))
    assert hf.raw_names["model.layers.0.self_attn.q_proj.weight"] == "blk.0.attn_q.weight"


def test_legacy_dat_imatrix(tmp_path):
    v = np.array([2.0, 4.0, 6.0], np.float32)
    p = tmp_path / "im.dat"
    _write_dat(p, {"blk.2.ffn_gate.weight": (v, 2), "output.weight": (v * 3, 3),
                   "zzz": (v, 1)})
    im = read_imatrix(p, names=["model.layers.2.mlp.gate_proj.weight", "lm_head.weight"])
    assert im.format == "dat" and im.chunks == 5
    np.testing.assert_array_equal(im.diag["model.layers.2.mlp.gate_proj.weight"], [1, 2, 3])
    np.testing.assert_array_equal(im.diag["lm_head.weight"], [2, 4, 6])
    assert im.unknown == ["zzz"]
    # truncated file -> clear error
    p.write_bytes(p.read_bytes()[:20])
    with pytest.raises(ImatrixError, match="truncated"):
        read_imatrix(p)
    # cut inside the first entry's values (4 count + 4 length + 21 name + 8 = 37
    # bytes of header, then 12 bytes of values): the same error, not numpy's
    _write_dat(p, {"blk.2.ffn_gate.weight": (v, 2)})
    p.write_bytes(p.read_bytes()[:37 + 6])
    with pytest.raises(ImatrixError, match="inside the values of 'blk.2.ffn_gate.weight'"):
        read_imatrix(p)


def test_imatrix_gram_feeds_profile_layer(tmp_path):
    from opscope_nb.profile.mining import profile_layer
    v = np.linspace(0.5, 2.0, 64).astype(np.float32)
    p = tmp_path / "im.dat"
    _write_dat(p, {"blk.0.attn_k.weight": (v, 1)})
    im = read_imatrix(p, names=["blk.0.attn_k.weight"])
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    lp = profile_layer("blk.0.attn_k.weight", w, gram=im.diag["blk.0.attn_k.weight"],
                       rank_cap=2)
    assert all(o.out_err is not None for o in lp.options)


def test_bad_files(tmp_path):
    with pytest.raises(ImatrixError, match="no such"):
        read_imatrix(tmp_path / "missing.dat")
    p = tmp_path / "zero.dat"
    p.write_bytes(struct.pack("<i", 0))
    with pytest.raises(ImatrixError, match="0 entries"):
        read_imatrix(p)
    assert gguf_to_hf("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_to_hf("blk.3.attn_norm.weight") is None
