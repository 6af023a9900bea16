"""The Gemma 4 audio encoder's hyper-parameters (:class:`AudioConfig`, ``Gemma4AudioConfig``'s field names), from an HF
``audio_config`` or an mmproj GGUF's ``clip.audio.*`` keys and tensor shapes, each value checked; the encoder that
reads them is :mod:`reference.audio`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class AudioConfig:
    """Audio encoder hyper-parameters; field names are ``Gemma4AudioConfig``'s.

    Attributes (HF defaults in brackets):
        hidden_size [1024], num_hidden_layers [12], num_attention_heads [8].
        hidden_act ["silu"]: the only one supported.
        subsampling_conv_channels [(128, 32)]: output channels of the two convs;
            the first must equal ``n_mels``.
        conv_kernel_size [5]: light-conv kernel (causal, left pad k - 1).
        residual_weight [0.5]: FFN half-step factor.
        attention_chunk_size [12], attention_context_left [13],
            attention_context_right [0]: C, P + 1 and R (see the module docstring).
        attention_logit_cap [50.0], attention_invalid_logits_value [-1e9].
        use_clipped_linears [True]: q/k/v/post, FFN and light-conv linears clamp
            their input and output to stored bounds.
        rms_norm_eps [1e-6]: subsampling LayerNorm, light-conv norms, ``embed_audio``.
        gradient_clipping [1e10]: clamp bound on the stream (a no-op in practice).
        output_proj_dims [1536]: E.
        n_mels [128]: mel bins of the input (not an HF field; mmproj
            ``clip.audio.num_mel_bins``).
        text_hidden_size: Ht, the width ``embed_audio`` projects to (HF
            ``text_config.hidden_size``; mmproj ``clip.audio.projection_dim``).
        audio_token_id [258881], boa_token_id [256000], eoa_token_index [258883]:
            the ``Gemma4Config`` token ids.
        source: file the config came from.
    """

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    n_mels: int = 128
    text_hidden_size: int = 1536
    audio_token_id: int = 258_881
    boa_token_id: int = 256_000
    eoa_token_index: int = 258_883
    source: str = ""

    @property
    def head_dim(self) -> int:
        """D = hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    @property
    def max_past(self) -> int:
        """P = attention_context_left - 1: past frames a query sees besides itself."""
        return self.attention_context_left - 1

    @property
    def n_rel_pos(self) -> int:
        """F = (C + P + R) // 2 + 1 relative positions (13)."""
        return (self.attention_chunk_size + self.max_past + self.attention_context_right) // 2 + 1

    def validate(self) -> AudioConfig:
        """Check the values; return self.

        Raises:
            ConfigError: one line naming the field and what was expected.
        """
        src = self.source or "audio config"
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "conv_kernel_size",
                    "attention_chunk_size", "attention_context_left", "output_proj_dims", "n_mels",
                    "text_hidden_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{src}: {key} = {v!r}: expected a positive integer")
        if not isinstance(self.attention_context_right, int) or self.attention_context_right < 0:
            raise ConfigError(f"{src}: attention_context_right = {self.attention_context_right!r}: expected >= 0")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{src}: hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                              f"{self.num_attention_heads}")
        if self.hidden_act != "silu":
            raise ConfigError(f"{src}: hidden_act = {self.hidden_act!r}: only 'silu' is supported")
        ch = self.subsampling_conv_channels
        if len(ch) != 2 or any(isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in ch):
            raise ConfigError(f"{src}: subsampling_conv_channels = {list(ch)}: expected two positive integers")
        if ch[0] != self.n_mels:
            raise ConfigError(f"{src}: subsampling_conv_channels[0] = {ch[0]} must equal the {self.n_mels} mel bins "
                              f"(the input projection reads (channels[0] // 4) * channels[1] features)")
        if not self.attention_logit_cap > 0:
            raise ConfigError(f"{src}: attention_logit_cap = {self.attention_logit_cap}: expected > 0")
        return self

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str) -> AudioConfig:
        """From an HF multimodal ``config.json`` (``audio_config`` plus ``text_config.hidden_size`` and the token ids).

        Missing fields take transformers' defaults.

        Raises:
            ConfigError: no ``audio_config``, or a bad value (named).
        """
        a = raw.get("audio_config")
        if not isinstance(a, dict):
            raise ConfigError(f"{source}: no audio_config (not a Gemma 4 model with an audio encoder)")
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        kw: dict[str, Any] = {}
        for key in cls.__dataclass_fields__:
            if key == "source":
                continue
            if key in a and a[key] is not None:
                kw[key] = a[key]
            elif key in raw and raw[key] is not None and key in ("audio_token_id", "boa_token_id", "eoa_token_index"):
                kw[key] = raw[key]
        kw.pop("n_mels", None)
        kw.pop("text_hidden_size", None)
        if "subsampling_conv_channels" in kw:
            kw["subsampling_conv_channels"] = tuple(kw["subsampling_conv_channels"])
        for key in ("residual_weight", "attention_logit_cap", "attention_invalid_logits_value", "rms_norm_eps",
                    "gradient_clipping"):
            if key in kw:
                if isinstance(kw[key], bool) or not isinstance(kw[key], (int, float)):
                    raise ConfigError(f"{source}: audio_config.{key} = {kw[key]!r}: expected a number")
                kw[key] = float(kw[key])
        if text.get("hidden_size") is None:
            raise ConfigError(f"{source}: missing field text_config.hidden_size")
        kw["text_hidden_size"] = text["hidden_size"]
        return cls(source=source, **kw).validate()

    @classmethod
    def from_mmproj(cls, meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str) -> AudioConfig:
        """From an mmproj GGUF's ``clip.audio.*`` keys and tensor shapes.

        Sizes come from ``clip.audio.embedding_length`` / ``block_count`` /
        ``attention.head_count`` / ``projection_dim`` / ``num_mel_bins`` and the
        shapes of ``a.conv1d.{0,1}.weight``, ``a.pre_encode.out.weight``,
        ``a.blk.0.conv_dw.weight``; clipped linears are on when any
        ``*.input_min`` tensor exists. llama.cpp hard-codes the rest (chunk 12,
        context_left 13, context_right 0, cap 50, residual 0.5, eps 1e-6: its
        converter writes a wrong ``layer_norm_epsilon``), so do we.

        Raises:
            ConfigError: not a ``gemma4a`` audio projector, a missing or bad key,
                ``feed_forward_length`` != 4 * embedding_length, a missing shape tensor.
        """
        proj = meta.get("clip.audio.projector_type") or meta.get("clip.projector_type")
        if proj != "gemma4a":
            raise ConfigError(f"{source}: clip.audio.projector_type = {proj!r}, expected 'gemma4a'")

        def key(k: str, default: Any = None) -> Any:
            v = meta.get(k, default)
            if v is None:
                raise ConfigError(f"{source}: missing key {k}")
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
                raise ConfigError(f"{source}: {k} = {v!r}: expected a positive integer")
            return int(v)

        def shape(name: str, ndim: int) -> tuple[int, ...]:
            if name not in shapes:
                raise ConfigError(f"{source}: missing tensor {name}")
            if len(shapes[name]) != ndim:
                raise ConfigError(f"{source}: tensor {name} has shape {list(shapes[name])}, expected {ndim} dims")
            return tuple(shapes[name])

        hidden = key("clip.audio.embedding_length")
        ff = key("clip.audio.feed_forward_length")
        if ff != 4 * hidden:
            raise ConfigError(f"{source}: clip.audio.feed_forward_length = {ff}, expected 4 * embedding_length = "
                              f"{4 * hidden}")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=key("clip.audio.block_count"),
            num_attention_heads=key("clip.audio.attention.head_count"),
            subsampling_conv_channels=(shape("a.conv1d.0.weight", 4)[0], shape("a.conv1d.1.weight", 4)[0]),
            conv_kernel_size=shape("a.blk.0.conv_dw.weight", 2)[1],
            output_proj_dims=shape("a.pre_encode.out.weight", 2)[0],
            use_clipped_linears=any(n.endswith(".input_min") for n in shapes),
            n_mels=key("clip.audio.num_mel_bins", 128),
            text_hidden_size=key("clip.audio.projection_dim"),
            source=source,
        ).validate()
