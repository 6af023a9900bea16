"""The HTTP client of the ``openai`` engine, and its two kinds of error.

:class:`Http` sends JSON and reads JSON (or server-sent events) back, every reply bounded in time
(``--server-timeout``: the whole request, connect to last byte) and in size (:attr:`Http.MAX_REPLY_BYTES`). Every
failure is one line naming the URL, of one of two kinds:

* :class:`ServerError` (an :class:`~reference.errors.InputError`, exit 2): the server cannot be used as given,
  before it served anything: down (connection refused), silent past the timeout, no known dialect, no model
  list, a URL that is not http(s); a prompt its dialect cannot take (llama-cpp-python: ids without a text form);
* :class:`ServerFailure` (an :class:`~harness.core.workers.EngineFailure`, exit 1: the engine under test is
  wrong): a request it should serve failed once it was serving: an HTTP error status (the server's own message
  is ``last_error``), no answer within the timeout, a body that is not JSON or of an unexpected shape, a token it
  cannot name, a greedy step whose token is not the top-1 of its own log-probs, fewer tokens than asked without a
  stop; :class:`ServerCrashed` when it stops answering altogether (connection refused or reset mid-run). Each
  carries the prompt's place in the batch (``index``) and the step where known.

Only the standard library is used.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Any, Iterator

from gemma4_harness.reference.errors import InputError

from ...core.workers import EngineCrashed, EngineProtocolError


class ServerError(InputError):
    """A completion server that cannot be used as given (one line, with the URL): down or silent before it served
    anything, no known dialect, a URL that is not http(s), a prompt its dialect cannot take. The user's input:
    exit 2."""


CONTEXT_EXCEEDED = ("maximum context length is", "exceeds the available context size")
"""How a server words an HTTP 400 for a request longer than its context: llama-cpp-python (and vLLM, in OpenAI's
wording) "This model's maximum context length is N tokens, however you requested ..." (``llama_cpp/server/errors.py``
``ErrorResponseFormatters.context_length_exceeded``, from ``Llama._create_completion``'s "Requested tokens (N)
exceed context window of M"); llama-server "request (N tokens) exceeds the available context size (M tokens), try
increasing it" (``tools/server/server-context.cpp``, ``ERROR_TYPE_EXCEED_CONTEXT_SIZE``, HTTP 400)."""

SERVER_CONTEXT_HINT = ("start the server with a larger context (llama-server -c N, per slot: each of its --parallel P "
                       "slots gets N/P unless --kv-unified; llama-cpp-python --n_ctx N; vLLM --max-model-len N), or "
                       "shorten or drop the prompt")
"""What to do about a prompt longer than the server's context (said after the line that names it)."""


class ServerContextExceeded(ServerError):
    """The server refused a request as longer than its context (HTTP 400 in one of its :data:`CONTEXT_EXCEEDED`
    wordings): the prompt does not fit that server as it was started, the user's input for that server (exit 2),
    not a fault of the engine. Any other HTTP 400 stays a :class:`ServerFailure`.

    Attributes:
        message: the server's own message.
        prompt_ids: the ids of the prompt sent (set by :meth:`OpenAIEngine.complete`), so that its caller can name
            the prompt by its file and line; None where not known.
    """

    def __init__(self, line: str, message: str) -> None:
        super().__init__(line)
        self.message = message
        self.prompt_ids: list[int] | None = None


class ServerFailure(EngineProtocolError):
    """A request the server should serve failed once it was serving (one line, with the URL): an HTTP error
    status, no answer within the timeout, malformed JSON or another shape, a token it cannot name, a step that is
    not greedy, a short answer. The engine under test is wrong: exit 1."""


class ServerCrashed(ServerFailure, EngineCrashed):
    """The server stopped answering once it was serving (connection refused or reset): it crashed or was stopped."""



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
            if self.serving and e.code == 400 and any(w in message for w in CONTEXT_EXCEEDED):
                raise ServerContextExceeded(f"{url}: HTTP 400: {message}", message) from None
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


def bad_shape(url: str, what: str, got: Any) -> ServerFailure:
    """An answer of another shape than the dialect's (the server broke its protocol; :class:`OpenAIEngine` makes it
    a :class:`ServerError` while the server is being found out)."""
    return ServerFailure(f"{url}: unexpected answer: expected {what}, got {_snippet(json.dumps(got).encode())}")

