"""Engines: everything that can run Gemma 4, behind one small protocol.

An engine is built from a model path (a ``.gguf`` file or an HF folder) and can

* ``logits(ids, trace=None)`` -> float ``[T, V]`` logits of every position;
* ``generate(prompts, max_new_tokens)`` -> greedy continuations;
* report trace points (llama.cpp graph-callback names, see :mod:`reference.model`)
  through the ``trace`` callback ``(point, layer, array [T, ...])``.

Engines: ``reference`` (float64 NumPy), ``transformers`` (HF fp32 eager, the
oracle), ``fast`` (torch, any device and dtype) and ``llamacpp`` (llama-cpp-python
in a subprocess, :mod:`harness.llamacpp`). New engines register in :data:`ENGINES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from reference import model as ref_model
from reference.errors import InputError, ModelFileError
from reference.weights import load_model

TraceFn = Callable[[str, int, np.ndarray], None]


class Generated:
    """One greedy continuation: ``tokens`` and, per step, the top-5 ``(id, logprob)`` pairs."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.top5: list[list[tuple[int, float]]] = []

    def add(self, logits: np.ndarray) -> None:
        """Take the greedy token from one step's logits ``[V]`` (ties -> lowest id)."""
        z = np.asarray(logits, dtype=np.float64)
        logp = z - (z.max() + np.log(np.sum(np.exp(z - z.max()))))
        top = np.argsort(-logp, kind="stable")[:5]
        self.tokens.append(int(np.argmax(z)))
        self.top5.append([(int(i), float(logp[i])) for i in top])


class EngineUnavailable(InputError):
    """The engine cannot run here or cannot read this kind of model file (one line says why)."""


class Engine(Protocol):
    """What the harness needs from an engine."""

    name: str

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """Logits ``[T, V]`` for every position of ``ids`` (one sequence, positions from 0)."""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt, ``max_new_tokens`` ids each."""


class ReferenceEngine:
    """The float64 NumPy reference (:mod:`reference.model`).

    Args:
        path: ``.gguf`` file or HF folder.

    Raises:
        InputError: from the loader (bad file, key or tensor).
    """

    name = "reference"

    def __init__(self, path: str | Path):
        self.cfg, self.weights = load_model(path)

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """float64 ``[T, V]``; see :func:`reference.model.forward`."""
        return ref_model.forward(self.cfg, self.weights, ids, trace=trace)

    def logits_cached(self, ids: Sequence[int], prefill: int) -> np.ndarray:
        """Logits from a prefill of ``ids[:prefill]`` then one-token decode steps. float64 ``[T, V]``."""
        cache = ref_model.KVCache(self.cfg)
        parts = [ref_model.forward(self.cfg, self.weights, ids[:prefill], cache)]
        for tok in ids[prefill:]:
            parts.append(ref_model.forward(self.cfg, self.weights, [tok], cache))
        return np.concatenate(parts, axis=0)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy, one prompt at a time, with the KV cache."""
        return [ref_model.greedy_generate(self.cfg, self.weights, p, max_new_tokens) for p in prompts]

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generated]:
        """Greedy with the top-5 log-probabilities of every step."""
        out = []
        for p in prompts:
            cache = ref_model.KVCache(self.cfg)
            logits = ref_model.forward(self.cfg, self.weights, p, cache)[-1]
            g = Generated()
            for _ in range(max_new_tokens):
                g.add(logits)
                logits = ref_model.forward(self.cfg, self.weights, [g.tokens[-1]], cache)[-1]
            out.append(g)
        return out


class TransformersEngine:
    """HF transformers ``Gemma4ForCausalLM``, fp32, eager attention: the oracle.

    A multimodal checkpoint (``model_type`` ``gemma4``) loads its text decoder
    with a key mapping ``model.language_model.`` -> ``model.``; any weight left
    unloaded is an error (transformers would otherwise leave it random).

    Args:
        path: HF model folder (transformers cannot load a Gemma 4 GGUF).

    Raises:
        EngineUnavailable: transformers/torch missing, or ``path`` is not a folder.
        ModelFileError: weights missing from the checkpoint.
    """

    name = "transformers"

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_dir():
            raise EngineUnavailable(f"{path}: the transformers engine needs an HF model folder, not a GGUF file")
        try:
            import torch
            import transformers
            from transformers import Gemma4ForCausalLM, Gemma4TextConfig
        except ImportError as e:
            raise EngineUnavailable(f"transformers engine unavailable ({e}); "
                                    "install with: pip install 'transformers>=5.23' torch") from None
        import json

        transformers.logging.set_verbosity_error()
        raw = json.loads((path / "config.json").read_text())
        kwargs = {}
        if raw.get("model_type") == "gemma4":
            from transformers import Gemma4Config

            kwargs["config"] = Gemma4Config.from_pretrained(path).text_config
            kwargs["key_mapping"] = {r"^model\.language_model\.": "model."}
        elif raw.get("model_type") != "gemma4_text":
            raise EngineUnavailable(f"{path}/config.json: model_type {raw.get('model_type')!r} is not Gemma 4")
        model, info = Gemma4ForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True, **kwargs)
        missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
        if missing:
            raise ModelFileError(f"{path}: transformers found no weight for {missing[0]} "
                                 f"({len(missing)} missing)")
        self.torch = torch
        self.model = model.eval()
        self.config: Gemma4TextConfig = model.config

    def _hooks(self, trace: TraceFn):
        """Register forward hooks that report our trace points; returns (handles, finish)."""
        torch = self.torch
        m = self.model.model
        records: dict[tuple[str, int], np.ndarray] = {}
        ple_inputs: dict[int, np.ndarray] = {}
        layer_in: dict[int, torch.Tensor] = {}
        ffn_parts: dict[int, dict[str, np.ndarray]] = {}
        handles = []

        def np_(t):
            return t.detach()[0].double().numpy()

        handles.append(m.embed_tokens.register_forward_hook(
            lambda mod, a, out: records.__setitem__(("inp_scaled", -1), np_(out))))
        handles.append(m.norm.register_forward_hook(
            lambda mod, a, out: records.__setitem__(("result_norm", -1), np_(out))))
        for i, layer in enumerate(m.layers):
            def pre(mod, args, kwargs, i=i):
                layer_in[i] = args[0]
                ple = args[1] if len(args) > 1 else kwargs.get("per_layer_input")
                if ple is not None:
                    ple_inputs[i] = np_(ple)

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.post_attention_layernorm.register_forward_hook(
                lambda mod, a, out, i=i: records.__setitem__(("attn_out", i), np_(layer_in[i] + out))))
            if layer.enable_moe_block:
                handles.append(layer.post_feedforward_layernorm_1.register_forward_hook(
                    lambda mod, a, out, i=i: ffn_parts.setdefault(i, {}).__setitem__("ffn_mlp", np_(out))))
                handles.append(layer.post_feedforward_layernorm_2.register_forward_hook(
                    lambda mod, a, out, i=i: ffn_parts.setdefault(i, {}).__setitem__("ffn_moe", np_(out))))
                handles.append(layer.post_feedforward_layernorm.register_forward_hook(
                    lambda mod, a, out, i=i: records.__setitem__(("ffn_out", i), np_(a[0]))))
            else:
                handles.append(layer.mlp.register_forward_hook(
                    lambda mod, a, out, i=i: records.__setitem__(("ffn_out", i), np_(out))))
            if getattr(layer, "hidden_size_per_layer_input", 0):
                handles.append(layer.post_per_layer_input_norm.register_forward_hook(
                    lambda mod, a, out, i=i: records.__setitem__(("per_layer_embd_out", i), np_(out))))
            handles.append(layer.register_forward_hook(
                lambda mod, a, out, i=i: records.__setitem__(("l_out", i), np_(out[0] if isinstance(out, tuple)
                                                                               else out))))

        def finish(logits: np.ndarray):
            trace("inp_scaled", -1, records[("inp_scaled", -1)])
            if ple_inputs:
                trace("inp_per_layer", -1, np.stack([ple_inputs[i] for i in sorted(ple_inputs)], axis=1))
            for i in range(len(m.layers)):
                trace("attn_out", i, records[("attn_out", i)])
                for k in ("ffn_mlp", "ffn_moe"):
                    if k in ffn_parts.get(i, {}):
                        trace(k, i, ffn_parts[i][k])
                trace("ffn_out", i, records[("ffn_out", i)])
                if ("per_layer_embd_out", i) in records:
                    trace("per_layer_embd_out", i, records[("per_layer_embd_out", i)])
                trace("l_out", i, records[("l_out", i)])
            trace("result_norm", -1, records[("result_norm", -1)])
            trace("result_output", -1, logits)

        return handles, finish

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """float32 logits as float64 ``[T, V]`` from one full forward (no cache)."""
        torch = self.torch
        handles, finish = self._hooks(trace) if trace else ([], None)
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        logits = out.logits[0].double().numpy()
        if finish:
            finish(logits)
        return logits

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy, one prompt at a time (see :meth:`generate_full`)."""
        return [g.tokens for g in self.generate_full(prompts, max_new_tokens)]

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generated]:
        """Greedy with transformers' own KV cache: prefill, then one token per forward."""
        torch = self.torch
        out = []
        for p in prompts:
            g = Generated()
            with torch.no_grad():
                o = self.model(torch.tensor([list(p)]), use_cache=True)
                for _ in range(max_new_tokens):
                    g.add(o.logits[0, -1].double().numpy())
                    o = self.model(torch.tensor([[g.tokens[-1]]]), past_key_values=o.past_key_values, use_cache=True)
            out.append(g)
        return out


class FastEngine:
    """The torch fast path (:mod:`fast`), on a chosen device and dtype.

    Args:
        path: ``.gguf`` file or HF folder (same loader as the reference).
        device: ``cpu`` / ``cuda`` / None (cuda when present).
        dtype: ``float32`` / ``bfloat16`` / ``float16``.
        batched: ``generate`` serves all prompts through one continuous batch (else one at a time).
        keep_quantized: keep GGUF quantized matrices packed on the device (dequantized on the fly).

    Raises:
        InputError: bad model file, device or dtype.
    """

    def __init__(self, path: str | Path, device: str | None = None, dtype: str = "float32", batched: bool = False,
                 keep_quantized: bool = False):
        from fast.model import FastModel

        cfg, weights = load_model(path)
        self.model = FastModel(cfg, weights, device, dtype, keep_quantized=keep_quantized)
        self.cfg = cfg
        self.batched = batched
        self.name = f"fast-{self.model.device.type}-{dtype}" + ("-batched" if batched else "")

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None, chunk: int | None = None) -> np.ndarray:
        """float32 logits as float64 ``[T, V]`` (one-shot prefill, or in chunks of ``chunk``)."""
        return self.model.logits(ids, chunk=chunk, trace=trace).double().cpu().numpy()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations; one continuous batch when ``batched``."""
        from fast.engine import generate

        return [r.tokens for r in generate(self.model, prompts, max_new_tokens, batched=self.batched)]

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """Like :meth:`generate` but returns :class:`fast.engine.Result` (tokens and top-5 logprobs)."""
        from fast.engine import generate

        return generate(self.model, prompts, max_new_tokens, batched=self.batched)


def _llamacpp_engine(path: str | Path, **options) -> Engine:
    """llama.cpp through llama-cpp-python, in a worker subprocess (lazy import: :mod:`harness.llamacpp`)."""
    from harness.llamacpp import LlamaCppEngine

    return LlamaCppEngine(path, **options)


ENGINES: dict[str, Callable[..., Engine]] = {
    "reference": ReferenceEngine,
    "transformers": TransformersEngine,
    "fast": FastEngine,
    "llamacpp": _llamacpp_engine,
}


def make_engine(name: str, path: str | Path, **options) -> Engine:
    """Build engine ``name`` for the model at ``path``.

    Args:
        options: engine-specific keywords (``device``, ``dtype``, ``batched`` for ``fast``);
            ignored by engines that take none.

    Raises:
        EngineUnavailable: unknown engine name or engine not installed (one line, says how to install).
        InputError: bad model file.
    """
    if name not in ENGINES:
        raise EngineUnavailable(f"unknown engine {name!r} (available: {', '.join(ENGINES)})")
    if name == "fast":
        return ENGINES[name](path, **{k: v for k, v in options.items() if v is not None})
    return ENGINES[name](path)
