"""A multimodal Gemma 4 as the reference reads it, and a prompt with images and audio laid out for it.

:func:`load_multimodal` opens either form of a multimodal checkpoint:

* an HF ``Gemma4ForConditionalGeneration`` folder: the text decoder (:func:`reference.weights.load_model`),
  the vision tower (:func:`reference.mm_weights.load_vision_hf`, when ``config.json`` has a
  ``vision_config``), the audio tower (:func:`reference.audio_weights.load_audio_hf`, when it has an
  ``audio_config``), the token ids of ``config.json``, and the processor settings the folder saves
  (``processor_config.json`` / ``preprocessor_config.json``; transformers' defaults when absent);
* a text GGUF plus an ``mmproj`` GGUF (llama.cpp's layout: ``clip.vision.projector_type = gemma4v``,
  ``clip.audio.projector_type = gemma4a``): the token ids come from the text GGUF's vocabulary (the
  strings ``<|image|>``, ``<|image>``, ``<image|>``, ``<|audio|>``, ``<|audio>``, ``<audio|>``,
  ``<|video|>``, which llama.cpp's mtmd also looks up), else transformers' defaults; the image
  processor takes the mmproj's patch size and pooling kernel with transformers' other defaults.
  A GGUF has no ``use_bidirectional_attention`` key: llama.cpp's mtmd decides by the text width
  (causal only for 1536 and 2560, the E2B and E4B checkpoints, which are the ones whose HF config says
  causal), and so does this loader.

:func:`prepare_prompt` turns a prompt with ONE placeholder per image (``image_token_id``) and per audio
clip (``audio_token_id``) into the expanded prompt (``boi + image x n + eoi``, ``boa + audio x n + eoa``,
as transformers' ``Gemma4Processor`` does), with the preprocessed media in prompt order
(:class:`MultimodalPrompt`). :func:`encode_prompt` runs the reference encoders on it and returns the
:class:`reference.multimodal.Injection` that :func:`reference.model.forward` takes.

Encoder trace points are the encoders' own names (:mod:`reference.vision`, :mod:`reference.audio`:
llama.cpp's clip callback names where it has them) prefixed by the item: ``v0.Qcur_pos`` is image 0's,
``a1.attn_out`` audio clip 1's (:func:`item_prefix`); the decoder's points keep their names.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .audio import encode_audio
from .audio_config import AudioConfig
from .audio_features import MelConfig, extract_features, load_audio, mel_config_from_folder
from .audio_weights import check_text_width, load_audio_hf, load_audio_mmproj
from .config import ModelConfig
from .errors import ConfigError, InputError, ModelFileError, PromptError
from .gguf_check import check_gguf
from .image_processing import ImageInput, ImageProcessorConfig, check_budget, load_image, preprocess_image, to_rgb
from .mm_weights import check_matches_text, load_mmproj, load_vision_hf
from .multimodal import MM_TYPE_AUDIO, MM_TYPE_IMAGE, MM_TYPE_TEXT, Injection, MultimodalTokenIds
from .vision import VisionConfig, check_patches, encode_image
from .weights import load_model, read_hf_config

TraceFn = Callable[[str, int, np.ndarray], None]

#: The token strings of the multimodal special tokens (Gemma 4's tokenizer; llama.cpp's mtmd inserts
#: ``<|image>`` / ``<image|>`` and ``<|audio>`` / ``<audio|>`` around a chunk).
TOKEN_STRINGS = {
    "image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>",
    "video_token_id": "<|video|>", "audio_token_id": "<|audio|>", "boa_token_id": "<|audio>",
    "eoa_token_index": "<audio|>",
}

#: llama.cpp ``mtmd_decode_use_non_causal``: a gemma4v model decodes images causally only when the text
#: width is one of these (E2B, E4B).
LLAMACPP_CAUSAL_WIDTHS = (1536, 2560)

MM_TOKEN_TYPES = ("auto", "off")
"""``--mm-token-types``: ``auto`` passes ``mm_token_type_ids`` (the bidirectional vision mask applies when
the model's config asks for it); ``off`` leaves them out (causal everywhere, as transformers without them)."""


@dataclass
class MultimodalModel:
    """A multimodal checkpoint: the text decoder, the encoders it has, and their input settings.

    Attributes:
        cfg, W: the text decoder (:func:`reference.weights.load_model`).
        tok: the special token ids.
        vision: ``(VisionConfig, weights)`` or None (no vision tower).
        audio: ``(AudioConfig, weights)`` or None (no audio tower).
        image_proc: image preprocessor settings.
        mel: audio front-end settings.
        source: the model path; mmproj: the mmproj path (GGUF form) or None.
    """

    cfg: ModelConfig
    W: Any
    tok: MultimodalTokenIds
    vision: tuple[VisionConfig, Any] | None
    audio: tuple[AudioConfig, Any] | None
    image_proc: ImageProcessorConfig
    mel: MelConfig
    source: str
    mmproj: str | None = None


def token_ids_from_vocab(tokens: Sequence[str] | None, vocab_size: int, source: str) -> MultimodalTokenIds:
    """The special ids of a GGUF vocabulary: each :data:`TOKEN_STRINGS` string's id, else transformers' default.

    Raises:
        ConfigError: an id (found or default) outside ``[0, vocab_size)`` (the model cannot take such a
            placeholder: one line naming the token).
    """
    index = {} if tokens is None else {t: i for i, t in enumerate(tokens) if t in TOKEN_STRINGS.values()}
    kw = {field: index[s] for field, s in TOKEN_STRINGS.items() if s in index}
    ids = MultimodalTokenIds(**kw)
    for field, s in TOKEN_STRINGS.items():
        v = getattr(ids, field)
        if not 0 <= v < vocab_size:
            raise ConfigError(f"{source}: the vocabulary has no {s} token and its default id {v} is outside "
                              f"[0, {vocab_size}) ({field})")
    return ids


def load_multimodal(model: str | os.PathLike, mmproj: str | os.PathLike | None = None) -> MultimodalModel:
    """Open a multimodal checkpoint: an HF folder, or a text GGUF with its mmproj GGUF.

    Args:
        model: HF ``Gemma4ForConditionalGeneration`` folder, or a text ``.gguf``.
        mmproj: the mmproj ``.gguf`` (only with a GGUF text model).

    Returns:
        :class:`MultimodalModel`.

    Raises:
        ModelFileError: a missing or unreadable file; an mmproj given with an HF folder; an mmproj whose
            projector width differs from the text model's hidden size (one line naming both files).
        ConfigError: bad metadata, an mmproj that is not a Gemma 4 one, or one without any encoder.
    """
    p = Path(model)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    if p.is_dir():
        if mmproj is not None:
            raise ModelFileError(f"--mmproj {mmproj}: an HF folder ({p}) carries its own vision and audio towers; "
                                 "--mmproj goes with a GGUF text model")
        return _load_hf(p)
    return _load_gguf(p, None if mmproj is None else Path(mmproj))


def _load_hf(p: Path) -> MultimodalModel:
    raw = read_hf_config(p)
    cfg, W = load_model(p)
    vision = load_vision_hf(p) if isinstance(raw.get("vision_config"), dict) else None
    audio = load_audio_hf(p) if isinstance(raw.get("audio_config"), dict) else None
    tok = MultimodalTokenIds.from_hf(raw, str(p / "config.json"))
    if vision is not None:
        check_matches_text(vision[0], cfg)
    if audio is not None:
        check_text_width(audio[0], cfg.hidden_size, str(p))
    return MultimodalModel(cfg, W, tok, vision, audio, ImageProcessorConfig.from_folder(p), mel_config_from_folder(p),
                           str(p))


def _load_gguf(p: Path, mmproj: Path | None) -> MultimodalModel:
    cfg, W = load_model(p)
    meta = getattr(W, "metadata", {})
    tok = token_ids_from_vocab(meta.get("tokenizer.ggml.tokens"), cfg.vocab_size, str(p))
    vision = audio = None
    if mmproj is not None:
        if not mmproj.is_file():
            raise ModelFileError(f"--mmproj {mmproj}: no such file")
        mmeta = check_gguf(mmproj).metadata
        if mmeta.get("general.architecture") != "clip":
            raise ConfigError(f"{mmproj}: general.architecture = {mmeta.get('general.architecture')!r}: expected "
                              "'clip' (an mmproj GGUF)")
        if not (mmeta.get("clip.has_vision_encoder") or mmeta.get("clip.has_audio_encoder")):
            raise ConfigError(f"{mmproj}: neither clip.has_vision_encoder nor clip.has_audio_encoder is true")
        if mmeta.get("clip.has_vision_encoder"):
            vision = load_mmproj(mmproj)
            check_matches_text(vision[0], cfg)
        if mmeta.get("clip.has_audio_encoder"):
            audio = load_audio_mmproj(mmproj, cfg.hidden_size, str(p))
    if vision is not None and cfg.use_bidirectional_attention is None \
            and cfg.hidden_size not in LLAMACPP_CAUSAL_WIDTHS:
        cfg = dataclasses.replace(cfg, use_bidirectional_attention="vision")
    proc = ImageProcessorConfig(source=f"{mmproj} (transformers' defaults)")
    if vision is not None:
        proc = dataclasses.replace(proc, patch_size=vision[0].patch_size,
                                   pooling_kernel_size=vision[0].pooling_kernel_size)
    return MultimodalModel(cfg, W, tok, vision, audio, proc, MelConfig(), str(p),
                           None if mmproj is None else str(mmproj))


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class MediaItem:
    """One image or audio clip of a prompt, preprocessed.

    Attributes:
        kind: ``"image"`` or ``"audio"``.
        source: the file (or a description), for messages.
        image: the preprocessed image (``kind == "image"``).
        rgb: the image's uint8 ``[H, W, 3]`` pixels before the resize (what llama.cpp's mtmd is given).
        features, mask: ``[T, M]`` log-mel features and ``[T]`` frame mask (``kind == "audio"``).
        samples: the 16 kHz waveform ``[N]`` (``kind == "audio"``).
        n_soft: soft tokens it becomes.
    """

    kind: str
    source: str
    n_soft: int
    image: ImageInput | None = None
    rgb: np.ndarray | None = None
    features: np.ndarray | None = None
    mask: np.ndarray | None = None
    samples: np.ndarray | None = None


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt with its media, expanded.

    Attributes:
        ids: the expanded token ids ``[T]`` (placeholders, begin and end tokens included).
        token_types: ``mm_token_type_ids`` ``[T]`` (0 text, 1 image, 3 audio).
        placeholder: bool ``[T]``, the soft-token positions.
        items: the media in prompt order.
        use_types: pass ``token_types`` to the model (``--mm-token-types auto``), or not (``off``).
    """

    ids: list[int]
    token_types: np.ndarray
    placeholder: np.ndarray
    items: tuple[MediaItem, ...]
    use_types: bool = True

    def injection(self, embeds: Any) -> Injection:
        """The :class:`Injection` of these soft tokens (``[n, h]``, prompt order)."""
        return Injection(embeds, self.placeholder, self.token_types if self.use_types else None)

    @property
    def n_soft(self) -> int:
        """Soft tokens of all items."""
        return sum(it.n_soft for it in self.items)


def item_prefix(items: Sequence[MediaItem], index: int) -> str:
    """Trace-point prefix of item ``index``: ``v<i>.`` for the i-th image, ``a<j>.`` for the j-th clip."""
    kind = items[index].kind
    n = sum(1 for it in items[:index] if it.kind == kind)
    return f"{'v' if kind == 'image' else 'a'}{n}."


def prefixed(trace: TraceFn | None, prefix: str) -> TraceFn | None:
    """A trace callback that reports ``prefix + point``."""
    if trace is None:
        return None
    return lambda point, layer, arr: trace(prefix + point, layer, arr)


def _no_tower(mm: MultimodalModel, tower: str, what: str) -> str:
    """The one-line reason a model cannot take an item of ``tower``."""
    if mm.mmproj is not None:
        return (f"{mm.mmproj}: the mmproj has no {tower} encoder (clip.has_{tower}_encoder is not true): it cannot "
                f"take {what}")
    if not os.path.isdir(mm.source):
        return f"{mm.source}: a text GGUF takes {what} only with its mmproj (--mmproj FILE)"
    return f"{mm.source}: config.json has no {tower}_config (no {tower} tower): the model cannot take {what}"


def image_item(mm: MultimodalModel, image: Any, max_soft_tokens: int | None = None) -> MediaItem:
    """Preprocess one image (a path, a PIL image or uint8 ``[H, W, 3]``) for ``mm``.

    Raises:
        InputError: no vision tower, an unreadable file, a budget outside the allowed set, an image that does
            not fit the budget, or one whose patch grid is larger than the model's position tables.
    """
    if mm.vision is None:
        raise InputError(_no_tower(mm, "vision", "an image"))
    source = str(image) if isinstance(image, (str, os.PathLike)) else f"{type(image).__name__} image"
    if isinstance(image, (str, os.PathLike)):
        image = load_image(image)
    rgb = to_rgb(image)
    try:
        inp = preprocess_image(rgb, mm.image_proc, max_soft_tokens)
        check_patches(mm.vision[0], inp.pixel_values, inp.position_ids)
    except InputError as e:
        raise type(e)(f"{source}: {e}") from None
    return MediaItem("image", source, inp.num_soft_tokens, image=inp, rgb=rgb)


def audio_item(mm: MultimodalModel, audio: Any, resample: bool = False) -> MediaItem:
    """Read and featurise one audio clip (a WAV path, or float samples at the front end's rate) for ``mm``.

    Audio longer than 30 s is truncated, as transformers does.

    Raises:
        InputError: no audio tower, an unreadable file, a sample rate other than the front end's without
            ``resample``, or a clip too short to give a frame.
    """
    if mm.audio is None:
        raise InputError(_no_tower(mm, "audio", "audio"))
    if isinstance(audio, (str, os.PathLike)):
        source, samples = str(audio), load_audio(audio, mm.mel, resample_to_rate=resample)
    else:
        source, samples = "audio samples", np.asarray(audio, dtype=np.float64)
    feats, mask = extract_features(samples, mm.mel)
    sub = mask[::2][::2]
    n = int(np.count_nonzero(sub))
    if n == 0:
        raise InputError(f"{source}: {samples.shape[0]} samples give no audio frame (at least "
                         f"{mm.mel.frame_length} samples at {mm.mel.sampling_rate} Hz are needed)")
    return MediaItem("audio", source, n, features=feats, mask=mask, samples=samples)


def expand(ids: Sequence[int], items: Sequence[MediaItem], tok: MultimodalTokenIds) -> tuple[list[int], list[int]]:
    """Replace each placeholder (one ``image_token_id`` / ``audio_token_id``) by its item's block, in order.

    Images go to the image placeholders and clips to the audio placeholders, each in order of appearance.

    Returns:
        ``(ids, mm_token_type_ids)``.

    Raises:
        PromptError: a placeholder count that differs from the number of images or clips, or a begin/end token
            already in the prompt (one line).
    """
    kinds = {"image": (tok.image_token_id, tok.boi_token_id, tok.eoi_token_id, MM_TYPE_IMAGE),
             "audio": (tok.audio_token_id, tok.boa_token_id, tok.eoa_token_index, MM_TYPE_AUDIO)}
    for kind, (ph, begin, end, _) in kinds.items():
        n_ph = sum(1 for t in ids if t == ph)
        n_items = sum(1 for it in items if it.kind == kind)
        if n_ph != n_items:
            what = "images" if kind == "image" else "audio clips"
            raise PromptError(f"prompt has {n_ph} {kind} placeholder(s) (id {ph}) but {n_items} {what} were given: "
                              f"each {kind} is marked by one id {ph}")
        stray = [t for t in ids if t in (begin, end)]
        if stray:
            raise PromptError(f"prompt already holds the {kind} begin/end token {stray[0]}; mark each {kind} by one "
                              f"placeholder id {ph} (the harness expands it)")
    queues = {k: iter([it for it in items if it.kind == k]) for k in kinds}
    by_id = {ph: k for k, (ph, *_rest) in kinds.items()}
    out: list[int] = []
    types: list[int] = []
    for t in ids:
        kind = by_id.get(int(t))
        if kind is None:
            out.append(int(t))
            types.append(MM_TYPE_TEXT)
            continue
        ph, begin, end, ty = kinds[kind]
        n = next(queues[kind]).n_soft
        out += [begin] + [ph] * n + [end]
        types += [MM_TYPE_TEXT] + [ty] * n + [MM_TYPE_TEXT]
    return out, types


def prepare_prompt(mm: MultimodalModel, ids: Sequence[int], images: Sequence[Any] = (), audio: Sequence[Any] = (),
                   resample: bool = False, mm_token_types: str = "auto",
                   max_soft_tokens: int | None = None) -> MultimodalPrompt:
    """Preprocess the media of one prompt and expand its placeholders.

    Args:
        mm: the model.
        ids: token ids with one ``image_token_id`` per image and one ``audio_token_id`` per clip.
        images: image files (or images), in the order of their placeholders.
        audio: WAV files (or 16 kHz sample arrays), in the order of their placeholders.
        resample: convert a WAV of another sample rate (else that is an error).
        mm_token_types: ``auto`` or ``off`` (:data:`MM_TOKEN_TYPES`).
        max_soft_tokens: image budget overriding the processor's.

    Returns:
        :class:`MultimodalPrompt`.

    Raises:
        InputError: see :func:`image_item`, :func:`audio_item`, :func:`expand`; an unknown ``mm_token_types``;
            a budget outside the allowed set.
    """
    if mm_token_types not in MM_TOKEN_TYPES:
        raise InputError(f"--mm-token-types {mm_token_types!r}: expected one of {', '.join(MM_TOKEN_TYPES)}")
    if max_soft_tokens is not None:
        check_budget(max_soft_tokens, "--image-tokens")
    ids = [int(t) for t in ids]
    # count before any file is read, so a miscounted prompt fails fast
    expand(ids, [MediaItem("image", "", 1)] * len(images) + [MediaItem("audio", "", 1)] * len(audio), mm.tok)
    items: list[MediaItem] = []
    img_iter, aud_iter = iter(images), iter(audio)
    for t in ids:
        if t == mm.tok.image_token_id:
            items.append(image_item(mm, next(img_iter), max_soft_tokens))
        elif t == mm.tok.audio_token_id:
            items.append(audio_item(mm, next(aud_iter), resample))
    out, types = expand(ids, items, mm.tok)
    types_arr = np.asarray(types, dtype=np.int64)
    return MultimodalPrompt(out, types_arr, types_arr != MM_TYPE_TEXT, tuple(items), mm_token_types == "auto")


# --------------------------------------------------------------------------- encoding


def encode_item(mm: MultimodalModel, item: MediaItem, trace: TraceFn | None = None) -> np.ndarray:
    """Soft tokens of one item through the reference encoders, float64 ``[n_soft, h]``.

    Raises:
        InputError: see :func:`reference.vision.encode_image` / :func:`reference.audio.encode_audio`.
    """
    if item.kind == "image":
        vcfg, VW = mm.vision
        return encode_image(vcfg, VW, item.image.pixel_values, item.image.position_ids, trace=trace)
    acfg, AW = mm.audio
    return encode_audio(acfg, AW, item.features, item.mask, trace=trace)


def encode_prompt(mm: MultimodalModel, prompt: MultimodalPrompt, trace: TraceFn | None = None) -> Injection:
    """Every item's soft tokens (encoder trace points prefixed by :func:`item_prefix`) as an :class:`Injection`.

    Raises:
        PromptError: an item gave another number of soft tokens than its placeholders hold.
    """
    rows = []
    for i, it in enumerate(prompt.items):
        e = encode_item(mm, it, prefixed(trace, item_prefix(prompt.items, i)))
        if e.shape[0] != it.n_soft:
            raise PromptError(f"{it.source}: the encoder gave {e.shape[0]} soft tokens for {it.n_soft} placeholders")
        rows.append(e)
    embeds = np.concatenate(rows) if rows else np.zeros((0, mm.cfg.hidden_size))
    return prompt.injection(embeds)
