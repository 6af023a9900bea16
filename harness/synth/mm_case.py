"""Synthetic multimodal cases (``cases/models/multimodal/*.toml``): text + vision + audio, built as an HF
``Gemma4ForConditionalGeneration`` folder and as a text GGUF plus an mmproj GGUF, from the same weights.

Spec format: a text spec (:mod:`.spec`: ``description``, ``seed``, ``[config]``, ``[init]``, ``[gates]``,
``qtypes``) plus

* ``[vision]``: ``Gemma4VisionConfig`` fields (the tower is absent without the table);
* ``[audio]``: ``Gemma4AudioConfig`` fields (absent without the table);
* ``[tokens]``: the special ids (``image_token_id``, ``boi_token_id``, ``eoi_token_id``, ``video_token_id``,
  ``audio_token_id``, ``boa_token_id``, ``eoa_token_index``; default :data:`DEFAULT_TOKEN_IDS`, below the
  tiny vocabulary);
* ``[processor]``: ``max_soft_tokens`` (the image processor's budget, default 70).

What the build writes (:func:`build_mm_case`), into ``<cache>/synth/<name>-<sha12>/`` like a text case:

* ``hf/``: the model through transformers' own classes (``save_pretrained``, fp32), the text decoder's
  weights from :func:`harness.synth.make_weights` (so every text-spec rule holds: norms and layer scalars
  randomised), the vision tower randomised by :func:`.mm_vision.randomise_vision_tower` (position table,
  norms, ``std_bias`` / ``std_scale``, clip bounds calibrated to bite) and the audio tower by
  :func:`.mm_audio.randomise_audio_tower` (norms, ``per_dim_scale``, finite clip bounds, bias); then
  ``processor_config.json`` with the ``image_processor`` and ``feature_extractor`` objects
  (``Gemma4ImageProcessorPil``, ``Gemma4AudioFeatureExtractor``), as ``ProcessorMixin`` saves them, and
  ``preprocessor_config.json`` (the image processor's);
* ``<name>-F32.gguf``: the text decoder (:func:`.gguf.write_gguf`) whose vocabulary holds the special
  token strings at the spec's ids (``<|image|>`` ...), as a converted Gemma 4 vocabulary does;
* ``<name>-mmproj.gguf``: one F32 mmproj with both towers, as llama.cpp's converter
  (``Gemma4VisionAudioModel``) writes it: ``clip.vision.projector_type = gemma4v`` and
  ``clip.audio.projector_type = gemma4a`` (no ``clip.projector_type``), vision tensors named through
  gguf-py's own MMPROJ map, audio tensors under the reference's canonical names (checked against gguf-py
  by ``tests/test_audio_reference.py``), no ``clip.use_gelu`` key (the converter writes none, so llama.cpp
  runs its vision MLP with ``gelu_quick``);
* ``<name>-mmproj-gelu.gguf``: the same with ``clip.use_gelu = true`` (what llama.cpp needs to run the
  tanh-GELU the model has), to measure what the missing key costs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
import torch
from gguf import GGUFValueType as VT
from safetensors.numpy import load_file
from transformers import (
    Gemma4AudioConfig,
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

from gemma4_harness.reference.audio_weights import expected_audio_tensors, load_audio_hf
from gemma4_harness.reference.image_processing import SUPPORTED_SOFT_TOKENS
from gemma4_harness.reference.mm_model import TOKEN_STRINGS
from gemma4_harness.reference.names import gguf_to_hf

from ..core.mm_prompts import MM_MODELS_DIR
from ..core.paths import cache_root
from .gguf import write_gguf
from .mm_audio import audio_mmproj_metadata, randomise_audio_tower
from .mm_model import load_text_weights
from .mm_vision import randomise_vision_tower
from .spec import Spec, SpecError, load_spec
from .weights import make_weights

MM_BUILDER_VERSION = "synth-mm-1"
"""Bumped whenever the bytes :func:`build_mm_case` writes for an unchanged spec change."""

#: Special ids below the tiny vocabularies (transformers' defaults are 255999..258884).
DEFAULT_TOKEN_IDS = {"image_token_id": 500, "audio_token_id": 501, "video_token_id": 502, "boi_token_id": 503,
                     "eoi_token_id": 504, "boa_token_id": 505, "eoa_token_index": 506}

_EXTRA_TABLES = ("vision", "audio", "tokens", "processor")
_VISION_FIELDS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_activation", "rms_norm_eps", "max_position_embeddings", "attention_bias",
    "attention_dropout", "rope_parameters", "pooling_kernel_size", "patch_size", "position_embedding_size",
    "use_clipped_linears", "standardize", "initializer_range"})
_AUDIO_FIELDS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act", "subsampling_conv_channels",
    "conv_kernel_size", "residual_weight", "attention_chunk_size", "attention_context_left",
    "attention_context_right", "attention_logit_cap", "attention_invalid_logits_value", "use_clipped_linears",
    "rms_norm_eps", "gradient_clipping", "output_proj_dims", "initializer_range"})


@dataclass(frozen=True)
class MMSpec:
    """A parsed multimodal spec (module docstring).

    Attributes:
        spec: the text part (:class:`.spec.Spec`, its ``extra`` holding the tables below as read).
        vision, audio: the tower configs (field -> value), or None for an absent tower.
        tokens: the special ids.
        max_soft_tokens: the image processor's budget.
    """

    spec: Spec
    vision: dict[str, Any] | None
    audio: dict[str, Any] | None
    tokens: dict[str, int]
    max_soft_tokens: int

    @property
    def name(self) -> str:
        """The case name (the file stem)."""
        return self.spec.name


def builtin_mm_specs() -> list[Path]:
    """The multimodal spec files in ``cases/models/multimodal/``, sorted (absolute paths)."""
    return sorted(MM_MODELS_DIR.glob("*.toml"))


def load_mm_spec(path: str | os.PathLike[str]) -> MMSpec:
    """Read and validate a multimodal spec.

    Raises:
        SpecError: one line ``<file>: <key>: <what was expected>``: anything :func:`.spec.load_spec` refuses,
            an unknown tower field, a bad token id or budget, a text config without
            ``use_bidirectional_attention`` where a vision tower is present and wants it stated.
    """
    spec = load_spec(path, extra=_EXTRA_TABLES)
    p = spec.path
    tables: dict[str, dict[str, Any] | None] = {}
    for name, known in (("vision", _VISION_FIELDS), ("audio", _AUDIO_FIELDS)):
        t = spec.extra.get(name)
        if t is not None and not isinstance(t, dict):
            raise SpecError(f"{p}: {name}: expected a table")
        bad = sorted(set(t or {}) - known)
        if bad:
            raise SpecError(f"{p}: {name}.{bad[0]}: not a Gemma4{name.capitalize()}Config field")
        tables[name] = None if t is None else dict(t)
    if tables["vision"] is None and tables["audio"] is None:
        raise SpecError(f"{p}: vision: a multimodal spec needs a [vision] or an [audio] table")
    tokens = dict(DEFAULT_TOKEN_IDS)
    for k, v in (spec.extra.get("tokens") or {}).items():
        if k not in DEFAULT_TOKEN_IDS:
            raise SpecError(f"{p}: tokens.{k}: unknown (known: {', '.join(DEFAULT_TOKEN_IDS)})")
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < spec.config["vocab_size"]:
            raise SpecError(f"{p}: tokens.{k}: expected an id in [0, {spec.config['vocab_size']})")
        tokens[k] = v
    if len(set(tokens.values())) != len(tokens) or min(tokens.values()) < 260:
        raise SpecError(f"{p}: tokens: the special ids must differ and lie above the 260 specials and byte tokens")
    proc = spec.extra.get("processor") or {}
    budget = proc.get("max_soft_tokens", 70)
    if budget not in SUPPORTED_SOFT_TOKENS or set(proc) - {"max_soft_tokens"}:
        raise SpecError(f"{p}: processor: expected only max_soft_tokens, one of {list(SUPPORTED_SOFT_TOKENS)}")
    return MMSpec(spec, tables["vision"], tables["audio"], tokens, int(budget))


# --------------------------------------------------------------------------- the HF folder


def write_mm_hf(ms: MMSpec, weights: Mapping[str, np.ndarray], out_dir: str | os.PathLike[str]) -> Path:
    """Write the HF folder (module docstring); reload it and check the text weights round-trip bit-exactly.

    Raises:
        RuntimeError: the text weights do not fit the language model, or the round trip differs.
    """
    spec = ms.spec
    tcfg = Gemma4TextConfig(**json.loads(json.dumps(spec.config)))
    vcfg = None if ms.vision is None else Gemma4VisionConfig(**ms.vision)
    acfg = None if ms.audio is None else Gemma4AudioConfig(**ms.audio)
    cfg = Gemma4Config(text_config=tcfg, vision_config=vcfg, audio_config=acfg, **ms.tokens)
    with torch.random.fork_rng(devices=[]):  # transformers' random init must not move the caller's RNG
        torch.manual_seed(spec.seed)
        model = Gemma4ForConditionalGeneration(cfg).eval()
        load_text_weights(model, weights)
        if vcfg is not None:
            randomise_vision_tower(model, spec.seed, bool(vcfg.use_clipped_linears))
        if acfg is not None:
            randomise_audio_tower(model, spec.seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    cfg_path = out / "config.json"  # as hf.write_hf: the keys Google's checkpoints state
    raw = json.loads(cfg_path.read_text())
    raw["text_config"]["global_head_dim"] = spec.config["global_head_dim"]
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    proc: dict[str, Any] = {"processor_class": "Gemma4Processor"}
    if vcfg is not None:
        ip = Gemma4ImageProcessorPil(patch_size=vcfg.patch_size, pooling_kernel_size=vcfg.pooling_kernel_size,
                                     max_soft_tokens=ms.max_soft_tokens)
        ip.save_pretrained(out)
        proc["image_processor"] = json.loads(ip.to_json_string())
    if acfg is not None:
        proc["feature_extractor"] = json.loads(Gemma4AudioFeatureExtractor().to_json_string())
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2, sort_keys=True) + "\n")
    saved = {}
    for f in sorted(out.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    for k, arr in weights.items():
        got = saved.get(gguf_to_hf(k, prefix="model.language_model."))
        if got is None or got.shape != arr.shape or not np.array_equal(got, np.asarray(arr, dtype=np.float32)):
            raise RuntimeError(f"{spec.name}: text tensor {k} did not round-trip through save_pretrained")
    return out


# --------------------------------------------------------------------------- the mmproj GGUF


def _vision_converter_name(hf_name: str) -> str:
    """The name llama.cpp's converter hands gguf-py's tensor map (``Gemma4VisionAudioModel.modify_tensors``)."""
    name = hf_name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    return name + ".weight" if name.endswith("position_embedding_table") else name


def mmproj_tensors(hf_dir: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], Any]:
    """The mmproj tensors of an HF folder: vision through gguf-py's MMPROJ map (patch projection as a
    ``[H, 3, p, p]`` kernel, clip scalars as 1-element tensors), audio under the canonical names.

    Returns:
        ``(name -> float32 array, audio config or None)``.

    Raises:
        RuntimeError: a vision tensor gguf-py cannot name.
    """
    hf_dir = Path(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    state: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    tensors: dict[str, np.ndarray] = {}
    if isinstance(raw.get("vision_config"), dict):
        tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 128)
        suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
        p = raw["vision_config"]["patch_size"]
        for key, arr in state.items():
            if not key.startswith(("model.vision_tower.", "model.embed_vision.")):
                continue
            arr = np.asarray(arr, dtype=np.float32)
            arr = arr.reshape(1) if arr.ndim == 0 else arr
            if key.endswith("patch_embedder.input_proj.weight"):
                arr = arr.reshape(arr.shape[0], p, p, 3).transpose(0, 3, 1, 2)
            name = tmap.get_name(_vision_converter_name(key), try_suffixes=suffixes)
            if name is None:
                raise RuntimeError(f"gguf-py has no MMPROJ name for {key}")
            tensors[name] = np.ascontiguousarray(arr)
    acfg = None
    if isinstance(raw.get("audio_config"), dict):
        acfg, AW = load_audio_hf(hf_dir)
        for name in expected_audio_tensors(acfg):
            tensors[name] = np.ascontiguousarray(np.asarray(AW[name], dtype=np.float32))
    return tensors, acfg


def write_mm_mmproj(hf_dir: str | os.PathLike[str], path: str | os.PathLike[str], use_gelu: bool | None = None) -> Path:
    """Write one F32 mmproj with the folder's vision and audio towers (module docstring), atomically, and read it
    back (names, shapes, bit-exact data).

    Args:
        hf_dir: the HF folder (:func:`write_mm_hf`).
        path: the ``.gguf`` to write.
        use_gelu: write ``clip.use_gelu`` with this value; None writes no key (as llama.cpp's converter).

    Raises:
        RuntimeError: a tensor gguf-py cannot name, or the read-back differs.
    """
    hf_dir, path = Path(hf_dir), Path(path)
    raw = json.loads((hf_dir / "config.json").read_text())
    tensors, acfg = mmproj_tensors(hf_dir)
    vc, tc = raw.get("vision_config"), raw["text_config"]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "clip")
    try:
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_clip_has_vision_encoder(isinstance(vc, dict))
        if isinstance(vc, dict):
            heads, hidden = vc["num_attention_heads"], vc["hidden_size"]
            w.add_clip_vision_projector_type(gguf.VisionProjectorType.GEMMA4V)
            w.add_vision_projection_dim(tc["hidden_size"])
            w.add_vision_image_size(224)
            w.add_vision_patch_size(vc["patch_size"])
            w.add_vision_embedding_length(hidden)
            w.add_vision_feed_forward_length(vc["intermediate_size"])
            w.add_vision_block_count(vc["num_hidden_layers"])
            w.add_vision_head_count(heads)
            w.add_vision_attention_layernorm_eps(vc.get("rms_norm_eps", 1e-6))
            w.add_vision_image_mean([0.0, 0.0, 0.0])
            w.add_vision_image_std([1.0, 1.0, 1.0])
            w.add_vision_projector_scale_factor(vc.get("pooling_kernel_size", 3))
            if vc.get("num_key_value_heads", heads) != heads:
                w.add_uint32("clip.vision.attention.head_count_kv", vc["num_key_value_heads"])
            if vc.get("head_dim", hidden // heads) != hidden // heads:
                w.add_uint32("clip.vision.attention.head_dim", vc["head_dim"])
            if use_gelu is not None:
                w.add_vision_use_gelu(use_gelu)
        if acfg is not None:
            for key, (val, vtype) in audio_mmproj_metadata(acfg).items():
                if key.startswith("clip.audio."):
                    w.add_key_value(key, val, VT[vtype])
            w.add_bool("clip.has_audio_encoder", True)
        for name, arr in tensors.items():
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    try:
        reader = gguf.GGUFReader(str(tmp))
        got = {t.name: t for t in reader.tensors}
        if set(got) != set(tensors):
            raise RuntimeError(f"{path}: tensor set differs after writing")
        for name, ref in tensors.items():
            back = np.asarray(got[name].data).reshape(ref.shape)
            if not np.array_equal(back.view(np.uint32), ref.view(np.uint32)):
                raise RuntimeError(f"{path}: {name}: data read back differs from what was written")
        del reader, got
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# --------------------------------------------------------------------------- building and caching


@dataclass(frozen=True)
class BuiltMMCase:
    """A built multimodal case on disk.

    Attributes:
        mspec: the spec.
        root: the case directory.
        hf_dir: the HF folder.
        gguf: the text GGUF (F32).
        mmproj: the mmproj GGUF (no ``clip.use_gelu``, as llama.cpp's converter writes it).
        mmproj_gelu: the same with ``clip.use_gelu = true``.
    """

    mspec: MMSpec
    root: Path
    hf_dir: Path
    gguf: Path
    mmproj: Path
    mmproj_gelu: Path
    files: dict[str, Path] = field(default_factory=dict)


def mm_case_key(ms: MMSpec) -> str:
    """Cache directory name: ``<name>-<sha12>`` over :data:`MM_BUILDER_VERSION` and the spec file's SHA-256."""
    h = hashlib.sha256(f"{MM_BUILDER_VERSION}\n{ms.spec.sha256}\n".encode()).hexdigest()
    return f"{ms.name}-{h[:12]}"


def _built(ms: MMSpec, root: Path) -> BuiltMMCase:
    return BuiltMMCase(ms, root, root / "hf", root / f"{ms.name}-F32.gguf", root / f"{ms.name}-mmproj.gguf",
                       root / f"{ms.name}-mmproj-gelu.gguf")


def build_mm_case(ms: MMSpec, out_dir: str | os.PathLike[str]) -> BuiltMMCase:
    """Build one multimodal case into ``out_dir`` (no caching): spec copy, HF folder, text GGUF, both mmprojs,
    then ``manifest.json``.

    Raises:
        RuntimeError: a writer's self-check failed, or the spec file changed since it was read.
    """
    t0 = time.perf_counter()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    raw = ms.spec.path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != ms.spec.sha256:
        raise RuntimeError(f"{ms.spec.path}: spec file changed since it was loaded")
    (root / "spec.toml").write_bytes(raw)
    weights = make_weights(ms.spec)
    case = _built(ms, root)
    write_mm_hf(ms, weights, case.hf_dir)
    specials = {ms.tokens[k]: s for k, s in TOKEN_STRINGS.items()}
    write_gguf(ms.spec, weights, case.gguf, "F32", special_tokens=specials)
    write_mm_mmproj(case.hf_dir, case.mmproj)
    if ms.vision is not None:
        write_mm_mmproj(case.hf_dir, case.mmproj_gelu, use_gelu=True)
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file()}
    manifest = {"builder_version": MM_BUILDER_VERSION, "name": ms.name, "spec_sha256": ms.spec.sha256,
                "seed": ms.spec.seed, "files": files, "build_seconds": round(time.perf_counter() - t0, 3)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return case


def ensure_mm_built(spec_or_path: MMSpec | str | os.PathLike[str],
                    cache_dir: str | os.PathLike[str] | None = None) -> BuiltMMCase:
    """The built case of a multimodal spec, built on a cache miss into ``<cache>/synth/<name>-<sha12>/``
    (:func:`mm_case_key`), in a temporary sibling renamed into place (as :func:`.cache.ensure_built`).

    Raises:
        SpecError: an invalid spec.
        RuntimeError: a writer's self-check failed.
    """
    ms = spec_or_path if isinstance(spec_or_path, MMSpec) else load_mm_spec(spec_or_path)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "synth"
    final = root / mm_case_key(ms)
    if (final / "manifest.json").is_file():
        return _built(ms, final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        build_mm_case(ms, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _built(ms, final)
