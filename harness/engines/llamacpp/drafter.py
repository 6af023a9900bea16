"""llama.cpp's MTP drafter, driven from the harness: one worker subprocess per call (:mod:`.drafter_worker`).

:func:`llamacpp_drafts` returns, per prompt, llama.cpp's first draft round after a prefill (the target's token
and ``h_nextn``, the drafts, their logits and next ``h``); :func:`llamacpp_speculative` runs speculative greedy
decoding entirely in llama.cpp, beside its plain greedy decoding in a fresh context.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...core.workers import EngineCrashed, crash_error, run_worker, temp_dir
from . import _import_llama_cpp, _rmtree


def _run(target: Path, drafter: Path, jobs: list[dict[str, Any]], n_ctx: int, threads: int | None,
         timeout: float) -> tuple[list[dict[str, Any]], Path]:
    _import_llama_cpp()
    out_dir = temp_dir("g4h-llamacpp-mtp-")  # removed by a watchdog if the harness is killed
    req = {"target": str(target), "drafter": str(drafter), "n_ctx": n_ctx, "threads": threads,
           "out_dir": str(out_dir), "jobs": jobs}
    try:
        proc = run_worker("gemma4_harness.harness.engines.llamacpp.drafter_worker", input=json.dumps(req), timeout=timeout)
    except subprocess.TimeoutExpired:
        _rmtree(out_dir)
        raise EngineCrashed(f"engine crashed: llama.cpp drafter worker ran past {timeout:.0f} s") from None
    if proc.returncode != 0 or not (out_dir / "result.json").is_file():
        _rmtree(out_dir)
        raise crash_error(proc.stderr, proc.returncode, Path(drafter).name)
    return json.loads((out_dir / "result.json").read_text())["jobs"], out_dir


def llamacpp_drafts(target: str | Path, drafter: str | Path, prompts: Sequence[Sequence[int]], n_draft: int,
                    n_ctx: int = 256, threads: int | None = None, timeout: float = 600.0) -> list[dict[str, Any]]:
    """llama.cpp's first draft round after each prompt: ``{"token", "h" [H_t], "drafts", "logits" [n, V],
    "h_next" [n, H_t]}`` (float32 arrays).

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
        EngineCrashed: the worker died or llama.cpp refused the models (one line).
    """
    jobs = [{"op": "draft", "prompt": list(p), "n_draft": n_draft} for p in prompts]
    res, out_dir = _run(Path(target), Path(drafter), jobs, n_ctx, threads, timeout)
    try:
        return [{"token": r["token"], "drafts": r["drafts"], "h": np.load(out_dir / r["h"], allow_pickle=False),
                 "logits": np.load(out_dir / r["logits"], allow_pickle=False), "h_next": np.load(out_dir / r["h_next"], allow_pickle=False)} for r in res]
    finally:
        _rmtree(out_dir)


def llamacpp_speculative(target: str | Path, drafter: str | Path, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, k: int, n_ctx: int = 256, threads: int | None = None,
                         timeout: float = 600.0) -> list[dict[str, Any]]:
    """Speculative and plain greedy decoding in llama.cpp, per prompt: ``{"tokens", "plain", "drafted",
    "accepted", "rounds"}``.

    Raises:
        EngineUnavailable, EngineCrashed: as :func:`llamacpp_drafts`.
    """
    jobs = [{"op": "speculative", "prompt": list(p), "max_new_tokens": max_new_tokens, "k": k} for p in prompts]
    res, out_dir = _run(Path(target), Path(drafter), jobs, n_ctx, threads, timeout)
    _rmtree(out_dir)
    return res
