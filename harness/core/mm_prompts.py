"""The multimodal prompt set (``cases/prompts/multimodal.jsonl``) and the synthetic media it names; where the
multimodal specs live (:data:`MM_MODELS_DIR`).

One JSON object a line::

    {"id": "image-audio", "prompt_ids": [2, 10, "<|image|>", 11, "<|audio|>", 12],
     "images": [{"height": 72, "width": 120, "seed": 3}], "audio": [{"seconds": 0.5, "seed": 4}],
     "note": "..."}

``prompt_ids`` holds token ids and the placeholder strings ``"<|image|>"`` / ``"<|audio|>"``, one per image
or clip (:func:`resolve_ids` puts a case's ids in); ``images`` and ``audio`` describe the media in the order
of their placeholders. The media are made here, deterministically from their seed: an image is a smooth
colour gradient plus noise (uint8 ``[H, W, 3]``, :func:`make_image`), a clip is Gaussian noise of standard
deviation 0.1 at 16 kHz (:func:`make_clip`: noise keeps every mel bin well above the ``1e-3`` floor, where
transformers' float32 front end and our float64 one agree to ~1e-6). :func:`write_wav` and
:func:`write_png` put them in files for the CLI.
"""

from __future__ import annotations

import os
import wave
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from gemma4_harness.reference.errors import InputError

from .paths import CASES_DIR
from .prompts import jsonl_objects

MM_PROMPTS = CASES_DIR / "prompts" / "multimodal.jsonl"
"""The default multimodal prompt set."""

MM_MODELS_DIR = CASES_DIR / "models" / "multimodal"
"""Built-in multimodal specs (built by :mod:`harness.synth.mm_case`)."""

PLACEHOLDERS = {"<|image|>": "image_token_id", "<|audio|>": "audio_token_id"}
"""Placeholder strings a prompt may hold, and the id each stands for."""

MM_FORM = ('{"id": "...", "prompt_ids": [int >= 0 or "<|image|>" or "<|audio|>", ...], "images": [{"height", '
           '"width", "seed"}, ...], "audio": [{"seconds", "seed"}, ...]}')
"""What a line of a multimodal prompt set holds (named where a line is not JSON)."""

SAMPLE_RATE = 16000


def make_image(height: int, width: int, seed: int) -> np.ndarray:
    """A deterministic test image: a colour gradient plus uniform noise of +-40. [] -> uint8 [H, W, 3]."""
    rng = np.random.default_rng(seed)
    y, x = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    base = np.stack([x, y, 1 - (x + y) / 2], -1) * 180 + 30 + rng.uniform(-40, 40, (height, width, 3))
    return np.clip(np.rint(base), 0, 255).astype(np.uint8)


def make_clip(seconds: float, seed: int, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A deterministic test clip: Gaussian noise, standard deviation 0.1. [] -> float64 [round(seconds * rate)]."""
    return 0.1 * np.random.default_rng(seed).standard_normal(int(round(seconds * rate)))


def write_png(path: str | os.PathLike, rgb: np.ndarray) -> Path:
    """Write uint8 ``[H, W, 3]`` as a PNG (lossless). Returns the path."""
    Image.fromarray(np.asarray(rgb, dtype=np.uint8)).save(path, format="PNG")
    return Path(path)


def write_wav(path: str | os.PathLike, samples: np.ndarray, rate: int = SAMPLE_RATE) -> Path:
    """Write mono 16-bit PCM (samples in [-1, 1), clipped, rounded to ``round(x * 32768)``). Returns the path."""
    pcm = np.clip(np.rint(np.asarray(samples) * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(pcm.tobytes())
    return Path(path)


def _media(obj: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or set(obj) != set(keys):
        raise InputError(f"{where}: expected an object with exactly {', '.join(keys)}")
    for k in keys:
        v = obj[k]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 if k == "seconds" else \
            isinstance(v, int) and not isinstance(v, bool) and v >= (0 if k == "seed" else 1)
        if not ok:
            what = "positive number" if k == "seconds" else "non-negative integer"
            raise InputError(f"{where}.{k} = {v!r}: expected a {what}")
    return dict(obj)


def load_mm_prompts(path: str | os.PathLike = MM_PROMPTS) -> list[dict[str, Any]]:
    """Read a multimodal prompt set (module docstring).

    Returns:
        one dict per line: ``id``, ``prompt_ids`` (ints and placeholder strings), ``images`` and ``audio``
        (lists of media descriptions), ``note``.

    Raises:
        InputError: an unreadable file or a bad line (one line naming the file, line and field).
    """
    p = Path(path)
    out, seen = [], set()
    for _, where, obj in jsonl_objects(p, MM_FORM):
        if not isinstance(obj.get("id"), str) or obj["id"] in seen:
            raise InputError(f"{where}: expected an object with a unique string id")
        ids = obj.get("prompt_ids")
        if not isinstance(ids, list) or not ids or any(
                not (isinstance(t, int) and not isinstance(t, bool) and t >= 0) and t not in PLACEHOLDERS for t in ids):
            raise InputError(f"{where}: prompt_ids: expected a list of token ids and {' / '.join(PLACEHOLDERS)}")
        images = [_media(m, ("height", "width", "seed"), f"{where}: images[{i}]")
                  for i, m in enumerate(obj.get("images", []))]
        audio = [_media(m, ("seconds", "seed"), f"{where}: audio[{i}]") for i, m in enumerate(obj.get("audio", []))]
        if ids.count("<|image|>") != len(images) or ids.count("<|audio|>") != len(audio):
            raise InputError(f"{where}: {ids.count('<|image|>')} <|image|> and {ids.count('<|audio|>')} <|audio|> "
                             f"placeholders for {len(images)} images and {len(audio)} clips")
        seen.add(obj["id"])
        out.append({"id": obj["id"], "prompt_ids": ids, "images": images, "audio": audio,
                    "note": str(obj.get("note", ""))})
    if not out:
        raise InputError(f"{p}: no prompts")
    return out


def resolve_ids(prompt_ids: list[Any], tok: Any) -> list[int]:
    """``prompt_ids`` with each placeholder string replaced by the model's id (``tok``: a
    :class:`reference.multimodal.MultimodalTokenIds`)."""
    return [int(getattr(tok, PLACEHOLDERS[t])) if isinstance(t, str) else int(t) for t in prompt_ids]


def prompt_media(prompt: dict[str, Any]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The images (uint8 ``[H, W, 3]``) and clips (float64 16 kHz samples) a prompt describes, in order."""
    return ([make_image(m["height"], m["width"], m["seed"]) for m in prompt["images"]],
            [make_clip(m["seconds"], m["seed"]) for m in prompt["audio"]])
