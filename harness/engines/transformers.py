"""The ``transformers`` engine: HF transformers in fp32 with eager attention, the oracle.

Gemma 4 loads from an HF folder (``Gemma4ForCausalLM``; a multimodal checkpoint's text decoder).
transformers cannot read a Gemma 4 GGUF, but it can read a Gemma 3 one: a Gemma 3 ``.gguf`` loads
through transformers' own GGUF loader (:func:`load_gemma3_gguf`), which the real-model checks and
the benchmark use.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoConfig, Gemma3ForCausalLM, Gemma4Config, Gemma4ForCausalLM, Gemma4TextConfig
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from gemma4_harness.reference.errors import InputError, ModelFileError, PromptError
from gemma4_harness.reference.names import gguf_to_hf
from gemma4_harness.reference.weight_check import check_values
from gemma4_harness.reference.weights import load_model, read_hf_config

from ..core import memory
from .base import DTYPE_BYTES, TOP_N, EngineUnavailable, Generated, TraceFn, bench_ids


def load_gemma3_gguf(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``Gemma3ForCausalLM`` (fp32, eager) from a GGUF through transformers' own GGUF loader.

    transformers reads the file twice (the config, then the tensors for the built module); both reads get one
    ``gguf.GGUFReader`` of the file (:func:`_one_reader`: opening a 262k-token vocabulary takes 9-12 s), and the
    module is built without its random initialisation (``transformers.initialization.no_init_weights``), since
    every weight is loaded from the file after (a weight the file lacks is an error here, not a random value).

    Returns:
        ``(model, info)`` where info has timings and what the loader did.

    Raises:
        whatever transformers raises (the caller records it as one line).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(path)
    t0 = time.perf_counter()
    with _one_reader(path):
        cfg_dict = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
        config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
        config._attn_implementation = "eager"
        t1 = time.perf_counter()
        with no_init_weights():
            model = Gemma3ForCausalLM(config).to(torch.float32).eval()
        state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    t2 = time.perf_counter()
    info = {
        "route": "transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint + Gemma3ForCausalLM (fp32, eager); "
                 "from_pretrained(gguf_file=...) needs the accelerate package",
        "config_s": round(t1 - t0, 3),
        "weights_s": round(t2 - t1, 3),
        "norm_unshift": "Gemma2TensorProcessor: *norm.weight - 1 (Gemma3RMSNorm multiplies by 1 + w)",
        "layer_types": list(config.layer_types),
        "rope_parameters": {k: dict(v) for k, v in (config.rope_parameters or {}).items()},
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
    }
    return model, info


@contextlib.contextmanager
def _one_reader(path: str) -> Iterator[None]:
    """While inside, ``gguf.GGUFReader(path)`` returns one reader of ``path``, opened on first use (transformers'
    ``load_gguf_checkpoint`` imports the class from ``gguf`` on each call); any other path opens as usual. The
    reader only reads (a read-only memory map), so sharing it changes nothing that is read."""
    original = gguf.GGUFReader
    opened: dict[str, Any] = {}

    def reader(p, *args, **kwargs):
        if str(p) != path or args or kwargs:
            return original(p, *args, **kwargs)
        if path not in opened:
            opened[path] = original(path)
        return opened[path]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _load_gemma4_layers(path: Path, text_config: Gemma4TextConfig, layers: int):
    """``Gemma4ForCausalLM`` (fp32, eager) of the first ``layers`` layers of an HF folder (``--layers N``).

    The config keeps the first N ``layer_types`` and the part of the KV-shared tail among them
    (:func:`reference.config.cut_layers`); the weights come through the reference's loader, cut the
    same way (the PLE table's first ``N * ple_dim`` columns), tensor by tensor into the module.

    Raises:
        InputError: layer N-1 is a sliding layer (transformers makes the last layer full attention,
            which would give it other weights' shapes) or ``layers`` is out of range.
        ModelFileError: a weight the module expects that the file does not give.
    """
    cfg, W = load_model(path, layers=layers, cache_bytes=0)
    types = list(text_config.layer_types)
    if types[layers - 1] != "full_attention":
        fulls = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
        raise InputError(f"{path}: --layers {layers}: layer {layers - 1} is a sliding layer, and transformers makes "
                         f"the last layer full attention; for the transformers engine use one of "
                         f"{', '.join(map(str, fulls[:6]))}{' ...' if len(fulls) > 6 else ''}")
    fields = text_config.to_dict()
    fields.update(num_hidden_layers=layers, layer_types=types[:layers], num_kv_shared_layers=cfg.n_kv_shared)
    fields.pop("model_type", None)
    if fields.get("per_layer_config"):  # per-layer overrides (a full layer's head_dim): the kept layers' only
        fields["per_layer_config"] = {k: v for k, v in fields["per_layer_config"].items() if int(k) < layers}
    config = Gemma4TextConfig(**fields)
    config._attn_implementation = "eager"
    model = Gemma4ForCausalLM(config).to(torch.float32)
    state = {gguf_to_hf(name): torch.from_numpy(np.array(W.raw(name), dtype=np.float32)) for name in W
             if name != "rope_freqs.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelFileError(f"{path}: --layers {layers}: transformers found no weight for "
                             f"{(missing or unexpected)[0]} ({len(missing)} missing, {len(unexpected)} unexpected)")
    model.tie_weights()
    return model


def _load_gemma4(path: Path, layers: int | None = None):
    """``Gemma4ForCausalLM`` (fp32, eager) from an HF folder; the text decoder of a multimodal one."""
    transformers.logging.set_verbosity_error()
    raw = read_hf_config(path)
    kwargs = {}
    if layers is not None:
        text = Gemma4Config.from_pretrained(path).text_config if raw.get("model_type") == "gemma4" else \
            Gemma4TextConfig.from_pretrained(path)
        if layers != text.num_hidden_layers:
            return _load_gemma4_layers(path, text, layers)
    if raw.get("model_type") == "gemma4":
        kwargs["config"] = Gemma4Config.from_pretrained(path).text_config
        kwargs["key_mapping"] = {r"^model\.language_model\.": "model."}
    elif raw.get("model_type") != "gemma4_text":
        raise EngineUnavailable(f"{path}/config.json: model_type {raw.get('model_type')!r} is not Gemma 4")
    model, info = Gemma4ForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True, **kwargs)
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    if missing:
        raise ModelFileError(f"{path}: transformers found no weight for {missing[0]} ({len(missing)} missing)")
    return model


def check_parameters(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Every loaded parameter finite and within :data:`reference.weight_check.MAX_ABS_FP32`, as the other
    engines check theirs (transformers itself would compute NaN logits and exit 0).

    Args:
        model: the loaded module (fp32 parameters, on the CPU).
        path: the checkpoint, for the message.

    Raises:
        ModelFileError: one line naming the parameter as transformers names it (``model.layers.1.mlp.up_proj
            .weight``), the first bad element's index and its value.

    Cost: two reductions per 4M-element chunk of each parameter, no copy (a view of the fp32 storage).
    """
    for name, p in model.named_parameters():
        check_values(str(path), name, p.detach().cpu().numpy())


class TransformersEngine:
    """HF transformers, fp32, eager attention: the oracle (and, cast to bf16, a benchmark engine).

    A multimodal checkpoint (``model_type`` ``gemma4``) loads its text decoder with a key mapping
    ``model.language_model.`` -> ``model.``; any weight left unloaded is an error (transformers would
    otherwise leave it random).

    Args:
        path: HF model folder (Gemma 4), or a Gemma 3 ``.gguf`` (transformers' GGUF loader; it cannot
            read a Gemma 4 GGUF).
        cfg: our config of the same model (optional; the benchmark's bytes-per-token count needs it).
        layers: ``--layers N``: only the first N layers (HF folders; see :func:`_load_gemma4_layers`).

    The model is planned before it is loaded (:func:`harness.core.memory.require`); a plan that does
    not fit, or an allocation that fails anyway, stops with one line.

    Raises:
        EngineUnavailable: transformers/torch missing, or a Gemma 4 GGUF.
        ModelFileError: weights missing from the checkpoint, or a weight that is NaN, Inf or beyond 1e30
            (:func:`check_parameters`).
        InputError: ``layers`` out of range or ending on a sliding layer; ``layers`` with a GGUF.
        NotEnoughMemory: the model cannot run in the memory available (one line).
    """

    name = "transformers"
    engine = "transformers"
    max_batch = None
    kv_elem = 4.0
    memory_plan: memory.MemoryPlan | None = None

    @memory.guarded
    def __init__(self, path: str | Path, cfg=None, layers: int | None = None):
        path = Path(path)
        self.cfg = cfg
        self.dtype = "float32"
        if path.is_dir():
            rcfg, W = load_model(path, layers=layers, cache_bytes=0)
            self.memory_plan = memory.require("transformers", memory.ModelInfo.from_loaded(path, rcfg, W))
            self.model = _load_gemma4(path, layers).eval()
        elif layers is not None:
            raise InputError(f"{path}: --layers: the transformers engine cuts HF folders only")
        elif cfg is None or getattr(cfg, "arch", None) == "gemma3":
            try:
                self.model = load_gemma3_gguf(path)[0]
            except Exception as e:  # transformers refuses the architecture (a Gemma 4 GGUF) or the file
                raise EngineUnavailable(f"{path}: the transformers engine needs an HF model folder for Gemma 4 "
                                        f"(its GGUF loader: {str(e).splitlines()[0][:120] if str(e) else e})") from None
        else:
            raise EngineUnavailable(f"{path}: the transformers engine needs an HF model folder (it cannot read "
                                    "a Gemma 4 GGUF); pass a case spec (cases/bench/*.toml) or an HF folder")
        self.config = self.model.config
        self.source = path  # for messages: the context length's file and key
        check_parameters(self.model, path)

    def cast(self, dtype: str) -> "TransformersEngine":
        """This engine in ``dtype`` (``float32`` / ``bfloat16``): itself when already so, else a deep copy
        (``Module.to`` casts in place, so two dtypes never share one module)."""
        target = getattr(torch, dtype)
        if all(p.dtype == target for p in self.model.parameters()):
            return self
        other = copy.copy(self)
        other.model = copy.deepcopy(self.model).to(target).eval()
        other.dtype = dtype
        return other

    def _hooks(self, trace: TraceFn):
        """Register forward hooks that report our trace points; returns (handles, finish)."""
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
            has_ple = bool(getattr(layer, "hidden_size_per_layer_input", 0))  # Gemma 4 E2B/E4B layers only

            def pre(mod, args, kwargs, i=i, has_ple=has_ple):
                layer_in[i] = args[0]
                ple = (args[1] if len(args) > 1 else kwargs.get("per_layer_input")) if has_ple else None
                if ple is not None:
                    ple_inputs[i] = np_(ple)

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.post_attention_layernorm.register_forward_hook(
                lambda mod, a, out, i=i: records.__setitem__(("attn_out", i), np_(layer_in[i] + out))))
            if getattr(layer, "enable_moe_block", False):
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

    def check_prompt(self, ids: Sequence[int], new_tokens: int = 0) -> list[int]:
        """The prompt as a list of ids, checked against the model's vocabulary and context (the same rules as
        :func:`reference.model.check_prompt`; transformers itself would index out of range or run past its
        positions silently).

        Raises:
            PromptError: empty, not integers, an id outside ``[0, vocab_size)``, or prompt plus ``new_tokens``
                longer than ``max_position_embeddings``.
        """
        ids = list(ids)
        if not ids:
            raise PromptError("prompt is empty")
        vocab = int(self.config.vocab_size)
        bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))
                    or not 0 <= int(i) < vocab), None)
        if bad is not None:
            raise PromptError(f"token id {bad!r:.40} is outside the vocabulary [0, {vocab})")
        context = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        if context and len(ids) + new_tokens > context:
            where = getattr(self, "source", None)
            key = (f"{where / 'config.json'}: key max_position_embeddings" if where is not None and where.is_dir()
                   else f"{where}: {self.config.model_type}.context_length" if where is not None
                   else "max_position_embeddings")
            raise PromptError(f"prompt of {len(ids)} tokens{f' + {new_tokens} new' if new_tokens else ''} is longer "
                              f"than the context: {key} = {context}")
        return [int(i) for i in ids]

    @memory.guarded
    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """float32 logits as float64 ``[T, V]`` from one full forward (no cache).

        Raises:
            PromptError: see :meth:`check_prompt`.
        """
        ids = self.check_prompt(ids)
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

    @memory.guarded
    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      top_n: int = TOP_N) -> list[Generated]:
        """Greedy with transformers' own KV cache: prefill, then one token per forward; the top-``top_n``
        log-probabilities of every step.

        Raises:
            PromptError: see :meth:`check_prompt` (every prompt is checked before any runs).
        """
        prompts = [self.check_prompt(p, max(int(max_new_tokens) - 1, 0)) for p in prompts]
        out = []
        for p in prompts:
            g = Generated(top_n)
            with torch.no_grad():
                o = self.model(torch.tensor([list(p)]), use_cache=True)
                for _ in range(max_new_tokens):
                    g.add(o.logits[0, -1].double().numpy())
                    o = self.model(torch.tensor([[g.tokens[-1]]]), past_key_values=o.past_key_values, use_cache=True)
            out.append(g)
        return out

    # ------------------------------------------------------------------ bench (harness.engines.base.Benchable)

    def elem_bytes(self, name: str) -> float:
        """Bytes per element of every weight in this engine's dtype."""
        return float(DTYPE_BYTES[self.dtype])

    def _context(self, depth: int, batch: int):
        if not depth:
            return None
        ids = torch.tensor([bench_ids(self.cfg.vocab_size, depth, 1)] * batch)
        with torch.inference_mode():
            return self.model(ids, use_cache=True, logits_to_keep=1).past_key_values

    def bench_time(self, test: str, n: int, depth: int, batch: int) -> float:
        """One ``pp``/``tg`` repetition with transformers' own ``DynamicCache`` (see
        :class:`harness.engines.base.Benchable`)."""
        past = self._context(depth, batch)
        with torch.inference_mode():
            if test == "pp":
                ids = torch.tensor([bench_ids(self.cfg.vocab_size, n, 100 + i) for i in range(batch)])
                t = time.perf_counter()
                self.model(ids, past_key_values=past, use_cache=True, logits_to_keep=1)
                return time.perf_counter() - t
            tok = torch.tensor(bench_ids(self.cfg.vocab_size, batch, 7)).view(batch, 1)
            t = time.perf_counter()
            for _ in range(n):
                o = self.model(tok, past_key_values=past, use_cache=True)
                past = o.past_key_values
                tok = o.logits[:, -1].argmax(-1).view(batch, 1)
            return time.perf_counter() - t

    def close(self) -> None:
        """Drop the model."""
        self.model = None
