"""Prompt layout of multimodal inputs: placeholder expansion and ``mm_token_type_ids``.

An image placeholder token in a prompt becomes ``boi + image_token * n + eoi``
(n = the image's soft tokens); a video frame becomes its timestamp text, then
``boi + video_token * n + eoi``. ``mm_token_type_ids`` marks the soft-token
positions: 0 text (boi and eoi included), 1 image, 2 video, 3 audio.

Sources: transformers ``Gemma4Processor.replace_image_token`` /
``replace_video_token`` (``processing_gemma4.py``), ``Gemma4Config`` (ids),
``Gemma4Model.forward`` (token types); llama.cpp ``tools/mtmd/mtmd.cpp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import ConfigError, PromptError

MM_TYPE_TEXT, MM_TYPE_IMAGE, MM_TYPE_VIDEO, MM_TYPE_AUDIO = 0, 1, 2, 3


@dataclass(frozen=True)
class MultimodalTokenIds:
    """Special token ids of the image and video blocks (transformers ``Gemma4Config`` defaults)."""

    image_token_id: int = 258880
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    video_token_id: int = 258884

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> "MultimodalTokenIds":
        """Ids from a multimodal ``config.json``; absent fields keep the defaults.

        Raises:
            ConfigError: a field that is not a non-negative integer, or two roles sharing one id.
        """
        kw = {}
        for name in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"):
            v = raw.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{source}: {name} = {v!r}: expected a non-negative integer")
            kw[name] = v
        ids = cls(**kw)
        values = [ids.image_token_id, ids.boi_token_id, ids.eoi_token_id, ids.video_token_id]
        if len(set(values)) != len(values):
            raise ConfigError(f"{source}: image/boi/eoi/video token ids must differ, got {values}")
        return ids


def image_block(n_soft: int, tok: MultimodalTokenIds) -> tuple[list[int], list[int]]:
    """``boi + image_token * n + eoi`` and its token types ``0, 1 * n, 0``."""
    return ([tok.boi_token_id] + [tok.image_token_id] * n_soft + [tok.eoi_token_id],
            [MM_TYPE_TEXT] + [MM_TYPE_IMAGE] * n_soft + [MM_TYPE_TEXT])


def expand_image_placeholders(ids: Sequence[int], n_soft_per_image: Sequence[int],
                              tok: MultimodalTokenIds = MultimodalTokenIds()) -> tuple[list[int], list[int]]:
    """Replace each image placeholder (one ``image_token_id``) by the image's block, in order.

    Args:
        ids: prompt token ids with one ``image_token_id`` per image.
        n_soft_per_image: soft tokens of each image, in order of appearance.
        tok: the special ids.

    Returns:
        ``(ids, mm_token_type_ids)`` of equal length: 1 on image soft tokens, 0 elsewhere.

    Raises:
        PromptError: the number of placeholders differs from the number of images,
            a count < 1, or a boi/eoi token already in the prompt.
    """
    ids = [int(t) for t in ids]
    n_placeholders = sum(t == tok.image_token_id for t in ids)
    if n_placeholders != len(n_soft_per_image):
        raise PromptError(f"prompt has {n_placeholders} image placeholders (id {tok.image_token_id}) "
                          f"but {len(n_soft_per_image)} images were given")
    if any(n < 1 for n in n_soft_per_image):
        raise PromptError(f"an image has {min(n_soft_per_image)} soft tokens: expected at least 1")
    stray = [t for t in ids if t in (tok.boi_token_id, tok.eoi_token_id)]
    if stray:
        raise PromptError(f"prompt already holds the image begin/end token {stray[0]}; pass placeholders only")
    out, types, counts = [], [], iter(n_soft_per_image)
    for t in ids:
        if t == tok.image_token_id:
            block, block_types = image_block(int(next(counts)), tok)
            out += block
            types += block_types
        else:
            out.append(t)
            types.append(MM_TYPE_TEXT)
    return out, types


def video_frame_block(timestamp_ids: Sequence[int], n_soft: int,
                      tok: MultimodalTokenIds = MultimodalTokenIds()) -> tuple[list[int], list[int]]:
    """One video frame: its tokenized ``"mm:ss "`` text, then ``boi + video_token * n + eoi``.

    Returns:
        ``(ids, mm_token_type_ids)``: 2 on the video soft tokens, 0 elsewhere.

    Raises:
        PromptError: ``n_soft`` < 1.
    """
    if n_soft < 1:
        raise PromptError(f"a video frame has {n_soft} soft tokens: expected at least 1")
    ids = list(timestamp_ids) + [tok.boi_token_id] + [tok.video_token_id] * n_soft + [tok.eoi_token_id]
    types = [MM_TYPE_TEXT] * (len(timestamp_ids) + 1) + [MM_TYPE_VIDEO] * n_soft + [MM_TYPE_TEXT]
    return ids, types
