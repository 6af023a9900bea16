"""The MTP drafter (Gemma 4 assistant): reference vs transformers (patched only where it cannot construct one),
loaders, bad input, store layers.

The drafter must read the target's last non-shared sliding layer on its sliding layers and the last non-shared
full layer on its full layers: perturbing each changes its drafts, perturbing any other layer does not, and a
drafter bound to the wrong layer fails the parity gates.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from gemma4_harness.fast.drafter import FastDrafter
from gemma4_harness.fast.model import FastModel
from gemma4_harness.harness.core.cases import MODELS_DIR, builtin_drafter_specs, builtin_specs, drafter_spec_for
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.parity.checks.drafter import (fast_state, gguf_vs_hf, reference_vs_fast,
                                                            reference_vs_transformers)
from gemma4_harness.harness.synth.drafter import ensure_drafter_built, load_drafter_spec
from gemma4_harness.reference import drafter as R
from gemma4_harness.reference.drafter_weights import load_drafter
from gemma4_harness.reference.errors import ConfigError, InputError, ModelFileError
from gemma4_harness.reference.weights import load_model

PROMPTS = load_prompts()
SHORT_LONG = [p for p in PROMPTS if p["id"] in ("len5", "len17-window+1", "len48-3xwindow")]
LONG = next(p for p in PROMPTS if p["id"] == "len32-2xwindow")  # longer than the window: the ring has wrapped


@pytest.fixture(scope="module", params=["e2b", "26b-a4b"])
def pair(request):
    """(built drafter, target cfg, target weights, bound HF drafter, its weights): e2b has the centroid head and
    a KV-shared tail; 26b-a4b a k_eq_v full store layer and a plain head."""
    built = ensure_drafter_built(MODELS_DIR / f"{request.param}-assistant.toml")
    tcfg, TW = load_model(built.target.gguf["F32"])
    d, DW = load_drafter(built.hf_dir)
    return built, tcfg, TW, R.bind(d, tcfg), DW


def test_every_target_has_a_drafter_spec_and_they_all_parse():
    assert len(builtin_drafter_specs()) == len(builtin_specs())
    for p in builtin_specs():
        dspec = load_drafter_spec(drafter_spec_for(p))
        assert dspec.target.name == p.stem
        assert dspec.config["hidden_size"] != dspec.assistant["backbone_hidden_size"]  # llama.cpp needs them to differ


def test_the_patch_is_applied_only_where_transformers_cannot_construct_an_assistant(monkeypatch):
    """Found by trying: transformers 5.23 cannot construct an assistant (kv_sharing_modes raises for an all-shared
    config) and gets the patch, only inside the block; 5.24 constructs it by itself and gets nothing. A
    transformers that gives a wrong answer either way is refused in one line, which is not bad input."""
    import transformers
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    from gemma4_harness.harness.core import hf_assistant as H

    built = ensure_drafter_built(MODELS_DIR / "edge-no-softcap-assistant.toml")
    raw = json.loads((built.hf_dir / "config.json").read_text())
    tc = {k: v for k, v in raw["text_config"].items() if k not in ("model_type", "transformers_version")}

    def build():
        return Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=Gemma4TextConfig(**tc),
                                                                backbone_hidden_size=64))

    try:
        build()
        expected = "native"
    except ValueError as e:
        assert "layer types producing a cache" in str(e)  # transformers 5.23
        expected = "patched"
    assert H.construction() == expected
    original = Gemma4TextConfig.__dict__["kv_sharing_modes"]
    with H.assistant_construction() as how:
        assert how == expected
        patched = getattr(Gemma4TextConfig.kv_sharing_modes.fget, "_g4h_patched", False)
        assert patched == (expected == "patched")
        m = build()
        assert all(layer.self_attn.is_kv_shared_layer for layer in m.model.layers)
        with H.assistant_construction():  # nested use is harmless
            pass
    assert Gemma4TextConfig.__dict__["kv_sharing_modes"] is original  # nothing left behind
    # a transformers whose assistant cannot be built, with or without the patch: refused in one line, not bad input
    class Broken(Gemma4AssistantForCausalLM):
        def __init__(self, config):
            raise TypeError("Gemma4AssistantForCausalLM.__init__() takes a new argument\n(second line)")

    monkeypatch.setattr(H, "_found", {})
    monkeypatch.setattr(transformers, "Gemma4AssistantForCausalLM", Broken)
    with pytest.raises(H.AssistantUnavailable) as e:
        with H.assistant_construction():
            pass
    msg = str(e.value)
    assert f"transformers {transformers.__version__} cannot construct Gemma4AssistantForCausalLM" in msg
    assert "\n" not in msg and not isinstance(e.value, InputError)


@pytest.mark.slow
def test_reference_drafter_matches_transformers(pair):
    from gemma4_harness.harness.engines.assistant import HFAssistantOracle

    built, tcfg, TW, d, DW = pair
    oracle = HFAssistantOracle(built.target.hf_dir, built.hf_dir)
    figs = reference_vs_transformers(d, DW, tcfg, TW, oracle, PROMPTS)
    shared = tcfg.n_kv_shared > 0
    for f in figs:
        if "informational_reason" in f.detail:  # only the store comparison, only without KV sharing
            assert not shared and f.gate == "drafter.store_kv.reference~transformers.max_abs"
            continue
        assert DEFAULT_GATES[f.gate].check(f.measured), (f.gate, f.prompt, f.measured)
    assert all(f.detail["same_drafts"] for f in figs if f.gate == "drafter.reference~transformers.max_abs")
    # transformers 5.23 hands a drafter no K/V of a target without KV sharing (a limit found here); 5.24 does
    hands_kv = bool(oracle.after_prefill(SHORT_LONG[0]["prompt_ids"])[2])
    assert hands_kv or not shared
    for p in SHORT_LONG:
        if hands_kv:  # transformers' own speculative greedy equals its plain greedy
            assert oracle.speculative_generate(p["prompt_ids"], 8, 3) == oracle.greedy(p["prompt_ids"], 8)
        else:
            with pytest.raises(KeyError):
                oracle.speculative_generate(p["prompt_ids"], 8, 3)


@pytest.mark.slow
def test_transformers_drafter_sees_w_plus_1_sliding_keys_where_the_specification_sees_w_minus_1():
    """A recorded difference (reference/drafter.py): given a sliding store longer than the window, transformers'
    drafter attends to its last W+1 keys; llama.cpp and this specification to the W-1 before the position."""
    from gemma4_harness.harness.engines.assistant import FULL, SLIDING, HFAssistantOracle

    built = ensure_drafter_built(MODELS_DIR / "e2b-assistant.toml")
    tcfg, TW = load_model(built.target.gguf["F32"])
    d, DW = load_drafter(built.hf_dir)
    d = R.bind(d, tcfg)
    oracle = HFAssistantOracle(built.target.hf_dir, built.hf_dir)
    ids, W = LONG["prompt_ids"], tcfg.sliding_window
    cache, tok, h = R.after_prefill(tcfg, TW, ids)
    s_il, f_il = d.text.layers[0].kv_donor, d.text.layers[-1].kv_donor
    full = (cache.k[f_il], cache.v[f_il])

    def hf(n_keys):
        kv = {SLIDING: (cache.k[s_il][-n_keys:], cache.v[s_il][-n_keys:]), FULL: full}
        return oracle.drafts(tok, h, len(ids), kv, 1)[1][0]

    ref = R.draft(d, DW, tcfg, TW, cache, tok, h, 1)[1][0]
    every = hf(len(ids))
    assert np.max(np.abs(every - hf(W + 1))) < 1e-4
    assert np.max(np.abs(hf(W - 1) - ref)) < 1e-4
    assert np.max(np.abs(every - ref)) > 1.0


def test_gguf_and_hf_drafters_agree(pair):
    built, tcfg, TW, d, DW = pair
    dg, DWg = load_drafter(built.gguf["F32"])
    dg = R.bind(dg, tcfg)
    assert dg.summary()["reads_target_layer"] == d.summary()["reads_target_layer"]
    assert not dg.use_ordered_embeddings  # a GGUF has no centroid head, as llama.cpp's converter writes it
    figs, facts = gguf_vs_hf(d, DW, dg, DWg, tcfg, TW, SHORT_LONG)
    assert all(f.measured == 0.0 for f in figs)
    assert bool(facts) == d.use_ordered_embeddings
    dq, DWq = load_drafter(built.gguf["Q8_0"])  # a quantized drafter loads and drafts finite values
    cache, tok, h0 = R.after_prefill(tcfg, TW, SHORT_LONG[0]["prompt_ids"])
    logits, h = R.drafter_forward(R.bind(dq, tcfg), DWq, tcfg, TW, [tok], h0[None], cache.n_past, cache)
    assert np.isfinite(logits).all() and np.isfinite(h).all()


def test_fast_drafter_matches_reference(pair):
    _, tcfg, TW, d, DW = pair
    for f in reference_vs_fast(d, DW, tcfg, TW, FastModel(tcfg, TW, "cpu", "float32"), SHORT_LONG[::2]):
        assert DEFAULT_GATES[f.gate].check(f.measured), (f.prompt, f.measured)
        assert f.detail["same_drafts"]


def test_centroid_head_masks_all_but_the_top_clusters():
    d, DW = load_drafter(ensure_drafter_built(MODELS_DIR / "e2b-assistant.toml").hf_dir)
    assert d.use_ordered_embeddings
    h = np.random.default_rng(0).standard_normal((3, d.text.hidden_size))
    logits = R.centroid_head(DW, h, d.num_centroids, d.centroid_top_k)
    full = h @ DW["token_embd.weight"].T
    for t in range(3):
        kept = logits[t] != logits[t].min()
        assert kept.sum() == d.centroid_top_k * d.text.vocab_size // d.num_centroids
        np.testing.assert_allclose(logits[t][kept], full[t][kept], rtol=0, atol=1e-12)  # float64, another sum order
        assert logits[t].min() == logits[t][kept].min() - 1.0


# --------------------------------------------------------------------------- which target layers it reads


def _perturbed_drafts(d, DW, tcfg, TW, ids, layer: int | None):
    cache, tok, h = R.after_prefill(tcfg, TW, ids)
    if layer is not None:
        cache.k[layer] = cache.k[layer] + 0.5
        cache.v[layer] = cache.v[layer] * -1.0
    return R.draft(d, DW, tcfg, TW, cache, tok, h, 2)


def test_drafter_reads_the_sliding_and_the_full_store_layer(pair):
    _, tcfg, TW, d, DW = pair
    stores = R.store_layers(tcfg)
    ids = LONG["prompt_ids"]
    base = _perturbed_drafts(d, DW, tcfg, TW, ids, None)
    for sliding, il in stores.items():
        moved = _perturbed_drafts(d, DW, tcfg, TW, ids, il)
        assert np.max(np.abs(np.array(moved[1]) - np.array(base[1]))) > 1e-2, ("store layer ignored", il, sliding)
    for L in tcfg.layers:
        if L.has_kv and L.index not in stores.values():
            same = _perturbed_drafts(d, DW, tcfg, TW, ids, L.index)
            np.testing.assert_array_equal(np.array(same[1]), np.array(base[1]))


def test_fast_drafter_reads_the_store_layers_of_the_fast_cache(pair):
    _, tcfg, TW, d, DW = pair
    fm = FastModel(tcfg, TW, "cpu", "float32")
    fd = FastDrafter(d, DW, fm)
    ids = LONG["prompt_ids"]

    def run(poke: int | None):
        cache, slot, tok, h = fast_state(fm, ids, 2)
        if poke is not None:
            for t in cache.stores[poke].tensors():
                t.add_(0.5)
        with torch.inference_mode():
            return fd.drafter_forward(cache, [slot], torch.tensor([tok]), h, [len(ids)])[0]

    base = run(None)
    stores = set(R.store_layers(tcfg).values())
    for L in tcfg.layers:
        if L.has_kv:
            moved = float((run(L.index) - base).abs().max())
            assert (moved > 1e-2) == (L.index in stores), (L.index, moved)


def test_a_drafter_bound_to_the_wrong_store_layer_fails_the_gates():
    built = ensure_drafter_built(MODELS_DIR / "e2b-assistant.toml")
    tcfg, TW = load_model(built.target.gguf["F32"])
    d, DW = load_drafter(built.hf_dir)
    d = R.bind(d, tcfg)
    other_sliding = max(L.index for L in tcfg.layers if L.has_kv and L.is_sliding and L.index != d.text.layers[0].kv_donor)
    wrong = dataclasses.replace(d, text=dataclasses.replace(d.text, layers=(
        dataclasses.replace(d.text.layers[0], kv_donor=other_sliding),) + d.text.layers[1:]))
    gate = DEFAULT_GATES["drafter.reference~fast.max_abs"]
    fm = FastModel(tcfg, TW, "cpu", "float32")
    fd = FastDrafter(wrong, DW, fm)
    ids = LONG["prompt_ids"]
    cache, tok, h = R.after_prefill(tcfg, TW, ids)
    _, logits, hs = R.draft(d, DW, tcfg, TW, cache, tok, h, 1)
    fcache, slot, _, fh = fast_state(fm, ids, 1)
    with torch.inference_mode():
        flog, fh2 = fd.drafter_forward(fcache, [slot], torch.tensor([tok]), fh, [len(ids)])
    err = max(float(np.max(np.abs(flog[0].double().numpy() - logits[0]))),
              float(np.max(np.abs(fh2[0].double().numpy() - hs[0]))))
    assert not gate.check(err), err


# --------------------------------------------------------------------------- bad input


def test_bind_refuses_a_drafter_that_does_not_fit_its_target():
    built = ensure_drafter_built(MODELS_DIR / "e2b-assistant.toml")
    tcfg, _ = load_model(built.target.gguf["F32"])
    d, _ = load_drafter(built.hf_dir)
    other, _ = load_model(ensure_drafter_built(MODELS_DIR / "31b-assistant.toml").target.gguf["F32"])
    with pytest.raises(ConfigError, match="backbone_hidden_size = 64 does not match the target's hidden size 128"):
        R.bind(d, other)
    all_full = dataclasses.replace(tcfg, layers=tuple(dataclasses.replace(L, is_sliding=False) for L in tcfg.layers))
    with pytest.raises(ConfigError, match="drafter layer 0 is sliding but the target has no non-shared sliding"):
        R.bind(d, all_full)
    wide = dataclasses.replace(d, text=dataclasses.replace(d.text, layers=(
        dataclasses.replace(d.text.layers[0], head_dim=64),) + d.text.layers[1:]))
    with pytest.raises(ConfigError, match=r"head_dim 64, kv heads 1\) cannot read target layer 3 \(head_dim 32"):
        R.bind(wide, tcfg)
    dg, _ = load_drafter(built.gguf["F32"])
    with pytest.raises(ConfigError, match="gemma4-assistant.embedding_length_out = 64 does not match"):
        R.bind(dg, other)
    for bad in (lambda: R.bind(d, other), lambda: R.bind(d, all_full)):
        with pytest.raises(ConfigError) as e:
            bad()
        assert "\n" not in str(e.value)


def test_loader_refuses_missing_or_extra_drafter_tensors(tmp_path):
    built = ensure_drafter_built(MODELS_DIR / "edge-no-softcap-assistant.toml")
    for what, edit, msg in [
        ("missing", lambda t: t.pop("pre_projection.weight"), "missing drafter tensor nextn.pre_projection.weight"),
        ("missing-layer", lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"),
         "missing drafter tensor blk.1.attn_q_norm.weight"),
        ("extra-k", lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((32, 32), np.float32)),
         "unexpected tensor blk.0.attn_k.weight"),
        ("shape", lambda t: t.__setitem__("post_projection.weight", np.zeros((32, 32), np.float32)),
         "nextn.post_projection.weight has shape [32, 32], expected [64, 32]"),
    ]:
        folder = tmp_path / what
        shutil.copytree(built.hf_dir, folder)
        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(ModelFileError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            load_drafter(folder)
    with pytest.raises(ConfigError, match="expected 'gemma4-assistant'"):
        load_drafter(built.target.gguf["F32"])
    with pytest.raises(ConfigError, match="expected 'gemma4_assistant'"):
        load_drafter(built.target.hf_dir)
