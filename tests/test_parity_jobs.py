"""``g4h parity --jobs N``: cases in worker processes give the same results, in the same order, as one at a time.

Three tiny user models (tests/conftest.py's tiny GGUF with three weight seeds), each against the fast engine and
the reference itself; a model that cannot be read stays its own one-line error in its place.
"""

from __future__ import annotations

import json

from gemma4_harness.harness.parity import run as run_parity


def _figures(data: dict) -> list:
    return [(c["case"], c.get("error"), [(k["gate"], k.get("prompt"), k["measured"]) for k in c["checks"]])
            for c in data["cases"]]


def test_jobs_give_the_same_results_in_the_same_order(make_tiny_gguf, tmp_path):
    models = [str(make_tiny_gguf(f"m{seed}.gguf", seed=seed)) for seed in (0, 1, 2)]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    models.insert(1, str(broken))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_ids": [2, 7, 9, 4, 30, 11]}) + "\n")
    kw = dict(models=models, against=["fast", "reference"], prompts=prompts, quiet=True)
    one, s1 = run_parity(out=str(tmp_path / "one"), **kw)
    two, s2 = run_parity(out=str(tmp_path / "two"), jobs=2, **kw)
    assert s1 == s2 == 2  # the unreadable model is bad input (exit 2); the others still ran
    assert [c["case"] for c in two["cases"]] == ["m0.gguf", "broken.gguf", "m1.gguf", "m2.gguf"]
    assert _figures(one) == _figures(two)
    assert two["cases"][1]["error"] and all(c["checks"] for i, c in enumerate(two["cases"]) if i != 1)
    assert one["verdict"] == two["verdict"]


def test_longest_first_starts_the_longest_and_the_unknown_first():
    from gemma4_harness.harness.parity.job import longest_first

    plan = [(None, name, "synthetic", name) for name in ("a", "b", "new", "c")]
    assert longest_first(plan, {"a": 5.0, "b": 40.0, "c": 12.5}) == [2, 1, 3, 0]
    assert longest_first(plan, {}) == [0, 1, 2, 3]  # no history: plan order


def test_default_jobs_for_the_library_and_for_user_models():
    import os

    from gemma4_harness.harness.parity.job import default_jobs

    cpus = len(os.sched_getaffinity(0))
    assert 1 <= default_jobs(11, builtin=True) <= min(cpus, 11)  # never more workers than CPUs or cases
    assert default_jobs(1, builtin=True) == 1
    assert default_jobs(11, builtin=False) == 1  # a user's model may be big: one at a time, on every thread


def test_an_empty_plan_runs_nothing():
    """Filters that leave no case (``--case mm-varied --skip multimodal --no-real``) give no results, not a pool of
    zero workers."""
    from gemma4_harness.harness.parity.job import run_cases

    assert run_cases([], {}, 1, threads=1) == [] and run_cases([], {}, 2) == []
