"""An explanation is a claim, held to one (issue 35, harness/parity/explain.py): the fault-and-explanation table.

Each row is a deliberately wrong ``cmd:`` engine (tests/cmd_stub.py) on tests/variant_lab.py's ``lab-dense`` judged
by ``g4h parity``; the pair fails, and its explanation must say what the engine is:

* every text spec variant, as an engine judged by its greedy streams alone (``--ops generate``: what a server gives):
  explained by exactly itself (the logits form of the same table is tests/test_explain.py's);
* a weight perturbation (half the rows of one ``ffn_down`` x1.02: no variant changes a matrix's shape) and a wrong
  model (``--serve-model lab-moe``): explained by no variant, with logits and with streams alone; no trial that
  measured nothing comparable (streams that part at step 0) counts;
* a decoding-only fault (exact logits, a repetition penalty in greedy decoding): said to be in decoding, with the
  request, the step and the repeated token, not "nothing to explain"; exact logits and noise on every logit of its
  generation (a broken KV cache would do that): said to be in its generation path, no decoding rule named;
* the same, where the engine gives no logits (``--ops generate``; a server of llama-server's dialect,
  tests/refserver.py, with a repetition penalty or a banned token): judged by its own top-N log-probs along its
  stream, said to be in decoding, with the request, the step and the rule; the same servers reporting the log-probs
  of the logits before those rules (llama-server's and vLLM's default): not greedy as asked, an engine failure whose
  line says the same finding as its explanation;
* ``--oracle fast``: the variant with a fast form is explained with fast, the one without with the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from refserver import ReferenceServer
from variant_lab import build

from gemma4_harness.harness.core.cases import PROMPTS
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.engines.variants import VARIANTS, family
from gemma4_harness.harness.parity.checks.server import ServerOptions
from gemma4_harness.harness.parity.job import run as run_parity

STUB = Path(__file__).resolve().parent / "cmd_stub.py"
PROMPT_IDS = ("len1-bos", "len5", "len16-window", "len17-window+1")
NEW_TOKENS = 8
MOE_ONLY = ("router_expert_input", "router_dense_input", "softcap_default_30", "experts_swiglu")
DENSE = [v.name for v in family("text") if v.name not in MOE_ONLY]


def _cmd(*args: str) -> str:
    return f"cmd:'{sys.executable} {STUB} " + " ".join(args) + "'"


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("lab"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [p for p in load_prompts(PROMPTS) if p["id"] in PROMPT_IDS]
    path.write_text("".join(json.dumps({"id": p["id"], "prompt_ids": p["prompt_ids"]}) + "\n" for p in rows))
    return path


def _parity(lab, prompts_file, out, engines, oracle="reference") -> dict[int, dict]:
    """engine number -> the explanation of its pair (None when it has none) after one ``g4h parity`` run."""
    data, status = run_parity(models=[str(lab["lab-dense"])], against=[_cmd(*e) for e in engines], quiet=True,
                              out=str(out), prompts=prompts_file, oracle=oracle,
                              server=ServerOptions(max_new_tokens=NEW_TOKENS))
    assert status == 1
    found: dict[int, dict] = {}
    for c in data["cases"][0]["checks"]:
        pair = c["gate"].rsplit(".", 1)[0]
        number = int(pair.split("#", 1)[1]) if "#" in pair else 1
        if "explanation" in c:
            assert number not in found, "one explanation per failing pair"
            found[number] = c["explanation"]
    return found


@pytest.fixture(scope="module")
def faults(lab, prompts_file, tmp_path_factory) -> tuple[list[tuple[str, ...]], dict[int, dict]]:
    moe = str(lab["lab-moe"])
    engines = [("--scale-rows", "2"), ("--serve-model", moe), ("--repeat-penalty", "1.5"),
               ("--ops", "generate", "--scale-rows", "2"), ("--ops", "generate", "--serve-model", moe),
               ("--generate-noise", "0.5"), ("--ops", "generate", "--repeat-penalty", "1.5")]
    return engines, _parity(lab, prompts_file, tmp_path_factory.mktemp("faults"), engines)


@pytest.fixture(scope="module")
def stream_variants(lab, prompts_file, tmp_path_factory) -> dict[int, dict]:
    engines = [("--ops", "generate", "--spec", v) for v in DENSE]
    return _parity(lab, prompts_file, tmp_path_factory.mktemp("streams"), engines)


@pytest.mark.parametrize("number, variant", list(enumerate(DENSE, 1)))
def test_each_variant_judged_by_its_streams_is_explained_by_exactly_itself(stream_variants, number, variant):
    e = stream_variants.get(number)
    assert e is not None, f"{variant}: the pair passed or was not explained"
    assert e["status"] == "explained", (variant, e["line"])
    assert [t["variants"] for t in e["explained_by"]] == [[variant]], (variant, e["line"])
    assert e["line"].startswith(f"explained by {variant}: ")
    best = e["explained_by"][0]
    assert best["figures"]["max_abs_logprob"] <= DEFAULT_GATES["reference~cmd.max_abs_logprob"].limit
    assert "unmeasured" not in best
    # the baseline's figure is quoted only where it was measured: never "0 -> 0" for a figure with no number
    base = e["baseline"]["figures"].get("max_abs_logprob")
    assert (f"max |Δlogprob| {base:.3g} -> " if base is not None else "max |Δlogprob| not measured (greedy request ") \
        in e["line"], e["line"]


@pytest.mark.parametrize("number, what", [(1, "row scale, logits"), (2, "wrong model, logits"),
                                          (4, "row scale, streams"), (5, "wrong model, streams")])
def test_perturbed_weights_and_a_wrong_model_are_explained_by_no_variant(faults, number, what):
    e = faults[1].get(number)
    assert e is not None, what
    assert e["status"] == "unexplained", (what, e["line"])
    assert e["line"].startswith("no known variant explains it"), e["line"]
    assert e["singles_tried"] >= len(DENSE) - 4 and e["pairs_tried"] >= 1  # it did search
    for t in e["candidates"]:
        assert not t["passed"]
        if t.get("unmeasured"):  # a trial with a figure it could not compute is failed, never a 0
            assert "(figures not measured)" in t["failing"]


def test_a_trial_that_compares_nothing_does_not_explain(faults):
    """The wrong model judged by its streams: they part at step 0 under every variant; a variant whose streams also
    part at step 0, within vLLM's top-N, compares no log-prob: "(nothing comparable measured)", not a perfect 0."""
    e = faults[1][5]
    nothing = [t for t in e["candidates"] if "(nothing comparable measured)" in t["failing"]]
    assert nothing, [t["failing"] for t in e["candidates"]]
    assert all(not t["passed"] and "max_abs_logprob" not in t["figures"] for t in nothing)


def test_a_fault_in_decoding_is_said_to_be_in_decoding(faults):
    """Exact logits, a repetition penalty in greedy decoding: the greedy figures fail, the logits agree along its
    own stream; the explanation names the request, the step, both tokens and the repeated token, not "nothing to
    explain" and no variant."""
    e = faults[1][3]
    assert e["status"] == "decoding", e["line"]
    d = e["decoding"]
    assert e["line"].startswith(f"in decoding, not in the logits: request {d['request']} step {d['step']}: it gave "
                                f"{d['ours']}, its own logits and the reference's give {d['oracle']}")
    assert d["ours"] != d["oracle"] and d["max_abs_logit"] <= DEFAULT_GATES["reference~cmd.max_abs_logit"].limit
    assert d["kind"] == "decoding", d["what"]
    assert "a repeated token's logit lowered" in d["what"] and "repetition penalty" in d["what"], d["what"]
    assert f"token {d['oracle']} occurs in the context" in d["what"]
    assert not e["explained_by"] and e["singles_tried"] == 0


def test_the_fast_oracle_explains_with_fast_where_the_variant_has_a_fast_form(lab, prompts_file, tmp_path):
    """``--oracle fast``: window_inclusive changes the config (a fast model built under it), attn_scale_head_dim a
    function (the oracle's own model, patched while the trial runs), norm_plus_one has no fast form (the
    reference); a weight perturbation is explained by none."""
    assert VARIANTS["window_inclusive"].has_fast and not VARIANTS["norm_plus_one"].has_fast
    found = _parity(lab, prompts_file, tmp_path, [("--spec", "window_inclusive"), ("--spec", "norm_plus_one"),
                                                  ("--scale-rows", "2"), ("--spec", "attn_scale_head_dim")],
                    oracle="fast")
    limit = DEFAULT_GATES["fast~cmd.max_abs_logit"].limit
    for number, variant, oracle in ((1, "window_inclusive", "fast"), (2, "norm_plus_one", "reference"),
                                    (4, "attn_scale_head_dim", "fast")):
        e = found[number]
        assert [t["variants"] for t in e["explained_by"]] == [[variant]], e["line"]
        assert e["baseline"]["oracle"] == "fast" and e["explained_by"][0]["oracle"] == oracle
        assert e["explained_by"][0]["figures"]["max_abs_logit"] <= limit
    assert found[3]["status"] == "unexplained", found[3]["line"]


def test_a_generation_path_that_computes_other_logits_is_not_called_a_decoding_rule(faults):
    """Exact logits, noise on its generation's logits: the divergence is in generation (its forward agrees), and the
    log-probs it reports differ from its forward's on tokens no decoding rule touches: said so, no penalty named,
    no variant searched."""
    e = faults[1].get(6)
    assert e is not None and e["status"] == "decoding", e["line"]
    d = e["decoding"]
    assert d["kind"] == "generation" and e["line"].startswith(f"in generation, not in the logits: request "
                                                              f"{d['request']} step {d['step']}: "), e["line"]
    assert "its generation computes other logits than its forward" in d["what"], d["what"]
    assert "repetition penalty" not in d["what"] and "banned" not in d["what"]


def _said_in_decoding(e: dict, oracle: str = "reference") -> dict:
    assert e is not None and e["status"] == "decoding", e and e["line"]
    d = e["decoding"]
    assert e["line"].startswith(f"in decoding, not in the logits: request {d['request']} step {d['step']}: it gave "
                                f"{d['ours']}, the {oracle}'s greedy token there is {d['oracle']} (no logits were given")
    assert d["kind"] == "decoding" and d["evidence"] == "log-probs" and d["ours"] != d["oracle"]
    assert d["spread"] <= DEFAULT_GATES["reference~cmd.max_abs_logprob"].limit
    assert not e["explained_by"] and e["singles_tried"] == 0
    return d


def test_a_fault_in_decoding_is_seen_from_log_probs_alone(faults):
    """No logits (``--ops generate``), a repetition penalty in greedy decoding, the log-probs of the penalised
    logits reported: its log-probs agree with the reference's on the tokens no rule touches, up to the normaliser;
    said to be in decoding, naming the repeated token (before: "no known variant explains it")."""
    d = _said_in_decoding(faults[1][7])
    assert "a repeated token's logit lowered" in d["what"] and f"token {d['oracle']} occurs in the context" in d["what"]


def _decoding_fault_run(model: Path, prompts_file: Path, out: Path, fault: str,
                        **server: object) -> tuple[dict, dict, int, int]:
    """``g4h parity`` of ``model`` against a server of llama-server's dialect (tests/refserver.py, exact logits,
    ``server`` its other options) whose greedy decoding applies ``fault``: a repetition penalty of 1.5, or a ban on
    the token the reference's greedy stream of the shortest prompt gives first at a step where it is not in the
    context. The run must fail (status 1).

    Returns:
        ``(results, the shortest prompt, that step, that token)``.
    """
    shortest = min(load_prompts(prompts_file), key=lambda p: len(p["prompt_ids"]))
    (g,) = ReferenceEngine(model).generate_full([shortest["prompt_ids"]], NEW_TOKENS)
    step, banned = next((k, t) for k, t in enumerate(g.tokens)
                        if k and t not in shortest["prompt_ids"] + g.tokens[:k])
    options = {"repeat_penalty": 1.5} if fault == "repeat-penalty" else {"ban": [banned]}
    with ReferenceServer(model, **server, **options) as srv:
        data, status = run_parity(models=[str(model)], against=[f"openai:{srv.url}/v1"], quiet=True,
                                  out=str(out), prompts=prompts_file,
                                  server=ServerOptions(skip=("server-batch", "server-stream", "server-stop",
                                                             "server-template"), max_new_tokens=NEW_TOKENS),
                                  engine_options={"declare": ["approximations=none", "kv_cache=f32"]})
    assert status == 1, data["verdict"]
    return data, shortest, step, banned


@pytest.mark.parametrize("fault", ["repeat-penalty", "ban"])
def test_a_server_with_a_fault_in_decoding_is_said_so(lab, prompts_file, tmp_path, fault):
    """A server of llama-server's dialect whose logits are exact (the float64 reference, declared exact) and whose
    greedy decoding applies a repetition penalty of 1.5, or bans the token the reference's greedy stream of the
    shortest prompt gives first at a step where it is not in the context: the pair fails, and the explanation says
    in decoding, the request and the step, and what the rule did."""
    data, shortest, step, banned = _decoding_fault_run(lab["lab-dense"], prompts_file, tmp_path, fault)
    (e,) = [c["explanation"] for c in data["cases"][0]["checks"] if "explanation" in c]
    d = _said_in_decoding(e)
    if fault == "ban":
        assert (d["request"], d["step"], d["oracle"]) == (shortest["id"], step, banned), e["line"]
        assert d["what"].startswith(f"a token banned: token {banned} is not among its top-"), d["what"]
    else:
        assert "a repeated token's logit lowered" in d["what"] and "repetition penalty" in d["what"], d["what"]


@pytest.mark.parametrize("fault", ["repeat-penalty", "ban"])
def test_a_server_reporting_log_probs_before_its_decoding_rules_is_not_greedy_and_says_what_differs(
        lab, prompts_file, tmp_path, fault):
    """The servers above reporting the log-probs of the logits before the penalty and the ban (llama-server's
    ``n_probs``, vLLM's default ``raw_logprobs``): the token each gives is not the top-1 of its own log-probs, so it
    did not decode greedily as asked: an engine failure (exit 1), whose line says what differs in decoding, the same
    finding as the pair's explanation (before: "not greedy decoding" alone, and no explanation)."""
    data, shortest, step, banned = _decoding_fault_run(lab["lab-dense"], prompts_file, tmp_path, fault,
                                                       raw_logprobs=True)
    (runs,) = [c for c in data["cases"][0]["checks"] if c.get("engine_failure")]
    assert runs["gate"].endswith(".runs") and not runs["pass"]
    e = runs["explanation"]
    d = e["decoding"]
    assert (runs["request"], runs["step"]) == (d["request"], d["step"]) and e["status"] == "decoding"
    assert e["line"] == f"in decoding, not in the logits: {d['line']}"
    assert d["line"].startswith(f"request {d['request']} step {d['step']}: it gave {d['ours']}, the reference's "
                                f"greedy token there is {d['oracle']} (no logits were given"), d["line"]
    assert d["spread"] <= DEFAULT_GATES["reference~openai.max_abs_logprob"].limit and d["ours"] != d["oracle"]
    assert runs["got"].endswith(f"not greedy decoding (temperature 0), which was asked; in decoding, not in the "
                                f"logits: {d['what']}"), runs["got"]
    taken = f"token {d['oracle']} is the top-1 of its own log-probs at "
    if fault == "ban":
        assert (d["request"], d["step"], d["oracle"]) == (shortest["id"], step, banned), e["line"]
        assert d["what"].startswith(f"token {banned} passed over after its log-probs were taken: {taken}"), d["what"]
    else:
        assert d["what"].startswith(f"a repeated token's logit lowered after its log-probs were taken: {taken}")
        assert f"token {d['oracle']} occurs in the context" in d["what"], d["what"]
