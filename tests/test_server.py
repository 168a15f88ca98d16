"""The HTTP service end to end: one uvicorn server for the module, on a free loopback port."""
import json
import re
import threading
import time

import httpx
import pytest
from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings

PROMPTS = ["What is the capital of France?", "Write a haiku about snow.", "List three fruits.",
           "Why is the sky blue?"]


@pytest.fixture(scope="module")
def server():
    # 4 slots and a waiting room of 1: the sixth outstanding request gets 503.
    with BackgroundServer(ServerSettings(ctx=2048, parallel=4, threads=1, max_queue=1,
                                         max_body_bytes=64 * 1024)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def chat(http, content, max_tokens=24, **kw):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                "temperature": 0, "max_tokens": max_tokens, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def metric(http, name, labels=""):
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def wait_for(http, pred, what, timeout=60.0):
    # Polls /health with a short sleep: a busy loop of GETs would take a core
    # from the engine thread it is waiting for.
    deadline = time.monotonic() + timeout
    while True:
        h = http.get("/health").json()
        if pred(h):
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what} in {timeout:.0f} s; last /health: {h}")
        time.sleep(0.01)


def test_four_concurrent_greedy_requests_match_one_at_a_time(server, http):
    alone = [chat(http, p)["choices"][0]["message"]["content"] for p in PROMPTS]
    batches_before = metric(http, "dreamstage_decode_batches_total")
    tokens_before = metric(http, "dreamstage_generated_tokens_total")
    together = [None] * 4
    start = threading.Barrier(4)

    def worker(i):
        with httpx.Client(base_url=server.url, timeout=300) as c:
            start.wait()
            together[i] = chat(c, PROMPTS[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["choices"][0]["message"]["content"] for r in together] == alone
    assert all(a for a in alone)
    # Batched: fewer decode calls than tokens generated (one at a time needs one per token).
    batches = metric(http, "dreamstage_decode_batches_total") - batches_before
    tokens = metric(http, "dreamstage_generated_tokens_total") - tokens_before
    assert tokens == sum(r["usage"]["completion_tokens"] for r in together)
    assert batches < tokens


def test_response_carries_adapter_version_and_usage(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                "temperature": 0})
    assert r.headers["X-Dreamstage-Adapter-Version"] == "0"
    body = r.json()
    assert body["adapter_version"] == 0 and body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] <= 4 and body["usage"]["prompt_tokens"] > 0


def test_completions_route_and_stop_string(http):
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200
    full = r.json()["choices"][0]["text"]
    assert "5" in full
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0, "stop": ["5"]})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and "5" not in c["text"] and full.startswith(c["text"])


def test_openai_sdk_streaming_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="base", messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream=True, temperature=0, max_tokens=24)
    assert raw.headers["x-dreamstage-adapter-version"] == "0"
    pieces, finish, versions = [], None, set()
    for chunk in raw.parse():
        versions.add(chunk.model_extra.get("adapter_version"))
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(pieces)
    assert text.strip() and finish in ("stop", "length")
    assert versions == {0}
    # and non-streaming through the SDK gives the same text
    done = client.chat.completions.create(model="base",
                                          messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          temperature=0, max_tokens=24)
    assert done.choices[0].message.content == text
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_disconnect_frees_the_slot(server, http):
    cancelled = metric(http, "dreamstage_requests_total", '{outcome="cancelled"}')
    with httpx.Client(base_url=server.url, timeout=300) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Count from 1 to 500."}], "max_tokens": 400,
                "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
            assert http.get("/health").json()["slots_busy"] == 1
    # the client is gone: the slot must come back without the 400 tokens being generated
    wait_for(http, lambda h: h["slots_busy"] == 0, "the slot freed")
    assert metric(http, "dreamstage_requests_total", '{outcome="cancelled"}') == cancelled + 1
    assert all(not s["busy"] for s in http.get("/slots").json()["slots"])


def test_overflow_gets_503_with_retry_after(server, http):
    body = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    clients = [httpx.Client(base_url=server.url, timeout=300) for _ in range(5)]
    streams = []
    try:
        for c in clients[:4]:  # fill the four slots (each stream answers once admitted)
            cm = c.stream("POST", "/v1/chat/completions", json=body)
            r = cm.__enter__()
            assert r.status_code == 200
            streams.append(cm)
        queued = {}
        waiter = threading.Thread(target=lambda: queued.setdefault("r", clients[4].post(
            "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})))
        waiter.start()  # takes the waiting room's one place
        wait_for(http, lambda h: h["queue_depth"] == 1, "a queued request")
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
        waiter.join(300)
        for c in clients:
            c.close()
    # the queued request was served once the streams let go of their slots
    assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] <= 4
    wait_for(http, lambda h: h["slots_busy"] == 0 and h["queue_depth"] == 0, "everything released")


def test_metrics_counters_move(http):
    names = ["dreamstage_prompt_tokens_total", "dreamstage_generated_tokens_total", "dreamstage_decode_batches_total",
             "dreamstage_time_to_first_token_seconds_count", "dreamstage_inter_token_latency_seconds_count"]
    before = {n: metric(http, n) for n in names}
    stops = metric(http, "dreamstage_requests_total", '{outcome="length"}')
    out = chat(http, "Tell me about the moon.", 6)
    assert out["choices"][0]["finish_reason"] == "length"
    after = {n: metric(http, n) for n in names}
    assert after["dreamstage_generated_tokens_total"] - before["dreamstage_generated_tokens_total"] == 6
    assert (after["dreamstage_prompt_tokens_total"] - before["dreamstage_prompt_tokens_total"]
            == out["usage"]["prompt_tokens"])
    assert (after["dreamstage_time_to_first_token_seconds_count"]
            == before["dreamstage_time_to_first_token_seconds_count"] + 1)
    assert (after["dreamstage_inter_token_latency_seconds_count"]
            == before["dreamstage_inter_token_latency_seconds_count"] + 5)
    assert after["dreamstage_decode_batches_total"] > before["dreamstage_decode_batches_total"]
    assert metric(http, "dreamstage_requests_total", '{outcome="length"}') == stops + 1
    text = http.get("/metrics").text
    for gauge in ("dreamstage_busy_slots", "dreamstage_queue_depth"):
        assert re.search(rf"^# TYPE {gauge} gauge$", text, re.M)


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": MSG, "max_tokens": -1}, "max_tokens"),
    ({"messages": MSG, "max_tokens": "10"}, "max_tokens"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 3}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stop": [1, 2]}, "stop"),
    ({"messages": MSG, "n": 5}, "n"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MSG, "max_tokens": 100000}, "max_tokens"),
    ({"messages": MSG, "grammar": "root ::= ("}, "grammar"),
])
def test_bad_chat_bodies_get_400_naming_the_field(http, body, field):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field
    assert field in err["message"]


@pytest.mark.parametrize("body,field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [[1, 2], [3, 999999]]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 999999]}, "prompt"),
])
def test_bad_completion_bodies_get_400_naming_the_field(http, body, field):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_malformed_json_and_oversize_bodies(http):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]})
    r = http.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"

    def chunked():
        yield big.encode()
    r = http.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_unknown_route_is_an_openai_shaped_404(http):
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_health_models_slots(http):
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["slots"] == 4
    s = http.get("/slots").json()
    assert s["slot_context"] == 2048 // 4 and len(s["slots"]) == 4
    assert http.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
