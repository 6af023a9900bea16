"""Run damaged GGUFs through an engine, each in its own process with a time and memory bound.

Used by ``tests/test_gguf_fuzz.py`` and, as a script, for a campaign of
thousands of files::

    python tests/gguf_campaign.py --reference 3000 --fast 300 --out /tmp/campaign.json

Each file is run in a forked child (the parent has numpy, gguf and the
engines imported, so a child starts in milliseconds): the child loads the file
with ``reference.load_model`` and computes the logits of a short prompt with
the reference (``forward``) or the fast engine (``FastModel(..., "cpu",
"float32").logits``), under ``RLIMIT_AS`` (its address space + 4 GiB) and a
wall-clock bound (5 s), with stdout, stderr and Python warnings captured.
With ``--cli``, each file goes instead through the ``g4h logits`` command in a
fresh process (exit status, stderr lines and the ``.npy`` classified the same
way; slower, for a sample)::

    python tests/gguf_campaign.py --cli --reference 190 --fast 38 --timeout 20

Outcomes (only the first two are acceptable):

* ``identical``: logits bit-identical to the clean file's;
* ``error``: an ``InputError`` whose message is one non-empty line naming the file;
* ``bad_message``: an ``InputError`` with a multi-line or anonymous message;
* ``noise``: a correct outcome, but something was printed or warned first;
* ``different`` / ``nonfinite``: exit 0 with other, or NaN/Inf, logits;
* ``traceback``: any other exception (MemoryError included);
* ``hang``: still running after the bound; ``crash``: the child died.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import re
import resource
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf_mutate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPT = [2, 5, 7, 11, 13]
TIMEOUT_S = 5.0
EXTRA_ADDRESS_SPACE = 4 << 30
OK = ("identical", "error")


SLOW_S = 3.0  # a file that takes longer than this is counted as slow (the campaign's first bound), even if it ends


@dataclass
class Outcome:
    kind: str
    detail: str
    seconds: float = 0.0


def logits_of(path: str | os.PathLike, engine: str) -> np.ndarray:
    """Load ``path`` and return the engine's logits of :data:`PROMPT` (float64 ``[T, vocab]``)."""
    from gemma4_harness.reference import forward, load_model

    cfg, W = load_model(path)
    if engine == "reference":
        return np.asarray(forward(cfg, W, PROMPT), dtype=np.float64)
    from gemma4_harness.fast.model import FastModel

    dtype = engine.partition(":")[2] or "float32"  # fast, fast:bfloat16, fast:float16
    return FastModel(cfg, W, "cpu", dtype).logits(PROMPT).double().numpy()


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _child(conn, path: str, engine: str) -> None:
    if sys.platform.startswith("linux"):
        limit = _vm_bytes() + EXTRA_ADDRESS_SPACE
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if engine.startswith("fast"):
        import torch

        torch.set_num_threads(1)
    out = io.StringIO()
    from gemma4_harness.reference.errors import InputError

    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        warnings.simplefilter("always")
        try:
            result = ("logits", logits_of(path, engine))
        except InputError as e:
            result = ("input_error", str(e))
        except BaseException as e:  # noqa: BLE001 - everything else is the finding
            result = ("traceback", f"{type(e).__name__}: {e}"[:300] + " @ "
                      + traceback.extract_tb(e.__traceback__)[-1].filename.split("/")[-1])
    noise = out.getvalue() + "".join(f"warning: {w.message}\n" for w in caught)
    conn.send((result, noise))
    conn.close()


def run_isolated(path: str | os.PathLike, engine: str, clean: np.ndarray, timeout: float = TIMEOUT_S) -> Outcome:
    """Run one file in a forked child and classify the result against the clean logits."""
    t0 = time.perf_counter()
    out = _run_isolated(path, engine, clean, timeout)
    out.seconds = time.perf_counter() - t0
    return out


def _run_isolated(path: str | os.PathLike, engine: str, clean: np.ndarray, timeout: float) -> Outcome:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(send, str(path), engine), daemon=True)
    p.start()
    send.close()
    got = None
    if recv.poll(timeout):
        try:
            got = recv.recv()
        except EOFError:
            got = None
    p.join(1.0)
    if p.is_alive():
        p.kill()
        p.join()
        if got is None:
            return Outcome("hang", f"still running after {timeout:g} s")
    recv.close()
    if got is None:
        return Outcome("crash", f"child exit code {p.exitcode}")
    (what, value), noise = got
    if what == "traceback":
        return Outcome("traceback", value)
    if what == "input_error":
        if not value.strip() or "\n" in value or Path(path).name not in value:
            return Outcome("bad_message", value)
        return Outcome("noise", f"{noise.strip()[:200]} | {value}") if noise else Outcome("error", value)
    if not np.all(np.isfinite(value)):
        return Outcome("nonfinite", f"{int(np.sum(~np.isfinite(value)))} non-finite logits")
    if value.shape != clean.shape or not np.array_equal(value, clean):
        diff = float(np.max(np.abs(value - clean))) if value.shape == clean.shape else float("nan")
        return Outcome("different", f"shape {value.shape}, max |diff| {diff:.3g}")
    return Outcome("noise", noise.strip()[:200]) if noise else Outcome("identical", "")


def cli_logits(path: str | os.PathLike, engine: str, work: Path, timeout: float) -> subprocess.CompletedProcess:
    """``g4h logits`` of :data:`PROMPT` on ``path`` in a fresh process (float64 ``.npy`` in ``work/cli.npy``)."""
    prompt, out = work / "cli-prompt.json", work / "cli.npy"
    prompt.write_text(json.dumps(PROMPT))
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "logits", "--model", str(path), "--engine", engine,
                           *(["--device", "cpu"] if engine == "fast" else []), "--prompt-ids", str(prompt),
                           "--out", str(out), "--out-dtype", "float64"],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def run_cli(path: str | os.PathLike, engine: str, clean: np.ndarray, work: Path, timeout: float) -> Outcome:
    """Run one file through the ``g4h logits`` command and classify its exit status, stderr and ``.npy``
    as :func:`run_isolated` does (``clean``: the command's own logits of the clean file).

    ``Outcome.seconds`` is the command's CPU time (user + system), not its wall time: on a shared machine a
    process that waits for a core is not a hang. ``timeout`` bounds the wall time."""
    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    c0 = cpu()
    try:
        proc = cli_logits(path, engine, work, timeout)
    except subprocess.TimeoutExpired:
        return Outcome("hang", f"still running after {timeout:g} s (wall)", cpu() - c0)
    seconds = cpu() - c0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    if "Traceback" in proc.stderr:
        return Outcome("traceback", proc.stderr.strip().splitlines()[-1][:300], seconds)
    if proc.returncode == 2:
        if len(lines) != 1 or Path(path).name not in lines[0]:
            return Outcome("bad_message", " | ".join(lines)[:300], seconds)
        return Outcome("error", lines[0].removeprefix("g4h: error: "), seconds)
    if proc.returncode != 0:
        return Outcome("crash", f"exit {proc.returncode}: {' | '.join(lines)[:300]}", seconds)
    value = np.load(work / "cli.npy")
    if not np.all(np.isfinite(value)):
        return Outcome("nonfinite", f"{int(np.sum(~np.isfinite(value)))} non-finite logits", seconds)
    if value.shape != clean.shape or not np.array_equal(value, clean):
        return Outcome("different", f"shape {value.shape}", seconds)
    return Outcome("identical", "", seconds)


# --------------------------------------------------------------------------- base files


def write_bases(out_dir: str | os.PathLike, names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Write the clean base files: the tiny F32 model and synthetic E2B / 26B-A4B / 31B cases in other types.

    ``tiny-F32`` (tests/conftest.py), ``e2b-Q8_0`` (PLE, KV sharing, a 512-token
    vocabulary), ``26b-a4b-Q4_0`` (MoE) and ``31b-BF16`` (k_eq_v), written by
    ``harness.synth.write_gguf`` from ``cases/models/*.toml`` (no transformers needed).
    """
    from conftest import write_tiny_gguf

    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_names = ("tiny-F32", "e2b-Q8_0", "26b-a4b-Q4_0", "31b-BF16")
    paths = {}
    for name in names or all_names:
        path = out_dir / f"{name}.gguf"
        if name == "tiny-F32":
            write_tiny_gguf(path)
        else:
            case, qtype = name.rsplit("-", 1)
            spec = synth.load_spec(MODELS_DIR / f"{case}.toml")
            synth.write_gguf(spec, synth.make_weights(spec), path, qtype)
        paths[name] = path
    return paths


@dataclass
class Base:
    name: str
    path: Path
    data: bytes
    layout: gguf_mutate.Layout
    clean: dict[str, np.ndarray]


def load_base(name: str, path: Path, engines: tuple[str, ...] = ("reference",)) -> Base:
    """Read a clean base file, locate its fields and compute its clean logits per engine."""
    return Base(name, path, path.read_bytes(), gguf_mutate.read_layout(path),
                {e: logits_of(path, e) for e in engines})


# --------------------------------------------------------------------------- naming


_HEADER_FIELDS = re.compile(r"\b(magic|header fields? \w+|not a GGUF file)")
_DOTTED = re.compile(r"\b(general|tokenizer|gemma4|gemma3)\.[\w.]+")
_NAMED = re.compile(r"\b(key|tensor) [^\s#(]")  # "tensor blk.0.attn_q.weight", not "tensor #3 (after ...)"


_NEIGHBOUR = re.compile(r"after (key|tensor) [^\s)]+")


def names_key_or_tensor(message: str, strict: bool = True) -> bool:
    """True when the message names a key or tensor as the file spells it (a damaged name included).

    ``strict``: the entry at fault itself; otherwise naming the last good entry
    before an unreadable one ("key #5 (after key general.name)") counts too.
    """
    text = _NEIGHBOUR.sub("", message) if strict else message
    return bool(_DOTTED.search(text) or _NAMED.search(text))


def names_field(message: str) -> bool:
    """Names a key, a tensor (or the entry before it) or a header field (magic, version, tensor_count, kv_count)."""
    return names_key_or_tensor(message, strict=False) or bool(_HEADER_FIELDS.search(message))


# --------------------------------------------------------------------------- campaign


def campaign(bases: list[Base], engine: str, n: int, seed: int, work: Path, timeout: float = TIMEOUT_S,
             via_cli: bool = False) -> dict:
    """Run ``n`` mutated files (kinds and bases in turn, details from ``seed``) through ``engine``, each bounded
    to ``timeout`` seconds; files slower than :data:`SLOW_S` are counted (and the slowest kept).

    ``via_cli``: through the ``g4h logits`` command (a fresh process each, so Python's start-up is inside the
    bound) instead of a forked child; the clean logits are then the command's own, and the seconds counted
    are CPU seconds (:func:`run_cli`)."""
    clean_cli = {}
    if via_cli:
        for base in bases:
            proc = cli_logits(base.path, engine, work, 120)
            if proc.returncode != 0:
                raise RuntimeError(f"g4h logits on the clean {base.name}: {proc.stderr.strip()}")
            clean_cli[base.name] = np.load(work / "cli.npy")
    rng = random.Random(seed)
    kinds = sorted(gguf_mutate.KINDS)
    counts: Counter = Counter()
    by_kind: dict[str, Counter] = {k: Counter() for k in kinds}
    examples: dict[str, list] = {}
    named = named_near = named_field = n_errors = 0
    slow = 0
    slowest = (0.0, "")
    t0 = time.time()
    for i in range(n):
        kind = kinds[i % len(kinds)]
        base = bases[(i // len(kinds)) % len(bases)]
        data, detail = gguf_mutate.mutate(base.data, base.layout, kind, rng)
        path = work / f"{base.name}.mut.gguf"
        path.write_bytes(data)
        out = (run_cli(path, engine, clean_cli[base.name], work, timeout) if via_cli
               else run_isolated(path, engine, base.clean[engine], timeout))
        slow += out.seconds > SLOW_S
        slowest = max(slowest, (out.seconds, f"{base.name} {kind}: {out.kind}"))
        counts[out.kind] += 1
        by_kind[kind][out.kind] += 1
        if out.kind == "error":
            n_errors += 1
            named += names_key_or_tensor(out.detail)
            named_near += names_key_or_tensor(out.detail, strict=False)
            named_field += names_field(out.detail)
        if out.kind not in OK or len(examples.get(out.kind, [])) < 3:
            examples.setdefault(out.kind, []).append(f"{base.name} {kind}: {detail} => {out.detail}")
    return {
        "engine": engine, "via": "g4h logits" if via_cli else "forked child", "files": n, "seed": seed,
        "seconds": round(time.time() - t0, 1),
        "timeout_s": timeout, f"over_{SLOW_S:g}_s": slow,
        "slowest": f"{slowest[0]:.2f} s ({slowest[1]})",
        "outcomes": dict(counts), "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "errors_naming_key_or_tensor": f"{named}/{n_errors}",
        "errors_naming_key_or_tensor_or_the_one_before": f"{named_near}/{n_errors}",
        "errors_naming_key_tensor_or_header_field": f"{named_field}/{n_errors}",
        "examples": {k: v[:20] for k, v in examples.items()},
    }


# --------------------------------------------------------------------------- extreme weights, other file kinds

#: Outcomes of the extreme-weight and file-kind classes that are acceptable: finite logits (a valid, different
#: model), the engine failed with its first non-finite layer and point (exit 1), or one line (exit 2: a weight
#: above the dtype's limit, the reference's own float64 overflow, a file that is not a regular file).
EXTREME_OK = ("finite", "finite_diverged", "engine_failed", "error")


DIVERGED = 1.0
"""A finite result whose largest |logit - reference logit| passes this (in logits) is counted as diverged: far beyond
any dtype's rounding on these models (bf16: a few hundredths), a wrong result the carry warning should have named."""


def _engine_child(conn, path: str, spec: str, compare: bool = False) -> None:
    """In a forked child: ``spec``'s engine (``reference`` or ``fast:<dtype>``) built by ``make_engine``, so that its
    output goes through the output check, then the logits of :data:`PROMPT`."""
    if sys.platform.startswith("linux"):
        limit = _vm_bytes() + EXTRA_ADDRESS_SPACE
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    torch.set_num_threads(1)
    out = io.StringIO()
    from gemma4_harness.harness.core.workers import EngineOutputError
    from gemma4_harness.harness.engines import make_engine
    from gemma4_harness.reference.errors import InputError
    from gemma4_harness.reference.weight_check import CarryWarning

    name, _, dtype = spec.partition(":")
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        warnings.simplefilter("always")
        try:
            eng = make_engine(name, path, **({"device": "cpu", "dtype": dtype} if name == "fast" else {}))
            result = ("logits", np.asarray(eng.logits(PROMPT), dtype=np.float64))
            if compare and name != "reference":  # how far a finite result is from the specification's
                ref = np.asarray(make_engine("reference", path).logits(PROMPT), dtype=np.float64)
                result = ("logits", result[1], float(np.max(np.abs(result[1] - ref))))
        except EngineOutputError as e:
            result = ("engine_failed", str(e))
        except InputError as e:
            result = ("input_error", str(e))
        except BaseException as e:  # noqa: BLE001 - everything else is the finding
            result = ("traceback", f"{type(e).__name__}: {e}"[:300] + " @ "
                      + traceback.extract_tb(e.__traceback__)[-1].filename.split("/")[-1])
    carry = [str(w.message) for w in caught if issubclass(w.category, CarryWarning)]
    noise = out.getvalue()
    conn.send((result, noise, carry))
    conn.close()


def run_engine_isolated(path: str | os.PathLike, spec: str, timeout: float, compare: bool = False
                        ) -> tuple[Outcome, list[str]]:
    """One file through ``spec``'s engine (:func:`_engine_child`) in a forked child; the outcome and the carry
    warnings it gave. ``compare``: a finite result is also compared with the reference's logits of the same file
    (``Outcome.detail`` ends with ``max |d| X``; more than :data:`DIVERGED`: the outcome is ``finite_diverged``)."""
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_engine_child, args=(send, str(path), spec, compare), daemon=True)
    p.start()
    send.close()
    got = None
    if recv.poll(timeout):
        try:
            got = recv.recv()
        except EOFError:
            got = None
    p.join(1.0)
    if p.is_alive():
        p.kill()
        p.join()
        if got is None:
            return Outcome("hang", f"still running after {timeout:g} s", time.perf_counter() - t0), []
    recv.close()
    secs = time.perf_counter() - t0
    if got is None:
        return Outcome("crash", f"child exit code {p.exitcode}", secs), []
    (what, value, *delta), noise, carry = got
    if noise.strip():
        return Outcome("noise", noise.strip()[:200], secs), carry
    if what == "traceback":
        return Outcome("traceback", value, secs), carry
    if what == "input_error":
        ok = value.strip() and "\n" not in value and Path(path).name in value
        return Outcome("error" if ok else "bad_message", value, secs), carry
    if what == "engine_failed":
        ok = "non-finite output, first at" in value and "\n" not in value
        return Outcome("engine_failed" if ok else "bad_message", value, secs), carry
    if not np.all(np.isfinite(value)):
        return Outcome("nonfinite", f"{int(np.sum(~np.isfinite(value)))} non-finite logits", secs), carry
    kind = "finite_diverged" if delta and not delta[0] <= DIVERGED else "finite"
    return Outcome(kind, f"max |logit| {float(np.max(np.abs(value))):.3g}" +
                   (f", max |d| from the reference {delta[0]:.3g}" if delta else ""), secs), carry


def extreme_campaign(bases: list[Base], spec: str, n: int, seed: int, work: Path, timeout: float = 30.0) -> dict:
    """``n`` files with one extreme but finite weight (:func:`gguf_mutate.weight_extreme`: roles, bases and
    magnitudes in turn, within ``spec``'s dtype limit) through ``spec``'s engine. Counts per outcome and role, and
    how often the load-time carry warning (:mod:`fast.carry`) named the fault of a non-finite result."""
    rng = random.Random(seed)
    dtype = spec.partition(":")[2] or "float64"
    ladder = gguf_mutate.LADDER["float16" if dtype == "float16" else "float32"]
    roles = list(gguf_mutate.ROLES)
    counts: Counter = Counter()
    by_role: dict[str, Counter] = {r: Counter() for r in roles}
    examples: dict[str, list] = {}
    warned = Counter()
    t0 = time.time()
    i = 0
    while sum(counts.values()) < n:
        role = roles[i % len(roles)]  # every role at every magnitude on one base, then the next base
        magnitude = ladder[(i // len(roles)) % len(ladder)]
        base = bases[(i // (len(roles) * len(ladder))) % len(bases)]
        i += 1
        if role not in gguf_mutate.roles_of(base.layout):
            if i > 50 * n:
                break
            continue
        data, detail = gguf_mutate.weight_extreme(base.data, base.layout, rng, role, magnitude)
        path = work / f"{base.name}.extreme.gguf"
        path.write_bytes(data)
        out, carry = run_engine_isolated(path, spec, timeout, compare=True)
        counts[out.kind] += 1
        by_role[role][f"{out.kind}{' (warned)' if carry else ''}"] += 1
        warned[(out.kind, bool(carry))] += 1
        missed = out.kind in ("engine_failed", "finite_diverged") and not carry
        if out.kind not in EXTREME_OK or missed or len(examples.get(out.kind, [])) < 3:
            key = f"{out.kind} (not warned)" if missed else out.kind
            examples.setdefault(key, []).append(f"{base.name} {detail} => {out.detail[:200]}")
    return {"engine": spec, "class": "extreme weights", "files": sum(counts.values()), "seed": seed,
            "seconds": round(time.time() - t0, 1), "timeout_s": timeout, "outcomes": dict(counts),
            "by_role": {k: dict(v) for k, v in by_role.items() if v},
            "carry_warning": {f"{k}{' (warned)' if w else ' (not warned)'}": c for (k, w), c in warned.items()},
            "examples": {k: v[:40] for k, v in examples.items()}}


FILE_KINDS = ("fifo", "dev_zero", "folder", "socket", "symlink_to_fifo")
"""What stands at the model's path in the file-kind class: none is a regular file a model can be mapped from."""


def file_kind_campaign(spec: str, work: Path, timeout: float = 30.0) -> dict:
    """Each of :data:`FILE_KINDS` as the model path through ``spec``'s engine: one line, quickly, never a hang."""
    import socket

    counts: Counter = Counter()
    examples = {}
    for kind in FILE_KINDS:
        d = work / f"kind-{kind}"
        if d.exists():
            import shutil

            shutil.rmtree(d)
        d.mkdir(parents=True)
        path = d / "model.gguf"
        sock = None
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dev_zero":
            path.symlink_to("/dev/zero")
        elif kind == "folder":
            path.mkdir()
        elif kind == "socket":
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(path))
        else:
            os.mkfifo(d / "f")
            path.symlink_to(d / "f")
        try:
            out, _ = run_engine_isolated(path, spec, timeout)
        finally:
            if sock is not None:
                sock.close()
        counts[out.kind] += 1
        examples[kind] = f"{out.kind}: {out.detail[:160]} ({out.seconds:.2f} s)"
    return {"engine": spec, "class": "file kinds", "files": len(FILE_KINDS), "outcomes": dict(counts),
            "examples": examples}


# --------------------------------------------------------------------------- a real-size file


def write_big_e2b(path: str | os.PathLike, n_layer: int | None = None) -> Path:
    """Write a Gemma 4 E2B-shaped Q8_0 GGUF (``cases/shapes/e2b.toml``: 262144-token vocabulary, PLE, 35 layers,
    4.9 GB) with random weights through :func:`harness.synth.scale.write_scale_gguf`; ``n_layer`` keeps the
    first layers only. Streams the data: memory stays ~100 MB."""
    from gemma4_harness.harness.synth.scale import write_scale_gguf

    return write_scale_gguf("e2b", path, layers=n_layer, fmt="q8_0")


def measure_big(path: str | os.PathLike) -> dict:
    """Seconds for: gguf.GGUFReader, check_gguf, load_model, check_weights (fp32 and fp16 limits) on ``path``,
    and the resident memory after them (private, and of the mapped file)."""
    import gguf

    from gemma4_harness.reference import load_model
    from gemma4_harness.reference.gguf_check import check_gguf
    from gemma4_harness.reference.weight_check import MAX_ABS_FP16, check_weights

    out = {"bytes": os.path.getsize(path)}
    steps = (("gguf.GGUFReader", lambda: gguf.GGUFReader(str(path))), ("check_gguf", lambda: check_gguf(path)),
             ("load_model", lambda: load_model(path)))
    for name, fn in steps:
        t = time.perf_counter()
        res = fn()
        out[f"{name}_s"] = round(time.perf_counter() - t, 3)
    out["tensors"] = len(res[1])
    cfg, W = res
    for label, limit in (("check_weights_fp32_s", None), ("check_weights_fp16_s", MAX_ABS_FP16)):
        t = time.perf_counter()
        check_weights(W) if limit is None else check_weights(W, limit)
        out[label] = round(time.perf_counter() - t, 3)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    for field in ("RssAnon", "RssFile"):  # private memory vs pages of the mapped file (page cache, reclaimable)
        out[f"{field}_mb"] = int(status.get(field, "0 kB").split()[0]) // 1024
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=int, default=3000, help="files through the reference")
    ap.add_argument("--fast", type=int, default=300, help="files through the fast engine (CPU), per --fast-dtypes")
    ap.add_argument("--fast-dtypes", default="float32", help="comma-separated compute dtypes of the fast engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per file before it counts as a hang")
    ap.add_argument("--work", default="/tmp/gguf-campaign")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--cli", action="store_true", help="run each file through the g4h logits command")
    ap.add_argument("--big", default=None, help="instead: write (if absent) and time a real-size E2B Q8_0 GGUF here")
    ap.add_argument("--big-layers", type=int, default=None, help="with --big: keep the first N layers")
    ap.add_argument("--extreme", type=int, default=0,
                    help="instead: files with one extreme but finite weight per engine of --engines")
    ap.add_argument("--engines", default="reference,fast:float32,fast:bfloat16,fast:float16",
                    help="with --extreme: engines (reference, fast:<dtype>)")
    args = ap.parse_args(argv)
    if args.extreme:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        names = ("tiny-F32", "e2b-F32", "26b-a4b-F32", "31b-BF16", "e2b-Q8_0")
        bases = [load_base(name, path, ()) for name, path in write_bases(work / "bases", names).items()]
        results = []
        for spec in args.engines.split(","):
            for r in (extreme_campaign(bases, spec, args.extreme, args.seed, work, args.timeout),
                      file_kind_campaign(spec, work, args.timeout)):
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "examples"}, indent=1), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        bad = sum(v for r in results for k, v in r["outcomes"].items() if k not in EXTREME_OK)
        return 1 if bad else 0
    if args.big:
        if not Path(args.big).exists():
            t = time.perf_counter()
            write_big_e2b(args.big, args.big_layers)
            print(f"wrote {args.big} in {time.perf_counter() - t:.0f} s", flush=True)
        print(json.dumps(measure_big(args.big)), flush=True)
        return 0
    work = Path(args.work)
    fast = [f"fast:{d}" if d != "float32" else "fast" for d in args.fast_dtypes.split(",")] if args.fast else []
    engines = ("reference", *fast)
    bases = [load_base(name, path, engines) for name, path in write_bases(work / "bases").items()]
    results = []
    for engine, n in (("reference", args.reference), *((f, args.fast) for f in fast)):
        if n:
            r = campaign(bases, engine, n, args.seed, work, args.timeout, via_cli=args.cli)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "examples"}, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    bad = sum(v for r in results for k, v in r["outcomes"].items() if k not in OK)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
