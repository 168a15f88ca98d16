"""The serving engine: one thread owns the resident context and every llama call.

Callers (the HTTP server, tests) never touch llama. They `submit` a request
with a sink (a thread-safe callable); the engine thread tokenizes it, admits
it into a free slot (a sequence id), and sends `Admitted`, `Delta`, then
`Finished` or `Failed` events through the sink.

One loop iteration:
  1. intake: tokenize newly submitted requests, refuse the ones that cannot fit;
  2. admit waiting requests into free slots (reusing a slot's cached prefix);
  3. build ONE llama_batch: the next token of every generating slot, then
     prompt chunks of prefilling slots, n_batch tokens at most;
  4. llama_decode; sample each slot that has an output; stream its text;
  5. call the dream hook once (idle=False).
With no active slot the thread blocks on a condition variable, waking every
`idle_interval` seconds to call the hook with idle=True: the dream stage
trains while nobody is being served.

The parts, one role each: slots.py (the records of a request and a slot, the
handles given out), core.py (the state and how a request ends), pool.py (K/V
cells and the lent sequence), admission.py (steps 1-2), batch.py (steps 3-4),
embeddings.py (embedding requests). This module holds the thread and the
public API.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from dreamstage.adapters.choice import DEFAULT_MAX_ADAPTERS, DEFAULT_MIXED_MAX_RANK
from dreamstage.adapters.selection import MixedAdapters
from dreamstage.serving import rpc
from dreamstage.serving.admission import AdmissionMixin
from dreamstage.serving.batch import BatchMixin
from dreamstage.serving.embeddings import EmbeddingMixin
from dreamstage.serving.generation import (
    Admitted,
    Delta,
    Embedded,
    EngineStopped,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    PromptScored,
    QueueFull,
    Sink,
    TextStream,
)
from dreamstage.serving.resident import ResidentModel
from dreamstage.serving.slots import RequestHandle, SequenceLease, _Job

# What callers import from here: the engine, its hook, its handles, and the request and events it speaks.
__all__ = ["Admitted", "Delta", "DreamHook", "Embedded", "Engine", "EngineStopped", "Event", "Failed", "Finished",
           "GenerationRequest", "NoDream", "PromptScored", "QueueFull", "RequestHandle", "SequenceLease", "Sink",
           "TextStream"]

log = logging.getLogger("dreamstage.serving.engine")

# How often the engine asks a failed RPC worker whether it answers again (`_reconnect`).
RECONNECT_PROBE_S = 1.0


class DreamHook(Protocol):
    """Called on the engine thread once after every decode batch and on idle wake-ups.

    The dream stage plugs a scheduler in here that runs at most one training
    micro-step. It must be synchronous and cheap when it has nothing to do:
    its time is added to the inter-token latency of every active stream.
    """

    def after_batch(self, engine: Engine, idle: bool) -> None: ...


class NoDream:
    def after_batch(self, engine: Engine, idle: bool) -> None:
        return None


class Engine(AdmissionMixin, BatchMixin, EmbeddingMixin):
    """Continuous batching over the resident context's sequence slots."""

    hook: DreamHook

    def __init__(self, model: ResidentModel, *, max_queue: int = 64, hook: DreamHook | None = None,
                 idle_interval: float = 0.05, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 adapter_max_rank: int = DEFAULT_MIXED_MAX_RANK):
        super().__init__(model, max_queue=max_queue, hook=hook or NoDream(), idle_interval=idle_interval,
                         max_adapters=max_adapters, adapter_max_rank=adapter_max_rank)

    # -- public, any thread -------------------------------------------------------
    def start(self) -> Engine:
        if self._running:
            return self
        self._batch = self.lc.llama_batch_init(self.n_batch, 0, 1)
        _ = self.model.eog_tokens               # read here, not at the first token sampled
        self._running = True
        self._thread = threading.Thread(target=self._run, name="dreamstage-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> bool:
        """Stop the loop after the current iteration (its micro-step included).

        True once the engine thread has ended. False if it is still running
        after `timeout` (None: wait as long as it takes); then nothing native
        is freed, since the thread may be inside llama_decode or a micro-step."""
        with self._cond:
            self._running = False
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return False
        with self._cond:
            batch, self._batch = self._batch, None
        if batch is not None:
            self.lc.llama_batch_free(batch)
        return True

    @property
    def running(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    def submit(self, request: GenerationRequest, sink: Sink) -> RequestHandle:
        """Queue a request. Raises QueueFull (backpressure) or EngineStopped."""
        return self.submit_group([request], [sink])[0]

    def submit_group(self, requests: list[GenerationRequest], sinks: list[Sink]) -> list[RequestHandle]:
        """Queue the choices of one n > 1 request: the first request's prompt is
        decoded once and its K/V copied to the others' slots, which are taken
        together (so n must not exceed the slots). Each choice has its own
        sampling (seed), sink and handle. Raises QueueFull, EngineStopped, ValueError."""
        if not 1 <= len(requests) <= self.n_seq or len(sinks) != len(requests):
            raise ValueError(f"n: {len(requests)} choices, where this server has {self.n_seq} slots")
        if any(r.max_tokens is not None and r.max_tokens < 1 for r in requests):
            raise ValueError("max_tokens must be at least 1")
        with self._cond:
            if not self._running:
                raise EngineStopped("the engine is not running")
            if self._outstanding + len(requests) > self.n_seq + self.max_queue:
                raise QueueFull(f"{self._outstanding} requests outstanding: all {self.n_seq} slots busy "
                                f"and the waiting room of {self.max_queue} is full")
            now = time.perf_counter()
            jobs = [_Job(RequestHandle(self, next(self._ids)), r, k, now) for r, k in zip(requests, sinks, strict=True)]
            jobs[0].followers = jobs[1:]
            self._inbox.append(jobs[0])
            self._outstanding += len(jobs)
            self._cond.notify_all()
        return [j.handle for j in jobs]

    @property
    def queue_depth(self) -> int:
        """Requests submitted but not yet in a slot."""
        return len(self._inbox) + len(self._waiting)

    def oldest_wait_s(self) -> float:
        """Seconds the oldest request not yet in a slot has waited (0.0 when none).
        The pacer charges an idle micro-step this much when a request arrived during it."""
        with self._cond:
            oldest = min((j.submitted for j in (*self._inbox, *self._waiting)), default=None)
        return 0.0 if oldest is None else max(0.0, time.perf_counter() - oldest)

    def busy_slots(self) -> int:
        """Slots serving a request (the dream stage's pacer asks this in the hook)."""
        return sum(1 for s in self.slots if s.busy)

    def slots_info(self) -> list[dict]:
        out = []
        for s in self.slots:
            job = s.job
            out.append({
                "id": s.seq_id,
                "busy": job is not None,
                "state": "idle" if job is None else ("prefill" if s.pending else "generating"),
                "request_id": job.handle.id if job else None,
                "cached_tokens": len(s.tokens),
                "prompt_tokens": len(job.prompt) if job else 0,
                "generated_tokens": s.generated if job else 0,
                "max_tokens": job.max_tokens if job else 0,
                "adapter_version": s.adapter_version if job else None,
                "adapter": s.adapter.label if job else None,
                "cached_adapter": s.adapter.label if s.tokens else None,
                "reserved_cells": s.reserved if job else 0,
            })
        return out

    def wake(self) -> None:
        """Run the loop now rather than at the next idle interval (any thread)."""
        with self._cond:
            self._cond.notify_all()

    # -- the engine thread -----------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._running:
                        break
                    if not self._inbox and not self._waiting and not any(s.busy for s in self.slots):
                        self._cond.wait(self.idle_interval)
                        if not self._running:
                            break
                        idle = not self._inbox
                    else:
                        idle = False
                    inbox = list(self._inbox)
                    self._inbox.clear()
                try:
                    if self.model.config.rpc and time.monotonic() >= self._reconnect_at:
                        self._reconnect()
                    if idle:
                        self._call_hook(True)
                        continue
                    self._intake(inbox)
                    self._reap_cancelled()
                    self._admit()
                    self._embed_waiting()
                    if self._step():
                        self._call_hook(False)
                except Exception as e:  # a bug must fail requests, never kill the engine
                    log.exception("engine loop iteration failed")
                    self.failing = f"{type(e).__name__}: {e}"
                    self._fail_all(f"internal engine error: {type(e).__name__}: {e}")
        finally:
            self._shutdown()

    def _reconnect(self) -> None:
        """Once every RPC worker of a model that lost one answers again, load the model
        again in place and serve on. What lived on the old context goes: requests in
        slots fail with 503, cached prefixes and loaded adapters are dropped (reloaded
        on demand), and the reload closes the dream stage's trainers (a held job
        reopens its own from its checkpoint: docs/architecture/rpc.md)."""
        self._reconnect_at = time.monotonic() + RECONNECT_PROBE_S
        endpoints = self.model.config.rpc
        gone = rpc.failed_worker(endpoints) or (None if self.model.ctx else "a worker")
        # only the failed worker is asked while the model holds the others: a worker takes one
        # client at a time, and probes queued on a live one's backlog (of 1) soon go unanswered
        asked = (gone,) if gone in endpoints else endpoints
        if gone is None or any(rpc.probe(e, timeout_s=0.5) for e in rpc.parse_endpoints(",".join(asked))):
            return
        log.warning("the RPC worker at %s answers again: loading the model again", gone)
        for s in self.slots:
            if s.busy:
                job = s.job
                assert job is not None  # busy
                self._free_slot(s)
                self._finish_job(job, Failed(503, f"the RPC worker at {gone} failed; the model is loading again"),
                                 "error")
            s.tokens.clear()            # its K/V went with the old context
        self.adapters.close()           # handles of the old model, freed before it is
        # /health is failing until the model is back (the worker alone answers before that)
        self.failing = f"the model is loading again after the RPC worker at {gone} came back"
        try:
            self.model.reload()
        except (ValueError, OSError) as e:   # tried again at the next probe; nothing decodes meanwhile
            self.failing = f"loading the model again after the RPC worker at {gone} came back failed: {e}"
            log.error("%s", self.failing)
            return
        self.adapters = MixedAdapters(self.model, *self.adapter_limits)
        self.failing = None
        self.stats.model_reloads += 1

    def _call_hook(self, idle: bool) -> None:
        # A failing dream step must not take serving down: log, count, go on.
        try:
            self.hook.after_batch(self, idle)
        except Exception:
            self.stats.hook_errors += 1
            log.exception("dream hook failed (idle=%s)", idle)

    def _fail_all(self, message: str) -> None:
        """Fail every active request and clear its sequence: the engine starts clean."""
        self.stats.decode_failures += 1
        for s in self.slots:
            if s.busy:
                job = s.job
                assert job is not None  # busy
                self._clear_slot(s)
                self._free_slot(s)
                self._finish_job(job, Failed(500, message), "error")

    def _shutdown(self) -> None:
        self._running = False
        for s in self.slots:
            job = s.job
            if job is not None:
                self._free_slot(s)
                self._finish_job(job, Failed(503, "the server is shutting down"), "error")
        with self._cond:
            pending = list(self._inbox) + list(self._waiting)
            self._inbox.clear()
            self._waiting.clear()
        for job in pending:
            self._finish_job(job, Failed(503, "the server is shutting down"), "error")

