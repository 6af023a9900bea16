"""A parity run as the pytest plugin (:mod:`harness.pytest_plugin`) sees it: ``g4h parity`` run in this process
(:func:`run_parity`, its options parsed by :func:`parse_argv` and built by :func:`parity_argv`), its checks
(:class:`ParityCheck`) and the run (:class:`ParityRun`: ``assert_passed()``), and the two ways it stops before a
verdict (:class:`G4HBadInput`, :class:`G4HEngineCrashed`).

Only the standard library at import: the project (torch, numpy) is imported inside the functions that run it.
"""

from __future__ import annotations

import contextlib
import io
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ParityCheck:
    """One check of a parity run, as ``results.json`` holds it.

    Attributes:
        case: the case (the model's file name on a user's model).
        gate: ``<pair>.<metric>`` (:data:`harness.core.gates.DEFAULT_GATES`).
        prompt: the prompt id, or None for a figure over several.
        measured, limit, op: the figure, its gate's limit and ``le`` / ``ge``.
        passed: within the gate; informational: reported, not gating (``reason`` says why).
        detail: every other field of the check (``first_divergence``, ``why``, ``qtype``, ``variant`` ...).
    """

    case: str
    gate: str
    prompt: Any
    measured: float
    limit: float | None
    op: str | None
    passed: bool
    informational: bool
    reason: str
    detail: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def opted_out(self) -> bool:
        """The user left the check out (``--skip``), or it is one a default run leaves out."""
        return str(self.detail.get("got", "")).replace("_", " ") == "opted out"

    @property
    def first_divergence(self) -> str | None:
        """Where the engine first leaves the oracle (a trace point ``point@layer``, ``logits@position N``, a
        stream step), when the check names it."""
        fd = self.detail.get("first_divergence")
        if isinstance(fd, dict):  # llama.cpp's trace comparison: {point, layer, rel_l2}
            return f"{fd.get('point')}@{fd.get('layer')}"
        return None if fd in (None, "") else str(fd)

    def label(self) -> str:
        """``<gate>[<prompt>/<qtype>/<variant>]``: the item's name within its case."""
        parts = [str(self.detail[k]) if k in self.detail else None for k in ("qtype", "variant")]
        parts = [str(self.prompt) if self.prompt not in (None, "") else None] + parts
        inside = "/".join(p for p in parts if p)
        return f"{self.gate}[{inside}]" if inside else self.gate

    def message(self, report: str | None = None) -> str:
        """The failure message: the check, its figure against its gate, the first divergence, the engine's reason
        and the report."""
        where = f"{self.case}: {self.gate}" + (f" on prompt {self.prompt}" if self.prompt not in (None, "") else "")
        op = "<=" if self.op == "le" else ">="
        lines = [f"g4h parity check failed: {where}",
                 f"  measured {fmt(self.measured)}, gate {op} {fmt(self.limit)}"]
        if self.first_divergence:
            lines.append(f"  first divergence: {self.first_divergence}")
        for key in ("why", "got"):
            value = self.detail.get(key)
            if isinstance(value, str) and value and value != self.first_divergence:
                lines.append(f"  {key}: {value}")
                break
        if report:
            lines.append(f"  report: {report}")
        return "\n".join(lines)


def fmt(x: Any) -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:.6g}" if math.isfinite(x) else str(x)
    return str(x)


def checks_of(results: dict[str, Any]) -> list[ParityCheck]:
    out = []
    for case in results.get("cases", []):
        for c in case.get("checks", []):
            known = {"gate", "prompt", "measured", "limit", "op", "pass", "informational", "reason"}
            measured = c.get("measured")
            out.append(ParityCheck(case=str(case["case"]), gate=str(c["gate"]), prompt=c.get("prompt"),
                                   measured=float(measured) if isinstance(measured, (int, float)) else math.nan,
                                   limit=c.get("limit"), op=c.get("op"), passed=bool(c.get("pass")),
                                   informational=bool(c.get("informational")), reason=str(c.get("reason") or ""),
                                   detail={k: v for k, v in c.items() if k not in known}))
    return out


@dataclass
class ParityRun:
    """A finished ``g4h parity`` run.

    Attributes:
        argv: the ``g4h parity`` arguments it ran with.
        results: ``results.json`` as a dict; status: the exit status ``g4h parity`` gives (0, 1 or 2);
        verdict: its one-line verdict; report: the run's ``report.md``.
    """

    argv: list[str]
    results: dict[str, Any]
    status: int
    verdict: str
    report: Path

    @property
    def checks(self) -> list[ParityCheck]:
        """Every check, in report order."""
        return checks_of(self.results)

    @property
    def case_errors(self) -> dict[str, str]:
        """Cases that could not run: case -> its one-line error."""
        return {c["case"]: c["error"] for c in self.results.get("cases", []) if c.get("error")}

    @property
    def failures(self) -> list[ParityCheck]:
        """The gating checks beyond their gate (the ones that make the run fail)."""
        return [c for c in self.checks if not c.passed and not c.informational]

    @property
    def passed(self) -> bool:
        """Exit status 0: every gate passed, every case ran."""
        return self.status == 0

    def check(self, gate: str, prompt: Any = None, case: str | None = None) -> ParityCheck:
        """The one check of ``gate`` (on ``prompt``, in ``case``).

        Raises:
            LookupError: none, or more than one, matches.
        """
        found = [c for c in self.checks if c.gate == gate and (prompt is None or c.prompt == prompt)
                 and (case is None or c.case == case)]
        if len(found) != 1:
            raise LookupError(f"{len(found)} checks of gate {gate!r}" + (f" on prompt {prompt!r}" if prompt else ""))
        return found[0]

    def assert_passed(self) -> None:
        """Raise AssertionError with the verdict and every failure's message unless the run passed."""
        if self.passed:
            return
        parts = [f"g4h parity: {self.verdict} (exit {self.status})"]
        parts += [f"{case}: could not run: {err}" for case, err in self.case_errors.items()]
        parts += [c.message() for c in self.failures]
        parts.append(f"report: {self.report}")
        raise AssertionError("\n".join(parts))


class G4HBadInput(Exception):
    """``g4h parity`` refused its input before any case ran (one line, as ``g4h: error: ...``)."""


class G4HEngineCrashed(Exception):
    """The job stopped in an engine (a worker process that died): one line naming where."""


def parse_argv(argv: list[str]) -> Any:
    """``g4h parity ARGV`` parsed (an ``argparse.Namespace``), its one-line error as :class:`G4HBadInput`."""
    from gemma4_harness.harness.cli import build_parser  # lazy: torch and numpy only when a run is asked for

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser("parity").parse_args(["parity", *argv])
    except SystemExit:
        line = next((ln for ln in reversed(err.getvalue().splitlines()) if ln.strip()), "invalid options")
        raise G4HBadInput(f"g4h parity {shlex.join(argv)}: {line.split('error: ', 1)[-1]}") from None


def run_parity(argv: list[str]) -> ParityRun:
    """Run ``g4h parity ARGV`` in this process and return the run.

    Raises:
        G4HBadInput: an option or an input it refuses before running (exit 2 of ``g4h parity``), one line.
        G4HEngineCrashed: the job itself stopped in an engine (exit 1 of ``g4h parity``), one line.
    """
    from gemma4_harness.harness.cli import _quiet_libraries  # lazy (as above)
    from gemma4_harness.harness.cli.parity import execute  # lazy (as above)
    from gemma4_harness.harness.core.workers import EngineCrashed  # lazy (as above)
    from gemma4_harness.reference.errors import InputError  # lazy (as above)

    args = parse_argv(argv)
    _quiet_libraries()
    try:
        results, status = execute(args)
    except InputError as e:
        raise G4HBadInput(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except EngineCrashed as e:
        raise G4HEngineCrashed(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return ParityRun(argv=list(argv), results=results, status=status, verdict=results["verdict"],
                     report=Path(results["run_dir"]) / "report.md")


def parity_argv(model: str | list[str] | None = None, against: str | list[str] | None = None, prompts: str | None = None,
          oracle: str | None = None, skip: list[str] | tuple[str, ...] = (), out: str | None = None,
          args: str | list[str] = ()) -> list[str]:
    """``g4h parity`` arguments from the plugin's options (or the fixture's keywords)."""
    argv: list[str] = []
    for m in [model] if isinstance(model, (str, Path)) else (model or []):
        argv += ["--model", str(m)]
    for a in [against] if isinstance(against, str) else (against or []):
        argv += ["--against", a]
    if prompts:
        argv += ["--prompts", str(prompts)]
    if oracle:
        argv += ["--oracle", oracle]
    for s in skip:
        argv += ["--skip", s]
    if out:
        argv += ["--out", str(out)]
    argv += shlex.split(args) if isinstance(args, str) else list(args)
    return argv
