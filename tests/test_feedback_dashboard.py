"""The dashboard with `serve --record`: it says recording is on, puts thumbs and a correction box under the
"Ask it" answers, and shows the pending feedback per adapter (headless Chromium, tests/webdriver.py)."""
from __future__ import annotations

import httpx
import pytest
from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings


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
