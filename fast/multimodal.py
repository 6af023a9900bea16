"""The multimodal merge in torch: the twins of :mod:`reference.multimodal`'s ops, and where prefill chunks may end.

Same names and signatures as the reference (``llm_input_ids``, ``merge_embeddings``, ``block_ids``,
``vision_blocks``); :class:`reference.multimodal.Injection` carries a prompt's soft tokens (numpy or
torch rows) and types into :meth:`fast.model.FastModel.step`, one per sequence.

**Chunked prefill and the KV cache.** On a sliding layer the first token of an image attends to the
image's last token, so no layer past the first can produce final K/V for an image token before the
whole image has been through the layer below: K/V of a partly prefilled image would have to be
recomputed. The cache therefore holds only final K/V, and a bidirectional image block is always
prefilled in one step: :func:`chunk_end` moves a chunk boundary that falls inside a block to the
block's end (never back, so every step makes progress; a step may then hold up to chunk + block
tokens). Keys of earlier steps are never in the current step's block, so a step needs block ids for
its new tokens only; decode steps are causal (transformers passes ``mm_token_type_ids`` on prefill
only). llama.cpp does the same by decoding an image in one ubatch (``n_ubatch`` >= image tokens);
mlx-vlm PR #1442 is the failure this avoids (a bidirectional overlay that breaks when queries and
keys differ in number, as in chunked prefill).
"""

from __future__ import annotations

import numpy as np
import torch

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.errors import PromptError
from gemma4_harness.reference.multimodal import MM_TYPE_IMAGE, MM_TYPE_VIDEO, Injection
from gemma4_harness.reference.multimodal import block_ids as _block_ids_np


def llm_input_ids(ids: torch.Tensor, placeholder: torch.Tensor, pad: int) -> torch.Tensor:
    """Token ids with every placeholder replaced by ``pad``. [T], [T] bool -> [T].

    Source: reference ``llm_input_ids``.
    """
    return torch.where(placeholder, torch.full_like(ids, pad), ids)


def merge_embeddings(x: torch.Tensor, placeholder: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Replace the placeholder rows of ``x`` by ``embeds`` in order, in x's dtype; no scaling.

    [T, h], [T] bool, [n, h] -> [T, h].

    Raises:
        PromptError: the number of placeholders differs from the number of rows (both named).

    Source: reference ``merge_embeddings``.
    """
    n_ph, n_rows = int(placeholder.sum()), int(embeds.shape[0])
    if n_ph != n_rows:
        raise PromptError(f"prompt has {n_ph} placeholder tokens but {n_rows} soft-token rows were given")
    out = x.clone()
    out[placeholder] = embeds.to(device=x.device, dtype=x.dtype)
    return out


def block_ids(token_types: torch.Tensor) -> torch.Tensor:
    """Bidirectional block of each token (maximal runs of image/video types, numbered by run start), -1
    elsewhere. [T] -> [T] int64. Source: reference ``block_ids``.
    """
    vision = (token_types == MM_TYPE_IMAGE) | (token_types == MM_TYPE_VIDEO)
    prev = torch.cat([vision.new_zeros(1), vision[:-1]])
    starts = vision & ~prev
    return torch.where(vision, torch.cumsum(starts.long(), 0) - 1, torch.full_like(token_types, -1, dtype=torch.long))


def vision_blocks(cfg: ModelConfig, inj: Injection | None) -> torch.Tensor | None:
    """:func:`block_ids` when bidirectional vision attention applies (``use_bidirectional_attention ==
    "vision"`` and types given), else None. [T] -> [T] int64 (CPU). Source: reference ``vision_blocks``.
    """
    if cfg.use_bidirectional_attention != "vision" or inj is None or inj.token_types is None:
        return None
    return block_ids(torch.as_tensor(np.asarray(inj.token_types), dtype=torch.long))


def chunk_end(cfg: ModelConfig, inj: Injection | None, start: int, size: int, n_tokens: int) -> int:
    """End of the prefill chunk that starts at ``start``: ``start + size``, moved forward to the end of
    the bidirectional block it would cut (see the module docstring); at most ``n_tokens``.

    Args:
        cfg: model config (``use_bidirectional_attention``).
        inj: the whole prompt's injection (or None).
        start, size: the chunk's first token and nominal length (> 0).
        n_tokens: the prompt's length.
    """
    end = min(start + size, n_tokens)
    if end >= n_tokens or cfg.use_bidirectional_attention != "vision" or inj is None or inj.token_types is None:
        return end
    blocks = _block_ids_np(np.asarray(inj.token_types))
    while end < n_tokens and blocks[end - 1] >= 0 and blocks[end] == blocks[end - 1]:
        end += 1
    return end
