"""The one patch the harness applies to transformers: constructing Gemma 4 assistants (MTP drafters).

transformers 5.23 cannot construct ``Gemma4AssistantForCausalLM`` at all:
``Gemma4AssistantConfig.__post_init__`` sets ``text_config.num_kv_shared_layers = num_hidden_layers`` (every
drafter layer reads the target's K/V), and ``Gemma4TextConfig.kv_sharing_modes`` then raises ``ValueError: The
set of layer types producing a cache is different than the set of layer types using them``, because the
unshared prefix it looks for donors in is empty (``configuration_gemma4.py:227-252``; this blocks
``from_pretrained`` too). The fix used here (``/work/shared/MULTIMODAL_MTP_FACTS.md`` §0.1): while the patch is
active, a config whose layers are *all* shared gets ``["reuse"] * num_hidden_layers`` (every layer takes K/V
from ``shared_kv_states[layer_type]``, which the target provides); every other config gets transformers' own
answer. With it, transformers' speculative greedy equals its plain greedy on the tiny cases.

The patch is guarded: it applies only to the exact property it was written against (a SHA-256 of its source
text, :data:`KNOWN_KV_SHARING_SHA256`). A later transformers that changes the property makes
:func:`kv_sharing_patch` raise :class:`AssistantPatchError` with one line, instead of silently patching code
nobody has read. The patch is installed only inside the ``with`` block and removed after it.

Users: the oracle wrapper (:mod:`harness.engines.assistant`) and the synthetic drafter writer
(:mod:`harness.synth.drafter`), which both need transformers' own assistant classes.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
from typing import Iterator

from reference.errors import InputError

KNOWN_KV_SHARING_SHA256 = "cb8d6426638d5879e9b35e68ac4a9268a954c140d2496b627b61f8058aea9bcc"
"""SHA-256 of the source text of ``Gemma4TextConfig.kv_sharing_modes`` (its getter) in transformers 5.23.0,
the property this patch was written against."""

_lock = threading.RLock()


class AssistantPatchError(InputError):
    """transformers' ``kv_sharing_modes`` is not the property the patch was written against (one line)."""


def _property_sha(fget) -> str:
    return hashlib.sha256(inspect.getsource(fget).encode("utf-8")).hexdigest()


@contextlib.contextmanager
def kv_sharing_patch() -> Iterator[None]:
    """Within the block, ``Gemma4TextConfig.kv_sharing_modes`` answers ``["reuse"] * L`` for an all-shared config.

    Raises:
        AssistantPatchError: transformers' ``kv_sharing_modes`` is not the one this patch was written against
            (its source hash differs from :data:`KNOWN_KV_SHARING_SHA256`), so the patch cannot be trusted.

    Source: transformers 5.23 ``Gemma4TextConfig.kv_sharing_modes``; the workaround of
    ``MULTIMODAL_MTP_FACTS.md`` §0.1.
    """
    import transformers  # optional heavy dependency: only the oracle and the writer need it
    from transformers import Gemma4TextConfig  # optional heavy dependency (as above)

    with _lock:
        original = Gemma4TextConfig.__dict__["kv_sharing_modes"]
        if getattr(original.fget, "_g4h_patched", False):  # nested use: already active
            yield
            return
        sha = _property_sha(original.fget)
        if sha != KNOWN_KV_SHARING_SHA256:
            raise AssistantPatchError(
                f"transformers {transformers.__version__} changed Gemma4TextConfig.kv_sharing_modes (source sha256 "
                f"{sha[:12]}, expected {KNOWN_KV_SHARING_SHA256[:12]}): re-check the assistant patch in "
                "harness/core/hf_assistant.py before using transformers' Gemma 4 assistant")

        def kv_sharing_modes(self):
            if self.num_kv_shared_layers and self.num_kv_shared_layers == self.num_hidden_layers:
                return ["reuse"] * self.num_hidden_layers
            return original.fget(self)

        kv_sharing_modes._g4h_patched = True  # type: ignore[attr-defined]
        Gemma4TextConfig.kv_sharing_modes = property(kv_sharing_modes)
        try:
            yield
        finally:
            Gemma4TextConfig.kv_sharing_modes = original
