"""Synthetic model specs (``cases/models/*.toml``): the format, the parser, and the per-layer table.

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

import hashlib
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.config_hf import config_from_hf
from gemma4_harness.reference.errors import InputError

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


class SpecError(InputError, ValueError):
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
            :func:`harness.core.gates.resolve`); checked when the parity job runs.
        qtypes: the GGUF variants to write (``qtypes = [...]`` in the file; default all of
            :data:`QTYPES`; a large benchmark model may write only ``F32``).
        extra: the further top-level tables a caller allowed (``load_spec(..., extra=...)``: the
            multimodal specs' ``[vision]``, ``[audio]`` ...), as read.
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
    extra: dict[str, Any] = field(default_factory=dict)


def _spec_fail(path: Path, key: str, what: str) -> SpecError:
    return SpecError(f"{path}: {key}: {what}")


def load_spec(path: str | os.PathLike[str], extra: tuple[str, ...] = ()) -> Spec:
    """Read and validate one TOML model spec.

    Args:
        path: a ``.toml`` file in the format of the module docstring.
        extra: further top-level keys this caller reads itself (kept in :attr:`Spec.extra`, unchecked here).

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
    unknown_keys = sorted(set(doc) - {"description", "seed", "config", "init", "gates", "qtypes", *extra})
    if unknown_keys:
        raise _spec_fail(p, unknown_keys[0], "unknown top-level key")
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
        extra={k: doc[k] for k in extra if k in doc},
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


def text_config(spec: Spec) -> ModelConfig:
    """The spec's model config with its per-layer table, derived by :func:`reference.config_hf.config_from_hf`.

    This is the one derivation of the per-layer facts (layer type, head_dim, KV heads, donor, FFN
    width, V projection) that every engine reads; the weight and GGUF writers read it too, so a spec
    cannot be written with a layout the engines would derive differently.

    Raises:
        ConfigError: the spec's ``[config]`` is not a valid Gemma 4 text config (the field is named).
    """
    raw = dict(spec.config)
    raw.setdefault("model_type", "gemma4_text")
    return config_from_hf(raw, str(spec.path))
