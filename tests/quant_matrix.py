"""The fault matrix of issue 34: per weight type, a correct file and faulty copies (:mod:`quant_faults`: the first
half of one matrix's rows x1.02, one block's scale x1.5, two rows swapped), each run through the ``llamacpp`` engine
and served by llama-server and llama-cpp-python's server with their defaults (nothing but the model, host and port
on their command line: tests/field_servers.py), judged against the reference on the correct file as ``g4h parity``
judges the pair (:func:`quant_pairs.judge`: the pair's gates; a server's own checks left out). The table of
docs/quantized-activations.md.

    python tests/quant_matrix.py [--file NAME ...] [--engine llamacpp|llama-server|llama-cpp-python ...]
                                 [--fault rows|block|swap ...] [--out DIR]

Files (:data:`FILES`): the synthetic e2b as written by ``g4h synth`` (F32, F16, BF16, Q8_0, Q4_0) and quantized by
llama-quantize (Q4_1, Q5_1, IQ4_NL), the synthetic 31b quantized by llama-quantize (Q5_0, Q4_K_S, Q6_K, Q4_K_M,
Q3_K_S, Q5_K_S: its rows of 256 take K-quants), the real Gemma 3 270M Q4_K_M. Prompts: the texts of tests/field_servers.py (llama-cpp-python takes text only), our tokenizer's ids for
every engine; 8 greedy tokens. Prints one line per run and the markdown table; writes ``DIR/matrix.json``. Exit
status: 0 when every correct run passed and every faulty one failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from field_servers import TEXTS, server  # noqa: E402
from quant_faults import FAULTS, make_fault  # noqa: E402
from quant_pairs import judge  # noqa: E402

FILES = {"e2b-F32": ("e2b", "F32"), "e2b-F16": ("e2b", "F16"), "e2b-BF16": ("e2b", "BF16"),
         "e2b-Q8_0": ("e2b", "Q8_0"), "e2b-Q4_0": ("e2b", "Q4_0"), "31b-Q5_0": ("31b", "Q5_0"),
         "31b-Q4_K_S": ("31b", "Q4_K_S"), "31b-Q6_K": ("31b", "Q6_K"), "31b-Q4_K_M": ("31b", "Q4_K_M"),
         "e2b-Q4_1": ("e2b", "Q4_1"), "e2b-Q5_1": ("e2b", "Q5_1"), "e2b-IQ4_NL": ("e2b", "IQ4_NL"),
         "31b-Q3_K_S": ("31b", "Q3_K_S"), "31b-Q5_K_S": ("31b", "Q5_K_S"),
         "gemma3-270m-Q4_K_M": (None, None)}
"""Table name -> (synthetic case, type: written by g4h synth, else by llama-quantize from the case's F32 file);
``(None, None)``: the real Gemma 3 270M Q4_K_M."""

TENSORS = ("blk.1.ffn_down.weight", "blk.3.attn_output.weight", "blk.2.ffn_gate.weight")
"""The matrices a fault goes into: per fault kind in turn (rows: the first, block: the second, swap: the third)."""

ENGINES = ("llamacpp", "llama-server", "llama-cpp-python")


def model_file(name: str, work: Path) -> Path:
    """The GGUF of table row ``name`` (built, quantized or assembled on first use)."""
    case, qtype = FILES[name]
    if case is None:
        from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

        return Path(gemma3_270m_gguf())
    from gemma4_harness.harness.core.cases import resolve_spec
    from gemma4_harness.harness.synth import ensure_built

    built = ensure_built(resolve_spec(case)).gguf
    if qtype in built:
        return Path(built[qtype])
    from gemma4_harness.harness.engines.llamacpp.tools import quantize

    dst = work / f"{name}.gguf"
    return dst if dst.is_file() else quantize(built["F32"], dst, qtype, threads=1)


def tensor_type(path: Path, name: str) -> str:
    import gguf

    return next(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name == name)


def run_one(runs, engine: str, served: Path, model: Path, prompts, log: Path) -> dict:
    """The pair's verdict and figures of ``engine`` on ``served``, judged against ``runs`` (the reference on
    ``model``)."""
    t0 = time.monotonic()
    if engine == "llamacpp":
        r = judge(runs, served, prompts)
    else:
        with server(engine, served, log) as srv:
            r = judge(runs, served, prompts, engine=f"openai:{srv.url}/v1", model=model)
    agree = next((v for g, v in r["gates"].items() if g.endswith("_q8.agreeing_positions")), None)
    greedy = next((v for g, v in r["gates"].items() if g.endswith(".greedy")), None)
    failing = sorted(g for g, v in r["gates"].items() if v["fail"])
    d = agree["detail"] if agree else {}
    local = next((v for g, v in r["gates"].items() if g.endswith("_q8.local_median")), None)
    med = next((v for g, v in r["gates"].items() if g.endswith("_q8.median_abs_logprob")), None)
    ld = local["detail"] if local else {}
    return {"exit": 0 if r["passed"] else 1, "seconds": round(time.monotonic() - t0),
            "local": None if local is None else local["worst"], "local_null": ld.get("null"),
            "local_limit": ld.get("limit"), "first_divergence": ld.get("first_divergence"),
            # the point with the most positions beyond the limit: [point@layer, engine's, null's, flips explain]
            "local_moved": max(([f"{q}@{il}", b, nb, m] for q, il, b, nb, m in ld.get("moved_per_point") or ()),
                               key=lambda r: r[1], default=None),
            "agreeing": None if agree is None else agree["worst"],
            "counts": [d.get("agreeing"), d.get("reference_agreeing"), d.get("positions")] if d else None,
            "agreeing_informational": bool(agree and (agree["informational"] or d.get("informational_reason"))), "failing": failing,
            # on the windows where the streams' null had no resolution: the streams' [agreeing, null, positions]
            "agreeing_on": "windows" if "streams" in d else None, "streams": d.get("streams"),
            # the windows asked where the streams' null had no resolution: [agreeing, null, windows]
            "windows": (None if not d.get("windows") else
                        [d["windows"]["agreeing"], d["windows"]["reference_agreeing"], d["windows"]["positions"]]),
            # [engine's median |dlogprob|, the null's, gated]: where neither count has resolution (a server)
            "median": None if med is None else [med["worst"], med["detail"].get("null"), not med["informational"]],
            "greedy": None if greedy is None else greedy["worst"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", action="append", choices=list(FILES), default=None)
    p.add_argument("--engine", action="append", choices=ENGINES, default=None)
    # the faults of dense matrices (TENSORS): an expert's fault is tests/quant_experts.py's
    p.add_argument("--fault", action="append", choices=[f for f in FAULTS if f != "expert"], default=None)
    p.add_argument("--out", default="reports/quant-matrix")
    p.add_argument("--skip-correct", action="store_true", help="the faulty copies only (the correct run measured apart)")
    p.add_argument("--correct-only", action="store_true", help="the correct file only (the false-alarm half)")
    a = p.parse_args(argv)
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
    from gemma4_harness.harness.tokenizer.prompt_ids import with_prompt_ids

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, status = [], 0
    for name in a.file or list(FILES):
        model = model_file(name, out)
        runs = ReferenceRuns(ReferenceEngine(model))
        prompts = with_prompt_ids([{"id": f"text{i}", "text": t} for i, t in enumerate(TEXTS)], model)
        copies = [] if a.skip_correct else [("correct", "-", model)]
        for kind, tensor in zip([] if a.correct_only else a.fault or FAULTS[:3], TENSORS):
            path, what = make_fault(kind, model, out / f"{name}-{kind}.gguf", tensor)
            copies.append((kind, f"{what} ({tensor_type(model, tensor)})", path))
        for kind, what, path in copies:
            for engine in a.engine or ENGINES:
                try:
                    r = run_one(runs, engine, path, model, prompts, out / f"{name}-{kind}-{engine}.log")
                except Exception as e:  # a run that could not be judged is a row, said, and fails the matrix
                    r = {"exit": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                ok = r["exit"] == (0 if kind == "correct" else 1)
                status |= not ok
                rows.append({"file": name, "fault": kind, "what": what, "engine": engine, **r,
                             "outcome": "ok" if ok else ("false alarm" if kind == "correct" else "miss")})
                print(json.dumps(rows[-1]), flush=True)
                (out / "matrix.json").write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    return status


def table(rows: list[dict]) -> str:
    """The markdown table of the matrix's rows."""
    lines = ["| file | copy | engine | exit | local_median (null; first diverging point) "
             "| agreeing_positions (engine / jittered reference, of positions) | greedy | outcome |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("counts")
        fig = ("-" if r.get("agreeing") is None or r["agreeing"] != r["agreeing"] else
               f"{r['agreeing']:.3g} ({c[0]} / {c[1]}, of {c[2]})" if c else f"{r['agreeing']:.3g}")
        if r.get("agreeing_on") == "windows":
            fig += f" on windows (streams {r['streams'][0]} / {r['streams'][1]})"
        if r.get("agreeing_informational"):
            fig += " (reported: flips too dense)"
        m = r.get("median")
        if m:
            fig += f"; median {m[0]:.2g} / {m[1]:.2g}{' gated' if m[2] else ''}"
        g = r.get("greedy")
        loc = ("-" if r.get("local") is None else
               f"{r['local']:.3g} ({r['local_null']:.2g}; {r.get('first_divergence') or '-'})")
        lines.append(f"| {r['file']} | {r['fault'] if r['fault'] == 'correct' else r['what']} | {r['engine']} | "
                     f"{r['exit'] if r['exit'] is not None else 'error: ' + r.get('error', '')} | {loc} | {fig} | "
                     f"{'-' if g is None else f'{g:.3g}'} | {r['outcome']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
