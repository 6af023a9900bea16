"""The default prompts for a server that takes text only (issue 36, "defaults that fit the engine").

``g4h parity --model M --against openai:URL`` without ``--prompts`` on llama-cpp-python's server (or the generic
OpenAI dialect) sends the default prompt set as text of the model's own vocabulary, of the same names and lengths
(:func:`harness.synth.prompts.text_prompt`, :func:`harness.parity.checks.server.default_text_prompts`).

* on several vocabularies (the synthetic GGUFs' SentencePiece one at several sizes, with and without a space prefix
  and with control tokens; a SentencePiece one whose pieces merge; a ``gemma4``-type one with merges; the real
  Gemma 3 tokenizer), for several seeds and lengths: every text has the length asked (a draw that merges with its
  neighbour would shorten it) and its ids survive the round trip ids -> text -> ids; a length no text has is
  refused;
* the newcomer's command, no option beside ``--model`` and ``--against``, on a real llama-server (ids) and a real
  llama-cpp-python server (text) on the synthetic GGUF: exit 0, every default prompt by its name;
* a wrong model behind llama-cpp-python's server (rows of one FFN matrix scaled): still exit 1 on the text defaults.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servers import (  # noqa: F401
    _need_llama_cpp_python_server,
    _running,
    llama_cpp_python_process,
    llama_cpp_python_server,
    llama_server,
    synth_gguf,
)

from gemma4_harness.harness.synth.prompts import PROMPT_LAYOUT, PROMPT_SEED, text_pieces, text_prompt

REAL_SPM = Path(__file__).resolve().parents[1] / "cases" / "data" / "gemma3-tokenizer" / "tokenizer.model"
BYTES = [f"<0x{i:02X}>" for i in range(256)]


class _Keys:
    """Collects the keys a GGUF writer is given (the synthetic vocabulary's, as :mod:`harness.synth.gguf` writes)."""

    def __init__(self) -> None:
        self.meta: dict = {}

    def add_key_value(self, key, value, *_a, **_kw) -> None:
        self.meta[key] = value


def _synthetic(vocab_size: int, special_tokens=None, **extra) -> dict:
    from gemma4_harness.harness.synth.gguf import add_tokenizer_keys

    keys = _Keys()
    add_tokenizer_keys(keys, vocab_size, special_tokens)
    return {**keys.meta, **extra}


def _merging_spm() -> dict:
    """A SentencePiece (``llama``) vocabulary whose pieces merge with their neighbours (``a`` + ``b`` is ``ab``)."""
    pieces = ["a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581b", "\u2581ab", "t", "h", "e", "he", "the",
              "\u2581the", "\u2581c"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + BYTES + pieces
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.scores": [0.0] * 260 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0}


def _gemma4_toy() -> dict:
    """A ``gemma4``-type vocabulary (BPE by merge rank) with a few merging pieces and a user-defined token."""
    pieces = ["a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "x", "y", "xy", "\u2581xy"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", '<|"|>'] + pieces + BYTES
    return {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3, 3, 3, 4] + [1] * len(pieces) + [6] * 256,
            "tokenizer.ggml.scores": [0.0] * len(tokens),
            "tokenizer.ggml.merges": ["a b", "b c", "ab c", "\u2581 a", "x y", "\u2581 xy"],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_space_prefix": False}


def _gemma3_real() -> dict:
    from gemma4_harness.harness.tokenizer.files import load_tokenizer_metadata

    return load_tokenizer_metadata(REAL_SPM)


VOCABULARIES = {
    "synthetic-300": lambda: _synthetic(300),
    "synthetic-512-controls": lambda: _synthetic(512, {262: "<start_of_image>", 263: "<end_of_image>"}),
    "synthetic-4096-no-space-prefix": lambda: _synthetic(4096, **{"tokenizer.ggml.add_space_prefix": False}),
    "spm-merging": _merging_spm,
    "gemma4-toy": _gemma4_toy,
    "gemma3-real": _gemma3_real,
}


@pytest.fixture(scope="module", params=sorted(VOCABULARIES))
def vocabulary(request):
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(VOCABULARIES[request.param](), request.param)
    return request.param, tok, text_pieces(tok.tokens, tok.types)


@pytest.mark.parametrize("seed", [PROMPT_SEED, 1, 29])
def test_every_default_text_prompt_round_trips_to_its_ids(vocabulary, seed):
    from gemma4_harness.harness.tokenizer.prompt_ids import text_ids

    name, tok, pieces = vocabulary
    encode = lambda t: text_ids(tok, t)  # noqa: E731 (the run's one text-to-ids path)
    for n in [n for _, n, _ in PROMPT_LAYOUT] + [6 + seed % 9, 61]:
        text = text_prompt(tok, encode, n, seed, pieces=pieces)
        assert text is not None, (name, n)
        ids = encode(text)
        assert len(ids) == n, (name, n, text, ids)
        body = ids[1:] if ids[:1] == [tok.bos_id] else ids
        assert encode(tok.decode(body)) == ids, (name, n, text)  # the text a server detokenizes encodes back
        assert text_prompt(tok, encode, n, seed, pieces=pieces) == text  # deterministic
        assert n > 1 or text == ""  # BOS alone


def test_a_length_no_text_has_is_refused_not_approximated():
    """The synthetic vocabulary with its space prefix spells the ``▁`` in front of a text as three byte tokens: no text
    of its pieces is 2 or 3 tokens long (BOS, then at least those three; special-token names, which are not drawn,
    aside), and none is made up."""
    from gemma4_harness.harness.tokenizer.prompt_ids import text_ids
    from gemma4_harness.reference.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(_synthetic(300), "synthetic-300")
    assert text_ids(tok, " ") == [2, 4 + 0xE2, 4 + 0x96, 4 + 0x81]
    assert [text_prompt(tok, lambda t: text_ids(tok, t), n) for n in (2, 3)] == [None, None]


def test_default_text_prompts_keep_names_lengths_and_marks(synth_gguf):
    from gemma4_harness.harness.core.prompts import load_prompts
    from gemma4_harness.harness.parity.checks.server import default_text_prompts
    from gemma4_harness.harness.synth.prompts import WINDOW_NAMED, named_for_window
    from gemma4_harness.harness.tokenizer.prompt_ids import with_prompt_ids

    ids = [{**p, "library": True, WINDOW_NAMED: True} for p in load_prompts()]
    texts, left = default_text_prompts(ids, synth_gguf)
    assert left == ["len1-bos"]  # BOS alone: an empty text, left out
    ids = [p for p in ids if p["id"] != "len1-bos"]
    assert [p["id"] for p in texts] == [p["id"] for p in ids]
    assert [len(p["prompt_ids"]) for p in texts] == [len(p["prompt_ids"]) for p in ids]
    assert all(p["library"] and p[WINDOW_NAMED] and "where" not in p for p in texts)
    assert with_prompt_ids([{"id": p["id"], "text": p["text"]} for p in texts], synth_gguf) == \
        [{"id": p["id"], "text": p["text"], "prompt_ids": p["prompt_ids"]} for p in texts]  # the one text-to-ids path
    assert [p["id"] for p in named_for_window(texts, 3)] == [p["id"] for p in named_for_window(ids, 3)]


# --------------------------------------------------------------------------- real servers


def parity(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "parity", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    found = sorted(out.glob("*/results.json"))
    return proc.returncode, (json.loads(found[-1].read_text()) if found else {}), proc.stdout + proc.stderr


def checks(data: dict) -> dict[str, dict]:
    return {c["gate"]: c for c in data["cases"][0]["checks"]}


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
def test_newcomers_command_without_prompts_gives_a_verdict(kind, request, synth_gguf, tmp_path):
    """``g4h parity --model M --against openai:URL``, nothing else: exit 0 on both llama.cpp servers; llama-server
    gets the default ids, llama-cpp-python their text form, judged by its own tokenizer too."""
    srv = request.getfixturevalue("llama_server" if kind == "llama-server" else "llama_cpp_python_server")
    rc, data, out = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{srv.url}/v1")
    assert rc == 0, out[-2500:]
    case, got = data["cases"][0], checks(data)
    names = {r["request"] for r in got["reference~openai.greedy"]["streams_detail"]}
    layout = {pid for pid, _, _ in PROMPT_LAYOUT}
    if kind == "llama-cpp-python":
        assert names == layout - {"len1-bos"}, names  # every default prompt sent by its name, but the empty text
        assert case["info"]["default_prompts"]["form"] == "text"
        assert case["info"]["default_prompts"]["left_out"] == ["len1-bos"]
        assert "takes text prompts only" in out
        tok = got["server.tokenizer"]
        assert tok["pass"] and tok["texts"] == len(PROMPT_LAYOUT) - 1 and tok["differing"] == 0, tok
    else:
        assert names == layout, names
        assert "default_prompts" not in case["info"] and "server.tokenizer" not in got


def test_wrong_model_behind_llama_cpp_python_fails_on_the_text_defaults(synth_gguf, tmp_path, tmp_path_factory):
    """The same command on llama-cpp-python's server serving a copy of the model with half the rows of one FFN down
    matrix scaled by 1.02: exit 1 on the model checks, its tokenizer still agreeing (no false alarm there)."""
    from quant_faults import scale_rows

    _need_llama_cpp_python_server()
    wrong = scale_rows(synth_gguf, tmp_path / "wrong.gguf", "blk.2.ffn_down.weight")
    with _running(llama_cpp_python_process, wrong, tmp_path_factory, "lcp-server-wrong") as srv:
        rc, data, out = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{srv.url}/v1")
    assert rc == 1, out[-2500:]
    case, got = data["cases"][0], checks(data)
    assert case["info"]["default_prompts"]["form"] == "text"
    assert got["server.tokenizer"]["pass"]
    assert not (got["reference~openai.greedy"]["pass"] and got["reference~openai.max_abs_logprob"]["pass"]), out[-2500:]
