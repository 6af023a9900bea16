"""What a full-depth job needs to finish on an ordinary machine (issue 38): the traced tensors it keeps beside the
model (:mod:`harness.traces.store`), and a llama.cpp worker deadline that follows the work
(:func:`harness.engines.llamacpp.work_deadline`, ``--engine-timeout``).

The 31B shape at full depth (17.3 GB, Q4_0) with ``--oracle fast`` was judged ``ENGINE FAILED`` on a correct
llama.cpp: its job held about 18 GB of traced tensors as float64 copies beside the file, llama.cpp read its weights
from disk on every token, and its worker ran past a fixed 600 s with every measured figure within its gate.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness.engines.llamacpp import (DEADLINE_BASE_S, DEADLINE_FLOPS, DEADLINE_READ_BYTES_S,
                                                     work_deadline)
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.harness.traces.store import TensorStore


def _maps() -> str:
    return Path("/proc/self/maps").read_text()


def test_a_spilled_trace_is_the_same_bits_and_no_anonymous_copy(tmp_path):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((7, 33)).astype(np.float32), rng.standard_normal((5, 11)),
              rng.standard_normal((4, 9)).astype(np.float16), np.arange(12, dtype=np.int32).reshape(3, 4)]
    kept = TraceWriter("fast", [2, 3], keep_tensors=True, store=TensorStore(budget=0, folder=tmp_path))
    held = TraceWriter("fast", [2, 3], keep_tensors=True, store=TensorStore(budget=1 << 30, folder=tmp_path))
    for w in (kept, held):
        for i, a in enumerate(arrays):
            w("l_out", i, a)
    a_tr, b_tr = kept.trace(), held.trace()
    for i, a in enumerate(arrays):
        want = np.asarray(a, dtype=np.float64)
        for tr in (a_tr, b_tr):
            got = tr.tensor("l_out", i)
            assert got.dtype == np.float64 and np.array_equal(got, want)
    # float32 stays float32 (exact, half the bytes); any other dtype becomes float64, as before
    assert [kept.tensors[f"l_out.{i}"].dtype for i in range(4)] == [np.float32, np.float64, np.float64, np.float64]
    assert all(isinstance(t, np.memmap) for t in kept.tensors.values())  # in files the kernel may drop and reread
    assert not any(isinstance(t, np.memmap) for t in held.tensors.values())
    files = sorted(tmp_path.glob("*.npy"))
    assert len(files) == 4 and str(files[0]) in _maps()


def test_files_go_when_their_tensors_go_and_the_budget_counts_live_bytes(tmp_path):
    store = TensorStore(budget=1000, folder=tmp_path)
    a = store.keep(np.zeros(100, np.float64))  # 800 bytes: in memory
    assert store.in_memory == 800 and store.spilled == 0
    b = store.keep(np.zeros(100, np.float64))  # would pass 1000: to a file
    assert store.spilled == 800 and len(list(tmp_path.glob("*.npy"))) == 1
    del b
    assert not list(tmp_path.glob("*.npy"))
    del a  # freed: the budget is free again, so a long-lived process (pytest) does not spill forever
    assert store.in_memory == 0
    store.keep(np.zeros(100, np.float64))
    assert store.spilled == 800


def test_the_deadline_follows_the_work():
    prompts = [[2] + [7] * 19 for _ in range(16)]
    gen = [{"op": "generate", "prompts": prompts, "max_new_tokens": 8, "batched": False, "top_n": 5}]
    small = work_deadline(gen, 50_000_000, 25_000_000)  # a small model: about the old fixed 600 s
    assert DEADLINE_BASE_S <= small < DEADLINE_BASE_S + 60
    # The 31B shape (17.3 GB, 30.7e9 parameters): each of the 16 prompts' prefill and 8 decode steps reads the file
    # once, and 448 tokens at 2 operations per parameter: the floors' time, above the ~800 s the worker was given
    # (and killed in) when the file did not fit beside the job.
    big = work_deadline(gen, 17_278_592_704, 30_700_000_000)
    reads, tokens = 1 + 16 + 16 * 8, 16 * (20 + 8)
    assert big == pytest.approx(DEADLINE_BASE_S + reads * 17_278_592_704 / DEADLINE_READ_BYTES_S
                                + tokens * 2 * 30_700_000_000 / DEADLINE_FLOPS)
    assert big > 3600
    batched = [dict(gen[0], batched=True)]
    assert work_deadline(batched, 17_278_592_704, 30_700_000_000) < big  # one decode step serves every prompt
    logits = [{"op": "logits", "ids": p, "trace": True} for p in prompts]
    assert work_deadline(logits, 17_278_592_704, 30_700_000_000) > work_deadline(logits[:1], 17_278_592_704,
                                                                                30_700_000_000)
    # a prefill in ubatches of 8 tokens: 3 llama_decode calls (3 reads of the file) for each 20-token prompt
    chunked = work_deadline(gen, 17_278_592_704, 30_700_000_000, n_ubatch=8)
    assert chunked - big == pytest.approx(16 * 2 * 17_278_592_704 / DEADLINE_READ_BYTES_S)


@pytest.mark.skipif(os.environ.get("G4H_SKIP_LLAMACPP", "") not in ("", "0"), reason="opted out: G4H_SKIP_LLAMACPP=1")
def test_engine_timeout_is_the_users_and_named(tmp_path):
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    gguf = synth.ensure_built(MODELS_DIR / "31b.toml").gguf["F32"]
    r = subprocess.run([sys.executable, "-m", "gemma4_harness", "parity", "--model", str(gguf), "--against",
                        "llamacpp", "--engine-timeout", "0.01", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert "llama.cpp worker ran past 0.01 s (--engine-timeout)" in last, last


@pytest.mark.skipif(os.environ.get("G4H_SKIP_LLAMACPP", "") not in ("", "0"), reason="opted out: G4H_SKIP_LLAMACPP=1")
@pytest.mark.parametrize("case", ["31b", "e2b"])
def test_a_context_fitted_to_the_work_gives_the_same_bits(case):
    """A worker's context is only as long as its work (rounded to 256 cells), not the engine's 1,024: the same logits,
    traces and streams, bit for bit, on a sliding-window case whose prompts pass its window (31b: window 16, prompts of up to 32 tokens) and on a
    KV-shared one (e2b)."""
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.harness.core.prompts import load_prompts
    from gemma4_harness.harness.engines.llamacpp import LlamaCppEngine
    gguf = synth.ensure_built(MODELS_DIR / f"{case}.toml").gguf["F32"]
    seqs = [p["prompt_ids"] for p in load_prompts()][:6]
    out = []
    for fit in (True, False):
        eng = LlamaCppEngine(gguf, threads=2, fit_context=fit)
        many = eng.logits_many(seqs, trace=True)
        gens = eng.generate_full(seqs, 6)
        out.append((many, [(g.tokens, g.top) for g in gens]))
    (a, ga), (b, gb) = out
    assert ga == gb
    for (za, ta), (zb, tb) in zip(a, b):
        assert np.array_equal(za, zb)
        assert [(p, layer) for p, layer, _ in ta] == [(p, layer) for p, layer, _ in tb]
        assert all(np.array_equal(x, y) for (_, _, x), (_, _, y) in zip(ta, tb))


@pytest.mark.parametrize("case", ["31b", "e2b"])
def test_rings_as_long_as_the_prompts_give_the_same_bits(case):
    """The fast oracle's prompt runs size each sliding layer's ring by the group's longest sequence, not the whole
    window (the 31B shape's window of 1,024 held 13.4 GB of rings for a group of 8 short prompts): the logits, traces,
    greedy streams and teacher-forced logits are the same bits as with whole-window rings."""
    import torch

    from gemma4_harness.fast import engine as fast_engine
    from gemma4_harness.fast.kvcache import RingStore
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.harness.engines.fast import FastEngine
    gguf = synth.ensure_built(MODELS_DIR / f"{case}.toml").gguf["F32"]
    model = FastEngine(gguf).model
    window = model.cfg.sliding_window
    prompts = [[2] + [5 + i for i in range(n)] for n in (0, 3, 6)]  # the longest with its stream: 15 < window 16
    assert max(len(p) for p in prompts) + 8 < window

    def run(bounded: bool):
        made = []
        orig = model.new_cache

        def new_cache(*a, **k):
            k["bounded"] = bounded and k.get("bounded", False)
            made.append(orig(*a, **k))
            return made[-1]
        model.new_cache = new_cache
        try:
            traces = [TraceWriter("fast", p, keep_tensors=True) for p in prompts]
            streams = fast_engine.prompt_runs(model, prompts, traces, new_tokens=8)
            forced = fast_engine.prompt_runs(model, prompts, forced=[[7, 8, 9]] * 3)
        finally:
            del model.new_cache
        rings = [s.capacity for c in made for s in c.stores.values() if isinstance(s, RingStore)]
        return streams, forced, [t.trace() for t in traces], rings

    (sa, fa, ta, ra), (sb, fb, tb, rb) = run(True), run(False)
    assert max(ra) < window and set(rb) == {window}
    for x, y in zip(sa + fa, sb + fb):
        assert torch.equal(x.logits, y.logits)
        assert (x.stream is None) == (y.stream is None)
        if x.stream is not None:
            assert x.stream.tokens == y.stream.tokens and x.stream.top == y.stream.top
        if x.forced is not None:
            assert torch.equal(x.forced, y.forced)
    for x, y in zip(ta, tb):
        assert [(r["point"], r["layer"]) for r in x.records] == [(r["point"], r["layer"]) for r in y.records]
        assert all(np.array_equal(x.tensor(r["point"], r["layer"]), y.tensor(r["point"], r["layer"]))
                   for r in x.records)


@pytest.mark.parametrize("extra", [0, 2])
def test_a_sequence_longer_than_its_bounded_ring_is_refused(extra):
    """A ring bounded below its window (``max_tokens``) refuses the token that would overwrite a position the
    queries still see, on the decode path and the prefill path alike, instead of attending to the wrong keys; one
    as long as the window (unbounded) wraps as it should."""
    import torch

    from gemma4_harness.fast.kvcache import RingStore
    window, bound = 16, 4

    def kv(T):
        return torch.ones(T, 1, 2), torch.ones(T, 1, 2)

    ring = RingStore(window, 1, 2, True, 1, "cpu", torch.float32, extra=extra, max_tokens=bound)
    assert ring.bounded and ring.capacity == bound
    for pos in range(bound):  # decode, one token a step, up to the bound
        ring.attend_and_append(0, pos, *kv(1), derive_k=None)
    with pytest.raises(ValueError, match="do not fit a ring bounded to 4"):
        ring.attend_and_append(0, bound, *kv(1), derive_k=None)
    prefill = RingStore(window, 1, 2, True, 1, "cpu", torch.float32, extra=extra, max_tokens=bound)
    prefill.attend_and_append(0, 0, *kv(3), derive_k=None)
    with pytest.raises(ValueError, match="do not fit"):
        prefill.attend_and_append(0, 3, *kv(2), derive_k=None)
    whole = RingStore(window, 1, 2, True, 1, "cpu", torch.float32, extra=extra)
    assert not whole.bounded
    for pos in range(window + extra + 3):  # past the whole window: wraps
        k, _, p = whole.attend_and_append(0, pos, *kv(1), derive_k=None)
    assert p.tolist() == list(range(pos + 1 - window - extra, pos + 1))


def test_a_release_while_the_store_spills_does_not_hang(tmp_path, monkeypatch):
    """A kept array's release runs from a weakref finalizer, which the garbage collector may fire in the thread that
    is inside :meth:`TensorStore.keep` (an allocation there starting a collection): the store must not wait on
    itself. Here the collection is made to happen where keep makes its spill folder."""
    import gc
    import threading

    from gemma4_harness.harness.traces import store as store_mod
    store = TensorStore(budget=1000)
    cycle: list = [store.keep(np.zeros(10))]  # 80 bytes in memory
    cycle.append(cycle)  # only the collector frees it
    del cycle

    def temp_dir(prefix, dir=None):
        gc.collect()  # the kept array's finalizer runs here, inside keep
        return tmp_path
    monkeypatch.setattr(store_mod, "temp_dir", temp_dir)
    done = threading.Event()

    def spill():
        store.keep(np.zeros(200))  # 1600 bytes > the budget: to a file
        done.set()
    threading.Thread(target=spill, daemon=True).start()
    assert done.wait(30), "TensorStore.keep waited on its own lock"
    assert store.in_memory == 0 and store.spilled == 1600


def test_a_spill_that_cannot_be_written_keeps_the_tensors_in_memory(tmp_path, capfd):
    """A folder that cannot take the files (a full disk, here a file where the folder should be) is no failure of
    the job: the tensors stay in memory, the same bits, and one line says why."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    store = TensorStore(budget=0, folder=blocked)
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(7)]
    kept = [store.keep(a) for a in arrays]
    assert all(not isinstance(k, np.memmap) and np.array_equal(k, a) for k, a in zip(kept, arrays))
    assert kept[0].dtype == np.float32 and store.spilled == 0 and store.in_memory == 15 * 4 + 7 * 8
    assert "not-a-folder" in store.spill_error
    assert capfd.readouterr().err.count("traced tensors stay in memory") == 1


def test_spills_go_to_disk_when_the_temporary_folder_is_memory(tmp_path, monkeypatch):
    """Where the temporary folder is a tmpfs (its files are memory) the spill folders go to the project cache."""
    import tempfile

    from gemma4_harness.harness.traces.store import spill_parent
    tmp = tmp_path / "tmp dir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("G4H_CACHE", str(tmp_path / "cache"))
    mounts = tmp_path / "mounts"
    on = str(tmp).replace(" ", "\\040")
    for fstype, want in (("tmpfs", tmp_path / "cache" / "traces"), ("ext4", tmp.resolve())):
        mounts.write_text(f"/dev/vda / ext4 rw 0 0\nnone {on} {fstype} rw 0 0\n")
        assert spill_parent(mounts) == want, fstype
    assert spill_parent(tmp_path / "no-such-table") == tmp.resolve()
