"""Where ``g4h sweep`` and ``g4h parity --address`` run: a Ray cluster started for the command (:class:`LocalCluster`)
or an existing one (``--address``). Here in ``core`` because both use it (:mod:`harness.sweep.run`,
:mod:`harness.parity.remote`).

* :class:`LocalCluster` starts ``nodes`` Ray nodes on this machine through the keeper process
  (:mod:`.keeper`), each with its share of the CPUs and of the memory, and a bounded object store, every one bound to
  127.0.0.1; when the ``with`` block ends (or the command dies) the keeper stops every Ray process it started.
* :func:`connect` attaches this process to a cluster (``ray.init(address=...)``); :func:`disconnect` detaches.
* :func:`nodes` lists the alive nodes and their resources; :func:`probe` runs one task on each to learn what it can
  run (the harness's version there, whether llama-cpp-python and torch import) before the sweep submits work.

Ray is an optional dependency (``pip install 'gemma4-harness[sweep]'``): this module imports it at the top, and
``g4h sweep`` and ``g4h parity --address`` check for it before importing this module.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

#: Ray's switch for a node on its own (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, read once, when Ray is
#: imported). Set to 0 before Ray is imported here (unless the user set it), so that a driver takes an address on
#: 127.0.0.1 at its word: Ray otherwise replaces a loopback host with this machine's network address
#: (``ray._private.services.resolve_ip_for_localhost``, through ``get_node_ip_address``), where a cluster bound to
#: 127.0.0.1 (:class:`LocalCluster`, :mod:`.keeper`) does not listen. Nothing else of a driver changes: its other
#: uses in Ray 2.60 are ``ray start``'s (the CLI, not run by a driver) and log labels.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
os.environ.setdefault(LOOPBACK_SWITCH, "0")

import ray  # noqa: E402 (after the switch above: Ray reads it when imported)
from ray._private.services import resolve_ip_for_localhost  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from gemma4_harness.reference.errors import InputError  # noqa: E402

from ..core.keeper import LOOPBACK  # noqa: E402
from ..core.memory import GB, available_memory  # noqa: E402
from ..core.paths import SEARCH_ROOT  # noqa: E402

#: Object store of each local node unless told otherwise: the base logits of a group (prompts x positions x
#: vocabulary x 8 bytes: 0.2 GB for 100 positions of a 262,144-token vocabulary) and the engines' logits in flight.
DEFAULT_OBJECT_STORE_BYTES = GB
#: Seconds the keeper may take to start every node.
START_TIMEOUT_S = 300.0
#: Seconds :func:`probe` waits for each node's answer.
PROBE_TIMEOUT_S = 120.0


class ClusterError(InputError):
    """The cluster could not be started, reached, or used (one line naming the address or node and what failed)."""


def cpus_here() -> int:
    """The CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class LocalCluster:
    """``nodes`` Ray nodes on this machine for the life of a ``with`` block (see the module docstring).

    Args:
        nodes: how many nodes (2 on one machine is how the tests show tasks spreading over nodes).
        cpus: CPUs in all (default: every CPU this process may use), split evenly; each node gets at least one.
        memory_bytes: memory in all (default: what is available now), split evenly: each node's Ray ``memory``
            resource, which tasks declare against.
        object_store_bytes: each node's object store (default :data:`DEFAULT_OBJECT_STORE_BYTES`, at most a fifth of
            its memory share).

    Attributes:
        address: ``HOST:PORT`` of the head, once started.
    """

    def __init__(self, nodes: int = 1, cpus: int | None = None, memory_bytes: int | None = None,
                 object_store_bytes: int | None = None) -> None:
        if nodes < 1:
            raise InputError(f"--local-nodes {nodes}: expected at least 1")
        self.n = int(nodes)
        total_cpus = int(cpus or cpus_here())
        if total_cpus < 1:
            raise InputError(f"--cpus {cpus}: expected at least 1")
        avail = memory_bytes or (available_memory()[0] or 4 * GB)
        share = int(avail * (0.9 if memory_bytes is None else 1.0)) // self.n
        store = int(object_store_bytes or DEFAULT_OBJECT_STORE_BYTES)
        store = max(80 * 2**20, min(store, share // 5)) if object_store_bytes is None else store
        self.spec = [{"cpus": max(1, total_cpus // self.n + (1 if i < total_cpus % self.n else 0)),
                      "memory": max(share - store, GB // 2), "object_store": store} for i in range(self.n)]
        self.address: str | None = None
        self._keeper: subprocess.Popen | None = None
        self._tmp: str | None = None

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> str:
        """Start the nodes (several seconds each); returns the head's address.

        Raises:
            ClusterError: ``ray start`` failed or took longer than :data:`START_TIMEOUT_S`.
        """
        # Ray's own variable for where its temporary folders go (``ray._private.utils.get_user_temp_dir``); /tmp by
        # default rather than $TMPDIR because Ray's Unix sockets live inside and their paths must stay short
        parent = os.environ.get("RAY_TMPDIR") or ("/tmp" if os.path.isdir("/tmp") else None)
        self._tmp = tempfile.mkdtemp(prefix="g4h-ray-", dir=parent)
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        env["PYTHONPATH"] = os.pathsep.join([str(SEARCH_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        self._keeper = subprocess.Popen([sys.executable, "-m", "gemma4_harness.harness.core.keeper"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        start_new_session=True, env=env, cwd=str(SEARCH_ROOT))
        assert self._keeper.stdin is not None and self._keeper.stdout is not None
        self._keeper.stdin.write(json.dumps({"nodes": self.spec, "temp_dir": self._tmp}) + "\n")
        self._keeper.stdin.flush()
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self._keeper.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        try:
            got = json.loads(answer[0]) if answer and answer[0].strip() else {"error": "the keeper answered nothing"}
        except ValueError:
            got = {"error": f"the keeper answered {answer[0][:200]!r}"}
        if "address" not in got:
            self.stop()
            raise ClusterError(f"local Ray cluster of {self.n} node(s): {got.get('error', 'no answer')} "
                               f"(took over {START_TIMEOUT_S:.0f} s?)" if not answer else
                               f"local Ray cluster of {self.n} node(s): {got['error']}")
        self.address = got["address"]
        os.environ["RAY_AUTH_MODE"] = "disabled"  # this process's own connection to the private cluster
        return self.address

    def stop(self) -> None:
        """Stop every Ray process of the cluster (the keeper does it when its stdin closes) and wait for it."""
        k, self._keeper = self._keeper, None
        if k is not None:
            try:
                if k.stdin is not None:
                    k.stdin.close()
            except OSError:
                pass
            try:
                k.wait(timeout=60)
            except subprocess.TimeoutExpired:
                k.kill()
                k.wait()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def connect(address: str) -> None:
    """Attach this process to the cluster at ``address`` (quietly: no driver log lines).

    Authentication: Ray 2.60's ``ray start --head`` turns token authentication on (the token in
    ``~/.ray/auth_token``), and a driver given an explicit address sends the token only with ``RAY_AUTH_MODE=token``
    (Ray's own rule, ``ray._private.worker.init``: an explicit address never enables it by itself, so a token is not
    sent to a server nobody vouched for). The sweep keeps that rule; a refusal says what to set.

    Raises:
        ClusterError: no cluster answers there, or it refused the connection (a token it expects, another Ray
            version): one line naming the address.
    """
    host = address.rpartition(":")[0].strip("[]")
    if host in (LOOPBACK, "localhost") and resolve_ip_for_localhost(host) != LOOPBACK:
        raise ClusterError(f"Ray cluster at {address}: Ray was imported before {LOOPBACK_SWITCH}=0 was set, and would "
                           f"connect to {resolve_ip_for_localhost(host)} instead (set {LOOPBACK_SWITCH}=0 before "
                           "importing Ray)")
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", namespace="g4h-sweep",
                 configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        cause = f"{e} {e.__cause__ or ''}"
        hint = (" (it asks for an authentication token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, or copy the "
                "head's ~/.ray/auth_token here)" if "Authentication" in cause or "InvalidAuthToken" in cause else "")
        raise ClusterError(f"Ray cluster at {address}: {str(e).splitlines()[0]}{hint}") from None
    except Exception as e:  # ray.exceptions.AuthenticationError and the like: still one line
        raise ClusterError(f"Ray cluster at {address}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def disconnect() -> None:
    """Detach from the cluster (a cluster started by :class:`LocalCluster` keeps running until it stops)."""
    if ray.is_initialized():
        ray.shutdown()


@dataclass(frozen=True)
class Node:
    """An alive node of the cluster: id, address, host name and its resources (CPUs, memory bytes, object store)."""

    node_id: str
    address: str
    host: str
    cpus: float
    memory: float
    object_store: float

    @property
    def short(self) -> str:
        """The first 8 hex digits of the node id (how rows and the report name nodes)."""
        return self.node_id[:8]


def nodes() -> list[Node]:
    """The alive nodes of the connected cluster, head first as Ray lists them."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        r = n.get("Resources", {})
        out.append(Node(n["NodeID"], n.get("NodeManagerAddress", "?"), n.get("NodeManagerHostname", "?"),
                        float(r.get("CPU", 0)), float(r.get("memory", 0)), float(r.get("object_store_memory", 0))))
    return out


def _facts() -> dict[str, Any]:
    """What this node can run (runs inside the probe task)."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"node": ray.get_runtime_context().get_node_id(), "python": sys.version.split()[0],
            "harness": version("gemma4-harness"),
            "harness_path": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            "ray": ray.__version__, "torch": version("torch"), "numpy": version("numpy"),
            "llama_cpp": importlib.util.find_spec("llama_cpp") is not None}


def probe(alive: list[Node]) -> dict[str, dict[str, Any]]:
    """One task on each node: what it can run (:func:`_facts`), or ``{"error": ...}`` when the task fails there.

    Returns:
        node id -> facts.
    """
    task = ray.remote(num_cpus=0, max_retries=0)(_facts)
    refs = {n.node_id: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
            .remote() for n in alive}
    out: dict[str, dict[str, Any]] = {}
    for nid, ref in refs.items():
        try:
            out[nid] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as e:  # the harness does not import there, the node died, or it took too long
            last = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
            out[nid] = {"error": f"{type(e).__name__}: {last}"}
    return out
