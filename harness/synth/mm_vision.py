"""Tiny synthetic Gemma 4 vision checkpoints: an HF folder and the matching mmproj GGUF.

:func:`build_tiny_hf` saves a random ``Gemma4ForConditionalGeneration`` (fp32)
whose vision parameters are randomised where transformers' initial values
would hide a fault (position table of ones, norm weights of one,
``std_bias``/``std_scale`` of 0/1, clip bounds of ±inf, small linear weights).
:func:`write_mmproj` converts such a folder to an F32 mmproj GGUF the way
llama.cpp's ``conversion/gemma.py`` ``Gemma4VisionAudioModel`` does, naming
tensors through gguf-py's own tensor map (not the reference's table), so a
load of both files checks the reference's name table against gguf-py.

Temporary flat location; it moves into ``harness/synth/`` later.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)
from transformers.models.gemma4.modeling_gemma4 import Gemma4ClippableLinear

from gemma4_harness.reference.image_processing import ImageProcessorConfig

# Tiny vision tower (k = 3 as llama.cpp hard-codes it; head_dim = hidden / heads as llama.cpp assumes).
TINY_VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 3,
    "position_embedding_size": 256, "standardize": True,
}
# Tiny text side: only its hidden size matters to the vision path (the projector's output width).
TINY_TEXT: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "pad_token_id": 0,
}
TINY_TOKEN_IDS = {"image_token_id": 500, "video_token_id": 502, "boi_token_id": 503, "eoi_token_id": 504}
CLIP_QUANTILES = (0.1, 0.9)  # clip bounds sit at these quantiles of each linear's input / output: they bite


def randomise_vision_tower(model, seed: int, clipped: bool) -> None:
    """Give every vision parameter a value that exposes faults; calibrate clip bounds so that they bite."""
    g = torch.Generator().manual_seed(seed)
    vt, ev = model.model.vision_tower, model.model.embed_vision
    with torch.no_grad():
        for name, prm in list(vt.named_parameters()) + [("embedding_projection.weight",
                                                          ev.embedding_projection.weight)]:
            if name.endswith("position_embedding_table"):
                prm.copy_(0.5 * torch.randn(prm.shape, generator=g))
            elif prm.ndim == 1:  # RMSNorm weights
                prm.copy_(0.5 + torch.rand(prm.shape, generator=g))
            else:  # linear weights: unit-variance outputs for unit-variance inputs
                prm.copy_(torch.randn(prm.shape, generator=g) * prm.shape[-1] ** -0.5)
        if vt.config.standardize:
            vt.std_bias.copy_(2.0 * torch.randn(vt.std_bias.shape, generator=g))
            vt.std_scale.copy_(0.3 + 1.2 * torch.rand(vt.std_scale.shape, generator=g))
    if clipped:
        _calibrate_clips(model, g)


def _calibrate_clips(model, g) -> None:
    """Set each ClippableLinear's bounds to quantiles of what it sees on a random image: the input
    bounds first, then (with those in force) the output bounds, so that every bound bites."""
    vt, cfg = model.model.vision_tower, model.config.vision_config
    linears = [m for m in vt.modules() if isinstance(m, Gemma4ClippableLinear)]
    side, p = 6 * cfg.patch_size * cfg.pooling_kernel_size, cfg.patch_size
    pix = torch.rand((1, (side // p) ** 2, 3 * p * p), generator=g)
    yy, xx = torch.meshgrid(torch.arange(side // p), torch.arange(side // p), indexing="ij")
    pos = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)[None]
    lo, hi = CLIP_QUANTILES
    for which in ("input", "output"):
        seen: dict[Any, torch.Tensor] = {}

        def hook(mod, inp, out, which=which, seen=seen):
            seen[mod] = (inp[0] if which == "input" else out).detach().flatten()

        hooks = [m.register_forward_hook(hook) for m in linears]
        try:
            with torch.no_grad():
                vt(pixel_values=pix, pixel_position_ids=pos)
        finally:
            for h in hooks:
                h.remove()
        with torch.no_grad():
            for mod, v in seen.items():
                getattr(mod, f"{which}_min").fill_(torch.quantile(v, lo))
                getattr(mod, f"{which}_max").fill_(torch.quantile(v, hi))


def build_tiny_hf(out_dir: str | os.PathLike, *, clipped: bool = False, seed: int = 0,
                  max_soft_tokens: int = 70, vision: Mapping[str, Any] | None = None) -> Path:
    """Save a tiny random ``Gemma4ForConditionalGeneration`` (fp32) and its image processor settings.

    Args:
        out_dir: folder to write (``config.json``, ``model.safetensors``, ``preprocessor_config.json``).
        clipped: ``use_clipped_linears`` with bounds calibrated to bite (10th / 90th percentiles).
        seed: parameter seed.
        max_soft_tokens: the processor's budget.
        vision: overrides of :data:`TINY_VISION`.

    Returns:
        ``Path(out_dir)``.
    """
    vcfg = {**TINY_VISION, **(vision or {}), "use_clipped_linears": clipped}
    cfg = Gemma4Config(text_config=Gemma4TextConfig(**TINY_TEXT), vision_config=Gemma4VisionConfig(**vcfg),
                       **TINY_TOKEN_IDS)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    randomise_vision_tower(model, seed, clipped)
    out = Path(out_dir)
    model.save_pretrained(out)
    Gemma4ImageProcessorPil(patch_size=vcfg["patch_size"], pooling_kernel_size=vcfg["pooling_kernel_size"],
                            max_soft_tokens=max_soft_tokens).save_pretrained(out)
    return out


# --------------------------------------------------------------------------- mmproj


def _converter_name(hf_name: str) -> str:
    """The name llama.cpp's converter hands to gguf-py's tensor map (``Gemma4VisionAudioModel.modify_tensors``)."""
    name = hf_name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    if name.endswith("position_embedding_table"):
        name += ".weight"
    return name


def write_mmproj(hf_dir: str | os.PathLike, path: str | os.PathLike, *, use_gelu: bool | None = None) -> Path:
    """Convert an HF Gemma 4 folder's vision side to an F32 mmproj GGUF with llama.cpp's keys and names.

    Keys: ``general.architecture = clip``, ``general.type = mmproj``,
    ``general.file_type`` (0, all F32), ``clip.has_vision_encoder``,
    ``clip.vision.projector_type = gemma4v``, ``clip.vision.projection_dim`` (text
    hidden size), ``image_size`` (224, unused, as the converter), ``patch_size``,
    ``embedding_length``, ``feed_forward_length``, ``block_count``,
    ``attention.head_count``, ``attention.layer_norm_epsilon`` (the config's
    ``rms_norm_eps``; the converter reads a ``layer_norm_eps`` field that
    Gemma 4 does not have and so always writes 1e-6), ``image_mean``,
    ``image_std``, ``projector.scale_factor`` (read by llama.cpp, not written by
    its converter), and ``attention.head_count_kv`` / ``attention.head_dim``
    only where they differ from heads / hidden_size/heads. ``clip.use_gelu`` is
    written only when ``use_gelu`` is given (the converter never writes it, so
    llama.cpp runs ``gelu_quick``).

    Tensors: HF vision tensors renamed through gguf-py's MMPROJ tensor map; the
    patch projection permuted to a ``[H, 3, p, p]`` kernel; clip scalars as
    1-element tensors. Written beside ``path``, read back (names, shapes,
    bit-exact data) and renamed into place.

    Raises:
        RuntimeError: a tensor gguf-py cannot name, or the read-back check fails.
    """

    hf_dir, path = Path(hf_dir), Path(path)
    raw = json.loads((hf_dir / "config.json").read_text())
    vc, tc = raw["vision_config"], raw["text_config"]
    proc = ImageProcessorConfig.from_folder(hf_dir)
    state: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 128)
    suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
    tensors: dict[str, np.ndarray] = {}
    p = vc["patch_size"]
    for key, arr in state.items():
        if not key.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        arr = np.asarray(arr, dtype=np.float32)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if key.endswith("patch_embedder.input_proj.weight"):
            arr = arr.reshape(arr.shape[0], p, p, 3).transpose(0, 3, 1, 2)
        name = tmap.get_name(_converter_name(key), try_suffixes=suffixes)
        if name is None:
            raise RuntimeError(f"gguf-py has no MMPROJ name for {key}")
        tensors[name] = np.ascontiguousarray(arr)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "clip")
    try:
        heads, hidden = vc["num_attention_heads"], vc["hidden_size"]
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_clip_has_vision_encoder(True)
        w.add_clip_vision_projector_type(gguf.VisionProjectorType.GEMMA4V)
        w.add_vision_projection_dim(tc["hidden_size"])
        w.add_vision_image_size(224)
        w.add_vision_patch_size(p)
        w.add_vision_embedding_length(hidden)
        w.add_vision_feed_forward_length(vc["intermediate_size"])
        w.add_vision_block_count(vc["num_hidden_layers"])
        w.add_vision_head_count(heads)
        w.add_vision_attention_layernorm_eps(vc.get("rms_norm_eps", 1e-6))
        w.add_vision_image_mean(list(proc.image_mean))
        w.add_vision_image_std(list(proc.image_std))
        w.add_vision_projector_scale_factor(vc.get("pooling_kernel_size", 3))
        if vc.get("num_key_value_heads", heads) != heads:
            w.add_uint32("clip.vision.attention.head_count_kv", vc["num_key_value_heads"])
        if vc.get("head_dim", hidden // heads) != hidden // heads:
            w.add_uint32("clip.vision.attention.head_dim", vc["head_dim"])
        if use_gelu is not None:
            w.add_vision_use_gelu(use_gelu)
        for name, arr in tensors.items():
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    try:
        _verify(tmp, tensors)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _verify(path: Path, expected: Mapping[str, np.ndarray]) -> None:

    reader = gguf.GGUFReader(str(path))
    got = {t.name: t for t in reader.tensors}
    if set(got) != set(expected):
        raise RuntimeError(f"{path}: tensor set differs: missing {sorted(set(expected) - set(got))[:3]}, "
                           f"unexpected {sorted(set(got) - set(expected))[:3]}")
    for name, ref in expected.items():
        t = got[name]
        back = np.asarray(t.data).reshape(tuple(int(x) for x in t.shape[::-1]))
        if back.shape != ref.shape or not np.array_equal(back.view(np.uint32), ref.view(np.uint32)):
            raise RuntimeError(f"{path}: {name}: data read back differs from what was written")
    del reader
