"""The ``cmd:`` engine (harness/engines/cmd.py, docs/engine-protocol.md) through a protocol engine built on the
reference (tests/cmd_stub.py), on the tiny 2-layer GGUF: answers, every fault as one line naming the command
and the request, the child dying with its parent, the CLI, and ``g4h parity --against cmd:...``.

The llama-cpp-python example engine (examples/llamacpp_engine.py) is tested in tests/test_parity_against.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness.cli import main as g4h
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.workers import EngineCrashed, EngineFailure
from gemma4_harness.harness.engines import EngineUnavailable, engine_kind, make_engine, split_engines
from gemma4_harness.harness.engines.cmd import CmdCrashed, CmdEngine, CmdError, command_argv
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.checks.server import ServerOptions
from gemma4_harness.harness.traces.format import read_trace
from gemma4_harness.reference.errors import InputError

STUB = Path(__file__).resolve().parent / "cmd_stub.py"
IDS = [2, 5, 9, 11, 3, 7, 30, 1]


def stub(*args: str) -> str:
    """The engine name of the stub with ``args``."""
    return "cmd:" + shlex.join([sys.executable, str(STUB), *args])


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    """Prompts for the tiny model (vocabulary 32, context 64, window 4)."""
    rng = np.random.default_rng(3)
    rows = [{"id": f"t{n}", "prompt_ids": [2] + rng.integers(3, 32, n - 1).tolist()} for n in (1, 3, 5, 9, 17)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- names


def test_engine_names_and_lists():
    assert engine_kind("cmd:./eng --x") == "cmd" and engine_kind("fast") == "fast"
    assert split_engines("fast, llamacpp,cmd:'./eng --ids 1,2' ,cmd:\"b,c\"") == [
        "fast", "llamacpp", "cmd:'./eng --ids 1,2'", 'cmd:"b,c"']
    with pytest.raises(InputError, match="unclosed"):
        split_engines("fast,cmd:'./eng")
    with pytest.raises(InputError, match="empty name"):
        split_engines("fast,,llamacpp")
    with pytest.raises(EngineUnavailable, match="unknown engine 'nope:x'.*cmd:"):
        make_engine("nope:x", "m.gguf")
    with pytest.raises(EngineUnavailable, match="nothing after cmd:"):
        make_engine("cmd: ", "m.gguf")


def test_command_argv_splits_like_a_shell():
    assert command_argv("python eng.py --name 'a b'") == ["python", "eng.py", "--name", "a b"]
    assert command_argv("'python eng.py --x 1,2'") == ["python", "eng.py", "--x", "1,2"]
    with pytest.raises(InputError, match="cannot split"):
        command_argv("python 'eng.py")


# --------------------------------------------------------------------------- answers


def test_stub_answers_match_the_reference(tiny_gguf, tmp_path):
    ref = ReferenceEngine(tiny_gguf)
    with make_engine(stub(), tiny_gguf) as eng:
        assert isinstance(eng, CmdEngine)
        assert eng.ops == ("logits", "generate", "trace", "tokenize") and eng.vocab_size == 32
        z = eng.logits(IDS)
        assert z.dtype == np.float64 and z.shape == (len(IDS), 32)
        np.testing.assert_array_equal(z, ref.logits(IDS).astype(np.float32))
        gens = eng.generate_full([IDS, IDS[:3]], 4)
        want = ref.generate_full([IDS, IDS[:3]], 4)
        assert [g.tokens for g in gens] == [g.tokens for g in want]
        assert gens[0].top[0][0][0] == want[0].top[0][0][0]
        assert eng.tokenize("ab") == [2, 97, 98]
        tr = read_trace(eng.trace_file(IDS, tmp_path / "t.jsonl", tmp_path / "dump"))
        assert tr.prompt_ids == IDS and tr.has_tensors()
        assert {r["point"] for r in tr.records} >= {"attn_out", "ffn_out", "l_out", "result_output"}
        workdir = eng.workdir
    assert eng.proc.poll() is not None and not os.path.exists(workdir)


FAULTS = [  # (stub fault, op, what the line must say)
    ("malformed", "logits", "logits (request 1): reply is not JSON: 'this is not a JSON reply'"),
    ("die", "logits", "logits (request 1): the engine exited (exit status 3) before answering; its last message: "
                      "stub: fatal: simulated crash in logits"),
    ("shape", "logits", "logits (request 1): logits of shape [7, 32] for 8 ids, expected [8, 32]"),
    ("dtype", "logits", "logits (request 1): logits of dtype int32, expected float32 or float64"),
    ("wrong-id", "logits", "logits (request 1): reply has id 8, expected 1"),
    ("error", "logits", "logits (request 1): the engine answered an error: stub: simulated failure"),
    ("not-greedy", "generate", "generate (request 1): results[0] step 0: token"),
    ("short", "generate", "generate (request 1): results[0]: 3 tokens and 3 top_logprobs steps, expected 4 of each"),
    ("version", "hello", "hello: speaks protocol 2; this harness speaks 1"),
    ("no-ops", "hello", "hello: ops: answers neither logits nor generate"),
]


@pytest.mark.parametrize("fault,op,says", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_fault_is_one_line_naming_command_and_request(tiny_gguf, fault, op, says):
    name = stub("--fault", fault, "--fault-op", op)
    label = "cmd:" + shlex.quote(name[len("cmd:"):])
    with pytest.raises(CmdError) as ei:
        eng = make_engine(name, tiny_gguf)
        eng.logits(IDS) if op == "logits" else eng.generate_full([IDS], 4)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{label} {says}"), msg
    assert isinstance(ei.value, EngineFailure) and not isinstance(ei.value, InputError)  # the engine's fault: exit 1
    assert isinstance(ei.value, EngineCrashed) == (fault == "die")
    if fault == "die":  # its own last stderr line comes along
        assert isinstance(ei.value, CmdCrashed) and ei.value.last_error == "stub: fatal: simulated crash in logits"
    if op != "hello":  # the engine was stopped after its fault, and says so again
        assert eng.proc.poll() is not None
        with pytest.raises(CmdError, match="request 1"):
            eng.logits(IDS)


def test_timeout_stops_the_engine(tiny_gguf):
    # the stub's start (a Python process importing NumPy) may take more than 2 s on a loaded machine: the hello
    # gets the default limit, the hanging request the short one
    eng = CmdEngine(shlex.join([sys.executable, str(STUB), "--fault", "hang"]), tiny_gguf)
    eng.timeout = 2.0
    t0 = time.monotonic()
    with pytest.raises(CmdError, match=r"logits \(request 1\): no reply within 2 s .*G4H_CMD_TIMEOUT"):
        eng.logits(IDS)
    assert time.monotonic() - t0 < 10 and eng.proc.poll() is not None


def test_refused_model_is_unavailable_and_missing_command_is_named(tiny_gguf):
    with pytest.raises(EngineUnavailable, match="cannot run tiny.gguf: stub: cannot read this model"):
        make_engine(stub("--fault", "refuse"), tiny_gguf)
    with pytest.raises(InputError, match="cmd:./no-such-engine: cannot start the command") as ei:
        make_engine("cmd:./no-such-engine", tiny_gguf)
    assert not isinstance(ei.value, EngineFailure)  # a command that does not exist is the user's input: exit 2


def test_child_dies_with_its_parent(tiny_gguf, tmp_path):
    """A harness process killed without closing the engine leaves no engine behind (PR_SET_PDEATHSIG), even an
    engine that does not exit when its stdin closes (``--linger``)."""
    code = (f"import sys, os; sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
            f"from gemma4_harness.harness.engines import make_engine\n"
            f"e = make_engine({stub('--linger')!r}, {str(tiny_gguf)!r})\n"
            f"print(e.proc.pid, flush=True)\n"
            f"os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state


# --------------------------------------------------------------------------- the CLI


def test_cli_logits_generate_trace(tiny_gguf, tmp_path, capsys):
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(IDS))
    out = tmp_path / "z.npy"
    assert g4h(["logits", "--model", str(tiny_gguf), "--engine", stub(), "--prompt-ids", str(ids_file),
                "--out", str(out)]) == 0
    np.testing.assert_array_equal(np.load(out), ReferenceEngine(tiny_gguf).logits(IDS).astype(np.float32))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": IDS}) + "\n")
    assert g4h(["generate", "--model", str(tiny_gguf), "--engine", stub(), "--prompts", str(prompts),
                "--max-new-tokens", "3", "--out", str(tmp_path / "g.jsonl")]) == 0
    (line,) = (tmp_path / "g.jsonl").read_text().splitlines()
    assert json.loads(line)["tokens"] == ReferenceEngine(tiny_gguf).generate([IDS], 3)[0]
    assert g4h(["trace", "--model", str(tiny_gguf), "--engine", stub(), "--prompt-ids", str(ids_file),
                "--out", str(tmp_path / "t.jsonl"), "--dump-tensors", str(tmp_path / "dumps")]) == 0
    tr = read_trace(tmp_path / "t.jsonl")
    assert tr.prompt_ids == IDS and tr.tensor("l_out", 1) is not None
    capsys.readouterr()
    assert g4h(["logits", "--model", str(tiny_gguf), "--engine", stub("--fault", "shape"), "--prompt-ids",
                str(ids_file), "--out", str(tmp_path / "bad.npy")]) == 1  # the engine is wrong: exit 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("g4h: engine failed: cmd:") and \
        "logits (request 1): logits of shape [7, 32]" in err[0], err
    assert g4h(["logits", "--model", str(tiny_gguf), "--engine", "cmd:./no-such-engine", "--prompt-ids",
                str(ids_file), "--out", str(tmp_path / "bad.npy")]) == 2  # a command that cannot start: exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("g4h: error: cmd:./no-such-engine: cannot start the command"), err


# --------------------------------------------------------------------------- g4h parity --against cmd:...


def _checks(data, prefix):
    return [c for case in data["cases"] for c in case["checks"] if c["gate"].startswith(prefix)]


def test_parity_against_stub_passes_and_gates_every_metric(tiny_gguf, prompts_file, tmp_path):
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub()], out=str(tmp_path), prompts=prompts_file,
                              quiet=True)
    assert status == 0, data["verdict"]
    gates = {c["gate"] for c in _checks(data, "reference~cmd")}
    assert gates == {f"reference~cmd.{m}" for m in ("runs", "max_abs_logit", "mean_kld", "same_top1_decisive",
                                                    "layer_rel_l2", "greedy", "max_abs_logprob")}
    assert all(c["pass"] for c in _checks(data, "reference~cmd"))
    layer = _checks(data, "reference~cmd.layer_rel_l2")
    assert layer and all(c["basis"] == ["tensors"] and c["first_divergence"] is None for c in layer)


def test_parity_against_stub_with_a_perturbed_layer_names_it(tiny_gguf, prompts_file, tmp_path):
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--perturb-layer", "1")], out=str(tmp_path),
                              prompts=prompts_file, quiet=True)
    assert status == 1 and data["verdict"].startswith("FAIL")
    layer = _checks(data, "reference~cmd.layer_rel_l2")
    limit = DEFAULT_GATES["reference~cmd.layer_rel_l2"].limit
    assert layer and all(c["first_divergence"] == "ffn_out@1" and c["measured"] > limit for c in layer), layer
    assert any(not c["pass"] for c in _checks(data, "reference~cmd.max_abs_logit"))


def test_parity_checksum_only_trace_still_names_the_layer(tiny_gguf, prompts_file, tmp_path):
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--perturb-layer", "1", "--no-tensors")],
                              out=str(tmp_path), prompts=prompts_file, quiet=True)
    layer = [c for c in _checks(data, "reference~cmd.layer_rel_l2") if c["prompt"] != "t1"]
    assert status == 1 and layer
    assert all(c["basis"] == ["checksums"] and c["first_divergence"] == "ffn_out@1" for c in layer), layer


def test_parity_sixteen_bit_engine_gets_the_bf16_gates(tiny_gguf, prompts_file, tmp_path):
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--dtype", "bfloat16")], out=str(tmp_path),
                              prompts=prompts_file, quiet=True)
    assert status == 0, data["verdict"]
    assert {c["gate"].split(".")[0] for c in _checks(data, "reference~cmd")} == {"reference~cmd_bf16"}


def test_two_engines_of_one_kind_get_their_own_pairs(tiny_gguf, prompts_file, tmp_path):
    """Two cmd: engines in one --against list: the second is the pair reference~cmd#2, judged by the reference~cmd
    gates; the intact one passes, the perturbed one fails at its layer and the verdict names its pair."""
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub(), stub("--perturb-layer", "1")],
                              out=str(tmp_path), prompts=prompts_file, quiet=True)
    assert status == 1
    first = [c for c in _checks(data, "reference~cmd.")]
    second = _checks(data, "reference~cmd#2.")
    assert first and all(c["pass"] for c in first)
    assert {c["gate"].split(".", 1)[1] for c in second} == {c["gate"].split(".", 1)[1] for c in first}
    layer = _checks(data, "reference~cmd#2.layer_rel_l2")
    assert layer and all(c["first_divergence"] == "ffn_out@1" and not c["pass"] for c in layer), layer
    assert all(c["limit"] == DEFAULT_GATES["reference~cmd.layer_rel_l2"].limit for c in layer)
    assert "reference~cmd#2.layer_rel_l2" in data["verdict"] and "reference~cmd." not in data["verdict"]


def test_parity_top_n_sets_vllm_n(tiny_gguf, prompts_file, tmp_path):
    """``--top-n``: an engine whose first token is the oracle's sixth most probable fails vLLM's rule with N = 5
    (naming the request, step 0 and both tokens) and passes it with N = 6 (each stream parted "within the top-N");
    the engine is asked for N log-probs and the greedy figure records N."""
    name = stub("--fault", "rank6", "--fault-op", "generate")
    data, status = run_parity(models=[str(tiny_gguf)], against=[name], out=str(tmp_path), prompts=prompts_file,
                              quiet=True)
    (greedy,) = _checks(data, "reference~cmd.greedy")
    assert status == 1 and not greedy["pass"] and greedy["top_n"] == 5
    assert re.fullmatch(r"request \S+ step 0: ours \d+, oracle \d+", greedy["first_fault"]), greedy["first_fault"]
    data, status = run_parity(models=[str(tiny_gguf)], against=[name], out=str(tmp_path), prompts=prompts_file,
                              quiet=True, server=ServerOptions(top_n=6))
    (greedy,) = _checks(data, "reference~cmd.greedy")
    assert status == 0, data["verdict"]
    assert greedy["pass"] and greedy["top_n"] == 6 and greedy["by_top_n"] == greedy["streams"] > 0, greedy
    assert data["cases"][0]["info"]["top_n"] == 6


def test_generate_full_keeps_the_top_n(tiny_gguf):
    """Every in-process engine keeps ``top_n`` pairs per step, best first; the first five are the default run's."""
    for eng in (ReferenceEngine(tiny_gguf), make_engine("fast", tiny_gguf)):
        five, = eng.generate_full([IDS], 3)
        nine, = eng.generate_full([IDS], 3, top_n=9)
        assert nine.tokens == five.tokens and all(len(s) == 9 for s in nine.top)
        assert [[i for i, _ in s[:5]] for s in nine.top] == [[i for i, _ in s] for s in five.top]
        assert all(all(a[1] >= b[1] for a, b in zip(s, s[1:])) for s in nine.top)


@pytest.mark.slow
def test_parity_protocol_fault_is_an_engine_failure_and_the_run_goes_on(tiny_gguf, prompts_file, tmp_path):
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--fault", "malformed"), "fast"],
                              out=str(tmp_path), prompts=prompts_file, quiet=True)
    assert status == 1
    runs = _checks(data, "reference~cmd.runs")
    assert len(runs) == 1 and not runs[0]["pass"] and runs[0]["engine_failure"] and not runs[0].get("bad_input")
    assert "logits (request 1): reply is not JSON" in runs[0]["got"] and runs[0]["request"] == "t1"
    assert data["verdict"].startswith("ENGINE FAILED: tiny.gguf/reference~cmd at request t1: cmd:"), data["verdict"]
    fast = _checks(data, "reference~fast")
    assert fast and all(c["pass"] for c in fast)  # the next pair still ran
    assert (Path(data["run_dir"]) / "report.md").read_text().count("reply is not JSON") >= 1


@pytest.mark.slow
def test_quantized_activations_are_reported_not_gated_on_quantized_files_only(tmp_path):
    """An engine that declares quantized_activations without its dot-product types (no vec_dot_types: the reference
    cannot emulate its rounding) is held to the fp32 bounds on an F32 file; on a Q8_0 file its figures are reported
    with the reason, and its mean KLD is gated at 2 x the 8-bit yardstick (reference~cmd_q8x.mean_kld): the stub
    perturbs layer 0, far more than an 8-bit rounding moves the model, so it fails there."""
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    built = synth.ensure_built(MODELS_DIR / "26b-a4b.toml")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_ids": [2, 40, 7, 99, 5, 17, 3]}) + "\n")
    name = stub("--approx", "quantized_activations", "--perturb-layer", "0")
    data, status = run_parity(models=[str(built.gguf["F32"])], against=[name], out=str(tmp_path), prompts=prompts,
                              quiet=True)
    assert status == 1 and not any(c.get("informational") for c in _checks(data, "reference~cmd"))
    data, status = run_parity(models=[str(built.gguf["Q8_0"])], against=[name], out=str(tmp_path), prompts=prompts,
                              quiet=True)
    assert status == 1, data["verdict"]
    checks = _checks(data, "reference~cmd")
    assert checks[0]["gate"] == "reference~cmd.runs" and checks[0]["pass"] and not checks[0].get("informational")
    kld = [c for c in checks if c["gate"] == "reference~cmd_q8x.mean_kld"]
    assert kld and not any(c["pass"] or c.get("informational") for c in kld)
    assert all(c["yardstick"] > 0 and c["measured"] > 2 * c["yardstick"] for c in kld)
    rest = [c for c in checks[1:] if c not in kld]
    assert rest and all(c["informational"] and "Q8_0" in c["reason"] and "vec_dot_types" in c["reason"]
                        for c in rest)
