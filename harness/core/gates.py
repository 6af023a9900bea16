"""The gate table: every tolerance the harness applies, in one place, each with its reason.

A gate compares one measured figure with a limit. Gates are keyed by the pair
they judge; a case may override a limit in its TOML ``[gates]`` table, and must
give a reason there (see :func:`resolve`).

Source of the defaults: ``docs/design.md`` ("Gates") and the issue that introduced
each pair.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from reference.errors import InputError


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
    Gate("fast~reference.max_abs_logit", 1e-3, "le",
         "torch fp32 vs float64: fp32 rounding (~1e-5 here) with 100x room for kernels that sum in another order"),
    Gate("fast~reference.layer_cosine", 0.99999, "ge",
         "per trace point cosine of fp32 vs float64; a formula fault drops it below 0.999"),
    Gate("fast_bf16~reference.mean_kld", 1e-3, "le",
         "bf16 weights and activations: llama-perplexity mean KLD of ~1e-4 is typical for 16-bit formats"),
    Gate("fast_bf16~reference.same_top1", 0.99, "ge",
         "bf16 may flip near-ties only; the synthetic cases keep median top-1 margins near 1"),
    Gate("fast.batched~solo.same_tokens", 1.0, "ge",
         "continuous batching must not change any greedy token (fp32)"),
    Gate("fast.batched~solo.max_abs_logit", 1e-4, "le",
         "same fp32 math, different matrix shapes: only summation-order rounding"),
    Gate("fast.neighbour_isolation.max_abs_logit", 0.0, "le",
         "same shapes, different neighbours: a row's arithmetic must not depend on other rows (bit-identical)"),
    Gate("fast.chunked~oneshot.max_abs_logit", 1e-4, "le",
         "chunked prefill (chunks <, =, > window) and token-by-token decode vs one forward, fp32"),
    Gate("llamacpp~reference.mean_kld", 1e-5, "le",
         "llama.cpp on CPU (F32 weights and KV cache, flash attention off) vs the float64 reference with "
         "llama.cpp's fp16 GELU table emulated (harness.engines.llamacpp.numerics.llamacpp_numerics): fp32 rounding leaves "
         "KLD 1e-8..5e-7; a formula or layout fault gives > 1e-3. Figures vs the exact GELU are reported beside"),
    Gate("llamacpp~reference.same_top1", 1.0, "ge",
         "llama.cpp F32 must pick the (fp16-GELU-table) reference's argmax at every position; without the "
         "table emulated, a near-tie (margin 0.003 on 26b-a4b) flips, which the report shows beside"),
    Gate("llamacpp~reference.max_abs_logit", 2e-2, "le",
         "fp32 rounding through the layers, measured up to 1.6e-2 on the small cases with llama.cpp's fp16 "
         "GELU table emulated in the reference (up to 2.7e-2 without); a formula fault moves logits by > 1e-1"),
    Gate("llamacpp~reference.runs", 1.0, "ge",
         "llama.cpp must load our GGUF and run it; an abort inside llama.cpp is that engine failing the case"),
    Gate("tokenizer.check", 1.0, "ge",
         "a tokenizer parity check (ours vs HF tokenizers / sentencepiece / round trips) must find 0 differing texts"),
    Gate("gemma3_real.continuation", 1.0, "ge",
         "the real Gemma 3 270M GGUF must greedily continue each known prompt with the expected text"),
    Gate("drafter.reference~transformers.max_abs", 1e-4, "le",
         "float64 reference drafter vs transformers' patched Gemma4AssistantForCausalLM (fp32 eager) on the same "
         "token, h_prev and store K/V, logits and h_next over 4 draft steps: fp32 rounding gives ~3e-6; a wrong "
         "store layer, position or head moves them by > 1e-1"),
    Gate("drafter.store_kv.reference~transformers.max_abs", 1e-4, "le",
         "the K/V transformers' target hands its drafter (shared_kv_states) and its hidden_states[-1] vs the "
         "reference's bound store layers and result_norm: the same fp32-vs-float64 rounding as "
         "reference~transformers; another layer's K/V differs by O(1)"),
    Gate("drafter.gguf_f32~safetensors.max_abs", 0.0, "le",
         "the same float32 drafter weights through the GGUF and safetensors loaders (full head on both sides) must "
         "give bit-identical float64 drafts"),
    Gate("drafter.fast~reference.max_abs", 1e-4, "le",
         "fast fp32 drafter over the fast target's cache vs the float64 reference over its own: fp32 rounding of "
         "target and drafter (~1e-5 here); a wrong store layer or missing input moves logits by > 1e-1"),
    Gate("drafter.llamacpp.runs", 1.0, "ge",
         "llama.cpp must load the gemma4-assistant GGUF beside its target (ctx_other) and draft; an abort is "
         "that engine failing the case"),
    Gate("drafter.llamacpp~reference.same_drafts", 1.0, "ge",
         "llama.cpp's drafter must propose the reference drafter's tokens (full head on both sides, fp16 GELU "
         "table emulated): a drafter reading the wrong KV group proposes others"),
    Gate("drafter.llamacpp~reference.max_abs", 2e-2, "le",
         "llama.cpp F32 drafter logits and h_next vs the reference with llama.cpp's fp16 GELU table: fp32 rounding "
         "through target and drafter (measured up to 8e-3), the bound of llamacpp~reference.max_abs_logit"),
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
        InputError: an unknown gate name, or an override without a reason, or with neither a limit
            nor ``informational = true``.
    """
    gates = dict(DEFAULT_GATES)
    for name, ov in (overrides or {}).items():
        if name not in gates:
            raise InputError(f"{where}: [gates] {name}: unknown gate (known: {', '.join(sorted(gates))})")
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


DIFF_TOL = 1e-3
"""``g4h diff``'s default bound on the relative error of a trace point (rel L2 with tensor dumps on
both sides, else the checksum lower bound of :func:`harness.traces.compare.checksum_error`).

Why 1e-3: fp32 rounding against the float64 reference stays near 1e-6 per point on the built-in
cases (the same margin as ``fast~reference.max_abs_logit``); a formula fault moves a point by 1e-2
or more. A bf16 or quantized engine needs a wider ``--tol``, chosen by whoever runs the diff."""


NEAR_TIE_MARGIN = 2 * DEFAULT_GATES["llamacpp~reference.max_abs_logit"].limit
"""A reference top-1 margin below this is a near-tie: two engines each inside the max-|Δlogit| gate of
llama.cpp against the reference (2e-2) may legitimately order the two best tokens differently there, so a
flip at such a position is reported as a near-tie, not a fault."""


# --------------------------------------------------------------------------- op-level bounds


@dataclass(frozen=True)
class OpBound:
    """The bound of one op of the twins (``reference.model.X`` against ``fast.model.X``) in one dtype.

    Attributes:
        op: the function name, the same in both twins.
        dtype: the fast twin's weight/input dtype (``float32`` or ``bfloat16``).
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
    OpBound("gelu_ffn", "float32", 1e-10, _FP32 + " (three matmuls)"),
    OpBound("gelu_ffn", "bfloat16", 1e-3, _BF16 + " (three matmuls, the hidden activation rounded again)"),
    OpBound("moe_route", "float32", 1e-10, "the same experts must be chosen (a swap is a fault); the weights "
            "are softmax outputs in float32"),
    OpBound("expert_ffn", "float32", 1e-10, _FP32 + " (two matmuls)"),
    OpBound("moe_experts", "float32", 1e-10, _FP32 + " (two matmuls per expert, weighted sums)"),
]}
"""Every op-level bound of the twin test table (``tests/test_ops.py``), keyed by ``(op, dtype)``."""
