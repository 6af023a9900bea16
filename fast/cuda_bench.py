"""Micro-benchmark of the fused Triton kernels: GB/s of packed weights read, against dequantize-then-multiply.

Run on a GPU: ``python -m gemma4_harness.fast.cuda_bench`` (defaults: Q8_0 and Q4_K; E4B's FFN
matrices 10240 x 2560 and 2560 x 10240, 31B's 21504 x 5376 and 5376 x 21504, the
262144 x 2560 LM head; ``M`` = 1, 8, 64; float32 ``x``). Smoke test on the CPU, through
Triton's interpreter, at tiny sizes: ``TRITON_INTERPRET=1 python -m gemma4_harness.fast.cuda_bench
--device cpu --smoke`` (``tests/test_cuda_kernels.py`` runs it; its figures mean nothing).

What it measures, per (type, matrix, ``M``):

* ``probe``: the device's streamed read bandwidth, GB/s: the best of a few ``sum()`` passes
  over a float32 buffer (1 GiB on CUDA, 16 MiB in smoke mode);
* ``fused``: :func:`fast.cuda_kernels.linear`, cycling through a pool of copies of the
  matrix at least ``pool_gib`` large (so the bytes come from device memory, not from the
  L2 cache: 50 MB on an H100/H200);
* ``dequant``: :func:`fast.quants.linear` with the fused (and CPU) kernels off: torch
  dequantizes chunks of rows into ``x.dtype``, then ``x @ w.T`` (cuBLAS on CUDA);
* ``ratio`` = fused / dequant; ``share`` = fused / probe; ``max_abs_diff`` between the two
  results (a sanity figure: they differ by summation order, and for 16-bit ``x`` by the
  dequant path's rounding of the weights to 16 bits).

GB/s = packed bytes of the matrix / seconds per call (1e9 bytes). Timing: after a warm-up
call (which compiles the kernel), ``torch.cuda.synchronize()`` then ``perf_counter`` around
a loop of calls ending in another synchronize; on the CPU, ``perf_counter`` alone. Figures
go to stdout, never into asserts.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from . import cuda_kernels, quant_kernels
from .quant_bench import case_args, ints, markdown, packed_pool, time_calls
from .quants import QuantizedTensor, linear

SHAPES = {"e4b_ffn_up": (10240, 2560), "e4b_ffn_down": (2560, 10240), "31b_ffn_up": (21504, 5376),
          "31b_ffn_down": (5376, 21504), "head": (262144, 2560)}
"""``[N, K]`` matrices: Gemma 4 E4B-like and 31B-like FFN gate/up and down, the LM head (tied token embedding)."""
SMOKE_SHAPES = {"tiny_up": (96, 256), "tiny_down": (40, 512)}
"""Tiny ``[N, K]`` matrices for ``--smoke`` (the interpreter runs a program at a time, in NumPy)."""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def read_probe(device: str, nbytes: int, reps: int = 5) -> float:
    """Streamed read bandwidth of ``device`` in GB/s: the best of ``reps`` float32 ``sum()`` passes over ``nbytes``."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buf.sum()
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        buf.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def _fused(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    y = cuda_kernels.linear(x, qt.raw, qt.qtype.name, qt.row_len)
    if y is None:
        raise RuntimeError(f"the fused kernel declined {qt!r} with x {tuple(x.shape)} {x.dtype} on {x.device}: "
                           f"{cuda_kernels.status()[1] or 'see fast.cuda_kernels.linear'}")
    return y


def _dequant(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    with cuda_kernels.disabled(), quant_kernels.disabled():
        return linear(x, qt)


def run(types: list[str], shapes: list[str], rows: list[int], device: str = "cuda", dtype: torch.dtype = torch.float32,
        pool_gib: float = 0.5, min_seconds: float = 0.5, smoke: bool = False) -> list[dict]:
    """Measure every (type, shape, M); one dict a row: ``type``, ``shape``, ``M``, ``MB`` (packed), ``probe``,
    ``fused``, ``dequant`` (GB/s), ``ratio``, ``max_abs_diff``.

    ``smoke``: shapes from :data:`SMOKE_SHAPES`, one copy of each matrix, one timed call per path (for the CPU
    interpreter). Raises RuntimeError when the fused kernel declines a case (e.g. no CUDA, no triton, or the CPU
    without ``TRITON_INTERPRET=1``), KeyError for an unknown shape name.
    """
    table_ = SMOKE_SHAPES if smoke else SHAPES
    probe = read_probe(device, (16 if smoke else 1024) << 20)
    out = []
    for qtype in types:
        for shape in shapes:
            n, k = table_[shape]
            pool = packed_pool(qtype, n, k, 0 if smoke else int(pool_gib * (1 << 30)))
            pool = [qt.to(device) for qt in pool]
            nbytes = pool[0].nbytes
            for m in rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
                row = {"type": qtype, "shape": f"{shape} {n}x{k}", "M": m, "MB": nbytes / 1e6, "probe": probe}
                secs = (0.0, 1) if smoke else (min_seconds, 10_000)
                row["fused"] = nbytes / time_calls(pool, x, *secs, fn=_fused, sync=lambda: _sync(device))[0] / 1e9
                row["dequant"] = nbytes / time_calls(pool, x, *secs, fn=_dequant, sync=lambda: _sync(device))[0] / 1e9
                row["ratio"] = row["fused"] / row["dequant"]
                diff = (_fused(x, pool[0]).float() - _dequant(x, pool[0]).float()).abs().max()
                row["max_abs_diff"] = float(diff)
                out.append(row)
            del pool
    return out


def table(rows: list[dict]) -> str:
    """Markdown table of :func:`run`'s rows."""
    return markdown(["type", "matrix", "M", "MB", "fused GB/s", "share of probe", "dequant GB/s", "fused/dequant",
                     "max abs diff"],
                    [[r["type"], r["shape"], str(r["M"]), f"{r['MB']:.4g}", f"{r['fused']:.4g}",
                      f"{r['fused'] / r['probe']:.0%}", f"{r['dequant']:.4g}", f"{r['ratio']:.3g}x",
                      f"{r['max_abs_diff']:.3g}"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints the device, the probe and the table. Returns 0, or 2 (after saying why) when the
    fused kernels are not available (no CUDA device, no triton, ``--device cpu`` without ``TRITON_INTERPRET=1``)."""
    ap = argparse.ArgumentParser(prog="python -m gemma4_harness.fast.cuda_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (default), or cpu with TRITON_INTERPRET=1 (smoke test only)")
    case_args(ap, SHAPES, "Q8_0,Q4_K", "1,8,64", shape_help=f"comma-separated, of {', '.join(SHAPES)} (default all; "
                                                             f"with --smoke: {', '.join(SMOKE_SHAPES)})")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="x's dtype")
    ap.add_argument("--pool-gib", type=float, default=0.5, help="bytes cycled through per case, GiB (default 0.5)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one call per path (CPU interpreter check)")
    a = ap.parse_args(argv)
    ok, why = cuda_kernels.status()
    name = torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available() else a.device
    print(f"device: {name}; fused kernels: {'available' if ok else 'not available: ' + why}"
          f"{' (' + why + ')' if ok and why else ''}")
    if not ok:
        return 2
    shapes = a.shapes.split(",") if a.shapes else list(SMOKE_SHAPES if a.smoke else SHAPES)
    rows = run(a.types.split(","), shapes, ints(a.rows), a.device, getattr(torch, a.dtype),
               a.pool_gib, smoke=a.smoke)
    print(f"read probe: {rows[0]['probe']:.1f} GB/s" if rows else "nothing measured")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
