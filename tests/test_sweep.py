"""``g4h sweep`` on Ray: two nodes on this machine (two ``ray start`` processes, through
:class:`harness.core.cluster.LocalCluster`), eight llama-quantize types of one tiny model and a second model on
fast and llama.cpp, dead tasks as rows, a wrong engine caught and a right one passed, resuming, and no Ray process
outliving the command.

The parts that need no cluster are in ``tests/test_sweep_parts.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("G4H_SKIP_LLAMACPP") == "1":
    pytest.skip("opted out with G4H_SKIP_LLAMACPP=1 (the sweep runs llama.cpp and its quantizer)",
                allow_module_level=True)
pytest.importorskip("ray", reason="g4h sweep needs Ray: pip install 'gemma4-harness[sweep]' (a test extra)")

import sweep_models as models  # noqa: E402
from ray import exceptions as rex  # noqa: E402

from gemma4_harness.harness.core.paths import REPO_ROOT  # noqa: E402
from gemma4_harness.harness.core import cluster  # noqa: E402
from gemma4_harness.harness.sweep.files import describe, group_files  # noqa: E402
from gemma4_harness.harness.sweep.progress import Progress  # noqa: E402
from gemma4_harness.harness.sweep.run import SweepOptions, _Sweep, dead_row, run_sweep  # noqa: E402
from gemma4_harness.harness.sweep.store import ROWS, RunDir  # noqa: E402

STUB = f"cmd:{sys.executable} {REPO_ROOT / 'tests' / 'cmd_stub.py'}"

#: The prompt set of these tests: the BOS-only prompt (greedy only), a short one, the window's edge, twice the window.
PROMPTS = [[2], [2, 127, 198, 237, 126], [2, 169, 23, 254, 172, 81, 60, 73, 157, 146, 110, 83, 140, 11, 48],
           [2] + [(7 * i + 3) % 380 + 4 for i in range(31)]]

#: Damage tiers of the eight types by bits per weight: every tier must show more mean KLD than the one before, for
#: each engine. Types inside a tier (4.25 to 4.9 bpw) may come in any order: their mixes differ more than their bits.
TIERS = [("F32",), ("Q8_0",), ("Q6_K",), ("Q5_K_M",), ("Q4_K_M", "Q4_0", "IQ4_XS"), ("Q3_K_M",), ("Q2_K",)]


@pytest.fixture(scope="module")
def files():
    a = models.build("sweep-a", models.SPEC_A)
    b = models.build("sweep-b", models.SPEC_B)
    return {"a": a, "b": b, "quants": models.quantized(a)}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "sweep.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": ids}) + "\n" for i, ids in enumerate(PROMPTS)))
    return p


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this machine, one CPU each, for the module's tests (stopped at its end)."""
    with cluster.LocalCluster(nodes=2, cpus=2, object_store_bytes=200 * 2**20) as c:
        yield c.address


def _opts(address, prompt_file, **kw):
    base = dict(against=["fast", "llamacpp"], prompts=str(prompt_file), new_tokens=4, address=address, quiet=True,
                task_timeout=600.0)
    return SweepOptions(**{**base, **kw})


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / ROWS).read_text().splitlines()]


@pytest.fixture(scope="module")
def sweep(files, prompt_file, two_nodes, tmp_path_factory):
    a, b, q = files["a"], files["b"], files["quants"]
    models_ = [str(a.gguf["F32"]), str(q["Q8_0"].parent / "*.gguf"), str(b.gguf["F32"]), str(b.gguf["BF16"]),
               str(b.gguf["Q4_0"])]
    out = tmp_path_factory.mktemp("runs")
    data, status = run_sweep(models_, _opts(two_nodes, prompt_file), out=out)
    return data, status, Path(data["run_dir"])


def test_two_groups_eight_types_two_engines_on_two_nodes(sweep, files):
    data, status, run_dir = sweep
    assert status == 0, [(r["label"], r["engine"], r["reason"]) for r in data["rows"] if r["status"] != "ok"]
    rows = data["rows"]
    assert len(rows) == (1 + len(models.TYPES) + 3) * 2
    not_run = [(r["label"], r["engine"]) for r in rows if r["status"] != "ok"]
    assert not_run == [("IQ4_XS", "fast")]  # fast decodes no i-quant: a declared limit, a row with its reason
    iq4 = next(r for r in rows if r["status"] != "ok")
    assert iq4["declared"] and "IQ4_XS" in iq4["reason"]
    # both nodes ran rows
    assert {r["node"] for r in rows if r["status"] == "ok"} == {n["node"][:8] for n in data["nodes"]}
    assert len(data["nodes"]) == 2
    # two groups, each measured against its own highest-precision file
    bases = {Path(g["base"]).name for g in data["groups"]}
    assert bases == {"sweep-a-F32.gguf", "sweep-b-F32.gguf"}
    # damage grows as bits per weight fall, tier by tier, on both engines
    a_rows = [r for r in rows if r["group"].startswith("gemma4-4L") and r["status"] == "ok"]
    for engine in ("fast", "llamacpp"):
        kld = {r["label"]: r["mean_kld"] for r in a_rows if r["engine"] == engine}
        tiers = [[kld[t] for t in tier if t in kld] for tier in TIERS]
        for lo, hi in zip(tiers, tiers[1:]):
            assert max(lo) < min(hi), (engine, kld)
    # the engines agree on every file both ran, each pair by its gate
    assert len(data["agreements"]) == len(models.TYPES) + 3  # group a: F32 and 7 types (IQ4_XS: one engine); b: 3
    assert all(a["passed"] and not a["informational"] for a in data["agreements"]), data["agreements"]
    f32 = next(a for a in data["agreements"] if a["label"] == "F32" and a["group"].startswith("gemma4-4L"))
    assert f32["gate"] == "sweep~engines.mean_kld"
    assert {a["gate"] for a in data["agreements"] if a["label"] != "F32"} == {"sweep~engines_q8.mean_kld_ratio"}
    assert all(g["sensitivity"]["status"] == "ok" for g in data["groups"])
    # the run directory
    csv = (run_dir / "sweep.csv").read_text().splitlines()
    assert len(csv) == len(rows) + 1 and csv[0].startswith("group,file,label")
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# g4h sweep: PASS") and "Rows, by damage" in report
    for png in ("kld_vs_bpw", "first_divergence"):
        name = next(g["plots"] for g in data["groups"])["kld" if png == "kld_vs_bpw" else "divergence"]
        assert name and name.startswith(png)
    for g in data["groups"]:
        for name in g["plots"].values():
            assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((run_dir / "pending").iterdir())  # every file's engine logits compared and dropped
    assert json.loads((run_dir / "results.json").read_text())["schema"] == "g4h-sweep"


def test_rows_carry_the_figures_the_report_promises(sweep):
    data, _, _ = sweep
    q4 = next(r for r in data["rows"] if r["label"] == "Q4_K_M" and r["engine"] == "llamacpp")
    for k in ("mean_kld", "mean_kld_unc", "kld_p99_0", "same_top_p_pct", "rms_dp_pct", "mean_ppl_ratio",
              "greedy_identical_pct", "greedy_agree_pct", "layer_rel_l2", "seconds", "peak_rss_gb", "memory_gb",
              "cpus"):
        assert q4[k] is not None, k
    assert set(q4["kld"]) >= {"kld_p99_9", "kld_p0_1", "median_kld", "minimum_kld", "dp_pct_p95_0"}
    assert len(q4["layer_rel_l2"]) == 4 and q4["cpus"] == 1 and q4["memory_gb"] > 0
    f32 = next(r for r in data["rows"] if r["label"] == "F32" and r["engine"] == "fast" and r["is_base"])
    assert f32["mean_kld"] < 1e-9 and f32["first_divergence_layer"] is None and f32["greedy_identical_pct"] == 100


def test_resume_runs_only_what_is_missing(sweep, prompt_file, two_nodes):
    data, _, run_dir = sweep
    lines = _lines(run_dir)
    again, status = run_sweep(None, _opts(two_nodes, prompt_file), resume=run_dir)
    assert status == 0 and len(_lines(run_dir)) == len(lines)  # nothing ran again
    assert [r["key"] for r in again["rows"]] == [r["key"] for r in data["rows"]]
    # an interrupted sweep: the last rows of two files never written
    rows = [x for x in lines if x["kind"] == "row" and x["status"] == "ok"]
    lost = {rows[-1]["key"], rows[-2]["key"]}
    keep = [x for x in lines if x["key"] not in lost]
    (run_dir / ROWS).write_text("".join(json.dumps(x) + "\n" for x in keep))
    again, status = run_sweep(None, _opts(two_nodes, prompt_file), resume=run_dir)
    new = _lines(run_dir)[len(keep):]
    assert status == 0 and {x["key"] for x in new if x["kind"] == "row"} == lost
    assert len(again["rows"]) == len(data["rows"])
    # killed between a file's rows and their comparison: that file's rows run again, and the comparison is made
    lines = _lines(run_dir)
    gone = next(x for x in lines if x["kind"] == "agreement" and x["label"] == "Q6_K")
    (run_dir / ROWS).write_text("".join(json.dumps(x) + "\n" for x in lines if x["key"] != gone["key"]))
    again, status = run_sweep(None, _opts(two_nodes, prompt_file), resume=run_dir)
    new = _lines(run_dir)[len(lines) - 1:]
    assert status == 0 and sorted((x["label"], x["engine"]) for x in new if x["kind"] == "row") == [
        ("Q6_K", "fast"), ("Q6_K", "llamacpp")]
    assert [x["key"] for x in new if x["kind"] == "agreement"] == [gone["key"]]


def test_dead_tasks_are_rows_and_the_sweep_goes_on(files, prompt_file, two_nodes, tmp_path):
    f = [str(files["quants"]["Q4_K_M"])]
    engines = ["fast", f"{STUB} --fault kill-parent", f"{STUB} --fault die", f"{STUB} --fault hang"]
    data, status = run_sweep(f, _opts(two_nodes, prompt_file, against=engines, task_timeout=30.0), out=tmp_path)
    assert status == 1
    by = {(r["label"], r["engine"]): r for r in data["rows"]}
    for label in ("Q4_K_M",):
        assert by[(label, "fast")]["status"] == "ok"
        killed = by[(label, engines[1])]
        assert killed["status"] == "crashed" and "Ray worker running it died" in killed["reason"], killed
        died = by[(label, engines[2])]
        assert died["status"] == "crashed" and "simulated crash" in died["reason"], died
        hung = by[(label, engines[3])]
        assert hung["status"] == "timeout" and "--task-timeout 30" in hung["reason"], (hung["status"], hung["reason"])
    report = (Path(data["run_dir"]) / "report.md").read_text()
    assert report.startswith("# g4h sweep: FAIL") and "Ray worker running it died" in report


def test_a_wrong_engine_is_caught_and_a_right_one_passes(files, prompt_file, two_nodes, tmp_path):
    f = [str(files["a"].gguf["F32"]), str(files["quants"]["Q8_0"])]
    right, wrong = STUB, f"{STUB} --perturb-layer 2"
    data, status = run_sweep(f, _opts(two_nodes, prompt_file, against=["fast", right, wrong], new_tokens=0),
                             out=tmp_path)
    assert status == 1 and all(r["status"] == "ok" for r in data["rows"])
    verdict = {(a["label"], *a["engines"]): a for a in data["agreements"]}
    for label in ("F32", "Q8_0"):
        ok = verdict[(label, "fast", right)]
        assert ok["passed"] and ok["gate"] == "sweep~engines.mean_kld", ok  # fp32 vs float64 on the same file
        for pair in ((label, "fast", wrong), (label, right, wrong)):
            assert not verdict[pair]["passed"], verdict[pair]
    # the wrong engine's own row shows where: its first divergent layer is the perturbed one or later
    bad = next(r for r in data["rows"] if r["engine"] == wrong and r["label"] == "F32")
    assert bad["first_divergence_layer"] is None or bad["first_divergence_layer"] >= 2


def _ray_processes_of(tmp_dir_prefix: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if tmp_dir_prefix in cmd:
                out.append(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find Ray's processes")
def test_the_local_cluster_lives_and_dies_with_the_command(files, prompt_file, tmp_path):
    # a parent folder of this test's own (Ray's RAY_TMPDIR, short for Ray's socket paths): a sweep of another
    # test running beside this one under xdist makes its g4h-ray-* folder in /tmp, not here (CI's stop 42 failure)
    parent = Path(tempfile.mkdtemp(prefix="g4ht", dir="/tmp"))
    cmd = [sys.executable, "-m", "gemma4_harness.harness.cli", "sweep", str(files["quants"]["Q4_0"]), "--prompts", str(prompt_file),
           "--max-new-tokens", "2", "--out", str(tmp_path), "--cpus", "1", "--against"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(parent)
    p = subprocess.run(cmd + ["fast"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "local Ray cluster: 1 node(s)" in p.stderr and "PASS (exit 0)" in p.stdout
    assert not list(parent.iterdir())  # its temporary folder went with it
    # killed outright mid-run: the keeper still stops every Ray process it started
    proc = subprocess.Popen(cmd + [f"{STUB} --fault hang"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        seen = ""
        while "submitted" not in seen and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
        assert "submitted" in seen, seen
        tmp_dirs = set(parent.glob("g4h-ray-*"))
        assert len(tmp_dirs) == 1 and _ray_processes_of(str(next(iter(tmp_dirs))))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        tmp_dir = next(iter(tmp_dirs))
        deadline = time.monotonic() + 30
        while (_ray_processes_of(str(tmp_dir)) or tmp_dir.exists()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ray_processes_of(str(tmp_dir)) and not tmp_dir.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(parent, ignore_errors=True)


def test_dead_task_reasons_name_what_killed_it():
    assert dead_row(rex.TaskCancelledError(), True, 30.0) == (
        "timeout", "ran past --task-timeout 30 s: cancelled (its worker killed)")
    status, reason = dead_row(rex.OutOfMemoryError("Task was killed due to the node running low on memory."),
                              False, None)
    assert status == "oom" and "Ray's memory monitor" in reason and "running low on memory" in reason
    status, reason = dead_row(rex.WorkerCrashedError(), False, None)
    assert status == "crashed" and "Ray worker running it died" in reason
    status, reason = dead_row(rex.NodeDiedError("node 1 died"), False, None)
    assert status == "crashed" and "its node died" in reason


def test_a_task_no_node_can_hold_is_a_row_at_once(files, prompt_file, tmp_path):
    f = describe(files["quants"]["Q4_0"])
    (g,), _ = group_files([f])
    rd = RunDir(tmp_path)
    sw = _Sweep(rd, _opts(None, prompt_file), [g], [], {g.name: [{"id": "p", "prompt_ids": [2, 5, 6, 7]}]},
                Progress(quiet=True))
    sw._submit_row(g, f, "llamacpp", threads=1, most_mem=1e6, tracker=None)  # a node of 1 MB: nothing fits
    (rec,) = rd.records().values()
    assert rec["status"] == "oom" and "llamacpp's memory plan" in rec["reason"] and "largest: 0.00 GB" in rec["reason"]
    assert not sw.tasks  # nothing was submitted to wait forever
