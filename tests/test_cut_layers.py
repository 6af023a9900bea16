"""``--layers N`` on model files: every engine that can cut a model runs the same first N layers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_harness.harness import synth
from gemma4_harness.harness.cli import main
from gemma4_harness.harness.core.cases import builtin_specs
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.engines import make_engine
from gemma4_harness.reference.errors import InputError

PROMPT = [2, 17, 230, 45, 9, 301, 77, 12, 5, 140]


@pytest.fixture(scope="module")
def e2b():
    return synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))


def _full_layers(cfg) -> list[int]:
    """Values of N whose last kept layer is a full-attention one (transformers' rule)."""
    return [L.index + 1 for L in cfg.layers if not L.is_sliding]


def test_reference_fast_and_transformers_agree_on_a_cut(e2b):
    ref_full = make_engine("reference", e2b.hf_dir)
    cfg = ref_full.cfg
    first_shared = cfg.n_layer - cfg.n_kv_shared
    n = first_shared + 2  # keeps part of the KV-shared tail
    ref = make_engine("reference", e2b.hf_dir, layers=n)
    assert ref.cfg.n_layer == n and 0 < ref.cfg.n_kv_shared < cfg.n_kv_shared
    for path in (e2b.hf_dir, e2b.gguf["Q8_0"]):
        ref_q = make_engine("reference", path, layers=n).logits(PROMPT)
        for mode in ("dequantized", "packed"):
            fast = make_engine("fast", path, device="cpu", dtype="float32", layers=n, weights=mode).logits(PROMPT)
            assert DEFAULT_GATES["reference~fast.max_abs_logit"].check(float(np.abs(fast - ref_q).max())), (path, mode)
    assert not np.array_equal(ref.logits(PROMPT), ref_full.logits(PROMPT))  # the cut is another model
    n_t = _full_layers(cfg)[0]  # transformers: the last kept layer must be a full one
    want = make_engine("reference", e2b.hf_dir, layers=n_t).logits(PROMPT)
    hf = make_engine("transformers", e2b.hf_dir, layers=n_t).logits(PROMPT)
    assert DEFAULT_GATES["reference~transformers.max_abs_logit"].check(float(np.abs(hf - want).max()))


def test_transformers_refuses_a_cut_that_ends_on_a_sliding_layer(e2b):
    ref = make_engine("reference", e2b.hf_dir)
    n = next(L.index + 1 for L in ref.cfg.layers if L.is_sliding)
    with pytest.raises(InputError, match=f"--layers {n}: layer {n - 1} is a sliding layer") as e:
        make_engine("transformers", e2b.hf_dir, layers=n)
    assert "\n" not in str(e.value)


def test_engines_that_cannot_cut_refuse_in_one_line(e2b):
    with pytest.raises(InputError, match="the llamacpp engine runs the file as it is"):
        make_engine("llamacpp", e2b.gguf["F32"], layers=2)


def test_layers_out_of_range_is_one_line(e2b, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    assert main(["logits", "--model", str(e2b.gguf["F32"]), "--engine", "reference", "--prompt-ids", str(ids),
                 "--out", str(tmp_path / "x.npy"), "--layers", "99"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--layers 99: expected an integer in [1," in err


def test_logits_cli_with_layers_and_cache(e2b, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    out = tmp_path / "cut.npy"
    assert main(["logits", "--model", str(e2b.gguf["Q8_0"]), "--engine", "reference", "--prompt-ids", str(ids),
                 "--out", str(out), "--layers", "3", "--ref-cache-gb", "0"]) == 0
    want = make_engine("reference", e2b.gguf["Q8_0"], layers=3).logits(PROMPT)
    assert np.array_equal(np.load(out), want)
