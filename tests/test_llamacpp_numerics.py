"""The reference with llama.cpp's numerics (harness/engines/llamacpp/numerics.py) against llama.cpp itself: its fp16
GELU table bit for bit, and its attention over an f16 KV cache (flash attention off and on) to float32 rounding,
from llama.cpp's own intermediate tensors (tests/llamacpp_dump.py, a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gemma4_harness.reference.model as rm
from gemma4_harness.harness.engines.llamacpp.numerics import (
    FA_TILE_Q,
    attention_flash_fp16,
    attention_kv_rounded,
    attention_numerics,
    gelu_fp16_table,
    gelu_table,
    llamacpp_numerics,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggml_lib import need_llamacpp  # noqa: E402

DUMP = Path(__file__).resolve().parent / "llamacpp_dump.py"
SHAPES = Path(__file__).resolve().parent / "shapes"


def _dump(tmp_path: Path, *args: str) -> dict[str, np.ndarray]:
    out = tmp_path / f"dump{len(list(tmp_path.glob('dump*')))}.npz"
    r = subprocess.run([sys.executable, str(DUMP), *args[:1], str(out), *args[1:]], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    with np.load(out) as z:
        return {k.replace("@", "-"): z[k] for k in z.files}


def test_table_is_ggmls_own(tmp_path):
    """Every finite entry of the rebuilt table equals llama.cpp's ``ggml_table_gelu_f16``; rounding the float64 GELU
    instead would differ in hundreds of entries (so this test can fail)."""
    need_llamacpp()
    theirs = _dump(tmp_path, "--gelu-table")["table"]
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    assert np.array_equal(gelu_table()[np.isfinite(x)], theirs[np.isfinite(x)])
    inside = np.isfinite(x) & (np.abs(x) < 10)
    naive = rm.gelu_tanh(x[inside]).astype(np.float16).astype(np.float64)
    assert np.sum(naive != theirs[inside]) > 100


def test_table_lookup_clamps_and_rounds():
    x = np.linspace(-12, 12, 20001)
    y = gelu_fp16_table(x)
    inside = (x > -10) & (x < 10)
    assert np.all(y[x <= -10] == 0.0) and np.array_equal(y[x >= 10], x[x >= 10])
    bits = x[inside].astype(np.float16).view(np.uint16)
    assert np.array_equal(y[inside], gelu_table()[bits])
    # an fp16 value in, an fp16 value out: the error is of the order of fp16's relative step
    assert np.all(np.abs(y[inside] - rm.gelu_tanh(x[inside])) <= 2.0 ** -10 * (np.abs(x[inside]) + 1))


def test_context_swaps_the_reference_gelu_and_restores_it(tiny_gguf):
    from gemma4_harness.reference import load_model

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


@pytest.mark.parametrize("flash", [False, True], ids=["f16-cache", "flash-attention"])
def test_attention_over_an_f16_cache_is_llamacpps(tmp_path, flash):
    """llama.cpp's attention output (``kqv_out``) of every layer of an odd shape, from its own Q, K and V, f16 KV
    cache: the emulation (``attn_fp16_operands`` without flash attention; the flash kernel's fp16 accumulator with
    it) agrees to float32 rounding (< 1e-6), where the exact attention over the same Q, K, V is off by > 1e-4."""
    need_llamacpp()
    from gemma4_harness.harness import synth

    gguf = synth.ensure_built(SHAPES / "odd-h72-v300.toml").gguf["F32"]
    ids = [2, 169, 23, 254, 172, 81, 60, 73, 157, 146, 110]  # 11 rows: flash attention's one-chunk kernel
    assert len(ids) < FA_TILE_Q
    names = [f"{n}-{il}" for il in range(4) for n in ("Qcur_pos", "Kcur_pos", "Vcur_normed", "kqv_out")]
    d = _dump(tmp_path, str(gguf), "--ids", ",".join(map(str, ids)), "--kv", "f16", "--names", ",".join(names),
              *(["--flash"] if flash else []))
    T, pos = len(ids), np.arange(len(ids))
    for il, window in enumerate((8, 8, 8, None)):  # odd-h72-v300: three sliding layers (window 8), then a full one
        q, k, v = (d[f"{n}-{il}"].reshape(T, -1, d[f"{n}-{il}"].shape[-1]) for n in ("Qcur_pos", "Kcur_pos",
                                                                                     "Vcur_normed"))
        theirs = d[f"kqv_out-{il}"].reshape(T, -1)
        mine = (attention_flash_fp16(q, k, v, pos, pos, window, 1.0) if flash else
                attention_kv_rounded(q, k, v, pos, pos, window, 1.0, kv="float16", operands=True))
        exact = rm.attention(q, k, v, pos, pos, window, 1.0)
        assert np.abs(mine - theirs).max() < 1e-6, (il, np.abs(mine - theirs).max())
        assert np.abs(exact - theirs).max() > 1e-4, il


def test_attention_numerics_swaps_and_restores(tiny_gguf):
    from gemma4_harness.reference import load_model

    cfg, W = load_model(tiny_gguf)
    ids = [2, 5, 9, 4, 7, 11, 3]
    exact = rm.forward(cfg, W, ids)
    original = rm.attention
    outs = []
    for kw in ({"kv": "float16"}, {"kv": "float16", "operands": True}, {"flash": True}, {"kv": "bfloat16"}):
        with attention_numerics(**kw):
            assert rm.attention is not original
            outs.append(rm.forward(cfg, W, ids))
        assert rm.attention is original
    assert all(0 < np.abs(o - exact).max() < 1e-1 for o in outs)
    assert np.array_equal(rm.forward(cfg, W, ids), exact)


@pytest.mark.parametrize("kw", [{"kv": "float16"}, {"kv": "float16", "operands": True}, {"flash": True}],
                         ids=["kv16", "operands", "flash"])
def test_fast_twin_follows_the_attention_emulation(tiny_gguf, kw):
    """``--oracle fast``: the fast engine in fp32 under the same attention emulation as the reference follows it: off
    by a fraction of what the emulation moves (fp32 inputs one bit apart decide some fp16 roundings the other
    way: ~1e-6 with a rounded cache, up to ~3e-4 through the flash kernel's fp16 accumulator)."""
    from gemma4_harness.harness.engines import make_engine
    from gemma4_harness.harness.engines.reference import ReferenceEngine

    ids = [2, 5, 9, 4, 7, 11, 3, 8, 13]
    ref, fast = ReferenceEngine(tiny_gguf), make_engine("fast", tiny_gguf, device="cpu")
    exact = ref.logits(ids)
    with attention_numerics(**kw):
        r, f = ref.logits(ids), np.asarray(fast.logits(ids), dtype=np.float64)
        (g,) = fast.generate_full([ids[:4]], 4)
        (h,) = ref.generate_full([ids[:4]], 4)
    assert np.abs(r - exact).max() > 1e-3
    assert np.abs(f - r).max() < 0.25 * np.abs(r - exact).max()
    assert g.tokens == h.tokens
