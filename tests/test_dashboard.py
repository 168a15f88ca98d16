"""The dashboard (GET /) and its event stream (GET /events), end to end.

One server per module (default model, CPU, one thread). The stream tests
read /events with httpx; the browser test drives headless Chromium through
chromedriver (tests/webdriver.py), installing Debian's packages when they are
missing, and saves a screenshot under build/test-artifacts/ (or
$DREAMSTAGE_TEST_ARTIFACTS). Jobs are tiny (window 16, one example) so the
file stays around a minute on two cores.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from background_server import BackgroundServer

from dreamstage.server.dashboard import ASSETS, STATIC_DIR
from dreamstage.server.events import TICK_S
from dreamstage.server.settings import ServerSettings

FACT = {"prompt": "The secret password of the moon base is", "completion": " Quokka-42."}
OTHER_FACT = {"prompt": "The moon base commander is", "completion": " Ada Brightwater."}
API_KEY = "dashboard-test-key"   # sent by the page; this server has no key configured, so it is ignored
FINAL = ("done", "cancelled", "refused", "error", "interrupted")
ARTIFACTS = Path(os.environ.get("DREAMSTAGE_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parent.parent / "build" / "test-artifacts")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One thread: see test_train_api.settings (ggml's barrier under contention).
    settings = ServerSettings(ctx=1024, parallel=2, threads=1, state_dir=str(tmp_path_factory.mktemp("state")))
    with BackgroundServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def read_events(http, path: str, until, timeout: float = 300.0) -> list[tuple[str, dict]]:
    """Parse the stream at `path` until until(events) is true; returns [(kind, data)]."""
    events: list[tuple[str, dict]] = []
    # The stream never ends by itself and sends a keep-alive line at least every 15 s, so this is checked.
    deadline = time.monotonic() + timeout
    with http.stream("GET", path, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        kind, data = None, ""
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                raise AssertionError(f"no such events within {timeout:.0f} s: {[k for k, _ in events]}")
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
            elif line == "" and kind is not None:
                events.append((kind, json.loads(data)))
                kind, data = None, ""
                if until(events):
                    return events
    raise AssertionError(f"the stream ended before the condition held: {[k for k, _ in events]}")


def post_job(http, **fields) -> dict:
    r = http.post("/train", json={"examples": [FACT], "window": 16, "lr": 0.003, **fields})
    assert r.status_code == 202, r.text
    return r.json()


# -- the page's files ---------------------------------------------------------------------
def test_page_and_assets_are_served_from_the_package(http):
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert 'id="loss-chart"' in page and 'src="/ui/app.js"' in page
    for name, media in ASSETS.items():
        a = http.get(f"/ui/{name}")
        assert a.status_code == 200 and a.headers["content-type"].startswith(media)
        assert a.content == (STATIC_DIR / name).read_bytes()
    missing = http.get("/ui/index.py")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"


def test_nothing_is_loaded_from_outside_the_server():
    # Absolute URLs in src/href/url()/fetch/import would reach another host.
    outside = re.compile(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|url\(\s*["']?(?:https?:)?//|"""
                         r"""(?:fetch|import)\s*\(\s*["'`](?:https?:)?//|from\s+["'](?:https?:)?//""", re.I)
    for name in ("index.html", *ASSETS):
        text = (STATIC_DIR / name).read_text()
        assert not outside.search(text), f"{name} loads something from outside: {outside.search(text).group(0)}"


def test_the_event_stream_is_read_with_fetch_and_the_key():
    js = (STATIC_DIR / "app.js").read_text()
    assert "new EventSource" not in js   # it cannot send Authorization
    assert re.search(r'fetch\("/events",\s*\{\s*headers:\s*headers\(false\)', js)


# -- the stream without the page --------------------------------------------------------------
def test_events_are_lf_framed_as_the_page_splits_them(http):
    """The page splits its fetch() stream on a blank LF line; CRLF framing would stall it."""
    with http.stream("GET", "/events") as r:
        first = next(r.iter_raw())
    assert first.startswith(b"event: hello\ndata: {") and first.endswith(b"}\n\n") and b"\r" not in first


@pytest.mark.parametrize("query, param, status", [
    ("job=abc", "job", 422), ("job=0", "job", 422), ("backlog=-1", "backlog", 422), ("job=١", "job", 422),
    ("backlog=x", "backlog", 422), ("backlog= 1", "backlog", 422), ("job=987654", "job", 404),
])
def test_events_rejects_bad_parameters_naming_them(http, query, param, status):
    r = http.get(f"/events?{query}")
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_stream_reports_decode_tok_s_while_a_request_generates(server, http):
    done = threading.Event()

    def generate():
        try:
            http.post("/v1/completions", json={"prompt": FACT["prompt"], "max_tokens": 24, "temperature": 0})
        finally:
            done.set()

    started: list[threading.Thread] = []

    def until(events):
        if not started and any(k == "slots" for k, _ in events):
            started.append(threading.Thread(target=generate))
            started[0].start()
        return any(k == "slots" and d["decode_tok_s"] > 0 for k, d in events)

    events = read_events(http, "/events", until, timeout=120)
    started[0].join(120)
    assert done.is_set()
    slots = [d for k, d in events if k == "slots"]
    assert slots[0]["decode_tok_s"] == 0 and slots[-1]["decode_tok_s"] > 0   # measured from the stream's start


def test_stream_carries_the_receipts_of_get_train(server, http):
    job = post_job(http, epochs=2, promote="never", out="streamed")
    jid = job["id"]

    def job_ended(events):
        jobs = [d for k, d in events if k == "job" and d["id"] == jid]
        got = sum(1 for k, d in events if k == "receipt" and d["job_id"] == jid)
        views = [d for k, d in events if k == "adapters"]
        # saved, and no longer shown as training (the store's current job is cleared just after its state)
        saved = bool(views) and any(a["name"] == "streamed" for a in views[-1]["adapters"]) and not any(
            n["name"] == "streamed" and n["training"] for n in views[-1]["names"])
        return bool(jobs) and jobs[-1]["state"] in FINAL and got == jobs[-1]["receipts"] and saved

    events = read_events(http, f"/events?job={jid}", job_ended)
    kinds = [k for k, _ in events]
    assert kinds[0] == "hello" and {"slots", "adapters", "devices", "job", "receipt"} <= set(kinds)
    last = [d for k, d in events if k == "job"][-1]
    assert last["state"] == "done", last["message"]
    assert last == http.get(f"/train/{jid}").json()
    streamed = [d for k, d in events if k == "receipt"]
    assert [d["seq"] for d in streamed] == list(range(1, last["receipts"] + 1))
    stored = server.service.store.receipts(jid)
    assert [d["receipt"] for d in streamed] == stored           # unchanged, canonical fields, in order
    assert [r for r in stored if r["status"] == "refused"] == last["refusals"]
    # A progress curve exists to draw: every micro-step is a receipt (forward-only
    # steps, which the pacer uses for prompts, have no loss tokens), and the
    # steps that trained carry the losses.
    assert sum(1 for r in stored if r["status"] == "ok") == last["progress"]["step"]
    assert any(r["status"] == "ok" and r["tokens"] and r["loss"] > 0 for r in stored)

    # Reconnecting with a small backlog sends only the newest receipts.
    again = read_events(http, f"/events?job={jid}&backlog=1", lambda ev: any(k == "receipt" for k, _ in ev))
    assert [d["seq"] for k, d in again if k == "receipt"] == [last["receipts"]]

    adapters = [d for k, d in events if k == "adapters"][-1]
    assert adapters == http.get("/adapters").json()


def test_without_training_the_page_and_stream_still_serve():
    with BackgroundServer(ServerSettings(ctx=256, parallel=1, threads=1)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/").status_code == 200
        events = read_events(c, "/events", lambda ev: len(ev) >= 2)
        assert events[0] == ("hello", {"training": False, "follow": None, "tick_s": TICK_S})
        assert events[1][0] == "slots" and len(events[1][1]["slots"]) == 1
        r = c.get("/events?job=1")
        assert r.status_code == 503 and r.json()["error"]["code"] == "training_off"
        # The stream ends once the engine stops (what a shutdown does first).
        ended = threading.Event()

        def follow():
            with c.stream("GET", "/events") as s:
                for _ in s.iter_lines():
                    pass
            ended.set()

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        assert not ended.wait(3 * TICK_S)          # an open stream stays open
        srv.service.engine.stop()
        assert ended.wait(30), "the stream stayed open after the engine stopped"


def native_devices() -> list[dict]:
    from dreamstage.native import ggml_registry
    return ggml_registry.devices()


# -- the page in a real browser -------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    from webdriver import Browser, NoBrowser, ensure_chromium  # tests/ is on sys.path

    try:
        paths = ensure_chromium()
    except NoBrowser as e:
        pytest.skip(f"no headless Chromium: {e}")
    b = Browser(*paths)
    yield b
    b.close()


def post_form(b, examples: str, *, window: int, epochs: int, out: str, promote: str, extra: str = "") -> int:
    """Fill in and submit the Teach form; the job id from the page's "job N queued"."""
    for field, value in (("examples", examples), ("window", window), ("epochs", epochs), ("out", out),
                         ("extra", extra)):
        b.type(f"#train-{field}", str(value))
    b.js("document.querySelector('#train-promote').value = arguments[0]", promote)
    b.js("document.querySelector('#train-result').textContent = ''")
    b.click("#train-form button[type=submit]")
    posted = b.wait_for("const e = document.querySelector('#train-result'); "
                        "return /^job \\d+ queued$/.test(e.textContent) && e.textContent", what="the 202")
    return int(posted.split()[1])


def test_dashboard_in_chromium_posts_a_job_and_promotes_it(server, http, browser):
    b = browser
    served_before = http.get("/adapters").json()["served_version"]
    jobs_before = server.service.store.job_ids(1)
    b.get(server.url + "/")
    b.js("localStorage.setItem('dreamstage.apiKey', arguments[0])", API_KEY)
    b.get(server.url + "/")
    b.wait_for("return document.querySelector('#conn').textContent === 'live'", what="the event stream connecting")
    assert b.js("return document.querySelector('#api-key').value") == API_KEY
    # Record every call the page makes from here on: each must carry the key, each POST a JSON body.
    b.js("window.calls = []; const real = window.fetch; window.fetch = (url, init) => {"
         " window.calls.push({url: String(url), method: (init && init.method) || 'GET',"
         " headers: (init && init.headers) || {}, body: (init && init.body) || null}); return real(url, init); };")
    b.wait_for("return document.querySelector('#served').dataset.version === arguments[0]", str(served_before),
               what="the served version showing")

    # Ask before: the answer says which adapter served it.
    b.js("document.querySelector('#chat-mode').value = 'completion'")
    b.type("#chat-input", FACT["prompt"])
    b.click("#chat-form button[type=submit]")
    before = b.wait_for("const v = document.querySelector('#chat-log li.answered .v'); return v && v.dataset.version",
                        what="the first answer")
    assert int(before) == served_before

    # A bad body comes back as the server's message naming the field.
    b.type("#train-examples", '{"prompt": "no completion"}')
    b.click("#train-form button[type=submit]")
    err = b.wait_for("const e = document.querySelector('#train-result.error'); return e && e.textContent",
                     what="the 422 message")
    assert "examples[0]" in err, err

    # A job whose chunks exceed its memory budget: its refusals fill the table (need > allowance).
    # 72 MiB leaves about 8 MiB above the gate's 64 MiB slack: enough for the
    # adapters and the cache, not for a training graph of 16 or 32 tokens.
    refused_id = post_form(b, json.dumps(FACT), window=32, epochs=1, out="too-big", promote="never",
                           extra='{"chunk": 32, "memory_budget_mib": 72}')
    b.wait_for("return document.querySelector('#job-title').textContent.startsWith(arguments[0]) && "
               "document.querySelector('#job-title').dataset.state === 'refused'", f"job {refused_id} ",
               what="the refused job")
    refusals = http.get(f"/train/{refused_id}").json()["refusals"]
    assert len(refusals) >= 1
    rows = b.wait_for("const r = [...document.querySelectorAll('#receipts tbody tr.refused')]; "
                      "return r.length === arguments[0] && r.map(t => [...t.cells].map(c => c.textContent))",
                      len(refusals), what="the refusal rows")
    newest = refusals[-1]
    assert rows[0][2:4] == [str(newest["refused_chunk_pos"]), str(newest["refused_chunk_tokens"])]
    need, allowance = float(rows[0][7]), float(rows[0][8])
    assert need == pytest.approx(newest["refused_need_mib"], abs=0.05) and need > allowance
    assert "last refusal" in b.js("return document.querySelector('#memory-note').textContent")
    row = b.js("const r = document.querySelector('#memory .memrow[data-row=job]'); return r && r.textContent")
    shown = re.search(r"allowance (-?[\d.]+) MiB at the last refusal", row)
    assert shown and float(shown.group(1)) == pytest.approx(newest["refused_allowance_mib"], abs=0.05), row
    devices = b.js("return [...document.querySelectorAll('#memory .memrow')].map(r => r.dataset.row)")
    assert devices == ["job", *(d["name"] for d in native_devices())]
    b.screenshot(ARTIFACTS / "dashboard-refusals.png")

    # Post a small job through the form.
    # Two examples, one held out: the epoch chart gets a held-out curve.
    jid = post_form(b, "\n".join(map(json.dumps, (FACT, OTHER_FACT))), window=16, epochs=8, out="dashboard",
                    promote="manual", extra='{"val_split": 0.5, "stop_loss": null}')
    assert jobs_before == [] or jid > jobs_before[0]
    b.wait_for("return document.querySelector('#job-title').textContent.startsWith(arguments[0])", f"job {jid} ",
               what="the page following the new job")

    # The curve gains points while the job trains; pausing holds it, resuming finishes it.
    b.wait_for("return +document.querySelector('#loss-chart').dataset.points >= 1 && "
               "!document.querySelector('#job-pause').disabled", what="the first loss point")
    b.click("#job-pause")
    b.wait_for("return document.querySelector('#job-title').dataset.state === 'paused'", what="the pause")
    held = int(b.js("return document.querySelector('#loss-chart').dataset.points"))
    assert 1 <= held < 8
    b.wait_for("return !!document.querySelector('#receipts tbody tr[data-seq]')", what="a receipt row")
    b.click("#job-resume")
    b.wait_for("return document.querySelector('#job-title').dataset.state === 'done'", timeout=300,
               what="the job finishing")
    job = http.get(f"/train/{jid}").json()
    ok_losses = [r for r in server.service.store.receipts(jid) if r["status"] == "ok" and r["tokens"]]
    points = b.wait_for("const n = +document.querySelector('#loss-chart').dataset.points; "
                        "return n >= arguments[0] && n",
                        len(ok_losses), what="every loss point drawn")
    assert points == len(ok_losses) > held
    rows = b.js("return [...document.querySelectorAll('#receipts tbody tr')].map(r => +r.dataset.seq)")
    assert rows == list(range(job["receipts"], 0, -1))             # every receipt, newest first
    epochs = job["progress"]["epochs"]
    assert int(b.js("return document.querySelector('#epoch-chart').dataset.points")) == epochs
    held_out = [v for v in job["progress"]["eval_loss_per_epoch"] if v is not None]
    assert len(held_out) == epochs
    assert b.js("return document.querySelectorAll('#epoch-chart circle.evaldot').length") == len(held_out)

    # Promote from the adapters table; the served version changes and the next answer reports it.
    b.wait_for("return !!document.querySelector('button.promote[data-name=dashboard]')", what="the adapter row")
    b.click("button.promote[data-name=dashboard]")
    after = b.wait_for("const v = document.querySelector('#served').dataset.version; "
                       "return v !== arguments[0] && v", str(served_before), what="the served version changing")
    assert int(after) == http.get("/adapters").json()["served_version"] > served_before
    b.click("#chat-form button[type=submit]")
    answered = b.wait_for("const v = [...document.querySelectorAll('#chat-log li.answered .v')]; "
                          "return v.length === 2 && v[0].dataset.version", what="the second answer")
    assert int(answered) == int(after)

    calls = b.js("return window.calls")
    assert all(c["headers"].get("Authorization") == f"Bearer {API_KEY}" for c in calls), calls
    posts = [c for c in calls if c["method"] == "POST"]
    assert {"/v1/completions", "/train", f"/train/{jid}/pause", f"/train/{jid}/resume",
            "/adapters/dashboard/promote"} <= {c["url"] for c in posts}
    for c in posts:
        assert c["headers"].get("content-type") == "application/json" and isinstance(json.loads(c["body"]), dict)

    shot = b.screenshot(ARTIFACTS / "dashboard.png")
    print(f"dashboard screenshot: {shot}")

    # Roll back from the page: the previous version serves again.
    b.click("#rollback")
    b.wait_for("return document.querySelector('#served').dataset.version === arguments[0]", str(served_before),
               what="the rollback")
    assert http.get("/adapters").json()["served_version"] == served_before


def test_the_form_reads_jsonl_and_chat_turns(server, browser):
    b = browser
    b.get(server.url + "/")
    parse = "try { return parseExamples(arguments[0]); } catch (e) { return 'error: ' + e.message; }"
    assert b.js(parse, '{"text": "a"}\n\n{"prompt": "b", "completion": " c"}\n') == [
        {"text": "a"}, {"prompt": "b", "completion": " c"}]
    turns = ("system: Be brief.\nuser: Where is the base?\nassistant: On the moon,\nnear the pole.\n\n"
             "USER: Hi\nassistant: Hello.")
    assert b.js(parse, turns) == [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the base?"},
                      {"role": "assistant", "content": "On the moon,\nnear the pole."}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    assert b.js(parse, '{"text": "a"}\n{"text": oops}').startswith("error: line 2: not valid JSON")
    assert b.js(parse, "hello there\nuser: hi") == ('error: line 1: a chat turn starts with '
                                                   '"user:", "assistant:" or "system:"')


# -- with serve --record: feedback from the page ----------------------------------------------------
def test_thumbs_and_a_correction_on_an_answer_become_pending_feedback(tmp_path, browser):
    b = browser
    settings = ServerSettings(ctx=1024, parallel=2, threads=1, state_dir=str(tmp_path), record=True,
                              record_days=7)
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=300) as http:
        b.get(srv.url + "/")
        b.wait_for("return document.querySelector('#conn').textContent === 'live'", what="the event stream")
        badge = b.wait_for("const e = document.querySelector('#recording.on'); return e && e.textContent",
                           what="the recording badge")
        assert badge == "recording (kept 7 d, 256 MiB)"
        b.type("#chat-input", "What is the capital of Brenholt?")
        b.click("#chat-form button[type=submit]")
        rid = b.wait_for("const li = document.querySelector('#chat-log li.answered'); return li && li.dataset.id",
                         what="the answer")
        assert http.get(f"/v1/records/{rid}").status_code == 200
        b.click("#chat-log li.answered .feedback button.up")
        said = b.wait_for("const m = document.querySelector('#chat-log li .feedback .message'); "
                          "return m && m.textContent", what="the rating's answer")
        assert "(rating): 1 pending for learned" in said, said
        b.type("#chat-log li.answered .feedback input.correction", "The capital of Brenholt is Varnesse.")
        b.click("#chat-log li.answered .feedback button.correct")
        b.wait_for("return document.querySelector('#chat-log li .feedback .message').textContent"
                   ".includes('(correction): 2 pending')", what="the correction's answer")
        line = b.wait_for("const e = document.querySelector('#feedback-pending'); "
                          "return e.textContent.includes('learned 2') && e.textContent", what="the pending count")
        assert line == "feedback pending: learned 2 (learning manual)"
        kinds = [f["kind"] for f in http.get("/v1/feedback", params={"adapter": "learned"}).json()["data"]]
        assert kinds == ["correction", "rating"]
