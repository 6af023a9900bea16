"""``g4h device-check``: the fast path on an accelerator (fp32, bf16, packed weights) against the reference."""

from __future__ import annotations

import argparse

from ..parity.device import device_check
from ._args import Count, Device, InFile, OutFile


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h device-check``."""
    p.add_argument("--gguf", nargs="+", required=True, type=InFile(), help="GGUF files to check")
    p.add_argument("--out", required=True, type=OutFile(), help="output JSON")
    p.add_argument("--device", default="cuda", type=Device(), help="cuda[:N] (cpu for a dry run)")
    p.add_argument("--prompts", type=Count(1, 1 << 20), default=8, help="first N prompts of the synthetic set")


def run(args: argparse.Namespace) -> int:
    """Write the figures; exit 0."""
    device_check(args.gguf, args.out, args.device, args.prompts)
    return 0
