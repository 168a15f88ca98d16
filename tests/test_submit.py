"""The submit use case (dreamstage.training.jobs.submit) without a server or a model."""
from __future__ import annotations

import threading

import pytest
from char_tokenizer import CharTokenizer

from dreamstage.training.jobs.store import JobStore
from dreamstage.training.jobs.submit import JobLimits, JobSubmitter, SubmitRefused

TEXT = "the quick brown fox jumps over the lazy dog. " * 3


class RecordingScheduler:
    """What the submitter tells the engine side: committed jobs, their rendered windows, forgotten jobs."""

    def __init__(self):
        self.notified, self.forgotten, self.held = {}, [], 0

    def notify_submitted(self, job_id, rendered=None):
        self.notified[job_id] = rendered
        self.held += sum(len(w.tokens) for w in (*rendered.train, *rendered.held_out))

    def forget(self, job_id):
        self.forgotten.append(job_id)

    def queued_tokens(self):
        return self.held


@pytest.fixture()
def store(tmp_path):
    with JobStore(tmp_path / "state") as s:
        yield s


def submitter(store, delay_s=0.0, **limits):
    return JobSubmitter(store, RecordingScheduler(), CharTokenizer(delay_s), JobLimits(**limits))


def test_an_accepted_job_is_committed_queued_and_handed_to_the_engine_rendered(store):
    sub = submitter(store)
    job = sub.submit({"text": TEXT, "window": 64, "chunk": 32})
    assert job["state"] == "queued" and store.queue() == [job["id"]]
    assert (job["window"], job["chunk"]) == (64, 32)
    rendered = sub.scheduler.notified[job["id"]]
    assert [len(w.tokens) for w in rendered.train] == [64, 64, 24]     # 136 tokens, overlap 8


def test_a_bad_field_is_refused_by_name_and_nothing_is_stored(store):
    sub = submitter(store)
    with pytest.raises(SubmitRefused) as e:
        sub.submit({"text": TEXT, "window": 64, "chunk": 128})
    assert (e.value.status, e.value.param, e.value.code) == (422, "chunk", "invalid_value")
    assert "larger than window 64" in e.value.message
    with pytest.raises(SubmitRefused) as e:
        sub.submit({"text": TEXT, "windw": 64})
    assert (e.value.status, e.value.param) == (422, "windw") and "unknown field" in e.value.message
    assert store.job_ids() == [] and sub.scheduler.notified == {}


def test_an_example_that_does_not_render_is_refused_naming_it(store):
    sub = submitter(store)
    body = {"window": 16, "examples": [{"prompt": "ok", "completion": "y"}, {"prompt": "p", "completion": "x" * 40}]}
    with pytest.raises(SubmitRefused) as e:
        sub.submit(body)
    assert e.value.status == 422 and e.value.param.startswith("examples[1]")
    assert store.job_ids() == []


@pytest.mark.parametrize("limits, status, param, name", [
    ({"max_job_examples": 1}, 413, "examples", "max_job_examples = 1"),
    ({"max_example_tokens": 100}, 413, "examples[0]", "max_example_tokens = 100"),
    ({"max_job_tokens": 100}, 413, "examples", "max_job_tokens = 100"),
])
def test_limits_are_counted_on_what_will_run(store, limits, status, param, name):
    sub = submitter(store, **limits)
    with pytest.raises(SubmitRefused) as e:
        sub.submit({"examples": [{"text": TEXT}, {"text": "short"}], "window": 64})
    assert (e.value.status, e.value.param, e.value.code) == (status, param, "limit_exceeded")
    assert name in e.value.message and store.job_ids() == []


def test_the_queue_limits_count_jobs_and_the_tokens_they_hold(store):
    sub = submitter(store, max_queued_jobs=2, max_queued_tokens=300)
    sub.submit({"text": TEXT, "window": 64})                        # 152 tokens held
    with pytest.raises(SubmitRefused, match="max_queued_tokens = 300") as e:
        sub.submit({"text": TEXT, "window": 64})
    assert e.value.status == 422
    sub.submit({"text": "a short one", "window": 64})
    with pytest.raises(SubmitRefused, match="2 jobs are queued, the server's limit max_queued_jobs = 2"):
        sub.submit({"text": "one more", "window": 64})
    assert len(store.queue()) == 2


def test_two_submissions_rendering_at_once_cannot_both_take_the_last_place(store):
    sub = submitter(store, delay_s=0.05, max_queued_jobs=1)
    results: list = []

    def post():
        try:
            results.append(sub.submit({"text": TEXT, "window": 64})["id"])
        except SubmitRefused as e:
            results.append(e.status)

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.queue()) == 1 and sorted(results, key=str).count(422) == 3


def test_cancelling_a_queued_job_drops_its_rendered_windows(store):
    sub = submitter(store)
    jid = sub.submit({"text": TEXT, "window": 64})["id"]
    view = sub.transition(jid, "cancelled")
    assert view["state"] == "cancelled" and sub.scheduler.forgotten == [jid]
    sub.transition(sub.submit({"text": TEXT, "window": 64})["id"], "cancelled")
    assert len(sub.scheduler.forgotten) == 2
