"""Micro-benchmark of the fast engine's ``--compute q8`` kernel against its exact fp32 packed kernel.

Run: ``python -m gemma4_harness.fast.q8_bench`` (defaults: Q8_0 and Q4_0, a 2048 x 8192, an 8192 x 2048 and a
2048 x 2816 matrix, ``M`` = 1 and 8, 1 and 2 threads, in one run; ``--types Q4_K,Q6_K --shapes 2048x2816
--emulated`` for the K-quants against the path they took before). ``pytest --bench -m bench -s -k q8_bench
tests/test_q8_compute.py`` runs the same and prints the table.

What it measures: seconds per product ``x @ W.T`` of ``M`` rows, for

* ``exact``: :func:`fast.quant_kernels.linear` (float32 activations, the exact dequantized weights, fp32 sums);
* ``q8``: :func:`fast.quant_kernels.q8_linear` (llama.cpp's arithmetic: the rows quantized to Q8_0 or Q8_K, integer
  dot products, ``fast/csrc/linear_q8.c``; its ISA path printed);
* ``emulated`` (with ``--emulated``): the same rounding emulated, :func:`fast.q8_compute._rounded_product` (the rows
  rounded in torch by :func:`fast.activation_quants.round_activations`, then the exact packed kernel): what
  ``--compute q8`` runs for a type the C kernel does not take;

over a pool of copies of the matrix (``pool_mib``, cycled through so that the bytes come from memory, not from the
last-level cache), after a warm-up call. GB/s = packed bytes / seconds per call (1e9 bytes). The load average
(``os.getloadavg``) is printed before and after: on a shared machine the figures are indicative only. Figures go to
stdout, never into asserts.
"""

from __future__ import annotations

import argparse
import os

import torch

from . import q8_compute, quant_kernels
from .quant_bench import case_args, ints, markdown, packed_pool, time_calls

SHAPES = {"2048x8192": (2048, 8192), "8192x2048": (8192, 2048), "2048x2816": (2048, 2816)}
"""``[N, K]``: a down-projection-like matrix (K 8192), its transpose shape (N 8192), and a [2816, 2048] input
(Gemma 4 E2B's rows of 2816: K a multiple of 256, for the K-quants)."""


def run(types: list[str], shapes: list[str], rows: list[int], threads: list[int], pool_mib: int = 512,
        min_seconds: float = 1.0, emulated: bool = False) -> list[dict]:
    """One dict per (type, shape, threads, M): ``exact`` and ``q8`` (wall seconds per call) and ``exact_cpu``,
    ``q8_cpu`` (process CPU seconds per call), ``MB`` packed; with ``emulated`` also ``emulated`` and
    ``emulated_cpu``. ``exact`` and ``exact_cpu`` are None for a type the exact packed kernel does not take (Q2_K,
    Q3_K: the engine dequantizes those in torch)."""
    out = []
    saved = torch.get_num_threads()
    try:
        for qtype in types:
            for shape in shapes:
                n, k = SHAPES[shape]
                pool = packed_pool(qtype, n, k, pool_mib << 20)
                nbytes = pool[0].nbytes

                def exact(x, w, k=k, qtype=qtype):
                    return quant_kernels.linear(x, w.raw, qtype, k, w.kernel_layout)

                def q8(x, w, k=k, qtype=qtype):
                    return quant_kernels.q8_linear(x, w.raw, qtype, k)

                def emulate(x, w, qtype=qtype):
                    return q8_compute._rounded_product(x, w, qtype, lambda: q8_compute._q8_1_minima(w))

                for t in threads:
                    torch.set_num_threads(t)
                    for m in rows:
                        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                        packed = exact(x, pool[0]) is not None
                        (e, ec), (q, qc) = (time_calls(pool, x, min_seconds, fn=exact) if packed else (None, None),
                                            time_calls(pool, x, min_seconds, fn=q8))
                        out.append({"type": qtype, "shape": shape, "threads": t, "M": m, "MB": nbytes / 1e6,
                                    "exact": e, "q8": q, "exact_cpu": ec, "q8_cpu": qc})
                        if emulated:
                            out[-1]["emulated"], out[-1]["emulated_cpu"] = time_calls(pool, x, min_seconds,
                                                                                      fn=emulate)
                del pool
    finally:
        torch.set_num_threads(saved)
    return out


def table(rows: list[dict]) -> str:
    """Markdown table of :func:`run`'s rows (the emulated columns where measured; n/a where not)."""
    emu = all("emulated" in r for r in rows)

    def ms(v):
        return "n/a" if v is None else f"{v * 1e3:.3f}"

    def ratio(a, b):
        return "n/a" if a is None or b is None else f"{a / b:.2f}x"

    def gbs(mb, v):
        return "n/a" if v is None else f"{mb / 1e3 / v:.1f}"

    return markdown(["type", "matrix", "threads", "M", "MB", "exact ms", "exact GB/s", "q8 ms", "q8 GB/s",
                     "q8 speed-up (wall)", "exact CPU ms", "q8 CPU ms", "q8 speed-up (CPU)"]
                    + (["emulated ms", "emulated CPU ms", "q8 over emulated (wall)", "q8 over emulated (CPU)"]
                       if emu else []),
                    [[r["type"], r["shape"], str(r["threads"]), str(r["M"]), f"{r['MB']:.1f}",
                      ms(r["exact"]), gbs(r["MB"], r["exact"]), ms(r["q8"]), gbs(r["MB"], r["q8"]),
                      ratio(r["exact"], r["q8"]), ms(r["exact_cpu"]), ms(r["q8_cpu"]),
                      ratio(r["exact_cpu"], r["q8_cpu"])]
                     + ([ms(r["emulated"]), ms(r["emulated_cpu"]), ratio(r["emulated"], r["q8"]),
                         ratio(r["emulated_cpu"], r["q8_cpu"])] if emu else [])
                     for r in rows])


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints the ISA paths, the load average before and after, and the table. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m gemma4_harness.fast.q8_bench", description=__doc__.splitlines()[0])
    case_args(ap, SHAPES, "Q8_0,Q4_0", of=list(quant_kernels.Q8_TYPES))
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--pool-mib", type=int, default=512, help="bytes cycled through per case, MiB (default 512)")
    ap.add_argument("--seconds", type=float, default=1.0, help="least seconds timed per figure (default 1)")
    ap.add_argument("--emulated", action="store_true",
                    help="also time the rounding emulated in torch + the exact packed kernel (the path before)")
    a = ap.parse_args(argv)
    print(f"exact packed kernel ISA {quant_kernels.isa()}, q8 kernel ISA {quant_kernels.q8_isa()} "
          "(512: AVX-512 VNNI for q8, AVX-512 for exact; 256: AVX2; 0: plain C)")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    rows = run(a.types.split(","), a.shapes.split(","), ints(a.rows), ints(a.threads), a.pool_mib, a.seconds,
               a.emulated)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
