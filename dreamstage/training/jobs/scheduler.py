"""The dream stage in the engine loop: training jobs between decode batches.

`DreamScheduler` is the engine's `DreamHook`. Everything it does with llama
(the Trainer, adapter loads, the served-adapter swap) happens on the engine
thread, inside `after_batch` and `hold_admission`. The HTTP side talks to it
only through the job store (submit, pause, resume, cancel are store
transitions the engine reads before each micro-step) and through a small
command queue (promote, rollback) whose results come back as futures.

One job trains at a time, FIFO. The job's whole life (render, starting,
trainer construction through the memory gate, the walk with its chunk
ladder, held-out evaluation, save, promotion) is one generator, `_job_steps` (program.py);
each `next()` runs at most one native micro-step. After a decode batch the
scheduler advances it once when the Pacer allows; with no active slot it
advances it repeatedly (after the idle grace) until a request arrives, so a
directed request waits at most one micro-step.

What each name serves, and how a promotion or rollback changes it, is
`served.py` (`AdapterSwitch`); this module applies a booked change at the
next batch boundary, busy slots or not (each slot keeps its own adapter).
Jobs train one at a time, round-robin across adapter names (`JobStore.queue`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

from dreamstage.adapters.choice import DEFAULT_MAX_ADAPTERS, DEFAULT_MIXED_MAX_RANK
from dreamstage.adapters.loaded import AdapterLoadError
from dreamstage.adapters.served import AdapterSwitch, ServedAdapters
from dreamstage.serving import rpc
from dreamstage.stats import DreamStats
from dreamstage.training.drift.record_file import DriftRecordFile
from dreamstage.training.jobs.memory import release_freed_memory
from dreamstage.training.jobs.program import AdapterSaveError, JobProgram
from dreamstage.training.jobs.request import check_adapter_name
from dreamstage.training.jobs.store import TERMINAL, InvalidTransition, JobStore
from dreamstage.training.pacing.pacer import DEFAULT_IDLE_GRACE_S, Pacer
from dreamstage.training.pacing.shaper import StepShaper
from dreamstage.training.pacing.threads import DreamThreads, StepRan
from dreamstage.training.pacing.warmup import AnchorWarmup
from dreamstage.training.walk.examples import RenderedJob
from dreamstage.training.walk.trainer import native_trainer

log = logging.getLogger("dreamstage.scheduler")


class AdapterInUse(RuntimeError):
    """An adapter a request or the training job is using cannot be unloaded."""

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


def _refused_for(worker: str) -> rpc.WorkerFailed:
    """What an adapter command gets while the RPC worker at `worker` is gone."""
    return rpc.WorkerFailed(f"the RPC worker at {worker} failed: adapters load again once it answers and the model "
                            "is loaded again")


class DreamScheduler(JobProgram):
    """The DreamHook: runs the job queue on the engine thread, paced."""

    def __init__(self, store: JobStore, resident, *, make_trainer: Callable | None = None,
                 served: ServedAdapters | None = None, idle_grace_s: float = DEFAULT_IDLE_GRACE_S,
                 clock: Callable[[], float] = time.monotonic, drift_guard: bool = True,
                 record_file: DriftRecordFile | None = None, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 adapter_budget_mib: float | None = None, adapter_max_rank: int = DEFAULT_MIXED_MAX_RANK):
        self.store = store
        self.drift_guard = drift_guard
        self._anchor_records: dict = {}   # prompt -> the base's AnchorBase, shared by every job of this process
        self._noise_margins: dict = {}    # (anchors, adapter shape) -> the drift noise margin (DriftGuard.noise_margin)
        # both kept across restarts (record_file.py): loaded here, saved when the warm-up or a job ends
        self._record_file = record_file if drift_guard else None
        if self._record_file is not None:
            self._anchor_records, self._noise_margins = self._record_file.load()
        self._warmup: AnchorWarmup | None = None   # records them while idle, before any job (warmup.py)
        self._served_at = -math.inf                # when the last decode batch ended
        self.resident = resident
        self.make_trainer = make_trainer or native_trainer
        self.switch = AdapterSwitch(store, served if served is not None else ServedAdapters(resident),
                                    max_adapters, adapter_budget_mib, adapter_max_rank)
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
        self._step_ran: StepRan | None = None         # next()'s step, for the shaper
        self._pause_t0 = 0.0                            # when the current pause began (the scheduler's clock)
        self._hook_done_at: float | None = None         # when after_batch last returned with a busy slot
        self._figures_at = 0.0
        self._figures_final: int | None = None          # the job whose final figures _end stored
        self._closing: list[Any] = []   # trainers of the job in progress (closed if the server stops)
        self._unrecorded: dict[int, str] = {}   # job -> error message the store could not take yet
        self._stepping = False          # the engine thread is inside the job's next()
        self.stats = DreamStats()       # engine thread writes; /metrics reads
        self._wake_engine: Callable[[], None] = lambda: None    # the engine's wake (startup)

    # -- any thread ------------------------------------------------------------------
    def notify_submitted(self, job_id: int, rendered: RenderedJob | None = None) -> None:
        """A job was committed; `rendered` saves the engine from rendering it again."""
        with self._lock:
            if rendered is not None:
                self._rendered[job_id] = rendered
            self._kick = True
        self._wake_engine()

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

    def rollback(self, name: str | None = None) -> concurrent.futures.Future:
        """Undo the latest promotion of `name` (None: of any name). The future's result is (view, applied_future)."""
        return self._command("rollback", (name,))

    def mirror(self, live: list[tuple[int, str, int]]) -> concurrent.futures.Future:
        """A follower's: serve exactly the leader's live promotions [(served_version, name, version)].
        The future's result is (the default's view, applied_future)."""
        return self._command("mirror", (live,))

    def retire(self, name: str) -> concurrent.futures.Future:
        """Unload `name` (DELETE /adapters/{name}): its promotions rolled back, its
        handles freed. The future raises AdapterInUse while a request or the job uses it."""
        return self._command("retire", (name,))

    def check_file(self, name: str | None, path: str) -> concurrent.futures.Future:
        """Whether llama.cpp loads `path` for this model and (unless name is None) it fits as `name`
        (an import's check, on the engine thread). The future's result is None."""
        return self._command("check", (name, path))

    def _command(self, kind: str, args: tuple) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append((kind, args, fut))
        self._wake_engine()                             # an idle engine takes it now, not at its next poll
        return fut

    @property
    def active_job(self) -> int | None:
        return self._job_id

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
        self._wake_engine = getattr(engine, "wake", self._wake_engine)
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
        if self._record_file is not None:
            self._save_records()        # what the warm-up or a job's guard recorded so far
            self._record_file.wait()
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

        A booked promotion or rollback applies here, between two batches, so
        the requests admitted next resolve to it; nothing waits for it."""
        if self._commands:
            self._run_commands(engine)
        if self.switch.pending is not None:
            self.switch.apply_pending(engine)
        return False

    def after_batch(self, engine, idle: bool) -> None:
        if self._unrecorded:
            self._record_failures()
        if self._commands:
            self._run_commands(engine)
        if self.switch.pending is not None:
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
        if state == "paused" or (state == "held" and self._failed_worker()):
            return False                          # held: until the worker is back and the engine reloaded
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
                ran = self._step_ran
                self._shaper.record_overhead(seconds - ran.before_s - ran.native_ms / 1000.0)
                if ran.kind == "stopped":
                    self._shaper.record_stopped(seconds, ran.tokens, ran.threads)
                elif ran.kind == "aborted":
                    self._shaper.record_aborted(ran.tokens)
                elif ran.kind == "resumed":
                    self._shaper.record_rest(seconds, ran.tokens, ran.threads, ran.trains)
                elif ran.kind == "ok":
                    self._shaper.record(seconds, ran.tokens, ran.threads, ran.trains)
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
            self._save_records()
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

    def _warm_anchors(self, engine) -> None:
        """No job, nobody served: one step of recording the default anchors ahead of time."""
        if self._warmup is None:
            access = self._probe_access(engine)
            if access is None:
                return
            self._warmup = AnchorWarmup(self.resident, self._anchor_records, *access,
                                        noise_cache=self._noise_margins, make_trainer=self.make_trainer)
        if not self._warmup.step():
            return
        if self._warmup.take_recorded() or self._warmup.done:
            self._save_records()

    def _save_records(self) -> None:
        if self._record_file is not None:
            self._record_file.save_in_background(self._anchor_records, self._noise_margins)

    # -- promotion and rollback (engine thread) ------------------------------------------------
    def _retire(self, engine, name: str) -> int:
        if self._job_id is not None and self.store.get(self._job_id)["out"] == name:
            raise AdapterInUse(f"adapter {name!r} is training (job {self._job_id}); cancel the job first")
        adapters = getattr(engine, "adapters", None)
        if adapters is not None and not adapters.unload(name):
            raise AdapterInUse(f"adapter {name!r} is answering requests; retry when they finish")
        return self.switch.retire(engine, name)

    def _run_commands(self, engine) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, args, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            if kind != "retire" and (gone := self._failed_worker()) is not None:
                fut.set_exception(_refused_for(gone))    # it would be placed on the dead worker's buffers
                continue
            try:
                view: dict | None
                applied: concurrent.futures.Future = concurrent.futures.Future()
                if kind == "promote":
                    name, version = args
                    view = self.switch.book_promotion(name, version, applied)
                elif kind == "rollback":
                    view = self.switch.book_rollback(applied, *args)
                elif kind == "mirror":
                    view = self.switch.book_mirror(args[0], applied)
                elif kind == "retire":
                    fut.set_result(self._retire(engine, *args))
                    continue
                else:
                    name, path = args
                    if name is not None:
                        self.switch.check_room(name, path)
                    self.switch.served.discard(self.switch.served.load(path))
                    fut.set_result(None)
                    continue
                fut.set_result((view, applied))
            except AdapterLoadError as e:
                # a worker that failed under the load refused the adapter's buffers: not the file's fault
                gone = self._failed_worker()
                fut.set_exception(e if gone is None else _refused_for(gone))
            except Exception as e:  # noqa: BLE001 - reported to the caller, never raised into the engine
                fut.set_exception(e)
