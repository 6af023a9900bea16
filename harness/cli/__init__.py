"""``g4h``: the command line. One module per sub-command, behind a registry.

:data:`COMMANDS` maps each sub-command to its module and a one-line summary (pip's
``commands_dict``): ``g4h --help`` lists them without importing any, and ``g4h <command>`` imports
only that command's module. A command module has ``add_arguments(parser)`` and
``run(args) -> exit status``.

Exit status of every command: 0 success (for ``parity``, every gate passed); 1 the engine under test
is wrong: a gate failed or a check could not run (``parity``), texts differ (``tokcheck``), a trace
diverges (``diff``), or an engine failed (:class:`~harness.core.workers.EngineFailure`: it crashed,
broke its protocol, answered a request wrongly or not at all; one line on stderr, ``g4h: engine
failed: ...``, naming the engine and the request); 2 the user's input cannot be used (one line on
stderr, ``g4h: error: ...``, naming the file, key, tensor, token id or URL and what was expected: an
unreadable model, a bad argument, a server that is down, an engine command that cannot be started),
or memory exhausted; 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import sys
import warnings
from typing import NamedTuple

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weight_check import CarryWarning

from ..core.memory import failure_line, is_out_of_memory
from ..core.text import for_terminal
from ..core.workers import EngineFailure
from ..engines.variants import spec_context


class Command(NamedTuple):
    """One sub-command: its module (``add_arguments``, ``run``) and its summary."""

    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "logits": Command("gemma4_harness.harness.cli.logits", "logits of every position of a prompt, [T, vocab], to .npy"),
    "generate": Command("gemma4_harness.harness.cli.generate", "greedy continuations of a JSONL prompt set"),
    "trace": Command("gemma4_harness.harness.cli.trace", "checksum trace of one prompt (JSONL), optionally with a tensor dump"),
    "diff": Command("gemma4_harness.harness.cli.diff", "compare two traces and name the first diverging point"),
    "parity": Command("gemma4_harness.harness.cli.parity", "compare engines on the case library and apply the gates"),
    "selftest": Command("gemma4_harness.harness.cli.selftest",
                        "inject known faults into a copy of the fast path; check they are caught"),
    "bench": Command("gemma4_harness.harness.cli.bench", "throughput (pp/tg tokens/s, batch and depth sweep, roofline share)"),
    "compare": Command("gemma4_harness.harness.cli.compare", "compare logits (.npy) or greedy outputs (.jsonl) an engine wrote"),
    "explain": Command("gemma4_harness.harness.cli.explain", "name the spec variant (docs/spec-variants.md) that explains where an "
                       "engine diverges"),
    "tokenize": Command("gemma4_harness.harness.cli.tokenize", "token ids of each line of a text file, to JSONL"),
    "tokcheck": Command("gemma4_harness.harness.cli.tokcheck", "texts whose token ids differ between two tokenizer engines"),
    "synth": Command("gemma4_harness.harness.cli.synth", "build synthetic cases (HF safetensors + GGUFs) and print their paths"),
    "device-check": Command("gemma4_harness.harness.cli.device_check", "the fast path on CUDA against the reference, to JSON"),
    "device-bench": Command("gemma4_harness.harness.cli.device_bench",
                            "the GPU speed figures in one run: graphs, fused kernels, roofline (--smoke: on the CPU)"),
    "sweep": Command("gemma4_harness.harness.cli.sweep", "every quantization of a model on every engine against one float64 base, "
                     "on Ray: KLD, greedy and first-divergence per file, a report and plots"),
    "quantize": Command("gemma4_harness.harness.cli.quantize", "make GGUF quantizations with llama.cpp's llama-quantize (built into "
                        "the user cache), K-quants and importance-matrix types included"),
    "inspect": Command("gemma4_harness.harness.cli.inspect", "what a GGUF file or HF folder holds, its problems, and which engines "
                       "can run it"),
}
"""Sub-command name -> :class:`Command`."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors on one line (bad input is one line, like every other refusal)."""

    def error(self, message: str):
        line = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {line} (options: {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``g4h``: every sub-command listed; only ``command``'s module imported for its options.

    Option values are checked as they are parsed (:mod:`harness.cli._args`); a bad one is one line, exit 2."""
    p = Parser(prog="g4h", description="Gemma 4 correctness and performance harness")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sp = sub.add_parser(name, help=cmd.summary, description=cmd.summary)
        if name == command:
            module = importlib.import_module(cmd.module)
            module.add_arguments(sp)
            sp.add_argument("--spec", default=None, metavar="VARIANT[,VARIANT]",
                            help="run the reference (and the fast engine, where the variant has a fast form) under "
                                 "these spec variants: another implementation's rule or a known fault "
                                 "(docs/spec-variants.md)")
            sp.set_defaults(func=module.run)
    return p


def _quiet_libraries() -> None:
    """Silence transformers' per-load progress bars and advisory logs (our own progress lines remain).

    Its environment switches are set (``TRANSFORMERS_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS``, read when it
    is imported), for this process and for the worker processes it spawns (the parity job's cases), so a command
    that never needs it does not pay its import (about 0.25 GB of memory with torch); when it is imported
    already, it is configured too.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        import transformers  # already imported: only configured

        transformers.utils.logging.disable_progress_bar()
        transformers.logging.set_verbosity_error()


def _spec(text: str | None) -> contextlib.AbstractContextManager:
    """``--spec``: the variants applied for the whole command (:func:`harness.engines.variants.spec_context`; the
    fast forms import torch only when applied)."""
    return spec_context(text) if text else contextlib.nullcontext()


def _error(msg: str) -> int:
    print(f"g4h: error: {for_terminal(msg, newlines=False)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``g4h``; returns the exit status (also when called from Python).

    Warnings: the harness's own (:class:`reference.weight_check.CarryWarning`: a weight the compute dtype cannot
    carry) are printed as they come, ``g4h: warning: ...``; a library's (NumPy's ``RuntimeWarning`` of an overflow,
    say) are held and printed only when the command succeeds: on an error the one line says what went wrong.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    held: list[warnings.WarningMessage] = []
    with _warnings_shown(functools.partial(_show_or_hold, held)):
        status = _run(args)
    if status == 0:
        for w in held:
            print(f"g4h: warning: {w.category.__name__}: {w.message}", file=sys.stderr)
    return status


@contextlib.contextmanager
def _warnings_shown(show):
    """Every warning shown once per place (the ``default`` action), through ``show``, while the command runs; then
    the filters as they were.

    CPython's ``_warnings`` keeps the filter list it read at the last warning, and at shutdown, with the ``warnings``
    module gone, it judges the warnings of module teardown by that list. Read while ``default`` was in force (here, or
    in a library's :class:`warnings.catch_warnings` copy), it shows ResourceWarnings: llama-cpp-python's
    ``llama_cpp/_utils.py`` leaves two files on ``/dev/null`` open for good, and every ``g4h`` run that loaded it
    ended with ``sys:1: ResourceWarning``. So the one filter is added to, and removed from, the list itself, and a
    warning nobody sees (:class:`_FiltersRead`) makes ``_warnings`` read the list as it is again."""
    entry = ("default", None, Warning, None, 0)
    shown = warnings.showwarning
    warnings.filters.insert(0, entry)
    warnings._filters_mutated()  # type: ignore[attr-defined]  # what simplefilter itself calls
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
        with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)
        warnings._filters_mutated()  # type: ignore[attr-defined]
        warnings.filterwarnings("ignore", category=_FiltersRead)
        warnings.warn(_FiltersRead())


class _FiltersRead(Warning):
    """Never shown: issued once a command ends so that CPython's ``_warnings`` reads the filters (see
    :func:`_warnings_shown`)."""


def _show_or_hold(held: list, message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` of :func:`main`: our own warnings now, one line each; the others held."""
    if issubclass(category, CarryWarning):
        print(f"g4h: warning: {message}", file=sys.stderr, flush=True)
    else:
        held.append(warnings.WarningMessage(message, category, filename, lineno, file, line))


def _run(args: argparse.Namespace) -> int:
    """Run the command; every failure is one line on stderr and its exit status."""
    try:
        _quiet_libraries()
        with _spec(getattr(args, "spec", None)):
            return args.func(args)
    except InputError as e:
        return _error(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except EngineFailure as e:  # the engine under test is wrong (crashed, broke its protocol): one line, exit 1
        print(f"g4h: engine failed: {for_terminal(str(e).splitlines()[0] if str(e) else type(e).__name__, False)}",
              file=sys.stderr)
        return 1
    except Exception as e:  # an allocation failure outside an engine: one line too; anything else is a bug
        if not is_out_of_memory(e):
            raise
        return _error(failure_line(None, e))
    except KeyboardInterrupt:
        print("g4h: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
