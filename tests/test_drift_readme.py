"""The README's one-fact job on a live server with the drift guard on."""

import time

from dreamstage.training.drift.anchors import load_anchors
from dreamstage.training.jobs.store import TERMINAL


def test_the_readme_walkthrough_is_promoted_by_a_live_server_with_the_guard_on(tmp_path):
    """The README's one-fact job over HTTP, the drift guard on as a user runs it
    (every other test server runs with it off): the job rehearses although its
    window is 32, its drift is measured on the held-out anchors, reported in
    GET /train/{id} and /metrics, and the adapter is promoted within the default
    bounds, so the walkthrough answers with the fact."""
    import httpx
    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings

    prompt = "The secret password of the moon base is"
    settings = ServerSettings(ctx=1024, parallel=2, threads=1, state_dir=str(tmp_path), drift_guard=True)
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600,
                                                          headers={"Content-Type": "application/json"}) as http:
        r = http.post("/train", json={"examples": [{"prompt": prompt, "completion": " Quokka-42."}], "window": 32,
                                      "epochs": 10, "promote": "auto", "out": "moon"})
        assert r.status_code == 202, r.text
        jid = r.json()["id"]
        deadline = time.monotonic() + 600
        while (job := http.get(f"/train/{jid}").json())["state"] not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
        drift = job["progress"]["drift"]
        print(f"\nREADME job: {job['message']}")
        assert job["state"] == "done" and drift["final"] and drift["anchors"] == len(load_anchors())
        assert (drift["max_drift"], drift["max_drift_kl"]) == (1.0, 1.0) and drift["drift_kl"] <= 1.0
        # window 32 holds no rehearsal prompt; the trainer's wider window does (rehearsal_window): the
        # job rehearses and consolidates (it drifted 0.11 nats where it drifted 0.50 without)
        assert "no rehearsal" not in job["message"] and "rehearsal-only epochs" in job["message"], job["message"]
        assert drift["drift_kl"] < 0.3
        assert job["adapter"]["promoted"] and "within max_drift 1, max_drift_kl 1" in job["message"]
        out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
        assert "Quokka-42" in out["choices"][0]["text"] and out["adapter_version"] == 1
        metrics = http.get("/metrics").text
        assert f'dreamstage_dream_drift_kl{{job="{jid}"}}' in metrics
