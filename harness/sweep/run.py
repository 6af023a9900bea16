"""The sweep on Ray: a base per group, then one task per (file, engine), each where its memory fits.

:func:`run_sweep` is ``g4h sweep``. Per group of files (:mod:`.files`), in Ray:

1. the *base* task: the float64 reference on the group's base file (:func:`.tasks.base_run`); its result is put
   in Ray's object store once and every other task of the group reads it from there (a node fetches it once);
2. the *sensitivity* task: the group's 8-bit yardstick (:func:`.tasks.sensitivity_run`), for the cross-engine gate;
3. one *row* task per (file, engine) (:func:`.tasks.engine_run`), declaring ``--cpus-per-task`` CPUs and the
   memory its engine's memory plan needs (:func:`harness.core.memory.plan`), scheduled ``SPREAD`` over the nodes.

A task that dies becomes a row with its reason (:func:`dead_row`): Ray's memory monitor killing it, its worker
dying (an abort in native code, a kill), its node dying, ``--task-timeout`` (the task is cancelled); the sweep goes
on. Rows are appended to the run directory as they arrive (:mod:`.store`): ``--resume DIR`` runs only what is
missing. When every engine of a file is done, their logits are compared (:func:`.judge.agreement`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..core import cluster  # first: it sets Ray's loopback switch before it imports Ray (cluster.LOOPBACK_SWITCH)

import ray  # after the cluster plumbing (above), not in isort's order
from ray import exceptions as rex

from gemma4_harness.reference.errors import InputError

from ..core.cases import PROMPTS
from ..core.engine_kinds import KIND, ORACLE, TWIN, default_against, planned_kinds
from ..core.memory import GB, plan
from ..core.paths import default_reports_dir
from ..core.prompts import load_prompts
from ..engines import check_engine_name, engine_kind
from ..engines.base import TOP_N
from . import judge, tasks
from . import prompts as prompt_sets
from .files import Group, SweepFile, describe, find_models, group_files
from .progress import Progress
from .report import write_outputs
from .store import RunDir, key_of, new_run_dir

DEFAULT_ENGINES = default_against("gguf")
"""Engines swept when ``--against`` is not given: a GGUF's default engines (the registry rows' ``default_for``:
fast, llamacpp)."""


@dataclass
class SweepOptions:
    """What ``g4h sweep`` was asked (the plan; ``address``/``local_nodes``/``cpus``/``object_store_gb``/``quiet``/
    ``retry_failed``/``task_timeout`` say how to run it and may change on ``--resume``)."""

    against: list[str] = field(default_factory=lambda: list(DEFAULT_ENGINES))
    prompts: str = str(PROMPTS)
    base: str | None = None
    new_tokens: int = 8
    top_n: int = TOP_N
    cpus_per_task: int = 1
    engine_options: dict[str, Any] = field(default_factory=dict)
    task_timeout: float | None = 7200.0
    address: str | None = None
    local_nodes: int = 1
    cpus: int | None = None
    object_store_gb: float | None = None
    retry_failed: bool = False
    quiet: bool = False

    PLANNED = ("against", "prompts", "base", "new_tokens", "top_n", "cpus_per_task", "engine_options")


@dataclass
class _Task:
    kind: str  # base | sensitivity | row
    key: str
    group: Group
    file: SweepFile | None = None
    engine: str | None = None
    cpus: int = 1
    memory: int | None = None
    ref: Any = None
    logits_ref: Any = None
    seen_start: float | None = None
    node: str | None = None
    timed_out: bool = False


@ray.remote(num_cpus=0)
class _Tracker:
    """Which task started where and when (a task tells it first thing): the driver's view of running tasks."""

    def __init__(self) -> None:
        self.started: dict[str, str] = {}

    def start(self, key: str, node: str) -> None:
        self.started[key] = node

    def snapshot(self) -> dict[str, str]:
        return dict(self.started)


def _started(tracker: Any, key: str) -> None:
    tracker.start.remote(key, ray.get_runtime_context().get_node_id())


@ray.remote(max_retries=0)
def _base_task(tracker, key, path, prompts, new_tokens, top_n, threads, options, emulations):
    _started(tracker, key)
    return tasks.base_run(path, prompts, new_tokens, top_n, threads, options=options, emulations=emulations)


@ray.remote(max_retries=0)
def _sensitivity_task(tracker, key, path, prompts, base, threads):
    _started(tracker, key)
    return tasks.sensitivity_run(path, prompts, base, threads)


@ray.remote(max_retries=0, num_returns=2)
def _row_task(tracker, key, path, engine, prompts, base, new_tokens, top_n, threads, options):
    _started(tracker, key)
    return tasks.engine_run(path, engine, prompts, base, new_tokens, top_n, threads, options)


# --------------------------------------------------------------------------- dead tasks


def dead_row(e: BaseException, timed_out: bool, timeout: float | None) -> tuple[str, str]:
    """``(status, reason)`` of a task that did not return (see :mod:`.judge`)."""
    first = _first_line(e)
    if isinstance(e, rex.TaskCancelledError):
        if timed_out:
            return "timeout", f"ran past --task-timeout {timeout:g} s: cancelled (its worker killed)"
        return "error", "cancelled"
    if isinstance(e, rex.OutOfMemoryError):
        return "oom", f"killed by Ray's memory monitor (the node ran short of memory): {first}"
    if isinstance(e, rex.WorkerCrashedError):
        return "crashed", f"the Ray worker running it died (killed, or an abort in native code): {first}"
    if isinstance(e, (rex.NodeDiedError, rex.LocalRayletDiedError, rex.ObjectLostError, rex.OwnerDiedError)):
        return "crashed", f"its node died: {first}"
    if isinstance(e, rex.RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return "error", f"{type(cause).__name__}: {_first_line(cause)}"
    return "error", f"{type(e).__name__}: {first}"


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("Traceback")]
    return (lines[0] if lines else type(e).__name__)[:300]


# --------------------------------------------------------------------------- planning


def _threads(opts: SweepOptions, alive: Sequence[cluster.Node]) -> int:
    most = max((int(n.cpus) for n in alive), default=1)
    return max(1, min(int(opts.cpus_per_task), most))


def _memory_need(engine: str, f: SweepFile, gp: list[dict[str, Any]], opts: SweepOptions) -> int | None:
    """Bytes the engine's memory plan needs for this file and prompt set (None for an engine without a plan)."""
    kind = engine_kind(engine)
    if f.facts is None or kind not in planned_kinds():
        return None
    o: dict[str, Any] = {"tokens": max(len(p["prompt_ids"]) for p in gp), "new_tokens": opts.new_tokens,
                         "fresh": True}
    o.update({k: opts.engine_options[k] for k in ("dtype", "weights")
              if k in KIND[kind].options and opts.engine_options.get(k)})  # the settings its row takes
    return plan(kind, f.facts, **o).need_bytes


def _row_memory(engine: str, f: SweepFile, gp: list[dict[str, Any]], opts: SweepOptions) -> int | None:
    """Bytes a row task needs: the engine's plan and the float64 reference's on the same file, which its parity pair
    runs in the same process (:func:`.tasks.pair_figures`); None when the engine has no plan."""
    need = _memory_need(engine, f, gp, opts)
    ref = _memory_need(ORACLE, f, gp, opts)
    return None if need is None else need + (ref or 0)


def _row_base(f: SweepFile, engine: str, group: Group | None) -> dict[str, Any]:
    return {"kind": "row", "group": group.name if group else None, "file": f.path, "file_key": f.key,
            "label": f.label, "file_type": f.file_type, "bpw": f.bpw, "size": f.size, "engine": engine,
            "engine_kind": engine_kind(engine), "problems": [p["code"] for p in f.problems],
            "is_base": bool(group and group.base.path == f.path)}


def _pre_row(f: SweepFile, engine: str, group: Group | None) -> dict[str, Any] | None:
    """The row of a (file, engine) that needs no task: an unusable file, or a limit ``g4h inspect`` declares."""
    kind = engine_kind(engine)
    bad = f.unusable
    if bad is not None:
        return {**_row_base(f, engine, group), "status": "bad_input", "reason": f"{bad['code']}: {bad['message']}"}
    row = f.engines.get(kind)
    if row is not None and not row["can_run"]:
        return {**_row_base(f, engine, group), "status": "not_run", "reason": row["reason"], "declared": True}
    return None


# --------------------------------------------------------------------------- the sweep


class _Sweep:
    """One run: the plan, the run directory, the tasks in flight, the records."""

    def __init__(self, rd: RunDir, opts: SweepOptions, groups: list[Group], bad: list[SweepFile],
                 gprompts: dict[str, list[dict[str, Any]]], progress: Progress) -> None:
        self.rd, self.opts, self.groups, self.bad = rd, opts, groups, bad
        self.gprompts = gprompts
        self.progress = progress
        self.records = rd.records()
        self.tasks: dict[str, _Task] = {}
        self.base_refs: dict[str, Any] = {}
        # the emulations each group's base is computed under (the declared numerics of the engines' kinds)
        self.emulations = {g.name: tasks.predicted_emulations(opts.against, g.base.types) for g in groups}
        self.base_keys = {g.name: key_of("base", g.base.key, prompt_sets.digest(gprompts[g.name]), opts.new_tokens,
                                         opts.top_n, *([[list(k) for k in self.emulations[g.name]]]
                                                       if self.emulations[g.name] else []))
                          for g in groups}
        self.effects: dict[str, dict[str, dict[str, float]]] = {}
        self.sens: dict[str, float | None] = {}
        self.logits_refs: dict[str, Any] = {}

    def row_key(self, g: Group, f: SweepFile, engine: str) -> str:
        return key_of("row", f.key, engine, self.opts.engine_options, self.base_keys[g.name])

    def done(self, key: str) -> bool:
        rec = self.records.get(key)
        if rec is None:
            return False
        if rec["kind"] == "row" and rec["status"] == "ok" and "checks" not in rec:
            return False  # a row of an earlier sweep, measured before the parity pair: its pair's figures are missing
        return not (self.opts.retry_failed and rec["kind"] == "row" and judge.failed(rec))

    def record(self, rec: dict[str, Any]) -> None:
        self.records[rec["key"]] = rec
        self.rd.append(rec)

    # ------------------------------------------------------------------ submission

    def submit_all(self, alive: Sequence[cluster.Node], tracker: Any) -> None:
        threads = _threads(self.opts, alive)
        most_mem = max((n.memory for n in alive), default=0)
        for f in self.bad:
            for e in self.opts.against:
                self.record({**_pre_row(f, e, None), "key": key_of("row", f.key, e)})
        for g in self.groups:
            gp = self.gprompts[g.name]
            bkey = self.base_keys[g.name]
            base = self.rd.load_base(bkey)
            if base is not None:
                self.base_refs[g.name] = ray.put(base)
                self.effects[g.name] = base.get("effects") or {}
            else:
                t = _Task("base", bkey, g, g.base, ORACLE, threads,
                          _memory_need(ORACLE, g.base, gp, self.opts))
                if t.memory and t.memory > most_mem:
                    self._base_failed(g, "oom", _no_node(t.memory, most_mem, ORACLE))
                    continue
                t.ref = _base_task.options(num_cpus=threads, memory=t.memory or None).remote(
                    tracker, bkey, g.base.path, gp, self.opts.new_tokens, self.opts.top_n, threads, {},
                    self.emulations[g.name])
                self.tasks[bkey] = t
                self.base_refs[g.name] = t.ref
            skey = key_of("sensitivity", bkey)
            if skey in self.records and self.records[skey]["status"] == "ok":
                self.sens[g.name] = self.records[skey]["mean_kld"]
            elif len(self.opts.against) > 1 or (set(g.base.types) - judge.EXACT_TYPES and any(
                    engine_kind(e) in judge.QUANTIZED_ACTIVATION_KINDS for e in self.opts.against)):
                t = _Task("sensitivity", skey, g, g.base, TWIN, threads, _memory_need(TWIN, g.base, gp, self.opts))
                if not (t.memory and t.memory > most_mem):
                    t.ref = _sensitivity_task.options(num_cpus=threads, memory=t.memory or None).remote(
                        tracker, skey, g.base.path, gp, self.base_refs[g.name], threads)
                    self.tasks[skey] = t
            for f in g.files:
                redo = self._lost_logits(g, f)
                for e in self.opts.against:
                    self._submit_row(g, f, e, threads, most_mem, tracker, redo)

    def _lost_logits(self, g: Group, f: SweepFile) -> set[str]:
        """Rows of ``f`` to run again: every engine ran (an earlier run) but the file's cross-engine figures are
        missing and some engine's logits were not kept (the command was killed between the rows and the comparison):
        the rows without kept logits."""
        keys = [self.row_key(g, f, e) for e in self.opts.against]
        ok = [k for k in keys if k in self.records and self.records[k]["status"] == "ok"]
        pairs = [key_of("agreement", a, b) for i, a in enumerate(ok) for b in ok[i + 1:]]
        if len(ok) < 2 or all(p in self.records for p in pairs):
            return set()
        return {k for k in ok if not self.rd.pending_file(k).is_file()}

    def _submit_row(self, g: Group, f: SweepFile, engine: str, threads: int, most_mem: float, tracker: Any,
                    redo: set[str] = frozenset()) -> None:
        key = self.row_key(g, f, engine)
        if self.done(key) and key not in redo:
            return
        pre = _pre_row(f, engine, g)
        if pre is not None:
            self.record({**pre, "key": key})
            return
        gp = self.gprompts[g.name]
        t = _Task("row", key, g, f, engine, threads, _row_memory(engine, f, gp, self.opts))
        if t.memory and t.memory > most_mem:
            self.record({**_row_base(f, engine, g), "key": key, "status": "oom",
                         "reason": _no_node(t.memory, most_mem, f"{engine}'s memory plan and the reference", "'s"),
                         "cpus": threads, "memory_gb": t.memory / GB})
            return
        t.ref, t.logits_ref = _row_task.options(num_cpus=threads, memory=t.memory or None,
                                                scheduling_strategy="SPREAD").remote(
            tracker, key, f.path, engine, gp, self.base_refs[g.name], self.opts.new_tokens, self.opts.top_n, threads,
            self.opts.engine_options)
        self.tasks[key] = t

    def _base_failed(self, g: Group, status: str, reason: str) -> None:
        """Every row of ``g`` without a record becomes ``no_base`` (the sweep goes on with the other groups)."""
        why = f"the base (float64 reference on {Path(g.base.path).name}) failed: {status}: {reason}"
        for f in g.files:
            for e in self.opts.against:
                key = self.row_key(g, f, e)
                if self.done(key):
                    continue
                t = self.tasks.pop(key, None)
                if t is not None and t.ref is not None:
                    ray.cancel(t.ref, force=True)
                pre = _pre_row(f, e, g)
                self.record({**(pre or {**_row_base(f, e, g), "status": "no_base", "reason": why}), "key": key})
        for key in [k for k, t in self.tasks.items() if t.group is g and t.kind == "sensitivity"]:
            ray.cancel(self.tasks.pop(key).ref, force=True)

    # ------------------------------------------------------------------ results

    def finish(self, t: _Task) -> None:
        """Handle a task whose first result is ready."""
        self.tasks.pop(t.key, None)
        try:
            value = ray.get(t.ref)
            error = None
        except Exception as e:  # a dead task: its reason
            value, error = None, e
        if t.kind == "base":
            if error is not None:
                status, reason = dead_row(error, t.timed_out, self.opts.task_timeout)
                self._base_failed(t.group, status, reason)
            else:
                self.rd.save_base(t.key, value)
                self.effects[t.group.name] = value.get("effects") or {}
            return
        if t.kind == "sensitivity":
            rec = value if error is None else dict(zip(("status", "reason"),
                                                       dead_row(error, t.timed_out, self.opts.task_timeout)))
            self.record({"kind": "sensitivity", "key": t.key, "group": t.group.name, **rec})
            self.sens[t.group.name] = rec.get("mean_kld") if rec.get("status") == "ok" else None
            self._agreements(t.group)
            return
        if error is not None:
            status, reason = dead_row(error, t.timed_out, self.opts.task_timeout)
            if _base_missing(error):
                return  # the base task's own failure writes this row
            row = {"status": status, "reason": reason, "where": {"node": t.node}}
        else:
            row, _ = value, None
        rec = {**_row_base(t.file, t.engine, t.group), **row, "key": t.key, "cpus": t.cpus,
               "memory_gb": None if t.memory is None else round(t.memory / GB, 3)}
        where = rec.pop("where", None) or {}
        rec["node"] = (where.get("node") or t.node or "")[:8] or None
        rec["host"] = where.get("host")
        if rec["status"] == "ok":
            self.logits_refs[t.key] = t.logits_ref
        self.record(rec)
        self._agreements(t.group, t.file)

    def _agreements(self, g: Group, only: SweepFile | None = None) -> None:
        """Cross-engine figures of each file of ``g`` whose engines are all done (and the yardstick, when needed)."""
        if len(self.opts.against) < 2:
            return
        skey = key_of("sensitivity", self.base_keys[g.name])
        for f in [only] if only is not None else g.files:
            keys = [self.row_key(g, f, e) for e in self.opts.against]
            if not all(k in self.records and k not in self.tasks for k in keys):
                continue
            ok = [self.records[k] for k in keys if self.records[k]["status"] == "ok"]
            if len(ok) < 2:
                self._drop_pending(keys)
                continue
            needs_yardstick = any(judge.rounds_activations(r) for r in ok) and set(f.types) - judge.EXACT_TYPES
            if needs_yardstick and skey in self.tasks:
                for k in keys:  # the yardstick is still running: keep the logits until it is in
                    self._keep(k)
                continue
            logits = {}
            for k in (r["key"] for r in ok):
                logits[k] = self._logits(k)
            for i, a in enumerate(ok):
                for b in ok[i + 1:]:
                    akey = key_of("agreement", a["key"], b["key"])
                    if akey in self.records:
                        continue
                    la, lb = logits[a["key"]], logits[b["key"]]
                    if la is None or lb is None:
                        continue
                    fig = judge.agreement(a, b, la, lb, self.gprompts[g.name], f.types, self.sens.get(g.name),
                                          self.effects.get(g.name))
                    self.record({"kind": "agreement", "key": akey, "group": g.name, "file": f.path,
                                 "label": f.label, "bpw": f.bpw, **fig})
            self._drop_pending(keys)

    def _keep(self, key: str) -> None:
        ref = self.logits_refs.get(key)
        if ref is not None and not self.rd.pending_file(key).is_file():
            self.rd.save_logits(key, ray.get(ref))

    def _logits(self, key: str) -> dict | None:
        ref = self.logits_refs.get(key)
        if ref is not None:
            try:
                return ray.get(ref)
            except Exception:  # lost with a node: the kept copy, if any
                pass
        return self.rd.load_logits(key)

    def _drop_pending(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.logits_refs.pop(k, None)
            self.rd.drop_logits(k)

    def current(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """The records of this plan (a resumed sweep's run directory may hold others): rows, agreements, and each
        group's yardstick."""
        keys = [key_of("row", f.key, e) for f in self.bad for e in self.opts.against]
        keys += [self.row_key(g, f, e) for g in self.groups for f in g.files for e in self.opts.against]
        rows = [self.records[k] for k in keys if k in self.records]
        base_types = {g.name: g.base.types for g in self.groups}
        for r in rows:  # an earlier sweep's row (no parity pair) on its base file, judged as it was: against the base
            if r.get("is_base") and r.get("group") in base_types and "checks" not in r:
                y = self.records.get(key_of("sensitivity", self.base_keys[r["group"]])) or {}
                r["against_base"] = judge.base_verdict(r, base_types[r["group"]],
                                                       y.get("mean_kld") if y.get("status") == "ok" else None,
                                                       self.effects.get(r["group"]))
        ok = [r["key"] for r in rows if r["status"] == "ok"]
        pairs = {key_of("agreement", a, b) for i, a in enumerate(ok) for b in ok[i + 1:]}
        pairs |= {key_of("agreement", b, a) for i, a in enumerate(ok) for b in ok[i + 1:]}
        agreements = [r for k, r in self.records.items() if r["kind"] == "agreement" and k in pairs]
        sens = {g.name: self.records[key_of("sensitivity", self.base_keys[g.name])] for g in self.groups
                if key_of("sensitivity", self.base_keys[g.name]) in self.records}
        return rows, agreements, sens

    # ------------------------------------------------------------------ the loop

    def wait(self, tracker: Any) -> None:
        """Until every task is in: results as they come, timeouts, progress."""
        last_poll = 0.0
        while self.tasks:
            refs = [t.ref for t in self.tasks.values()]
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            by_ref = {t.ref: t for t in self.tasks.values()}
            for r in ready:
                t = by_ref.get(r)
                if t is not None:
                    self.finish(t)
                    for rec in self._new_records():
                        self.progress.row(rec)
            now = time.monotonic()
            if now - last_poll > 1.0:
                last_poll = now
                self._poll(tracker, now)

    _seen = 0

    def _new_records(self) -> list[dict[str, Any]]:
        recs = list(self.records.values())
        out, self._seen = recs[self._seen:], len(recs)
        return out

    def _poll(self, tracker: Any, now: float) -> None:
        try:
            started = ray.get(tracker.snapshot.remote(), timeout=5)
        except Exception:  # a busy actor: next time
            return
        for key, t in list(self.tasks.items()):
            if key in started and t.seen_start is None:
                t.seen_start, t.node = now, started[key]
            limit = self.opts.task_timeout
            if limit and t.seen_start is not None and not t.timed_out and now - t.seen_start > limit:
                t.timed_out = True
                ray.cancel(t.ref, force=True)
        self.progress.tick([(t.kind, t.file.label if t.file else "", t.engine, t.node, t.seen_start is not None)
                            for t in self.tasks.values()])


def _base_missing(e: BaseException) -> bool:
    """Whether a row task failed only because its base task did (the error is the base's, passed on by Ray)."""
    return isinstance(e, rex.RayTaskError) and "_base_task" in str(getattr(e, "function_name", "") or "")


def _no_node(need: int, most: float, engine: str, plan_of: str = "'s memory plan") -> str:
    return (f"needs {need / GB:.2f} GB ({engine}{plan_of}), more than any node offers (largest: {most / GB:.2f} "
            f"GB of Ray memory resource)")


def _check_nodes(facts: dict[str, dict[str, Any]], alive: Sequence[cluster.Node]) -> None:
    bad = [(n, facts[n.node_id]) for n in alive if "error" in facts.get(n.node_id, {"error": "no answer"})]
    if bad:
        n, f = bad[0]
        raise cluster.ClusterError(f"Ray node {n.short} ({n.host}): cannot run the harness's tasks ({f['error']}); "
                                   "every node needs gemma4-harness installed (pip install 'gemma4-harness[sweep]') "
                                   "and the model files at the same paths")


def plan_sweep(models: Sequence[str], opts: SweepOptions, say: Callable[[str], None]
               ) -> tuple[list[Group], list[SweepFile], dict[str, list[dict[str, Any]]], list[str]]:
    """Find, inspect and group the files; the prompts of each group. Returns ``(groups, unusable, prompts by group,
    skipped notes)``.

    Raises:
        InputError: nothing usable named, an unknown engine, a prompt file that cannot be used.
    """
    for e in opts.against:
        check_engine_name(e)
    paths = find_models(models)
    say(f"inspecting {len(paths)} model(s)")
    files, skipped = [], []
    for p in paths:
        f = describe(p)
        if f is None:
            skipped.append(f"{p}: an mmproj (general.architecture = clip), not a decoder: left out")
        else:
            files.append(f)
    if not files:
        raise InputError("no decoder among the models named (only mmproj files?)")
    groups, bad = group_files(files, opts.base)
    raw = load_prompts(opts.prompts)
    gp = {g.name: prompt_sets.for_model(raw, g.base.path, g.base.vocab, g.base.context, opts.new_tokens, opts.prompts)
          for g in groups}
    return groups, bad, gp, skipped


_PLANNED_TYPES = {"against": "a list of engine names", "prompts": "a path", "base": "a path or null",
                  "new_tokens": "an integer >= 0", "top_n": "an integer >= 0", "cpus_per_task": "an integer >= 1",
                  "engine_options": "an object"}


def _planned_options(options: dict[str, Any], resume: str | Path) -> dict[str, Any]:
    """The plan's options of a resumed sweep, each checked like an argument (a shared or crafted plan.json).

    Raises:
        InputError: one line naming the key and what it must be."""
    out: dict[str, Any] = {}
    for k in SweepOptions.PLANNED:
        if k not in options:
            continue
        v = options[k]
        if k == "against":
            ok = isinstance(v, list) and bool(v) and all(isinstance(e, str) for e in v)
        elif k == "prompts":
            ok = isinstance(v, str)
        elif k == "base":
            ok = v is None or isinstance(v, str)
        elif k == "engine_options":
            ok = isinstance(v, dict)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= (1 if k == "cpus_per_task" else 0)
        if not ok:
            raise InputError(f"--resume {resume}: plan.json key 'options.{k}': expected {_PLANNED_TYPES[k]}")
        out[k] = v
    return out


def run_sweep(models: Sequence[str] | None, opts: SweepOptions, out: str | Path | None = None,
              resume: str | Path | None = None) -> tuple[dict[str, Any], int]:
    """``g4h sweep`` (see the module docstring).

    Args:
        models: files, folders, globs (None with ``resume``: the plan's).
        opts: the options.
        out: the parent of the run directory (default ``reports/``).
        resume: an earlier run directory to continue.

    Returns:
        ``(results, exit status)``: 0 every row ran and every pair of engines agrees, 1 a row failed or a pair
        disagrees, 2 an unusable file.

    Raises:
        InputError: bad input before anything runs (one line); :class:`.cluster.ClusterError` when no cluster can be
        started or reached.
    """
    progress = Progress(quiet=opts.quiet)
    if resume is not None:
        rd, planned = RunDir.resume(resume)
        models = planned["models"]
        opts = replace(opts, **_planned_options(planned["options"], resume))
    else:
        if not models:
            raise InputError("g4h sweep: name the model files (GGUFs, folders, globs), or --resume DIR")
        rd = None
    groups, bad, gp, skipped = plan_sweep(models, opts, progress.say)
    if rd is None:
        rd = RunDir(new_run_dir(out or default_reports_dir()))
        rd.write_plan({"models": [str(m) for m in models],
                       "options": {k: getattr(opts, k) for k in SweepOptions.PLANNED}})
    progress.say(f"run directory {rd.path}")
    t0 = time.perf_counter()
    local = None if opts.address else cluster.LocalCluster(
        nodes=opts.local_nodes, cpus=opts.cpus,
        object_store_bytes=int(opts.object_store_gb * GB) if opts.object_store_gb else None)
    sweep = _Sweep(rd, opts, groups, bad, gp, progress)
    interrupted = False
    alive: list[cluster.Node] = []
    timing: dict[str, float] = {}
    with (local if local is not None else contextlib.nullcontext()):
        address = local.address if local is not None else opts.address
        if local is not None:
            progress.say(f"local Ray cluster: {opts.local_nodes} node(s) at {address}")
        cluster.connect(address)
        try:
            alive = cluster.nodes()
            _check_nodes(cluster.probe(alive), alive)
            timing["cluster_s"] = round(time.perf_counter() - t0, 1)
            progress.nodes(alive)
            tracker = _Tracker.remote()
            before = sum(1 for r in sweep.records.values() if r["kind"] == "row")
            sweep.submit_all(alive, tracker)
            progress.start(len(sweep.tasks), before)
            t1 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):  # Ray prints a dead worker's notice on stdout
                    sweep.wait(tracker)
            except KeyboardInterrupt:
                interrupted = True
                for t in list(sweep.tasks.values()):
                    ray.cancel(t.ref, force=True)
                for key in list(sweep.logits_refs):
                    sweep._keep(key)
            timing["tasks_s"] = round(time.perf_counter() - t1, 1)
        finally:
            progress.stop()
            cluster.disconnect()
    timing["wall_s"] = round(time.perf_counter() - t0, 1)
    rows, agreements, sens = sweep.current()
    data = write_outputs(rd, groups, bad, gp, rows, agreements, sens, opts, alive, timing, skipped, interrupted)
    if interrupted:
        raise KeyboardInterrupt
    return data, data["exit_status"]
