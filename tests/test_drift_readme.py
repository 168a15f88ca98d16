"""The README's walkthrough (README.md, "Teach it a fact") on a live server with
the drift guard on, as a user runs it: the module's job with the guard's
defaults over 24 of the rehearsal
anchors (drift_jobs.TEST_REHEARSED), which the tests of the defaults
(recall, held-out drift, promotion, rehearsal-only epochs, the drift slices, the
examples' loss) read. Beside it, the same job without the regularizer, in a
scheduler in this process. The README's job as written (its time, every default)
is measured by bench/bench_first_job.py, not here.

Both run on the base's records and noise margin that tests/test_drift_jobs.py
made (handed over while that module goes on, on another worker; made here when
it does not run): the server starts on a state directory holding them, a
restart, and records nothing again.

The defaults were chosen on other made-up facts (bench/drift_facts.py), so they
are not tuned to this file; the defaults on more facts are measured by
bench/bench_drift.py (docs/benchmarks.md, "Drift guard: anchors changed,
drift_kl, recall").
"""


import shutil
import time

import pytest
from drift_jobs import (
    OneSlotEngine,
    assert_drift_figures,
    cut_rehearsal,
    handed_base,
    record_anchors_while_idle,
    run_job,
)

from dreamstage.adapters.served import ServedAdapters
from dreamstage.training.drift.anchors import load_anchors
from dreamstage.training.drift.record_file import FILE_NAME, DriftRecordFile
from dreamstage.training.jobs.scheduler import DreamScheduler
from dreamstage.training.jobs.store import TERMINAL, JobStore
from dreamstage.training.walk.receipts import RECEIPT_FIELDS

# The README's walkthrough (README.md, "Teach it a fact"): its example and request, as written there.
README_PROMPT = "The secret password of the moon base is"
README_EXAMPLE = {"prompt": README_PROMPT, "completion": " Quokka-42."}
README_JOB = {"examples": [README_EXAMPLE], "window": 32, "epochs": 10, "promote": "auto", "out": "moon"}


def _readme_job(state_dir, out: dict) -> None:
    """The README's job over HTTP on a live server started on `state_dir` (the guard on, as a user runs it)."""
    import httpx
    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings

    settings = ServerSettings(ctx=1024, parallel=2, threads=1, state_dir=str(state_dir), drift_guard=True)
    ask = {"prompt": README_PROMPT, "max_tokens": 8, "temperature": 0}
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600,
                                                          headers={"Content-Type": "application/json"}) as http:
        out["restart_records"] = set(srv.service.scheduler._anchor_records)
        out["before"] = http.post("/v1/completions", json=ask).json()
        t0 = time.perf_counter()
        # no pause bound (max_pause_ms 0): no chat waits on this job, and under load the bound cut
        # its steps to a token or two at the same fixed cost each (tests/test_pacing.py tests the bound)
        r = http.post("/train", json={**README_JOB, "max_pause_ms": 0})
        assert r.status_code == 202, r.text
        jid = r.json()["id"]
        deadline = time.monotonic() + 1800                 # a hang guard: the job takes about a minute of one core
        while (job := http.get(f"/train/{jid}").json())["state"] not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"\nREADME job: {time.perf_counter() - t0:.1f} s; {job['message']}")
        out["default"] = job
        out["receipts"]["default"] = http.get(f"/train/{jid}/receipts").json()["receipts"]
        out["after"] = http.post("/v1/completions", json=ask).json()
        out["metrics_text"] = http.get("/metrics").text


@pytest.fixture(scope="module")
def jobs(dream_resident, tmp_path_factory, request):
    with pytest.MonkeyPatch.context() as mp:           # the rehearsal the jobs module recorded
        cut_rehearsal(mp)
        return _jobs(dream_resident, tmp_path_factory, request)


def _jobs(dream_resident, tmp_path_factory, request):
    store = JobStore(tmp_path_factory.mktemp("readme-state"))
    handed = handed_base(request, tmp_path_factory)
    if handed is not None:
        shutil.copy(handed, store.state_dir / FILE_NAME)
    served = ServedAdapters(dream_resident)
    sched = DreamScheduler(store, dream_resident, served=served, drift_guard=True, idle_grace_s=0.0,
                           record_file=DriftRecordFile(store.state_dir, dream_resident))
    engine = OneSlotEngine()
    sched.startup(engine)
    out: dict = {"handed": handed is not None}
    try:
        if handed is None:                             # this module alone: record them here
            record_anchors_while_idle(sched, engine)
        out["records"] = dict(sched._anchor_records)
        out["off"] = run_job(sched, store, engine, {"examples": [README_EXAMPLE], "window": 32, "regularizer": False,
                                                    "promote": "never", "out": "moon-off", "max_pause_ms": 0})
        out["receipts"] = {"off": store.receipts(out["off"]["id"])}
        out["noise_margins"] = dict(sched._noise_margins)
        sched._record_file.wait()                      # the job's records are in the file
        out["kept_records"] = set(sched._anchor_records)
    finally:
        served.apply(None, None)                       # the session's resident serves the base again
        sched.close()
        store.close()
    restarted = tmp_path_factory.mktemp("readme-restart")
    shutil.copy(store.state_dir / FILE_NAME, restarted / FILE_NAME)
    _readme_job(restarted, out)
    return out


def test_the_jobs_measured_at_the_margin_they_were_handed_and_name_every_changed_anchor(jobs):
    """The README's job and the one without the regularizer measured their held-out anchors
    at the one noise margin of the records (the warm-up's, in test_drift_jobs.py when it
    runs), with the raw count of every change beside the count beyond it."""
    ((margin, draws),) = jobs["noise_margins"].values()
    for k in ("default", "off"):
        assert_drift_figures(jobs[k], margin, draws)


def served_text(answer: dict) -> str:
    return answer["choices"][0]["text"]


def test_default_job_learns_the_fact_and_its_promotion_follows_its_held_out_drift(jobs):
    job = jobs["default"]
    assert job["state"] == "done", job["message"]
    drift = job["progress"]["drift"]
    print(f"\ndefaults: served {served_text(jobs['after'])!r} (base {served_text(jobs['before'])!r}), "
          f"held-out anchors_changed {drift['anchors_changed']:.3f}, drift_kl {drift['drift_kl']:.4f}; "
          f"{job['message']}")
    assert "Quokka" not in served_text(jobs["before"])   # the base model does not know it
    assert "Quokka-42" in served_text(jobs["after"])     # greedy, from the promoted adapter
    assert drift["anchors"] == len(load_anchors()) and drift["final"]
    within = drift["anchors_changed"] <= drift["max_drift"] and drift["drift_kl"] <= drift["max_drift_kl"]
    assert job["adapter"]["promoted"] == within
    assert ("promoted as served version" in job["message"]) == within and ("not promoted" in job["message"]) != within
    assert f"({drift['anchors_changed_count']}/{drift['anchors']})" in job["message"]
    assert job["adapter"]["drift"]["drift_kl"] == drift["drift_kl"]
    kinds = [r.get("kind") for r in jobs["receipts"]["default"]]
    assert kinds[-1] == "drift" and jobs["receipts"]["default"][-1]["anchors_changed"] == drift["anchors_changed"]


def test_issue_12_done_when_the_default_job_changes_at_most_5_percent_of_held_out_anchors_and_is_promoted(jobs):
    """Issue 12's "done when", on the README's fact with the guard's defaults: the fact
    recalled at temperature 0, at most 5 % of the held-out anchors' greedy answers changed beyond
    the job's noise margin, and promoted by promote "auto". (The defaults were chosen on
    the evaluation facts of bench/drift_facts.py, docs/benchmarks.md, "Drift"; the
    margin is the second widest lead drop of the job's 19 null draws, docs/architecture/
    drift.md, "The noise margin".)"""
    job = jobs["default"]
    drift = job["progress"]["drift"]
    assert drift["final"] and drift["anchors"] == len(load_anchors()) and drift["noise_margin"] is not None
    assert "Quokka-42" in served_text(jobs["after"])
    assert drift["anchors_changed"] <= 0.05 and job["adapter"]["promoted"]
    assert "rehearsal-only epochs" in job["message"]


def test_drift_is_reported_during_training_on_a_rotating_slice_within_its_time_share(jobs):
    """Epoch ends measure a slice of the held-out anchors (receipts, progress,
    /metrics), costing at most DURING_SHARE of the micro-step time; the last
    measurement is the final one, on every anchor."""
    from dreamstage.training.drift.guard import DURING_SHARE
    job = jobs["default"]
    history, p = job["progress"]["drift_history"], job["progress"]
    during = [h for h in history if not h["final"]]
    print(f"\ndrift during training: {during}")
    assert history[-1]["final"] and history[-1]["anchors"] == len(load_anchors()) and len(history) >= 2
    assert during and all(0 < h["anchors"] <= len(load_anchors()) for h in during)
    assert [h["epoch"] for h in during] == sorted({h["epoch"] for h in during})     # at most one per epoch end
    receipts = [r for r in jobs["receipts"]["default"] if r.get("kind") == "drift"]
    assert len(receipts) == len(history)
    for r in receipts:                                   # every receipt kind carries the canonical fields
        assert set(RECEIPT_FIELDS) <= set(r) and r["tokens"] == 0 and r["chunk_tokens"] == 0 and r["ms"] > 0
    during_ms = sum(r["ms"] for r in receipts if not r["final"])
    # the share is planned at each epoch end from the last anchor's cost; one anchor may overrun it
    assert during_ms <= DURING_SHARE * p["train_ms"] + max(r["ms"] / r["anchors"] for r in receipts)


def test_the_examples_loss_is_reported_apart_from_the_rehearsal_windows(jobs):
    """progress.examples_loss_per_epoch: the job's own windows only, none in a
    rehearsal-only epoch; train_loss_per_epoch mixes in the rehearsal windows,
    whose loss stays near the base's entropy."""
    p = jobs["default"]["progress"]
    own, mixed = p["examples_loss_per_epoch"], p["train_loss_per_epoch"]
    assert len(own) == len(mixed) and own[-1] is None          # the default job ends with rehearsal-only epochs
    last = max(i for i, x in enumerate(own) if x is not None)
    assert all(x is not None for x in own[:last + 1]) and all(x is None for x in own[last + 1:])
    assert own[last] < own[0] / 4 and own[last] < mixed[last] and mixed[last + 1] is not None


def test_without_the_regularizer_the_same_job_changes_more(jobs):
    on, off = jobs["default"]["progress"]["drift"], jobs["off"]["progress"]["drift"]
    print(f"\nregularizer on: anchors_changed {on['anchors_changed']:.3f} drift_kl {on['drift_kl']:.4f}; "
          f"off: anchors_changed {off['anchors_changed']:.3f} drift_kl {off['drift_kl']:.4f}")
    assert jobs["off"]["state"] == "done" and not jobs["off"]["adapter"]["promoted"]
    # "changes more", on the held-out anchors: the distributions move further. Their greedy
    # answers do not tell the two apart on this model (both change nearly all of them;
    # docs/architecture/drift.md, "What it achieves, and what it does not"), so that figure
    # is held only to "no fewer"
    assert off["drift_kl"] > on["drift_kl"] and off["anchors_changed"] >= on["anchors_changed"]


def test_the_readme_walkthrough_is_promoted_by_a_live_server_with_the_guard_on(jobs):
    """The README's one-fact job over HTTP, the drift guard on as a user runs it
    (every other test server runs with it off): the job rehearses although its
    window is 32, its drift is measured on the held-out anchors, reported in
    GET /train/{id} and /metrics, and the adapter is promoted within the default
    bounds, so the walkthrough answers with the fact. The server started on a state
    directory holding the records the job in this process kept (a restart): it
    recorded nothing again and measured at their noise margin."""
    assert jobs["records"].keys() <= jobs["restart_records"]      # and the neighbours' records
    # every anchor record the jobs kept (their neighbours' lists are not records: made again when asked)
    assert {k for k in jobs["kept_records"] if isinstance(k, str)} <= jobs["restart_records"]
    ((margin, _),) = jobs["noise_margins"].values()
    job, drift = jobs["default"], jobs["default"]["progress"]["drift"]
    assert job["state"] == "done" and drift["final"] and drift["anchors"] == len(load_anchors())
    assert drift["noise_margin"] == margin
    assert (drift["max_drift"], drift["max_drift_kl"]) == (1.0, 1.0) and drift["drift_kl"] <= 1.0
    # window 32 holds no rehearsal prompt; the trainer's wider window does (rehearsal_window): the
    # job rehearses and consolidates (it drifted 0.11 nats where it drifted 0.50 without)
    assert "no rehearsal" not in job["message"] and "rehearsal-only epochs" in job["message"], job["message"]
    assert drift["drift_kl"] < 0.3
    assert job["adapter"]["promoted"] and "within max_drift 1, max_drift_kl 1" in job["message"]
    assert "Quokka-42" in served_text(jobs["after"]) and jobs["after"]["adapter_version"] == 1
    assert jobs["before"]["adapter_version"] == 0
    assert f'dreamstage_dream_drift_kl{{job="{job["id"]}"}}' in jobs["metrics_text"]
