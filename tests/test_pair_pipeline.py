"""One pair pipeline (issue 33, item 1): the trials of the spec-variant search (``g4h explain``, the parity job's
explanation of a failing pair: :class:`harness.parity.explain.TextSubject`) measure an engine's answers with the
pair's own metric functions (``harness/parity/compare.py``: ``prompt_logit_figures``, ``layer_figure``,
``generation_figures``, ``near_tie_margin``) at the pair's limits, and ``g4h explain`` names the pair as
``g4h parity`` does (``harness.parity.checks.pair.engine_pair``), so the two judge one engine alike.

The model is the F32 ``odd-h88-v515-gqa`` synthetic shape (tests/shapes/); the float64 reference stands in for the
engine, with one top-1 flip made by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness import synth
from gemma4_harness.harness.cli import main as g4h_main
from gemma4_harness.harness.core.gates import DEFAULT_GATES, NEAR_TIE_MARGIN
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity.checks.pair import pair_checks
from gemma4_harness.harness.parity.checks.pair_figures import _logit_figures
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
from gemma4_harness.harness.parity.explain import TextSubject
from gemma4_harness.harness.parity.explain_search import Observed, judge_figures

SHAPE = Path(__file__).resolve().parent / "shapes" / "odd-h88-v515-gqa.toml"
PROMPTS = [{"id": "g5", "prompt_ids": [2, 40, 311, 7, 199]},
           {"id": "g13", "prompt_ids": [2, 13, 500, 77, 256, 91, 8, 430, 61, 5, 388, 17, 3]}]


@pytest.fixture(scope="module")
def model() -> Path:
    return synth.ensure_built(SHAPE).gguf["F32"]


@pytest.fixture(scope="module")
def runs(model) -> ReferenceRuns:
    return ReferenceRuns(ReferenceEngine(model))


def _flipped(base: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, float]:
    """``base`` with its top-1 and top-2 swapped at the position whose top-1 margin is the smallest in (lo, hi)."""
    top = np.sort(base, axis=1)
    margin = top[:, -1] - top[:, -2]
    inside = np.nonzero((margin > lo) & (margin < hi))[0]
    assert inside.size, f"no position with a top-1 margin in ({lo}, {hi}): {margin}"
    pos = int(inside[np.argmin(margin[inside])])
    ours = base.copy()
    a, b = np.argsort(base[pos])[-2:]
    ours[pos, a], ours[pos, b] = base[pos, b], base[pos, a]
    return ours, float(margin[pos])


@pytest.mark.parametrize("pair", ["reference~fast_bf16", "reference~fast"])
def test_a_trial_judges_a_top1_flip_as_the_pair_does(runs, pair):
    """A top-1 flip at a margin above the default near-tie margin (4e-2) but within the bf16 pair's near-tie margin
    (twice its max |Δlogit| bound: harness.parity.compare.near_tie_margin): ``reference~fast_bf16`` calls it a
    near-tie and passes, ``reference~fast`` (fp32, margin 4e-2) fails it; the explanation's trial without variants
    fails exactly the gates the pair fails, with the same figures (on 6f54468 the trial judged the flip at the
    default margin whatever the pair: same_top1_decisive failed under reference~fast_bf16 where the pair passed)."""
    p = PROMPTS[1]
    base, _ = runs.logits((), p)
    limit = DEFAULT_GATES[f"{pair}.max_abs_logit"].limit
    ours, margin = _flipped(base, 2 * NEAR_TIE_MARGIN, 2 * DEFAULT_GATES["reference~fast_bf16.max_abs_logit"].limit)
    pair_figs = _logit_figures(runs, ours, base, (), pair, p, limit)
    want = judge_figures(pair_figs, DEFAULT_GATES)
    assert (want == []) == (pair == "reference~fast_bf16"), (pair, margin, want)
    trial = TextSubject(runs.ref, [Observed(p["id"], list(p["prompt_ids"]), logits=ours)], pair).measure((), full=True)
    assert trial.failing == want and trial.passed == (not want), (trial.failing, want, margin)
    assert trial.figures["max_abs_logit"] == pair_figs[0].measured


def test_g4h_explain_names_and_judges_the_pair_as_parity(runs, model, tmp_path, capsys):
    """``g4h explain --engine fast --dtype bfloat16`` judges the pair ``g4h parity`` measures for that engine
    (``reference~fast_bf16``, its 16-bit gates), and its diverging prompts are the ones the pair fails on (on
    6f54468 it named the pair ``reference~fast`` and judged a bf16 engine by the fp32 bounds)."""
    figs = pair_checks(runs, "fast", model, PROMPTS, lambda _: None, "t", options={"dtype": "bfloat16"})
    pairs = {f.gate.rsplit(".", 1)[0] for f in figs}
    parity_failing = sorted({str(f.prompt) for f in figs if f.prompt is not None and judge_figures([f], DEFAULT_GATES)})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "e.json"
    capsys.readouterr()
    rc = g4h_main(["explain", "--model", str(model), "--prompts", str(prompts), "--engine", "fast", "--dtype",
                   "bfloat16", "--explain-budget", "0", "--json", str(out)])
    said = json.loads(out.read_text())
    assert pairs == {said["pair"]} == {"reference~fast_bf16"}, (pairs, said["pair"])
    assert sorted(said["failing_prompts"]) == parity_failing, (said["failing_prompts"], parity_failing)
    assert rc == (1 if parity_failing else 0), capsys.readouterr().out


def test_explain_asks_no_stream_past_the_context():
    """The explanation's engine answers (``observe``) ask for a greedy stream only where the prompt and its new
    tokens fit the model's context, as the pair does (``_measure_figures``' ``gen_prompts``): a generate-only engine
    that refuses past its context is not asked there (before, its refusal ended the explanation as "the engine
    failed when asked again")."""
    from gemma4_harness.harness.engines.base import Generated
    from gemma4_harness.harness.parity.checks.explain_pair import observe
    from gemma4_harness.reference.errors import InputError

    class GenerateOnly:
        ops = ("generate",)
        context = 12
        asked: list[int] = []

        def generate_full(self, prompts, n, top_n=5):
            (ids,) = prompts
            self.asked.append(len(ids))
            if len(ids) + n > self.context:
                raise InputError(f"{len(ids)} + {n} tokens exceed the context of {self.context}")
            g = Generated()
            g.tokens, g.top = [1] * n, [[(1, -0.1)]] * n
            return [g]

    eng = GenerateOnly()
    prompts = [{"id": "short", "prompt_ids": [2, 5, 6]}, {"id": "long", "prompt_ids": [2] + [7] * 9}]
    seen = observe(eng, "cmd", prompts, new_tokens=4, streams=True, context=eng.context)
    assert eng.asked == [3] and [o.stream is not None for o in seen] == [True, False]
