"""An engine that gives logits and no tensor traces, rounding its activations as llama.cpp does, on a quantized file
of tests/test_local_gate.py and its faulty copies (quant_faults.make_fault), judged as ``g4h parity`` judges the pair
(``harness/parity/checks/pair.py`` ``_measure``; ``<pair>_q8.agreeing_positions`` on logits, harness/parity/checks/
quantized.py ``quantized_gates``). Prints one JSON line per copy: whether the pair passes, the gates that fail, and
the ``agreeing_positions`` figure (the engine's count, the null's, the ratio, or why it has no resolution) and the
``median_abs_logit`` figure (the engine's median, the null's, the limit, whether it judges); the
tables of docs/quantized-activations.md ("Engines with logits and no tensors").

    python tests/quant_logits_only.py VARIANT cmd|llamacpp [rows,block,swap] [N_TOKENS]

``cmd``: examples/llamacpp_engine.py (llama-cpp-python behind the subprocess protocol; its hello declares
gelu_fp16_table and quantized_activations) with ``--declare vec_dot_types=llama.cpp``, as ``g4h parity --against
"cmd:python examples/llamacpp_engine.py" --declare vec_dot_types=llama.cpp`` would run it. ``llamacpp``: the
``llamacpp`` engine with its traces withheld (:class:`NoTraces`). The faults: rows x1.02 in ``blk.1.ffn_down`` (the
first half), one block x1.5 in ``blk.3.attn_output``, rows swapped in ``blk.2.ffn_gate`` (quant_matrix.TENSORS);
``e2b-q8_0`` or ``e2b-f16`` for VARIANT: the e2b case in that type; a row of tests/quant_matrix.py ``FILES``
(``31b-Q4_K_M``, ``gemma3-270m-Q4_K_M``): that file. ``none`` for the faults: the correct file only.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_faults import make_fault  # noqa: E402
from quant_matrix import TENSORS  # noqa: E402
from quant_pairs import prompts_for  # noqa: E402

from gemma4_harness.harness.core.gates import DEFAULT_GATES  # noqa: E402
from gemma4_harness.harness.engines import make_engine  # noqa: E402
from gemma4_harness.harness.engines.numerics import KIND_NUMERICS, declare, engine_numerics  # noqa: E402
from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.parity.checks.pair import _measure, pair_name  # noqa: E402
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns  # noqa: E402
from gemma4_harness.harness.parity.result import CaseResult  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llamacpp_engine.py"


class NoTraces:
    """The ``llamacpp`` engine on ``path`` offering logits and generation only (``ops``): no ``logits_many`` (whose
    batch carries traces), so the pair is judged as an engine without tensors is."""

    ops = ("logits", "generate")

    def __init__(self, path: Path) -> None:
        self.eng = make_engine("llamacpp", path)
        self.numerics = KIND_NUMERICS["llamacpp"]
        self.name = "llamacpp (no traces)"

    def logits(self, ids, trace=None):
        return self.eng.logits(ids)

    def generate_full(self, *a, **k):
        return self.eng.generate_full(*a, **k)

    def close(self):
        getattr(self.eng, "close", lambda: None)()


def engine(which: str, path: Path):
    """The engine of ``which`` on ``path`` and its kind."""
    if which == "cmd":
        eng = make_engine("cmd:" + shlex.join([sys.executable, str(EXAMPLE), "--threads", "2"]), path)
        eng.numerics = declare(eng.numerics, {"vec_dot_types": "llama.cpp"})
        return eng, "cmd"
    return NoTraces(path), "llamacpp"


def built(variant: str, tmp: Path) -> Path:
    from quant_matrix import FILES, model_file

    if variant in FILES:  # a row of tests/quant_matrix.py: 31b-Q4_K_M (llama-quantize), gemma3-270m-Q4_K_M (real)
        return model_file(variant, tmp)
    if variant.startswith("e2b-"):  # e2b-q8_0, e2b-f16: the e2b case in that type
        from gemma4_harness.harness.core.cases import resolve_spec
        from gemma4_harness.harness.synth import ensure_built

        return Path(ensure_built(resolve_spec("e2b")).gguf[variant[4:].upper()])
    from test_local_gate import _built

    return _built(variant, tmp)[1]


def main(argv: list[str]) -> int:
    variant, which = argv[0], argv[1]
    faults = argv[2].split(",") if len(argv) > 2 and argv[2] else ["rows", "block", "swap"]
    faults = [f for f in faults if f != "none"]  # none: the correct file only
    n_tokens = int(argv[3]) if len(argv) > 3 else 4
    tensors = dict(zip(("rows", "block", "swap"), TENSORS))
    tmp = Path(tempfile.mkdtemp(prefix="quant-logits-only-"))
    path = built(variant, tmp)
    runs = ReferenceRuns(ReferenceEngine(path))
    prompts = prompts_for(path, runs.ref.cfg)
    copies = [("correct", path)] + [(f, make_fault(f, path, tmp / f"{f}.gguf", tensors[f])[0]) for f in faults]
    for label, f in copies:
        t0 = time.time()
        eng, kind = engine(which, f)
        pair = pair_name(kind, engine_numerics(eng, kind).dtype)
        try:
            figs = _measure(runs, eng, kind, pair, prompts, lambda m: None, "q", n_tokens)
        finally:
            getattr(eng, "close", lambda: None)()
        res = CaseResult(case="q", kind="user", model=str(f))
        res.apply(figs, DEFAULT_GATES)
        agree = next((c for c in res.checks if c["gate"].endswith("_q8.agreeing_positions")), None)
        failing = sorted({c["gate"] for c in res.checks if not c["pass"] and not c.get("informational")})
        row = {"variant": variant, "engine": which, "copy": label, "passed": res.passed, "failing": failing,
               "prompts": len(prompts), "positions": sum(len(p["prompt_ids"]) for p in prompts),
               "seconds": round(time.time() - t0, 1)}
        if agree is not None:
            row.update(ratio=agree["measured"], agreeing=agree.get("agreeing"),
                       reference_agreeing=agree.get("reference_agreeing"),
                       judged=not agree.get("informational"), no_resolution=agree.get("no_resolution"))
        med = next((c for c in res.checks if c["gate"].endswith("_q8.median_abs_logit")), None)
        if med is not None:  # the sizes (gates.Q8_MEDIAN_LOGIT_WHY): judged where the count has no resolution
            row.update(median_abs_logit=med["measured"], median_null=med.get("null"), median_limit=med["limit"],
                       median_judged=not med.get("informational"))
        kld = [c for c in res.checks if c["gate"].endswith("_q8x.mean_kld")]
        if kld:
            row["q8x_mean_kld"] = [round(c["measured"], 6) for c in kld]
            row["q8x_limit"] = [round(c["limit"], 6) for c in kld]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
