"""``g4h selftest``: mutation testing of the harness itself.

Each *mutant* is one known fault class injected into a copy of the fast path
(:class:`MutantFastModel`, a subclass of :class:`fast.model.FastModel`; ``fast/``
itself is never modified). The selftest traces the mutant and the float64
reference on the built-in synthetic cases, compares the traces with the
fast~reference gates (per trace point cosine >= 0.99999, max |Δlogit| <= 1e-3 at
``result_output``; :data:`harness.gates.DEFAULT_GATES`) through
:func:`harness.traces.compare`, and checks that

* the unmutated copy passes every gate and equals :class:`FastModel` bit for bit
  (the *control*: a mutant's detection is then the fault's doing, not the copy's);
* every mutant is detected on every case that exercises it, and the first failing
  (point, layer) in trace order is the one the fault must first show at
  (:attr:`Mutant.expected`, derived from the case's config);
* every mutant listed as *equivalent* stays within the gates (the claim that it
  cannot change the model's output is checked, not just stated).

Exit status 0 only when all three hold; 1 otherwise; 2 on bad input (an unknown
case or prompt id). The report goes to ``reports/<ts>-selftest/`` (``report.md``
with the mutant table, ``results.json``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fast import model as fast_model
from fast.model import FastModel, gelu_ffn, linear, moe_route, rms_norm
from reference.config import LayerSpec, ModelConfig
from reference.errors import InputError

from . import traces

RESULTS_VERSION = 1


# --------------------------------------------------------------------------- the mutable copy


def moe_experts_act(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, idx: torch.Tensor,
                    weights: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], rows: int = 16) -> torch.Tensor:
    """:func:`fast.model.moe_experts` with the gate activation as a parameter.

    [N, h], [E, 2F, h], [E, h, F], [N, K] x2 -> [N, h]. ``act`` is GELU-tanh in the model (transformers
    ``Gemma4TextExperts``); the SwiGLU mutant passes ``F.silu``.
    """
    return fast_model.moe_experts(x, w_gate_up, w_down, idx, weights, rows=rows, act=act)


def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


class MutantFastModel(FastModel):
    """The fast path (CPU, float32) with one switchable fault.

    ``decoder_layer`` and ``per_layer_inputs`` are copies of :class:`FastModel`'s with the switch
    points marked ``MUTANT``; ``attention_block`` wraps the parent's. With ``mutant=None`` the copy
    computes exactly what :class:`FastModel` computes (the selftest's control checks this bit for bit).

    Args:
        cfg, W: config and weights from :func:`reference.weights.load_model` (a mutant may pass an
            altered config: see :data:`MUTANTS`).
        mutant: the name of a switch used inside these methods, or None.

    Raises:
        InputError: as :class:`FastModel`.
    """

    SWITCHES = ("attn_scale", "experts_swiglu", "router_prenormed", "router_rmsnormed", "ple_token_unscaled",
                "ple_no_inv_sqrt2", "layer_scalar_branch")

    def __init__(self, cfg: ModelConfig, W, mutant: str | None = None):
        super().__init__(cfg, W, "cpu", "float32")
        self.mutant = mutant

    def attention_block(self, layer: LayerSpec, *args):
        """Parent's attention; MUTANT ``attn_scale``: q.k scaled by 1/sqrt(head_dim) instead of 1.0."""
        if self.mutant != "attn_scale":
            return super().attention_block(layer, *args)
        saved = self.cfg
        self.cfg = dataclasses.replace(saved, attn_scale=1.0 / math.sqrt(layer.head_dim))
        try:
            return super().attention_block(layer, *args)
        finally:
            self.cfg = saved

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Copy of :meth:`FastModel.per_layer_inputs`. [N], [N, h] -> [N, L, P]."""
        cfg, w = self.cfg, self.w
        N, L, P = ids.shape[0], cfg.n_layer, cfg.ple_dim
        tok = fast_model.embed_rows(w["per_layer_token_embd.weight"], ids).reshape(N, L, P)
        if self.mutant != "ple_token_unscaled":  # MUTANT: token part not scaled by sqrt(P)
            tok = tok * math.sqrt(P)
        ctx = linear(x, w["per_layer_model_proj.weight"]).float() * cfg.hidden_size**-0.5
        ctx = rms_norm(ctx.reshape(N, L, P), w["per_layer_proj_norm.weight"], cfg.rms_eps)
        if self.mutant == "ple_no_inv_sqrt2":  # MUTANT (equivalent): 1/sqrt(2) dropped
            return ctx + tok
        return (ctx + tok) * 2.0**-0.5

    def decoder_layer(self, layer: LayerSpec, x, positions, seqs, offsets, cache, views, ple, tr) -> torch.Tensor:
        """Copy of :meth:`FastModel.decoder_layer` with switch points. [N, h] -> [N, h]."""
        cfg, w, eps, il = self.cfg, self.w, self.cfg.rms_eps, layer.index
        b = f"blk.{il}."
        attn = self.attention_block(layer, rms_norm(x, w[b + "attn_norm.weight"], eps), positions, seqs, offsets,
                                    cache, views)
        a = x + rms_norm(attn, w[b + "post_attention_norm.weight"], eps)
        if tr:
            tr("attn_out", il, a)
        xn = rms_norm(a, w[b + "ffn_norm.weight"], eps)
        f = gelu_ffn(xn, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"])
        if layer.has_moe:
            f = rms_norm(f, w[b + "post_ffw_norm_1.weight"], eps)
            router_in = a
            if self.mutant == "router_prenormed":  # MUTANT: router fed the pre-FFN-normed input
                router_in = xn
            elif self.mutant == "router_rmsnormed":  # MUTANT (equivalent): router fed rms_norm(a), no weight
                router_in = rms_norm(a, None, eps)
            idx, wgt = moe_route(router_in, w[b + "ffn_gate_inp.weight"], w[b + "ffn_gate_inp.scale"],
                                 w[b + "ffn_down_exps.scale"], cfg.n_expert_used, eps)
            xe = rms_norm(a, w[b + "pre_ffw_norm_2.weight"], eps)
            act = F.silu if self.mutant == "experts_swiglu" else _gelu_tanh  # MUTANT: SwiGLU experts
            moe = rms_norm(moe_experts_act(xe, w[b + "ffn_gate_up_exps.weight"], w[b + "ffn_down_exps.weight"],
                                           idx, wgt, act), w[b + "post_ffw_norm_2.weight"], eps)
            if tr:
                tr("ffn_mlp", il, f)
                tr("ffn_moe", il, moe)
            f = f + moe
        if tr:
            tr("ffn_out", il, f)
        y = a + rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
        if ple is not None:
            g = F.gelu(linear(y, w[b + "inp_gate.weight"]), approximate="tanh") * ple
            p = rms_norm(linear(g, w[b + "proj.weight"]), w[b + "post_norm.weight"], eps)
            if tr:
                tr("per_layer_embd_out", il, p)
            y = y + p
        if cfg.has_layer_scalar and b + "layer_output_scale.weight" in w:
            s = w[b + "layer_output_scale.weight"].to(y.dtype)
            if self.mutant == "layer_scalar_branch":  # MUTANT: scalar on the layer's branches only
                y = x + (y - x) * s
            else:
                y = y * s
        if tr:
            tr("l_out", il, y)
        return y


# --------------------------------------------------------------------------- mutant builders


def _plain(name: str) -> Callable[[ModelConfig, Any], FastModel]:
    return lambda cfg, W: MutantFastModel(cfg, W, name)


def _with_cfg(**changes) -> Callable[[ModelConfig, Any], FastModel]:
    return lambda cfg, W: MutantFastModel(dataclasses.replace(cfg, **changes), W)


def _window_plus_one(cfg: ModelConfig, W) -> FastModel:
    return MutantFastModel(dataclasses.replace(cfg, sliding_window=cfg.sliding_window + 1), W)


def first_same_type_donors(cfg: ModelConfig) -> list[int]:
    """The wrong donor rule: a shared layer reads the *first* non-shared layer of its type (transformers
    ``Gemma4TextConfig.kv_sharing_modes`` takes the last)."""
    first_shared = cfg.n_layer - cfg.n_kv_shared
    out = []
    for L in cfg.layers:
        if L.has_kv:
            out.append(L.index)
        else:
            out.append(next(j for j in range(first_shared) if cfg.layers[j].is_sliding == L.is_sliding))
    return out


def _donor_changed(cfg: ModelConfig) -> list[int]:
    wrong = first_same_type_donors(cfg)
    return [L.index for L in cfg.layers if not L.has_kv and wrong[L.index] != L.kv_donor]


def _wrong_donor(cfg: ModelConfig, W) -> FastModel:
    wrong = first_same_type_donors(cfg)
    layers = tuple(dataclasses.replace(L, kv_donor=wrong[L.index]) for L in cfg.layers)
    return MutantFastModel(dataclasses.replace(cfg, layers=layers), W)


def _norms_plus_one(cfg: ModelConfig, W) -> FastModel:
    fm = MutantFastModel(cfg, W)
    for name in list(fm.w.t):
        if name.endswith("norm.weight") or "_norm_" in name and name.endswith(".weight"):
            fm.w.t[name] = fm.w.t[name] + 1.0
    return fm


def _proportional_layers(cfg: ModelConfig) -> list[LayerSpec]:
    return [L for L in cfg.layers if L.rope_freq_factors is not None and np.any(L.rope_freq_factors != 1.0)]


def _set_inv_freq(fm: FastModel, il: int, inv: np.ndarray) -> None:
    fm.inv_freq[il] = torch.tensor(inv, dtype=torch.float64)
    fm._rope_cache.pop(il, None)


def _rope_exponent_rotated(cfg: ModelConfig, W) -> FastModel:
    """Proportional RoPE with exponents over the rotated dims: ``base^(-2i / n_rotated)`` instead of
    ``base^(-2i / head_dim)`` for the rotated pairs (the unrotated pairs keep inverse frequency ~0)."""
    fm = MutantFastModel(cfg, W)
    for L in _proportional_layers(cfg):
        n_pairs = int(np.sum(L.rope_freq_factors == 1.0))
        i = np.arange(0, 2 * n_pairs, 2, dtype=np.float64)
        inv = np.zeros(L.n_rot // 2)
        inv[:n_pairs] = L.rope_base ** (-i / (2 * n_pairs)) * L.rope_scale
        _set_inv_freq(fm, L.index, inv)
    return fm


def _rope_factors_fp16(cfg: ModelConfig, W) -> FastModel:
    """Frequency factors rounded to float16: 1.0 stays 1.0, 1e30 overflows to inf (inverse frequency 0)."""
    fm = MutantFastModel(cfg, W)
    for L in cfg.layers:
        if L.rope_freq_factors is None:
            continue
        with np.errstate(over="ignore"):
            f16 = L.rope_freq_factors.astype(np.float16).astype(np.float64)
        i = np.arange(0, L.n_rot, 2, dtype=np.float64)
        inv = L.rope_base ** (-i / L.n_rot) * L.rope_scale / f16
        _set_inv_freq(fm, L.index, inv)
    return fm


# --------------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Mutant:
    """One fault class.

    Attributes:
        name: short id.
        fault: what the mutant computes differently, one sentence.
        exercised_by: which cases can show it, one phrase.
        applies: config -> whether this case exercises the fault.
        expected: config -> the (point, layer) where the fault must first show.
        make: (config, weights) -> the mutant model.
        equivalent: for an excluded, mathematically equivalent mutant: why it cannot change the output
            (the selftest checks that it stays within the gates); None for a real mutant.
    """

    name: str
    fault: str
    exercised_by: str
    applies: Callable[[ModelConfig], bool]
    expected: Callable[[ModelConfig], tuple[str, int]] | None
    make: Callable[[ModelConfig, Any], FastModel]
    equivalent: str | None = None


def _first_sliding(cfg: ModelConfig) -> int:
    return next(L.index for L in cfg.layers if L.is_sliding)


def _first_moe(cfg: ModelConfig) -> int:
    return next(L.index for L in cfg.layers if L.has_moe)


def _has_moe(cfg: ModelConfig) -> bool:
    return any(L.has_moe for L in cfg.layers)


MUTANTS: tuple[Mutant, ...] = (
    Mutant("attn_scale", "attention scores scaled by 1/sqrt(head_dim) instead of Gemma 4's 1.0",
           "every case", lambda c: True, lambda c: ("attn_out", 0), _plain("attn_scale")),
    Mutant("v_norm_dropped", "no weightless RMSNorm on V", "every case", lambda c: c.has_v_norm,
           lambda c: ("attn_out", 0), _with_cfg(has_v_norm=False)),
    Mutant("kv_donor_first", "a KV-shared layer reads the first non-shared layer of its type instead of the "
           "last (transformers' rule)", "KV-shared cases whose type has 2+ non-shared layers (e2b, e4b, e4b-wide)",
           lambda c: bool(_donor_changed(c)), lambda c: ("attn_out", _donor_changed(c)[0]), _wrong_donor),
    Mutant("rope_exponent_rotated", "proportional RoPE with exponents over the rotated dims "
           "(base^(-2i/n_rot_eff)) instead of the full head_dim", "every case (full layers, partial rotary 0.25)",
           lambda c: bool(_proportional_layers(c)), lambda c: ("attn_out", _proportional_layers(c)[0].index),
           _rope_exponent_rotated),
    Mutant("experts_swiglu", "experts gate with SiLU (SwiGLU) instead of GELU-tanh", "MoE (26b-a4b)",
           _has_moe, lambda c: ("ffn_moe", _first_moe(c)), _plain("experts_swiglu")),
    Mutant("softcap_dropped", "final logit softcap not applied", "cases with a softcap (all but edge-no-softcap)",
           lambda c: c.final_logit_softcap is not None, lambda c: ("result_output", -1),
           _with_cfg(final_logit_softcap=None)),
    Mutant("norm_plus_one", "every RMSNorm weight used as 1 + w (the Gemma 3 convention)", "every case",
           lambda c: True, lambda c: ("inp_per_layer", -1) if c.ple_dim else ("attn_out", 0), _norms_plus_one),
    Mutant("router_prenormed", "router fed rms_norm(a) * ffn_norm (the dense MLP's pre-FFN-normed input) "
           "instead of the residual a", "MoE (26b-a4b)", _has_moe, lambda c: ("ffn_moe", _first_moe(c)),
           _plain("router_prenormed")),
    Mutant("ple_token_unscaled", "PLE token part not scaled by sqrt(P)", "PLE (e2b, e4b, e4b-wide, edge-keqv)",
           lambda c: bool(c.ple_dim), lambda c: ("inp_per_layer", -1), _plain("ple_token_unscaled")),
    Mutant("layer_scalar_branch", "layer scalar applied to the layer's residual branch only "
           "(x + s * (y - x)) instead of the whole stream (s * y)", "every case", lambda c: c.has_layer_scalar,
           lambda c: ("l_out", 0), _plain("layer_scalar_branch")),
    Mutant("window_off_by_one", "sliding layers attend window + 1 keys (pos_i - pos_j <= window)",
           "cases with sliding layers, prompts longer than the window", lambda c: any(L.is_sliding for L in c.layers),
           lambda c: ("attn_out", _first_sliding(c)), _window_plus_one),
)
"""The real mutants (each must be detected, first at ``expected``)."""

EQUIVALENT: tuple[Mutant, ...] = (
    Mutant("rope_factors_fp16", "RoPE frequency factors rounded to float16", "proportional-RoPE full layers",
           lambda c: bool(_proportional_layers(c)), None, _rope_factors_fp16,
           equivalent="Gemma 4's factor table holds only 1.0 (exact in fp16) and 1e30, which overflows fp16 to "
           "inf: the unrotated pairs' inverse frequency becomes 0 instead of ~1e-30 * base^(-2i/D). Their "
           "rotation angle pos * 1e-30 stays below 1e-24 rad at any position in the context, so cos is exactly 1 "
           "and x * sin is far below half an ulp of the other term in fp32 and fp64: no result changes. (Not "
           "equivalent for a table with finite factors that fp16 cannot hold exactly, e.g. llama3-style ones.)"),
    Mutant("ple_no_inv_sqrt2", "PLE inputs (context + token) not scaled by 1/sqrt(2)", "PLE cases",
           lambda c: bool(c.ple_dim), None, _plain("ple_no_inv_sqrt2"),
           equivalent="a uniform factor on the per-layer input enters the PLE branch multiplicatively "
           "(gelu(gate y) * ple), passes the linear projection and is removed by its post_norm RMSNorm; only "
           "the eps (1e-6 against a mean square of order 1) sees it. inp_per_layer itself changes by exactly "
           "sqrt(2) (cosine 1: a relative-L2 rule would flag the point, not the model)."),
    Mutant("router_rmsnormed", "router fed rms_norm(a) (no weight) instead of a", "MoE (26b-a4b)", _has_moe,
           None, _plain("router_rmsnormed"),
           equivalent="the router RMS-normalises its input first, and RMSNorm without weight is idempotent up "
           "to eps (a unit-RMS vector keeps RMS 1), so the scores and the top-k choice are unchanged."),
)
"""Mathematically equivalent mutants: excluded from detection, each with the reason (and checked)."""


# --------------------------------------------------------------------------- running


def fast_reference_rule(gates: dict | None = None) -> traces.DivergenceRule:
    """The fast~reference gates as a :class:`harness.traces.DivergenceRule`: per-point cosine and
    max |Δlogit| at ``result_output`` (defaults from :data:`harness.gates.DEFAULT_GATES`)."""
    from .gates import DEFAULT_GATES

    g = gates or DEFAULT_GATES
    return traces.DivergenceRule(tol=None, min_cosine=g["fast~reference.layer_cosine"].limit,
                                 max_abs={"result_output": g["fast~reference.max_abs_logit"].limit})


def trace_fast(fm: FastModel, ids: Sequence[int], case: str, engine: str) -> traces.Trace:
    """Trace one prompt through a fast model, keeping the tensors. Returns an in-memory trace."""
    w = traces.TraceWriter(engine, ids, case=case, dtype="float32", keep_tensors=True)
    fm.logits(ids, trace=w)
    return w.trace()


def trace_reference(cfg: ModelConfig, W, ids: Sequence[int], case: str) -> traces.Trace:
    """Trace one prompt through the float64 reference, keeping the tensors."""
    from reference import model as ref_model

    w = traces.TraceWriter("reference", ids, case=case, dtype="float64", keep_tensors=True)
    ref_model.forward(cfg, W, ids, trace=w)
    return w.trace()


def _run_one(tr: traces.Trace, ref: traces.Trace, rule: traces.DivergenceRule) -> dict[str, Any]:
    res = traces.compare(tr, ref, rule)
    f = res.first
    out_row = next((r for r in res.rows if r.point == "result_output"), None)
    cos = [r.cosine for r in res.rows if r.cosine is not None]
    return {"detected": f is not None, "first": None if f is None else f.where, "why": "" if f is None else f.why,
            "n_diverged": sum(r.diverged for r in res.rows), "n_points": len(res.rows),
            "min_cosine": min(cos) if cos else None,
            "max_abs_logit": None if out_row is None else out_row.max_abs}


def select_prompts(prompts: list[dict[str, Any]], ids: Sequence[str] | None, cfg: ModelConfig) -> list[dict[str, Any]]:
    """The prompts to use on one case: those named in ``ids`` (in that order), or by default every prompt
    longer than the case's sliding window (a window fault shows only there).

    Raises:
        InputError: an id that is not in the prompt set.
    """
    if ids:
        by_id = {str(p["id"]): p for p in prompts}
        missing = [i for i in ids if str(i) not in by_id]
        if missing:
            raise InputError(f"selftest: unknown prompt id {missing[0]!r} (known: {', '.join(by_id)})")
        return [by_id[str(i)] for i in ids]
    w = cfg.sliding_window or 1
    return [p for p in prompts if len(p["prompt_ids"]) > w]


def run_selftest(cases: Sequence[str] | None = None, prompt_ids: Sequence[str] | None = None,
                 out: str | None = None, quiet: bool = False, write: bool = True) -> tuple[dict[str, Any], int]:
    """Run every mutant on the built-in cases that exercise it; write the report.

    Args:
        cases: built-in case names (``cases/models/<name>.toml``); None = all.
        prompt_ids: prompt ids of ``cases/prompts/synthetic.jsonl``; None = per case, every prompt longer
            than its sliding window.
        out: parent folder of the run directory (default ``reports/``).
        quiet: no progress lines on stderr.
        write: write ``reports/<ts>-selftest/`` (``report.md``, ``results.json``).

    Returns:
        ``(results, status)``: status 0 when the controls pass, every mutant is detected with the
        expected first point on every case that exercises it, and every equivalent mutant stays within
        the gates; else 1.

    Raises:
        InputError: an unknown case name or prompt id.
    """
    from reference.weights import load_model

    from . import synth
    from .gates import resolve
    from .parity import load_prompts

    def progress(msg: str) -> None:
        if not quiet:
            print(f"g4h selftest: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    specs = synth.builtin_specs()
    if cases:
        known = {s.stem: s for s in specs}
        bad = [c for c in cases if c not in known]
        if bad:
            raise InputError(f"selftest: unknown case {bad[0]!r} (known: {', '.join(known)})")
        specs = [known[c] for c in cases]
    prompts = load_prompts()
    mut_runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in MUTANTS + EQUIVALENT}
    controls = []
    rules = {}
    for spec_path in specs:
        spec = synth.load_spec(spec_path)
        built = synth.ensure_built(spec_path)
        cfg, W = load_model(built.gguf["F32"])
        rule = fast_reference_rule(resolve(spec.gates, str(spec_path)))
        rules[spec.name] = rule.describe()
        use = select_prompts(prompts, prompt_ids, cfg)
        progress(f"[{spec.name}] reference traces on {len(use)} prompts")
        refs = {p["id"]: trace_reference(cfg, W, p["prompt_ids"], spec.name) for p in use}
        control = MutantFastModel(cfg, W)
        plain = FastModel(cfg, W, "cpu", "float32")
        ctl = {"case": spec.name, "runs": [], "copy_equal": True}
        for p in use:
            r = _run_one(trace_fast(control, p["prompt_ids"], spec.name, "fast-copy"), refs[p["id"]], rule)
            ctl["runs"].append({"prompt": p["id"], **r})
            a = control.logits(p["prompt_ids"]).numpy()
            b = plain.logits(p["prompt_ids"]).numpy()
            ctl["copy_equal"] = ctl["copy_equal"] and bool(np.array_equal(a, b))
        ctl["pass"] = ctl["copy_equal"] and not any(r["detected"] for r in ctl["runs"])
        controls.append(ctl)
        progress(f"[{spec.name}] control {'ok' if ctl['pass'] else 'FAILED'}; mutants")
        for m in MUTANTS + EQUIVALENT:
            if not m.applies(cfg):
                continue
            fm = m.make(cfg, W)
            exp = None if m.expected is None else "{}@{}".format(*m.expected(cfg))
            for p in use:
                r = _run_one(trace_fast(fm, p["prompt_ids"], spec.name, f"fast-mutant-{m.name}"), refs[p["id"]], rule)
                ok = (not r["detected"]) if m.equivalent else (r["detected"] and r["first"] == exp)
                if m.equivalent:  # how far from the unmutated copy (0 = bit-identical)
                    r["max_abs_logit_vs_control"] = float(np.max(np.abs(
                        fm.logits(p["prompt_ids"]).numpy() - control.logits(p["prompt_ids"]).numpy())))
                mut_runs[m.name].append({"case": spec.name, "prompt": p["id"], "tokens": len(p["prompt_ids"]),
                                         "expected": exp, "ok": ok, **r})
    mutants, excluded = [], []
    for m in MUTANTS + EQUIVALENT:
        runs = mut_runs[m.name]
        row = {"name": m.name, "fault": m.fault, "exercised_by": m.exercised_by,
               "cases": sorted({r["case"] for r in runs}), "runs": runs,
               "detected": bool(runs) and all(r["detected"] for r in runs),
               "first": _summarise(runs, "first"), "expected": _summarise(runs, "expected"),
               "pass": bool(runs) and all(r["ok"] for r in runs)}
        if not runs:
            row["note"] = "no selected case exercises this fault"
        if m.equivalent:
            row["why_equivalent"] = m.equivalent
            row["any_detected"] = any(r["detected"] for r in runs)
            row["max_abs_logit"] = max((r["max_abs_logit"] or 0.0 for r in runs), default=None)
            row["min_cosine"] = min((r["min_cosine"] for r in runs if r["min_cosine"] is not None), default=None)
            row["max_abs_logit_vs_control"] = max((r["max_abs_logit_vs_control"] for r in runs), default=None)
            row["pass"] = not row["any_detected"]  # the equivalence claim holds (no runs: nothing to refute)
            excluded.append(row)
        else:
            mutants.append(row)
    status = 0 if all(c["pass"] for c in controls) and all(m["pass"] for m in mutants) and \
        all(e["pass"] for e in excluded) else 1
    data = {"version": RESULTS_VERSION, "kind": "selftest",
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": time.perf_counter() - t0, "status": status, "rules": rules,
            "cases": [s.stem for s in specs], "prompt_filter": list(prompt_ids) if prompt_ids else None,
            "controls": controls, "mutants": mutants, "excluded": excluded}
    if write:
        from .report import new_run_dir, write_json_atomic, write_text_atomic

        run_dir = new_run_dir("selftest", out)
        write_json_atomic(run_dir / "results.json", data)
        write_text_atomic(run_dir / "report.md", render_report(data))
        data["run_dir"] = str(run_dir)
    return data, status


def _summarise(runs: list[dict[str, Any]], key: str) -> str:
    """``attn_out@0`` when every run agrees, else ``case: value; ...`` (one value per case)."""
    vals = {r[key] for r in runs}
    if len(vals) <= 1:
        return next(iter(vals), None) or "-"
    per_case: dict[str, set] = {}
    for r in runs:
        per_case.setdefault(r["case"], set()).add(r[key] or "-")
    return "; ".join(f"{c}: {'/'.join(sorted(v))}" for c, v in per_case.items())


def mutant_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the report table: mutant, cases, detected, first point, expected, result."""
    rows = []
    for m in data["mutants"]:
        rows.append({"mutant": m["name"], "cases": ", ".join(m["cases"]) or "(none)",
                     "detected": "yes" if m["detected"] else "NO", "first point": m["first"],
                     "expected": m["expected"], "result": "PASS" if m["pass"] else "FAIL"})
    return rows


def render_report(data: dict[str, Any]) -> str:
    """``report.md``: verdict, mutant table, controls, excluded equivalent mutants with reasons, per-run details."""
    from .report import markdown_table

    verdict = ("PASS: every mutant detected, first divergence named correctly" if data["status"] == 0 else
               "FAIL: a mutant escaped, was named wrongly, a control failed, or an equivalence claim was refuted")
    rule = next(iter(data["rules"].values()), "")
    lines = ["# Selftest (mutation testing of the harness)", "",
             f"**{verdict}** (created {data['created_utc']}; cases {', '.join(data['cases'])})", "",
             f"Each mutant is one fault injected into a copy of the fast path (fp32, CPU); its traces are compared "
             f"with the float64 reference's under the fast~reference gates ({rule}). *first point* is the first "
             f"(point, layer) in trace order that breaks a gate.", "",
             markdown_table(mutant_table(data), ["mutant", "cases", "detected", "first point", "expected", "result"]),
             "", "## Faults", ""]
    lines += [f"- **{m['name']}**: {m['fault']} (exercised by {m['exercised_by']})" for m in data["mutants"]]
    lines += ["", "## Controls (the unmutated copy)", ""]
    rows = [{"case": c["case"], "bit-equal to FastModel": c["copy_equal"],
             "min cosine": min((r["min_cosine"] for r in c["runs"] if r["min_cosine"] is not None), default=None),
             "max |Δlogit|": max((r["max_abs_logit"] or 0.0 for r in c["runs"]), default=None),
             "result": "PASS" if c["pass"] else "FAIL"} for c in data["controls"]]
    lines += [markdown_table(rows, ["case", "bit-equal to FastModel", "min cosine", "max |Δlogit|", "result"]), ""]
    lines += ["## Excluded: mathematically equivalent mutants", "",
              "Run anyway; each must stay within the gates (else the equivalence claim is wrong and the selftest "
              "fails).", ""]
    rows = [{"mutant": e["name"], "cases": ", ".join(e["cases"]) or "(none)",
             "min cosine": e.get("min_cosine"), "max |Δlogit| vs reference": e.get("max_abs_logit"),
             "max |Δlogit| vs unmutated copy": e.get("max_abs_logit_vs_control"),
             "claim holds": "yes" if e["pass"] else "NO"} for e in data["excluded"]]
    lines += [markdown_table(rows, ["mutant", "cases", "min cosine", "max |Δlogit| vs reference",
                                    "max |Δlogit| vs unmutated copy", "claim holds"]), ""]
    lines += [f"- **{e['name']}** ({e['fault']}): {e['why_equivalent']}" for e in data["excluded"]]
    lines += ["", "## Runs", ""]
    rows = []
    for m in data["mutants"] + data["excluded"]:
        for r in m["runs"]:
            rows.append({"mutant": m["name"], "case": r["case"], "prompt": r["prompt"], "first": r["first"] or "-",
                         "expected": r["expected"] or "(none: equivalent)", "diverged": f"{r['n_diverged']}/{r['n_points']}",
                         "why": r["why"], "ok": "yes" if r["ok"] else "NO"})
    lines += [markdown_table(rows, ["mutant", "case", "prompt", "first", "expected", "diverged", "why", "ok"]), ""]
    return "\n".join(lines)


def selftest_command(cases: Sequence[str] | None, prompt_ids: Sequence[str] | None, out: str | None,
                     quiet: bool) -> int:
    """``g4h selftest``: run, print the mutant table and the report path; return the exit status."""
    from .report import markdown_table

    data, status = run_selftest(cases, prompt_ids, out, quiet)
    print(markdown_table(mutant_table(data), ["mutant", "cases", "detected", "first point", "expected", "result"]))
    bad_eq = [e["name"] for e in data["excluded"] if not e["pass"]]
    bad_ctl = [c["case"] for c in data["controls"] if not c["pass"]]
    if bad_eq:
        print(f"equivalence claims refuted: {', '.join(bad_eq)}")
    if bad_ctl:
        print(f"controls failed: {', '.join(bad_ctl)}")
    print(f"\nreport: {data['run_dir']}/report.md  (exit {status})")
    return status
