"""What a running sweep shows: rows done, running and failed, and the load of each node.

On a terminal (stderr a TTY) a :mod:`rich` live panel is redrawn about once a second: the counts, one line per
node (its CPUs, the tasks running there), the tasks running now. Elsewhere (a CI log, a pipe) one plain line per
finished row. ``--quiet`` shows neither.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from ..core.progress import duration, eta
from . import judge


def _fmt(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) and x == x else "-"


class Progress:
    """The progress display of one sweep (see the module docstring).

    Args:
        quiet: show nothing.
        stream: where to draw (default stderr).
    """

    def __init__(self, quiet: bool = False, stream: Any = None) -> None:
        self.quiet = quiet
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)
        self.live: Live | None = None
        self.total = self.done = self.failed = 0
        self.node_list: list[Any] = []
        self.running: list[tuple] = []
        self.t0 = time.monotonic()

    def say(self, line: str) -> None:
        """One line (not in quiet mode)."""
        if not self.quiet:
            self.console.print(f"g4h sweep: {line}", markup=False)

    def nodes(self, alive: Sequence[Any]) -> None:
        """The cluster's nodes, once."""
        self.node_list = list(alive)
        for n in alive:
            self.say(f"node {n.short} ({n.host}, {n.address}): {n.cpus:g} CPUs, {n.memory / 1e9:.1f} GB, object "
                     f"store {n.object_store / 1e9:.2f} GB")

    def start(self, tasks: int, already: int) -> None:
        """The sweep's tasks are submitted: ``tasks`` to run, ``already`` rows from an earlier run."""
        self.total = tasks
        self.t0 = time.monotonic()
        if already:
            self.say(f"{already} row(s) already in the run directory")
        self.say(f"{tasks} task(s) submitted")
        if not self.quiet and self.console.is_terminal:
            self.live = Live(self._panel(), console=self.console, refresh_per_second=2, transient=True)
            self.live.start()

    def row(self, rec: dict[str, Any]) -> None:
        """A record arrived."""
        if rec["kind"] == "row":
            self.done += 1
            self.failed += judge.failed(rec) or rec["status"] == "bad_input"
            if self.live is None and not self.quiet:
                what = (f"mean KLD {_fmt(rec.get('mean_kld'))}, same top {_fmt(rec.get('same_top_p_pct'))} %"
                        if rec["status"] == "ok" else rec.get("reason") or "")
                where = f" on {rec['node']}" if rec.get("node") else ""
                self.say(f"[{self.done}/{self.total}{self._left()}] {rec['label']} {rec['engine']}: "
                         f"{rec['status']}: {what}{where} ({_fmt(rec.get('seconds'))} s)")
        elif rec["kind"] == "agreement" and self.live is None and not rec["passed"]:
            self.say(f"{rec['label']}: {' vs '.join(rec['engines'])} disagree: {rec['gate']} {_fmt(rec['measured'])} "
                     f"(limit {_fmt(rec['limit'])})")
        if self.live is not None:
            self.live.update(self._panel())

    def tick(self, running: list[tuple]) -> None:
        """The tasks in flight: ``(kind, label, engine, node, started)`` each."""
        self.running = running
        if self.live is not None:
            self.live.update(self._panel())

    def _left(self) -> str:
        """``, about T left`` (:func:`harness.core.progress.eta` over the rows done), or nothing before the first."""
        left = eta(time.monotonic() - self.t0, self.done, self.total) if self.done < self.total else None
        return f", about {left} left" if left else ""

    def _panel(self) -> Group:
        started = [r for r in self.running if r[4]]
        head = (f"rows done {self.done}/{self.total}, failed {self.failed}, running {len(started)}, queued "
                f"{len(self.running) - len(started)}  ({duration(time.monotonic() - self.t0)}{self._left()})")
        nodes = Table("node", "host", "CPUs", "running", box=None, pad_edge=False)
        for n in self.node_list:
            mine = [r for r in started if (r[3] or "") == n.node_id]
            nodes.add_row(n.short, n.host, f"{n.cpus:g}", ", ".join(f"{r[1]}/{r[2]}" for r in mine) or "-")
        return Group(head, nodes)

    def stop(self) -> None:
        """Remove the live panel."""
        if self.live is not None:
            self.live.stop()
            self.live = None
