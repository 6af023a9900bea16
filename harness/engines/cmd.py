"""The ``cmd`` engine: any program that speaks the harness's subprocess protocol (``docs/engine-protocol.md``).

``cmd:'COMMAND ARGS ...'`` names it: the command is split as a shell would (:func:`shlex.split`; no shell
runs it), started once per model with this process's environment and working folder, and spoken to in
JSON lines: one request a line on its stdin, one reply a line on its stdout. Its stderr is its own log;
the harness keeps it in a file and quotes its last meaningful line when something goes wrong. The engine runs in
a process group of its own, which dies with the harness however the harness ends (SIGKILL included: a watchdog
kills the group, :func:`harness.core.workers.start_child`), and is killed as a group when the engine is closed or
fails (a shell wrapper's children included); closing its stdin asks it to exit first.

Requests (each with ``id`` and ``op``): ``hello`` (protocol version, model path, scratch folder; the reply
names the ops the engine answers, its vocabulary, dtype and known approximations), ``logits`` (ids in, a
``.npy`` ``[T, V]`` out), ``generate`` (prompts in, greedy tokens and top-N log-probs out), and optionally
``trace`` (a ``g4h-trace`` JSONL file out, ``docs/trace-format.md``) and ``tokenize``.

Every fault of the engine is a :class:`CmdError`, one line naming the command and the request: it says
nothing within the timeout, it writes a line that is not a JSON reply (or a reply to another request), it
answers ``ok: false``, or it hands back logits of the wrong shape or dtype, a generation of the wrong length, a
greedy token that is not its own top-1; an engine that dies is :class:`CmdCrashed`, a :class:`CmdError` too.
Both are engine failures (:class:`~harness.core.workers.EngineFailure`: the engine under test is wrong, exit 1
at the CLI, "ENGINE FAILED" in a parity report), carrying the prompt (``index`` in the batch) and the step where
known and the engine's last stderr line (``last_error``). A command that cannot be split or started is the
user's input (:class:`~reference.errors.InputError`, exit 2). The engine is stopped after its first fault; a
later request gets the same line. An engine that answers ``hello`` with ``ok: false`` (it cannot read this
model) is :class:`~harness.engines.base.EngineUnavailable`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shlex
import subprocess
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.workers import (
    EngineCrashed,
    EngineProtocolError,
    crash_line,
    remove_temp_dir,
    start_child,
    stop_child,
    temp_dir,
)
from .base import TOP_N, EngineUnavailable, Generated, TraceFn
from .numerics import APPROXIMATIONS as KNOWN_APPROXIMATIONS
from .numerics import DTYPES as NUMERIC_DTYPES
from .numerics import KV_CACHE_TYPES, VEC_DOT_TABLES, Numerics

PROTOCOL_VERSION = 1
"""The protocol version this module speaks (``hello``'s ``protocol``)."""

OPS = ("logits", "generate", "trace", "tokenize")
"""Requests an engine may answer besides ``hello``; it must answer ``logits`` or ``generate`` (or both)."""

DTYPES = NUMERIC_DTYPES
"""What an engine may say it computes in (``hello``'s ``dtype``; 16-bit engines get the 16-bit gates)."""

APPROXIMATIONS = tuple(KNOWN_APPROXIMATIONS)
"""Known approximations an engine may declare (``hello``'s ``approximations``), with what the harness does with
each: :data:`harness.engines.numerics.APPROXIMATIONS`. ``hello``'s ``kv_cache`` says what its KV cache stores
(:data:`harness.engines.numerics.KV_CACHE_TYPES`). The parity job gates the engine against a reference that makes
the declared approximations it can emulate, at bounds that grow with their effect on the model
(``docs/engine-protocol.md``, "Numerics")."""

TIMEOUT_ENV = "G4H_CMD_TIMEOUT"
"""Environment variable: seconds to wait for each reply (default :data:`DEFAULT_TIMEOUT`)."""

DEFAULT_TIMEOUT = 600.0
"""Seconds the harness waits for one reply (``hello`` includes loading the model)."""

MAX_LINE = 256 << 20
"""Longest reply line read (bytes); a longer one is a fault (a runaway writer, not a reply)."""

EXIT_GRACE = 10.0
"""Seconds an engine gets to exit after its stdin is closed, before it is killed."""


class CmdError(EngineProtocolError):
    """A ``cmd:`` engine that failed: one line naming the command, the request and what went wrong (the engine
    under test is wrong: exit 1)."""


class CmdCrashed(CmdError, EngineCrashed):
    """A ``cmd:`` engine whose process died (or closed its stdout): one line with its exit status and the last
    line of its stderr."""


def command_argv(spec: str) -> list[str]:
    """The argv of a ``cmd:`` engine from the text after ``cmd:``.

    Split as a POSIX shell would (:func:`shlex.split`). A command given whole inside one pair of quotes
    (``'python eng.py --x'``, as typed after ``cmd:`` inside a comma list) is split once more.

    Raises:
        InputError: unbalanced quotes, or an empty command.
    """
    try:
        argv = shlex.split(spec)
        if len(argv) == 1 and spec.strip()[:1] in "'\"" and any(c.isspace() for c in argv[0]):
            argv = shlex.split(argv[0])
    except ValueError as e:
        raise InputError(f"cmd:{spec}: cannot split the command ({e})") from None
    if not argv:
        raise InputError(f"cmd:{spec}: empty command")
    return argv


def _stop(proc: subprocess.Popen, workdir: str, grace: float) -> None:
    """Close the engine's stdin, give it ``grace`` seconds to exit, then kill its process group (it and whatever it
    started: :func:`~harness.core.workers.stop_child`); remove its scratch folder."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except OSError:
        pass
    stop_child(proc, grace)  # the engine's whole process group: what it started dies with it
    for f in (proc.stdout, proc.stderr):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    remove_temp_dir(workdir)


class CmdEngine:
    """A program behind the subprocess protocol, running one model.

    Args:
        spec: the command (the text after ``cmd:``), see :func:`command_argv`.
        path: the model (``.gguf`` file or HF folder), sent in ``hello`` as an absolute path.
        timeout: seconds to wait for each reply (default ``$G4H_CMD_TIMEOUT`` or :data:`DEFAULT_TIMEOUT`).
        check_greedy: :meth:`generate_full` fails a step whose token is not the most probable of its own top
            log-probs (False where that is judged and explained instead: ``g4h parity``, ``g4h explain``, through
            :func:`harness.parity.checks.pair_figures.not_greedy`).

    Attributes (from the engine's ``hello`` reply):
        ops: the requests it answers (a subset of :data:`OPS`).
        engine: the name and version it gives (``llama-cpp-python 0.3.36``), or ``"?"``.
        vocab_size: its vocabulary size, or None when it did not say (then the first logits fix it).
        dtype: what it computes in (:data:`DTYPES`; default ``float32``).
        approximations: the known approximations it makes (:data:`APPROXIMATIONS`).
        numerics: the whole declaration (:class:`harness.engines.numerics.Numerics`: dtype, ``kv_cache``,
            approximations), which the parity job's gates follow.

    Raises:
        InputError: the command cannot be split or started (exit 2: the user's input).
        CmdError: its ``hello`` is missing, late or malformed, or names another protocol version, unknown ops,
            dtype or approximations; :class:`CmdCrashed`: it died before answering.
        EngineUnavailable: the engine answers ``hello`` with ``ok: false`` (it cannot read this model).
    """

    kind = "cmd"

    def __init__(self, spec: str, path: str | os.PathLike, timeout: float | None = None, check_greedy: bool = True):
        self.check_greedy = check_greedy
        self.argv = command_argv(spec)
        self.label = "cmd:" + shlex.quote(shlex.join(self.argv))
        self.name = self.label
        self.model = Path(path).resolve()
        if timeout is None:
            timeout = _env_timeout()
        self.timeout = float(timeout)
        self._next_id = 0
        self._failed: CmdError | None = None
        self._buf = bytearray()
        self.workdir = str(temp_dir("g4h-cmd-"))  # removed by a watchdog if the harness is killed
        self._log = open(os.path.join(self.workdir, "stderr.log"), "w+b")
        try:
            self.proc = start_child(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                    bufsize=0)
        except OSError as e:
            self._log.close()
            remove_temp_dir(self.workdir)
            raise InputError(f"{self.label}: cannot start the command ({e.strerror or e})") from None
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.workdir, EXIT_GRACE)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._hello()

    # ------------------------------------------------------------------ handshake

    def _hello(self) -> None:
        ans = self.request("hello", _refusal_ok=True, protocol=PROTOCOL_VERSION, model=str(self.model),
                           workdir=self.workdir)
        if ans.get("ok") is not True:
            why = _one_line(ans.get("error", "no reason given"))
            self.close()
            raise EngineUnavailable(f"{self.label}: cannot run {self.model.name}: {why}")
        where = "hello"
        if ans.get("protocol") != PROTOCOL_VERSION:
            self._fail(where, f"speaks protocol {ans.get('protocol')!r}; this harness speaks {PROTOCOL_VERSION}")
        ops = ans.get("ops")
        if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
            self._fail(where, f"ops: expected a list of request names, got {_show(ops)}")
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            self._fail(where, f"ops: unknown request {unknown[0]!r} (known: {', '.join(OPS)})")
        if "logits" not in ops and "generate" not in ops:
            self._fail(where, "ops: answers neither logits nor generate (the harness needs one of them)")
        vocab = ans.get("vocab_size")
        if vocab is not None and not (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0):
            self._fail(where, f"vocab_size: expected a positive integer, got {_show(vocab)}")
        dtype = ans.get("dtype", "float32")
        if dtype not in DTYPES:
            self._fail(where, f"dtype: expected one of {', '.join(DTYPES)}, got {_show(dtype)}")
        kv = ans.get("kv_cache")
        if kv is not None and kv not in KV_CACHE_TYPES:
            self._fail(where, f"kv_cache: expected one of {', '.join(KV_CACHE_TYPES)}, got {_show(kv)}")
        approx = ans.get("approximations", [])
        if not isinstance(approx, list) or any(a not in APPROXIMATIONS for a in approx):
            self._fail(where, f"approximations: expected a list of {', '.join(APPROXIMATIONS)}, got {_show(approx)}")
        vec_dot = ans.get("vec_dot_types")
        if vec_dot is not None and vec_dot not in VEC_DOT_TABLES:
            self._fail(where, f"vec_dot_types: expected one of {', '.join(VEC_DOT_TABLES)}, got {_show(vec_dot)}")
        self.ops = tuple(ops)
        self.engine = str(ans.get("engine") or "?")
        self.vocab_size: int | None = vocab
        self.numerics = Numerics(dtype, kv, tuple(dict.fromkeys(approx)), "declared in hello", vec_dot)
        self.dtype = dtype
        self.approximations = self.numerics.approximations

    # ------------------------------------------------------------------ transport

    def request(self, op: str, _refusal_ok: bool = False, **fields: Any) -> dict[str, Any]:
        """Send one request, return its reply (a JSON object with ``"ok": true``).

        Raises:
            CmdError: the engine failed earlier, died, was late, wrote a malformed line, answered another
                request, or answered ``ok: false`` (unless ``_refusal_ok``: then that reply is returned).
        """
        rid = self._next_id
        self._next_id += 1
        where = f"{op} (request {rid})"
        if self._failed is not None:
            raise type(self._failed)(str(self._failed)).at(last_error=self._failed.last_error)
        line = json.dumps({"id": rid, "op": op, **fields}, allow_nan=False) + "\n"
        deadline = time.monotonic() + self.timeout
        self._write_line(line.encode("utf-8"), where, deadline)
        raw = self._read_line(where, deadline)
        try:
            ans = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._fail(where, f"reply is not JSON: {_show(raw.decode('utf-8', 'replace'))}")
        if not isinstance(ans, dict):
            self._fail(where, f"reply is not a JSON object: {_show(ans)}")
        if ans.get("id") != rid or isinstance(ans.get("id"), bool):  # true == 1 in Python, not in the protocol
            self._fail(where, f"reply has id {_show(ans.get('id'))}, expected {rid}")
        if ans.get("ok") is not True:
            if _refusal_ok and ans.get("ok") is False:
                return ans
            if ans.get("ok") is False:
                self._fail(where, f"the engine answered an error: {_one_line(ans.get('error', 'no reason given'))}")
            self._fail(where, f"reply has no \"ok\": true or false (got {_show(ans.get('ok'))})")
        return ans

    def _write_line(self, data: bytes, where: str, deadline: float) -> None:
        view = memoryview(data)
        fd = self.proc.stdin.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(where, f"the engine did not read the request within {self.timeout:g} s "
                                      f"(the engine was stopped; {TIMEOUT_ENV} sets the limit)")
                if not sel.select(left):
                    continue
                try:
                    n = os.write(fd, view[:1 << 16])
                except BlockingIOError:
                    continue
                except OSError:  # BrokenPipeError: the engine is gone
                    self._fail(where, self._died("before reading the request"), CmdCrashed)
                view = view[n:]

    def _read_line(self, where: str, deadline: float) -> bytes:
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[:nl + 1]
                if line.strip():
                    return line
                continue
            if len(self._buf) > MAX_LINE:
                self._fail(where, f"reply line longer than {MAX_LINE >> 20} MiB")
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(where, f"no reply within {self.timeout:g} s (the engine was stopped; "
                                  f"{TIMEOUT_ENV} sets the limit)")
            if not self._sel.select(left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                self._fail(where, self._died("before answering"), CmdCrashed)
            self._buf += chunk

    def _died(self, when: str) -> str:
        try:
            rc = self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return f"the engine closed its stdout {when} (still running)"
        status = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        last = self._last_stderr(rc)
        return f"the engine exited ({status}) {when}" + (f"; its last message: {last}" if last else "")

    def _last_stderr(self, rc: int) -> str:
        try:
            self._log.flush()
            size = self._log.seek(0, os.SEEK_END)
            self._log.seek(max(0, size - 16384))
            text = self._log.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return crash_line(text, rc) if text.strip() else ""

    def _fail(self, where: str, what: str, cls: type[CmdError] = CmdError, **at: Any):
        """Record the first fault, stop the engine, raise ``cls`` (:class:`CmdError`) with the engine's last stderr
        line as ``last_error`` and ``at`` (``index``, ``step``, ``partial``: :meth:`EngineFailure.at`)."""
        err = cls(f"{self.label} {where}: {what}")
        rc = self.proc.poll()
        err.at(last_error=self._last_stderr(rc if rc is not None else 0) or None, **at)
        self._failed = err
        self.close(grace=0.0)
        raise err

    def close(self, grace: float = EXIT_GRACE) -> None:
        """Close the engine's stdin (it should exit), kill it after ``grace`` seconds, remove its scratch folder."""
        state = self._finalizer.detach()
        if state is not None:
            _, _, (proc, workdir, _), _ = state
            _stop(proc, workdir, grace)
            self._sel.close()
            self._log.close()
        if self._failed is None:
            self._failed = CmdError(f"{self.label}: the engine was closed")

    def __enter__(self) -> "CmdEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ engine protocol

    def _needs(self, op: str) -> None:
        if op not in self.ops:
            raise EngineUnavailable(f"{self.label}: the engine does not answer {op!r} "
                                    f"(its hello lists {', '.join(self.ops)})")

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """Logits ``[T, V]`` (as float64) of every position of ``ids``, through the engine's ``logits`` request.

        Raises:
            EngineUnavailable: the engine does not answer ``logits``; or ``trace`` was given (a ``cmd:``
                engine hands its trace points over as a file: :meth:`trace_file`).
            CmdError: see :meth:`request`; the reply names no readable ``.npy``, or one that is not float32 /
                float64 ``[len(ids), vocab_size]``.
        """
        self._needs("logits")
        if trace is not None:
            raise EngineUnavailable(f"{self.label}: a cmd engine reports trace points in a trace file "
                                    "(its 'trace' request), not through a callback")
        ids = [int(t) for t in ids]
        rid = self._next_id
        out = os.path.join(self.workdir, f"logits-{rid}.npy")
        ans = self.request("logits", ids=ids, out=out)
        where = f"logits (request {rid})"
        path = ans.get("logits")
        if not isinstance(path, str):
            self._fail(where, f"reply has no \"logits\" path (got {_show(path)})")
        try:
            z = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            self._fail(where, f"cannot read its logits file {path} ({_one_line(str(e)) or type(e).__name__})")
        finally:
            if os.path.dirname(os.path.abspath(path)) == self.workdir:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if z.dtype not in (np.float32, np.float64):
            self._fail(where, f"logits of dtype {z.dtype}, expected float32 or float64")
        vocab = self.vocab_size if self.vocab_size is not None else (z.shape[-1] if z.ndim == 2 else -1)
        if z.shape != (len(ids), vocab):
            self._fail(where, f"logits of shape {list(z.shape)} for {len(ids)} ids, expected [{len(ids)}, {vocab}]")
        self.vocab_size = vocab
        return np.asarray(z, dtype=np.float64)

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      top_n: int = TOP_N) -> list[Generated]:
        """Greedy continuations with the top-``top_n`` ``(id, logprob)`` of every step, through ``generate``.

        Raises:
            EngineUnavailable: the engine does not answer ``generate``.
            CmdError: see :meth:`request`; a result list of another length, a stream of other than
                ``max_new_tokens`` tokens, a step without top log-probs or with more than ``top_n``, a token
                that is not the most probable of its own step's log-probs (with ``check_greedy``).
        """
        self._needs("generate")
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            return []
        rid = self._next_id
        where = f"generate (request {rid})"
        ans = self.request("generate", prompts=prompts, max_new_tokens=int(max_new_tokens), top_n=int(top_n))
        results = ans.get("results")
        if not isinstance(results, list) or len(results) != len(prompts):
            n = len(results) if isinstance(results, list) else _show(results)
            self._fail(where, f"results: expected a list of {len(prompts)}, got {n}")
        out = []
        for k, r in enumerate(results):
            out.append(self._generated(where, k, r, int(max_new_tokens), int(top_n)))
        return out

    def _generated(self, where: str, k: int, r: Any, n: int, top_n: int) -> Generated:
        try:
            tokens = [_int(t) for t in r["tokens"]]
            token_only = r.get("top_logprobs") is None  # an engine that gives tokens only (docs/engine-protocol.md)
            steps = [[] for _ in tokens] if token_only else \
                [[(_int(i), _float(lp)) for i, lp in step] for step in r["top_logprobs"]]
        except (KeyError, TypeError, ValueError, AttributeError):
            self._fail(where, f"results[{k}]: expected {{\"tokens\": [int], \"top_logprobs\": [[[id, logprob], "
                              f"...], ...]}} (top_logprobs optional), got {_show(r)}", index=k)
        if len(tokens) != n or len(steps) != n:
            self._fail(where, f"results[{k}]: {len(tokens)} tokens and {len(steps)} top_logprobs steps, "
                              f"expected {n} of each", index=k, step=min(len(tokens), len(steps), n), partial=tokens)
        for i, (tok, step) in enumerate(zip(tokens, steps)):
            if token_only:
                continue
            if not 1 <= len(step) <= top_n:
                self._fail(where, f"results[{k}] step {i}: {len(step)} top log-probs, expected 1..{top_n}",
                           index=k, step=i)
            best = max(lp for _, lp in step)
            if self.check_greedy and not any(t == tok and lp >= best for t, lp in step):
                self._fail(where, f"results[{k}] step {i}: token {tok} is not the most probable of its own top "
                                  f"log-probs {step[:3]} (not greedy)", index=k, step=i)
        g = Generated()
        g.tokens, g.top = tokens, steps
        return g

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt, ``max_new_tokens`` ids each."""
        return [g.tokens for g in self.generate_full(prompts, max_new_tokens)]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The engine's token ids of ``text`` (BOS added when ``add_special`` and the model wants it).

        Raises:
            EngineUnavailable: the engine does not answer ``tokenize``.
            CmdError: see :meth:`request`; ``ids`` missing or not a list of integers.
        """
        self._needs("tokenize")
        rid = self._next_id
        ans = self.request("tokenize", text=str(text), add_special=bool(add_special))
        try:
            return [_int(t) for t in ans["ids"]]
        except (KeyError, TypeError, ValueError):
            self._fail(f"tokenize (request {rid})", f"ids: expected a list of integers, got {_show(ans.get('ids'))}")

    def trace_file(self, ids: Sequence[int], out: str | os.PathLike, dump_dir: str | os.PathLike | None = None
                   ) -> Path:
        """Ask the engine to trace ``ids`` into ``out`` (a ``g4h-trace`` JSONL file, ``docs/trace-format.md``;
        with ``dump_dir``, the full tensors too). Returns the path the engine names (reading and checking the
        file is the caller's: :func:`harness.traces.format.read_trace`).

        Raises:
            EngineUnavailable: the engine does not answer ``trace``.
            CmdError: see :meth:`request`; the reply names no file that exists.
        """
        self._needs("trace")
        rid = self._next_id
        ans = self.request("trace", ids=[int(t) for t in ids], out=str(Path(out).resolve()),
                           dump_dir=None if dump_dir is None else str(Path(dump_dir).resolve()))
        path = ans.get("trace")
        if not isinstance(path, str) or not os.path.isfile(path):
            self._fail(f"trace (request {rid})", f"reply names no trace file that exists (got {_show(path)})")
        return Path(path)


# --------------------------------------------------------------------------- helpers


def _env_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise InputError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return v


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("not an integer")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("not a number")
    return float(v)


def _one_line(text: Any) -> str:
    s = str(text).strip()
    return s.splitlines()[0] if s else ""


def _show(v: Any, n: int = 80) -> str:
    """``v`` for a message: a string quoted, anything else as JSON; at most ``n`` characters."""
    s = (v if isinstance(v, str) else json.dumps(v, default=str)).replace("\n", " ")
    s = s[:n] + "..." if len(s) > n else s
    return repr(s) if isinstance(v, str) else s


