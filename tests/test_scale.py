"""The scale fixture (:mod:`harness.synth.scale`, ``g4h synth --shape``): real-size GGUFs written a block at a time."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from gemma4_harness.fast.shapes import load_shape, shape_names
from gemma4_harness.harness.cli import main
from gemma4_harness.harness.core import memory, memory_machine
from gemma4_harness.harness.core.paths import REPO_ROOT
from gemma4_harness.harness.synth.scale import FORMATS, shape_raw_config, write_scale_gguf
from gemma4_harness.reference import model as M
from gemma4_harness.reference.config_hf import config_from_hf
from gemma4_harness.reference.weights import load_model

#: E2B made small (``[config]`` overrides of ``cases/shapes/e2b.toml``), cut to 7 layers: PLE, two KV-shared
#: layers with the double-wide MLP, both layer types.
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "head_dim": 32, "global_head_dim": 64,
         "hidden_size_per_layer_input": 32, "vocab_size": 2048, "vocab_size_per_layer_input": 2048,
         "sliding_window": 8}
SMALL_LAYERS = 7


def _small(path, fmt="q8_0", **kw):
    return write_scale_gguf("e2b", path, layers=SMALL_LAYERS, fmt=fmt, overrides=SMALL, **kw)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fixture_writes_the_shape_in_each_format(tmp_path, fmt):
    path = _small(tmp_path / "m.gguf", fmt)
    cfg, W = load_model(path)
    want = load_shape("e2b", layers=SMALL_LAYERS, overrides=SMALL)
    assert want.n_kv_shared and any(L.n_ff == 256 for L in cfg.layers)
    assert [(L.is_sliding, L.n_ff, L.head_dim, L.kv_donor) for L in cfg.layers] == \
        [(L.is_sliding, L.n_ff, L.head_dim, L.kv_donor) for L in want.layers]
    assert W.raw_dtype("blk.0.ffn_up.weight") == FORMATS[fmt] and W.raw_dtype("blk.0.attn_norm.weight") == "F32"
    logits = M.forward(cfg, W, [2, 100, 7, 2047, 5])
    assert np.isfinite(logits).all() and logits.std(axis=1).min() > 0.1  # finite, not constant
    again = _small(tmp_path / "again.gguf", fmt)
    assert again.read_bytes() == path.read_bytes()  # seeded per tensor: the same file every time


def test_blocks_quantize_like_the_whole_tensor(tmp_path, monkeypatch):
    """Writing in blocks of rows gives the bytes of quantizing each tensor whole."""
    import gemma4_harness.harness.synth.scale as scale

    whole = _small(tmp_path / "whole.gguf", "q4_0")
    monkeypatch.setattr(scale, "BLOCK_ELEMENTS", 64 * 3)  # three rows of 64 per block
    blocks = _small(tmp_path / "blocks.gguf", "q4_0")
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


def test_synth_cli_refuses_bad_options(tmp_path):
    out = tmp_path / "cli.gguf"
    assert main(["synth", "--shape", "e2b"]) == 2  # no --out
    assert main(["synth", "--shape", "e9b", "--out", str(out)]) == 2  # unknown shape
    assert main(["synth", "--layers", "2"]) == 2  # --layers without --shape
    with pytest.raises(SystemExit):  # argparse refuses a format it does not list
        main(["synth", "--shape", "e2b", "--format", "q5_k", "--out", str(out)])
    assert not out.exists()


@pytest.mark.slow
def test_e2b_scale_file_runs_through_the_streaming_reference(tmp_path):
    """E2B at its real width (262144 vocabulary, PLE, 1536 hidden), cut to 2 layers: the reference's logits
    are finite and spread out, and its peak private memory (a fresh process) stays within the 3 GB the
    full model is held to."""
    path = write_scale_gguf("e2b", tmp_path / "e2b-2.gguf", layers=2, fmt="q8_0")
    ids = tmp_path / "ids.json"
    ids.write_text(str([2 + 997 * i for i in range(16)]))
    out = tmp_path / "out.npy"
    proc = subprocess.Popen([sys.executable, "-m", "gemma4_harness.harness.cli", "logits", "--model", str(path), "--engine",
                             "reference", "--prompt-ids", str(ids), "--out", str(out)], cwd=REPO_ROOT,
                            stderr=subprocess.PIPE, text=True)
    with memory_machine.PeakMemory(proc.pid, interval=0.02) as pm:
        _, err = proc.communicate(timeout=1200)
    assert proc.returncode == 0, err
    logits = np.load(out)
    assert logits.shape == (16, 262144) and np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 0.1 and len(set(logits.argmax(axis=1).tolist())) > 1
    assert pm.peak_anon < 3 * memory.GB, pm.as_dict()
