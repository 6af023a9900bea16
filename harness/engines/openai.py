"""The ``openai`` engine: a model behind an HTTP completion server (llama-server, llama-cpp-python, vLLM, any other).

Given ``openai:http://HOST:PORT/v1``, :class:`OpenAIEngine` finds out which server answers (its
*dialect*, :func:`detect_dialect`), takes the model name from ``/v1/models`` (or an override), and runs
greedy continuations with the top-N log-probabilities of every step, returning token ids. What each
dialect accepts and answers is in ``docs/server-dialects.md`` (observed on llama-server and
llama-cpp-python 0.3.36; vLLM written to its documented API, not run here). In short:

* ``llama-server``: ``POST /completion`` with the prompt as token ids, ``n_probs``, ``return_tokens``. It
  reports a step's log-probs only once the generated text ends in complete UTF-8 (its ``validate_utf8``): the
  other steps get an empty ``top`` entry, placed by replaying that rule over the token pieces
  (:meth:`OpenAIEngine._place_llama_server`). ``/tokenize``, ``/detokenize``, ``/apply-template``; no prompt
  log-probs.
* ``llama-cpp-python``: ``POST /v1/completions`` takes text prompts only (a token id list is a 500), and
  names tokens by their text. Prompts go as the server's own detokenization of the ids, checked to
  tokenize back to the same ids; generated texts are mapped back to ids through its tokenizer and
  checked. Stops at EOS. Prompt log-probs through ``echo``.
* ``vllm``: ``POST /v1/completions`` with token ids, ``return_tokens_as_token_ids`` (tokens named
  ``token_id:N``), ``ignore_eos``; prompt log-probs through ``prompt_logprobs``; ``/tokenize``, ``/detokenize``.
* ``openai`` (generic: transformers serve, any other server of OpenAI's API): ``POST /v1/completions`` with a text
  prompt and OpenAI's own fields only; text back, its tokens named by the oracle's (:meth:`OpenAIEngine._generic_ids`);
  no log-probs, no tokenizer.

Every greedy request lets the server stop at an end-of-generation token, as users run it; a stream that stops ends
with that token's id (:meth:`OpenAIEngine._end_with_eog`).

Only the standard library is used. Every failure is one line naming the URL, of one of two kinds:

* :class:`ServerError` (an :class:`~reference.errors.InputError`, exit 2): the server cannot be used as given,
  before it served anything: down (connection refused), silent past the timeout, no known dialect, no model
  list, a URL that is not http(s); a prompt its dialect cannot take (llama-cpp-python: ids without a text form);
* :class:`ServerFailure` (an :class:`~harness.core.workers.EngineFailure`, exit 1: the engine under test is
  wrong): a request it should serve failed once it was serving: an HTTP error status (the server's own message
  is ``last_error``), no answer within the timeout, a body that is not JSON or of an unexpected shape, a token it
  cannot name, a greedy step whose token is not the top-1 of its own log-probs, fewer tokens than asked without a
  stop; :class:`ServerCrashed` when it stops answering altogether (connection refused or reset mid-run). Each
  carries the prompt's place in the batch (``index``) and the step where known.
"""

from __future__ import annotations

import codecs
import concurrent.futures as cf
import contextlib
import http.client
import io
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from gemma4_harness.reference.chat import EOS as EOS_TEXT
from gemma4_harness.reference.chat import TURN_CLOSE
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import BYTE, CONTROL, NORMAL, USER_DEFINED, read_gguf_metadata, tokenizer_from_gguf

from ..core.progress import counter
from ..core.workers import EngineCrashed, EngineFailure, EngineProtocolError
from .base import TOP_N, EngineUnavailable, Generated
from .numerics import DIALECT_NUMERICS, parse_declare
from .numerics import declare as declare_numerics

DIALECTS = ("llama-server", "llama-cpp-python", "vllm", "openai")
"""Known dialects; ``openai`` is the generic one: any server with OpenAI's ``/v1/completions`` (transformers serve,
and every server none of the others names), judged on what that API promises (:meth:`OpenAIEngine._gen_generic`)."""

TEXT_ONLY_DIALECTS = ("llama-cpp-python", "openai")
"""Dialects that take no token-id prompt: a prompt goes as text, which must encode back to its ids
(llama-cpp-python: :meth:`OpenAIEngine._lcp_text`, through the server's own tokenizer; the generic dialect:
:meth:`OpenAIEngine._generic_text`, through ours). ``g4h parity`` without ``--prompts`` gives them its default prompt
set as text of the model's vocabulary (:func:`harness.parity.checks.server.default_text_prompts`)."""

LLAMACPP_APPROXIMATIONS = ("gelu_fp16_table", "quantized_activations")
"""What every server built on llama.cpp makes (as the ``llamacpp`` engine kind): its fp16 GELU table, and
activations rounded to the dot-product type of quantized weights; its attention numerics depend on the dialect's
defaults (:data:`harness.engines.numerics.DIALECT_NUMERICS`)."""


DOWN_HINT = ("nothing listens there: a server that is not running, or one that exited while loading its model "
             "(llama-server aborts at load on a model it cannot run, GGML_ASSERT in its log); its own log says which. "
             "g4h inspect MODEL checks the file, and g4h parity --against llamacpp runs the same llama.cpp in-process "
             "and names the assertion")
"""Said after "connection refused" before the server answered: this client did not start the server, so it cannot
read its last words; where they are and how to get them."""


class ServerError(InputError):
    """A completion server that cannot be used as given (one line, with the URL): down or silent before it served
    anything, no known dialect, a URL that is not http(s), a prompt its dialect cannot take. The user's input:
    exit 2."""


class ServerFailure(EngineProtocolError):
    """A request the server should serve failed once it was serving (one line, with the URL): an HTTP error
    status, no answer within the timeout, malformed JSON or another shape, a token it cannot name, a step that is
    not greedy, a short answer. The engine under test is wrong: exit 1."""


class ServerCrashed(ServerFailure, EngineCrashed):
    """The server stopped answering once it was serving (connection refused or reset): it crashed or was stopped."""


class ServerGenerated(Generated):
    """One greedy continuation from a server.

    Attributes (besides :class:`harness.engines.Generated`'s ``tokens`` and ``top``; ``top[i]`` holds the
    top-``top_n`` ``(id, logprob)`` pairs of step ``i``, best first, or ``[]`` where the server reported none):
        logprobs: per step, the log-probability of the generated token (NaN where the server reported none).
        missing: the steps the server reported no log-probs for (llama-server: text not yet complete UTF-8).
        text: the generated text as the server returned it.
        pieces: llama-cpp-python: each step's own text as its log-probs name it (the token decoded alone, bytes
            that are no whole UTF-8 character dropped); empty for the other dialects.
        finish_reason: ``"length"`` (``max_new_tokens`` reached) or ``"stop"`` (EOS or a stop string).
        stream_error: the message of an error event that ended a stream read for the stream check (``gaps``; the
            generic dialect), the text and steps before it kept; None otherwise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[float] = []
        self.missing: list[int] = []
        self.text = ""
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.stream_error: str | None = None


def parse_url(spec: str) -> tuple[str, str]:
    """``openai:http://h:p/v1`` (or ``http://h:p/v1``, ``http://h:p``) -> (``http://h:p/v1``, ``http://h:p``).

    Raises:
        ServerError: not an http(s) URL.
    """
    url = (spec[len("openai:"):] if spec.startswith("openai:") else spec).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"{spec}: expected openai:http://HOST:PORT/v1")
    root = url[:-3] if url.endswith("/v1") else url
    return root + "/v1", root


class _Deadline(threading.local):
    """The deadline of the request the current thread is making (:class:`Http`), and the sockets it opened."""

    at: float | None = None
    socks: list | None = None


_REQUEST = _Deadline()


class _Connection(http.client.HTTPConnection):
    """An HTTP connection that hands its socket to the request being made in this thread (:class:`Http` shuts it
    down at the request's deadline: a server that drips its status line or headers cannot stretch the request)."""

    def connect(self) -> None:
        left = None if _REQUEST.at is None else _REQUEST.at - time.monotonic()
        if left is not None:
            if left <= 0:
                raise TimeoutError("timed out")
            self.timeout = min(self.timeout, left) if isinstance(self.timeout, (int, float)) else left
        super().connect()
        if _REQUEST.socks is not None:
            _REQUEST.socks.append(self.sock)


class _Handler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(_Connection, req)


class Http:
    """JSON over HTTP with one-line errors, every reply read within bounds.

    ``timeout`` (``--server-timeout``): seconds one request may take in all, from connecting to the last byte of
    its reply (a stream's last event included). A socket timeout alone restarts at every byte received, so a
    server that drips its reply (or its headers) a byte at a time would never reach it: the request's sockets are
    shut down at its deadline by a timer, and the deadline is checked between reads.

    A reply (a JSON body, a whole stream, an error body) is read in pieces up to :attr:`MAX_REPLY_BYTES`; beyond
    it the server is failing (a flood), not answering. A body that is not strict JSON (cut short, ``NaN`` or
    ``Infinity`` where a number belongs, nested past Python's recursion limit) is a malformed answer.

    Attributes:
        serving: False (the default) while the server is being found out: every error is a :class:`ServerError`
            (the URL cannot be used: exit 2); True once it has answered (:class:`OpenAIEngine` sets it): an error
            is the server failing a request it should serve, :class:`ServerFailure` (or :class:`ServerCrashed`
            when it stops answering altogether): exit 1.
    """

    MAX_REPLY_BYTES = 128 << 20
    """Largest reply read (bytes). The largest one the harness asks for is llama-server's answer with the
    probabilities of the whole vocabulary for one step (``n_probs`` = vocabulary size, 262144 for Gemma 4): about
    130 bytes an entry (id, token text, its bytes, log-prob) is 34 MB; 128 MiB is near 4 times that, and bounds
    what a flooding server costs (the bytes, then their JSON objects: under 1.5 GB measured on a flood)."""

    MAX_ERROR_BYTES = 64 << 10
    """Largest error body read (bytes): only its message is quoted (300 characters)."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = float(timeout)
        self.serving = False
        self._direct = urllib.request.build_opener(urllib.request.ProxyHandler({}), _Handler)  # loopback: no proxy
        self._proxied = urllib.request.build_opener(_Handler)

    def error(self, msg: str, crashed: bool = False, last_error: str | None = None) -> InputError | ServerFailure:
        """The exception for ``msg``: :class:`ServerError` before the server served, else :class:`ServerFailure`
        (:class:`ServerCrashed` when ``crashed``) with the server's own message as ``last_error``."""
        if not self.serving:
            return ServerError(msg)
        return (ServerCrashed if crashed else ServerFailure)(msg).at(last_error=last_error)

    def _late(self, url: str) -> InputError | ServerFailure:
        """The request ran past its deadline (``--server-timeout`` bounds the whole request, a drip included)."""
        return self.error(f"{url}: no answer within {self.timeout:g} s (timeout)")

    def _transport(self, url: str, reason: Any) -> InputError | ServerFailure:
        if _REQUEST.at is not None and time.monotonic() >= _REQUEST.at:
            return self._late(url)
        if isinstance(reason, ConnectionRefusedError):
            if self.serving:
                return self.error(f"{url}: the server stopped answering (connection refused)", crashed=True)
            return self.error(f"{url}: server down (connection refused)")
        if isinstance(reason, (socket.timeout, TimeoutError)) or "timed out" in str(reason):
            return self.error(f"{url}: no answer within {self.timeout:g} s (timeout)")
        if self.serving and isinstance(reason, (ConnectionError, HTTPException)):  # reset, closed without answer
            return self.error(f"{url}: the server stopped answering: the connection closed without a response "
                              f"({type(reason).__name__}: {reason})", crashed=True)
        return self.error(f"{url}: connection failed ({type(reason).__name__}: {reason})")

    @contextlib.contextmanager
    def _request(self) -> Iterator[None]:
        """The bounds of one request made in this thread: its deadline (``timeout`` from now) and a timer that
        shuts its sockets down when the deadline passes (a blocked read then returns)."""
        outer = (_REQUEST.at, _REQUEST.socks)
        _REQUEST.at, _REQUEST.socks = time.monotonic() + self.timeout, []
        socks = _REQUEST.socks

        def cut() -> None:
            for sock in list(socks):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        timer = threading.Timer(self.timeout, cut)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            _REQUEST.at, _REQUEST.socks = outer

    def _open(self, url: str, body: Any = None):
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        loopback = urllib.parse.urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")
        try:
            return (self._direct.open if loopback else self._proxied.open)(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            body_file = getattr(e, "file", None)
            try:
                raw = b"" if body_file is None else self._read(body_file, url, self.MAX_ERROR_BYTES, cut_ok=True)
            except (ServerError, ServerFailure):
                raw = b""
            e.file = io.BytesIO(raw)  # what _error_message reads: the bounded body
            e.__dict__.pop("read", None)
            message = _error_message(e)
            raise self.error(f"{url}: HTTP {e.code}: {message}", last_error=message) from None
        except urllib.error.URLError as e:
            raise self._transport(url, e.reason) from None
        except (HTTPException, OSError) as e:  # socket.timeout and ConnectionError are OSErrors
            raise self._transport(url, e) from None

    def _read(self, r: Any, url: str, limit: int, cut_ok: bool = False) -> bytes:
        """The body of ``r``, read in pieces as they arrive, at most ``limit`` bytes, before the request's deadline.

        Raises:
            ServerError, ServerFailure: the deadline passed (a drip), more than ``limit`` bytes (unless ``cut_ok``:
                then the first ``limit``), the connection failed.
        """
        buf = bytearray()
        read = getattr(r, "read1", None) or r.read
        while True:
            if _REQUEST.at is not None and time.monotonic() >= _REQUEST.at:
                raise self._late(url)
            try:
                chunk = read(1 << 16)
            except (HTTPException, OSError, ValueError) as e:
                raise self._transport(url, e) from None
            if not chunk:
                if _REQUEST.at is not None and time.monotonic() >= _REQUEST.at:  # cut by the deadline's timer
                    raise self._late(url)
                short = getattr(r, "length", None)  # http.client: bytes its Content-Length announced, not sent
                if short and not cut_ok:
                    raise self.error(f"{url}: reply cut short: the connection closed {short} bytes before the "
                                     f"end its Content-Length announced ({len(buf) + short})")
                return bytes(buf)
            buf += chunk
            if len(buf) > limit:
                if cut_ok:
                    return bytes(buf[:limit])
                raise self.error(f"{url}: reply larger than {limit >> 20} MiB (Http.MAX_REPLY_BYTES): a flood, not "
                                 f"an answer (read stopped there)")

    def _json(self, url: str, raw: bytes, what: str) -> Any:
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            why = f" ({e})" if isinstance(e, _NotANumber) else ""
            raise self.error(f"{url}: {what} is not JSON{why}: {_snippet(raw[:4096])}") from None

    def call(self, url: str, body: Any = None) -> Any:
        """GET (``body`` None) or POST ``body`` as JSON; returns the decoded JSON answer.

        Raises:
            ServerError, ServerFailure: connection refused, timeout (the whole request: :attr:`timeout`), HTTP error
                status, a reply over :attr:`MAX_REPLY_BYTES`, a body that is not strict JSON (:meth:`error`).
        """
        with self._request():
            r = self._open(url, body)
            with r:
                raw = self._read(r, url, self.MAX_REPLY_BYTES)
        return self._json(url, raw, "answer")

    def stream(self, url: str, body: Any) -> Iterator[Any]:
        """POST ``body`` and yield the JSON of every server-sent event (``data: ...``) until ``[DONE]`` or EOF.

        The whole stream is one request: :attr:`timeout` bounds it from the request to its last event, and its
        bytes together are at most :attr:`MAX_REPLY_BYTES`.

        Raises:
            ServerError, ServerFailure: as :meth:`call`; an event that is not JSON.
        """
        with self._request():
            deadline, left = _REQUEST.at, self.MAX_REPLY_BYTES
            with self._open(url, body) as r:
                pending = bytearray()
                while True:
                    nl = pending.find(b"\n")
                    if nl < 0:
                        if _REQUEST.at is not None and time.monotonic() >= _REQUEST.at:
                            raise self._late(url)
                        chunk = self._read_some(r, url)
                        left -= len(chunk)
                        if left < 0:
                            raise self.error(f"{url}: stream larger than {self.MAX_REPLY_BYTES >> 20} MiB "
                                             f"(Http.MAX_REPLY_BYTES): a flood, not an answer (read stopped there)")
                        if not chunk:
                            if deadline is not None and time.monotonic() >= deadline:
                                raise self._late(url)
                            line, pending = bytes(pending), bytearray()
                            if not line.strip():
                                return
                        else:
                            pending += chunk
                            continue
                    else:
                        line = bytes(pending[:nl])
                        del pending[:nl + 1]
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, ": ping" comments, "event:" lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield self._json(url, data, "stream event")

    def _read_some(self, r: Any, url: str) -> bytes:
        """What has arrived of ``r`` (at most 64 KiB; empty at the end), within the request's deadline."""
        read = getattr(r, "read1", None) or r.read
        try:
            return read(1 << 16)
        except (HTTPException, OSError, ValueError) as e:
            raise self._transport(url, e) from None


class _NotANumber(ValueError):
    pass


def _no_constant(name: str) -> Any:
    """``json.loads``'s ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259)."""
    raise _NotANumber(f"{name} is not a JSON number")


def _snippet(raw: bytes, n: int = 80) -> str:
    text = " ".join(raw.decode("utf-8", "replace").split())
    return repr(text[:n] + ("..." if len(text) > n else "")) if text else "empty body"


def _error_message(e: urllib.error.HTTPError) -> str:
    """The server's own message from an error body (``{"error": {"message"}}``, ``{"detail"}``, ``{"message"}``)."""
    try:
        raw = e.read()
    except OSError:
        raw = b""
    try:
        body = json.loads(raw)
    except ValueError:
        return _snippet(raw) if raw else str(e.reason or "no message")
    msg: Any = body
    if isinstance(body, dict):
        err = body.get("error")
        msg = ((err.get("message") if isinstance(err, dict) else err) or body.get("detail") or body.get("message")
               or body)
    text = msg if isinstance(msg, str) else json.dumps(msg)
    return " ".join(text.split())[:300]


def _shape(url: str, what: str, got: Any) -> ServerFailure:
    """An answer of another shape than the dialect's (the server broke its protocol; :class:`OpenAIEngine` makes it
    a :class:`ServerError` while the server is being found out)."""
    return ServerFailure(f"{url}: unexpected answer: expected {what}, got {_snippet(json.dumps(got).encode())}")


def detect_dialect(http: Http, base: str, root: str) -> str:
    """Which server answers at ``root``: ``llama-server``, ``llama-cpp-python``, ``vllm``, else ``openai`` (the
    generic dialect) for any server whose ``/v1/models`` lists a model.

    llama-server answers ``GET /props`` with ``default_generation_settings``; llama-cpp-python and vLLM are
    FastAPI apps whose ``GET /openapi.json`` lists ``/extras/tokenize`` (llama-cpp-python) or ``/tokenize``
    and ``/version`` (vLLM); ``/v1/models``' ``owned_by`` (``llamacpp``, ``me``, ``vllm``) is the last resort.

    Raises:
        ServerError: the server is down or slow, or none of these answers says which server it is and it lists
            no model.
    """
    for path in ("/props", "/openapi.json"):
        try:
            ans = http.call(root + path)
        except ServerError as e:
            if "HTTP " not in str(e):
                raise  # down, timeout, not JSON: no point in asking further
            continue
        if not isinstance(ans, dict):
            continue
        if "default_generation_settings" in ans:
            return "llama-server"
        paths = set(ans.get("paths") or {})
        if "/extras/tokenize" in paths:
            return "llama-cpp-python"
        if {"/tokenize", "/version"} <= paths:
            return "vllm"
        if "/v1/completions" in paths:  # another FastAPI server of OpenAI's API (transformers serve)
            return "openai"
    models = http.call(base + "/models")
    data = models.get("data") if isinstance(models, dict) else None
    owners = {m.get("owned_by") for m in data or [] if isinstance(m, dict)}
    for owner, dialect in (("llamacpp", "llama-server"), ("vllm", "vllm"), ("me", "llama-cpp-python")):
        if owner in owners:
            return dialect
    if data:  # a model list in OpenAI's shape: a server of OpenAI's API, judged on what that API promises
        return "openai"
    raise ServerError(f"{root}: cannot tell which server this is (no llama-server /props, no FastAPI /openapi.json "
                      f"with llama-cpp-python or vLLM routes, /v1/models owned_by {sorted(map(str, owners))})")


def utf8_cut(text: bytes) -> bool:
    """True when ``text`` ends inside a multi-byte UTF-8 character, by llama-server's own test (``validate_utf8``
    in ``tools/server/server-common.cpp``: a lead byte among the last 4 with fewer bytes after it than it needs)."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if ((c & 0xE0) == 0xC0 and i < 2) or ((c & 0xF0) == 0xE0 and i < 3) or ((c & 0xF8) == 0xF0 and i < 4):
            return True
    return False


END_OF_TURN_TEXTS = (EOS_TEXT, TURN_CLOSE, "<|tool_response>", "<end_of_turn>")
"""Token texts that end a generation besides the stated EOS id: Gemma 4's ``<turn|>`` (the end of a turn,
``reference/chat.py`` ``TURN_CLOSE``) and ``<|tool_response>`` (the model hands over to a tool), Gemma 3's
``<end_of_turn>``; llama.cpp marks the same texts end-of-generation (``llama_vocab::impl::load``, its
``special_eog_ids`` list in ``src/llama-vocab.cpp``), transformers takes them from ``generation_config.json``'s
``eos_token_id``."""


def _vocab_size(path: Any) -> int | None:
    """The vocabulary size of the model at ``path``: a GGUF's ``tokenizer.ggml.tokens``, an HF folder's
    ``vocab_size`` (``config.json``, or its ``text_config``); None where it cannot be read here."""
    if path is None:
        return None
    p = Path(str(path))
    try:
        if p.suffix == ".gguf" and p.is_file():
            return len(read_gguf_metadata(p).get("tokenizer.ggml.tokens") or []) or None
        if (p / "config.json").is_file():
            cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
            v = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
            return int(v) if isinstance(v, int) else None
    except (InputError, OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def end_of_generation_ids(path: Any) -> set[int]:
    """The token ids that end a generation for the model at ``path``: a GGUF's ``tokenizer.ggml.eos_token_id``,
    ``eot_token_id`` and ``eom_token_id`` and the tokens of :data:`END_OF_TURN_TEXTS`; an HF folder's
    ``eos_token_id`` of ``generation_config.json`` and ``config.json`` (an int or a list) and the added tokens of
    ``tokenizer.json`` with those texts. Empty for no path or a model without them (never raises: a file that
    cannot be read is refused elsewhere, with its name)."""
    ids: set[int] = set()
    if path is None:
        return ids
    p = Path(str(path))
    try:
        if p.suffix == ".gguf" and p.is_file():
            meta = read_gguf_metadata(p)
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
                if isinstance(meta.get(key), int):
                    ids.add(int(meta[key]))
            tokens = meta.get("tokenizer.ggml.tokens") or []
            ids.update(i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS)
        elif p.is_dir():
            for name in ("generation_config.json", "config.json"):
                f = p / name
                cfg = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
                cfg = cfg.get("text_config", cfg) if "eos_token_id" not in cfg else cfg
                e = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
                ids.update(int(x) for x in (e if isinstance(e, list) else [e]) if isinstance(x, int))
            f = p / "tokenizer.json"
            added = json.loads(f.read_text(encoding="utf-8")).get("added_tokens", []) if f.is_file() else []
            ids.update(int(a["id"]) for a in added if isinstance(a, dict) and a.get("content") in END_OF_TURN_TEXTS)
    except (InputError, OSError, ValueError, TypeError, AttributeError, KeyError):
        return ids
    return ids


class OpenAIEngine:
    """A model served over HTTP, driven greedily, token ids in and out.

    Built by :func:`harness.engines.make_engine` for the name ``openai:URL`` as ``OpenAIEngine(URL, model_path,
    server_model=..., server_timeout=...)``.

    Args:
        url: ``http://HOST:PORT/v1`` (``openai:`` and ``/v1`` optional).
        path: the model file the harness compares with; the server holds its own copy, so it is not read here.
        model: the model name to send (default: the first entry of ``GET /v1/models``); ``server_model`` is the
            same (``--server-model``).
        timeout: seconds allowed for connecting and for each read of one request; ``server_timeout`` is the same
            (``--server-timeout``, default 120).
        concurrency: requests in flight at once in :meth:`generate_full` (default 1: each prompt alone).
        dialect: skip detection and assume this one (one of :data:`DIALECTS`).
        check_greedy: :meth:`generate_full` raises on a step whose token is not the top-1 of the server's own
            log-probs (False where gates judge that instead: ``g4h parity``).
        declare: ``--declare KEY=VALUE`` items (or their parsed form, :func:`harness.engines.numerics.parse_declare`)
            that replace the dialect's default numerics: ``dtype=``, ``kv_cache=``, ``approximations=``.

    Attributes:
        path: ``path`` as given.
        name: ``openai:URL (dialect, model 'NAME')``, as reports show it.
        ops: ``("generate",)``: no logits, no trace points.
        numerics: what the server computes (:class:`harness.engines.numerics.Numerics`): its dialect's defaults
            (:data:`harness.engines.numerics.DIALECT_NUMERICS`: llama-server with an f16 KV cache and flash
            attention, llama-cpp-python with an f16 KV cache, vLLM in bfloat16), or as declared.
        approximations, dtype: ``numerics.approximations``, ``numerics.dtype``.
        hints: prompt ids -> the oracle's greedy tokens and per step its top-N ``{id: log-prob}``, set by the parity
            job: llama-cpp-python names byte tokens by an empty text, and such a step is named by the oracle's token
            of that text there (:meth:`_lcp_ids`); nothing else reads them.
        answers: ``(ids, max_new_tokens, top_n) -> (ServerGenerated, seconds)`` of every prompt
            :meth:`generate_full` sent (the server checks reuse them as the answers "sent alone").
        offers_prompt_logprobs: whether :meth:`prompt_logprobs` can answer (vLLM, llama-cpp-python); its answers are
            kept, so the pair check and ``server.prompt_logprobs`` send one request per prompt.
        probes_prompt_logprobs: whether :meth:`prefix_logprobs` stands in for it (llama-server: ids in, top-N of
            each generated step out, nothing for the prompt).

    Raises:
        ServerError: the server is down, slow, answers an error or an unexpected shape, or is no known dialect
            (before it served anything: the URL cannot be used). Later requests raise :class:`ServerFailure`.
    """

    ops = ("generate",)

    def __init__(self, url: str, path: Any = None, model: str | None = None, timeout: float = 120.0,
                 concurrency: int = 1, dialect: str | None = None, check_greedy: bool = True,
                 server_model: str | None = None, server_timeout: float | None = None,
                 declare: Sequence[str] | Mapping[str, Any] | None = None) -> None:
        self.base, self.root = parse_url(url)
        said = declare if isinstance(declare, Mapping) else parse_declare(declare or ())  # bad input before any request
        self.http = Http(float(server_timeout) if server_timeout is not None else timeout)
        self.concurrency = max(1, int(concurrency))
        self.check_greedy = check_greedy
        self.path = path
        if dialect is not None and dialect not in DIALECTS:
            raise ServerError(f"{self.root}: unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
        try:
            self.dialect = dialect or detect_dialect(self.http, self.base, self.root)
            try:
                self._models = self.http.call(self.base + "/models")
            except ServerError as e:
                if self.dialect != "openai" or "HTTP " not in str(e):
                    raise
                self._models = {"error": str(e)}  # transformers serve lists only its hub cache (a 500 without one)
            self.model = server_model or model or self._model_name()
        except EngineFailure as e:  # an answer of another shape before it served: not a server this client can use
            raise ServerError(str(e)) from None
        except ServerError as e:
            if "connection refused" not in str(e):
                raise
            raise ServerError(f"{e}: {DOWN_HINT}") from None
        self.http.serving = True  # from here on, a failing request is the server's fault
        self._check_vocabulary()
        self.name = f"openai:{self.base} ({self.dialect}, model {self.model!r})"
        self.no_logprobs = ("the generic OpenAI dialect reads no log-probabilities (OpenAI's completions API returns "
                            "text; transformers serve ignores logprobs): tokens only, named by the text"
                            if self.dialect == "openai" else None)
        self.numerics = declare_numerics(DIALECT_NUMERICS[self.dialect], said)
        self.approximations = self.numerics.approximations
        self.dtype = self.numerics.dtype
        self.answers: dict[tuple[tuple[int, ...], int, int], tuple[ServerGenerated, float]] = {}
        self.offers_prompt_logprobs = self.dialect in ("vllm", "llama-cpp-python")
        self.probes_prompt_logprobs = self.dialect == "llama-server"
        self._prompt_lp: dict[tuple[tuple[int, ...], int], list[tuple[float, list[tuple[int, float]]] | None]] = {}
        self.hints: dict[tuple[int, ...], tuple[list[int], list[dict[int, float]]]] = {}  # naming only (see above)
        self._pieces: dict[int, bytes] = {}  # llama-server: token id -> its text's bytes
        self._text_id: dict[str, int | None] = {}  # llama-cpp-python: token text -> id
        self._id_text: dict[int, str] = {}
        self._texts: dict[str, int] | None = None  # llama-cpp-python: the model file's unique token texts
        self._bos: list[int] | None = None  # the ids an empty text tokenizes to with specials (BOS)

    def _model_name(self) -> str | None:
        """The first model ``/v1/models`` lists; on the generic dialect, None where it lists none (the requests then
        name no model, which a server of one model takes: transformers serve with a model given on its command line
        lists only its hub cache)."""
        data = self._models.get("data") if isinstance(self._models, dict) else None
        if not data and self.dialect == "openai":
            return None
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise _shape(self.base + "/models", '{"data": [{"id": str, ...}, ...]}', self._models)
        return data[0]["id"]

    def _check_vocabulary(self) -> None:
        """The server's vocabulary against the model file's, where the server states it (llama-server's
        ``/v1/models`` ``data[0].meta.n_vocab``): another size means it serves another model.

        Raises:
            ServerFailure: the sizes differ (both named): exit 1, the engine under test does not run this model.
        """
        try:
            theirs = int(self._models["data"][0]["meta"]["n_vocab"])
        except (KeyError, IndexError, TypeError, ValueError):
            return
        ours = _vocab_size(self.path)
        if ours is not None and ours != theirs:
            raise ServerFailure(f"{self.base}/models: the server's model has a vocabulary of {theirs} tokens "
                                f"(meta.n_vocab), {self.path} one of {ours}: it serves another model")

    def logits(self, ids: Sequence[int], trace: Any = None) -> Any:
        """Impossible: a completion server returns the top-N log-probabilities of the tokens it generates, never
        the logits of every position, and exposes no trace points.

        Raises:
            EngineUnavailable: always (one line; exit 2 on the command line).
        """
        what = "trace points" if trace is not None else "the logits of every position"
        raise EngineUnavailable(f"openai:{self.base}: a completion server returns no {what} (only the top-N "
                                "log-probabilities of generated tokens); use g4h generate, or g4h parity --against")

    # ------------------------------------------------------------------ tokens and templates

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The server's token ids of ``text`` (special-token text parsed); ``add_special`` adds BOS as the model does.

        llama-cpp-python's ``/extras/tokenize`` always adds BOS: without ``add_special`` that BOS is dropped.
        """
        if self.dialect == "openai":
            raise ServerError(f"{self.root}: the generic OpenAI dialect has no tokenizer endpoint")
        if self.dialect == "llama-server":
            url, body = self.root + "/tokenize", {"content": text, "add_special": add_special, "parse_special": True}
        elif self.dialect == "vllm":
            url, body = self.root + "/tokenize", {"model": self.model, "prompt": text,
                                                  "add_special_tokens": add_special}
        else:
            url, body = self.root + "/extras/tokenize", {"input": text}
        ids = _int_list(url, self.http.call(url, body), "tokens")
        if self.dialect == "llama-cpp-python" and not add_special:
            if self._bos is None:
                self._bos = _int_list(url, self.http.call(url, {"input": ""}), "tokens")
            ids = ids[len(self._bos):] if self._bos and ids[:len(self._bos)] == self._bos else ids
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """The server's text of ``ids``."""
        ids = [int(t) for t in ids]
        if self.dialect == "openai":
            raise ServerError(f"{self.root}: the generic OpenAI dialect has no detokenizer endpoint")
        url, body, key = {"llama-server": (self.root + "/detokenize", {"tokens": ids}, "content"),
                          "vllm": (self.root + "/detokenize", {"model": self.model, "tokens": ids}, "prompt"),
                          "llama-cpp-python": (self.root + "/extras/detokenize", {"tokens": ids}, "text")}[self.dialect]
        ans = self.http.call(url, body)
        if not isinstance(ans, dict) or not isinstance(ans.get(key), str):
            raise _shape(url, f'{{"{key}": str}}', ans)
        return ans[key]

    def apply_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The server's chat template applied to ``messages`` (``[{"role", "content"}, ...]``), generation prompt added.

        Raises:
            ServerError: the dialect offers no such endpoint (only llama-server's ``/apply-template`` does).
        """
        if self.dialect != "llama-server":
            raise ServerError(f"{self.root}: {self.dialect} offers no endpoint that returns the templated text")
        url = self.root + "/apply-template"
        ans = self.http.call(url, {"messages": list(messages)})
        if not isinstance(ans, dict) or not isinstance(ans.get("prompt"), str):
            raise _shape(url, '{"prompt": str}', ans)
        return ans["prompt"]

    def chat_ids(self, messages: Sequence[dict[str, str]],
                 enable_thinking: bool = False) -> tuple[list[int], str | None]:
        """The token ids the server evaluates for a chat request of ``messages`` (generation prompt added), and the
        templated text where the server shows it.

        ``enable_thinking`` goes as ``chat_template_kwargs`` (llama-server turns thinking on by default for a template
        that supports it). llama-server: ``/apply-template`` (which drops a leading BOS text when its tokenizer adds
        BOS), then ``/tokenize`` of that text with BOS added, as its chat endpoint does. vLLM: ``/tokenize`` with
        ``messages`` (documented, not run here).

        Raises:
            ServerError: the dialect offers no such endpoint (llama-cpp-python). ServerFailure: an answer of another
                shape.
        """
        kwargs = {"chat_template_kwargs": {"enable_thinking": bool(enable_thinking)}}
        if self.dialect == "llama-server":
            url = self.root + "/apply-template"
            ans = self.http.call(url, {"messages": list(messages), **kwargs})
            if not isinstance(ans, dict) or not isinstance(ans.get("prompt"), str):
                raise _shape(url, '{"prompt": str}', ans)
            return self.tokenize(ans["prompt"], add_special=True), ans["prompt"]
        if self.dialect == "vllm":
            url = self.root + "/tokenize"
            ans = self.http.call(url, {"model": self.model, "messages": list(messages), "add_generation_prompt": True,
                                       **kwargs})
            return _int_list(url, ans, "tokens"), None
        raise ServerError(f"{self.root}: {self.dialect} offers no endpoint that renders or tokenizes a chat template")

    # ------------------------------------------------------------------ generation

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_n: int = TOP_N,
                      stream: bool = False) -> list[ServerGenerated]:
        """Greedy continuations (temperature 0) with the top-``top_n`` ``(id, logprob)`` of every step.

        Up to ``concurrency`` requests are in flight at once; results come back in the prompts' order, and are
        kept in :attr:`answers` (not streamed ones).
        Every dialect stops at an end-of-generation token (``finish_reason == "stop"``, fewer tokens, the last one
        that token's id: :meth:`_end_with_eog`), as the model would: asking a server to ignore EOS gives no greedy
        stream (llama-server bans the token but reports the raw log-probs). ``stream``: read the answer as
        server-sent events.

        Raises:
            ServerFailure: a request failed or answered an unexpected shape; a step's token is not the top-1 of
                the server's own log-probs (a greedy server never does that); fewer tokens than ``max_new_tokens``
                without a stop (or more). The prompt's place is its ``index``, the step its ``step`` where known.
            ServerError: a prompt cannot be sent as the dialect needs (llama-cpp-python: ids that do not survive
                its text round trip); llama-server streamed without steps whose token ids it does not send.
        """
        if max_new_tokens <= 0 or not prompts:
            return [ServerGenerated() for _ in prompts]
        args = [[int(t) for t in p] for p in prompts]

        def one(k: int) -> ServerGenerated:
            t0 = time.monotonic()
            try:
                g = self.complete(args[k], max_new_tokens, top_n, stream=stream)
            except EngineFailure as e:
                raise e.at(index=k, step=0 if isinstance(e, ServerCrashed) else None)
            if not stream:
                self.answers[(tuple(args[k]), int(max_new_tokens), int(top_n))] = (g, time.monotonic() - t0)
            sent.step()
            return g

        with counter(f"{self.dialect} requests", len(args)) as sent, \
                cf.ThreadPoolExecutor(min(self.concurrency, len(args))) as ex:
            out = list(ex.map(one, range(len(args))))
        for k, g in enumerate(out):
            if len(g.tokens) > max_new_tokens or (len(g.tokens) < max_new_tokens and g.finish_reason != "stop"):
                raise ServerFailure(f"{self.base}: prompt {k}: {len(g.tokens)} tokens where {max_new_tokens} were "
                                    f"asked (finish_reason {g.finish_reason!r}, not a stop)").at(
                    index=k, step=min(len(g.tokens), max_new_tokens), partial=list(g.tokens))
        if self.check_greedy:
            for k, g in enumerate(out):
                try:
                    _check_greedy(self.base, k, g, self.eog_ids)
                except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
                    raise ServerFailure(f"{self.base}: prompt {k}: log-probs the {self.dialect} dialect cannot read "
                                        f"({type(e).__name__}: {str(e)[:200]})").at(index=k) from None
        return out

    def complete(self, ids: Sequence[int], max_new_tokens: int, top_n: int = TOP_N, *, stream: bool = False,
                 stop: Sequence[str] | None = None, ignore_eos: bool = False, gaps: bool = False) -> ServerGenerated:
        """One greedy request (temperature 0), as the dialect takes it; no check of the answer against itself.

        Args:
            ids: the prompt's token ids (BOS included where the model wants one).
            max_new_tokens: ``max_tokens`` / ``n_predict``.
            top_n: log-probabilities per step (0: none asked; llama-server then reports no steps).
            stream: read the answer as server-sent events.
            stop: stop strings (the text is cut before the first one; ``finish_reason`` ``stop``).
            ignore_eos: generate past EOS (llama-server, vLLM; llama-server bans the end-of-generation ids with a
                -inf bias but reports the log-probs of the raw logits, where they may stay the top-1). False (the
                default, as users run servers): stop there (``finish_reason`` ``stop``), the stream ending with the
                end-of-generation id (:meth:`_end_with_eog`). llama-cpp-python always stops at EOS.
            gaps: a stream as the stream check reads it: llama-server's steps it left out (text not yet complete
                UTF-8) get the token id -1 and are listed in ``missing``, instead of raising; on the generic dialect an
                error event ends the stream, its message in ``stream_error``, the text before it kept.

        Raises:
            ServerFailure, ServerError: as :meth:`generate_full`, except the greedy and length checks.
        """
        one = {"llama-server": self._gen_llama_server, "llama-cpp-python": self._gen_lcp,
               "vllm": self._gen_vllm, "openai": self._gen_generic}[self.dialect]
        extra = {"stop": [str(x) for x in stop]} if stop else {}
        ids = [int(t) for t in ids]
        try:
            g = one(ids, int(max_new_tokens), int(top_n), bool(stream), extra, bool(ignore_eos), bool(gaps))
            if not ignore_eos and not stop:
                self._end_with_eog(g, ids, int(max_new_tokens))
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
            # A reply of the right outline whose values are not what they should be (a token id "12x", a step that
            # is a string): the server broke its protocol, as with any other malformed reply (exit 1, one line).
            raise ServerFailure(f"{self.base}: a completion reply the {self.dialect} dialect cannot read "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
        return g

    @property
    def eog_ids(self) -> set[int]:
        """The ids that end a generation for the model the harness compares with (:func:`end_of_generation_ids` of
        :attr:`path`)."""
        if getattr(self, "_eog", None) is None:
            self._eog = end_of_generation_ids(self.path)
        return self._eog

    def _end_with_eog(self, g: ServerGenerated, ids: list[int], n: int) -> None:
        """A generation that stopped at an end-of-generation token ends with that token's id, as llama-server and
        vLLM return it: the dialects that leave it out (llama-cpp-python's ``_create_completion`` breaks on
        ``llama_token_is_eog`` before listing the token; a text-only server) get it appended, without log-probs
        (listed in ``missing``). Which id it was is not said: the oracle's token at that step where that is one
        (:attr:`hints`), else the end-of-generation id the oracle ranks highest there, else the smallest known one;
        the greedy comparison then judges the stop like any other token (a stop where the oracle goes on parts from
        it there). Only a ``stop`` with fewer tokens than asked is such an end (a stop string is not sent here).
        llama-server and vLLM list the token they stopped on; where that is no end-of-generation id of ours nor a
        control token (llama.cpp marks every end-of-generation token control), the stop is put after it too."""
        if g.finish_reason != "stop" or len(g.tokens) >= n:
            return
        eog = self.eog_ids
        if g.tokens and g.tokens[-1] in eog:
            return
        if self.dialect in ("llama-server", "vllm") and g.tokens and self._is_control(g.tokens[-1]):
            return  # it listed the token it stopped on: an end-of-generation id of its own list (a control token)
        k = len(g.tokens)
        hint, hint_top = self.hints.get(tuple(ids), (None, None))
        if hint is not None and k < len(hint) and int(hint[k]) in eog:
            tid = int(hint[k])
        else:
            top = hint_top[k] if hint_top and k < len(hint_top) else {}
            ranked = sorted((t for t in top if int(t) in eog), key=lambda t: -top[t])
            tid = int(ranked[0]) if ranked else (min(eog) if eog else -1)
        g.tokens.append(tid)
        g.logprobs.append(math.nan)
        g.top.append([])
        g.missing.append(k)
        if g.pieces:
            g.pieces.append("")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy token ids only (the engine protocol of :mod:`harness.engines`)."""
        return [g.tokens for g in self.generate_full(prompts, max_new_tokens)]

    def _gen_llama_server(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                          gaps: bool) -> ServerGenerated:
        url = self.root + "/completion"
        body = {"prompt": ids, "n_predict": n, "n_probs": top_n, "temperature": 0, "return_tokens": True,
                "ignore_eos": ignore_eos, "stream": stream, **extra,
                "cache_prompt": False}  # no reuse: a request's numbers must not depend on what its slot held
        g = ServerGenerated()
        if stream:
            placed: dict[int, dict] = {}
            for part in self.http.stream(url, body):
                if not isinstance(part, dict):
                    raise _shape(url, "a JSON object per event", part)
                g.text += part.get("content") or ""
                for step in part.get("completion_probabilities") or []:
                    placed[int(part.get("tokens_predicted", 0)) - 1] = step
                if part.get("stop"):
                    g.finish_reason = "stop" if part.get("stop_type") in ("eos", "word") else "length"
                    n = int(part.get("tokens_predicted", n))
            left_out = [i for i in range(n) if i not in placed]
            if left_out and not gaps:
                raise ServerError(f"{url}: the stream left out steps {left_out[:8]} (llama-server sends a step only "
                                  f"once the text is complete UTF-8) and with them their token ids; use stream=False")
            steps: list[dict | None] = [placed.get(i) for i in range(n)]
            g.tokens = [-1 if s is None else _entry_id(url, s) for s in steps]
        else:
            ans = self.http.call(url, body)
            tokens = ans.get("tokens") if isinstance(ans, dict) else None
            entries = ans.get("completion_probabilities", []) if isinstance(ans, dict) else None  # absent when none
            if not isinstance(tokens, list) or not isinstance(entries, list) or \
                    len(tokens) != ans.get("tokens_predicted"):
                raise _shape(url, '{"tokens": [...] (return_tokens was sent), "tokens_predicted", '
                                  '"completion_probabilities": [...]}', ans)
            g.tokens = [int(t) for t in tokens]
            g.text = ans.get("content") or ""
            g.finish_reason = "stop" if ans.get("stop_type") in ("eos", "word") else "length"
            steps = self._place_llama_server(url, g.tokens, entries)
        for i, step in enumerate(steps):
            if step is None:
                g.missing.append(i)
                g.logprobs.append(math.nan)
                g.top.append([])
                continue
            try:
                g.logprobs.append(float(step["logprob"]))
                g.top.append([(int(c["id"]), float(c["logprob"])) for c in step["top_logprobs"]])
            except (KeyError, TypeError, ValueError):
                raise _shape(url, 'completion_probabilities [{"id", "logprob", "top_logprobs": [{"id", "logprob"}]}]',
                             step) from None
        return g

    def _place_llama_server(self, url: str, tokens: list[int], entries: list[Any]) -> list[dict | None]:
        """llama-server's log-prob entries placed at their steps (None where it reported nothing).

        It appends an entry only when the generated text so far ends in complete UTF-8 (:func:`utf8_cut`);
        replaying that rule over the tokens' texts (their bytes, from the entries' candidates, or from the
        whole vocabulary once: :meth:`_learn_pieces`) says which steps the entries belong to.

        Raises:
            ServerFailure: the entries do not fit the tokens under that rule.
        """
        ids = [_entry_id(url, e) for e in entries]
        if ids == tokens:
            return list(entries)
        if not entries:  # a server that reports no log-probs (tokens only): every step without
            return [None] * len(tokens)
        for e in entries:
            for c in e.get("top_logprobs") or []:
                if isinstance(c, dict) and isinstance(c.get("bytes"), list):
                    self._pieces.setdefault(int(c["id"]), bytes(c["bytes"]))
        if any(t not in self._pieces for t in tokens):
            self._learn_pieces()
        out: list[dict | None] = []
        text, k = b"", 0
        for t in tokens:
            if t not in self._pieces:
                raise ServerFailure(f"{url}: token {t} has no text in the vocabulary llama-server reported")
            text += self._pieces[t]
            if not utf8_cut(text) and k < len(entries):
                if ids[k] != t:
                    break
                out.append(entries[k])
                k += 1
            else:
                out.append(None)
        if k != len(entries) or len(out) != len(tokens):
            raise ServerFailure(f"{url}: {len(entries)} log-prob entries (ids {ids[:6]}) do not fit the {len(tokens)} "
                              f"tokens {tokens[:6]} under llama-server's complete-UTF-8 rule")
        return out

    def _learn_pieces(self) -> None:
        """The bytes of every token's text, from one request: one forced greedy step (``logit_bias``) whose
        ``top_logprobs`` list the whole vocabulary (``n_probs`` = ``n_vocab`` from ``/v1/models``)."""
        url = self.root + "/completion"
        try:
            n_vocab = int(self._models["data"][0]["meta"]["n_vocab"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise _shape(self.base + "/models", 'data[0].meta.n_vocab', self._models) from None
        a = self.tokenize("a", add_special=False)[-1]  # any token whose text is complete UTF-8
        ans = self.http.call(url, {"prompt": [a], "n_predict": 1, "n_probs": n_vocab, "temperature": 0,
                                   "logit_bias": [[a, 1000.0]], "return_tokens": True})
        try:
            for c in ans["completion_probabilities"][0]["top_logprobs"]:
                self._pieces[int(c["id"])] = bytes(c["bytes"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise _shape(url, "one step with n_vocab top_logprobs carrying bytes", ans) from None

    def _gen_vllm(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                  gaps: bool) -> ServerGenerated:
        url = self.base + "/completions"
        body = {"model": self.model, "prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": top_n,
                "ignore_eos": ignore_eos, "return_tokens_as_token_ids": True, "stream": stream, **extra}
        g = ServerGenerated()
        for part in (self.http.stream(url, body) if stream else [self.http.call(url, body)]):
            choice = _first_choice(url, part)
            g.text += choice.get("text") or ""
            g.finish_reason = choice.get("finish_reason") or g.finish_reason
            lp = choice.get("logprobs")
            if not lp and (stream or not choice.get("text")):
                continue  # a stream's closing event; an empty completion
            try:
                for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
                    g.tokens.append(_token_id(tok))
                    g.logprobs.append(float(tlp))
                    pairs = sorted(((_token_id(k), float(v)) for k, v in top.items()), key=lambda kv: (-kv[1], kv[0]))
                    g.top.append(pairs[:top_n])
            except (KeyError, TypeError, ValueError, AttributeError):
                raise _shape(url, 'logprobs {"tokens": ["token_id:N"], "token_logprobs", "top_logprobs": '
                                  '[{"token_id:N": logprob}]}', lp) from None
        return g

    def _is_control(self, tid: int) -> bool:
        """Whether ``tid`` is a control token of the model's vocabulary (False where the vocabulary cannot be read)."""
        try:
            tok = self._local_tok()
        except InputError:
            return False
        return 0 <= tid < len(tok.types) and tok.types[tid] == CONTROL

    # ------------------------------------------------------------------ the generic dialect

    local_tokenizer_of: Any = None
    """``path -> tokenizer`` of the model the harness compares with (``encode(text, add_bos, parse_special)``,
    ``decode``-free: ``tokens``, ``types``, ``bos_id``); set by :mod:`harness.parity.checks.server` (a layer above),
    else a GGUF's own (:func:`reference.tokenizer.tokenizer_from_gguf`). The generic dialect sends text, made and
    checked with it."""

    def _local_tok(self) -> Any:
        if getattr(self, "_tok", None) is None:
            make = type(self).local_tokenizer_of
            if make is not None:
                self._tok = make(self.path)
            elif self.path is not None and str(self.path).endswith(".gguf"):
                self._tok = tokenizer_from_gguf(self.path)
            else:
                raise ServerError(f"{self.root}: the generic OpenAI dialect sends text prompts, and {self.path} "
                                  "has no tokenizer this client can read")
        return self._tok

    def _piece_bytes(self, tid: int) -> bytes:
        """The bytes a server's text holds for token ``tid`` (a byte token's byte, a normal or user-defined piece with
        ``▁`` as a space); empty for the others (control tokens: a server decodes with ``skip_special_tokens``)."""
        tok = self._local_tok()
        if not 0 <= tid < len(tok.tokens):
            return b""
        ty, piece = tok.types[tid], tok.tokens[tid]
        if ty == BYTE and piece.startswith("<0x") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        if ty in (NORMAL, USER_DEFINED):
            return piece.replace("\u2581", " ").encode("utf-8")
        return b""

    def _generic_text(self, ids: list[int]) -> str:
        """The text sent for prompt ``ids`` on the generic dialect: our tokenizer's text of the ids after BOS (the
        server adds BOS to a text prompt, as transformers' tokenizers and llama.cpp do), checked to encode back to
        ``ids`` with our tokenizer (the server's cannot be asked: OpenAI's API has no tokenizer endpoint).

        Raises:
            ServerError: the ids have no text that encodes back to them (``--prompts`` with ``{"text"}`` prompts).
        """
        tok = self._local_tok()
        body = ids[1:] if ids and tok.bos_id is not None and ids[0] == tok.bos_id else ids
        raw = b"".join(self._piece_bytes(t) for t in body)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or tok.encode(text, add_bos=ids[:1] == [tok.bos_id], parse_special=True) != ids:
            raise ServerError(f"{self.base}/completions: the generic OpenAI dialect takes text prompts only, and the "
                              f"prompt {ids[:8]} has no text that our tokenizer turns back into it (give text prompts: "
                              "--prompts FILE with {\"text\": ...} lines)")
        return text

    def _gen_generic(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                     gaps: bool) -> ServerGenerated:
        """OpenAI's ``POST /v1/completions`` with a text prompt and only the fields OpenAI defines (transformers
        serve answers 422 to any other): greedy is ``temperature`` 0; the answer is text, and its tokens are named
        by the oracle (:meth:`_generic_ids`). No log-probs are read (transformers serve ignores ``logprobs``)."""
        url = self.base + "/completions"
        body = {**({"model": self.model} if self.model is not None else {}), "prompt": self._generic_text(ids),
                "max_tokens": n, "temperature": 0, "stream": stream, **extra}
        g = ServerGenerated()
        count = None
        for part in (self.http.stream(url, body) if stream else [self.http.call(url, body)]):
            if isinstance(part, dict) and "error" in part and "choices" not in part:  # an error event mid-stream
                err = part["error"]
                msg = " ".join(str(err.get("message") if isinstance(err, dict) else err).split())[:300]
                if stream and gaps:  # the stream check judges it against the answer without streaming
                    g.stream_error = msg
                    break
                raise ServerFailure(f"{url}: the {'stream' if stream else 'answer'} carries an error instead of "
                                    f"choices: {msg}").at(last_error=msg)
            choice = _first_choice(url, part)
            text = choice.get("text")
            if text is not None and not isinstance(text, str):
                raise _shape(url, '{"choices": [{"text": str, "finish_reason"}]}', part)
            g.text += text or ""
            g.finish_reason = choice.get("finish_reason") or g.finish_reason
            usage = part.get("usage") if isinstance(part, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                count = usage["completion_tokens"]
        hint, hint_top = self.hints.get(tuple(ids), (None, None))
        g.tokens = self._generic_ids(g.text, n, count, g.finish_reason, hint, hint_top)
        g.logprobs = [math.nan] * len(g.tokens)
        g.top = [[] for _ in g.tokens]
        g.missing = list(range(len(g.tokens)))
        return g

    def _generic_ids(self, text: str, n: int, count: int | None, finish: str | None, hint: Sequence[int] | None,
                     hint_top: Sequence[Mapping[int, float]] | None) -> list[int]:
        """Token ids of a generated ``text`` on the generic dialect (OpenAI's API returns text, not ids): step by
        step, the oracle's token (``hint``) while its text agrees with the server's (:func:`_text_agrees`), else the
        first of the oracle's top-N there (best first) whose text does; the first step none explains is -1 (unknown:
        the greedy comparison fails it, as a token outside the oracle's top-N). Control tokens render as nothing (a
        server decodes with ``skip_special_tokens``).

        A ``stop`` ends where the text is explained (the end-of-generation token is appended after:
        :meth:`_end_with_eog`); a ``length`` finish has ``min(n, count)`` steps (``count``: the server's
        ``usage.completion_tokens``), those the text does not explain -1. Without a hint every step is -1."""
        total = (min(n, count) if count is not None else n) if finish == "length" else None
        out: list[int] = []
        raw = b""
        explained = text == ""
        while len(out) < n and not (total is None and explained) and not (total is not None and len(out) >= total):
            k = len(out)
            if not hint or k >= len(hint):
                break
            top = hint_top[k] if hint_top and k < len(hint_top) else {}
            cands = [int(hint[k])] + [int(t) for t in sorted(top, key=lambda t: -top[t]) if int(t) != int(hint[k])]
            got = next((c for c in cands if c not in self.eog_ids  # an end-of-generation id is the stop, not text
                        and _text_agrees(raw + self._piece_bytes(c), text)), None)
            if got is None:
                break
            out.append(got)
            raw += self._piece_bytes(got)
            explained = _text_agrees(raw, text, whole=True)
        if not explained:
            out.append(-1)  # the step where the text parts from every candidate (or no oracle to name it by)
        if total is not None:
            out += [-1] * (total - len(out))
        return out[:n]

    def _lcp_text(self, ids: list[int]) -> str:
        """The text llama-cpp-python must be sent for prompt ``ids`` (it takes no id prompts), checked to tokenize back:
        the server's detokenization of the ids after BOS, without its leading space (or ``▁``, where byte tokens spell
        it) where the vocabulary adds one back (SentencePiece's ``add_space_prefix``, as the synthetic vocabularies do).

        Raises:
            ServerError: the ids do not survive the round trip ids -> text -> ids on this server.
        """
        if self._bos is None:
            self._bos = self.tokenize("", add_special=True)
        bos = self._bos
        body = ids[len(bos):] if bos and ids[:len(bos)] == bos else ids
        try:
            text = self.detokenize(body)
        except ServerFailure as e:  # its detokenizer refuses these ids (bytes that are no UTF-8): no text to send
            if isinstance(e, ServerCrashed):
                raise
            raise ServerError(f"{self.base}/completions: llama-cpp-python takes text prompts only, and cannot turn the "
                              f"prompt {ids[:8]} into text ({e})") from None
        back = self.tokenize(text, add_special=True)  # what the server evaluates: it adds BOS to a text prompt
        if back != ids and text[:1] in (" ", "\u2581"):  # a vocabulary that adds a space prefix (add_space_prefix)
            text, back = text[1:], self.tokenize(text[1:], add_special=True)
        if back != ids:
            raise ServerError(f"{self.base}/completions: llama-cpp-python takes text prompts only, and the prompt "
                              f"{ids[:8]} comes back as {back[:8]} after its text round trip")
        return text

    def _gen_lcp(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                 gaps: bool) -> ServerGenerated:
        url = self.base + "/completions"  # it has no ignore_eos: it always stops at EOS
        body = {"model": self.model, "prompt": self._lcp_text(ids), "max_tokens": n, "temperature": 0,
                "logprobs": top_n, "repeat_penalty": 1.0, "stream": stream, **extra}
        g = ServerGenerated()
        texts: list[str] = []
        tops: list[dict] = []
        generated = 0  # usage.completion_tokens of a whole answer
        for part in (self.http.stream(url, body) if stream else [self.http.call(url, body)]):
            choice = _first_choice(url, part)
            g.text += choice.get("text") or ""
            g.finish_reason = choice.get("finish_reason") or g.finish_reason
            usage = part.get("usage") if isinstance(part, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                generated = usage["completion_tokens"]
            lp = choice.get("logprobs")
            if not lp and (stream or not choice.get("text")):
                continue  # a stream's closing event; an empty completion (EOS first)
            try:
                texts += [str(t) for t in lp["tokens"]]
                g.logprobs += [float(x) for x in lp["token_logprobs"]]
                tops += [{str(k): float(v) for k, v in d.items()} for d in lp["top_logprobs"]]
            except (KeyError, TypeError, ValueError, AttributeError):
                raise _shape(url, 'logprobs {"tokens": [str], "token_logprobs", "top_logprobs": [{str: logprob}]}',
                             lp) from None
        hint, hint_top = self.hints.get(tuple(ids), (None, None))
        if not stream:  # a stream lists a generated BOS (as an empty text); a whole answer's log-probs leave it out
            texts, tops, g.logprobs = self._lcp_restore_bos(texts, tops, g.logprobs, hint, generated - len(texts))
        # It generates past max_tokens while a UTF-8 character is incomplete (its multibyte_fix, which skips its
        # length test) and may then stop at EOS: keep the first n, which ended by length.
        if len(texts) >= n and g.finish_reason == "stop" and not extra.get("stop"):
            g.finish_reason = "length"
        texts, tops, g.logprobs = texts[:n], tops[:n], g.logprobs[:n]
        g.tokens, named_by_hint = self._lcp_ids(url, texts, hint, hint_top, g.logprobs)
        g.pieces = [t if isinstance(t, str) else "" for t in texts]
        for k, d in enumerate(tops):
            if k in named_by_hint:  # its text names no single token: its step's candidates cannot be named either
                g.top.append([])
                g.missing.append(k)
                g.logprobs[k] = math.nan
                continue
            pairs = [(g.tokens[k] if piece == texts[k] else self._lcp_id(piece), v)
                     for piece, v in sorted(d.items(), key=lambda kv: -kv[1])]
            g.top.append([(i, v) for i, v in pairs if i is not None][:top_n])
        return g

    def _lcp_restore_bos(self, texts: list, tops: list, lps: list, hint: Sequence[int] | None,
                         dropped: int | None = None) -> tuple[list, list, list]:
        """llama-cpp-python leaves a generated BOS out of a whole completion's log-prob lists (``_create_completion``
        in ``llama_cpp/llama.py``: ``if token == bos_token_id: continue``; a stream lists it, as an empty text). Where
        the hint (the oracle's stream) has BOS at a step and the server's list, agreeing with the hint so far, names
        the hint's next token there (or ends), the BOS is put back: its id as the step's "text" (:meth:`_lcp_ids`
        takes it as named), no log-probs. ``dropped``: how many tokens the answer's lists leave out (its
        ``usage.completion_tokens`` minus their length; None: not known), at most that many are put back."""
        if not hint or not texts or dropped == 0 or (dropped is not None and dropped < 0):
            return texts, tops, lps
        if self._bos is None:
            self._bos = self.tokenize("", add_special=True)
        if not self._bos:
            return texts, tops, lps
        bos = self._bos[0]
        out_t, out_top, out_lp, k = [], [], [], 0
        for j, want in enumerate(hint):
            nxt = hint[j + 1] if j + 1 < len(hint) else None
            if want == bos and (dropped is None or dropped > 0) and \
                    (k >= len(texts) or (nxt is not None and self._lcp_piece(int(nxt)) == texts[k])):
                dropped = None if dropped is None else dropped - 1
                out_t.append(bos)
                out_top.append({})
                out_lp.append(math.nan)
                continue
            if k >= len(texts) or self._lcp_piece(int(want)) != texts[k]:
                break  # parted from the hint: nothing more to restore
            out_t.append(texts[k])
            out_top.append(tops[k])
            out_lp.append(lps[k])
            k += 1
        return out_t + texts[k:], out_top + tops[k:], out_lp + lps[k:]

    def _lcp_ids(self, url: str, texts: list, hint: Sequence[int] | None = None,
                 hint_top: Sequence[Mapping[int, float]] | None = None,
                 lps: Sequence[float] | None = None) -> tuple[list[int], set[int]]:
        """Token ids of generated tokens that llama-cpp-python names by text: its tokenization of the whole text when
        that gives one token per named text (each checked by detokenizing it), else one lookup per text
        (:meth:`_lcp_id`).

        A text that is no single token (llama-cpp-python names every byte token that is not a whole UTF-8 character
        ``''``, its ``detokenize(...).decode(errors="ignore")``) is named by the oracle (``hint``: its greedy tokens
        for this prompt, ``hint_top``: its top-N ``{id: log-prob}`` at each step, :attr:`OpenAIEngine.hints`) while
        the stream agrees with the oracle's: by the oracle's greedy token when it has that text on this server, else
        by the token of the oracle's top-N there that has it (of several, the one whose oracle log-prob is nearest the
        server's own for its token, ``lps``); with none, the step is left unnamed (-1) for the greedy comparison to
        judge (a token of no name in the oracle's top-N parts from it as a fault), as is every such step after the
        stream parted from the oracle's. Returns the ids and the steps so named (or unnamed), whose log-probs cannot be
        named either; an int among ``texts`` is an id already known (a restored BOS).

        Raises:
            ServerFailure: a text that is no single token of this model, without an oracle to name it by (its
                ``step`` set): the server generated a token this client cannot name.
        """
        if texts and all(isinstance(t, str) for t in texts):
            ids = self.tokenize("".join(texts), add_special=False)
            if len(ids) == len(texts) and all(self._lcp_piece(i) == t for i, t in zip(ids, texts)):
                return ids, set()
        out: list[int] = []
        by_hint: set[int] = set()
        for k, piece in enumerate(texts):
            if isinstance(piece, int):  # a BOS put back (:meth:`_lcp_restore_bos`)
                out.append(piece)
                by_hint.add(k)
                continue
            tid = self._lcp_id(piece)
            if tid is None:
                if hint is None:
                    raise ServerFailure(f"{url}: llama-cpp-python names step {k}'s token only by the text {piece!r}, "
                                        f"which is no single token of this model").at(step=k)
                tid = -1
                if len(hint) > k and list(hint[:k]) == out:
                    if self._lcp_piece(int(hint[k])) == piece:  # the oracle's own token: the likeliest by far
                        tid = int(hint[k])
                    else:  # the oracle's top-N token of that text whose log-prob is nearest the server's own
                        top = hint_top[k] if hint_top and len(hint_top) > k else {}
                        named = [int(t) for t in top if self._lcp_piece(int(t)) == piece]
                        mine = lps[k] if lps is not None and k < len(lps) else math.nan
                        if len(named) > 1 and mine == mine:
                            named = [min(named, key=lambda t: abs(top[t] - mine))]
                        tid = named[0] if len(named) == 1 else -1
                by_hint.add(k)
            out.append(tid)
        return out, by_hint

    def _lcp_piece(self, tid: int) -> str:
        """The text llama-cpp-python gives token ``tid`` in a completion's log-probs: its detokenization; for a token
        whose bytes are no whole UTF-8 text, which ``/extras/detokenize`` refuses (HTTP 500, "codec can't decode"),
        what its completions show, the bytes decoded with ``errors="ignore"`` (the empty text for a lone byte)."""
        if tid not in self._id_text:
            try:
                self._id_text[tid] = self.detokenize([tid])
            except ServerFailure as e:
                if "codec can't decode" not in str(e):
                    raise
                self._id_text[tid] = ""
        return self._id_text[tid]

    def _lcp_id(self, piece: str) -> int | None:
        """The one token id whose text is ``piece``, checked back on the server (its detokenization of the id is
        ``piece``): its tokenizer's id for the text, else the one vocabulary entry of the model file that renders as
        that text (:meth:`_vocab_texts`: a tokenizer need not produce every piece from text, SentencePiece merges
        reach only pieces whose prefixes are pieces); None when neither names it (a text of several tokens, or one
        that several tokens share, such as the empty text of byte tokens)."""
        if piece not in self._text_id:
            ids = self.tokenize(piece, add_special=False) if piece else []
            tid = ids[0] if len(ids) == 1 and self._lcp_piece(ids[0]) == piece else None
            if tid is None and piece:
                cand = self._vocab_texts().get(piece)
                tid = cand if cand is not None and self._lcp_piece(cand) == piece else None
            self._text_id[piece] = tid
        return self._text_id[piece]

    def _vocab_texts(self) -> dict[str, int]:
        """Text -> id for every token of the model file (a GGUF) whose text, as llama.cpp renders one token without
        specials (a normal piece with ``▁`` as a space, a byte token's byte where it is a whole UTF-8 character; a
        user-defined piece as it is), is non-empty and no other token's; empty for another model form."""
        if getattr(self, "_texts", None) is None:
            self._texts = {}
            path = getattr(self, "path", None)
            if path is not None and str(path).endswith(".gguf"):
                try:
                    tok = tokenizer_from_gguf(path)
                except InputError:
                    return self._texts
                seen: dict[str, int | None] = {}
                for i, (t, ty) in enumerate(zip(tok.tokens, tok.types)):
                    if ty == NORMAL:
                        text = t.replace("\u2581", " ")
                    elif ty == BYTE and len(t) == 6 and t.startswith("<0x"):
                        text = bytes([int(t[3:5], 16)]).decode("utf-8", "ignore")
                    elif ty == USER_DEFINED:
                        text = t
                    else:
                        continue
                    if text:
                        seen[text] = None if text in seen else i
                self._texts = {k: v for k, v in seen.items() if v is not None}
        return self._texts

    # ------------------------------------------------------------------ prompt log-probs

    def prefix_logprobs(self, ids: Sequence[int], top_n: int = TOP_N) -> list[tuple[None, list[tuple[int, float]]] | None]:
        """Per prompt position, the top-N log-probabilities a server that reports none for the prompt (llama-server:
        ``/v1/completions`` ignores ``echo``) gives for it, asked as one greedy token after each prefix: position
        ``i`` is step 0 of ``ids[:i]``. Costs ``len(ids) - 1`` one-token requests (the server's prompt cache makes
        each a decode step). Same form as :meth:`prompt_logprobs`, with None for the given token's own log-prob
        (the server names only its top-N).

        Raises:
            ServerFailure: as :meth:`generate_full`; the prefix's place is its ``index``.
        """
        gens = self.generate_full([list(ids[:i]) for i in range(1, len(ids))], 1, top_n)
        return [None] + [(None, list(g.top[0])) if g.top and g.top[0] else None for g in gens]

    def prompt_logprobs(self, ids: Sequence[int],
                        top_n: int = TOP_N) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per prompt position, the log-probability of the given token after the ones before it, and the top-N.

        Returns:
            One entry per token of ``ids``: None for position 0 (nothing precedes it) and, on llama-cpp-python,
            for the first token after BOS (its echo nulls the first listed token); else
            ``(logprob of ids[i], [(id, logprob), ...] best first)``.
            Kept per ``(ids, top_n)``: asked again, the same answer without a request.

        Raises:
            ServerError: the dialect has no prompt log-probs (llama-server). ServerFailure: the answer has another
                shape.
        """
        key = (tuple(int(t) for t in ids), int(top_n))
        if key not in self._prompt_lp:
            self._prompt_lp[key] = self._prompt_logprobs(list(key[0]), int(top_n))
        return self._prompt_lp[key]

    def _prompt_logprobs(self, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """:meth:`prompt_logprobs`, asked of the server."""
        url = self.base + "/completions"
        if self.dialect == "openai":
            raise ServerError(f"{self.root}: the generic OpenAI dialect reads no prompt log-probabilities")
        if self.dialect == "llama-server":
            raise ServerError(f"{self.root}: llama-server returns no prompt log-probabilities (/v1/completions "
                              "ignores echo; /completion reports generated tokens only)")
        if self.dialect == "vllm":
            ans = self.http.call(url, {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                       "prompt_logprobs": top_n})
            plp = _first_choice(url, ans).get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) != len(ids):
                raise _shape(url, f"choices[0].prompt_logprobs, a list of {len(ids)} entries", plp)
            out: list[tuple[float, list[tuple[int, float]]] | None] = [None]
            for tid, d in zip(ids[1:], plp[1:]):
                try:
                    top = sorted((int(k), float(v["logprob"]), int(v["rank"])) for k, v in d.items())
                    best = [(k, lp) for k, lp, r in sorted(top, key=lambda x: x[2]) if r <= top_n]
                    out.append((float(d[str(tid)]["logprob"]), best))
                except (KeyError, TypeError, ValueError, AttributeError):
                    raise _shape(url, '{"<id>": {"logprob", "rank", "decoded_token"}}', d) from None
            return out
        ans = self.http.call(url, {"model": self.model, "prompt": self._lcp_text(ids), "max_tokens": 1,
                                   "temperature": 0, "logprobs": top_n, "echo": True, "repeat_penalty": 1.0})
        lp = _first_choice(url, ans).get("logprobs") or {}
        try:
            token_lp, tops = lp["token_logprobs"], lp["top_logprobs"]
        except (KeyError, TypeError):
            raise _shape(url, 'logprobs {"token_logprobs", "top_logprobs"}', lp) from None
        # The echo lists the prompt without a leading BOS (its first entry null), then the generated tokens: one,
        # or more where the first ends inside a UTF-8 character (its multibyte_fix), as usage.completion_tokens says;
        usage = ans.get("usage") if isinstance(ans, dict) else None
        # None generated where the first token is an end-of-generation one: it stops there without listing it.
        generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
        generated = generated if isinstance(generated, int) and generated >= 0 else 1
        skip = len(ids) - (len(token_lp) - generated)
        if skip not in (0, 1):
            raise _shape(url, f"{len(ids) - 1} or {len(ids)} prompt entries and {generated} generated",
                         f"{len(token_lp)} entries")
        out = [None] * (skip + 1)
        for k in range(skip + 1, len(ids)):
            d = tops[k - skip] or {}
            pairs = [(ids[k] if p == lp["tokens"][k - skip] else self._lcp_id(p), v)
                     for p, v in sorted(d.items(), key=lambda kv: -kv[1])]
            out.append((float(token_lp[k - skip]), [(i, float(v)) for i, v in pairs if i is not None][:top_n]))
        return out


def _text_agrees(raw: bytes, text: str, whole: bool = False) -> bool:
    """Whether ``raw`` (the bytes of some tokens) may begin ``text`` (a server's decoded generation), or be all of it
    (``whole``). Decoders differ on bytes that are no whole UTF-8 character: Python's ``errors="replace"`` gives one
    U+FFFD per bad sequence, HF tokenizers' ``ByteFallback`` a U+FFFD for every byte of a run of byte tokens that is
    not valid UTF-8 as a whole (seen on transformers serve: the valid ``_`` and ``9`` of such a run shown as U+FFFD).
    So a U+FFFD of the server's stands for any one character of ours; bytes of an unfinished character at the end of
    ``raw`` must begin the server's next character (or a U+FFFD) there."""
    def like(ours: str) -> bool:
        return len(ours) <= len(text) and all(a == b or b == "\ufffd" for a, b in zip(ours, text))

    if whole:  # the end of the text: an unfinished character there was decoded as U+FFFD
        ours = raw.decode("utf-8", "replace")
        return like(ours) and len(ours) == len(text)
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    ours = dec.decode(raw, final=False)
    pending = dec.getstate()[0]
    if not like(ours):
        return False
    nxt = text[len(ours):len(ours) + 1]
    return not pending or (bool(nxt) and (nxt == "\ufffd" or nxt.encode("utf-8").startswith(pending)))


def _entry_id(url: str, entry: Any) -> int:
    try:
        return int(entry["id"])
    except (KeyError, TypeError, ValueError):
        raise _shape(url, 'completion_probabilities [{"id", "logprob", "top_logprobs"}]', entry) from None


def _int_list(url: str, ans: Any, key: str) -> list[int]:
    vals = ans.get(key) if isinstance(ans, dict) else None
    if not isinstance(vals, list) or not all(isinstance(v, int) for v in vals):
        raise _shape(url, f'{{"{key}": [int, ...]}}', ans)
    return vals


def _first_choice(url: str, ans: Any) -> dict:
    choices = ans.get("choices") if isinstance(ans, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _shape(url, '{"choices": [{...}]}', ans)
    return choices[0]


def _token_id(tok: str) -> int:
    """vLLM's ``token_id:123`` (``return_tokens_as_token_ids``) -> 123."""
    if not isinstance(tok, str) or not tok.startswith("token_id:"):
        raise ValueError(tok)
    return int(tok[len("token_id:"):])


def _check_greedy(url: str, k: int, g: ServerGenerated, eog: set[int] | frozenset[int] = frozenset()) -> None:
    """Each generated token is the top-1 of its step's log-probs, or ties with it: what greedy means. Where that
    top-1 is an end-of-generation id (``eog``) the server should have stopped: said so."""
    for i, (tok, top) in enumerate(zip(g.tokens, g.top)):
        if not top or tok == top[0][0]:
            continue
        mine = next((lp for tid, lp in top if tid == tok), None)
        if (mine is None or mine != top[0][1]) and top[0][0] in eog:
            raise ServerFailure(f"{url}: prompt {k}, step {i}: the server's own top-1 is the end-of-generation token "
                                f"{top[0][0]} (at {top[0][1]:.6g}), where it should stop; it generated {tok} "
                                f"(EOS ignored or banned, though the request let it stop)").at(index=k, step=i)
        if mine is None or mine != top[0][1]:
            raise ServerFailure(f"{url}: prompt {k}, step {i}: generated token {tok} is not the top-1 of the server's "
                                f"own log-probs ({top[0][0]} at {top[0][1]:.6g}); greedy (temperature 0) was asked"
                                ).at(index=k, step=i)
