"""Worker subprocesses: engines that may abort the process (llama.cpp) run in one, and die with it.

llama.cpp aborts the whole process on some layouts (a ``GGML_ASSERT``), so the harness never loads it
in its own process: it starts ``python -m <worker module>`` and talks to it through pipes or files.
This module holds what every such worker shares:

* :func:`worker_env`: the worker's environment (this checkout first on ``PYTHONPATH``; no debugger
  attached on an abort);
* :func:`start_worker` / :func:`run_worker`: start one with ``PR_SET_PDEATHSIG`` on Linux, so it is
  killed when the parent dies (no orphan under PID 1); :func:`start_child` does the same for any program
  (a ``cmd:`` engine); :func:`process_pool` for a pool of Python workers (``g4h parity --jobs``);
* :func:`temp_dir` / :func:`remove_temp_dir` (or :func:`temp_folder`, a ``with`` block): a worker's
  temporary folder, removed even when the parent is killed with SIGKILL (a watchdog process holds the
  other end of a pipe from the parent: when the parent dies, however it dies, the pipe closes and the
  watchdog removes the folders still registered);
* :class:`EngineCrashed` and :func:`crash_error`: a dead worker becomes one line,
  ``engine crashed: <what it last said>``, never a traceback.

The process policy, in one place: **every process the harness starts dies with the process that started it**,
however that one ends (SIGKILL included), and nothing it started goes on computing.

* a program or worker (:func:`start_child`, :func:`start_worker`, :func:`run_worker`): a session (and process
  group) of its own (``start_new_session``: set by ``subprocess`` in C, no ``preexec_fn``, which is unsafe in a
  threaded process), registered with the watchdog, which SIGKILLs the whole group when this process dies (its
  grandchildren included: a shell wrapper's children, a server's workers); :func:`stop_child` ends the group on
  close and on timeout. The program is started through a tiny launcher (``python -I -S -c``: :data:`_LAUNCH`) that
  sets ``PR_SET_PDEATHSIG`` (SIGKILL) on itself, exits if its parent died already, and ``exec``s the program in
  the same process: the direct child dies with this process even in the instant before it is registered;
* a pool worker (:func:`process_pool`, multiprocessing's spawn): the same, as the first thing its initializer
  does, before any task;
* multiprocessing's resource tracker (started by the pool's queues, not by us): registered with the watchdog,
  which waits :data:`REMOVE_RETRY_S` for it to end on its own (it does once every holder of its pipe is gone, and
  removes the semaphores of the dead) and kills it after;
* the watchdog itself runs in its own session (a Ctrl-C of the terminal does not reach it) and exits when its pipe
  from the parent closes, after removing the parent's folders and ending what is registered.

``tests/test_parity_kill.py`` kills ``g4h parity --jobs 2`` at ten moments and counts what survives (0).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import importlib
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

from .paths import SEARCH_ROOT


class EngineFailure(RuntimeError):
    """The engine under test is wrong: it crashed, broke its protocol, or returned unusable output.

    The opposite of :class:`reference.errors.InputError` (the user's input cannot be used, exit 2): an engine
    failure is the engine's fault, exit 1, headed "ENGINE FAILED". ``str(err)`` is one line.

    Where it happened, when known (set by the engine or by its caller with :meth:`at`; None otherwise):

    Attributes:
        request: the request the engine failed on, as the user knows it (a prompt's id).
        step: the generation step (0-based) of that request where the fault shows.
        last_error: the engine's own last error line (its stderr, a server's error message).
        index: the prompt's place in the batch the engine was given (its caller maps it to ``request``).
        partial: the token ids the engine returned for that prompt before the fault was found, when any (its
            caller compares them with the reference to name ``step``).
        decoding: for a greedy stream whose token is not the top-1 of the engine's own log-probs, what differs in
            decoding there when its log-probs are the oracle's (a dict with ``request``, ``step``, ``what``, ``line``:
            :func:`harness.parity.explain_decoding.decoding_by_logprobs`), else None.
    """

    request: Any = None
    step: int | None = None
    last_error: str | None = None
    index: int | None = None
    partial: list[int] | None = None
    decoding: dict[str, Any] | None = None

    def at(self, **where: Any) -> "EngineFailure":
        """Record where the fault happened (``request``, ``step``, ``last_error``, ``index``, ``partial``); a value
        already known is kept (the innermost caller knows best). Returns ``self``, for ``raise err.at(...)``."""
        for key, value in where.items():
            if key not in ("request", "step", "last_error", "index", "partial"):
                raise TypeError(f"EngineFailure.at: unknown field {key!r}")
            if value is not None and getattr(self, key) is None:
                setattr(self, key, value)
        return self


class EngineCrashed(EngineFailure):
    """The engine's process died (abort, signal, non-zero exit) or could not load the model.

    ``str(err)`` is one line, ``engine crashed: <what the engine last said>``.
    """


class EngineProtocolError(EngineFailure):
    """The engine answered, but not as its protocol says (a malformed reply, a token it cannot name, a missing
    field, an HTTP error on a request it should serve). ``str(err)`` is one line naming the request."""


class EngineOutputError(EngineFailure):
    """The engine returned non-finite numbers (NaN or Inf logits, or a non-finite activation at a trace point).
    ``str(err)`` is one line naming the first layer and point where they appeared."""


_SRC_PATH = re.compile(r"(?:[A-Za-z]:)?[^\s:()]*[/\\]([^/\\\s:()]+\.(?:c|cc|cpp|h|hpp|cu)):")


def crash_line(stderr: str, rc: int) -> str:
    """The one line that says why the worker died (source paths shortened to the file name)."""
    return _SRC_PATH.sub(r"\1:", _pick_line(stderr, rc))


_REASON_KEYS = ("GGML_ASSERT", "GGML_ABORT", "error", "Error", "failed", "terminate")


def _is_reason(stderr: str) -> bool:
    """stderr holds a line that says why (a worker error, an assert, an error message)."""
    return "G4H-WORKER-ERROR" in stderr or any(k in stderr for k in _REASON_KEYS)


def _pick_line(stderr: str, rc: int) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "G4H-WORKER-ERROR" in ln:
            return ln.split("]: ", 1)[-1] if "]: " in ln else ln
    for key in _REASON_KEYS:
        for ln in reversed(lines):
            if key in ln:
                return ln
    if lines:
        return lines[-1]
    return f"exit status {rc}"


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def worker_env() -> dict[str, str]:
    """The environment of a llama.cpp worker process: this one's, plus the folder holding ``gemma4_harness``
    first on ``PYTHONPATH`` (:data:`harness.core.paths.SEARCH_ROOT`, so ``python -m gemma4_harness.harness.<worker>``
    imports this checkout or install) and ``GGML_NO_BACKTRACE=1`` (an abort prints its assert line and never
    attaches a debugger). Workers run in that folder (``python -m`` puts its folder first on ``sys.path``: the
    user's folder could shadow ``gemma4_harness``) and write nothing there: every file they write has an absolute
    path."""
    env = dict(os.environ)
    env["GGML_NO_BACKTRACE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(SEARCH_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def crash_error(stderr: str, rc: int, model_name: str) -> EngineCrashed:
    """The :class:`EngineCrashed` for a worker that died with exit status ``rc`` (negative: a signal).

    Args:
        stderr: everything the worker wrote on stderr.
        rc: its exit status (``Popen.returncode``).
        model_name: the GGUF's file name, named when stderr does not say why.

    Returns:
        ``EngineCrashed("engine crashed: <line>")``, one line: the worker's ``G4H-WORKER-ERROR`` message,
        else its last line that names a reason (``GGML_ASSERT``, ``error``, ``terminate``, ...; source paths
        shortened to the file name) with the exit status, else ``llama.cpp worker died (<status>) on
        <model_name>`` and its last stderr line, if any.
    """
    line = crash_line(stderr, rc)
    if not _is_reason(stderr):
        line = f"llama.cpp worker died ({_describe_rc(rc)}) on {model_name}" + (
            f"; its last message: {line}" if stderr.strip() else "")
        return EngineCrashed(f"engine crashed: {line}")
    return EngineCrashed(f"engine crashed: {line} ({_describe_rc(rc)})")


_PR_SET_PDEATHSIG = 1

#: Seconds the watchdog keeps trying to remove a folder that a dying worker may still be writing into (and gives
#: multiprocessing's resource tracker to end on its own).
REMOVE_RETRY_S = 5.0


def _die_with_parent(parent: int) -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn``: ask the kernel to SIGKILL this process when its parent dies (Linux only).

    A parent that died between the fork and the ``prctl`` sends no signal: the child then finds itself
    adopted (its parent id is no longer ``parent``) and exits at once.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def die_with_parent(parent: int) -> None:
    """In a process the harness started (not between fork and exec: a pool worker's initializer): be killed with
    SIGKILL when ``parent`` dies, and exit at once if it is dead already (:func:`_die_with_parent`)."""
    if sys.platform.startswith("linux"):
        _die_with_parent(parent)


def _pool_init(parent: int, initializer: str | None, initargs: tuple) -> None:  # pragma: no cover - in a worker
    """A pool worker's first step: die with ``parent``; then import and run ``initializer`` (``module:function``,
    named rather than pickled, so that nothing heavy is imported before the worker is tied to its parent)."""
    die_with_parent(parent)
    if initializer:
        module, _, name = initializer.partition(":")
        getattr(importlib.import_module(module), name)(*initargs)


def process_pool(workers: int, initializer: str | None = None, initargs: tuple = ()) -> Any:
    """A ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` spawned Python processes (a fresh interpreter
    each, no forked torch or BLAS threads), under the process policy of this module:

    * each worker is registered with the watchdog as it starts, which SIGKILLs it at once when this process dies
      (its first seconds, while it imports, included);
    * each worker sets ``PR_SET_PDEATHSIG`` first in its initializer, then runs ``initializer(*initargs)``
      (``"module:function"``);
    * multiprocessing's resource tracker (started by the pool's queues) is registered with the watchdog, which
      gives it :data:`REMOVE_RETRY_S` to end on its own (unlinking the semaphores of the dead) before killing it.

    Use it as a ``with`` block (the pool is shut down and its workers joined at the end).
    """
    class PolicyPool(ProcessPoolExecutor):
        """Registers every worker with the watchdog as soon as it exists (spawned in ``submit``)."""

        _watched: set[int] = set()

        def submit(self, *args: Any, **kwargs: Any) -> Any:
            future = super().submit(*args, **kwargs)
            for proc in list((getattr(self, "_processes", None) or {}).values()):  # no public accessor
                if proc.pid and proc.pid not in self._watched:
                    self._watched.add(proc.pid)
                    watch_process(proc.pid, wait_s=0.0)
            return future

    pool = PolicyPool(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_pool_init,
                      initargs=(os.getpid(), initializer, tuple(initargs)))
    pool._watched = set()
    _watch_resource_tracker()
    return pool


def _watch_resource_tracker() -> None:
    """Register multiprocessing's resource tracker, when running, with the watchdog (started by the pool's queues)."""
    pid = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)  # no public accessor
    if pid:
        watch_process(pid, wait_s=REMOVE_RETRY_S)


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22): with the pid, it
    names one process even after the pid is reused. None when it is gone (or there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def watch_process(pid: int, wait_s: float = REMOVE_RETRY_S) -> None:
    """Have the watchdog end process ``pid`` when this process dies: SIGKILL after ``wait_s`` seconds for it to end
    on its own (0: at once). For a process started by a library, where no ``PR_SET_PDEATHSIG`` can be set before it
    runs (Linux only: the process is named by its pid and start time)."""
    start = _start_time(pid)
    if start is None:
        return
    entry = f"{pid}:{start}:{wait_s:g}"
    with _lock:
        _procs.add(entry)
        _tell_watchdog(f"k{entry}")


_LAUNCH = ("import ctypes, os, signal, sys\n"
           "try:\n"
           "    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"  # 1: PR_SET_PDEATHSIG
           "except Exception:\n"
           "    pass\n"
           "if os.getppid() != int(sys.argv[1]):\n"
           "    os._exit(1)\n"
           "os.execvp(sys.argv[2], sys.argv[2:])\n")
"""The launcher of every program the harness starts on Linux (``python -I -S -c _LAUNCH PARENT PROGRAM ARGS``): it
asks the kernel to SIGKILL it when its parent dies, exits if the parent is gone already, and replaces itself with
the program (``exec``: same process, same pid, the death signal kept). This is what ``preexec_fn`` did, without
running Python between ``fork`` and ``exec`` of a threaded process."""


def _resolve(argv0: str, env: dict[str, str] | None) -> str:
    """``argv0`` as ``exec`` would find it, checked here (the launcher's ``exec`` failure would be its own
    traceback): an :class:`OSError` that names it when it is missing or not executable."""
    if os.sep in argv0:
        if not os.path.exists(argv0):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv0)
        if os.path.isdir(argv0) or not os.access(argv0, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), argv0)
        return argv0
    found = shutil.which(argv0, path=(env if env is not None else os.environ).get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv0)
    return found


def _watch_group(pgid: int) -> None:
    """Have the watchdog SIGKILL process group ``pgid`` (led by our child ``pgid``) when this process dies."""
    start = _start_time(pgid)
    if start is None and sys.platform.startswith("linux"):
        return  # gone already (and reaped by nobody yet: it is a zombie with a start time, so this is rare)
    with _lock:
        _groups[pgid] = f"{pgid}:{start}"
        _tell_watchdog(f"g{_groups[pgid]}")


def _unwatch_group(pgid: int) -> None:
    with _lock:
        entry = _groups.pop(pgid, None)
        if entry is not None:
            _tell_watchdog(f"G{entry}")


def _popen(argv: Sequence[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv)`` under the process policy: its own session and process group, registered with the
    watchdog (the group is SIGKILLed when this process dies), the death signal set by :data:`_LAUNCH` (Linux)."""
    argv = list(argv)
    if popen.pop("preexec_fn", None) is not None:
        raise ValueError("the process policy starts no preexec_fn (unsafe in a threaded process)")
    popen["start_new_session"] = True
    if sys.platform.startswith("linux"):
        if popen.get("cwd") is not None and os.sep in argv[0] and not os.path.isabs(argv[0]):
            argv[0] = os.path.join(popen["cwd"], argv[0])
        argv = [sys.executable, "-I", "-S", "-c", _LAUNCH, str(os.getpid()), _resolve(argv[0], popen.get("env")),
                *argv[1:]]
    proc = subprocess.Popen(argv, **popen)
    _watch_group(proc.pid)
    return proc


def _popen_kwargs() -> dict[str, Any]:
    return {"env": worker_env(), "cwd": str(SEARCH_ROOT)}


def start_child(argv: Sequence[str], **popen: Any) -> subprocess.Popen:
    """Start the program ``argv`` as a child that dies with this process, its own children included (the process
    policy above: a session of its own, killed as a group by the watchdog, ``PR_SET_PDEATHSIG`` on Linux). End it
    with :func:`stop_child`.

    Unlike :func:`start_worker` it keeps this process's environment and working folder unless ``popen``
    says otherwise (a user's engine runs where the user ran ``g4h``).

    Raises:
        OSError: the program cannot be started (not found, not executable).
    """
    return _popen(argv, **popen)


def start_worker(module: str, args: Sequence[str] = (), **popen: Any) -> subprocess.Popen:
    """Start ``python -m <module> <args>`` as a worker that dies with this process (:func:`start_child`'s policy).

    Args:
        module: the worker module, e.g. ``harness.engines.llamacpp.tokworker``.
        args: its command-line arguments.
        popen: more ``subprocess.Popen`` keywords (pipes, ``text`` ...).

    Returns:
        the running process; end it with :func:`stop_child`.
    """
    return _popen([sys.executable, "-m", module, *args], **_popen_kwargs(), **popen)


def run_worker(module: str, args: Sequence[str] = (), *, input: str | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m <module> <args>`` to completion as a worker (stdout/stderr captured as text); its process
    group is killed when it ends (what it started goes with it), on a timeout and on any error here.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` (its group has been killed).
    """
    argv = [sys.executable, "-m", module, *args]
    proc = _popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                  **_popen_kwargs())
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_child(proc, 0.0)
        raise subprocess.TimeoutExpired(argv, timeout) from None
    except BaseException:
        stop_child(proc, 0.0)
        raise
    stop_child(proc, 0.0)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _exited_unreaped(pid: int) -> bool:
    """Process ``pid`` (our child) has exited; it is left a zombie (``WNOWAIT``), so its pid, the group's id, is not
    reused before :func:`stop_child` has killed the group."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already (by Popen.poll elsewhere)
        return True


def stop_child(proc: subprocess.Popen, grace: float = 0.0) -> int:
    """End a process started by :func:`start_child` / :func:`start_worker` and everything in its process group:
    wait up to ``grace`` seconds for it to exit on its own (its stdin closed by the caller), then SIGKILL the whole
    group (the leader if still running, and any grandchild it left behind, whether or not it exited), reap it and
    release it from the watchdog.

    Returns:
        its exit status (``Popen.returncode``).
    """
    deadline = time.monotonic() + grace
    if proc.returncode is None and hasattr(os, "waitid"):
        while not _exited_unreaped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    with contextlib.suppress(OSError):  # the group outlives its leader while a grandchild is in it
        os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    _unwatch_group(proc.pid)
    return rc


# --------------------------------------------------------------------------- temporary folders

_lock = threading.Lock()
_watchdog: subprocess.Popen | None = None
_held: set[str] = set()
_procs: set[str] = set()  # "pid:start time" of processes the watchdog ends with this one (watch_process)
_groups: dict[int, str] = {}  # process group id -> "pgid:leader start time" the watchdog kills with this one


def _forget_after_fork() -> None:  # pragma: no cover - runs in a forked child
    """A forked child holds none of its parent's folders, and starts its own watchdog when it needs one.

    Its copy of the parent's pipe is closed, so the parent's watchdog still sees the parent's death.
    """
    global _lock, _watchdog
    _lock = threading.Lock()
    if _watchdog is not None and _watchdog.stdin is not None:
        try:
            _watchdog.stdin.close()  # empty: every write is flushed under the lock
        except OSError:
            pass
    _watchdog = None
    _held.clear()
    _procs.clear()
    _groups.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _start_watchdog() -> subprocess.Popen:
    """``python -m gemma4_harness.harness.core.workers`` in its own session (a Ctrl-C or a kill of the harness's process
    group does not reach it), reading folder registrations on its stdin."""
    return subprocess.Popen([sys.executable, "-m", "gemma4_harness.harness.core.workers"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=worker_env(), cwd=str(SEARCH_ROOT))


def _tell_watchdog(line: str) -> None:
    """Send ``+PATH`` or ``-PATH`` to this process's watchdog, starting it (again) when needed."""
    global _watchdog
    for _ in range(2):
        if _watchdog is None or _watchdog.poll() is not None:
            _watchdog = _start_watchdog()
            assert _watchdog.stdin is not None
            for held in _held:  # a restarted watchdog learns every folder still held
                _watchdog.stdin.write(f"+{held}\n".encode())
            for proc in _procs:  # and every process to end
                _watchdog.stdin.write(f"k{proc}\n".encode())
            for group in _groups.values():  # and every process group to kill
                _watchdog.stdin.write(f"g{group}\n".encode())
        assert _watchdog.stdin is not None
        try:
            _watchdog.stdin.write(f"{line}\n".encode())
            _watchdog.stdin.flush()
            return
        except (BrokenPipeError, OSError):
            _watchdog = None


def temp_dir(prefix: str, dir: str | os.PathLike | None = None) -> Path:
    """A fresh temporary folder (in ``dir``, default ``tempfile.gettempdir()``) that is removed when this
    process ends.

    Removed by :func:`remove_temp_dir`, or else, however this process ends (SIGKILL included), by a
    watchdog process: it holds the read end of a pipe from this process, sees it close when this process
    dies, and removes every folder still registered (retrying for :data:`REMOVE_RETRY_S` while a dying
    worker may still write into one).

    Args:
        prefix: the folder name's prefix, e.g. ``g4h-llamacpp-``.
        dir: the folder to make it in.

    Returns:
        the folder's path.
    """
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    with _lock:
        _held.add(path)
        _tell_watchdog(f"+{path}")
    return Path(path)


def remove_temp_dir(path: str | os.PathLike, keep: bool = False) -> None:
    """Remove a folder made by :func:`temp_dir` (and what is in it) and tell the watchdog it is gone.

    ``keep``: only tell the watchdog (the folder was renamed into place and is no longer temporary).
    """
    if not keep:
        shutil.rmtree(path, ignore_errors=True)
    with _lock:
        if str(path) in _held:
            _held.discard(str(path))
            _tell_watchdog(f"-{path}")


@contextlib.contextmanager
def temp_folder(prefix: str, dir: str | os.PathLike | None = None) -> Iterator[Path]:
    """:func:`temp_dir` as a ``with`` block: the folder is removed when the block ends, and by the watchdog
    when this process is killed inside it (where ``tempfile.TemporaryDirectory`` would leave it behind).

    Args:
        prefix: the folder name's prefix, e.g. ``g4h-pair-``.
        dir: the folder to make it in (default ``tempfile.gettempdir()``).

    Yields:
        the folder's path.
    """
    path = temp_dir(prefix, dir)
    try:
        yield path
    finally:
        remove_temp_dir(path)


@atexit.register
def _stop_watchdog() -> None:
    """At a normal exit: release the registered processes (they end with this process by themselves: the
    resource tracker on its pipe's end), close the pipe, so the watchdog removes what is left and exits; wait
    for it."""
    if _watchdog is not None:
        try:
            if _watchdog.stdin is not None:
                for proc in _procs:
                    _watchdog.stdin.write(f"K{proc}\n".encode())
                _watchdog.stdin.close()
            _watchdog.wait(REMOVE_RETRY_S + 1)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _remove(path: str, retry_s: float = REMOVE_RETRY_S) -> None:
    """Remove ``path``, retrying while something (a worker being killed) may still create files in it."""
    deadline = time.monotonic() + retry_s
    while os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _end(pid: int, start: str, wait_s: float = REMOVE_RETRY_S) -> None:
    """End process ``pid`` (if it is still the one that started at ``start``): wait ``wait_s`` for it to exit on
    its own, then SIGKILL."""
    deadline = time.monotonic() + wait_s
    while _start_time(pid) == start and time.monotonic() < deadline:
        time.sleep(0.05)
    if _start_time(pid) == start:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _kill_group(entry: str) -> None:
    """SIGKILL the process group of ``entry`` (``PGID:LEADER START``), unless its id now leads another process (the
    leader was reaped and its pid reused: a group of that id is then someone else's)."""
    pgid, _, start = entry.partition(":")
    if not pgid.isdigit():
        return
    now = _start_time(int(pgid))
    if now is not None and start not in ("None", now):
        return
    with contextlib.suppress(OSError):
        os.killpg(int(pgid), signal.SIGKILL)


def watch(stream: BinaryIO) -> None:
    """The watchdog's loop: ``+PATH`` / ``-PATH`` lines register and release folders, ``kPID:START:WAIT`` /
    ``KPID:START:WAIT`` register and release a process, ``gPGID:START`` / ``GPGID:START`` a process group (killed
    first, at once); at end of input (the parent closed the pipe, or died) every
    folder still registered is removed and every registered process ended (:func:`_end`)."""
    held: set[str] = set()
    procs: set[str] = set()
    groups: set[str] = set()
    for raw in stream:
        line = raw.decode("utf-8", "surrogateescape").rstrip("\n")
        if line[:1] == "+":
            held.add(line[1:])
        elif line[:1] == "-":
            held.discard(line[1:])
        elif line[:1] == "k":
            procs.add(line[1:])
        elif line[:1] == "K":
            procs.discard(line[1:])
        elif line[:1] == "g":
            groups.add(line[1:])
        elif line[:1] == "G":
            groups.discard(line[1:])
    for group in groups:  # first, at once: engines and workers may be computing, their children too
        _kill_group(group)
    entries = []
    for proc in procs:
        pid, start, wait_s = (proc.split(":") + ["", ""])[:3]
        if pid.isdigit():
            entries.append((float(wait_s or REMOVE_RETRY_S), int(pid), start))
    for wait_s, pid, start in sorted(entries):
        if wait_s == 0:  # a pool worker: at once, before anything else (it may be computing)
            _end(pid, start, 0.0)
    for path in held:
        _remove(path)
    for wait_s, pid, start in sorted(entries):
        if wait_s:
            _end(pid, start, wait_s)


if __name__ == "__main__":  # the watchdog process of temp_dir()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(sys.stdin.buffer)
