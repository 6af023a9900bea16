"""Shape-only models: Gemma 4 text decoders at their real dimensions, with random weights made on the device.

``g4h bench`` measures throughput at full scale without any model file: a
*shape* (``cases/shapes/<name>.toml``) holds the real ``config.json`` text
config of one published model (``e2b``, ``e4b``, ``26b-a4b``, ``31b``), and
:class:`RandomWeights` gives :class:`fast.model.FastModel` every tensor the
decoder reads, drawn directly on the device in the requested dtype (no file,
no host copy). Random weights compute nothing meaningful, but they move
exactly the bytes and run exactly the kernels of the real model.

Shape file format (TOML)::

    description = "one line: which model, its salient dimensions"
    source = "where every number came from (repository/path or URL)"
    [config]   # HF Gemma4TextConfig fields, as in cases/models/*.toml

The numbers and their sources are in each file's ``source`` string; the main
one is Google's copy of the four published ``config.json`` text configs in
github.com/AI-Hypercomputer/maxtext
``src/maxtext/checkpoint_conversion/utils/hf_model_configs.py``.

Helpers for small runs: :func:`truncate_layers` (``--layers N``: the first N
layers, KV sharing kept valid) and a ``vocab_size`` override in
:func:`load_shape`, so that a CPU test can run real-width layers.

Use::

    cfg = load_shape("31b")                                   # or load_shape("e2b", layers=4)
    fm = FastModel(cfg, RandomWeights(cfg, seed=0), "cuda", "bfloat16")

Device memory for the weights is :func:`param_counts` ``["total"]`` times the
dtype's size (norms and scales stay float32, a negligible share): E2B 9.3 GB,
E4B 14.9 GB, 26B-A4B 50.5 GB, 31B 61.4 GB in bfloat16; twice that in float32.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from gemma4_harness.reference.config import ModelConfig, expected_tensors, kv_donors
from gemma4_harness.reference.config_hf import config_from_hf
from gemma4_harness.reference.errors import InputError

from .paths import CASES_DIR
from .quant_blocks import block_layout
from .quants import QuantizedTensor

#: Folder of the shipped shape files (``cases/shapes``: the clone's, or the installed package's own copy).
SHAPES_DIR = CASES_DIR / "shapes"

_TOP_KEYS = ("description", "source", "config")


@dataclass(frozen=True)
class ShapeSpec:
    """A parsed shape file.

    Attributes:
        name: the file stem (``e2b`` for ``cases/shapes/e2b.toml``).
        description: the file's one-line description.
        source: where the numbers came from (free text, repository paths / URLs).
        config: the ``[config]`` table (HF ``Gemma4TextConfig`` field names).
        path: absolute path of the file.
    """

    name: str
    description: str
    source: str
    config: dict[str, Any]
    path: Path


def shape_names() -> list[str]:
    """Names of the shipped shapes (``cases/shapes/*.toml`` stems), sorted."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.toml"))


def shape_path(name_or_path: str | Path) -> Path:
    """Resolve a shape name (``e2b``, ``e4b``, ``26b-a4b``, ``31b``) or a path to its TOML file.

    Raises:
        InputError: neither a shipped shape name nor an existing file (the message
            lists the shipped names).
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise InputError(f"{p}: shape file not found")
        return p.resolve()
    cand = SHAPES_DIR / f"{name_or_path}.toml"
    if cand.is_file():
        return cand
    raise InputError(f"shape {str(name_or_path)!r}: unknown (expected one of {', '.join(shape_names())} "
                     "or a path to a .toml shape file)")


def load_shape_spec(name_or_path: str | Path) -> ShapeSpec:
    """Read and check one shape file (format: module docstring).

    Raises:
        InputError: unknown name, unreadable file, invalid TOML, a missing or
            mistyped ``description``/``source``/``[config]``, or an unknown
            top-level key. One line: ``<file>: <key>: <what was expected>``.
    """
    p = shape_path(name_or_path)
    try:
        doc = tomllib.loads(p.read_bytes().decode("utf-8"))
    except OSError as e:
        raise InputError(f"{p}: cannot read shape file: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{p}: not valid TOML: {str(e).splitlines()[0]}") from None
    for key, typ in (("description", str), ("source", str), ("config", dict)):
        if key not in doc:
            raise InputError(f"{p}: {key}: missing")
        if not isinstance(doc[key], typ):
            raise InputError(f"{p}: {key}: expected {'a table' if typ is dict else 'a string'}, "
                             f"got {type(doc[key]).__name__}")
    extra = sorted(set(doc) - set(_TOP_KEYS))
    if extra:
        raise InputError(f"{p}: {extra[0]}: unknown top-level key (expected {', '.join(_TOP_KEYS)})")
    return ShapeSpec(name=p.stem, description=doc["description"], source=doc["source"].strip(),
                     config=dict(doc["config"]), path=p)


def load_shape(name_or_path: str | Path, *, layers: int | None = None, vocab_size: int | None = None,
               overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a shape, optionally made smaller.

    Args:
        name_or_path: ``e2b`` | ``e4b`` | ``26b-a4b`` | ``31b``, or a path to a shape file.
        layers: keep only the first N layers (:func:`truncate_layers`); None = all.
        vocab_size: replace the vocabulary size (and the PLE table's rows,
            ``vocab_size_per_layer_input``, when the file states it), e.g. to fit a
            CPU test; None = the real 262144.
        overrides: other ``[config]`` fields to replace before the config is built
            (e.g. ``{"num_experts": 8, "top_k_experts": 2}``); each key must be a field
            the file states.

    Returns:
        The config, built by :func:`reference.config_hf.config_from_hf` (so derived
        per-layer facts follow transformers' rules); ``source`` names the file.

    Raises:
        InputError: see :func:`load_shape_spec`; an override key the file does not
            state or a non-positive ``vocab_size``; a bad field value
            (:class:`reference.errors.ConfigError`, naming file and field); a bad
            ``layers`` (see :func:`truncate_layers`).
    """
    spec = load_shape_spec(name_or_path)
    raw = dict(spec.config)
    for key, value in (overrides or {}).items():
        if key not in raw:
            raise InputError(f"{spec.path}: override {key!r}: not a field of its [config] table")
        raw[key] = value
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise InputError(f"{spec.path}: vocab_size override {vocab_size!r}: expected a positive integer")
        raw["vocab_size"] = vocab_size
        if "vocab_size_per_layer_input" in raw:
            raw["vocab_size_per_layer_input"] = vocab_size
    raw.setdefault("model_type", "gemma4_text")
    cfg = config_from_hf(raw, str(spec.path))
    if layers is not None:
        cfg = truncate_layers(cfg, layers)
    return cfg


def _sharing_valid(is_sliding: list[bool], n_shared: int) -> bool:
    first = len(is_sliding) - n_shared
    return all(any(is_sliding[j] == is_sliding[i] for j in range(first)) for i in range(first, len(is_sliding)))


def truncate_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The first ``n`` layers of ``cfg`` as a model of its own (for ``--layers N`` and CPU tests).

    Layer ``i`` keeps its real type (sliding/full) except that the last one is
    made full, as transformers forces for any Gemma 4 config. The KV-shared
    tail keeps the real model's share of shared layers,
    ``round(n * n_kv_shared / n_layer)``, reduced until every shared layer has a
    non-shared layer of its type to read from (so E2B at 10 layers shares its
    last 5, like its full 35 share 20; at 2 layers nothing is shared). Every
    layer's facts (head_dim, KV heads, V projection, FFN width incl. the
    double-wide MLP, RoPE) are copied from a layer of the real model with the
    same type and sharing, so the truncated layers are real layers.

    Args:
        cfg: a full config (e.g. from :func:`load_shape`).
        n: layers to keep, 1 <= n <= ``cfg.n_layer``.

    Returns:
        A new :class:`ModelConfig` (``cfg`` itself when nothing changes);
        ``source`` gets `` (first N layers)``. Tensors that span all layers (the
        PLE table and projection) shrink with it through
        :func:`reference.config.expected_tensors`.

    Raises:
        InputError: ``n`` out of range, or the real model has no layer of a
            needed (type, sharing) kind to copy.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.n_layer:
        raise InputError(f"{cfg.source}: layers = {n!r}: expected an integer in [1, {cfg.n_layer}]")
    if n == cfg.n_layer:
        return cfg
    is_sliding = [layer.is_sliding for layer in cfg.layers[:n]]
    is_sliding[-1] = False
    n_shared = round(n * cfg.n_kv_shared / cfg.n_layer)
    while n_shared and not _sharing_valid(is_sliding, n_shared):
        n_shared -= 1
    donors = kv_donors(is_sliding, n_shared, f"{cfg.source}: num_kv_shared_layers")
    templates: dict[tuple[bool, bool], Any] = {}
    for layer in cfg.layers:
        templates.setdefault((layer.is_sliding, layer.has_kv), layer)
    new_layers = []
    for i, sl in enumerate(is_sliding):
        has_kv = donors[i] == i
        t = templates.get((sl, has_kv))
        if t is None:
            kind = ("sliding" if sl else "full") + (" KV-owning" if has_kv else " KV-shared")
            raise InputError(f"{cfg.source}: layers = {n}: the model has no {kind} layer to copy")
        ff = None if t.rope_freq_factors is None else t.rope_freq_factors.copy()
        new_layers.append(dataclasses.replace(t, index=i, kv_donor=donors[i], rope_freq_factors=ff))
    return dataclasses.replace(cfg, n_layer=n, n_kv_shared=n_shared, layers=tuple(new_layers),
                               source=f"{cfg.source} (first {n} layers)")


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the text decoder, from :func:`reference.config.expected_tensors`.

    Returns:
        ``total`` (every tensor the decoder reads); ``token_embd`` (plus an untied
        ``output`` head in ``output``); ``ple_table`` (``per_layer_token_embd``, a
        lookup table: Google's "effective" size excludes it); ``experts`` (all expert
        matrices); ``active`` (per token: ``total`` minus the unchosen experts'
        share, ``experts * (1 - top_k / n_expert)``); ``effective`` (``total - ple_table``).
        Counts are elements, not bytes. The real checkpoints also store K/V
        projections for KV-shared layers, which the decoder never reads; they are
        not counted.
    """
    shapes = expected_tensors(cfg)
    size = {k: math.prod(s) for k, s in shapes.items()}
    total = sum(size.values())
    experts = sum(v for k, v in size.items() if k.endswith("_exps.weight"))
    unused = experts * (cfg.n_expert - cfg.n_expert_used) // cfg.n_expert if cfg.n_expert else 0
    ple = size.get("per_layer_token_embd.weight", 0)
    return {
        "total": total,
        "token_embd": size["token_embd.weight"],
        "output": size.get("output.weight", 0),
        "ple_table": ple,
        "experts": experts,
        "active": total - unused,
        "effective": total - ple,
    }


# --------------------------------------------------------------------------- random weights

#: Elements drawn per block (float32 scratch of 64 MiB): big tensors are filled block by
#: block along their first dimension, so making a 262144 x 5376 table never needs a
#: second full-size float32 copy.
BLOCK_ELEMENTS = 1 << 24


PACKED_TYPES = ("Q8_0", "Q4_K")
"""GGUF types :class:`RandomWeights` can draw packed (``g4h bench --shape S --quant TYPE``)."""


def random_packed(qtype: str, shape: tuple[int, ...], device: str | torch.device, std: float,
                  gen: torch.Generator) -> QuantizedTensor:
    """A ``[rows, cols]`` matrix of random GGUF blocks of ``qtype``, made on ``device``, whose decoded values have
    mean about 0 and standard deviation about ``std``.

    Every byte is uniform random except the fp16 block scales, which are set so that the values come out at
    ``std``: Q8_0 (``d * q``, q uniform int8, std 73.9): ``d = std / 73.9``; Q4_K (``d * sc * q - dmin * m``,
    6-bit sc and m uniform in 0..63, q uniform in 0..15): ``dmin = 7.5 d`` centres the values and
    ``d = std / 258`` scales them (``sc * q - 7.5 m`` has variance 1333.5 * 77.5 - 236.25**2 + 7.5**2 * 341.25,
    std 258). Decoded values
    are exact gguf values like any file's (:mod:`fast.quants`). Layouts: the GGML block formats (Q8_0: fp16 d then
    32 int8; Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of 4-bit quants).

    Args:
        qtype: one of :data:`PACKED_TYPES`.
        shape: ``(rows, cols)``, cols a multiple of the type's block size.
        device: where the bytes are made (no host copy on a GPU).
        std: target standard deviation of the decoded values (> 0).
        gen: a generator on ``device``.

    Raises:
        ValueError: an unknown type or a shape the blocks do not fit.
    """
    if qtype not in PACKED_TYPES:
        raise ValueError(f"random_packed: {qtype!r}: expected one of {', '.join(PACKED_TYPES)}")
    bs, ts = block_layout(qtype)
    rows, cols = shape
    if cols % bs:
        raise ValueError(f"random_packed: {cols} columns do not fill {qtype} blocks of {bs}")
    raw = torch.randint(0, 256, (rows, cols // bs, ts), dtype=torch.uint8, device=device, generator=gen)
    if qtype == "Q8_0":
        scales = [std / 73.9]
    else:
        scales = [std / 258.3, 7.5 * std / 258.3]
    for i, value in enumerate(scales):
        f16 = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)  # 2 bytes, little-endian
        raw[:, :, 2 * i:2 * i + 2] = f16
    return QuantizedTensor(raw.reshape(rows, -1), qtype, shape)


class RandomWeights:
    """Every tensor of ``expected_tensors(cfg)``, drawn on the device on request.

    Stands in for :class:`reference.weights.Weights` when building a
    :class:`fast.model.FastModel`: it iterates the same canonical GGUF names and
    answers ``shape(name)`` without making anything; ``torch_tensor(name,
    device, dtype)`` makes the tensor. FastWeights asks for 1-D tensors and
    scales in float32 and for matrices in the model dtype.

    Each tensor has its own ``torch.Generator(device)`` seeded from ``seed`` and
    the tensor name (SHA-256), so its values depend on nothing else. Values are
    drawn in float32 (block by block, :data:`BLOCK_ELEMENTS`) and rounded to the
    requested dtype, so a bfloat16 tensor is the rounding of the float32 one.
    Same seed, name, device type and torch version -> same values; CPU and CUDA
    generators differ, so CPU and CUDA draws differ.

    Scales (chosen so that activations stay O(1) through any number of layers,
    not to mimic trained weights):

    * ``token_embd``, untied ``output``: normal, std ``hidden**-0.5`` (the model
      multiplies embeddings by ``sqrt(hidden)``: unit-variance input; logits O(1)).
    * ``per_layer_token_embd``: normal, std ``ple_dim**-0.5`` (scaled by ``sqrt(ple_dim)``).
    * router ``ffn_gate_inp.weight``: normal, std 1 (its input is RMS-normalised and
      scaled by ``hidden**-0.5``, so expert scores have std ~1).
    * every other matrix / expert stack ``[.., out, in]``: normal, std ``in**-0.5``.
    * ``attn_q_norm``, ``attn_k_norm``: uniform ``[0.75, 1.25] * head_dim**-0.25``, so
      q.k has std ~1 (Gemma 4 attends with scale 1.0).
    * ``layer_output_scale``: uniform ``[0.8, 1.2]``.
    * every other 1-D tensor (RMSNorm weights, router scale, per-expert scale):
      uniform ``[0.5, 1.5]``.

    With ``qtype`` (one of :data:`PACKED_TYPES`), every 2-D matrix is drawn as packed GGUF blocks of that type
    instead (:meth:`torch_packed`, :func:`random_packed`, same std), as a quantized GGUF stores it: the fast
    engine keeps them packed (``--weights packed``) or decodes them at load.

    Args:
        cfg: the config (e.g. :func:`load_shape`).
        seed: integer seed, >= 0.
        qtype: None (float matrices) or a GGUF type of :data:`PACKED_TYPES`.

    Raises:
        InputError: a negative or non-integer seed, or a type not in :data:`PACKED_TYPES`.
        KeyError: (``shape``, ``torch_tensor``) a name the model does not have.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, qtype: str | None = None):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"random weights: seed {seed!r}: expected an integer >= 0")
        if qtype is not None and qtype not in PACKED_TYPES:
            raise InputError(f"random weights: --quant {qtype!r}: expected one of {', '.join(PACKED_TYPES)}")
        self.cfg = cfg
        self.seed = seed
        self.qtype = qtype
        self.source = f"random weights (seed {seed}{', ' + qtype if qtype else ''}) for {cfg.source}"
        self._shapes = expected_tensors(cfg)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy-order shape of ``name`` (linear ``[out, in]``, experts ``[E, out, in]``). Raises KeyError."""
        return self._shapes[name]

    def is_packed(self, name: str) -> bool:
        """True when ``name`` is drawn as packed GGUF blocks (:attr:`qtype` set, a 2-D matrix whose rows fill
        whole blocks), as a quantized GGUF stores its matrices. Raises KeyError for an unknown name."""
        shape = self._shapes[name]
        return self.qtype is not None and len(shape) == 2 and shape[-1] % block_layout(self.qtype)[0] == 0

    def raw_dtype(self, name: str) -> str:
        """The GGUF type ``name`` is drawn in: :attr:`qtype` for a packed matrix, else ``F32`` (a loader's term)."""
        return self.qtype if self.is_packed(name) else "F32"

    def torch_packed(self, name: str, device: str | torch.device) -> QuantizedTensor:
        """Make matrix ``name`` as random packed blocks of :attr:`qtype` on ``device`` (:func:`random_packed`, with
        the std of :meth:`init`). Raises KeyError for an unknown name, ValueError when it is not packed."""
        if not self.is_packed(name):
            raise ValueError(f"random weights: {name} is not drawn packed")
        gen = torch.Generator(device=torch.device(device))
        gen.manual_seed(self.tensor_seed(name))
        return random_packed(self.qtype, self._shapes[name], device, self.init(name)[2], gen)

    def tensor_seed(self, name: str) -> int:
        """The 63-bit generator seed of tensor ``name`` (from ``seed`` and the name)."""
        digest = hashlib.sha256(f"{self.seed}\0{name}".encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def init(self, name: str) -> tuple[str, float, float]:
        """How ``name`` is drawn: ``("normal", 0, std)`` or ``("uniform", low, high)`` (class docstring).

        Raises:
            KeyError: unknown name.
        """
        shape = self._shapes[name]
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if len(shape) == 1:
            if suffix in ("attn_q_norm.weight", "attn_k_norm.weight"):
                s = shape[0] ** -0.25
                return "uniform", 0.75 * s, 1.25 * s
            if suffix == "layer_output_scale.weight":
                return "uniform", 0.8, 1.2
            return "uniform", 0.5, 1.5
        if name in ("token_embd.weight", "output.weight"):
            return "normal", 0.0, self.cfg.hidden_size ** -0.5
        if name == "per_layer_token_embd.weight":
            return "normal", 0.0, self.cfg.ple_dim ** -0.5
        if suffix == "ffn_gate_inp.weight":
            return "normal", 0.0, 1.0
        return "normal", 0.0, shape[-1] ** -0.5

    def torch_tensor(self, name: str, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Make tensor ``name`` on ``device`` in ``dtype`` (contiguous, numpy-order shape).

        Nothing is made on the host when ``device`` is a GPU: the generator, the
        float32 scratch block and the result all live on the device.

        Raises:
            KeyError: unknown name.
        """
        shape = self._shapes[name]
        kind, a, b = self.init(name)
        device = torch.device(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(self.tensor_seed(name))
        out = torch.empty(shape, device=device, dtype=dtype)
        direct = dtype == torch.float32  # draw straight into the result; else into a float32 block, then round
        step = max(1, BLOCK_ELEMENTS // max(math.prod(shape[1:]), 1))
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            block = out[lo:hi] if direct else torch.empty((hi - lo, *shape[1:]), device=device, dtype=torch.float32)
            if kind == "normal":
                block.normal_(a, b, generator=gen)
            else:
                block.uniform_(a, b, generator=gen)
            if not direct:
                out[lo:hi].copy_(block)
        return out
