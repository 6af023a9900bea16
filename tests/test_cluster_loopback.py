"""A Ray cluster the harness starts for itself (:class:`harness.core.cluster.LocalCluster`: ``g4h sweep`` without
``--address``, and the tests' clusters) keeps to 127.0.0.1: every Internet socket of its processes (the keeper,
the GCS, the raylets with their node manager and object manager, the dashboard and runtime-env agents, the workers)
and of the driver attached to it listens on, and connects to, the loopback only (Unix sockets are not Internet
sockets). Read from ``/proc`` (tests/ray_sockets.py) while a task runs on each node and an object made on one node
is read on the other (the object managers talk).

Before, the nodes were started with ``ray start``, which listens on every interface (``0.0.0.0``) and on this
machine's network address.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray", reason="the local cluster needs Ray: pip install 'gemma4-harness[sweep]' (a test extra)")
if not Path("/proc/net/tcp").is_file():
    pytest.skip("reads the sockets from /proc (Linux)", allow_module_level=True)

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from ray_sockets import TCP_LISTEN, inet_sockets, off_loopback  # noqa: E402

from gemma4_harness.harness.core import cluster  # noqa: E402
from gemma4_harness.harness.core.keeper import session_members  # noqa: E402


def test_a_local_cluster_listens_and_connects_on_127_0_0_1_only():
    with cluster.LocalCluster(nodes=2, cpus=2, object_store_bytes=100 * 2**20) as c:
        cluster.connect(c.address)
        try:
            alive = cluster.nodes()
            assert len(alive) == 2, alive
            mine = ray.get_runtime_context().get_node_id()
            other = next(n for n in alive if n.node_id != mine)
            big = ray.put(np.ones(1 << 18))  # 2 MB: in the object store of this process's node, not inline
            task = ray.remote(num_cpus=1)(lambda a: float(a.sum()))  # by value: workers cannot import this file
            got = ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                           .remote(big) for n in alive], timeout=300)
            assert got == [float(1 << 18)] * 2
            socks = inet_sockets(session_members(os.getsid(c._keeper.pid)) + [os.getpid()])
        finally:
            cluster.disconnect()
    listening = {s.name for s in socks if s.state == TCP_LISTEN}
    assert {"gcs_server", "raylet"} <= listening, socks  # the daemons' sockets were read
    bad = off_loopback(socks)
    assert not bad, "\n".join(bad)
    assert c.address.startswith("127.0.0.1:"), c.address
    assert [n.address for n in alive] == ["127.0.0.1", "127.0.0.1"] and other.address == "127.0.0.1"
