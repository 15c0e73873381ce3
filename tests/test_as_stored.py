"""Issue 58 items 2-4 on small quantised GGUF files the tests write: a tensor's
stored ggml type is an option of error 0 at its stored bytes that ``apply``
copies unchanged; dense is priced as stored; budgets that cannot be met are
errors; the written file's labels (general.file_type, opscope.* keys)."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from opscope_nb.cli import main  # noqa: E402
from opscope_nb.formats import ggml  # noqa: E402

#: A Q4_K_M-like mix (llama-quantize's: attn_v / ffn_down Q6_K, the rest Q4_K)
#: and an all-Q6_K file; 1-D norms F32.  Rows x cols, cols multiples of 256.
Q4_K_M = {"token_embd.weight": ((64, 256), "Q4_K"),
          "blk.0.attn_norm.weight": ((256,), "F32"),
          "blk.0.attn_q.weight": ((256, 256), "Q4_K"),
          "blk.0.attn_k.weight": ((64, 256), "Q4_K"),
          "blk.0.attn_v.weight": ((64, 256), "Q6_K"),
          "blk.0.attn_output.weight": ((256, 256), "Q4_K"),
          "blk.0.ffn_norm.weight": ((256,), "F32"),
          "blk.0.ffn_up.weight": ((512, 256), "Q4_K"),
          "blk.0.ffn_down.weight": ((256, 512), "Q6_K"),
          "output_norm.weight": ((256,), "F32")}
Q6_K = {n: (s, "Q6_K" if len(s) == 2 else t) for n, (s, t) in Q4_K_M.items()}
FTYPE = {"Q4_K_M": 15, "Q6_K": 18}


def write_quant_gguf(path, spec, file_type, seed=0):
    """A GGUF of random weights quantised with the package's ggml quantisers
    (bit-exact to libggml), llama.cpp's names, ``general.file_type``."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.add_block_count(1)
    for name, (shape, t) in spec.items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.05
        if t == "F32":
            w.add_tensor(name, x)
            continue
        q = ggml.quantize(x, t)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[t])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    return str(path)


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def tensors_of(path):
    """{name: (type name, shape, sha256 of the bytes)} and the key-values of a GGUF."""
    from opscope_nb.io._gguf_header import GGUFFile
    f = GGUFFile(str(path))
    ts = {t.name: (t.tensor_type.name, [int(x) for x in t.shape],
                   hashlib.sha256(np.ascontiguousarray(t.data).view(np.uint8).data)
                   .hexdigest()) for t in f.tensors}
    kv = {k: v for k, v in f.fields.items() if not k.startswith("GGUF.")}
    return ts, kv, f


def stored_blocks(path):
    """{name: (type, uint8 blocks, [rows, cols])} of a GGUF's tensors."""
    from opscope_nb.io._gguf_header import GGUFFile
    out = {}
    for t in GGUFFile(str(path)).tensors:
        shape = [int(x) for x in t.shape][::-1]
        out[t.name] = (t.tensor_type.name, np.ascontiguousarray(t.data).view(np.uint8)
                       .reshape(-1).copy(), shape)
    return out


def _profile(src, out, *extra):
    rc, o, e = run(["profile", src, "--menu", "ggml", "--include-embeddings", "--out", out,
                    "-q", *extra])
    return rc, o, e


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """A Q4_K_M-like source and its ggml-menu profile at --budget 1 (exact)."""
    d = tmp_path_factory.mktemp("q4km")
    src = write_quant_gguf(d / "q4km.gguf", Q4_K_M, FTYPE["Q4_K_M"])
    rc, o, e = _profile(src, d / "p", "--budget", "1", "--method", "exact")
    assert rc == 0, e
    return src, d / "p"


# ───────────────────────────── the menu ─────────────────────────────

@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("menu", ["ggml", "default"])
def test_stored_type_is_an_option_of_error_0_at_the_stored_bytes(qtype, menu):
    from opscope_nb.profile.mining import profile_layer
    rng = np.random.default_rng(5)
    blocks = ggml.quantize(rng.standard_normal((16, 512)).astype(np.float32), qtype)
    w = ggml.dequantize(blocks, qtype, (16, 512))           # what the loader gives
    gram = np.diag(rng.random(512) + 0.5)
    kw = dict(stored_dtype=qtype, menu=menu, rank_cap=2, lr_ranks=(), gram=gram,
              ggml_types=None if menu == "ggml" else None)
    lp = profile_layer("blk.0.ffn_down.weight", w, **kw)
    by = {o.label: o for o in lp.options}
    assert lp.dense_bytes == blocks.nbytes
    assert lp.options[0].label == "dense" and lp.options[0].bytes == blocks.nbytes
    own = by[qtype]
    assert own.rel_err == 0.0 and own.out_err == 0.0 and own.bytes == blocks.nbytes
    # --requantize: the same type measured as a re-quantisation of the loaded values
    rq = {o.label: o for o in profile_layer("x", w, requantize=True, **kw).options}[qtype]
    from opscope_nb.formats import ggml_importance
    again = ggml.dequantize(ggml.quantize(w, qtype, importance=ggml_importance(gram)),
                            qtype, w.shape)
    want = np.linalg.norm((w.astype(np.float64) - again)) / np.linalg.norm(w)
    assert rq.bytes == blocks.nbytes and rq.rel_err == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_stored_type_is_offered_even_when_types_leave_it_out():
    from opscope_nb.profile.mining import profile_layer
    blocks = ggml.quantize(np.random.default_rng(1).standard_normal((4, 256))
                           .astype(np.float32), "Q4_K")
    w = ggml.dequantize(blocks, "Q4_K", (4, 256))
    lp = profile_layer("x", w, stored_dtype="Q4_K", menu="ggml", ggml_types=["Q8_0", "Q2_K"])
    assert [o.label for o in lp.options] == ["dense", "Q4_K", "Q8_0", "Q2_K"]
    assert lp.options[1].rel_err == 0.0 and lp.options[1].bytes == blocks.nbytes
    with pytest.raises(TypeError, match="requantize"):
        profile_layer("x", w, requantize="yes")


# ───────────────────────────── apply copies what is kept ─────────────────────────────

def _data_section(path):
    from opscope_nb.io._gguf_header import GGUFFile
    start = min(t.data_offset for t in GGUFFile(str(path)).tensors)
    with open(path, "rb") as f:
        return f.read()[start:]


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q6_K"])
def test_all_as_stored_plan_writes_the_source_again(kind, tmp_path, q4km):
    if kind == "Q4_K_M":
        src, prof = q4km
    else:
        src = write_quant_gguf(tmp_path / "q6k.gguf", Q6_K, FTYPE["Q6_K"], seed=2)
        prof = tmp_path / "p"
        assert _profile(src, prof, "--budget", "1", "--method", "exact")[0] == 0
    plan = json.load(open(prof / "plan.json"))
    rows = plan["methods"]["exact"]["layers"]
    assert all(r["rel_err"] == 0.0 for r in rows) and len(rows) == 7
    out = tmp_path / "out.gguf"
    rc, o, e = run(["apply", src, prof / "plan.json", "-o", out, "-q"])
    assert rc == 0, e
    a, ka, _ = tensors_of(src)
    b, kb, _ = tensors_of(out)
    assert a == b                                          # every tensor, by hash
    mine = [k for k in kb if k.startswith("opscope.")]
    assert list(kb)[:len(ka)] == list(ka) and list(kb)[len(ka):] == mine
    assert all(ka[k].raw == kb[k].raw for k in ka)         # general.file_type kept too
    assert _data_section(src) == _data_section(out)        # byte for byte
    assert kb["opscope.plan.budget"].contents() == 1.0
    assert kb["opscope.plan.method"].contents() == "exact"
    assert kb["opscope.plan.objective"].contents() == plan["objective_used"]
    assert kb["opscope.plan.bytes"].contents() == sum(r["bytes"] for r in rows)
    assert kb["opscope.plan.requantize"].contents() is False
    from opscope_nb import __version__
    assert kb["opscope.version"].contents() == __version__
    assert "the source's, no tensor changed type" in o
    nw = sum(int(np.prod(s)) for t, s, _ in a.values() if len(s) == 2)
    assert f"{8 * sum(r['bytes'] for r in rows) / nw:.3f} bits/weight" in o
    allw = sum(int(np.prod(s)) for t, s, _ in a.values())
    assert (f"({8 * os.path.getsize(out) / allw:.3f} bits/weight over all {allw} weights "
            f"of the file)") in o


def _hand_plan(prof_dir, out_dir, labels, budget_bytes=None):
    """plan.json choosing ``labels[name]`` among each profiled layer's options."""
    doc = json.load(open(prof_dir / "plan.json"))
    m = doc["methods"]["exact"]
    prof = json.load(open(prof_dir / "profile.json"))
    rows = []
    for rec in prof["layers"]:
        p = rec["profile"]
        j = [o["label"] for o in p["options"]].index(labels.get(p["name"], "dense"))
        o = p["options"][j]
        rows.append({"name": p["name"], "option": j, "label": o["label"],
                     "decomp": o["decomp"], "rel_err": o["rel_err"], "bytes": o["bytes"]})
    m = dict(m, layers=rows, total_bytes=sum(r["bytes"] for r in rows),
             budget_bytes=m["budget_bytes"] if budget_bytes is None else budget_bytes)
    doc["methods"] = {"exact": m}
    os.makedirs(out_dir, exist_ok=True)
    with open(out_dir / "plan.json", "w") as f:
        json.dump(doc, f)
    return out_dir / "plan.json", rows


def test_plan_keeping_some_tensors_as_stored_copies_exactly_those(tmp_path, q4km):
    src, prof = q4km
    labels = {"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K",   # as stored
              "blk.0.attn_output.weight": "Q2_K", "blk.0.attn_v.weight": "Q8_0",
              "token_embd.weight": "dense"}
    plan, rows = _hand_plan(prof, tmp_path / "h", labels)
    before = stored_blocks(src)
    for requantize in (False, True):
        out = tmp_path / f"o{int(requantize)}.gguf"
        rc, o, e = run(["apply", src, plan, "-o", out, "-q"]
                       + (["--requantize"] if requantize else []))
        assert rc == 0, e
        after = stored_blocks(out)
        for name, (t, raw, shape) in before.items():
            lab = labels.get(name)
            if lab in (None, "dense") or (lab == t and not requantize):
                assert after[name][0] == t and np.array_equal(after[name][1], raw), name
            else:          # re-quantised from the stored values, as ggml does it
                w = ggml.dequantize(raw.reshape(shape[0], -1), t, tuple(shape))
                want = ggml.quantize(w, lab)
                assert after[name][0] == lab
                assert np.array_equal(after[name][1], want.reshape(-1)), name
        # 4 Q4_K tensors, 3 F32 norms, Q6_K / Q2_K / Q8_0 one each: llama.cpp's guess
        # is Q4_K -> MOSTLY_Q4_K_M = 15, marked GUESSED (the file is mixed)
        _, kv, _ = tensors_of(out)
        assert kv["general.file_type"].contents() == 15 | 1024
        assert kv["opscope.plan.requantize"].contents() is requantize
        assert "planned in their stored type" in o


def test_guess_file_type_follows_llama_cpp():
    from opscope_nb.io.gguf_export import guess_file_type
    f32 = ("F32", 1)
    # the most tensors win, F32 norms included; K-quants as their _M preset
    assert guess_file_type({"a.weight": ("Q4_K", 2), "b.weight": ("Q4_K", 2),
                            "c.weight": ("Q6_K", 2), "n1": f32}) == (15 | 1024, "Q4_K", True)
    # one type in every 2-D weight: not mixed, no GUESSED flag
    assert guess_file_type({"a.weight": ("Q8_0", 2), "n1": f32}) == (7, "Q8_0", False)
    # ties: the first type to reach the count in name (byte) order, as std::map
    assert guess_file_type({"b": ("Q2_K", 2), "a": ("Q5_0", 2)})[:2] == (8 | 1024, "Q5_0")
    assert guess_file_type({"B": ("Q2_K", 2), "a": ("Q5_0", 2)})[:2] == (10 | 1024, "Q2_K")
    # more norms than weights: llama.cpp guesses all F32 (one 2-D type: not mixed)
    assert guess_file_type({"a": ("Q3_K", 2), "n1": f32, "n2": f32}) == (0, "F32", False)


# ───────────────────────────── budgets ─────────────────────────────

def _smallest(prof_dir):
    from fractions import Fraction
    prof = json.load(open(prof_dir / "profile.json"))
    mn = sum(min(o["bytes"] for o in r["profile"]["options"]) for r in prof["layers"])
    dense = sum(r["profile"]["dense_bytes"] for r in prof["layers"])
    x = Fraction(mn * 10000, dense)
    return mn, float(Fraction(-(-x.numerator // x.denominator), 10000))


def test_infeasible_budget_exits_2_naming_the_smallest_feasible(tmp_path, q4km):
    src, _ = q4km
    d = tmp_path / "p"
    rc, o, e = _profile(src, d, "--budget", "0.35")
    mn, frac = _smallest(d)                        # the profile is kept for allocate
    assert rc == 2 and e.count("\n") == 1 and "Traceback" not in e
    assert f"smallest feasible budget is --budget {frac:g}" in e and "--fit" in e
    assert not (d / "plan.json").exists()
    rc, o, e = run(["allocate", d / "profile.json", "--budget", "0.5", "--out", tmp_path / "a"])
    assert rc == 2 and e.count("\n") == 1 and f"--budget {frac:g}" in e
    assert not (tmp_path / "a" / "plan.json").exists()
    rc, o, e = run(["allocate", d / "profile.json", "--bpw", "2", "--method", "exact"])
    assert rc == 2 and "--bpw 2.625" in e                     # every layer Q2_K
    # --fit: the plan at the smallest feasible budget, and a warning
    rc, o, e = run(["allocate", d / "profile.json", "--budget", "0.5", "--fit", "--method",
                    "exact", "--out", tmp_path / "f"])
    assert rc == 0 and "--fit" in e and f"--budget {frac:g}" in e
    plan = json.load(open(tmp_path / "f" / "plan.json"))
    assert plan["budget"] == frac and plan["budget_fitted_from"] == 0.5
    assert plan["methods"]["exact"]["total_bytes"] == mn
    # the default budget is always reachable: 0.35 of the way from the smallest plan
    rc, o, e = run(["allocate", d / "profile.json", "--method", "exact", "--out",
                    tmp_path / "g"])
    plan = json.load(open(tmp_path / "g" / "plan.json"))
    assert rc == 0 and plan["budget_default"] == 0.35 and frac < plan["budget"] < 1
    assert "bits/weight" in o and plan["methods"]["exact"]["feasible"]


def test_apply_refuses_a_plan_over_its_budget(tmp_path, q4km):
    src, prof = q4km
    plan, rows = _hand_plan(prof, tmp_path / "h", {}, budget_bytes=1000)
    rc, o, e = run(["apply", src, plan, "-o", tmp_path / "o.gguf", "-q"])
    assert rc == 2 and e.count("\n") == 1 and "--over-budget" in e
    assert str(sum(r["bytes"] for r in rows)) in e and "1000" in e
    assert not (tmp_path / "o.gguf").exists()
    rc, o, e = run(["apply", src, plan, "-o", tmp_path / "o.gguf", "-q", "--over-budget"])
    assert rc == 0 and (tmp_path / "o.gguf").exists()


def test_extreme_damage_is_flagged_with_the_budget_that_avoids_it(tmp_path, q4km):
    src, _ = q4km
    d = tmp_path / "p"
    rc, o, e = _profile(src, d, "--types", "Q4_K,TQ2_0", "--budget", "0.4", "--fit",
                        "--method", "exact")
    assert rc == 0, e
    prof = json.load(open(d / "profile.json"))
    need = sum(min(o["bytes"] for o in r["profile"]["options"] if o["rel_err"] <= 0.3)
               for r in prof["layers"])
    _, frac = _smallest(d)
    from fractions import Fraction
    x = Fraction(need * 10000, sum(r["profile"]["dense_bytes"] for r in prof["layers"]))
    avoid = float(Fraction(-(-x.numerator // x.denominator), 10000))
    assert "extreme damage" in e and f"--budget {avoid:g}" in e
    ex = json.load(open(d / "plan.json"))["methods"]["exact"]["extra"]["extreme_damage"]
    assert ex["avoid_budget"] == avoid and ex["layers_above"] > ex["layers"] / 2
    # at that budget the plan is not flagged
    rc, o, e = run(["allocate", d / "profile.json", "--budget", f"{avoid:g}", "--method",
                    "exact"])
    assert rc == 0 and "extreme damage" not in e


def test_quant_reports_against_the_stored_bytes(q4km):
    """The recipe is compared with the bytes the weights take now, not float32's."""
    from opscope_nb.cli._common import fmt_bytes
    src, _ = q4km
    rc, o, e = run(["quant", src, "-q"])
    assert rc == 0, e
    line = o.split("mixed recipe")[1]
    stored = sum(r * ggml.row_bytes(t, c) for n, ((r, *rest), t) in Q4_K_M.items()
                 if rest and not n.startswith("token_embd") for c in rest)
    assert f"vs {fmt_bytes(stored)} as stored (Q4_K/Q6_K;" in line
    assert "no saving" in line          # int8/int4 per channel is larger than Q4_K_M


def test_llama_cpp_reports_the_file_type_written(tmp_path):
    """llama.cpp loads the written file and names the file type the export wrote:
    one tensor re-typed -> the guess from the most tensors, "(guessed)"; nothing
    re-typed -> the source's own label, unflagged."""
    import ctypes
    from naive_models import smollm2_gguf
    from opscope_nb.formats import Decomp
    from opscope_nb.io.gguf_export import export_gguf
    from opscope_nb.models import llamacpp
    src = smollm2_gguf()
    if src is None or not llamacpp.available():
        pytest.skip("needs the SmolLM2 wheel and llama-cpp-python (the [llama] extra)")
    import llama_cpp

    def desc(path):
        llm = llamacpp.load(str(path), n_ctx=32)
        try:
            buf = ctypes.create_string_buffer(256)
            llama_cpp.llama_model_desc(llm.model, buf, 256)
            return buf.value.decode()
        finally:
            llm.close()

    mixed = export_gguf(src, {"blk.0.attn_k.weight": Decomp.ggml("Q8_0")},
                        str(tmp_path / "m.gguf"))
    assert mixed["file_type"] == 3 | 1024 and not mixed["file_type_kept"]
    d = desc(tmp_path / "m.gguf")
    assert "Q4_1" in d and "guessed" in d, d
    same = export_gguf(src, {"blk.0.attn_k.weight": Decomp.dense()}, str(tmp_path / "s.gguf"))
    assert same["file_type"] == 3 and same["file_type_kept"]
    d = desc(tmp_path / "s.gguf")
    assert "Q4_1" in d and "guessed" not in d, d


def test_safetensors_output_keeps_the_stored_blocks(tmp_path, q4km):
    """``apply -o OUT.safetensors`` of a tensor planned in its stored type packs
    the stored blocks themselves (no re-quantisation), and they run as is."""
    from test_stored_bytes import _raw_in
    from opscope_nb.runtime.checkpoint import load
    src, prof = q4km
    labels = {"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K",
              "blk.0.attn_output.weight": "Q2_K"}
    plan, rows = _hand_plan(prof, tmp_path / "h", labels)
    out = tmp_path / "c.safetensors"
    rc, o, e = run(["apply", src, plan, "-o", out, "-q"])
    assert rc == 0, e
    before = stored_blocks(src)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        st, raw = _raw_in(out, f"{name}.blocks")
        assert st == "U8" and raw == before[name][1].tobytes()
    st, raw = _raw_in(out, "blk.0.attn_output.weight.blocks")
    t, shape = before["blk.0.attn_output.weight"][::2]
    w = ggml.dequantize(before["blk.0.attn_output.weight"][1].reshape(shape[0], -1), t,
                        tuple(shape))
    assert raw == ggml.quantize(w, "Q2_K").tobytes()
    nw = sum(int(np.prod(before[r["name"]][2])) for r in rows)
    assert f"{sum(r['bytes'] for r in rows)} B written = " \
           f"{8 * sum(r['bytes'] for r in rows) / nw:.3f} bits/weight" in o
    tensors, _ = load(str(out))
    np.testing.assert_array_equal(
        tensors["blk.0.attn_q.weight"].dense(),
        ggml.dequantize(before["blk.0.attn_q.weight"][1].reshape(256, -1), "Q4_K", (256, 256)))


def test_profiles_and_plans_of_before_dense_at_float32(tmp_path, q4km):
    """A profile.json of before (dense at float32 bytes) is re-priced on load; a
    plan of before, whose dense rows apply would write in fewer bytes than it
    records, is refused with the fix."""
    from opscope_nb.profile.mining import LayerProfile
    src, prof = q4km
    rec = json.load(open(prof / "profile.json"))["layers"][0]["profile"]
    old = json.loads(json.dumps(rec))
    old["options"][0]["bytes"] = 4 * old["rows"] * old["cols"]
    lp = LayerProfile.from_dict(old)
    assert lp.options[0].bytes == rec["dense_bytes"] == lp.dense_bytes
    assert LayerProfile.from_dict(rec).options[0].bytes == rec["dense_bytes"]
    plan, rows = _hand_plan(prof, tmp_path / "h", {})
    doc = json.load(open(plan))
    for r in doc["methods"]["exact"]["layers"]:
        p = next(x["profile"] for x in json.load(open(prof / "profile.json"))["layers"]
                 if x["name"] == r["name"])
        r["bytes"] = 4 * p["rows"] * p["cols"]
    doc["methods"]["exact"]["budget_bytes"] = 10 ** 9
    json.dump(doc, open(plan, "w"))
    rc, o, e = run(["apply", src, plan, "-o", tmp_path / "o.gguf", "-q"])
    assert rc == 2 and e.count("\n") == 1 and "re-plan it with 'opscope-nb allocate" in e
