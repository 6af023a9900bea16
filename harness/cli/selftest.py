"""``g4h selftest``: inject known faults into a copy of the fast path and check that each is caught."""

from __future__ import annotations

import argparse

from ..selftest import selftest_command
from ._args import OutDir, check_out_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h selftest``."""
    p.add_argument("--case", action="append", default=None, help="only this built-in case (repeatable)")
    p.add_argument("--prompt", action="append", default=None,
                   help="only this prompt id of cases/prompts/synthetic.jsonl (repeatable; default: every prompt "
                        "longer than the sliding window)")
    p.add_argument("--out", default=None, type=OutDir(), help="parent folder of the run directory (default reports/)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every mutant is caught at its first point (see :mod:`harness.selftest`)."""
    check_out_dir(args.out)
    return selftest_command(args.case, args.prompt, args.out, args.quiet)
