"""Tool-call parsing on recorded outputs of each format, the forcing grammar, and the offer text."""
import json

import pytest

from dreamstage.serving.sampling import json_schema_grammar
from dreamstage.serving.tools import call_text, forced_call_grammar, offer_text, parse_tool_calls

NAMES = frozenset({"get_weather", "add"})
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def calls(text):
    got = parse_tool_calls(text, NAMES)
    return None if got is None else (got[0], [(c.name, json.loads(c.arguments)) for c in got[1]])


@pytest.mark.parametrize("text,expected", [
    # Hermes / Qwen 2.5 / Qwen 3
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ("", [("get_weather", {"city": "Paris"})])),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     ("Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})])),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',          # cut at the stop: no closing tag
     ("", [("add", {"a": 1, "b": 2})])),
    # Mistral, with and without the marker (a control token the served text omits)
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcdefghi"}]',
     ("", [("get_weather", {"city": "Rome"})])),
    ('[{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "get_weather", "arguments": {"city": "Bern"}}]',
     ("", [("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Bern"})])),
    # Llama 3.x
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', ("", [("get_weather", {"city": "Lima"})])),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}', ("", [("add", {"a": 5, "b": 6})])),
    ('{"name": "add", "parameters": {"a": 1, "b": 1}}; {"name": "get_weather", "parameters": {"city": "Kyiv"}}',
     ("", [("add", {"a": 1, "b": 1}), ("get_weather", {"city": "Kyiv"})])),
    # generic JSON, arguments as a JSON string too
    ('{"tool_calls": [{"name": "add", "arguments": "{\\"a\\": 7, \\"b\\": 8}"}]}', ("", [("add", {"a": 7, "b": 8})])),
    ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Quito"}}}',
     ("", [("get_weather", {"city": "Quito"})])),
    ('{"type": "function", "function": {"name": "add", "arguments": {"a": 0, "b": 0}}}',
     ("", [("add", {"a": 0, "b": 0})])),
])
def test_each_format_is_read(text, expected):
    assert calls(text) == expected


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild.",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>',       # malformed JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',                          # not an offered tool
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',                        # arguments not an object
    '{"name": "add", "parameters": {"a": 1}}; not json',
    '[TOOL_CALLS] nonsense',
    '{"answer": 42}',
    "[]",
    '{"tool_calls": []}',
    '{"name": "add", "arguments": "not json"}',
])
def test_malformed_or_foreign_calls_stay_text(text):
    assert parse_tool_calls(text, NAMES) is None


def test_call_text_round_trips_through_the_parser():
    text = call_text("get_weather", '{"city": "Paris"}')
    assert calls(text) == ("", [("get_weather", {"city": "Paris"})])
    assert "get_weather" in offer_text([WEATHER]) and "<tool_call>" in offer_text([WEATHER])


def test_the_forcing_grammar_names_each_tool_once():
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    g = forced_call_grammar([WEATHER, add], json_schema_grammar)
    assert g.startswith('root ::= "<tool_call>" tool-call "</tool_call>"')
    assert '"\\"get_weather\\""' in g and '"\\"add\\""' in g
    assert len([line for line in g.splitlines() if line.startswith("root ::=")]) == 1


def test_parallel_tool_calls_false_keeps_the_first_call():
    from dreamstage.server.answers import ChatShape
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    many, called = ChatShape({}, (), False, NAMES).assistant_message(text)
    one, _ = ChatShape({}, (), False, NAMES, one_call=True).assistant_message(text)
    assert called and many["content"] is None and len(many["tool_calls"]) == 2
    assert [json.loads(c["function"]["arguments"]) for c in one["tool_calls"]] == [{"a": 1, "b": 2}]
    plain, called = ChatShape({}, (), False, NAMES).assistant_message("no calls here")
    assert not called and plain == {"role": "assistant", "content": "no calls here"}


def test_prompt_messages_for_a_template_without_tools():
    from dreamstage.serving.tools import prompt_messages
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out = prompt_messages(msgs, [WEATHER], native=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert calls_of(out[2]["content"]) == [("get_weather", {"city": "Paris"})]
    assert out[3] == {"role": "tool", "content": "sunny"}
    native = prompt_messages(msgs, [WEATHER], native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[2]["tool_call_id"] == "c1"


def calls_of(text):
    return calls(text)[1]


def test_a_template_that_reads_tools_gets_them_and_the_calls():
    from dreamstage.serving.chat import ChatTemplate
    from dreamstage.serving.tools import prompt_messages
    t = ChatTemplate("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                     "{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
                     "{{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}", "", "")
    assert t.supports_tools
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = t.render(prompt_messages(msgs, [WEATHER], native=True), None, [WEATHER])
    assert text == '[get_weather]Weather?<get_weather {"city": "Paris"}>sunny'


STREAMED = [
    ("Paris is sunny today.", "Paris is sunny today.", None),
    ("Let me check.\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>",
     "Let me check.", [("get_weather", {"city": "Oslo"})]),
    ("One moment [TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}]",
     "One moment", [("add", {"a": 1, "b": 2})]),
    ("{\"name\": \"add\", \"parameters\": {\"a\": 5, \"b\": 6}}", None, [("add", {"a": 5, "b": 6})]),
    ("<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",            # not offered: text
     "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>", None),
    ("Use <b>bold</b> or [links](x) {braces} freely.", "Use <b>bold</b> or [links](x) {braces} freely.", None),
    ("Try <tool_cal", "Try <tool_cal", None),                                       # a marker's prefix, then the end
    ("{\"answer\": 42}", "{\"answer\": 42}", None),
]


@pytest.mark.parametrize("text,content,expected", STREAMED)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_streamed_answer_with_tools_sends_text_as_it_comes_and_calls_at_the_end(text, content, expected, piece):
    """Streamed in pieces of `piece` characters, the content deltas add up to the whole answer's
    content, no part of a call goes out as content, and the calls come whole at the end."""
    from dreamstage.server.answers import ChatShape
    from dreamstage.serving.generation import Delta, Finished
    shape = ChatShape({}, (), False, NAMES)
    early = [shape.delta(Delta(text[i:i + piece], 0), 0, 0) for i in range(0, len(text), piece)]
    early_text = "".join(c["choices"][0]["delta"]["content"] for c in early if c)
    last = shape.final(Finished("stop", 1, 1, 0, 0), 0)
    deltas = [c["choices"][0]["delta"] for c in last]
    streamed = early_text + "".join(d.get("content") or "" for d in deltas)
    whole, called = ChatShape({}, (), False, NAMES).assistant_message(text)
    assert streamed == (whole["content"] or "") == (content or "")
    assert last[-1]["choices"][0]["finish_reason"] == ("tool_calls" if expected else "stop")
    got = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    if expected:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got[0]] == expected
        assert [c["index"] for c in got[0]] == list(range(len(expected))) and all(c["id"] for c in got[0])
        assert "{" not in early_text and "tool_call" not in early_text and "TOOL" not in early_text
    else:
        assert not got
    if text.startswith(("Paris", "Use")):
        assert len(early_text) > len(text) // 2          # plain text is not held to the end
