"""Tokenizers from GGUF metadata (``reference/tokenizer.py``) against the reference libraries.

* ``gemma4`` type: ours (GGUF) vs HF ``tokenizers`` (tokenizer.json) on the
  gemma4-type test vocabulary built from the real Gemma 3 one
  (``harness/tokenizer/build.py``), on the corpora and on hypothesis strings (10,000
  in the slow run), with special markers parsed and kept as text.
* ``llama`` type: ours on the real Gemma 3 270M GGUF and on ``tokenizer.model``
  vs ``sentencepiece``.
* Rules on toy vocabularies (merge rank, leftmost ties, the newline split, byte
  fallback, special-token modes, BOS when asked, decode).
* ``<bos>`` at the start of a text with BOS asked: ``[2, 2, ...]`` in ours, transformers' Gemma 3 tokenizer and
  llama.cpp's ``llama_tokenize(add_special=true, parse_special=true)`` on the real Gemma 3 270M GGUF.
* The CLI (``g4h tokenize``, ``g4h tokcheck``) and its bad-input contract, in a
  subprocess.

The real Gemma 3 ``tokenizer.model`` is carried in ``cases/data/gemma3-tokenizer/``; the
``tokenizer.json`` is derived from it (:mod:`harness.tokenizer.build`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hypothesis
import hypothesis.strategies
import pytest
import sentencepiece
from clitools import assert_one_line_error
from clitools import run_cli as _run_cli

from gemma4_harness.reference.errors import ConfigError, InputError

REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_DIR = REPO_ROOT / "cases" / "data" / "gemma3-tokenizer"  # carried by the project (README there)
REAL_SPM = REAL_DIR / "tokenizer.model"
CLI_TIMEOUT_S = 180

# Markers and fragments the hypothesis strings are built from (besides arbitrary characters).
MARKERS = ["<|turn>", "<turn|>", '<|"|>', "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|think|>",
           "<|image|>", "<bos>", "<eos>", "<unk>", "<pad>", "<mask>", "<unused3>", "<start_of_turn>", "[multimodal]"]
FRAGMENTS = [" ", "  ", "    ", "\n", "\n\n", "\n\n\n\n", "\t", "\r\n", "<0x41>", "<0xFF>", "😀", "\u200d", "👍🏽",
             "👨‍👩‍👧", "é", "e\u0301", "日本語", "한국어", "ไทย", "Привет", "مرحبا", "  return x", "12345", "<h1>",
             "</td>", "\ufffd", "\ufeff", "\x00", "www.", "ing", "▁"]


def _real_json() -> Path:
    """The Gemma 3 tokenizer.json, derived from the carried tokenizer.model on first use (then cached)."""
    from gemma4_harness.harness.tokenizer.build import gemma3_tokenizer_files

    return gemma3_tokenizer_files()["json"]


def test_carried_tokenizer_files_are_intact():
    """cases/data/gemma3-tokenizer holds the real tokenizer.model and its terms, as SHA256SUMS says."""
    import hashlib

    sums = dict(reversed(line.split()) for line in (REAL_DIR / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {"tokenizer.model", "GEMMA_TERMS.html"}
    for name, digest in sums.items():
        assert hashlib.sha256((REAL_DIR / name).read_bytes()).hexdigest() == digest, name


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf4(built):
    """HF tokenizers on the matching tokenizer.json as encode functions: (markers parsed, markers as text)."""
    from gemma4_harness.harness.tokenizer.engines import cached_tok_engine

    parse = cached_tok_engine("hf", str(built.json), False, True)
    text = cached_tok_engine("hf", str(built.json), False, False)
    return parse.encode, text.encode


@pytest.fixture(scope="module")
def corpus():
    from gemma4_harness.harness.tokenizer.corpus import load_corpus

    return load_corpus()


@pytest.fixture(scope="module")
def gemma3_gguf():
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def sp():
    return sentencepiece.SentencePieceProcessor(model_file=str(REAL_SPM))


def _meta(tokens, types, merges=None, model="gemma4", **extra):
    m = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
         "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
         "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_space_prefix": False}
    if merges is not None:
        m["tokenizer.ggml.merges"] = merges
    m.update(extra)
    return m


BYTES = [f"<0x{i:02X}>" for i in range(256)]


def toy(merges, extra_tokens=()):
    """A small gemma4-type vocabulary: specials, a few pieces, 256 byte tokens."""
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", '<|"|>', "\n", "\n\n", "a", "b", "c", "ab", "bc",
              "abc", "▁", "▁a", "a\n", "<", "|", ">", "t", "u", "r", "n"] + list(extra_tokens) + BYTES
    types = [3, 3, 3, 3, 3, 4] + [1] * (18 + len(extra_tokens)) + [6] * 256
    return GGUFTokenizer(_meta(tokens, types, merges, **{"tokenizer.ggml.scores": [0.0] * len(tokens)}), "toy")


# --------------------------------------------------------------------------- gemma4 rules on toy vocabularies


def test_merge_rank_decides_not_score():
    t1 = toy(["a b", "b c"])
    t2 = toy(["b c", "a b"])
    ids = lambda t, s: t.pieces(t.encode(s, add_bos=False))
    assert ids(t1, "abc") == ["ab", "c"]
    assert ids(t2, "abc") == ["a", "bc"]
    t3 = toy(["a b", "ab c"])
    assert ids(t3, "abc") == ["abc"]


def test_leftmost_wins_on_equal_rank():
    t = toy(["a a"], extra_tokens=["aa"])
    assert t.pieces(t.encode("aaa", add_bos=False)) == ["aa", "a"]
    assert t.pieces(t.encode("aaaa", add_bos=False)) == ["aa", "aa"]


def test_newline_runs_split_merging():
    t = toy(["a \n", "\n \n"])
    # "a\n" is a token and a merge, but the text is cut into "a" | "\n" first
    assert t.pieces(t.encode("a\n", add_bos=False)) == ["a", "\n"]
    assert t.pieces(t.encode("a\n\na", add_bos=False)) == ["a", "\n\n", "a"]


def test_space_escape_and_byte_fallback():
    t = toy(["▁ a"])
    assert t.pieces(t.encode(" a é", add_bos=False)) == ["▁a", "▁", "<0xC3>", "<0xA9>"]
    assert t.decode(t.encode(" a é")) == " a é"


def test_special_modes_and_bos_when_asked():
    t = toy(["a b"])
    # user-defined <|"|> always matched; control <|turn> only with parse_special=True
    assert t.encode('<|"|>ab', add_bos=False) == [5, 11]
    assert t.encode("<|turn>", add_bos=False, parse_special=True) == [4]
    assert t.pieces(t.encode("<|turn>", add_bos=False)) == ["<", "|", "t", "u", "r", "n", ">"]
    assert t.encode("<bos>ab", parse_special=True) == [2, 2, 11]  # BOS asked, and <bos> in the text: both
    assert t.encode("<bos>ab", add_bos=False, parse_special=True) == [2, 11]
    assert t.encode("") == [2]
    assert t.encode("", add_bos=False) == []
    assert t.decode([2, 4, 5, 11, 1]) == '<|"|>ab'  # control dropped, user-defined kept
    assert t.decode([2, 4, 5, 11, 1], special=True) == '<bos><|turn><|"|>ab<eos>'


BOS_TEXTS = ("<bos>hello world", "<bos><start_of_turn>user\nhi<end_of_turn>\n", "hello <bos> world", "hello")


def _ours_on(path) -> "object":
    from gemma4_harness.harness.tokenizer.files import load_tokenizer_metadata
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    return GGUFTokenizer(load_tokenizer_metadata(path), source=str(path))


def test_bos_in_text_as_transformers_has_it():
    """transformers' Gemma tokenizer (the tokenizer.json of the carried Gemma 3 tokenizer.model, through
    ``PreTrainedTokenizerFast``) puts its BOS before a text that starts with ``<bos>`` too: ``[2, 2, ...]``; ours
    (BOS asked, special text parsed, as the harness reads ``{"text"}`` prompts) gives the same ids."""
    from transformers import PreTrainedTokenizerFast

    from gemma4_harness.harness.tokenizer.build import gemma3_tokenizer_files

    files = gemma3_tokenizer_files()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(files["json"]))
    ours = _ours_on(files["spm"])
    for text in BOS_TEXTS:
        want = hf(text).input_ids
        assert ours.encode(text, add_bos=True, parse_special=True) == want, text
    assert hf(BOS_TEXTS[0]).input_ids[:2] == [2, 2]  # the case the harness had wrong: it gave one BOS


def test_bos_in_text_as_llamacpp_has_it(gemma3_gguf):
    """llama.cpp's ``llama_tokenize(..., add_special=true, parse_special=true)`` (llama-server's ``/tokenize`` of a
    prompt) on the real Gemma 3 270M GGUF: ``<bos>`` in the text and the added BOS, ``[2, 2, ...]``; ours the same."""
    import llama_cpp  # noqa: F401  (missing: nox -s tests installs it from the build cache)

    llm = llama_cpp.Llama(model_path=str(gemma3_gguf), vocab_only=True, verbose=False)
    ours = _ours_on(gemma3_gguf)
    for text in BOS_TEXTS:
        want = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert ours.encode(text, add_bos=True, parse_special=True) == want, text
    assert llm.tokenize(BOS_TEXTS[0].encode(), add_bos=True, special=True)[:2] == [2, 2]


def test_add_bos_follows_the_file():
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "a"] + BYTES
    m = _meta(tokens, [3, 3, 3, 3, 1] + [6] * 256, model="llama", **{"tokenizer.ggml.add_bos_token": False})
    t = GGUFTokenizer(m, "toy")
    assert t.encode("a") == [4]
    assert t.encode("a", add_bos=True) == [2, 4]


@pytest.mark.parametrize("meta, match", [
    ({"tokenizer.ggml.tokens": ["a"]}, "no tokenizer in this file"),
    ({"tokenizer.ggml.model": "bpe-ish", "tokenizer.ggml.tokens": ["a"]}, "'bpe-ish' is not supported"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"]}, "needs tokenizer.ggml.merges"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"],
      "tokenizer.ggml.merges": ["a b", "a zz"]}, r"merges\[1\] = 'a zz' names 'zz'"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b"],
      "tokenizer.ggml.merges": ["a b"]}, "merged piece 'ab' is not in"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"],
      "tokenizer.ggml.merges": ["ab"]}, "expected two tokens"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.bos_token_id": 7},
     "bos_token_id = 7 is not a token id"),
])
def test_bad_metadata_is_one_clear_error(meta, match):
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    with pytest.raises(ConfigError, match=match) as err:
        GGUFTokenizer(meta, "x.gguf")
    assert "\n" not in str(err.value) and str(err.value).startswith("x.gguf: ")


# --------------------------------------------------------------------------- the gemma4-type test vocabulary


def test_built_vocabulary_layout(built, g4):
    from gemma4_harness.harness.tokenizer.build import GEMMA4_SPECIALS
    from gemma4_harness.reference.tokenizer import CONTROL, USER_DEFINED, read_gguf_metadata

    assert built.gguf.parent.parent.name == "tok" and built.gguf.parent.name.startswith("gemma4-test-")
    assert g4.model == "gemma4" and g4.vocab_size == 262_144 and g4.n_merges == 514_906
    assert g4.tokens[105] == "<|turn>" and g4.tokens[106] == "<turn|>" and g4.types[105] == CONTROL
    for i, (text, ty) in GEMMA4_SPECIALS.items():
        assert g4.tokens[i] == text and g4.types[i] == ty
    assert {g4.types[i] for i in (48, 49, 50, 51, 52, 100, 101)} == {USER_DEFINED}
    assert g4.bos_id == 2 and g4.eos_id == 1 and g4.add_bos and not g4.add_space_prefix
    meta = read_gguf_metadata(built.gguf)
    assert meta["general.architecture"] == "gemma4" and meta["tokenizer.ggml.eot_token_id"] == 106
    assert meta["tokenizer.chat_template"].startswith("{#- Gemma 4 chat format")
    doc = json.loads(built.json.read_text(encoding="utf-8"))
    assert doc["pre_tokenizer"]["pattern"] == {"Regex": "\n+"} and doc["model"]["byte_fallback"]
    added = {a["id"]: a for a in doc["added_tokens"]}
    assert added[105]["special"] and not added[52]["special"] and 107 not in added


def test_build_is_cached_and_deterministic(built):
    from gemma4_harness.harness.tokenizer.build import build_gemma4_test_tokenizer, gemma4_test_metadata, tokenizer_json_document

    mtime = built.gguf.stat().st_mtime_ns
    again = build_gemma4_test_tokenizer()
    assert again == built and built.gguf.stat().st_mtime_ns == mtime  # reused
    a = tokenizer_json_document(gemma4_test_metadata(_real_json()))
    assert json.dumps(a, ensure_ascii=False, separators=(",", ":")) == built.json.read_text(encoding="utf-8")


def test_gemma4_corpus_parity(g4, hf4, corpus):
    parse, text = hf4
    diffs = []
    for c in corpus:
        for mode, hf in ((True, parse), (False, text)):
            if g4.encode(c.text, add_bos=False, parse_special=mode) != hf(c.text):
                diffs.append((c.source, mode))
    assert not diffs, diffs[:5]
    assert len(corpus) >= 150


def test_gemma4_known_ids(g4):
    assert g4.encode("<|turn>user\nhi<turn|>", parse_special=True) == [2, 105, 2364, 107, 2202, 106]
    assert g4.encode("Hello world") == [2, 9259, 1902]
    assert g4.encode("a  b\n\n\nc", add_bos=False) == [236746, 138, 236763, 109, 236755]


def test_roundtrip_every_corpus_line(g4, corpus):
    for c in corpus:
        assert g4.decode(g4.encode(c.text)) == c.text, c.source
        assert g4.decode(g4.encode(c.text, add_bos=False, parse_special=True), special=True) == c.text, c.source


def _text_strategy():
    """Arbitrary text (no surrogates) with markers and fragments sprinkled in; cheap to draw (10,000 in ~10 s)."""
    st = hypothesis.strategies
    alpha = st.one_of(st.characters(blacklist_categories=("Cs",)), st.sampled_from(list(" \n\t<|>_\"abc")))
    text = st.text(alpha, max_size=10)
    atom = st.sampled_from([""] + MARKERS + FRAGMENTS)
    return st.tuples(text, atom, text, atom, text, atom).map("".join)


def _hypothesis_parity(g4, hf4, n: int) -> dict:
    parse, text = hf4
    seen = {"n": 0, "differ": [], "roundtrip": []}

    @hypothesis.settings(max_examples=n, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(_text_strategy())
    def run(s):
        seen["n"] += 1
        for mode, hf in ((True, parse), (False, text)):
            if g4.encode(s, add_bos=False, parse_special=mode) != hf(s):
                seen["differ"].append((s, mode))
        if "▁" not in s and g4.decode(g4.encode(s)) != s:
            seen["roundtrip"].append(s)

    run()
    return seen


def test_gemma4_hypothesis_parity_quick(g4, hf4):
    seen = _hypothesis_parity(g4, hf4, 300)
    assert not seen["differ"], seen["differ"][:3]
    assert not seen["roundtrip"], seen["roundtrip"][:3]


@pytest.mark.slow
def test_gemma4_hypothesis_parity_10000(g4, hf4):
    seen = _hypothesis_parity(g4, hf4, 10_000)
    print(f"\nhypothesis strings: {seen['n']}, differing: {len(seen['differ'])}, "
          f"round-trip failures: {len(seen['roundtrip'])}")
    assert seen["n"] >= 10_000
    assert not seen["differ"], seen["differ"][:3]
    assert not seen["roundtrip"], seen["roundtrip"][:3]


# --------------------------------------------------------------------------- the llama type (Gemma 3)


def test_gemma3_gguf_vs_sentencepiece_on_corpus(gemma3_gguf, sp, corpus):
    from gemma4_harness.harness.tokenizer.engines import cached_tok_engine

    tok = cached_tok_engine("ours", str(gemma3_gguf), True, None).tok
    assert tok.model == "llama"
    bad = [c.source for c in corpus if tok.encode(c.text) != [2] + sp.encode(c.text)]
    assert not bad, bad[:5]
    for c in corpus:  # round trip: SentencePiece rule, specials decoded
        assert tok.decode(tok.encode(c.text, add_bos=False), special=True) == c.text, c.source


def test_gemma3_spm_metadata_engine(sp, corpus):
    from gemma4_harness.harness.tokenizer.corpus import compare_engines
    from gemma4_harness.harness.tokenizer.engines import cached_tok_engine

    ours = cached_tok_engine("ours", str(REAL_SPM), True, None)
    assert ours.tok.model == "llama" and ours.tok.add_space_prefix is False
    res = compare_engines(ours, cached_tok_engine("spm", str(REAL_SPM), True, None), corpus)
    assert res["differing"] == 0, res["diffs"][:3]


def test_gemma3_llama_parse_special_modes(gemma3_gguf):
    from gemma4_harness.harness.tokenizer.engines import cached_tok_engine

    tok = cached_tok_engine("ours", str(gemma3_gguf), True, None).tok
    s = "<start_of_turn>user<bos>"
    assert tok.encode(s, add_bos=False)[0] == 105  # SentencePiece rule: user-defined in spm
    assert tok.encode(s, add_bos=False, parse_special=True)[-1] == 2  # all control tokens
    assert 105 not in tok.encode(s, add_bos=False, parse_special=False)  # llama.cpp default


# --------------------------------------------------------------------------- corpora files


def test_corpus_format(corpus, tmp_path):
    from gemma4_harness.harness.tokenizer.corpus import load_corpus, unescape

    assert unescape(r"a\nb\tc\\n\u00e9\U0001F600\d") == "a\nb\tc\\né😀\\d"
    names = {c.source.split(":")[0] for c in corpus}
    assert {"prose_scripts.txt", "emoji.txt", "whitespace.txt", "code.txt", "specials.txt", "bytes.txt",
            "long_words.txt", "numbers.txt", "prose_latin.txt"} <= names
    assert not any("▁" in c.text for c in corpus)
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "x\\ny"}\n\n{"text": "z"}\n')
    assert [c.text for c in load_corpus(f)] == ["x\ny", "z"]
    f.write_text('{"nope": 1}\n')
    with pytest.raises(InputError, match="c.jsonl:1"):
        load_corpus(f)


def test_engine_selection_errors(tmp_path):
    from gemma4_harness.harness.tokenizer.engines import TokEngineUnavailable as EngineUnavailable
    from gemma4_harness.harness.tokenizer.engines import make_tok_engine

    with pytest.raises(InputError, match="unknown tokenizer engine"):
        make_tok_engine("nope", tmp_path)
    bad = tmp_path / "x.txt"
    bad.write_text("hello")
    with pytest.raises(InputError, match="not a tokenizer file"):
        make_tok_engine("ours", bad)
    g = tmp_path / "v.gguf"
    g.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "llama_cpp", None)  # as when llama-cpp-python is not installed
        with pytest.raises(EngineUnavailable, match="^llamacpp: not installed: pip install llama-cpp-python$"):
            make_tok_engine("llamacpp", g)


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str, extra_path: Path | None = None):
    return _run_cli(*args, extra_path=extra_path, timeout=CLI_TIMEOUT_S)


one_line_error = assert_one_line_error


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "in.txt"
    f.write_text("hello world\n<|turn>user\n")
    return f


def test_cli_bad_tokenizer_files(tmp_path, text_file, make_tiny_gguf):
    from gemma4_harness.harness.tokenizer.build import write_vocab_gguf

    out = tmp_path / "ids.jsonl"
    no_tok = make_tiny_gguf("model.gguf")  # a model GGUF without tokenizer keys
    one_line_error(run_cli("tokenize", "--tokenizer", str(no_tok), "--text-file", str(text_file), "--out", str(out)),
                   "tokenizer.ggml.model is missing")
    unknown = write_vocab_gguf(tmp_path / "u.gguf", {"tokenizer.ggml.model": "wordpiece9",
                                                       "tokenizer.ggml.tokens": ["a", "b"]})
    one_line_error(run_cli("tokenize", "--tokenizer", str(unknown), "--text-file", str(text_file), "--out", str(out)),
                   "'wordpiece9' is not supported")
    merges = write_vocab_gguf(tmp_path / "m.gguf", {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b", "b missing"]})
    one_line_error(run_cli("tokcheck", "--tokenizer", str(merges), "--against", "ours"),
                   "tokenizer.ggml.merges[1] = 'b missing' names 'missing'")
    assert not out.exists()
    one_line_error(run_cli("tokenize", "--tokenizer", str(tmp_path / "absent.gguf"), "--text-file", str(text_file),
                           "--out", str(out)), "absent.gguf")


def test_cli_engine_errors(tmp_path, text_file):
    from gemma4_harness.harness.tokenizer.build import write_vocab_gguf

    g = write_vocab_gguf(tmp_path / "v.gguf", {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"] + BYTES,
        "tokenizer.ggml.token_type": [1, 1, 1] + [6] * 256, "tokenizer.ggml.merges": ["a b"]})
    out = tmp_path / "o.jsonl"
    one_line_error(run_cli("tokenize", "--tokenizer", str(g), "--engine", "hf", "--text-file", str(text_file),
                           "--out", str(out)), "engine hf needs a tokenizer.json")
    # llama-cpp-python missing (simulated by a shadowing package that fails to import)
    fake = tmp_path / "no_llamacpp" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated: llama-cpp-python not installed')\n")
    line = one_line_error(run_cli("tokcheck", "--tokenizer", str(g), "--against", "llamacpp",
                                  extra_path=fake.parent), "not installed: pip install llama-cpp-python")
    assert line == "g4h: error: llamacpp: not installed: pip install llama-cpp-python"
    one_line_error(run_cli("tokcheck", "--tokenizer", str(g), "--against", "ours", "--corpus", str(tmp_path / "no")),
                   "no such corpus")
    # the small valid vocabulary works end to end
    proc = run_cli("tokenize", "--tokenizer", str(g), "--text-file", str(text_file), "--out", str(out), "--no-bos")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0] == {"text": "hello world", "ids": rows[0]["ids"]} and len(rows) == 2


def test_cli_tokenize_and_tokcheck(built, g4, tmp_path):
    corpus = REPO_ROOT / "cases" / "tokenizer" / "specials.txt"
    out = tmp_path / "ids.jsonl"
    proc = run_cli("tokenize", "--tokenizer", str(built.gguf), "--engine", "ours", "--text-file", str(corpus),
                   "--out", str(out), "--escapes", "--special", "parse")
    assert proc.returncode == 0, proc.stderr
    from gemma4_harness.harness.tokenizer.corpus import load_corpus

    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    want = [c.text for c in load_corpus(corpus)]
    assert [r["text"] for r in rows] == want
    assert [r["ids"] for r in rows] == [g4.encode(t, parse_special=True) for t in want]
    # exit 0 when nothing differs (a cheap pair: ours on tokenizer.model metadata vs sentencepiece)
    proc = run_cli("tokcheck", "--tokenizer", str(REAL_SPM), "--engine", "ours", "--against", "spm",
                   "--corpus", str(corpus), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith(f"{len(want)} texts, 0 differ")
    assert json.loads((tmp_path / "r.json").read_text())["differing"] == 0


def test_cli_tokcheck_reports_differences(tmp_path):
    corpus = REPO_ROOT / "cases" / "tokenizer" / "specials.txt"
    # sentencepiece never matches <bos>/<eos>/<pad>/<unk> in text; HF tokenizers does
    proc = run_cli("tokcheck", "--tokenizer", str(REAL_SPM), "--engine", "spm", "--against", str(_real_json()),
                   "--corpus", str(corpus), "--special", "parse")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first difference at token 1" in proc.stdout and "'<eos>'" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].endswith("differ") and " 0 differ" not in proc.stdout


# --------------------------------------------------------------------------- the report


@pytest.mark.slow
def test_tokenizer_checks_report():
    from gemma4_harness.harness.tokenizer.checks import tokenizer_checks

    rep = tokenizer_checks(n_random=300)
    json.dumps(rep)
    by = {c["name"]: c for c in rep["checks"]}
    for name in ("gemma4_ours_vs_hf", "gemma4_ours_vs_hf_text_mode", "gemma3_spm_ours_vs_spm",
                 "gemma3_json_ours_vs_hf", "roundtrip", "bos_as_reference", "newline_runs", "gguf_chat_template"):
        assert by[name]["status"] == "pass", by[name]
    assert by["gemma3_gguf_ours_vs_spm"]["status"] == "pass"
    v = by["gguf_vocab_vs_real_tokenizer"]
    assert v["status"] == "info" and v["counts"]["token_text_differs_ids"] == "138-167"
    assert by["llamacpp"]["status"] == "pass", by["llamacpp"]
    assert by["transformers_gguf"]["status"] == "opted_out"  # slow: only with slow=True
    assert set(rep["summary"]) <= {"pass", "info", "opted_out"}, rep["summary"]
