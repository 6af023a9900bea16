"""The distribution: the wheel holds everything an installed ``g4h`` reads, and an installed ``g4h`` works from an
empty folder without writing inside its environment.

The wheel is built from a copy of the files a build reads (``pyproject.toml``, ``setup.py``, ``MANIFEST.in``, the
three packages, ``cases/``: tests/conftest.py's ``wheel``, which tests/test_namespace.py installs too), so the test
writes nothing into the clone. The slow test installs it into a fresh
virtualenv whose dependencies come from this test environment's ``site-packages`` (one path line in a ``.pth``:
pip resolves nothing and downloads nothing, and ``pip check`` still proves the wheel's requirements are met; the
editable install of this clone is not on that path, because a ``.pth`` file inside a directory added by a path
line is not processed), runs ``g4h synth e2b`` and ``g4h parity --case e2b --no-real`` from an empty folder with
an empty ``HOME``, and compares a listing of the virtualenv and of the shared ``site-packages`` (every file and
folder with its size and mtime) before and after. ``--no-real`` keeps the test near a minute and a half (the real
Gemma 3 and tokenizer cases take minutes of CPU; the wheel's copy of their data is checked file by file here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _files_under(root: Path) -> set[str]:
    """Every file under ``root`` (relative, POSIX), hidden files and Python caches left out (setup.py's rule)."""
    out = set()
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        out |= {Path(dirpath, f).relative_to(root).as_posix() for f in files if not f.startswith(".")}
    return out


def test_wheel_holds_the_case_library_kernel_sources_and_entry_points(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    cases = _files_under(REPO / "cases")
    assert {"data/gemma3-tokenizer/tokenizer.model", "tokenizer/gemma4_chat_template.jinja",
            "prompts/synthetic.jsonl", "models/e2b.toml", "shapes/e2b.toml"} <= cases
    missing = sorted(f for f in cases if f"gemma4_harness/harness/_cases/{f}" not in names)
    assert not missing, f"files of cases/ missing from the wheel: {missing[:10]}"
    bundled = "gemma4_harness/harness/_cases/"
    extra = sorted(n for n in names if n.startswith(bundled) and n[len(bundled):] not in cases)
    assert not extra, f"files in the wheel's case library that cases/ does not hold: {extra[:10]}"
    csrc = {p.name for p in (REPO / "fast" / "csrc").iterdir() if p.suffix in (".c", ".h")}
    assert {"linear_quant.c", "linear_q8.c", "linear_f32.c", "rows_f32.c", "workpool.h", "fp16.h"} <= csrc
    assert {f"gemma4_harness/fast/csrc/{n}" for n in csrc} <= names
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry = zipfile.ZipFile(wheel).read(meta).decode()
    assert "g4h = gemma4_harness.harness.cli:main" in entry and "[pytest11]" in entry and "gemma4_harness.harness.pytest_plugin" in entry
    assert not any(n.startswith(("tests/", "reports/", "docs/")) for n in names)
    # one top-level import name (docs/architecture.md, "One import name"): nothing an engine repository's own
    # harness/, reference/ or fast/ folder could shadow
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"gemma4_harness"}


def _listing(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``roots``: path -> (size, mtime_ns). A folder's mtime changes when an entry is
    created or removed in it, so a file written and deleted again shows too."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in [""] + files:
                p = Path(dirpath, name)
                st = p.lstat()
                out[str(p)] = (st.st_size if name else 0, st.st_mtime_ns)
    return out


def _changes(before: dict, after: dict) -> list[str]:
    return sorted([f"added {p}" for p in after.keys() - before.keys()]
                  + [f"removed {p}" for p in before.keys() - after.keys()]
                  + [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]])


@pytest.mark.slow
def test_installed_wheel_runs_from_an_empty_folder_and_writes_nothing_in_its_environment(wheel, tmp_path):
    venv, home, work = tmp_path / "venv", tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    shared = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "g4h_test_dependencies.pth").write_text("".join(f"{p}\n" for p in shared))
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    proc = subprocess.run(pip + ["install", "--no-index", "--no-deps", "--force-reinstall", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = subprocess.run(pip + ["check"], capture_output=True, text=True, timeout=120)
    assert "gemma4-harness" not in check.stdout.lower(), check.stdout

    env = {k: v for k, v in os.environ.items()
           if k not in ("G4H_CACHE", "XDG_CACHE_HOME", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HOME=str(home), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")

    def run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)

    where = run("python", "-c", "import gemma4_harness.harness as h, gemma4_harness.fast.paths as p; print(h.__file__); "
                "print(p.CASES_DIR); "
                "print(p.cache_root())")
    assert where.returncode == 0, where.stderr
    pkg, cases, cache = where.stdout.split()
    assert Path(pkg).is_relative_to(site) and Path(cases) == site / "gemma4_harness" / "harness" / "_cases", where.stdout
    assert Path(cache) == home / ".cache" / "gemma4-harness"

    before = _listing(venv, *map(Path, shared))
    synth = run("g4h", "synth", "e2b")
    assert synth.returncode == 0, synth.stderr[-3000:]
    assert f"{cache}/synth/e2b-" in synth.stdout, synth.stdout

    skip = ["--skip", "llamacpp"] if os.environ.get("G4H_SKIP_LLAMACPP", "") not in ("", "0") else []
    parity = run("g4h", "parity", "--case", "e2b", "--no-real", "--quiet", *skip)
    assert parity.returncode == 0, parity.stdout[-4000:] + parity.stderr[-3000:]
    assert "PASS: every gate passed" in parity.stdout
    (report,) = (work / "reports").glob("*-parity/report.md")
    assert sorted(p.name for p in work.iterdir()) == ["reports"]
    assert (Path(cache) / "kernels").is_dir(), "the packed CPU kernels were compiled into the user cache"

    changes = _changes(before, _listing(venv, *map(Path, shared)))
    assert not changes, f"{len(changes)} entries written inside the environment: {changes[:20]}"
