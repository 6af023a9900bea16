"""``g4h parity --address HOST:PORT`` (or ``RAY_ADDRESS``): the float64 reference's pass work on a Ray cluster.

What :meth:`.checks.reference_runs.ReferenceRuns.prefetch` asks of the reference
(:func:`.checks.oracle_pass.reference_pass`: every prompt's forwards under every approximation set, the greedy streams,
the cached-vs-uncached chains) is split into one group of prompts per alive node (contiguous, in the prompt set's order:
:func:`groups`), and each group is one Ray task on its node (:func:`_group_pass`) that loads the reference from the
model's path (the same path on every node: a node without the file is bad input naming the node and the path) and runs
the same passes on its prompts, on as many BLAS threads as this process's reference would use (:func:`blas_threads`: the
last bits of a float64 product depend on how many threads split it). A prompt's figures do not depend on which prompts
share its pass (:mod:`reference.batch`: bit for bit the one-by-one path's), so the merged
:class:`.checks.oracle_pass.PassResult` (:func:`merge`, in prompt order) is what one machine computes, where the nodes
run the same numpy and BLAS build on the same kind of CPU (a BLAS picks its kernels by CPU model).

A node lost mid-run: its task is retried by Ray (:data:`MAX_RETRIES`, on another node when its own is gone: the
node affinity is soft). When it cannot be, :class:`ClusterLost` carries the reason, and the case fails every
pair's ``.runs`` with it (:func:`lost_figures`): no figure of a partial pass is kept.

Under ``--spec``, each task runs the reference under the same variants (:func:`spreader`'s ``spec``, handed to the
task as an argument).

The cluster plumbing is the sweep's (:mod:`harness.core.cluster`). Ray is an optional dependency, imported only
where a cluster is asked for (:func:`_load_ray`): a ``g4h parity`` run without ``--address`` does not pay for its
import; without Ray this module still imports, and ``--address`` says how to get it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, ContextManager, Sequence

from gemma4_harness.reference.errors import InputError

from ..core.environ import THREAD_VARIABLES
from ..core.engine_kinds import ORACLE
from ..core.gates import pair_name
from ..engines import engine_kind
from ..engines.checked import CheckedEngine
from ..engines.numerics import emulate
from ..engines.reference import ReferenceEngine
from ..engines.variants import active, parse_spec, under
from .checks.oracle_pass import PassResult, reference_pass
from .result import Figure, fig

# Ray is an optional dependency, and its import takes about 0.4 s (2 s on a loaded machine): it is imported by
# _load_ray() where a cluster is asked for (open_cluster, a group's task, _spread), not by every g4h parity run
ray = cluster = NodeAffinitySchedulingStrategy = None  # type: ignore[assignment,misc]


def _load_ray() -> bool:
    """Import Ray and the cluster plumbing (:mod:`harness.core.cluster`) into this module, once; False when Ray is
    not installed."""
    global ray, cluster, NodeAffinitySchedulingStrategy
    if ray is None:
        try:
            # the cluster plumbing first: it sets Ray's loopback switch before it imports Ray (cluster.LOOPBACK_SWITCH)
            import gemma4_harness.harness.core.cluster as _cluster  # lazy: it imports Ray at its top

            import ray as _ray  # lazy: Ray is optional, and its import costs every run 0.4 to 2 s
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as _affinity  # lazy: as Ray
        except ModuleNotFoundError as e:  # without Ray, --address says how to get it
            if e.name != "ray":
                raise
            return False
        ray, cluster, NodeAffinitySchedulingStrategy = _ray, _cluster, _affinity
    return True


#: Times Ray runs a group's task again after its worker or node died (a task that raised is not retried).
MAX_RETRIES = 2
#: Test-only: a file; a task whose environment names it exits at once (``os._exit``, as on a lost node) when it
#: finds the file missing (and makes it: the retry runs), or holding ``always`` (every attempt); holding ``wait``,
#: it adds its process id to ``<file>.started`` and waits until the file says otherwise (while a test kills a
#: node). tests/test_parity_address.py sets it before its cluster starts (the nodes' workers inherit it).
DIE_ENV = "G4H_TEST_PARITY_TASK_EXIT"
#: Seconds :func:`open_cluster` waits for the head's port to accept a connection.
CONNECT_TIMEOUT_S = 10.0
SWEEP_EXTRA = "pip install 'gemma4-harness[sweep]'"


class ClusterLost(RuntimeError):
    """The reference's pass work could not be completed on the cluster (a node lost beyond the retries, a task
    that failed there): one line with the group, the node and the reason."""


def open_cluster(address: str) -> int:
    """Attach this process to the cluster at ``address`` (:func:`harness.core.cluster.connect`); returns its alive
    nodes' count.

    Raises:
        InputError: Ray is not installed, no cluster answers at ``address`` or it has no alive node (one line).
    """
    if not _load_ray():
        raise InputError(f"--address {address}: g4h parity reaches a cluster through Ray, which is not installed: "
                         f"{SWEEP_EXTRA}")
    _answers(address)
    cluster.connect(address)
    alive = cluster.nodes()
    if not alive:
        cluster.disconnect()
        raise cluster.ClusterError(f"Ray cluster at {address}: no alive node")
    return len(alive)


def _answers(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse at once a ``HOST:PORT`` where nothing accepts a TCP connection (``ray.init`` would try for about ten
    minutes); other forms (``ray://``, ``auto``) are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise cluster.ClusterError(f"Ray cluster at {address}: nothing answers there ({e.strerror or e}; is the head "
                           "started: ray start --head?)") from None


def close_cluster() -> None:
    """Detach from the cluster (:func:`open_cluster`), when attached."""
    if cluster is not None:
        cluster.disconnect()


def blas_threads() -> int:
    """The BLAS threads a reference forward of this process runs on: the thread variables where set (as
    :func:`harness.parity.job.run_cases` sets them for its workers), else every CPU this process may use."""
    for name in THREAD_VARIABLES:
        if (os.environ.get(name) or "").isdigit() and int(os.environ[name]) > 0:
            return int(os.environ[name])
    return len(os.sched_getaffinity(0))


def groups(n_prompts: int, n_nodes: int) -> list[range]:
    """Contiguous groups of prompt indices, one per node (fewer when there are fewer prompts), sizes within one
    of each other, the larger first: the same split for the same counts."""
    k = max(1, min(n_nodes, n_prompts))
    size, extra = divmod(n_prompts, k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def merge(parts: Sequence[PassResult], sets: Sequence[tuple[str, ...]], prompts: Sequence[dict[str, Any]],
          gen_sets: Sequence[tuple[str, ...]]) -> PassResult:
    """One :class:`PassResult` from the groups' (in group order, the groups contiguous in prompt order), with its
    keys in the order :func:`reference_pass` gives them on the whole set; ``passes``: the most any group ran (each
    group runs pass 1 and one per greedy step, as the whole set does)."""
    logits: dict = {}
    cached: dict = {}
    for r in parts:
        logits.update(r.logits)
        cached.update(r.cached)
    out = PassResult(passes=max((r.passes for r in parts), default=0))
    out.logits = {(a, str(p["id"])): logits[(a, str(p["id"]))] for a in sets for p in prompts}
    out.cached = {str(p["id"]): cached[str(p["id"])] for p in prompts if str(p["id"]) in cached}
    for a in gen_sets:
        out.generations[a] = [g for r in parts for g in r.generations.get(a, [])]
    return out


def _die_if_told() -> None:
    """The test hook of :data:`DIE_ENV`."""
    flag = os.environ.get(DIE_ENV)
    if not flag:
        return
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        os._exit(1)
    except FileExistsError:
        pass
    with open(flag) as f:
        how = f.read().strip()
    if how == "always":
        os._exit(1)
    if how == "wait":
        with open(flag + ".started", "a") as f:
            f.write(f"{os.getpid()}\n")
        while how == "wait":
            time.sleep(0.2)
            with open(flag) as f:
                how = f.read().strip()


def _group_pass(path: str, options: dict[str, Any], sets: Sequence[tuple[str, ...]],
                prompts: Sequence[dict[str, Any]], gen_sets: Sequence[tuple[str, ...]],
                gen_prompts: Sequence[dict[str, Any]], new_tokens: int, top_n: int, cached: bool,
                spec: Sequence[str] = ()) -> dict[str, Any]:
    """One group's pass work, on the node it runs on: ``{"result": PassResult}``, or ``{"missing": host, "node": id}`` when the
    model is not at ``path`` there, or ``{"input_error": line}`` when the reference refuses it (an overflow). ``spec``:
    the variants of the command's ``--spec``, the reference run under them."""
    _die_if_told()
    if not os.path.isfile(path) and not os.path.isdir(path):
        _load_ray()  # a task runs where Ray is: this worker's copy of the module has not imported it yet
        return {"missing": socket.gethostname(), "node": ray.get_runtime_context().get_node_id()[:8]}
    try:
        with under(parse_spec(list(spec)), fast=False, spec=True):
            ref = CheckedEngine(ReferenceEngine(path, cache_gb=options.get("cache_gb"), layers=options.get("layers")),
                                ORACLE)
            return {"result": reference_pass(ref, sets, prompts, gen_sets, gen_prompts, new_tokens, top_n, cached,
                                             emulate)}
    except InputError as e:
        return {"input_error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def spreader(address: str, path: str, options: dict[str, Any],
             spec: Sequence[str] | None = None) -> Callable[..., PassResult]:
    """A stand-in for :func:`.checks.oracle_pass.reference_pass` (the same arguments; ``ref`` and ``numerics``
    are not used: each node loads its own reference of ``path`` with ``options``' ``cache_gb`` and ``layers``, and
    makes the approximations as :meth:`ReferenceRuns.numerics` does) that runs the pass work on the cluster at
    ``address`` (attached by :func:`open_cluster`, or here when this process is a ``--jobs`` worker). ``spec``: the
    variants each node's reference runs under (None: this process's ``--spec``,
    :func:`harness.engines.variants.active`)."""
    path = os.path.abspath(str(path))
    spec = tuple(active() if spec is None else spec)

    def run(ref: Any, sets: Sequence[tuple[str, ...]], prompts: Sequence[dict[str, Any]],
            gen_sets: Sequence[tuple[str, ...]], gen_prompts: Sequence[dict[str, Any]], new_tokens: int, top_n: int,
            cached: bool, numerics: Callable[[tuple[str, ...]], ContextManager],
            progress: Callable[[str], None] = lambda m: None) -> PassResult:
        return _spread(address, path, options, sets, prompts, gen_sets, gen_prompts, new_tokens, top_n, cached,
                       progress, spec)

    return run


def _spread(address: str, path: str, options: dict[str, Any], sets: Sequence[tuple[str, ...]],
            prompts: Sequence[dict[str, Any]], gen_sets: Sequence[tuple[str, ...]],
            gen_prompts: Sequence[dict[str, Any]], new_tokens: int, top_n: int, cached: bool,
            progress: Callable[[str], None], spec: tuple[str, ...] = ()) -> PassResult:
    if not _load_ray() or not ray.is_initialized():
        open_cluster(address)
    alive = [n for n in cluster.nodes() if n.cpus >= 1]
    if not alive:
        raise ClusterLost(f"Ray cluster at {address}: no alive node with a CPU for the reference's passes")
    cpus = min(n.cpus for n in alive)  # each task takes a whole node (of the smallest size: a retry fits any)
    split = groups(len(prompts), len(alive))
    progress(f"reference: the passes of {len(prompts)} prompt(s) on {len(split)} node(s) of the Ray cluster at "
             f"{address} ({', '.join(str(len(g)) for g in split)} prompt(s) each)")
    # the BLAS threads of this process on every node: a float64 product's last bits depend on how many threads
    # split it (measured: e4b-wide Q8_0, nodes of 1 CPU with 1 thread each moved mean_kld 1.35932e-12 -> 1.35927e-12)
    threads = blas_threads()
    env = {"env_vars": {name: str(threads) for name in THREAD_VARIABLES}}
    task = ray.remote(max_retries=MAX_RETRIES)(_group_pass)
    pending, t0 = [], time.perf_counter()
    for g, node in zip(split, alive):
        part = [prompts[i] for i in g]
        ids = {str(p["id"]) for p in part}
        gen = [p for p in gen_prompts if str(p["id"]) in ids]
        ref = task.options(num_cpus=cpus, runtime_env=env,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=True)).remote(
            path, options, list(sets), part, list(gen_sets), gen, new_tokens, top_n, cached, spec)
        pending.append((g, node, ref))
    parts = []
    for g, node, ref in pending:
        what = f"prompts {g.start + 1}-{g.stop} of {len(prompts)}, sent to Ray node {node.short} ({node.host})"
        try:
            got = ray.get(ref)
        except Exception as e:  # a node or worker lost beyond the retries, a task that raised there
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            _cancel([r for _, _, r in pending])
            raise ClusterLost(f"the reference's passes of {what} did not complete (tried {MAX_RETRIES + 1} "
                              f"times): {type(e).__name__}: {lines[-1][:300] if lines else ''}") from None
        if "missing" in got or "input_error" in got:
            _cancel([r for _, _, r in pending])
        if "missing" in got:
            raise InputError(f"Ray node {got['node']} ({got['missing']}): the model {path} is not there (every node "
                             "reads the model from the same path: copy it there, or mount a shared store)")
        if "input_error" in got:
            raise InputError(got["input_error"])
        parts.append(got["result"])
    progress(f"reference: the passes on {len(split)} node(s) done in {time.perf_counter() - t0:.1f} s")
    return merge(parts, sets, prompts, gen_sets)


def _cancel(refs: Sequence[Any]) -> None:
    """Stop the groups' tasks still running (the job stops: their work would be thrown away)."""
    for r in refs:
        try:
            ray.cancel(r, force=True)
        except Exception:  # done already, or its node gone: nothing to stop
            pass


def lost_figures(names: Sequence[str], reason: str) -> list[Figure]:
    """The failing ``reference~<kind>.runs`` figure of every engine of ``names`` when the reference's pass work
    was lost on the cluster (:class:`ClusterLost`): nothing of the pair is measured."""
    return [fig(f"{pair_name(engine_kind(n), oracle=ORACLE)}.runs", 0.0, None,
                got=f"not run: the reference's pass work on the Ray cluster failed: {reason}", cluster_failure=True)
            for n in names]
