"""Attention in bounded memory: no engine builds the ``[H, T, S]`` score matrix of a long prompt.

The numbers are checked elsewhere (``tests/test_ops.py``: the blocked attention equals the whole score
matrix); here, what each engine touches. The reference's peak allocation (``tracemalloc`` sees NumPy's
buffers) on a sliding layer stays below the scores one query block would need against *all* keys, and
on a full layer below one whole score matrix. The fast engine's ``scaled_dot_product_attention`` calls
see at most a block of queries and, on a sliding layer, only the keys of the block's windows. The
times and peaks of whole long prompts are measured by ``tests/longprompt.py`` (not a test).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

import gemma4_harness.fast.model as fm
import gemma4_harness.reference.model as rm

H, HKV, D, WINDOW = 2, 1, 8, 16


def _qkv(T: int):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((T, H, D)), rng.standard_normal((T, HKV, D)), rng.standard_normal((T, HKV, D)),
            np.arange(T))


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_reference_sliding_layer_reads_only_the_window():
    T = 8192
    q, k, v, pos = _qkv(T)
    peak = _peak_bytes(lambda: rm.attention(q, k, v, pos, pos, WINDOW, 1.0))
    one_block_all_keys = H * rm.ATTENTION_BLOCK * T * 8  # float64 scores of one query block against every key
    assert peak < one_block_all_keys, f"peak {peak / 1e6:.1f} MB"


def test_reference_full_layer_never_holds_the_whole_score_matrix():
    T = 2048
    q, k, v, pos = _qkv(T)
    peak = _peak_bytes(lambda: rm.attention(q, k, v, pos, pos, None, 1.0))
    assert peak < H * T * T * 8, f"peak {peak / 1e6:.1f} MB"  # one [H, T, T] float64 matrix


@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
def test_fast_attention_calls_see_a_block_of_queries_and_only_reachable_keys(monkeypatch, window):
    T = 4 * fm.ATTENTION_BLOCK + 100
    q, k, v = (torch.from_numpy(a).float() for a in _qkv(T)[:3])
    pos = torch.arange(T)
    calls: list[tuple[int, int]] = []
    block = fm.attend_block

    def spy(query, key, value, allowed, scale, group):
        calls.append((query.shape[0], key.shape[0]))
        return block(query, key, value, allowed, scale, group)

    monkeypatch.setattr(fm, "attend_block", spy)
    fm.attention(q, k, v, pos, pos, window, 1.0)
    assert len(calls) == -(-T // fm.ATTENTION_BLOCK)
    assert max(t for t, _ in calls) <= fm.ATTENTION_BLOCK
    most_keys = fm.ATTENTION_BLOCK + WINDOW - 1 if window else T
    assert max(s for _, s in calls) == most_keys
