"""Issue 37, item 4: a completion server's replies are read within bounds. Small hostile servers (http.server on
127.0.0.1 in a thread) answer the discovery requests like llama-server, then every completion with one fault: a
1.5 GB reply (streamed by the server, never held), a drip of one byte a second, JSON cut short, NaN where numbers
belong, fields dropped. Each must be an engine failure (exit 1 at the CLI) naming the request, within its time
limit and with bounded memory; never a traceback, never a hang.

The client runs in a subprocess (its peak RSS is its own); each case prints ``kind``, ``seconds``, ``rss_mb``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_stub import JsonHandler, StubServer

ROOT = Path(__file__).resolve().parents[1]

GOOD = {"content": "ab", "tokens": [7, 8], "tokens_predicted": 2, "stop_type": "limit",
        "completion_probabilities": [
            {"id": 7, "token": "a", "logprob": -0.1, "top_logprobs": [{"id": 7, "token": "a", "logprob": -0.1}]},
            {"id": 8, "token": "b", "logprob": -0.2, "top_logprobs": [{"id": 8, "token": "b", "logprob": -0.2}]}]}

FLOOD_BYTES = 1_500_000_000


class Hostile(StubServer):
    """llama-server's discovery answers, then every POST answered by ``mode``; ``url``: the engine name that reaches
    it (``openai:http://127.0.0.1:PORT/v1``)."""

    def __init__(self, mode: str) -> None:
        me = self
        self.mode, self.sent = mode, 0

        class H(JsonHandler):
            protocol_version = "HTTP/1.1"

            def _head(self, length: int | None) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if length is not None:
                    self.send_header("Content-Length", str(length))
                self.end_headers()

            def do_GET(self):
                if self.path == "/props":
                    return self._send(200, {"default_generation_settings": {}})
                return self._send(200, {"object": "list", "data": [{"id": "stub", "owned_by": "llamacpp"}]})

            def do_POST(self):
                self._body()
                good = json.dumps(GOOD).encode()
                try:
                    if me.mode == "flood":  # a valid start, then 1.5 GB of digits: never held by this server
                        head = b'{"content": "'
                        self._head(FLOOD_BYTES)
                        self.wfile.write(head)
                        block = b"9" * (1 << 20)
                        while me.sent < FLOOD_BYTES:
                            self.wfile.write(block)
                            me.sent += len(block)
                    elif me.mode == "drip":
                        self._head(len(good))
                        for i in range(len(good)):
                            self.wfile.write(good[i:i + 1])
                            self.wfile.flush()
                            time.sleep(1.0)
                    elif me.mode == "drip-headers":
                        for c in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
                            self.wfile.write(bytes([c]))
                            self.wfile.flush()
                            time.sleep(0.2)
                    elif me.mode == "cut":
                        self._send(200, good[:len(good) // 2])
                    elif me.mode == "cut-length":  # says more than it sends, then closes
                        self._head(len(good) + 100)
                        self.wfile.write(good)
                        self.close_connection = True
                    elif me.mode == "nan":
                        self._send(200, good.replace(b"-0.1", b"NaN").replace(b"-0.2", b"-Infinity"))
                    elif me.mode == "drop":
                        self._send(200, {k: v for k, v in GOOD.items() if k != "tokens"})
                    elif me.mode == "deep":
                        self._send(200, b"[" * 200_000 + b"]" * 200_000)
                    else:
                        self._send(200, good)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        super().__init__(H)
        self.url = f"openai:{self.url}/v1"


CLIENT = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from gemma4_harness.harness.engines.openai import OpenAIEngine
from gemma4_harness.harness.core.workers import EngineFailure
from gemma4_harness.reference.errors import InputError
t0 = time.monotonic()
out = {{}}
try:
    eng = OpenAIEngine({url!r}, timeout={timeout})
    eng.generate_full([[2, 5]], 2)
    out.update(kind="ok")
except EngineFailure as e:
    out.update(kind="engine", exit=1, msg=str(e), index=e.index, step=e.step)
except InputError as e:
    out.update(kind="input", exit=2, msg=str(e))
# VmHWM: this process's own peak (ru_maxrss would carry the forking pytest worker's peak across the exec)
hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")]
out.update(seconds=round(time.monotonic() - t0, 2),
           rss_mb=(hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) // 1024)
print(json.dumps(out))
"""


def _client(url: str, timeout: float, limit_s: float) -> tuple[dict, str]:
    code = CLIENT.format(root=str(ROOT), url=url, timeout=timeout)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s, check=False)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


#: mode, --server-timeout, the message's words, the most seconds it may take (the timeout plus start-up slack).
CASES = [
    ("flood", 60.0, "reply larger than 128 MiB", 60.0),
    ("drip", 3.0, "no answer within 3 s (timeout)", 3.0 + 15.0),
    ("drip-headers", 3.0, "no answer within 3 s (timeout)", 3.0 + 15.0),
    ("cut", 10.0, "answer is not JSON", 20.0),
    ("cut-length", 10.0, "reply cut short", 20.0),
    ("nan", 10.0, "NaN is not a JSON number", 20.0),
    ("drop", 10.0, "unexpected answer", 20.0),
    ("deep", 10.0, "answer is not JSON", 20.0),
]


@pytest.mark.parametrize("mode, timeout, words, most_s", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_server_is_an_engine_failure_within_bounds(mode, timeout, words, most_s):
    with Hostile(mode) as srv:
        t0 = time.monotonic()
        got, _ = _client(srv.url, timeout, limit_s=most_s + 60)
        took = time.monotonic() - t0
    print(f"{mode}: {got['kind']} in {got['seconds']} s (limit {most_s:g} s), peak RSS {got['rss_mb']} MB; "
          f"{got.get('msg', '')[:160]}")
    assert got["kind"] == "engine" and got["exit"] == 1, got
    assert words in got["msg"] and "/completion" in got["msg"] and got["index"] == 0, got
    assert got["seconds"] <= most_s and took <= most_s + 30, got
    assert got["rss_mb"] < 1500, got  # 128 MiB of reply at most, and the interpreter
    if mode == "flood":
        assert srv.sent < FLOOD_BYTES  # the client stopped reading: the server could not finish


def test_the_good_answer_passes():
    """The same server without a fault is served (the faults above are what fails)."""
    with Hostile("good") as srv:
        got, _ = _client(srv.url, 10.0, limit_s=120)
    assert got["kind"] == "ok", got
