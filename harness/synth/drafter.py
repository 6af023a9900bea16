"""Tiny synthetic Gemma 4 assistants (MTP drafters) beside their targets: spec, weights, HF and GGUF writers.

A drafter spec (``cases/models/<target>-assistant.toml``) names its target spec and a seed::

    description = "one line"
    seed = 1234
    target = "e2b"                 # cases/models/e2b.toml
    [assistant]                    # Gemma4AssistantConfig fields (backbone_hidden_size = the target's hidden)
    use_ordered_embeddings = true
    num_centroids = 16
    centroid_intermediate_top_k = 4
    [config]                       # the drafter's Gemma4TextConfig; see INHERITED for what the target supplies
    hidden_size = 32
    ...
    [init]                         # as for a target (harness.synth.spec.INIT_DEFAULTS)

The drafter's text config inherits from its target every field that must agree with the K/V it reads
(:data:`INHERITED`); a spec may still state one (the bad-input tests do). :func:`make_drafter_weights` draws
every tensor as :func:`harness.synth.make_weights` does (its own seeded generator per name, parameters that
transformers initialises to 1 randomised, bf16-representable values); ``masked_embd_ordering`` is a seeded
permutation (transformers initialises it to zeros). :func:`write_drafter_hf` writes through transformers' own
``Gemma4AssistantForCausalLM`` (patched only where transformers cannot construct it: :mod:`harness.core.hf_assistant`);
:func:`write_drafter_gguf` writes a ``gemma4-assistant`` GGUF as llama.cpp's converter would (the
``gemma4-assistant.*`` keys of ``Gemma4AssistantModel``, ``embedding_length_out`` = the target's hidden size,
``nextn_predict_layers``; no ``masked_embedding.*`` tensors). :func:`ensure_drafter_built` caches both.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from gemma4_harness.reference.drafter import DrafterConfig, drafter_config_from_hf, drafter_expected_tensors
from gemma4_harness.reference.drafter_weights import gguf_to_drafter_hf
from gemma4_harness.reference.errors import ConfigError

from ..core.hf_assistant import assistant_construction
from .cache import BuiltCase, _cache_root, _versions, build_atomically, ensure_built
from .gguf import gguf_metadata, write_gguf
from .spec import CONFIG_KEYS, INIT_DEFAULTS, Spec, SpecError, load_spec
from .weights import _init_kind, _rng, _round_to_bf16

DRAFTER_BUILDER_VERSION = "drafter-1"
"""Bumped whenever the bytes written for an unchanged drafter spec change."""

DRAFTER_QTYPES: tuple[str, ...] = ("F32", "Q8_0")
"""GGUF file types a drafter is written in (F32 for the comparisons, Q8_0 for the quantized loader)."""

INHERITED: tuple[str, ...] = (
    "vocab_size", "num_key_value_heads", "head_dim", "global_head_dim", "attention_k_eq_v",
    "num_global_key_value_heads", "sliding_window", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
    "hidden_activation",
)
"""Text-config fields a drafter takes from its target unless its spec states them (they must agree with the
target's store layers, or :func:`reference.drafter.bind` refuses the pair)."""

ASSISTANT_KEYS = ("use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k", "backbone_hidden_size")


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter spec.

    Attributes:
        name: the file stem (``e2b-assistant``).
        description, seed: as in the file.
        target: the target's :class:`harness.synth.spec.Spec`.
        config: the drafter's text config (the file's ``[config]`` over the inherited fields).
        assistant: the ``Gemma4AssistantConfig`` fields (``backbone_hidden_size`` defaults to the target's hidden).
        init: ``[init]`` merged over :data:`harness.synth.spec.INIT_DEFAULTS`.
        path: the spec file; sha256: of the drafter spec's bytes and the target spec's hash.
    """

    name: str
    description: str
    seed: int
    target: Spec
    config: dict[str, Any]
    assistant: dict[str, Any]
    init: dict[str, float]
    path: Path
    sha256: str
    qtypes: tuple[str, ...] = DRAFTER_QTYPES

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` object of the HF assistant (``model_type`` ``gemma4_assistant``)."""
        return {"model_type": "gemma4_assistant", "text_config": dict(self.config, model_type="gemma4_text"),
                "tie_word_embeddings": True, **self.assistant}

    def drafter_config(self) -> DrafterConfig:
        """The drafter's config and per-layer table (:func:`reference.drafter.drafter_config_from_hf`)."""
        return drafter_config_from_hf(self.hf_config(), str(self.path))


def _fail(p: Path, key: str, what: str) -> SpecError:
    return SpecError(f"{p}: {key}: {what}")


def load_drafter_spec(path: str | os.PathLike[str]) -> DrafterSpec:
    """Read and validate one drafter spec (format in the module docstring).

    Raises:
        SpecError: unreadable or invalid TOML; ``description``/``seed``/``target``/``[config]`` missing; an unknown
            key; a target spec that cannot be read; a config :func:`reference.drafter.drafter_config_from_hf`
            refuses (one line each, naming the file and key).
    """
    p = Path(path).resolve()
    try:
        raw = p.read_bytes()
        doc = tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec file: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{p}: not valid TOML: {str(e).splitlines()[0]}") from None
    for key, typ in (("description", str), ("seed", int), ("target", str), ("config", dict)):
        if not isinstance(doc.get(key), typ) or isinstance(doc.get(key), bool):
            raise _fail(p, key, f"missing or not a {typ.__name__}")
    extra = sorted(set(doc) - {"description", "seed", "target", "config", "assistant", "init"})
    if extra:
        raise _fail(p, extra[0], "unknown top-level key")
    target_path = p.parent / f"{doc['target']}.toml"
    if not target_path.is_file():
        raise _fail(p, "target", f"no target spec {target_path.name} beside it")
    target = load_spec(target_path)
    unknown = sorted(set(doc["config"]) - CONFIG_KEYS)
    if unknown:
        raise _fail(p, f"config.{unknown[0]}", "not a Gemma4TextConfig field")
    config = {k: copy.deepcopy(target.config[k]) for k in INHERITED if k in target.config}
    config.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False,
                  enable_moe_block=False, tie_word_embeddings=True)
    config.update(copy.deepcopy(doc["config"]))
    assistant = dict(doc.get("assistant", {}))
    bad = sorted(set(assistant) - set(ASSISTANT_KEYS))
    if bad:
        raise _fail(p, f"assistant.{bad[0]}", f"not a Gemma4AssistantConfig field ({', '.join(ASSISTANT_KEYS)})")
    assistant.setdefault("backbone_hidden_size", target.config["hidden_size"])
    init = dict(INIT_DEFAULTS)
    for key, val in doc.get("init", {}).items():
        if key not in INIT_DEFAULTS or isinstance(val, bool) or not isinstance(val, (int, float)):
            raise _fail(p, f"init.{key}", "unknown init key or not a number")
        init[key] = float(val)
    if init["output_std"] != init["output_std"]:
        init["output_std"] = init["embed_std"]
    sha = hashlib.sha256(raw + b"\n" + target.sha256.encode()).hexdigest()
    spec = DrafterSpec(name=p.stem, description=doc["description"], seed=int(doc["seed"]), target=target,
                       config=config, assistant=assistant, init=init, path=p, sha256=sha)
    try:
        spec.drafter_config()
    except ConfigError as e:  # name the spec file instead of a config.json that does not exist yet
        raise SpecError(f"{p}: {str(e).split(': ', 1)[-1]}") from None
    return spec


def make_drafter_weights(spec: DrafterSpec) -> dict[str, np.ndarray]:
    """Every drafter tensor, deterministically from ``spec.seed`` (see the module docstring).

    Returns:
        ``canonical name -> array``: float32 (bf16-representable), and ``masked_embd_ordering`` int64, a
        permutation of the token ids, with the centroid head.
    """
    d = spec.drafter_config()
    init = spec.init
    out: dict[str, np.ndarray] = {}
    for name, shape in drafter_expected_tensors(d).items():
        rng = _rng(spec.seed, name)
        if name == "masked_embd_ordering":
            out[name] = rng.permutation(shape[0]).astype(np.int64)
            continue
        kind = _init_kind(name)
        if kind == "embed":
            arr = rng.standard_normal(shape) * init["embed_std"]
        elif kind == "linear":
            arr = rng.standard_normal(shape) * (init["linear_gain"] / np.sqrt(shape[-1]))
        else:
            arr = rng.uniform(init[f"{kind}_low"], init[f"{kind}_high"], size=shape)
        out[name] = _round_to_bf16(np.ascontiguousarray(arr, dtype=np.float32))
    return out


def write_drafter_hf(spec: DrafterSpec, weights: Mapping[str, np.ndarray], out_dir: str | os.PathLike[str]) -> Path:
    """Write the HF assistant through transformers' own ``Gemma4AssistantForCausalLM``.

    Loads ``weights`` into the model (the tied ``lm_head`` takes ``token_embd``), checks every state-dict entry
    holds them, ``save_pretrained`` (float32 safetensors), reloads with ``from_pretrained`` and checks the
    round trip bit for bit.

    Raises:
        RuntimeError: the names or shapes do not match the model's state dict, or the round trip differs.
        AssistantUnavailable: this transformers cannot construct the assistant (:mod:`harness.core.hf_assistant`).
    """
    import torch  # optional heavy dependency: only the HF writer needs it
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig  # heavy, optional

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    expected = {gguf_to_drafter_hf(k): v for k, v in weights.items()}
    expected["lm_head.weight"] = weights["token_embd.weight"]
    with assistant_construction():
        cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**copy.deepcopy(spec.config)),
                                    tie_word_embeddings=True, **spec.assistant)
        with torch.random.fork_rng(devices=[]):
            model = Gemma4AssistantForCausalLM(cfg).eval()
        keys = set(model.state_dict())
        if keys != set(expected):
            raise RuntimeError(f"{spec.name}: weights do not match Gemma4AssistantForCausalLM: missing "
                               f"{sorted(keys - set(expected))[:4]}, unexpected {sorted(set(expected) - keys)[:4]}")
        state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in expected.items()}
        model.load_state_dict(state, strict=True)
        _same(spec.name, "after load", model.state_dict(), expected)
        model.generation_config.num_assistant_tokens = 4
        model.save_pretrained(out)
        reloaded = Gemma4AssistantForCausalLM.from_pretrained(out, dtype=torch.float32)
        _same(spec.name, "after reload", reloaded.state_dict(), expected)
    return out


def _same(name: str, when: str, state, expected: Mapping[str, np.ndarray]) -> None:
    for k, arr in expected.items():
        got = state[k].detach().cpu().numpy()
        if got.shape != arr.shape or not np.array_equal(got, arr):
            raise RuntimeError(f"{name}: {when}: tensor {k} does not hold the synthetic weights")


def drafter_gguf_metadata(spec: DrafterSpec) -> dict[str, tuple[Any, str, str | None]]:
    """The ``gemma4-assistant.*`` keys: those ``Gemma4Model`` writes for the drafter's text config, with
    ``shared_kv_layers`` = ``block_count`` (transformers' forced value), plus ``embedding_length_out`` and
    ``nextn_predict_layers``. Source: llama.cpp ``conversion/gemma.py`` ``Gemma4AssistantModel``."""
    as_target = Spec(name=spec.name, description=spec.description, seed=spec.seed, config=spec.config,
                     init=spec.init, path=spec.path, sha256=spec.sha256)
    n_layer = spec.config["num_hidden_layers"]
    md: dict[str, tuple[Any, str, str | None]] = {}
    for key, val in gguf_metadata(as_target).items():
        md[key.replace("gemma4.", "gemma4-assistant.", 1) if key.startswith("gemma4.") else key] = val
    md["gemma4-assistant.attention.shared_kv_layers"] = (n_layer, "UINT32", None)
    md["gemma4-assistant.embedding_length_out"] = (spec.assistant["backbone_hidden_size"], "UINT32", None)
    md["gemma4-assistant.nextn_predict_layers"] = (n_layer, "UINT32", None)
    return md


def write_drafter_gguf(spec: DrafterSpec, weights: Mapping[str, np.ndarray], path: str | os.PathLike[str],
                       qtype: str = "F32") -> Path:
    """Write a ``gemma4-assistant`` GGUF (see the module docstring) and read it back (as :func:`write_gguf`).

    Raises:
        ValueError: the drafter's hidden size equals its target's (llama.cpp refuses such a file:
            ``embedding_length_out`` must differ from ``embedding_length``); an unknown qtype.
        RuntimeError: the read-back check fails.
    """
    if spec.config["hidden_size"] == spec.assistant["backbone_hidden_size"]:
        raise ValueError(f"{spec.name}: drafter hidden size equals the target's ({spec.config['hidden_size']}); "
                         "llama.cpp requires embedding_length_out to differ")
    as_target = Spec(name=spec.name, description=spec.description, seed=spec.seed, config=spec.config,
                     init=spec.init, path=spec.path, sha256=spec.sha256)
    tensors = {k: v for k, v in weights.items() if not k.startswith("masked_embd_")}
    return write_gguf(as_target, tensors, path, qtype, arch="gemma4-assistant", metadata=drafter_gguf_metadata(spec))


@dataclass(frozen=True)
class BuiltDrafter:
    """A built drafter on disk: its HF folder, one GGUF per :data:`DRAFTER_QTYPES`, and its built target."""

    spec: DrafterSpec
    root: Path
    hf_dir: Path
    target: BuiltCase
    gguf: dict[str, Path] = field(default_factory=dict)


def drafter_key(spec: DrafterSpec) -> str:
    """Cache directory name: ``<name>-<sha12>`` over the builder version and the spec (and target) hash."""
    digest = hashlib.sha256(f"{DRAFTER_BUILDER_VERSION}\n{spec.sha256}\n".encode()).hexdigest()
    return f"{spec.name}-{digest[:12]}"


def _built(spec: DrafterSpec, root: Path, target: BuiltCase) -> BuiltDrafter:
    return BuiltDrafter(spec=spec, root=root, hf_dir=root / "hf", target=target,
                        gguf={q: root / f"{spec.name}-{q}.gguf" for q in spec.qtypes})


def build_drafter(spec: DrafterSpec, out_dir: str | os.PathLike[str], target: BuiltCase) -> BuiltDrafter:
    """Write one drafter into ``out_dir``: ``spec.toml``, ``hf/``, the GGUFs, then ``manifest.json``."""
    t0 = time.perf_counter()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "spec.toml").write_bytes(spec.path.read_bytes())
    weights = make_drafter_weights(spec)
    built = _built(spec, root, target)
    write_drafter_hf(spec, weights, built.hf_dir)
    for q, p in built.gguf.items():
        write_drafter_gguf(spec, weights, p, q)
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file()}
    manifest = {"builder_version": DRAFTER_BUILDER_VERSION, "name": spec.name, "spec_sha256": spec.sha256,
                "target": str(target.root), "files": files, "versions": _versions(),
                "build_seconds": round(time.perf_counter() - t0, 3)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return built


def ensure_drafter_built(spec_or_path: DrafterSpec | str | os.PathLike[str],
                         cache_dir: str | os.PathLike[str] | None = None) -> BuiltDrafter:
    """The built drafter (and its built target), building either on a cache miss (atomically, as
    :func:`harness.synth.ensure_built`).

    Raises:
        SpecError: an invalid drafter or target spec.
        RuntimeError: a writer's self-check failed.
    """
    spec = spec_or_path if isinstance(spec_or_path, DrafterSpec) else load_drafter_spec(spec_or_path)
    target = ensure_built(spec.target, cache_dir)
    root = build_atomically(_cache_root(cache_dir), drafter_key(spec), lambda tmp: build_drafter(spec, tmp, target))
    return _built(spec, root, target)
