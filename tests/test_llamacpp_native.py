"""The native llama.cpp variant of ``g4h bench`` (``--engines llamacpp-native``): its own cache key (flags and this
CPU), a build that only bench asks for, and a worker that really loads the variant's libraries.

No test compiles the variant (about as long as the portable build): a stand-in folder holding the portable build's
libraries, with a stamp, is the "native build" here, which is enough to prove that the libraries come from the
folder the bench names (an empty folder makes the worker fail to load).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from servers import require_llamacpp

from gemma4_harness.harness.bench import BenchOptions, bench
from gemma4_harness.harness.bench.run import BenchPlan
from gemma4_harness.harness.core.workers import EngineCrashed
from gemma4_harness.harness.engines.llamacpp import LlamaCppEngine
from gemma4_harness.harness.engines.llamacpp import build as lb
from gemma4_harness.harness.engines.llamacpp import native


def test_native_key_is_its_own_and_names_the_cpu(monkeypatch, tmp_path):
    root = native.native_build_root(tmp_path)
    assert root.parent == tmp_path and "-native-" in root.name and root != lb.build_root([], tmp_path)
    assert "-DGGML_NATIVE=ON" in native.NATIVE_FLAGS and "-DGGML_NATIVE=OFF" not in native.NATIVE_FLAGS
    monkeypatch.setattr(native, "cpu_model", lambda: "model name: another CPU\nflags: sse2")
    assert native.native_build_root(tmp_path) != root  # a cache shared between machines: one build per CPU
    assert native.native_lib_dir(tmp_path) is None


def test_only_a_bench_engine_with_a_gguf_builds_it(monkeypatch, tmp_path):
    """The build is asked for by the bench's llamacpp-native alone, and only once it has a file to run."""
    import gemma4_harness.harness.bench.models as bm

    called = []
    monkeypatch.setattr(bm, "ensure_native_built", lambda *a, **k: called.append(1) or tmp_path)
    src = type("Src", (), {"shape": None, "gguf": None, "layers": None})()
    with pytest.raises(Exception, match="needs a GGUF"):
        bm.make_bench_engines("llamacpp-native", src, ["float32"], "cpu", 1)
    assert called == []


def _stand_in(cache: Path) -> Path:
    """The portable build's libraries in the native variant's folder, with a stamp: what ensure_native_built finds."""
    portable = lb.ensure_built()
    root = native.native_build_root(cache)
    (root / "lib").mkdir(parents=True)
    libs = sorted(p.name for p in portable.lib_dir.iterdir() if p.name.startswith(("libllama", "libggml")))
    for name in libs:
        shutil.copy2(portable.lib_dir / name, root / "lib" / name)
    (root / "stamp.json").write_text(json.dumps({"libs": libs}))
    return root / "lib"


def test_the_worker_loads_the_named_libraries(tmp_path):
    if not require_llamacpp():
        pytest.skip("opted out with G4H_SKIP_LLAMACPP=1")
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import builtin_specs

    gguf = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b")).gguf["Q8_0"]
    lib = _stand_in(tmp_path)
    assert native.ensure_native_built(tmp_path) == lib  # found: no build
    assert LlamaCppEngine(gguf, lib_dir=lib).info()["n_vocab"] > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EngineCrashed):
        LlamaCppEngine(gguf, lib_dir=empty).info()


def test_bench_times_both_builds_side_by_side(monkeypatch, tmp_path):
    if not require_llamacpp():
        pytest.skip("opted out with G4H_SKIP_LLAMACPP=1")
    import gemma4_harness.harness.bench.models as bm
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import builtin_specs

    gguf = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b")).gguf["Q8_0"]
    lib = _stand_in(tmp_path / "cache")
    monkeypatch.setattr(bm, "ensure_native_built", lambda: lib)
    plan = BenchPlan(engines=["llamacpp", "llamacpp-native"], pp=0, tg=2, reps=2, warmup=0)
    data, status, _ = bench(BenchOptions(model=str(gguf), engines=["llamacpp", "llamacpp-native"], plan=plan,
                                         out=str(tmp_path / "out")), lambda m: None)
    assert status == 0 and not data["skipped"]
    rows = {r["engine"]: r for r in data["rows"]}
    assert rows["llamacpp"]["mean_tok_s"] > 0 and rows["llamacpp-native"]["mean_tok_s"] > 0
    assert data["engine_builds"]["llamacpp-native"]["libraries"] == str(lib)
    assert "AVX2" in data["engine_builds"]["llamacpp"]["system_info"]
