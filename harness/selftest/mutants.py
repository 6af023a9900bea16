"""The self-test's mutants: each one known fault class, injected into the fast path by overriding ONE
of :class:`fast.model.FastModel`'s block functions (or by changing the config, the weights or the RoPE
table it is built with). ``fast/`` itself is never modified.

:data:`MM_MUTANTS` are the multimodal ones: a :class:`fast.model.FastModel` method, or ONE module function of the
encoders (:mod:`fast.vision`, :mod:`fast.audio`; the mel front end, :mod:`reference.audio_features`, which the fast
path shares) replaced while the mutant runs and restored after, or the encoder weights.

:data:`MUTANTS` are real faults: each must be detected, first at :attr:`Mutant.expected`.
:data:`EQUIVALENT` are mathematically equivalent changes: each must stay within the gates (the claim
is checked, not just stated).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from gemma4_harness.fast import audio as FA
from gemma4_harness.fast import vision as FV
from gemma4_harness.fast.model import FastModel, StepBatch, attention, embed_rows, linear, rms_norm
from gemma4_harness.fast.multimodal import merge_embeddings
from gemma4_harness.reference import audio_features as AF
from gemma4_harness.reference.config import LayerSpec, ModelConfig

_rope_2d = FV.rope_2d  # bound at import: a mutant swaps the module's name while it runs
_magnitude_spectrum = AF.magnitude_spectrum


def _fast(cls: type[FastModel] = FastModel) -> Callable[[ModelConfig, Any], FastModel]:
    """The builder of a mutant class: the fast path on the CPU in float32."""
    return lambda cfg, W: cls(cfg, W, "cpu", "float32")


def _with_cfg(**changes) -> Callable[[ModelConfig, Any], FastModel]:
    """A mutant made by building the unmodified fast path from an altered config."""
    return lambda cfg, W: FastModel(dataclasses.replace(cfg, **changes), W, "cpu", "float32")


# --------------------------------------------------------------------------- one overridden function each


class AttnScale(FastModel):
    """``attend``: q.k scaled by 1/sqrt(head_dim) instead of Gemma 4's 1.0 (the bidirectional image blocks kept, as
    :meth:`fast.model.FastModel.attend` passes them)."""

    def attend(self, layer, q, k, v, q_pos, k_pos, q_block=None, masks=None):
        window = self.cfg.sliding_window if layer.is_sliding else None
        k_block = None if q_block is None else torch.cat([q_block.new_full((k.shape[0] - q.shape[0],), -1), q_block])
        return attention(q, k, v, q_pos, k_pos, window, 1.0 / math.sqrt(layer.head_dim), q_block, k_block, masks)


class ExpertsSwiGLU(FastModel):
    """``moe_experts``: the experts gate with SiLU (SwiGLU) instead of GELU-tanh."""

    def moe_experts(self, layer, x, idx, wgt):
        b = f"blk.{layer.index}."
        gate_up, down = self.w[b + "ffn_gate_up_exps.weight"], self.w[b + "ffn_down_exps.weight"]
        Fdim = down.shape[2]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, g in zip(idx[t].tolist(), wgt[t]):
                gu = linear(x[t:t + 1], gate_up[e])
                out[t] += g * linear(F.silu(gu[:, :Fdim]) * gu[:, Fdim:], down[e])[0]
        return out


class RouterPrenormed(FastModel):
    """``moe_route``: the router fed the dense MLP's pre-FFN-normed input instead of the residual."""

    def moe_route(self, layer, x):
        return super().moe_route(layer, rms_norm(x, self.w[f"blk.{layer.index}.ffn_norm.weight"], self.cfg.rms_eps))


class RouterRMSNormed(FastModel):
    """``moe_route``: the router fed rms_norm(x) without weight (equivalent: the router normalises first)."""

    def moe_route(self, layer, x):
        return super().moe_route(layer, rms_norm(x, None, self.cfg.rms_eps))


class PleTokenUnscaled(FastModel):
    """``ple_token``: the PLE token part not scaled by sqrt(P)."""

    def ple_token(self, ids, check=True):
        N, L, P = ids.shape[0], self.cfg.n_layer, self.cfg.ple_dim
        return embed_rows(self.w["per_layer_token_embd.weight"], ids, check).reshape(N, L, P)


class PleNoInvSqrt2(FastModel):
    """``per_layer_inputs``: (context + token) not scaled by 1/sqrt(2) (equivalent: see :data:`EQUIVALENT`)."""

    def per_layer_inputs(self, ids, x, check=True):
        return self.ple_context(x) + self.ple_token(ids, check)


class LayerScalarBranch(FastModel):
    """``layer_scale``: the scalar applied to the layer's residual branch only, ``x + s (y - x)``, instead of
    the whole stream ``s y`` (``decoder_layer`` only hands it the layer's input)."""

    def decoder_layer(self, layer: LayerSpec, x, batch: StepBatch, ple, tr=None, attention_block=None):
        self._layer_input = x
        return super().decoder_layer(layer, x, batch, ple, *(() if tr is None else (tr,)),
                                     attention_block=attention_block)

    def layer_scale(self, layer, y):
        name = f"blk.{layer.index}.layer_output_scale.weight"
        if name not in self.w:
            return y
        x = self._layer_input
        return x + (y - x) * self.w[name].to(y.dtype)


# --------------------------------------------------------------------------- config, weights and table mutants


def first_same_type_donors(cfg: ModelConfig) -> list[int]:
    """The wrong donor rule: a shared layer reads the *first* non-shared layer of its type (transformers
    ``Gemma4TextConfig.kv_sharing_modes`` takes the last)."""
    first_shared = cfg.n_layer - cfg.n_kv_shared
    out = []
    for L in cfg.layers:
        if L.has_kv:
            out.append(L.index)
        else:
            out.append(next(j for j in range(first_shared) if cfg.layers[j].is_sliding == L.is_sliding))
    return out


def _donor_changed(cfg: ModelConfig) -> list[int]:
    wrong = first_same_type_donors(cfg)
    return [L.index for L in cfg.layers if not L.has_kv and wrong[L.index] != L.kv_donor]


def _wrong_donor(cfg: ModelConfig, W) -> FastModel:
    wrong = first_same_type_donors(cfg)
    layers = tuple(dataclasses.replace(L, kv_donor=wrong[L.index]) for L in cfg.layers)
    return FastModel(dataclasses.replace(cfg, layers=layers), W, "cpu", "float32")


def _window_plus_one(cfg: ModelConfig, W) -> FastModel:
    return FastModel(dataclasses.replace(cfg, sliding_window=cfg.sliding_window + 1), W, "cpu", "float32")


def _norms_plus_one(cfg: ModelConfig, W) -> FastModel:
    fm = FastModel(cfg, W, "cpu", "float32")
    for name in list(fm.w.t):
        if name.endswith("norm.weight") or "_norm_" in name and name.endswith(".weight"):
            fm.w.t[name] = fm.w.t[name] + 1.0
    return fm


def _proportional_layers(cfg: ModelConfig) -> list[LayerSpec]:
    return [L for L in cfg.layers if L.rope_freq_factors is not None and np.any(L.rope_freq_factors != 1.0)]


def _set_inv_freq(fm: FastModel, il: int, inv: np.ndarray) -> None:
    fm.inv_freq[il] = torch.tensor(inv, dtype=torch.float64)
    fm._rope_cache.pop(il, None)


def _rope_exponent_rotated(cfg: ModelConfig, W) -> FastModel:
    """Proportional RoPE with exponents over the rotated dims: ``base^(-2i / n_rotated)`` instead of
    ``base^(-2i / head_dim)`` for the rotated pairs (the unrotated pairs keep inverse frequency ~0)."""
    fm = FastModel(cfg, W, "cpu", "float32")
    for L in _proportional_layers(cfg):
        n_pairs = int(np.sum(L.rope_freq_factors == 1.0))
        i = np.arange(0, 2 * n_pairs, 2, dtype=np.float64)
        inv = np.zeros(L.n_rot // 2)
        inv[:n_pairs] = L.rope_base ** (-i / (2 * n_pairs)) * L.rope_scale
        _set_inv_freq(fm, L.index, inv)
    return fm


def _rope_factors_fp16(cfg: ModelConfig, W) -> FastModel:
    """Frequency factors rounded to float16: 1.0 stays 1.0, 1e30 overflows to inf (inverse frequency 0)."""
    fm = FastModel(cfg, W, "cpu", "float32")
    for L in cfg.layers:
        if L.rope_freq_factors is None:
            continue
        with np.errstate(over="ignore"):
            f16 = L.rope_freq_factors.astype(np.float16).astype(np.float64)
        i = np.arange(0, L.n_rot, 2, dtype=np.float64)
        inv = L.rope_base ** (-i / L.n_rot) * L.rope_scale / f16
        _set_inv_freq(fm, L.index, inv)
    return fm


# --------------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Mutant:
    """One fault class.

    Attributes:
        name: short id.
        fault: what the mutant computes differently, one sentence.
        exercised_by: which cases can show it, one phrase.
        applies: config -> whether this case exercises the fault.
        expected: config -> the (point, layer) where the fault must first show.
        make: (config, weights) -> the mutant model.
        equivalent: for an excluded, mathematically equivalent mutant: why it cannot change the output
            (the selftest checks that it stays within the gates); None for a real mutant.
    """

    name: str
    fault: str
    exercised_by: str
    applies: Callable[[ModelConfig], bool]
    expected: Callable[[ModelConfig], tuple[str, int]] | None
    make: Callable[[ModelConfig, Any], FastModel]
    equivalent: str | None = None


def _first_sliding(cfg: ModelConfig) -> int:
    return next(L.index for L in cfg.layers if L.is_sliding)


def _first_moe(cfg: ModelConfig) -> int:
    return next(L.index for L in cfg.layers if L.has_moe)


def _has_moe(cfg: ModelConfig) -> bool:
    return any(L.has_moe for L in cfg.layers)


MUTANTS: tuple[Mutant, ...] = (
    Mutant("attn_scale", "attention scores scaled by 1/sqrt(head_dim) instead of Gemma 4's 1.0",
           "every case", lambda c: True, lambda c: ("attn_out", 0), _fast(AttnScale)),
    Mutant("v_norm_dropped", "no weightless RMSNorm on V", "every case", lambda c: c.has_v_norm,
           lambda c: ("attn_out", 0), _with_cfg(has_v_norm=False)),
    Mutant("kv_donor_first", "a KV-shared layer reads the first non-shared layer of its type instead of the "
           "last (transformers' rule)", "KV-shared cases whose type has 2+ non-shared layers (e2b, e4b, e4b-wide)",
           lambda c: bool(_donor_changed(c)), lambda c: ("attn_out", _donor_changed(c)[0]), _wrong_donor),
    Mutant("rope_exponent_rotated", "proportional RoPE with exponents over the rotated dims "
           "(base^(-2i/n_rot_eff)) instead of the full head_dim", "every case (full layers, partial rotary 0.25)",
           lambda c: bool(_proportional_layers(c)), lambda c: ("attn_out", _proportional_layers(c)[0].index),
           _rope_exponent_rotated),
    Mutant("experts_swiglu", "experts gate with SiLU (SwiGLU) instead of GELU-tanh", "MoE (26b-a4b)",
           _has_moe, lambda c: ("ffn_moe", _first_moe(c)), _fast(ExpertsSwiGLU)),
    Mutant("softcap_dropped", "final logit softcap not applied", "cases with a softcap (all but edge-no-softcap)",
           lambda c: c.final_logit_softcap is not None, lambda c: ("result_output", -1),
           _with_cfg(final_logit_softcap=None)),
    Mutant("norm_plus_one", "every RMSNorm weight used as 1 + w (the Gemma 3 convention)", "every case",
           lambda c: True, lambda c: ("inp_per_layer", -1) if c.ple_dim else ("attn_out", 0), _norms_plus_one),
    Mutant("router_prenormed", "router fed rms_norm(a) * ffn_norm (the dense MLP's pre-FFN-normed input) "
           "instead of the residual a", "MoE (26b-a4b)", _has_moe, lambda c: ("ffn_moe", _first_moe(c)),
           _fast(RouterPrenormed)),
    Mutant("ple_token_unscaled", "PLE token part not scaled by sqrt(P)", "PLE (e2b, e4b, e4b-wide, edge-keqv)",
           lambda c: bool(c.ple_dim), lambda c: ("inp_per_layer", -1), _fast(PleTokenUnscaled)),
    Mutant("layer_scalar_branch", "layer scalar applied to the layer's residual branch only "
           "(x + s * (y - x)) instead of the whole stream (s * y)", "every case", lambda c: c.has_layer_scalar,
           lambda c: ("l_out", 0), _fast(LayerScalarBranch)),
    Mutant("window_off_by_one", "sliding layers attend window + 1 keys (pos_i - pos_j <= window)",
           "cases with sliding layers, prompts longer than the window", lambda c: any(L.is_sliding for L in c.layers),
           lambda c: ("attn_out", _first_sliding(c)), _window_plus_one),
)
"""The real mutants (each must be detected, first at ``expected``)."""

EQUIVALENT: tuple[Mutant, ...] = (
    Mutant("rope_factors_fp16", "RoPE frequency factors rounded to float16", "proportional-RoPE full layers",
           lambda c: bool(_proportional_layers(c)), None, _rope_factors_fp16,
           equivalent="Gemma 4's factor table holds only 1.0 (exact in fp16) and 1e30, which overflows fp16 to "
           "inf: the unrotated pairs' inverse frequency becomes 0 instead of ~1e-30 * base^(-2i/D). Their "
           "rotation angle pos * 1e-30 stays below 1e-24 rad at any position in the context, so cos is exactly 1 "
           "and x * sin is far below half an ulp of the other term in fp32 and fp64: no result changes. (Not "
           "equivalent for a table with finite factors that fp16 cannot hold exactly, e.g. llama3-style ones.)"),
    Mutant("ple_no_inv_sqrt2", "PLE inputs (context + token) not scaled by 1/sqrt(2)", "PLE cases",
           lambda c: bool(c.ple_dim), None, _fast(PleNoInvSqrt2),
           equivalent="a uniform factor on the per-layer input enters the PLE branch multiplicatively "
           "(gelu(gate y) * ple), passes the linear projection and is removed by its post_norm RMSNorm; only "
           "the eps (1e-6 against a mean square of order 1) sees it. inp_per_layer itself changes by exactly "
           "sqrt(2) (cosine 1: a relative-L2 rule would flag the point, not the model)."),
    Mutant("router_rmsnormed", "router fed rms_norm(a) (no weight) instead of a", "MoE (26b-a4b)", _has_moe,
           None, _fast(RouterRMSNormed),
           equivalent="the router RMS-normalises its input first, and RMSNorm without weight is idempotent up "
           "to eps (a unit-RMS vector keeps RMS 1), so the scores and the top-k choice are unchanged."),
)
"""Mathematically equivalent mutants: excluded from detection, each with the reason (and checked)."""


# --------------------------------------------------------------------------- multimodal: one overridden function each


class SqrtHInjected(FastModel):
    """``merge``: the soft tokens multiplied by sqrt(h), as text rows are (transformers and llama.cpp inject them
    unscaled)."""

    def merge(self, batch, x):
        parts = []
        for i, s in enumerate(batch.seqs):
            part = x[batch.rows(i)]
            if s.mm is not None:
                ph = torch.as_tensor(np.asarray(s.mm.placeholder), device=x.device)
                part = merge_embeddings(part, ph, torch.as_tensor(s.mm.embeds) * math.sqrt(self.cfg.hidden_size))
            parts.append(part)
        return torch.cat(parts)


class PlePlaceholderId(FastModel):
    """``placeholders_to_pad``: placeholders keep their own id, so the PLE token part reads the image/audio token's
    row instead of the pad row (Crane PR #23)."""

    def placeholders_to_pad(self, batch, ids):
        return ids


class CausalImageBlock(FastModel):
    """``_blocks``: no bidirectional block: image tokens attend causally on sliding layers too (vLLM #40106)."""

    def _blocks(self, inj):
        return None


class BidirectionalFullLayers(FastModel):
    """``attend``: full layers get the image blocks too (bidirectional everywhere; ``decoder_layer`` only hands it
    the step's bookkeeping, as :class:`LayerScalarBranch` does)."""

    def decoder_layer(self, layer: LayerSpec, x, batch: StepBatch, ple, tr=None, attention_block=None):
        self._batch = batch
        return super().decoder_layer(layer, x, batch, ple, *(() if tr is None else (tr,)),
                                     attention_block=attention_block)

    def attend(self, layer, q, k, v, q_pos, k_pos, q_block=None, masks=None):
        blocks = getattr(self, "_batch", None) and self._batch.blocks
        if q_block is None and not layer.is_sliding and blocks and len(blocks) == 1 and blocks[0] is not None:
            q_block = blocks[0]
        return super().attend(layer, q, k, v, q_pos, k_pos, q_block, masks)


def rope_2d_xy_swapped(x, positions, theta):
    """:func:`fast.vision.rope_2d` with the x and y coordinates swapped (the first half rotated by the row)."""
    return _rope_2d(x, positions[:, [1, 0]], theta)


def pool_cells_column_major(positions, k):
    """:func:`fast.vision.pool_cells` numbering the cells column by column instead of row by row."""
    pos = positions.clamp(min=0)
    cells_per_col = (int(pos[:, 1].max()) + 1) // k
    return pos[:, 1] // k + cells_per_col * (pos[:, 0] // k)


def power_spectrum(frames, cfg):
    """:func:`reference.audio_features.magnitude_spectrum` squared: the power spectrum instead of the magnitude."""
    return _magnitude_spectrum(frames, cfg) ** 2


def softcap_dropped(x, cap):
    """:func:`fast.model.softcap` as the audio attention calls it, doing nothing: the logit softcap 50 dropped."""
    return x


def clip_bounds_ignored(cfg, W, name):
    """:func:`fast.vision.clip_bounds` answering "no bounds": every ClippableLinear runs unclamped."""
    return None


def _per_dim_scale_raw(fm) -> None:
    """The audio weights' ``per_dim_scale`` put back to the raw parameter (``softplus^-1`` of the stored value): an
    engine that reads the HF parameter and forgets the softplus."""
    for name, t in list(fm.aw.t.items()):
        if name.endswith("per_dim_scale.weight"):
            fm.aw.t[name] = torch.log(torch.expm1(t.double())).float()


@dataclass(frozen=True)
class MMMutant:
    """One multimodal fault class, run on a multimodal case's prompt (encoder points ``v<i>.`` / ``a<j>.`` first).

    Attributes:
        name, fault, exercised_by: as :class:`Mutant`.
        applies: (model, prompt) -> whether the case and prompt exercise the fault.
        expected: (model, prompt) -> the (point, layer) where it must first show.
        model: the :class:`fast.model.FastModel` subclass with the overridden method (None: the unmutated one).
        patch: ``(module, name, function)``: a module function replaced while the mutant runs (the encoders are
            module functions; the mel front end is the reference's, which the fast path uses too), or None.
        weights: a change to the built engine's encoder weights, or None.
    """

    name: str
    fault: str
    exercised_by: str
    applies: Callable[[Any, Any], bool]
    expected: Callable[[Any, Any], tuple[str, int]]
    model: type[FastModel] | None = None
    patch: tuple[Any, str, Callable[..., Any]] | None = None
    weights: Callable[[Any], None] | None = None


def _has(kind: str) -> Callable[[Any, Any], bool]:
    return lambda mm, pr: any(it.kind == kind for it in pr.items)


def _bidir(mm, pr) -> bool:
    return mm.cfg.use_bidirectional_attention == "vision" and pr.use_types and _has("image")(mm, pr)


def _first(kind: str, point: str, layer: int = -1) -> Callable[[Any, Any], tuple[str, int]]:
    """The point of the first item of ``kind`` (prompt order)."""
    return lambda mm, pr: (f"{'v' if kind == 'image' else 'a'}0.{point}", layer)


def _layer_of(sliding: bool) -> Callable[[Any, Any], tuple[str, int]]:
    return lambda mm, pr: ("attn_out", next(L.index for L in mm.cfg.layers if L.is_sliding == sliding))


MM_MUTANTS: tuple[MMMutant, ...] = (
    MMMutant("mm_sqrt_h_injected", "image and audio soft tokens multiplied by sqrt(hidden) when merged",
             "every multimodal case", lambda mm, pr: bool(pr.items), lambda mm, pr: ("inp_scaled", -1),
             model=SqrtHInjected),
    MMMutant("mm_ple_placeholder_id", "the PLE token part at placeholders reads the placeholder id's row, not the "
             "pad id's", "PLE cases (mm-llamacpp)", lambda mm, pr: bool(pr.items) and bool(mm.cfg.ple_dim),
             lambda mm, pr: ("inp_per_layer", -1), model=PlePlaceholderId),
    MMMutant("mm_causal_image_block", "image tokens attend causally on sliding layers (no bidirectional block)",
             "use_bidirectional_attention = vision (mm-llamacpp)", _bidir, _layer_of(True), model=CausalImageBlock),
    MMMutant("mm_bidirectional_full_layers", "the image block is bidirectional on full layers too",
             "use_bidirectional_attention = vision (mm-llamacpp)", _bidir, _layer_of(False),
             model=BidirectionalFullLayers),
    MMMutant("mm_rope_xy_swapped", "vision 2-D RoPE: x and y swapped (first half rotated by the row)",
             "every case with a vision tower", _has("image"), _first("image", "Qcur_pos", 0),
             patch=(FV, "rope_2d", rope_2d_xy_swapped)),
    MMMutant("mm_pool_column_major", "vision pooler numbers its cells column by column", "every case with a vision "
             "tower", _has("image"), _first("image", "pooled"), patch=(FV, "pool_cells", pool_cells_column_major)),
    MMMutant("mm_power_spectrum", "audio front end: power spectrum |X|^2 instead of the magnitude |X|",
             "every case with an audio tower", _has("audio"), _first("audio", "inp_raw"),
             patch=(AF, "magnitude_spectrum", power_spectrum)),
    MMMutant("mm_audio_softcap_dropped", "audio attention logits not soft-capped (cap 50)",
             "every case with an audio tower", _has("audio"), _first("audio", "attn_out", 0),
             patch=(FA, "softcap", softcap_dropped)),
    MMMutant("mm_per_dim_scale_no_softplus", "audio query scale uses per_dim_scale itself, not softplus(per_dim_scale)",
             "every case with an audio tower", _has("audio"), _first("audio", "attn_out", 0),
             weights=_per_dim_scale_raw),
    MMMutant("mm_clip_bounds_ignored", "vision ClippableLinear bounds ignored", "vision towers with clipped linears "
             "(mm-llamacpp)", lambda mm, pr: _has("image")(mm, pr) and mm.vision[0].use_clipped_linears,
             _first("image", "Qcur_pos", 0), patch=(FV, "clip_bounds", clip_bounds_ignored)),
)
"""The multimodal mutants (each must be detected, first at ``expected``)."""
