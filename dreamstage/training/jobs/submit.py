"""Submitting a training job: validate, render, check the limits, commit, enqueue.

The one place POST /train's use case lives: the route parses JSON and maps
`SubmitRefused` to an HTTP error; the CLI's server and tests call the same
`JobSubmitter.submit`. A job is validated and rendered (chat template,
windows, loss masks) before it is committed, so an accepted job is one that
will run and that survives a restart; the engine is then told, and given the
rendered windows so it does not render them again.

Limits are counted on what will actually run (examples after groups expand,
rendered tokens), never guessed from the body's size.
"""
from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dreamstage.training.jobs.request import TrainRequest, parse_train_request
from dreamstage.training.jobs.spec import JobSpec
from dreamstage.training.jobs.store import ENGINE_ONLY, InvalidTransition, JobStore
from dreamstage.training.walk.examples import ExampleErrors, RenderedJob, render_job
from dreamstage.validation import field_errors, field_path


@dataclass(frozen=True)
class JobLimits:
    """What one POST /train may cost, counted on what will actually run.

    Breaking one is a 413 (this job is too big) or 422 (the queue is full)
    naming the limit and its value; each has a `serve` flag."""
    max_job_examples: int = 100_000       # examples after groups are expanded (one per completion)
    max_example_tokens: int = 262_144     # rendered tokens of one source example, over all its windows
    max_job_tokens: int = 2_000_000       # rendered tokens of the whole job (train and held out)
    max_queued_jobs: int = 16             # jobs waiting to start
    max_queued_tokens: int = 4_000_000    # rendered tokens the waiting jobs hold in memory

    def validate(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class SubmitRefused(ValueError):
    """A job that is not accepted, and why: `status` is the HTTP status that
    says it (413 too big, 422 invalid or the queue is full), `param` the field."""

    def __init__(self, status: int, message: str, param: str | None, code: str):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def invalid(errors: list[tuple[str, str]]) -> SubmitRefused:
    """422 naming the first field; the message lists up to five."""
    return SubmitRefused(422, "; ".join(f"{p}: {m}" for p, m in errors[:5]), errors[0][0], "invalid_value")


def _too_big(limit: str, value: int, what: str, param: str = "examples") -> SubmitRefused:
    return SubmitRefused(413, f"{what} is more than the server's limit {limit} = {value}", param, "limit_exceeded")


class JobSubmitter:
    """Accepts jobs into `store` for `scheduler` (the engine's DreamScheduler).

    Thread-safe: the limit checks and the commit run under one lock, so two
    submissions rendering at once cannot both take the queue's last place.
    Rendering (the tokenizer only) runs outside it."""

    def __init__(self, store: JobStore, scheduler, tokenizer, limits: JobLimits | None = None):
        self.store, self.scheduler, self.tokenizer = store, scheduler, tokenizer
        self.limits = limits or JobLimits()
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}      # bodies refused, by SubmitRefused.code (for /metrics)

    def submit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Accept one POST /train body; returns the committed job's view.

        Raises SubmitRefused (nothing stored), or OSError / sqlite3.Error when
        the state directory cannot take the job (nothing stored either)."""
        try:
            return self._submit(body)
        except SubmitRefused as e:
            with self._lock:
                self.refused[e.code] = self.refused.get(e.code, 0) + 1
            raise

    def _submit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            req = parse_train_request(body)
        except ValidationError as e:
            raise invalid(field_errors(e)) from None
        return self.submit_spec(req, req.to_job_spec())

    def submit_spec(self, req: TrainRequest, spec: JobSpec,
                    within: Callable[[sqlite3.Connection, int], None] | None = None) -> dict[str, Any]:
        """Accept a job whose spec was derived elsewhere (feedback: dreamstage/records/), the limits checked as
        for a body; `within` runs inside the job's commit (JobStore.submit)."""
        if len(spec.examples) > self.limits.max_job_examples:
            raise _too_big("max_job_examples", self.limits.max_job_examples,
                           f"the job has {len(spec.examples)} examples (groups expanded), which")
        self._check_queue()                          # early: a full queue costs no rendering
        rendered = self.render(spec)
        with self._lock:
            self._check_queue()
            self._check_tokens(rendered)
            job = self.store.submit(req, spec, within)   # committed (fsynced) before it returns, spec and all
            self.scheduler.notify_submitted(job["id"], rendered)
        return job

    def render(self, spec: JobSpec) -> RenderedJob:
        try:
            return render_job(spec, self.tokenizer)
        except ExampleErrors as e:
            raise invalid([(field_path(err.loc), err.message) for err in e.errors]) from None

    def transition(self, job_id: int, target: str) -> dict[str, Any]:
        """Pause, resume or cancel; returns the job's view. A cancelled queued
        job's rendered windows are dropped now, not when it would have run.
        A held job runs again only when the engine says so (ENGINE_ONLY)."""
        if (current := self.store.state(job_id), target) in ENGINE_ONLY:
            raise InvalidTransition(job_id, current, target, "a held job goes on by itself once its RPC worker "
                                                             "answers again; cancel it to give up")
        self.store.transition(job_id, target)
        if target == "cancelled":
            self.scheduler.forget(job_id)
        return self.store.get(job_id)

    def _check_queue(self) -> None:
        queued, limit = len(self.store.queue()), self.limits.max_queued_jobs
        if queued >= limit:
            raise SubmitRefused(422, f"{queued} jobs are queued, the server's limit max_queued_jobs = {limit}; "
                                     "wait for one to start or cancel one", None, "limit_exceeded")

    def _check_tokens(self, rendered: RenderedJob) -> None:
        limits = self.limits
        per_source: dict[int, int] = {}
        total = 0
        for w in (*rendered.train, *rendered.held_out):
            per_source[w.source] = per_source.get(w.source, 0) + len(w.tokens)
            total += len(w.tokens)
        worst = max(per_source.items(), key=lambda kv: kv[1], default=None)
        if worst is not None and worst[1] > limits.max_example_tokens:
            raise _too_big("max_example_tokens", limits.max_example_tokens,
                           f"examples[{worst[0]}] renders to {worst[1]} tokens, which", f"examples[{worst[0]}]")
        if total > limits.max_job_tokens:
            raise _too_big("max_job_tokens", limits.max_job_tokens, f"the job renders to {total} tokens, which")
        queued = self.scheduler.queued_tokens()
        if queued + total > limits.max_queued_tokens:
            raise SubmitRefused(422, f"the queued jobs hold {queued} tokens; this job's {total} would pass the "
                                     f"server's limit max_queued_tokens = {limits.max_queued_tokens}; wait for the "
                                     "queue to drain", "examples", "limit_exceeded")
