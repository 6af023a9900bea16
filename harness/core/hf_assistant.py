"""Constructing Gemma 4 assistants (MTP drafters) with transformers, patched only where it cannot by itself.

An assistant's layers all read the target's K/V: ``Gemma4AssistantConfig.__post_init__`` sets
``text_config.num_kv_shared_layers = num_hidden_layers`` (transformers ``models/gemma4_assistant/
configuration_gemma4_assistant.py``). transformers 5.23's ``Gemma4TextConfig.kv_sharing_modes``
(``models/gemma4/configuration_gemma4.py``) looks for the donor layers in the unshared prefix, which is empty
there, and raises ``ValueError: The set of layer types producing a cache is different than the set of layer types
using them``: 5.23 cannot construct ``Gemma4AssistantForCausalLM`` at all, ``from_pretrained`` included.
transformers 5.24 answers ``["reuse"] * num_hidden_layers`` for such a config and constructs it by itself.

What this transformers does is found by trying, once per process (:func:`construction`): a two-layer assistant is
built on the meta device (no weights), first as transformers is; only if that fails, under the patch. The patch
(:func:`_patched`) makes ``kv_sharing_modes`` answer ``["reuse"] * num_hidden_layers`` for a config whose layers
are *all* shared (every layer takes K/V from ``shared_kv_states[layer_type]``, which the target provides: what
5.24 does) and leaves transformers' own answer for every other config. Either way the built assistant must have
every layer KV-shared, the property the harness relies on; if neither way gives that,
:class:`AssistantUnavailable` says why in one line.

:func:`assistant_construction` is the context every use runs in: a no-op where transformers constructs
assistants by itself, the patch (installed inside the block, removed after it) where it needs it.

Users: the drafter oracle (:mod:`harness.engines.assistant`) and the synthetic drafter writer
(:mod:`harness.synth.drafter`). A transformers that cannot construct an assistant is an oracle problem: the
drafter checks that need it do not run and say why; it is not bad input, and the rest of the case still runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_lock = threading.RLock()
_found: dict[str, str] = {}


class AssistantUnavailable(RuntimeError):
    """This transformers cannot construct a Gemma 4 assistant whose layers all read the target's K/V, with or
    without the patch (one line, naming the transformers version and what went wrong)."""


def _probe() -> None:
    """Build a two-layer assistant on the meta device; raise what transformers raises, or ValueError when a built
    layer is not KV-shared."""
    import torch  # optional heavy dependency: only the oracle and the writer need it
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig  # (as above)

    text = Gemma4TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=64)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=24))
    shared = [bool(getattr(layer.self_attn, "is_kv_shared_layer", False)) for layer in model.model.layers]
    if not all(shared):
        raise ValueError(f"the assistant's layers are not all KV-shared ({shared})")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1].strip() if text else ''}"


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    """Within the block, ``Gemma4TextConfig.kv_sharing_modes`` answers ``["reuse"] * L`` for an all-shared config
    and transformers' own answer otherwise."""
    from transformers import Gemma4TextConfig  # optional heavy dependency (as above)

    original = Gemma4TextConfig.__dict__["kv_sharing_modes"]
    if getattr(original.fget, "_g4h_patched", False):  # nested use: already active
        yield
        return

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


def construction() -> str:
    """How this transformers constructs a Gemma 4 assistant, found by trying once per process: ``"native"`` (by
    itself: no patch) or ``"patched"`` (only under :func:`_patched`).

    Raises:
        AssistantUnavailable: neither way builds an assistant whose layers all read the target's K/V.
    """
    import transformers  # optional heavy dependency (as above)

    with _lock:
        version = transformers.__version__
        if version not in _found:
            try:
                _probe()
                _found[version] = "native"
            except Exception as native:  # whatever transformers raises: the patch is tried next
                try:
                    with _patched():
                        _probe()
                    _found[version] = "patched"
                except Exception as patched:
                    _found[version] = (f"transformers {version} cannot construct Gemma4AssistantForCausalLM: "
                                       f"{_one_line(native)}; with the harness's kv_sharing_modes patch: "
                                       f"{_one_line(patched)}")
        how = _found[version]
    if how not in ("native", "patched"):
        raise AssistantUnavailable(how)
    return how


@contextlib.contextmanager
def assistant_construction() -> Iterator[str]:
    """The context in which transformers constructs and runs Gemma 4 assistants: nothing changed where it can by
    itself, the ``kv_sharing_modes`` patch where it cannot (:func:`construction`). Yields ``"native"`` or
    ``"patched"``.

    Raises:
        AssistantUnavailable: this transformers cannot construct one either way (one line).
    """
    how = construction()
    if how == "native":
        yield how
        return
    with _lock, _patched():
        yield how
