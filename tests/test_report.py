"""harness.core.io: run directories are never reused, writes are atomic, JSON takes numpy values."""

from __future__ import annotations

import json
import os
import re
import threading
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness.core import io as report
from gemma4_harness.harness.core.io import (
    dumps_json,
    markdown_table,
    run_timestamp,
    staged_run_dir,
    write_json_atomic,
    write_text_atomic,
)

RUN_RE = re.compile(r"^\d{8}-\d{6}-parity(-\d+)?$")


def new_run_dir(name, out):
    """A run directory made the way every run makes one (staged, then renamed into place)."""
    with staged_run_dir(name, out) as rd:
        pass
    return rd.final


def test_staged_run_dir_appears_whole_or_not_at_all(tmp_path):
    with staged_run_dir("parity", tmp_path) as rd:
        (rd.path / "results.json").write_text("{}")
        assert rd.path.name.startswith(".tmp-") and rd.final is None
        assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # nothing visible yet
    assert RUN_RE.match(rd.final.name) and (rd.final / "results.json").is_file() and not rd.path.exists()
    with pytest.raises(RuntimeError):
        with staged_run_dir("parity", tmp_path) as failed:
            (failed.path / "results.json").write_text("{}")
            raise RuntimeError("killed")
    assert not failed.path.exists() and failed.final is None
    assert [p.name for p in tmp_path.iterdir()] == [rd.final.name]


def test_stale_temp_dir_of_a_dead_run_is_removed(tmp_path):
    dead = tmp_path / ".tmp-20250101-000000-parity-pid999999-abc"
    dead.mkdir()
    alive = tmp_path / f".tmp-20250101-000000-parity-pid{os.getpid()}-abc"
    alive.mkdir()
    new_run_dir("parity", tmp_path)
    assert not dead.exists() and alive.exists()


# --------------------------------------------------------------------------- run directories


def test_run_dir_name_and_location(tmp_path):
    d = new_run_dir("parity", out=tmp_path)
    assert d.parent == tmp_path.resolve()
    assert d.is_dir() and not any(d.iterdir())
    assert RUN_RE.match(d.name), d.name


def test_run_dir_creates_missing_base(tmp_path):
    d = new_run_dir("x", out=tmp_path / "a" / "b")
    assert d.is_dir() and d.parent == (tmp_path / "a" / "b").resolve()


def test_default_base_is_reports_under_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = new_run_dir("x", None)
    assert d.parent == (tmp_path / "reports").resolve()


def test_same_name_same_second_never_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "run_timestamp", lambda now=None: "20250101-000000")
    dirs = [new_run_dir("parity", out=tmp_path) for _ in range(4)]
    assert [d.name for d in dirs] == [
        "20250101-000000-parity", "20250101-000000-parity-2", "20250101-000000-parity-3", "20250101-000000-parity-4",
    ]
    assert len(set(dirs)) == 4


def test_existing_dir_with_content_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "run_timestamp", lambda now=None: "20250101-000000")
    first = new_run_dir("parity", out=tmp_path)
    (first / "report.md").write_text("old run")
    second = new_run_dir("parity", out=tmp_path)
    assert second != first
    assert (first / "report.md").read_text() == "old run"


def test_real_clock_back_to_back(tmp_path):
    a = new_run_dir("parity", out=tmp_path)
    b = new_run_dir("parity", out=tmp_path)
    assert a != b and a.is_dir() and b.is_dir()


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_concurrent_runs_get_distinct_dirs(tmp_path, monkeypatch, native):
    """Eight threads that finish their runs at once, in the same second, 20 times: 8 distinct directories
    each time (a plain rename onto the other thread's fresh empty directory replaced it, ~1 try in 5)."""
    monkeypatch.setattr(report, "run_timestamp", lambda now=None: "20250101-000000")
    if not native:
        monkeypatch.setattr(report, "_renameat2", lambda: None)
    for round_ in range(20):
        base = tmp_path / str(round_)
        got: list[Path] = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def work():
            start.wait()
            d = new_run_dir("parity", out=base)
            with lock:
                got.append(d)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 8 and len(set(got)) == 8
        assert sorted(p.name for p in base.iterdir()) == sorted(d.name for d in got)


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_rename_never_replaces_an_empty_directory(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(report, "_renameat2", lambda: None)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "results.json").write_text("{}")
    dst.mkdir()
    with pytest.raises(FileExistsError):
        report._rename_no_replace(src, dst)
    assert (src / "results.json").is_file() and dst.is_dir() and not any(dst.iterdir())


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "-lead", "sp ace", ".hidden"])
def test_bad_run_names(tmp_path, bad):
    with pytest.raises(ValueError):
        new_run_dir(bad, out=tmp_path)


def test_out_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(NotADirectoryError):
        new_run_dir("x", out=f)


def test_timestamp_is_utc():
    t = datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
    assert run_timestamp(t) == "20250304-050607"
    assert len(run_timestamp()) == 15


# --------------------------------------------------------------------------- atomic writes


def test_write_text_atomic_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "report.md"
    write_text_atomic(p, "one")
    write_text_atomic(p, "two ✓")
    assert p.read_text(encoding="utf-8") == "two ✓"
    assert sorted(os.listdir(tmp_path)) == ["report.md"]


def test_write_text_atomic_mode_follows_umask(tmp_path):
    old = os.umask(0o022)
    try:
        p = write_text_atomic(tmp_path / "r.md", "x")
    finally:
        os.umask(old)
    assert (p.stat().st_mode & 0o777) == 0o644


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "results.json"
    write_text_atomic(p, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(p, "new")
    assert p.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_unserialisable_json_writes_nothing(tmp_path):
    p = tmp_path / "results.json"
    write_json_atomic(p, {"ok": 1})
    with pytest.raises(TypeError, match=r"\$\.bad"):
        write_json_atomic(p, {"bad": object()})
    assert json.loads(p.read_text()) == {"ok": 1}
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_write_into_missing_folder_raises(tmp_path):
    """One line naming the path (an OutputError: an OSError, and bad input to the CLI)."""
    with pytest.raises(OSError, match=r"nope/a\.md: cannot write output \(No such file or directory\)"):
        write_text_atomic(tmp_path / "nope" / "a.md", "x")


def test_write_text_rejects_bytes(tmp_path):
    with pytest.raises(TypeError):
        write_text_atomic(tmp_path / "a", b"x")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- JSON


def test_json_numpy_values(tmp_path):
    obj = {
        "f64": np.float64(1.5),
        "f32": np.float32(0.25),
        "i64": np.int64(7),
        "u8": np.uint8(255),
        "b": np.bool_(True),
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3),
        "iarr": np.array([1, 2], dtype=np.int32),
        "scalar_arr": np.array(3.0),
        "tuple": (1, np.int16(2)),
        "path": Path("/x/y"),
        "nested": [{"z": np.float16(0.5)}],
        1: "int key",
    }
    p = write_json_atomic(tmp_path / "results.json", obj)
    back = json.loads(p.read_text())
    assert back == {
        "f64": 1.5, "f32": 0.25, "i64": 7, "u8": 255, "b": True,
        "arr": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "iarr": [1, 2], "scalar_arr": 3.0,
        "tuple": [1, 2], "path": "/x/y", "nested": [{"z": 0.5}], "1": "int key",
    }
    assert isinstance(back["i64"], int) and isinstance(back["b"], bool)


def test_json_sorted_indented_strict(tmp_path):
    text = dumps_json({"b": 1, "a": [np.nan, np.inf, -np.inf, float("nan")]})
    assert text.index('"a"') < text.index('"b"')
    assert text.endswith("\n") and '\n  "a": [' in text
    assert json.loads(text) == {"a": ["NaN", "Infinity", "-Infinity", "NaN"], "b": 1}
    assert "NaN," not in text.replace('"NaN",', "")  # no bare NaN tokens: strict JSON


def test_json_float32_exact_roundtrip():
    x = np.float32(0.1)
    assert json.loads(dumps_json(x)) == float(x)


def test_json_dataclass():
    import dataclasses

    @dataclasses.dataclass
    class R:
        name: str
        err: np.float64

    assert json.loads(dumps_json(R("c", np.float64(2e-5)))) == {"name": "c", "err": 2e-5}


def test_json_rejects_complex():
    with pytest.raises(TypeError):
        dumps_json({"c": np.complex64(1 + 2j)})


# --------------------------------------------------------------------------- markdown


def test_markdown_table():
    rows = [
        {"case": "e2b", "gate": "max_abs", "value": 1.23456789e-5, "pass": True},
        {"case": "31b|x", "gate": "rel_l2", "value": 2, "pass": False, "extra": "ignored"},
        {"case": "multi\nline"},
    ]
    t = markdown_table(rows, ["case", "gate", "value", "pass"])
    lines = t.rstrip("\n").split("\n")
    assert len(lines) == 5
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["case", "gate", "value", "pass"]
    assert lines[1].split("|")[3].strip().endswith(":")  # numeric column right-aligned
    assert "1.23457e-05" in lines[2] and "True" in lines[2]
    assert "31b\\|x" in lines[3] and "ignored" not in t
    assert "multi line" in lines[4]
    assert len({len(line) for line in lines}) == 1  # padded columns


def test_markdown_table_empty_rows_and_errors():
    assert markdown_table([], ["a"]).count("\n") == 2
    with pytest.raises(ValueError):
        markdown_table([{"a": 1}], [])
    with pytest.raises(TypeError):
        markdown_table([1], ["a"])  # type: ignore[list-item]


def test_dataframe_markdown():
    import pandas as pd

    df = pd.DataFrame([{"case": "31b|x", "value": 1.23456789e-5, "n": 3, "note": None, "fig": "1e-3"},
                       {"case": "multi\nline", "value": float("nan"), "n": 4, "note": "ok", "fig": "2"}])
    t = report.dataframe_markdown(df, right=["fig"])
    lines = t.rstrip("\n").split("\n")
    assert t.endswith("\n") and len(lines) == 4
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["case", "value", "n", "note", "fig"]
    align = [c.strip() for c in lines[1].strip("|").split("|")]
    assert [a.endswith(":") for a in align] == [False, True, True, False, True]  # numeric + asked: right
    cells = [c.strip() for c in lines[2].strip("|").split(" | ")]
    assert cells == ["31b\\|x", "1.23457e-05", "3", "", "1e-3"]  # pipe escaped, None empty, strings verbatim
    assert "multi line" in lines[3] and "nan" in lines[3]  # one line per row; NaN in a float column is a value
    assert len({len(line) for line in lines}) == 1  # padded columns
    assert report.dataframe_markdown(pd.DataFrame(columns=["a", "b"])).count("\n") == 2
    with pytest.raises(ValueError):
        report.dataframe_markdown(pd.DataFrame())


def test_dataframe_markdown_without_tabulate_falls_back(monkeypatch):
    import sys

    import pandas as pd

    monkeypatch.setitem(sys.modules, "tabulate", None)  # import tabulate -> ImportError
    df = pd.DataFrame([{"case": "a|b", "value": 1.5}])
    assert report.dataframe_markdown(df) == markdown_table([{"case": "a|b", "value": 1.5}], ["case", "value"])
