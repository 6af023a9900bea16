"""The one prompt-file reader (harness/core/prompts.py ``load_prompts``) on every form a user writes: both forms,
the optional keys, and each way a line can be wrong, every refusal one line naming the file and line (the file alone
where no line is at fault: an empty file). Then the one text-to-ids path (harness/tokenizer/prompt_ids.py), which
``g4h parity --model``, ``g4h explain`` and ``g4h sweep`` share.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servers import synth_gguf  # noqa: F401 (a fixture)

from gemma4_harness.harness.core.prompts import load_prompts, read_prompt_ids
from gemma4_harness.reference.errors import PromptError


def _file(tmp_path: Path, *lines: str) -> Path:
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f


def test_both_forms_with_and_without_their_optional_keys(tmp_path):
    f = _file(tmp_path, '{"text": "Hello"}', "", "   ", '{"id": "b", "prompt_ids": [2, 5], "note": "short"}',
              '{"id": 7, "text": "<bos>hi"}', '{"prompt_ids": [0], "other": [1, 2]}')
    assert load_prompts(f) == [
        {"id": 1, "text": "Hello", "note": "", "where": f"{f}:1"},
        {"id": "b", "prompt_ids": [2, 5], "note": "short", "where": f"{f}:4"},
        {"id": 7, "text": "<bos>hi", "note": "", "where": f"{f}:5"},  # the text as written: BOS comes later
        {"id": 6, "prompt_ids": [0], "note": "", "where": f"{f}:6"},  # the line number; other keys ignored
    ]


def test_a_utf8_bom_crlf_a_line_separator_in_a_text_and_no_last_newline_are_read(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [2, 3]}\r\n{"text": "a\xe2\x80\xa8b"}\n{"text": "\xc3\xa9t\xc3\xa9"}')
    assert [(p["id"], p.get("prompt_ids"), p.get("text")) for p in load_prompts(f)] == \
        [(1, [2, 3], None), (2, None, "a\u2028b"), (3, None, "été")]  # U+2028 is JSON text, not a line end


#: One wrong line each (line 2 of the file; line 1 is a good prompt), and the start of what the refusal says
#: after ``FILE:2: ``.
BAD_LINES = {
    "bad JSON": ('{"prompt_ids": [2, 3]', "not valid JSON ("),
    "not an object": ("[2, 3]", "expected {\"text\": \"...\"} or {\"prompt_ids\": [int >= 0, ...]}"),
    "missing key": ('{"id": "a", "note": "no prompt"}', "expected {\"text\""),
    "both keys": ('{"text": "a", "prompt_ids": [2]}', "expected {\"text\": \"...\"} or {\"prompt_ids\": [int >= 0, "
                  "...]} (one of them, non-empty)"),
    "empty text": ('{"text": ""}', "expected {\"text\""),
    "text not a string": ('{"text": ["a"]}', "expected {\"text\""),
    "empty ids": ('{"prompt_ids": []}', "expected {\"text\""),
    "bool ids": ('{"prompt_ids": [2, true]}', "expected {\"text\""),
    "negative ids": ('{"prompt_ids": [2, -1]}', "expected {\"text\": \"...\"} or {\"prompt_ids\": [int >= 0"),
    "float ids": ('{"prompt_ids": [2, 3.0]}', "expected {\"text\""),
    "ids as a string": ('{"prompt_ids": "2 3"}', "expected {\"text\""),
    "bool id": ('{"id": false, "text": "a"}', '"id": expected a non-empty string or an integer, got false'),
    "empty id": ('{"id": "", "text": "a"}', '"id": expected a non-empty string or an integer, got ""'),
    "note not a string": ('{"text": "a", "note": 3}', '"note": expected a string, got 3'),
    "duplicate id 1 and \"1\"": ('{"id": "1", "text": "a"}', "duplicate id '1' (line 1 has it too; ids are "
                                 "compared as text)"),
}


@pytest.mark.parametrize("name", sorted(BAD_LINES))
def test_a_wrong_line_is_bad_input_naming_the_file_and_line(tmp_path, name):
    line, says = BAD_LINES[name]
    f = _file(tmp_path, '{"prompt_ids": [2, 5]}', line)  # line 1's id is 1
    with pytest.raises(PromptError) as ei:
        load_prompts(f)
    msg = str(ei.value)
    assert msg.startswith(f"{f}:2: {says}"), msg
    assert "\n" not in msg


def test_a_text_line_where_only_ids_are_taken_names_its_line(tmp_path):
    """The built-in cases, ``g4h compare`` and ``g4h generate`` take token ids only: the same reader refuses text
    there, naming the line; the ids lines read as elsewhere."""
    f = _file(tmp_path, '{"id": "a", "prompt_ids": [2, 5]}', '{"id": "b", "text": "hello"}')
    with pytest.raises(PromptError) as ei:
        load_prompts(f, ids_only=True)
    assert str(ei.value) == (f'{f}:2: expected {{"prompt_ids": [int >= 0, ...]}} (token ids only here, no "text"), '
                             'with an optional "id" (a string or an integer) and "note"')
    assert load_prompts(f)[1]["text"] == "hello"
    assert load_prompts(_file(tmp_path, '{"id": "a", "prompt_ids": [2, 5]}'), ids_only=True)[0]["prompt_ids"] == [2, 5]


def test_not_utf8_names_the_line_of_the_first_bad_byte(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt_ids": [2]}\n\n{"text": "ok \xff"}\n')
    with pytest.raises(PromptError) as ei:
        load_prompts(f)
    assert str(ei.value) == f"{f}:3: not UTF-8 text (invalid byte 0xff at offset 34)"
    f.write_bytes(b'\xef\xbb\xbf{"text": "\xfe"}\n')  # after a BOM: the offset is still the file's
    with pytest.raises(PromptError, match=rf"^{f}:1: not UTF-8 text \(invalid byte 0xfe at offset 13\)$"):
        load_prompts(f)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_is_bad_input_naming_the_file(tmp_path, content):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(PromptError) as ei:
        load_prompts(f)
    assert str(ei.value).startswith(f"{f}: no prompts (expected {{\"text\"")


def test_a_missing_file_is_bad_input_naming_it(tmp_path):
    with pytest.raises(PromptError, match=str(tmp_path / "none.jsonl")):
        load_prompts(tmp_path / "none.jsonl")


def test_the_case_librarys_set_reads_with_its_ids_as_written():
    recs = load_prompts(ids_only=True)
    assert recs and all(isinstance(p["id"], str) and p["note"] for p in recs)  # the ids results and baselines hold


def test_prompt_ids_file(tmp_path):
    f = tmp_path / "p.json"
    f.write_text("[2, 5, 6]")
    assert read_prompt_ids(f) == [2, 5, 6]
    for bad in ("[]", "[2, true]", '{"prompt_ids": [2]}', "[2,"):
        f.write_text(bad)
        with pytest.raises(PromptError, match=rf"^{f}: "):
            read_prompt_ids(f)


def test_one_text_to_ids_path_for_parity_and_the_sweep(synth_gguf, tmp_path):  # noqa: F811 (the fixture)
    """A text prompt gets the same ids in ``g4h parity --model`` / ``g4h explain`` (``with_prompt_ids``) and in a
    sweep (``for_model``): BOS added, and a text's own leading ``<bos>`` kept after it (issue 35)."""
    from gemma4_harness.harness.sweep.prompts import for_model
    from gemma4_harness.harness.tokenizer.prompt_ids import model_tokenizer, text_ids, with_prompt_ids

    f = _file(tmp_path, json.dumps({"id": "t", "text": "ab"}), json.dumps({"id": "b", "text": "<bos>ab"}),
              '{"id": 3, "prompt_ids": [2, 4]}')
    tok = model_tokenizer(synth_gguf)
    parity = with_prompt_ids(load_prompts(f), synth_gguf)
    sweep = for_model(load_prompts(f), synth_gguf, vocab=tok.vocab_size, context=64, new_tokens=4, source=f)
    assert [p["prompt_ids"] for p in parity] == [p["prompt_ids"] for p in sweep]
    assert parity[0]["prompt_ids"] == text_ids(tok, "ab") and parity[0]["prompt_ids"][0] == tok.bos_id
    assert parity[1]["prompt_ids"] == [tok.bos_id] + parity[0]["prompt_ids"]
    assert [p["id"] for p in parity] == ["t", "b", 3] and [p["id"] for p in sweep] == ["t", "b", "3"]
    assert parity[2] == load_prompts(f)[2]  # an ids record is as it was
