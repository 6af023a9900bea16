"""The ``transformers`` multimodal engine: ``Gemma4ForConditionalGeneration`` (eager) in float32, the oracle,
or in float64 (:func:`float64_everywhere`); :mod:`harness.engines.mm` describes the protocol."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.gemma4 import modeling_gemma4 as mg

from gemma4_harness.reference.mm_model import MultimodalModel, MultimodalPrompt, item_prefix, prefixed
from gemma4_harness.reference.model import TraceFn

from .base import EngineUnavailable, Generated
from .mm import check_rows


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """Route transformers' hard-coded float32 steps to float64 while the block runs.

    ``model.double()`` alone leaves a Gemma 4 computing partly in float32: its RMSNorm, the audio attention,
    the eager softmax, the vision pooler, standardize and both RoPE tables cast to ``float32``
    (``hidden_states.float()``, ``dtype=torch.float32``, ``dtype=torch.float``). Inside this block
    ``Tensor.float`` is ``Tensor.double`` and the module attributes ``torch.float`` / ``torch.float32`` are
    ``torch.float64``, so those casts keep float64; everything is restored on exit. Build the RoPE modules
    inside the block too (their inverse frequencies are computed at construction:
    :meth:`TransformersMM._rebuild_rope`).
    """
    saved = (torch.Tensor.float, torch.float, torch.float32)
    torch.Tensor.float = torch.Tensor.double
    torch.float = torch.float32 = torch.float64
    try:
        yield
    finally:
        torch.Tensor.float, torch.float, torch.float32 = saved


class TransformersMM:
    """transformers' ``Gemma4ForConditionalGeneration``, eager attention, on the CPU.

    Encoders run one item at a time (``get_image_features`` / ``get_audio_features`` on our pixels and
    features), then the decoder runs on the prompt with those soft tokens merged by transformers itself
    (``Gemma4Model.forward``: placeholder mask, pad-row PLE, ``masked_scatter``, the vision mask from
    ``mm_token_type_ids``).

    Args:
        path: the HF folder.
        dtype: ``float32`` (the oracle) or ``float64`` (``model.double()`` with :func:`float64_everywhere`).

    Raises:
        EngineUnavailable: not an HF folder.
    """

    @classmethod
    def for_model(cls, mm: MultimodalModel, device: str | None = None, dtype: str | None = None) -> "TransformersMM":
        """The engine over ``mm``'s HF folder (:func:`harness.engines.mm.make_mm_engine`; ``device`` does not apply:
        the CPU; ``dtype`` None: float32).

        Raises:
            EngineUnavailable: ``mm`` is a GGUF or has an mmproj (transformers reads neither).
        """
        if mm.mmproj is not None or not os.path.isdir(mm.source):
            raise EngineUnavailable(f"{mm.source}: the transformers engine needs the HF folder (it cannot read a "
                                    "Gemma 4 GGUF or an mmproj)")
        return cls(mm.source, dtype or "float32")

    def __init__(self, path: str | os.PathLike, dtype: str = "float32"):
        if not os.path.isdir(path):
            raise EngineUnavailable(f"{path}: the transformers engine needs an HF model folder (it cannot read a "
                                    "Gemma 4 GGUF or an mmproj)")
        if dtype not in ("float32", "float64"):
            raise EngineUnavailable(f"transformers multimodal engine: dtype {dtype!r}: expected float32 or float64")
        transformers.logging.set_verbosity_error()
        self.dtype = dtype
        self.model = transformers.Gemma4ForConditionalGeneration.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32).eval()
        self.tdtype = torch.float32
        if dtype == "float64":
            self.model = self.model.double()
            self.tdtype = torch.float64
            self._rebuild_rope()
        self.name = "transformers" if dtype == "float32" else "transformers-float64"

    def _ctx(self):
        return float64_everywhere() if self.dtype == "float64" else contextlib.nullcontext()

    def _rebuild_rope(self) -> None:
        """Rebuild what transformers forms in float32 at construction, in float64: the text and vision RoPE inverse
        frequencies, the audio relative-position timescales, the embedding scales ``sqrt(h)``."""
        m = self.model.model
        saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            with float64_everywhere():
                lm = m.language_model
                lm.rotary_emb = type(lm.rotary_emb)(lm.config).double()
                if getattr(m, "vision_tower", None) is not None:
                    enc = m.vision_tower.encoder
                    enc.rotary_emb = type(enc.rotary_emb)(enc.config).double()
                if getattr(m, "audio_tower", None) is not None:
                    at = m.audio_tower
                    at.rel_pos_enc = type(at.rel_pos_enc)(at.config).double()
            for mod in lm.modules():  # Gemma4TextScaledWordEmbedding: sqrt(h) was rounded to float32
                if hasattr(mod, "scalar_embed_scale"):
                    mod.embed_scale.fill_(float(mod.scalar_embed_scale))
        finally:
            torch.set_default_dtype(saved)

    def _t(self, arr):
        return torch.tensor(np.asarray(arr), dtype=self.tdtype)

    # ------------------------------------------------------------------ encoders

    def _image(self, item, trace: TraceFn | None):
        m = self.model.model
        pv, pos = self._t(item.image.pixel_values[None]), torch.tensor(item.image.position_ids[None])
        valid = ~(pos[0] == -1).all(-1)
        hooks = _vision_hooks(m, trace, valid) if trace else _Hooks()
        try:
            with torch.no_grad(), self._ctx():
                out = m.get_image_features(pv, pos, return_dict=True)
                rows = torch.cat(out.pooler_output)
        finally:
            hooks.close()
        if trace:
            trace("projected", -1, rows.double().numpy())
        return rows

    def _audio(self, item, trace: TraceFn | None):
        m = self.model.model
        hooks = _audio_hooks(m, trace) if trace else _Hooks()
        try:
            with torch.no_grad(), self._ctx():
                out = m.get_audio_features(self._t(item.features[None]), torch.tensor(item.mask[None]),
                                           return_dict=True)
        finally:
            hooks.close()
        if trace:
            trace("projected", -1, out.pooler_output[0].double().numpy())
        return out.pooler_output[0][out.attention_mask[0]]

    def _soft(self, prompt: MultimodalPrompt, trace: TraceFn | None):
        rows = []
        for i, it in enumerate(prompt.items):
            tr = prefixed(trace, item_prefix(prompt.items, i))
            rows.append(self._image(it, tr) if it.kind == "image" else self._audio(it, tr))
        return rows

    def soft_tokens(self, prompt: MultimodalPrompt, trace: TraceFn | None = None) -> list[np.ndarray]:
        """``[n_soft, h]`` per item, as float64."""
        rows = [r.double().numpy() for r in self._soft(prompt, trace)]
        check_rows(prompt, rows)
        return rows

    # ------------------------------------------------------------------ decoder

    @contextlib.contextmanager
    def _injected(self, prompt: MultimodalPrompt, rows) -> Iterator[dict[str, Any]]:
        """forward() keywords that make transformers merge ``rows`` (image rows through ``mm_encoder_outputs``,
        audio rows through ``get_audio_features`` answering with them)."""
        m = self.model.model
        img = [r for r, it in zip(rows, prompt.items) if it.kind == "image"]
        aud = [r for r, it in zip(rows, prompt.items) if it.kind == "audio"]
        kw: dict[str, Any] = {}
        if img:
            kw["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=tuple(img))}
        if aud:
            a = torch.cat(aud)[None]
            kw["input_features"] = torch.zeros((1, 1, 1), dtype=self.tdtype)
            kw["input_features_mask"] = torch.ones((1, 1), dtype=torch.bool)
            m.get_audio_features = lambda *args, **kwargs: SimpleNamespace(
                pooler_output=a, attention_mask=torch.ones(a.shape[:2], dtype=torch.bool))
        if prompt.use_types:
            kw["mm_token_type_ids"] = torch.tensor([prompt.token_types.tolist()])
        try:
            yield kw
        finally:
            m.__dict__.pop("get_audio_features", None)

    def logits(self, prompt: MultimodalPrompt, trace: TraceFn | None = None, embeds=None) -> np.ndarray:
        """``[T, V]`` as float64 (float32 or float64 arithmetic, by ``dtype``)."""
        if embeds is None:
            rows = self._soft(prompt, trace)
        else:
            e, rows = self._t(embeds), []
            for it in prompt.items:
                rows.append(e[:it.n_soft])
                e = e[it.n_soft:]
        lm = self.model.model.language_model
        hooks = _decoder_hooks(lm, trace) if trace else _Hooks()
        try:
            with torch.no_grad(), self._ctx(), self._injected(prompt, rows) as kw:
                out = self.model(input_ids=torch.tensor([prompt.ids]), use_cache=False, **kw)
        finally:
            hooks.close()
        logits = out.logits[0].double().numpy()
        if trace:
            hooks.finish(trace, logits)
        return logits

    def generate_full(self, prompt: MultimodalPrompt, max_new_tokens: int) -> Generated:
        """Greedy with transformers' own cache; ``mm_token_type_ids`` on the prefill only."""
        g = Generated()
        with torch.no_grad(), self._ctx(), self._injected(prompt, self._soft(prompt, None)) as kw:
            o = self.model(input_ids=torch.tensor([prompt.ids]), use_cache=True, **kw)
            for _ in range(max_new_tokens):
                g.add(o.logits[0, -1].double().numpy())
                o = self.model(input_ids=torch.tensor([[g.tokens[-1]]]), past_key_values=o.past_key_values,
                               use_cache=True)
        return g


class _Hooks:
    """Registered hook handles, and the decoder's records (reported by :meth:`finish`)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.records: dict[tuple[str, int], np.ndarray] = {}
        self.order: list[tuple[str, int]] = []
        self.restore: list[Any] = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for undo in self.restore:
            undo()
        self.handles, self.restore = [], []

    def put(self, point: str, layer: int, arr) -> None:
        key = (point, layer)
        if key not in self.records:
            self.order.append(key)
        self.records[key] = arr

    def finish(self, trace: TraceFn, logits: np.ndarray) -> None:
        """Report the decoder points in the reference's order, then ``result_output``."""
        rank = {p: i for i, p in enumerate(("attn_out", "ffn_mlp", "ffn_moe", "ffn_out", "per_layer_embd_out",
                                            "l_out"))}
        keys = sorted(self.records, key=lambda k: (0 if k[1] < 0 and k[0].startswith("inp") else
                                                   2 if k[1] < 0 else 1, k[1], rank.get(k[0], 0)))
        for k in keys:
            trace(k[0], k[1], self.records[k])
        trace("result_output", -1, logits)


def _np(t) -> np.ndarray:
    return t.detach()[0].double().numpy()


def _decoder_hooks(lm, trace: TraceFn) -> _Hooks:
    """Forward hooks on transformers' text model reporting the decoder trace points (the same as
    :class:`harness.engines.transformers.TransformersEngine`, with ``inp_scaled`` taken after the merge)."""
    h = _Hooks()
    layer_in: dict[int, Any] = {}
    h.handles.append(lm.register_forward_pre_hook(
        lambda mod, args, kwargs: h.put("inp_scaled", -1, _np(kwargs["inputs_embeds"])), with_kwargs=True))
    h.handles.append(lm.norm.register_forward_hook(lambda mod, a, out: h.put("result_norm", -1, _np(out))))
    ple: dict[int, np.ndarray] = {}
    for i, layer in enumerate(lm.layers):
        has_ple = bool(getattr(layer, "hidden_size_per_layer_input", 0))

        def pre(mod, args, kwargs, i=i, has_ple=has_ple):
            layer_in[i] = args[0]
            p = (args[1] if len(args) > 1 else kwargs.get("per_layer_input")) if has_ple else None
            if p is not None:
                ple[i] = _np(p)
                if len(ple) == len(lm.layers):
                    h.put("inp_per_layer", -1, np.stack([ple[j] for j in sorted(ple)], axis=1))

        h.handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        h.handles.append(layer.post_attention_layernorm.register_forward_hook(
            lambda mod, a, out, i=i: h.put("attn_out", i, _np(layer_in[i] + out))))
        if getattr(layer, "enable_moe_block", False):
            h.handles.append(layer.post_feedforward_layernorm_1.register_forward_hook(
                lambda mod, a, out, i=i: h.put("ffn_mlp", i, _np(out))))
            h.handles.append(layer.post_feedforward_layernorm_2.register_forward_hook(
                lambda mod, a, out, i=i: h.put("ffn_moe", i, _np(out))))
            h.handles.append(layer.post_feedforward_layernorm.register_forward_hook(
                lambda mod, a, out, i=i: h.put("ffn_out", i, _np(a[0]))))
        else:
            h.handles.append(layer.mlp.register_forward_hook(lambda mod, a, out, i=i: h.put("ffn_out", i, _np(out))))
        if has_ple:
            h.handles.append(layer.post_per_layer_input_norm.register_forward_hook(
                lambda mod, a, out, i=i: h.put("per_layer_embd_out", i, _np(out))))
        h.handles.append(layer.register_forward_hook(
            lambda mod, a, out, i=i: h.put("l_out", i, _np(out[0] if isinstance(out, tuple) else out))))
    return h


def _vision_hooks(m, trace: TraceFn, valid) -> _Hooks:
    """Hooks on transformers' vision tower reporting :mod:`reference.vision`'s trace points (per-patch points:
    the valid rows only). ``Qcur_pos`` / ``Kcur_pos`` / ``Vcur_normed`` come from a wrapper around
    ``eager_attention_forward`` (the tensors it is handed), removed by :meth:`_Hooks.close`."""
    h = _Hooks()

    def put(point, il, t, rows=True):
        t = t.detach()
        trace(point, il, (t[0][valid] if rows else t).double().numpy())

    real = mg.eager_attention_forward
    vision_attn = {id(layer.self_attn) for layer in m.vision_tower.encoder.layers}

    def attn(module, q, k, v, *a, **kw):  # q: [1, nH, N, D] after the norm and RoPE; v after v_norm
        if id(module) in vision_attn:
            il = module.layer_idx
            put("Qcur_pos", il, q.transpose(1, 2))
            put("Kcur_pos", il, k.transpose(1, 2))
            put("Vcur_normed", il, v.transpose(1, 2))
        return real(module, q, k, v, *a, **kw)

    mg.eager_attention_forward = attn
    h.restore.append(lambda: setattr(mg, "eager_attention_forward", real))
    vt = m.vision_tower
    h.handles += [
        vt.patch_embedder.input_proj.register_forward_pre_hook(lambda mod, a: put("inp_raw_scaled", -1, a[0])),
        vt.patch_embedder.input_proj.register_forward_hook(lambda mod, a, o: put("inp", -1, o)),
        vt.patch_embedder.register_forward_hook(lambda mod, a, o: put("pos_embd", -1, o)),
        vt.pooler.register_forward_hook(lambda mod, a, o: put("pooled", -1, o[0][o[1]], rows=False)),
    ]
    if vt.config.standardize:
        h.handles.append(vt.register_forward_hook(lambda mod, a, o: put("std_scaled", -1, o.last_hidden_state,
                                                                        rows=False)))
    for il, layer in enumerate(vt.encoder.layers):
        def post(point, il=il):
            return lambda mod, a, o: put(point, il, o)

        def pre(point, il=il):
            return lambda mod, a: put(point, il, a[0])

        h.handles += [
            layer.input_layernorm.register_forward_hook(post("layer_inp_normed")),
            layer.self_attn.o_proj.register_forward_pre_hook(pre("kqv_out")),
            layer.self_attn.o_proj.register_forward_hook(post("attn_out")),
            layer.post_attention_layernorm.register_forward_hook(post("attn_post_normed")),
            layer.pre_feedforward_layernorm.register_forward_pre_hook(pre("ffn_inp")),
            layer.pre_feedforward_layernorm.register_forward_hook(post("ffn_inp_normed")),
            layer.mlp.register_forward_hook(post("ffn_out")),
            layer.post_feedforward_layernorm.register_forward_hook(post("ffn_post_normed")),
            layer.register_forward_hook(post("layer_out")),
        ]
    return h


def _audio_hooks(m, trace: TraceFn) -> _Hooks:
    """Hooks on transformers' audio tower reporting :mod:`reference.audio`'s trace points."""
    h = _Hooks()
    tower = m.audio_tower

    def hook(name, il=-1, pre=False, channels_last=False):
        def f(mod, inp, out=None):
            t = inp[0] if pre else (out[0] if isinstance(out, tuple) else out)
            a = t.detach().double().numpy()[0]
            trace(name, il, np.moveaxis(a, 0, -1) if channels_last else a)
        return f

    h.handles += [
        tower.subsample_conv_projection.register_forward_pre_hook(
            lambda mod, a: trace("inp_raw", -1, (a[0] * a[1][..., None]).detach()[0].double().numpy())),
        tower.subsample_conv_projection.layer0.register_forward_hook(hook("sscp_conv_0", channels_last=True)),
        tower.subsample_conv_projection.layer1.register_forward_hook(hook("sscp_conv_1", channels_last=True)),
        tower.subsample_conv_projection.register_forward_hook(hook("inp_proj")),
        tower.rel_pos_enc.register_forward_hook(
            lambda mod, i, o: trace("pos_emb", -1, o.detach().double().numpy().reshape(-1, o.shape[-1]))),
        tower.output_proj.register_forward_hook(hook("output_proj")),
    ]
    for il, layer in enumerate(tower.layers):
        h.handles += [layer.feed_forward1.register_forward_hook(hook("ffn_1_out", il)),
                      layer.lconv1d.register_forward_pre_hook(hook("attn_out", il, pre=True)),
                      layer.lconv1d.register_forward_hook(hook("conv_out", il)),
                      layer.feed_forward2.register_forward_hook(hook("ffn_2_out", il)),
                      layer.register_forward_hook(hook("layer_out", il))]
    return h
