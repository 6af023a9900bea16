"""The CPU a native build is for: its model name and feature flags (no torch import, so build tools can key on it)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for), from /proc/cpuinfo; part of
    every cache key of a build for this CPU (the kernels of :mod:`fast.cpu_kernels`, the native llama.cpp of
    :mod:`harness.engines.llamacpp.build`). Elsewhere: the platform's processor or machine name."""
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features", "CPU part") and key not in found:
                found[key] = line
    except OSError:
        pass
    return "\n".join(found.values()) or platform.processor() or platform.machine()
