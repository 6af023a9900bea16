"""Servers at the end of a generation, the generic OpenAI dialect, and a server that cannot be used (issue 35).

Real servers on a model whose greedy continuations reach EOS (:mod:`eos_model`): llama-server, llama-cpp-python's
server and ``transformers serve`` (the generic dialect) must pass; deliberately wrong servers (a proxy that makes
llama-server ignore EOS, one that ends generations early, a perturbed model behind transformers serve, a server of
another vocabulary) must fail, each saying why.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from eos_model import EOS_ID, eos_case, perturbed_hf
from servers import (  # noqa: F401
    FaultStub,
    _need_llama_cpp_python_server,
    _running,
    llama_cpp_python_process,
    llama_server_process,
    running_llama_server,
    synth_gguf,
    transformers_serve_process,
)

#: Text prompts on the EOS model's GGUF (its SentencePiece vocabulary); see the reference check in each test.
GGUF_TEXTS = {"hello": "hello world", "cat": "The cat sat", "abcd": "a b c d", "once": "Once upon",
              "123": "1 2 3", "what": "what is it"}
#: Text prompts on the EOS model's HF folder (its tokenizer.json).
HF_TEXTS = {"hello": "hello world", "cat": "The cat sat", "zzz": "zzz", "123": "1 2 3", "ok": "ok",
            "once": "Once upon"}


def parity(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "parity", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    found = sorted(out.glob("*/results.json"))
    return proc.returncode, (json.loads(found[-1].read_text()) if found else {}), proc.stdout + proc.stderr


def checks(data: dict) -> dict[str, dict]:
    return {c["gate"]: c for c in data["cases"][0]["checks"]}


def prompt_file(tmp_path: Path, texts: dict[str, str]) -> str:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    return str(f)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> tuple[Path, Path]:
    return eos_case(tmp_path_factory.mktemp("eos-model"))


def reference_streams(model: Path, texts: dict[str, str], n: int = 8) -> dict[str, list[int]]:
    """The reference's greedy streams of the text prompts (EOS not stopping them)."""
    from gemma4_harness.harness.engines import make_engine
    from gemma4_harness.harness.tokenizer.prompt_ids import model_tokenizer, text_ids

    tok = model_tokenizer(model)
    ref = make_engine("reference", str(model))
    ids = [text_ids(tok, t) for t in texts.values()]
    return {k: g.tokens for k, g in zip(texts, ref.generate_full(ids, n))}


def reaching(streams: dict[str, list[int]]) -> dict[str, int]:
    return {k: s.index(EOS_ID) for k, s in streams.items() if EOS_ID in s}


# --------------------------------------------------------------------------- units


def test_end_of_generation_ids(tmp_path, eos_model):
    from gemma4_harness.harness.engines.openai import end_of_generation_ids

    gguf, hf = eos_model
    assert end_of_generation_ids(gguf) == {EOS_ID} == end_of_generation_ids(hf)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 50, "content": "<|tool_response>"},
                                                                          {"id": 7, "content": "<pad>"}]}))
    assert end_of_generation_ids(tmp_path) == {1, 106, 50}
    assert end_of_generation_ids(None) == set() == end_of_generation_ids(tmp_path / "missing.gguf")


def test_text_agrees_as_decoders_render_bytes():
    from gemma4_harness.harness.engines.openai import _text_agrees

    fffd = "\ufffd"
    assert _text_agrees(b"_\\9\x99", fffd * 4 + " t296")  # HF ByteFallback: a bad run is all U+FFFD
    assert _text_agrees(b"\xe2" * 5, fffd * 5) and _text_agrees(b"\xe2" * 5, fffd * 5, whole=True)
    assert not _text_agrees(b"\xe2" * 6, fffd * 5)
    assert not _text_agrees(b"\xca", "a") and _text_agrees(b"\xc3", "\u00e9")  # a lead byte must begin the next char
    assert _text_agrees(b"ab", "ab", whole=True) and not _text_agrees(b"a", "ab", whole=True)
    assert not _text_agrees(b"ax", "ab")


def _generic(gguf: Path, hint: list[int], top: list[dict[int, float]] | None = None):
    from gemma4_harness.harness.engines.openai import Generic, OpenAIEngine

    eng = OpenAIEngine.__new__(OpenAIEngine)
    eng.path, eng.hints = gguf, {}
    return Generic(eng), hint, top or [{} for _ in hint]


def test_generic_ids_follow_the_oracle_while_the_text_does(eos_model):
    gguf, _ = eos_model
    t260, t261 = 260, 261  # fillers "▁t260", "▁t261"
    a, b = 4 + ord("a"), 4 + ord("b")
    gen, hint, top = _generic(gguf, [a, t260, b, EOS_ID, a], [{a: -0.1}, {t260: -0.2, t261: -1.0}, {b: -0.1},
                                                              {EOS_ID: -0.1, a: -2.0}, {a: -0.1}])
    assert gen.ids("a t260b", 5, None, "stop", hint, top) == [a, t260, b]  # then EOS (_end_with_eog)
    # the server took the oracle's runner-up at step 1: named by the oracle's top-N
    assert gen.ids("a t261b", 5, None, "stop", hint, top)[:2] == [a, t261]
    # a text no candidate explains: -1 at that step, the rest unknown up to the count of a length finish
    assert gen.ids("a zzz", 5, 5, "length", hint, top) == [a, -1, -1, -1, -1]
    assert gen.ids("a t260b", 5, 5, "stop", None, None) == [-1]  # no oracle stream: nothing named


def _answer(text: str, tokens: list[int], error: str | None = None):
    from gemma4_harness.harness.engines.openai import ServerGenerated

    g = ServerGenerated()
    g.text, g.tokens, g.stream_error = text, list(tokens), error
    g.top = [[] for _ in tokens]
    return g


def test_a_stream_broken_at_bytes_that_are_no_utf8_is_not_judged_and_any_other_break_fails():
    """``server.stream~nostream.same_tokens`` on the generic dialect (text only), with what transformers serve 5.23
    streamed on the EOS model: where the answer without streaming shows U+FFFD (bytes that are no UTF-8) and the
    stream broke there with an error, or ended without only such characters, its text before that the answer's (a
    U+FFFD standing for any character), the request is not judged, with the reason; an error anywhere else, a stream
    whose text is not the answer's, and the same streams on a dialect that names steps by id, fail; the figure is
    taken over the requests judged."""
    from gemma4_harness.harness.parity.checks.server import ServerOptions
    from gemma4_harness.harness.parity.checks.server_generation import stream_figures, unstreamable

    fffd = "\ufffd"
    whole = _answer(f"{fffd * 4} t296 t320", [99, 96, 61, 157, 296, 320, EOS_ID])  # "_", "\\", "9", 0x99, ...
    held = "Invalid prefix encountered while decoding stream. Token ID: 296, Expected prefix: '9'"
    why = unstreamable(_answer("_\\9", [99, 96, 61], held), whole)
    assert why is not None and why.startswith("not judged: ") and held in why and "U+FFFD at character 3" in why
    for streamed in ("_\\9 t296", f"{fffd * 4} t29"):  # past the bad bytes
        assert unstreamable(_answer(streamed, [99, -1], held), whole) is None, streamed
    assert unstreamable(_answer(" t296", [296], held), _answer(f"x{fffd}", [5, 157])) is None  # not its text
    assert unstreamable(_answer("_\\9", [99, 96, 61], held), _answer("_\\9 t296", [99, 96, 61, 296])) is None
    all_bad = _answer(fffd * 5, [157, 158, 159, 160, 161, EOS_ID])
    assert unstreamable(_answer("", [EOS_ID]), all_bad).startswith("not judged: its stream ended without the last 5")
    assert unstreamable(_answer("", [EOS_ID]), _answer(f"{fffd} t296", [157, 296, EOS_ID])) is None

    class Streams:  # the engine's streamed answers by prompt
        def __init__(self, answers, dialect="openai"):
            self.answers, self.dialect = answers, dialect

        def complete(self, ids, n, top_n, stream=False, gaps=False):
            assert stream and gaps
            return self.answers[tuple(ids)]

    ok = _answer(" t423 t496", [423, 496, EOS_ID])
    prompts = {"bad": [1, 5], "fine": [1, 6], "zzz": [1, 7]}
    alone = {"bad": whole, "fine": ok, "zzz": all_bad}
    broken = {(1, 5): _answer("_\\9", [99, 96, 61], held), (1, 6): _answer(" t423 t496", [423, 496, EOS_ID]),
              (1, 7): _answer("", [EOS_ID])}
    (f,) = stream_figures(Streams(broken), ["bad", "fine", "zzz"], prompts, alone, ServerOptions())
    rows = {r["request"]: r for r in f.detail["rows"]}
    assert f.measured == 1.0 and f.detail["not_judged"] == ["bad", "zzz"] and rows["bad"]["not_judged"] == why
    assert rows["fine"]["ok"] and "informational_reason" not in f.detail
    (f,) = stream_figures(Streams(broken), ["bad"], prompts, alone, ServerOptions())
    assert f.measured != f.measured and f.detail["informational_reason"].startswith("no request's stream could be "
                                                                                      "judged: not judged: ")
    (f,) = stream_figures(Streams(broken, "llama-server"), ["bad", "fine", "zzz"], prompts, alone, ServerOptions())
    assert f.measured == 1.0 - 2 / 3 and "not_judged" not in f.detail
    (f,) = stream_figures(Streams({**broken, (1, 6): _answer(" t423", [423], "injected fault")}), ["bad", "fine"],
                          prompts, alone, ServerOptions())
    assert f.measured == 0.0 and f.detail["why"] == ("request fine the stream carries an error instead of choices: "
                                                     "injected fault")


# --------------------------------------------------------------------------- real servers, prompts reaching EOS


def test_llama_server_stops_at_eos_and_passes(eos_model, tmp_path_factory, tmp_path):
    gguf, _ = eos_model
    want = reaching(reference_streams(gguf, GGUF_TEXTS))
    assert len(want) >= 2 and any(v > 0 for v in want.values())  # the model does what the test needs
    with running_llama_server(gguf, tmp_path_factory, "llama-server-eos") as srv:
        rc, data, out = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{srv.url}/v1",
                               "--prompts", prompt_file(tmp_path, GGUF_TEXTS))
        assert rc == 0, out[-2000:]
        assert "overflow encountered" not in out  # the fp16 flash emulation no longer warns
        got = checks(data)
        rows = {r["request"]: r for r in got["reference~openai.greedy"]["streams_detail"]}
        for rid, step in want.items():  # each stream ends with the EOS id, where the reference's greedy choice is EOS
            assert rows[rid]["kind"] == "identical" and f"a {step + 1}, b 8" in rows[rid]["reason"], rows[rid]
        assert got["server.stop.eos"]["pass"] and got["server.stop.eos"]["eos_reached"] >= len(want)

        # wrong: a server that ignores EOS where the request lets it stop (llama-server then bans EOS and reports the
        # raw log-probs, where EOS stays the top-1)
        with FaultStub("ignore-eos", upstream=srv.url) as stub:
            rc, data, out = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{stub.url}/v1",
                                   "--prompts", prompt_file(tmp_path, GGUF_TEXTS), "--skip", "server-batch",
                                   "--skip", "server-stream")
        assert rc == 1 and "ENGINE FAILED" in out, out[-1500:]
        assert any(r.get("kind") == "fault" and r.get("oracle") == EOS_ID
                   for r in checks(data)["reference~openai.greedy"]["streams_detail"])

        # wrong: a server that ends a generation before the reference's EOS
        # (step 1: the first token of both streams is a whole filler, so the stub cuts the log-prob entries with it)
        with FaultStub("early-stop", upstream=srv.url, step=1) as stub:
            rc, data, out = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{stub.url}/v1",
                                   "--prompts", prompt_file(tmp_path, {"hello": "hello world", "abcd": "a b c d"}),
                                   "--skip", "server-batch", "--skip", "server-stream", "--skip", "server-stop")
        assert rc == 1 and stub.altered, out[-1500:]
        g = checks(data)["reference~openai.greedy"]
        assert not g["pass"] and all(r["step"] == 1 and r["ours"] == EOS_ID for r in g["streams_detail"]), g


def test_llama_cpp_python_stops_at_eos_and_passes(eos_model, tmp_path_factory, tmp_path):
    gguf, _ = eos_model
    _need_llama_cpp_python_server()
    want = reaching(reference_streams(gguf, GGUF_TEXTS))
    with _running(llama_cpp_python_process, gguf, tmp_path_factory, "lcp-eos") as srv:
        rc, data, out = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{srv.url}/v1",
                               "--prompts", prompt_file(tmp_path, GGUF_TEXTS))
        assert rc == 0, out[-2000:]
        rows = {r["request"]: r for r in checks(data)["reference~openai.greedy"]["streams_detail"]}
        for rid, step in want.items():  # it lists no EOS: the client put it back where it stopped
            assert rows[rid]["kind"] == "identical" and f"a {step + 1}, b 8" in rows[rid]["reason"], rows[rid]

        with FaultStub("early-stop", upstream=srv.url, step=1) as stub:
            rc, data, out = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{stub.url}/v1",
                                   "--prompts", prompt_file(tmp_path, {"hello": "hello world", "abcd": "a b c d"}),
                                   "--skip", "server-batch", "--skip", "server-stream", "--skip", "server-stop")
        assert rc == 1 and stub.altered, out[-1500:]
        assert "step 1: ours 1" in checks(data)["reference~openai.greedy"]["why"]


# --------------------------------------------------------------------------- transformers serve: the generic dialect


def test_transformers_serve_is_judged_by_the_generic_dialect(eos_model, tmp_path_factory, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai", reason="pip install 'transformers[serving]'")
    _, hf = eos_model
    want = reaching(reference_streams(hf, HF_TEXTS))
    assert len(want) >= 2 and any(v > 0 for v in want.values())
    prompts = prompt_file(tmp_path, HF_TEXTS)
    skip = ("--skip", "server-stream")
    with _running(transformers_serve_process, hf, tmp_path_factory, "transformers-serve-eos") as srv:
        rc, data, out = parity(tmp_path, "--model", str(hf), "--against", f"openai:{srv.url}/v1", "--prompts", prompts)
        assert rc == 0, out[-2500:]
        got = checks(data)
        # its stream breaks on byte tokens that are no UTF-8 (its DecodeStream: "Invalid prefix encountered") or
        # holds them back to the end: those requests are not judged, with the reason; the others are, and pass
        stream = got["server.stream~nostream.same_tokens"]
        assert stream["pass"] and stream["measured"] == 1.0 and 0 < len(stream["not_judged"]) < len(HF_TEXTS), stream
        rows = {r["request"]: r for r in stream["rows"]}
        assert all(rows[r]["not_judged"].startswith("not judged: its stream ") for r in stream["not_judged"])
        assert any("Invalid prefix encountered" in rows[r]["not_judged"] for r in stream["not_judged"]), rows
        assert "(openai, model None)" in got["reference~openai.runs"]["engine"]
        rows = {r["request"]: r for r in got["reference~openai.greedy"]["streams_detail"]}
        for rid, step in want.items():
            assert rows[rid]["kind"] == "identical" and f"a {step + 1}, b 8" in rows[rid]["reason"], rows[rid]
        for gate in ("reference~openai.max_abs_logprob", "server.tokenizer", "server.prompt_logprobs",
                     "server.chat_template"):  # what it could not judge, said per check
            assert got[gate]["informational"] and "generic OpenAI dialect" in got[gate]["reason"], got[gate]
        # --dialect names it without asking
        rc2, _, out2 = parity(tmp_path, "--model", str(hf), "--against", f"openai:{srv.url}/v1", "--prompts", prompts,
                              "--dialect", "openai", *skip, "--skip", "server-batch", "--skip", "server-stop")
        assert rc2 == 0, out2[-1500:]
    wrong = perturbed_hf(hf, tmp_path / "perturbed-hf")
    with _running(transformers_serve_process, wrong, tmp_path_factory, "transformers-serve-wrong") as srv:
        rc, data, out = parity(tmp_path, "--model", str(hf), "--against", f"openai:{srv.url}/v1", "--prompts", prompts,
                               *skip, "--skip", "server-batch", "--max-new-tokens", "16")
    assert rc == 1, out[-1500:]
    assert not checks(data)["reference~openai.greedy"]["pass"]


@pytest.mark.parametrize("mode", ["stream-drop", "stream-dup", "stream-error"])
def test_a_wrong_stream_on_the_generic_dialect_still_fails(eos_model, tmp_path_factory, tmp_path, mode):
    """transformers serve behind a proxy that drops, repeats or replaces by an error event the second text chunk of
    every stream (the first for ``stream-error``: "ok" streams two, and its text is valid UTF-8): the stream check
    fails (exit 1), naming a request whose stream is not what it answers without streaming; a stream broken at bytes
    that are no UTF-8 is the only one it does not judge."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai", reason="pip install 'transformers[serving]'")
    _, hf = eos_model
    prompts = prompt_file(tmp_path, HF_TEXTS)
    with _running(transformers_serve_process, hf, tmp_path_factory, f"transformers-serve-{mode}") as srv, \
            FaultStub(mode, upstream=srv.url, step=0 if mode == "stream-error" else 1) as proxy:
        rc, data, out = parity(tmp_path, "--model", str(hf), "--against", f"openai:{proxy.url}/v1", "--prompts",
                               prompts, "--skip", "server-batch", "--skip", "server-stop")
    assert rc == 1, out[-1500:]
    assert proxy.altered, "the proxy altered no stream"
    got = checks(data)
    stream = got["server.stream~nostream.same_tokens"]
    assert not stream["pass"] and stream["measured"] < 1.0, stream
    assert got["reference~openai.greedy"]["pass"]  # the answers without streaming are right
    bad = {r["request"]: r["why"] for r in stream["rows"] if r["ok"] is False}
    assert "ok" in bad, stream["rows"]
    if mode == "stream-error":
        assert bad["ok"] == "the stream carries an error instead of choices: injected fault"


# --------------------------------------------------------------------------- servers that cannot be used


def test_server_down_says_what_to_look_at_before_reference_work(synth_gguf, tmp_path):
    from servers import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    rc, data, out = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{url}", "--max-new-tokens", "2")
    assert rc == 2, out[-1500:]
    assert "connection refused" in out and "exited while loading its model" in out and "g4h inspect" in out
    said, loading = out.find("cannot be used"), out.find("loading with the reference")
    assert 0 <= said < loading, out[:1500]  # the URL is found unusable before any reference work
    assert "reference: pass" not in out[:loading]


def test_vocabulary_mismatch_is_named(eos_model, synth_gguf, tmp_path_factory, tmp_path):
    from gemma4_harness.harness import synth

    shape = Path(__file__).parent / "shapes" / "odd-h72-v300.toml"
    other = synth.ensure_built(shape).gguf["F32"]  # a vocabulary of 300 tokens
    from gemma4_harness.reference.tokenizer import read_gguf_metadata

    n_other = len(read_gguf_metadata(other)["tokenizer.ggml.tokens"])
    n_ours = len(read_gguf_metadata(synth_gguf)["tokenizer.ggml.tokens"])
    assert n_other != n_ours
    with running_llama_server(other, tmp_path_factory, "llama-server-other-vocab") as srv:
        rc, data, out = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{srv.url}/v1",
                               "--max-new-tokens", "2")
    assert rc == 1, out[-1500:]
    assert f"vocabulary of {n_other} tokens" in out and f"one of {n_ours}" in out and "serves another model" in out


def test_prompt_names_follow_the_models_window():
    from gemma4_harness.harness.synth.prompts import PROMPT_LAYOUT, WINDOW_NAMED, layout_name, make_prompts, named_for_window

    assert [layout_name(n, 16) for _, n, _ in PROMPT_LAYOUT] == [pid for pid, _, _ in PROMPT_LAYOUT]
    default = [{**p, WINDOW_NAMED: True} for p in make_prompts()]  # g4h parity --model without --prompts
    renamed = named_for_window(default, 3)
    assert "len16-window" not in [p["id"] for p in renamed] and not any(WINDOW_NAMED in p for p in renamed)
    assert {"len16-5xwindow+1", "len5-window+2"} <= {p["id"] for p in renamed}
    assert [p["id"] for p in named_for_window(default, None)][1:4] == ["len5", "len15", "len16"]
    mine = make_prompts()  # a user's own file with these names keeps them
    assert named_for_window(mine, 3) == mine


def test_default_prompt_names_on_a_model_of_another_window(tmp_path):
    """g4h parity --model M (the default prompt set) on the odd-h72-v300 shape, whose window is 8: no prompt is named
    for a window of 16."""
    from gemma4_harness.harness import synth

    model = synth.ensure_built(Path(__file__).parent / "shapes" / "odd-h72-v300.toml").gguf["F32"]
    rc, data, out = parity(tmp_path, "--model", str(model), "--against", "reference", "--quick")
    from gemma4_harness.harness.synth.prompts import PROMPT_LAYOUT, layout_name

    names = {c.get("prompt") for c in data["cases"][0]["checks"]} - {None}
    assert rc == 0 and names and names <= {layout_name(n, 8) for _, n, _ in PROMPT_LAYOUT}, (names, out[-800:])
    assert not names & {"len15-window-1", "len16-window", "len17-window+1"}, names


def test_fp16_emulation_overflows_like_llamacpp_without_a_warning():
    import warnings

    import numpy as np

    from gemma4_harness.harness.engines.llamacpp.numerics import fp16

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fp16(np.array([65504.0, 65519.0, 65520.0, -1e6, 1.0]))
    assert got[0] == 65504.0 and got[1] == 65504.0 and math.isinf(got[2]) and got[3] == -np.inf and got[4] == 1.0
