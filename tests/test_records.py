"""Records of served answers (`serve --record`): what is kept, retention, deletion, scoped keys.

The store's rules run on a JobStore with a simulated clock; the HTTP side runs one server per module
on the default model (CPU, one thread)."""
from __future__ import annotations

import json

import httpx
import pytest
from background_server import BackgroundServer

from dreamstage.records.store import RecordPolicy, RecordStore, ServedAnswer
from dreamstage.server.settings import ServerSettings
from dreamstage.training.jobs.store import JobStore

JSON = {"Content-Type": "application/json"}


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def answer(rid: str, index: int = 0, adapter: str | None = None, text: str = "an answer") -> ServedAnswer:
    return ServedAnswer(rid, index, "chat", [1, 2, 3], text, "stop", adapter, 0 if adapter is None else 1,
                        0 if adapter is None else 1, {"temperature": 0.0},
                        messages=[{"role": "user", "content": "q"}])


def test_retention_by_age_and_size_on_write_and_at_open(tmp_path):
    clock = Clock()
    jobs = JobStore(tmp_path, clock=clock)
    store = RecordStore(jobs, RecordPolicy(days=1.0, mib=1.0))
    store.add([answer("a")])
    clock.t += 0.5 * 86400
    store.add([answer("b"), answer("b", 1)])
    assert [a.id for a in store.recent()] == ["b", "b", "a"]
    clock.t += 0.6 * 86400                       # "a" is 1.1 days old: the next write removes it
    store.add([answer("c")])
    assert sorted({a.id for a in store.recent()}) == ["b", "c"]
    clock.t += 0.6 * 86400                       # "b" expires; nothing is written: the next open removes it
    jobs.close()
    jobs = JobStore(tmp_path, clock=clock)
    store = RecordStore(jobs, RecordPolicy(days=1.0, mib=1.0))
    assert [a.id for a in store.recent()] == ["c"]

    # size: the oldest go first until the rest fits
    n, size = store.totals()
    assert n == 1 and size > 0
    small = RecordStore(jobs, RecordPolicy(days=1.0, mib=2.5 * size / (1 << 20)))
    clock.t += 1.0
    small.add([answer("d")])
    clock.t += 1.0
    small.add([answer("e")])
    assert [a.id for a in small.recent()] == ["e", "d"]        # "c", the oldest, made room
    jobs.close()


def test_records_by_adapter_scope_and_deletion(tmp_path):
    jobs = JobStore(tmp_path)
    store = RecordStore(jobs)
    store.add([answer("x", 0, "alice"), answer("x", 1, "alice")])
    store.add([answer("y", 0, "bob")])
    store.add([answer("z", 0, None)])
    assert {a.id for a in store.recent(adapter="alice")} == {"x"}
    assert {a.id for a in store.recent(adapter="base")} == {"z"}
    assert {a.id for a in store.recent(names=frozenset({"bob"}))} == {"y"}     # a scoped key: no base records
    assert [a.index for a in store.get("x")] == [0, 1]
    assert store.delete("x") == 2 and store.get("x") == []
    assert store.delete_adapter("bob") == 1 and store.recent(adapter="bob") == []
    assert [a.id for a in store.recent()] == ["z"]
    jobs.close()


# -- over HTTP ----------------------------------------------------------------------------------
def settings(state_dir, **kw) -> ServerSettings:
    base = dict(ctx=1024, parallel=4, threads=1, state_dir=str(state_dir), record=True)
    base.update(kw)
    return ServerSettings(**base)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    keys = state.parent / "keys.json"
    keys.write_text(json.dumps({"alice-key": {"adapters": ["alice"], "train": True},
                                "chat-key": {"adapters": ["learned"], "train": False}}))
    with BackgroundServer(settings(state, api_key="admin", api_keys=str(keys))) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600, headers={**JSON, "Authorization": "Bearer admin"}) as c:
        yield c


def ask(http, content: str, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                "max_tokens": 8, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_each_choice_is_recorded_with_the_tokens_it_was_served(server, http):
    got = ask(http, "Name a colour.", n=2, seed=7, temperature=0.9)
    rid = got["id"]
    rec = http.get(f"/v1/records/{rid}").json()["data"]
    assert [r["index"] for r in rec] == [0, 1]
    for r, c in zip(rec, got["choices"], strict=True):
        assert r["answer"] == c["message"]["content"] and r["finish_reason"] == c["finish_reason"]
        assert r["kind"] == "chat" and r["adapter"] is None and r["adapter_version"] == 0
        assert r["messages"] == [{"role": "user", "content": "Name a colour."}]
        assert len(r["prompt_tokens"]) == got["usage"]["prompt_tokens"]
        assert r["sampling"]["temperature"] == 0.9 and r["sampling"]["max_tokens"] == 8
    assert rec[0]["sampling"]["seed"] == 7 and rec[1]["sampling"]["seed"] == 8     # each choice its own seed
    # the exact tokens serving decoded (its own rendering of this conversation)
    service = server.service
    asked = [{"role": "user", "content": "Name a colour."}]
    assert rec[0]["prompt_tokens"] == service.prompts._chat(service.chat, asked)
    listed = http.get("/v1/records", params={"adapter": "base"}).json()
    assert listed["recording"] is True and rid in [r["id"] for r in listed["data"]]


def test_streams_and_completions_are_recorded_and_store_false_is_not(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                "max_tokens": 6, "temperature": 0, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    rid = events[0]["id"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    (rec,) = http.get(f"/v1/records/{rid}").json()["data"]
    assert rec["answer"] == text and text
    done = http.post("/v1/completions", json={"prompt": "One, two,", "max_tokens": 4, "temperature": 0}).json()
    (rec,) = http.get(f"/v1/records/{done['id']}").json()["data"]
    assert rec["kind"] == "completion" and rec["prompt"] == "One, two," and rec["answer"] == done["choices"][0]["text"]
    assert rec["messages"] is None
    batch = http.post("/v1/completions", json={"prompt": ["Red, green,", "Up, down,"], "max_tokens": 3,
                                                "temperature": 0}).json()
    recs = sorted(http.get(f"/v1/records/{batch['id']}").json()["data"], key=lambda r: r["index"])
    assert [(r["index"], r["prompt"], r["answer"]) for r in recs] == [
        (0, "Red, green,", batch["choices"][0]["text"]), (1, "Up, down,", batch["choices"][1]["text"])]
    assert recs[0]["prompt_tokens"] != recs[1]["prompt_tokens"]
    resp = http.post("/v1/responses", json={"input": "One, two,", "max_output_tokens": 3, "temperature": 0}).json()
    (rec,) = http.get(f"/v1/records/{resp['id']}").json()["data"]
    assert rec["kind"] == "chat" and rec["answer"] == resp["output"][0]["content"][0]["text"]
    assert rec["messages"] == [{"role": "user", "content": "One, two,"}]
    ids = http.post("/v1/completions", json={"prompt": [[1, 2, 3]], "max_tokens": 2}).json()
    (rec,) = http.get(f"/v1/records/{ids['id']}").json()["data"]
    assert rec["prompt"] is None and rec["prompt_tokens"] == [1, 2, 3]
    private = ask(http, "Keep this to yourself.", store=False)
    assert http.get(f"/v1/records/{private['id']}").status_code == 404
    private = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Shh."}],
                                                      "max_tokens": 4, "stream": True, "store": False})
    rid = json.loads(next(line for line in private.text.splitlines() if line.startswith("data: {"))[6:])["id"]
    assert http.get(f"/v1/records/{rid}").status_code == 404


def test_delete_and_scoped_keys(server, http):
    mine = ask(http, "A record to delete.")["id"]
    assert http.delete(f"/v1/records/{mine}").json() == {"id": mine, "deleted": 1}
    assert http.get(f"/v1/records/{mine}").status_code == 404
    assert http.delete(f"/v1/records/{mine}").status_code == 404
    theirs = ask(http, "The admin's question.")["id"]          # answered by the base: no scoped key sees it
    with httpx.Client(base_url=server.url, timeout=600,
                      headers={**JSON, "Authorization": "Bearer alice-key"}) as alice:
        r = alice.get(f"/v1/records/{theirs}")
        assert r.status_code == 404 and r.json()["error"]["param"] == "id"
        assert alice.delete(f"/v1/records/{theirs}").status_code == 404
        assert alice.get("/v1/records").json()["data"] == []
        assert alice.get("/v1/records", params={"adapter": "bob"}).status_code == 404
        assert alice.post("/v1/feedback", json={"id": theirs, "rating": 1}).status_code == 404
        assert alice.delete("/adapters/bob/records").status_code == 404
        assert alice.delete("/adapters/alice/records").json() == {"adapter": "alice", "deleted": 0}
    with httpx.Client(base_url=server.url, timeout=600,
                      headers={**JSON, "Authorization": "Bearer chat-key"}) as chat:
        r = chat.post("/v1/feedback", json={"id": theirs, "rating": 1})
        assert r.status_code == 403
    assert http.get(f"/v1/records/{theirs}").status_code == 200
    n = len(http.get("/v1/records", params={"adapter": "base", "limit": "1000"}).json()["data"])
    assert http.delete("/adapters/learned/records").json()["deleted"] == 0     # base records are not "learned"'s
    assert http.get("/v1/records", params={"limit": "x"}).json()["error"]["param"] == "limit"
    assert n >= 1


def test_recording_off_answers_503_and_store_false_is_accepted(tmp_path):
    with BackgroundServer(ServerSettings(ctx=512, parallel=1, threads=1, state_dir=str(tmp_path))) as srv:
        with httpx.Client(base_url=srv.url, timeout=600, headers=JSON) as c:
            got = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 2, "store": True})
            assert got.status_code == 200 and "X-Dreamstage-Ignored-Fields" not in got.headers   # a field we read
            r = c.get(f"/v1/records/{got.json()['id']}")
            assert r.status_code == 503 and r.json()["error"]["code"] == "recording_off"
            assert c.post("/v1/feedback", json={"id": got.json()["id"], "rating": 1}).status_code == 503
    with pytest.raises(ValueError, match="record needs a state directory"):
        ServerSettings(record=True)
    with pytest.raises(ValueError, match="learn needs --record"):
        ServerSettings(state_dir=str(tmp_path), learn="auto")
