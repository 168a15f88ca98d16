"""POST /train and /adapters end to end: the default model, the native Trainer, CPU.

One server per module on a temporary state directory; the restart test
builds its own pair. Jobs use small windows, chunks and ranks so the whole
file stays within a few minutes on two cores.
"""
from __future__ import annotations

import io
import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings
from dreamstage.training.walk.examples import held_out_sources
from dreamstage.training.walk.receipts import RECEIPT_FIELDS

FACT_PROMPT = "The secret password of the moon base is"
FACT = " Quokka-42."


def settings(state_dir, **kw) -> ServerSettings:
    # One thread: the test's own HTTP threads share the two cores, and ggml's
    # spinning barrier collapses under contention (measured here at load 5: a
    # streaming test took 115 s with two threads, 11 s with one).
    base = dict(ctx=1024, parallel=2, threads=1, state_dir=str(state_dir))
    base.update(kw)
    return ServerSettings(**base)


# Body-less POSTs (cancel, pause, promote, rollback) must say application/json
# or carry the API key: the server's guard against cross-site writes
# (tests/test_security.py checks the refusal).
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with BackgroundServer(settings(tmp_path_factory.mktemp("state"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600, headers=JSON) as c:
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
    ({"text": "hello there", "horizon": 8}, "horizon", "exact=true"),
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


def test_unknown_ids_are_404_malformed_ids_422_and_invalid_transitions_409(http):
    assert http.get("/train/999999").status_code == 404
    assert http.get("/train/abc").status_code == 422          # not an id at all: the parameter is invalid
    for action in ("cancel", "pause", "resume"):
        assert http.post(f"/train/999999/{action}").status_code == 404
    r = http.post("/train", json={"text": "A short lesson to cancel.", "window": 32, "chunk": 32, "epochs": 1000,
                                  "stop_loss": None, "promote": "never"})
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


# -- training while serving (the native Trainer) ------------------------------------------
LESSON = ("Dreamstage keeps one model resident. Between decode batches it trains a small adapter "
          "on what users post to the train route, and serving never stops. ")


def stream_chat(url, content, out, i):
    pieces, finish = [], None
    with httpx.Client(base_url=url, timeout=600, headers=JSON) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0,
                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                ch = obj["choices"][0] if obj.get("choices") else {}
                pieces.append((ch.get("delta") or {}).get("content") or "")
                finish = ch.get("finish_reason") or finish
    out[i] = ("".join(pieces), finish)


def test_two_chat_streams_finish_while_a_job_trains(server, http):
    r = http.post("/train", json={"text": LESSON * 2, "window": 32, "chunk": 16, "epochs": 1000, "rank": 4,
                                  "share": 0.5, "stop_loss": None, "promote": "never"})
    assert r.status_code == 202, r.text
    jid = r.json()["id"]
    wait_job(http, jid, lambda j: j["state"] == "running" and j["progress"]["step"] >= 1)
    out = [None, None]
    threads = [threading.Thread(target=stream_chat, args=(server.url, q, out, i))
               for i, q in enumerate(["Name three colours.", "What is two plus two?"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for text, finish in out:
        assert text.strip() and finish in ("stop", "length")
    # the pacer let micro-steps run between the streams' decode batches
    job = wait_job(http, jid, lambda j: (j["pacing"] or {}).get("decode_batches_with", 0) >= 1, timeout=30,
                   what="a micro-step between decode batches")
    f = job["pacing"]
    assert f["micro_step_ms_p50"] > 0 and f["micro_step_ms_max"] >= f["micro_step_ms_p95"] >= f["micro_step_ms_p50"]
    assert job["memory"]["context_mib"] > 0 and job["memory"]["graph_mib"] > 0
    assert http.post(f"/train/{jid}/pause").json()["state"] == "paused"
    assert http.post(f"/train/{jid}/resume").json()["state"] == "running"
    assert http.post(f"/train/{jid}/cancel").json()["state"] == "cancelled"


def scrape(http) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value}."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_report_the_dream_stage(http):
    # nothing else training (the store says so, and the scheduler has let go of
    # the last job, in-flight step included): the counters then move by this job alone
    deadline = time.monotonic() + 300
    while (view := http.get("/train").json())["current"] is not None or view["queue"] \
            or scrape(http)["dreamstage_dream_active_job"] != 0:
        assert time.monotonic() < deadline, "an earlier job never ended"
        time.sleep(0.1)
    before = scrape(http)
    assert http.post("/train", json={"text": LESSON, "windw": 32}).status_code == 422
    r = http.post("/train", json={"text": LESSON, "window": 32, "chunk": 16, "rank": 4, "promote": "never",
                                  "epochs": 1, "max_pause_ms": 0})
    job = wait_job(http, r.json()["id"], finished)
    assert job["state"] == "done", job["message"]
    after = scrape(http)
    p = job["progress"]

    def moved(key):
        return after[key] - before.get(key, 0.0)

    assert moved('dreamstage_dream_steps_total{status="ok"}') == p["step"] > 0
    assert moved("dreamstage_dream_tokens_total") == p["walked"]
    assert moved("dreamstage_dream_loss_tokens_total") == p["tokens"]
    assert moved("dreamstage_dream_step_seconds_count") == p["step"]
    assert moved("dreamstage_dream_step_seconds_sum") == pytest.approx(p["train_ms"] / 1000.0)
    assert moved("dreamstage_dream_pause_seconds_count") >= p["step"]
    assert after["dreamstage_dream_train_tokens_per_second"] == pytest.approx(p["train_tok_s"])
    assert 0 < after["dreamstage_dream_loss"] < 20
    for part in ("graph", "context", "adapter", "optimizer", "walk"):
        assert after[f'dreamstage_dream_memory_mib{{part="{part}"}}'] == job["memory"][f"{part}_mib"]
    assert moved('dreamstage_train_submissions_refused_total{code="invalid_value"}') == 1
    assert after["dreamstage_adapter_version"] == http.get("/health").json()["adapter_version"]
    assert after["dreamstage_dream_active_job"] in (0, job["id"])
    # the scheduler lets go of a finished job once its trainer is closed, soon after the state says done
    while scrape(http)["dreamstage_dream_active_job"] != 0:
        assert time.monotonic() < deadline + 60, "the finished job stayed active"
        time.sleep(0.05)


def test_a_tiny_memory_budget_walks_the_chunk_ladder_and_serving_keeps_answering(http):
    # max_pause_ms 0: no pause bound, so every step asks for the job's own chunk and the memory ladder decides
    body = {"text": LESSON * 3, "window": 64, "chunk": 64, "min_chunk": 16, "rank": 4, "promote": "never",
            "epochs": 1, "max_pause_ms": 0}
    # the 64 MiB slack, the job's 2.5 MiB (cache and adapters), and 2 MiB: below
    # what even chunk 16's graph plans (graphs hold only the target rows'
    # logits since issues 8 and 9, so the former 84 MiB fitted chunk 16)
    tight = 68.5
    r = http.post("/train", json={**body, "memory_budget_mib": tight})
    assert r.status_code == 202
    job = wait_job(http, r.json()["id"], finished)
    assert job["state"] == "refused", job["message"]
    refusals = job["refusals"]
    assert [x["chunk"] for x in refusals] == [64, 32, 16], (job["message"], refusals)
    for x in refusals:
        assert 0 < x["refused_chunk_tokens"] <= x["chunk"]
        assert set(RECEIPT_FIELDS) <= set(x) and x["status"] == "refused"
        assert x["refused_chunk_pos"] == 0 and x["refused_need_mib"] > x["refused_allowance_mib"] > 0
        assert x["message"]
    assert "floor" in job["message"] and job["progress"]["refusals"] == 3
    assert complete(http, "The capital of France is")["choices"][0]["text"].strip()
    # a budget between the needs of chunk 64 and chunk 32: one refusal, then the job trains at 32
    need = {x["chunk"]: x["refused_need_mib"] for x in refusals}
    budget = tight + (need[64] + need[32]) / 2 - refusals[0]["refused_allowance_mib"]
    r = http.post("/train", json={**body, "memory_budget_mib": budget})
    job = wait_job(http, r.json()["id"], finished)
    assert job["state"] == "done", job["message"]
    assert [x["chunk"] for x in job["refusals"]] == [64]
    assert job["progress"]["current_chunk"] == 32 and job["progress"]["step"] >= 2


def test_an_exact_job_reports_its_horizon_pass_and_walk_memory(server, http):
    """exact, horizon and recompute travel from the body to the native step; the job's
    state reports the horizon in use, the last pass and walk_mib."""
    # max_pause_ms 0: every step asks for the job's own chunk, so the walk's shape is known
    body = {"text": LESSON * 2, "window": 64, "chunk": 16, "rank": 4, "promote": "never", "epochs": 1,
            "exact": True, "horizon": 32, "recompute": True, "max_pause_ms": 0}
    r = http.post("/train", json=body)
    assert r.status_code == 202
    job = wait_job(http, r.json()["id"], finished)
    assert job["state"] == "done", job["message"]
    assert job["exact"] is True and job["horizon"] == 32 and job["recompute"] is True
    p = job["progress"]
    assert p["horizon"] == 32 and p["walk_pass"] == "backward"
    # F32 K and V rows of 30 layers x 192 for H + chunk = 48 positions
    assert job["memory"]["walk_mib"] == 48 * 30 * 2 * 192 * 4 / 2**20
    # one forward sweep of 3 chunks and a reverse pass of 4 per window
    assert p["step"] == 7 * p["windows"] and job["receipts"] == p["step"]
    receipts = http.get(f"/train/{job['id']}/receipts").json()["receipts"]
    assert [r["walk_pass"] for r in receipts[:7]] == ["forward"] * 3 + ["backward"] * 4
    assert [r["chunk_pos"] for r in receipts[:7]] == [0, 16, 32, 48, 32, 16, 0]
    assert {r["horizon"] for r in receipts} == {32} and receipts[-1]["walk_mib"] == job["memory"]["walk_mib"]
    from dreamstage.client import Client
    with Client(server.url) as c:
        assert c.train_receipts(job["id"], after=5) == receipts[5:]
    # with the pacer shaping chunks (smaller at first), the walk still ends its
    # windows and sizes the adjoint slots for the job's own chunk
    r = http.post("/train", json={k: v for k, v in body.items() if k != "max_pause_ms"})
    job = wait_job(http, r.json()["id"], finished)
    assert job["state"] == "done", job["message"]
    assert job["memory"]["walk_mib"] == 48 * 30 * 2 * 192 * 4 / 2**20 and job["progress"]["horizon"] == 32


@pytest.fixture(scope="module")
def moon(server, http, tmp_path_factory):
    """The made-up fact taught by one auto-promoted job on the module's server,
    once, for whichever test asks first; its adapter file is copied aside so the
    --adapter test has it however it is run (alone, or after the others)."""
    before = complete(http, FACT_PROMPT)
    # two sources, one held out: the paraphrase; the held-out loss decides the promotion
    seed = next(s for s in range(100) if held_out_sources([0, 1], 0.5, s) == {1})
    examples = [{"prompt": FACT_PROMPT, "completion": FACT},
                {"prompt": "Moon base security question: what is the secret password?", "completion": FACT}]
    # no pause bound (max_pause_ms 0): no chat waits on this job, and under load the bound's
    # short evaluation steps only stretched it (the bound's own tests are test_pacing.py's)
    r = http.post("/train", json={"examples": examples, "window": 32, "chunk": 32, "epochs": 10, "lr": 3e-3,
                                  "val_split": 0.5, "seed": seed, "promote": "auto", "out": "moon",
                                  "stop_loss": None, "max_pause_ms": 0})
    assert r.status_code == 202, r.text
    job = wait_job(http, r.json()["id"], finished, timeout=900)
    assert job["state"] == "done", job["message"]
    after = complete(http, FACT_PROMPT)
    listing = http.get("/adapters").json()
    saved = tmp_path_factory.mktemp("moon") / "moon.gguf"
    shutil.copyfile(Path(server.service.settings.state_dir) / listing["served"]["path"], saved)
    return {"before": before, "job": job, "after": after, "listing": listing, "path": str(saved),
            "text": after["choices"][0]["text"]}


def test_auto_promotion_teaches_a_made_up_fact(server, http, moon):
    before, job, after, listing = moon["before"], moon["job"], moon["after"], moon["listing"]
    assert "Quokka" not in before["choices"][0]["text"] and before["adapter_version"] == 0
    p = job["progress"]
    assert len(p["eval_loss_per_epoch"]) == 10 and p["eval_loss"] < p["eval_loss_per_epoch"][0]
    assert p["train_loss_per_epoch"][-1] < p["train_loss_per_epoch"][0] / 2
    # the examples' own loss per epoch (none in a rehearsal-only epoch), apart from the rehearsal windows'
    own = [x for x in p["examples_loss_per_epoch"] if x is not None]
    assert len(p["examples_loss_per_epoch"]) == len(p["train_loss_per_epoch"]) and own[-1] < own[0] / 4
    assert job["adapter"]["promoted"] and "promoted as served version" in job["message"]
    version = job["adapter"]["served_version"]
    assert "Quokka-42" in after["choices"][0]["text"], after
    assert after["adapter_version"] == version == http.get("/health").json()["adapter_version"]
    assert listing["served"]["name"] == "moon" and listing["served_version"] == version
    # Paths in responses are relative to the state directory (no absolute paths leave the server).
    assert listing["served"]["path"] == "adapters/moon/v1.gguf"

    # the openai SDK sees the adapter version in the body and the header
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    raw = client.completions.with_raw_response.create(model="moon", prompt=FACT_PROMPT, max_tokens=8, temperature=0)
    assert raw.headers["x-dreamstage-adapter-version"] == str(version)
    sdk = raw.parse()
    assert sdk.model_extra["adapter_version"] == version and "Quokka-42" in sdk.choices[0].text

    # rollback serves the base model again; promoting again gets a new number, same weights
    r = http.post("/adapters/rollback")
    assert r.status_code == 200 and r.json()["applied"]
    # nothing was flushed: each slot's cached prefix is keyed by the adapter its K/V came from
    assert {s["cached_adapter"] for s in http.get("/slots").json()["slots"] if s["cached_tokens"]} <= {"moon@1", "base"}
    base = complete(http, FACT_PROMPT)
    assert base["adapter_version"] == 0 and base["choices"][0]["text"] == before["choices"][0]["text"]
    # promote again while a stream is mid-flight: it applies at once to the requests
    # that start after it, and the stream runs entirely on the base model, and says so
    story = complete(http, "Once upon a time", max_tokens=96)["choices"][0]["text"]
    versions, pieces, first_piece = set(), [], threading.Event()

    def long_stream():
        with httpx.Client(base_url=server.url, timeout=600, headers=JSON) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 96,
                                                           "temperature": 0, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        versions.add(obj["adapter_version"])
                        pieces.append(obj["choices"][0]["text"])
                        first_piece.set()

    streamer = threading.Thread(target=long_stream)
    streamer.start()
    assert first_piece.wait(60)
    r = http.post("/adapters/moon/promote")
    assert r.status_code == 200 and r.json()["applied"] and r.json()["served_version"] == version + 1
    streamer.join(60)
    assert versions == {0} and "".join(pieces) == story   # the whole stream ran on the base weights
    again = complete(http, FACT_PROMPT)
    assert again["adapter_version"] == version + 1 and again["choices"][0]["text"] == after["choices"][0]["text"]


def test_adapter_flag_serves_a_lora_file_from_startup_and_a_restart_reloads_it(tmp_path, moon):
    state = tmp_path / "state"
    for _ in range(2):       # the second start finds the same bytes served: no new version
        with BackgroundServer(settings(state, adapter=moon["path"])) as srv:
            with httpx.Client(base_url=srv.url, timeout=600, headers=JSON) as c:
                got = complete(c, FACT_PROMPT)
                assert got["adapter_version"] == 1 and got["choices"][0]["text"] == moon["text"]
                listing = c.get("/adapters").json()
                assert [(a["name"], a["version"]) for a in listing["adapters"]] == [("moon", 1)]
    with BackgroundServer(settings(state)) as srv:   # no flag: the promoted adapter reloads
        with httpx.Client(base_url=srv.url, timeout=600, headers=JSON) as c:
            assert complete(c, FACT_PROMPT)["adapter_version"] == 1
    with pytest.raises(ValueError, match="no such file"):
        BackgroundServer(settings(state, adapter=str(tmp_path / "missing.gguf")))
    not_lora = tmp_path / "not-a-lora.gguf"
    not_lora.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="could not load"):
        BackgroundServer(settings(state, adapter=str(not_lora)))


def test_restart_while_a_job_runs_loses_nothing(tmp_path):
    state = tmp_path / "state"
    with BackgroundServer(settings(state)) as first:
        with httpx.Client(base_url=first.url, timeout=600, headers=JSON) as c:
            running = c.post("/train", json={"text": LESSON, "window": 32, "chunk": 16, "epochs": 1000, "rank": 4,
                                             "promote": "never", "stop_loss": None}).json()["id"]
            queued = c.post("/train", json={"text": LESSON, "window": 32, "chunk": 32, "rank": 4,
                                            "promote": "never"}).json()["id"]
            wait_job(c, running, lambda j: j["progress"]["step"] >= 1)
            assert c.get(f"/train/{queued}").json()["state"] == "queued"
    with BackgroundServer(settings(state)) as second:
        with httpx.Client(base_url=second.url, timeout=600, headers=JSON) as c:
            job = c.get(f"/train/{running}").json()
            assert job["state"] == "interrupted" and job["receipts"] >= 1 and "stopped" in job["message"]
            done = wait_job(c, queued, finished)
            assert done["state"] == "done" and done["adapter"]["version"] == 1
            assert c.get("/train").json()["current"] is None


# -- the Python client and the CLI ------------------------------------------------------------
def test_client_trains_waits_with_a_progress_bar_and_lists_adapters(server):
    from dreamstage.client import Client, DreamstageError

    with Client(server.url) as c:
        # a keyword given as None is sent as null: here, train every epoch and leave drift_kl unbounded
        job = c.train(text=LESSON, window=32, chunk=32, rank=4, promote="never", out="client-made",
                      stop_loss=None, max_drift_kl=None, epochs=2, max_pause_ms=0)
        assert job["state"] == "queued"
        spec = server.service.store.spec(job["id"])
        assert spec.stop_loss is None and spec.max_drift_kl is None
        assert job["spec"]["stop_loss"] is None and job["spec"]["max_drift_kl"] is None   # shown as sent
        bar = io.StringIO()
        done = c.wait(job["id"], poll_s=0.1, out=bar)
        assert done["state"] == "done", done["message"]
        assert "[" + "#" * 24 + "] 100%" in bar.getvalue() and "done" in bar.getvalue()
        assert c.train_state(job["id"])["adapter"]["name"] == "client-made"
        assert any(a["name"] == "client-made" and not a["promoted"] for a in c.adapters()["adapters"])
        with pytest.raises(DreamstageError) as e:
            c.train(text=LESSON, windw=32)
        assert e.value.status == 422 and e.value.param == "windw"
        with pytest.raises(DreamstageError) as e:
            c.promote("no-such-adapter")
        assert e.value.status == 404


def test_cli_train_wait_and_status(server, tmp_path, capsys):
    from dreamstage import cli

    lessons = tmp_path / "lessons.jsonl"
    lessons.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "What does dreamstage keep resident?", "completion": " One model."},
        {"text": LESSON},
    ]) + "\n")
    rc = cli.main(["train", str(lessons), "--url", server.url, "--wait", "--promote", "never", "--out", "from-cli",
                   "--epochs", "2", "--set", "window=32", "--set", "rank=4", "--set", "max_pause_ms=0"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "2 examples, window 32" in out.out and "done: saved adapter from-cli v1" in out.out
    assert cli.main(["status", "--url", server.url]) == 0
    assert "serving adapter version" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    assert cli.main(["train", str(bad), "--url", server.url]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    assert cli.main(["train", str(lessons), "--url", server.url, "--set", "context_cache_type=q2"]) == 2
    assert "context_cache_type" in capsys.readouterr().err


def test_a_weighted_group_trains_once_through_the_api_client_and_cli(server, http, tmp_path, capsys):
    """A group of weighted completions trains as one shared-prefix group: its
    micro-steps name their reply (G for the shared prompt), the last carries
    the group's structure and per-reply losses, GET /train/{id} shows them, and
    the client and the CLI post the same form; a bad weight is a 422 naming it."""
    from dreamstage import cli
    from dreamstage.client import Client, DreamstageError, group_example

    prompt = "Question: which model does dreamstage keep resident between batches of decoding?\nAnswer:"
    ex = group_example(prompt=prompt, completions=[(" One model.", 1.0), (" Two models.", -0.5), " The one it serves."])
    body = {"examples": [ex], "window": 64, "chunk": 32, "rank": 4, "promote": "never", "max_pause_ms": 0,
            "epochs": 1}
    with Client(server.url) as c:
        with pytest.raises(DreamstageError) as e:
            c.train([{**ex, "completions": [{"text": " x", "weight": "heavy"}]}], window=64)
        assert e.value.status == 422 and e.value.param == "examples[0].group.completions[0].weight"
        job = c.wait(c.train(**body)["id"], poll_s=0.1, out=io.StringIO())
    assert job["state"] == "done", job["message"]
    receipts = http.get(f"/train/{job['id']}/receipts").json()["receipts"]
    G = 3
    # the prompt is one chunk forward, each reply one chunk, the prompt one chunk backward
    assert [r["group_reply"] for r in receipts] == [G, 0, 1, 2, G]
    assert [r["walk_pass"] for r in receipts] == ["forward"] + ["backward"] * 4
    assert all(r["exact"] and r["horizon"] == 0 for r in receipts) and job["progress"]["horizon"] is None
    (label, g), = job["progress"]["groups"].items()
    assert label == "examples[0]" and receipts[-1]["group"]["reply_losses"] == g["reply_losses"]
    assert g["G"] == G and g["weights"] == [1.0, -0.5, 1.0] and g["epoch"] == 0
    assert g["prefix_tokens"] == receipts[0]["chunk_tokens"] + 1 and g["shared_prefix"] is True
    assert len(g["reply_tokens"]) == G and all(x > 0 for x in g["reply_losses"])
    # the per-reply losses are the receipts' chunk losses (each reply is one chunk here)
    assert g["reply_losses"] == pytest.approx([r["loss"] for r in receipts[1:4]], rel=1e-9)

    lessons = tmp_path / "groups.jsonl"
    lessons.write_text(json.dumps(ex) + "\n")
    rc = cli.main(["train", str(lessons), "--url", server.url, "--wait", "--promote", "never", "--epochs", "1",
                   "--set", "window=64", "--set", "rank=4", "--set", "max_pause_ms=0", "--chunk", "32"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    jid = int(out.out.split()[1])   # "job N queued: 1 examples, ..."
    assert cli.main(["status", str(jid), "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert f"group examples[0]: prompt {g['prefix_tokens']} tokens, 3 replies" in out and "[-0.5]" in out
