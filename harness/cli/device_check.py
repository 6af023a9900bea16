"""``g4h device-check``: the fast path on an accelerator (fp32, bf16, packed weights) against the reference."""

from __future__ import annotations

import argparse

from ..parity.device import device_check


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h device-check``."""
    p.add_argument("--gguf", nargs="+", required=True, help="GGUF files to check")
    p.add_argument("--out", required=True, help="output JSON")
    p.add_argument("--device", default="cuda", help="cuda[:N] (cpu for a dry run)")
    p.add_argument("--prompts", type=int, default=8, help="first N prompts of the synthetic set")


def run(args: argparse.Namespace) -> int:
    """Write the figures; exit 0."""
    device_check(args.gguf, args.out, args.device, args.prompts)
    return 0
