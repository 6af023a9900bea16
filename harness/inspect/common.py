"""The checks both file formats share: the config's facts, tensor types and counts, the loader's tensor checks,
K/V tensors of shared layers, special token ids, and the small helpers that name a key or tensor in a message."""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import gguf
import numpy as np

from gemma4_harness.reference.config import ModelConfig, expected_tensors, optional_tensors, unread_tensors

from .model import UNUSABLE, WARNING, Inspection, Problem, TensorType

_SHARED_KV = ("attn_k.weight", "attn_k_norm.weight", "attn_v.weight")


def describe_config(info: Inspection, cfg: ModelConfig) -> None:
    info.model = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "n_layer": cfg.n_layer,
                  "sliding_window": cfg.sliding_window, "context_length": cfg.context_length,
                  "final_logit_softcap": cfg.final_logit_softcap, "ple_dim": cfg.ple_dim,
                  "n_kv_shared": cfg.n_kv_shared, "n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used,
                  "n_ff_exp": cfg.n_ff_exp, "tie_word_embeddings": cfg.tie_word_embeddings}
    info.layers = [{"index": L.index, "type": "sliding" if L.is_sliding else "full", "head_dim": L.head_dim,
                    "n_head": L.n_head, "n_kv_head": L.n_kv_head,
                    "kv_donor": None if L.has_kv else L.kv_donor, "has_v_proj": L.has_v_proj, "n_ff": L.n_ff,
                    "moe": {"experts": cfg.n_expert, "top_k": cfg.n_expert_used, "n_ff_exp": cfg.n_ff_exp}
                    if L.has_moe else None} for L in cfg.layers]


def tensor_types(items: Iterable[tuple[int | None, str, tuple[int, ...], int | None]]) -> list[TensorType]:
    acc: dict[str, list] = {}
    for type_id, name, shape, n_bytes in items:
        a = acc.setdefault(name, [type_id, 0, 0, 0])
        a[1] += 1
        a[2] += int(np.prod(shape, dtype=object))
        a[3] = None if a[3] is None or n_bytes is None else a[3] + n_bytes
    out = [TensorType(name, a[0], a[1], a[2], a[3]) for name, a in acc.items()]
    return sorted(out, key=lambda t: -(t.bytes if t.bytes is not None else t.elements))


def count_params(info: Inspection, tensors: list[tuple[str, tuple[int, ...]]], label: str | None,
                  label_key: str | None) -> None:
    """Parameter count and size label, counted as gguf's writer does (``GGUFWriter.get_total_parameter_count``:
    an ``*_exps.*`` tensor of 3 dims is ``n_expert`` experts), labelled with ``gguf.utility.size_label``."""
    total = shared = expert = expert_sum = n_exp_tensors = 0
    for name, shape in tensors:
        size = int(np.prod(shape, dtype=object))
        total += size
        if "_exps." in name and len(shape) >= 3:
            expert += size // shape[-3]
            expert_sum += shape[-3]
            n_exp_tensors += 1
        else:
            shared += size
    n_expert = expert_sum // n_exp_tensors if n_exp_tensors else 0
    info.n_params = total
    info.n_expert_params = expert * n_expert
    if label:
        info.size_label, info.size_label_source = label, label_key
    elif total:
        info.size_label = gguf.utility.size_label(total, shared, expert, n_expert)
        info.size_label_source = "computed"


def tensor_problems(source: str, cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], skip: tuple[str, ...]
                     ) -> list[Problem]:
    """The loader's tensor checks, from the tensor table: missing, mis-shaped, unread decoder tensors."""
    expected, optional = expected_tensors(cfg), optional_tensors(cfg)
    missing = [n for n in expected if n not in shapes and n not in optional and n not in skip]
    wrong = [n for n, s in expected.items() if n in shapes and n not in skip and tuple(shapes[n]) != tuple(s)]
    unread = unread_tensors(cfg, shapes)
    out = []

    def more(names):
        return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    if missing:
        n = missing[0]
        out.append(Problem(UNUSABLE, "tensors", n, f"{source}: missing tensor {n}{more(missing)} (expected shape "
                                                   f"{list(expected[n])})"))
    if wrong:
        n = wrong[0]
        out.append(Problem(UNUSABLE, "tensors", n, f"{source}: tensor {n}{more(wrong)} has shape {list(shapes[n])}, "
                                                   f"expected {list(expected[n])}"))
    if unread:
        n = unread[0]
        out.append(Problem(UNUSABLE, "tensors", n, f"{source}: tensor {n}{more(unread)} is not one this {cfg.arch} "
                                                   "config reads (a misspelt or damaged name, or keys that do not "
                                                   "match the tensors)"))
    return out


def shared_kv_tensors(cfg: ModelConfig, names: Iterable[str]) -> list[str]:
    """The ``attn_k`` / ``attn_k_norm`` / ``attn_v`` tensors of KV-shared layers among ``names`` (canonical):
    shipped, but read by no engine (a shared layer reads its donor's cache). Sorted by layer."""
    have = set(names)
    return [f"blk.{L.index}.{s}" for L in cfg.layers if not L.has_kv for s in _SHARED_KV
            if f"blk.{L.index}.{s}" in have]


def compact_names(names: list[str]) -> str:
    """``blk.15-19.attn_k.weight, blk.15.attn_v.weight``: names grouped by suffix, layer runs as ranges."""
    groups: dict[str, list[int]] = {}
    other = []
    for n in names:
        m = re.match(r"^blk\.(\d+)\.(.+)$", n)
        if m:
            groups.setdefault(m.group(2), []).append(int(m.group(1)))
        else:
            other.append(n)
    parts = []
    for suffix, layers in groups.items():
        layers = sorted(set(layers))
        runs, start = [], layers[0]
        for a, b in zip(layers, layers[1:] + [None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        parts += [f"blk.{r}.{suffix}" for r in runs]
    return ", ".join(parts + other)


def shared_kv_problems(cfg: ModelConfig, names: Iterable[str]) -> list[Problem]:
    found = shared_kv_tensors(cfg, names)
    if not found:
        return []
    return [Problem(WARNING, "shared_kv_tensors", found[0],
                    f"{cfg.source}: {len(found)} K/V tensors of KV-shared layers that no engine reads (each shared "
                    f"layer reads its donor's cache): {compact_names(found)}")]


def special_id_problems(path: str, tok: Mapping[str, Any], n_tokens: int | None, key_fmt: str,
                         names: Mapping[str, str]) -> list[Problem]:
    out = []
    for short, long in names.items():
        tid = tok.get(f"{short}_id")
        if tid is not None and n_tokens is not None and not 0 <= tid < n_tokens:
            key = key_fmt.format(long)
            out.append(Problem(WARNING, "special_token_id", key, f"{path}: {key} = {tid}: expected an id below the "
                                                                 f"vocabulary size {n_tokens}"))
    return out


def one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


_NAMED = re.compile(r"\b((?:general|tokenizer|gemma3|gemma4)\.[\w.]*\w"  # a key
                    r"|blk\.\d+\.\w+(?:\.\w+)?|[a-z_]+\.(?:weight|scale))\b")  # a tensor


def named_in(e: BaseException, default: str) -> str:
    """The first GGUF key or tensor name a message names (best effort), else ``default``."""
    m = _NAMED.search(str(e).split(": ", 1)[-1])
    return m.group(1) if m else default


def str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else None
