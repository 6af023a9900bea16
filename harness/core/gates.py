"""The gate table: every tolerance the harness applies, in one place, each with its reason.

A gate compares one measured figure with a limit. Gates are keyed by the pair
they judge; a case may override a limit in its TOML ``[gates]`` table, and must
give a reason there (see :func:`resolve`).

Source of the defaults: ``docs/design.md`` ("Gates"); each gate's reason says where its figure comes from.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gemma4_harness.reference.errors import InputError

from .engine_kinds import ORACLE, ORACLES, rounding_kinds
from .names import old_gate_line


@dataclass(frozen=True)
class Gate:
    """One limit on one metric.

    Attributes:
        name: ``<pair>.<metric>``, e.g. ``reference~transformers.max_abs_logit``.
        limit: the bound.
        op: ``le`` (measured <= limit passes) or ``ge`` (measured >= limit).
        reason: why this bound, in one sentence.
        informational: measured and reported but not gating (a case's override, with its reason).
    """

    name: str
    limit: float
    op: str
    reason: str
    informational: bool = False

    def check(self, measured: float) -> bool:
        """True when ``measured`` is within the gate. NaN never passes."""
        if measured != measured:  # NaN
            return False
        return measured <= self.limit if self.op == "le" else measured >= self.limit


DEFAULT_GATES: dict[str, Gate] = {g.name: g for g in [
    Gate("reference~transformers.max_abs_logit", 1e-4, "le",
         "float64 reference vs fp32 eager: fp32 rounding over a tiny model's depth stays ~1e-5; a formula "
         "fault moves logits by > 1e-2"),
    Gate("reference~transformers.runs", 1.0, "ge",
         "the transformers oracle must load the model and run; when it cannot, its comparisons are not measured "
         "and this row fails with the reason (the case's other checks still run)"),
    Gate("reference~transformers.layer_rel_l2", 1e-4, "le",
         "per trace point ||ref - hf|| / ||hf||; fp32 rounding gives ~1e-6, so 1e-4 leaves room without hiding "
         "a per-layer fault"),
    Gate("reference.cached~uncached.max_abs_logit", 1e-10, "le",
         "same float64 arithmetic in a different order (prefill + one-token decode vs one forward): only "
         "summation-order rounding, ~1e-14"),
    Gate("reference.gguf_f32~safetensors.max_abs_logit", 0.0, "le",
         "the same float32 weights through two loaders must give bit-identical float64 logits"),
    Gate("reference.gguf_quant~gguf_quants.max_abs_weight", 0.0, "le",
         "our loader must dequantize exactly as gguf.quants.dequantize does"),
    Gate("fast.batched~solo.same_tokens", 1.0, "ge",
         "continuous batching must not change any greedy token (fp32)"),
    Gate("fast.batched~solo.max_abs_logit", 1e-4, "le",
         "same fp32 math, different matrix shapes: only summation-order rounding"),
    Gate("fast.neighbour_isolation.max_abs_logit", 0.0, "le",
         "same shapes, different neighbours: a row's arithmetic must not depend on other rows (bit-identical)"),
    Gate("fast.static~paged.same_tokens", 1.0, "ge",
         "the static-shape decoder (dense cache, CUDA graphs on a GPU) must give the paged engine's greedy tokens"),
    Gate("fast.static~paged.max_abs_logit", 1e-4, "le",
         "same fp32 formulas; attention sums over every cache slot (masked ones weigh exactly 0) and MoE batches "
         "its products otherwise: only summation-order rounding (9.8e-6..2.4e-5 measured on the built-in cases)"),
    Gate("fast.chunked~oneshot.max_abs_logit", 1e-4, "le",
         "chunked prefill (chunks <, =, > window) and token-by-token decode vs one forward, fp32"),
    Gate("reference~transformers.mm_runs", 1.0, "ge",
         "transformers' Gemma4ForConditionalGeneration (fp32 and float64) must load the multimodal case and run; "
         "when it cannot, its figures are not measured and this row says why (the case's other checks still run)"),
    Gate("reference~hf_processor.runs", 1.0, "ge",
         "transformers' Gemma4ImageProcessorPil and Gemma4AudioFeatureExtractor must build from the case's "
         "processor_config.json and run; when they cannot, this row says why (the case's other checks still run)"),
    Gate("mm.transformers.runs", 1.0, "ge",
         "transformers' multimodal model must run the vision-mask probe; when it cannot, this row says why (the "
         "reference's own mask figures are still measured)"),
    Gate("reference~transformers.mm_soft_token_max_abs", 1e-4, "le",
         "projected soft tokens (embed_vision / embed_audio outputs, magnitudes ~3-4) of the float64 encoders vs "
         "transformers' fp32 eager: rounding through the layers, the pooler and the projection measured "
         "3e-6..1.9e-5 (images, 1-30 s clips); a formula fault moves them by > 1"),
    Gate("reference~transformers.mm_encoder_layer_rel_l2", 1e-4, "le",
         "||ref - hf|| / ||hf|| at every vision / audio encoder trace point, fp32 eager: measured 1e-7..5e-6; "
         "a seeded fault moves the worst point past 1e-2"),
    Gate("reference~transformers.mm_merged_max_abs_logit", 1e-4, "le",
         "the merge alone: transformers' own soft tokens injected into our decoder (placeholders, the PLE pad "
         "row, the bidirectional mask) against transformers' logits, held to the text gate (1.5e-5 measured); "
         "merge and mask faults move logits by 3.7 (window + 1) to 16 (soft tokens scaled by sqrt(h))"),
    Gate("reference~transformers.mm_max_abs_logit", 1e-4, "le",
         "end to end through transformers' fp32 vision and audio towers, reported beside the gated parts: their "
         "soft-token rounding (up to 1.5e-5 absolute, inside mm_soft_token_max_abs) reaches the logits amplified "
         "5-10x, 7e-5..1.2e-4 measured on the tiny multimodal model; the encoders and the merge are gated "
         "separately, so this figure only informs", informational=True),
    Gate("reference~transformers_f64.mm_max_abs_logit", 1e-10, "le",
         "end to end against transformers in float64 (model.double(), eager, its hard-coded float32 casts routed to "
         "float64: harness.engines.mm_transformers.float64_everywhere; per_dim_scale's softplus in float64): the same "
         "formulas at the same precision leave float64 summation order, 4e-13..1.6e-12 measured on the multimodal "
         "cases; this proves the formulas where the fp32 oracle cannot (its encoder rounding reaches the logits as "
         "~1e-4, above the text gate)"),
    Gate("reference~transformers_f64.mm_soft_token_max_abs", 1e-10, "le",
         "projected soft tokens against transformers in float64: 7e-14..1e-13 measured; any formula difference in "
         "an encoder shows far above"),
    Gate("reference~transformers_f64.layer_rel_l2", 1e-10, "le",
         "every encoder and decoder trace point against transformers in float64: 2.5e-14 worst measured"),
    Gate("reference.mmproj~hf.max_abs_soft_token", 0.0, "le",
         "the same float32 weights through the mmproj GGUF and the HF safetensors loaders, the same processor "
         "budget: bit-identical soft tokens"),
    Gate("reference.mmproj~hf.max_abs_logit", 0.0, "le",
         "the text GGUF + mmproj against the HF folder, the same soft tokens: bit-identical logits (a GGUF's "
         "bidirectional setting follows llama.cpp's width rule, an HF config states it)"),
    Gate("mm.causal.first_image_token_change", 0.0, "le",
         "a causal model (no use_bidirectional_attention, or mm_token_type_ids not given): no later soft token may "
         "reach the first image token on any layer; the masked weight is exactly 0"),
    Gate("reference~llamacpp.mm_vision_runs", 1.0, "ge",
         "llama.cpp's mtmd must load the text GGUF and the mmproj and encode every image; an abort inside llama.cpp "
         "(a worker subprocess) is that engine failing the case"),
    Gate("reference~llamacpp.mm_audio_runs", 1.0, "ge",
         "llama.cpp's mtmd must encode every audio clip; an abort is that engine failing the case"),
    Gate("reference~llamacpp.mm_vision_cosine", 0.99999, "ge",
         "llama.cpp's projected image soft tokens (mtmd, F32 mmproj with clip.use_gelu = true) against the reference "
         "with llama.cpp's F16 im2col and fp16 GELU table emulated: cosine >= 1 - 4e-10 measured; the mmproj as the "
         "converter writes it (no clip.use_gelu: gelu_quick) gives 0.99978..0.99996, pooling or RoPE faults far less"),
    Gate("reference~llamacpp.mm_audio_cosine", 0.9999, "ge",
         "llama.cpp's projected audio soft tokens against the reference (conv F16 im2col emulated): 0.9999927 (7 s) "
         "..0.9999969 (1 s) measured, a gap the emulation does not close and the clip callback cannot localise "
         "(llama.cpp's float32 mel front end is a graph input it does not report); 0.9999 sits 10x above it"),
    Gate("reference~llamacpp.mm_soft_token_max_abs", 0.05, "le",
         "reported beside the cosines, not gated: soft tokens of magnitude ~3 move by 2e-4 (vision, emulated) to "
         "2e-2 (audio)", informational=True),
    Gate("reference~hf_processor.max_abs_pixel", 2.0**-25, "le",
         "our float64 pixels rounded once to float32 vs Gemma4ImageProcessorPil's float32: both take uint8 * "
         "(1/255) in float64 of the same PIL-resized image, so at most half a float32 ulp at 1.0"),
    Gate("reference~hf_processor.max_abs_mel", 1e-5, "le",
         "log-mel features vs Gemma4AudioFeatureExtractor, which frames, windows and transforms in float32: "
         "1e-6 (1 s) to 5e-6 (30 s) measured on noise clips, 1.6e-5 on noise + tone; a pure tone sits at 3e-4 "
         "in near-empty bins (HF's own float32 noise, shown by emulating its float32 steps)"),
    Gate("mm.bidirectional.full_layer_change", 0.0, "le",
         "relative change of the first image token's output on a full layer when only the last soft token "
         "changes: a full layer is causal, the masked weight is exactly 0, so the output is bit-identical"),
    Gate("mm.bidirectional.sliding_layer_change", 1e-3, "ge",
         "the same change on the first sliding layer, the last soft token 7.5 windows later: 2.2e-2 measured on "
         "the tiny multimodal model; an engine that ignores the vision mask (vLLM #40106) or drops it for an "
         "image longer than the window (vLLM PR #47217) gives exactly 0"),
    Gate("oracle~engine.max_abs_logit", 2e-2, "le",
         "an fp32 engine against the oracle's logits (g4h compare, server and cmd engines): fp32 rounding through the "
         "layers plus approximations such as llama.cpp's fp16 GELU table reach 1.6e-2 on the small cases; a formula "
         "fault moves logits by > 1e-1"),
    Gate("oracle~engine.mean_kld", 1e-5, "le",
         "an fp32 engine: llama-perplexity mean KLD of 1e-8..5e-7 from rounding; a formula or layout fault gives > 1e-3"),
    Gate("oracle~engine.same_top1_decisive", 1.0, "ge",
         "every position whose oracle top-1 margin is at least the near-tie margin must keep its argmax; flips at "
         "near-ties are reported beside, not failed (two correct engines may order a near-tie differently)"),
    Gate("oracle~engine.greedy", 1.0, "ge",
         "every greedy stream agrees by vLLM's rule (check_logprobs_close): identical, or at the first mismatch "
         "each token is in the other side's top-N; a divergence where the oracle's margin is a near-tie passes"),
    Gate("oracle~engine.max_abs_logprob", 2e-2, "le",
         "an fp32 engine's log-probs of the shared top-N tokens on the agreed prefix: the same rounding as its logits"),
    Gate("oracle~engine_bf16.max_abs_logit", 1.0, "le",
         "reported for a 16-bit engine, not gated: bf16 moves logits by 1e-2..1 on the small cases; the KLD and "
         "top-1 gates judge it", informational=True),
    Gate("oracle~engine_bf16.mean_kld", 1e-3, "le",
         "a 16-bit engine: mean KLD of ~1e-4 is typical for 16-bit formats (as reference~fast_bf16)"),
    Gate("oracle~engine_bf16.same_top1_decisive", 0.99, "ge",
         "a 16-bit engine may flip a few decisive positions on narrow models; more is a fault"),
    Gate("oracle~engine_bf16.greedy", 1.0, "ge",
         "every greedy stream agrees by vLLM's rule (check_logprobs_close), as for fp32"),
    Gate("oracle~engine_bf16.max_abs_logprob", 1.0, "le",
         "reported for a 16-bit engine, not gated (as its logits)", informational=True),
    Gate("server.tokenizer", 1.0, "ge",
         "every text prompt must tokenize on the server to the ids our tokenizer gives; a difference is a tokenizer "
         "fault, reported apart from the model's figures (which run on our ids)"),
    Gate("server.batched~alone.greedy", 1.0, "ge",
         "requests sharing batches (staggered, concurrent) against the same requests sent one at a time: fp32 "
         "summation order changes with the batch shape (bit-identical for 1 of 16 requests on llama-server, "
         "docs/server-dialects.md), so equality is not asked, but every request must agree by vLLM's rule or part at "
         "a near-tie of the alone run"),
    Gate("server.batched~alone.max_abs_logprob", 2e-2, "le",
         "reported, not gated: on fp32 weights batch shapes move log-probs by ~4e-3, on quantized ones by up to 0.6 "
         "(llama.cpp's quantized matmuls, docs/server-dialects.md); the greedy rule judges", informational=True),
    Gate("server.stream~nostream.same_tokens", 1.0, "ge",
         "streaming is a transport choice: the same request streamed must give the same tokens and text (every step "
         "the stream names) as without streaming"),
    Gate("server.stop.max_tokens", 1.0, "ge",
         "max_tokens must give exactly that many tokens (finish_reason length) unless EOS comes first"),
    Gate("server.stop.string", 1.0, "ge",
         "with a stop string taken from the oracle's continuation, where the server's own stream agrees with it (a "
         "parting of the streams is the greedy gate's to judge), the server must stop there: finish_reason stop, "
         "the text cut just before the string"),
    Gate("server.stop.eos", 1.0, "ge",
         "with EOS not ignored, the server must stop where the oracle's greedy stream reaches EOS and nowhere else "
         "(a parting at an oracle near-tie excepted)"),
    Gate("server.prompt_logprobs", 1e-3, "le",
         "the log-probs a server reports for the prompt's own tokens (vLLM prompt_logprobs, llama-cpp-python echo) "
         "against the reference's, and the shared top-N at each position: the same fp32 rounding as "
         "reference~openai.max_abs_logprob; with the server's approximations (its dialect's defaults or --declare) "
         "max(this, 2 x their effect on these log-probs: EFFECT_FACTOR)"),
    Gate("server.chat_template", 1.0, "ge",
         "the ids the server evaluates for a chat request must be the ids of our Gemma 4 chat format "
         "(reference/chat.py), BOS exactly once"),
    Gate("tokenizer.check", 1.0, "ge",
         "a tokenizer parity check (ours vs HF tokenizers / sentencepiece / round trips) must find 0 differing texts"),
    Gate("gemma3_real.continuation", 1.0, "ge",
         "the real Gemma 3 270M GGUF must greedily continue each known prompt with the expected text"),
    Gate("drafter.reference~transformers.runs", 1.0, "ge",
         "transformers must construct the case's Gemma4AssistantForCausalLM (by itself, or with the harness's "
         "kv_sharing_modes patch where it cannot: harness.core.hf_assistant) to write the drafter's HF folder and "
         "be its oracle; when it cannot, the drafter checks do not run and this row says why (the rest of the "
         "case still runs)"),
    Gate("drafter.reference~transformers.max_abs", 1e-4, "le",
         "float64 reference drafter vs transformers' Gemma4AssistantForCausalLM (fp32 eager) on the same "
         "token, h_prev and store K/V, logits and h_next over 4 draft steps: fp32 rounding gives ~3e-6; a wrong "
         "store layer, position or head moves them by > 1e-1"),
    Gate("drafter.store_kv.reference~transformers.max_abs", 1e-4, "le",
         "the K/V transformers' target hands its drafter (shared_kv_states) and its hidden_states[-1] vs the "
         "reference's bound store layers and result_norm: the same fp32-vs-float64 rounding as "
         "reference~transformers; another layer's K/V differs by O(1)"),
    Gate("drafter.gguf_f32~safetensors.max_abs", 0.0, "le",
         "the same float32 drafter weights through the GGUF and safetensors loaders (full head on both sides) must "
         "give bit-identical float64 drafts"),
    Gate("drafter.reference~fast.max_abs", 1e-4, "le",
         "fast fp32 drafter over the fast target's cache vs the float64 reference over its own: fp32 rounding of "
         "target and drafter (~1e-5 here); a wrong store layer or missing input moves logits by > 1e-1"),
    Gate("drafter.llamacpp.runs", 1.0, "ge",
         "llama.cpp must load the gemma4-assistant GGUF beside its target (ctx_other) and draft; an abort is "
         "that engine failing the case"),
    Gate("drafter.reference~llamacpp.same_drafts", 1.0, "ge",
         "llama.cpp's drafter must propose the reference drafter's tokens (full head on both sides, fp16 GELU "
         "table emulated): a drafter reading the wrong KV group proposes others"),
    Gate("drafter.reference~llamacpp.max_abs", 2e-2, "le",
         "llama.cpp F32 drafter logits and h_next vs the reference with llama.cpp's fp16 GELU table: fp32 rounding "
         "through target and drafter (measured up to 8e-3), the bound of oracle~engine.max_abs_logit"),
    Gate("speculative.llamacpp.lossless", 1.0, "ge",
         "speculative greedy decoding inside llama.cpp (its drafter, verify, llama_memory_seq_rm rollback) must "
         "return llama.cpp's own plain greedy tokens"),
    Gate("speculative.lossless.same_tokens", 1.0, "ge",
         "speculative greedy must return plain greedy token for token, whatever the drafter proposes (a flip at a "
         "verify-vs-decode near-tie is named in the detail)"),
    Gate("speculative.verify~decode.max_abs_logit", 1e-4, "le",
         "the logits a token is chosen from, verify forward over k+1 rows vs one-token decode: same fp32 math in "
         "other matrix shapes, only summation-order rounding (as batched vs solo)"),
    Gate("speculative.oracle.acceptance", 1.0, "ge",
         "a drafter that proposes the target's own greedy tokens must have every draft accepted; less means the "
         "verifier rejects right drafts (a rollback or verify fault, or near-ties)"),
    Gate("speculative.random.acceptance", 0.05, "le",
         "uniform random drafts match the target's argmax with probability about 1/V (0.2 % at V = 512); more "
         "means the verifier accepts wrong drafts"),
    Gate("speculative.partial.acceptance_error", 0.0, "le",
         "a drafter right for exactly 2 tokens of every round must have exactly min(2, drafted) accepted in "
         "every round: the accepted prefix ends at the first wrong draft"),
    Gate("speculative.model.drafted", 1.0, "ge",
         "the case's assistant must actually have proposed drafts (a drafter that never runs still gives "
         "lossless output)"),
]}


# --------------------------------------------------------------------------- the reference against any engine

_RUNS = ("the engine must load the model and answer; an engine that cannot run (not installed, cannot read this "
         "model form, crashed, broke the protocol) fails the case: a check that did not run is not a pass")


def _pair_gates(pair: str, engine: str, bf16: bool = False, **own: tuple[float, str]) -> list[Gate]:
    """The gates of ``pair``, the reference against one engine on a user's model (``g4h parity --model M --against
    NAME``, :mod:`harness.parity.checks.pair`): ``runs``, then each metric with the bound of ``oracle~engine``
    (``oracle~engine_bf16`` for a 16-bit engine), unless ``own`` gives the metric a ``(limit, reason)`` of its own
    (``layer_rel_l2`` has no ``oracle~engine`` bound, so every pair gives one). ``engine`` says what the engine is."""
    base = "oracle~engine_bf16" if bf16 else "oracle~engine"
    gates = [Gate(f"{pair}.runs", 1.0, "ge", _RUNS)]
    for metric in ("max_abs_logit", "mean_kld", "same_top1_decisive", "greedy", "max_abs_logprob", "layer_rel_l2"):
        g = DEFAULT_GATES.get(f"{base}.{metric}")
        if metric in own:
            limit, why = own[metric]
            gates.append(Gate(f"{pair}.{metric}", limit, g.op if g else "le", f"{engine}: {why}"))
        else:
            gates.append(Gate(f"{pair}.{metric}", g.limit, g.op, f"{engine}: as {g.name}: {g.reason}", g.informational))
    return gates


_FP32_LAYER = (1e-3, "per trace point of an fp32 engine: fp32 rounding leaves 1e-7..1e-6 (fast fp32 near 1e-6, "
                     "g4h diff's default DIFF_TOL); a formula fault moves a point by 1e-2 or more")

_DECLARED = ("; an engine that declares approximations (docs/engine-protocol.md, \"Numerics\") is gated at "
             "max(this, 2 x their effect on this model, measured on the same figure: EFFECT_FACTOR)")

_FP32_OWN = {
    "max_abs_logit": (1e-3, "fp32 rounding, the bound of reference~fast (measured ~1e-5 on the small cases, 3e-4 "
                            "on the real Gemma 3 270M, 2e-5..4e-5 for a third-party fp32 engine); a logit off by "
                            "1e-2 fails" + _DECLARED),
    "max_abs_logprob": (1e-3, "the same fp32 rounding as the logits (max_abs_logit)" + _DECLARED),
    "mean_kld": (1e-5, "llama-perplexity mean KLD of 1e-12..1e-8 from fp32 rounding; a formula or layout fault "
                       "gives > 1e-3 (KLD grows with the square of a logit error: max(this, 4 x effect))"
                       + _DECLARED),
    "layer_rel_l2": (_FP32_LAYER[0], _FP32_LAYER[1] + _DECLARED),
}
"""The bounds of an engine computing in 32 or 64 bits, before the effect of what it declares is added."""

PAIR_GATES: list[Gate] = [
    *_pair_gates("reference~reference", "a second float64 reference on the same file",
                 **{m: (0.0, "the same float64 code on the same weights and ids must give bit-identical results")
                    for m in ("max_abs_logit", "mean_kld", "max_abs_logprob", "layer_rel_l2")}),
    *_pair_gates("reference~fast", "the torch fast path in fp32",
                 max_abs_logit=(1e-3, "fp32 rounding (~1e-5 on the small cases, 3e-4 on the real "
                                      "Gemma 3 270M) with room for kernels that sum in another order"),
                 max_abs_logprob=(1e-3, "the same rounding as its logits (reference~fast.max_abs_logit)"),
                 layer_rel_l2=(1e-3, "fp32 vs float64 per trace point stays near 1e-6 (g4h diff's default DIFF_TOL); "
                                     "a formula fault moves a point by 1e-2 or more")),
    *_pair_gates("reference~fast_bf16", "the torch fast path in bf16 (weights and activations; --dtype bfloat16)",
                 bf16=True, layer_rel_l2=(5e-2, "per trace point of a 16-bit engine: bf16 rounding (unit roundoff "
                                                "3.9e-3) through a few operations; a formula fault moves a point by "
                                                "1e-1 or more")),
    # reference~transformers.max_abs_logit, .layer_rel_l2 and .runs are above (the built-in cases use them too)
    Gate("reference~transformers.mean_kld", 1e-5, "le",
         "HF transformers fp32 eager: fp32 vs float64 leaves KLD near 1e-12 (bound as oracle~engine.mean_kld); a "
         "formula fault gives > 1e-3"),
    Gate("reference~transformers.same_top1_decisive", 1.0, "ge",
         "HF transformers fp32 eager: as oracle~engine.same_top1_decisive (near-ties reported, not failed)"),
    Gate("reference~transformers.greedy", 1.0, "ge",
         "HF transformers fp32 eager: as oracle~engine.greedy (vLLM's rule)"),
    Gate("reference~transformers.max_abs_logprob", 1e-4, "le",
         "HF transformers fp32 eager: the same rounding as its logits (reference~transformers.max_abs_logit)"),
    *_pair_gates("reference~llamacpp", "llama.cpp through llama-cpp-python (F32 KV cache, flash attention off: "
                 "declares its fp16 GELU table, which the reference emulates)", **_FP32_OWN),
    *_pair_gates("reference~openai", "a model behind an OpenAI-compatible server (greedy streams with top-N "
                 "log-probs only), against the reference with the numerics its dialect implies or --declare states "
                 "emulated (llama-server: fp16 GELU table, f16 KV cache, flash attention; llama-cpp-python: fp16 "
                 "GELU table, f16 KV cache)", **_FP32_OWN),
    *_pair_gates("reference~openai_bf16", "a model behind an OpenAI-compatible server computing in 16 bits (vLLM's "
                 "default for Gemma checkpoints, or --declare dtype=bfloat16)", bf16=True,
                 layer_rel_l2=(5e-2, "per trace point of a 16-bit engine (a server gives none)")),
    *_pair_gates("reference~cmd", "an engine behind the subprocess protocol computing in 32 or 64 bits (its hello's "
                 "dtype), against the reference with the approximations it declares emulated", **_FP32_OWN),
    *_pair_gates("reference~cmd_bf16", "an engine behind the subprocess protocol computing in 16 bits", bf16=True,
                 layer_rel_l2=(5e-2, "per trace point of a 16-bit engine: bf16 rounding (unit roundoff 3.9e-3) "
                                     "through a few operations; a formula fault moves a point by 1e-1 or more")),
]
"""The gates of every ``reference~<engine kind>`` pair (one line per engine kind; a new kind adds its line)."""

Q8_AGREEING = 0.2
"""The least ratio of ``<pair>_q8.agreeing_positions`` (see :data:`Q8_AGREEING_WHY`)."""

Q8_AGREEING_WHY = (
    "the positions, over the prompts, in each prompt's leading run whose logits agree with the emulating reference "
    "within the fp32 bound (1e-3), over the same count for the emulating reference against itself with every "
    "product's output moved in its last fp32 bits (jitter_sums: fp32 sums in another order; "
    "harness.parity.checks.quantized.NULL, harness.engines.llamacpp.numerics.jitter_sums_numerics). What the "
    "emulation leaves: fp32 accumulation (1e-7 relative at every trace point, 2e-6 on the logits), and sporadic "
    "flips: an activation within fp32 noise of an int8 rounding midpoint, which the engine's fp32 value takes the "
    "other way; a flip moves everything after it as far as the whole rounding does (e2b Q8_0: max |dlogit| 0.35 "
    "against the emulating reference, 0.83 against the exact one), so the worst figures are reported, not gated. A "
    "fault in a matrix moves every position, a flip only those after it: a correct engine agrees on about as many "
    "positions as the jittered reference does (the same law), a faulty one on none. Not the input jitter (every "
    "product's input moved by a few fp32 ulps, jitter_numerics: this null until issue 34): it also flips the exact "
    "int8 ties of inputs an engine computes bit for bit as the reference does (the first layer's norm of a quantized "
    "embedding row, a PLE row), at the first positions; on the PLE Q4_0 file of tests/test_local_gate.py it agreed "
    "on no position (no resolution: the pair fell back to the 8-bit yardstick, which passed the rows x1.02 and the "
    "block x1.5 faults below). Measured with engines that give logits and no tensors (tests/quant_logits_only.py: "
    "examples/llamacpp_engine.py with --declare vec_dot_types=llama.cpp, and the llamacpp engine with its traces "
    "withheld), the 8 synthetic prompts (217 positions): correct files 83 positions against the null's 69 (1.20, "
    "h96-q8_0, both engines), 39 and 51 against 52 (0.75, 0.98, h128-ple-q4_0), 94 against 69 (1.36, e2b Q8_0), 104 "
    "against 111 (0.94, h96-q4_1, cmd), 49 against 66 (0.74, h128-ple-q5_1, cmd); the first half of blk.1.ffn_down's "
    "rows x1.02, one block of blk.3.attn_output x1.5, two rows of blk.2.ffn_gate swapped: 0 in all 24 copies. Against "
    "the input null: 3.07 (h96-q8_0), none (h128-ple-q4_0), 1.81 (e2b Q8_0), 0.82 (h96-q4_1), 0.80 (h128-ple-q5_1); "
    "with the llamacpp engine before it was judged per layer, correct files 7.89 (31b Q4_K_M by llama-quantize) and "
    "21 (the real Gemma 3 270M Q4_K_M), the rows fault 0 in all 7 copies; against the sums null, the llamacpp "
    "engine with its traces withheld (tests/quant_logits_only.py 31b-Q4_K_M|gemma3-270m-Q4_K_M llamacpp), 82 "
    "against 72 (1.14) and 22 against 16 (1.38), the rows, block and swap faults 0 on both. 0.2: a correct engine's "
    "count may fall below the jittered reference's one draw by chance; 5 x below is far outside what the figures "
    "show, and a "
    "fault gives 0 (docs/quantized-activations.md). An engine that gives log-probs, not logits (an OpenAI server, a "
    "cmd: engine without logits) is counted the same way on what it returns: per greedy stream, its prompt positions "
    "where it reports prompt log-probs (llama-cpp-python's echo, vLLM) or, where it takes ids and reports none "
    "(llama-server), its top-N for one token after each prefix, then each generated step, whose top-N "
    "log-probs agree with the emulating reference's for the same ids (on the engine's own tokens: a prefill, then a "
    "decode step per token, as it ran them) within the fp32 log-prob bound (1e-3), over the same count for the "
    "emulating reference with every product's output moved in its last fp32 bits (jitter_sums: fp32 sums in another "
    "order) on the same tokens, positions and ids (harness.parity.checks.quantized.stream_agreement, NULL). Not the "
    "input jitter there: it also flips the exact int8 ties of the first layer's input (a quantized embedding row's "
    "norm), which a server computes bit for bit as the reference does, at the first prompt positions; on "
    "llama-cpp-python's server it agreed on 4 positions over 6 streams, under the floor, where the correct server "
    "agreed on 12 (e2b Q4_1) and 69 (IQ4_NL), and every fault passed. The sums null is the quieter one (a correct "
    "server may agree on fewer positions than it: the engine also differs in its fp32 norms, softmax, attention); "
    "measured on the servers' fault matrix (docs/quantized-activations.md), correct servers 0.29 to 4.5 of it where "
    "it has resolution (12 / 42 on e2b Q4_1, llama-cpp-python), every fault 0. "
    "Measured, e2b Q8_0, six text prompts, 8 new tokens, servers with their defaults: llama-server 36 positions "
    "against the jittered reference's 6, llama-cpp-python's server passing; the first half of blk.1.ffn_down's "
    "rows x1.02: 0 (tests/test_quantized_servers.py). Judged where the jittered reference agrees on at least one "
    "position per stream, or per prompt on logits (fewer: no resolution, reported; with the input null, e2b F16 on "
    "llama-server, 2 over 6, was a false alarm, and through the llamacpp engine, 2 over 6 prompts; on logits, e2b F16 "
    "agrees on none of 8 prompts with the sums null, 1 with the input null: median_abs_logit judges there, "
    "Q8_MEDIAN_LOGIT_WHY; the 8-bit yardstick judged there before it and passed the rows and block faults). For a "
    "server whose streams' null is under "
    "that floor, windows judge instead: each distinct prompt token after BOS asked as [BOS, token] for one token "
    "(independent requests, two rows each: quantized.WINDOWS_WHY), counted the same way, judged where the null "
    "agrees on at least window_floor() = 14 of them (a Poisson count of mean 14 falls under 0.2 x 14 with "
    "probability under 1e-4, Q8_LOCAL_ALPHA), else median_abs_logprob judges (Q8_MEDIAN_WHY). Where the engine "
    "gives its tensors (the llamacpp engine), reported only: local_median judges")

Q8_MEDIAN_WHY = (
    "where agreeing_positions has no resolution for a server (its null agrees on fewer positions than one per stream, "
    "and on fewer windows [BOS, token] than the floor: harness.parity.checks.quantized.WINDOWS_WHY, window_floor), "
    "the sizes judge: the median, over every compared position of every greedy stream, of the largest difference of "
    "the server's log-probs from the emulating reference's on the ids it named, at max(fp32 bound, 2 x the same "
    "median of the null (the emulating reference with its fp32 sums jittered, quantized.NULL)). Why sizes there: "
    "rounding flips too dense to count agreeing positions are those of a fine rounding (F16, BF16: a spacing of "
    "2^-11 or 2^-8 relative, flipped by fp32 noise at many elements of every row, each flip small), so every "
    "position carries many of them and its difference is their sum, a noise whose size grows with the square root "
    "of the flips' count, that is of the size of the fp32 noise that triggers them: the engine's and the null's "
    "are the same law, a fault adds its own effect to every position, and the median ignores the sporadic large "
    "ones. 2 (EFFECT_FACTOR, as local_median): a correct engine whose fp32 differences are up to 4 x the null's. "
    "Measured (e2b F16, six text prompts, 8 new tokens; docs/quantized-activations.md): correct llama-server "
    "4.4e-3 against the null's 3.35e-3 (1.31 x), llama-cpp-python 3.2e-3 against 3.4e-3 (0.95 x); the first half "
    "of blk.1.ffn_down's rows x1.02 6.1 x, one block x1.5 21 x, two rows swapped 60 x. Its limits: it is blind "
    "where a coarse (int8) rounding's flips are dense, each flip as large as the rounding's effect: on the real "
    "Gemma 3 270M Q4_K_M served by llama-cpp-python, correct 1.02 x, the three faults 1.06 to 1.14 x (that case is "
    "judged by the windows instead); and a server whose fp32 noise is more than ~4 x the null's would fail here "
    "correct (not seen)")

Q8_MEDIAN_LOGIT_WHY = (
    "where agreeing_positions on logits has no resolution (an engine with logits and no tensors: its null agrees on "
    "fewer positions than one per prompt), the sizes judge, as median_abs_logprob does for a server (Q8_MEDIAN_WHY, "
    "the same rule and factor): the median, over every position of every prompt pooled, of the largest difference "
    "over the vocabulary of the engine's logits from the emulating reference's, at max(fp32 bound, 2 x the same "
    "median of the null (the emulating reference with its fp32 sums jittered, quantized.NULL, against the emulating "
    "reference)). Pooled, not per prompt: a fault moves every position of every prompt, and one prompt's few "
    "positions make a coarse median of their own (as the streams' positions are pooled). Why sizes there: the flips "
    "too dense to count are those of a fine rounding (F16, BF16), each small, every position carrying many: its "
    "difference is their sum, the engine's and the null's of the same law, and a fault adds its effect to every "
    "position. Measured (tests/quant_logits_only.py e2b-f16 cmd|llamacpp: the e2b F16 file, the 8 synthetic prompts, "
    "217 positions, the null agreeing on no leading position; examples/llamacpp_engine.py and the llamacpp engine "
    "with its traces withheld, the same figures): correct engine 7.0e-3 against the null's 7.5e-3 (0.94 x; limit "
    "1.5e-2); the first half of blk.1.ffn_down's rows x1.02 4.9e-2 (6.6 x the null), one block of "
    "blk.3.attn_output x1.5 1.2e-1 (16 x), two rows of blk.2.ffn_gate swapped 4.1e-1 (55 x); the 8-bit yardstick "
    "that judged there before passed the rows and block faults. Its limits are median_abs_logprob's: blind where a "
    "coarse (int8) rounding's flips are dense (h128-ple-q4_0, where the count has resolution and judges: correct "
    "0.16 against the null's 0.16, the rows fault 0.26 under the limit 0.33; the real Gemma 3 270M Q4_K_M through "
    "the llamacpp engine without traces: correct 1.36 against 1.42, the faults 1.51 to 1.71 under 2.84), and an "
    "engine whose fp32 noise is more than ~4 x the null's would fail here correct (not seen). Elsewhere reported, "
    "not gated (agreeing_positions judges)")
"""Why ``<pair>_q8.median_abs_logit`` gates where the logits' leading runs have no resolution."""

Q8_LOCAL_FLOOR = 1e-4
"""The least limit of ``<pair>_q8.local_median`` (see :data:`Q8_LOCAL_WHY`)."""

Q8_LOCAL_WHY = (
    "where the engine gives its tensors (the llamacpp engine's traces): each layer judged on its own. The emulating "
    "reference is re-seeded from the engine's stream (each layer, and the final norm, enter with the engine's l_out "
    "of the layer before, the first layer with its inp_scaled: reference.model.forward's layer_inputs), so an int8 "
    "rounding flip cannot carry from one layer into the next, while a fault in a matrix moves its own layer fully. "
    "Per trace point: the median over every position of every prompt of the per-position relative L2 against that "
    "reference; the figure is the worst point's, and the first point beyond the limit names the first diverging "
    "layer (harness.parity.checks.quantized.local_figure). The limit is max(1e-4, 2 x the null): the null is the same "
    "median for the re-seeded reference with every product's output moved in its last bits (jitter_sums, "
    "gemma4_harness.harness.engines.llamacpp.numerics.jitter_sums_numerics: a model of fp32 sums in another order, which flips the "
    "roundings an engine's sums can flip and not the exact ties of inputs both sides compute bit for bit), worst "
    "over the points; 2 as for an emulated approximation (EFFECT_FACTOR: the engine and the null each one such "
    "distance from the reference). 1e-4: fp32 accumulation against float64 leaves a median of 1e-7 (measured, "
    "correct llamacpp engine, tests/quant_matrix.py: 9.6e-8 on e2b Q8_0, Q4_0 and F16, 9.9e-8 on 31b Q4_K_M, "
    "1.2e-7 on the real Gemma 3 270M Q4_K_M; the null 1.5e-7 to 2.1e-7), so 1e-4 lies ~1000 x above it; a flip "
    "moves few positions and leaves the median where it was. A fault moves every position: the first half of one "
    "matrix's rows x1.02 gave 1.4e-2 (e2b, 31b) and 1.8e-2 (Gemma 3, Q6_K) at the ffn_out of its layer, one "
    "block's scale x1.5 1.7e-2 to 2.1e-2 and 7.6e-3 (Gemma 3, Q4_K), two rows swapped 0.10, 1.3e-2 (31b) and "
    "1.9e-3 (Gemma 3, Q5_0): the smallest 18 x above the limit (docs/quantized-activations.md). The median alone "
    "is blind to a fault that moves fewer than half of a point's positions (one MoE expert's matrix: only the "
    "positions routed to it move; measured, odd-h48-v777-moe widened to h64, 5 experts top-2, 217 positions: the "
    "first half of one expert's ffn_down_exps rows x1.02 (one copy per expert of blk.1 and blk.2) moved 31 to 134 "
    "positions by 1e-3..1e-2 and passed at a median of ~1e-7 in 7 of the 10 copies, in Q8_0 and in Q4_0: "
    "tests/quant_experts.py). So each point is judged at the rank the flips allow, not "
    "at the median: the positions beyond the limit are counted for the engine and for the null; a flip is a rare, "
    "independent event at a point, so the null's count n bounds the flips' rate (Poisson, upper bound at "
    "Q8_LOCAL_ALPHA), an engine with twice that rate (EFFECT_FACTOR, as above) exceeds m positions with "
    "probability under Q8_LOCAL_ALPHA, and the point's figure is its (m+1)-th largest error: beyond the limit "
    "exactly when more than m positions are (m capped at the median's rank, so never below the median). m is 36 "
    "for n = 0, 44 for 1, 64 for 5 (harness.parity.checks.quantized.flips_explained). Measured, correct llamacpp "
    "engine, the 8 synthetic prompts (217 positions): at most 4 positions beyond the limit at any point (the null 0 to "
    "5) on the MoE shape in Q8_0 and Q4_0 and the four shapes of tests/test_local_gate.py; one expert's rows x1.02 in "
    "blk.1 or blk.2 (20 copies): caught in 18 (63 to 134 positions at its ffn_moe); the other 2 (an expert routed to "
    "31 and 36 of the 217 positions) are below the resolution m = 36 - more prompts or positions raise it, as a "
    "fault's count grows with them and m does not (tests/test_local_gate.py)")

Q8_LOCAL_ALPHA = 1e-4
"""The tail probability of ``local_median``'s count of flips (see :data:`Q8_LOCAL_WHY`): the upper bound of the
flips' rate from the null's count, and the engine's count beyond twice that rate, each at this probability; per
point, so ~2e-2 over the ~200 points of a 35-layer model at the worst case of an engine whose flips are exactly twice
as frequent as the null's (a correct engine's are as frequent: far less). Smaller costs resolution: 1e-6 allows 56
positions where the null has none, against 36."""

_Q8_WHY = ("an engine that rounds its activations (quantized_activations, llama.cpp's dot-product types) on a file "
           "with quantized or 16-bit matrices, against the reference that rounds them the same way "
           "(reference/activation_quants.py, bit-identical to the built llama.cpp: tests/test_activation_quants.py; "
           "docs/quantized-activations.md): ")

Q8_REPORTED = {
    "max_abs_logit": 1e-3, "max_abs_logprob": 1e-3, "mean_kld": 1e-5, "layer_rel_l2": 1e-3,
}
"""The figures of an emulated pair that are reported against the fp32 bounds, not gated: their worst value is set by
the sporadic rounding flips (:data:`Q8_AGREEING_WHY`), as large as the rounding's whole effect."""


def _q8_gates(pair: str) -> list[Gate]:
    """``<pair>_q8.*``: ``agreeing_positions`` (:data:`Q8_AGREEING`), the same top-1 and greedy rules as
    ``oracle~engine`` (near-ties reported, not failed), and the worst-value figures reported (:data:`Q8_REPORTED`);
    ``<pair>_q8x.mean_kld`` where the rounding cannot be emulated. Not ``max(fp32 bound, 2 x effect)``: the effect of
    the rounding (max |dlogit| ~1 on the small cases) is far larger than a fault of one matrix."""
    out = [Gate(f"{pair}_q8.{m}", limit, "le", _Q8_WHY + "reported against the fp32 bound, not gated: its worst "
                "value is set by the sporadic int8 rounding flips the emulation leaves (agreeing_positions judges)",
                informational=True) for m, limit in Q8_REPORTED.items()]
    out.append(Gate(f"{pair}_q8.agreeing_positions", Q8_AGREEING, "ge", _Q8_WHY + Q8_AGREEING_WHY))
    out.append(Gate(f"{pair}_q8.local_median", Q8_LOCAL_FLOOR, "le", _Q8_WHY + Q8_LOCAL_WHY))
    out.append(Gate(f"{pair}_q8.median_abs_logprob", Q8_REPORTED["max_abs_logprob"], "le", _Q8_WHY + Q8_MEDIAN_WHY))
    out.append(Gate(f"{pair}_q8.median_abs_logit", Q8_REPORTED["max_abs_logit"], "le",
                    _Q8_WHY + Q8_MEDIAN_LOGIT_WHY))
    for m in ("same_top1_decisive", "greedy"):
        g = DEFAULT_GATES[f"oracle~engine.{m}"]
        out.append(Gate(f"{pair}_q8.{m}", g.limit, g.op, _Q8_WHY + "as " + g.name + ": " + g.reason))
    out.append(Gate(f"{pair}_q8x.mean_kld", 1e-5, "le",
                    "an engine that declares quantized_activations the reference cannot emulate (no vec_dot_types, "
                    "a type outside llama.cpp's table; the fast oracle emulates it too, by its --compute q8) on a file with quantized or 16-bit "
                    "matrices: its mean KLD against the exact oracle, at max(1e-5, 2 x the KLD that rounding every "
                    "such product's input to 8 bits (Q8_K blocks of 256 where the row allows, else Q8_0) causes on "
                    "this model and prompt: the yardstick, harness.engines.llamacpp.numerics.coarse_q8_numerics). An "
                    "engine that gives log-probs, not logits (a server), is judged on its greedy streams: the KLD "
                    "coarsened to the top-N ids it named plus one bin for the rest (a lower bound of the full KLD, "
                    "harness.core.metrics.binned_kld), averaged over the streams' positions, against the yardstick's "
                    "on the same bins (harness.parity.checks.quantized.stream_kld). "
                    "Why 2: an engine with its own 8-bit rounding stands about one yardstick from the exact model "
                    "(the sweep measured 0.45..1.0 x, sweep~engines_q8.mean_kld_ratio; llama.cpp on a 31b-shaped "
                    "Q5_K_M, measured before its Q5_1 products were emulated: 1.56 x); a fault must move the model "
                    "by about an 8-bit rounding of the whole model to be seen here (a 1.02 scale of half of one "
                    "matrix's rows is not: it was missed on 31b Q5_K_M judged this way). The other figures of "
                    "such a pair are reported, not gated"))
    return out


PAIR_GATES += [g for kind in rounding_kinds() for g in _q8_gates(f"{ORACLE}~{kind}")]
"""The kinds that may round their activations (the registry rows' ``rounds``: llama.cpp always, a server by its
dialect's defaults, a ``cmd:`` engine when it declares it, the fast engine under ``--compute q8``, llama.cpp's
arithmetic, fast/q8_compute.py, which declares ``quantized_activations`` as llama.cpp does): each judged by the same
gates."""

DEFAULT_GATES.update({g.name: g for g in PAIR_GATES})

PAIR_METRICS = ("runs", "max_abs_logit", "mean_kld", "same_top1_decisive", "greedy", "max_abs_logprob", "layer_rel_l2")
"""The metrics of a pair of :mod:`harness.parity.checks.pair` (``<pair>.<metric>``)."""


def oracle_pair_gates(oracle: str) -> list[Gate]:
    """The gates of the pairs ``<oracle>~<kind>`` when ``oracle`` stands in for the reference (``g4h parity
    --oracle fast``): every ``reference~<kind>`` gate of :data:`PAIR_METRICS` with its bound kept, and
    ``<oracle>~<oracle>`` (a second engine of the oracle's own kind) from ``reference~reference`` (bit-identical).

    Why the same bounds: the fast engine in fp32 is itself held within ``reference~fast`` of the reference
    (max |Δlogit| ~1e-5 on the built-in cases, 3e-4 on the real Gemma 3 270M), well inside the bounds of the
    other engines' pairs, so the bounds are kept, not widened; a figure that passes against the reference but fails
    against fast points at fast, and the run against the reference settles it. ``<oracle>~reference`` has no gates:
    it is ``reference~<oracle>`` (``--against <oracle>`` with the default oracle).
    """
    out = []
    for g in PAIR_GATES + [DEFAULT_GATES[f"reference~transformers.{m}"] for m in ("runs", "max_abs_logit",
                                                                                  "layer_rel_l2")]:
        pair, _, metric = g.name.rpartition(".")
        kind = pair.split("~", 1)[1]
        emulated = pair.endswith("_q8") and metric in Q8_ONLY_METRICS
        if (metric not in PAIR_METRICS and not emulated) or kind == oracle:
            continue
        other = oracle if kind == ORACLE else kind
        stands = (f"{oracle} stands in for the reference, its products computed as llama.cpp computes them "
                  "(--compute q8: fast/q8_compute.py)" if pair.endswith("_q8") else
                  f"{oracle} fp32 stands in for the reference")
        out.append(replace(g, name=f"{oracle}~{other}.{metric}",
                           reason=f"{g.reason} [--oracle {oracle}: {stands}; the bound of {g.name}]"))
    return out


Q8_ONLY_METRICS = ("agreeing_positions", "local_median", "median_abs_logprob", "median_abs_logit")
"""The metrics only an emulated pair (``<pair>_q8``) has: :func:`oracle_pair_gates` gives them to the fast oracle's
pairs too (it emulates ``quantized_activations`` through its ``--compute q8``)."""


DEFAULT_GATES.update({g.name: g for oracle in ORACLES if oracle != ORACLE for g in oracle_pair_gates(oracle)})


_NUMBERED = re.compile(r"#\d+(?=[.~]|$)")


EFFECT_FACTOR = 2.0
"""An engine that declares approximations (a 16-bit KV cache, llama.cpp's fp16 GELU table and attention operands,
its flash attention) is compared with a reference that makes them too (``harness.engines.numerics.emulate``), and
each figure of its pair is gated at ``max(fp32 bound, EFFECT_FACTOR**k x effect)``: the *effect* is how far the
declared approximations move that same figure on this model and these prompts (the reference with them against the
reference without them); k = 1 for differences of logits, log-probs and trace points, 2 for a KLD (quadratic in a
logit difference).

Why 2, from the triangle inequality: the engine makes the approximations its own way (another summation order,
another KV cell order in a server, an fp16 rounding that lands on the other side of a midpoint where the fp32
value before it differs in its last bit), so it stands about one effect from the exact model, as the emulating
reference does, and at most about two effects from the emulating reference. Measured (tests/field_servers.py, on
the six built-in GGUF cases llama.cpp runs and six odd synthetic shapes, llama-server and llama-cpp-python's server
with their defaults; docs/server-dialects.md, "Default settings"): the servers' greedy log-probs stood at most 0.87 x
the effect from the emulating reference (llama-server on 31b: 0.019 against an effect of 0.022), llama-cpp-python's
prompt log-probs at most 0.81 x (31b: 0.013 against 0.016). Why not a fixed bound: one fp16
rounding decided the other way moves a logit by 1e-4..1e-3, and a random model amplifies that by 10-1000x
depending on its shape (the GELU table alone moved the greedy log-probs of one odd shape by 0.67), so no fixed
number is both safe and tight; an engine that declares nothing has no effect and keeps the fp32 bound (1e-3)."""


def effect_limit(gate: Gate, effect: float, power: int = 1) -> float:
    """The limit of ``gate`` for an engine whose declared approximations move the figure by ``effect``:
    ``max(gate.limit, EFFECT_FACTOR**power * effect)`` for an upper bound (``le``); ``gate.limit`` otherwise or when
    ``effect`` is not a finite number."""
    if gate.op != "le" or not (effect == effect) or effect in (float("inf"),):
        return gate.limit
    return max(gate.limit, EFFECT_FACTOR ** power * float(effect))


def pair_name(kind: str, dtype: str | None = None, oracle: str = ORACLE) -> str:
    """``<oracle>~<kind>`` (``reference~llamacpp``), with ``_bf16`` for an engine that computes in 16 bits: the
    name of an engine's pair with the oracle, in ``g4h parity`` (``harness/parity/checks/pair.py``) and in
    ``g4h sweep`` (an engine on the group's base file against the base, ``harness/sweep/judge.py``)."""
    return f"{oracle}~{kind}" + ("_bf16" if dtype in ("bfloat16", "float16") else "")


def with_effect(gate: Gate, effect: float, power: int = 1) -> Gate:
    """``gate`` at :func:`effect_limit`, its reason saying so (unchanged when the effect does not raise it)."""
    limit = effect_limit(gate, effect, power)
    if limit == gate.limit:
        return gate
    return replace(gate, limit=limit, reason=f"{gate.reason} [declared approximations: their effect here is "
                                             f"{effect:.3g}, so the limit is {EFFECT_FACTOR:g}"
                                             f"{'^2' if power == 2 else ''} x that = {limit:.3g}]")


def gate_for(gates: Mapping[str, Gate], name: str) -> Gate:
    """The gate of figure ``name``: ``gates[name]``, or, for the second or later engine of one kind in a run
    (``reference~openai#2.greedy``, ``server#2.stop.eos``: :func:`harness.parity.checks.pair.pair_checks`), the
    gate of the name without its number, under the numbered name.

    Raises:
        KeyError: no gate of that name, numbered or not (a harness bug).
    """
    if name in gates:
        return gates[name]
    base = _NUMBERED.sub("", name)
    if base == name:
        raise KeyError(name)
    return replace(gates[base], name=name)


def resolve(overrides: Mapping[str, Any] | None, where: str) -> dict[str, Gate]:
    """The default gates with a case's overrides applied.

    Args:
        overrides: the case's ``[gates]`` table: ``name -> {limit = x, reason = "..."}`` to tighten or
            loosen a bound, or ``name -> {informational = true, reason = "..."}`` to report a figure
            without gating on it.
        where: the case file, for messages.

    Returns:
        name -> :class:`Gate`.

    Raises:
        InputError: an unknown gate name (a name of an earlier results version: the line names the new one,
            :func:`harness.core.names.old_gate_line`), or an override without a reason, or with neither a limit
            nor ``informational = true``.
    """
    gates = dict(DEFAULT_GATES)
    for name, ov in (overrides or {}).items():
        if name not in gates:
            raise InputError(old_gate_line(name, where)
                             or f"{where}: [gates] {name}: unknown gate (known: {', '.join(sorted(gates))})")
        ok = isinstance(ov, Mapping) and str(ov.get("reason", "")).strip() and (
            "limit" in ov or ov.get("informational") is True)
        if not ok:
            raise InputError(f"{where}: [gates] {name}: expected {{limit = <number>, reason = \"...\"}} "
                             "or {informational = true, reason = \"...\"}")
        gates[name] = replace(gates[name], limit=float(ov.get("limit", gates[name].limit)), reason=str(ov["reason"]),
                              informational=bool(ov.get("informational", False)))
    return gates


SPEED_RATIO_MARGIN = 0.25
"""``g4h bench --baseline``: a same-run speed ratio (fast/transformers, fast/llamacpp, batch B/batch 1)
fails when it drops below ``(1 - SPEED_RATIO_MARGIN)`` times its baseline value.

Why 25 %: on the shared 2-core CI VM, ratios of two engines measured in the same run moved by up to
about ±15 % between quiet runs (memory bandwidth itself varied 2-3x from minute to minute, which a
ratio cancels only in part, because two engines are never measured at the same instant). 25 % sits
above that noise and still catches a kernel falling back to a slow path (typically 2x or more)."""


SELFTEST_MIN_COSINE = 0.99999
"""``g4h selftest``'s bound on each trace point of a mutant of the fast path against the reference (with
``reference~fast.max_abs_logit`` at ``result_output``): a cosine, not the pair's relative L2 (``layer_rel_l2``),
because the selftest also checks that its mathematically equivalent mutants stay within the rule, and one of them
scales an intermediate by a constant that the next RMSNorm removes (``ple_no_inv_sqrt2``: ``inp_per_layer`` x
sqrt(2), cosine 1, relative L2 0.41): a relative-L2 rule would flag the point, not the model. fp32 against float64
leaves a relative L2 of at most 2.0e-6 at any point of the built-in text cases (reference~fast.layer_rel_l2, full parity
run), a cosine of about 1 - 2e-12; every mutant that is a fault breaks the rule at the point it must first show at
(tests/test_selftest.py, harness/selftest/mutants.py)."""


DIFF_TOL = 1e-3
"""``g4h diff``'s default bound on the relative error of a trace point (rel L2 with tensor dumps on
both sides, else the checksum lower bound of :func:`harness.traces.compare.checksum_error`).

Why 1e-3: fp32 rounding against the float64 reference stays near 1e-6 per point on the built-in
cases (the same margin as ``reference~fast.max_abs_logit``); a formula fault moves a point by 1e-2
or more. A bf16 or quantized engine needs a wider ``--tol``, chosen by whoever runs the diff."""


NEAR_TIE_MARGIN = 2 * DEFAULT_GATES["oracle~engine.max_abs_logit"].limit
"""A reference top-1 margin below this is a near-tie: two engines each inside the max-|Δlogit| gate of
an fp32 engine against the oracle (oracle~engine, 2e-2) may legitimately order the two best tokens
differently there, so a flip at such a position is reported as a near-tie, not a fault."""


MEL_F32_EMULATION_MAX_ABS = 2e-6
"""Our log-mel pipeline run in Gemma4AudioFeatureExtractor's float32 steps vs the extractor, max |diff|:
the same formula, so only float32 rounding of the log (values of order 10, ulp ~1e-6) remains."""

RESAMPLE_MAX_ABS = 2e-3
"""Band-limited resampling (44.1 -> 16 kHz) of a 1 kHz sine of amplitude 0.5 vs the exact sine, away from
the clip edges: the Kaiser (beta 5) filter's pass-band ripple, 5.7e-4 measured."""

BLOCKED_ATTENTION_MAX_ABS = 1e-12
"""One attention computed two ways in float64 (a full masked matrix, or query blocks reading only the keys
in their reach): the same sums in another order, so rounding at 1e-16 relative on values of order 1."""


# --------------------------------------------------------------------------- op-level bounds


@dataclass(frozen=True)
class OpBound:
    """The bound of one op of the twins (``reference.model.X`` against ``fast.model.X``) in one dtype.

    Attributes:
        op: the function name, the same in both twins; ``module.name`` outside the model modules
            (``vision.patch_embed``: ``reference.vision`` against ``fast.vision``).
        dtype: the fast twin's weight/input dtype (``float32`` or ``bfloat16``; ``int64`` for integer ops).
        max_nmse: the bound on ``sum((fast - ref)^2) / sum(ref^2)`` (llama.cpp test-backend-ops' NMSE).
        reason: why this bound, in one sentence.
    """

    op: str
    dtype: str
    max_nmse: float
    reason: str


_FP32 = ("float32 rounding (unit roundoff 6e-8, NMSE ~1e-15 per op) with room for sums over a few hundred "
         "terms and BLAS summation order; a formula fault gives NMSE >= 1e-4")
_BF16 = ("bfloat16 weights and inputs (unit roundoff 3.9e-3, NMSE ~1e-5 per rounded operand) with room for a "
         "few roundings in a row; a formula fault gives NMSE >= 1e-2")

OP_BOUNDS: dict[tuple[str, str], OpBound] = {(b.op, b.dtype): b for b in [
    OpBound("rms_norm", "float32", 1e-12, _FP32),
    OpBound("rms_norm", "bfloat16", 1e-4, _BF16),
    OpBound("gelu_tanh", "float32", 1e-12, _FP32),
    OpBound("gelu_tanh", "bfloat16", 1e-4, _BF16),
    OpBound("softcap", "float32", 1e-12, _FP32),
    OpBound("linear", "float32", 1e-12, _FP32),
    OpBound("linear", "bfloat16", 1e-4, _BF16),
    OpBound("rope_angles", "float32", 1e-12, "angles formed in float64 and rounded once to float32"),
    OpBound("apply_rope", "float32", 1e-12, _FP32),
    OpBound("attention", "float32", 1e-10, _FP32 + " (softmax over S keys, then S-term sums)"),
    OpBound("attention_mask", "float32", 0.0, "a boolean mask: the twins must see exactly the same keys"),
    OpBound("gelu_ffn", "float32", 1e-10, _FP32 + " (three matmuls)"),
    OpBound("gelu_ffn", "bfloat16", 1e-3, _BF16 + " (three matmuls, the hidden activation rounded again)"),
    OpBound("moe_route", "float32", 1e-10, "the same experts must be chosen (a swap is a fault); the weights "
            "are softmax outputs in float32"),
    OpBound("expert_ffn", "float32", 1e-10, _FP32 + " (two matmuls)"),
    OpBound("moe_experts", "float32", 1e-10, _FP32 + " (two matmuls per expert, weighted sums)"),
    # the multimodal merge (reference/multimodal.py <-> fast/multimodal.py)
    OpBound("multimodal.llm_input_ids", "int64", 0.0, "token ids: the twins must read the same table rows"),
    OpBound("multimodal.block_ids", "int64", 0.0, "block numbers: the twins must open the same blocks"),
    OpBound("multimodal.merge_embeddings", "float32", 1e-12, "a copy of rows: only the float32 rounding of the "
            "float64 inputs (NMSE ~1e-16); a row out of order or scaled gives NMSE >= 1e-2"),
    # the vision tower (reference/vision.py <-> fast/vision.py)
    OpBound("vision.clipped_linear", "float32", 1e-12, _FP32),
    OpBound("vision.clipped_linear", "bfloat16", 1e-4, _BF16),
    OpBound("vision.patch_embed", "float32", 1e-12, _FP32 + " (a 3p^2-term sum per output)"),
    OpBound("vision.patch_embed", "bfloat16", 1e-4, _BF16),
    OpBound("vision.position_embed", "float32", 1e-12, _FP32),
    OpBound("vision.rope_2d", "float32", 1e-12, "angles formed in float64 and rounded once to float32, then "
            "one rotation in float32"),
    OpBound("vision.vision_attention", "float32", 1e-10, _FP32 + " (softmax over N keys, then N-term sums)"),
    OpBound("vision.pool", "float32", 1e-12, _FP32 + " (k^2-term means, times sqrt(H))"),
    OpBound("vision.embed_vision", "float32", 1e-12, _FP32),
    OpBound("vision.embed_vision", "bfloat16", 1e-4, _BF16),
    # the audio tower (reference/audio.py <-> fast/audio.py)
    OpBound("audio.clippable_linear", "float32", 1e-12, _FP32),
    OpBound("audio.clippable_linear", "bfloat16", 1e-4, _BF16),
    OpBound("audio.conv2d_stride2", "float32", 1e-12, _FP32 + " (9 * C_in-term sums)"),
    OpBound("audio.layer_norm", "float32", 1e-12, _FP32),
    OpBound("audio.glu", "float32", 1e-12, _FP32),
    OpBound("audio.causal_depthwise_conv", "float32", 1e-12, _FP32),
    OpBound("audio.rel_pos_table", "float32", 1e-12, "sines formed in float64 and rounded once to float32"),
    OpBound("audio.relative_bias", "float32", 1e-12, _FP32 + " (D-term dot products, then a gather)"),
    OpBound("audio.attention_mask", "float32", 0.0, "a boolean mask: the twins must see exactly the same frames"),
]}
"""Every op-level bound of the twin test table (``tests/test_ops.py``), keyed by ``(op, dtype)``."""



SWEEP_DIVERGENCE_REL_L2 = 0.1
"""``g4h sweep``: a file's first-divergence layer is the first layer whose residual stream (``l_out``) on the trace
prompt is farther than this from the float64 reference's on the group's base file (relative L2).

Why 0.1: rounding a layer's weights to 4 bits alone moves its output by about 7 % (Q4_0 on Gaussian weights: a step
of max|w|/8 over a block of 32, max|w| ~ 2.0 sigma, gives an error of step/sqrt(12) ~ 0.074 sigma; the K-quants'
scales and minima do better), so a state more than 10 % off has taken more damage than one layer of 4-bit rounding
gives: the layer where a file's error stops being rounding-sized. Measured on e4b-wide: Q8_0 never passes it (0.8 %
at layer 0 to 2 % at the last), Q4_K_M at layer 0 (10.6 %), Q2_K at layer 0 (39 %)."""


SWEEP_GATES: dict[str, Gate] = {g.name: g for g in [
    Gate("sweep~engines.mean_kld", 1e-5, "le",
         "two engines on the same file, neither rounding its activations (or a file of F32 matrices only): each "
         "computes the file's own weights in fp32, so only fp32 rounding separates them (as oracle~engine.mean_kld: "
         "1e-8..5e-7 measured; llama.cpp and fast on e4b-wide F32: 9.2e-7 with llama.cpp's fp16 GELU table in it); a "
         "dequantization or formula fault in one of them moves the pair by the file's damage, 1e-3 or more. When the "
         "two declare different emulable approximations (llama.cpp's GELU table, fast none), max(this, 4 x their "
         "effect: the mean KLD between the float64 base under the one and under the other, EFFECT_FACTOR), as "
         "g4h parity raises its gates (an F32 MoE model with linear gain 1.6: the table alone moves the pair by "
         "3.9e-4)"),
    Gate("sweep~engines_bf16.mean_kld", 1e-3, "le",
         "two engines on the same file, one computing in 16 bits (a cmd: engine's hello dtype): as "
         "oracle~engine_bf16.mean_kld"),
    Gate("sweep~engines_q8.mean_kld_ratio", 2.0, "le",
         "two engines on a file with quantized or 16-bit matrices, one of which rounds the activations of those "
         "products (llama.cpp: quantized_activations, to block_q8_0 for the legacy types and block_q8_K for K- and "
         "i-quants, to F16/BF16 for 16-bit weights): their mean KLD over the group's 8-bit yardstick, the fast engine "
         "with every product's input rounded the coarser way (blocks of 256: harness.sweep.tasks.sensitivity_run), "
         "as llama.cpp does for K- and i-quants and more coarsely than for the legacy types. Measured: e4b-wide "
         "(yardstick 5.6e-3) 0.50 (Q8_0), 0.47 (Q4_0: block_q8_0 there), 0.77..1.0 (Q6_K..Q2_K); E2B's dimensions "
         "cut to 4 layers (5.6e-4) 0.45 (Q8_0), 0.93 (Q4_K_M), 0.92 (Q2_K); 2 leaves room for the statistics of a "
         "short prompt set and for a file whose weights sit far from the base's; a fault in one engine moves the pair "
         "by the file's own damage, 10 to 1000 times the yardstick on a K-quant"),
]}
"""The cross-engine gates of ``g4h sweep``: two engines on the same file (:mod:`harness.sweep.judge`)."""
DEFAULT_GATES.update(SWEEP_GATES)


# --------------------------------------------------------------------------- the gate tables of docs/gates.md

GATE_TABLES = ("summary", "full")
"""The generated tables (:func:`gate_table`): ``summary`` (one row per pair) and ``full`` (one row per gate and per
op bound, with its reason), both in docs/gates.md, the one document that holds them (README.md links it). A
document holds one between ``<!-- gates:NAME -->`` and ``<!-- /gates:NAME -->``; ``python -m gemma4_harness.harness.core.gates
--write`` rewrites them (in docs/gates.md, or in the files named), ``tests/test_docs.py`` holds them equal to this
module and in that one place."""

GATES_DOC = Path(__file__).resolve().parents[2] / "docs" / "gates.md"
"""Where the tables live: docs/gates.md of the source tree (``--write`` with no file)."""


def _fmt(x: float) -> str:
    """A limit as the tables print it: ``1e-4``, ``2e-2``, ``0.99999``, ``2.98023e-8``, ``0``, ``1``."""
    if x == 0 or 0.1 <= abs(x) < 1e4:
        return f"{x:g}"
    mantissa, _, exponent = f"{x:.6e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell (``|`` escaped)."""
    return text.replace("|", "\\|")


def _limit(g: Gate) -> str:
    """``≤ 1e-4``, ``≥ 1`` and `` (informational)`` for a gate reported but not gated."""
    return f"{'≤' if g.op == 'le' else '≥'} {_fmt(g.limit)}" + (" (informational)" if g.informational else "")


def gate_table(kind: str = "summary") -> str:
    """One of :data:`GATE_TABLES` as Markdown, from :data:`DEFAULT_GATES` and :data:`OP_BOUNDS` (their order).

    ``summary``: one row per pair (a gate's name up to its last dot), its metrics and limits; then the rule for
    declared approximations (:data:`EFFECT_FACTOR`). ``full``: one row per gate with its reason, then one row per op
    bound of the twin table.

    Raises:
        ValueError: ``kind`` is not one of :data:`GATE_TABLES`.
    """
    if kind == "summary":
        pairs: dict[str, list[Gate]] = {}
        for g in DEFAULT_GATES.values():
            pairs.setdefault(g.name.rpartition(".")[0], []).append(g)
        lines = ["| pair | gates (metric, limit) |", "|---|---|"]
        lines += [f"| `{pair}` | " + "; ".join(f"`{g.name.rpartition('.')[2]}` {_limit(g)}" for g in gates) + " |"
                  for pair, gates in pairs.items()]
        lines += ["", f"An engine that declares approximations is gated at max(limit, {EFFECT_FACTOR:g} x their effect "
                      f"on the same figure) ({EFFECT_FACTOR:g}^2 x for a KLD): `EFFECT_FACTOR`."]
        return "\n".join(lines) + "\n"
    if kind == "full":
        lines = ["| gate | limit | reason |", "|---|---|---|"]
        lines += [f"| `{g.name}` | {_limit(g)} | {_cell(g.reason)} |" for g in DEFAULT_GATES.values()]
        lines += ["", "Op-level bounds of the twin table (`tests/test_ops.py`: `reference.model.X` against "
                      "`fast.model.X`, NMSE as llama.cpp's test-backend-ops):", "",
                  "| op | dtype | max NMSE | reason |", "|---|---|---|---|"]
        lines += [f"| `{b.op}` | {b.dtype} | {_fmt(b.max_nmse)} | {_cell(b.reason)} |" for b in OP_BOUNDS.values()]
        return "\n".join(lines) + "\n"
    raise ValueError(f"unknown gate table {kind!r} (known: {', '.join(GATE_TABLES)})")


def _marked(kind: str) -> re.Pattern[str]:
    """The block of table ``kind`` in a document, markers included (group 1: the text between them)."""
    return re.compile(rf"(?s)<!-- gates:{kind} -->\n(.*?)<!-- /gates:{kind} -->")


def gate_tables_in(text: str) -> dict[str, str]:
    """The generated tables a document holds: ``kind -> the text between its markers``."""
    return {k: m.group(1) for k in GATE_TABLES for m in [_marked(k).search(text)] if m}


def with_gate_tables(text: str) -> str:
    """``text`` with every marked table replaced by :func:`gate_table`'s."""
    for kind in GATE_TABLES:
        text = _marked(kind).sub(lambda _m, k=kind: f"<!-- gates:{k} -->\n{gate_table(k)}<!-- /gates:{k} -->", text)
    return text


def _main(argv: list[str] | None = None) -> int:
    """``python -m gemma4_harness.harness.core.gates --markdown [summary|full]`` prints a table; ``--write [FILE...]`` rewrites the
    marked tables of each file (default docs/gates.md, :data:`GATES_DOC`). Returns the exit status (2: a file that
    cannot be read or holds no marked table)."""
    p = argparse.ArgumentParser(prog="python -m gemma4_harness.harness.core.gates", description=_main.__doc__)
    p.add_argument("--markdown", choices=GATE_TABLES, nargs="?", const="summary", default=None,
                   help="print this table (default summary)")
    p.add_argument("--write", nargs="*", default=None, metavar="FILE",
                   help="rewrite the marked tables in these files (default docs/gates.md)")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(gate_table(args.markdown))
    for name in ([str(GATES_DOC)] if args.write == [] else args.write or []):
        try:
            with open(name, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            print(f"{name}: cannot read: {e.strerror}", file=sys.stderr)
            return 2
        if not gate_tables_in(text):
            print(f"{name}: no <!-- gates:{'|'.join(GATE_TABLES)} --> block", file=sys.stderr)
            return 2
        new = with_gate_tables(text)
        if new != text:
            with open(name, "w", encoding="utf-8") as f:
                f.write(new)
            print(f"{name}: gate tables rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
