"""The output check (``harness/core/finite.py``, applied by ``harness/engines/checked.py`` and the fast engine's
decode loop): an engine that returns NaN or Inf fails (exit 1, one line naming the first layer and trace point),
in every command and in parity; a correct engine on the same prompt passes.

The faulty engines are deliberate: the fast engine on a GGUF with one ``ffn_norm`` weight that fp32 cannot carry
(the reference computes it finitely), and ``tests/cmd_nan_stub.py`` (the reference behind the subprocess protocol
with a NaN in ``blk.1.ffn_down.weight``).
"""

from __future__ import annotations

import shlex
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf_mutate import read_layout

from gemma4_harness.harness.cli import main as g4h
from gemma4_harness.harness.core.finite import FiniteTrace, ModelOverflow, check_logits
from gemma4_harness.harness.core.workers import EngineOutputError
from gemma4_harness.harness.engines import make_engine
from gemma4_harness.harness.engines.checked import CheckedEngine
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.reference.weight_check import CarryWarning

NAN_STUB = Path(__file__).resolve().parent / "cmd_nan_stub.py"


def nan_engine(layer: int = 1) -> str:
    return "cmd:" + shlex.join([sys.executable, str(NAN_STUB), "--perturb-layer", str(layer)])


def with_weight(src: Path, dst: Path, tensor: str, index: int, value: float) -> Path:
    """A copy of an F32 GGUF with one element of one tensor set (offsets from gguf's reader of the clean file)."""
    t = {t.name: t for t in read_layout(src).tensors}[tensor]
    buf = bytearray(src.read_bytes())
    struct.pack_into("<f", buf, t.data_start + 4 * index, value)
    dst.write_bytes(bytes(buf))
    return dst


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory) -> Path:
    """The tiny model with blk.0.ffn_norm.weight[3] = 1e25: within the fp32 weight limit (1e30), carried by the
    float64 reference, but gelu(gate) * up squares it past float32's 3.4e38 in fast."""
    from conftest import write_tiny_gguf

    tmp = tmp_path_factory.mktemp("ovf")
    return with_weight(write_tiny_gguf(tmp / "tiny.gguf"), tmp / "ffn-norm-1e25.gguf", "blk.0.ffn_norm.weight", 3,
                       1e25)


def test_reference_carries_it_and_fast_fails_naming_layer_and_point(overflowing):
    ids = [2, 5, 7, 11]
    ref = make_engine("reference", overflowing)
    assert np.all(np.isfinite(ref.logits(ids)))  # no false alarm: the specification is finite here
    with pytest.warns(CarryWarning, match="tensor blk.0.ffn_norm.weight: float32 cannot carry it"):
        fast = make_engine("fast", overflowing, device="cpu")  # named at load (fast/carry.py)
    with pytest.raises(EngineOutputError, match=r"fast-cpu-float32: non-finite output, first at layer 0, point "
                                                r"ffn_out: NaN .*; logits: NaN at \[0, 0\]"):
        fast.logits(ids)
    w = TraceWriter("fast", ids)
    with pytest.raises(EngineOutputError, match="first at layer 0, point ffn_out"):
        fast.logits(ids, trace=w)  # traced: stopped at the point itself
    assert [(r["point"], r["layer"]) for r in w.records] == [("inp_scaled", -1), ("attn_out", 0)]  # all finite
    with pytest.raises(EngineOutputError, match=r"first at layer 0, point ffn_out.*generate: request 0, step 0"):
        fast.generate_full([ids], 3)


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    """``g4h ARGV`` in this process: (exit status, non-empty stderr lines)."""
    capsys.readouterr()
    rc = g4h(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, [ln for ln in err.splitlines() if ln.strip()]


def test_cli_logits_trace_generate_exit_1_with_the_point(overflowing, tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text("[2, 5, 7]")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [2, 5, 7]}\n')
    runs = [("logits", "--prompt-ids", str(prompt), "--out", str(tmp_path / "o.npy")),
            ("trace", "--prompt-ids", str(prompt), "--out", str(tmp_path / "t.jsonl")),
            ("generate", "--prompts", str(prompts), "--max-new-tokens", "2", "--out", str(tmp_path / "g.jsonl"))]
    for cmd, *rest in runs:
        rc, lines = run(capsys, cmd, "--model", str(overflowing), "--engine", "fast", "--device", "cpu", *rest)
        assert rc == 1, lines
        assert lines[-1].startswith("g4h: engine failed: engine fast-cpu-float32: non-finite output, first at "
                                    "layer 0, point ffn_out"), (cmd, lines)
    assert not any((tmp_path / f).exists() for f in ("o.npy", "t.jsonl", "g.jsonl"))  # no output written


def test_cmd_engine_located_through_its_trace_file(tiny_gguf, tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text("[2, 5, 7]")
    rc, lines = run(capsys, "logits", "--model", str(tiny_gguf), "--engine", nan_engine(1), "--prompt-ids",
                    str(prompt), "--out", str(tmp_path / "o.npy"))
    assert rc == 1 and "first at layer 1, point ffn_out: its sum is NaN; logits: NaN at [0, 0]" in lines[-1], lines
    rc, lines = run(capsys, "trace", "--model", str(tiny_gguf), "--engine", nan_engine(0), "--prompt-ids",
                    str(prompt), "--out", str(tmp_path / "t.jsonl"))
    assert rc == 1 and "first at layer 0, point ffn_out" in lines[-1], lines


def test_parity_fails_the_engine_with_the_point(tiny_gguf, tmp_path):
    from gemma4_harness.harness.parity import run as run_parity

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [2, 5, 7, 11]}\n')
    data, status = run_parity(models=[str(tiny_gguf)], against=[nan_engine(1)], out=str(tmp_path),
                              prompts=prompts, quiet=True)
    checks = {c["gate"]: c for case in data["cases"] for c in case["checks"] if c["gate"].endswith(".runs")}
    assert status == 1, data["verdict"]
    bad = checks["reference~cmd.runs"]
    assert not bad["pass"] and "non-finite output, first at layer 1, point ffn_out" in bad["got"], bad
    # the same stub without the NaN passes every gate: test_cmd_engine.test_parity_against_stub_passes...


def test_compare_of_a_nan_file(tmp_path, capsys):
    """The engine's file holds a NaN: the engine failed (1); the oracle's does: bad input (2). Was a traceback."""
    good, bad = np.zeros((3, 8)), np.zeros((3, 8))
    bad[1, 2] = np.nan
    np.save(tmp_path / "good.npy", good)
    np.save(tmp_path / "bad.npy", bad)
    rc, lines = run(capsys, "compare", str(tmp_path / "bad.npy"), str(tmp_path / "good.npy"))
    assert rc == 1 and lines == [f"g4h: engine failed: {tmp_path / 'bad.npy'}: logits are not finite: NaN at [1, 2] "
                                 "(1 of 24 values NaN/Inf)"]
    rc, lines = run(capsys, "compare", str(tmp_path / "good.npy"), str(tmp_path / "bad.npy"))
    assert rc == 2 and len(lines) == 1 and "bad.npy: logits are not finite: NaN at [1, 2]" in lines[0]


def test_reference_overflow_is_bad_input_and_checks_are_exact():
    class Overflowing:
        name = "reference"

        def logits(self, ids, trace=None):
            x = np.full((len(ids), 4), 1e308)
            for layer in range(3):
                if trace is not None:
                    trace("l_out", layer, x)
                x = x * 10.0 if layer == 1 else x
            return x

    with np.errstate(over="ignore"), pytest.raises(ModelOverflow, match="first at layer 2, point l_out: [+]Inf"):
        CheckedEngine(Overflowing(), "reference").logits([1, 2])
    check_logits("e", np.array([[0.0, -3e38, 3e38]]))  # extreme but finite: passes
    for v in (np.nan, np.inf, -np.inf):
        with pytest.raises(EngineOutputError):
            check_logits("e", np.array([[0.0, v]]))
    seen = []
    FiniteTrace(lambda p, layer, a: seen.append(p), "e")("attn_out", 0, np.ones((2, 3)))
    assert seen == ["attn_out"]


def test_the_reference_many_forwards_are_checked_too():
    """``logits_chains`` (the parity job's passes, :mod:`harness.parity.checks.oracle_pass`) goes through the same
    check: a non-finite trace point stops it at the point, non-finite logits name the forward."""
    from gemma4_harness.reference.batch import Chain

    class Overflowing:
        name = "reference"

        def logits_chains(self, chains):
            out = []
            for c in chains:
                x = np.full((len(c.calls[0]), 4), 1e308)
                for layer in range(3):
                    for t in c.traces or ():
                        if t is not None:
                            t("l_out", layer, x)
                    x = x * 10.0 if layer == 1 else x
                out.append([x])
            return out

    seen = []
    with np.errstate(over="ignore"), pytest.raises(ModelOverflow, match="first at layer 2, point l_out: [+]Inf"):
        CheckedEngine(Overflowing(), "reference").logits_chains([Chain([[1, 2]], traces=[
            lambda p, layer, a: seen.append(layer)])])
    assert seen == [0, 1]  # the caller's trace saw the finite points
    with pytest.raises(ModelOverflow, match="forward 1"):
        CheckedEngine(_NanSecond(), "reference").logits_chains([Chain([[1]]), Chain([[2]])])


class _NanSecond:
    """Chains' logits: finite for the first chain, NaN for the others."""
    name = "reference"

    def logits_chains(self, chains):
        return [[np.zeros((len(c.calls[0]), 4)) if i == 0 else np.full((len(c.calls[0]), 4), np.nan)]
                for i, c in enumerate(chains)]
