"""An engine on a quantized GGUF (correct, or a faulty copy: :mod:`quant_faults`) against the reference on the correct
file, judged as ``g4h parity`` judges the pair (``harness/parity/checks/pair.py``, the gates of
``harness/core/gates.py``; a server's own checks left out); for tests/test_quantized_gates.py, tests/quant_matrix.py
and the figures of docs/quantized-activations.md.

    python tests/quant_pairs.py FILE.gguf [TENSOR ...]   # llamacpp: the correct file, then one faulty copy per tensor
    python tests/quant_pairs.py --fast-q8 FILE.gguf [TENSOR ...]   # the same, the fast engine under --compute q8
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_faults import scale_rows  # noqa: E402

from gemma4_harness.harness.core.gates import DEFAULT_GATES  # noqa: E402
from gemma4_harness.harness.core.prompts import load_prompts  # noqa: E402
from gemma4_harness.harness.engines import engine_kind, make_engine  # noqa: E402
from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.parity.checks.pair import _measure, engine_numerics, pair_name  # noqa: E402
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns  # noqa: E402
from gemma4_harness.harness.parity.result import CaseResult  # noqa: E402


def judge(runs: ReferenceRuns, engine_file: str | Path, prompts, n_tokens: int = 8, engine: str = "llamacpp",
          model: str | Path | None = None, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pair ``reference~<kind of engine>`` with ``engine`` (``llamacpp``, ``fast``: run on ``engine_file``;
    ``openai:URL``: a server already serving ``engine_file``, told ``model``, the reference's file) and the reference
    of ``runs``: whether it passes, and per gate the worst figure, its limit, the worst figure against the exact
    reference, and the last check's record (``detail``). ``options``: the engine's keywords (``{"compute": "q8"}``
    for the fast engine's llama.cpp arithmetic)."""
    kind = engine_kind(engine)
    eng = make_engine(engine, engine_file if kind in ("llamacpp", "fast") else model, **(options or {}))
    pair = pair_name(kind, engine_numerics(eng, kind).dtype)
    try:
        figs = _measure(runs, eng, kind, pair, prompts, lambda m: None, "q", n_tokens)
    finally:
        close = getattr(eng, "close", None)
        if close:
            close()
    res = CaseResult(case="q", kind="user", model=str(engine_file))
    res.apply(figs, DEFAULT_GATES)
    out: dict[str, Any] = {"passed": res.passed, "gates": {}}
    for c in res.checks:
        g = out["gates"].setdefault(c["gate"], {"worst": None, "limit": c["limit"], "exact": None, "fail": 0,
                                                "informational": bool(c.get("informational")), "detail": c})
        worse = (lambda a, b: a > b) if c["op"] == "le" else (lambda a, b: a < b)
        if g["worst"] is None or worse(c["measured"], g["worst"]):
            g["worst"] = c["measured"]
        ex = c.get("vs_exact_reference")
        if ex is not None and (g["exact"] is None or worse(ex, g["exact"])):
            g["exact"] = ex
        g["fail"] += 0 if (c["pass"] or c.get("informational")) else 1
    return out


def prompts_for(path: str | Path, cfg, n: int | None = None) -> list[dict[str, Any]]:
    """The synthetic prompt set within the model's vocabulary (the first ``n``)."""
    ps = [p for p in load_prompts() if max(p["prompt_ids"]) < cfg.vocab_size]
    return ps[:n] if n else ps


def main(argv: list[str]) -> int:
    engine, options = "llamacpp", None
    if argv and argv[0] == "--fast-q8":  # the fast engine under --compute q8 (llama.cpp's arithmetic)
        engine, options, argv = "fast", {"compute": "q8"}, argv[1:]
    path, tensors = argv[0], argv[1:]
    ref = ReferenceEngine(path)
    runs = ReferenceRuns(ref)
    prompts = prompts_for(path, ref.cfg)
    with tempfile.TemporaryDirectory() as tmp:
        for label, f in [("correct", path)] + [(t, scale_rows(path, Path(tmp) / f"{i}.gguf", t))
                                               for i, t in enumerate(tensors)]:
            r = judge(runs, f, prompts, engine=engine, options=options)
            print(f"{Path(path).name} {label}: {'PASS' if r['passed'] else 'FAIL'}")
            for g, v in r["gates"].items():
                ex = "" if v["exact"] is None else f" (exact reference: {v['exact']:.3g})"
                print(f"  {g}: {v['worst']:.3g} vs {v['limit']:.3g}{ex}{' FAIL' if v['fail'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
