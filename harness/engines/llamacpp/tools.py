"""llama.cpp's own quantizer: ``llama-quantize`` and ``llama-imatrix``, built beside the cached ``llama-server``.

Users who publish GGUFs make them with ``llama-quantize`` (every file type: legacy ``Q4_0``..``Q8_0``,
K-quants ``Q2_K``..``Q6_K`` and their ``_S``/``_M``/``_L`` mixes, ``IQ*`` i-quants) and, for the
importance-matrix types, ``llama-imatrix``. The harness builds both from the same vendored llama.cpp
tree (llama-cpp-python 0.3.36's sdist) and against the same shared libraries as the cached build of
:mod:`.build`, so a test or a user without a quantizer can make every type from one F32/BF16 file.

How they are built (once; about a minute on 2 cores): the cached build keeps its libraries
(``lib/libllama.so``, ``libllama-common.so``, ``libggml*.so``) but not its CMake tree, and rebuilding that
tree for two more targets would recompile the libraries (~13 minutes on 2 cores). So:

1. CMake *configures* the vendored tree again with the cached build's own flags (``stamp.json``), which
   takes seconds and compiles nothing, and exports ``compile_commands.json``: the exact compiler
   command (defines such as ``LLAMA_SHARED``/``LLAMA_SUBPROCESS``, include folders, ``-O3``) of each
   tool source, and the generated ``common/build-info.cpp``;
2. those sources (``tools/quantize/quantize.cpp`` + ``main.cpp``, ``tools/imatrix/imatrix.cpp``,
   ``build-info.cpp``) are compiled with those commands, and linked against the cached shared
   libraries with the cached build's run path (``$ORIGIN/../lib``);
3. the executables are moved into ``<build>/bin/`` (a rename each, under the build's lock), and
   ``<build>/tools.json`` records them (flags, compiler, seconds) last, so a half-made tool set is never
   taken for a complete one.

The cache key of the build (:func:`.build.build_key`) is unchanged: a cache built before this module
existed gets the tools added in place; any build variant (another key: extra CMake flags) gets its own.

Public API: :func:`ensure_tools` (-> :class:`LlamaCppTools`), :func:`quantize`, :func:`make_imatrix`,
:data:`QUANT_TYPES`, :data:`IMATRIX_TYPES`; CLI ``python -m gemma4_harness.harness.engines.llamacpp.tools [--print-path]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from gemma4_harness.reference.errors import InputError

from . import build as _build
from .build_steps import BuildLock, _last_error, extract_sdist, run_step

#: The tools and their sources in the vendored tree (``tools/quantize/CMakeLists.txt``: ``llama-quantize`` is
#: ``main.cpp`` over the ``llama-quantize-impl`` library, i.e. ``quantize.cpp``; ``tools/imatrix/CMakeLists.txt``).
TOOL_SOURCES: dict[str, tuple[str, ...]] = {
    "llama-quantize": ("tools/quantize/quantize.cpp", "tools/quantize/main.cpp"),
    "llama-imatrix": ("tools/imatrix/imatrix.cpp",),
}
#: The configure-time source every tool links (``common/CMakeLists.txt``: ``llama-common-base``).
BUILD_INFO = "common/build-info.cpp"
#: Bumped when the way the tools are made changes (a different number rebuilds them).
TOOLS_VERSION = 1

#: ``llama-quantize``'s file types (``tools/quantize/quantize.cpp``, ``QUANT_OPTIONS``), aliases left out.
QUANT_TYPES: tuple[str, ...] = (
    "Q1_0", "Q2_0", "Q4_0", "Q4_1", "MXFP4_MOE", "Q5_0", "Q5_1", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S",
    "IQ1_M", "TQ1_0", "TQ2_0", "Q2_K", "Q2_K_S", "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ3_XS", "Q3_K_S", "Q3_K_M",
    "Q3_K_L", "IQ4_NL", "IQ4_XS", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16", "F32",
)
#: Aliases ``llama-quantize`` accepts for a type of :data:`QUANT_TYPES`.
QUANT_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
#: File types whose tensors need an importance matrix (``src/llama-quant.cpp``, ``tensor_requires_imatrix``:
#: tensors quantized to IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, and Q2_K inside a Q2_K_S file; the
#: mixes that use them: ``llama_tensor_get_type``). ``llama-quantize`` refuses them without ``--imatrix``.
IMATRIX_TYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "Q2_K_S"})


class QuantizeError(InputError):
    """``llama-quantize`` or ``llama-imatrix`` refused the input or failed: one line naming the file and the tool's
    reason (its most telling stderr line)."""


@dataclass(frozen=True)
class LlamaCppTools:
    """The tools of one cached build.

    Attributes:
        build: the :class:`.build.LlamaCppBuild` they belong to.
        quantize: the ``llama-quantize`` executable.
        imatrix: the ``llama-imatrix`` executable.
        stamp: ``tools.json`` (version, compiler, flags, seconds).
    """

    build: _build.LlamaCppBuild
    quantize: Path
    imatrix: Path
    stamp: dict


def _stamp_path(root: Path) -> Path:
    return root / "tools.json"


def _load_tools(b: _build.LlamaCppBuild) -> LlamaCppTools | None:
    """The tools of ``b`` when ``tools.json`` says they are complete and of :data:`TOOLS_VERSION`."""
    try:
        stamp = json.loads(_stamp_path(b.root).read_text())
    except (OSError, ValueError):
        return None
    t = LlamaCppTools(b, b.root / "bin" / "llama-quantize", b.root / "bin" / "llama-imatrix", stamp)
    ok = stamp.get("version") == TOOLS_VERSION and t.quantize.is_file() and t.imatrix.is_file()
    return t if ok else None


def ensure_tools(build: _build.LlamaCppBuild | None = None, force: bool = False, jobs: int | None = None,
                 log: Callable[[str], None] | None = None) -> LlamaCppTools:
    """``llama-quantize`` and ``llama-imatrix`` of the cached llama.cpp build, compiled first when absent.

    Args:
        build: the build to add them to (default: :func:`.build.ensure_built`, which builds llama.cpp itself
            first when the cache lacks it).
        force: compile them again even when present.
        jobs: parallel compiler processes (default: the CPU count, at most one per source).
        log: receives one progress line per phase (default: stderr, prefixed ``llama.cpp tools:``).

    Returns:
        The :class:`LlamaCppTools`.

    Raises:
        BuildError: a compiler or cmake is missing, the configure or a compile/link step failed (the message names
            the step and the log file).
    """
    say = log or (lambda m: print(f"llama.cpp tools: {m}", file=sys.stderr, flush=True))
    b = build or _build.ensure_built(log=log)
    if not force:
        found = _load_tools(b)
        if found is not None:
            return found
    with BuildLock(b.root.with_name(b.root.name + ".lock")):
        found = None if force else _load_tools(b)
        if found is not None:  # another process made them while we waited
            return found
        return _make_tools(b, jobs, say)


def _make_tools(b: _build.LlamaCppBuild, jobs: int | None, say: Callable[[str], None]) -> LlamaCppTools:
    cache = b.root.parent
    tmp = Path(tempfile.mkdtemp(prefix=f".tools-{b.root.name}-", dir=cache))
    log_path = b.root / "tools.build.log"
    seconds: dict[str, float] = {}
    try:
        with open(log_path, "w") as logf:
            tarball = _build.fetch_sdist(cache, None, say)
            src = extract_sdist(tarball, tmp / "src") / "vendor" / "llama.cpp"
            cfg = tmp / "configure"
            flags = [f for f in b.stamp.get("flags", []) if not f.startswith("-DCMAKE_INSTALL_RPATH=")]
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            t0 = time.perf_counter()
            say(f"configuring the vendored llama.cpp for {', '.join(TOOL_SOURCES)} (flags of {b.root.name})")
            run_step(["cmake", "-S", str(src), "-B", str(cfg), *gen, *flags, "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"],
                        logf, "cmake configure (tools)", log_path)
            seconds["configure"] = time.perf_counter() - t0
            commands = _compile_commands(cfg / "compile_commands.json", src, cfg)
            objs, out = tmp / "obj", tmp / "bin"
            objs.mkdir()
            out.mkdir()
            t0 = time.perf_counter()
            sources = sorted({s for srcs in TOOL_SOURCES.values() for s in srcs} | {BUILD_INFO})
            say(f"compiling {len(sources)} sources against {b.lib_dir} (about a minute)")
            obj_of = _compile_all(sources, commands, objs, logf, log_path, jobs)
            seconds["compile"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for tool, srcs in TOOL_SOURCES.items():
                _link([obj_of[s] for s in (*srcs, BUILD_INFO)], out / tool, b, logf, log_path)
            seconds["link"] = time.perf_counter() - t0
        for tool in TOOL_SOURCES:  # in place, where the run path $ORIGIN/../lib finds the cached libraries
            os.replace(out / tool, b.root / "bin" / tool)
            try:
                _check_tool(b.root / "bin" / tool)
            except _build.BuildError:
                (b.root / "bin" / tool).unlink(missing_ok=True)
                raise
        stamp = {"version": TOOLS_VERSION, "tools": list(TOOL_SOURCES), "sources": TOOL_SOURCES,
                 "compiler": commands[BUILD_INFO][0][0], "flags": flags,
                 "seconds": {k: round(v, 1) for k, v in seconds.items()},
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        part = _stamp_path(b.root).with_suffix(".json.part")
        part.write_text(json.dumps(stamp, indent=2) + "\n")
        os.replace(part, _stamp_path(b.root))
        say(f"done in {sum(seconds.values()):.0f} s: {b.root / 'bin'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    made = _load_tools(b)
    if made is None:
        raise _build.BuildError(f"{b.root}: the tools were made but tools.json or an executable is missing")
    return made


def _compile_commands(path: Path, src: Path, cfg: Path) -> dict[str, tuple[list[str], str]]:
    """Source (relative to the llama.cpp tree; ``common/build-info.cpp`` for the generated one) -> its compiler
    argv from CMake's ``compile_commands.json`` without ``-c``, ``-o``, the dependency-file options and the source,
    and the source's absolute path."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _build.BuildError(f"{path}: CMake wrote no compile_commands.json ({e})") from None
    wanted = {str((src / s).resolve()): s for srcs in TOOL_SOURCES.values() for s in srcs}
    wanted[str((cfg / BUILD_INFO).resolve())] = BUILD_INFO
    out: dict[str, tuple[list[str], str]] = {}
    for e in entries:
        f = str((Path(e["directory"]) / e["file"]).resolve())
        if f not in wanted or wanted[f] in out:
            continue
        argv = e.get("arguments") or shlex.split(e["command"])
        keep, skip = [], False
        for a in argv:
            if skip:
                skip = False
                continue
            if a in ("-o", "-MF", "-MT", "-MQ"):
                skip = True
                continue
            if a in ("-c", "-MD", "-MMD") or str(Path(e["directory"]) / a) == f or a == e["file"]:
                continue
            keep.append(a)
        out[wanted[f]] = (keep, f)
    missing = sorted(set(wanted.values()) - set(out))
    if missing:
        raise _build.BuildError(f"{path}: no compile command for {', '.join(missing)} (a llama.cpp tree without "
                                f"these tools?)")
    return out


def _compile_all(sources: Sequence[str], commands: dict[str, tuple[list[str], str]], objs: Path, logf, log_path: Path,
                 jobs: int | None) -> dict[str, Path]:
    """Compile every source to ``objs/<name>.o``, ``jobs`` at a time; returns source -> object."""
    n = max(1, min(len(sources), jobs or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 0) or os.cpu_count()
                   or 1))
    obj_of = {s: objs / (s.replace("/", "_") + ".o") for s in sources}
    pending = list(sources)
    running: list[tuple[str, subprocess.Popen]] = []
    failed: list[tuple[str, int]] = []
    while pending or running:
        while pending and len(running) < n:
            s = pending.pop(0)
            argv = [*commands[s][0], "-c", commands[s][1], "-o", str(obj_of[s])]
            logf.write(f"\n$ {' '.join(argv)}\n")
            logf.flush()
            running.append((s, subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)))
        s, p = running.pop(0)
        rc = p.wait()
        if rc != 0:
            failed.append((s, rc))
    if failed:
        logf.flush()
        s, rc = failed[0]
        raise _build.BuildError(f"llama.cpp tools: compiling {s} failed (exit status {rc}): "
                                f"{_last_error(log_path)} (full log: {log_path})")
    return obj_of


def _link(objs: Sequence[Path], out: Path, b: _build.LlamaCppBuild, logf, log_path: Path) -> None:
    """Link ``objs`` into ``out`` against the cached libraries, with the cached build's run path."""
    cxx = os.environ.get("CXX", "").split() or [shutil.which("c++") or shutil.which("g++") or "c++"]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    libs = sorted(p for p in b.lib_dir.iterdir() if p.name.startswith(("libllama", "libggml")) and
                  p.name.endswith(suffix) and not p.name.startswith("libllama-server"))
    origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
    argv = [*cxx, "-O3", "-DNDEBUG", *map(str, objs), "-o", str(out), *map(str, libs), "-pthread",
            f"-Wl,-rpath,{origin}/../lib"]
    if sys.platform != "darwin":
        argv.append(f"-Wl,-rpath-link,{b.lib_dir}")
    run_step(argv, logf, f"link {out.name}", log_path)


def _check_tool(exe: Path) -> None:
    """The tool must start and find its libraries (``--help`` exits 0 or 1 after printing usage, never 127)."""
    try:
        p = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _build.BuildError(f"{exe}: does not run ({e})") from None
    text = (p.stdout + p.stderr).lower()
    if "usage" not in text:
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        raise _build.BuildError(f"{exe} --help exited {p.returncode}: {lines[-1] if lines else 'no output'}")


# --------------------------------------------------------------------------- running them


def canonical_type(name: str) -> str:
    """The :data:`QUANT_TYPES` name of a file type as a user writes it (any case; ``Q4_K`` -> ``Q4_K_M``).

    Raises:
        InputError: not a ``llama-quantize`` type (the known ones are listed).
    """
    up = name.strip().upper()
    up = QUANT_ALIASES.get(up, up)
    if up not in QUANT_TYPES:
        raise InputError(f"{name!r}: not a llama-quantize file type (known: {', '.join(QUANT_TYPES)})")
    return up


def _tool_line(stderr: str, rc: int) -> str:
    """The most telling line of a failed tool run: an ``error`` line, else its last line."""
    lines = [ln.strip(" =\t") for ln in stderr.splitlines() if ln.strip(" =\t")]
    for ln in lines:
        if "error" in ln.lower() or "failed" in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else f"exit status {rc}"


def _run_tool(argv: list[str], what: str, timeout: float | None) -> None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise QuantizeError(f"{what}: timed out after {timeout:.0f} s") from None
    if p.returncode != 0:
        raise QuantizeError(f"{what}: {_tool_line(p.stderr + p.stdout, p.returncode)}")


def quantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, *, imatrix: str | os.PathLike | None = None,
             threads: int | None = None, timeout: float | None = None, tools: LlamaCppTools | None = None) -> Path:
    """Quantize the GGUF ``src`` to file type ``qtype`` with ``llama-quantize``, writing ``dst`` atomically.

    Args:
        src: a GGUF (F32, BF16 or F16 for a clean quantization; llama-quantize refuses a quantized one).
        dst: the file to write (its folder must exist); replaced only when the quantizer succeeded.
        qtype: a :data:`QUANT_TYPES` name (or alias); :data:`IMATRIX_TYPES` need ``imatrix``.
        imatrix: an importance matrix from :func:`make_imatrix` (``llama-imatrix``'s GGUF or legacy ``.dat``).
        threads: quantizer threads (default: llama-quantize's, every CPU).
        timeout: seconds before the quantizer is stopped.
        tools: the built tools (default :func:`ensure_tools`).

    Returns:
        ``dst``.

    Raises:
        InputError: an unknown type, or an imatrix type without ``imatrix``.
        QuantizeError: llama-quantize failed (its reason, with ``src`` named).
    """
    qt = canonical_type(qtype)
    if qt in IMATRIX_TYPES and imatrix is None:
        raise InputError(f"{qt}: llama-quantize needs an importance matrix for this type (make one with "
                         f"make_imatrix / g4h quantize --imatrix-text FILE)")
    t = tools or ensure_tools()
    dst = Path(dst)
    part = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    argv = [str(t.quantize)] + (["--imatrix", str(imatrix)] if imatrix is not None else [])
    argv += [str(src), str(part), qt] + ([str(int(threads))] if threads else [])
    try:
        _run_tool(argv, f"{src}: llama-quantize {qt}", timeout)
        os.replace(part, dst)
    finally:
        part.unlink(missing_ok=True)
    return dst


def make_imatrix(model: str | os.PathLike, text: str | os.PathLike, dst: str | os.PathLike, *, ctx: int = 128,
                 chunks: int | None = None, threads: int | None = None, timeout: float | None = None,
                 tools: LlamaCppTools | None = None) -> Path:
    """An importance matrix of ``model`` over the calibration text ``text`` (``llama-imatrix``), written to ``dst``.

    Args:
        model: the GGUF to calibrate (the unquantized file the types will be made from).
        text: a UTF-8 text file; the model's tokenizer splits it into chunks of ``ctx`` tokens.
        ctx: tokens per chunk (``-c``); the text must hold at least one chunk.
        chunks: at most this many chunks (``--chunks``; default all).
        threads: threads (``-t``).
        timeout: seconds before it is stopped.

    Returns:
        ``dst`` (llama-imatrix's GGUF format).

    Raises:
        QuantizeError: llama-imatrix failed (too little text for one chunk, a model it cannot load ...).
    """
    t = tools or ensure_tools()
    dst = Path(dst)
    part = dst.with_name(f".{dst.name}.{os.getpid()}.part.gguf")
    argv = [str(t.imatrix), "-m", str(model), "-f", str(text), "-o", str(part), "-c", str(int(ctx)), "--no-ppl",
            "--output-format", "gguf"]
    argv += (["--chunks", str(int(chunks))] if chunks else []) + (["-t", str(int(threads))] if threads else [])
    try:
        _run_tool(argv, f"{model}: llama-imatrix over {text}", timeout)
        if not part.is_file():
            raise QuantizeError(f"{model}: llama-imatrix over {text} wrote no matrix (is the text shorter than one "
                                f"chunk of {ctx} tokens?)")
        os.replace(part, dst)
    finally:
        part.unlink(missing_ok=True)
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gemma4_harness.harness.engines.llamacpp.tools [--print-path] [--force]``: build the tools if needed, say where.

    Returns (as exit status): 0 when they are there; 2 with one line on stderr when they cannot be made.
    """
    ap = argparse.ArgumentParser(prog="python -m gemma4_harness.harness.engines.llamacpp.tools", description=__doc__.splitlines()[0])
    ap.add_argument("--print-path", action="store_true", help="print only the folder holding the tools")
    ap.add_argument("--force", action="store_true", help="compile them again even when present")
    args = ap.parse_args(argv)
    try:
        t = ensure_tools(force=args.force)
    except _build.BuildError as e:
        print(f"llamacpp_tools: error: {e}", file=sys.stderr)
        return 2
    if args.print_path:
        print(t.quantize.parent)
        return 0
    print(f"quantize: {t.quantize}\nimatrix:  {t.imatrix}\nbuilt:    {t.stamp.get('built_at')} in "
          f"{t.stamp.get('seconds')} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
