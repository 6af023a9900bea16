"""The small-M float32 CPU kernel of fast/ (``fast/csrc/linear_f32.c``): accuracy, batch independence, fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gemma4_harness.fast import cpu_kernels as ck

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

available, why = ck.status()
needs_kernel = pytest.mark.skipif(not available, reason=f"CPU kernel not built here: {why}")


def _error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case float32 rounding error of each dot product: K * u * sum_k |x_k w_k| (Higham, Thm 3.1), u = 2^-24."""
    k = x.shape[1]
    return k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 13, 16])
@pytest.mark.parametrize("n,k", [(2, 16), (64, 1024), (258, 48)])
def test_matches_float64_within_the_rounding_bound(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = ck.linear_f32(x, w)
    assert y is not None and y.shape == (m, n) and y.dtype == torch.float32
    exact = x.double() @ w.double().T
    assert bool(((y.double() - exact).abs() <= _error_bound(x, w)).all())


@needs_kernel
def test_rows_do_not_depend_on_batch_size_or_neighbours():
    """A row's result is bit-identical alone, in any batch size, and next to any other rows."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(ck.MAX_ROWS, 256, generator=g)
    full = ck.linear_f32(x, w)
    for m in range(1, ck.MAX_ROWS + 1):
        assert torch.equal(ck.linear_f32(x[:m], w), full[:m])
        other = torch.cat([x[:1], torch.randn(m - 1, 256, generator=g)])
        assert torch.equal(ck.linear_f32(other, w)[0], full[0])


@pytest.mark.parametrize("x,w", [
    (torch.zeros(17, 32), torch.zeros(4, 32)),                        # more rows than MAX_ROWS
    (torch.zeros(2, 24), torch.zeros(4, 24)),                         # K not a multiple of 16
    (torch.zeros(2, 32), torch.zeros(3, 32)),                         # odd N
    (torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16)),
    (torch.zeros(2, 32), torch.zeros(32, 4).T),                      # non-contiguous weight
])
def test_falls_back_when_it_does_not_apply(x, w):
    assert ck.linear_f32(x, w) is None


def test_can_be_switched_off():
    code = "from gemma4_harness.fast import cpu_kernels as ck; print(ck.status())"
    env = dict(os.environ, G4H_CPU_KERNEL="0", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "(False, 'disabled by G4H_CPU_KERNEL=0')"


@needs_kernel
def test_build_is_cached():
    assert ck.build() == ck.build()
