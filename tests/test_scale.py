"""The scale fixture (:mod:`harness.synth.scale`, ``g4h synth --shape``): real-size GGUFs written a block at a time."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from fast.shapes import load_shape, shape_names
from harness.cli import main
from harness.core import memory
from harness.core.paths import REPO_ROOT
from harness.synth.scale import FORMATS, shape_raw_config, write_scale_gguf
from reference import model as M
from reference.config import config_from_hf
from reference.weights import load_model

SMALL_SHAPE = """
description = "test: a small E2B-like decoder (PLE, KV sharing, double-wide MLP)"
source = "tests/test_scale.py"
[config]
vocab_size = 2048
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 4
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 32
global_head_dim = 64
attention_k_eq_v = false
layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
sliding_window = 8
max_position_embeddings = 4096
rms_norm_eps = 1e-6
hidden_activation = "gelu_pytorch_tanh"
num_kv_shared_layers = 2
hidden_size_per_layer_input = 32
vocab_size_per_layer_input = 2048
use_double_wide_mlp = true
enable_moe_block = false
final_logit_softcapping = 30.0
tie_word_embeddings = true
bos_token_id = 2
eos_token_id = 1
pad_token_id = 0
[config.rope_parameters.sliding_attention]
rope_type = "default"
rope_theta = 10000.0
[config.rope_parameters.full_attention]
rope_type = "proportional"
partial_rotary_factor = 0.25
rope_theta = 1000000.0
"""


@pytest.fixture(scope="module")
def small_shape(tmp_path_factory):
    p = tmp_path_factory.mktemp("shape") / "small.toml"
    p.write_text(SMALL_SHAPE)
    return p


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fixture_writes_the_shape_in_each_format(small_shape, tmp_path, fmt):
    path = write_scale_gguf(str(small_shape), tmp_path / "m.gguf", fmt=fmt)
    cfg, W = load_model(path)
    want = load_shape(small_shape)
    assert [(L.is_sliding, L.n_ff, L.head_dim, L.kv_donor) for L in cfg.layers] == \
        [(L.is_sliding, L.n_ff, L.head_dim, L.kv_donor) for L in want.layers]
    assert W.raw_dtype("blk.0.ffn_up.weight") == FORMATS[fmt] and W.raw_dtype("blk.0.attn_norm.weight") == "F32"
    logits = M.forward(cfg, W, [2, 100, 7, 2047, 5])
    assert np.isfinite(logits).all() and logits.std(axis=1).min() > 0.1  # finite, not constant
    again = write_scale_gguf(str(small_shape), tmp_path / "again.gguf", fmt=fmt)
    assert again.read_bytes() == path.read_bytes()  # seeded per tensor: the same file every time


def test_blocks_quantize_like_the_whole_tensor(small_shape, tmp_path, monkeypatch):
    """Writing in blocks of rows gives the bytes of quantizing each tensor whole."""
    import harness.synth.scale as scale

    whole = write_scale_gguf(str(small_shape), tmp_path / "whole.gguf", fmt="q4_0")
    monkeypatch.setattr(scale, "BLOCK_ELEMENTS", 64 * 3)  # three rows of 64 per block
    blocks = write_scale_gguf(str(small_shape), tmp_path / "blocks.gguf", fmt="q4_0")
    a, b = gguf.GGUFReader(str(whole)), gguf.GGUFReader(str(blocks))
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.name == tb.name and np.array_equal(ta.data, tb.data), ta.name


@pytest.mark.parametrize("shape", shape_names())
@pytest.mark.parametrize("layers", [None, 1, 2, 7])
def test_metadata_of_a_cut_shape_derives_the_same_layers(shape, layers):
    raw, cfg = shape_raw_config(shape, layers)
    again = config_from_hf(raw, "raw")
    assert [(L.is_sliding, L.n_ff, L.head_dim, L.n_kv_head, L.kv_donor, L.has_v_proj) for L in again.layers] == \
        [(L.is_sliding, L.n_ff, L.head_dim, L.n_kv_head, L.kv_donor, L.has_v_proj) for L in cfg.layers]


def test_synth_cli_writes_a_shape(small_shape, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["synth", "--shape", str(small_shape), "--layers", "2", "--format", "q8_0", "--out", str(out)]) == 0
    cfg, _ = load_model(out)
    assert cfg.n_layer == 2 and str(out) in capsys.readouterr().out
    assert main(["synth", "--shape", "e2b"]) == 2  # no --out
    with pytest.raises(SystemExit):  # argparse refuses a format it does not list
        main(["synth", "--shape", str(small_shape), "--format", "q5_k", "--out", str(out)])


@pytest.mark.slow
def test_e2b_scale_file_runs_through_the_streaming_reference(tmp_path):
    """E2B at its real width (262144 vocabulary, PLE, 1536 hidden), cut to 2 layers: the reference's logits
    are finite and spread out, and its peak private memory (a fresh process) stays within the 3 GB the
    full model is held to."""
    path = write_scale_gguf("e2b", tmp_path / "e2b-2.gguf", layers=2, fmt="q8_0")
    ids = tmp_path / "ids.json"
    ids.write_text(str([2 + 997 * i for i in range(16)]))
    out = tmp_path / "out.npy"
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "logits", "--model", str(path), "--engine",
                             "reference", "--prompt-ids", str(ids), "--out", str(out)], cwd=REPO_ROOT,
                            stderr=subprocess.PIPE, text=True)
    with memory.PeakMemory(proc.pid, interval=0.02) as pm:
        _, err = proc.communicate(timeout=1200)
    assert proc.returncode == 0, err
    logits = np.load(out)
    assert logits.shape == (16, 262144) and np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 0.1 and len(set(logits.argmax(axis=1).tolist())) > 1
    assert pm.peak_anon < 3 * memory.GB, pm.as_dict()
