"""``g4h parity --address`` (:mod:`harness.parity.remote`): the reference's passes on a Ray cluster, one group of
prompts per node, give the results of a run on this machine (the ``cases`` of results.json compared, less the
timings and the cluster's address); a task whose worker dies, or whose node is killed mid-run (its raylet and
workers), is run again and the figures are the same; one that dies every time fails every pair's ``.runs`` with
the reason (exit 1, no figure of a partial pass); an address where no cluster answers is bad input (exit 2, one
line).

The model is tests/variant_lab.py's ``lab-dense`` (vocabulary 512, context 256), against the fast engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray", reason="g4h parity --address needs Ray: pip install 'gemma4-harness[sweep]' (a test extra)")

from ray_sockets import TCP_LISTEN, inet_sockets, off_loopback  # noqa: E402
from variant_lab import build  # noqa: E402

from gemma4_harness.harness.cli import main  # noqa: E402
from gemma4_harness.harness.core import cluster  # noqa: E402
from gemma4_harness.harness.core.environ import THREAD_VARIABLES  # noqa: E402
from gemma4_harness.harness.core.keeper import session_members  # noqa: E402
from gemma4_harness.harness.parity import job, remote  # noqa: E402

#: Five prompts of 1 to 19 tokens: groups of 3 and 2 on two nodes.
PROMPTS = [[2], [2, 127, 198, 237, 126], [2, 169, 23, 254, 172, 81, 60, 73, 157, 146, 110, 83, 140, 11, 48],
           [2, 40, 41], [2] + [(7 * i + 3) % 380 + 4 for i in range(18)]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("lab"))["lab-dense"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": ids}) + "\n" for i, ids in enumerate(PROMPTS)))
    return p


@pytest.fixture(scope="module")
def flag(tmp_path_factory) -> Path:
    """The test hook's file (:data:`remote.DIE_ENV`), made: no task dies until a test removes it."""
    f = tmp_path_factory.mktemp("flag") / "die"
    f.write_text("")
    return f


@pytest.fixture(scope="module")
def two_nodes(flag):
    """Two Ray nodes on this machine, one CPU each; their workers see the test hook's file."""
    saved = os.environ.get(remote.DIE_ENV)
    os.environ[remote.DIE_ENV] = str(flag)
    try:
        with cluster.LocalCluster(nodes=2, cpus=2, object_store_bytes=200 * 2**20) as c:
            yield c.address
    finally:
        if saved is None:
            os.environ.pop(remote.DIE_ENV, None)
        else:
            os.environ[remote.DIE_ENV] = saved


def _parity(capsys, model, prompt_file, out: Path, *extra: str) -> tuple[int, dict, str]:
    capsys.readouterr()
    rc = main(["parity", "--model", str(model), "--against", "fast", "--prompts", str(prompt_file), "--max-new-tokens",
               "3", "--out", str(out), "--explain-budget", "0", *extra])
    err = capsys.readouterr().err
    runs = sorted(out.glob("*/results.json"))
    return rc, (json.loads(runs[-1].read_text()) if runs else {}), err


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])


def _cases(data: dict) -> list[dict]:
    """The figures of every case, less what differs between runs of the same job (timings, the cluster)."""
    out = []
    for c in data["cases"]:
        c = {k: v for k, v in c.items() if k != "seconds"}
        c["info"] = {k: v for k, v in c.get("info", {}).items() if k != "cluster"}
        out.append(c)
    return out


@pytest.fixture(scope="module")
def here(model, prompt_file, tmp_path_factory):
    """The job run on this machine, without a cluster."""

    out = tmp_path_factory.mktemp("here")
    rc = main(["parity", "--model", str(model), "--against", "fast", "--prompts", str(prompt_file),
               "--max-new-tokens", "3", "--out", str(out), "--explain-budget", "0", "--quiet"])
    data = json.loads(next(out.glob("*/results.json")).read_text())
    assert rc == 0, data["verdict"]
    return data


@pytest.mark.slow
def test_two_nodes_give_the_figures_of_one_machine(model, prompt_file, two_nodes, here, tmp_path, capsys):
    rc, data, err = _parity(capsys, model, prompt_file, tmp_path, "--address", two_nodes)
    assert rc == 0, data.get("verdict")
    assert "on 2 node(s) of the Ray cluster" in err and "(3, 2 prompt(s) each)" in err, err
    assert data["cases"][0]["info"]["cluster"] == {"address": two_nodes}
    assert _cases(data) == _cases(here)


@pytest.mark.slow
def test_a_task_whose_worker_dies_is_retried_with_the_same_figures(model, prompt_file, two_nodes, here, flag,
                                                                    tmp_path, capsys):
    flag.unlink()  # the first task to start dies (and makes the file again): Ray runs it again
    rc, data, _ = _parity(capsys, model, prompt_file, tmp_path, "--address", two_nodes)
    assert flag.exists() and rc == 0, data.get("verdict")
    assert _cases(data) == _cases(here)


@pytest.mark.slow
def test_a_task_that_dies_every_time_fails_the_pairs_with_the_reason(model, prompt_file, two_nodes, flag, tmp_path,
                                                                     capsys):
    flag.write_text("always")
    try:
        rc, data, _ = _parity(capsys, model, prompt_file, tmp_path, "--address", two_nodes)
    finally:
        flag.write_text("")
    assert rc == 1
    (case,) = data["cases"]
    runs = [c for c in case["checks"] if c["gate"].endswith(".runs")]
    assert [c["gate"] for c in runs] == ["reference~fast.runs"] and runs[0]["pass"] is False, runs
    assert "did not complete (tried 3 times)" in runs[0]["got"], runs[0]
    assert [c["gate"] for c in case["checks"]] == ["reference~fast.runs"]  # nothing of a partial pass


@pytest.mark.slow
def test_a_node_killed_mid_run_has_its_task_run_again_elsewhere(model, prompt_file, here, tmp_path, capsys):
    """The raylet of the node this process is not attached to is killed while both groups' tasks run: its task is
    run again on the node left, and the figures are the same."""
    import ray

    flag = tmp_path / "wait"
    flag.write_text("wait")
    saved = os.environ.get(remote.DIE_ENV)
    os.environ[remote.DIE_ENV] = str(flag)
    try:
        with cluster.LocalCluster(nodes=2, cpus=2, object_store_bytes=200 * 2**20) as c:
            got: dict = {}
            job = threading.Thread(target=lambda: got.update(zip(("rc", "data", "err"), _parity(
                capsys, model, prompt_file, tmp_path / "out", "--address", c.address))))
            job.start()
            started = Path(f"{flag}.started")
            deadline = time.monotonic() + 300
            while (not started.exists() or len(started.read_text().split()) < 2) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(started.read_text().split()) == 2, "both groups' tasks should have started"
            mine = ray.get_runtime_context().get_node_id()
            other = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] != mine)
            # that node's raylet (its command line names its socket) and its workers (its children), no other process
            arg = f"--raylet_socket_name={other['RayletSocketName']}".encode()
            ours = session_members(os.getsid(c._keeper.pid))
            (raylet,) = [pid for pid in ours if arg in _cmdline(pid)]
            node = [raylet] + [pid for pid in ours if _parent(pid) == raylet]
            waiting = {int(x) for x in started.read_text().split()}
            assert len(waiting & set(node)) == 1, (node, waiting)  # one group's task runs there, now lost
            for pid in node:
                os.kill(pid, signal.SIGKILL)
            flag.write_text("")  # the task left (and the one run again) go on
            job.join(600)
            assert got["rc"] == 0, got["data"].get("verdict")
            assert _cases(got["data"]) == _cases(here)
    finally:
        if saved is None:
            os.environ.pop(remote.DIE_ENV, None)
        else:
            os.environ[remote.DIE_ENV] = saved


@pytest.mark.slow
def test_a_head_started_apart_through_ray_address(model, prompt_file, here, tmp_path, capsys, monkeypatch):
    """A head started apart with ``ray start --head``, bound to 127.0.0.1, reached through ``RAY_ADDRESS``: the
    results are this machine's, and every Internet socket of the head's processes and of this driver is on the
    loopback (tests/ray_sockets.py). ``ray start --node-ip-address=127.0.0.1`` keeps the loopback only under
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (tests/conftest.py sets it; ray/scripts/scripts.py ``start``), which also
    leaves the "ray start --address" line out of its output: the address is read from the head's
    ``ray_current_cluster`` file."""
    assert os.environ.get(cluster.LOOPBACK_SWITCH) == "0"
    # its own temporary folder, short (Ray's Unix socket paths inside must stay under 108 bytes)
    tmp = tempfile.mkdtemp(prefix="r", dir=os.environ.get("RAY_TMPDIR") or "/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=tmp)
    env.pop(remote.DIE_ENV, None)
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port=0",
                             "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={tmp}", "--object-store-memory=200000000"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = head.communicate(timeout=300)
        assert head.returncode == 0, out
        address = Path(tmp, "ray_current_cluster").read_text().strip()
        assert address.startswith("127.0.0.1:"), (address, out)
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        monkeypatch.setenv("RAY_ADDRESS", address)
        socks: list = []
        real_close = job.close_cluster

        def close_after_reading_the_sockets() -> None:  # while this driver is still attached
            socks.extend(inet_sockets(session_members(head.pid) + [os.getpid()]))
            real_close()

        monkeypatch.setattr(job, "close_cluster", close_after_reading_the_sockets)
        rc, data, err = _parity(capsys, model, prompt_file, tmp_path)
        assert rc == 0, data.get("verdict")
        assert {s.name for s in socks if s.state == TCP_LISTEN} >= {"gcs_server", "raylet"}, socks
        bad = off_loopback(socks)
        assert not bad, "\n".join(bad)
        assert "on 1 node(s) of the Ray cluster" in err, err
        assert data["cases"][0]["info"]["cluster"] == {"address": address}
        assert _cases(data) == _cases(here)
    finally:
        # the head's processes only (its session), not every Ray process of the machine as `ray stop` would
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in session_members(head.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2)
        subprocess.run(["rm", "-rf", tmp], check=False)


def test_an_address_where_no_cluster_answers_is_bad_input(model, prompt_file, tmp_path, capsys):
    rc, data, err = _parity(capsys, model, prompt_file, tmp_path, "--address", "127.0.0.1:1", "--quiet")
    assert rc == 2 and not data
    assert "Traceback" not in err
    assert "Ray cluster at 127.0.0.1:1" in err.strip().splitlines()[-1], err


def test_groups_split_the_prompts_in_order():
    assert [list(g) for g in remote.groups(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(g) for g in remote.groups(2, 4)] == [[0], [1]]
    assert [list(g) for g in remote.groups(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.slow
def test_a_node_without_the_model_file_says_so(two_nodes, tmp_path):
    import ray

    cluster.connect(two_nodes)
    try:
        got = ray.get(ray.remote(remote._group_pass).remote(str(tmp_path / "absent.gguf"), {}, [()],
                                                            [{"id": "p", "prompt_ids": [2]}], [], [], 1, 1, False))
    finally:
        cluster.disconnect()
    assert set(got) == {"missing", "node"} and got["missing"]  # its host: the driver names the node and the path
    assert len(got["node"]) == 8  # the node it ran on (8 hex digits, as reports name nodes)


def test_the_tasks_run_on_the_drivers_blas_threads(monkeypatch):
    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert remote.blas_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert remote.blas_threads() == 3
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # OpenBLAS reads its own first
    assert remote.blas_threads() == 1


def test_a_task_runs_the_reference_under_the_commands_spec(model):
    """``--spec`` reaches the nodes: a group's task is handed the variants and its reference runs under them
    (run here, without Ray: the task's function itself), as this machine's reference does. A variant of a function
    the many-forwards path calls through the module (``rms_norm``; one of ``forward``'s own makes the pass work run
    one by one here instead, :func:`reference.batch.replaced`) was lost on the nodes before."""
    from gemma4_harness.harness.engines.checked import CheckedEngine
    from gemma4_harness.harness.engines.numerics import emulate
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.engines.variants import VARIANTS, under
    from gemma4_harness.harness.parity.checks.oracle_pass import reference_pass

    prompts = [{"id": "p", "prompt_ids": PROMPTS[2]}]
    args = ({}, [()], prompts, [], [], 1, 1, False)

    def logits(got: dict) -> np.ndarray:
        return got["result"].logits[((), "p")][0]

    plain = logits(remote._group_pass(str(model), *args))
    spec = logits(remote._group_pass(str(model), *args, spec=("norm_plus_one",)))
    with under([VARIANTS["norm_plus_one"]], fast=False):
        here = reference_pass(CheckedEngine(ReferenceEngine(model), "reference"), [()], prompts, [], [], 1, 1, False,
                              emulate).logits[((), "p")][0]
    assert np.array_equal(spec, here)
    assert np.abs(spec - plain).max() > 1e-3  # the variant changes this model's logits: the check can fail


def test_jobs_above_one_with_an_address_is_bad_input(model, prompt_file, tmp_path, capsys):
    # refused before the cluster is reached: the address is one where nothing answers, and the line names --jobs
    rc, data, err = _parity(capsys, model, prompt_file, tmp_path, "--address", "127.0.0.1:1", "--jobs", "2",
                            "--quiet")
    assert rc == 2 and not data
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].count("--jobs 2 with --address 127.0.0.1:1"), err


def test_a_run_without_an_address_does_not_import_ray(model, prompt_file, tmp_path):
    # a whole g4h parity job in a process of its own (this one has imported Ray): Ray is imported only where a
    # cluster is asked for (remote._load_ray)
    code = ("import json, sys\nfrom gemma4_harness.harness.cli import main\n"
            f"rc = main(['parity', '--model', {str(model)!r}, '--against', 'fast', '--prompts', {str(prompt_file)!r}, "
            f"'--quick', '--max-new-tokens', '1', '--out', {str(tmp_path)!r}, '--explain-budget', '0', '--quiet'])\n"
            "print(json.dumps({'rc': rc, 'ray': sorted(m for m in sys.modules if m == 'ray' or "
            "m.startswith('ray.'))[:3]}))\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    last = json.loads(got.stdout.strip().splitlines()[-1])
    assert last == {"rc": 0, "ray": []}, last
