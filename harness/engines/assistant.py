"""The oracle for MTP drafters: transformers' ``Gemma4AssistantForCausalLM`` beside its ``Gemma4ForCausalLM``.

fp32 eager. transformers 5.23 cannot construct the assistant by itself, 5.24 can: every use here runs inside
:func:`harness.core.hf_assistant.assistant_construction`, which patches ``kv_sharing_modes`` only where transformers
needs it (found by trying) and raises :class:`~harness.core.hf_assistant.AssistantUnavailable` in one line where
even the patch does not help.

Two ways to drive it:

* :meth:`HFAssistantOracle.drafts` runs a draft round exactly as transformers'
  ``SinglePositionMultiTokenCandidateGenerator`` does, from inputs the caller gives (the token, ``h_prev``, the
  position, and the store layers' K/V as the specification selects them: positions before ``p``, the window on
  sliding layers). This compares the drafter alone.
* :meth:`HFAssistantOracle.store_kv` and :meth:`HFAssistantOracle.after_prefill` run the HF target and return
  what it hands a drafter (``shared_kv_states``, ``hidden_states[-1]``), to check that the reference binds the
  same store layers; :meth:`HFAssistantOracle.speculative_generate` is transformers' own assisted greedy
  generation. Beyond the sliding window transformers' drafter also sees rejected drafts' K/V on sliding layers
  (transformers ``generation/candidate_generator.py``, ``SinglePositionMultiTokenCandidateGenerator.
  get_candidates``: it slices the target's K/V with ``[:, :, :current_length]``, which leaves a sliding store
  layer's ring of window - 1 + k + 1 entries whole), which changes its acceptance, never its output: acceptance
  is not compared with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import transformers
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

from ..core.hf_assistant import assistant_construction
from .transformers import check_parameters

SLIDING, FULL = "sliding_attention", "full_attention"


class HFAssistantOracle:
    """transformers' target and assistant, fp32 eager, on CPU.

    Args:
        target_dir: HF folder of the target (``Gemma4ForCausalLM``).
        drafter_dir: HF folder of the assistant (``Gemma4AssistantForCausalLM``).

    Attributes:
        construction: ``"native"`` (transformers constructs the assistant by itself) or ``"patched"``.

    Raises:
        AssistantUnavailable: this transformers cannot construct the assistant, even patched (one line).
    """

    name = "transformers-assistant"

    def __init__(self, target_dir: str | Path, drafter_dir: str | Path):
        transformers.logging.set_verbosity_error()
        self.target = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
        with assistant_construction() as how:
            self.construction = how
            self.drafter = Gemma4AssistantForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
        check_parameters(self.target, target_dir)  # NaN, Inf, |w| > 1e30: one line, as every engine
        check_parameters(self.drafter, drafter_dir)

    def after_prefill(self, prompt: Sequence[int]) -> tuple[int, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """The HF target after reading ``prompt``: its greedy next token, ``hidden_states[-1]`` at the last position
        and its ``shared_kv_states`` (``{layer type: (K, V)}``, each ``[S, Hkv, D]`` float64, every position)."""
        with torch.no_grad():
            out = self.target(torch.tensor([list(prompt)]), use_cache=False, output_hidden_states=True,
                              return_shared_kv_states=True)
        kv = {t: (k[0].transpose(0, 1).double().numpy(), v[0].transpose(0, 1).double().numpy())
              for t, (k, v) in out.shared_kv_states.items()}
        return int(out.logits[0, -1].argmax()), out.hidden_states[-1][0, -1].double().numpy(), kv

    def drafts(self, token: int, h_prev: np.ndarray, position: int, kv: dict[str, tuple[np.ndarray, np.ndarray]],
               n: int) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
        """One draft round: ``n`` greedy steps at ``position`` from ``token`` and ``h_prev`` [H_t].

        Args:
            kv: ``{"sliding_attention" | "full_attention": (K, V)}``, each ``[S, Hkv, D]``: the keys the drafter
                may see (all of them are visible to transformers' bidirectional masks).

        Returns:
            ``(tokens, logits [V] per step, h_next [H_t] per step)`` float64.

        Source: transformers ``SinglePositionMultiTokenCandidateGenerator.get_candidates``.
        """
        shared = {t: (torch.tensor(k, dtype=torch.float32).transpose(0, 1)[None],
                      torch.tensor(v, dtype=torch.float32).transpose(0, 1)[None]) for t, (k, v) in kv.items()}
        emb = self.target.get_input_embeddings()
        tok, h = int(token), torch.tensor(np.asarray(h_prev), dtype=torch.float32).view(1, 1, -1)
        tokens, logits, hs = [], [], []
        with torch.no_grad(), assistant_construction():
            for _ in range(n):
                x = torch.cat([emb(torch.tensor([[tok]])), h], dim=-1)
                out = self.drafter(inputs_embeds=x, position_ids=torch.tensor([[position]]), shared_kv_states=shared,
                                   attention_mask=None)
                tok, h = int(out.logits[0, -1].argmax()), out.last_hidden_state
                tokens.append(tok)
                logits.append(out.logits[0, -1].double().numpy())
                hs.append(h[0, -1].double().numpy())
        return tokens, logits, hs

    def speculative_generate(self, prompt: Sequence[int], max_new_tokens: int, k: int) -> list[int]:
        """transformers' own assisted greedy generation with the assistant drafting ``k`` tokens per round."""
        self.drafter.generation_config.num_assistant_tokens = k
        self.drafter.generation_config.num_assistant_tokens_schedule = "constant"
        with torch.no_grad(), assistant_construction():
            out = self.target.generate(torch.tensor([list(prompt)]), assistant_model=self.drafter, do_sample=False,
                                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        return out[0, len(prompt):].tolist()

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """transformers' plain greedy generation (no assistant)."""
        with torch.no_grad():
            out = self.target.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=max_new_tokens,
                                       min_new_tokens=max_new_tokens)
        return out[0, len(prompt):].tolist()
