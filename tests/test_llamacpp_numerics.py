"""The reference with llama.cpp's fp16 GELU table (what the llama.cpp gates compare against); no llama.cpp needed."""

from __future__ import annotations

import numpy as np

import reference.model as rm
from harness.engines.llamacpp.numerics import gelu_fp16_table, llamacpp_numerics


def test_table_values_are_fp16_of_gelu_of_fp16_inputs():
    x = np.linspace(-12, 12, 20001)
    y = gelu_fp16_table(x)
    inside = (x > -10) & (x < 10)
    x16 = x.astype(np.float16).astype(np.float64)
    assert np.array_equal(y[inside], rm.gelu_tanh(x16[inside]).astype(np.float16).astype(np.float64))
    assert np.all(y[x <= -10] == 0.0) and np.array_equal(y[x >= 10], x[x >= 10])
    # an fp16 value in, an fp16 value out: the error is of the order of fp16's relative step
    assert np.all(np.abs(y[inside] - rm.gelu_tanh(x[inside])) <= 2.0 ** -10 * (np.abs(x[inside]) + 1))


def test_context_swaps_the_reference_gelu_and_restores_it(tiny_gguf):
    from reference import load_model

    cfg, W = load_model(tiny_gguf)
    ids = [2, 5, 9, 4, 7]
    exact = rm.forward(cfg, W, ids)
    original = rm.gelu_tanh
    with llamacpp_numerics():
        assert rm.gelu_tanh is gelu_fp16_table
        emulated = rm.forward(cfg, W, ids)
    assert rm.gelu_tanh is original
    d = np.abs(exact - emulated).max()
    assert 0 < d < 1e-1 * np.abs(exact).max()
    assert np.array_equal(rm.forward(cfg, W, ids), exact)
