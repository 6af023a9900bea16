"""The Gemma 4 image preprocessor: an image in, padded patches and their positions out.

The rule is transformers 5.23 ``Gemma4ImageProcessorPil``
(``models/gemma4/image_processing_pil_gemma4.py``), step by step:

1. convert to RGB (an image with alpha is composited onto white first);
2. resize, aspect ratio kept, to the largest size whose sides are multiples of
   ``k*p`` within ``max_soft_tokens * k^2`` patches (floor-based, see
   :func:`target_size`), with PIL's bicubic filter; an image already at that
   size is not resampled;
3. rescale by 1/255 (no normalisation by default: the model does ``2x - 1``);
4. cut into p x p patches, row-major, each flattened as (row, column, channel);
5. positions ``(x, y) = (column, row)`` in patches; pad to ``max_patches`` rows
   with zero pixels and position ``(-1, -1)``.

The resize is PIL's own, as in the oracle, so resized pixels are bit-identical.
Values stay float64 here; transformers returns float32, i.e. these values
rounded once to float32.

Video: a list of frames, each preprocessed as an image (default budget 70) and
labelled with its ``"mm:ss"`` timestamp; in the prompt each frame is
``"mm:ss " + boi + video_token * n + eoi`` and frames are joined by one space
(transformers ``Gemma4Processor.replace_video_token``). transformers' own video
processor resizes with torchvision (antialiased bilinear/bicubic), which is not
reproduced here; frames go through the PIL image path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import ConfigError, InputError
from .files import check_regular, read_json

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
VIDEO_MAX_SOFT_TOKENS = 70  # transformers Gemma4VideoProcessor.max_soft_tokens
PIL_RESAMPLE_FILTERS = (0, 1, 2, 3, 4, 5)  # NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Image processor settings (transformers ``Gemma4ImageProcessorPil`` field names and defaults).

    Attributes:
        patch_size: p. pooling_kernel_size: k.
        max_soft_tokens: token budget per image, one of :data:`SUPPORTED_SOFT_TOKENS`.
        do_resize, resample (PIL filter number; 3 = bicubic), do_rescale,
        rescale_factor, do_normalize, image_mean, image_std, do_convert_rgb: the steps.
        source: where the settings came from (for messages).
    """
    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    do_resize: bool = True
    resample: int = 3
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True
    source: str = "transformers defaults"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str) -> "ImageProcessorConfig":
        """Settings from a processor JSON object; missing fields take the defaults, unknown ones are ignored.

        Raises:
            ConfigError: a bad value (the field is named).
        """
        fields = {f.name for f in dataclasses.fields(cls)} - {"source"}
        kw = {k: v for k, v in d.items() if k in fields and v is not None}
        for k in ("image_mean", "image_std"):
            if k in kw:
                v = kw[k]
                v = [v] * 3 if isinstance(v, (int, float)) else v
                if not isinstance(v, (list, tuple)) or len(v) != 3:
                    raise ConfigError(f"{source}: {k} = {kw[k]!r}: expected 3 numbers")
                kw[k] = tuple(v)
        return cls(**kw, source=source).validated()

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "ImageProcessorConfig":
        """Settings of an HF folder, as transformers finds them: ``processor_config.json``'s
        ``image_processor`` object if present, else ``preprocessor_config.json``, else the defaults.

        Raises:
            ConfigError: unreadable JSON or a bad value (file and field named).
        """
        path = Path(path)
        for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
            f = path / name
            if not os.path.lexists(f):
                continue
            d = read_json(f, streams=False, error=ConfigError)
            if not isinstance(d, dict):
                raise ConfigError(f"{f}: expected a JSON object")
            if key is None:
                return cls.from_dict(d, str(f))
            if isinstance(d.get(key), dict):
                return cls.from_dict(d[key], f"{f} ({key})")
        return cls()

    def validated(self) -> "ImageProcessorConfig":
        """Check every value; return ``self``.

        Raises:
            ConfigError: the field and what was expected.
        """
        for k in ("patch_size", "pooling_kernel_size", "max_soft_tokens"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{self.source}: {k} = {v!r}: expected a positive integer")
        check_budget(self.max_soft_tokens, self.source)
        for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if not isinstance(getattr(self, k), bool):
                raise ConfigError(f"{self.source}: {k} = {getattr(self, k)!r}: expected true or false")
        if self.resample not in PIL_RESAMPLE_FILTERS or isinstance(self.resample, bool):
            raise ConfigError(f"{self.source}: resample = {self.resample!r}: expected a PIL filter number 0-5")
        if not isinstance(self.rescale_factor, (int, float)) or not self.rescale_factor > 0:
            raise ConfigError(f"{self.source}: rescale_factor = {self.rescale_factor!r}: expected a positive number")
        for k in ("image_mean", "image_std"):
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in getattr(self, k)):
                raise ConfigError(f"{self.source}: {k} = {list(getattr(self, k))!r}: expected 3 numbers")
        if any(s == 0 for s in self.image_std):
            raise ConfigError(f"{self.source}: image_std = {list(self.image_std)!r}: expected non-zero values")
        return self


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image.

    Attributes:
        pixel_values: float64 ``[max_patches, 3p^2]``; padding rows are 0.
        position_ids: int64 ``[max_patches, 2]`` (x = column, y = row); padding rows ``(-1, -1)``.
        num_soft_tokens: soft tokens the image becomes (valid patches / k^2).
        size: ``(height, width)`` in pixels after the resize.
    """
    pixel_values: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int
    size: tuple[int, int]


def check_budget(max_soft_tokens: Any, where: str = "image budget") -> int:
    """Return the budget if it is one of :data:`SUPPORTED_SOFT_TOKENS`.

    Raises:
        ConfigError: one line naming the value and the allowed set.
    """
    if max_soft_tokens not in SUPPORTED_SOFT_TOKENS or isinstance(max_soft_tokens, bool):
        raise ConfigError(f"{where}: max_soft_tokens = {max_soft_tokens!r}: expected one of "
                          f"{', '.join(map(str, SUPPORTED_SOFT_TOKENS))}")
    return int(max_soft_tokens)


# --------------------------------------------------------------------------- steps


def load_image(path: str | os.PathLike):
    """Open and decode an image file with PIL.

    Returns:
        a loaded ``PIL.Image.Image``.

    Raises:
        InputError: one line naming the file (missing, unreadable, not an image, truncated).
    """
    check_regular(path, "image")  # a FIFO or a device: refused, never opened by PIL
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except FileNotFoundError:
        raise InputError(f"{path}: no such image file") from None
    except UnidentifiedImageError:
        raise InputError(f"{path}: not an image PIL can read") from None
    except (OSError, ValueError, SyntaxError) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise InputError(f"{path}: cannot decode the image ({why})") from None


def to_rgb(image) -> np.ndarray:
    """RGB uint8 pixels of a PIL image: alpha (an ``A`` band or a ``transparency`` entry) is composited
    onto white, other modes go through ``convert("RGB")``. A uint8 ``[H, W, 3]`` array passes through.

    Returns:
        uint8 ``[H, W, 3]``.

    Raises:
        InputError: another kind of input.

    Source: transformers ``image_transforms.convert_to_rgb``.
    """
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InputError(f"image array of dtype {image.dtype} and shape {list(image.shape)}: "
                             "expected uint8 [H, W, 3]")
        return image
    if not isinstance(image, Image.Image):
        raise InputError(f"image of type {type(image).__name__}: expected a PIL image, a path or a uint8 "
                         "[H, W, 3] array")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.asarray(image.convert("RGB"))


def target_size(height: int, width: int, patch_size: int, pooling_kernel_size: int,
                max_soft_tokens: int) -> tuple[int, int]:
    """Size after the aspect-preserving resize.

    ``f = sqrt(max_patches * p^2 / (H*W))``; each side becomes
    ``floor(f * side / (k*p)) * (k*p)``. A side that rounds to 0 becomes ``k*p``
    and the other ``min(floor(long/short) * k*p, max_soft_tokens * k*p)``.

    Returns:
        ``(height, width)``, multiples of ``k*p``, at most ``max_soft_tokens * k^2`` patches.

    Raises:
        InputError: the image cannot be fitted (both sides round to 0, or over the budget).

    Source: transformers ``get_aspect_ratio_preserving_size`` (``image_processing_pil_gemma4.py``).
    """
    max_patches = max_soft_tokens * pooling_kernel_size**2
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling_kernel_size * patch_size
    th = math.floor(factor * height / side) * side
    tw = math.floor(factor * width / side) * side
    if th == 0 and tw == 0:
        raise InputError(f"image {height}x{width}: cannot be resized to a multiple of {side} pixels per side")
    longest = max_soft_tokens * side
    if th == 0:
        th, tw = side, min(math.floor(width / height) * side, longest)
    elif tw == 0:
        th, tw = min(math.floor(height / width) * side, longest), side
    if th * tw > target_px:
        raise InputError(f"image {height}x{width}: resized to {th}x{tw} it exceeds the budget of "
                         f"{max_soft_tokens} soft tokens ({max_patches} patches of {patch_size}px)")
    return th, tw


def resize(rgb: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """PIL resize to ``(height, width)``; no resampling when the size is already right.

    uint8 [H, W, 3] -> uint8 [h, w, 3]. Source: transformers ``image_transforms.resize`` (PIL).
    """
    if rgb.shape[:2] == tuple(size):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((size[1], size[0]), resample=resample))


def rescale(rgb: np.ndarray, factor: float) -> np.ndarray:
    """``pixels * factor`` in float64. [H, W, 3] -> [H, W, 3]."""
    return rgb.astype(np.float64) * factor


def normalize(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``(x - mean) / std`` per channel. [H, W, 3] -> [H, W, 3] (off by default for Gemma 4)."""
    return (x - np.asarray(mean, dtype=np.float64)) / np.asarray(std, dtype=np.float64)


def patchify(img: np.ndarray, patch_size: int) -> np.ndarray:
    """Cut into patches, row-major; each patch flattened as (row, column, channel).

    [H, W, C] -> [(H/p)*(W/p), p*p*C]. Source: transformers ``convert_image_to_patches``.
    """
    h, w, c = img.shape
    p = patch_size
    return img.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4).reshape((h // p) * (w // p), p * p * c)


def patch_positions(rows: int, cols: int) -> np.ndarray:
    """``(x, y) = (column, row)`` of every patch in row-major order. [] -> [rows*cols, 2] int64."""
    y, x = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
    return np.stack([x, y], axis=-1)


def pad_patches(patches: np.ndarray, positions: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad to ``length`` rows: zero pixels, position ``(-1, -1)``. [n, d], [n, 2] -> [length, d], [length, 2]."""
    extra = length - patches.shape[0]
    return (np.concatenate([patches, np.zeros((extra, patches.shape[1]))]),
            np.concatenate([positions, np.full((extra, 2), -1, dtype=np.int64)]))


# --------------------------------------------------------------------------- pipeline


def preprocess_image(image, cfg: ImageProcessorConfig = ImageProcessorConfig(),
                     max_soft_tokens: int | None = None) -> ImageInput:
    """Run the whole preprocessor on one image.

    Args:
        image: a path, a PIL image or a uint8 ``[H, W, 3]`` array.
        cfg: settings (see :meth:`ImageProcessorConfig.from_folder`).
        max_soft_tokens: budget overriding ``cfg.max_soft_tokens``.

    Returns:
        :class:`ImageInput`.

    Raises:
        InputError: an unreadable file, an empty image, a budget outside the
            allowed set, or an image that cannot fit the budget.
    """
    budget = check_budget(cfg.max_soft_tokens if max_soft_tokens is None else max_soft_tokens)
    if isinstance(image, (str, os.PathLike)):
        image = load_image(image)
    rgb = to_rgb(image) if cfg.do_convert_rgb else np.asarray(image)
    if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise InputError(f"image of shape {list(rgb.shape)}: expected a non-empty [H, W, 3] image")
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    max_patches = budget * k * k
    if cfg.do_resize:
        rgb = resize(rgb, target_size(rgb.shape[0], rgb.shape[1], p, k, budget), cfg.resample)
    h, w = rgb.shape[:2]
    if h % (p * k) or w % (p * k) or (h // p) * (w // p) > max_patches:
        raise InputError(f"image {h}x{w}: sides must be multiples of {p * k} pixels with at most "
                         f"{max_patches} patches (budget {budget} soft tokens)")
    x = rescale(rgb, cfg.rescale_factor) if cfg.do_rescale else rgb.astype(np.float64)
    if cfg.do_normalize:
        x = normalize(x, cfg.image_mean, cfg.image_std)
    patches = patchify(x, p)
    pixels, positions = pad_patches(patches, patch_positions(h // p, w // p), max_patches)
    return ImageInput(pixels, positions, patches.shape[0] // (k * k), (h, w))


def format_timestamp(seconds: float) -> str:
    """``"mm:ss"`` of a frame time (whole minutes and seconds, truncated). Source: transformers
    ``Gemma4Processor.replace_video_token``."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


@dataclass(frozen=True)
class VideoFrame:
    """One video frame: its image input and its timestamp (``"mm:ss"``).

    In the prompt the frame is ``text_prefix + boi + video_token * n + eoi``.
    """
    timestamp: str
    image: ImageInput

    @property
    def text_prefix(self) -> str:
        """The text before the frame's image block: ``"mm:ss "``."""
        return f"{self.timestamp} "


def preprocess_video(frames: Sequence[Any], timestamps: Sequence[float],
                     cfg: ImageProcessorConfig = ImageProcessorConfig(),
                     max_soft_tokens: int = VIDEO_MAX_SOFT_TOKENS) -> list[VideoFrame]:
    """Preprocess already-sampled frames, each as an image, with their timestamps.

    Args:
        frames: images (paths, PIL images or uint8 arrays), in time order.
        timestamps: seconds of each frame (frame index / fps), non-negative.
        cfg: image settings (the budget is ``max_soft_tokens``).
        max_soft_tokens: per-frame budget (transformers' video default 70).

    Returns:
        one :class:`VideoFrame` per frame.

    Raises:
        InputError: no frames, counts differ, a negative or unordered timestamp, or any image error.
    """
    if not frames:
        raise InputError("video has no frames")
    if len(frames) != len(timestamps):
        raise InputError(f"video has {len(frames)} frames but {len(timestamps)} timestamps")
    ts = [float(t) for t in timestamps]
    if any(t < 0 for t in ts) or any(b < a for a, b in zip(ts, ts[1:])):
        raise InputError("video timestamps must be non-negative and in increasing order")
    return [VideoFrame(format_timestamp(t), preprocess_image(f, cfg, max_soft_tokens)) for f, t in zip(frames, ts)]
