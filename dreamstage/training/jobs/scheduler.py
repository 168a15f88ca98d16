"""The dream stage in the engine loop: training jobs between decode batches.

`DreamScheduler` is the engine's `DreamHook`. Everything it does with llama
(the Trainer, adapter loads, the served-adapter swap) happens on the engine
thread, inside `after_batch` and `hold_admission`. The HTTP side talks to it
only through the job store (submit, pause, resume, cancel are store
transitions the engine reads before each micro-step) and through a small
command queue (promote, rollback) whose results come back as futures.

One job trains at a time, FIFO. The job's whole life (render, starting,
trainer construction through the memory gate, the walk with its chunk
ladder, held-out evaluation, save, promotion) is one generator, `_job_steps`;
each `next()` runs at most one native micro-step. After a decode batch the
scheduler advances it once when the Pacer allows; with no active slot it
advances it repeatedly (after the idle grace) until a request arrives, so a
directed request waits at most one micro-step.

What serves, and how a promotion or rollback becomes a swap between two
batches, is `served.py` (`AdapterSwitch`); this module only decides when
the pending swap may be applied (no busy slot).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import math
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

from dreamstage.adapters.served import (
    AdapterLoadError,
    AdapterSwitch,
    ServedAdapters,
    auto_promote_decision,
)
from dreamstage.stats import DreamStats
from dreamstage.training.drift.decoding import set_context_adapter
from dreamstage.training.drift.guard import DriftGuard, drift_figures, drift_receipt, promotion_decision
from dreamstage.training.drift.measure import summary
from dreamstage.training.drift.rehearsal import consolidation_lr, rehearsal_window
from dreamstage.training.drift.stopping import ExampleHold, OwnLoss, held_windows, reply_lost
from dreamstage.training.jobs.spec import DEFAULT_CHUNK, GATE_SLACK_MIB, JobSpec, check_adapter_name
from dreamstage.training.jobs.store import TERMINAL, AdapterNotFound, InvalidTransition, JobStore
from dreamstage.training.pacing.pacer import DEFAULT_IDLE_GRACE_S, Pacer
from dreamstage.training.pacing.shaper import DreamThreads, StepShaper, load_average, trains_from
from dreamstage.training.pacing.warmup import AnchorWarmup
from dreamstage.training.walk.examples import RenderedJob, render_job
from dreamstage.training.walk.groups import TrainGroup
from dreamstage.training.walk.plan import JobRun, ladder
from dreamstage.training.walk.receipts import Receipt

log = logging.getLogger("dreamstage.scheduler")

# How long one idle call may keep training before it returns to the engine
# loop (which then waits idle_interval and calls again). A request arriving
# meanwhile is seen after the current micro-step.
IDLE_BURST_S = 0.5
# Pacing figures are written to the job row at most this often (and at the end).
FIGURES_EVERY_S = 1.0
# How often the queue is polled when nobody said a job was submitted.
QUEUE_POLL_S = 0.5
# The anchors are recorded ahead of any job only once nothing was served for
# this long: a gap between a steady client's requests (tens of ms) is not
# idle time the warm-up may take, since nothing paces it.
WARMUP_AFTER_IDLE_S = 1.0


class AdapterSaveError(RuntimeError):
    """The finished job's adapter could not be written; the job ends `error` with this message."""


def release_freed_memory() -> None:
    """Give freed heap back to the OS after a job's trainers are closed.

    glibc keeps freed chunks in its arenas, so a trainer's few hundred MB
    stayed in the process's RSS after a cancel although nothing used them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass                    # not glibc: nothing to trim


def native_trainer(resident, spec: JobSpec, chunk: int, lr: float | None = None):
    """The native Trainer for a job (lr=0 makes an evaluator that never moves).

    An evaluator (lr given) runs the plain walk: it needs only the forward
    loss, which both walks compute alike, and the exact walk would add a
    reverse pass and adjoint buffers for nothing."""
    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer  # needs the native core

    exact = spec.exact and lr is None
    return Trainer(resident, LoraConfig(**spec.lora_fields()), cache_type=spec.context_cache_type,
                   window=spec.window, chunk=chunk, budget_mib=spec.memory_budget_mib or 0.0,
                   slack_mib=GATE_SLACK_MIB, optimizer=OptimizerConfig(lr=spec.lr if lr is None else lr), exact=exact,
                   horizon=(spec.horizon or 0) if exact else -1, recompute=spec.recompute)


def clear_receipt(receipt: Any, spec: JobSpec) -> Any:
    """A receipt as the job stores it: a negative allowance becomes 0 with a message that says why."""
    if isinstance(receipt, Receipt):
        return receipt.with_clear_allowance(spec.memory_budget_mib, GATE_SLACK_MIB)
    return receipt


def _waited_note(waited: int) -> list[str]:
    """The job's note on epochs its early stop waited for the examples' greedy replies (none: [])."""
    if not waited:
        return []
    return [f"the early stop waited {waited} epoch{'s' * (waited > 1)} for every example's greedy reply"]


class DreamScheduler:
    """The DreamHook: runs the job queue on the engine thread, paced."""

    def __init__(self, store: JobStore, resident, *, make_trainer: Callable | None = None,
                 served: ServedAdapters | None = None, idle_grace_s: float = DEFAULT_IDLE_GRACE_S,
                 clock: Callable[[], float] = time.monotonic, drift_guard: bool = True):
        self.store = store
        self.drift_guard = drift_guard
        self._anchor_records: dict = {}   # prompt -> the base's AnchorBase, shared by every job of this process
        self._noise_margins: dict = {}    # (anchors, adapter shape) -> the drift noise margin (DriftGuard.noise_margin)
        self._warmup: AnchorWarmup | None = None   # records them while idle, before any job (warmup.py)
        self._served_at = -math.inf                # when the last decode batch ended
        self.resident = resident
        self.make_trainer = make_trainer or native_trainer
        self.switch = AdapterSwitch(store, served if served is not None else ServedAdapters(resident))
        self.idle_grace_s = idle_grace_s
        self.clock = clock
        self._lock = threading.Lock()
        self._commands: deque[tuple[str, tuple, concurrent.futures.Future]] = deque()
        self._rendered: dict[int, RenderedJob] = {}
        self._kick = True
        self._last_poll = -1e9
        self._job_id: int | None = None
        self._job: Generator[None, None, None] | None = None
        self._pacer: Pacer | None = None
        self._shaper: StepShaper | None = None
        self._threads: DreamThreads | None = None
        # next()'s step, for the shaper: chunk tokens, threads, trained, "ok" | "stopped" | "resumed",
        # its native ms, and the pause's time before it
        self._step_ran: tuple[int, int, bool, str, float, float] | None = None
        self._pause_t0 = 0.0                            # when the current pause began (the scheduler's clock)
        self._hook_done_at: float | None = None         # when after_batch last returned with a busy slot
        self._figures_at = 0.0
        self._figures_final: int | None = None          # the job whose final figures _end stored
        self._closing: list[Any] = []   # trainers of the job in progress (closed if the server stops)
        self._unrecorded: dict[int, str] = {}   # job -> error message the store could not take yet
        self._stepping = False          # the engine thread is inside the job's next()
        self.stats = DreamStats()       # engine thread writes; /metrics reads

    # -- any thread ------------------------------------------------------------------
    def notify_submitted(self, job_id: int, rendered: RenderedJob | None = None) -> None:
        """A job was committed; `rendered` saves the engine from rendering it again."""
        with self._lock:
            if rendered is not None:
                self._rendered[job_id] = rendered
            self._kick = True

    def forget(self, job_id: int) -> None:
        """Drop a job's rendered windows (it was cancelled while queued): its
        memory goes back now, not when the job would have started."""
        with self._lock:
            self._rendered.pop(job_id, None)

    def queued_tokens(self) -> int:
        """Tokens the rendered, not yet started jobs hold in memory (for the queue limit)."""
        with self._lock:
            held = list(self._rendered.values())
        return sum(len(w.tokens) for r in held for w in (*r.train, *r.held_out))

    def promote(self, name: str, version: int | None = None) -> concurrent.futures.Future:
        """Book and apply a promotion. The future's result is (view, applied_future)."""
        check_adapter_name(name)
        return self._command("promote", (name, version))

    def rollback(self) -> concurrent.futures.Future:
        return self._command("rollback", ())

    def _command(self, kind: str, args: tuple) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append((kind, args, fut))
        return fut

    @property
    def active_job(self) -> int | None:
        return self._job_id

    def pacing_ledger(self) -> tuple[float, float, float, float] | None:
        """The running job's pacer ledger (`Pacer.ledger`), or None."""
        return self._pacer.ledger() if self._pacer is not None else None

    def pacing(self) -> dict | None:
        p = self._pacer
        if p is None:
            return None
        return {**p.figures(), **(self._shaper.figures() if self._shaper is not None else {})}

    @property
    def served(self):
        """The llama handles of the adapter serving runs with (`served.ServedAdapters`)."""
        return self.switch.served

    @property
    def served_error(self) -> str | None:
        """Why the stored served adapter could not be reloaded (None: it was, or there is none)."""
        return self.switch.served_error

    # -- startup and shutdown (the engine thread is not running) ----------------------------
    def startup(self, engine, adapter_path: str | None = None) -> None:
        """Reload the served adapter the store names; import and promote
        `adapter_path` (--adapter). Call before the engine starts."""
        self.switch.reload(engine, adapter_path)

    def close(self, wait_s: float = 60.0) -> None:
        """After the engine thread stopped: free the job's trainers and mark it interrupted.

        If the engine thread is still inside a micro-step (its join timed out),
        wait for it; past `wait_s` leave the native state alone (freeing it under
        a running step would crash) and let recovery mark the job at the next start."""
        deadline = time.monotonic() + wait_s
        while self._stepping and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._stepping:
            log.error("a micro-step is still running after %.0f s; leaving the dream stage as it is", wait_s)
            return
        if self._warmup is not None:
            self._warmup.stop()
        job, jid = self._job, self._job_id
        self._job = self._job_id = None
        if job is not None:
            try:
                job.close()
            except Exception:  # shutting down
                log.exception("closing the active job")
        for t in self._closing:
            t.close()
        self._closing.clear()
        if jid is not None:
            try:
                if self.store.state(jid) not in TERMINAL:
                    self.store.transition(jid, "interrupted", "the server stopped while the job was training; "
                                                              "its in-memory adapter and optimizer state were lost")
            except Exception:  # the store may be closed already
                log.exception("marking job %s interrupted", jid)
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for _, _, fut in commands:
            fut.set_exception(RuntimeError("the server is shutting down"))

    # -- the engine's hooks ---------------------------------------------------------------
    def hold_admission(self, engine) -> bool:
        """Called by the engine before admitting requests: True keeps them waiting.

        A pending adapter swap holds admission until the busy slots drain,
        then is applied here, between two batches."""
        if self._commands:
            self._run_commands(engine)
        if self.switch.pending is None:
            return False
        if engine.busy_slots():
            return True
        self.switch.apply_pending(engine)
        return False

    def after_batch(self, engine, idle: bool) -> None:
        if self._unrecorded:
            self._record_failures()
        if self._commands:
            self._run_commands(engine)
        if self.switch.pending is not None and not engine.busy_slots():
            self.switch.apply_pending(engine)
        if not idle and self._pacer is not None:
            self._pacer.record_batch(engine.last_batch_decode_tokens, self._batch_seconds(engine),
                                     getattr(engine, "last_batch_tokens", None))
        try:
            if not idle:
                self._served_at = self.clock()
            if self._job is None and not self._pick(engine):
                if idle and self.clock() - self._served_at >= WARMUP_AFTER_IDLE_S:
                    self._warm_anchors(engine)
                return
            if self._warmup is not None:
                self._warmup.stop()                     # the job's guard records what is missing
            if idle or not engine.busy_slots():
                # the batch that just ended freed the last slot: the gap before the
                # next request is idle time, used at once when the pacer allows
                deadline = self.clock() + IDLE_BURST_S
                while self._job is not None and engine.queue_depth == 0 and self.clock() < deadline:
                    if not self._advance(engine, 0):
                        break
            else:
                self._advance(engine, engine.busy_slots())
            self._flush_figures(final=False)
        finally:
            self._hook_done_at = self.clock() if engine.busy_slots() else None

    def _batch_seconds(self, engine) -> float | None:
        """The engine's time for the batch just decoded. An engine that does not
        say (`last_batch_s`) is timed from the hook's last return, which is only
        batch work when a slot was busy then (an idle engine waits in between)."""
        measured = getattr(engine, "last_batch_s", None)
        if measured is not None:
            return float(measured)
        if self._hook_done_at is None:
            return None
        return max(0.0, self.clock() - self._hook_done_at)

    # -- jobs -------------------------------------------------------------------------------
    def _pick(self, engine) -> bool:
        now = self.clock()
        with self._lock:
            kicked, self._kick = self._kick, False
        if not kicked and now - self._last_poll < QUEUE_POLL_S:
            return False
        self._last_poll = now
        jid = self.store.next_queued()
        if jid is None:
            return False
        self._job_id = jid
        self._job = self._job_steps(jid, engine)
        return True

    def _advance(self, engine, active_slots: int) -> bool:
        """Run the job one step if its state and the pacer allow; False when nothing ran."""
        jid, job = self._job_id, self._job
        assert jid is not None and job is not None  # called only while a job is active
        state = self.store.state(jid)
        if state in TERMINAL:                     # cancelled by the server (or ended by the job itself)
            self._end_job()
            return False
        if state == "paused":
            return False
        pacer = self._pacer
        if pacer is not None and state == "running" and not pacer.should_dream(active_slots):
            return False
        t0 = self._pause_t0 = self.clock()
        self._stepping = True
        self._step_ran = None
        try:
            next(job)
        except StopIteration:
            self._end_job()
        except AdapterSaveError as e:
            log.error("dream job %s: %s", jid, e)
            self._fail(jid, str(e))
            self._end_job()
        except (OSError, sqlite3.OperationalError) as e:
            # The store could not take a receipt (a full or unwritable disk):
            # stop the job rather than train on without a record of it.
            log.error("dream job %s: the state directory cannot be written: %s", jid, e)
            self._fail(jid, f"the state directory cannot be written ({e}); the job stopped")
            self._end_job()
        except Exception as e:  # a failing job must not take serving down
            log.exception("dream job %s failed", jid)
            self._fail(jid, f"internal error in the dream stage: {type(e).__name__}: {e}")
            self._end_job()
        finally:
            self._stepping = False
            seconds = self.clock() - t0             # the whole pause serving saw, store writes included
            self.stats.pause.observe(seconds)
            if pacer is not None:
                waited = 0.0
                if active_slots == 0 and engine.queue_depth:
                    # a request arrived during an idle step; an engine that cannot say
                    # when is charged the whole step (the most it can have waited)
                    oldest = getattr(engine, "oldest_wait_s", None)
                    waited = oldest() if oldest is not None else seconds
                pacer.record_dream(seconds, waited)
            if self._shaper is not None and self._step_ran is not None:
                tokens, threads, trains, kind, native_ms, before = self._step_ran
                self._shaper.record_overhead(seconds - before - native_ms / 1000.0)
                if kind == "stopped":
                    self._shaper.record_stopped(seconds, tokens, threads)
                elif kind == "resumed":
                    self._shaper.record_rest(seconds, tokens, threads, trains)
                elif kind == "ok":
                    self._shaper.record(seconds, tokens, threads, trains)
        return True

    def _end_job(self) -> None:
        job, jid = self._job, self._job_id
        if self._figures_final != jid or jid is None:
            self._flush_figures(final=True)             # ended elsewhere (refused, error, cancelled)
        self._figures_final = None
        self._job = self._job_id = None
        self._pacer = self._shaper = None
        if job is not None:
            job.close()                                 # runs the generator's finally: trainers closed
            release_freed_memory()
        with self._lock:
            if jid is not None:
                self._rendered.pop(jid, None)
            self._kick = True                           # the next queued job may start at once

    def _fail(self, jid: int, message: str) -> None:
        try:
            if self.store.state(jid) not in TERMINAL:
                self.store.transition(jid, "error", message)
        except InvalidTransition:
            pass
        except (OSError, sqlite3.Error) as e:
            # The store cannot be written either (a full disk). Keep the
            # verdict and write it as soon as it can be, so the job does not
            # stay "running" with no message until a restart.
            log.error("job %s: recording its error failed (%s); will retry", jid, e)
            self._unrecorded[jid] = message

    def unrecorded_error(self, job_id: int) -> str | None:
        """The error a job ended with that the store could not take yet (a full disk)."""
        return self._unrecorded.get(job_id)

    def _record_failures(self) -> None:
        for jid, message in list(self._unrecorded.items()):
            try:
                if self.store.state(jid) not in TERMINAL:
                    self.store.transition(jid, "error", message)
                del self._unrecorded[jid]
            except InvalidTransition:
                del self._unrecorded[jid]
            except (OSError, sqlite3.Error):
                return

    def _flush_figures(self, final: bool) -> None:
        if self._pacer is None or self._job_id is None:
            return
        now = self.clock()
        if final or now - self._figures_at >= FIGURES_EVERY_S:
            self._figures_at = now
            try:
                self.store.set_pacing(self._job_id, self.pacing() or {})
            except (OSError, sqlite3.OperationalError) as e:   # a full disk: figures are not worth a job
                log.warning("job %s: pacing figures not stored: %s", self._job_id, e)

    def _end(self, jid: int, target: str, message: str) -> Generator[None, None, None]:
        """Move the job to a final state; a pause that raced in waits for resume.
        The pacing figures are stored first, so the final state's event and a
        GET /train/{id} after it show the same job (_end_job then leaves them)."""
        self._flush_figures(final=True)
        self._figures_final = jid
        while True:
            try:
                self.store.transition(jid, target, message)
                return
            except InvalidTransition as e:
                if e.current != "paused":
                    return                              # cancelled (or ended) meanwhile: that stands
                yield

    def _job_steps(self, jid: int, engine) -> Generator[None, None, None]:
        """One job, start to end; every `yield` follows at most one native micro-step."""
        store = self.store
        spec = store.spec(jid)
        with self._lock:
            rendered = self._rendered.pop(jid, None)
        store.transition(jid, "starting")
        if rendered is None:
            try:
                rendered = render_job(spec, self.resident)
            except ValueError as e:
                yield from self._end(jid, "error", f"the examples no longer render: {e}")
                return
        yield
        try:
            trainer, spec = self._job_trainer(spec, engine)
        except Exception as e:  # noqa: BLE001 - the gate's refusal (DreamError) or a bad value
            receipt = getattr(e, "receipt", None)
            if receipt is not None:
                receipt = clear_receipt(receipt, spec)
                if getattr(receipt, "status", "") == "refused":
                    self.stats.count_refusal("memory_gate")   # the job's training cache did not fit
                store.append_receipt(jid, receipt)
            state = "refused" if receipt is not None and getattr(receipt, "status", "") == "refused" else "error"
            yield from self._end(jid, state, f"the dream stage could not start: {getattr(receipt, 'message', '') or e}")
            return
        self._closing.append(trainer)
        try:
            yield from self._train(jid, spec, rendered, trainer, engine)
        finally:
            trainer.close()
            self._closing.remove(trainer)

    def _job_trainer(self, spec: JobSpec, engine) -> tuple[Any, JobSpec]:
        """The job's Trainer and the spec its walk runs under. When the guard
        will run (`_probe_access`) with the regularizer on, the trainer's window is long enough for
        the rehearsal windows (drift_guard.rehearsal_window), and a job whose
        chunk is its whole window walks them whole too (up to DEFAULT_CHUNK);
        the job's examples stay cut to its own window (render_job). Should the
        memory gate refuse that, the job's own window and chunk are tried (the
        rehearsal then trains the anchors that fit, as the guard's note says)."""
        guarded = self._probe_access(engine) is not None
        window = rehearsal_window(self.resident, spec) if guarded else spec.window
        if window != spec.window:
            chunk = min(DEFAULT_CHUNK, window) if spec.chunk == spec.window else spec.chunk
            wide = dataclasses.replace(spec, window=window, chunk=chunk)
            try:
                return self.make_trainer(self.resident, wide, wide.chunk), wide
            except Exception as e:  # noqa: BLE001 - refused (or failed) at the longer window: try the job's own
                log.info("a trainer window of %d for the rehearsal failed (%s); using the job's %d",
                         window, getattr(getattr(e, "receipt", None), "message", "") or e, spec.window)
        return self.make_trainer(self.resident, spec, spec.chunk), spec

    def _train(self, jid: int, spec: JobSpec, rendered: RenderedJob, trainer, engine) -> Generator[None, None, None]:
        store = self.store
        self._pacer = Pacer.from_spec(spec.pacing, idle_grace_s=self.idle_grace_s, clock=self.clock)
        self._threads = DreamThreads(self.resident)
        # the pause ladder halves down to one token: below the memory floor
        # (min_chunk) too, since a small chunk is the only way to a short pause
        self._shaper = None
        if spec.pacing.max_pause_ms is not None:
            # the plain walk's gradient depends on where a window is cut: keep its
            # chunk and let the step deadline bound the pause (StepShaper.keep_chunk)
            self._shaper = StepShaper(spec.pacing.max_pause_ms, ladder(spec.chunk, 1), self._threads.counts,
                                      other_load=load_average, cores=os.cpu_count(),
                                      keep_chunk=not getattr(trainer, "exact", False))
        self._figures_at = self.clock()
        store.transition(jid, "running")
        self.stats.job_started()
        yield                                           # from here on the pacer decides each step
        guard = self._drift_guard(spec, rendered, engine)
        if guard is not None:
            yield from guard.record_or_fail(trainer)    # the base's anchor answers and their noise, in short steps
            if (note := guard.rehearsal_note()) is not None:
                log.info("dream job %s: %s", jid, note)
        run = JobRun(store, jid, spec, guard.windows if guard else rendered.train, guard.order if guard else None)
        own = OwnLoss(len(rendered.train), spec.stop_loss)
        if guard is not None:
            # the guard's set-up (its windows, the rehearsal note) took a step of its
            # own: the first micro-step's pause, which the shaper fits, is its own
            yield
        notes: list[str] = []
        eval_before = None
        if rendered.held_out and spec.promote == "auto":
            eval_before = yield from self._evaluate(spec, trainer, rendered.held_out, spec.chunk, notes)
        begun = None
        consolidating = False                           # in the rehearsal-only epochs (spec.consolidate)
        hold: ExampleHold | None = None                 # the examples through those epochs
        consolidate_note = -1                           # where `notes` says how many of them ran
        checkable = [i for i, w in enumerate(rendered.train) if not isinstance(w, TrainGroup)]
        stop_leads: tuple[list[int], list[float]] | None = None   # the replies' leads the early stop read
        waited = 0                                      # epochs the early stop waited for the greedy replies
        decay: tuple[int, int] | None = None            # (windows begun, windows in all) of a decaying consolidation
        memory_cap = spec.chunk                         # the memory ladder's chunk (halved on a refusal)
        resume_threads: int | None = None               # set while a step stopped at its deadline waits to go on
        while (cur := run.current()) is not None:
            group = isinstance(cur[0], TrainGroup)      # the native core picks a group's steps
            trains = None if group else trains_from(cur[0].mask, cur[1].chunk_pos)
            if resume_threads is not None:              # the last step stopped at its deadline: go on with it
                chunk, threads = run.walk.chunk, resume_threads
            else:
                chunk, threads = (self._shaper.choose(memory_cap, trains, cut=group)
                                  if self._shaper is not None else (run.walk.chunk, self._threads.serve_batch))
            if chunk != run.walk.chunk:
                run.walk.chunk = chunk                  # the walk and the trainer move together
                trainer.set_chunk(chunk)
                cur = run.current()
                assert cur is not None  # the same position, cut to another chunk
            window, step = cur
            if step.chunk_pos == 0 and begun != (step.epoch, step.order_pos):
                if group:
                    trainer.begin_group(window.prefix, window.replies, window.share_prefix)
                else:
                    if decay is not None:               # the window's update at its share of the falling step
                        trainer.set_lr(consolidation_lr(spec.lr, *decay))
                        decay = (decay[0] + 1, decay[1])
                    trainer.begin_window(window.tokens, window.mask, window.soft)
                begun = (step.epoch, step.order_pos)
            before = self.clock() - self._pause_t0      # this pause's work so far (a new window's set-up)
            if self._shaper is not None:
                deadline = self._shaper.deadline_ms()
                # the deadline is on the native step; the pause began earlier
                trainer.set_step_deadline(None if deadline is None else max(1.0, deadline - 1000.0 * before))
            receipt = clear_receipt(self._threads.run(threads, trainer.micro_step), spec)
            self.stats.record(receipt)
            # for the shaper: a whole step, a stopped part, or the end of a stopped step (record_rest)
            kind = "stopped" if receipt.status == "stopped" else "resumed" if resume_threads is not None else "ok"
            self._step_ran = ((receipt.chunk_tokens, threads, receipt.tokens > 0, kind, receipt.ms, before)
                              if receipt.status in ("ok", "stopped") else None)
            resume_threads = threads if receipt.status == "stopped" else None
            if (self._shaper is not None and self._shaper.keep_chunk and not group and receipt.status == "ok"
                    and receipt.ms > spec.pacing.max_pause_ms
                    and not getattr(trainer, "last_step_stoppable", False)):
                # a step the deadline could not stop (a graph on a GPU) passed the bound: cut chunks from now on
                log.info("dream job %s: a %.0f ms step could not stop at its deadline; the pause bound cuts chunks "
                         "from now on", jid, receipt.ms)
                self._shaper.cut()
            try:
                done = trainer.chunks_left == 0
                event = run.record(receipt, window_done=done,
                                   reply_losses=trainer.group_reply_losses() if group and done else None)
                own.note(step.window_index, receipt)
            except InvalidTransition:
                # a pause raced the end JobRun recorded (refused at the floor, or an
                # error receipt): the receipt is stored; end the job once resumed
                target = "refused" if receipt.status == "refused" else "error"
                yield from self._end(jid, target, receipt.message or f"the micro-step was {receipt.status}")
                return
            if event == "retry":
                memory_cap = run.chunk
                trainer.set_chunk(run.chunk)            # same position, smaller chunk (nothing was allocated)
            elif event in ("refused", "error"):
                return                                  # JobRun moved the job and kept every receipt
            elif event in ("epoch", "done"):
                if consolidating and hold is not None:
                    # a rehearsal-only epoch ended: kept only while the examples hold (ExampleHold):
                    # every greedy reply that was answered still is, and every loss within its bound
                    why = None
                    if guard is not None and hold.leads is not None:
                        now = yield from guard.reply_leads(trainer, [rendered.train[i] for i in hold.windows])
                        why = reply_lost(hold.windows, hold.leads, now)
                    if why is None:
                        per = yield from self._window_losses(spec, trainer, [rendered.train[i] for i in hold.windows],
                                                             memory_cap, notes, "the examples' loss")
                        why = hold.check(None if per is None else [loss for loss, _ in per])
                    if why is None:
                        hold.snapshot = trainer.lora_parameters()
                    else:
                        trainer.set_lora_parameters(hold.snapshot)
                        run.end_here()                              # no more rehearsal-only epochs
                        notes[consolidate_note] = (
                            f"then {hold.kept} of {spec.consolidate} rehearsal-only epochs (consolidate): after the "
                            f"next one {why}, so the adapter is the one before it")
                        event = "done"
                ev = None
                if rendered.held_out:
                    ev = yield from self._evaluate(spec, trainer, rendered.held_out, memory_cap, notes)
                stop = own.converged() and event == "epoch"
                if stop and guard is not None and not consolidating:
                    # the loss says stop; the greedy replies must say so too (a mean hides one token)
                    idx = held_windows(own.final, checkable)
                    leads = yield from guard.reply_leads(trainer, [rendered.train[i] for i in idx])
                    if leads is not None and min(leads, default=1.0) <= 0.0:
                        stop, waited = False, waited + 1
                    elif leads is not None:
                        stop_leads = (idx, leads)
                run.end_epoch(ev, own.mean)
                if (stop or event == "done") and guard is not None and not consolidating and guard.consolidates():
                    # the job's own training is over: rehearsal-only epochs follow (spec.consolidate)
                    if stop:
                        notes.append(own.stop_note(run.walk.epoch))
                    notes.extend(_waited_note(waited))
                    consolidating = True
                    hold = ExampleHold(own.final, spec.stop_loss, checkable, trainer.lora_parameters())
                    if stop_leads is not None and stop_leads[0] == hold.windows:
                        hold.leads = stop_leads[1]
                    else:
                        hold.leads = yield from guard.reply_leads(trainer, [rendered.train[i] for i in hold.windows])
                    run.consolidate(spec.consolidate, guard.consolidation_order)
                    if spec.consolidate_decay:
                        decay = (0, sum(len(guard.consolidation_order(c)) for c in range(spec.consolidate)))
                    consolidate_note = len(notes)
                    notes.append(f"then {spec.consolidate} rehearsal-only epochs (consolidate)")
                    stop, event = False, "epoch"
                if stop:
                    notes.append(own.stop_note(run.walk.epoch))
                    notes.extend(_waited_note(waited))
                    yield
                    break
                if guard is not None and event == "epoch":
                    p = store.get(jid)["progress"]
                    drift = yield from guard.measure_during(trainer, p["train_ms"], p["step"])
                    self._store_drift(jid, spec, drift, run.walk.epoch, final=False)
            yield
        if guard is not None:
            drift = yield from guard.measure_or_fail(trainer)
            self._store_drift(jid, spec, drift, run.walk.epoch, final=True)
        progress = store.get(jid)["progress"]
        message = yield from self._finish(jid, spec, trainer, progress["eval_loss"], eval_before, guard)
        if guard is not None and (note := guard.rehearsal_note()) is not None:
            notes.append(note)
        if guard is not None and guard.neighbour_prompts:
            notes.append(f"rehearsed {len(guard.neighbour_prompts)} neighbours of its prompts each epoch")
        yield from self._end(jid, "done", "; ".join([message, *notes]))

    def _evaluate(self, spec: JobSpec, trainer, windows, chunk: int,
                  notes: list[str]) -> Generator[None, None, float | None]:
        """Held-out loss of the shadow adapter as it is now (the token-weighted
        mean of `_window_losses`); None when it could not be measured, noted."""
        per = yield from self._window_losses(spec, trainer, windows, chunk, notes, "held-out loss")
        tokens = sum(t for _, t in per or ())
        return sum(loss * t for loss, t in per) / tokens if per and tokens else None

    def _window_losses(self, spec: JobSpec, trainer, windows, chunk: int, notes: list[str],
                       what: str) -> Generator[None, None, list[tuple[float, int]] | None]:
        """Each window's forward loss (and loss tokens) under the shadow adapter as it is now.

        The native core has no forward-only pass yet, so an evaluator is a
        second Trainer of the same shape with lr 0 (its AdamW update moves
        nothing) holding a copy of the shadow's parameters; its micro-steps'
        losses are exactly the forward loss. It costs a second training cache
        and a wasted backward, goes through the same memory gate, and its
        receipts are not the job's. A refusal or a failed step returns None
        and notes that `what` was not measured."""
        try:
            evaluator = self.make_trainer(self.resident, spec, chunk, 0.0)
        except Exception as e:  # noqa: BLE001 - any refusal or failure of the evaluator only costs the figure
            receipt = getattr(e, "receipt", None)
            why = (receipt is not None and receipt.message) or e
            notes.append(f"{what} not measured: the evaluator was refused ({why})")
            return None
        self._closing.append(evaluator)
        try:
            evaluator.set_lora_parameters(trainer.lora_parameters())
            out = []
            for w in windows:
                evaluator.begin_window(w.tokens, w.mask)
                pos, loss_sum, tokens = 0, 0.0, 0
                while evaluator.chunks_left:
                    step_chunk, threads = (self._shaper.choose(chunk, trains_from(w.mask, pos), cut=True)
                                           if self._shaper is not None
                                           else (chunk, self._threads.serve_batch if self._threads is not None else 0))
                    if step_chunk != evaluator.chunk:
                        evaluator.set_chunk(step_chunk)   # an evaluation step pauses serving like any other
                    r = (evaluator.micro_step() if self._threads is None
                         else self._threads.run(threads, evaluator.micro_step))
                    self._step_ran = ((r.chunk_tokens, threads, r.tokens > 0, "ok", r.ms, 0.0)
                                      if r.status == "ok" else None)
                    pos += r.chunk_tokens
                    yield
                    if r.status != "ok":
                        notes.append(f"{what} not measured: {r.message}")
                        return None
                    loss_sum += r.loss * r.tokens
                    tokens += r.tokens
                out.append((loss_sum / tokens if tokens else 0.0, tokens))
            return out
        finally:
            evaluator.close()
            self._closing.remove(evaluator)

    def _store_drift(self, jid: int, spec: JobSpec, drift, epoch: int, final: bool) -> None:
        """A drift measurement (None: none ran) as the job's receipt, and into /metrics."""
        figures = drift_figures(drift, spec.max_drift, spec.max_drift_kl, epoch, final)
        if drift is None or figures is None:
            return
        job = self.store.get(jid)
        self.store.append_receipt(jid, drift_receipt(figures, step=job["progress"]["step"], ms=drift.ms,
                                                     memory=job["memory"]))
        self.stats.record_drift(jid, drift)

    def _probe_access(self, engine) -> tuple[Callable[[], Any], Callable[[], None]] | None:
        """What a drift probe decodes with: the engine's sequence lender and the
        call that puts serving's adapter back. None when the guard is off on
        this server, or on a resident without llama handles or an engine that
        lends no sequence (test doubles)."""
        lend = getattr(engine, "hold_idle_sequence", None)
        if not self.drift_guard or getattr(self.resident, "ctx", None) is None or lend is None:
            return None
        served = self.switch.served
        return lend, lambda: set_context_adapter(self.resident, served.handle)

    def _drift_guard(self, spec: JobSpec, rendered: RenderedJob, engine) -> DriftGuard | None:
        """The job's drift guard, or None (`_probe_access`)."""
        access = self._probe_access(engine)
        if access is None:
            return None
        lend, restore = access
        return DriftGuard(self.resident, spec, rendered.train, seq_id=lend, cache=self._anchor_records,
                          noise_cache=self._noise_margins, restore=restore)

    def _warm_anchors(self, engine) -> None:
        """No job, nobody served: one step of recording the default anchors ahead of time."""
        if self._warmup is None:
            access = self._probe_access(engine)
            if access is None:
                return
            self._warmup = AnchorWarmup(self.resident, self._anchor_records, *access)
        self._warmup.step()

    def _finish(self, jid: int, spec: JobSpec, trainer, eval_after, eval_before,
                guard=None) -> Generator[None, None, str]:
        """Save the shadow adapter as a new version; promote per the job's rule. Returns the message."""
        store = self.store
        name = store.get(jid)["out"]
        version = store.next_adapter_version(name)
        path = store.adapter_path(name, version)
        try:
            trainer.save(path)                          # atomic: temp file, fsync, rename
        except OSError as e:
            # A full or unwritable state directory: atomic_file removed the temp
            # file and left every earlier version (and the served one) as it was.
            raise AdapterSaveError(f"saving adapter {name} v{version} failed: {e.strerror or e}; "
                                   "the previously saved and served adapters are unchanged") from e
        store.add_adapter(name, version, jid, eval_after,
                          drift_figures(guard.drift, spec.max_drift, spec.max_drift_kl) if guard is not None else None)
        yield
        saved = f"saved adapter {name} v{version}"
        if guard is not None and guard.drift is not None:
            saved += f" ({summary(guard.drift)})"
        if spec.promote == "never":
            return f"{saved}; not promoted (promote=never)"
        if spec.promote == "manual":
            return f"{saved}; promote it with POST /adapters/{name}/promote"
        if guard is not None:
            ok, why = promotion_decision(eval_before, eval_after, guard.drift, spec.max_drift, spec.max_drift_kl,
                                         guard.failure)
        else:
            ok, why = auto_promote_decision(eval_before, eval_after)
        if not ok:
            return f"{saved}; {why}"
        try:
            view = self.switch.book_promotion(name, version, None)
        except (AdapterLoadError, AdapterNotFound) as e:
            return f"{saved}; auto promotion failed: {e}"
        return f"{saved}; promoted as served version {view['served_version']} ({why})"

    # -- promotion and rollback (engine thread) ------------------------------------------------
    def _run_commands(self, engine) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, args, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                view: dict | None
                if kind == "promote":
                    name, version = args
                    applied: concurrent.futures.Future = concurrent.futures.Future()
                    view = self.switch.book_promotion(name, version, applied)
                else:
                    applied = concurrent.futures.Future()
                    view = self.switch.book_rollback(applied)
                fut.set_result((view, applied))
            except Exception as e:  # noqa: BLE001 - reported to the caller, never raised into the engine
                fut.set_exception(e)
