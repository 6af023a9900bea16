"""llama.cpp's multimodal encoders (mtmd), run in a worker subprocess (:mod:`.mmworker`).

:func:`mtmd_soft_tokens` hands llama.cpp a text GGUF, an mmproj and the media (images as uint8 RGB, clips as
16 kHz float samples) and returns the projected soft tokens llama.cpp computes for each (``mtmd_encode_chunk``
then ``mtmd_get_output_embd``), plus the vision trace points its clip graph names like the reference's. An abort
inside llama.cpp becomes :class:`harness.core.workers.EngineCrashed` (one line), as for the text engine.

llama.cpp resizes images itself (``smart_resize``: rounding to multiples of ``patch * pooling`` within a token
budget, where transformers floors within its budget). To compare the encoders alone, give it the image the
reference's processor produced (:func:`processed_rgb`): its sides are already multiples of ``patch * pooling``,
and with ``image_min_tokens`` at or below its token count llama.cpp keeps it as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gemma4_harness.reference.image_processing import ImageInput

from ...core.workers import EngineCrashed, crash_error, run_worker


def processed_rgb(image: ImageInput, patch_size: int) -> np.ndarray:
    """The resized uint8 image behind a preprocessed one: the patches put back in place and ``x * 255``
    rounded (exact: the processor rescaled uint8 values by 1/255 in float64). [N, 3p^2] -> uint8 [H, W, 3]."""
    h, w = image.size
    p = patch_size
    rows, cols = h // p, w // p
    patches = image.pixel_values[: rows * cols].reshape(rows, cols, p, p, 3)
    rgb = patches.transpose(0, 2, 1, 3, 4).reshape(h, w, 3)
    return np.clip(np.rint(rgb * 255.0), 0, 255).astype(np.uint8)


def mtmd_soft_tokens(model: str | os.PathLike, mmproj: str | os.PathLike, items: Sequence[tuple[str, np.ndarray]],
                     threads: int | None = None, image_min_tokens: int = 1, image_max_tokens: int = 1120,
                     timeout: float = 600.0) -> dict[str, Any]:
    """llama.cpp's soft tokens of each item.

    Args:
        model: the text GGUF (mtmd needs its model for the projector width).
        mmproj: the mmproj GGUF.
        items: ``("image", uint8 [H, W, 3])`` or ``("audio", float [N] at 16 kHz)``.
        threads: CPU threads (default: :func:`.worker.default_threads`, `$OMP_NUM_THREADS` or every CPU).
        image_min_tokens, image_max_tokens: llama.cpp's image token budget (``mtmd_context_params``).
        timeout: seconds the worker may run.

    Returns:
        ``{"embeds": [float64 [n, n_embd] per item], "n_chunks": [...], "non_causal": bool,
        "traces": [{(point, layer): float64 array} per item]}``.

    Raises:
        EngineCrashed: the worker died, timed out, or llama.cpp refused the files (one line).
    """
    out_dir = Path(tempfile.mkdtemp(prefix="g4h-mtmd-"))
    try:
        req_items = []
        for k, (kind, data) in enumerate(items):
            np.save(out_dir / f"in{k}.npy", np.asarray(data, dtype=np.uint8 if kind == "image" else np.float32))
            req_items.append({"kind": kind, "file": f"in{k}.npy"})
        req = {"model": str(model), "mmproj": str(mmproj), "threads": threads, "out_dir": str(out_dir),
               "image_min_tokens": image_min_tokens, "image_max_tokens": image_max_tokens, "items": req_items}
        try:
            proc = run_worker("gemma4_harness.harness.engines.llamacpp.mmworker", input=json.dumps(req), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineCrashed(f"engine crashed: llama.cpp mtmd worker ran past {timeout:.0f} s "
                                f"on {Path(mmproj).name}") from None
        if proc.returncode != 0 or not (out_dir / "result.json").is_file():
            raise crash_error(proc.stderr, proc.returncode, Path(mmproj).name)
        res = json.loads((out_dir / "result.json").read_text())
        return {"embeds": [np.load(out_dir / it["embd"], allow_pickle=False).astype(np.float64) for it in res["items"]],
                "n_chunks": [it["n_chunks"] for it in res["items"]], "non_causal": res["non_causal"],
                "traces": [{(p, int(layer)): np.load(out_dir / f, allow_pickle=False).astype(np.float64) for p, layer, f in it["trace"]}
                           for it in res["items"]]}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)

