"""One import name: the harness installs as ``gemma4_harness`` only, so an engine repository's own ``harness/``,
``reference/`` and ``fast/`` packages neither shadow ours nor are shadowed by them (docs/architecture.md, "One
import name").

The wheel's top-level names are ``gemma4_harness`` and its ``.dist-info``. The wheel, and an editable install of a
copy of the checkout, each go into a fresh virtualenv whose dependencies are this environment's (a folder of links
to its ``site-packages`` entries, this project's own install left out: nothing is resolved or downloaded). From an
engine repository holding its own ``harness/``, ``fast/`` (whose ``__init__`` raises if imported) and
``reference/`` (imported by the repository's own test, which checks it got its own), ``python -m pytest``: without
our options it starts and passes; with ``--g4h-model tiny.gguf --g4h-against fast`` our items pass; against a
``cmd:`` engine with noise in one layer's FFN it fails with exit 1. In a checkout, a folder name is refused
(``import harness``: ImportError; ``harness.cli`` run with ``python -m``: one line naming the command to run,
exit 2), so no module is ever loaded under two names, and ``python -m gemma4_harness`` is ``g4h``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STUB = REPO / "tests" / "cmd_stub.py"
OURS = ("gemma4_harness", "harness", "reference", "fast", "__editable__")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "G4H_TEST"))
           and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def deps(tmp_path_factory) -> Path:
    """This environment's installed packages, as links, without this project's own install: the entries of every
    folder on ``sys.path`` but the standard library's and this clone's sources (a virtualenv inside the clone, as
    nox makes it under ``.nox/``, is an environment: its site-packages count; the first of a name wins, as on
    import)."""
    farm = tmp_path_factory.mktemp("deps")
    stdlib = [Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")]
    for entry in sys.path:
        folder = Path(entry or ".").resolve()
        ours = folder.is_relative_to(REPO) and "site-packages" not in folder.parts
        if not folder.is_dir() or ours or folder == farm or any(
                folder.is_relative_to(s) and "site-packages" not in folder.parts for s in stdlib):
            continue
        for item in folder.iterdir():
            if not item.name.startswith(OURS) and not item.name.endswith(".pth") and not (farm / item.name).exists():
                (farm / item.name).symlink_to(item)
    return farm


def _venv(where: Path, deps: Path, *install: str) -> Path:
    """A fresh virtualenv at ``where`` with ``deps`` on its path and ``pip install --no-deps INSTALL`` done."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = Path(subprocess.run([str(where / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "g4h_test_dependencies.pth").write_text(f"{deps}\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"), "install",
                           "--no-index", "--no-deps", "--no-build-isolation", "-q", *install],
                          capture_output=True, text=True, timeout=300, env=_clean_env())
    # (without PYTHONPATH: a checkout on it holds gemma4_harness.egg-info, and pip, run under the new interpreter,
    # took that for an installed gemma4-harness and installed nothing)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "bin"


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request, wheel_source, deps, tmp_path_factory) -> tuple[str, Path, Path]:
    """(kind, the virtualenv's bin folder, where its gemma4_harness.harness must come from); the wheel and the build
    inputs are tests/conftest.py's (``wheel``, ``wheel_source``)."""
    where = tmp_path_factory.mktemp(f"venv-{request.param}")
    if request.param == "wheel":
        whl = request.getfixturevalue("wheel")
        bin_ = _venv(where, deps, str(whl))
        return request.param, bin_, where
    return request.param, _venv(where, deps, "-e", str(wheel_source)), wheel_source


@pytest.fixture()
def engine_repo(tmp_path, tiny_gguf) -> Path:
    """An engine author's repository: its own harness/, reference/ and fast/ packages, a test of its own, a tiny
    gemma4 GGUF and a prompt set for its 32-token vocabulary."""
    repo = tmp_path / "engine"
    for name in ("harness", "fast"):
        (repo / name).mkdir(parents=True)
        (repo / name / "__init__.py").write_text(
            f"raise RuntimeError('the engine repository\\'s own {name} package was imported')\n")
    (repo / "reference").mkdir()
    (repo / "reference" / "__init__.py").write_text("OWN = 'the engine repository'\n")
    (repo / "test_engine.py").write_text(
        "import os\n\nimport reference\n\n\ndef test_its_own_reference():\n"
        "    assert reference.OWN == 'the engine repository'\n"
        "    assert os.path.dirname(os.path.dirname(reference.__file__)) == os.path.dirname(__file__)\n")
    (repo / "m.gguf").write_bytes(tiny_gguf.read_bytes())
    (repo / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"p{n}", "prompt_ids": [2] + [(7 * k + n) % 31 + 1 for k in range(n)]}) + "\n"
        for n in (4, 9)))
    return repo


def test_the_wheels_only_top_level_name_is_gemma4_harness(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gemma4_harness"}, sorted(tops)
    assert {"gemma4_harness/__init__.py", "gemma4_harness/__main__.py", "gemma4_harness/harness/__init__.py",
            "gemma4_harness/reference/__init__.py", "gemma4_harness/fast/__init__.py",
            "gemma4_harness/harness/pytest_plugin/__init__.py", "gemma4_harness/harness/pytest_plugin/plan.py",
            "gemma4_harness/harness/pytest_plugin/run.py"} <= set(names)


@pytest.mark.slow
def test_the_plugin_from_an_engine_repository_with_its_own_harness_reference_fast(installed, engine_repo):
    kind, bin_, home = installed
    env = _clean_env(PATH=f"{bin_}{os.pathsep}{os.environ.get('PATH', '')}")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_ / "python"), *args], cwd=engine_repo, env=env, capture_output=True,
                              text=True, timeout=600)

    where = run("-c", "import gemma4_harness.harness as h, gemma4_harness.fast.paths as p; print(h.__file__); "
                "print(p.CASES_DIR)")
    assert where.returncode == 0, where.stderr[-3000:]
    ours, cases = map(Path, where.stdout.split())
    assert ours.is_relative_to(home) and (cases / "models" / "e2b.toml").is_file(), (kind, where.stdout)

    pytest_ = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"]
    plain = run(*pytest_)  # (1) an ordinary pytest run: starts, the plugin loaded, the repository's test passes
    out = plain.stdout + plain.stderr
    assert plain.returncode == 0 and "1 passed" in out and "Error while loading" not in out, out[-3000:]
    assert "--g4h-model" in run(*pytest_, "--help").stdout

    opts = ["--g4h-model", "m.gguf", "--g4h-prompts", "prompts.jsonl"]
    good = run(*pytest_, *opts, "--g4h-against", "fast", "-rA")  # (2) our items pass beside the repository's test
    out = good.stdout + good.stderr
    assert good.returncode == 0 and "3 passed" in out and "PASSED m.gguf::reference~fast" in out, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out

    perturbed = "cmd:" + shlex.join([sys.executable, str(STUB), "--perturb-layer", "1"])
    bad = run(*pytest_, *opts, "--g4h-against", perturbed)  # (3) a wrong engine: its item fails, exit 1
    out = bad.stdout + bad.stderr
    assert bad.returncode == 1 and "FAILED m.gguf::reference~cmd" in out, out[-3000:]
    assert "first divergence: ffn_out@1" in out and "INTERNALERROR" not in out

    g4h = subprocess.run([str(bin_ / "g4h"), "--help"], cwd=engine_repo, env=env, capture_output=True, text=True)
    module = run("-m", "gemma4_harness", "--help")
    assert g4h.returncode == module.returncode == 0 and g4h.stdout == module.stdout != "", module.stderr[-2000:]


def _checkout(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` with this checkout on the path (as ``PYTHONPATH=.`` from its root)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_clean_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_in_a_checkout_a_folder_name_is_refused_and_nothing_loads_twice(tmp_path):
    folder_name = ".".join(("harness", "core", "gates"))  # spelt in parts: the rename script leaves it alone
    proc = _checkout("-m", folder_name, "--markdown", "summary", cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["error: the module harness.core.gates is named "
                                        "gemma4_harness.harness.core.gates: run python -m "
                                        "gemma4_harness.harness.core.gates --markdown summary"]
    for name in ("harness", "reference", "fast"):
        proc = _checkout("-c", f"import {name}", cwd=tmp_path)
        assert proc.returncode == 1 and f"ImportError: {name!r} is gemma4-harness's {name}/" in proc.stderr
        assert f"import gemma4_harness.{name} " in proc.stderr, proc.stderr[-2000:]
    code = ("import sys, gemma4_harness.harness.cli.parity, gemma4_harness.harness.engines.fast, "
            "gemma4_harness.harness.pytest_plugin\n"
            "print(gemma4_harness.harness.__file__)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('harness', 'reference', 'fast')))\n"
            "print(len([m for m in sys.modules if m.startswith('gemma4_harness.')]))")
    proc = _checkout("-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, twice, ours = proc.stdout.splitlines()
    assert Path(where) == REPO / "harness" / "__init__.py" and twice == "[]" and int(ours) > 50, proc.stdout
    gates = _checkout("-m", "gemma4_harness.harness.core.gates", "--markdown", "summary", cwd=tmp_path)
    assert gates.returncode == 0 and gates.stdout.startswith("| pair | gates"), gates.stdout[:500] + gates.stderr[-2000:]
    g4h = _checkout("-m", "gemma4_harness", "--help", cwd=tmp_path)
    cli = _checkout("-m", "gemma4_harness.harness.cli", "--help", cwd=tmp_path)
    assert g4h.returncode == cli.returncode == 0 and g4h.stdout == cli.stdout and "usage: g4h" in g4h.stdout
