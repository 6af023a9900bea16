"""The llama.cpp build cache (:mod:`harness.engines.llamacpp.build`): key, lock, wheel surgery, errors, the real cached build."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from clitools import REPO_ROOT
from servers import require_llamacpp

from gemma4_harness.harness.engines.llamacpp import build as lb
from gemma4_harness.harness.engines.llamacpp import build_steps, pins
from gemma4_harness.reference.errors import InputError


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert pins.cache_dir() == tmp_path / "gemma4-harness"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert pins.cache_dir() == Path.home() / ".cache" / "gemma4-harness"


def test_key_is_stable_and_follows_the_flags(monkeypatch, tmp_path):
    k = lb.build_key([])
    assert k == lb.build_key([]) and len(k) == 12 and int(k, 16) >= 0
    assert lb.build_key(["-DGGML_NATIVE=ON"]) != k
    monkeypatch.setenv(lb.EXTRA_FLAGS_ENV, "-DGGML_CUDA=ON")
    assert lb.build_root(cache=tmp_path).name == f"llama.cpp-{lb.LLAMA_CPP_PYTHON_VERSION}-{lb.build_key(['-DGGML_CUDA=ON'])}"


def _run_cli(env_over: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **env_over)
    return subprocess.run([sys.executable, "-m", "gemma4_harness.harness.engines.llamacpp.build", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=120)


def test_missing_cmake_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    p = _run_cli({"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": str(empty)}, "--print-path")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "llamacpp_build: error: cannot build llama.cpp: cmake not found on PATH "
        "(install cmake >= 3.14, e.g. apt-get install cmake or pip install cmake)"]
    # nothing half-built is left behind: only the lock file
    assert [q.name for q in (tmp_path / "cache" / "gemma4-harness").iterdir()] == [lb.build_root(cache=Path("x")).name
                                                                                  + ".lock"]


def test_missing_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-g4h")
    with pytest.raises(lb.BuildError) as ei:
        build_steps.check_tools()
    msg = str(ei.value)
    assert isinstance(ei.value, InputError) and "\n" not in msg
    assert msg == ("cannot build llama.cpp: no C++ compiler found (looked for no-such-compiler-g4h; install one, "
                   "e.g. apt-get install g++, or set CXX)")


def test_bad_sdist_is_refused_and_leaves_nothing(tmp_path):
    fake = tmp_path / pins.SDIST_NAME
    fake.write_bytes(b"not the sdist")
    with pytest.raises(lb.BuildError, match=r"SHA-256 [0-9a-f]{64} is not the one PyPI publishes"):
        build_steps.fetch_sdist(tmp_path / "cache", fake)
    assert not (tmp_path / "cache" / "sdist" / pins.SDIST_NAME).exists()


def _record_ok(whl: Path) -> dict[str, bytes]:
    """Every entry of the wheel, after checking each RECORD line's hash and size."""
    with zipfile.ZipFile(whl) as z:
        files = {n: z.read(n) for n in z.namelist()}
    record = next(n for n in files if n.endswith(".dist-info/RECORD"))
    rows = list(csv.reader(io.StringIO(files[record].decode())))
    assert {r[0] for r in rows} == set(files)
    for name, digest, size in rows:
        if name == record:
            assert digest == "" and size == ""
            continue
        want = base64.urlsafe_b64encode(hashlib.sha256(files[name]).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={want}" and int(size) == len(files[name]), name
    return files


def test_add_files_to_wheel_rewrites_record_and_tag(tmp_path):
    src = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"\x7fELF fake")
    dst = tmp_path / "pkg-1.0-py3-none-linux_x86_64.whl"
    build_steps.add_files_to_wheel(src, dst, {"pkg/lib/libx.so": lib}, tag="py3-none-linux_x86_64")
    files = _record_ok(dst)
    assert files["pkg/lib/libx.so"] == b"\x7fELF fake" and files["pkg/__init__.py"] == b"x = 1\n"
    wheel = files["pkg-1.0.dist-info/WHEEL"].decode().splitlines()
    assert "Tag: py3-none-linux_x86_64" in wheel and "Root-Is-Purelib: false" in wheel
    assert not any(ln in wheel for ln in ("Tag: py3-none-any", "Root-Is-Purelib: true"))


def test_lock_excludes_a_second_holder(tmp_path):
    lock = tmp_path / "x.lock"
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "sys.exit(0 if fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) is None else 1)")
    with build_steps.BuildLock(lock):
        busy = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True)
        assert busy.returncode != 0 and "BlockingIOError" in busy.stderr
    assert subprocess.run([sys.executable, "-c", probe, str(lock)]).returncode == 0


@pytest.fixture(scope="module")
def built():
    """The real cached build (built now when absent: minutes)."""
    try:
        return lb.ensure_built()
    except lb.BuildError as e:
        if require_llamacpp():
            pytest.fail(str(e), pytrace=False)
        pytest.skip(f"opted out with G4H_SKIP_LLAMACPP=1: {e}")


def test_cached_build_is_complete_and_not_rebuilt(built):
    again = lb.ensure_built()
    assert again.root == built.root and again.stamp["built_at"] == built.stamp["built_at"]  # reused, not rebuilt
    assert built.root.name == f"llama.cpp-{lb.LLAMA_CPP_PYTHON_VERSION}-{lb.build_key(lb._extra_from_env())}"
    assert built.stamp["version"] == lb.LLAMA_CPP_PYTHON_VERSION and built.stamp["sdist_sha256"] == lb.SDIST_SHA256
    p = subprocess.run([str(built.server), "--version"], capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ.get("PATH", "")})  # finds its libraries through its run path
    assert p.returncode == 0 and lb.LLAMA_CPP_COMMIT in (p.stdout + p.stderr)
    files = _record_ok(built.wheel)
    libs = sorted(n for n in files if n.startswith("llama_cpp/lib/"))
    assert {"llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml.so", "llama_cpp/lib/libggml-base.so",
            "llama_cpp/lib/libggml-cpu.so", "llama_cpp/lib/libmtmd.so"} <= set(libs)
    assert not any(n.startswith(("lib/", "include/", "bin/")) for n in files)  # nothing outside the package
    assert "llama_cpp/llama_cpp.py" in files and "llama_cpp/server/app.py" in files


def test_cli_prints_the_paths(built):
    p = _run_cli({}, "--print-wheel")
    assert p.returncode == 0 and p.stdout.strip() == str(built.wheel)
    p = _run_cli({}, "--print-path")
    assert p.returncode == 0 and p.stdout.strip() == str(built.root)


def test_every_module_name_the_llamacpp_package_reaches_exists():
    """Each ``<module>.<name>`` that a module of the llamacpp package reads from a sibling it imported as a module
    exists there. The tools (``llama-quantize``, ``llama-imatrix``) are compiled only where the cache lacks them, so
    a name moved by a split (``build._Lock`` -> ``build_steps.BuildLock``) failed only on a fresh cache, with an
    AttributeError in ``g4h quantize`` and every test that quantizes (found on a fresh machine; CI's kept cache never
    compiles them)."""
    import ast
    import importlib

    folder = Path(REPO_ROOT) / "harness" / "engines" / "llamacpp"
    missing = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.level == 1 and not node.module for a in node.names}  # from . import build as _build
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = importlib.import_module(f"gemma4_harness.harness.engines.llamacpp.{aliases[node.value.id]}")
                if not hasattr(module, node.attr):
                    missing.append(f"{path.name}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert not missing, missing
