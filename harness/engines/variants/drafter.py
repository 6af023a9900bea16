"""Spec variants of the MTP drafter (the Gemma 4 assistant): which of the target's sliding keys it sees, its head.

Sources: transformers 5.23 ``models/gemma4_assistant/modeling_gemma4_assistant.py`` and ``masking_utils.py``;
llama.cpp ``src/models/gemma4-assistant.cpp``; the reference's own account in ``reference/drafter.py``.
"""

from __future__ import annotations

import dataclasses

import gemma4_harness.reference.drafter as rd
from gemma4_harness.reference.model import softcap

from .core import Patch, Source, Variant

HF_A = "models/gemma4_assistant/modeling_gemma4_assistant.py"
LC_A = "src/models/gemma4-assistant.cpp"
TARGET_SOFTCAP = 30.0
"""The final softcap of every released Gemma 4 target (``final_logit_softcapping``), which the fault
:func:`drafter_softcap` applies to the drafter's logits."""


def _sliding(d) -> bool:
    return any(L.is_sliding for L in d.text.layers)


def drafter_window_hf(orig):
    """:func:`reference.drafter.drafter_forward` with the drafter's window 2 wider: its query at ``p`` sees the last
    ``W + 1`` keys ``p-W-1 .. p-1``, as transformers' flipped bidirectional window ``|i - j| <= W`` does, instead of
    llama.cpp's ``p-W+1 .. p-1``."""
    def drafter_forward(d, *a, **kw):
        text = dataclasses.replace(d.text, sliding_window=d.text.sliding_window + 2)
        return orig(dataclasses.replace(d, text=text), *a, **kw)
    return drafter_forward


def drafter_full_head(orig):
    """:func:`reference.drafter.drafter_forward` with the centroid mask off: the full tied head."""
    def drafter_forward(d, *a, **kw):
        return orig(dataclasses.replace(d, use_ordered_embeddings=False), *a, **kw)
    return drafter_forward


def drafter_softcap(orig):
    """:func:`reference.drafter.drafter_head` soft-capping the drafter's logits at the target's 30."""
    def drafter_head(d, W, h):
        return softcap(orig(d, W, h), TARGET_SOFTCAP)
    return drafter_head


DRAFTER_VARIANTS: tuple[Variant, ...] = (
    Variant("drafter_window_hf", "drafter", "disagreement",
            "the drafter's sliding layers see the last W + 1 cached keys (p-W-1 .. p-1)",
            "keys p-W+1 .. p-1, what a target query at p sees minus p itself (llama.cpp)",
            (Source("transformers 5.23", f"{HF_A} Gemma4AssistantForCausalLM.create_attention_masks; "
                    "masking_utils.py sliding_window_bidirectional_overlay",
                    "a bidirectional window abs(q_idx - kv_idx) <= sliding_window over the flipped store"),
             Source("llama.cpp", f"{LC_A} llama_model_gemma4_assistant::graph::graph",
                    "build_attn_inp_kv_iswa: the target's SWA mask at the draft position"),
             Source("harness", "reference/drafter.py (module docstring)", "measured on e2b-assistant")),
            ("transformers 5.23",), "drafter_window",
            lambda d: ("attn_out", next(L.index for L in d.text.layers if L.is_sliding)) if _sliding(d)
            else "the drafter has no sliding layer",
            (Patch(rd, "drafter_forward", drafter_window_hf),), (), drafter_window_hf),
    Variant("drafter_full_head", "drafter", "disagreement",
            "the drafter's logits come from its full tied head, the centroid mask ignored",
            "the centroid-masked head when use_ordered_embeddings (transformers)",
            (Source("llama.cpp", f"{LC_A} llama_model_gemma4_assistant::graph::graph",
                    "logits = build_lora_mm(model.output, cur): no centroid mask"),
             Source("transformers 5.23", f"{HF_A} Gemma4AssistantForCausalLM.forward",
                    "masked_embedding(last_hidden_state, lm_head.weight) when use_ordered_embeddings")),
            ("llama.cpp",), "drafter_head",
            lambda d: ("result_output", -1) if d.use_ordered_embeddings else "the drafter has no centroid head",
            (Patch(rd, "drafter_forward", drafter_full_head),), (), drafter_full_head),
    Variant("drafter_softcap", "drafter", "fault", "the target's final softcap (30) applied to the drafter's logits",
            "no softcap on the drafter",
            (Source("transformers 5.23", f"{HF_A} Gemma4AssistantForCausalLM.forward", "lm_head, no softcap"),
             Source("llama.cpp", f"{LC_A} llama_model_gemma4_assistant::graph::graph",
                    "result_output = build_lora_mm(output, cur), no softcap")), (), "drafter_softcap",
            lambda d: ("result_output", -1), (Patch(rd, "drafter_head", drafter_softcap),), (), drafter_softcap),
)
"""The MTP drafter's variants."""
