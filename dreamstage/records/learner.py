"""Feedback into training jobs: `build_job` (what a job of pending feedback trains) and `Learner` (when:
at once on request, or by itself for adapters whose learning is `auto`).

In `auto`, an adapter's pending feedback becomes a job when `examples` items have gathered or `minutes`
after the last one came, whichever is first, and only while no feedback job of that adapter is queued or
training (the next one then continues from what that one promoted). Every feedback job is `promote: auto`
with the server's drift guard: promoted only when the guard allows; otherwise its version is stored with
its figures and waits for a person (POST /adapters/{name}/promote). The job and the feedback it claims
commit in one transaction (`RecordStore.claim`); feedback of a job the server lost mid-way (`interrupted`)
is pending again at the next start. So a crash loses no feedback and trains none twice.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dreamstage.records.feedback import departures, rating_weights, trained_weights
from dreamstage.records.store import Feedback, RecordStore
from dreamstage.training.jobs.example_forms import TokenExample
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.spec import DEFAULT_WINDOW, MAX_WINDOW, JobSpec, SourcedExample

log = logging.getLogger("dreamstage.records")

POLL_S = 1.0            # how often the learner looks at the pending feedback (and at once when told)
RETRY_AFTER_S = 30.0    # after a job could not be submitted (the queue full), before trying that adapter again
WINDOW_STEP = 64        # a feedback job's window: its longest example rounded up to this, at least DEFAULT_WINDOW
# A feedback job's fields where they differ from POST /train's defaults (docs/architecture/feedback.md, "The
# job"). With the drift guard on, the early stop also waits for every example's greedy reply, so the default
# stop_loss ends a job once each correction is the answer at temperature 0; without the guard a lower stop_loss
# stands in for that check. A feedback job rehearses half the default anchors an epoch.
FEEDBACK_JOB = {"promote": "auto", "fit": "left", "epochs": 20, "consolidate": 2, "anchor_ratio": 4.0}
UNGUARDED_STOP_LOSS = 0.05


def build_job(adapter: str, items: list[Feedback], guarded: bool = True) -> tuple[Any, JobSpec]:
    """The job that trains `items` (pending feedback of `adapter`): (its request as GET /train shows it, its
    spec); `guarded`: the server's drift guard is on (FEEDBACK_JOB). Corrections are plain examples; ratings
    of one prompt one group (`rating_weights`, an answer rated twice counts its latest rating); each
    preference a group of +1 and -1. A group whose weights are all 0 is shown but not trained, unless
    nothing else is (the job then ends at its first epoch's early stop and the guard's decision). The
    request shows each example as text (the prompt detokenized); the spec trains the recorded tokens
    (`TokenExample`)."""
    shown: list[dict[str, Any]] = []
    plain: list[SourcedExample] = []
    idle: list[SourcedExample] = []            # groups of weight 0 only: trained only when nothing else is

    def add_group(prompt: list[int], prompt_text: str, replies: list[dict], weights: list[float]) -> None:
        i, weights = len(shown), trained_weights(weights)
        shown.append({"prompt": prompt_text, "completions": [
            {"text": r["text"], "weight": w} for r, w in zip(replies, weights, strict=True)]})
        tokens = [r["tokens"] for r in replies]
        (plain if any(weights) else idle).extend(
            SourcedExample(i, f"examples[{i}].completions[{j}]",
                           TokenExample(prompt=[*prompt, *t[:s]], reply=t[s:e]), group=f"examples[{i}]", weight=w)
            for j, (t, w, (s, e)) in enumerate(zip(tokens, weights, departures(tokens, weights), strict=True))
            if e > s)

    ratings: dict[str, list[Feedback]] = {}
    for f in items:
        body = f.body
        if f.kind == "correction":
            i = len(shown)
            shown.append({"prompt": body["prompt_text"], "completion": body["replies"][0]["text"]})
            plain.append(SourcedExample(i, f"examples[{i}]", TokenExample(prompt=body["prompt"],
                                                                          reply=body["replies"][0]["tokens"])))
        elif f.kind == "preference":
            add_group(body["prompt"], body["prompt_text"], body["replies"], [1.0, -1.0])
        else:
            ratings.setdefault(f.prompt_key, []).append(f)
    for group in ratings.values():
        latest: dict[tuple[str, int], dict] = {}
        for f in group:                                   # ids ascend: a later rating replaces an earlier
            r = f.body["replies"][0]
            latest[(r["record_id"], r["index"])] = r
        replies = list(latest.values())
        add_group(group[0].body["prompt"], group[0].body["prompt_text"], replies,
                  rating_weights([r["rating"] for r in replies]))
    plain = plain or idle       # a job of alike negative ratings only: it trains nothing, and the guard decides
    longest = max(len(e.example.prompt) + len(e.example.reply) for e in plain
                  if isinstance(e.example, TokenExample))
    window = min(MAX_WINDOW, max(DEFAULT_WINDOW, -(-longest // WINDOW_STEP) * WINDOW_STEP))
    more = {} if guarded else {"stop_loss": UNGUARDED_STOP_LOSS}
    req = parse_train_request({"examples": shown, "adapter": adapter, "window": window, **FEEDBACK_JOB, **more})
    return req, replace(req.to_job_spec(), examples=tuple(plain))


class Learner:
    """Starts feedback jobs: `learn(name)` now, or by itself (a thread) for the `auto` adapters."""

    def __init__(self, records: RecordStore, submitter, clock: Callable[[], float] = time.time, guarded: bool = True):
        """guarded: the server's drift guard is on (build_job)."""
        self.records, self.submitter, self.clock, self.guarded = records, submitter, clock, guarded
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()           # one job built from one adapter's pending feedback at a time
        self._failed_at: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    def learn(self, name: str) -> dict[str, Any] | None:
        """A job of `name`'s pending feedback, submitted now (its view), or None when none is pending.
        Raises SubmitRefused as POST /train would."""
        with self._lock:
            items = self.records.pending(name)
            if not items:
                return None
            req, spec = build_job(name, items, self.guarded)
            job = self.submitter.submit_spec(req, spec, self.records.claim([f.id for f in items]))
            log.info("feedback job %s for %r: %d feedback items", job["id"], name, len(items))
            return job

    def due(self, now: float) -> list[str]:
        """The auto adapters whose pending feedback should become a job now."""
        out = []
        pending = self.records.pending_counts()
        for name in self.records.auto_names():
            if name not in pending or now - self._failed_at.get(name, -RETRY_AFTER_S) < RETRY_AFTER_S:
                continue
            count, last = pending[name]
            s = self.records.learning(name)
            if (count >= s.examples or now - last >= 60.0 * s.minutes) and self.records.open_job(name) is None:
                out.append(name)
        return out

    def tick(self) -> list[int]:
        """Start the jobs that are due; returns their ids."""
        started = []
        for name in self.due(self.clock()):
            try:
                job = self.learn(name)
            except Exception as e:  # noqa: BLE001 - a refused job (queue full, a store error) is retried later
                self._failed_at[name] = self.clock()
                log.warning("feedback job for %r not started (retrying in %.0f s): %s", name, RETRY_AFTER_S, e)
                continue
            if job is not None:
                started.append(job["id"])
        return started

    def notify(self) -> None:
        """New feedback, a changed setting or an ended job: look now."""
        self._wake.set()

    def start(self) -> Learner:
        self._thread = threading.Thread(target=self._run, name="dreamstage-learner", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("the feedback learner failed a round")
            self._wake.wait(POLL_S)
            self._wake.clear()

    def close(self, wait_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(wait_s)
