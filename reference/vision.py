"""The Gemma 4 vision encoder in float64 NumPy: patches in, projected soft tokens out.

One small function per operation, composed by :func:`encode_image`. Formulas
follow transformers 5.23 ``models/gemma4/modeling_gemma4.py``
(``Gemma4VisionPatchEmbedder``, ``Gemma4VisionAttention``,
``Gemma4VisionEncoderLayer``, ``Gemma4VisionPooler``, ``Gemma4VisionModel``,
``Gemma4MultimodalEmbedder``), the tie-breaker; llama.cpp
``tools/mtmd/models/gemma4v.cpp`` and ``clip.cpp`` (``build_vit``) give the
tensor names (canonical weight names are the mmproj GGUF names, see
:mod:`reference.mm_weights`) and the trace-point names.

Shapes: N = patches (padding rows included), H = vision hidden_size,
nH / nKV = query / KV heads, D = head_dim, F = intermediate_size,
p = patch_size, k = pooling_kernel_size, n_soft = soft tokens of one image,
H_text = text hidden size.

Trace points (llama.cpp clip graph-callback names; per-patch arrays hold the
non-padding rows only, in the processor's row-major order, so they line up
with llama.cpp, which has no padding):

* layer -1: ``inp_raw_scaled`` ``[N, 3p^2]`` (``2x - 1``; patches in HWC order,
  whereas llama.cpp's tensor is the image itself), ``inp`` ``[N, H]`` (patch
  projection), ``pos_embd`` ``[N, H]`` (plus the x and y tables);
* per layer: ``layer_inp_normed``, ``Qcur_pos`` / ``Kcur_pos`` ``[N, nH|nKV, D]``
  (after q/k norm and 2-D RoPE), ``Vcur_normed`` ``[N, nKV, D]``, ``kqv_out``
  ``[N, nH*D]`` (before the output projection), ``attn_out`` (after it),
  ``attn_post_normed``, ``ffn_inp`` (the residual stream after attention),
  ``ffn_inp_normed``, ``ffn_out`` (the MLP output), ``ffn_post_normed``,
  ``layer_out``, all ``[N, H]`` unless stated;
* layer -1: ``pooled`` ``[n_soft, H]`` (after the ``sqrt(H)`` scale),
  ``std_scaled`` ``[n_soft, H]`` (only when ``standardize``), ``projected``
  ``[n_soft, H_text]``.

A trace callback gets ``(point, layer, array)`` as in :mod:`reference.model`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .errors import ConfigError, InputError
from .model import apply_rope, gelu_tanh, linear, rms_norm, rope_angles, softmax

TraceFn = Callable[[str, int, np.ndarray], None]

# llama.cpp clip.cpp hard-codes these for PROJECTOR_TYPE_GEMMA4V (HF reads them from the config).
LLAMACPP_ROPE_THETA = 100.0
LLAMACPP_POOLING_KERNEL = 3

# Suffixes of the four ClippableLinear scalars, in (input_min, input_max, output_min, output_max) order.
CLIP_BOUND_SUFFIXES = ("input_min", "input_max", "output_min", "output_max")


def _f32(x: float) -> float:
    return float(np.float32(x))


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class VisionConfig:
    """Hyper-parameters of the vision tower and its projector (HF ``Gemma4VisionConfig`` field names).

    Attributes:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim: sizes.
        rms_norm_eps: RMSNorm epsilon (float32-rounded, as both sources store it).
        rope_theta: base of the 2-D RoPE (HF ``rope_parameters.rope_theta``, default 100).
        patch_size: p, pixels per patch side.
        pooling_kernel_size: k, patches per pooled cell side.
        position_embedding_size: rows of each of the x and y position tables.
        use_clipped_linears: every encoder linear clamps its input and output
            (``Gemma4ClippableLinear``).
        standardize: ``(h - std_bias) * std_scale`` after the pooler.
        text_hidden_size: output width of ``embed_vision`` (the text model's hidden size).
        source: file the config came from (for messages).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    text_hidden_size: int
    source: str = ""

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json",
                text_hidden_size: int | None = None) -> "VisionConfig":
        """Build from an HF ``config.json``: a multimodal one (``model_type`` ``gemma4`` with
        ``vision_config`` and ``text_config``) or a bare ``vision_config`` object.

        Defaults are transformers 5.23 ``Gemma4VisionConfig``'s.

        Args:
            raw: the parsed JSON object.
            source: path, for messages.
            text_hidden_size: projector output width; needed only for a bare vision_config.

        Raises:
            ConfigError: no vision_config, a missing text hidden size, or a bad value (the field is named).
        """
        if raw.get("model_type") == "gemma4":
            vc = raw.get("vision_config")
            if not isinstance(vc, Mapping):
                raise ConfigError(f"{source}: model_type 'gemma4' without a vision_config object (no vision tower)")
            tc = raw.get("text_config") or {}
            text_hidden_size = tc.get("hidden_size", text_hidden_size) if isinstance(tc, Mapping) else None
        else:
            vc = raw
        if vc.get("model_type", "gemma4_vision") != "gemma4_vision":
            raise ConfigError(f"{source}: vision_config.model_type = {vc.get('model_type')!r}: "
                              "expected 'gemma4_vision'")
        if text_hidden_size is None:
            raise ConfigError(f"{source}: text_config.hidden_size is missing (needed for the projector width)")

        def get(key: str, default: Any) -> Any:
            v = vc.get(key)
            return default if v is None else v

        if get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: vision_config.hidden_activation = {vc['hidden_activation']!r}: "
                              "expected 'gelu_pytorch_tanh'")
        if get("attention_bias", False):
            raise ConfigError(f"{source}: vision_config.attention_bias = true is not supported (Gemma 4 has none)")
        rope = get("rope_parameters", {})
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: vision_config.rope_parameters: expected an object")
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{source}: vision_config.rope_parameters.rope_type = {rope['rope_type']!r}: "
                              "expected 'axial'")
        hidden = get("hidden_size", 768)
        heads = get("num_attention_heads", 12)
        cfg = cls(
            hidden_size=hidden, intermediate_size=get("intermediate_size", 3072),
            num_hidden_layers=get("num_hidden_layers", 16), num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", 12), head_dim=get("head_dim", 64),
            rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", 100.0),
            patch_size=get("patch_size", 16), pooling_kernel_size=get("pooling_kernel_size", 3),
            position_embedding_size=get("position_embedding_size", 10240),
            use_clipped_linears=get("use_clipped_linears", False), standardize=get("standardize", False),
            text_hidden_size=text_hidden_size, source=source,
        )
        return cfg.validated("vision_config.")

    @classmethod
    def from_mmproj(cls, meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]],
                    source: str = "mmproj") -> "VisionConfig":
        """Build from an mmproj GGUF's metadata and tensor table (llama.cpp ``clip.cpp`` rules).

        ``pooling_kernel_size`` comes from ``clip.vision.projector.scale_factor``
        (llama.cpp's hard-coded 3 when absent) and the RoPE theta is llama.cpp's
        hard-coded 100; ``position_embedding_size`` and the projector width come
        from the shapes of ``v.position_embd.weight`` and
        ``mm.input_projection.weight``; ``standardize`` from the presence of
        ``v.std_bias``; ``use_clipped_linears`` from any ``.input_min``-style scalar.

        Note: llama.cpp runs the vision MLP with ``gelu_quick`` unless
        ``clip.use_gelu`` is true, and the converter does not write that key; the
        model's activation (and this reference's) is tanh-GELU either way.

        Args:
            meta: GGUF key -> value.
            tensors: GGUF tensor name -> numpy-order shape.
            source: path, for messages.

        Raises:
            ConfigError: not a gemma4v mmproj, a missing key or tensor, a bad value (named).
        """
        arch = meta.get("general.architecture")
        if arch != "clip":
            raise ConfigError(f"{source}: general.architecture = {arch!r}: expected 'clip' (an mmproj GGUF)")
        ptype = meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")
        if ptype != "gemma4v":
            raise ConfigError(f"{source}: clip.vision.projector_type = {ptype!r}: expected 'gemma4v'")
        if meta.get("clip.has_vision_encoder") is not True:
            raise ConfigError(f"{source}: clip.has_vision_encoder is not true (no vision tower in this mmproj)")

        def req(key: str) -> Any:
            if key not in meta:
                raise ConfigError(f"{source}: missing key {key}")
            return meta[key]

        for name in ("v.position_embd.weight", "mm.input_projection.weight"):
            if name not in tensors:
                raise ConfigError(f"{source}: missing tensor {name}")
        pos_shape, proj_shape = tensors["v.position_embd.weight"], tensors["mm.input_projection.weight"]
        if len(pos_shape) != 3 or pos_shape[0] != 2:
            raise ConfigError(f"{source}: v.position_embd.weight has shape {list(pos_shape)}, expected [2, P, H]")
        text_hidden = int(proj_shape[0])
        proj_dim = meta.get("clip.vision.projection_dim")
        if proj_dim is not None and proj_dim != text_hidden:
            raise ConfigError(f"{source}: clip.vision.projection_dim = {proj_dim} but mm.input_projection.weight "
                              f"has {text_hidden} output rows")
        hidden = req("clip.vision.embedding_length")
        heads = req("clip.vision.attention.head_count")
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
        cfg = cls(
            hidden_size=hidden, intermediate_size=req("clip.vision.feed_forward_length"),
            num_hidden_layers=req("clip.vision.block_count"), num_attention_heads=heads,
            num_key_value_heads=meta.get("clip.vision.attention.head_count_kv", heads),
            head_dim=meta.get("clip.vision.attention.head_dim", hidden // heads if ok else 0),
            rms_norm_eps=req("clip.vision.attention.layer_norm_epsilon"), rope_theta=LLAMACPP_ROPE_THETA,
            patch_size=req("clip.vision.patch_size"),
            pooling_kernel_size=meta.get("clip.vision.projector.scale_factor", LLAMACPP_POOLING_KERNEL),
            position_embedding_size=int(pos_shape[1]),
            use_clipped_linears=any(n.rsplit(".", 1)[-1] in CLIP_BOUND_SUFFIXES for n in tensors),
            standardize="v.std_bias" in tensors, text_hidden_size=text_hidden, source=source,
        )
        return cfg.validated("clip.vision.")

    def validated(self, where: str) -> "VisionConfig":
        """Check every value; return a copy with eps and theta float32-rounded.

        Raises:
            ConfigError: a non-positive size, heads not a multiple of KV heads,
                head_dim not a multiple of 4 (each RoPE half needs pairs), eps
                outside (0, 1), theta <= 0. The message names the field.
        """
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "patch_size", "pooling_kernel_size",
                     "position_embedding_size", "text_hidden_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ConfigError(f"{self.source}: {where}{name} = {v!r}: expected a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.source}: {where}num_attention_heads = {self.num_attention_heads} is not a "
                              f"multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"{self.source}: {where}head_dim = {self.head_dim}: expected a multiple of 4 "
                              "(x and y RoPE halves of rotated pairs)")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ConfigError(f"{self.source}: {where}rms_norm_eps = {eps!r}: expected 0 < eps < 1")
        th = self.rope_theta
        if isinstance(th, bool) or not isinstance(th, (int, float)) or th <= 0:
            raise ConfigError(f"{self.source}: {where}rope_theta = {th!r}: expected a positive number")
        for name in ("use_clipped_linears", "standardize"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{self.source}: {where}{name} = {getattr(self, name)!r}: expected true or false")
        return dataclasses.replace(self, rms_norm_eps=_f32(eps), rope_theta=_f32(th))

    @property
    def patch_dim(self) -> int:
        """Values per patch, ``3 * p^2``."""
        return 3 * self.patch_size**2


# --------------------------------------------------------------------------- operations


def clipped_linear(x: np.ndarray, w: np.ndarray, bounds: tuple[float, float, float, float] | None) -> np.ndarray:
    """ClippableLinear: clamp the input, ``x @ w.T``, clamp the output; plain linear when ``bounds`` is None.

    [N, in], [out, in], (input_min, input_max, output_min, output_max) -> [N, out].
    Source: transformers ``Gemma4ClippableLinear``; llama.cpp ``clip_graph_gemma4v::build_mm``.
    """
    if bounds is None:
        return linear(x, w)
    in_lo, in_hi, out_lo, out_hi = bounds
    return np.clip(linear(np.clip(x, in_lo, in_hi), w), out_lo, out_hi)


def scale_pixels(pixel_values: np.ndarray) -> np.ndarray:
    """Map pixels from [0, 1] to [-1, 1]: ``2x - 1``. [N, 3p^2] -> [N, 3p^2].

    Source: transformers ``Gemma4VisionPatchEmbedder.forward``; llama.cpp ``inp_raw_scaled``.
    """
    return 2.0 * pixel_values - 1.0


def patch_embed(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Patch projection (a stride-p convolution without bias), on patches flattened in HWC order.

    [N, p*p*3] (row, column, channel), [H, 3, p, p] (llama.cpp's conv kernel) -> [N, H].
    Source: transformers ``Gemma4VisionPatchEmbedder.input_proj``; llama.cpp ``ggml_conv_2d``.
    """
    n, p = x.shape[0], kernel.shape[-1]
    return np.einsum("nijc,hcij->nh", x.reshape(n, p, p, 3), kernel)


def position_embed(positions: np.ndarray, table: np.ndarray, padding: np.ndarray) -> np.ndarray:
    """Learned 2-D position embedding ``T_x[x] + T_y[y]``, zero on padding rows.

    [N, 2] (x = column, y = row), [2, P, H], [N] bool -> [N, H].
    Source: transformers ``Gemma4VisionPatchEmbedder._position_embeddings``.
    """
    pos = np.maximum(positions, 0)
    emb = table[0][pos[:, 0]] + table[1][pos[:, 1]]
    return np.where(padding[:, None], 0.0, emb)


def rope_inv_freq_2d(head_dim: int, theta: float) -> np.ndarray:
    """Inverse frequencies of each RoPE half: ``theta^(-2i / (D/2))`` for i < D/4. [] -> [D/4].

    Source: transformers ``Gemma4VisionRotaryEmbedding.compute_axial_rope_parameters``.
    """
    half = head_dim // 2
    return theta ** (-np.arange(0, half, 2, dtype=np.float64) / half)


def rope_2d(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """2-D RoPE: dims [0, D/2) rotate by x, dims [D/2, D) by y, NeoX pairs (i, i + D/4) within each half.

    [N, heads, D], [N, 2] -> [N, heads, D]. Source: transformers ``apply_multidimensional_rope``;
    llama.cpp ``gemma4v.cpp`` (two NEOX ``ggml_rope_ext`` calls with n_dims = D/2).
    """
    half = x.shape[-1] // 2
    inv = rope_inv_freq_2d(x.shape[-1], theta)
    cos_x, sin_x = rope_angles(positions[:, 0], inv)
    cos_y, sin_y = rope_angles(positions[:, 1], inv)
    x_part = apply_rope(x[..., :half], cos_x, sin_x, half)
    y_part = apply_rope(x[..., half:], cos_y, sin_y, half)
    return np.concatenate([x_part, y_part], axis=-1)


def vision_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_valid: np.ndarray) -> np.ndarray:
    """Non-causal attention with scale 1.0 over the valid keys (padding keys masked).

    [N, nH, D], [N, nKV, D], [N, nKV, D], [N] bool -> [N, nH*D].
    Source: transformers ``Gemma4VisionAttention`` (``scaling = 1.0``, ``create_bidirectional_mask``).
    """
    n, heads, d = q.shape
    group = heads // k.shape[1]
    kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [N, nH, D]
    scores = np.einsum("thd,shd->hts", q, kh)  # [nH, N, N]
    scores = np.where(key_valid[None, None, :], scores, -np.inf)
    out = np.einsum("hts,shd->thd", softmax(scores), vh)  # [N, nH, D]
    return out.reshape(n, heads * d)


def vision_mlp(cfg: VisionConfig, W: Mapping[str, np.ndarray], b: str, x: np.ndarray) -> np.ndarray:
    """GeGLU MLP ``down(gelu_tanh(gate x) * up x)`` with ClippableLinear projections. [N, H] -> [N, H].

    Source: transformers ``Gemma4VisionMLP``.
    """
    g = clipped_linear(x, W[b + "ffn_gate.weight"], clip_bounds(cfg, W, b + "ffn_gate"))
    u = clipped_linear(x, W[b + "ffn_up.weight"], clip_bounds(cfg, W, b + "ffn_up"))
    return clipped_linear(gelu_tanh(g) * u, W[b + "ffn_down.weight"], clip_bounds(cfg, W, b + "ffn_down"))


def pool_cells(positions: np.ndarray, k: int) -> np.ndarray:
    """Pooled cell of each patch, row-major: ``x//k + ((max_x + 1)//k) * (y//k)``. [N, 2] -> [N] int.

    ``max_x`` is taken over the given rows (padding rows clamped to 0).
    Source: transformers ``Gemma4VisionPooler._avg_pool_by_positions``.
    """
    pos = np.maximum(positions, 0)
    cells_per_row = (int(pos[:, 0].max()) + 1) // k
    return pos[:, 0] // k + cells_per_row * (pos[:, 1] // k)


def pool(h: np.ndarray, positions: np.ndarray, padding: np.ndarray, k: int) -> np.ndarray:
    """Average each k x k cell of patches (sum / k^2), drop empty cells and padding, scale by ``sqrt(H)``.

    [N, H], [N, 2], [N] bool -> [n_soft, H], cells in row-major order.
    Source: transformers ``Gemma4VisionPooler``; llama.cpp ``gemma4v.cpp`` (``ggml_pool_2d``, ``pooled``).
    """
    valid = ~padding
    cells = pool_cells(positions, k)[valid]
    n_cells = int(cells.max()) + 1
    sums = np.zeros((n_cells, h.shape[1]))
    np.add.at(sums, cells, h[valid])
    counts = np.bincount(cells, minlength=n_cells)
    return sums[counts > 0] / k**2 * math.sqrt(h.shape[1])


def standardize(h: np.ndarray, std_bias: np.ndarray, std_scale: np.ndarray) -> np.ndarray:
    """``(h - std_bias) * std_scale``. [n, H], [H], [H] -> [n, H].

    Source: transformers ``Gemma4VisionModel.forward``; llama.cpp ``gemma4v.cpp`` (``std_scaled``).
    """
    return (h - std_bias) * std_scale


def embed_vision(h: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Projector into the text model: RMSNorm without weight, then linear (no sqrt(H_text) scale).

    [n, H], [H_text, H] -> [n, H_text]. Source: transformers ``Gemma4MultimodalEmbedder``;
    llama.cpp ``gemma4v.cpp`` (``projected``).
    """
    return linear(rms_norm(h, None, eps), w)


# --------------------------------------------------------------------------- blocks


def clip_bounds(cfg: VisionConfig, W: Mapping[str, np.ndarray], name: str) -> tuple[float, float, float, float] | None:
    """The four ClippableLinear scalars of linear ``name`` (e.g. ``v.blk.0.attn_q``), or None without clipping.

    A scalar missing from ``W`` means no bound (llama.cpp ``get_scalar`` defaults to ±FLT_MAX).
    """
    if not cfg.use_clipped_linears:
        return None
    inf = (-np.inf, np.inf, -np.inf, np.inf)
    return tuple(float(W[f"{name}.{s}"][0]) if f"{name}.{s}" in W else d
                 for s, d in zip(CLIP_BOUND_SUFFIXES, inf))  # type: ignore[return-value]


def _trace(trace: TraceFn | None, point: str, layer: int, arr: np.ndarray, rows: np.ndarray | None) -> None:
    if trace:
        trace(point, layer, arr if rows is None else arr[rows])


def attention_block(cfg: VisionConfig, W: Mapping[str, np.ndarray], il: int, x: np.ndarray,
                    positions: np.ndarray, valid: np.ndarray, trace: TraceFn | None) -> np.ndarray:
    """Self-attention of one encoder layer, from the normed stream to the output projection.

    q, k: projection, per-head RMSNorm with weight, 2-D RoPE; v: projection,
    RMSNorm without weight. [N, H] -> [N, H]. Source: transformers ``Gemma4VisionAttention``.
    """
    b, n, d, eps = f"v.blk.{il}.", x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    q = clipped_linear(x, W[b + "attn_q.weight"], clip_bounds(cfg, W, b + "attn_q")).reshape(n, -1, d)
    k = clipped_linear(x, W[b + "attn_k.weight"], clip_bounds(cfg, W, b + "attn_k")).reshape(n, -1, d)
    v = clipped_linear(x, W[b + "attn_v.weight"], clip_bounds(cfg, W, b + "attn_v")).reshape(n, -1, d)
    q = rope_2d(rms_norm(q, W[b + "attn_q_norm.weight"], eps), positions, cfg.rope_theta)
    k = rope_2d(rms_norm(k, W[b + "attn_k_norm.weight"], eps), positions, cfg.rope_theta)
    v = rms_norm(v, None, eps)
    _trace(trace, "Qcur_pos", il, q, valid)
    _trace(trace, "Kcur_pos", il, k, valid)
    _trace(trace, "Vcur_normed", il, v, valid)
    out = vision_attention(q, k, v, valid)
    _trace(trace, "kqv_out", il, out, valid)
    return clipped_linear(out, W[b + "attn_out.weight"], clip_bounds(cfg, W, b + "attn_out"))


def encoder_layer(cfg: VisionConfig, W: Mapping[str, np.ndarray], il: int, h: np.ndarray, positions: np.ndarray,
                  valid: np.ndarray, trace: TraceFn | None) -> np.ndarray:
    """One encoder layer with sandwich norms. [N, H] -> [N, H].

    ``a = h + attn_post_norm(attn(ln1(h)))``; ``y = a + ffn_post_norm(mlp(ln2(a)))``.
    Source: transformers ``Gemma4VisionEncoderLayer``; llama.cpp ``clip_graph::build_vit``.
    """
    b, eps = f"v.blk.{il}.", cfg.rms_norm_eps
    x = rms_norm(h, W[b + "ln1.weight"], eps)
    _trace(trace, "layer_inp_normed", il, x, valid)
    a = attention_block(cfg, W, il, x, positions, valid, trace)
    _trace(trace, "attn_out", il, a, valid)
    a = rms_norm(a, W[b + "attn_post_norm.weight"], eps)
    _trace(trace, "attn_post_normed", il, a, valid)
    h = h + a
    _trace(trace, "ffn_inp", il, h, valid)
    x = rms_norm(h, W[b + "ln2.weight"], eps)
    _trace(trace, "ffn_inp_normed", il, x, valid)
    f = vision_mlp(cfg, W, b, x)
    _trace(trace, "ffn_out", il, f, valid)
    f = rms_norm(f, W[b + "ffn_post_norm.weight"], eps)
    _trace(trace, "ffn_post_normed", il, f, valid)
    h = h + f
    _trace(trace, "layer_out", il, h, valid)
    return h


def check_patches(cfg: VisionConfig, pixel_values: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """Validate one image's patches and positions; return the padding mask [N] bool.

    Raises:
        InputError: wrong shapes, no valid patch, a position outside the
            position tables, or a patch grid whose sides are not multiples of k.
    """
    pv, pos = np.asarray(pixel_values), np.asarray(position_ids)
    if pv.ndim != 2 or pv.shape[1] != cfg.patch_dim:
        raise InputError(f"pixel_values has shape {list(pv.shape)}, expected [N, {cfg.patch_dim}] (3 * patch_size^2)")
    if pos.shape != (pv.shape[0], 2):
        raise InputError(f"position_ids has shape {list(pos.shape)}, expected [{pv.shape[0]}, 2]")
    padding = np.all(pos == -1, axis=-1)
    real = pos[~padding]
    if real.size == 0:
        raise InputError("the image has no patches (every position is padding)")
    if real.min() < 0 or real.max() >= cfg.position_embedding_size:
        bad = int(real.min()) if real.min() < 0 else int(real.max())
        raise InputError(f"patch position {bad} is outside the position tables [0, {cfg.position_embedding_size}): "
                         "the image is too large for this model")
    k = cfg.pooling_kernel_size
    width, height = int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1
    if width % k or height % k:
        raise InputError(f"patch grid {width} x {height} is not a multiple of pooling_kernel_size {k} on each side")
    return padding


def encode_image(cfg: VisionConfig, W: Mapping[str, np.ndarray], pixel_values: np.ndarray,
                 position_ids: np.ndarray, trace: TraceFn | None = None) -> np.ndarray:
    """Soft-token embeddings of one image, ready to replace its image tokens in the text model.

    Args:
        cfg: vision config.
        W: canonical vision weights (mmproj GGUF names, float64), e.g. from
            :func:`reference.mm_weights.load_vision`.
        pixel_values: [N, 3p^2] patches in [0, 1], HWC order inside a patch;
            padding rows allowed (as the image processor pads to its budget).
        position_ids: [N, 2] (x = column, y = row) in patches; ``(-1, -1)`` marks padding.
        trace: optional callback ``(point, layer, array)``; see the module docstring.

    Returns:
        float64 ``[n_valid / k^2, H_text]``, soft tokens in row-major cell order.

    Raises:
        InputError: see :func:`check_patches`.

    Source: transformers ``Gemma4Model.get_image_features``.
    """
    padding = check_patches(cfg, pixel_values, position_ids)
    valid = ~padding
    pos = np.asarray(position_ids, dtype=np.int64)
    x = scale_pixels(np.asarray(pixel_values, dtype=np.float64))
    _trace(trace, "inp_raw_scaled", -1, x, valid)
    h = patch_embed(x, W["v.patch_embd.weight"])
    _trace(trace, "inp", -1, h, valid)
    h = h + position_embed(pos, W["v.position_embd.weight"], padding)
    _trace(trace, "pos_embd", -1, h, valid)
    for il in range(cfg.num_hidden_layers):
        h = encoder_layer(cfg, W, il, h, pos, valid, trace)
    h = pool(h, pos, padding, cfg.pooling_kernel_size)
    _trace(trace, "pooled", -1, h, None)
    if cfg.standardize:
        h = standardize(h, W["v.std_bias"], W["v.std_scale"])
        _trace(trace, "std_scaled", -1, h, None)
    out = embed_vision(h, W["mm.input_projection.weight"], cfg.rms_norm_eps)
    _trace(trace, "projected", -1, out, None)
    return out
