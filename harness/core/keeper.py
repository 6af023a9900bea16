"""The keeper of a local Ray cluster: starts its nodes, and stops every process of them when its parent goes.

``python -m gemma4_harness.harness.core.keeper`` is started by :class:`harness.core.cluster.LocalCluster` in a session of its
own (``start_new_session``), with a pipe on its stdin. It reads one JSON line (the nodes to start), starts the head
and one node per further node through Ray's own local-cluster class (``ray.cluster_utils.Cluster``; every process in
this session: Ray's daemons, raylets, agents and worker processes inherit it), answers one JSON line on stdout
(``{"address": "127.0.0.1:PORT"}`` or ``{"error": "..."}``), then waits for its stdin to close. That happens when
the command ends, normally or not (a ``SIGKILL`` of the parent closes the pipe too). It then stops every process of
its session: ``SIGTERM``, a few seconds' grace, ``SIGKILL``; removes the cluster's temporary folder; and exits. So
no Ray process outlives the command or test that started the cluster.

Every node is bound to 127.0.0.1 (:data:`LOOPBACK`), its ``node_ip_address``, with the dashboard off: Ray's gRPC
servers (the GCS, the raylet's node manager and object manager, the workers' and the driver's core-worker servers)
listen on ``127.0.0.1`` when the node's address is ``127.0.0.1``, and on ``0.0.0.0``, every interface, otherwise
(``src/ray/rpc/grpc_server.cc``, ``GrpcServer::Run``); the dashboard agent's gRPC server likewise
(``ray/dashboard/agent.py``); the runtime-env agent listens on the node's address (``ray/_private/runtime_env/agent/
main.py``). Not ``ray start --node-ip-address=127.0.0.1``: the CLI turns a loopback address into the machine's own
(``ray/scripts/scripts.py`` ``start``: ``services.resolve_ip_for_localhost``) unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and with that switch it refuses a further node (``ray start --address``).

Request: ``{"nodes": [{"cpus": 1, "memory": bytes | null, "object_store": bytes}, ...], "temp_dir": "/tmp/g4h-ray-x"}``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

#: Seconds between SIGTERM and SIGKILL when the cluster is stopped.
GRACE_S = 3.0


def session_members(sid: int) -> list[int]:
    """Process ids in session ``sid`` other than this process (Linux ``/proc``; empty elsewhere)."""
    out = []
    me = os.getpid()
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def stop_session(grace: float = GRACE_S) -> None:
    """SIGTERM every other process of this session, wait up to ``grace`` seconds, SIGKILL what is left."""
    sid = os.getsid(0)
    if not Path("/proc").is_dir():  # no /proc: the process group is the best handle there is
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(os.getpgid(0), signal.SIGTERM)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = session_members(sid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 1.0)
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = session_members(sid)
        if not pids:
            return


#: The address every node of a local cluster listens and connects on: the loopback, never a network interface.
LOOPBACK = "127.0.0.1"


def node_args(node: dict[str, Any], temp_dir: str) -> dict[str, Any]:
    """``ray.cluster_utils.Cluster.add_node``'s keywords (``ray._private.parameter.RayParams``) for one node of the
    request: its CPUs, object store and memory, the cluster's temporary folder, :data:`LOOPBACK`, no dashboard."""
    args: dict[str, Any] = {"num_cpus": int(node["cpus"]), "object_store_memory": int(node["object_store"]),
                            "temp_dir": temp_dir, "node_ip_address": LOOPBACK, "include_dashboard": False}
    if node.get("memory"):
        args["memory"] = int(node["memory"])
    return args


def start(req: dict[str, Any]) -> str:
    """Start the nodes of ``req`` in this process's session; returns the head's address (``127.0.0.1:PORT``)."""
    tmp = req["temp_dir"]
    os.environ.update({
        "RAY_AUTH_MODE": "disabled",  # a private cluster on this machine: no token to hand around
        "RAY_USAGE_STATS_ENABLED": "0",  # what ray start --disable-usage-stats sets (ray._common.usage.usage_lib)
        # the "current cluster" file Ray writes for ray.init(address="auto") goes to our folder, not /tmp/ray, where
        # it would point a user's own ray.init() at this private cluster (ray._private.utils.write_ray_address)
        "RAY_TMPDIR": tmp,
    })
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    from ray.cluster_utils import Cluster  # lazy: Ray is optional (the sweep extra), and only the keeper starts nodes

    # shutdown_at_exit False: the keeper stops every process of its session itself (stop_session), SIGKILL included
    c = Cluster(shutdown_at_exit=False)
    for node in req["nodes"]:
        c.add_node(**node_args(node, tmp))
    return str(c.address)


def main() -> int:
    """Run the keeper (see the module docstring); returns the exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C belongs to the command, which then closes our stdin
    line = sys.stdin.readline()
    try:
        req = json.loads(line)
    except ValueError:
        return 2
    try:
        address = start(req)
        answer: dict[str, Any] = {"address": address}
    except Exception as e:  # noqa: BLE001 (Ray's own errors too: the parent gets one line, then we stop the session)
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        answer = {"error": f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"}
    try:
        print(json.dumps(answer), flush=True)
        if "address" in answer:
            sys.stdin.read()  # until the parent closes the pipe (it ended, or died)
    except (BrokenPipeError, OSError):
        pass
    finally:
        stop_session()
        for _ in range(3):  # a process killed a moment ago may still have had a file open
            shutil.rmtree(req["temp_dir"], ignore_errors=True)
            if not os.path.exists(req["temp_dir"]):
                break
            time.sleep(0.5)
    return 0 if "address" in answer else 1


if __name__ == "__main__":
    sys.exit(main())
