"""llama.cpp's MTP drafter (``gemma4-assistant`` GGUF beside its target, through ``ctx_other``), in a worker process.

Skipped as a whole when llama-cpp-python is not installed, as ``tests/test_llamacpp.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python not installed (pip install 'gemma4-harness[llamacpp]'; builds from source, ~5 min)")

from gemma4_harness.harness.core.cases import MODELS_DIR  # noqa: E402
from gemma4_harness.harness.core.gates import DEFAULT_GATES  # noqa: E402
from gemma4_harness.harness.core.prompts import load_prompts  # noqa: E402
from gemma4_harness.harness.parity.checks.drafter import llamacpp_drafter_checks  # noqa: E402
from gemma4_harness.harness.synth.drafter import ensure_drafter_built  # noqa: E402

PROMPTS = [p for p in load_prompts() if p["id"] in ("len5", "len17-window+1", "len48-3xwindow")]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["e2b", "26b-a4b"])
def test_llamacpp_drafts_what_the_reference_drafts_and_its_speculation_is_lossless(name):
    figs = llamacpp_drafter_checks(ensure_drafter_built(MODELS_DIR / f"{name}-assistant.toml"), PROMPTS,
                                   lambda m: None, name)
    gates = {f.gate for f in figs}
    assert {"drafter.llamacpp.runs", "drafter.reference~llamacpp.same_drafts", "drafter.reference~llamacpp.max_abs",
            "speculative.llamacpp.lossless"} <= gates
    for f in figs:
        assert DEFAULT_GATES[f.gate].check(f.measured), (f.gate, f.prompt, f.measured, f.detail)


def test_llamacpp_aborting_on_a_donor_layout_is_one_figure():
    """llama.cpp's share map sends the drafter's full layer of this target to a sliding layer: it aborts, and the
    worker's death becomes ``drafter.llamacpp.runs`` = 0 with the assert's line."""
    (f,) = llamacpp_drafter_checks(ensure_drafter_built(MODELS_DIR / "edge-keqv-shared-donor-assistant.toml"),
                                   PROMPTS, lambda m: None, "edge-keqv-shared-donor")
    assert f.gate == "drafter.llamacpp.runs" and f.measured == 0.0
    assert "GGML_ASSERT" in f.detail["got"] and "\n" not in f.detail["got"]
