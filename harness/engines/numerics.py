"""What an engine declares about its numerics, and what the reference emulates of it.

An engine under test computes in some precision and may make known approximations; the harness compares it with
the float64 reference, so it must know them to tell a rounding from a fault. A :class:`Numerics` holds the
declaration:

* ``dtype``: what the engine computes in (``float64``, ``float32``, ``bfloat16``, ``float16``); a 16-bit engine
  gets the 16-bit gates (``reference~<kind>_bf16``).
* ``kv_cache``: what its KV cache stores (``float32``, ``float16``, ``bfloat16``; None: the compute dtype).
* ``approximations``: known deliberate approximations, from :data:`APPROXIMATIONS`.

Where it comes from (:attr:`Numerics.source`): a ``cmd:`` engine's ``hello`` reply (``docs/engine-protocol.md``),
a server dialect's defaults (:data:`DIALECT_NUMERICS`: what ``llama-server`` and llama-cpp-python's server do
when started as users start them), ``g4h parity --declare KEY=VALUE`` over those (:func:`declare`), or a built-in
engine's own settings (:data:`KIND_NUMERICS`).

What the harness does with it (``harness/parity/checks/pair.py``): the reference makes every approximation it can
emulate (:meth:`Numerics.emulation`, :func:`emulate`: llama.cpp's fp16 GELU table, a 16-bit KV cache, llama.cpp's
fp16 attention operands and its CPU flash attention), and every figure is gated at ``max(fp32 bound,
2 x effect)``, where the *effect* is how far the declared approximations move that figure on this model (the
reference with them against the reference without them): see ``harness/core/gates.py``, :data:`EFFECT_FACTOR`.
An engine that declares nothing is held to the fp32 bounds. ``quantized_activations`` is emulated too (llama.cpp's
activation rounding, bit for bit: ``reference/activation_quants.py``) where the engine names its dot-product types
(``vec_dot_types``); on a file with quantized or 16-bit matrices its pair is then judged by the ``<pair>_q8`` gates,
not by the effect (docs/quantized-activations.md). The fast oracle (``g4h parity --oracle fast``) makes every one of
:data:`EMULATED` too: the GELU table and the attention by the fast twins that :func:`emulate` swaps into
:mod:`fast.model`, ``quantized_activations`` by computing as its ``--compute q8`` does (``fast_q8`` of
:func:`emulate`; docs/quantized-activations.md, "The fast oracle").
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterable, Mapping

from gemma4_harness.reference.activation_quants import VEC_DOT_TYPE
from gemma4_harness.reference.errors import InputError

from ..core.engine_kinds import KINDS

DTYPES = ("float64", "float32", "bfloat16", "float16")
"""What an engine may say it computes in."""

KV_CACHE_TYPES = ("float64", "float32", "float16", "bfloat16")
"""What an engine may say its KV cache stores (emulated: the cache's values are rounded to that type)."""

APPROXIMATIONS: dict[str, str] = {
    "gelu_fp16_table": "GELU read from a table over every fp16 input (llama.cpp's CPU backend, GGML_GELU_FP16): "
                       "emulated with ggml's own table",
    "quantized_activations": "the activations of a matrix product with quantized or 16-bit weights are rounded to "
                             "the weights' dot-product type first (llama.cpp: Q8_0, Q8_1, Q8_K, F16, BF16); emulated "
                             "with llama.cpp's own table and rounding (reference/activation_quants.py; the fast "
                             "oracle: its --compute q8, fast/q8_compute.py) where the engine's dot-product types are "
                             "llama.cpp's (vec_dot_types) and every type of the file is in that table",
    "attn_fp16_operands": "with a 16-bit KV cache, the query and the softmax weights are rounded to the cache type "
                          "before their products with K and V (llama.cpp without flash attention: ggml_mul_mat "
                          "converts its f32 operand to the F16 cache's vec_dot type on x86); emulated",
    "flash_attn_fp16": "llama.cpp's CPU flash attention: K and V in fp16 (an F32 cache is cast), and for calls of "
                       "fewer than 64 query rows (every decode step) the query in fp16 and the output accumulated in "
                       "fp16 key by key; emulated in key order",
}
"""Known approximations an engine may declare, and what the harness does with each."""

EMULATED = ("gelu_fp16_table", "quantized_activations", "attn_fp16_operands", "flash_attn_fp16")
"""The approximations the reference makes too (:func:`emulate`)."""


@dataclass(frozen=True)
class Numerics:
    """An engine's declared numerics (see the module docstring).

    Attributes:
        dtype: compute dtype (:data:`DTYPES`).
        kv_cache: KV cache storage type (:data:`KV_CACHE_TYPES`), or None for the compute dtype.
        approximations: names from :data:`APPROXIMATIONS`, in declaration order.
        source: where the declaration came from, for the report (``hello``, ``llama-server defaults``,
            ``--declare``...).
        vec_dot_types: with ``quantized_activations``, whose dot-product types the engine rounds to: ``llama.cpp``
            (:data:`reference.activation_quants.VEC_DOT_TYPE`, llama.cpp's CPU backend), or None when it did not
            say (then the rounding cannot be emulated: see ``harness/parity/checks/quantized.py``).
    """

    dtype: str = "float32"
    kv_cache: str | None = None
    approximations: tuple[str, ...] = ()
    source: str = ""
    vec_dot_types: str | None = None

    @property
    def kv(self) -> str:
        """The KV cache type in effect (the compute dtype when none was declared)."""
        return self.kv_cache or self.dtype

    @property
    def sixteen_bit(self) -> bool:
        """Whether the engine computes in 16 bits (then the 16-bit gates judge it)."""
        return self.dtype in ("bfloat16", "float16")

    def emulation(self) -> tuple[str, ...]:
        """What the reference makes too, as a hashable key (the reference's shared outputs are kept per key):
        ``gelu_fp16_table``; ``quantized_activations`` when the engine's dot-product types are known
        (:data:`VEC_DOT_TABLES`); the attention as one of ``flash_attn_fp16``, ``kv_cache=<type>`` with or without
        ``attn_fp16_operands``; empty for a 16-bit engine (its rounding is everywhere, the 16-bit gates judge it)."""
        if self.sixteen_bit:
            return ()
        out = [a for a in ("gelu_fp16_table",) if a in self.approximations]
        if "quantized_activations" in self.approximations and self.vec_dot_types in VEC_DOT_TABLES:
            out.append("quantized_activations")
        if "flash_attn_fp16" in self.approximations:
            out.append("flash_attn_fp16")
        elif self.kv in ("float16", "bfloat16"):
            out.append(f"kv_cache={self.kv}")
            if "attn_fp16_operands" in self.approximations:
                out.append("attn_fp16_operands")
        return tuple(out)

    def describe(self) -> str:
        """One line for the report: ``float32, KV cache float16, approximations: a, b (llama-server defaults)``."""
        parts = [self.dtype, f"KV cache {self.kv}"]
        parts.append("approximations: " + (", ".join(self.approximations) if self.approximations else "none"))
        return ", ".join(parts) + (f" ({self.source})" if self.source else "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for ``results.json``."""
        return {"dtype": self.dtype, "kv_cache": self.kv, "approximations": list(self.approximations),
                "emulated": list(self.emulation()), "source": self.source,
                **({"vec_dot_types": self.vec_dot_types} if "quantized_activations" in self.approximations else {})}


_LLAMACPP = ("gelu_fp16_table", "quantized_activations")

VEC_DOT_TABLES = ("llama.cpp",)
"""The dot-product tables an engine may name in ``vec_dot_types`` (``hello``, ``--declare``): ``llama.cpp``, the
CPU backend's ``type_traits_cpu`` (:data:`reference.activation_quants.VEC_DOT_TYPE`)."""

DIALECT_NUMERICS: dict[str, Numerics] = {
    # llama-server (tools/server, common/arg.cpp): --cache-type-k/-v f16, --flash-attn auto, which resolves to
    # enabled on the CPU (llama_context's resolve_fused_ops: "Flash Attention enabled").
    "llama-server": Numerics("float32", "float16", (*_LLAMACPP, "flash_attn_fp16"),
                             "llama-server defaults: KV cache f16, flash attention auto (on for the CPU)",
                             "llama.cpp"),
    # llama-cpp-python's server (llama_cpp/server/settings.py): type_k/type_v None (llama.cpp's f16), flash_attn
    # False.
    "llama-cpp-python": Numerics("float32", "float16", (*_LLAMACPP, "attn_fp16_operands"),
                                 "llama-cpp-python server defaults: KV cache f16, flash attention off", "llama.cpp"),
    # vLLM: --dtype auto takes the checkpoint's torch_dtype, bfloat16 for Gemma checkpoints.
    "vllm": Numerics("bfloat16", None, (), "vLLM default: dtype auto (bfloat16 for Gemma checkpoints)"),
    # any other OpenAI-compatible server (transformers serve: --dtype auto keeps an fp32 checkpoint in fp32): nothing
    # is known of it, so nothing is emulated; --declare states what it computes.
    "openai": Numerics("float32", None, (), "generic OpenAI server: nothing declared (fp32 assumed)"),
}
"""What a server of each dialect computes when started with its defaults (``--declare`` changes it)."""

KIND_NUMERICS: dict[str, Numerics] = {k.name: Numerics(*k.numerics) for k in KINDS if k.numerics is not None}
"""The numerics of the built-in engine kinds that make approximations (their registry rows' ``numerics``,
:data:`harness.core.engine_kinds.KINDS`: ``llamacpp``, F32 KV cache, flash attention off)."""


EXACT_TYPES = frozenset({"F32", "F64", "float32", "float64"})
"""Stored matrix types whose products no engine rounds the activations of (``quantized_activations`` acts on the
others)."""


def engine_numerics(eng: Any, kind: str) -> Numerics:
    """What the engine computes: its own declaration (``eng.numerics``: a ``cmd:`` engine's ``hello``, a server's
    dialect defaults or ``--declare``), else its kind's (:data:`KIND_NUMERICS`), else its ``dtype`` with no
    approximations. Read by ``g4h parity`` (``harness/parity/checks/pair.py``) and ``g4h sweep``
    (``harness/sweep/tasks.py``) alike."""
    own = getattr(eng, "numerics", None)
    if isinstance(own, Numerics):
        return own
    if kind in KIND_NUMERICS:
        return KIND_NUMERICS[kind]
    dtype = str(getattr(eng, "dtype", None) or "float32").replace("torch.", "")
    return Numerics(dtype if dtype in DTYPES else "float32")


def effective(approx: Iterable[str], types: Iterable[str]) -> tuple[str, ...]:
    """The emulation key ``approx`` (:meth:`Numerics.emulation`) as it acts on a model whose matrices are stored as
    ``types``: ``quantized_activations`` rounds the inputs of quantized and 16-bit matrices only, so on a file with
    none (every matrix in :data:`EXACT_TYPES`: an F32 file) it is left out (kept, it would change nothing but the
    RMSNorms, llama.cpp's float32 steps, whose fp32 roundings move the other emulations' roundings off the ones they
    were judged with: ``harness/parity/checks/reference_runs.py``, ``ReferenceRuns.effective``)."""
    approx = tuple(approx)
    if "quantized_activations" in approx and not set(types) - EXACT_TYPES:
        return tuple(a for a in approx if a != "quantized_activations")
    return approx


def key_name(key: Iterable[str]) -> str:
    """An emulation key as one string (``gelu_fp16_table+kv_cache=float16``; ``exact`` for none), for JSON."""
    return "+".join(key) or "exact"


def emulable_types(types) -> list[str]:
    """Of the GGML weight types ``types``, those llama.cpp's table (:data:`reference.activation_quants.VEC_DOT_TYPE`)
    does not hold: :func:`harness.engines.llamacpp.numerics.linear_input_quantized` cannot emulate them. Sorted."""
    return sorted(t for t in set(types) if t not in VEC_DOT_TYPE)


def parse_declare(items: Iterable[str]) -> dict[str, Any]:
    """``--declare KEY=VALUE`` options -> ``{"dtype": ..., "kv_cache": ..., "approximations": [...]}`` (only the keys
    given). ``approximations`` takes a comma list, or ``none``; ``kv_cache`` takes ``f16``/``f32``/``bf16`` as
    llama.cpp spells them too.

    Raises:
        InputError: not ``KEY=VALUE``, an unknown key or value (one line naming it).
    """
    out: dict[str, Any] = {}
    spell = {"f16": "float16", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    for item in items:
        key, sep, value = str(item).partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise InputError(f"--declare {item!r}: expected KEY=VALUE (dtype=, kv_cache=, approximations=)")
        if key in ("dtype", "kv_cache"):
            value = spell.get(value, value)
            allowed = DTYPES if key == "dtype" else KV_CACHE_TYPES
            if value not in allowed:
                raise InputError(f"--declare {key}={value}: expected one of {', '.join(allowed)}")
            out[key] = value
        elif key == "approximations":
            names = [] if value == "none" else [v.strip() for v in value.split(",") if v.strip()]
            bad = [n for n in names if n not in APPROXIMATIONS]
            if bad:
                raise InputError(f"--declare approximations={value}: unknown {bad[0]!r} (known: "
                                 f"{', '.join(APPROXIMATIONS)}, or none)")
            out[key] = names
        elif key == "vec_dot_types":
            if value not in (*VEC_DOT_TABLES, "none"):
                raise InputError(f"--declare vec_dot_types={value}: expected one of {', '.join(VEC_DOT_TABLES)}, "
                                 "or none")
            out[key] = None if value == "none" else value
        else:
            raise InputError(f"--declare {key}: unknown key (known: dtype, kv_cache, approximations, vec_dot_types)")
    return out


def declare(base: Numerics, overrides: Mapping[str, Any] | None) -> Numerics:
    """``base`` with the keys of ``overrides`` (:func:`parse_declare`) replaced; the source says so."""
    if not overrides:
        return base
    changed = {k: (tuple(v) if k == "approximations" else v) for k, v in overrides.items()}
    said = ", ".join(f"{k}={','.join(v) or 'none' if k == 'approximations' else v}" for k, v in overrides.items())
    return replace(base, **changed, source=f"--declare {said}" + (f" over {base.source}" if base.source else ""))


def emulate(key: Iterable[str], fast_q8: Callable[[], ContextManager] | None = None,
            jitter_rng: Any = None) -> ContextManager:
    """The reference (and the fast twin, for the GELU table and the attention) under the emulations of ``key``
    (:meth:`Numerics.emulation`), nested; unknown names are ignored. ``fast_q8``: with ``quantized_activations`` in
    ``key``, the context in which a fast engine computes as llama.cpp (``FastEngine.computing("q8")``,
    :mod:`fast.q8_compute`: ``g4h parity --oracle fast``), entered beside the reference's emulation and before the
    jitters, which then perturb its products' inputs too. ``jitter_rng``: the ``numpy.random.Generator`` the
    ``jitter_sums`` null draws from (one stream across many entries: a chain of :func:`reference.batch.forward_chains`,
    :func:`harness.engines.llamacpp.numerics.jitter_sums_numerics`); None: a fresh stream of seed 0 per entry."""
    emulations = importlib.import_module(f"{__package__}.llamacpp.numerics")  # it imports torch: only when emulating
    attention_numerics, llamacpp_numerics = emulations.attention_numerics, emulations.llamacpp_numerics
    key = tuple(key)
    stack = contextlib.ExitStack()
    if "gelu_fp16_table" in key:
        stack.enter_context(llamacpp_numerics())
    if "quantized_activations" in key:
        stack.enter_context(emulations.quantized_activations_numerics())
        if fast_q8 is not None:
            stack.enter_context(fast_q8())
    if "jitter" in key:  # after the rounding it perturbs the input of (harness/parity/checks/quantized.py)
        stack.enter_context(emulations.jitter_numerics())
    if "jitter_sums" in key:  # the fp32 sums' last bits, the null of the re-seeded per-layer comparison
        stack.enter_context(emulations.jitter_sums_numerics(0 if jitter_rng is None else jitter_rng))
    if "quantized_activations_q8" in key:  # the yardstick where the engine's rounding cannot be emulated
        stack.enter_context(emulations.coarse_q8_numerics())
    kv = next((k.split("=", 1)[1] for k in key if k.startswith("kv_cache=")), None)
    if "flash_attn_fp16" in key or kv is not None:
        stack.enter_context(attention_numerics(kv=kv, operands="attn_fp16_operands" in key,
                                               flash="flash_attn_fp16" in key))
    return stack
