"""The Gemma 4 audio front end in float64 NumPy: WAV in, log-mel features and frame mask out.

Follows transformers 5.23 ``Gemma4AudioFeatureExtractor`` (``feature_extraction_gemma4.py``,
``audio_utils.mel_filter_bank`` / ``window_function``; its ``_extract_spectrogram`` and ``__call__`` for the
framing, the frame mask and the 30 s truncation). With the default settings:

* 16 kHz mono; 20 ms frames (320 samples) every 10 ms (160 samples);
* "semicausal" framing: 160 zeros are put in front, frames of 321 samples are cut
  every 160 samples and the last sample of each frame is dropped (it only feeds
  the pre-emphasis, which is off by default);
* periodic Hann window of 320, zero-padded to a 512-point real FFT, **magnitude**
  (not power) spectrum;
* 128 triangular mel filters on the HTK scale over 0-8000 Hz, no area
  normalisation; ``log(mel + 1e-3)`` (the floor is added, not clamped);
* a frame is valid iff its last sample (index ``i*160 + 320`` after the left pad)
  is real audio; invalid frames are zeroed.

Call-level behaviour of HF (``__call__``): audio longer than 30 s (480 000
samples) is **truncated**; the samples are right-padded with zeros to a
multiple of 128 (the extra frames are masked). llama.cpp (``mtmd-audio.cpp``
``mtmd_audio_preprocessor_gemma4a::preprocess``) instead **splits** audio into
30 s chunks and encodes each one separately: see :func:`split_llamacpp`.

Shapes: N = samples, T = frames, M = mel bins (``feature_size``), B = FFT bins.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, InputError
from .files import read_bytes, read_json

# --------------------------------------------------------------------------- settings

MAX_AUDIO_BYTES = 1 << 30
"""The most a WAV file may hold (1 GiB: some 9 hours of 16 kHz 16-bit mono)."""


@dataclass(frozen=True)
class MelConfig:
    """Settings of the mel front end; field names are ``Gemma4AudioFeatureExtractor``'s.

    Attributes:
        feature_size: mel bins M (128).
        sampling_rate: expected input rate in Hz (16000).
        padding_value: value of the right padding (0.0).
        frame_length_ms / hop_length_ms: frame and hop in ms (20 / 10).
        min_frequency / max_frequency: mel filter range in Hz (0 / 8000).
        preemphasis: pre-emphasis coefficient (0 = off); ``preemphasis_htk_flavor``
            selects HTK's first-sample rule.
        fft_overdrive: doubles the FFT length.
        dither: HF adds Gaussian noise of this std; the reference never does
            (the specification is the noiseless front end; compare with HF at 0).
        input_scale_factor: multiplies the waveform first.
        mel_floor: added before the log (1e-3).
        per_bin_mean / per_bin_stddev: optional per-bin normalisation, length M.
        max_length: HF ``__call__`` truncation length in samples (480000 = 30 s).
        pad_to_multiple_of: HF ``__call__`` right padding multiple in samples (128).
        source: where the settings came from (for messages).
    """

    feature_size: int = 128
    sampling_rate: int = 16000
    padding_value: float = 0.0
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    dither: float = 0.0
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_length: int = 480_000
    pad_to_multiple_of: int = 128
    source: str = "transformers defaults"

    @property
    def frame_length(self) -> int:
        """Samples per frame: ``round(sampling_rate * frame_length_ms / 1000)`` (320)."""
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        """Samples between frames: ``round(sampling_rate * hop_length_ms / 1000)`` (160)."""
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        """FFT size: next power of two >= frame_length, doubled with ``fft_overdrive`` (512)."""
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * n if self.fft_overdrive else n

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str) -> MelConfig:
        """Settings from a saved feature-extractor dict (HF ``preprocessor_config.json`` form).

        Unknown keys are ignored. The derived sample counts that HF saves
        (``frame_length``, ``hop_length``, ``fft_length``) are checked against the
        ones derived from the ms fields (HF silently recomputes them).

        Raises:
            ConfigError: a wrong type or value, ``padding_side`` other than right,
                a contradictory saved sample count. The message names the key.
        """
        kw: dict[str, Any] = {}
        names = {f.name for f in fields(cls)} - {"source"}
        for key in sorted(names & set(d)):
            if d[key] is not None:
                kw[key] = _field_value(key, d[key], source)
        cfg = cls(source=source, **kw)
        if d.get("padding_side", "right") != "right":
            raise ConfigError(f"{source}: padding_side = {d['padding_side']!r}: only 'right' is supported")
        for key in ("frame_length", "hop_length", "fft_length"):
            if key in d and d[key] is not None and _field_value(key, d[key], source) != getattr(cfg, key):
                raise ConfigError(f"{source}: {key} = {d[key]} contradicts the {getattr(cfg, key)} derived "
                                  f"from the ms fields and sampling_rate")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError (one line, naming the field) for values the front end cannot use."""
        if not 0 <= self.min_frequency < self.max_frequency <= self.sampling_rate / 2:
            raise ConfigError(f"{self.source}: min_frequency {self.min_frequency} / max_frequency "
                              f"{self.max_frequency}: expected 0 <= min < max <= sampling_rate/2")
        if self.frame_length < 2 or self.hop_length < 1:
            raise ConfigError(f"{self.source}: frame_length_ms / hop_length_ms give {self.frame_length} / "
                              f"{self.hop_length} samples")
        if self.mel_floor <= 0:
            raise ConfigError(f"{self.source}: mel_floor = {self.mel_floor}: expected > 0")
        for key in ("per_bin_mean", "per_bin_stddev"):
            v = getattr(self, key)
            if v is not None and len(v) != self.feature_size:
                raise ConfigError(f"{self.source}: {key} has {len(v)} values, expected feature_size "
                                  f"{self.feature_size}")


MAX_FIELD = 1e9
"""The largest magnitude a processor number may have (a sample rate, a length in ms or samples, a frequency): beyond
it the derived sample counts are not numbers a front end can use."""

_INT_FIELDS = ("feature_size", "sampling_rate", "max_length", "pad_to_multiple_of", "frame_length", "hop_length",
               "fft_length")
_BOOL_FIELDS = ("preemphasis_htk_flavor", "fft_overdrive")
_NUMERIC_STRING_FIELDS = ("mel_floor",)
"""Fields transformers converts with ``np.array(value, dtype=np.float64)`` (``Gemma4AudioFeatureExtractor.__init__``),
which reads a numeric string as its number; every other number it computes with as it is."""


def _field_value(key: str, v: Any, source: str) -> Any:
    """A processor-config value as the front end takes it, accepting the types transformers accepts.

    ``Gemma4AudioFeatureExtractor`` (transformers ``models/gemma4/feature_extraction_gemma4.py``) multiplies and
    divides the numeric fields as they are (a JSON number: int or float), converts ``mel_floor`` with
    ``np.array(..., dtype=np.float64)`` (so ``"0.001"`` is 0.001 there), builds ``per_bin_*`` with ``np.array`` and
    branches on the flags. Counts must be whole numbers (``16000.0`` is 16000). A flag must be true or false: a
    string such as ``"false"`` would be true in ``if``, not what its writer meant, so it is refused with the key.

    Raises:
        ConfigError: one line naming the file and key, the value and what was expected.
    """
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{source}: {key} = {v!r}: expected {expected}")

    if key in _BOOL_FIELDS:
        if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
            return bool(v)
        raise bad("true or false")
    if key in ("per_bin_mean", "per_bin_stddev"):
        if not isinstance(v, (list, tuple)) or not all(_is_number(x) for x in v):
            raise bad("a list of numbers")
        return tuple(float(x) for x in v)
    if isinstance(v, str) and key in _NUMERIC_STRING_FIELDS:
        try:
            v = float(v)
        except ValueError:
            raise bad("a number (a numeric string is read as one, as transformers does)") from None
    if not _is_number(v):
        raise bad("a number")
    if not math.isfinite(float(v)) or abs(float(v)) > MAX_FIELD:
        raise bad(f"a finite number of magnitude at most {MAX_FIELD:g}")
    if key in _INT_FIELDS:
        if float(v) != int(v) or int(v) <= 0:
            raise bad("a positive integer")
        return int(v)
    return float(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mel_config_from_folder(path: str | os.PathLike) -> MelConfig:
    """Front-end settings of an HF model folder.

    Looks, in this order, at ``processor_config.json`` (its ``feature_extractor``
    object, as ``ProcessorMixin.save_pretrained`` writes it) and
    ``preprocessor_config.json`` (when its ``feature_extractor_type`` is
    ``Gemma4AudioFeatureExtractor``); else transformers' defaults.

    Raises:
        ConfigError: a file that is not valid JSON, or bad values (named).
    """
    path = Path(path)
    for name, key in (("processor_config.json", "feature_extractor"), ("preprocessor_config.json", None)):
        f = path / name
        if not os.path.lexists(f):
            continue
        d = read_json(f, streams=False, error=ConfigError)
        if key is not None:
            d = d.get(key) if isinstance(d, dict) else None
        if isinstance(d, dict) and d.get("feature_extractor_type") == "Gemma4AudioFeatureExtractor":
            return MelConfig.from_dict(d, f"{f}" + (f" ({key})" if key else ""))
    return MelConfig()


# --------------------------------------------------------------------------- operations


def hann_window(n: int) -> np.ndarray:
    """Periodic Hann window, ``0.5 - 0.5 cos(2 pi i / n)``. [] -> [n]. Source: ``audio_utils.window_function``."""
    i = np.arange(n, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * i / n)


def hz_to_mel(f: np.ndarray) -> np.ndarray:
    """HTK mel scale, ``2595 log10(1 + f / 700)``. [...] -> [...]. Source: ``audio_utils.hertz_to_mel``."""
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_to_hz(m: np.ndarray) -> np.ndarray:
    """Inverse of :func:`hz_to_mel`. [...] -> [...]."""
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


def mel_filter_bank(cfg: MelConfig) -> np.ndarray:
    """Triangular mel filters on linear FFT-bin frequencies, no area normalisation.

    M + 2 edge frequencies are equally spaced on the HTK mel scale between
    ``min_frequency`` and ``max_frequency``; filter m rises from edge m to edge
    m+1 and falls to edge m+2. FFT bin b sits at ``b * (sr // 2) / (B - 1)`` Hz.
    [] -> [B, M] with B = fft_length // 2 + 1. Source: ``audio_utils.mel_filter_bank``
    (``norm=None``, ``mel_scale="htk"``).
    """
    n_bins = cfg.fft_length // 2 + 1
    edges = mel_to_hz(np.linspace(hz_to_mel(cfg.min_frequency), hz_to_mel(cfg.max_frequency),
                                  cfg.feature_size + 2))  # [M+2]
    freqs = np.linspace(0.0, cfg.sampling_rate // 2, n_bins)  # [B]
    lo, mid, hi = edges[None, :-2], edges[None, 1:-1], edges[None, 2:]
    rising = (freqs[:, None] - lo) / (mid - lo)
    falling = (hi - freqs[:, None]) / (hi - mid)
    return np.maximum(0.0, np.minimum(rising, falling))  # [B, M]


def semicausal_frames(x: np.ndarray, cfg: MelConfig) -> np.ndarray:
    """Cut frames of ``frame_length + 1`` samples every hop after ``frame_length // 2`` zeros in front.

    [N] -> [T, frame_length + 1], ``T = (N + frame_length//2 - frame_length - 1) // hop + 1``
    (0 when negative). Source: ``Gemma4AudioFeatureExtractor._extract_spectrogram``.
    """
    xp = np.concatenate([np.zeros(cfg.frame_length // 2), x])
    size, hop = cfg.frame_length + 1, cfg.hop_length
    n_frames = max(0, (xp.shape[0] - size) // hop + 1)
    idx = np.arange(n_frames)[:, None] * hop + np.arange(size)[None, :]
    return xp[idx]


def preemphasize(frames: np.ndarray, cfg: MelConfig) -> np.ndarray:
    """Pre-emphasis inside each frame, dropping the extra sample.

    Off (coefficient 0): the first ``frame_length`` samples. HTK flavour:
    ``[x0 (1 - a), x[1:-1] - a x[:-2]]``; otherwise ``x[1:] - a x[:-1]``.
    [T, frame_length + 1] -> [T, frame_length]. Source: as :func:`semicausal_frames`.
    """
    a = cfg.preemphasis
    if a <= 0.0:
        return frames[:, :-1]
    if cfg.preemphasis_htk_flavor:
        return np.concatenate([frames[:, :1] * (1.0 - a), frames[:, 1:-1] - a * frames[:, :-2]], axis=1)
    return frames[:, 1:] - a * frames[:, :-1]


def magnitude_spectrum(frames: np.ndarray, cfg: MelConfig) -> np.ndarray:
    """``|rfft(frame * hann, n=fft_length)|``: the magnitude, not the power.

    [T, frame_length] -> [T, B]. Source: as :func:`semicausal_frames`.
    """
    return np.abs(np.fft.rfft(frames * hann_window(cfg.frame_length), n=cfg.fft_length, axis=-1))


def log_mel(spec: np.ndarray, cfg: MelConfig) -> np.ndarray:
    """``log(spec @ filters + mel_floor)``, then the optional per-bin mean / stddev.

    [T, B] -> [T, M]. Source: as :func:`semicausal_frames`.
    """
    out = np.log(spec @ mel_filter_bank(cfg) + cfg.mel_floor)
    if cfg.per_bin_mean is not None:
        out = out - np.asarray(cfg.per_bin_mean)
    if cfg.per_bin_stddev is not None:
        out = out / np.asarray(cfg.per_bin_stddev)
    return out


def frame_mask(n_real: int, n_frames: int, cfg: MelConfig) -> np.ndarray:
    """Frame i is valid iff its last sample, ``i*hop + frame_length`` after the left pad, is real audio.

    Real audio occupies indices ``[frame_length//2, frame_length//2 + n_real)``
    of the left-padded signal. [] -> [T] bool. Source: as :func:`semicausal_frames`.
    """
    last = np.arange(n_frames) * cfg.hop_length + cfg.frame_length
    return last < cfg.frame_length // 2 + n_real


def pad_or_truncate(x: np.ndarray, cfg: MelConfig, truncate: bool = True) -> tuple[np.ndarray, int]:
    """HF ``__call__`` length handling for one clip.

    Truncate to ``max_length`` samples (when ``truncate``), then right-pad with
    ``padding_value`` to a multiple of ``pad_to_multiple_of``.
    [N] -> ([N'], number of real samples kept). Source: ``SequenceFeatureExtractor.pad``
    (``padding="longest"``, ``truncation=True``).
    """
    if truncate:
        x = x[: cfg.max_length]
    n_real = x.shape[0]
    m = cfg.pad_to_multiple_of
    n_pad = (-n_real) % m if m else 0
    return np.concatenate([x, np.full(n_pad, float(cfg.padding_value))]), n_real


def extract_features(samples: np.ndarray, cfg: MelConfig | None = None,
                     truncate: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Log-mel features and frame mask of one clip, as ``Gemma4AudioFeatureExtractor()([clip])``.

    Args:
        samples: [N] waveform at ``cfg.sampling_rate``, nominally in [-1, 1].
        cfg: settings (default: transformers' defaults).
        truncate: cut to ``cfg.max_length`` (30 s) as HF does; False keeps all of
            it (what one llama.cpp chunk sees, see :func:`split_llamacpp`).

    Returns:
        ``(features [T, M] float64, mask [T] bool)``; invalid frames are zero.

    Raises:
        InputError: not a 1-D array of finite values.
    """
    cfg = cfg or MelConfig()
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1:
        raise InputError(f"audio samples: expected a 1-D array, got shape {list(x.shape)}")
    if not np.all(np.isfinite(x)):
        raise InputError("audio samples: contain NaN or Inf")
    x, n_real = pad_or_truncate(x, cfg, truncate)
    x = x * cfg.input_scale_factor
    frames = preemphasize(semicausal_frames(x, cfg), cfg)  # [T, frame_length]
    feats = log_mel(magnitude_spectrum(frames, cfg), cfg)  # [T, M]
    mask = frame_mask(n_real, feats.shape[0], cfg)  # [T]
    return feats * mask[:, None], mask


def split_llamacpp(samples: np.ndarray, cfg: MelConfig | None = None) -> list[np.ndarray]:
    """llama.cpp's long-audio rule: consecutive chunks of 30 s (the last one shorter).

    Each chunk is encoded on its own and the soft tokens are concatenated; HF
    instead truncates at 30 s. llama.cpp frames a chunk like
    :func:`extract_features` with ``truncate=False`` and keeps only the valid
    frames (it has no 128-sample padding and no mask, which gives the same
    encoder output because the mask drops exactly those frames).
    [N] -> list of [<= 30 s * sr]. Source: llama.cpp ``tools/mtmd/mtmd-audio.cpp``
    ``mtmd_audio_preprocessor_gemma4a::preprocess``.
    """
    cfg = cfg or MelConfig()
    x = np.asarray(samples, dtype=np.float64)
    n = 30 * cfg.sampling_rate
    return [x[i:i + n] for i in range(0, x.shape[0], n)]


def soft_token_count(n_samples: int, cfg: MelConfig | None = None) -> int:
    """Audio soft tokens for a clip of ``n_samples`` after HF truncation: valid frames, halved (ceil) twice.

    25 per second at the defaults (100 frames/s, two stride-2 convolutions).
    Source: transformers ``processing_gemma4.py`` (mask subsampled ``[::2]`` twice).
    """
    cfg = cfg or MelConfig()
    n = min(n_samples, cfg.max_length)
    n_frames = max(0, (n + cfg.frame_length // 2 - cfg.frame_length - 1) // cfg.hop_length + 1)
    valid = int(frame_mask(n, n_frames, cfg).sum())
    return (valid + 3) // 4 if valid else 0


# --------------------------------------------------------------------------- WAV files

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Read a RIFF WAVE file: PCM 8/16/24/32-bit or IEEE float 32/64-bit, any channel count.

    Integer PCM is scaled to [-1, 1) by ``2^(bits-1)`` (8-bit is unsigned, offset
    128); channels are **averaged** to mono. The RIFF chunks are parsed here with
    ``struct`` because the stdlib ``wave`` module of Python 3.11 reads integer PCM
    only.

    Returns:
        ``(samples [N] float64, sample_rate)``.

    Raises:
        InputError: the file is missing or unreadable, not RIFF/WAVE, has no
            ``fmt``/``data`` chunk, an unsupported encoding, or no samples (one
            line naming the file).
    """
    path = Path(path)
    try:  # the one reader: a regular file (never a FIFO or a device), bounded
        raw = read_bytes(path, max_bytes=MAX_AUDIO_BYTES, streams=False)
    except InputError as e:
        raise InputError(f"{path}: cannot read audio file: {str(e).split(': ', 1)[-1]}") from None
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise InputError(f"{path}: not a WAV file (expected a RIFF/WAVE header)")
    fmt = data = None
    pos = 12
    while pos + 8 <= len(raw):
        cid, size = raw[pos:pos + 4], struct.unpack("<I", raw[pos + 4:pos + 8])[0]
        body = raw[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            data = body
        pos += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or data is None:
        raise InputError(f"{path}: WAV file without a 'fmt ' and a 'data' chunk")
    tag, channels, rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # first two bytes of the sub-format GUID
    if channels < 1 or bits % 8 or block != channels * bits // 8:
        raise InputError(f"{path}: inconsistent WAV format ({channels} channels, {bits} bits, block {block})")
    width = bits // 8
    n = len(data) // block
    if n == 0:
        raise InputError(f"{path}: WAV file has no samples")
    data = data[: n * block]
    if tag == _FLOAT and bits in (32, 64):
        x = np.frombuffer(data, dtype="<f4" if bits == 32 else "<f8").astype(np.float64)
    elif tag == _PCM and bits == 8:
        x = (np.frombuffer(data, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    elif tag == _PCM and bits in (16, 32):
        x = np.frombuffer(data, dtype=f"<i{width}").astype(np.float64) / 2.0 ** (bits - 1)
    elif tag == _PCM and bits == 24:
        b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = np.where(v >= 1 << 23, v - (1 << 24), v).astype(np.float64) / 2.0 ** 23
    else:
        raise InputError(f"{path}: unsupported WAV encoding (format tag {tag}, {bits} bits); "
                         f"expected PCM 8/16/24/32-bit or float 32/64-bit")
    if not np.all(np.isfinite(x)):
        raise InputError(f"{path}: WAV samples contain NaN or Inf")
    return x.reshape(n, channels).mean(axis=1), int(rate)


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited rational resampling (polyphase windowed sinc).

    With ``L/M = sr_out/sr_in`` in lowest terms, output sample n is
    ``sum_k x[k] h(n M - k L)`` where h is a Kaiser(beta 5)-windowed sinc
    low-pass at ``1 / (2 max(L, M))`` cycles per upsampled sample, half-length
    ``10 max(L, M)`` taps, scaled to sum L: the design of
    ``scipy.signal.resample_poly``'s default (scipy is not a dependency; not
    checked against it). Zeros are assumed outside the clip.
    [N] -> [ceil(N L / M)].
    """
    g = math.gcd(int(sr_in), int(sr_out))
    up, down = int(sr_out) // g, int(sr_in) // g
    if up == down:
        return np.asarray(x, dtype=np.float64).copy()
    half = 10 * max(up, down)
    t = np.arange(-half, half + 1, dtype=np.float64)  # filter taps at the upsampled rate
    cutoff = 1.0 / (2 * max(up, down))  # in cycles per upsampled sample
    h = np.sinc(2 * cutoff * t) * np.kaiser(t.size, 5.0)
    h = h / h.sum() * up  # unit DC gain per output phase on average, as firwin's scaling
    n_out = -(-x.shape[0] * up // down)
    out = np.empty(n_out)
    k_span = np.arange(-(half // up) - 1, half // up + 2)  # input offsets that can reach a tap
    for start in range(0, n_out, 65536):
        n = np.arange(start, min(n_out, start + 65536))
        centre = (n * down) // up  # input sample at or just before output n
        k = centre[:, None] + k_span[None, :]  # [n, taps]
        tap = n[:, None] * down - k * up  # offset in upsampled samples
        ok = (np.abs(tap) <= half) & (k >= 0) & (k < x.shape[0])
        xv = np.where(ok, x[np.clip(k, 0, x.shape[0] - 1)], 0.0)
        out[n] = np.sum(xv * np.where(ok, h[np.clip(tap + half, 0, 2 * half)], 0.0), axis=1)
    return out


def load_audio(path: str | os.PathLike, cfg: MelConfig | None = None, resample_to_rate: bool = False) -> np.ndarray:
    """A WAV file as mono samples at ``cfg.sampling_rate``.

    Args:
        path: the file (see :func:`read_wav`).
        cfg: front-end settings (default 16 kHz).
        resample_to_rate: convert another rate with :func:`resample`; without
            it a different rate is an error (the harness never resamples silently).

    Returns:
        [N] float64.

    Raises:
        InputError: unreadable file (see :func:`read_wav`), or a sample rate
            other than ``cfg.sampling_rate`` without ``resample_to_rate``.
    """
    cfg = cfg or MelConfig()
    x, rate = read_wav(path)
    if rate != cfg.sampling_rate:
        if not resample_to_rate:
            raise InputError(f"{path}: sample rate {rate} Hz, expected {cfg.sampling_rate} Hz "
                             f"(resample it, or ask for resampling)")
        x = resample(x, rate, cfg.sampling_rate)
    return x
