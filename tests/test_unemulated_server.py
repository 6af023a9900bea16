"""A server whose activation rounding cannot be emulated is gated, not waved through (issue 34).

``g4h parity --model F --against openai:URL --declare vec_dot_types=none``: the server says it rounds the
activations of its quantized products (``quantized_activations``, llama-server's default) but not to which types (a
llama-server on a GPU backend: CUDA's MMQ rounds every type's activations to Q8_1, not the CPU table's), so the
oracle cannot emulate it (:meth:`ReferenceRuns.emulation_gap`). Before, every figure of such a pair was
informational, and a server gives no logits, so the gated mean KLD had nothing to stand on: the pair had no gated
figure and any server passed (measured below: the swapped copies exited 0). Now its greedy streams' KLD on the top-N
bins (:func:`harness.parity.checks.quantized.stream_kld`, :func:`harness.core.metrics.binned_kld`) is the pair's
``reference~openai_q8x.mean_kld``, gated at 2 x the 8-bit yardstick's on the same bins.

The faults are the ones the rule can see, named by what it is: a fault must move the model by more than an 8-bit
rounding of every product does (docs/quantized-activations.md, "Not emulated, on a server": rows x1.02 and one
block x1.5 pass this rule, as they pass ``_q8x`` on logits; the emulating gates catch them when the server says
its types). Two rows of ``blk.2.ffn_gate`` swapped (:func:`quant_faults.swap_rows`: exact bytes, a shape change
Gemma's norms do not cancel) measured 2.8 x (Q8_0) and 3.0 x (PLE Q4_0) the yardstick, over the limit of 2 x; the
correct files 1.42 x and 0.83 x (``python tests/quant_unemulated.py VARIANT small reference correct,swap``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from field_servers import server  # noqa: E402
from quant_faults import make_fault  # noqa: E402
from servers import _unavailable  # noqa: E402
from test_local_gate import _built  # noqa: E402

from gemma4_harness.harness.parity.checks.quantized import STREAM_KLD_ON  # noqa: E402

GATE = "reference~openai_q8x.mean_kld"
PROMPTS = [[2, 127, 198, 237, 126], [2, 169, 23, 254, 172, 81, 60, 73, 157, 146, 110],
           [2, 233, 57, 205, 13, 117, 24, 183, 103, 184, 222, 113, 30, 115, 142, 140, 234],
           [2, 18, 215, 49, 66, 245, 27, 159]]
"""The four prompts of tests/test_oracle_fast_server.py (within both vocabularies), 4 new tokens each: 41 prompt
positions (asked as one token after each prefix: llama-server reports no prompt log-probs) and 16 steps."""

NEW_TOKENS = 4

OPTIONS = ("--declare", "vec_dot_types=none", "--skip", "server-batch", "--skip", "server-stream", "--skip",
           "server-stop", "--explain-budget", "0", "--quiet")
"""What the server says it computes (quantized activations of unknown types), and what is not judged here (batch
invariance, streaming, stop: tests/test_server_parity.py; the explanation of a failing pair)."""


@pytest.fixture(scope="module", params=["h96-q8_0", "h128-ple-q4_0"])
def served(request, tmp_path_factory):
    """``(correct file, {"correct": server, "swap": server}, folder)``: llama-server with its defaults on a small
    quantized file of tests/test_local_gate.py and on its copy with two rows of ``blk.2.ffn_gate`` swapped."""
    from gemma4_harness.harness.engines.llamacpp.build import ensure_built
    from gemma4_harness.harness.engines.llamacpp.pins import BuildError

    try:
        ensure_built()
    except BuildError as e:
        _unavailable(f"llama-server: {e}")
    tmp = tmp_path_factory.mktemp(request.param)
    _, good = _built(request.param, tmp)
    bad, _ = make_fault("swap", good, tmp / "swap.gguf", "blk.2.ffn_gate.weight")
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{k}", "prompt_ids": p}) + "\n"
                                               for k, p in enumerate(PROMPTS)))
    started = {}
    try:
        for fault, path in (("correct", good), ("swap", bad)):
            try:
                started[fault] = server("llama-server", path, tmp / f"{fault}-server.log").start()
            except RuntimeError as e:
                _unavailable(f"llama-server: {e}")
        yield good, started, tmp
    finally:
        for s in started.values():
            s.stop()


def _parity(served, fault: str, capsys) -> tuple[int, str, dict[str, dict]]:
    """``g4h parity`` of the server of ``fault`` against the correct file, with :data:`OPTIONS`: the exit status,
    what it printed, the checks by gate."""
    from gemma4_harness.harness.cli import main

    good, servers, tmp = served
    out = tmp / f"out-{fault}"
    rc = main(["parity", "--model", str(good), "--against", f"openai:{servers[fault].url}/v1",
               "--prompts", str(tmp / "prompts.jsonl"), "--out", str(out), "--max-new-tokens", str(NEW_TOKENS),
               *OPTIONS])
    printed = capsys.readouterr().out
    (results,) = out.glob("*/results.json")
    case = json.loads(results.read_text())["cases"][0]
    assert case.get("error") is None, case["error"]
    return rc, printed, {c["gate"]: c for c in case["checks"]}


def _judged_by_the_yardstick(checks: dict[str, dict]) -> dict:
    """The rounding was not emulated, every other figure of the pair says why, and the streams' KLD judges."""
    runs = checks["reference~openai.runs"]
    assert "quantized_activations" not in runs["numerics"]["emulated"], runs["numerics"]
    gated = [g for g, c in checks.items() if g.startswith("reference~openai") and not c.get("informational")]
    assert sorted(gated) == ["reference~openai.runs", GATE], gated
    said = checks["reference~openai.greedy"]
    assert "cannot emulate here: the engine does not say whose dot-product types" in said["reason"], said
    kld = checks[GATE]
    assert kld["on"] == STREAM_KLD_ON and kld["quantized_activations"].startswith("not emulated"), kld
    assert kld["positions"] > 4 * len(PROMPTS), kld  # the prompt positions, then the steps
    assert 0 < kld["yardstick"] and kld["limit"] == pytest.approx(2 * kld["yardstick"]), kld
    return kld


def test_correct_server_passes_the_streams_yardstick(served, capsys):
    """The correct file: exit 0, the streams' binned KLD within 2 x the yardstick's."""
    rc, printed, checks = _parity(served, "correct", capsys)
    kld = _judged_by_the_yardstick(checks)
    print(f"correct: {kld['measured']:.3g} (yardstick {kld['yardstick']:.3g}), exit {rc}")
    assert rc == 0 and kld["pass"], printed


def test_swapped_rows_fail_the_streams_yardstick(served, capsys):
    """Two rows of blk.2.ffn_gate swapped: exit 1 on the streams' binned KLD, named in the verdict line (before: no
    gated figure, exit 0)."""
    rc, printed, checks = _parity(served, "swap", capsys)
    kld = _judged_by_the_yardstick(checks)
    print(f"swap: {kld['measured']:.3g} (yardstick {kld['yardstick']:.3g}), exit {rc}")
    assert rc == 1 and not kld["pass"], printed
    verdict = next(line for line in printed.splitlines() if line.startswith("FAIL"))
    assert GATE in verdict, verdict


def test_the_streams_yardstick_is_not_a_pass_without_positions():
    """Streams with no position to compare (each ended at once, no prompt log-probs): the figure is reported as not
    measured (never a pass, not a failure of a correct server that stops at end-of-sequence); with positions it is
    the gated mean, with the yardstick as its effect."""
    from gemma4_harness.harness.core.gates import DEFAULT_GATES
    from gemma4_harness.harness.parity.checks.quantized import NO_STREAM_ROWS, quantized_gates
    from gemma4_harness.harness.parity.result import CaseResult, fig

    def judged(positions: int) -> dict:
        kld = {"mean_kld": 0.002 if positions else float("nan"), "yardstick": 0.001, "positions": positions,
               "per_prompt": {}}
        figures = [fig("reference~openai.max_abs_logprob", 0.1, None, stream_kld=kld)]
        quantized_gates(None, figures, "reference~openai", "openai", ["Q8_0"], "no vec_dot_types", [])
        case = CaseResult("c", "user", "m")
        case.apply(figures, DEFAULT_GATES)
        return {c["gate"]: c for c in case.checks}["reference~openai_q8x.mean_kld"]

    empty, some = judged(0), judged(12)
    assert empty.get("informational") and not empty["pass"] and NO_STREAM_ROWS in empty["reason"], empty
    assert not some.get("informational") and some["pass"] and some["limit"] == pytest.approx(0.002), some
