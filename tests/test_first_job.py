"""A job trains before the drift guard's records are all made (issue 53, item 4).

On the default model, with the anchor sets cut short (4 measured, 8
rehearsal, 4 of them a job epoch) and 3 null draws, so that a whole first
job runs in well under a minute of one core: its first micro-step comes while records are still
missing, the records an epoch visits are made before it, and the promotion
reads every measured anchor and the noise margin of them all.
"""
from __future__ import annotations

import numpy as np
import pytest
from drift_jobs import OneSlotEngine, cut_anchors
from drift_steps import run_steps

from dreamstage.adapters.served import ServedAdapters
from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.guard import DriftGuard
from dreamstage.training.drift.measure import DriftProbe
from dreamstage.training.drift.record_file import DriftRecordFile
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.scheduler import DreamScheduler
from dreamstage.training.jobs.store import TERMINAL, JobStore
from dreamstage.training.walk.examples import render_job

MEASURED = load_anchors()[:4]
REHEARSED = rehearsal_anchors()[:8]
NULLS = 3
JOB = {"examples": [{"prompt": "The secret password of the moon base is", "completion": " Quokka-42."}],
       "window": 32, "epochs": 2, "lr": 0.001, "seed": 2, "anchor_ratio": 4, "neighbours": 1, "consolidate": 1,
       "promote": "auto", "out": "moon"}


@pytest.fixture
def short_anchors(monkeypatch):
    cut_anchors(monkeypatch, MEASURED, REHEARSED, NULLS)


@pytest.fixture(scope="module")
def first_job(dream_resident, tmp_path_factory):
    """The job run by a scheduler whose records are empty; what it looked like at its first step."""
    mp = pytest.MonkeyPatch()
    cut_anchors(mp, MEASURED, REHEARSED, NULLS)
    try:
        store = JobStore(tmp_path_factory.mktemp("first-job"))
        sched = DreamScheduler(store, dream_resident, served=ServedAdapters(dream_resident), drift_guard=True,
                               idle_grace_s=0.0)
        engine = OneSlotEngine()
        sched.startup(engine)
        job = store.submit(parse_train_request(JOB))
        sched.notify_submitted(job["id"])
        at_first = None
        for _ in range(200_000):
            got = store.get(job["id"])
            if at_first is None and got["progress"]["step"] >= 1:
                at_first = {"progress": got["progress"], "cached": set(sched._anchor_records),
                            "margins": dict(sched._noise_margins)}
            if got["state"] in TERMINAL:
                break
            sched.after_batch(engine, True)
        for _ in range(5):                          # a booked promotion is applied between batches
            sched.after_batch(engine, True)
        yield {"job": store.get(job["id"]), "at_first": at_first, "store": store, "sched": sched,
               "receipts": store.receipts(job["id"])}
        sched.close()
    finally:
        mp.undo()


def test_the_first_step_comes_before_the_records_are_complete(first_job):
    at = first_job["at_first"]
    assert at is not None, "the job never took a training step"
    records = at["progress"]["drift_records"]
    assert records == {"measured": 0, "of": len(MEASURED), "pending": True}
    assert not any(p in at["cached"] for p in MEASURED)         # none of the measured anchors yet
    assert not at["margins"]                                     # nor the noise margin
    made = [p for p in REHEARSED if p in at["cached"]]
    assert 0 < len(made) < len(REHEARSED)                        # only what the first epoch visits
    job = first_job["job"]
    assert job["state"] == "done", job["message"]
    assert job["progress"]["drift_records"] == {"measured": len(MEASURED), "of": len(MEASURED), "pending": False}


def test_the_guard_decides_promotion_over_the_full_record_set(first_job):
    job = first_job["job"]
    final = job["progress"]["drift"]
    assert final["final"] is True and final["anchors"] == len(MEASURED)
    assert "anchors_recorded" not in final
    assert final["noise_margin"] is not None and len(final["noise_draws"]) == NULLS
    assert set(first_job["sched"]._anchor_records) >= {*MEASURED, *REHEARSED}
    spec = parse_train_request(JOB).to_job_spec()
    ok = final["anchors_changed"] <= spec.max_drift + 1e-12 and (spec.max_drift_kl is None
                                                                 or final["drift_kl"] <= spec.max_drift_kl)
    assert f"/{len(MEASURED)})" in job["message"]                  # the message quotes the full measurement
    promoted = "promoted as served version" in job["message"]
    assert promoted == ok, job["message"]
    # every measurement during training says over how many recorded anchors it was made
    during = [r for r in first_job["receipts"] if r.get("kind") == "drift" and not r.get("final")]
    for r in during:
        made, total = r.get("anchors_recorded", [len(MEASURED), len(MEASURED)])
        assert r["anchors"] <= made <= total == len(MEASURED)


def test_the_noise_margin_made_while_training_equals_the_one_made_before(dream_resident, first_job, short_anchors):
    """The null draws between micro-steps use the shadow's parameters at the job's start,
    as the draws before its first step did: the same margin, draw for draw."""
    job = first_job["job"]
    trainer, _ = first_job["sched"]._job_trainer(parse_train_request(JOB).to_job_spec(), OneSlotEngine())
    try:
        probe = DriftProbe(dream_resident, MEASURED, seq_id=0)
        run_steps(probe.record())
        run_steps(probe.null_margin(trainer, draws=NULLS))
    finally:
        trainer.close()
    final = job["progress"]["drift"]
    assert final["noise_draws"] == [round(x, 4) for x in probe.noise_draws]
    assert final["noise_margin"] == pytest.approx(probe.noise_margin, abs=1e-9)


def test_each_epoch_visits_the_same_windows_as_with_every_record_made_first(dream_resident, short_anchors):
    """The records are made in the order the epochs need them, and an epoch waits for its
    own: the windows each epoch visits do not depend on when the records came."""
    spec = parse_train_request({**JOB, "epochs": 4, "neighbours": 0}).to_job_spec()
    train = render_job(spec, dream_resident).train

    def guard():
        return DriftGuard(dream_resident, spec, train, seq_id=0, restore=lambda: None, cache={})
    full = guard()
    run_steps(full.record())
    late = guard()
    late.start()
    seen = []
    for epoch in range(spec.epochs):
        while not late.ready(epoch):
            late.step_recording()
        seen.append([late.windows[i].label for i in late.order(epoch)])
        if epoch == 0:
            assert late.recording                    # the first epoch did not wait for every record
    run_steps(late.finish_recording())
    assert seen == [[full.windows[i].label for i in full.order(e)] for e in range(spec.epochs)]
    assert [late.windows[i].label for i in late.consolidation_order(0)] == \
        [full.windows[i].label for i in full.consolidation_order(0)]
    for a, b in zip(late.probe.bases, full.probe.bases, strict=True):
        assert a.answer == b.answer and np.array_equal(a.top_ids, b.top_ids)


def test_the_records_made_before_a_stop_are_kept_for_the_restart(dream_resident, short_anchors, tmp_path):
    """A server stopped while its first job still records keeps what was recorded: the
    restart loads it from the state directory and records only the rest."""
    store = JobStore(tmp_path)
    sched = DreamScheduler(store, dream_resident, served=ServedAdapters(dream_resident), drift_guard=True,
                           idle_grace_s=0.0, record_file=DriftRecordFile(tmp_path, dream_resident))
    engine = OneSlotEngine()
    sched.startup(engine)
    job = store.submit(parse_train_request(JOB))
    sched.notify_submitted(job["id"])
    while store.get(job["id"])["progress"]["step"] < 1:
        sched.after_batch(engine, True)
    made = {p for p in sched._anchor_records if isinstance(p, str)}
    sched.close()
    assert store.get(job["id"])["state"] == "interrupted"
    store.close()
    records, _ = DriftRecordFile(tmp_path, dream_resident).load()
    assert set(records) == made and 0 < len(made & set(REHEARSED)) < len(REHEARSED)
