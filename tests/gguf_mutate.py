"""A small GGUF mutation engine: damage a valid file in one known way.

Field positions come from ``gguf.GGUFReader`` run on the *clean* file (not from
``reference.gguf_check``, the code under test). Each mutation kind is one
function ``(data, layout, rng) -> (bytes, detail)``; ``rng`` is a
``random.Random`` (hypothesis passes its own, shrinkable one).

Every kind damages the file so that a correct loader must either refuse it
with one line or still compute exactly the clean logits. What is *not*
generated, because the result is another valid model that no checker can tell
from the real one: new values inside a key's valid range (a different
``sliding_window``, an optional key removed, a finite softcap), bit flips in
such values and in ordinary weight bytes, a finite weight below the
limit of ``reference.weight_check`` (fp16 ``65504`` included), a type swapped
for another that occupies the same bytes (F16/BF16, Q4_0/IQ4_NL, Q4_0/NVFP4 on
rows of 64, Q3_K/IQ3_S), and values of ``rope_freqs`` that are positive.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

U32, F32, STRING, ARRAY = 4, 6, 8, 9
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class Key:
    name: str
    start: int  # offset of the name length
    end: int  # first byte after the value
    vtype_off: int
    vtype: int
    etype: int | None
    count_off: int | None  # arrays: offset of the element count
    value_off: int  # scalars: the value; arrays: the first item
    lengths: list[int] = field(default_factory=list)  # offsets of u64 string lengths (name first)


@dataclass
class Tensor:
    name: str
    start: int
    ndims_off: int
    dims_off: int
    dims: tuple[int, ...]
    type_off: int
    ggml_type: int
    offset_off: int
    rel_offset: int
    data_start: int
    n_bytes: int


@dataclass
class Layout:
    path: Path
    size: int
    kv_end: int
    ti_end: int
    data_offset: int
    alignment: int
    keys: dict[str, Key]
    tensors: list[Tensor]


def read_layout(path: str | Path) -> Layout:
    """Locate every field of a valid GGUF file (through ``gguf.GGUFReader``)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    base = r.data.ctypes.data

    def at(part) -> int:
        return part.ctypes.data - base

    keys: dict[str, Key] = {}
    kv_end = 24
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        parts = f.parts
        vtype = int(parts[2][0])
        last = parts[-1]
        end = at(last) + last.nbytes
        kv_end = max(kv_end, end)
        k = Key(name, f.offset, end, at(parts[2]), vtype, None, None, at(parts[3]) if len(parts) > 3 else end,
                [at(parts[0])])
        if vtype == STRING:
            k.lengths.append(at(parts[3]))
        if vtype == ARRAY:
            k.etype, k.count_off = int(parts[3][0]), at(parts[4])
            k.value_off = at(parts[5]) if len(parts) > 5 else end
            if k.etype == STRING:
                k.lengths += [at(p) for p in parts[5::2]]
        keys[name] = k
    tensors = []
    for t in r.tensors:
        p = t.field.parts
        tensors.append(Tensor(t.name, t.field.offset, at(p[2]), at(p[3]), tuple(int(x) for x in t.shape),
                              at(p[4]), int(t.tensor_type), at(p[5]), int(p[5][0]), t.data_offset, int(t.n_bytes)))
    last = tensors[-1]
    ti_end = last.offset_off + 8
    return Layout(Path(path), len(r.data), kv_end, ti_end, r.data_offset, int(r.alignment), keys, tensors)


def _put(buf: bytearray, off: int, fmt: str, value) -> None:
    struct.pack_into(fmt, buf, off, value)


def _rebuild(data: bytes, lay: Layout, head: bytes) -> bytes:
    """``head`` (header + keys + tensor infos, edited) padded to the alignment, then the original data section."""
    pad = -len(head) % lay.alignment
    return head + b"\0" * pad + data[lay.data_offset:]


HUGE = (2**64 - 1, 2**63, 2**63 - 1, 2**32, 2**32 - 1, 2**64 - 1024, 2**40)


def _tensor(lay: Layout, rng: random.Random, want: Callable[[Tensor], bool] = lambda t: True) -> Tensor:
    return rng.choice([t for t in lay.tensors if want(t)])


# --------------------------------------------------------------------------- the kinds


def truncate(data: bytes, lay: Layout, rng: random.Random):
    """Cut the file inside one region: header, keys, tensor infos, padding, data, or the last tensor's bytes."""
    regions = {"header": (0, 24), "keys": (24, lay.kv_end), "tensor infos": (lay.kv_end, lay.ti_end),
               "data": (lay.data_offset, lay.size - 1)}
    if lay.data_offset > lay.ti_end:
        regions["padding"] = (lay.ti_end, lay.data_offset)
    last = lay.tensors[-1]
    regions["last tensor"] = (last.data_start, last.data_start + last.n_bytes - 1)
    region = rng.choice(sorted(regions))
    lo, hi = regions[region]
    cut = rng.randrange(lo, max(lo + 1, hi))
    return data[:cut], f"truncated in {region} at byte {cut}"


def header_bitflip(data: bytes, lay: Layout, rng: random.Random):
    """Flip one bit of the 24-byte header (magic, version, tensor_count, kv_count)."""
    bit = rng.randrange(24 * 8)
    buf = bytearray(data)
    buf[bit // 8] ^= 1 << (bit % 8)
    return bytes(buf), f"header bit {bit} flipped"


def _structural_fields(lay: Layout) -> list[tuple[str, int, int]]:
    out = []
    for k in lay.keys.values():
        out += [(f"{k.name}: string length", off, 8) for off in k.lengths[:4]]
        out.append((f"{k.name}: value type", k.vtype_off, 4))
        if k.count_off is not None:
            out += [(f"{k.name}: array type", k.count_off - 4, 4), (f"{k.name}: array count", k.count_off, 8)]
    for t in lay.tensors:
        out += [(f"{t.name}: name length", t.start, 8), (f"{t.name}: n_dims", t.ndims_off, 4),
                (f"{t.name}: type", t.type_off, 4), (f"{t.name}: offset", t.offset_off, 8)]
        out += [(f"{t.name}: dim {j}", t.dims_off + 8 * j, 8) for j in range(len(t.dims))]
    return out


def struct_bitflip(data: bytes, lay: Layout, rng: random.Random):
    """Flip one bit of a structural field: a length, type tag, count, n_dims, dimension, tensor type or offset."""
    what, off, size = rng.choice(_structural_fields(lay))
    bit = rng.randrange(size * 8)
    buf = bytearray(data)
    buf[off + bit // 8] ^= 1 << (bit % 8)
    return bytes(buf), f"{what}: bit {bit} flipped"


def _count_fields(lay: Layout) -> list[tuple[str, int]]:
    out = [("tensor_count", 8), ("kv_count", 16)]
    for k in lay.keys.values():
        if k.count_off is not None:
            out.append((f"{k.name}: array count", k.count_off))
        out += [(f"{k.name}: string length", off) for off in k.lengths[:2]]
    out += [(f"{t.name}: name length", t.start) for t in lay.tensors]
    return out


def name_bitflip(data: bytes, lay: Layout, rng: random.Random):
    """Flip one bit in a key name or a tensor name (a misspelt optional key or tensor would be read as absent)."""
    names = [(f"key {k.name}", k.start + 8, len(k.name.encode())) for k in lay.keys.values()]
    names += [(f"tensor {t.name}", t.start + 8, len(t.name.encode())) for t in lay.tensors]
    what, off, n = rng.choice(names)
    i, bit = rng.randrange(n), rng.randrange(8)
    buf = bytearray(data)
    buf[off + i] ^= 1 << bit
    return bytes(buf), f"{what}: name byte {i} bit {bit} flipped -> {bytes(buf[off:off + n])!r}"


def count_huge(data: bytes, lay: Layout, rng: random.Random):
    """Set a count or length (kv_count, tensor_count, an array count, a string length) huge or 'negative'."""
    what, off = rng.choice(_count_fields(lay))
    value = rng.choice(HUGE + (lay.size, lay.size * 4 + 1))
    buf = bytearray(data)
    _put(buf, off, "<Q", value)
    return bytes(buf), f"{what} = {value}"


def count_off(data: bytes, lay: Layout, rng: random.Random):
    """Change a count or length by a small amount (+-1..3)."""
    what, off = rng.choice(_count_fields(lay))
    old = struct.unpack_from("<Q", data, off)[0]
    new = max(0, old + rng.choice((-3, -2, -1, 1, 2, 3)))
    if new == old:
        new = old + 1
    buf = bytearray(data)
    _put(buf, off, "<Q", new)
    return bytes(buf), f"{what}: {old} -> {new}"


def value_type(data: bytes, lay: Layout, rng: random.Random):
    """Change a key's value type tag (another known type, an unknown one, or ARRAY for a scalar)."""
    k = rng.choice(list(lay.keys.values()))
    new = rng.choice([t for t in list(range(13)) + [13, 255, 2**31] if t != k.vtype])
    buf = bytearray(data)
    _put(buf, k.vtype_off, "<I", new)
    return bytes(buf), f"{k.name}: value type {k.vtype} -> {new}"


def array_type(data: bytes, lay: Layout, rng: random.Random):
    """Change an array's element type (another type, ARRAY itself, or an unknown code)."""
    k = rng.choice([k for k in lay.keys.values() if k.count_off is not None])
    new = rng.choice([t for t in list(range(13)) + [13, 99] if t != k.etype])
    buf = bytearray(data)
    _put(buf, k.count_off - 4, "<I", new)
    return bytes(buf), f"{k.name}: array element type {k.etype} -> {new}"


def required_keys(lay: Layout) -> list[str]:
    """The keys ``config_from_gguf`` cannot do without (its ``req()`` calls) that this file has."""
    arch = "gemma4" if "gemma4.block_count" in lay.keys else "gemma3"
    names = ["general.architecture"] + [f"{arch}.{k}" for k in (
        "block_count", "embedding_length", "attention.head_count", "feed_forward_length",
        "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.key_length_swa",
        "expert_count", "expert_used_count", "expert_feed_forward_length")]
    if arch == "gemma4":
        names.append("gemma4.attention.sliding_window_pattern")
    return [n for n in names if n in lay.keys]


def key_rename(data: bytes, lay: Layout, rng: random.Random):
    """Rename a required key (one character changed, same length)."""
    k = lay.keys[rng.choice(required_keys(lay))]
    name_off = k.start + 8
    i = rng.randrange(len(k.name))
    new_char = rng.choice([c for c in b"abcdefghijklmnopqrstuvwxyz_.0123456789" if c != k.name.encode()[i]])
    buf = bytearray(data)
    buf[name_off + i] = new_char
    return bytes(buf), f"key {k.name} renamed to {bytes(buf[name_off:name_off + len(k.name)]).decode()}"


def key_remove(data: bytes, lay: Layout, rng: random.Random):
    """Remove a required key (kv_count decremented, the rest re-laid out)."""
    k = lay.keys[rng.choice(required_keys(lay))]
    head = bytearray(data[:k.start] + data[k.end:lay.ti_end])
    _put(head, 16, "<Q", len(lay.keys) - 1)
    return _rebuild(data, lay, bytes(head)), f"key {k.name} removed"


# Values no model can have, per key suffix (the key's own GGUF type).
NONSENSE: dict[str, tuple] = {
    "final_logit_softcapping": (float("inf"), float("-inf"), float("nan"), 0.0, -30.0),
    "rope.freq_base": (-1.0, 0.0, float("nan"), float("inf"), float("-inf")),
    "rope.freq_base_swa": (-1.0, 0.0, float("nan"), float("inf")),
    "attention.layer_norm_rms_epsilon": (0.0, -1e-6, 1.0, 2.0, float("nan"), float("inf")),
    "block_count": (0, 4294967295, 513, 1, 3),
    "attention.head_count": (0, 3, 4294967295),
    "attention.head_count_kv": (0, 3, 4294967295),
    "attention.key_length": (0, 7, 4294967295),
    "attention.key_length_swa": (0, 7, 4294967295),
    "attention.value_length": (0, 5),
    "attention.sliding_window": (0,),
    "context_length": (0, 4294967295),
    "embedding_length": (0, 4294967295),
    "feed_forward_length": (0, 4294967295),
    "rope.dimension_count": (0, 7, 4294967295),
    "rope.dimension_count_swa": (0, 7, 4294967295),
    "embedding_length_per_layer_input": (0, 4294967295),
    "attention.shared_kv_layers": (4294967295, 512),
    "expert_count": (0, 1025, 4294967295),
    "expert_used_count": (0, 4294967295),
    "expert_feed_forward_length": (0, 4294967295),
}


def number_nonsense(data: bytes, lay: Layout, rng: random.Random):
    """Set a model number to a value no model can have (softcap inf, freq_base -1, eps 0, block_count 2**32-1, ...)."""
    arch = "gemma4" if "gemma4.block_count" in lay.keys else "gemma3"
    choices = [(lay.keys[f"{arch}.{s}"], vals) for s, vals in NONSENSE.items() if f"{arch}.{s}" in lay.keys]
    k, vals = rng.choice(choices)
    value = rng.choice(vals)
    buf = bytearray(data)
    if k.vtype == ARRAY:  # a per-layer array: one element
        n = struct.unpack_from("<Q", data, k.count_off)[0]
        off = k.value_off + rng.randrange(n) * _SIZES[k.etype]
        fmt = "<f" if k.etype == F32 else "<I"
    else:
        off, fmt = k.value_off, "<f" if k.vtype == F32 else "<I"
    _put(buf, off, fmt, float(value) if fmt == "<f" else int(value))
    return bytes(buf), f"{k.name} = {value}"


def tensor_misalign(data: bytes, lay: Layout, rng: random.Random):
    """Move a tensor's offset by 1..alignment-1 bytes."""
    t = _tensor(lay, rng)
    delta = rng.randrange(1, lay.alignment)
    new = t.rel_offset - delta if t.rel_offset >= delta and rng.random() < 0.5 else t.rel_offset + delta
    buf = bytearray(data)
    _put(buf, t.offset_off, "<Q", new)
    return bytes(buf), f"{t.name}: offset {t.rel_offset} -> {new}"


def tensor_overlap(data: bytes, lay: Layout, rng: random.Random):
    """Point a tensor's offset into another tensor's data (aligned)."""
    t = _tensor(lay, rng)
    other = _tensor(lay, rng, lambda o: o.name != t.name)
    inside = rng.randrange(0, max(1, other.n_bytes // lay.alignment)) * lay.alignment
    new = other.rel_offset + inside
    buf = bytearray(data)
    _put(buf, t.offset_off, "<Q", new)
    return bytes(buf), f"{t.name}: offset {t.rel_offset} -> {new} (inside {other.name})"


def tensor_beyond(data: bytes, lay: Layout, rng: random.Random):
    """Point a tensor's offset past the end of the file."""
    t = _tensor(lay, rng)
    data_len = lay.size - lay.data_offset
    new = rng.choice((data_len + lay.alignment - data_len % lay.alignment, 2**63, 2**64 - lay.alignment,
                      data_len * 16 // lay.alignment * lay.alignment))
    buf = bytearray(data)
    _put(buf, t.offset_off, "<Q", new)
    return bytes(buf), f"{t.name}: offset {t.rel_offset} -> {new}"


def tensor_type_swap(data: bytes, lay: Layout, rng: random.Random):
    """Swap a tensor's type for a known type that would not occupy the same bytes.

    A type of another block size whose bytes per element are the same (Q4_0 and
    NVFP4 on rows of 64, Q3_K and IQ3_S, TQ2_0 and IQ2_XXS, F16 and BF16) leaves
    a file no reader can tell from a real one, so it is not generated.
    """
    import gguf

    t = _tensor(lay, rng)
    n_elems = 1
    for d in t.dims:
        n_elems *= d

    def same_bytes(q) -> bool:
        block, size = gguf.GGML_QUANT_SIZES[q]
        return t.dims[0] % block == 0 and n_elems // block * size == t.n_bytes

    new = int(rng.choice([q for q in gguf.GGML_QUANT_SIZES if not same_bytes(q)]))
    buf = bytearray(data)
    _put(buf, t.type_off, "<I", new)
    return bytes(buf), f"{t.name}: type {gguf.GGMLQuantizationType(t.ggml_type).name} -> " \
                       f"{gguf.GGMLQuantizationType(new).name}"


def tensor_dims(data: bytes, lay: Layout, rng: random.Random):
    """Change one dimension (+-1, x2, /2, 0, 2**63, 2**64-1) or swap two (a transposed tensor)."""
    t = _tensor(lay, rng)
    buf = bytearray(data)
    if len(t.dims) > 1 and t.dims[0] != t.dims[1] and rng.random() < 0.25:
        _put(buf, t.dims_off, "<Q", t.dims[1])
        _put(buf, t.dims_off + 8, "<Q", t.dims[0])
        return bytes(buf), f"{t.name}: dims {list(t.dims)} swapped"
    j = rng.randrange(len(t.dims))
    old = t.dims[j]
    new = rng.choice([v for v in (old + 1, old - 1, old * 2, old // 2, 0, 2**63, 2**64 - 1, old + 32) if v != old])
    _put(buf, t.dims_off + 8 * j, "<Q", new)
    return bytes(buf), f"{t.name}: ne[{j}] {old} -> {new}"


def tensor_ndims(data: bytes, lay: Layout, rng: random.Random):
    """Set a tensor's n_dims to 0, 5, 9, 2**32-1 or one more/less than stored."""
    t = _tensor(lay, rng)
    n = len(t.dims)
    new = rng.choice([v for v in (0, 5, 9, 2**32 - 1, n + 1, n - 1) if v != n and v >= 0])
    buf = bytearray(data)
    _put(buf, t.ndims_off, "<I", new)
    return bytes(buf), f"{t.name}: n_dims {n} -> {new}"


_SCALE_AT = {"Q8_0": (34, 0), "Q4_0": (18, 0), "Q4_1": (20, 0), "Q5_0": (22, 0), "Q5_1": (24, 0),
             "Q4_K": (144, 0), "Q5_K": (176, 0), "Q6_K": (210, 208), "Q2_K": (84, 80), "Q3_K": (110, 108)}
_F16_BAD = (0x7C00, 0xFC00, 0x7E00, 0x7C01)  # +Inf, -Inf, NaN (quiet), NaN (signalling)
_BF16_BAD = (0x7F80, 0xFF80, 0x7FC0, 0x7F7F)  # +Inf, -Inf, NaN, 3.39e38 (> 1e30)
_F32_BAD = (float("nan"), float("inf"), float("-inf"), 1e35, -3e38)


def weight_bad(data: bytes, lay: Layout, rng: random.Random):
    """Put NaN, +-Inf or a value above 1e30 in one weight (F32/F16/BF16), or NaN/Inf in one quant scale field."""
    import gguf

    names = {q.value: q.name for q in gguf.GGMLQuantizationType}
    t = _tensor(lay, rng, lambda t: t.name != "rope_freqs.weight"
                and names[t.ggml_type] in ("F32", "F16", "BF16", *_SCALE_AT))
    tname = names[t.ggml_type]
    buf = bytearray(data)
    if tname == "F32":
        i, v = rng.randrange(t.n_bytes // 4), rng.choice(_F32_BAD)
        _put(buf, t.data_start + 4 * i, "<f", v)
    elif tname in ("F16", "BF16"):
        i, v = rng.randrange(t.n_bytes // 2), rng.choice(_F16_BAD if tname == "F16" else _BF16_BAD)
        _put(buf, t.data_start + 2 * i, "<H", v)
    else:
        block, off = _SCALE_AT[tname]
        i, v = rng.randrange(t.n_bytes // block), rng.choice(_F16_BAD)
        _put(buf, t.data_start + block * i + off, "<H", v)
    return bytes(buf), f"{t.name} ({tname}): item {i} set to {v!r}"


def rope_freqs_bad(data: bytes, lay: Layout, rng: random.Random):
    """Set one rope_freqs factor to 0, a negative value, NaN or Inf."""
    t = next(t for t in lay.tensors if t.name == "rope_freqs.weight")
    i, v = rng.randrange(t.n_bytes // 4), rng.choice((0.0, -1.0, -1e30, float("nan"), float("inf")))
    buf = bytearray(data)
    _put(buf, t.data_start + 4 * i, "<f", v)
    return bytes(buf), f"rope_freqs.weight[{i}] = {v}"


# --------------------------------------------------------------------------- extreme but finite weights

ROLES: dict[str, str] = {
    "norm_in": r"(attn_norm|ffn_norm|pre_ffw_norm_2|output_norm)",
    "norm_post": r"(post_attention_norm|post_ffw_norm|post_ffw_norm_1|post_ffw_norm_2|post_norm)",
    "norm_qk": r"(attn_q_norm|attn_k_norm)",
    "layer_scale": r"layer_output_scale",
    "attn_proj": r"(attn_q|attn_k|attn_v|attn_output)",
    "ffn_proj": r"(ffn_gate|ffn_up|ffn_down)",
    "experts": r"(ffn_gate_up_exps|ffn_down_exps)",
    "router": r"ffn_gate_inp",
    "embedding": r"(token_embd|per_layer_token_embd)",
    "ple": r"(inp_gate|proj|per_layer_model_proj|per_layer_proj_norm)",
}
"""Tensor roles of a Gemma 4 decoder (the tensor name without ``blk.N.`` and ``.weight``/``.scale``), as
:mod:`fast.carry` reasons about them."""

LADDER = {"float32": (1e2, 1e4, 1e6, 1e9, 1e12, 1e16, 1e19, 1e22, 1e26, 9.9e29),
          "float16": (300.0, 1e3, 3e3, 1e4, 3e4, 6e4, 65000.0)}
"""Magnitudes the extreme-weight class writes: finite and within the weight check's limit for the engine's dtype
(1e30 for float32 and bfloat16, 65504 for float16), so the file loads and the numbers decide."""


def roles_of(lay: Layout) -> dict[str, list[Tensor]]:
    """The file's tensors of each role (roles it has none of are left out)."""
    import re

    out: dict[str, list[Tensor]] = {}
    for role, pat in ROLES.items():
        rx = re.compile(rf"(blk\.\d+\.)?{pat}\.(weight|scale)")
        ts = [t for t in lay.tensors if rx.fullmatch(t.name)]
        if ts:
            out[role] = ts
    return out


def weight_extreme(data: bytes, lay: Layout, rng: random.Random, role: str, magnitude: float) -> tuple[bytes, str]:
    """Set weights of one tensor of ``role`` to about +-``magnitude``: one element of an F32/F16/BF16 tensor (a
    1-D tensor of one element, the layer scale, is that element), or one block's scale field of a quantized tensor
    (its weights then reach the scale times their codes; an fp16 scale holds at most 65504)."""
    import gguf
    import numpy as np

    names = {q.value: q.name for q in gguf.GGMLQuantizationType}
    pool = [t for t in roles_of(lay).get(role, []) if names[t.ggml_type] in ("F32", "F16", "BF16", *_SCALE_AT)]
    if not pool:
        raise KeyError(role)
    t = rng.choice(pool)
    tname = names[t.ggml_type]
    v = magnitude * rng.choice((1.0, -1.0))
    buf = bytearray(data)
    if tname == "F32":
        i = rng.randrange(t.n_bytes // 4)
        _put(buf, t.data_start + 4 * i, "<f", v)
    elif tname == "F16":
        i = rng.randrange(t.n_bytes // 2)
        v = float(np.clip(v, -65504.0, 65504.0))
        _put(buf, t.data_start + 2 * i, "<H", int(np.array([v], dtype=np.float16).view(np.uint16)[0]))
    elif tname == "BF16":
        i = rng.randrange(t.n_bytes // 2)
        _put(buf, t.data_start + 2 * i, "<H", int(np.array([v], dtype=np.float32).view(np.uint32)[0]) >> 16)
    else:
        block, off = _SCALE_AT[tname]
        i = rng.randrange(t.n_bytes // block)
        scale = float(np.clip(v / 127.0, -65504.0, 65504.0))  # codes up to ~127 (Q8_0), fewer for the others
        _put(buf, t.data_start + block * i + off, "<H", int(np.array([scale], dtype=np.float16).view(np.uint16)[0]))
        v = scale
    what = "element" if tname in ("F32", "F16", "BF16") else "block scale"
    return bytes(buf), f"{t.name} ({tname}, {role}): {what} {i} = {v:.3g}"


KINDS: dict[str, Callable] = {f.__name__: f for f in (
    truncate, header_bitflip, struct_bitflip, name_bitflip, count_huge, count_off, value_type, array_type, key_rename,
    key_remove, number_nonsense, tensor_misalign, tensor_overlap, tensor_beyond, tensor_type_swap, tensor_dims,
    tensor_ndims, weight_bad, rope_freqs_bad)}


def mutate(data: bytes, lay: Layout, kind: str, rng: random.Random) -> tuple[bytes, str]:
    """Apply the mutation ``kind`` (a key of :data:`KINDS`) to the clean file's bytes."""
    return KINDS[kind](data, lay, rng)

