"""Issue 37, item 1: nothing a resumed sweep reads back from its run folder can run code. A run folder may be
shared or crafted: its bases are NPZ read with ``allow_pickle=False`` and checked like any input (one line, exit 2);
a pickle left in it is refused, never loaded."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from gemma4_harness.harness.sweep.store import RunDir, base_from_npz, base_to_npz
from gemma4_harness.reference.errors import InputError

KEY = "0123456789abcdef"


class _Marker:
    """Unpickling this writes a marker file (what a crafted base would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "executed"))


def _run_folder(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    (d / "base").mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps({"schema": "g4h-sweep-plan", "models": [str(tmp_path / "m.gguf")],
                                             "options": {"against": ["fast"]}}))
    return d


def _g4h(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", *args], capture_output=True, text=True, env=env, check=False,
                          timeout=120)


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _crafted(marker: Path) -> dict[str, bytes]:
    """Run-folder files that would run code if read with pickle (each must be refused, nothing executed)."""
    payload = pickle.dumps(_Marker(str(marker)))
    obj = np.empty(1, dtype=object)
    obj[0] = _Marker(str(marker))
    buf = io.BytesIO()
    np.save(buf, obj, allow_pickle=True)
    return {
        f"{KEY}.pkl": payload,  # an older harness's base, or a crafted one
        f"{KEY}.npz": _npz(meta=obj),  # an object array inside an NPZ: needs pickle to load
        f"{KEY}.npy": buf.getvalue(),
    }


@pytest.mark.parametrize("name", list(_crafted(Path("x"))))
def test_a_crafted_run_folder_runs_nothing_and_is_bad_input(tmp_path, name):
    marker = tmp_path / "marker"
    d = _run_folder(tmp_path)
    (d / "base" / name).write_bytes(_crafted(marker)[name])
    p = _g4h("sweep", "--resume", str(d))
    assert not marker.exists(), "a crafted run folder ran code"
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(d / "base" / name) in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_the_crafted_pickle_does_run_code_when_unpickled(tmp_path):
    """The test above can fail: the payload writes its marker when something does unpickle it."""
    marker = tmp_path / "marker"
    pickle.loads(_crafted(marker)[f"{KEY}.pkl"])
    assert marker.read_text() == "executed"


@pytest.mark.parametrize("plan, key", [
    ({"schema": "g4h-sweep-plan", "models": "x.gguf", "options": {}}, "'models'"),
    ({"schema": "g4h-sweep-plan", "models": ["x.gguf"], "options": []}, "'options'"),
    ({"schema": "g4h-sweep-plan", "models": ["x.gguf"], "options": {"top_n": "9"}}, "'options.top_n'"),
    ({"schema": "g4h-sweep-plan", "models": ["x.gguf"], "options": {"against": 5}}, "'options.against'"),
    ([1, 2], "not a g4h sweep plan"),
])
def test_a_crafted_plan_is_one_line(tmp_path, plan, key):
    d = tmp_path / "run"
    d.mkdir()
    (d / "plan.json").write_text(json.dumps(plan))
    p = _g4h("sweep", "--resume", str(d))
    assert p.returncode == 2 and key in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def _base() -> dict:
    rng = np.random.default_rng(0)
    return {"file": "m.gguf", "engine": "reference", "logits": {"a": rng.normal(size=(3, 7)), "b": rng.normal(size=(2, 7))},
            "trace_prompt": "b", "layers": {0: rng.normal(size=(2, 4)).astype(np.float32)},
            "greedy": {"a": {"tokens": [1, 2], "top": [[1, 3], [2, 4]]}}, "seconds": 1.5, "peak_rss_gb": 0.1,
            "where": {"host": "h"}}


def test_a_base_round_trips_without_pickle(tmp_path):
    rd = RunDir(tmp_path)
    base = _base()
    rd.save_base(KEY, base)
    with np.load(rd.base_file(KEY), allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    got = rd.load_base(KEY)
    assert got.keys() == base.keys()
    for k in base["logits"]:
        assert np.array_equal(got["logits"][k], base["logits"][k])
    assert np.array_equal(got["layers"][0], base["layers"][0]) and got["greedy"] == base["greedy"]
    assert rd.load_base("f" * 16) is None


@pytest.mark.parametrize("edit, what", [
    (lambda a: a.update(logits_0=np.full((3, 7), np.nan)), "non-finite"),
    (lambda a: a.pop("logits_1"), "members"),
    (lambda a: a.update(meta=np.frombuffer(b"{not json", np.uint8)), "not UTF-8 JSON"),
    (lambda a: a.update(logits_0=np.zeros(3)), "expected float [T, V]"),
])
def test_a_doctored_base_is_one_line(tmp_path, edit, what):
    with np.load(io.BytesIO(base_to_npz(_base())), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    edit(arrays)
    f = tmp_path / f"{KEY}.npz"
    f.write_bytes(_npz(**arrays))
    with pytest.raises(InputError, match=re.escape(what)), np.load(f, allow_pickle=False) as z:
        base_from_npz(z, f)
