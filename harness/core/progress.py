"""The progress display of long work: phase lines, and counters with an estimate of the time left.

One :class:`Display` per command (``g4h parity``, ``g4h sweep``) writes to stderr, never to a results file:

* :meth:`Display.say`: one line, ``<prefix>: <message>`` (a phase begins);
* :meth:`Display.counter`: a phase of ``total`` equal steps (a reference pass's layers, its greedy steps, a server's
  requests, a sweep's tasks), ticked with :meth:`Counter.step`. On a terminal one live line is redrawn in place
  (``\\r``, at most :data:`LIVE_EVERY_S` apart), showing every open counter, innermost last
  (``reference greedy steps 3/8 | layer 12/35, 1m40s, about 2m10s left``); elsewhere (a CI log, a pipe) a plain
  line per counter at most every :data:`PLAIN_EVERY_S` seconds, and one when a counter that printed ends.
  ``quiet``: nothing at all.

Code that does long work asks for a counter from the active display (:func:`counter`, :func:`activate`), so that
the phases need no display argument threaded through every call; with none active (a library call, a test) a
counter costs nothing and shows nothing. ``reference/`` stays plain: it takes a callback (``on_layer``), and the
callers here tick a counter with it.

Only the standard library: the core display must not need :mod:`rich` (the ``[sweep]`` extra).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import Any, Iterator

from .text import for_terminal

__all__ = ["Counter", "Display", "activate", "active", "counter", "duration", "eta", "plain_every", "say"]

PLAIN_EVERY_S = 5.0
"""Seconds between two plain lines of one counter (stderr not a terminal); ``$G4H_PROGRESS_EVERY`` says otherwise
(``0``: a line at every step)."""

EVERY_ENV = "G4H_PROGRESS_EVERY"

LIVE_EVERY_S = 0.25
"""Seconds between two redraws of the live line (stderr a terminal)."""


def duration(seconds: float) -> str:
    """``seconds`` as ``42s``, ``3m05s`` or ``2h07m`` (rounded to whole seconds / minutes)."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(elapsed: float, done: float, total: float) -> str | None:
    """The time left of work of ``total`` equal steps of which ``done`` took ``elapsed`` seconds (a linear
    extrapolation: ``elapsed / done * (total - done)``), as :func:`duration`; None before the first step."""
    if done <= 0 or total <= 0:
        return None
    return duration(elapsed / done * max(total - done, 0.0))


def plain_every() -> float:
    """Seconds between two plain lines of a counter: ``$G4H_PROGRESS_EVERY`` when it is a number >= 0, else
    :data:`PLAIN_EVERY_S`."""
    try:
        v = float(os.environ.get(EVERY_ENV, ""))
    except ValueError:
        return PLAIN_EVERY_S
    return v if v >= 0 and math.isfinite(v) else PLAIN_EVERY_S


class Counter:
    """A phase of ``total`` equal steps (:meth:`Display.counter`); a context manager that ends it on exit.

    Attributes:
        label: what is counted (``reference pass 1: layer``); total: the steps; done: those finished.
    """

    def __init__(self, display: "Display | None", label: str, total: int) -> None:
        self.display, self.label, self.total = display, label, max(int(total), 0)
        self.done = 0
        self.t0 = time.monotonic()
        self.last_line = self.t0  # a plain line comes PLAIN_EVERY_S after the start, then as often
        self.printed = -1  # the count its last plain line showed (-1: none yet)

    def step(self, n: int = 1) -> None:
        """``n`` more steps finished (thread-safe; a no-op without a display)."""
        if self.display is not None:
            self.display._step(self, n)

    def fraction(self) -> float:
        """Steps done, counting an open inner counter's share of the current step (``0.0`` to ``1.0``)."""
        if not self.total:
            return 1.0
        inner = self.display._inner(self) if self.display is not None else None
        part = inner.fraction() if inner is not None and self.done < self.total else 0.0
        return min((self.done + part) / self.total, 1.0)

    def text(self) -> str:
        """``label done/total, elapsed, about T left``."""
        elapsed = time.monotonic() - self.t0
        left = eta(elapsed, self.fraction() * self.total, self.total)
        return (f"{self.label} {self.done}/{self.total}, {duration(elapsed)}"
                + (f", about {left} left" if left is not None and self.done < self.total else ""))

    def close(self) -> None:
        """End the phase (its last count and time said, when it printed a plain line and not that one)."""
        if self.display is not None:
            self.display._close(self)

    def __enter__(self) -> "Counter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Display:
    """The progress display of one command (module docstring); a plain object: a ``--jobs`` worker process gets a
    copy, which draws plain lines (several processes cannot share one live line).

    Args:
        prefix: said before every line (``g4h parity``).
        quiet: show nothing.
        live: redraw one line in place; None: when stderr is a terminal.
        stream: where to write (default: ``sys.stderr`` when written, so a copy in another process writes to its
            own).
    """

    def __init__(self, prefix: str, quiet: bool = False, live: bool | None = None, stream: Any = None) -> None:
        self.prefix, self.quiet, self.stream = prefix, quiet, stream
        self.live = live
        self.every = plain_every()
        self._open: list[Counter] = []
        self._drawn = 0.0
        self._width = 0  # characters of the live line now on screen
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_open", "stream")}
        return {**state, "live": False, "_width": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, stream=None, _open=[], _lock=threading.Lock())

    def __call__(self, msg: str) -> None:
        """:meth:`say`: a display is a ``progress(msg)`` callable, as the checks take one."""
        self.say(msg)

    def _out(self) -> Any:
        return self.stream if self.stream is not None else sys.stderr

    def _is_live(self) -> bool:
        if self.live is None:
            isatty = getattr(self._out(), "isatty", None)
            self.live = bool(isatty and isatty())
        return self.live

    def say(self, msg: str) -> None:
        """One line, ``<prefix>: <msg>`` (the live line redrawn below it)."""
        if self.quiet:
            return
        with self._lock:
            self._clear()
            self._write(f"{self.prefix}: {for_terminal(msg)}\n")
            if self._open and self._is_live():
                self._draw()

    def counter(self, label: str, total: int) -> Counter:
        """A new phase of ``total`` steps, inside the phases open now (a context manager: :class:`Counter`)."""
        if self.quiet:
            return Counter(None, label, total)
        c = Counter(self, label, total)
        with self._lock:
            self._open.append(c)
        return c

    def _inner(self, c: Counter) -> Counter | None:
        i = next((k for k, o in enumerate(self._open) if o is c), None)
        return self._open[i + 1] if i is not None and i + 1 < len(self._open) else None

    def _step(self, c: Counter, n: int) -> None:
        with self._lock:
            c.done = min(c.done + n, c.total)
            now = time.monotonic()
            if self._is_live():
                if now - self._drawn >= LIVE_EVERY_S or c.done == c.total:
                    self._draw()
            elif now - c.last_line >= self.every:
                self._plain(c, now)

    def _plain(self, c: Counter, now: float) -> None:
        outer = [o.text() for o in self._open[:self._open.index(c)]] if c in self._open else []
        self._write(f"{self.prefix}: {' | '.join(outer + [c.text()])}\n")
        c.last_line, c.printed = now, c.done

    def _close(self, c: Counter) -> None:
        with self._lock:
            if c not in self._open:
                return
            if not self._is_live() and 0 <= c.printed < c.done:  # a phase that showed: its end too, once
                self._plain(c, time.monotonic())
            self._open.remove(c)
            if self._is_live():
                self._clear()
                if self._open:
                    self._draw()

    def _draw(self) -> None:
        line = f"{self.prefix}: " + " | ".join(o.text() for o in self._open)
        self._clear()
        self._write(line)
        self._width, self._drawn = len(line), time.monotonic()

    def _clear(self) -> None:
        if self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width = 0

    def _write(self, text: str) -> None:
        out = self._out()
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):  # a closed or broken stderr: the work goes on without its display
            pass


_active: Display | None = None


def active() -> Display | None:
    """The display of the command running in this process, or None."""
    return _active


@contextlib.contextmanager
def activate(display: Display | None) -> Iterator[Display | None]:
    """While inside, :func:`counter` and :func:`say` use ``display`` (None: show nothing); the one before is
    restored on exit."""
    global _active
    before, _active = _active, display
    try:
        yield display
    finally:
        _active = before


def counter(label: str, total: int) -> Counter:
    """A counter of the active display (:meth:`Display.counter`); with none active, one that shows nothing."""
    d = _active
    return d.counter(label, total) if d is not None else Counter(None, label, total)


def say(msg: str) -> None:
    """A line of the active display (:meth:`Display.say`); nothing with none active."""
    if _active is not None:
        _active.say(msg)
