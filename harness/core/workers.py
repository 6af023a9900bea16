"""Worker subprocesses: engines that may abort the process (llama.cpp) run in one, and die with it.

llama.cpp aborts the whole process on some layouts (a ``GGML_ASSERT``), so the harness never loads it
in its own process: it starts ``python -m <worker module>`` and talks to it through pipes or files.
This module holds what every such worker shares:

* :func:`worker_env`: the worker's environment (this checkout first on ``PYTHONPATH``; no debugger
  attached on an abort);
* :func:`start_worker` / :func:`run_worker`: start one with ``PR_SET_PDEATHSIG`` on Linux, so it is
  killed when the parent dies (no orphan under PID 1); :func:`start_child` does the same for any program
  (a ``cmd:`` engine);
* :class:`EngineCrashed` and :func:`crash_error`: a dead worker becomes one line,
  ``engine crashed: <what it last said>``, never a traceback.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from typing import Any, Sequence

from .paths import REPO_ROOT


class EngineCrashed(RuntimeError):
    """The engine's process died (abort, signal, non-zero exit) or could not load the model.

    ``str(err)`` is one line, ``engine crashed: <what the engine last said>``.
    """


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
    """The environment of a llama.cpp worker process: this one's, plus the repo root first on ``PYTHONPATH``
    (so ``python -m harness.<worker>`` imports this checkout) and ``GGML_NO_BACKTRACE=1`` (an abort prints
    its assert line and never attaches a debugger)."""
    env = dict(os.environ)
    env["GGML_NO_BACKTRACE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn``: ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _popen_kwargs() -> dict[str, Any]:
    kw: dict[str, Any] = {"env": worker_env(), "cwd": str(REPO_ROOT)}
    if sys.platform.startswith("linux"):
        kw["preexec_fn"] = _die_with_parent
    return kw


def start_child(argv: Sequence[str], **popen: Any) -> subprocess.Popen:
    """Start the program ``argv`` as a child that dies with this process (``PR_SET_PDEATHSIG`` on Linux).

    Unlike :func:`start_worker` it keeps this process's environment and working folder unless ``popen``
    says otherwise (a user's engine runs where the user ran ``g4h``).

    Raises:
        OSError: the program cannot be started (not found, not executable).
    """
    if sys.platform.startswith("linux"):
        popen.setdefault("preexec_fn", _die_with_parent)
    return subprocess.Popen(list(argv), **popen)


def start_worker(module: str, args: Sequence[str] = (), **popen: Any) -> subprocess.Popen:
    """Start ``python -m <module> <args>`` as a worker that dies with this process.

    Args:
        module: the worker module, e.g. ``harness.engines.llamacpp.tokworker``.
        args: its command-line arguments.
        popen: more ``subprocess.Popen`` keywords (pipes, ``text`` ...).

    Returns:
        the running process.
    """
    return subprocess.Popen([sys.executable, "-m", module, *args], **_popen_kwargs(), **popen)


def run_worker(module: str, args: Sequence[str] = (), *, input: str | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m <module> <args>`` to completion as a worker (stdout/stderr captured as text).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` (it has been killed).
    """
    return subprocess.run([sys.executable, "-m", module, *args], input=input, capture_output=True, text=True,
                          timeout=timeout, **_popen_kwargs())
