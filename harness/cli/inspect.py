"""``g4h inspect PATH [--json]``: what a GGUF file or HF folder holds, what is wrong with it, which engines run it.

Reads the metadata and tensor table only (:func:`harness.inspect.inspect_model`). Prints the
architecture and size label, the per-layer table, tensor types with counts and bytes, tokenizer facts,
one row per engine setting and the problems found; ``--json`` prints the document of
``docs/inspect-json.md`` instead. Exit status: 0 usable, 1 usable with warnings, 2 unusable or
unreadable (unreadable: one line on stderr; with ``--json`` stdout still gets a document whose
verdict is ``unreadable``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from gemma4_harness.reference.errors import InputError

from ..inspect import Inspection, inspect_model, unreadable_dict
from ._args import InFile

NO_ESTIMATE = "no memory estimate (the reference's loader refuses the file)"
"""What the memory column says of a row that can run but has no estimate."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h inspect``."""
    p.add_argument("path", type=InFile(folders=True),
                   help=".gguf file or HF model folder (config.json + *.safetensors)")
    p.add_argument("--json", action="store_true", help="print the JSON document (docs/inspect-json.md) instead")


def run(args: argparse.Namespace) -> int:
    """Print the inspection; exit 0 (usable), 1 (warnings) or 2 (unusable; unreadable raises InputError)."""
    try:
        info = inspect_model(args.path)
    except InputError as e:
        if args.json:
            print(json.dumps(unreadable_dict(args.path, str(e).splitlines()[0] if str(e) else type(e).__name__),
                             indent=1))
        raise
    if args.json:
        print(json.dumps(info.as_dict(), indent=1))
    else:
        print(render(info), end="")
    return info.exit_code


# --------------------------------------------------------------------------- text


def _table(header: Sequence[str], rows: list[Sequence[Any]], indent: str = "  ") -> list[str]:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else \
        f"{n / 1e3:.1f} kB"


def _layer_runs(layers: list[dict[str, Any]]) -> list[list[Any]]:
    """Consecutive layers with the same facts as one row (``0-3``)."""
    def facts(L):
        moe = L["moe"]
        return (L["type"], L["head_dim"], f"{L['n_head']}/{L['n_kv_head']}", L["kv_donor"],
                "yes" if L["has_v_proj"] else "no", L["n_ff"],
                f"{moe['experts']} experts, top {moe['top_k']}, width {moe['n_ff_exp']}" if moe else None)
    rows: list[list[Any]] = []
    start = 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or facts(layers[i]) != facts(layers[start]):
            span = str(start) if i - 1 == start else f"{start}-{i - 1}"
            rows.append([span, *facts(layers[start])])
            start = i
    return rows


def render(info: Inspection) -> str:
    """The text report of ``g4h inspect`` (one section per fact group; problems and verdict last)."""
    out = [info.path]
    fmt = f"GGUF v{info.gguf_version}" if info.format == "gguf" else "HF folder (config.json + safetensors)"
    out.append(f"  format        {fmt}, {info.file_bytes:,} bytes ({_gb(info.file_bytes)})")
    label = f"{info.size_label} ({info.size_label_source})" if info.size_label else "-"
    arch = [f"{info.architecture or '?'}", f"size {label}", f"{info.n_params:,} parameters"]
    if info.file_type:
        arch.append(f"general.file_type {info.file_type}")
    if info.name:
        arch.append(f"name {info.name}")
    out.append("  architecture  " + " · ".join(arch))
    m = info.model
    if m:
        facts = [f"vocab {m['vocab_size']}", f"hidden {m['hidden_size']}", f"{m['n_layer']} layers",
                 f"sliding window {m['sliding_window']}", f"context {m['context_length']}",
                 f"final softcap {m['final_logit_softcap'] if m['final_logit_softcap'] is not None else 'none'}"]
        if m["ple_dim"]:
            facts.append(f"PLE {m['ple_dim']}")
        if m["n_kv_shared"]:
            facts.append(f"{m['n_kv_shared']} KV-shared layers")
        if m["n_expert"]:
            facts.append(f"MoE {m['n_expert']} experts, top {m['n_expert_used']}")
        facts.append("tied head" if m["tie_word_embeddings"] else "own output head")
        out.append("  model         " + " · ".join(facts))
    if info.layers:
        out += ["", "layers"]
        out += _table(("layers", "type", "head_dim", "q/kv heads", "kv donor", "v_proj", "ffn", "moe"),
                      _layer_runs(info.layers))
    out += ["", "tensor types"]
    out += _table(("type", "tensors", "elements", "bytes"),
                  [[t.type, t.count, f"{t.elements:,}", "?" if t.bytes is None else f"{t.bytes:,} ({_gb(t.bytes)})"]
                   for t in info.tensor_types])
    tok = info.tokenizer
    if tok:
        vocab = f"{tok['tokens']} tokens" if tok["tokens"] is not None else "no token list"
        rows = f"{tok['embedding_rows']} embedding rows" if tok["embedding_rows"] is not None else "no embedding"
        tmpl = f"present ({tok['chat_template_source']})" if tok["chat_template"] else "missing"
        out += ["", "tokenizer",
                f"  model {tok['model'] or 'none'} · {vocab} / {rows} · bos {_id(tok['bos_id'])} · "
                f"eos {_id(tok['eos_id'])} · pad {_id(tok['pad_id'])} · chat template {tmpl}"]
    out += ["", "engines"]
    rows_e = []
    for r in info.engines:
        if r.can_run:
            detail = NO_ESTIMATE if r.memory is None else _memory_text(r.memory)
            detail += "".join(f"; {n}" for n in r.notes)
        else:
            detail = r.reason
        rows_e.append([r.engine, r.dtype, r.weights, "yes" if r.can_run else "no", detail])
    out += _table(("engine", "dtype", "weights", "runs", "memory / why not"), rows_e)
    out += ["", "problems"]
    out += [f"  {p.severity}: {p.message}" for p in info.problems] or ["  none"]
    n_warn = sum(p.severity == "warning" for p in info.problems)
    verdict = {"usable": "usable", "warnings": f"usable with {n_warn} warning{'s' * (n_warn != 1)}",
               "unusable": "unusable"}[info.verdict]
    out += ["", f"verdict: {verdict} (exit {info.exit_code})"]
    return "\n".join(out) + "\n"


def _id(v: int | None) -> str:
    return "-" if v is None else str(v)


def _memory_text(mem: dict[str, Any]) -> str:
    """``needs 3.1 GB of 20.5 GB`` and, when it does not fit, ``(does not fit: try --weights packed or ...)``."""
    need, avail = mem.get("need_bytes"), mem.get("available_bytes")
    text = f"needs {_gb(need)}" + (f" of {_gb(avail)}" if avail is not None else "")
    if mem.get("fits") is False:
        advice = mem.get("advice") or []
        text += " (does not fit" + (": try " + " or ".join(advice) if advice else "") + ")"
    return text
