"""POST /train and /adapters end to end: the default model, the native Trainer, CPU.

One server per module on a temporary state directory; the restart test
builds its own pair. Jobs use small windows, chunks and ranks so the whole
file stays within a few minutes on two cores.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from dreamstage.server.service import BackgroundServer
from dreamstage.server.settings import ServerSettings

FACT_PROMPT = "The secret password of the moon base is"
FACT = " Quokka-42."


def settings(state_dir, **kw) -> ServerSettings:
    base = dict(ctx=1024, parallel=2, threads=2, state_dir=str(state_dir))
    base.update(kw)
    return ServerSettings(**base)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with BackgroundServer(settings(tmp_path_factory.mktemp("state"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


def wait_job(http, jid, pred, timeout=300.0, what="the job"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/train/{jid}").json()
        if pred(job):
            return job
        time.sleep(0.1)
    raise AssertionError(f"{what} never got there: {job['state']} {job['progress']} {job['message']}")


def finished(job):
    return job["state"] in ("done", "cancelled", "refused", "error", "interrupted")


def complete(http, prompt, max_tokens=8):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


# -- validation -----------------------------------------------------------------------
BAD_BODIES = [
    ({}, "body", "text or a non-empty examples list"),
    ({"text": "hello there", "windw": 64}, "windw", "unknown field"),
    ({"text": "hello there", "context_cache_type": "q5_k"}, "context_cache_type", "'q5_k'"),
    ({"text": 5}, "text", ""),
    ({"text": "hello there", "window": "64"}, "window", ""),
    ({"text": "hello there", "window": 64, "chunk": 128}, "chunk", "larger than window"),
    ({"text": "hello there", "share": 0.2, "max_slowdown": 0.1}, "max_slowdown", "exclusive"),
    ({"text": "hello there", "out": "../escape"}, "out", "bare adapter name"),
    ({"text": "hello there", "promote": "sometimes"}, "promote", ""),
    ({"text": "hello there", "exact": True}, "exact", "not supported"),
    ({"examples": [{"prompt": "a"}]}, "examples[0]", "completion"),
    ({"examples": [{"colour": "blue"}]}, "examples[0]", "one of"),
    ({"examples": [{"messages": [{"role": "user", "content": "hi"}]}]}, "examples[0]", "no trained assistant"),
    ({"examples": [{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}]},
     "examples[0]", "wizard"),
]


@pytest.mark.parametrize("body,param,says", BAD_BODIES, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_BODIES)])
def test_malformed_bodies_get_422_naming_the_field(http, body, param, says):
    before = len(http.get("/train").json()["queue"])
    r = http.post("/train", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert says in err["message"], err
    assert len(http.get("/train").json()["queue"]) == before


def test_an_unknown_context_cache_type_is_named_in_the_422(http):
    r = http.post("/train", json={"text": "hello there", "context_cache_type": "q3_k_m"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "context_cache_type" and "q3_k_m" in err["message"] and "q8_0" in err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'"text"'])
def test_a_body_that_is_not_a_json_object_is_422_on_body(http, raw):
    r = http.post("/train", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"


def test_unknown_ids_are_404_and_invalid_transitions_409(http):
    assert http.get("/train/999999").status_code == 404
    assert http.get("/train/abc").status_code == 404
    for action in ("cancel", "pause", "resume"):
        assert http.post(f"/train/999999/{action}").status_code == 404
    r = http.post("/train", json={"text": "A short lesson to cancel.", "window": 32, "chunk": 32, "epochs": 1000,
                                  "promote": "never"})
    assert r.status_code == 202
    job = r.json()
    assert job["state"] == "queued" and r.headers["location"] == f"/train/{job['id']}"
    for k, v in {"context_cache_type": "q8_0", "chunk": 32, "window": 32, "recompute": False, "exact": False}.items():
        assert job[k] == v
    assert http.post(f"/train/{job['id']}/cancel").json()["state"] == "cancelled"
    for action in ("resume", "pause", "cancel"):
        r = http.post(f"/train/{job['id']}/{action}")
        assert r.status_code == 409 and "cancelled" in r.json()["error"]["message"]


def test_adapter_routes_refuse_what_does_not_exist(http):
    r = http.post("/adapters/no-such-adapter/promote")
    assert r.status_code == 404 and "no-such-adapter" in r.json()["error"]["message"]
    assert http.post("/adapters/..bad/promote").status_code == 422
    r = http.post("/adapters/x/promote", json={"version": "1"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "version"
    r = http.post("/adapters/x/promote", json={"versoin": 1})
    assert r.status_code == 422 and r.json()["error"]["param"] == "versoin"
    listing = http.get("/adapters").json()
    if listing["served_version"] == 0:
        r = http.post("/adapters/rollback")
        assert r.status_code == 409 and "base model" in r.json()["error"]["message"]
