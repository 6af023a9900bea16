"""Each engine's memory rule (:data:`PLAN_RULES`, named by a registry row's ``memory_rule``): the terms of the bytes it
needs for a model, dtype, weight mode and context (weights as it holds them, the KV cache, activations, its runtime),
from the model's facts (:mod:`.memory_facts`); :func:`.memory.plan` adds them up against what the machine has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.weights import READ_ELEMENTS, block_bounds

from .memory_facts import GB, ModelInfo, TensorFacts


#: Resident bytes of a process that has imported what each rule's engine needs, before any model, rounded up, by
#: rule name (:data:`PLAN_RULES`). Measured (``VmRSS`` after ``import harness.engines.<engine>``; CPython 3.11,
#: numpy 2, torch 2.13 CPU, transformers 5.23): the reference (``float64``) 0.04 GB, fast (``torch``) 0.23 GB,
#: transformers (``hf-torch``) 0.35 GB. The llama.cpp worker (``worker``) is a second process with llama-cpp-python's
#: libraries: not measured here, taken as 0.3 GB.
RUNTIME_BYTES = {"float64": int(0.1 * GB), "torch": int(0.3 * GB), "hf-torch": int(0.5 * GB),
                 "worker": int(0.3 * GB)}


#: Bytes per element of the fast engine's compute dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

#: GGML types the fast engine keeps packed with ``--weights packed`` (plain float types are not packed).
UNPACKED = ("F32", "F16", "BF16", "F64")


def _f64(t: TensorFacts) -> int:
    return 8 * t.elements


#: Tables the reference reads in parts (rows of the prompt's tokens; the head in blocks), never whole.
_READ_IN_PARTS = ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")


def _layer_groups(info: ModelInfo) -> list[list[TensorFacts]]:
    """Tensors the reference holds at the same time: each matrix alone (``ffn_block`` reads the FFN's
    three one at a time), a MoE layer's two expert stacks together (``moe_experts`` takes both); tables
    read in parts are not among them."""
    T = info.tensors
    groups: list[list[TensorFacts]] = [[t] for n, t in T.items() if len(t.shape) == 2 and n not in _READ_IN_PARTS]
    for L in info.cfg.layers:
        b = f"blk.{L.index}."
        groups.append([T[b + n + ".weight"] for n in ("ffn_gate_up_exps", "ffn_down_exps") if b + n + ".weight" in T])
    return [g for g in groups if g]


def _in_use(group: list[TensorFacts]) -> int:
    """float64 bytes of a group, plus the float32 temporaries of reading its largest tensor (a matrix is read
    :data:`reference.weights.READ_ELEMENTS` at a time; an expert stack whole)."""
    big = max(group, key=lambda t: t.elements)
    temp = 8 * (big.elements if len(big.shape) > 2 else min(big.elements, READ_ELEMENTS))
    return sum(_f64(t) for t in group) + temp


def _kv_bytes(cfg: ModelConfig, context: int, elem: int, window_bound: bool, batch: int = 1) -> int:
    """K and V of every layer that owns them for ``context`` tokens (sliding layers: at most the window
    when ``window_bound``; one tensor on a layer without V projection)."""
    total = 0
    for L in cfg.layers:
        if not L.has_kv:
            continue
        s = min(context, cfg.sliding_window) if (window_bound and L.is_sliding) else context
        total += s * L.n_kv_head * L.head_dim * (2 if L.has_v_proj else 1) * elem
    return total * batch


def _head_name(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"


def _layer_sets(info: ModelInfo) -> list[list[TensorFacts]]:
    """Tensors a layer-outer pass (:func:`reference.batch.forward_chains`) holds at once: every tensor of one
    layer, of a MoE layer's expert stacks one expert each (the pass reads each expert alone, uses it for every
    call's rows and drops it: :meth:`reference.weights.Weights.expert`), or the tensors read whole outside the
    layers (the PLE projection)."""
    sets: dict[str, list[TensorFacts]] = {}
    for n, t in info.tensors.items():
        if n in _READ_IN_PARTS:
            continue
        if len(t.shape) == 3:  # [E, out, in]: one expert
            t = TensorFacts(t.shape[1:], t.dtype, t.nbytes // t.shape[0])
        sets.setdefault(n.split(".")[1] if n.startswith("blk.") else "", []).append(t)
    return list(sets.values())


def _reference_terms(info: ModelInfo, tokens: int, context: int, forwards: int, cache_bytes: int,
                     layer_held: bool = False) -> tuple[dict[str, int], int]:
    cfg, T = info.cfg, info.tensors
    h, V = cfg.hidden_size, cfg.vocab_size
    working = max((_in_use(g) for g in (_layer_sets(info) if layer_held else _layer_groups(info))), default=0)
    cacheable = sum(_f64(t) for n, t in T.items() if n != "per_layer_token_embd.weight")
    head = T[_head_name(cfg)]
    block = max(b - a for a, b in block_bounds(head.shape[0], head.shape[1]))
    ple = cfg.ple_dim * cfg.n_layer
    heads = max((L.n_head for L in cfg.layers), default=1)
    terms = {
        "runtime": RUNTIME_BYTES["float64"],
        "weight cache": min(cache_bytes, cacheable) if forwards > 1 else 0,
        "weights in use": working,
        "LM head block": 16 * block * h,  # float64, and gguf's two float32 arrays while it is read
        "logits": 3 * 8 * tokens * V,  # the blocks' products, their concatenation, the softcap
        "KV cache": _kv_bytes(cfg, context, 8, window_bound=False),
        "activations": 8 * tokens * (6 * h + 3 * ple + 3 * heads * context),
    }
    return terms, 0


def _fast_terms(info: ModelInfo, tokens: int, context: int, dtype: str, weights: str, batch: int,
                device: str = "cpu") -> tuple[dict[str, int], int]:
    cfg = info.cfg
    elem = DTYPE_BYTES[dtype]
    dense = packed = 0
    biggest = 0
    ranks = (2, 3) if str(device).startswith("cpu") else (2,)  # expert stacks stay packed on the CPU only
    for t in info.tensors.values():
        keep_packed = weights == "packed" and info.form == "gguf" and len(t.shape) in ranks \
            and t.dtype not in UNPACKED
        if keep_packed:
            packed += t.nbytes
            continue
        dense += t.elements * (4 if len(t.shape) == 1 else elem)
        # While a tensor is converted (fast.weights.FastWeights): a copy of its GGUF bytes, and its float32
        # form when the target is another dtype (or when a float array is copied before it is cast).
        copied = t.nbytes if info.form == "gguf" and t.dtype != "F32" else 0
        biggest = max(biggest, copied + (4 * t.elements if elem != 4 or copied == 0 else 0))
    terms = {
        "runtime": RUNTIME_BYTES["torch"],
        "weights": dense,
        "packed weights": packed,
        "largest tensor in conversion": biggest,
        "KV cache": _kv_bytes(cfg, context, 4, window_bound=True, batch=batch),
        "logits": (4 + 8) * tokens * batch * cfg.vocab_size,  # float32 on the device, float64 for the caller
        "activations": 4 * tokens * batch * (8 * cfg.hidden_size + 3 * cfg.ple_dim * cfg.n_layer),
    }
    return terms, packed if info.form == "gguf" else 0


def _transformers_terms(info: ModelInfo, tokens: int, context: int) -> tuple[dict[str, int], int]:
    cfg = info.cfg
    params = sum(t.elements for t in info.tensors.values())
    biggest = max((t.nbytes + 4 * t.elements for t in info.tensors.values()), default=0)
    heads = max((L.n_head for L in cfg.layers), default=1)
    terms = {
        "runtime": RUNTIME_BYTES["hf-torch"],
        "weights": 4 * params,
        "largest tensor in conversion": biggest,
        "KV cache": _kv_bytes(cfg, context, 4, window_bound=True),
        "logits": 2 * 4 * tokens * cfg.vocab_size,
        "activations": 4 * tokens * (8 * cfg.hidden_size + 3 * heads * context + 3 * cfg.ple_dim * cfg.n_layer),
    }
    return terms, 0


def _llamacpp_terms(info: ModelInfo, tokens: int, context: int) -> tuple[dict[str, int], int]:
    cfg = info.cfg
    terms = {
        "runtime": RUNTIME_BYTES["worker"],
        "model file (mapped)": info.file_bytes,
        "KV cache": _kv_bytes(cfg, context, 4, window_bound=False),
        "logits": 4 * tokens * cfg.vocab_size,
        "compute buffer": 4 * min(tokens, 512) * (4 * cfg.hidden_size + max(L.n_ff for L in cfg.layers)
                                                   + cfg.vocab_size),
    }
    return terms, 0


@dataclass(frozen=True)
class PlanRule:
    """How one kind of engine is planned (:data:`PLAN_RULES`; a registry row names its rule: ``memory_rule``).

    Attributes:
        terms: ``(info, options) -> (breakdown, mapped bytes)``, the terms of :func:`plan`'s docstring.
        shown: the options a plan reports (:attr:`MemoryPlan.options`).
        knobs: the options that change the need, for the line that says none of their settings fits (None: the
            engine runs the file as it is).
        oom_advice: what an allocation failure's line suggests when the plan gave no advice.
        torch: the engine runs torch: planned on its device, and it starts torch threads (``RLIMIT_AS``).
        in_process: the engine runs in the harness's own process (its runtime is running already; the llama.cpp
            engine runs in a worker process).
    """

    terms: Callable[[ModelInfo, dict[str, Any]], tuple[dict[str, int], int]]
    shown: tuple[str, ...]
    knobs: str | None = None
    oom_advice: tuple[str, ...] = ("--layers N",)
    torch: bool = False
    in_process: bool = True


PLAN_RULES: dict[str, PlanRule] = {
    "float64": PlanRule(
        lambda info, o: _reference_terms(info, o["tokens"], o["context"], o["forwards"], o["cache_bytes"],
                                         o["layer_held"]),
        ("tokens", "new_tokens", "cache_bytes", "forwards"), "--ref-cache-gb or --layers",
        ("a smaller --ref-cache-gb", "--layers N")),
    "torch": PlanRule(
        lambda info, o: _fast_terms(info, o["tokens"], o["context"], o["dtype"], o["weights"], o["batch"],
                                    o["device"]),
        ("tokens", "new_tokens", "batch", "dtype", "weights", "device"), "--weights, --dtype or --layers",
        ("--weights packed", "--dtype bfloat16", "--layers N"), torch=True),
    "hf-torch": PlanRule(lambda info, o: _transformers_terms(info, o["tokens"], o["context"]),
                         ("tokens", "new_tokens", "device"), "--layers", torch=True),
    "worker": PlanRule(lambda info, o: _llamacpp_terms(info, o["tokens"], o["context"]), ("tokens", "new_tokens"),
                       in_process=False),
}
"""Memory-plan rule name -> :class:`PlanRule` (the registry rows' ``memory_rule``), named by what the engine runs:
``float64`` (the NumPy reference, with its weight cache), ``torch`` (the fast engine), ``hf-torch`` (transformers'
model in torch), ``worker`` (llama.cpp in a worker process, the file mapped)."""
