"""The memory plan: estimates from the tensor table, a one-line stop when short, the peak sampler."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from clitools import assert_one_line_error

from gemma4_harness.harness import synth
from gemma4_harness.harness.core import memory, memory_machine, memory_rules
from gemma4_harness.harness.core.cases import builtin_specs
from gemma4_harness.harness.core.paths import REPO_ROOT
from gemma4_harness.harness.engines import make_engine
from gemma4_harness.harness.engines.fast import FastEngine
from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.checks.pair import GREEDY_NEW_TOKENS
from gemma4_harness.harness.synth.scale import write_scale_gguf
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weights import load_model

#: E2B with a real vocabulary under one tiny layer (``[config]`` overrides): 18 MB at Q8_0, while the logits
#: of :data:`PROMPT` alone need hundreds of MB.
WIDE_VOCAB = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "head_dim": 32,
              "global_head_dim": 64, "hidden_size_per_layer_input": 0}


#: 64 tokens: the reference's logits of this prompt are [64, 262144] float64, 134 MB, held about three times.
PROMPT = [2 + 7 * i for i in range(64)]


@pytest.fixture(scope="module")
def wide_vocab_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    return write_scale_gguf("e2b", d / "wide.gguf", layers=1, fmt="q8_0", overrides=WIDE_VOCAB)


def _e2b_info(form="Q8_0"):
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    return memory.model_info(built.hf_dir if form == "hf" else built.gguf[form])


def test_plan_terms_sum_and_read_no_tensor():
    info = _e2b_info()
    for engine in memory.ENGINES:
        p = memory.plan(engine, info, tokens=32)
        assert p.need_bytes == sum(p.breakdown.values()) > 0
        assert p.fits  # a tiny case fits any machine that runs the tests
    packed = memory.plan("fast", info, weights="packed").breakdown
    dequant = memory.plan("fast", info, weights="dequantized").breakdown
    assert packed["packed weights"] > 0 and packed["weights"] < dequant["weights"]
    assert memory.plan("fast", info, dtype="bfloat16").breakdown["weights"] < dequant["weights"]
    once = memory.plan("reference", info, cache_bytes=10**12).breakdown
    many = memory.plan("reference", info, cache_bytes=10**12, new_tokens=4).breakdown
    assert once["weight cache"] == 0 < many["weight cache"]  # one forward caches nothing


def test_reference_estimate_scales_with_the_model_not_the_file():
    """The E2B shape at full size: the reference's estimate stays within a few GB (it streams), the fast
    engine's dequantized fp32 weights are ~4 bytes per parameter."""
    from gemma4_harness.fast.shapes import RandomWeights, load_shape, param_counts

    cfg = load_shape("e2b")
    info = memory.ModelInfo.from_loaded("e2b", cfg, RandomWeights(cfg))
    ref = memory.plan("reference", info, tokens=16)
    assert ref.need_bytes < 3 * memory.GB
    fast = memory.plan("fast", info, tokens=16)
    assert fast.breakdown["weights"] >= 4 * (param_counts(cfg)["total"] - 10**6)


def test_layer_outer_pass_holds_one_expert_not_the_stacks():
    """The 26B-A4B shape: a layer-outer pass (``layer_held``, :func:`reference.batch.forward_chains`) holds a layer's
    dense matrices and one expert of each stack (it reads each expert alone and drops it), about 0.5 GB of float64,
    not the layer's two stacks (6.1 GB); a forward call by call still counts the stacks (it may read every expert)."""
    from gemma4_harness.fast.shapes import RandomWeights, load_shape

    cfg = load_shape("26b-a4b")
    info = memory.ModelInfo.from_loaded("26b-a4b", cfg, RandomWeights(cfg))
    held = memory.plan("reference", info, tokens=650, layer_held=True, forwards=2).breakdown["weights in use"]
    assert held < 1 * memory.GB
    assert memory.plan("reference", info, tokens=650).breakdown["weights in use"] > 6 * memory.GB


def test_line_is_one_line_with_need_available_and_advice():
    info = _e2b_info()
    p = memory.plan("fast", info)
    p.fits, p.available_bytes, p.advice = False, 1000, ["--weights packed", "--layers 2"]
    line = p.line()
    assert "\n" not in line and "GB" in line and "--weights packed or --layers 2" in line


def test_advice_names_options_that_fit(monkeypatch):
    info = _e2b_info()
    need = memory.plan("fast", info).need_bytes
    runtime = memory_rules.RUNTIME_BYTES["torch"]
    monkeypatch.setattr(memory, "available_memory", lambda *a, **k: (need - runtime - 1, "MemAvailable"))
    p = memory.plan("fast", info)
    assert not p.fits and p.advice
    for opt in p.advice:  # each piece of advice is checked with the same estimate
        if opt == "--weights packed":
            assert memory.plan("fast", info, weights="packed").need_bytes < need
        if opt.startswith("--layers"):
            assert int(opt.split()[1]) < info.cfg.n_layer


def test_guarded_turns_allocation_failures_into_one_line():
    class Engine:
        engine = "fast"
        memory_plan = None

        @memory.guarded
        def run(self, exc):
            raise exc

    try:
        np.empty(1 << 58, dtype=np.uint8)  # numpy's own allocation failure (_ArrayMemoryError, a MemoryError)
    except MemoryError as e:
        numpy_failure = e
    for exc in (MemoryError(), numpy_failure,
                RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                             "you tried to allocate 17179869184 bytes.")):
        with pytest.raises(memory.NotEnoughMemory) as e:
            Engine().run(exc)
        assert "\n" not in str(e.value) and "try" in str(e.value)
    with pytest.raises(RuntimeError, match="something else"):
        Engine().run(RuntimeError("something else"))


def _run_limited(args: list[str], headroom_mb: int, limit: str = "AS") -> subprocess.CompletedProcess:
    """``g4h ARGS`` in a child whose address space (``limit="AS"``: ``RLIMIT_AS``, what ``ulimit -v`` sets) or
    private data (``"DATA"``: ``RLIMIT_DATA``, ``ulimit -d``; the stack is not part of it) is limited to what it
    has after its imports + headroom."""
    code = textwrap.dedent(f"""
        import resource, sys
        import numpy, gguf, gemma4_harness.reference, gemma4_harness.harness.engines.reference, gemma4_harness.harness.cli.logits
        from gemma4_harness.harness.cli import main
        a = numpy.ones((256, 256))
        (a @ a).sum()  # OpenBLAS starts its threads and buffers now: under the limit their failure is a crash
        field = {{"AS": "VmSize:", "DATA": "VmData:"}}[{limit!r}]
        vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field)][0]
        limit = vm + {headroom_mb} * 2**20
        resource.setrlimit(resource.RLIMIT_{limit}, (limit, limit))
        sys.exit(main({args!r}))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=300)


def _logits_limited(model, tmp_path, headroom_mb: int, limit: str = "AS"):
    ids = tmp_path / "ids.json"
    ids.write_text(str(PROMPT))
    out = tmp_path / "out.npy"
    proc = _run_limited(["logits", "--model", str(model), "--engine", "reference", "--prompt-ids", str(ids),
                         "--out", str(out)], headroom_mb, limit)
    return proc, out


@pytest.mark.slow
def test_a_low_address_space_limit_stops_with_one_line(wide_vocab_gguf, tmp_path):
    proc, out = _logits_limited(wide_vocab_gguf, tmp_path, headroom_mb=256)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "not enough memory for the reference engine" in lines[0] and "RLIMIT_AS" in lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_an_allocation_that_fails_anyway_stops_with_one_line(wide_vocab_gguf, tmp_path):
    """A limit the plan does not read (``RLIMIT_DATA``): the plan fits, the allocation fails inside the engine
    (numpy's MemoryError), and that too ends in one line and exit 2, with no traceback and no output.

    (Under a tight ``RLIMIT_AS`` instead, the main thread's stack cannot grow either, and the process may die of
    SIGSEGV wherever it stands: no handler can turn that into a line, so the plan, which reads ``RLIMIT_AS``, is
    what must stop it first.)"""
    proc, out = _logits_limited(wide_vocab_gguf, tmp_path, headroom_mb=256, limit="DATA")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "out of memory in the reference engine" in lines[0] and "Unable to allocate" in lines[0], lines[0]
    assert "the estimate was" in lines[0] and "; try " in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_the_same_run_fits_with_room(wide_vocab_gguf, tmp_path):
    proc, out = _logits_limited(wide_vocab_gguf, tmp_path, headroom_mb=2048)
    assert proc.returncode == 0, proc.stderr
    logits = np.load(out)
    assert np.isfinite(logits).all() and logits.std() > 0.1  # the scale fixture's logits are spread out


def _engines_of(built):
    """(engine, model path, options) of every engine that plans its memory, on a built case."""
    gguf_q8 = built.gguf["Q8_0"]
    return [("reference", gguf_q8, {}), ("reference", built.hf_dir, {"cache_gb": 0}),
            ("fast", gguf_q8, {"device": "cpu", "weights": "dequantized"}),
            ("fast", gguf_q8, {"device": "cpu", "weights": "packed", "dtype": "bfloat16"}),
            ("transformers", built.hf_dir, {})]


def test_the_test_hook_decides_whether_each_engine_loads(monkeypatch):
    """``G4H_MEMORY_AVAILABLE_GB`` (a test hook) stands for the machine's memory: none at all stops every
    engine before it loads, with one line naming the need, what is available and what to try; plenty lets
    the same engines load."""
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, "0")
    for name, path, opts in _engines_of(built):
        with pytest.raises(memory.NotEnoughMemory) as e:
            make_engine(name, path, **opts)
        line = str(e.value)
        assert "\n" not in line and f"not enough memory for the {name}" in line, line
        assert re.search(r"it needs about \d+\.\d GB \(", line), line
        assert re.search(r"\d+\.\d GB available \(G4H_MEMORY_AVAILABLE_GB\)", line), line
        assert "; try " in line or "; no " in line, line
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, "1000")
    for name, path, opts in _engines_of(built):
        eng = make_engine(name, path, **opts)
        assert eng.memory_plan.fits and eng.memory_plan.available_from == memory_machine.AVAILABLE_ENV
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, "lots")
    with pytest.raises(InputError, match="G4H_MEMORY_AVAILABLE_GB"):
        memory.available_memory()


def test_a_loaded_engine_does_not_count_its_weights_twice(monkeypatch):
    """After loading, the fast engine plans each call with its built weights as held: a machine that had room
    for the weights and a forward still has room for the forward."""
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    eng = make_engine("fast", built.gguf["F32"], device="cpu", weights="dequantized")
    weights = eng.memory_plan.breakdown["weights"]
    first = eng.memory_plan
    # What is left once the weights are built: the plan's need less the weights and the runtime, and a little.
    left = first.need_bytes - weights - first.already_bytes + 10**5
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, str(left / memory.GB))
    eng.logits([2, 5, 7])
    assert eng.memory_plan.fits and eng.memory_plan.already_bytes >= weights


@pytest.mark.parametrize("stem, form", [("31b", "Q4_0"), ("26b-a4b", "Q8_0"), ("e2b", "Q8_0")])
def test_a_loaded_packed_engine_does_not_count_its_packed_weights_twice(monkeypatch, stem, form):
    """The fast engine with its quantized matrices packed (``--oracle fast``'s float32 oracle, issue 38: its plan
    of a call asked for the 31B's 17.3 GB of packed weights a second time): after loading, its packed weights are
    held like its dense ones, for its own calls and for an engine that shares its model; a call asks only for
    what is new, and a machine with less than that still stops it with one line."""
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == stem))
    eng = make_engine("fast", built.gguf[form], device="cpu", weights="packed")
    first = eng.memory_plan
    weights = first.breakdown["weights"] + first.breakdown["packed weights"]
    assert first.breakdown["packed weights"] > 10**5  # more than the margin below: counted twice, it does not fit
    left = first.need_bytes - weights - first.already_bytes + 10**5
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, str(left / memory.GB))
    eng.logits([2, 5, 7])
    assert eng.memory_plan.fits and eng.memory_plan.already_bytes >= weights
    cfg, W = load_model(built.gguf[form], cache_bytes=0)
    twin = FastEngine.from_model(cfg, W, device="cpu", weights="packed", share=eng)
    assert twin.memory_plan.fits and twin.model is eng.model
    new = eng.memory_plan.need_bytes - eng.memory_plan.already_bytes
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, str((new - 10**4) / memory.GB))
    with pytest.raises(memory.NotEnoughMemory) as e:
        eng.logits([2, 5, 7])
    assert "\n" not in str(e.value) and "not enough memory for the fast float32 packed engine" in str(e.value)


def test_oracle_fast_stops_before_any_pair_when_its_largest_call_cannot_fit(wide_vocab_gguf, tmp_path, monkeypatch):
    """``--oracle fast``: the oracle plans the job's largest call (the longest prompt and its greedy tokens) once it
    is loaded; a machine with room for the reference, the oracle's weights and a one-token call, but not for that
    call, stops the case with one line before any pair's engine starts (issue 38: the refusal came after minutes
    of work)."""
    prompt = [2 + 7 * i for i in range(256)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt_ids": prompt}) + "\n")
    ref = make_engine("reference", wide_vocab_gguf).memory_plan
    eng = make_engine("fast", wide_vocab_gguf, device="cpu", dtype="float32")
    load = eng.memory_plan
    eng.plan_ahead(len(prompt) + GREEDY_NEW_TOKENS)
    call = eng.memory_plan
    room = max(p.need_bytes - p.already_bytes for p in (ref, load)) + 10**6
    assert room < call.need_bytes - call.already_bytes  # the long prompt's logits: what does not fit
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, str(room / memory.GB))
    stub = shlex.join([sys.executable, str(REPO_ROOT / "tests" / "cmd_stub.py")])
    data, status = run_parity(models=[str(wide_vocab_gguf)], against=[f"cmd:{stub}"], out=str(tmp_path / "out"),
                              prompts=prompts, quiet=True, oracle="fast")
    case = data["cases"][0]
    assert status == 2 and case["checks"] == [], case
    assert "not enough memory for the fast float32 packed engine" in case["error"], case["error"]


def test_packed_weights_held_and_mapped_count_once(monkeypatch):
    """Against ``RLIMIT_AS`` the packed weights mapped from the file are already in the address space; a loaded
    engine's held weights include the same bytes, which count once."""
    info = _e2b_info()
    monkeypatch.setattr(memory, "available_memory", lambda *a, **k: (10**12, "RLIMIT_AS"))
    b = memory.plan("fast", info, weights="packed").breakdown
    assert b["packed weights"] > 0
    held = b["weights"] + b["packed weights"]
    p = memory.plan("fast", info, weights="packed", held=held)
    assert p.already_bytes == b["runtime"] + held < p.need_bytes


@pytest.mark.slow
def test_ulimit_v_stops_the_fast_engine_with_one_line(wide_vocab_gguf, tmp_path):
    """``ulimit -v`` in the shell that starts ``g4h``: the fast engine's plan reads the limit (RLIMIT_AS) and
    stops with one line before it builds its weights."""
    probe = subprocess.run([sys.executable, "-c", "import torch, gemma4_harness.harness.cli, gemma4_harness.harness.cli.logits, gemma4_harness.harness.engines.fast;"
                            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmSize:')][0])"],
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=True)
    limit_kb = int(probe.stdout.strip()) + 150 * 1024  # what the imports take, and 150 MB
    ids = tmp_path / "ids.json"
    ids.write_text(str(PROMPT))
    out = tmp_path / "out.npy"
    cmd = (f"ulimit -v {limit_kb} && exec {shlex.quote(sys.executable)} -m gemma4_harness.harness.cli logits --model "
           f"{shlex.quote(str(wide_vocab_gguf))} --engine fast --device cpu --prompt-ids {ids} --out {out}")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    line = assert_one_line_error(proc, str(wide_vocab_gguf))
    assert "not enough memory for the fast float32" in line and "(RLIMIT_AS)" in line, line
    assert not out.exists()


def test_peak_memory_sees_an_allocation():
    with memory_machine.PeakMemory(interval=0.001) as pm:
        before = pm.peak_anon
        a = np.ones(50_000_000)  # 400 MB, touched
        a.sum()
    assert pm.peak_anon - before > 300e6 and pm.peak_rss >= pm.peak_anon
    del a


def test_model_info_reads_headers_only():
    info = _e2b_info("hf")
    cfg, _ = load_model(info.path)
    assert info.form == "hf" and info.cfg.n_layer == cfg.n_layer
    assert info.tensors["token_embd.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert info.file_bytes > 0
