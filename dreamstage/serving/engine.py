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
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from dreamstage.adapters.choice import BASE, DEFAULT_MAX_ADAPTERS, DEFAULT_MIXED_MAX_RANK, AdapterChoice
from dreamstage.adapters.loaded import AdapterLoadError, AdaptersFull
from dreamstage.adapters.selection import MixedAdapters
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
from dreamstage.serving.sampling import GrammarError, Sampler, TokenLogprob, log_softmax, scored
from dreamstage.stats import EngineStats

if TYPE_CHECKING:
    import ctypes
    from collections.abc import Callable

    from llama_cpp.llama_cpp import llama_batch

log = logging.getLogger("dreamstage.serving.engine")


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


class RequestHandle:
    """What `submit` returns: an id and a way to cancel."""

    def __init__(self, engine: Engine, rid: int):
        self._engine = engine
        self.id = rid
        self.cancelled = False

    def cancel(self) -> None:
        """Free the request's slot at the next loop iteration (idempotent, any thread)."""
        if not self.cancelled:
            self.cancelled = True
            self._engine._wake()


# -- slots ----------------------------------------------------------------------
@dataclass
class _Job:
    handle: RequestHandle
    request: GenerationRequest
    sink: Sink
    submitted: float
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    adapter: AdapterChoice = BASE     # resolved at intake (the request's, else the engine's default)
    # The other choices of an n > 1 request: admitted with this job, they share
    # its prompt's K/V (copied once it is decoded). Emptied at admission.
    followers: list[_Job] = field(default_factory=list)


class _Slot:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.tokens: list[int] = []   # tokens whose K/V this sequence holds, in order
        self.job: _Job | None = None
        self.sampler: Sampler | None = None   # sampler chain of the active request
        self.prompt_scores: list[TokenLogprob | None] = []   # with prompt_logprobs, filled during prefill
        self.pending: list[int] = []  # prompt tokens still to decode
        self.next_token: int | None = None  # sampled, not yet decoded
        self.generated = 0
        self.cached = 0
        self.stream: TextStream | None = None
        self.awaiting: _Slot | None = None   # a follower waiting for this slot's leader to finish its prompt
        self.adapter_version: int | None = 0
        self.adapter: AdapterChoice = BASE   # what `tokens`' K/V were computed with (and the job's while busy)
        # Unified pool: the cells the busy request may hold at most (prompt + max_tokens); 0 while idle.
        self.reserved = 0
        self.used_at = 0.0   # when the slot last finished or took a request: idle prefixes go least recent first
        self.t_last: float = 0.0
        self.first_token_at: float | None = None

    @property
    def busy(self) -> bool:
        return self.job is not None


class SequenceLease:
    """An idle slot's sequence lent to the dream hook (Engine.hold_idle_sequence).
    `valid` turns False when the loan ends: the borrower's `release()`, or
    serving taking the slot back. Either way the sequence is cleared."""

    def __init__(self, engine: Engine, slot: _Slot):
        self.engine, self.slot, self.valid = engine, slot, True
        self.cells = 0     # unified pool: the room held for the borrower's decodes (reserve)

    @property
    def seq_id(self) -> int:
        return self.slot.seq_id

    def reserve(self, cells: int) -> bool:
        """Engine thread only: clear the sequence and hold room for decodes of
        positions 0 .. cells-1 on it, before the borrower starts a run of them.
        False while a unified pool has no such room (ask again at a later step);
        always True with one K/V stream per slot. Raises ValueError when `cells`
        exceeds the context, which no room could hold."""
        return self.valid and self.engine._reserve_lease(self, cells)

    def release(self) -> None:
        if self.valid and self.engine._lease is self:
            self.engine._end_lease()
        self.valid = False


class Engine:
    """Continuous batching over the resident context's sequence slots."""

    def __init__(self, model: ResidentModel, *, max_queue: int = 64, hook: DreamHook | None = None,
                 idle_interval: float = 0.05, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 adapter_max_rank: int = DEFAULT_MIXED_MAX_RANK):
        self.model = model
        self.lc = model.lc
        self.n_seq = model.config.n_seq
        self.n_batch = model.n_batch
        # A request's context budget: prompt + max_tokens <= slot_ctx. With one
        # K/V stream per slot that is the stream's size. With a unified cache
        # (kv_unified) every slot draws on one pool of n_ctx cells and a request
        # may use all of it: admission reserves prompt + max_tokens cells of the
        # pool, so an admitted request can always finish (_make_room).
        self.slot_ctx = self.lc.llama_n_ctx_seq(model.ctx)
        self.pool: int | None = model.n_ctx if model.config.kv_unified else None
        self.max_queue = max_queue
        self.hook: DreamHook = hook or NoDream()
        self.idle_interval = idle_interval
        # Version of the served adapter set; 0 = base model. The dream stage's
        # promotion bumps it between two decode batches (on this thread).
        self.adapter_version = 0
        # Which adapter each batch row decodes with: the base and adapters of rank
        # <= adapter_max_rank share every batch (selection.py).
        self.adapters = MixedAdapters(model, max_adapters, adapter_max_rank)
        # A request that names no adapter gets this one (the served default; the dream stage sets it).
        self.default_adapter: Callable[[], AdapterChoice] = lambda: BASE
        self.stats = EngineStats()
        self._vocab_ids = np.arange(model.n_vocab, dtype=np.int32)   # row index -> token id, for prompt scores
        self.slots = [_Slot(i) for i in range(self.n_seq)]
        self._lease: SequenceLease | None = None   # an idle slot lent to the dream hook
        self._cond = threading.Condition()
        self._inbox: deque[_Job] = deque()     # submitted, not yet tokenized
        self._waiting: deque[_Job] = deque()   # tokenized, waiting for a slot
        self._outstanding = 0                  # submitted and not finished
        self._ids = itertools.count(1)
        self._running = False
        self._thread: threading.Thread | None = None
        self._batch: llama_batch | None = None   # allocated by start()
        # The last decode batch, for the dream stage's pacer: all tokens in it, and
        # how many of them were single decode tokens of generating slots.
        self.last_batch_tokens = 0
        self.last_batch_decode_tokens = 0
        # The engine's own time for that batch (build, decode, sample, stream):
        # the pacer measures chat speed from this, not from gaps between batches.
        self.last_batch_s = 0.0
        # Why the last loop iteration failed (None once a batch decodes again):
        # /health reports an engine that cannot serve instead of "ok".
        self.failing: str | None = None

    # -- public, any thread -------------------------------------------------------
    def start(self) -> Engine:
        if self._running:
            return self
        self._batch = self.lc.llama_batch_init(self.n_batch, 0, 1)
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

    def forget_cached_prefixes(self) -> int:
        """Engine thread only: drop every idle slot's cached prefix, so no later
        request reuses it. An adapter swap calls this: those K/V were computed
        with the old weights. Returns the number of slots cleared."""
        cleared = 0
        for s in self.slots:
            if not s.busy and s.tokens:
                self.lc.llama_memory_seq_rm(self.model.memory, s.seq_id, -1, -1)
                s.tokens.clear()
                cleared += 1
        return cleared

    def hold_idle_sequence(self) -> SequenceLease | None:
        """Engine thread only (the dream hook): lend an idle slot's sequence for
        decodes of the hook's own (the drift probe) that span several hook
        calls; None when every slot is busy. The slot's cached prefix is
        dropped first (the borrower's decodes overwrite it). The loan ends with
        `release()`, or when serving needs the slot: `_admit` takes a lent slot
        only when no other is free, clears it, and marks the lease invalid, so
        a request never waits for the borrower. One lease at a time: asking
        again while it is valid returns the same lease. With a unified pool the
        borrower calls `lease.reserve(cells)` before each run of decodes: the
        lease holds that room, and admission ends the loan before a request waits."""
        if self._lease is not None and self._lease.valid:
            return self._lease
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        slot = min(idle, key=lambda s: len(s.tokens))   # the smallest cached prefix is the cheapest to lose
        self._clear_slot(slot)
        self._lease = SequenceLease(self, slot)
        return self._lease

    def _clear_slot(self, slot: _Slot) -> None:
        self.lc.llama_memory_seq_rm(self.model.memory, slot.seq_id, -1, -1)
        slot.tokens.clear()

    def pool_info(self) -> dict | None:
        """The unified pool's cells (/slots): None with one K/V stream per slot."""
        if self.pool is None:
            return None
        lease = self._lease.cells if self._lease is not None and self._lease.valid else 0
        reserved = sum(s.reserved for s in self.slots if s.busy)
        cached = sum(len(s.tokens) for s in self.slots if not s.busy)
        return {"cells": self.pool, "reserved": reserved, "cached": cached, "lent": lease,
                "free": self.pool - reserved - cached - lease, "evicted_prefixes": self.stats.evicted_prefixes}

    def _pool_demand(self, skip: tuple[_Slot, ...] = ()) -> int:
        """Cells of the unified pool spoken for: each busy slot's reservation, each idle
        slot's cached prefix (a prefix copied to n > 1 choices counts once per slot:
        never less than llama.cpp holds), the lease's room; `skip`'s slots left out."""
        lease = self._lease.cells if self._lease is not None and self._lease.valid else 0
        return lease + sum(s.reserved if s.busy else len(s.tokens) for s in self.slots if s not in skip)

    def _make_room(self, need: int, skip: tuple[_Slot, ...], take_lease: bool) -> bool:
        """Unified pool: True when `need` cells fit beside what is spoken for, after ending
        the lease (take_lease) and evicting idle slots' cached prefixes, least recently used
        first, as far as that takes. Nothing is taken when even all of it would not make the
        room: the request waits for busy slots to finish, and the prefixes stay."""
        assert self.pool is not None
        free = self.pool - self._pool_demand(skip)
        if need <= free:
            return True
        lease = self._lease if take_lease and self._lease is not None and self._lease.valid else None
        idle = sorted((s for s in self.slots if not s.busy and s.tokens and s not in skip), key=lambda s: s.used_at)
        if need > free + (lease.cells if lease else 0) + sum(len(s.tokens) for s in idle):
            return False
        if lease is not None and lease.cells:
            free += lease.cells
            self._end_lease()                         # serving takes the lent room back first
        for s in idle:
            if need <= free:
                break
            free += len(s.tokens)
            self._clear_slot(s)
            self.stats.evicted_prefixes += 1
        return True

    def _reserve_lease(self, lease: SequenceLease, cells: int) -> bool:
        if cells > self.slot_ctx:
            raise ValueError(f"a lent sequence of {cells} positions exceeds the context of {self.slot_ctx} tokens")
        self._clear_slot(lease.slot)
        if self.pool is None:
            return True
        lease.cells = 0
        if not self._make_room(cells, (), take_lease=False):
            return False
        lease.cells = cells
        return True

    def _end_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None and lease.valid:
            lease.valid, lease.cells = False, 0
            self._clear_slot(lease.slot)

    def _wake(self) -> None:
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

    def _call_hook(self, idle: bool) -> None:
        # A failing dream step must not take serving down: log, count, go on.
        try:
            self.hook.after_batch(self, idle)
        except Exception:
            self.stats.hook_errors += 1
            log.exception("dream hook failed (idle=%s)", idle)

    def _admission_held(self) -> bool:
        # A dream hook may hold admission (an optional `hold_admission(engine)`):
        # an adapter swap waits for the busy slots to drain, so every request
        # runs on one adapter version. Waiting requests then stay queued.
        hold = getattr(self.hook, "hold_admission", None)
        if hold is None:
            return False
        try:
            return bool(hold(self))
        except Exception:
            self.stats.hook_errors += 1
            log.exception("dream hook failed in hold_admission")
            return False

    def _fail_all(self, message: str) -> None:
        """Fail every active request and clear its sequence: the engine starts clean."""
        self.stats.decode_failures += 1
        for s in self.slots:
            if s.busy:
                job = s.job
                assert job is not None  # busy
                self.lc.llama_memory_seq_rm(self.model.memory, s.seq_id, -1, -1)
                s.tokens.clear()
                self._free_slot(s)
                self._finish_job(job, Failed(500, message), "error")

    def _send(self, job: _Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a dead consumer (closed loop) cancels its request
            job.handle.cancelled = True

    def _finish_job(self, job: _Job, event: Event, outcome: str) -> None:
        # followers still attached: the group was never admitted, and ends as its leader does
        followers, job.followers = job.followers, []
        for f in [job, *followers]:
            self._send(f, event)
            self.stats.count_request(outcome)
        with self._cond:
            self._outstanding -= 1 + len(followers)

    def _intake(self, jobs: list[_Job]) -> None:
        for job in jobs:
            # Whatever goes wrong with one request fails that request and
            # releases its place; the others are still taken in.
            try:
                self._intake_one(job)
            except Exception as e:
                log.exception("intake of request %d failed", job.handle.id)
                bad_text = isinstance(e, UnicodeError)
                self._finish_job(job, Failed(400 if bad_text else 500, f"prompt: {type(e).__name__}: {e}",
                                             "prompt" if bad_text else None), "invalid" if bad_text else "error")

    def _intake_one(self, job: _Job) -> None:
        m = self.model
        if job.handle.cancelled:
            self._finish_job(job, Failed(499, "cancelled before admission"), "cancelled")
            return
        req = job.request
        if isinstance(req.prompt, str):
            toks = m.tokenize(req.prompt, add_special=req.add_special, parse_special=True)
        else:
            toks = list(req.prompt)
            bad = next((t for t in toks if not isinstance(t, int) or not 0 <= t < m.n_vocab), None)
            if bad is not None:
                msg = f"prompt token {bad!r} is not in the vocabulary (0..{m.n_vocab - 1})"
                self._finish_job(job, Failed(400, msg, "prompt"), "invalid")
                return
        if not toks:
            self._finish_job(job, Failed(400, "prompt is empty after tokenization", "prompt"), "invalid")
            return
        budget, words = self._budget(1 + len(job.followers))
        room = budget - len(toks)
        if req.max_tokens is None or room < 1:
            if room < 1:
                self._finish_job(job, Failed(400, f"{req.prompt_param}: the prompt has {len(toks)} tokens; {words}, "
                                                  "leaving no room to generate", req.prompt_param), "invalid")
                return
            max_tokens = room
        elif req.max_tokens > room:
            self._finish_job(job, Failed(400, f"prompt ({len(toks)} tokens) plus max_tokens ({req.max_tokens}) "
                                              f"exceeds {words}", "max_tokens"), "invalid")
            return
        else:
            max_tokens = req.max_tokens
        job.prompt, job.max_tokens = toks, max_tokens
        self._waiting.append(job)

    def _budget(self, choices: int) -> tuple[int, str]:
        """The most prompt + max_tokens one choice of a request of `choices` may take, and
        those numbers in words for a 400. One stream per slot: the stream. A unified pool:
        all of it, split evenly between the choices of n > 1 (each reserves its own)."""
        if self.pool is None:
            return self.slot_ctx, (f"the per-slot context of {self.slot_ctx} tokens "
                                   f"(n_ctx {self.model.n_ctx} / {self.n_seq} slots)")
        if choices == 1:
            return self.slot_ctx, f"the context of {self.slot_ctx} tokens (shared by {self.n_seq} slots)"
        share = self.slot_ctx // choices
        return share, f"the context of {self.slot_ctx} tokens split between {choices} choices ({share} each)"

    def _reap_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.handle.cancelled]:
            self._waiting.remove(job)
            self._finish_job(job, Failed(499, "cancelled before admission"), "cancelled")
        for s in self.slots:
            if s.job is not None and s.job.handle.cancelled:
                self._release(s, None, "cancelled")

    def _admit(self) -> None:
        if self._waiting and self._admission_held():
            return
        while self._waiting:
            lent = self._lease.slot if self._lease is not None else None
            free = [s for s in self.slots if not s.busy and s is not lent]
            job = self._waiting[0]
            need = 1 + len(job.followers)
            if len(free) < need and lent is not None and not lent.busy:
                self._end_lease()                   # serving needs the lent slot back
                free.append(lent)
            if len(free) < need:
                return
            # the default is read here, after hold_admission applied any booked promotion
            adapter = job.request.adapter if job.request.adapter is not None else self.default_adapter()
            slot, n_common = max(((s, _common_prefix(s.tokens, job.prompt) if s.adapter.key == adapter.key else 0)
                                  for s in free), key=_slot_preference)
            others = [s for s in free if s is not slot][:need - 1]
            # A unified pool: the group's cells must fit now (each choice reserves prompt +
            # max_tokens), else it waits at the head of the queue for busy slots to finish.
            if self.pool is not None and not self._make_room(need * (len(job.prompt) + job.max_tokens),
                                                             (slot, *others), take_lease=True):
                return
            self._waiting.popleft()
            job.adapter = adapter
            for f in job.followers:
                f.adapter = job.adapter
            if not self._acquire_adapter(job, need):
                continue
            fresh = not job.request.cache_prompt or job.request.prompt_logprobs is not None
            # At least the last prompt token is decoded again: its logits are needed.
            n_common = 0 if fresh else min(n_common, len(job.prompt) - 1)
            group = [job, *job.followers]
            samplers = self._samplers(group)
            if samplers is None:
                for _ in range(need):
                    self.adapters.release(job.adapter)
                continue
            job.followers = []
            self._seat(slot, job, samplers[0], n_common)
            for follower, fslot, sampler in zip(group[1:], others, samplers[1:], strict=True):
                follower.prompt, follower.max_tokens = job.prompt, job.max_tokens
                self._clear_slot(fslot)
                self._seat(fslot, follower, sampler, len(job.prompt))
                fslot.pending, fslot.awaiting = [], slot

    def _acquire_adapter(self, job: _Job, need: int) -> bool:
        """One reference to the job's adapter per slot it takes; False (the job failed) when it cannot load."""
        got = 0
        try:
            for _ in range(need):
                self.adapters.acquire(job.adapter)
                got += 1
            return True
        except (AdapterLoadError, AdaptersFull) as e:
            for _ in range(got):
                self.adapters.release(job.adapter)
            status = 503 if isinstance(e, AdaptersFull) else 422
            self._finish_job(job, Failed(status, f"adapter {job.adapter.label}: {e}", "model"), "error")
            return False

    def _samplers(self, group: list[_Job]) -> list[Sampler] | None:
        """One sampler per job of an admitted group; None (the group failed with a 400) if one cannot be built."""
        made: list[Sampler] = []
        try:
            for j in group:
                made.append(Sampler(self.model.vocab, self.model.n_vocab, j.request.sampling))
            return made
        except Exception as e:  # noqa: BLE001 - a grammar or sampling value llama.cpp refused
            for m in made:
                m.free()
            leader = group[0]
            leader.followers = group[1:]
            if isinstance(e, GrammarError):
                self._finish_job(leader, Failed(400, str(e), "grammar"), "invalid")
            else:
                self._finish_job(leader, Failed(400, f"sampler could not be built: {e}", "sampling"), "invalid")
            return None

    def _seat(self, slot: _Slot, job: _Job, sampler: Sampler, n_common: int) -> None:
        """Put `job` in `slot`, keeping the first n_common cached prompt tokens."""
        self.lc.llama_memory_seq_rm(self.model.memory, slot.seq_id, n_common, -1)
        del slot.tokens[n_common:]
        slot.job, slot.sampler = job, sampler
        slot.prompt_scores = [None]
        slot.pending = job.prompt[n_common:]
        slot.next_token = None
        slot.generated = 0
        slot.cached = n_common
        slot.stream = TextStream(job.request.stop)
        slot.adapter = job.adapter
        slot.adapter_version = job.adapter.served_version
        slot.first_token_at = None
        slot.awaiting = None
        slot.reserved = len(job.prompt) + job.max_tokens
        slot.used_at = time.perf_counter()
        self.stats.prompt_tokens += len(job.prompt)
        self.stats.prompt_tokens_cached += n_common     # a follower's whole prompt: its leader's copied K/V
        self._send(job, Admitted(slot.seq_id, slot.adapter_version, len(job.prompt), n_common, slot.adapter))

    def _step(self) -> bool:
        """Build and decode one batch; sample and stream. False when there was nothing to decode."""
        t_start = time.perf_counter()
        lc, batch = self.lc, self._batch
        assert batch is not None  # allocated before the loop runs
        tok, nseq, seq, logits = batch.token, batch.n_seq_id, batch.seq_id, batch.logits
        # llama_cpp annotates llama_batch.pos as an array of arrays; it is flat (llama_pos *)
        pos = cast("ctypes.Array[ctypes.c_int32]", batch.pos)
        n = 0
        outputs: list[tuple[_Slot, int]] = []
        prompt_rows: list[tuple[_Slot, int, int]] = []   # (slot, batch row, prompt position it predicts)
        copies: list[tuple[_Slot, _Slot]] = []   # (leader, follower): the prompt's K/V to copy after this decode
        rows: list[AdapterChoice] = []           # each row's adapter, for the seam
        working = [s for s in self.slots if s.busy and (s.next_token is not None or (
            s.pending and not (s.job is not None and s.job.request.embed)))]
        turn = self.adapters.batch_keys([s.adapter.key for s in working])
        # Generating slots first: each costs one token, so decode never starves.
        for s in self.slots:
            if s.busy and s.next_token is not None and s.adapter.key in turn:
                tok[n], pos[n], nseq[n], logits[n] = s.next_token, len(s.tokens), 1, 1
                seq[n][0] = s.seq_id
                rows.append(s.adapter)
                s.tokens.append(s.next_token)
                s.next_token = None
                outputs.append((s, n))
                n += 1
        n_decode = n
        for s in self.slots:
            if n >= self.n_batch:
                break
            if s.busy and s.pending and not (s.job is not None and s.job.request.embed) and s.adapter.key in turn:
                take = min(len(s.pending), self.n_batch - n)
                chunk, s.pending = s.pending[:take], s.pending[take:]
                base = len(s.tokens)
                score = s.job is not None and s.job.request.prompt_logprobs is not None
                for i, t in enumerate(chunk):
                    tok[n], pos[n], nseq[n], logits[n] = t, base + i, 1, int(score)
                    seq[n][0] = s.seq_id
                    if score and (s.pending or i < len(chunk) - 1):
                        prompt_rows.append((s, n, base + i + 1))
                    n += 1
                s.tokens.extend(chunk)
                rows += [s.adapter] * len(chunk)
                if not s.pending:
                    logits[n - 1] = 1
                    outputs.append((s, n - 1))
                    joining = [f for f in self.slots if f.awaiting is s]
                    outputs += [(f, n - 1) for f in joining]     # the same row: the same distribution
                    copies += [(s, f) for f in joining]
        if n == 0:
            return False
        self.adapters.bind(rows)
        batch.n_tokens = n
        self.last_batch_tokens = n
        self.last_batch_decode_tokens = n_decode
        rc = lc.llama_decode(self.model.ctx, batch)
        self.stats.decode_batches += 1
        self.stats.mixed_batches += len({r.key for r in rows}) > 1
        if rc != 0:
            self._decode_failed(rc, outputs)
            self.last_batch_s = time.perf_counter() - t_start
            if rc != 1:
                self.failing = f"llama_decode failed with status {rc}"
            return True
        self.failing = None
        for leader, f in copies:
            # one stream per slot: a whole-stream copy, done by llama.cpp before the next decode;
            # a unified pool: the prompt's cells are tagged with the follower's sequence too
            self.lc.llama_memory_seq_rm(self.model.memory, f.seq_id, -1, -1)
            self.lc.llama_memory_seq_cp(self.model.memory, leader.seq_id, f.seq_id, -1, -1)
            f.tokens, f.awaiting = list(leader.tokens), None
        self._score_prompts(prompt_rows, copies)
        self._sample(outputs)
        self.last_batch_s = time.perf_counter() - t_start
        return True

    def _embed_waiting(self) -> None:
        """Answer each admitted embedding request whole: its prompt decoded alone, in batches
        of n_batch with the context's embeddings on (llama.cpp then outputs every token),
        pooled by mean and L2-normalized. Streams wait meanwhile, as for a prompt chunk."""
        for s in self.slots:
            job = s.job
            if job is None or not job.request.embed or job.handle.cancelled:
                continue
            lc, ctx, batch = self.lc, self.model.ctx, self._batch
            assert batch is not None
            pos = cast("ctypes.Array[ctypes.c_int32]", batch.pos)
            total = np.zeros(self.model.n_embd, dtype=np.float64)
            lc.llama_memory_seq_rm(self.model.memory, s.seq_id, 0, -1)
            s.tokens.clear()
            lc.llama_set_embeddings(ctx, True)
            try:
                for a in range(0, len(job.prompt), self.n_batch):
                    chunk = job.prompt[a:a + self.n_batch]
                    for i, t in enumerate(chunk):
                        batch.token[i], pos[i], batch.n_seq_id[i], batch.logits[i] = t, a + i, 1, 1
                        batch.seq_id[i][0] = s.seq_id
                    batch.n_tokens = len(chunk)
                    self.adapters.bind([s.adapter] * len(chunk))
                    if lc.llama_decode(ctx, batch) != 0:
                        raise RuntimeError("llama_decode failed for an embedding request")
                    s.tokens.extend(chunk)
                    for i in range(len(chunk)):
                        total += np.ctypeslib.as_array(lc.llama_get_embeddings_ith(ctx, i), shape=(self.model.n_embd,))
            except RuntimeError as e:      # this request fails; the others go on
                lc.llama_memory_seq_rm(self.model.memory, s.seq_id, -1, -1)
                s.tokens.clear()
                self._free_slot(s)
                self._finish_job(job, Failed(500, str(e)), "error")
                continue
            finally:
                lc.llama_set_embeddings(ctx, False)
            mean = total / len(job.prompt)
            norm = float(np.linalg.norm(mean)) or 1.0
            event = Embedded(tuple(float(x) for x in mean / norm), len(job.prompt))
            s.pending = []
            self._free_slot(s)
            self._finish_job(job, event, "stop")

    def _score_prompts(self, rows: list[tuple[_Slot, int, int]], copies: list[tuple[_Slot, _Slot]]) -> None:
        """Score prompt positions from their rows' logits (the raw model distribution); send
        PromptScored to each slot whose prompt this batch finished, and to its followers (`copies`)."""
        for s, idx, at in rows:
            job = s.job
            if job is None or job.request.prompt_logprobs is None:
                continue
            row = self.lc.llama_get_logits_ith(self.model.ctx, idx)
            logits = np.ctypeslib.as_array(row, shape=(self.model.n_vocab,)).astype(np.float64)
            s.prompt_scores.append(scored(self._vocab_ids, log_softmax(logits), job.prompt[at],
                                          job.request.prompt_logprobs))
        for s in {r[0] for r in rows}:
            if s.job is not None and not s.pending:
                scores = PromptScored(tuple(s.prompt_scores))
                for j in [s.job, *(f.job for leader, f in copies if leader is s and f.job is not None)]:
                    self._send(j, scores)

    def _sample(self, outputs: list[tuple[_Slot, int]]) -> None:
        """Sample each slot that has an output row; stream its text; release finished slots."""
        now = time.perf_counter()
        eog = self.model.is_eog
        for s, idx in outputs:
            job, stream, sampler = s.job, s.stream, s.sampler
            if job is None or stream is None or sampler is None or job.handle.cancelled:
                continue
            top = job.request.logprobs
            if top is None:
                token, logprob = sampler.sample(self.model.ctx, idx), None
            else:
                token, logprob = sampler.sample_scored(self.model.ctx, idx, top)
            s.generated += 1
            self.stats.generated_tokens += 1
            if s.first_token_at is None:
                s.first_token_at = now
                self.stats.ttft.observe(now - job.submitted)
            else:
                self.stats.itl.observe(now - s.t_last)
            s.t_last = now
            if (eog(token) and not job.request.ignore_eos) or token in job.request.stop_tokens:
                self._release(s, "stop")
                continue
            text = stream.push(self.model.token_piece(token))
            self._send(job, Delta(text, token, logprob))
            if stream.stopped:
                self._release(s, "stop", flush=False)
            elif s.generated >= job.max_tokens:
                self._release(s, "length")
            else:
                s.next_token = token

    def _decode_failed(self, rc: int, outputs) -> None:
        # Status 1 means no free K/V cells; others are hard errors. Either way the
        # batch's slots are failed and their sequences cleared, and serving goes on.
        self.stats.decode_failures += 1
        msg = ("the K/V cache has no room for this batch" if rc == 1 else f"llama_decode failed with status {rc}")
        for s in self.slots:
            if s.busy and (s in (o[0] for o in outputs) or s.pending):
                self.lc.llama_memory_seq_rm(self.model.memory, s.seq_id, -1, -1)
                s.tokens.clear()
                job = s.job
                assert job is not None  # busy
                self._free_slot(s)
                self._finish_job(job, Failed(500 if rc != 1 else 503, msg), "error")

    def _release(self, s: _Slot, reason: str | None, outcome: str | None = None, flush: bool = True) -> None:
        job = s.job
        assert job is not None, "released a free slot"
        if reason is not None and flush and s.stream is not None:
            tail = s.stream.flush()
            if tail:
                self._send(job, Delta(tail, -1))
        if reason is None:
            event: Event = Failed(499, "cancelled")
        else:
            event = Finished(reason, len(job.prompt), s.generated, s.cached, s.adapter_version, s.adapter)
        self._free_slot(s)
        self._finish_job(job, event, outcome or reason or "cancelled")

    def _free_slot(self, s: _Slot) -> None:
        for f in self.slots:
            if f.awaiting is s:           # its leader left before the prompt was decoded: decode it itself
                assert f.job is not None
                f.awaiting, f.pending, f.cached = None, list(f.job.prompt), 0
        if s.sampler is not None:
            s.sampler.free()
        if s.job is not None:
            self.adapters.release(s.job.adapter)
        s.sampler = None
        s.job = None
        s.reserved = 0
        s.used_at = time.perf_counter()
        s.pending = []
        s.next_token = None
        s.stream = None
        # s.tokens stays: the next request may extend this prefix.

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


def _slot_preference(cand: tuple[_Slot, int]) -> tuple:
    """Which free slot a request takes (the max): one whose cache it continues (the
    common prefix, computed with the same adapter, is at least half of what the slot
    holds), the longest first; else an empty slot, so another conversation's cache is
    not given up for a shared template header; else the longest common prefix; on a
    tie the least recently used."""
    slot, common = cand
    continues = common > 0 and 2 * common >= len(slot.tokens)
    return (continues, common if continues else -1, not slot.tokens, common, -slot.used_at)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
