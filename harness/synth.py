"""Deterministic tiny synthetic Gemma 4 checkpoints, as HF safetensors and GGUF.

A *spec* (``cases/models/*.toml``) names a tiny Gemma 4 text decoder and a
seed. :func:`make_weights` turns it into one set of float32 arrays under the
canonical GGUF tensor names of :mod:`reference.names`; :func:`write_hf` writes
those arrays through transformers' own ``Gemma4TextConfig`` /
``Gemma4ForCausalLM`` (``save_pretrained``, safetensors) and :func:`write_gguf`
writes the same arrays through ``gguf.GGUFWriter`` with llama.cpp's ``gemma4``
keys, in any of :data:`QTYPES`. :func:`ensure_built` caches the result per spec
file and builder version.

Spec format (TOML, read with :mod:`tomllib`)::

    description = "one line: what this case exercises"
    seed = 1234
    [config]        # Gemma4TextConfig field names (HF config.json names), plus
                    # the constructor kwargs global_head_dim and
                    # num_global_key_value_heads
    [init]          # weight scales; keys and defaults in INIT_DEFAULTS

``[init]`` keys (all optional, see :data:`INIT_DEFAULTS`):

* ``embed_std``: std of ``token_embd`` (normal, mean 0). With a tied head this
  also sets the logit scale: logit std ~ ``embed_std * sqrt(hidden) * rms(output_norm)``.
* ``output_std``: std of an untied ``output.weight`` (defaults to ``embed_std``).
* ``ple_embed_std``: std of ``per_layer_token_embd``.
* ``linear_gain``: every projection matrix ``[out, in]`` (attention, MLP,
  experts, PLE gate/projection, PLE model projection) is normal with std
  ``linear_gain / sqrt(in)``.
* ``router_std``: std of the router projection ``ffn_gate_inp`` (absolute; the
  router feeds it an RMS-normalised input scaled by ``hidden**-0.5``, so the
  expert scores have about this std, and top-k choices are not near-ties).
* ``norm_low`` / ``norm_high``: RMSNorm weights not named below (input, pre-FFN,
  MoE pre/post-branch, PLE projection norm) are uniform in this range (Gemma 4
  norms multiply by the weight itself, no ``1 + w``; transformers initialises
  them to 1, which would hide a missing multiply).
* ``qk_norm_low`` / ``qk_norm_high``: ``attn_q_norm`` / ``attn_k_norm``. Gemma 4
  attention has scale 1.0, so these set how peaked attention is.
* ``post_norm_low`` / ``post_norm_high``: ``post_attention_norm``,
  ``post_ffw_norm`` and the PLE ``post_norm``: the size of what each block adds
  to the residual. Above 1 so that the layers, not the scaled input embedding,
  dominate the final state (otherwise a tied head just echoes the input token).
* ``output_norm_low`` / ``output_norm_high``: final ``output_norm``; with a small
  ``embed_std`` it sets the logit scale.
* ``layer_scalar_low`` / ``layer_scalar_high``: ``layer_output_scale`` (HF
  ``layer_scalar``, initialised to 1 by transformers), uniform.
* ``router_scale_low`` / ``router_scale_high``: router ``scale`` (per hidden
  channel), uniform.
* ``per_expert_scale_low`` / ``per_expert_scale_high``: router
  ``per_expert_scale``, uniform.

Every tensor is drawn from its own ``numpy.random.default_rng`` seeded by the
spec seed and a hash of the tensor name, so a tensor's values do not depend on
which other tensors exist.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from reference.names import gguf_to_hf

#: Repository root (``harness/`` lives directly under it).
REPO_ROOT = Path(__file__).resolve().parents[1]

#: Bumped whenever the bytes this module writes for an unchanged spec change.
BUILDER_VERSION = "synth-2"

#: GGUF tensor types :func:`write_gguf` and :func:`ensure_built` produce.
QTYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0")

#: Defaults for the ``[init]`` table (see the module docstring).
INIT_DEFAULTS: dict[str, float] = {
    "embed_std": 0.2,
    "output_std": float("nan"),  # NaN: same as embed_std
    "ple_embed_std": 1.0,
    "linear_gain": 1.0,
    "router_std": 1.5,
    "norm_low": 0.6,
    "norm_high": 1.4,
    "qk_norm_low": 0.5,
    "qk_norm_high": 1.0,
    "post_norm_low": 1.5,
    "post_norm_high": 3.0,
    "output_norm_low": 2.0,
    "output_norm_high": 4.0,
    "layer_scalar_low": 0.5,
    "layer_scalar_high": 1.5,
    "router_scale_low": 0.5,
    "router_scale_high": 1.5,
    "per_expert_scale_low": 0.5,
    "per_expert_scale_high": 1.5,
}

#: ``Gemma4TextConfig`` fields a spec may set (transformers 5.x), plus the two
#: constructor-only kwargs that end up in ``config.per_layer_config``.
CONFIG_KEYS: frozenset[str] = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
    "pad_token_id", "eos_token_id", "bos_token_id", "tie_word_embeddings",
    "rope_parameters", "attention_bias", "attention_dropout", "sliding_window",
    "layer_types", "final_logit_softcapping", "use_bidirectional_attention",
    "vocab_size_per_layer_input", "hidden_size_per_layer_input", "attention_k_eq_v",
    "num_kv_shared_layers", "enable_moe_block", "use_double_wide_mlp", "num_experts",
    "top_k_experts", "moe_intermediate_size",
    # constructor kwargs, not dataclass fields:
    "global_head_dim", "num_global_key_value_heads",
})

#: Keys a spec's ``[config]`` must state (defaults in transformers are those of
#: the real E2B and would silently make a huge or PLE-enabled model).
REQUIRED_CONFIG_KEYS: tuple[str, ...] = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
    "layer_types", "sliding_window", "rope_parameters", "hidden_size_per_layer_input",
    "tie_word_embeddings",
)

SLIDING = "sliding_attention"
FULL = "full_attention"

#: Special token ids of the synthetic vocabulary (Gemma's layout).
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
#: First byte token ``<0x00>``; bytes occupy ids 4..259.
BYTE_BASE = 4

_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}


class SpecError(ValueError):
    """A spec file is unreadable or invalid; the message is one line naming the file and key."""


@dataclass(frozen=True)
class Spec:
    """A parsed model spec.

    Attributes:
        name: the file stem (``e2b`` for ``cases/models/e2b.toml``).
        description: the spec's one-line description.
        seed: integer seed for :func:`make_weights`.
        config: the ``[config]`` table: kwargs for ``Gemma4TextConfig``.
        init: the ``[init]`` table merged over :data:`INIT_DEFAULTS`.
        path: absolute path of the spec file.
        sha256: hex SHA-256 of the spec file's bytes.
        gates: the ``[gates]`` table: per-gate overrides with reasons (see
            :func:`harness.gates.resolve`); checked when the parity job runs.
        qtypes: the GGUF variants to write (``qtypes = [...]`` in the file; default all of
            :data:`QTYPES`; a large benchmark model may write only ``F32``).
    """

    name: str
    description: str
    seed: int
    config: dict[str, Any]
    init: dict[str, float]
    path: Path
    sha256: str
    gates: dict[str, Any] = field(default_factory=dict)
    qtypes: tuple[str, ...] = QTYPES


@dataclass(frozen=True)
class LayerPlan:
    """Per-layer facts derived once from a config (transformers' rules).

    Attributes:
        index: layer index.
        layer_type: ``"sliding_attention"`` or ``"full_attention"``.
        head_dim: ``head_dim`` (sliding) or ``global_head_dim`` (full).
        n_kv_heads: KV heads of this layer (``num_global_key_value_heads`` on full
            layers only when ``attention_k_eq_v`` is true and it is set).
        kv_shared: the layer reuses a donor's K/V (it has no k/v projections).
        kv_donor: index of the layer whose K/V this layer reads (itself if not shared).
        has_v_proj: the layer has its own ``attn_v`` (false when shared or k_eq_v full).
        ffn_width: dense MLP width (``2 * intermediate_size`` on shared layers when
            ``use_double_wide_mlp``).
    """

    index: int
    layer_type: str
    head_dim: int
    n_kv_heads: int
    kv_shared: bool
    kv_donor: int
    has_v_proj: bool
    ffn_width: int


@dataclass(frozen=True)
class BuiltCase:
    """A built synthetic case on disk.

    Attributes:
        spec: the spec it was built from.
        root: the case directory ``<cache>/<name>-<sha12>/``.
        hf_dir: HF checkpoint directory (``config.json``, ``model.safetensors``).
        gguf: qtype (one of :data:`QTYPES`) -> path of the GGUF file.
    """

    spec: Spec
    root: Path
    hf_dir: Path
    gguf: dict[str, Path] = field(default_factory=dict)


# --------------------------------------------------------------------------- specs


def _spec_fail(path: Path, key: str, what: str) -> SpecError:
    return SpecError(f"{path}: {key}: {what}")


def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and validate one TOML model spec.

    Args:
        path: a ``.toml`` file in the format of the module docstring.

    Returns:
        The :class:`Spec`; ``config`` holds only keys the file states, ``init``
        is merged over :data:`INIT_DEFAULTS` (``output_std`` defaults to
        ``embed_std``).

    Raises:
        SpecError: the file is unreadable, is not valid TOML, misses
            ``description``/``seed``/``[config]``/``[init]`` or a key of
            :data:`REQUIRED_CONFIG_KEYS`, has an unknown config or init key, or
            states an inconsistent layout (``layer_types`` length or last type,
            KV-sharing donors, MoE sizes, head counts). The message is one line:
            ``<file>: <key>: <what was expected>``.
    """
    p = Path(path).resolve()
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec file: {e.strerror or e}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{p}: not valid TOML: {str(e).splitlines()[0]}") from None

    for key, typ in (("description", str), ("seed", int), ("config", dict), ("init", dict)):
        if key not in doc:
            raise _spec_fail(p, key, "missing")
        if not isinstance(doc[key], typ) or isinstance(doc[key], bool):
            raise _spec_fail(p, key, f"expected {typ.__name__}, got {type(doc[key]).__name__}")
    extra = sorted(set(doc) - {"description", "seed", "config", "init", "gates", "qtypes"})
    if extra:
        raise _spec_fail(p, extra[0], "unknown top-level key")
    if doc["seed"] < 0:
        raise _spec_fail(p, "seed", "must be >= 0")
    gates = doc.get("gates", {})
    if not isinstance(gates, dict):
        raise _spec_fail(p, "gates", "expected a table of gate overrides")
    qtypes = doc.get("qtypes", list(QTYPES))
    if not isinstance(qtypes, list) or "F32" not in qtypes or any(q not in QTYPES for q in qtypes):
        raise _spec_fail(p, "qtypes", f"expected a list of GGUF types from {list(QTYPES)} including F32")

    cfg = dict(doc["config"])
    for key in REQUIRED_CONFIG_KEYS:
        if key not in cfg:
            raise _spec_fail(p, f"config.{key}", "missing")
    unknown = sorted(set(cfg) - CONFIG_KEYS)
    if unknown:
        raise _spec_fail(p, f"config.{unknown[0]}", "not a Gemma4TextConfig field")
    _validate_config(p, cfg)

    init = dict(INIT_DEFAULTS)
    for key, val in doc["init"].items():
        if key not in INIT_DEFAULTS:
            raise _spec_fail(p, f"init.{key}", f"unknown init key (known: {', '.join(INIT_DEFAULTS)})")
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise _spec_fail(p, f"init.{key}", "expected a finite number")
        init[key] = float(val)
    if math.isnan(init["output_std"]):
        init["output_std"] = init["embed_std"]
    for key in ("embed_std", "output_std", "ple_embed_std", "linear_gain", "router_std"):
        if init[key] <= 0:
            raise _spec_fail(p, f"init.{key}", "must be > 0")
    for lo in ("norm", "qk_norm", "post_norm", "output_norm", "layer_scalar", "router_scale", "per_expert_scale"):
        if not init[f"{lo}_low"] <= init[f"{lo}_high"]:
            raise _spec_fail(p, f"init.{lo}_low", f"must be <= init.{lo}_high")

    return Spec(
        name=p.stem,
        description=doc["description"],
        seed=int(doc["seed"]),
        config=cfg,
        init=init,
        path=p,
        sha256=hashlib.sha256(raw).hexdigest(),
        gates=gates,
        qtypes=tuple(q for q in QTYPES if q in qtypes),
    )


def _validate_config(p: Path, cfg: dict[str, Any]) -> None:
    def pos_int(key: str, allow_zero: bool = False) -> int:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
            raise _spec_fail(p, f"config.{key}", f"expected an integer {'>= 0' if allow_zero else '> 0'}, got {v!r}")
        return v

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                "sliding_window"):
        pos_int(key)
    n_layers = cfg["num_hidden_layers"]
    pos_int("hidden_size_per_layer_input", allow_zero=True)
    if cfg["hidden_size_per_layer_input"] > 0 and "vocab_size_per_layer_input" not in cfg:
        raise _spec_fail(p, "config.vocab_size_per_layer_input", "missing (required when hidden_size_per_layer_input > 0)")
    if "num_kv_shared_layers" in cfg:
        pos_int("num_kv_shared_layers", allow_zero=True)
    lt = cfg["layer_types"]
    if not isinstance(lt, list) or len(lt) != n_layers or any(t not in (SLIDING, FULL) for t in lt):
        raise _spec_fail(p, "config.layer_types",
                         f"expected a list of {n_layers} entries, each {SLIDING!r} or {FULL!r}")
    if lt[-1] != FULL:
        raise _spec_fail(p, "config.layer_types", "the last layer must be full_attention (transformers forces it)")
    rp = cfg["rope_parameters"]
    if not isinstance(rp, dict):
        raise _spec_fail(p, "config.rope_parameters", "expected a table keyed by layer type")
    for t in set(lt):
        if not isinstance(rp.get(t), dict) or "rope_theta" not in rp[t] or "rope_type" not in rp[t]:
            raise _spec_fail(p, f"config.rope_parameters.{t}", "missing (needs rope_type and rope_theta)")
    n_heads = cfg["num_attention_heads"]
    for key in ("num_key_value_heads", "num_global_key_value_heads"):
        if key in cfg:
            v = pos_int(key)
            if n_heads % v:
                raise _spec_fail(p, f"config.{key}", f"must divide num_attention_heads={n_heads}")
    n_shared = cfg.get("num_kv_shared_layers", 0)
    if n_shared >= n_layers:
        raise _spec_fail(p, "config.num_kv_shared_layers", f"must be < num_hidden_layers={n_layers}")
    if n_shared:
        first = n_layers - n_shared
        if set(lt[first:]) - set(lt[:first]):
            raise _spec_fail(p, "config.num_kv_shared_layers",
                             "a shared layer type has no non-shared donor layer of the same type")
    if cfg.get("enable_moe_block", False):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            pos_int(key)
        if cfg["top_k_experts"] > cfg["num_experts"]:
            raise _spec_fail(p, "config.top_k_experts", "must be <= num_experts")


def builtin_specs() -> list[Path]:
    """The spec files shipped in ``<repo>/cases/models/``, sorted by path.

    Returns:
        Absolute paths of ``*.toml`` files (may be empty).
    """
    return sorted((REPO_ROOT / "cases" / "models").glob("*.toml"))


def layer_plans(config: Mapping[str, Any]) -> list[LayerPlan]:
    """Derive the per-layer table of a spec config, following transformers' Gemma 4 rules.

    Args:
        config: a spec ``[config]`` table (validated by :func:`load_spec`).

    Returns:
        One :class:`LayerPlan` per layer. The KV donor of a shared layer is the
        last non-shared layer of the same type (``Gemma4TextConfig.kv_sharing_modes``).
    """
    n = config["num_hidden_layers"]
    types = list(config["layer_types"])
    n_shared = config.get("num_kv_shared_layers", 0)
    first_shared = n - n_shared
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    n_kv = config["num_key_value_heads"]
    n_kv_global = config.get("num_global_key_value_heads")
    double = bool(config.get("use_double_wide_mlp", False))
    plans = []
    for i, t in enumerate(types):
        full = t == FULL
        shared = i >= first_shared
        donor = i
        if shared:
            donor = max(j for j in range(first_shared) if types[j] == t)
        plans.append(LayerPlan(
            index=i,
            layer_type=t,
            head_dim=config["global_head_dim"] if full else config["head_dim"],
            n_kv_heads=n_kv_global if (full and k_eq_v and n_kv_global is not None) else n_kv,
            kv_shared=shared,
            kv_donor=donor,
            has_v_proj=not shared and not (full and k_eq_v),
            ffn_width=config["intermediate_size"] * (2 if double and shared else 1),
        ))
    return plans


# --------------------------------------------------------------------------- weights


def tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Canonical GGUF tensor names and numpy shapes of a spec's text decoder.

    Args:
        config: a spec ``[config]`` table.

    Returns:
        An ordered dict ``name -> shape`` (numpy orientation: linear ``[out, in]``,
        experts ``[n_expert, out, in]``): global tensors first, then ``blk.0`` ..
        ``blk.N-1``, then ``output_norm`` and (untied only) ``output``. The set
        equals the state dict of transformers' ``Gemma4ForCausalLM`` mapped with
        :func:`reference.names.hf_to_gguf` (tied ``lm_head`` excluded).
        ``rope_freqs`` is not included: it is derived (see :func:`rope_freqs`).
    """
    H = config["hidden_size"]
    V = config["vocab_size"]
    L = config["num_hidden_layers"]
    nq = config["num_attention_heads"]
    P = config.get("hidden_size_per_layer_input", 0)
    moe = bool(config.get("enable_moe_block", False))
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, H)}
    if P:
        shapes["per_layer_token_embd.weight"] = (config["vocab_size_per_layer_input"], L * P)
        shapes["per_layer_model_proj.weight"] = (L * P, H)
        shapes["per_layer_proj_norm.weight"] = (P,)
    for lp in layer_plans(config):
        b = f"blk.{lp.index}."
        hd = lp.head_dim
        s = {
            "attn_norm.weight": (H,),
            "attn_q.weight": (nq * hd, H),
            "attn_q_norm.weight": (hd,),
        }
        if not lp.kv_shared:
            s["attn_k.weight"] = (lp.n_kv_heads * hd, H)
            s["attn_k_norm.weight"] = (hd,)
            if lp.has_v_proj:
                s["attn_v.weight"] = (lp.n_kv_heads * hd, H)
        s["attn_output.weight"] = (H, nq * hd)
        s["post_attention_norm.weight"] = (H,)
        s["ffn_norm.weight"] = (H,)
        s["ffn_gate.weight"] = (lp.ffn_width, H)
        s["ffn_up.weight"] = (lp.ffn_width, H)
        s["ffn_down.weight"] = (H, lp.ffn_width)
        s["post_ffw_norm.weight"] = (H,)
        if moe:
            E = config["num_experts"]
            Im = config["moe_intermediate_size"]
            s["ffn_gate_inp.weight"] = (E, H)
            s["ffn_gate_inp.scale"] = (H,)
            s["ffn_down_exps.scale"] = (E,)
            s["ffn_gate_up_exps.weight"] = (E, 2 * Im, H)
            s["ffn_down_exps.weight"] = (E, H, Im)
            s["pre_ffw_norm_2.weight"] = (H,)
            s["post_ffw_norm_1.weight"] = (H,)
            s["post_ffw_norm_2.weight"] = (H,)
        if P:
            s["inp_gate.weight"] = (P, H)
            s["proj.weight"] = (H, P)
            s["post_norm.weight"] = (H,)
        s["layer_output_scale.weight"] = (1,)
        shapes.update({b + k: v for k, v in s.items()})
    shapes["output_norm.weight"] = (H,)
    if not config.get("tie_word_embeddings", True):
        shapes["output.weight"] = (V, H)
    return shapes


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    key = tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _init_kind(name: str) -> str:
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if name == "token_embd.weight":
        return "embed"
    if name == "output.weight":
        return "output"
    if name == "per_layer_token_embd.weight":
        return "ple_embed"
    if suffix == "layer_output_scale.weight":
        return "layer_scalar"
    if suffix == "ffn_gate_inp.scale":
        return "router_scale"
    if suffix == "ffn_down_exps.scale":
        return "per_expert_scale"
    if suffix == "ffn_gate_inp.weight":
        return "router"
    if suffix in ("attn_q_norm.weight", "attn_k_norm.weight"):
        return "qk_norm"
    if suffix in ("post_attention_norm.weight", "post_ffw_norm.weight", "post_norm.weight"):
        return "post_norm"
    if name == "output_norm.weight":
        return "output_norm"
    if "norm" in suffix:
        return "norm"
    return "linear"


def make_weights(spec: Spec) -> dict[str, np.ndarray]:
    """Draw every weight of the spec's text decoder, deterministically from ``spec.seed``.

    Args:
        spec: a :class:`Spec` from :func:`load_spec`.

    Returns:
        Ordered dict ``canonical GGUF name -> np.ndarray`` (float32, C-contiguous,
        shapes from :func:`tensor_shapes`). Normal weights use the ``[init]`` stds
        (module docstring); every tensor that transformers initialises to 1 (all
        RMSNorm weights, ``layer_output_scale``, router ``scale`` and
        ``per_expert_scale``) is drawn uniform from its ``[init]`` range, so none
        is constant. Same spec (same seed and config) -> bit-identical arrays.
    """
    init = spec.init
    out: dict[str, np.ndarray] = {}
    for name, shape in tensor_shapes(spec.config).items():
        rng = _rng(spec.seed, name)
        kind = _init_kind(name)
        if kind in ("embed", "output", "ple_embed", "router"):
            std = init[{"embed": "embed_std", "output": "output_std",
                        "ple_embed": "ple_embed_std", "router": "router_std"}[kind]]
            arr = rng.standard_normal(shape) * std
        elif kind == "linear":
            arr = rng.standard_normal(shape) * (init["linear_gain"] / math.sqrt(shape[-1]))
        else:
            lo, hi = init[f"{kind}_low"], init[f"{kind}_high"]
            arr = rng.uniform(lo, hi, size=shape)
        out[name] = _round_to_bf16(np.ascontiguousarray(arr, dtype=np.float32))
    return out


def _round_to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), kept as float32. [...] -> [...].

    Real Gemma checkpoints ship in bfloat16, so a bf16 engine reads them without
    re-rounding. Synthetic weights are made bf16-representable for the same reason:
    a bf16 run is then judged on its arithmetic, not on rounding the weights
    (which alone moves these small, sensitive models by a KLD of ~1e-3).
    """
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def rope_freqs(config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs.weight`` for proportional RoPE on full-attention layers.

    Args:
        config: a spec ``[config]`` table.

    Returns:
        float32 ``[global_head_dim // 2]``: 1.0 for the first
        ``int(global_head_dim * partial_rotary_factor / 2)`` frequency pairs and
        1e30 for the rest (a divisor that makes those pairs' rotation angle zero,
        as ``convert_hf_to_gguf.py`` encodes ``rope_type = "proportional"``).
    """
    gd = config["global_head_dim"]
    full_rope = config["rope_parameters"].get(FULL, {})
    factor = float(full_rope.get("partial_rotary_factor", 1.0))
    n_rot = int(gd * factor / 2)
    f = np.full(gd // 2, 1e30, dtype=np.float32)
    f[:n_rot] = 1.0
    return f


# --------------------------------------------------------------------------- HF


def _hf_config(spec: Spec):
    from transformers import Gemma4TextConfig

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
    import torch
    from safetensors import safe_open
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
    for lp in layer_plans(spec.config):
        attn = reloaded.model.layers[lp.index].self_attn
        if attn.head_dim != lp.head_dim or getattr(attn, "is_kv_shared_layer", False) != lp.kv_shared:
            raise RuntimeError(f"{spec.name}: layer {lp.index} reloaded with head_dim {attn.head_dim}, "
                               f"expected {lp.head_dim}")
    return out


def _check_state(name: str, when: str, state: Mapping[str, Any], expected: Mapping[str, np.ndarray]) -> None:
    if set(state) != set(expected):
        raise RuntimeError(f"{name}: {when}: state dict keys differ from the weights")
    for k, arr in expected.items():
        got = state[k].detach().cpu().numpy()
        if got.dtype != np.float32 or got.shape != arr.shape or not np.array_equal(got, arr):
            raise RuntimeError(f"{name}: {when}: tensor {k} does not hold the synthetic weights")


# --------------------------------------------------------------------------- GGUF


def _gguf_qtype(qtype: str):
    import gguf

    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r} not supported; expected one of {', '.join(QTYPES)}")
    return gguf.GGMLQuantizationType[qtype]


def gguf_tensor_type(name: str, shape: Sequence[int], qtype: str) -> str:
    """The GGML type :func:`write_gguf` stores a tensor in.

    Args:
        name: canonical tensor name (unused today; kept so a per-tensor rule
            can be added without changing callers).
        shape: numpy shape of the tensor.
        qtype: the file type requested, one of :data:`QTYPES`.

    Returns:
        ``"F32"`` for 1-D tensors (norms, scales, ``rope_freqs``,
        ``layer_output_scale``); ``"F16"`` for a matrix whose row length is not a
        multiple of the quant block size (llama.cpp's converter falls back to F16
        the same way); ``qtype`` otherwise.
    """
    import gguf

    if len(shape) < 2 or qtype == "F32":
        return "F32"
    block = gguf.GGML_QUANT_SIZES[_gguf_qtype(qtype)][0]
    if shape[-1] % block:
        return "F16"
    return qtype


def _vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    n_fill = vocab_size - len(tokens)
    if n_fill < 0:
        raise ValueError(f"vocab_size {vocab_size} < {len(tokens)} (4 specials + 256 byte tokens)")
    tokens += [f"\u2581t{i}" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.NORMAL] * n_fill
    scores = [0.0] * (BYTE_BASE + 256) + [-float(i) for i in range(1, n_fill + 1)]
    return tokens, scores, [int(t) for t in types]


def gguf_metadata(spec: Spec) -> dict[str, tuple[Any, str, str | None]]:
    """The model keys :func:`write_gguf` writes (tokenizer keys excluded).

    Args:
        spec: the spec.

    Returns:
        Ordered dict ``key -> (value, GGUFValueType name, array sub-type name or
        None)``, following llama.cpp ``convert_hf_to_gguf.py``
        (``TextModel``/``Gemma3Model``/``Gemma4Model.set_gguf_parameters``):
        per-layer arrays are UINT32 (``feed_forward_length`` when
        ``use_double_wide_mlp``, ``attention.head_count_kv`` when ``attention_k_eq_v``
        with ``num_global_key_value_heads``) and BOOL
        (``attention.sliding_window_pattern``, true = sliding layer).
    """
    c = spec.config
    a = "gemma4"
    plans = layer_plans(c)
    rp = c["rope_parameters"]
    md: dict[str, tuple[Any, str, str | None]] = {}
    md["general.name"] = (spec.name, "STRING", None)
    md["general.file_type"] = (0, "UINT32", None)  # replaced per qtype in write_gguf
    md[f"{a}.context_length"] = (int(c.get("max_position_embeddings", 131072)), "UINT32", None)
    md[f"{a}.embedding_length"] = (c["hidden_size"], "UINT32", None)
    md[f"{a}.block_count"] = (c["num_hidden_layers"], "UINT32", None)
    if c.get("use_double_wide_mlp", False):
        md[f"{a}.feed_forward_length"] = ([lp.ffn_width for lp in plans], "ARRAY", "UINT32")
    else:
        md[f"{a}.feed_forward_length"] = (c["intermediate_size"], "UINT32", None)
    md[f"{a}.attention.head_count"] = (c["num_attention_heads"], "UINT32", None)
    if c.get("attention_k_eq_v", False) and c.get("num_global_key_value_heads") is not None:
        md[f"{a}.attention.head_count_kv"] = ([lp.n_kv_heads for lp in plans], "ARRAY", "UINT32")
    else:
        md[f"{a}.attention.head_count_kv"] = (c["num_key_value_heads"], "UINT32", None)
    md[f"{a}.attention.key_length"] = (c["global_head_dim"], "UINT32", None)
    md[f"{a}.attention.value_length"] = (c["global_head_dim"], "UINT32", None)
    md[f"{a}.attention.key_length_swa"] = (c["head_dim"], "UINT32", None)
    md[f"{a}.attention.value_length_swa"] = (c["head_dim"], "UINT32", None)
    md[f"{a}.attention.layer_norm_rms_epsilon"] = (float(c.get("rms_norm_eps", 1e-6)), "FLOAT32", None)
    md[f"{a}.attention.sliding_window"] = (c["sliding_window"], "UINT32", None)
    md[f"{a}.attention.sliding_window_pattern"] = ([lp.layer_type == SLIDING for lp in plans], "ARRAY", "BOOL")
    md[f"{a}.attention.shared_kv_layers"] = (int(c.get("num_kv_shared_layers", 0)), "UINT32", None)
    md[f"{a}.embedding_length_per_layer_input"] = (int(c["hidden_size_per_layer_input"]), "UINT32", None)
    md[f"{a}.rope.freq_base"] = (float(rp.get(FULL, rp.get(SLIDING))["rope_theta"]), "FLOAT32", None)
    md[f"{a}.rope.freq_base_swa"] = (float(rp.get(SLIDING, rp.get(FULL))["rope_theta"]), "FLOAT32", None)
    md[f"{a}.rope.dimension_count"] = (c["global_head_dim"], "UINT32", None)
    md[f"{a}.rope.dimension_count_swa"] = (c["head_dim"], "UINT32", None)
    if c.get("final_logit_softcapping") is not None:
        md[f"{a}.final_logit_softcapping"] = (float(c["final_logit_softcapping"]), "FLOAT32", None)
    if c.get("enable_moe_block", False):
        md[f"{a}.expert_count"] = (c["num_experts"], "UINT32", None)
        md[f"{a}.expert_used_count"] = (c["top_k_experts"], "UINT32", None)
        md[f"{a}.expert_feed_forward_length"] = (c["moe_intermediate_size"], "UINT32", None)
    return md


def write_gguf(spec: Spec, weights: Mapping[str, np.ndarray], path: str | os.PathLike[str], qtype: str = "F32") -> Path:
    """Write a ``gemma4`` GGUF file with llama.cpp's tensor names and keys.

    Keys: see :func:`gguf_metadata`, plus ``general.architecture = "gemma4"``,
    ``general.file_type``, ``general.quantization_version`` and a minimal
    SentencePiece-style vocabulary (``tokenizer.ggml.model = "llama"``: ``<pad>``,
    ``<eos>``, ``<bos>``, ``<unk>`` (ids 0-3), byte tokens ``<0x00>``..``<0xFF>``
    (ids 4-259, type BYTE), filler pieces ``▁t<id>`` up to ``vocab_size``, with
    scores, token types, special ids and ``add_bos_token = true``).

    Tensors: ``rope_freqs.weight`` (see :func:`rope_freqs`), then ``weights`` in
    their order; a tied head has no ``output.weight``. Types per
    :func:`gguf_tensor_type`; data goes through ``gguf.quants.quantize``. The file
    is written beside ``path`` and renamed into place, then read back with
    ``gguf.GGUFReader``: every tensor must have its shape, its type, and dequantize
    to exactly ``dequantize(quantize(x))`` (bit-exact ``x`` for F32).

    Args:
        spec: the spec.
        weights: canonical name -> float32 array, as from :func:`make_weights`.
        path: output file.
        qtype: one of :data:`QTYPES`.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: unknown ``qtype``; ``vocab_size`` < 260.
        RuntimeError: the read-back check fails.
    """
    import gguf
    from gguf import GGUFValueType as VT

    _gguf_qtype(qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    tensors: dict[str, np.ndarray] = {"rope_freqs.weight": rope_freqs(spec.config)}
    tensors.update(weights)
    if spec.config.get("tie_word_embeddings", True):
        tensors.pop("output.weight", None)
    tokens, scores, ttypes = _vocab(spec.config["vocab_size"])

    w = gguf.GGUFWriter(str(tmp), "gemma4")
    try:
        for key, (val, vtype, sub) in gguf_metadata(spec).items():
            if key == "general.file_type":
                val = _FILE_TYPES[qtype]
            w.add_key_value(key, val, VT[vtype], sub_type=VT[sub] if sub else None)
        w.add_key_value("general.quantization_version", gguf.GGML_QUANT_VERSION, VT.UINT32)
        w.add_key_value("tokenizer.ggml.model", "llama", VT.STRING)
        w.add_key_value("tokenizer.ggml.tokens", tokens, VT.ARRAY, sub_type=VT.STRING)
        w.add_key_value("tokenizer.ggml.scores", scores, VT.ARRAY, sub_type=VT.FLOAT32)
        w.add_key_value("tokenizer.ggml.token_type", ttypes, VT.ARRAY, sub_type=VT.INT32)
        w.add_key_value("tokenizer.ggml.bos_token_id", BOS_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.eos_token_id", EOS_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.unknown_token_id", UNK_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.padding_token_id", PAD_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.add_bos_token", True, VT.BOOL)
        w.add_key_value("tokenizer.ggml.add_eos_token", False, VT.BOOL)

        expected: dict[str, tuple[str, np.ndarray]] = {}
        for name, arr in tensors.items():
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            tname = gguf_tensor_type(name, arr.shape, qtype)
            ttype = gguf.GGMLQuantizationType[tname]
            if tname == "F32":
                w.add_tensor(name, arr)
                expected[name] = (tname, arr)
                continue
            data = gguf.quants.quantize(arr, ttype)
            # F16 comes back as a float16 array (numpy shape); BF16 and Q* as uint8
            # with the row length in bytes, which add_tensor turns back into elements.
            w.add_tensor(name, data, raw_dtype=ttype)
            expected[name] = (tname, gguf.quants.dequantize(data, ttype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    try:
        _verify_gguf(tmp, expected, spec.name, qtype)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _verify_gguf(path: Path, expected: Mapping[str, tuple[str, np.ndarray]], name: str, qtype: str) -> None:
    import gguf

    reader = gguf.GGUFReader(str(path))
    got = {t.name: t for t in reader.tensors}
    if set(got) != set(expected):
        raise RuntimeError(f"{name} {qtype}: GGUF tensor set differs: missing {sorted(set(expected) - set(got))[:5]}, "
                           f"unexpected {sorted(set(got) - set(expected))[:5]}")
    for tname, (ttype, ref) in expected.items():
        t = got[tname]
        if t.tensor_type.name != ttype:
            raise RuntimeError(f"{name} {qtype}: {tname}: type {t.tensor_type.name}, expected {ttype}")
        if tuple(int(x) for x in t.shape[::-1]) != ref.shape:
            raise RuntimeError(f"{name} {qtype}: {tname}: ne {list(t.shape)} does not match numpy shape {ref.shape}")
        back = gguf.quants.dequantize(t.data, t.tensor_type)
        if back.shape != ref.shape or back.dtype != np.float32:
            back = back.reshape(ref.shape) if back.size == ref.size else back
        if back.shape != ref.shape or not np.array_equal(back.view(np.uint32), ref.view(np.uint32)):
            raise RuntimeError(f"{name} {qtype}: {tname}: data read back differs from what was written")
    del reader


# --------------------------------------------------------------------------- cache


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("G4H_CACHE")
    if env:
        return Path(env) / "synth"
    return REPO_ROOT / ".g4h-cache" / "synth"


def case_key(spec: Spec) -> str:
    """Cache directory name of a spec: ``<name>-<sha12>``.

    ``sha12`` is the first 12 hex digits of SHA-256 over :data:`BUILDER_VERSION`
    and the spec file's SHA-256, so editing the spec or the builder starts a new
    case directory.
    """
    h = hashlib.sha256(f"{BUILDER_VERSION}\n{spec.sha256}\n".encode()).hexdigest()
    return f"{spec.name}-{h[:12]}"


def _built_case(spec: Spec, root: Path) -> BuiltCase:
    return BuiltCase(spec=spec, root=root, hf_dir=root / "hf",
                     gguf={q: root / f"{spec.name}-{q}.gguf" for q in spec.qtypes})


def _versions() -> dict[str, str]:
    import gguf  # noqa: F401
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("numpy", "torch", "transformers", "gguf", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:  # pragma: no cover
            out[pkg] = "?"
    return out


def build_case(spec: Spec, out_dir: str | os.PathLike[str]) -> BuiltCase:
    """Build one case into ``out_dir`` (no caching, no atomic rename).

    Writes ``spec.toml`` (a byte copy of the spec), ``hf/`` (:func:`write_hf`),
    ``<name>-<QTYPE>.gguf`` for every qtype in :data:`QTYPES`
    (:func:`write_gguf`) and, last, ``manifest.json`` (builder version, spec
    sha256, file sha256s, package versions, build seconds).

    Raises:
        RuntimeError: a writer's self-check failed, or the spec file no longer
            has ``spec.sha256``.
    """
    t0 = time.perf_counter()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    raw = spec.path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != spec.sha256:
        raise RuntimeError(f"{spec.path}: spec file changed since it was loaded")
    (root / "spec.toml").write_bytes(raw)
    weights = make_weights(spec)
    case = _built_case(spec, root)
    write_hf(spec, weights, case.hf_dir)
    for q, p in case.gguf.items():
        write_gguf(spec, weights, p, q)
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    manifest = {
        "builder_version": BUILDER_VERSION,
        "name": spec.name,
        "spec_sha256": spec.sha256,
        "seed": spec.seed,
        "n_tensors": len(weights),
        "files": files,
        "versions": _versions(),
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return case


def ensure_built(spec_or_path: Spec | str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> BuiltCase:
    """Return the built case of a spec, building it on a cache miss.

    The case lives in ``<root>/<name>-<sha12>/`` (:func:`case_key`) where
    ``<root>`` is ``cache_dir`` if given, else ``$G4H_CACHE/synth`` if that
    variable is set, else ``<repo>/.g4h-cache/synth``. A case directory counts as
    built when its ``manifest.json`` exists. A miss builds into a fresh
    ``.tmp-*`` directory beside it and renames that into place in one step, so an
    interrupted or concurrent build never leaves a partial case under the final
    name; when two builders race, the loser discards its copy and uses the
    winner's.

    Args:
        spec_or_path: a :class:`Spec` or a spec file path.
        cache_dir: override of the cache root (see above).

    Returns:
        The :class:`BuiltCase` (HF dir and one GGUF per :data:`QTYPES`).

    Raises:
        SpecError: the spec file is invalid.
        RuntimeError: a writer's self-check failed.
    """
    spec = spec_or_path if isinstance(spec_or_path, Spec) else load_spec(spec_or_path)
    root = _cache_root(cache_dir)
    final = root / case_key(spec)
    if (final / "manifest.json").is_file():
        return _built_case(spec, final)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(root, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        build_case(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():
                # A directory without a manifest under the final name is not ours to
                # keep (it cannot come from this builder); replace it.
                if final.exists():
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _built_case(spec, final)


def _clean_stale_tmp(root: Path, key: str, max_age_s: float = 3600.0) -> None:
    now = time.time()
    for p in root.glob(f".tmp-{key}-*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------- prompts / checks


def prompts_path() -> Path:
    """Path of the committed synthetic prompt set, ``<repo>/cases/prompts/synthetic.jsonl``."""
    return REPO_ROOT / "cases" / "prompts" / "synthetic.jsonl"


#: (id, length, note) of the synthetic prompts; lengths are relative to sliding_window = 16.
PROMPT_LAYOUT: tuple[tuple[str, int, str], ...] = (
    ("len1-bos", 1, "BOS only"),
    ("len5", 5, "short"),
    ("len15-window-1", 15, "sliding_window - 1"),
    ("len16-window", 16, "exactly sliding_window"),
    ("len17-window+1", 17, "sliding_window + 1: first position whose window drops a key"),
    ("len32-2xwindow", 32, "2 x sliding_window"),
    ("len48-3xwindow", 48, "3 x sliding_window"),
    ("len83-5xwindow+3", 83, "5 x sliding_window + 3"),
)
PROMPT_SEED = 20260401


def make_prompts(seed: int = PROMPT_SEED) -> list[dict[str, Any]]:
    """Generate the synthetic prompt set (what ``cases/prompts/synthetic.jsonl`` holds).

    Args:
        seed: numpy ``default_rng`` seed.

    Returns:
        One dict per :data:`PROMPT_LAYOUT` entry: ``id``, ``prompt_ids`` (BOS id 2,
        then ids uniform in [4, 256): byte tokens, valid in every spec's
        vocabulary), ``note``.
    """
    rng = np.random.default_rng(seed)
    out = []
    for pid, n, note in PROMPT_LAYOUT:
        ids = [BOS_ID] + [int(x) for x in rng.integers(BYTE_BASE, 256, size=n - 1)]
        out.append({"id": pid, "prompt_ids": ids, "note": note})
    return out


def load_prompts(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Read a prompt JSONL file (default :func:`prompts_path`).

    Returns:
        The records, each with at least ``id`` (str) and ``prompt_ids`` (list of int).

    Raises:
        ValueError: a line is not JSON or lacks ``id``/``prompt_ids`` (message names
            the file and line).
    """
    p = Path(path) if path is not None else prompts_path()
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not JSON: {e.msg}") from None
        if not isinstance(rec.get("id"), str) or not isinstance(rec.get("prompt_ids"), list):
            raise ValueError(f"{p}:{i}: expected keys id (str) and prompt_ids (list)")
        out.append(rec)
    return out


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
    import torch
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


# --------------------------------------------------------------------------- CLI


def _resolve_spec_arg(arg: str) -> Path:
    p = Path(arg)
    if p.suffix == ".toml" or p.exists():
        return p
    cand = REPO_ROOT / "cases" / "models" / f"{arg}.toml"
    return cand if cand.exists() else p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.synth [--out DIR] [--stats] [spec ...]``: build cases and print their paths.

    A spec is a path or the stem of a builtin spec (``e2b``); none means all
    builtin specs. ``--out`` is the cache root (default as in :func:`ensure_built`).
    ``--stats`` also prints :func:`logit_stats` over the synthetic prompts.
    Returns the exit status (2 on a spec error, 1 on a build error).
    """
    ap = argparse.ArgumentParser(prog="python -m harness.synth", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="cache root (default: $G4H_CACHE/synth or <repo>/.g4h-cache/synth)")
    ap.add_argument("--stats", action="store_true", help="print logit magnitude / margin statistics")
    ap.add_argument("specs", nargs="*", help="spec files or builtin names (default: all builtin)")
    args = ap.parse_args(argv)
    try:  # progress bars of save_pretrained / from_pretrained would drown the paths
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    paths = [_resolve_spec_arg(s) for s in args.specs] or builtin_specs()
    status = 0
    prompts = [r["prompt_ids"] for r in load_prompts()] if args.stats else []
    for p in paths:
        t0 = time.perf_counter()
        try:
            case = ensure_built(p, args.out)
        except SpecError as e:
            print(f"error: {e}", file=sys.stderr)
            status = max(status, 2)
            continue
        except (RuntimeError, ValueError, OSError) as e:
            print(f"error: {p}: build failed: {e}", file=sys.stderr)
            status = max(status, 1)
            continue
        dt = time.perf_counter() - t0
        print(f"{case.spec.name}: {case.root} ({dt:.2f}s)")
        print(f"  hf: {case.hf_dir}")
        for q, g in case.gguf.items():
            print(f"  {q}: {g}")
        if args.stats:
            s = logit_stats(case.hf_dir, prompts)
            print("  stats: " + ", ".join(f"{k}={v:.4g}" for k, v in s.items()))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
