"""The ``llamacpp`` engine (llama.cpp through llama-cpp-python, in a worker subprocess).

Skipped as a whole when llama-cpp-python is not installed (it has no wheel on
PyPI; ``pip install 'gemma4-harness[llamacpp]'`` builds it from source).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python not installed (pip install 'gemma4-harness[llamacpp]'; builds from source, ~5 min)")

from harness import synth  # noqa: E402
from harness.engines import EngineUnavailable, ReferenceEngine, make_engine  # noqa: E402
from harness.gates import DEFAULT_GATES  # noqa: E402
from harness.llamacpp import INSTALL_MSG, EngineCrashed, LlamaCppEngine, check_synthetic  # noqa: E402
from reference.errors import InputError, PromptError  # noqa: E402

PROMPTS = synth.load_prompts()
LONGEST = max(PROMPTS, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]
THREADS = 2

#: Cases llama.cpp runs and agrees on (no KV-shared layers; softcap key present). The KV-shared cases
#: abort in llama.cpp (its donor rule: see test_kv_donor_layout_abort_is_engine_crashed).
PASSING = "31b"
#: A KV-shared layout whose last two non-shared layers are not [sliding, full]: llama.cpp asserts.
ABORTS = "edge-keqv-shared-donor"


def _case(name):
    return synth.ensure_built(synth.REPO_ROOT / "cases" / "models" / f"{name}.toml")


@pytest.fixture(scope="module")
def passing():
    return _case(PASSING)


def test_logits_shape_and_finite(passing):
    eng = make_engine("llamacpp", passing.gguf["F32"])
    assert eng.name == "llamacpp"
    z = eng.logits(LONGEST)
    assert z.dtype == np.float64
    assert z.shape == (len(LONGEST), passing.spec.config["vocab_size"])
    assert np.isfinite(z).all()


def test_gates_on_passing_case(passing):
    rows = check_synthetic(passing, PROMPTS, threads=THREADS)
    summary = rows[-1]
    assert summary["prompt"] == "all" and "error" not in summary
    assert len(rows) == len(PROMPTS) + 1
    for name in ("mean_kld", "same_top1", "max_abs_logit"):
        g = summary["gates"][f"llamacpp~reference.{name}"]
        assert g["limit"] == DEFAULT_GATES[f"llamacpp~reference.{name}"].limit
        assert g["pass"], (name, g)
    assert summary["pass"]
    assert summary["trace"]["first_divergence"] is None, summary["trace"]
    assert not summary["trace"]["missing"], summary["trace"]["missing"]


def test_trace_points_line_up_with_reference(passing):
    eng = LlamaCppEngine(passing.gguf["F32"], threads=THREADS)
    ids = LONGEST[:20]
    ours: dict = {}
    z = eng.logits(ids, trace=lambda p, layer, a: ours.__setitem__((p, layer), a))
    ref: dict = {}
    ReferenceEngine(passing.gguf["F32"]).logits(ids, trace=lambda p, layer, a: ref.__setitem__((p, layer), a))
    assert set(ref) <= set(ours)
    n_layer = passing.spec.config["num_hidden_layers"]
    assert {("l_out", i) for i in range(n_layer)} <= set(ours)
    for key, want in ref.items():
        got = ours[key]
        assert got.shape == want.shape, key
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < 1e-2, (key, rel)  # the fp16 GELU table gives ~1e-3
    np.testing.assert_array_equal(ours[("result_output", -1)].astype(np.float64), z)


def test_generate_solo_batched_and_reference_agree(passing):
    prompts = [p["prompt_ids"] for p in PROMPTS[1:4]]
    eng = LlamaCppEngine(passing.gguf["F32"], threads=THREADS)
    solo = eng.generate_full(prompts, 6)
    batched = eng.generate(prompts, 6, batched=True)
    assert [g.tokens for g in solo] == batched
    assert all(len(g.top5) == 6 and len(g.top5[0]) == 5 for g in solo)
    assert all(g.top5[0][0][0] == g.tokens[0] for g in solo)
    assert [g.tokens for g in solo] == ReferenceEngine(passing.gguf["F32"]).generate(prompts, 6)


def test_truncated_gguf_is_engine_crashed(passing, tmp_path):
    bad = tmp_path / "truncated.gguf"
    data = passing.gguf["F32"].read_bytes()
    bad.write_bytes(data[: len(data) // 3])
    eng = LlamaCppEngine(bad, threads=THREADS)
    with pytest.raises(EngineCrashed) as ei:
        eng.logits([2, 5, 6])
    msg = str(ei.value)
    assert msg.startswith("engine crashed: ") and "\n" not in msg


def test_kv_donor_layout_abort_is_engine_crashed():
    case = _case(ABORTS)
    eng = LlamaCppEngine(case.gguf["F32"], threads=THREADS)
    with pytest.raises(EngineCrashed) as ei:
        eng.logits([2, 5, 6])
    msg = str(ei.value)
    assert msg.startswith("engine crashed: ") and "GGML_ASSERT" in msg and "\n" not in msg
    assert "llama-kv-cache.cpp" in msg  # source path shortened to the file name
    # check_synthetic names the crash in its result instead of raising, so a run goes on with the next case.
    rows = check_synthetic(case, PROMPTS[:2], threads=THREADS, trace=False)
    assert len(rows) == 1 and rows[0]["error"] == msg
    assert rows[0]["error_kind"] == "engine" and rows[0]["pass"] is False


def test_chunked_prefill_through_the_ring_buffer(passing):
    """n_ubatch below the sliding window: the prompt goes through several decodes (swa_full off)."""
    one = LlamaCppEngine(passing.gguf["F32"], threads=THREADS).logits(LONGEST)
    chunked = LlamaCppEngine(passing.gguf["F32"], threads=THREADS, n_ubatch=7).logits(LONGEST)
    assert np.max(np.abs(one - chunked)) <= 1e-3


def test_prompt_longer_than_context(passing):
    eng = LlamaCppEngine(passing.gguf["F32"], n_ctx=8, threads=THREADS)
    with pytest.raises(PromptError):
        eng.logits(list(range(4, 14)))
    with pytest.raises(PromptError):
        eng.logits([2, 100000])


def test_not_installed_message(monkeypatch, passing):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(EngineUnavailable) as ei:
        LlamaCppEngine(passing.gguf["F32"])
    assert str(ei.value) == INSTALL_MSG
    assert str(ei.value) == ("llama.cpp engine not installed: pip install 'gemma4-harness[llamacpp]' "
                             "(builds llama-cpp-python from source, ~5 min)")
    assert isinstance(ei.value, InputError)
    with pytest.raises(EngineUnavailable, match="not installed"):
        make_engine("llamacpp", passing.gguf["F32"])
