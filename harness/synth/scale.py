"""The scale fixture: a GGUF at a real Gemma 4 size (E2B, E4B, 26B-A4B, 31B) with random weights.

``g4h synth --shape e2b [--layers N] --format q8_0 --out FILE.gguf`` writes the text decoder of a
shape (``cases/shapes/*.toml``, read by :func:`fast.shapes.load_shape`; ``--layers`` through
:func:`fast.shapes.truncate_layers`) straight through ``gguf``'s writer: each tensor is drawn in
float32 a block of rows at a time, quantized with ``gguf.quants.quantize`` and written, so memory
stays at one block (~100 MB) whatever the model's size; no model is ever built in torch. Tests and
benchmarks use it to probe scale (the E2B file is 4.9 GB at Q8_0).

Values follow :meth:`fast.shapes.RandomWeights.init` (matrices normal with std ``in**-0.5``, tied
embeddings ``hidden**-0.5``, the PLE table ``ple_dim**-0.5``, norms uniform in [0.5, 1.5], q/k norms
scaled by ``head_dim**-0.25``): activations stay O(1) through any number of layers and the logits are
finite and spread out (measured on the E2B file: see ``tests/test_scale.py``). Each tensor draws from
its own generator seeded by ``(seed, name)`` (:meth:`~fast.shapes.RandomWeights.tensor_seed`), so a
file is the same on every run. Keys: :func:`harness.synth.gguf_metadata`'s ``gemma4`` keys, the
synthetic SentencePiece-style vocabulary of :func:`harness.synth.write_gguf`, ``rope_freqs``.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np

from gemma4_harness.fast.shapes import RandomWeights, load_shape, load_shape_spec
from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.errors import InputError

from .gguf import add_keys, gguf_tensor_type
from .weights import rope_freqs, tensor_shapes

#: ``--format`` -> the GGML type of the matrices (1-D tensors are F32; a row that does not fill a
#: quant block falls back to F16, as in :func:`harness.synth.gguf_tensor_type`).
FORMATS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "f16": "F16"}

#: Float32 elements drawn, quantized and written per step.
BLOCK_ELEMENTS = 1 << 24


def shape_raw_config(shape: str, layers: int | None = None, overrides: Mapping[str, Any] | None = None
                     ) -> tuple[dict, ModelConfig]:
    """The shape's ``[config]`` table (HF field names) and its config, cut to ``layers`` layers.

    ``overrides``: ``[config]`` fields to replace first (:func:`fast.shapes.load_shape`), e.g. a small
    ``hidden_size`` for a test.

    The table is rewritten for the cut (``num_hidden_layers``, ``layer_types``,
    ``num_kv_shared_layers`` from :func:`fast.shapes.truncate_layers`), so the metadata written from it
    describes the same layers the config holds.

    Raises:
        InputError: unknown shape, bad ``layers``; a cut whose metadata would derive other layers.
    """
    spec = load_shape_spec(shape)
    cfg = load_shape(shape, layers=layers, overrides=overrides)
    raw = {**spec.config, **(overrides or {})}
    raw.setdefault("model_type", "gemma4_text")
    if layers is not None and layers != len(raw["layer_types"]):
        raw.update(num_hidden_layers=cfg.n_layer, num_kv_shared_layers=cfg.n_kv_shared,
                   layer_types=cfg.layer_types())
    return raw, cfg


def _draw(rw: RandomWeights, name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` float32 values of tensor ``name`` as :meth:`RandomWeights.init` says."""
    kind, a, b = rw.init(name)
    if kind == "normal":
        return rng.standard_normal(n, dtype=np.float32) * np.float32(b) + np.float32(a)
    return rng.uniform(a, b, n).astype(np.float32)


def write_scale_gguf(shape: str, path: str | os.PathLike, *, layers: int | None = None, fmt: str = "q8_0",
                     seed: int = 0, overrides: Mapping[str, Any] | None = None,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Write a real-size ``gemma4`` GGUF with random weights, one block of rows at a time.

    Args:
        shape: ``e2b`` | ``e4b`` | ``26b-a4b`` | ``31b`` (or a shape ``.toml``).
        path: the output file (written beside it and renamed into place).
        layers: keep the first N layers (:func:`fast.shapes.truncate_layers`); None = all.
        fmt: ``q8_0`` | ``q4_0`` | ``f16`` (:data:`FORMATS`).
        seed: random seed (>= 0).
        overrides: ``[config]`` fields to replace (:func:`fast.shapes.load_shape`); None for the real shape.
        progress: called with a line per tensor group (e.g. ``print``), or None.

    Returns:
        ``Path(path)``.

    Raises:
        InputError: unknown shape or format, bad ``layers`` or ``seed``, an output that cannot be written.
    """
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    qtype = FORMATS[fmt]
    raw, cfg = shape_raw_config(shape, layers, overrides)
    rw = RandomWeights(cfg, seed)
    spec = types.SimpleNamespace(config=raw, name=f"{Path(str(shape)).stem}-random", path=Path(str(shape)))
    shapes = {"rope_freqs.weight": (raw["global_head_dim"] // 2,), **tensor_shapes(spec)}
    if set(shapes) - {"rope_freqs.weight"} != set(rw):
        raise InputError(f"shape {shape}: the metadata would describe other tensors than the config reads")
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {path}: cannot create its folder ({e.strerror})") from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write(tmp, raw, spec, shapes, rw, qtype, progress)
        os.replace(tmp, path)
    except OSError as e:
        raise InputError(f"--out {path}: cannot write ({e.strerror or e})") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _write(tmp: Path, raw: dict, spec, shapes: dict[str, tuple[int, ...]], rw: RandomWeights, qtype: str,
           progress: Callable[[str], None] | None) -> None:
    w = gguf.GGUFWriter(str(tmp), "gemma4")
    try:
        add_keys(w, spec, qtype)
        types_: dict[str, str] = {}
        for name, shape in shapes.items():
            types_[name] = gguf_tensor_type(name, shape, qtype)
            gtype = gguf.GGMLQuantizationType[types_[name]]
            nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, gtype)))
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=gtype)  # shape in elements
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]  # the data, streamed: each tensor padded to the alignment, as GGUFWriter pads

        def pad() -> None:
            fout.write(b"\0" * (-fout.tell() % w.data_alignment))

        pad()
        for i, (name, shape) in enumerate(shapes.items()):
            gtype = gguf.GGMLQuantizationType[types_[name]]
            if name == "rope_freqs.weight":
                fout.write(rope_freqs(raw).tobytes())
            else:
                rng = np.random.default_rng(rw.tensor_seed(name))
                cols = shape[-1]
                rows = int(np.prod(shape[:-1]))
                step = max(1, BLOCK_ELEMENTS // cols)
                for r0 in range(0, rows, step):  # quantization is row-wise: blocks of rows give the same bytes
                    block = _draw(rw, name, rng, min(step, rows - r0) * cols).reshape(-1, cols)
                    data = block if types_[name] == "F32" else gguf.quants.quantize(block, gtype)
                    fout.write(data.tobytes())
            pad()
            if progress and (name.endswith("attn_norm.weight") or not name.startswith("blk.")):
                progress(f"{name} ({types_[name]}) written")
    finally:
        w.close()
