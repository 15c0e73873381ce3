"""``opscope-nb refine --runtime llama.cpp`` (issue 59, item 3) on a tiny random
Llama GGUF: the errors (these run without llama-cpp-python), and with it: the
candidate file assembled from cached blocks is byte for byte what ``apply``
writes for the same plan, the score is llama.cpp's KL of that file against
the source file, candidate files are deleted, and the llama.cpp-scored search
keeps the bytes within the budget and never returns a plan worse on the
held-out split than its start."""
from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tiny_archs as ta                                                   # noqa: E402
from naive_models import write_tiny_llama                                 # noqa: E402
from opscope_nb.cli import main                                           # noqa: E402
from opscope_nb.formats import Decomp, packed_bytes, pack, unpack         # noqa: E402
from opscope_nb.io import gguf_reader                                     # noqa: E402
from opscope_nb.models import llamacpp, open_model                        # noqa: E402
from opscope_nb.plan import refine as rf                                  # noqa: E402
from opscope_nb.plan import refine_llamacpp as rl                         # noqa: E402
from opscope_nb.plan.allocate import exact_allocate                       # noqa: E402
from opscope_nb.plan.apply import apply_plan                              # noqa: E402
from opscope_nb.profile.mining import DecompOption, LayerProfile          # noqa: E402

LABELS = ("dense", "Q8_0", "Q5_0", "Q4_0")
OBJ = "output"
STORED_Q8 = "blk.1.attn_k.weight"
needs_llama = pytest.mark.skipif(not llamacpp.available(),
                                 reason="llama-cpp-python not installed (the [llama] extra)")


def _realigned(src, dst, align):
    """``src`` rewritten with ``general.alignment = align`` (tensor data padded
    to it: with 256, a tensor of 2176 bytes is followed by padding)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    w.add_custom_alignment(align)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt,
                        sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def _layers(path, labels=LABELS):
    """A profile of every 2-D tensor of the GGUF file: ``labels`` as options
    (dense priced as stored), errors measured."""
    from opscope_nb.io import gguf_dequantize
    r = gguf_reader(path)
    out = []
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        w = gguf_dequantize(t.data, t.tensor_type, (rows, cols))
        opts = []
        for lab in labels:
            d = Decomp.from_label(lab) if lab == "dense" or "/" in lab else Decomp.ggml(lab)
            if d.kind == "dense":
                opts.append(DecompOption(d, 0.0, int(t.n_bytes), 0))
                continue
            a = unpack(pack(w, d), d, w.shape)
            opts.append(DecompOption(d, float(np.linalg.norm(a - w) / np.linalg.norm(w)),
                                     int(packed_bytes(rows, cols, d)), 0))
        out.append(LayerProfile(t.name, rows, cols, int(t.n_bytes), opts))
    return out


def _profile(tmp_path, src, layers, name="p"):
    prof = tmp_path / name / "profile.json"
    prof.parent.mkdir()
    prof.write_text(json.dumps({"tool": "opscope-nb", "source": {"path": str(src)},
                                "settings": {}, "layers": [
                                    {"name": lp.name, "profile": lp.to_dict()}
                                    for lp in layers]}))
    return prof


def _cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


COMMON = ["--budget", "0.3", "--objective", OBJ, "--tokens", "96", "--held-out-tokens", "64",
          "--window", "48", "--text", "sample", "-q", "--runtime", "llama.cpp"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama GGUF with 256-byte alignment, a ``general.file_type``
    and one tensor stored as Q8_0 (an option in its stored type is copied)."""
    from opscope_nb.io.gguf_export import export_gguf
    d = tmp_path_factory.mktemp("tiny_refine_llamacpp")
    a = _realigned(ta.write_gguf(d / "tiny.gguf", "llama"), d / "aligned.gguf", 256)
    path = str(d / "source.gguf")
    export_gguf(a, {STORED_Q8: Decomp.ggml("Q8_0")}, path)
    r = gguf_reader(path)
    assert r.alignment == 256 and int(r.fields["general.file_type"].contents()) == 1024
    return path, _layers(path)


# --------------------------------------------------------------------------- #
# errors: no llama.cpp needed
# --------------------------------------------------------------------------- #
def test_runtime_llamacpp_without_llama_cpp_exits_2(tiny_gguf, tmp_path, monkeypatch):
    path, layers = tiny_gguf
    prof = _profile(tmp_path, path, layers)

    def missing():
        raise llamacpp.LlamaCppError("the llama.cpp runtime needs llama-cpp-python "
                                     "(ImportError: no module); pip install -e \".[llama]\"")
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    monkeypatch.setattr(llamacpp, "_lib", missing)
    for cmd in (["refine", prof, "--out", tmp_path / "o"],
                ["allocate", prof, "--refine", "--out", tmp_path / "a", "--method", "exact"]):
        rc, so, se = _cli(*cmd, *COMMON)
        assert rc == 2, se
        line = se.strip().splitlines()[-1]
        assert "--runtime llama.cpp" in line and "llama-cpp-python" in line
        assert "--runtime numba" in line and "pip install" in line


def test_runtime_llamacpp_on_safetensors_source_exits_2(tmp_path):
    d = str(tmp_path / "st")
    W = write_tiny_llama(d, seed=3, n_layers=2)
    lp = []
    for n, w in W.items():
        if w.ndim == 2 and "embed" not in n:
            opts = [DecompOption(Decomp.dense(), 0.0, 4 * w.size, 0),
                    DecompOption(Decomp.from_label("int8/chan"), 0.01,
                                 packed_bytes(*w.shape, Decomp.from_label("int8/chan")), 0)]
            lp.append(LayerProfile(n, w.shape[0], w.shape[1], 4 * w.size, opts))
    prof = _profile(tmp_path, d, lp)
    rc, so, se = _cli("refine", prof, "--out", tmp_path / "o", *COMMON)
    assert rc == 2
    assert "scores GGUF files" in se and d in se and "--runtime numba" in se


def test_runtime_llamacpp_on_an_encoder_exits_2(tmp_path):
    p = tmp_path / "enc.gguf"
    w = gguf.GGUFWriter(str(p), "bert")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="scores decoders.*bert encoder"):
        rl.check_source(str(p))
    lp = [LayerProfile("blk.0.attn_q.weight", 32, 32, 4096,
                       [DecompOption(Decomp.dense(), 0.0, 4096, 0),
                        DecompOption(Decomp.ggml("Q8_0"), 0.01, 1088, 0)])]
    prof = _profile(tmp_path, p, lp)
    rc, so, se = _cli("refine", prof, "--out", tmp_path / "o", *COMMON)
    assert rc == 2 and "scores decoders" in se and "--runtime numba" in se


def test_runtime_llamacpp_needs_ggml_options(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    layers = _layers(path, ("dense", "Q8_0", "int4/g16"))
    with pytest.raises(ValueError, match="ggml type or dense.*int4/g16.*--menu ggml"):
        rl.check_options(layers)
    prof = _profile(tmp_path, path, layers)
    rc, so, se = _cli("refine", prof, "--out", tmp_path / "o", *COMMON)
    assert rc == 2 and "int4/g16" in se and "--menu ggml" in se


# --------------------------------------------------------------------------- #
# with llama.cpp
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def scorer(tiny_gguf):
    if not llamacpp.available():
        pytest.skip("llama-cpp-python not installed (the [llama] extra)")
    path, layers = tiny_gguf
    model = open_model(path)
    sc = rl.LlamaCppScorer.from_text(path, model, layers, text="sample", tokens=96,
                                     held_out_tokens=64, window=48, screen_tokens=40,
                                     n_threads=1)
    a = exact_allocate(layers, 0.15, objective=OBJ)
    assert a.feasible
    yield sc, a
    sc.close()


def _plan_json(tmp_path, layers, choice, budget=None):
    rows = [{"name": lp.name, "option": int(c), "label": lp.options[c].decomp.label,
             "decomp": lp.options[c].decomp.to_dict(), "bytes": int(lp.options[c].bytes)}
            for lp, c in zip(layers, choice)]
    m = {"layers": rows}
    if budget is not None:
        m["budget_bytes"] = int(budget)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tool": "opscope-nb", "methods": {"exact": m}}))
    return str(plan)


@needs_llama
def test_assembled_candidate_is_what_apply_writes(scorer, tiny_gguf, tmp_path):
    path, layers = tiny_gguf
    sc, a = scorer
    rng = np.random.default_rng(0)
    k8 = [lp.name for lp in layers].index(STORED_Q8)
    plans = [list(a.choice), [int(x) for x in rng.integers(0, len(LABELS), len(layers))],
             [0] * len(layers), [1] * len(layers), [3] * len(layers)]
    assert {p[k8] for p in plans} >= {0, 1, 3}    # the Q8_0 tensor kept, as Q8_0, as Q4_0
    for k, c in enumerate(plans):
        out = str(tmp_path / f"apply{k}.gguf")
        apply_plan(path, _plan_json(tmp_path, layers, c), out, force=True, over_budget=True)
        tool = {f.name: f.contents() for f in gguf_reader(out).fields.values()
                if f.name.startswith("opscope.")}
        mine = str(tmp_path / f"mine{k}.gguf")
        n = sc.write(c, mine, tool_kv=tool)
        with open(out, "rb") as f1, open(mine, "rb") as f2:
            want, got = f1.read(), f2.read()
        assert n == len(got) == len(want)
        assert got == want, k
    # packed once: the blocks of every (tensor, option) used so far are cached
    n_cached = len(sc._blocks)
    sc.write(plans[1], str(tmp_path / "again.gguf"))
    assert len(sc._blocks) == n_cached


@needs_llama
def test_score_is_llamacpps_kl_of_the_applied_file(scorer, tiny_gguf, tmp_path):
    from opscope_nb.models.evaluate import kl_stats
    path, layers = tiny_gguf
    sc, a = scorer
    out = str(tmp_path / "c.gguf")
    apply_plan(path, _plan_json(tmp_path, layers, a.choice), out, force=True)
    ref = llamacpp.load(path, n_ctx=48, n_threads=1)
    comp = llamacpp.load(out, n_ctx=48, n_threads=1)
    try:
        for split in ("search", "held_out"):
            kl = np.concatenate([kl_stats(llamacpp.logits(ref, ch), llamacpp.logits(comp, ch))[0]
                                 for ch in sc.splits[split].chunks])
            assert sc.full_score(a.choice, split) == pytest.approx(kl.mean(), rel=1e-6,
                                                                   abs=1e-12)
    finally:
        ref.close()
        comp.close()
    assert sc.score(a.choice) == sc.full_score(a.choice) > 0
    assert sc.score(a.choice, "held_out") == sc.full_score(a.choice, "held_out") \
        != sc.score(a.choice)
    assert sc.score([0] * len(layers)) == pytest.approx(0.0, abs=1e-7)   # dense = source (float32 p)
    assert os.listdir(sc.tmpdir) == []                  # candidate files deleted


@needs_llama
def test_llamacpp_refine_keeps_budget_and_is_never_worse(scorer, tiny_gguf):
    path, layers = tiny_gguf
    sc, a = scorer
    B = a.budget_bytes
    states = []
    # accept_z=0: any lower score is a move (16 candidates on a tiny model
    # find none 2 standard errors lower; the gate is tested in test_refine_paired)
    r = rf.refine(sc, a.choice, B, objective=OBJ, evals=16, seed=2, survivors=2,
                  on_state=states.append, accept_z=0.0)
    assert r.runtime == "llama.cpp" and r.to_dict()["runtime"] == "llama.cpp"
    assert r.scores["runtime"] == "llama.cpp"
    assert states and all(rf.plan_bytes(layers, st["best"]) <= B for st in states)
    assert rf.plan_bytes(layers, r.best) <= B and rf.plan_bytes(layers, r.choice) <= B
    assert r.accepted >= 1 and r.scores["best"]["search"] < r.scores["start"]["search"]
    assert r.kept == (r.scores["best"]["held_out"] < r.scores["start"]["held_out"])
    assert r.choice == (r.best if r.kept else list(a.choice))
    assert r.scores["start"]["held_out"] == sc.full_score(a.choice, "held_out")
    assert r.scores["best"]["search"] == sc.full_score(r.best)
    assert sc.runs["llama.cpp"][0] > 0 and r.forwards > 0
    assert set(sc.rates()) == {"llama.cpp", "numba"}

    class Rigged(rl.LlamaCppScorer):
        """Held-out scores that punish every plan but the start."""

        def score(self, choice, split="search", **kw):
            v = super().score(choice, split, **kw)
            if split == "held_out" and list(choice) != list(a.choice):
                return (10.0, None) if kw.get("ppl") else 10.0
            return v
    rigged = Rigged.__new__(Rigged)
    rigged.__dict__.update(sc.__dict__)
    r2 = rf.refine(rigged, a.choice, B, objective=OBJ, evals=16, seed=2, survivors=2,
                   accept_z=0.0)
    assert r2.best == r.best != r2.start
    assert not r2.kept and r2.choice == list(a.choice)


@needs_llama
def test_cli_refine_runtime_llamacpp(tiny_gguf, tmp_path):
    path, layers = tiny_gguf
    prof = _profile(tmp_path, path, layers)
    out = tmp_path / "o"
    rc, so, se = _cli("refine", prof, "--out", out, "--evals", "6", "--screen-tokens", "40",
                      *COMMON)
    assert rc == 0, se
    doc = json.load(open(out / "plan.json"))
    assert doc["refine"]["runtime"] == "llama.cpp" and doc["refine"]["evals"] == 6
    assert "runtime llama.cpp" in so and "llama.cpp" in so.split("search ")[-1]
    # a numba state is not continued by a llama.cpp run (the scores differ)
    rc, so, se = _cli("refine", prof, "--out", out, "--evals", "8", "--screen-tokens", "40",
                      *COMMON[:-2])
    assert rc == 0, se
    assert "continuing" not in so and json.load(open(out / "plan.json"))["refine"][
        "runtime"] == "numba"
