"""Writing a synthetic case as an HF checkpoint, through transformers' own Gemma 4 classes."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from safetensors import safe_open

from gemma4_harness.reference.names import gguf_to_hf

from .spec import Spec, text_config


def _hf_config(spec: Spec):
    from transformers import Gemma4TextConfig  # heavy: imported only when a case is built

    return Gemma4TextConfig(**copy.deepcopy(spec.config))


def write_hf(spec: Spec, weights: Mapping[str, np.ndarray], out_dir: str | os.PathLike[str]) -> Path:
    """Write an HF text checkpoint through transformers' own Gemma 4 classes.

    Builds ``Gemma4TextConfig(**spec.config)`` and ``Gemma4ForCausalLM``, loads
    ``weights`` into it (names mapped with :func:`reference.names.gguf_to_hf`;
    the tied ``lm_head`` takes ``token_embd``), checks that every state-dict
    entry (parameters and the persistent ``layer_scalar`` buffers) now holds the
    given values, then ``save_pretrained(out_dir)`` (float32 safetensors,
    ``config.json``, ``generation_config.json``). ``config.json`` is then given
    ``global_head_dim`` and ``num_global_key_value_heads`` as well, as Google's
    published checkpoints state them (transformers >= 5.2x saves only the derived
    ``per_layer_config``; on reload it uses ``per_layer_config`` and ignores the two
    extra keys). Finally reloads with ``from_pretrained`` and checks the
    safetensors key set and every tensor round-trip bit-exactly.

    Args:
        spec: the spec.
        weights: canonical name -> float32 array, as from :func:`make_weights`.
        out_dir: directory to write (created; existing files are overwritten).

    Returns:
        ``Path(out_dir)``.

    Raises:
        RuntimeError: the weight names do not match the model's state dict
            exactly, a tensor has the wrong shape, or the round trip differs.
    """
    import torch  # heavy: imported only when a case is built
    from transformers import Gemma4ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _hf_config(spec)
    tied = bool(cfg.tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):  # transformers' random init must not move the caller's RNG
        model = Gemma4ForCausalLM(cfg).eval()
    model_keys = set(model.state_dict())

    expected: dict[str, np.ndarray] = {gguf_to_hf(k): v for k, v in weights.items()}
    file_keys = set(expected)
    if tied:
        if "lm_head.weight" in expected:
            raise RuntimeError(f"{spec.name}: tied spec but weights contain output.weight")
        expected["lm_head.weight"] = weights["token_embd.weight"]
    missing = sorted(model_keys - set(expected))
    extra = sorted(set(expected) - model_keys)
    if missing or extra:
        raise RuntimeError(f"{spec.name}: weights do not match Gemma4ForCausalLM: "
                           f"missing {missing[:5]}, unexpected {extra[:5]}")
    state = {}
    for k, arr in expected.items():
        ref = model.state_dict()[k]
        if tuple(ref.shape) != arr.shape:
            raise RuntimeError(f"{spec.name}: {k}: shape {arr.shape}, model expects {tuple(ref.shape)}")
        state[k] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    model.load_state_dict(state, strict=True)
    _check_state(spec.name, "after load", model.state_dict(), expected)
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{spec.name}: lm_head is not tied to embed_tokens after loading")

    model.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["global_head_dim"] = spec.config["global_head_dim"]
    cfg_json["num_global_key_value_heads"] = spec.config.get("num_global_key_value_heads")
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")

    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        saved = set(f.keys())
    if saved != file_keys:
        raise RuntimeError(f"{spec.name}: safetensors keys differ: missing {sorted(file_keys - saved)[:5]}, "
                           f"unexpected {sorted(saved - file_keys)[:5]}")
    reloaded = Gemma4ForCausalLM.from_pretrained(out, dtype=torch.float32)
    _check_state(spec.name, "after reload", reloaded.state_dict(), expected)
    for L in text_config(spec).layers:
        attn = reloaded.model.layers[L.index].self_attn
        if attn.head_dim != L.head_dim or getattr(attn, "is_kv_shared_layer", False) != (not L.has_kv):
            raise RuntimeError(f"{spec.name}: layer {L.index} reloaded with head_dim {attn.head_dim}, "
                               f"expected {L.head_dim}")
    return out


def _check_state(name: str, when: str, state: Mapping[str, Any], expected: Mapping[str, np.ndarray]) -> None:
    if set(state) != set(expected):
        raise RuntimeError(f"{name}: {when}: state dict keys differ from the weights")
    for k, arr in expected.items():
        got = state[k].detach().cpu().numpy()
        if got.dtype != np.float32 or got.shape != arr.shape or not np.array_equal(got, arr):
            raise RuntimeError(f"{name}: {when}: tensor {k} does not hold the synthetic weights")


def logit_stats(hf_dir: str | os.PathLike[str], prompts: Iterable[Sequence[int]]) -> dict[str, float]:
    """Logit magnitude and top-1 margin of an HF checkpoint under transformers (fp32, eager).

    Args:
        hf_dir: an HF checkpoint directory (e.g. ``BuiltCase.hf_dir``).
        prompts: token-id sequences, each run alone (batch 1, no cache).

    Returns:
        ``max_abs_logit`` over all positions and prompts, ``median_margin`` /
        ``min_margin`` / ``p10_margin`` of top1 - top2 over all positions,
        ``max_abs_hidden`` (last hidden state), ``n_positions`` and ``finite``
        (1.0 if every logit is finite).
    """
    import torch  # heavy: imported only when asked
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    margins, max_abs, max_h, finite = [], 0.0, 0.0, True
    with torch.no_grad():
        for ids in prompts:
            out = model(input_ids=torch.tensor([list(ids)]), use_cache=False, output_hidden_states=True)
            lg = out.logits[0].double()
            finite &= bool(torch.isfinite(lg).all())
            max_abs = max(max_abs, float(lg.abs().max()))
            max_h = max(max_h, float(out.hidden_states[-1].abs().max()))
            top = torch.topk(lg, 2, dim=-1).values
            margins.extend((top[:, 0] - top[:, 1]).tolist())
    m = np.array(margins)
    return {
        "max_abs_logit": max_abs,
        "median_margin": float(np.median(m)),
        "p10_margin": float(np.percentile(m, 10)),
        "min_margin": float(m.min()),
        "max_abs_hidden": max_h,
        "n_positions": float(m.size),
        "finite": 1.0 if finite else 0.0,
    }
