"""POST /v1/responses through the `openai` SDK's Responses client, checked against the chat route:
the same conversation gives the same answer, the tool loop round-trips, the stream's events
build the same response, and what the route cannot take is a 400 naming the field."""
from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest
from background_server import BackgroundServer

from dreamstage.server.response_store import ResponseStore
from dreamstage.server.settings import ServerSettings
from dreamstage.server.tenants import ALL, AdapterScope

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerSettings(ctx=1024, parallel=2, threads=1)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_answer(client, messages, **kw):
    done = client.chat.completions.create(model="base", messages=messages, temperature=0, **kw)
    return done.choices[0], done.usage


def test_a_response_answers_as_the_chat_route_does(client):
    parts = [{"type": "input_text", "text": "Name a color."}]
    got = client.responses.create(model="base", instructions="Answer briefly.", temperature=0, max_output_tokens=24,
                                  input=[{"role": "user", "content": parts}])
    want, usage = chat_answer(client, [{"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": "Name a color."}], max_tokens=24)
    assert got.object == "response" and got.id.startswith("resp_") and got.output_text == want.message.content
    assert [o.type for o in got.output] == ["message"] and got.output[0].role == "assistant"
    assert got.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert (got.usage.input_tokens, got.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    cut = client.responses.create(model="base", input="Count from one to fifty.", temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_the_tool_loop_round_trips(client):
    called = client.responses.create(model="base", input=ASK, tools=[WEATHER], tool_choice="required",
                                     temperature=0, max_output_tokens=60)
    (call,) = [o for o in called.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert jsonschema_rs.is_valid(WEATHER["parameters"], json.loads(call.arguments))
    after = client.responses.create(model="base", tools=[WEATHER], temperature=0, max_output_tokens=24, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "clear, 21 degrees"}])
    want, _ = chat_answer(client, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "clear, 21 degrees"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=24)
    assert after.output_text == (want.message.content or "")


def test_the_stream_builds_the_same_response(client):
    ask = dict(model="base", input="Count to five.", temperature=0, max_output_tokens=20)
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text and len(deltas) > 3
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in client.responses.create(model="base", input=ASK, tools=[WEATHER], tool_choice="required",
                                                     max_output_tokens=60, stream=True)]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]


def test_text_format_holds_the_answer_to_its_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    for seed in range(4):     # hot sampling: a raw newline inside a string once slipped through the grammar
        got = client.responses.create(model="base", input="Name a city.", max_output_tokens=40, temperature=1.5,
                                      text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
                                      extra_body={"seed": seed})
        assert got.status == "completed" and jsonschema_rs.is_valid(schema, json.loads(got.output_text)), got


@pytest.mark.parametrize(("body", "param"), (
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning"}]}, "input"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
))
def test_what_it_cannot_take_is_a_400_naming_the_field(server, body, param):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/responses", json={"model": "base", "input": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_previous_response_id_continues_the_kept_conversation(client, server):
    first = client.responses.create(model="base", input="My name is Ada.", temperature=0, max_output_tokens=16)
    then = client.responses.create(model="base", previous_response_id=first.id, input="What is my name?",
                                   temperature=0, max_output_tokens=16)
    want, _ = chat_answer(client, [{"role": "user", "content": "My name is Ada."},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "What is my name?"}], max_tokens=16)
    assert then.output_text == want.message.content and then.previous_response_id == first.id
    # the tool loop by reference: the call's id is the one the kept conversation holds
    called = client.responses.create(model="base", input=ASK, tools=[WEATHER], tool_choice="required",
                                     temperature=0, max_output_tokens=60)
    (call,) = [o for o in called.output if o.type == "function_call"]
    by_ref = client.responses.create(model="base", previous_response_id=called.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=24, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id,
                                                                   "output": "clear, 21 degrees"}])
    whole = client.responses.create(model="base", tools=[WEATHER], temperature=0, max_output_tokens=24, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "clear, 21 degrees"}])
    assert by_ref.output_text == whole.output_text
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get(f"/v1/responses/{first.id}").json()["output"][0]["content"][0]["text"] == first.output_text
        client.responses.delete(first.id)               # the SDK's own call (JSON headers, a key)
        json_headers = {"Content-Type": "application/json"}
        for r in (http.get(f"/v1/responses/{first.id}"), http.delete(f"/v1/responses/{first.id}",
                                                                      headers=json_headers)):
            assert r.status_code == 404
        r = http.post("/v1/responses", json={"input": "hi", "previous_response_id": first.id})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        unkept = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False}).json()
        assert unkept["store"] is False and http.get(f"/v1/responses/{unkept['id']}").status_code == 404


def test_the_store_keeps_the_newest_within_its_bounds_and_each_scope_its_own():
    alice, bob = AdapterScope(frozenset({"alice"})), AdapterScope(frozenset({"bob"}))
    store = ResponseStore(max_kept=3, max_bytes=10_000)
    for i in range(4):
        store.put(f"r{i}", alice, [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
    assert store.get("r0", ALL) is None and store.get("r3", alice).response == {"id": "r3"}
    assert store.get("r3", bob) is None and store.get("r3", ALL) is not None and not store.delete("r3", bob)
    store.put("big", bob, [{"role": "user", "content": "x" * 9_000}], {"id": "big"})
    assert store.get("big", bob) is not None and store.get("r1", alice) is None     # bytes bound: the oldest left
    assert store.delete("big", bob) and store.get("big", bob) is None
