"""The one small HTTP server the tests stand in for a completion server with (http.server on 127.0.0.1 in a
thread): :class:`JsonHandler`, a request handler that answers JSON, and :class:`StubServer`, which serves a handler
on a free port. The stand-ins are subclasses of :class:`StubServer` with a :class:`JsonHandler` of their own: the
exact float64 server (tests/refserver.py ``ReferenceServer``), the fault-injecting server and proxy
(tests/servers.py ``FaultStub``), the hostile replies (tests/test_hostile_http.py ``Hostile``) and the server that
refuses with HTTP 400 (tests/test_server_context.py ``FakeServer``).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet request handler with :meth:`_send` (a status and a JSON body) and :meth:`_body` (the request's)."""

    def log_message(self, *a: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
        """Answer ``code`` with ``body``: bytes as they are, anything else as JSON; a client that has gone away
        already (one that gave up on a slow answer) is no error."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _body(self) -> bytes:
        """The request's body (``Content-Length`` bytes; empty without one)."""
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


class StubServer:
    """``handler`` served on ``127.0.0.1`` at a free port, in a daemon thread: ``url`` is ``http://127.0.0.1:PORT``.

    ``with StubServer(H) as s:`` starts it and, at the end, stops it (:meth:`close`). ``block_on_close`` False: closing
    does not wait for handlers still at work (one that sleeps, to be slow)."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], block_on_close: bool = True) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads, self.server.block_on_close = True, block_on_close
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.stopped = False

    def start(self) -> StubServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (a server that crashed, from a handler: the call returns at once; later connections are
        refused once the socket is closed, :meth:`close`)."""
        if not self.stopped:
            self.stopped = True
            threading.Thread(target=self.server.shutdown, daemon=True).start()

    def close(self) -> None:
        """Stop serving, and close the listening socket."""
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
