"""Speculative decoding in the fast engine: KV rollback (ring buffers included), lossless output, acceptance, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from clitools import assert_one_line_error, run_cli

from gemma4_harness.fast.drafter import FastDrafter
from gemma4_harness.fast.engine import Engine, Request
from gemma4_harness.fast.model import FastModel, SeqStep
from gemma4_harness.fast.speculative import ModelProposer, OracleProposer, PartialProposer, RandomProposer, SpecEngine
from gemma4_harness.harness.cli import main
from gemma4_harness.harness.core.cases import MODELS_DIR
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.parity.checks.speculative import compare_streams, scenarios, speculative_checks
from gemma4_harness.harness.synth.drafter import ensure_drafter_built
from gemma4_harness.reference import drafter as R
from gemma4_harness.reference.drafter_weights import load_drafter
from gemma4_harness.reference.weights import load_model

PROMPTS = load_prompts()


@pytest.fixture(scope="module")
def small():
    """edge-no-softcap (3 layers, window 16) and its assistant: the quickest case with both layer types."""
    built = ensure_drafter_built(MODELS_DIR / "edge-no-softcap-assistant.toml")
    cfg, W = load_model(built.target.gguf["F32"])
    fm = FastModel(cfg, W, "cpu", "float32")
    d, DW = load_drafter(built.hf_dir)
    return built, fm, FastDrafter(R.bind(d, cfg), DW, fm)


# --------------------------------------------------------------------------- rollback


def _decode(fm, cache, slot, ids, start):
    with torch.inference_mode():
        return fm.step(cache, [SeqStep(slot, torch.tensor(ids), start)], all_logits=True)


@pytest.mark.parametrize("k", [4, pytest.param(1, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)])
def test_rollback_restores_the_cache_exactly(small, k):
    """Junk written and rolled back after every token leaves every later logit bit-identical to a cache that never
    saw it, over two windows (the rings of window + k slots wrap)."""
    _, fm, _ = small
    W = fm.cfg.sliding_window
    rng = np.random.default_rng(k)
    prompt, cont = [2] + rng.integers(4, 256, W + 1).tolist(), rng.integers(4, 256, W - 2).tolist()
    clean, spec = fm.new_cache(1, 200), fm.new_cache(1, 200, ring_extra=k)
    a, b = clean.alloc(), spec.alloc()
    _decode(fm, clean, a, prompt, 0)
    _decode(fm, spec, b, prompt, 0)
    full = next(st for il, st in spec.stores.items() if not fm.cfg.layers[il].is_sliding)
    for i, t in enumerate(cont):
        pos = len(prompt) + i
        want = _decode(fm, clean, a, [t], pos)
        got = _decode(fm, spec, b, [t], pos)
        assert torch.equal(want, got), (i, float((want - got).abs().max()))
        pages = len(full.free_pages)
        _decode(fm, spec, b, rng.integers(4, 256, k).tolist(), pos + 1)  # rejected drafts
        spec.truncate(b, pos + 1)
        assert len(full.free_pages) >= pages and spec.length(b) == pos + 1


def test_rollback_beyond_the_ring_is_refused(small):
    _, fm, _ = small
    cache = fm.new_cache(1, 100, ring_extra=2)
    slot = cache.alloc()
    _decode(fm, cache, slot, list(range(4, 44)), 0)
    with pytest.raises(ValueError, match="cannot roll back from 40 to 36 tokens: the ring keeps 2 beyond its window"):
        cache.truncate(slot, 36)
    assert cache.length(slot) == 40  # nothing changed
    cache.truncate(slot, 37)
    with pytest.raises(ValueError, match="cannot roll back from 37 to 38"):
        cache.truncate(slot, 38)


# --------------------------------------------------------------------------- lossless and acceptance


def _run(fm, proposer, k, reqs, **opts):
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    return SpecEngine(fm, proposer, k, max_tokens=longest, keep_logits=True, **opts).run(reqs)


def test_every_drafter_is_lossless_and_accepted_as_designed(small):
    """A quick slice of the parity check: the batched scenario (arrivals, a retirement, prompts on both sides of
    the window) at K = 4 with every drafter; the full matrix is the slow test below."""
    _, fm, fd = small
    few = [p for p in PROMPTS if p["id"] in ("len1-bos", "len5", "len17-window+1", "len32-2xwindow")]
    reqs, opts = scenarios(few, fm.cfg.sliding_window)["batched"]
    plain = Engine(fm, max_tokens=200, keep_logits=True, **opts).run(reqs)
    cont = {k: v.tokens for k, v in plain.items()}
    for prop in (OracleProposer(cont), RandomProposer(fm.cfg.vocab_size), PartialProposer(cont, 2, fm.cfg.vocab_size),
                 ModelProposer(fd)):
        res = _run(fm, prop, 4, reqs, **opts)
        cmp = compare_streams(plain, res)
        assert not cmp["mismatched"], (prop.name, cmp)
        assert DEFAULT_GATES["speculative.verify~decode.max_abs_logit"].check(cmp["max_abs_logit"])
        drafted = sum(r.stats.drafted for r in res.values())
        accepted = sum(r.stats.accepted for r in res.values())
        assert drafted > 0
        if prop.name == "oracle":
            assert accepted == drafted
        elif prop.name == "random":
            assert accepted / drafted <= 0.05
        elif prop.name == "partial2":
            assert all(a == min(2, dr) for r in res.values() for dr, a in r.stats.rounds)
        for r in res.values():  # tokens per forward: every emitted token is accounted for
            assert len(r.tokens) == sum(a + 1 for _, a in r.stats.rounds) + 1
            assert r.stats.target_forwards == len(r.stats.rounds) + 1


def test_stop_token_inside_an_accepted_run(small):
    _, fm, _ = small
    p = PROMPTS[5]["prompt_ids"]
    plain = Engine(fm, max_tokens=200).run([Request("a", p, 10)])["a"].tokens
    stop = plain[4]
    want = Engine(fm, max_tokens=200).run([Request("a", p, 10, stop=(stop,))])["a"].tokens
    got = _run(fm, OracleProposer({"a": plain}), 7, [Request("a", p, 10, stop=(stop,))])["a"].tokens
    assert got == want == plain[:plain.index(stop) + 1]


@pytest.mark.slow
def test_speculative_parity_figures_pass_their_gates(small):
    """The parity job's speculative checks on the small case: every drafter, K in {1, 2, 4, 7}, both scenarios."""
    _, fm, fd = small
    info = {}
    figs = speculative_checks(fm, PROMPTS, info, lambda m: None, "edge-no-softcap", lambda: ModelProposer(fd))
    for f in figs:
        assert DEFAULT_GATES[f.gate].check(f.measured), (f.gate, f.prompt, f.measured, f.detail)
    assert info["speculative"]["streams"] == 4 * (4 * len(PROMPTS) + len(PROMPTS))


# --------------------------------------------------------------------------- g4h generate


def _generate(tmp_path, name: str, *extra: str, capsys=None) -> tuple[int, list[dict]]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": p["id"], "prompt_ids": p["prompt_ids"]})
                                 for p in (PROMPTS[1], PROMPTS[4])) + "\n")
    out = tmp_path / f"{name}.jsonl"
    rc = main(["generate", "--model", "edge-no-softcap", "--prompts", str(prompts), "--max-new-tokens", "6",
               "--batched", "--out", str(out), *extra])
    return rc, [json.loads(line) for line in out.read_text().splitlines()] if rc == 0 else []


def test_generate_with_a_drafter_writes_the_same_output(tmp_path):
    outs = {}
    for name, extra in (("plain", []), ("model", ["--draft-model", "edge-no-softcap-assistant", "--draft-tokens", "3"]),
                        ("oracle", ["--draft-model", "oracle"])):
        rc, outs[name] = _generate(tmp_path, name, *extra)
        assert rc == 0
    for name in ("model", "oracle"):
        for a, b in zip(outs["plain"], outs[name]):
            assert a["tokens"] == b["tokens"]
            assert [[t for t, _ in s] for s in a["top_logprobs"]] == [[t for t, _ in s] for s in b["top_logprobs"]]
            st = b["speculative"]
            assert st["drafted"] > 0 and st["target_forwards"] >= 1
    assert all(line["speculative"]["acceptance_rate"] == 1.0 for line in outs["oracle"])
    assert "speculative" not in outs["plain"][0]


def test_generate_refuses_a_bad_drafter(tmp_path, capsys):
    for extra, says in ((["--draft-model", "31b-assistant"], "does not match the target's hidden size"),
                        (["--draft-model", "nowhere"], "--draft-model nowhere"),
                        (["--draft-model", "oracle", "--engine", "reference"], "fast engine")):
        rc, _ = _generate(tmp_path, "bad", *extra)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.slow
def test_generate_cli_in_a_subprocess(tmp_path):
    """As a user runs it: one line and exit 2 for a drafter that does not fit."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [2, 5, 6]}) + "\n")
    proc = run_cli("generate", "--model", "edge-no-softcap", "--prompts", str(prompts), "--max-new-tokens", "2",
                   "--out", str(tmp_path / "o.jsonl"), "--draft-model", "31b-assistant")
    assert_one_line_error(proc, "does not match the target's hidden size")


# --------------------------------------------------------------------------- g4h bench


def test_bench_times_speculation_beside_the_plain_engine(tmp_path):
    """The rows, the speed-up ratio and the acceptance table exist (no timing is asserted)."""
    from gemma4_harness.harness.bench import BenchOptions, bench
    from gemma4_harness.harness.bench.run import BenchPlan

    plan = BenchPlan(engines=["fast"], pp=0, tg=6, reps=1, warmup=0)
    opts = BenchOptions(model=str(MODELS_DIR / "edge-no-softcap.toml"), engines=["fast"], plan=plan,
                        out=str(tmp_path), draft_model="oracle", draft_tokens=4)
    data, status, run_dir = bench(opts, lambda m: None)
    assert status == 0
    assert {(r["engine"], r["test"]) for r in data["rows"]} == {("fast", "tg"), ("fast-spec", "tg")}
    assert "tg6 b1 fast-spec-float32/fast-float32" in data["ratios"]
    (run,) = data["speculative"]["runs"]
    assert run["acceptance_rate"] == 1.0 and run["tokens_per_forward"] == 6 / 2  # 6 tokens in rounds of 5, then 1
    assert "Speculative decoding (same run)" in (run_dir / "report.md").read_text()
