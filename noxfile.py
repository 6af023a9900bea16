"""Sessions for gemma4-harness.

    nox -s parity          # build the synthetic checkpoints, run every parity gate, write reports/<ts>-parity/
    nox -s tests           # the whole pytest suite, slow tests included
    nox -s tests -- -m "not slow"   # the quick subset

Both sessions install the CPU build of torch pinned to 2.13.0 first, so pip
never pulls a multi-GB CUDA build; on a GPU machine install your own torch
into your environment and use ``pip install -e .[test]`` directly instead.
Arguments after ``--`` go to ``g4h parity`` / ``pytest`` unchanged.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

# The CPU build of torch 2.13.0 lies on this project's CI machines; elsewhere set G4H_TORCH
# to the requirement to install (e.g. a CPU wheel), or pip takes the default CUDA build.
TORCH_PIN = os.environ.get("G4H_TORCH", "torch==2.13.0")
# The oracle's version is part of what a parity run means: pin the one the gates were set with.
ORACLE_PIN = "transformers==5.23.0"


def _install(session: nox.Session) -> None:
    """torch first (pinned CPU build), then the project with its test extras, editable."""
    session.install(TORCH_PIN)
    session.install("-e", ".[test]", ORACLE_PIN)


@nox.session
def parity(session: nox.Session) -> None:
    """Parity run: float64 reference vs transformers fp32 eager on every case and prompt set, plus real Gemma 3 270M."""
    _install(session)
    session.run("g4h", "parity", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The pytest suite (default: everything, slow tests included); posargs go to pytest."""
    _install(session)
    session.run("pytest", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Throughput benchmarks (pytest --bench); writes reports/<ts>-bench/. llama.cpp is included when
    ``nox -s llamacpp`` has built its wheel into .g4h-cache/wheels (otherwise it is listed as skipped)."""
    _install(session)
    wheels = ".g4h-cache/wheels"
    built = sorted(f for f in os.listdir(wheels) if f.startswith("llama_cpp_python-0.3.36")) if os.path.isdir(wheels) else []
    if built:
        session.install(os.path.join(wheels, built[-1]))
    session.run("pytest", "--bench", "-m", "bench", "-s", *session.posargs)


LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"
LLAMA_CPP_CMAKE = ("-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF "
                   "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF")


@nox.session
def llamacpp(session: nox.Session) -> None:
    """llama.cpp as an engine: builds llama-cpp-python once into .g4h-cache/wheels (about 5-10 min on
    2 cores), reuses it afterwards, then runs its tests and the parity job (which then includes llama.cpp)."""
    _install(session)
    wheels = ".g4h-cache/wheels"
    os.makedirs(wheels, exist_ok=True)
    if not any(f.startswith("llama_cpp_python-0.3.36") for f in os.listdir(wheels)):
        session.run("pip", "wheel", LLAMA_CPP_PIN, "--no-deps", "-w", wheels, env={"CMAKE_ARGS": LLAMA_CPP_CMAKE})
    session.install("--find-links", wheels, LLAMA_CPP_PIN)
    session.run("pytest", "tests/test_llamacpp.py", *session.posargs)
    session.run("g4h", "parity", "--no-real")
