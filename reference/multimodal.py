"""Multimodal prompts: placeholder expansion, ``mm_token_type_ids``, and the merge into the text decoder.

An image placeholder token in a prompt becomes ``boi + image_token * n + eoi``
(n = the image's soft tokens); a video frame becomes its timestamp text, then
``boi + video_token * n + eoi``. ``mm_token_type_ids`` marks the soft-token
positions: 0 text (boi and eoi included), 1 image, 2 video, 3 audio.

The merge (the ops :func:`reference.model.forward` composes when given an :class:`Injection`):

* :func:`llm_input_ids`: placeholders become the pad id before any table lookup, so the scaled
  token embedding and the PLE *token* part read the pad row there;
* :func:`merge_embeddings`: the placeholder rows of ``E[ids] * sqrt(h)`` are replaced by the
  injected soft tokens in order of appearance, **not** scaled by ``sqrt(h)``; the PLE *context*
  part is then computed from the merged rows, so it sees the injected embedding;
* :func:`block_ids`: with ``use_bidirectional_attention == "vision"`` and ``mm_token_type_ids``
  given, each maximal run of image/video tokens is one block; on sliding layers a query in a
  block also sees every later key of its block, whatever the window (the window still bounds the
  past); full layers stay causal (:func:`reference.model.attention_mask`).

Sources: transformers ``Gemma4Processor.replace_image_token`` /
``replace_video_token`` (``processing_gemma4.py``), ``Gemma4Config`` (ids),
``Gemma4Model.forward`` (llm_input_ids, masked_scatter, token types),
``get_block_sequence_ids_for_mask`` and ``create_masks_for_vision_model``; llama.cpp
``tools/mtmd/mtmd.cpp`` and ``src/models/gemma4.cpp`` (PLE row 0 for embedding batches, no
``sqrt(n_embd)`` on them); ``tools/mtmd/mtmd.cpp`` for which checkpoints decode images non-causally. Where the
two disagree: ``docs/design.md``, "Multimodal input".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .config import ModelConfig
from .errors import ConfigError, PromptError

MM_TYPE_TEXT, MM_TYPE_IMAGE, MM_TYPE_VIDEO, MM_TYPE_AUDIO = 0, 1, 2, 3


@dataclass(frozen=True)
class MultimodalTokenIds:
    """Special token ids of the image and video blocks (transformers ``Gemma4Config`` defaults)."""

    image_token_id: int = 258880
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    video_token_id: int = 258884
    audio_token_id: int = 258881
    boa_token_id: int = 256000
    eoa_token_index: int = 258883

    @property
    def placeholder_ids(self) -> tuple[int, int, int]:
        """The ids a soft token replaces: image, video, audio."""
        return self.image_token_id, self.video_token_id, self.audio_token_id

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> "MultimodalTokenIds":
        """Ids from a multimodal ``config.json``; absent fields keep the defaults.

        Raises:
            ConfigError: a field that is not a non-negative integer, or two roles sharing one id.
        """
        kw = {}
        for name in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id", "audio_token_id",
                     "boa_token_id", "eoa_token_index"):
            v = raw.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{source}: {name} = {v!r}: expected a non-negative integer")
            kw[name] = v
        ids = cls(**kw)
        values = [ids.image_token_id, ids.boi_token_id, ids.eoi_token_id, ids.video_token_id, ids.audio_token_id,
                  ids.boa_token_id, ids.eoa_token_index]
        if len(set(values)) != len(values):
            raise ConfigError(f"{source}: image/boi/eoi/video/audio/boa/eoa token ids must differ, got {values}")
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


def layout_prompt(parts: Sequence[int | tuple[str, int]],
                  tok: MultimodalTokenIds = MultimodalTokenIds()) -> tuple[list[int], list[int]]:
    """A prompt of text tokens, images, video frames and audio clips, already expanded.

    Args:
        parts: in order, a text token id (int), or ``("image", n)``, ``("video", n)``, ``("audio", n)``:
            ``boi + image * n + eoi``, ``boi + video * n + eoi`` (the frame's timestamp text is the
            caller's), ``boa + audio * n + eoa``.
        tok: the special ids.

    Returns:
        ``(ids, mm_token_type_ids)``.

    Raises:
        PromptError: an unknown kind or a count < 1.

    Source: transformers ``Gemma4Processor`` (``processing_gemma4.py``).
    """
    kinds = {"image": (tok.boi_token_id, tok.image_token_id, tok.eoi_token_id, MM_TYPE_IMAGE),
             "video": (tok.boi_token_id, tok.video_token_id, tok.eoi_token_id, MM_TYPE_VIDEO),
             "audio": (tok.boa_token_id, tok.audio_token_id, tok.eoa_token_index, MM_TYPE_AUDIO)}
    ids: list[int] = []
    types: list[int] = []
    for part in parts:
        if isinstance(part, (int, np.integer)):
            ids.append(int(part))
            types.append(MM_TYPE_TEXT)
            continue
        kind, n = part
        if kind not in kinds or int(n) < 1:
            raise PromptError(f"prompt part {part!r}: expected ('image'|'video'|'audio', n >= 1)")
        begin, soft, end, t = kinds[kind]
        ids += [begin] + [soft] * int(n) + [end]
        types += [MM_TYPE_TEXT] + [t] * int(n) + [MM_TYPE_TEXT]
    return ids, types


# --------------------------------------------------------------------------- the merge into the text decoder


@dataclass(frozen=True)
class Injection:
    """The multimodal part of one prompt (or of one chunk of it): the soft tokens and where they go.

    Attributes:
        embeds: float ``[n, h]``: the projected soft tokens of every image, video frame and audio clip
            of the prompt, concatenated in prompt order (``embed_vision`` / ``embed_audio`` outputs;
            numpy or torch).
        placeholder: bool ``[T]``: the positions whose token is a placeholder (image, video or audio
            token id); exactly n of them, filled in order of appearance.
        token_types: int ``[T]`` ``mm_token_type_ids`` (0 text, 1 image, 2 video, 3 audio), or None:
            not given, and then every layer is causal (HF falls back to the causal mask, as its
            ``generate`` does after the prefill).

    Source: transformers ``Gemma4Model.forward`` (``get_placeholder_mask``, ``mm_token_type_ids``).
    """

    embeds: Any
    placeholder: np.ndarray
    token_types: np.ndarray | None = None

    def part(self, lo: int, hi: int) -> Injection:
        """The injection of the tokens ``[lo, hi)``: their placeholders, rows and types."""
        before = int(np.count_nonzero(self.placeholder[:lo]))
        inside = int(np.count_nonzero(self.placeholder[lo:hi]))
        types = None if self.token_types is None else self.token_types[lo:hi]
        return Injection(self.embeds[before:before + inside], self.placeholder[lo:hi], types)

    def without_types(self) -> Injection:
        """The same rows with ``mm_token_type_ids`` not given (causal everywhere)."""
        return Injection(self.embeds, self.placeholder, None)


def make_injection(ids: Sequence[int], embeds: Any, tok: MultimodalTokenIds = MultimodalTokenIds(),
                   token_types: Sequence[int] | None = None) -> Injection:
    """An :class:`Injection` whose placeholders are the tokens equal to ``tok.placeholder_ids``.

    Args:
        ids: the expanded prompt ``[T]`` (e.g. from :func:`expand_image_placeholders`).
        embeds: ``[n, h]`` soft tokens in prompt order.
        tok: the special ids.
        token_types: ``mm_token_type_ids`` ``[T]``, or None (not given).

    Source: transformers ``Gemma4Model.get_placeholder_mask`` (from ``input_ids``).
    """
    ids_arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    types = None if token_types is None else np.asarray(token_types, dtype=np.int64).reshape(-1)
    return Injection(embeds, np.isin(ids_arr, tok.placeholder_ids), types)


def check_injection(cfg: ModelConfig, inj: Injection, n_tokens: int) -> None:
    """Validate an injection against a prompt of ``n_tokens`` tokens of a model with hidden size h.

    Raises:
        PromptError: one line: placeholder or type array of another length than the prompt, rows that
            are not ``[n, h]``, a type outside 0..3, or types that mark other positions than the
            placeholders (a soft-token type on a text token or the reverse).
    """
    ph = np.asarray(inj.placeholder)
    if ph.dtype != bool or ph.shape != (n_tokens,):
        raise PromptError(f"placeholder mask has shape {list(ph.shape)} ({ph.dtype}), expected bool [{n_tokens}]")
    shape = tuple(inj.embeds.shape)
    if len(shape) != 2 or shape[1] != cfg.hidden_size:
        raise PromptError(f"injected embeddings have shape {list(shape)}, expected [n, {cfg.hidden_size}] "
                          "(the text model's hidden size)")
    if inj.token_types is None:
        return
    types = np.asarray(inj.token_types)
    if types.shape != (n_tokens,):
        raise PromptError(f"mm_token_type_ids has shape {list(types.shape)}, expected [{n_tokens}]")
    bad = types[(types < MM_TYPE_TEXT) | (types > MM_TYPE_AUDIO)]
    if bad.size:
        raise PromptError(f"mm_token_type_ids holds {int(bad[0])}: expected 0 text, 1 image, 2 video or 3 audio")
    wrong = np.flatnonzero((types != MM_TYPE_TEXT) != ph)
    if wrong.size:
        i = int(wrong[0])
        raise PromptError(f"mm_token_type_ids[{i}] = {int(types[i])} but the token there is "
                          f"{'a placeholder' if ph[i] else 'text'}: types must mark exactly the placeholders")


def pad_id(cfg: ModelConfig) -> int:
    """The id placeholders become before any table lookup: ``pad_token_id``, else 0.

    Source: transformers ``Gemma4Model.forward`` (``text_config.pad_token_id``, default 0); llama.cpp
    ``gemma4.cpp`` reads PLE row 0 for embedding batches.
    """
    return 0 if cfg.pad_token_id is None else int(cfg.pad_token_id)


def llm_input_ids(ids: np.ndarray, placeholder: np.ndarray, pad: int) -> np.ndarray:
    """Token ids with every placeholder replaced by ``pad``. [T], [T] bool -> [T].

    Source: transformers ``Gemma4Model.forward`` (``llm_input_ids``).
    """
    return np.where(placeholder, pad, ids)


def merge_embeddings(x: np.ndarray, placeholder: np.ndarray, embeds: np.ndarray) -> np.ndarray:
    """Replace the placeholder rows of the scaled text embeddings by the soft tokens, in order; no scaling.

    [T, h], [T] bool, [n, h] -> [T, h].

    Raises:
        PromptError: the number of placeholders differs from the number of rows (both named).

    Source: transformers ``Gemma4Model.forward`` (``masked_scatter``); llama.cpp ``gemma4.cpp``
    (``sqrt(n_embd)`` only for token batches).
    """
    n_ph, n_rows = int(np.count_nonzero(placeholder)), int(embeds.shape[0])
    if n_ph != n_rows:
        raise PromptError(f"prompt has {n_ph} placeholder tokens but {n_rows} soft-token rows were given")
    out = np.array(x, dtype=np.float64)
    out[placeholder] = np.asarray(embeds, dtype=np.float64)
    return out


def block_ids(token_types: np.ndarray) -> np.ndarray:
    """Bidirectional block of each token: maximal runs of image/video types, numbered from 0 by run
    start; -1 elsewhere (text, audio). Two images with no text token between them form one block.

    [T] -> [T] int64. Source: transformers ``get_block_sequence_ids_for_mask``.
    """
    vision = (token_types == MM_TYPE_IMAGE) | (token_types == MM_TYPE_VIDEO)
    starts = vision & ~np.concatenate([[False], vision[:-1]])
    return np.where(vision, np.cumsum(starts) - 1, -1).astype(np.int64)


def vision_blocks(cfg: ModelConfig, inj: Injection | None) -> np.ndarray | None:
    """:func:`block_ids` of the prompt when bidirectional vision attention applies, else None.

    It applies only with ``use_bidirectional_attention == "vision"`` and ``mm_token_type_ids`` given.
    [T] -> [T] int64 or None. Source: transformers ``Gemma4Model.forward`` (``use_bidir``).
    """
    if cfg.use_bidirectional_attention != "vision" or inj is None or inj.token_types is None:
        return None
    return block_ids(np.asarray(inj.token_types))
