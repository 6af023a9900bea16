"""The keeper of a local Ray cluster: starts its nodes, and stops every process of them when its parent goes.

``python -m gemma4_harness.harness.core.keeper`` is started by :class:`harness.core.cluster.LocalCluster` in a session of its
own (``start_new_session``), with a pipe on its stdin. It reads one JSON line (the nodes to start), runs ``ray
start --head`` and one ``ray start --address`` per further node (each in this session: Ray's daemons, raylets,
agents and worker processes inherit it), answers one JSON line on stdout (``{"address": "HOST:PORT"}`` or
``{"error": "..."}``), then waits for its stdin to close. That happens when the command ends, normally or not (a
``SIGKILL`` of the parent closes the pipe too). It then stops every process of its session: ``SIGTERM``, a few
seconds' grace, ``SIGKILL``; removes the cluster's temporary folder; and exits. So no Ray process outlives the
command or test that started the cluster.

Request: ``{"nodes": [{"cpus": 1, "memory": bytes | null, "object_store": bytes}, ...], "temp_dir": "/tmp/g4h-ray-x",
"python": "/path/to/python"}``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Seconds between SIGTERM and SIGKILL when the cluster is stopped.
GRACE_S = 3.0
#: Seconds one ``ray start`` may take.
START_TIMEOUT_S = 180.0


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


def _ray(python: str, args: list[str], env: dict[str, str]) -> str:
    """Run ``ray <args>`` (Ray's own CLI module) and return its output; RuntimeError with its last line on failure."""
    p = subprocess.run([python, "-m", "ray.scripts.scripts", *args], capture_output=True, text=True, env=env,
                       timeout=START_TIMEOUT_S)
    text = p.stdout + p.stderr
    if p.returncode != 0:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        raise RuntimeError(f"ray {args[0]} {args[1] if len(args) > 1 else ''} failed: "
                           f"{lines[-1].strip() if lines else p.returncode}")
    return text


def _node_args(node: dict[str, Any], temp_dir: str) -> list[str]:
    args = [f"--num-cpus={int(node['cpus'])}", f"--object-store-memory={int(node['object_store'])}",
            f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    if node.get("memory"):
        args.append(f"--memory={int(node['memory'])}")
    return args


def start(req: dict[str, Any]) -> str:
    """Start the nodes of ``req``; returns the head's address."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")  # a private cluster on this machine: no token to hand around
    py, tmp = req["python"], req["temp_dir"]
    nodes = req["nodes"]
    out = _ray(py, ["start", "--head", "--port=0", "--include-dashboard=false", *_node_args(nodes[0], tmp)], env)
    m = re.search(r"ray start --address='([^']+)'", out)
    if not m:
        raise RuntimeError("ray start --head printed no address")
    address = m.group(1)
    for node in nodes[1:]:
        _ray(py, ["start", f"--address={address}", *_node_args(node, tmp)], env)
    return address


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
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        answer = {"error": str(e)}
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
