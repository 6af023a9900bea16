"""``g4h explain`` on a fault only in decoding (issue 35, item 2): the CLI runs the parity job's explanation
(:func:`harness.parity.explain.explain_text`, one path), greedy streams included, so it says "in decoding" with the
request, the step and what differs, and exits 1, for

* a ``cmd:`` engine with exact logits (or none: ``--ops generate``) whose greedy decoding bans a token
  (tests/cmd_stub.py ``--ban``) or applies a repetition penalty, reporting the log-probs after those rules or before
  them (``--raw-logprobs``: not greedy by its own numbers, judged by the pair as a server's stream is, not failed in
  the protocol first; ``g4h parity`` says the same);
* a server without logits (tests/refserver.py, llama-server's dialect) whose greedy decoding applies a repetition
  penalty, bans a token, or does either after taking its log-probs (``raw_logprobs``: its token is then not the top-1
  of its own log-probs, said as the parity job says it, with the same explanation);
* a ban of a token that is never the greedy one: the streams never part, only the normaliser of the log-probs moves
  (:func:`harness.parity.explain_decoding.decoding_by_shift`: the one token whose probability, taken out, moves it so at every
  step).

And never "in decoding" where it is not: a correct engine of each kind passes (exit 0, nothing to explain), and a
weight perturbation or log-probs off by a constant (faults in the numbers, not in decoding) are searched and explained
by no variant. Three shapes: tests/variant_lab.py's ``lab-dense`` (5 layers, vocabulary 512) and ``lab-moe`` (2
layers, MoE, tied head), and the tiny model of tests/conftest.py (2 layers, vocabulary 32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_gguf
from refserver import ReferenceServer
from variant_lab import build

from gemma4_harness.harness.cli import main as g4h_main
from gemma4_harness.harness.core.cases import PROMPTS
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity.explain_decoding import decoding_by_shift
from gemma4_harness.harness.parity.job import run as run_parity

STUB = Path(__file__).resolve().parent / "cmd_stub.py"
LAB_PROMPTS = ("len1-bos", "len5", "len16-window")
TINY_PROMPTS = [{"id": "t3", "prompt_ids": [2, 7, 9]}, {"id": "t5", "prompt_ids": [2, 11, 4, 30, 5]},
                {"id": "t9", "prompt_ids": [2, 3, 17, 8, 21, 6, 12, 29, 10]}]
NEW_TOKENS = 8  # what observe() asks (harness.parity.checks.pair.GREEDY_NEW_TOKENS)
EXACT = ("--declare", "approximations=none", "--declare", "kv_cache=f32")  # the reference server computes exactly


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path, list[dict]]]:
    """shape -> (GGUF, prompts file, prompts)."""
    d = tmp_path_factory.mktemp("shapes")
    lab = build(d / "lab")
    lab_rows = [{"id": p["id"], "prompt_ids": p["prompt_ids"]} for p in load_prompts(PROMPTS)
                if p["id"] in LAB_PROMPTS]
    out = {}
    for name, path, rows in (("lab-dense", lab["lab-dense"], lab_rows), ("lab-moe", lab["lab-moe"], lab_rows),
                             ("tiny", write_tiny_gguf(d / "tiny.gguf"), TINY_PROMPTS)):
        f = d / f"{name}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = (path, f, rows)
    return out


def _explain(capsys, tmp_path, model: Path, prompts: Path, engine: str, *extra: str) -> tuple[int, str, dict]:
    """``g4h explain`` in this process: exit code, stdout, its --json."""
    out = tmp_path / "e.json"
    capsys.readouterr()
    rc = g4h_main(["explain", "--model", str(model), "--engine", engine, "--prompts", str(prompts),
                   "--explain-budget", "10", "--json", str(out), *extra])
    printed = capsys.readouterr().out
    return rc, printed, json.loads(out.read_text())


def _stub(*args: str) -> str:
    return f"cmd:'{sys.executable} {STUB} " + " ".join(args) + "'"


def _first_new(model: Path, rows: list[dict]) -> tuple[str, int, int]:
    """``(request, step, token)``: on the shortest prompt that has one, the first step after the first whose
    reference greedy token is not in its context and in no shorter prompt's stream (banning it parts the streams
    there first, and no repetition rule would touch it)."""
    ref, before = ReferenceEngine(model), set()
    for p in sorted(rows, key=lambda r: len(r["prompt_ids"])):
        (g,) = ref.generate_full([p["prompt_ids"]], NEW_TOKENS)
        ctx = list(p["prompt_ids"])
        found = next(((k, int(t)) for k, t in enumerate(g.tokens)
                      if k and t not in ctx + g.tokens[:k] and t not in before), None)
        if found is not None:
            return str(p["id"]), *found
        before |= set(int(t) for t in g.tokens)
    raise AssertionError("no prompt's greedy stream gives a token new to its context")


def _never_greedy(model: Path, rows: list[dict], top_n: int = 6) -> int:
    """The token most probable at some step of the reference's greedy streams (a ban of it moves the normaliser
    there) that is never the greedy token nor among the top ``top_n`` at any step of any stream: banning it parts
    no stream and lowers nothing in sight."""
    ref = ReferenceEngine(model)
    best = np.zeros(ref.cfg.vocab_size)
    shown: set[int] = set()
    for r in rows:
        ids = list(r["prompt_ids"])
        (g,) = ref.generate_full([ids], NEW_TOKENS)
        z = np.asarray(ref.logits(ids + list(g.tokens[:-1])), dtype=np.float64)[len(ids) - 1:]
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        best = np.maximum(best, p.max(axis=0))
        shown |= {int(t) for row in np.argsort(-p, axis=1)[:, :top_n] for t in row}
    best[sorted(shown)] = 0
    return int(np.argmax(best))


def _said_in_decoding(rc: int, printed: str, e: dict) -> dict:
    assert rc == 1, printed
    assert e["status"] == "decoding", e["line"]
    d = e["decoding"]
    assert printed.strip().splitlines()[-1] == f"in decoding, not in the logits: {d['line']}", printed
    assert d["line"].startswith(f"request {d['request']} step {d['step']}: ")
    assert e["singles_tried"] == 0 and e["pairs_tried"] == 0 and not e["explained_by"]  # nothing searched
    assert d["kind"] == "decoding"
    return d


# --------------------------------------------------------------------------- cmd: engines


@pytest.mark.parametrize("shape", ["lab-dense", "tiny"])
@pytest.mark.parametrize("ops", [(), ("--ops", "generate")], ids=["logits", "streams-only"])
def test_a_cmd_engine_that_bans_a_token_is_said_to_be_in_decoding(models, capsys, tmp_path, shape, ops):
    """Exact logits (or none), the token the reference's greedy stream gives at some step banned in decoding: "in
    decoding" at that request and step, "a token banned", naming it (before: "nothing to explain", exit 0, where
    the logits are given)."""
    model, prompts, rows = models[shape]
    request, step, banned = _first_new(model, rows)
    rc, printed, e = _explain(capsys, tmp_path, model, prompts, _stub(*ops, "--ban", str(banned)))
    d = _said_in_decoding(rc, printed, e)
    assert (d["request"], d["step"], d["oracle"]) == (request, step, banned), d["line"]
    assert d["what"].startswith(f"a token banned: token {banned} is not among its top-"), d["what"]
    if ops:  # no logits: its own log-probs are the evidence
        assert d["evidence"] == "log-probs"
    else:  # its logits along its own stream agree with the reference's
        assert d["max_abs_logit"] <= DEFAULT_GATES["reference~cmd.max_abs_logit"].limit


@pytest.mark.parametrize("shape", ["lab-moe", "tiny"])
def test_a_cmd_engine_with_a_repetition_penalty_is_said_to_be_in_decoding(models, capsys, tmp_path, shape):
    model, prompts, _ = models[shape]
    rc, printed, e = _explain(capsys, tmp_path, model, prompts, _stub("--repeat-penalty", "1.5"))
    d = _said_in_decoding(rc, printed, e)
    assert "a repeated token's logit lowered" in d["what"] and "repetition penalty" in d["what"], d["what"]
    assert d["ours"] != d["oracle"]


@pytest.mark.parametrize("shape", ["lab-dense", "tiny"])
@pytest.mark.parametrize("ops", [(), ("--ops", "generate")], ids=["logits", "streams-only"])
def test_a_cmd_engine_reporting_log_probs_before_its_decoding_rules_is_said_to_be_in_decoding(
        models, capsys, tmp_path, shape, ops):
    """A ban (with logits) or a repetition penalty (streams only) applied after the log-probs were taken (``--raw-
    logprobs``): its token is not the top-1 of its own log-probs. The engine no longer fails the protocol before
    anything is explained (``check_greedy``): not greedy, said, and in decoding, what differs said (before: "engine
    failed: ... (not greedy)" and no explanation)."""
    model, prompts, _ = models[shape]
    request, step, banned = _first_new(model, models[shape][2])
    rule = ("--repeat-penalty", "1.5") if ops else ("--ban", str(banned))
    rc, printed, e = _explain(capsys, tmp_path, model, prompts, _stub(*ops, *rule, "--raw-logprobs"))
    d = _said_in_decoding(rc, printed, e)
    assert "they were taken before its decoding rules" in d["what"], d["what"]
    assert e["not_greedy"].startswith(f"request {d['request']} step {d['step']}: token {d['ours']} is not the top-1 "
                                      f"of its own log-probs ({d['oracle']} at "), e["not_greedy"]
    if not ops:
        assert (d["request"], d["step"], d["oracle"]) == (request, step, banned)
        assert d["what"].startswith(f"token {banned} passed over after its log-probs were taken"), d["what"]


def test_g4h_parity_says_the_same_of_that_cmd_engine(models, tmp_path):
    """``g4h parity`` on the same engine (repetition penalty after its log-probs): an engine failure (exit 1) at the
    request and step, whose line ends with what differs in decoding, the pair's explanation saying the same (as
    for a server: tests/test_explain_claims.py)."""
    model, prompts, _ = models["tiny"]
    data, status = run_parity(models=[str(model)], against=[_stub("--repeat-penalty", "1.5", "--raw-logprobs")],
                              quiet=True, out=str(tmp_path), prompts=prompts)
    assert status == 1, data["verdict"]
    (runs,) = [c for c in data["cases"][0]["checks"] if c.get("engine_failure")]
    e = runs["explanation"]
    d = e["decoding"]
    assert runs["gate"] == "reference~cmd.runs" and e["status"] == "decoding"
    assert (runs["request"], runs["step"]) == (d["request"], d["step"])
    assert runs["got"].endswith(f"not greedy decoding (temperature 0), which was asked; in decoding, not in the "
                                f"logits: {d['what']}"), runs["got"]
    assert "a repeated token's logit lowered after its log-probs were taken" in d["what"], d["what"]


@pytest.mark.parametrize("shape", ["lab-dense", "lab-moe", "tiny"])
def test_a_correct_cmd_engine_is_not_said_to_be_in_decoding(models, capsys, tmp_path, shape):
    model, prompts, rows = models[shape]
    for ops in ((), ("--ops", "generate")):
        rc, printed, e = _explain(capsys, tmp_path, model, prompts, _stub(*ops))
        assert rc == 0 and e["status"] == "nothing_to_explain", printed
        assert f"0 of {len(rows)} prompts diverge" in printed


@pytest.mark.parametrize("ops", [(), ("--ops", "generate")], ids=["logits", "streams-only"])
def test_a_weight_perturbation_is_not_said_to_be_in_decoding(models, capsys, tmp_path, ops):
    """Half the rows of one ffn_down x1.02 (the logits are wrong, and so is every log-prob of its streams): searched,
    explained by no variant, never "in decoding"."""
    model, prompts, _ = models["tiny"]
    rc, printed, e = _explain(capsys, tmp_path, model, prompts, _stub(*ops, "--scale-rows", "1"))
    assert rc == 1 and e["status"] == "unexplained", printed
    assert "decoding" not in e and "in decoding" not in printed


# --------------------------------------------------------------------------- servers (no logits)


@pytest.mark.parametrize("shape", ["lab-moe", "tiny"])
@pytest.mark.parametrize("fault", ["repeat-penalty", "ban", "raw-repeat-penalty", "raw-ban"])
def test_a_server_with_a_fault_in_decoding_is_said_so(models, capsys, tmp_path, shape, fault):
    """A server whose logits are exact and whose greedy decoding applies a repetition penalty of 1.5 or bans the
    token the reference gives at some step, reporting the log-probs after those rules or, ``raw-``, before them
    (llama-server's ``n_probs``): "in decoding" with the request and the step; ``raw-``: its token is not the top-1
    of its own log-probs, also said (an engine failure, exit 1: before, the CLI stopped there with no explanation)."""
    model, prompts, rows = models[shape]
    request, step, banned = _first_new(model, rows)
    raw = fault.startswith("raw-")
    options = {"repeat_penalty": 1.5} if fault.endswith("repeat-penalty") else {"ban": [banned]}
    with ReferenceServer(model, raw_logprobs=raw, **options) as srv:
        rc, printed, e = _explain(capsys, tmp_path, model, prompts, f"openai:{srv.url}/v1", *EXACT)
    d = _said_in_decoding(rc, printed, e)
    assert d["evidence"] == "log-probs" and d["ours"] != d["oracle"], d["line"]
    assert d["spread"] <= DEFAULT_GATES["reference~openai.max_abs_logprob"].limit
    if fault.endswith("ban"):
        assert (d["request"], d["step"], d["oracle"]) == (request, step, banned), d["line"]
    else:
        assert "a repeated token's logit lowered" in d["what"], d["what"]
    if raw:
        assert "taken before its decoding rules" in d["what"], d["what"]
        assert e["not_greedy"].endswith("not greedy decoding (temperature 0), which was asked"), e["not_greedy"]
        assert f"  engine failed: {e['not_greedy']}" in printed
    else:
        assert "not_greedy" not in e


@pytest.mark.parametrize("shape", ["lab-dense", "tiny"])
def test_a_ban_that_never_parts_the_streams_is_said_to_be_in_decoding(models, capsys, tmp_path, shape):
    """A server that bans a token that is never the greedy one, nor among the top-N, and reports the log-probs
    after the ban: its tokens are the reference's, its log-probs are shifted at every step by the probability the
    ban took out (before: "no known variant explains it"). Said in decoding, naming the banned token."""
    model, prompts, _ = models[shape]
    banned = _never_greedy(model, models[shape][2])
    with ReferenceServer(model, ban=[banned]) as srv:
        rc, printed, e = _explain(capsys, tmp_path, model, prompts, f"openai:{srv.url}/v1", *EXACT)
    d = _said_in_decoding(rc, printed, e)
    assert d["ours"] == d["oracle"] and d["evidence"] == "log-probs"
    assert d["what"].startswith(f"a token banned: token {banned}'s probability is taken out at every step"), d["what"]
    assert "its tokens are the reference's, its log-probs are not" in d["line"]


@pytest.mark.parametrize("shape", ["lab-moe", "tiny"])
def test_a_correct_server_and_one_whose_numbers_are_off_are_not_said_to_be_in_decoding(models, capsys, tmp_path,
                                                                                         shape):
    """The exact server passes (exit 0); one whose log-probs are all off by 0.01 (its numbers, not its decoding:
    no token's probability taken out gives that shift at every step) fails, never "in decoding"."""
    model, prompts, _ = models[shape]
    with ReferenceServer(model) as srv:
        rc, printed, e = _explain(capsys, tmp_path, model, prompts, f"openai:{srv.url}/v1", *EXACT)
    assert rc == 0 and e["status"] == "nothing_to_explain", printed
    with ReferenceServer(model, perturb=0.01) as srv:
        rc, printed, e = _explain(capsys, tmp_path, model, prompts, f"openai:{srv.url}/v1", *EXACT)
    assert rc == 1 and e["status"] == "unexplained", printed
    assert "decoding" not in e and "in decoding" not in printed


# --------------------------------------------------------------------------- decoding_by_shift on its own


def _log_softmax(z: np.ndarray) -> np.ndarray:
    return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("vocab, steps, top_n", [(40, 5, 5), (300, 9, 3), (1000, 4, 8)])
def test_decoding_by_shift_names_the_banned_token_and_nothing_else(vocab, steps, top_n):
    """Synthetic logits ``[steps, vocab]``: a stream whose log-probs are those of the logits with one token at -inf
    (never greedy, never listed) names that token; log-probs off by a constant, noisy log-probs (a fault in the
    numbers), and a token raised are not decoding."""
    rng = np.random.default_rng(vocab)
    z = rng.normal(0, 2, (steps, vocab))
    lz = _log_softmax(z)
    order = np.argsort(-lz, axis=1)
    best = np.exp(lz).max(axis=0)
    best[np.unique(order[:, :top_n])] = 0
    ban = int(np.argmax(best))  # the most probable token at some step among those no step lists
    tokens = [int(order[k, 0]) for k in range(steps)]
    ids = [vocab - 1]

    def stream(logits: np.ndarray) -> dict:
        lp = _log_softmax(logits)
        return {"tokens": tokens, "logprobs": [{int(t): float(lp[k, t]) for t in np.argsort(-lp[k])[:top_n]}
                                               for k in range(steps)]}

    zb = z.copy()
    zb[:, ban] = -np.inf
    limit = 1e-3
    assert np.max(np.abs(_log_softmax(zb)[:, tokens] - lz[:, tokens])) > limit  # the ban is seen: it fails the gate
    d = decoding_by_shift("r", ids, stream(zb), z, limit)
    assert d is not None and d["what"].startswith(f"a token banned: token {ban}'s"), d
    assert decoding_by_shift("r", ids, stream(z + 0.0), z, limit) is None  # agrees: nothing to say
    off = stream(z)
    off["logprobs"] = [{t: v + 0.01 for t, v in s.items()} for s in off["logprobs"]]
    assert decoding_by_shift("r", ids, off, z, limit) is None  # no token's probability gives +0.01 at every step
    assert decoding_by_shift("r", ids, stream(z + rng.normal(0, 0.05, z.shape)), z, limit) is None
    up = z.copy()
    up[:, ban] += 3.0  # a token raised: the others lose mass (a negative shift), nothing was taken out
    assert decoding_by_shift("r", ids, stream(up), z, limit) is None
