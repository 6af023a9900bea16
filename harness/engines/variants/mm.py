"""Spec variants of the multimodal merge (soft tokens into the decoder, the per-layer embedding of placeholders, the
image mask). Sources: transformers 5.23 ``models/gemma4/modeling_gemma4.py`` ``Gemma4Model.forward``; llama.cpp
``src/models/gemma4.cpp`` and ``tools/mtmd/mtmd.cpp``; gemma 4.0.1 ``gemma/gm/nn/gemma4/_modules.py``,
``_transformer.py`` and ``gemma/gm/vision/_token_utils.py``.
"""

from __future__ import annotations

import math

import numpy as np

import gemma4_harness.reference.model as rm
from gemma4_harness.reference.multimodal import pad_id as _pad_id

from .core import FAST_MODEL, Patch, Source, Variant

HF_MM = "models/gemma4/modeling_gemma4.py Gemma4Model.forward"
SELFTEST = "harness/selftest/mutants.py"


def _first_layer(cfg, sliding: bool):
    return next((("attn_out", L.index) for L in cfg.layers if L.is_sliding == sliding),
                f"no {'sliding' if sliding else 'full'} layer")


def _bidir(cfg) -> bool:
    return cfg.use_bidirectional_attention == "vision"


def ple_row_zero(orig):
    """:func:`reference.multimodal.pad_id` answering 0: placeholders read row 0 of the PLE table whatever the model's
    ``pad_token_id``."""
    def pad_id(cfg):
        return 0
    return pad_id


def _fast_ple_row_zero(orig):
    """``FastModel.placeholders_to_pad`` setting each sequence's placeholders to 0 (the twin of
    :func:`ple_row_zero`)."""
    import torch  # the fast twin's tensors: only when it runs under the variant

    def placeholders_to_pad(self, batch, ids):
        parts = []
        for i, s in enumerate(batch.seqs):
            part = ids[batch.rows(i)]
            if s.mm is not None:
                part = torch.where(torch.as_tensor(np.asarray(s.mm.placeholder), device=ids.device), 0, part)
            parts.append(part)
        return torch.cat(parts)
    return placeholders_to_pad


def ple_placeholder_row(orig):
    """:func:`reference.multimodal.llm_input_ids` keeping the placeholders' own ids (their token embedding is
    replaced by the soft token anyway, so only the PLE token part reads a different row)."""
    def llm_input_ids(ids, placeholder, pad):
        return np.asarray(ids)
    return llm_input_ids


def _fast_ple_placeholder_row(orig):
    def placeholders_to_pad(self, batch, ids):
        return ids
    return placeholders_to_pad


def soft_tokens_scaled(orig):
    """:func:`reference.multimodal.merge_embeddings` multiplying the soft tokens by ``sqrt(hidden)`` as text rows
    are."""
    def merge_embeddings(x, placeholder, embeds):
        return orig(x, placeholder, np.asarray(embeds) * math.sqrt(x.shape[-1]))
    return merge_embeddings


def image_block_causal(orig):
    """:func:`reference.multimodal.vision_blocks` answering None: image tokens attend causally on every layer."""
    def vision_blocks(cfg, inj):
        return None
    return vision_blocks


def _fast_image_block_causal(orig):
    def _blocks(self, inj):
        return None
    return _blocks


_BLOCKS: list = [None]  # the prompt's image blocks, for bidirectional_full_layers' decoder_layer


def keep_blocks(orig):
    """:func:`reference.multimodal.vision_blocks` noting its answer (for :func:`bidirectional_full_layers`)."""
    def vision_blocks(cfg, inj):
        _BLOCKS[0] = orig(cfg, inj)
        return _BLOCKS[0]
    return vision_blocks


def bidirectional_full_layers(orig):
    """:func:`reference.model.decoder_layer` handing the image blocks to full layers too."""
    def decoder_layer(cfg, layer, W, x, positions, k_pos, cache, ple, trace=rm.no_trace, blocks=None):
        qb = _BLOCKS[0]
        if blocks is None and not layer.is_sliding and qb is not None:
            blocks = (qb, np.concatenate([np.full(cache.n_past, -1), qb]))
        return orig(cfg, layer, W, x, positions, k_pos, cache, ple, trace, blocks)
    return decoder_layer


S_PLE_HF = Source("transformers 5.23", HF_MM, "llm_input_ids = where(multimodal_mask, text_config.pad_token_id, ids), "
                  "then get_per_layer_inputs(llm_input_ids, ...)")
S_PLE_LC = Source("llama.cpp", "src/models/gemma4.cpp build_inp_per_layer ([TAG_GEMMA4_IMG_PADDING])",
                  "embedding batches read row 0 of per_layer_token_embd (\"padding token (ID=0)\")")
S_PLE_JAX = Source("gemma 4.0.1", "gemma/gm/nn/gemma4/_modules.py Embedder.encode_per_layer_input",
                   "ids outside [0, vocab) read row 0; soft tokens are -2 / -4 (gemma/gm/vision/_token_utils.py)")
S_MASK = (Source("transformers 5.23", HF_MM, "bidirectional image blocks on sliding layers when "
                 "use_bidirectional_attention == 'vision'"),
          Source("gemma 4.0.1", "gemma/gm/nn/gemma4/_transformer.py Transformer._encode_and_get_inputs",
                 "sliding_attention_mask with the image blocks for 'vision'; global layers causal"),
          Source("llama.cpp", "tools/mtmd/mtmd.cpp mtmd_decode_use_non_causal; src/models/gemma4.cpp "
                 "load_arch_hparams", "non-causal on SWA layers only, and never at text width 1536 or 2560"))

MM_VARIANTS: tuple[Variant, ...] = (
    Variant("mm_ple_row_zero", "multimodal", "disagreement",
            "placeholders read PLE row 0, whatever pad_token_id says", "the pad_token_id row (transformers)",
            (S_PLE_LC, S_PLE_JAX, S_PLE_HF), ("llama.cpp", "gemma 4.0.1 (JAX)"), "mm_ple_row",
            lambda c: ("inp_per_layer", -1) if c.ple_dim and _pad_id(c) != 0 else
            ("the model has no PLE" if not c.ple_dim else "pad_token_id is 0: every rule reads row 0"),
            (Patch(rm, "pad_id", ple_row_zero),), (Patch(FAST_MODEL, "placeholders_to_pad", _fast_ple_row_zero),),
            ple_row_zero),
    Variant("mm_ple_placeholder_row", "multimodal", "fault",
            "the PLE token part at placeholders reads the placeholder id's own row", "the pad_token_id row",
            (S_PLE_HF, S_PLE_LC, Source("harness", f"{SELFTEST} PlePlaceholderId",
                                        "the self-test's mm_ple_placeholder_id mutant")), (), "mm_ple_row",
            lambda c: ("inp_per_layer", -1) if c.ple_dim else "the model has no PLE",
            (Patch(rm, "llm_input_ids", ple_placeholder_row),),
            (Patch(FAST_MODEL, "placeholders_to_pad", _fast_ple_placeholder_row),), ple_placeholder_row),
    Variant("mm_soft_tokens_scaled", "multimodal", "fault", "soft tokens multiplied by sqrt(hidden) when merged",
            "soft tokens merged as the projector gives them",
            (Source("llama.cpp", "src/models/gemma4.cpp llama_model_gemma4::graph::graph",
                    "ggml_scale(inpL, ubatch.token ? sqrtf(n_embd) : 1.0f)"),
             Source("transformers 5.23", HF_MM, "soft tokens scattered into the already scaled inputs_embeds"),
             Source("harness", f"{SELFTEST} SqrtHInjected", "the self-test's mm_sqrt_h_injected mutant")), (),
            "mm_merge_scale", lambda c: ("inp_scaled", -1), (Patch(rm, "merge_embeddings", soft_tokens_scaled),),
            (), soft_tokens_scaled),
    Variant("mm_image_block_causal", "multimodal", "disagreement",
            "image tokens attend causally on sliding layers although the config asks for bidirectional blocks",
            "bidirectional image blocks on sliding layers (use_bidirectional_attention = 'vision')", S_MASK,
            ("llama.cpp at text widths 1536 and 2560 (tools/mtmd/mtmd.cpp)",), "mm_mask",
            lambda c: _first_layer(c, True) if _bidir(c) else "the model attends causally already",
            (Patch(rm, "vision_blocks", image_block_causal),),
            (Patch(FAST_MODEL, "_blocks", _fast_image_block_causal),), image_block_causal),
    Variant("mm_bidirectional_full_layers", "multimodal", "fault",
            "the image blocks are bidirectional on full layers too", "full layers stay causal", S_MASK, (), "mm_mask",
            lambda c: _first_layer(c, False) if _bidir(c) else "the model has no bidirectional image blocks",
            (Patch(rm, "vision_blocks", keep_blocks), Patch(rm, "decoder_layer", bidirectional_full_layers)), (),
            bidirectional_full_layers),
)
"""The multimodal merge's variants."""
