"""Micro-benchmark of the packed CPU kernels: GB/s of packed weights read, against the torch path and a read probe.

Run: ``python -m gemma4_harness.fast.quant_bench`` (defaults: Q8_0 and Q4_K, E2B's FFN matrices
6144 x 1536 and 1536 x 6144 and its 262144 x 1536 LM head, ``M`` = 1 and 8,
torch's thread count). ``pytest --bench -m bench -s -k quant_kernels`` runs the
same and prints the table.

What it measures, in one run:

* ``probe``: the machine's streamed read bandwidth, the same way ``g4h bench``
  measures its roofline (a float32 sum and a matrix-vector product over 1 GiB,
  best pass of each after a warm-up; the faster of the two);
* ``packed``: :func:`fast.quants.linear` with the C kernel, over a pool of copies of
  the matrix at least ``pool_gib`` large and cycled through, so that the bytes come
  from DRAM and not from the last-level cache (this machine reports 480 MiB of L3);
* ``torch``: the same call with the kernels off (:func:`fast.quant_kernels.disabled`):
  torch dequantizes chunks of rows, then ``F.linear``, the path before the kernels;
* ``L2`` (``--l2``): the same product on the matrix's first rows, cut to at most 768 KB so
  that they stay in a 1 MB L2 cache (:data:`L2_BYTES`), called over and over through
  :func:`fast.quant_kernels.linear` directly. ``memory / L2`` near 1 says the
  kernel is bound by its instructions, not by the read (a faster memory would not help it);
  well below 1, that the read bounds it. The 2-core CI VM gave 0.99-1.07 at M = 1 on one thread
  for Q4_K, Q5_0 and Q6_K, 0.87 for Q8_0 (``docs/design.md``, Speed).

GB/s = packed bytes of the matrix / seconds per call (1e9 bytes). ``share`` = GB/s / probe.
``per CPU-s`` divides by the process's CPU time instead of the wall clock: with one
thread, what a core delivers while it runs, a figure a busy shared machine distorts
less (with more threads it counts their waiting too). Figures go to stdout, never into asserts.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import quant_kernels
from .quants import QuantizedTensor, linear

SHAPES = {"ffn_up": (6144, 1536), "ffn_down": (1536, 6144), "head": (262144, 1536)}
"""E2B-like ``[N, K]`` matrices: FFN gate/up, FFN down, the LM head (tied token embedding)."""


def read_probe(nbytes: int = 1 << 30, reps: int = 3) -> float:
    """Streamed read bandwidth in GB/s: float32 sum and matrix-vector product over ``nbytes``, best pass of each."""
    cols = 1 << 14
    buf = torch.ones(nbytes // 4 // cols * cols, dtype=torch.float32)
    ones = torch.ones(cols, dtype=torch.float32)
    best = math.inf
    for fn in (lambda: buf.sum(), lambda: torch.mv(buf.view(-1, cols), ones)):
        for i in range(reps + 1):
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if i:
                best = min(best, dt)
    return buf.numel() * 4 / best / 1e9


def packed_pool(qtype: str, n: int, k: int, pool_bytes: int, seed: int = 0) -> list[QuantizedTensor]:
    """Copies of one random packed ``[n, k]`` matrix (finite fp16 scales), enough to fill ``pool_bytes``."""
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
    scale = np.full((n, k // bs, 1), 0.01, dtype=np.float16).view(np.uint8)
    offsets = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,)}.get(qtype, (0,))
    for off in offsets:
        raw[:, :, off:off + 2] = scale
    raw = raw.reshape(n, -1)
    count = max(1, -(-pool_bytes // raw.nbytes))
    return [QuantizedTensor(torch.from_numpy(raw.copy()), qtype, (n, k)) for _ in range(count)]


def time_calls(pool: list[QuantizedTensor], x: torch.Tensor, min_seconds: float, max_calls: int | None = None,
               fn: Callable[[torch.Tensor, QuantizedTensor], Any] = linear,
               sync: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per ``fn(x, W)`` call (default :func:`fast.quants.linear`), cycling
    through ``pool`` after an untimed warm-up call: at least one pass of the pool and ``min_seconds``, at most
    ``max_calls`` calls (None: no limit). ``sync`` (a device's ``synchronize``) is called after the warm-up and after
    the last call, so that queued work is timed. Shared by this module, :mod:`fast.q8_bench` and
    :mod:`fast.cuda_bench`."""
    fn(x, pool[-1])
    if sync is not None:
        sync()
    calls, t0, c0 = 0, time.perf_counter(), time.process_time()
    while (max_calls is None or calls < max_calls) and (calls < len(pool) or time.perf_counter() - t0 < min_seconds):
        fn(x, pool[calls % len(pool)])
        calls += 1
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of pre-formatted cells (the benches' tables; figures formatted by the caller)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def case_args(ap: argparse.ArgumentParser, shapes: dict[str, tuple[int, int]], types: str, rows: str = "1,8",
              shape_help: str | None = None, of: list[str] | None = None) -> None:
    """The benches' common options: ``--types`` (default ``types``; ``of``: the types taken, for the help),
    ``--shapes`` (names of ``shapes``, default all; or default None and ``shape_help``), ``--rows`` (values of M,
    default ``rows``; :func:`ints` reads it)."""
    kinds = f", of {', '.join(of)}" if of else ""
    ap.add_argument("--types", default=types, help=f"comma-separated GGUF types{kinds} (default {types})")
    ap.add_argument("--shapes", default=None if shape_help else ",".join(shapes),
                    help=shape_help or f"comma-separated, of {', '.join(shapes)}")
    ap.add_argument("--rows", default=rows, help=f"values of M (default {rows})")


def ints(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``."""
    return [int(v) for v in text.split(",")]


L2_BYTES = 768 * 1024
"""Packed bytes of the L2 case: three quarters of the per-core L2 of the CI VM (1 MB), so that x and the output fit
beside it; large enough that the call's own cost (a few microseconds) stays small beside the product's. On a CPU
with a smaller L2 the case reads from L3 and says less."""


def run(types: list[str], shapes: list[str], rows: list[int], pool_gib: float = 1.0, torch_path: bool = True,
        min_seconds: float = 1.0, l2: bool = False) -> list[dict]:
    """Measure every (type, shape, M); returns one dict a row (see the module docstring for the fields)."""
    probe = read_probe()
    out = []
    for qtype in types:
        for shape in shapes:
            n, k = SHAPES[shape]
            pool = packed_pool(qtype, n, k, int(pool_gib * (1 << 30)))
            nbytes = pool[0].nbytes
            for m in rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                row = {"type": qtype, "shape": f"{shape} {n}x{k}", "M": m, "MB": nbytes / 1e6, "probe": probe}
                wall, cpu = time_calls(pool, x, min_seconds, 10_000)
                row["packed"], row["packed_cpu"] = nbytes / wall / 1e9, nbytes / cpu / 1e9
                if torch_path:
                    with quant_kernels.disabled():
                        row["torch"] = nbytes / time_calls(pool, x, min_seconds / 2, 3)[0] / 1e9
                if l2:
                    row_bytes = pool[0].raw.shape[1]
                    n2 = max(16, L2_BYTES // row_bytes // 16 * 16)
                    raw2 = pool[0].raw[:n2].clone()
                    lay = quant_kernels.layout(raw2, qtype, k)
                    quant_kernels.linear(x, raw2, qtype, k, lay)
                    calls, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < min_seconds / 2:
                        quant_kernels.linear(x, raw2, qtype, k, lay)
                        calls += 1
                    row["l2"] = raw2.numel() / ((time.perf_counter() - t0) / calls) / 1e9
                out.append(row)
            del pool
    return out


def table(rows: list[dict]) -> str:
    """Markdown table of :func:`run`'s rows."""
    cells = []
    for r in rows:
        t, c = r.get("torch"), r.get("l2")
        old, gain = ("", "") if t is None else (f"{t:.2f}", f"{r['packed'] / t:.1f}x")
        cache, ratio = ("", "") if c is None else (f"{c:.2f}", f"{r['packed'] / c:.2f}")
        cells.append([r["type"], r["shape"], str(r["M"]), f"{r['MB']:.1f}", f"{r['packed']:.2f}",
                      f"{r['packed'] / r['probe']:.0%}", f"{r['packed_cpu']:.2f}", old, gain, cache, ratio])
    return markdown(["type", "matrix", "M", "MB", "packed GB/s", "share of probe", "per CPU-s", "torch path GB/s",
                     "speed-up", "L2 GB/s", "memory / L2"], cells)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints the machine, the probe and the table. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m gemma4_harness.fast.quant_bench", description=__doc__.splitlines()[0])
    case_args(ap, SHAPES, "Q8_0,Q4_K")
    ap.add_argument("--pool-gib", type=float, default=1.0, help="bytes cycled through per case, GiB (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch dequantize-then-F.linear path")
    ap.add_argument("--l2", action="store_true", help="also time each product on an L2-sized cut of the matrix")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ok, why = quant_kernels.status()
    print(f"packed kernels: {'ISA ' + str(quant_kernels.isa()) if ok else 'not available: ' + why}; "
          f"threads {torch.get_num_threads()}")
    rows = run(a.types.split(","), a.shapes.split(","), ints(a.rows), a.pool_gib,
               not a.no_torch, l2=a.l2)
    print(f"read probe: {rows[0]['probe']:.1f} GB/s" if rows else "nothing measured")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
