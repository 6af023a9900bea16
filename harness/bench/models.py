"""Where ``g4h bench`` finds its model, and which engines it times on it.

``--model`` takes a GGUF file, an HF folder, or a case spec (``cases/bench/*.toml``,
``cases/models/*.toml``: built and cached on first use, giving both a GGUF and an HF folder);
``--shape`` a real-size config with random weights made on the device. Which engine reads which form:

- ``fast``, ``fast-graph`` (the same engine, tg through :mod:`fast.static_decode`), ``fast-unchecked`` (the same
  engine, tg without its output check), ``reference``: either form,
  through :func:`reference.weights.load_model`;
- ``transformers``: an HF folder (Gemma 4), or a Gemma 3 GGUF through transformers' GGUF loader;
- ``llamacpp``: a GGUF (an optional extra: ``pip install 'gemma4-harness[llamacpp]'``); ``llamacpp-native``: the
  same through llama.cpp's libraries compiled for this CPU (built once into the user cache on first use).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Sequence

from gemma4_harness.fast import shapes
from gemma4_harness.reference import load_model
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weights import DEFAULT_CACHE_BYTES

from .. import synth
from ..core.cases import MODELS_DIR
from ..core.engine_kinds import BENCH, BenchEngine
from ..engines import engine_class
from ..engines.base import Benchable, EngineUnavailable
from ..engines.fast import FastEngine
from ..engines.llamacpp import LlamaCppBench
from ..engines.llamacpp.pins import BuildError
from ..engines.llamacpp.native import ensure_native_built
from ..engines.reference import ReferenceEngine
from .run import ENGINE_NAMES, param_count


class ModelSource:
    """Where each engine finds the model named by ``--model`` or ``--shape``.

    Attributes:
        name: short model name for the report.
        gguf: a GGUF file or None.
        hf_dir: a Gemma 4 HF folder or None.
        shape: a shape-only model name or None (``quant``: its matrices drawn as packed GGUF blocks of that type;
            ``vocab_size``: a smaller vocabulary, for smoke runs).
        cfg, W: our config and weights (W is lazy; for a shape, random on the device).
    """

    def __init__(self, model: str | None, shape: str | None, device: str, layers: int | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, quant: str | None = None, vocab_size: int | None = None):
        self.gguf: Path | None = None
        self.hf_dir: Path | None = None
        self.shape = shape
        self.layers = None
        if shape:
            self.cfg = shapes.load_shape(shape, layers=layers, vocab_size=vocab_size)
            self.W = shapes.RandomWeights(self.cfg, qtype=quant)
            self.name = f"{Path(shape).stem} (shape only{', ' + quant if quant else ''})"
            self.path = str(shape)
            self.size_bytes = None
            return
        if model is None:
            raise InputError("g4h bench: give --model PATH or --shape NAME")
        if quant is not None:
            raise InputError("--quant draws a shape-only model's matrices packed: it needs --shape, not --model")
        p = Path(model)
        if not p.exists() and (MODELS_DIR / f"{model}.toml").is_file():
            p = MODELS_DIR / f"{model}.toml"  # a built-in case name
        if not p.exists():
            raise InputError(f"{p}: no such file or folder")
        if p.suffix == ".toml":
            built = synth.ensure_built(p)
            qt = "F32" if "F32" in built.gguf else sorted(built.gguf)[0]
            self.gguf, self.hf_dir = built.gguf[qt], built.hf_dir
        elif p.is_dir():
            self.hf_dir = p
        else:
            self.gguf = p
        self.layers = layers
        self.cfg, self.W = load_model(self.gguf or self.hf_dir, layers=layers, cache_bytes=cache_bytes)
        self.name = p.stem
        self.path = str(p)
        self.size_bytes = (self.gguf.stat().st_size if self.gguf else
                           sum(f.stat().st_size for f in self.hf_dir.glob("*.safetensors")))

    def info(self) -> dict[str, Any]:
        """Model facts for ``results.json``."""
        return {"name": self.name, "path": self.path, "arch": self.cfg.arch, "params": param_count(self.cfg),
                "size_bytes": self.size_bytes, "gguf": str(self.gguf) if self.gguf else None,
                "hf_dir": str(self.hf_dir) if self.hf_dir else None, "n_layer": self.cfg.n_layer,
                "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size}


def make_bench_engines(name: str, src: ModelSource, dtypes: Sequence[str], device: str,
                       threads: int | None, weights: str | None = None,
                       built: Sequence[Benchable] = ()) -> list[Benchable]:
    """The engines of ``name`` to time (one per dtype where the engine takes a dtype), made by its row's ``maker``
    (:data:`harness.core.engine_kinds.BENCH_ENGINES`).

    ``weights``: the fast engine's weight mode (``packed``/``dequantized``; None: packed for a quantized GGUF,
    :func:`harness.engines.fast.default_weight_mode`). ``built``: engines made already; ``fast`` and
    ``fast-graph`` of one dtype share one built model (:meth:`harness.engines.fast.FastEngine.from_model`'s
    ``share``).

    Raises:
        EngineUnavailable: not installed, or cannot read this model form (one line).
    """
    row = BENCH.get(name)
    if row is None:
        raise EngineUnavailable(f"unknown engine {name!r} (available: {', '.join(ENGINE_NAMES)})")
    if src.shape and not row.shapes:
        raise EngineUnavailable(f"{name}: a shape-only model has no file; only the fast engine runs it")
    module, _, function = row.maker.partition(":")
    return getattr(importlib.import_module(module), function)(row, src, dtypes, device, threads, weights, built)


def fast_benches(row: BenchEngine, src: ModelSource, dtypes: Sequence[str], device: str, threads: int | None,
                 weights: str | None, built: Sequence[Benchable]) -> list[Benchable]:
    """The fast engine of each dtype, or of its ``row.variant`` (``graph``, ``unchecked``, ``q8``)."""
    twins = {b.dtype: b for b in built if isinstance(b, FastEngine)}
    if row.variant == "q8":  # llama.cpp's arithmetic (fast.q8_compute): float32 activations only
        engines = [FastEngine.from_model(src.cfg, src.W, device, "float32", weights=weights,
                                         share=twins.get("float32"), compute="q8")]
        engines[0].engine = row.name
        return engines
    engines = [FastEngine.from_model(src.cfg, src.W, device, dt, weights=weights, static=row.variant == "graph",
                                     share=twins.get(dt))
               for dt in dtypes]
    if row.variant == "unchecked":  # the same engine and model, its decode loop's output check off
        for eng in engines:
            eng.engine, eng.tests, eng.check_output = row.name, ("tg",), False
    return engines


def transformers_benches(row: BenchEngine, src: ModelSource, dtypes: Sequence[str], device: str,
                         threads: int | None, weights: str | None, built: Sequence[Benchable]) -> list[Benchable]:
    """transformers in each dtype of ``dtypes`` but float16 (an HF folder; a Gemma 3 GGUF through its GGUF loader)."""
    if src.hf_dir is None and not (src.gguf is not None and src.cfg.arch == "gemma3"):
        raise EngineUnavailable("transformers needs an HF folder for Gemma 4 (it cannot read a Gemma 4 GGUF); "
                                "pass a case spec (cases/bench/*.toml) or an HF folder")
    eng = engine_class(row.kind)(src.hf_dir or src.gguf, src.cfg, layers=src.layers)  # imported when asked
    if device != "cpu":
        eng.model = eng.model.to(device)
    return [eng.cast(dt) for dt in dtypes if dt != "float16"]


def reference_benches(row: BenchEngine, src: ModelSource, dtypes: Sequence[str], device: str, threads: int | None,
                      weights: str | None, built: Sequence[Benchable]) -> list[Benchable]:
    """The float64 reference, warmed."""
    eng = ReferenceEngine.from_model(src.cfg, src.W)
    eng.warm()
    return [eng]


def llamacpp_benches(row: BenchEngine, src: ModelSource, dtypes: Sequence[str], device: str, threads: int | None,
                     weights: str | None, built: Sequence[Benchable]) -> list[Benchable]:
    """llama.cpp on the GGUF as it is: the portable build, or (``native``) the one compiled for this CPU."""
    if src.gguf is None:
        raise EngineUnavailable(f"{row.name} needs a GGUF file")
    if src.layers is not None:
        raise EngineUnavailable(f"{row.name} runs the file as it is: --layers cannot cut it")
    lib_dir = None
    if row.variant == "native":
        LlamaCppBench(src.gguf, src.cfg)  # llama-cpp-python is there before a build is started
        try:
            lib_dir = ensure_native_built()
        except BuildError as e:
            raise EngineUnavailable(f"{row.name}: {e}") from None
    return [LlamaCppBench(src.gguf, src.cfg, threads=threads, lib_dir=lib_dir, engine=row.name)]
