"""The streaming reference: weights read when used, tables read in parts, the same logits bit for bit.

The reference before streaming dequantized every tensor whole and kept it; these tests run that
form (:class:`WholeTables`, every table dequantized whole, the head in one product) beside the
streaming one (:class:`reference.weights.Weights` with no cache, so every read goes to the file) and
require ``np.array_equal`` on every built-in case, every file form and type, and the real Gemma 3
GGUF (262,144-token vocabulary, K-quants: the head is read in many blocks).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import PROMPTS, builtin_specs
from gemma4_harness.reference import model as M
from gemma4_harness.reference.config import cut_layers
from gemma4_harness.reference.errors import ConfigError, ModelFileError
from gemma4_harness.reference.lazy_tensors import SafetensorsFile, safetensors_folder
from gemma4_harness.reference.weights import block_bounds, load_model


class WholeTables:
    """The pre-streaming weights: every tensor dequantized whole (``W[name]``), rows taken from the whole
    table, the LM head as one block."""

    def __init__(self, W):
        self.W = W

    def __getitem__(self, name):
        return self.W[name]

    def __contains__(self, name):
        return name in self.W

    def rows(self, name, ids):
        return self.W[name][ids]

    def row_blocks(self, name):
        return iter([self.W[name]])


def _prompts():
    return [json.loads(line)["prompt_ids"] for line in Path(PROMPTS).read_text().splitlines() if line.strip()]


def _same_logits(path, prompts, layers=None):
    cfg, whole = load_model(path, cache_bytes=10**12, layers=layers)
    _, streamed = load_model(path, cache_bytes=0, layers=layers)
    for ids in prompts:
        a = M.forward(cfg, WholeTables(whole), ids)
        b = M.forward(cfg, streamed, ids)
        assert np.array_equal(a, b), f"{path}: prompt of {len(ids)} tokens: max |diff| {np.abs(a - b).max():.3g}"
        cache = M.KVCache(cfg)  # decode steps: the head in one-row products
        steps = [M.forward(cfg, streamed, ids[:-1], cache), M.forward(cfg, streamed, ids[-1:], cache)] \
            if len(ids) > 1 else [M.forward(cfg, streamed, ids, cache)]
        cache_w = M.KVCache(cfg)
        steps_w = [M.forward(cfg, WholeTables(whole), ids[:-1], cache_w),
                   M.forward(cfg, WholeTables(whole), ids[-1:], cache_w)] if len(ids) > 1 else \
            [M.forward(cfg, WholeTables(whole), ids, cache_w)]
        assert all(np.array_equal(x, y) for x, y in zip(steps, steps_w)), f"{path}: cached steps differ"
    assert streamed.cached_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", builtin_specs(), ids=lambda p: p.stem)
def test_streaming_is_bit_identical_on_every_builtin_case(spec):
    """Every file of the case (HF safetensors and each GGUF type), every prompt of the synthetic set."""
    built = synth.ensure_built(spec)
    for path in [built.hf_dir, *built.gguf.values()]:
        _same_logits(path, _prompts())


@pytest.mark.slow
def test_streaming_is_bit_identical_on_the_real_gemma3_gguf():
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    path = gemma3_270m_gguf()
    cfg, _ = load_model(path, cache_bytes=0)
    assert len(block_bounds(cfg.vocab_size, cfg.hidden_size)) > 1  # the head really is read in blocks
    _same_logits(path, [[2, 818, 5279, 529], [2, 9259, 236764, 1603, 1217, 1069, 236881]])


@pytest.mark.parametrize("h, V", [(256, 80000), (1536, 10000)])
def test_head_blocks_give_the_one_call_product(h, V):
    """The property the bit-identity rests on: BLAS gives the same columns whether the product is made in
    one call or in :func:`block_bounds` blocks (a short remainder is merged, so no block is narrow)."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((V, h))
    bounds = block_bounds(V, h)
    assert len(bounds) > 1 and bounds[-1][1] == V
    for T in (1, 2, 5, 17):
        x = rng.standard_normal((T, h))
        parts = np.concatenate([x @ W[a:b].T for a, b in bounds], axis=1)
        assert np.array_equal(parts, x @ W.T), f"T={T}"


def test_cache_admits_on_second_read_within_budget():
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    cfg, W = load_model(built.gguf["Q8_0"], cache_bytes=10**12)
    ids = _prompts()[1]
    first = M.forward(cfg, W, ids)
    assert W.cached_bytes == 0  # one forward reads each tensor once: nothing kept
    second = M.forward(cfg, W, ids)
    assert W.cached_bytes > 0 and np.array_equal(first, second)
    _, small = load_model(built.gguf["Q8_0"], cache_bytes=100_000)
    for _ in range(3):
        assert np.array_equal(M.forward(cfg, small, ids), first)
    assert 0 < small.cached_bytes <= 100_000


def test_rows_read_only_those_rows_and_equal_the_whole_table():
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    ids = np.array([5, 2, 5, 300, 0], dtype=np.int64)
    for path in [built.hf_dir, *built.gguf.values()]:
        _, W = load_model(path, cache_bytes=0)
        for name in ("token_embd.weight", "per_layer_token_embd.weight"):
            assert np.array_equal(W.rows(name, ids), W[name][ids]), f"{path} {name}"
            got = np.concatenate(list(W.row_blocks(name)))
            assert np.array_equal(got, W[name]), f"{path} {name} blocks"


def test_bf16_safetensors_read_exactly(tmp_path):
    """BF16 is widened by bit placement, which is what torch's bfloat16 -> float32 gives."""
    import torch
    from safetensors.torch import save_file as save_torch

    t = torch.randn(7, 64).to(torch.bfloat16)
    t[0, :4] = torch.tensor([0.0, -0.0, 1e-40, 3e38])
    save_torch({"w": t, "v": torch.randn(3)}, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert np.array_equal(f.read("w"), t.float().numpy())
    assert np.array_equal(f.read_rows("w", np.array([4, 1])), t.float().numpy()[[4, 1]])
    assert f.lazy("v").read_rows is None and f.lazy("w").dtype == "BF16"


def test_one_name_in_two_safetensors_files_is_refused(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "1.safetensors"))
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "2.safetensors"))
    with pytest.raises(ModelFileError, match="tensor a is also in 1.safetensors"):
        safetensors_folder(tmp_path)


def test_damaged_safetensors_is_one_line(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelFileError, match="cannot read safetensors") as e:
        safetensors_folder(tmp_path)
    assert "\n" not in str(e.value)


def test_a_nan_in_a_row_read_is_named_in_the_whole_table(make_tiny_gguf, tmp_path):
    """A NaN in the embedding row of a prompt token: the element is named with its row in the table."""
    path = make_tiny_gguf()
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    offset = int(t.data_offset) + (7 * t.data.shape[1] + 3) * 4
    data = bytearray(path.read_bytes())
    data[offset:offset + 4] = np.array([np.nan], dtype=np.float32).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    cfg, W = load_model(bad, cache_bytes=0)
    assert W.rows("token_embd.weight", np.array([1, 2, 3])).shape == (3, cfg.hidden_size)  # row 7 not read
    with pytest.raises(ModelFileError, match=r"token_embd.weight: element \[7, 3\] is NaN"):
        W.rows("token_embd.weight", np.array([1, 7]))
    with pytest.raises(ModelFileError, match=r"token_embd.weight: element \[7, 3\] is NaN"):
        M.forward(cfg, W, [1, 2, 3])  # the tied head reads every row


def test_cut_layers_keeps_a_valid_sharing_layout():
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    cfg, _ = load_model(built.gguf["F32"])
    first_shared = cfg.n_layer - cfg.n_kv_shared
    for n in range(1, cfg.n_layer + 1):
        cut = cut_layers(cfg, n)
        assert cut.n_layer == n and cut.layers == cfg.layers[:n]
        assert cut.n_kv_shared == max(0, n - first_shared)
        assert all(L.kv_donor < n and cut.layers[L.kv_donor].has_kv for L in cut.layers)
    with pytest.raises(ConfigError, match="--layers 0"):
        cut_layers(cfg, 0)


@pytest.mark.parametrize("form", ["hf", "Q8_0", "F16"])
def test_layers_cut_equals_the_first_layers_of_the_whole_model(form):
    """``--layers N`` on a file: the trace of the cut model equals the whole model's up to layer N-1
    (the PLE table and projection cut to N layers carry the same values)."""
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    path = built.hf_dir if form == "hf" else built.gguf[form]
    cfg, W = load_model(path)
    n = cfg.n_layer - cfg.n_kv_shared  # the last layer before the shared tail: the cut shares nothing
    cut_cfg, cut_W = load_model(path, layers=n, cache_bytes=0)
    assert cut_cfg.n_layer == n and "per_layer_token_embd.weight" in cut_W
    whole, part = {}, {}
    ids = _prompts()[2]
    M.forward(cfg, W, ids, trace=lambda p, il, a: whole.setdefault((p, il), a))
    M.forward(cut_cfg, cut_W, ids, trace=lambda p, il, a: part.setdefault((p, il), a))
    assert np.array_equal(part[("inp_per_layer", -1)], whole[("inp_per_layer", -1)][:, :n])
    for il in range(n):
        assert np.array_equal(part[("l_out", il)], whole[("l_out", il)]), f"layer {il}"
