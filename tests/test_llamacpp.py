"""The ``llamacpp`` engine (llama.cpp through llama-cpp-python, in a worker subprocess).

llama-cpp-python has no wheel on PyPI; ``python -m gemma4_harness.harness.engines.llamacpp.build`` builds it into
the user cache and ``nox -s tests`` installs it from there. Without it these tests fail; the one
opt-out is ``G4H_SKIP_LLAMACPP=1``, which skips them, each saying so.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

if os.environ.get("G4H_SKIP_LLAMACPP", "") not in ("", "0"):
    pytest.skip("opted out with G4H_SKIP_LLAMACPP=1", allow_module_level=True)
import llama_cpp  # noqa: E402, F401  (missing: nox -s tests installs it from the build cache)

from gemma4_harness.harness import synth  # noqa: E402
from gemma4_harness.harness.core.cases import MODELS_DIR  # noqa: E402
from gemma4_harness.harness.core.gates import resolve  # noqa: E402
from gemma4_harness.harness.core.prompts import load_prompts  # noqa: E402
from gemma4_harness.harness.core.workers import EngineCrashed  # noqa: E402
from gemma4_harness.harness.engines import EngineUnavailable, make_engine  # noqa: E402
from gemma4_harness.harness.engines.checked import CheckedEngine  # noqa: E402
from gemma4_harness.harness.engines.llamacpp import INSTALL_MSG, LlamaCppEngine  # noqa: E402
from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.parity.checks.pair import pair_checks  # noqa: E402
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns  # noqa: E402
from gemma4_harness.harness.parity.result import CaseResult  # noqa: E402
from gemma4_harness.reference.errors import InputError, PromptError  # noqa: E402

PROMPTS = load_prompts()
LONGEST = max(PROMPTS, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]
THREADS = 2

#: A case llama.cpp runs and agrees on (softcap key present). KV-shared cases run too (e2b) unless a shared
#: layer's donor under llama.cpp's rule is of the other layer type: see test_kv_donor_layout_abort_is_engine_crashed.
PASSING = "31b"
#: A KV-shared layout whose last two non-shared layers are not [sliding, full]: llama.cpp asserts.
ABORTS = "edge-keqv-shared-donor"


def _case(name):
    return synth.ensure_built(MODELS_DIR / f"{name}.toml")


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


def _llamacpp_pair(built, prompts) -> list[dict]:
    """The checks of the pair pipeline (what a built-in case and ``--model`` both run) for llama.cpp on the case's
    F32 GGUF, judged by the case's gates."""
    path = built.gguf["F32"]
    runs = ReferenceRuns(CheckedEngine(ReferenceEngine(path), "reference"))
    res = CaseResult(case=built.spec.name, kind="synthetic", model=str(path))
    figs = pair_checks(runs, "llamacpp", path, prompts, lambda m: None, built.spec.name, options={"threads": THREADS})
    res.apply(figs, resolve(built.spec.gates, str(built.spec.path)))
    return res.checks


def test_gates_on_passing_case(passing):
    checks = _llamacpp_pair(passing, PROMPTS)
    assert [c["measured"] for c in checks if c["gate"] == "reference~llamacpp.runs"] == [1.0]
    bad = [(c["gate"], c["prompt"], c["measured"], c["limit"]) for c in checks if not c["pass"]]
    assert not bad
    for metric in ("max_abs_logit", "mean_kld", "same_top1_decisive", "layer_rel_l2"):
        got = [c for c in checks if c["gate"] == f"reference~llamacpp.{metric}"]
        assert len(got) == len(PROMPTS), metric
        assert not any(c.get("informational") for c in got), metric
    # the fp16 GELU table is emulated (the gate is raised by its measured effect), the exact figure kept beside
    kld = [c for c in checks if c["gate"] == "reference~llamacpp.max_abs_logit"]
    assert all(c["emulated"] == ["gelu_fp16_table"] and "vs_exact_reference" in c for c in kld)
    assert all(c["first_divergence"] is None for c in checks if c["gate"] == "reference~llamacpp.layer_rel_l2")


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
    assert all(len(g.top) == 6 and len(g.top[0]) == 5 for g in solo)
    assert all(g.top[0][0][0] == g.tokens[0] for g in solo)
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
    # the pair names the crash in a failing .runs figure instead of raising, so a run goes on with the next case.
    (runs,) = [c for c in _llamacpp_pair(case, PROMPTS[:2]) if c["gate"] == "reference~llamacpp.runs"]
    assert runs["measured"] == 0.0 and runs["engine_failure"] and msg.removeprefix("engine crashed: ") in runs["got"]


@pytest.mark.slow
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


# --------------------------------------------------------------------------- the tokenizer engine (a worker too)

TOK_BYTES = [f"<0x{i:02X}>" for i in range(256)]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A small gemma4-type vocabulary GGUF llama.cpp loads: specials, a marker, a few merges, 256 byte tokens."""
    from gemma4_harness.harness.tokenizer.build import write_vocab_gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "a", "b", "ab", "▁", "▁a"] + TOK_BYTES
    return write_vocab_gguf(tmp_path_factory.mktemp("tokvocab") / "small.gguf", {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 3, 3, 1, 1, 1, 1, 1] + [6] * 256,
        "tokenizer.ggml.merges": ["a b", "▁ a"], "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0})


@pytest.fixture(scope="module")
def aborting_vocab(tmp_path_factory):
    """A llama-type vocabulary without byte tokens: it loads, but tokenizing throws std::out_of_range in llama.cpp
    (``byte_to_token``), which ends in ``std::terminate`` -> abort."""
    from gemma4_harness.harness.tokenizer.build import write_vocab_gguf

    return write_vocab_gguf(tmp_path_factory.mktemp("tokvocab") / "noscores.gguf", {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1]})


TOK_TEXTS = ["ab ab", "<|turn>ab<bos>", "", "a\nb", "é日本😀", "<|turn><|turn>"]

#: Run in a fresh interpreter: the tokenizer engine, and llama-cpp-python's own Llama(vocab_only=True) (what the
#: engine ran in-process before it had a worker) on the same texts and flags.
_CHILD = r"""
import json, os, sys
from gemma4_harness.harness.tokenizer.engines import make_tok_engine
path, texts = sys.argv[1], json.loads(sys.argv[2])
out = {"pid": os.getpid()}
for ps in (True, False):
    e = make_tok_engine("llamacpp", path, add_bos=True, parse_special=ps)
    ids = e.encode_many(texts)
    out[f"ids_{ps}"] = ids
    out[f"one_by_one_{ps}"] = [e.encode(t) for t in texts]
    out[f"decode_{ps}"] = [e.decode(i) for i in ids]
    out[f"pieces_{ps}"] = [e.pieces(i) for i in ids]
    out["worker_pid"] = e.worker_pid
    out["bos_id"] = e.bos_id
out["llama_cpp_loaded_in_parent"] = "llama_cpp" in sys.modules
import llama_cpp
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
bos = llm.token_bos()
for ps in (True, False):
    direct = [llm.tokenize(t.encode(), add_bos=False, special=ps) for t in texts]
    out[f"direct_{ps}"] = [i if i[:1] == [bos] else [bos] + i for i in direct]
    out[f"direct_decode_{ps}"] = [llm.detokenize(i).decode("utf-8", "replace") for i in out[f"ids_{ps}"]]
    out[f"direct_pieces_{ps}"] = [[llm.detokenize([t], special=True).decode("utf-8", "replace") for t in i]
                                  for i in out[f"ids_{ps}"]]
print(json.dumps(out))
os._exit(0)
"""


def test_tokenizer_engine_runs_in_a_worker_with_the_old_results(small_vocab):
    import json
    import subprocess

    from clitools import REPO_ROOT

    proc = subprocess.run([sys.executable, "-c", _CHILD, str(small_vocab), json.dumps(TOK_TEXTS)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["llama_cpp_loaded_in_parent"] is False  # llama.cpp never ran in the harness process
    assert out["worker_pid"] not in (None, out["pid"])
    assert out["bos_id"] == 2
    for ps in ("True", "False"):
        assert out[f"ids_{ps}"] == out[f"direct_{ps}"], ps  # same ids as Llama.tokenize, BOS once
        assert out[f"one_by_one_{ps}"] == out[f"ids_{ps}"]
        assert out[f"decode_{ps}"] == out[f"direct_decode_{ps}"]
        assert out[f"pieces_{ps}"] == out[f"direct_pieces_{ps}"]
    assert out["ids_True"][1][:2] == [2, 4] and 4 not in out["ids_False"][1]  # <|turn> parsed / kept as text


def test_tokenizer_worker_is_one_child_process(small_vocab):
    import os

    from gemma4_harness.harness.tokenizer.engines import make_tok_engine

    eng = make_tok_engine("llamacpp", small_vocab)
    pid = eng.worker_pid
    assert pid is not None and pid != os.getpid()
    eng.encode_many(["ab"] * 1500)  # several batches, one worker
    eng.encode("ab")
    assert eng.worker_pid == pid
    eng.close()
    assert eng.worker_pid is None


def test_tokenizer_worker_abort_is_engine_crashed(aborting_vocab, small_vocab):
    import os
    import signal

    from gemma4_harness.harness.tokenizer.engines import make_tok_engine

    crashing = make_tok_engine("llamacpp", aborting_vocab)
    with pytest.raises(EngineCrashed) as ei:
        crashing.encode_many(["ab", "a b"])
    msg = str(ei.value)
    assert msg.startswith("engine crashed: ") and "\n" not in msg
    assert "std::out_of_range" in msg and "SIGABRT" in msg
    # a worker killed under a live engine: the next call names the signal, the one after runs a fresh worker
    eng = make_tok_engine("llamacpp", small_vocab)
    want = eng.encode("ab ab")
    os.kill(eng.worker_pid, signal.SIGKILL)
    with pytest.raises(EngineCrashed, match=r"^engine crashed: llama\.cpp worker died \(signal SIGKILL\) on small"):
        eng.encode("ab ab")
    assert eng.encode("ab ab") == want
    with pytest.raises(InputError, match="outside the vocabulary"):  # refused by the worker, which stays up
        eng.pieces([10**6])
    assert eng.decode(want) == "ab ab"


def test_tokenizer_unloadable_file_is_engine_crashed(tmp_path, small_vocab):
    from gemma4_harness.harness.tokenizer.engines import make_tok_engine

    bad = tmp_path / "truncated.gguf"
    data = small_vocab.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineCrashed) as ei:
        make_tok_engine("llamacpp", bad)
    msg = str(ei.value)
    assert msg.startswith("engine crashed: llama.cpp could not load the vocabulary of truncated.gguf: ")
    assert "\n" not in msg


def test_tokenizer_crash_is_reported_and_the_run_goes_on(aborting_vocab, small_vocab, tmp_path):
    import os
    import signal

    from clitools import assert_one_line_error, run_cli

    from gemma4_harness.harness.tokenizer.checks import Ctx, run_check
    from gemma4_harness.harness.tokenizer.corpus import compare_engines
    from gemma4_harness.harness.tokenizer.engines import make_tok_engine

    def crashing(ctx) -> dict:
        compare_engines(make_tok_engine("ours", small_vocab), make_tok_engine("llamacpp", aborting_vocab), ["ab"])
        return {"status": "pass"}

    chk = run_check("llamacpp", crashing, Ctx(texts=[]))
    assert chk["status"] == "error" and chk["detail"].startswith("engine crashed: ") and "SIGABRT" in chk["detail"]
    # a crash in the middle of a comparison ends it with the same error, not one error per text
    eng = make_tok_engine("llamacpp", small_vocab)
    os.kill(eng.worker_pid, signal.SIGKILL)
    with pytest.raises(EngineCrashed):
        compare_engines(make_tok_engine("ours", small_vocab), eng, ["ab", "ba"])
    corpus = tmp_path / "c.txt"
    corpus.write_text("ab\nab ab\n")
    line = assert_one_line_error(run_cli("tokcheck", "--tokenizer", str(small_vocab), "--against", "llamacpp",
                                         "--against-tokenizer", str(aborting_vocab), "--corpus", str(corpus)),
                                 "engine crashed", rc=1)  # the engine under test crashed: exit 1, not bad input
    assert line.startswith("g4h: engine failed: engine crashed: ") and "std::out_of_range" in line


#: A parent that keeps llama.cpp busy: the tokenizer worker up, and one model worker after another.
_BUSY_PARENT = r"""
import sys
from gemma4_harness.harness.engines.llamacpp import LlamaCppEngine
from gemma4_harness.harness.tokenizer.engines import make_tok_engine
tok = make_tok_engine("llamacpp", sys.argv[2])
print(tok.worker_pid, flush=True)
eng = LlamaCppEngine(sys.argv[1], n_ctx=1024, threads=1)
ids = [2] + [5, 7, 11] * 300
while True:
    eng.logits(ids, trace=lambda point, layer, array: None)
"""


@pytest.mark.parametrize("delay", [pytest.param(0.0, marks=pytest.mark.slow), 0.5,
                                   pytest.param(1.5, marks=pytest.mark.slow)])
def test_killed_parent_leaves_no_llamacpp_worker_and_no_temp_dir(passing, small_vocab, tmp_path, delay):
    """kill -9 of the harness while a llama.cpp worker runs: the worker (and the tokenizer worker) die, and the
    worker's folder of results goes too. ``delay``: seconds after the first model worker appears (in its start,
    its load, its decode, or the next worker's)."""
    import signal
    import subprocess
    import time

    from test_workers import children_of, process_gone, wait_until

    from gemma4_harness.harness.core.workers import worker_env

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", _BUSY_PARENT, str(passing.gguf["F32"]), str(small_vocab)],
                              stdout=subprocess.PIPE, text=True, env=dict(worker_env(), TMPDIR=str(tmp)))
    seen = {int(parent.stdout.readline())}

    def model_workers() -> set[int]:
        return {p for p, cmd in children_of(parent.pid).items() if "llamacpp.worker" in cmd}

    assert wait_until(lambda: bool(model_workers()), 60), "no llama.cpp worker started"
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        seen |= model_workers()
        time.sleep(0.01)
    seen |= model_workers()
    assert any(p.name.startswith("g4h-llamacpp-") for p in tmp.iterdir())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_until(lambda: all(process_gone(p) for p in seen)), "a worker outlived its parent"
    assert wait_until(lambda: not any(tmp.iterdir())), f"left behind: {sorted(p.name for p in tmp.iterdir())}"


def test_worker_threads_follow_omp_num_threads(monkeypatch):
    """llama.cpp's workers run on ``$OMP_NUM_THREADS`` threads when it is set (a parity or pytest-xdist worker's
    share of the CPUs), else on every CPU this process may use."""
    import os

    from gemma4_harness.harness.engines.llamacpp.worker import default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    for unset in ("", "x", "0"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_threads() == len(os.sched_getaffinity(0))
