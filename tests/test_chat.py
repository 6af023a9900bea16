"""The Gemma 4 chat format (``reference/chat.py``).

* Rendering: turns, the system turn, thinking on/off, tool declarations, tool
  calls and responses, media placeholders, the generation prompt (exact text).
* Token ids: rendered text tokenized with the gemma4-type test tokenizer, BOS
  exactly once.
* Round trips: render -> parse keeps every message, thinking block and tool
  call (hand-written and hypothesis conversations); model output parsing.
* The Jinja path: the chat template stored in the test GGUF, rendered through
  transformers' own sandboxed renderer, gives the same text as ours.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies
import pytest

from gemma4_harness.reference import chat, chat_parse
from gemma4_harness.reference.errors import InputError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "nullable": True},
        "tags": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}, "required": ["deep"]}}}}}
NOOP = {"type": "function", "function": {"name": "noop", "description": "Does nothing"}}


def call(name, args, cid=None):
    c = {"type": "function", "function": {"name": name, "arguments": args}}
    if cid is not None:
        c["id"] = cid
    return c


# --------------------------------------------------------------------------- rendering (exact text)


def test_plain_turns():
    msgs = [{"role": "user", "content": "  Hi there!  "}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]
    assert chat.render(msgs, add_generation_prompt=True) == (
        "<bos><|turn>user\nHi there!<turn|>\n<|turn>model\nHello.<turn|>\n"
        "<|turn>user\nBye<turn|>\n<|turn>model\n")
    assert chat.render(msgs[:1], bos=False) == "<|turn>user\nHi there!<turn|>\n"


def test_system_and_thinking_switch():
    msgs = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "2+2?"}]
    on = chat.render(msgs, add_generation_prompt=True, enable_thinking=True)
    off = chat.render(msgs, add_generation_prompt=True)
    assert on == "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n"
    assert off == "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n"
    # thinking on without a system message still opens a system turn
    assert chat.render(msgs[1:], enable_thinking=True).startswith("<bos><|turn>system\n<|think|>\n<turn|>\n")
    # some Gemma 4 templates close an empty thought when thinking is off
    assert chat.render(msgs, add_generation_prompt=True, empty_thought_when_off=True).endswith(
        "<|turn>model\n<|channel>thought\n<channel|>")
    assert chat.render(msgs, add_generation_prompt=True, enable_thinking=True,
                       empty_thought_when_off=True).endswith("<|turn>model\n")


def test_thinking_history_rules():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "old thought"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "thinking": "why call", "tool_calls": [call("noop", {})]}]
    text = chat.render(msgs)
    assert "old thought" not in text  # before the last user message: dropped
    assert "<|channel>thought\nwhy call\n<channel|><|tool_call>call:noop{}<tool_call|><|tool_response>" in text
    assert "<|channel>thought\nold thought\n<channel|>a1" in chat.render(msgs, preserve_thinking=True)
    # thinking blocks inside model text are stripped from history
    m = [{"role": "assistant", "content": "<|channel>thought\nhidden<channel|> shown "}]
    assert chat.render(m, bos=False) == "<|turn>model\nshown<turn|>\n"


def test_tool_declarations():
    text = chat.render([{"role": "user", "content": "w?"}], [WEATHER, NOOP])
    assert text.startswith(
        '<bos><|turn>system\n<|tool>declaration:get_weather{description:<|"|>Weather for a city<|"|>,parameters:{'
        'properties:{city:{description:<|"|>City name<|"|>,type:<|"|>STRING<|"|>},'
        'days:{nullable:true,type:<|"|>INTEGER<|"|>},'
        'opts:{properties:{deep:{type:<|"|>BOOLEAN<|"|>}},required:[<|"|>deep<|"|>],type:<|"|>OBJECT<|"|>},'
        'tags:{items:{type:<|"|>STRING<|"|>},type:<|"|>ARRAY<|"|>},'
        'unit:{enum:[<|"|>celsius<|"|>,<|"|>fahrenheit<|"|>],type:<|"|>STRING<|"|>}},'
        'required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|>'
        '<|tool>declaration:noop{description:<|"|>Does nothing<|"|>}<tool|><turn|>\n')
    with pytest.raises(InputError, match="without a function name"):
        chat.render([], [{"type": "function", "function": {"description": "x"}}])


def test_tool_calls_and_responses():
    args = {"city": "Paris", "days": 2, "flag": True, "none": None, "ratio": 0.5,
            "nested": {"B": [1, "two"], "a": {}}}
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "tool_calls": [call("get_weather", args, "c1"), call("noop", "raw text", "c2")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": {"ok": True, "n": 3}},
            {"role": "assistant", "content": "It is sunny."}]
    text = chat.render(msgs, add_generation_prompt=True)
    assert text == (
        "<bos><|turn>user\nWeather?<turn|>\n<|turn>model\n"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2,flag:true,nested:{a:{},B:[1,<|"|>two<|"|>]},'
        "none:None,ratio:0.5}<tool_call|><|tool_call>call:noop{raw text}<tool_call|>"
        '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
        "<|tool_response>response:noop{n:3,ok:true}<tool_response|>"
        "It is sunny.<turn|>\n<|turn>model\n")
    # no generation prompt right after tool responses: the model turn stays open
    assert chat.render(msgs[:4], add_generation_prompt=True).endswith("<tool_response|>")
    # tool calls without responses: the turn ends waiting for the tool
    waiting = chat.render(msgs[:2], add_generation_prompt=True)
    assert waiting.endswith("<tool_call|><|tool_response>")
    # legacy tool_responses on the assistant message
    legacy = [{"role": "assistant", "tool_calls": [call("f", {})], "tool_responses": [{"name": "f", "response": 7}]}]
    assert chat.render(legacy, bos=False) == (
        "<|turn>model\n<|tool_call>call:f{}<tool_call|><|tool_response>response:f{value:7}<tool_response|>")


def test_media_and_content_lists():
    msgs = [{"role": "user", "content": [{"type": "text", "text": " look "}, {"type": "image"}, {"type": "audio"},
                                         {"type": "video"}]}]
    assert chat.render(msgs, add_generation_prompt=True) == (
        "<bos><|turn>user\nlook<|image|><|audio|><|video|><turn|>\n<|turn>model\n")


def test_format_value_rules():
    assert chat.format_value({"b": 1, "A": "x"}) == '{<|"|>A<|"|>:<|"|>x<|"|>,<|"|>b<|"|>:1}'
    assert chat.format_value({"b": 1, "A": "x"}, escape_keys=False) == '{A:<|"|>x<|"|>,b:1}'
    assert chat.format_value([True, False, None, 1.5, -3]) == "[true,false,None,1.5,-3]"
    assert chat_parse.parse_value('{A:<|"|>x, y<|"|>,b:[1,2.5,true,None]}') == {"A": "x, y", "b": [1, 2.5, True, None]}
    for bad in ("{a:1", "[1,2", '<|"|>open', "{a 1}", "1 2]"):
        with pytest.raises(InputError):
            chat_parse.parse_value(bad)


def test_bad_messages():
    with pytest.raises(InputError, match="message 1"):
        chat.render([{"role": "user", "content": "x"}, {"content": "no role"}])


# --------------------------------------------------------------------------- model output


def test_parse_model_output():
    out = chat_parse.parse_model_output(
        "<|channel>thought\nThe user wants weather.\n<channel|>Let me check."
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
        "<|tool_call>call:noop{}<tool_call|><|tool_response>")
    assert out == {"thinking": "The user wants weather.", "content": "Let me check.",
                   "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}), call("noop", {})],
                   "stop": "<|tool_response>"}
    final = chat_parse.parse_model_output(" The answer is 4. <turn|>\n<|turn>user\n")
    assert final == {"thinking": None, "content": "The answer is 4.", "tool_calls": [], "stop": "<turn|>"}
    assert chat_parse.parse_model_output("partial")["stop"] is None
    assert chat_parse.parse_model_output("x<eos>")["stop"] == "<eos>"
    raw = chat_parse.parse_model_output("<|tool_call>call:f{not parseable}<tool_call|>")
    assert raw["tool_calls"] == [call("f", "not parseable")]
    for bad, msg in (("<|channel>thought\nno end", "without <channel|>"), ("<|tool_call>call:f{", "without"),
                     ("<|tool_call>nocall<tool_call|>", "expected call:NAME")):
        with pytest.raises(InputError, match=msg):
            chat_parse.parse_model_output(bad)


# --------------------------------------------------------------------------- round trips

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi", "reasoning_content": "greet\n"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "Weather in Paris and Rome?"},
     {"role": "assistant", "content": "", "reasoning_content": "two calls",
      "tool_calls": [call("get_weather", {"city": "Paris"}, "a"), call("get_weather", {"city": "Rome"}, "b")]},
     {"role": "tool", "tool_call_id": "a", "content": "sunny"},
     {"role": "tool", "tool_call_id": "b", "content": {"temp": 12.5, "sky": ["cloud", "rain"]}},
     {"role": "assistant", "content": "Paris is sunny; Rome is rainy.", "thinking": "summarise"},
     {"role": "user", "content": "thanks"},
     {"role": "assistant", "tool_calls": [call("noop", {"x": None, "deep": {"k": [True, 1, "s"]}})]}],
    [{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "a"},
     {"role": "assistant", "tool_calls": [call("noop", {})]}, {"role": "tool", "name": "noop", "content": "done"},
     {"role": "user", "content": "b"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("msgs", CONVERSATIONS)
def test_render_parse_round_trip(msgs):
    for thinking in (False, True):
        text = chat.render(msgs, [WEATHER, NOOP], enable_thinking=thinking, preserve_thinking=True,
                           add_generation_prompt=True)
        back = chat_parse.parse_conversation(text)
        assert back["messages"] == chat_parse.normalize_messages(msgs)
        assert back["enable_thinking"] is thinking
        assert [t["name"] for t in back["tools"]] == ["get_weather", "noop"]
        ends_waiting = bool(msgs[-1].get("tool_calls"))
        assert back["add_generation_prompt"] is not ends_waiting


def _conversations():
    st = hypothesis.strategies
    safe = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=12)
    key = st.text(alphabet="abcXYZ_", min_size=1, max_size=5)
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                       st.floats(allow_nan=False, allow_infinity=False, width=32), safe)
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(key, c, max_size=3),
                         max_leaves=6)
    args = st.dictionaries(key, value, max_size=3)
    name = st.sampled_from(["get_weather", "search", "calc.add", "f"])
    thinking = st.one_of(st.none(), safe.filter(lambda s: s.strip() != "" or s == ""))

    @st.composite
    def conv(draw):
        msgs = []
        if draw(st.booleans()):
            msgs.append({"role": "system", "content": draw(safe)})
        for _ in range(draw(st.integers(1, 3))):
            msgs.append({"role": "user", "content": draw(safe)})
            for _ in range(draw(st.integers(0, 2))):  # tool rounds
                calls = [call(draw(name), draw(args), f"id{len(msgs)}_{k}") for k in range(draw(st.integers(1, 2)))]
                m = {"role": "assistant", "tool_calls": calls}
                th = draw(thinking)
                if th:
                    m["reasoning_content"] = th
                msgs.append(m)
                for c in calls:
                    body = draw(st.one_of(safe, st.dictionaries(key, value, max_size=3).filter(
                        lambda d: list(d) != ["value"])))
                    msgs.append({"role": "tool", "tool_call_id": c["id"], "content": body})
            final = {"role": "assistant", "content": "A" + draw(safe)}  # empty text after tool responses renders as nothing
            th = draw(thinking)
            if th:
                final["thinking"] = th
            msgs.append(final)
        return msgs

    return conv()


def test_round_trip_hypothesis():

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(_conversations())
    def run(msgs):
        text = chat.render(msgs, preserve_thinking=True, add_generation_prompt=True)
        back = chat_parse.parse_conversation(text)
        assert back["messages"] == chat_parse.normalize_messages(msgs), text
        for m in msgs:  # every thinking block and tool call is in the parsed result
            if m.get("tool_calls"):
                assert any(b.get("tool_calls") == chat_parse.normalize_messages([m])[0]["tool_calls"]
                           for b in back["messages"])

    run()


def test_model_output_round_trip():
    msg = {"role": "assistant", "content": "Done.", "reasoning_content": "think\nmore",
           "tool_calls": [call("search", {"q": "gemma 4", "n": 3})]}
    text = chat.render([msg], bos=False, preserve_thinking=True)
    body = text[len("<|turn>model\n"):]
    out = chat_parse.parse_model_output(body)
    assert out["thinking"] == "think\nmore" and out["tool_calls"] == [call("search", {"q": "gemma 4", "n": 3})]
    assert out["stop"] == "<|tool_response>"


# --------------------------------------------------------------------------- ids and the Jinja template


def test_render_ids_bos_once(g4):
    msgs = CONVERSATIONS[1]
    ids = chat.render_ids(g4, msgs, [WEATHER], add_generation_prompt=True)
    assert ids.count(2) == 1 and ids[0] == 2
    assert ids[1:4] == [105, 9731, 107]  # <|turn> system \n
    assert 106 in ids and 48 in ids and 49 in ids and 52 in ids and 50 in ids and 46 in ids
    assert g4.decode(ids, special=True) == chat.render(msgs, [WEATHER], add_generation_prompt=True)
    assert chat.render_ids(g4, msgs, bos=False)[0] == 2  # the tokenizer adds the one BOS
    # markers kept as text would not give the turn ids
    assert 105 not in g4.encode(chat.render(msgs), parse_special=False)


JINJA_CASES = [
    {"name": "plain", "messages": [{"role": "user", "content": " hi "}], "add_generation_prompt": True},
    {"name": "system+thinking", "enable_thinking": True, "add_generation_prompt": True,
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "add"}]},
    {"name": "tools", "tools": [WEATHER, NOOP], "messages": CONVERSATIONS[1], "add_generation_prompt": True},
    {"name": "developer", "tools": [NOOP], "messages": CONVERSATIONS[2], "add_generation_prompt": True},
    {"name": "waiting", "messages": CONVERSATIONS[1][:3], "add_generation_prompt": True},
    {"name": "media", "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]},
                                   {"role": "assistant", "content": [{"type": "text", "text": " ok "}]}]},
    {"name": "legacy", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "r",
                                    "tool_calls": [call("f", "raw")], "tool_responses": [{"name": "f",
                                                                                         "response": {"a": 1}}]}]},
    {"name": "system list", "messages": [{"role": "system", "content": [{"type": "text", "text": " a "},
                                                                         {"type": "text", "text": "b"}]},
                                         {"role": "user", "content": "u"}]},
]


def test_gguf_chat_template_matches_ours(built):
    template = chat.chat_template_from_gguf(built.gguf)
    assert template is not None
    assert chat.compare_with_template(template, JINJA_CASES) == []
    broken = template.replace("'<turn|>\\n'", "'<turn|>'")
    diffs = chat.compare_with_template(broken, JINJA_CASES[:1])
    assert diffs and diffs[0]["name"] == "plain" and diffs[0]["position"] > 0


def test_gguf_chat_template_hypothesis(built):
    template = chat.chat_template_from_gguf(built.gguf)

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(_conversations(), hypothesis.strategies.booleans())
    def run(msgs, thinking):
        cases = [{"messages": msgs, "tools": [WEATHER], "enable_thinking": thinking, "add_generation_prompt": True}]
        assert chat.compare_with_template(template, cases) == []

    run()


def test_template_errors_are_one_line():
    with pytest.raises(InputError, match="chat template failed") as err:
        chat.render_with_template("{{ raise_exception('nope') }}", [{"role": "user", "content": "x"}])
    assert "\n" not in str(err.value)
