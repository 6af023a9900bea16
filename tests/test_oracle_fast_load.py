"""``g4h parity --model F --oracle fast`` loads the model once, for the fast oracle and for what is asked of the
reference (its config, its weights' stored types, an explanation's trials): the float64 reference engine is not
loaded from the file a second time (``ReferenceEngine(path)``) nor planned (issue 38). Before, its plan (a layer's
float64 weights and an LM-head block) could refuse a job it runs no pass of: here a machine with room for every call
of the fast oracle's job but not for the reference's plan runs the job.

The model is tests/test_memory.py's wide-vocabulary one-layer Q8_0 file (its float64 LM-head block is the
reference's largest need), against tests/cmd_stub.py (the reference behind the engine protocol, in its own process).
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from gemma4_harness.harness.core import memory
from gemma4_harness.harness.core.paths import REPO_ROOT
from gemma4_harness.harness.engines import make_engine
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.checks.pair import GREEDY_NEW_TOKENS
from gemma4_harness.harness.synth.scale import write_scale_gguf

#: tests/test_memory.py's WIDE_VOCAB: a vocabulary of 2^18 on a 64-wide model.
WIDE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "head_dim": 32,
        "num_key_value_heads": 1, "vocab_size": 1 << 18}
PROMPT = [2, 9, 40, 7]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    path = write_scale_gguf("e2b", d / "wide.gguf", layers=1, fmt="q8_0", overrides=WIDE)
    prompts = d / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_ids": PROMPT}) + "\n")
    return path, prompts


def _job(path, prompts, out):
    stub = shlex.join([sys.executable, str(REPO_ROOT / "tests" / "cmd_stub.py")])
    return run_parity(models=[str(path)], against=[f"cmd:{stub}"], out=str(out), prompts=prompts, quiet=True,
                      oracle="fast", explain_budget=0)


def test_oracle_fast_neither_loads_nor_plans_the_float64_reference(wide, tmp_path, monkeypatch):
    path, prompts = wide
    calls: list[str] = []
    init, plan = ReferenceEngine.__init__, ReferenceEngine._plan

    def counted_init(self, *a, **k):
        calls.append("ReferenceEngine(path)")
        init(self, *a, **k)

    def counted_plan(self, *a, **k):
        calls.append("ReferenceEngine._plan")
        plan(self, *a, **k)

    monkeypatch.setattr(ReferenceEngine, "__init__", counted_init)
    monkeypatch.setattr(ReferenceEngine, "_plan", counted_plan)
    data, status = _job(path, prompts, tmp_path / "out")
    case = data["cases"][0]
    assert case.get("error") is None and status == 0, (case.get("error"), data["verdict"])
    assert case["info"]["oracle"]["name"] == "fast"
    assert calls == [], calls  # this process's: the stub engine runs its own reference in its own process


def test_oracle_fast_runs_where_only_the_reference_plan_would_not_fit(wide, tmp_path, monkeypatch):
    path, prompts = wide
    ref = make_engine("reference", path).memory_plan
    eng = make_engine("fast", path, device="cpu", dtype="float32")
    load = eng.memory_plan
    eng.plan_ahead(len(PROMPT) + GREEDY_NEW_TOKENS)
    call = eng.memory_plan
    eng.close()
    fast_need = max(p.need_bytes - p.already_bytes for p in (load, call))
    ref_need = ref.need_bytes - ref.already_bytes
    assert fast_need < ref_need, (fast_need, ref_need)  # the float64 LM-head block: what does not fit
    room = (fast_need + ref_need) // 2
    monkeypatch.setattr(memory, "available_memory", lambda *a, **k: (room, "MemAvailable"))  # this process only
    data, status = _job(path, prompts, tmp_path / "out")
    case = data["cases"][0]
    assert case.get("error") is None, case["error"]  # before: "not enough memory for the reference engine ..."
    assert status == 0, data["verdict"]
