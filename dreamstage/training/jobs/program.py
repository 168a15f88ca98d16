"""A training job's program: its whole life as one generator, run on the engine thread.

`JobProgram._job_steps` renders the job, builds its trainer through the memory
gate, walks its windows (`_micro_step`), ends its epochs (`_epoch_end`: held-out
loss, the early stop, drift), runs the rehearsal-only epochs
(`_begin_consolidation`, `_consolidation_kept`), saves the adapter and applies
the promotion rule (`_finish`, jobs/promotion.py). Each `yield` follows at most
one native micro-step; the scheduler (scheduler.py) decides when `next()` runs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dreamstage.adapters.served import AdapterLoadError, AdapterSwitch
from dreamstage.adapters.versions import AdapterNotFound
from dreamstage.stats import DreamStats
from dreamstage.training.drift.guard import DriftGuard, drift_figures
from dreamstage.training.drift.measure import summary
from dreamstage.training.drift.rehearsal import consolidation_lr, rehearsal_window
from dreamstage.training.drift.stopping import ExampleHold, OwnLoss, held_windows, reply_lost
from dreamstage.training.jobs.hold import WorkerHold
from dreamstage.training.jobs.measures import JobMeasures
from dreamstage.training.jobs.promotion import promotion_decision
from dreamstage.training.jobs.spec import DEFAULT_CHUNK, GATE_SLACK_MIB, JobSpec
from dreamstage.training.jobs.store import InvalidTransition, JobStore
from dreamstage.training.pacing.pacer import Pacer
from dreamstage.training.pacing.shaper import StepShaper, trains_from
from dreamstage.training.pacing.threads import DreamThreads, StepRan, load_average
from dreamstage.training.walk.examples import RenderedJob, render_job
from dreamstage.training.walk.groups import TrainGroup
from dreamstage.training.walk.plan import JobRun, ladder
from dreamstage.training.walk.receipts import Receipt

log = logging.getLogger("dreamstage.scheduler")


class AdapterSaveError(RuntimeError):
    """The finished job's adapter could not be written; the job ends `error` with this message."""


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


@dataclass
class JobLoop:
    """A job's walk between micro-steps: what its epoch ends and consolidation read and write."""

    jid: int
    spec: JobSpec
    rendered: RenderedJob
    trainer: Any
    guard: DriftGuard | None
    run: JobRun
    own: OwnLoss
    memory_cap: int                                 # the memory ladder's chunk (halved on a refusal)
    checkable: list[int]                            # the job's windows whose greedy reply can be checked
    notes: list[str] = field(default_factory=list)
    eval_before: float | None = None
    begun: tuple[int, int] | None = None            # the (epoch, order position) whose window was begun
    consolidating: bool = False                     # in the rehearsal-only epochs (spec.consolidate)
    hold: ExampleHold | None = None                 # the examples through those epochs
    consolidate_note: int = -1                      # where `notes` says how many of them ran
    stop_leads: tuple[list[int], list[float]] | None = None   # the replies' leads the early stop read
    waited: int = 0                                 # epochs the early stop waited for the greedy replies
    decay: tuple[int, int] | None = None            # (windows begun, windows in all) of a decaying consolidation
    resume_threads: int | None = None               # set while a step stopped at its deadline waits to go on
    record_turn: bool = False                       # the guard's next recording step comes before the next micro-step
    # with RPC workers: (TrainerCheckpoint, decay, the resident's loads) taken as the window
    # in progress began, what a job held for a failed worker resumes from (_hold)
    checkpoint: tuple[Any, tuple[int, int] | None, int] | None = None


class JobProgram(WorkerHold, JobMeasures):
    """The job's program; DreamScheduler (scheduler.py) is the one class that runs it."""

    store: JobStore
    resident: Any
    make_trainer: Callable
    switch: AdapterSwitch
    stats: DreamStats
    clock: Callable[[], float]
    idle_grace_s: float
    drift_guard: bool
    _lock: Any
    _rendered: dict[int, RenderedJob]
    _anchor_records: dict
    _noise_margins: dict
    _pacer: Pacer | None
    _shaper: StepShaper | None
    _threads: DreamThreads | None
    _step_ran: StepRan | None
    _pause_t0: float
    _figures_at: float
    _figures_final: int | None
    _closing: list[Any]

    if TYPE_CHECKING:
        def _flush_figures(self, final: bool) -> None: ...

        def _save_records(self) -> None: ...

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
            why = self._start_from_served(jid, trainer)
            if why is not None:
                yield from self._end(jid, "error", why)
                return
            yield from self._train(jid, spec, rendered, trainer, engine)
        finally:
            trainer.close()
            self._closing.remove(trainer)

    def _start_from_served(self, jid: int, trainer) -> str | None:
        """A job on a name that serves a version starts from it (a new name from zero).
        Returns why it cannot (its shape differs from the job's), else None."""
        name = self.store.get(jid)["out"]
        served = self.store.served(name)
        load = getattr(trainer, "load", None)
        if served is None or load is None:
            return None
        try:
            load(served["path"])
        except (ValueError, OSError) as e:
            return (f"adapter {name!r} serves v{served['version']}, which this job would continue, but its "
                    f"shape differs from the job's rank/targets/top_layers: {e}")
        log.info("dream job %s starts from %s v%d", jid, name, served["version"])
        return None

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
        """The walk, its epoch ends and the rehearsal-only epochs, then the save."""
        self._start_pacing(spec, trainer)
        self._figures_at = self.clock()
        self.store.transition(jid, "running")
        self.stats.job_started()
        yield                                           # from here on the pacer decides each step
        guard = self._drift_guard(spec, rendered, engine)
        try:
            if guard is not None:
                # the base's records the first epoch visits, in short steps; the rest
                # are made between the micro-steps (_record_turn)
                guard.start(trainer)
                while not guard.ready(0):
                    guard.step_recording()
                    yield
                self._note_records(jid, guard)
            run = JobRun(self.store, jid, spec, guard.windows if guard else rendered.train,
                         guard.order if guard else None)
            lp = JobLoop(jid, spec, rendered, trainer, guard, run, OwnLoss(len(rendered.train), spec.stop_loss),
                         memory_cap=spec.chunk,
                         checkable=[i for i, w in enumerate(rendered.train) if not isinstance(w, TrainGroup)])
            if guard is not None:
                # the guard's set-up (its windows) took a step of its own: the
                # first micro-step's pause, which the shaper fits, is its own
                yield
            if rendered.held_out and spec.promote == "auto":
                lp.eval_before = yield from self._evaluate(spec, trainer, rendered.held_out, spec.chunk, lp.notes)
            while True:
                if self._worker_lost(lp):              # between two steps (a decode batch saw it first)
                    if not (yield from self._hold(lp, None)):
                        return
                    continue
                if (yield from self._record_turn(lp)):
                    continue
                if run.current() is None:
                    break
                event = yield from self._micro_step(lp)
                if event is None:
                    return                              # the job ended (JobRun or _end moved it)
                if event in ("epoch", "done") and (yield from self._epoch_end(lp, event)):
                    yield
                    break
                yield
            yield from self._conclude(lp)
        finally:
            if guard is not None:
                guard.close()

    def _record_turn(self, lp: JobLoop) -> Generator[None, None, bool]:
        """While the guard still makes the job's records: one probe step in turn with
        each micro-step (so the pacer paces both alike), and before an epoch whose
        records are not all made yet, as many as it waits for. Never while a
        micro-step stopped at its deadline waits to go on. True: a step ran."""
        guard, walk = lp.guard, lp.run.walk
        if guard is None or not guard.recording or lp.resume_threads is not None:
            return False
        waits = not walk.finished and not walk.order_known and not guard.ready(walk.epoch, lp.consolidating)
        if not (waits or lp.record_turn):
            lp.record_turn = True
            return False
        lp.record_turn = False
        guard.step_recording()
        if not guard.recording:
            self._note_records(lp.jid, guard)
            self._save_records()                        # a restart before the job ends keeps them
        yield
        return True

    def _note_records(self, jid: int, guard: DriftGuard) -> None:
        """The job's progress says how many measured anchors are recorded so far."""
        made, total = guard.recorded()
        self.store.update_progress(jid, drift_records={"measured": made, "of": total, "pending": guard.recording})

    def _start_pacing(self, spec: JobSpec, trainer) -> None:
        """The job's pacer, thread counts and, with a pause bound, its step shaper."""
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

    def _micro_step(self, lp: JobLoop) -> Generator[None, None, str | None]:
        """One native micro-step at the walk's position; the event JobRun recorded (None: the job ended)."""
        spec, trainer, run = lp.spec, lp.trainer, lp.run
        threads_of = self._threads
        assert threads_of is not None  # set by _start_pacing
        cur = run.current()
        assert cur is not None  # the caller checked
        group = isinstance(cur[0], TrainGroup)          # the native core picks a group's steps
        trains = None if group else trains_from(cur[0].mask, cur[1].chunk_pos)
        if lp.resume_threads is not None:               # the last step stopped at its deadline: go on with it
            chunk, threads = run.walk.chunk, lp.resume_threads
        else:
            chunk, threads = (self._shaper.choose(lp.memory_cap, trains, cut=group)
                              if self._shaper is not None else (run.walk.chunk, threads_of.serve_batch))
        if chunk != run.walk.chunk:
            run.walk.chunk = chunk                      # the walk and the trainer move together
            trainer.set_chunk(chunk)
            cur = run.current()
            assert cur is not None  # the same position, cut to another chunk
        window, step = cur
        if step.chunk_pos == 0 and lp.begun != (step.epoch, step.order_pos):
            if lp.checkpoint is None and self._workers():   # the first window's: later ones come as windows end
                self._checkpoint(lp)
            if group:
                trainer.begin_group(window.prefix, window.replies, window.share_prefix)
            else:
                if lp.decay is not None:                # the window's update at its share of the falling step
                    trainer.set_lr(consolidation_lr(spec.lr, *lp.decay))
                    lp.decay = (lp.decay[0] + 1, lp.decay[1])
                trainer.begin_window(window.tokens, window.mask, window.soft)
            lp.begun = (step.epoch, step.order_pos)
        before = self.clock() - self._pause_t0          # this pause's work so far (a new window's set-up)
        if self._shaper is not None:
            deadline = self._shaper.deadline_ms()
            # the deadline is on the native step; the pause began earlier
            trainer.set_step_deadline(None if deadline is None else max(1.0, deadline - 1000.0 * before))
            limit = self._shaper.abort_ms()
            trainer.set_step_abort(None if limit is None else max(1.0, limit - 1000.0 * before))
        receipt = clear_receipt(threads_of.run(threads, trainer.micro_step), spec)
        self.stats.record(receipt)
        # for the shaper: a whole step, a stopped part, or the end of a stopped step (record_rest)
        kind = (receipt.status if receipt.status in ("stopped", "aborted")
                else "resumed" if lp.resume_threads is not None else "ok")
        self._step_ran = (StepRan(receipt.chunk_tokens, threads, receipt.tokens > 0, kind, receipt.ms, before)
                          if receipt.status in ("ok", "stopped", "aborted") else None)
        lp.resume_threads = threads if receipt.status == "stopped" else None
        if lp.checkpoint is not None:
            gone = self._failed_worker() if receipt.status == "error" else None
            if gone is not None or (receipt.status == "ok" and trainer.chunks_left == 0 and not self._checkpoint(lp)):
                # a failed step, or the window's update lost before it was copied out: the window again
                return "step" if (yield from self._hold(lp, receipt)) else None
        if (self._shaper is not None and self._shaper.keep_chunk and not group and receipt.status == "ok"
                and spec.pacing.max_pause_ms is not None and receipt.ms > spec.pacing.max_pause_ms
                and not getattr(trainer, "last_step_stoppable", False)):
            # a step the deadline could not stop (a graph on a GPU) passed the bound: cut chunks from now on
            log.info("dream job %s: a %.0f ms step could not stop at its deadline; the pause bound cuts chunks "
                     "from now on", lp.jid, receipt.ms)
            self._shaper.cut()
        try:
            done = trainer.chunks_left == 0
            losses = trainer.group_reply_losses() if group and done else None
            event = run.record(receipt, window_done=done, reply_losses=losses)
            lp.own.note(step.window_index, receipt)
            if losses is not None:
                lp.own.note_group(step.window_index, losses, [w for _, _, w in window.replies])
        except InvalidTransition:
            # a pause raced the end JobRun recorded (refused at the floor, or an
            # error receipt): the receipt is stored; end the job once resumed
            target = "refused" if receipt.status == "refused" else "error"
            yield from self._end(lp.jid, target, receipt.message or f"the micro-step was {receipt.status}")
            return None
        if event == "retry":
            lp.memory_cap = run.chunk
            trainer.set_chunk(run.chunk)                # same position, smaller chunk (nothing was allocated)
        elif event in ("refused", "error"):
            return None                                 # JobRun moved the job and kept every receipt
        return event

    def _epoch_end(self, lp: JobLoop, event: str) -> Generator[None, None, bool]:
        """An epoch (or the walk) ended: held-out loss, the early stop, the start of
        the rehearsal-only epochs, the drift during training. True: training stops here."""
        spec, trainer, run, guard, own, rendered = lp.spec, lp.trainer, lp.run, lp.guard, lp.own, lp.rendered
        if lp.consolidating and lp.hold is not None:
            event = yield from self._consolidation_kept(lp, event)
        ev = None
        if rendered.held_out:
            ev = yield from self._evaluate(spec, trainer, rendered.held_out, lp.memory_cap, lp.notes)
        stop = own.converged() and event == "epoch"
        if stop and guard is not None and not lp.consolidating:
            # the loss says stop; the greedy replies must say so too (a mean hides one token)
            idx = held_windows(own.final, lp.checkable)
            leads = yield from guard.reply_leads(trainer, [rendered.train[i] for i in idx])
            if leads is not None and min(leads, default=1.0) <= 0.0:
                stop, lp.waited = False, lp.waited + 1
            elif leads is not None:
                lp.stop_leads = (idx, leads)
        run.end_epoch(ev, own.mean)
        if (stop or event == "done") and guard is not None and not lp.consolidating:
            yield from guard.until_rehearsed()          # which rehearsal anchors fit is known once all are made
        if (stop or event == "done") and guard is not None and not lp.consolidating and guard.consolidates():
            # the job's own training is over: rehearsal-only epochs follow (spec.consolidate)
            yield from self._begin_consolidation(lp, guard, stop)
            stop, event = False, "epoch"
        if stop:
            lp.notes.append(own.stop_note(run.walk.epoch))
            lp.notes.extend(_waited_note(lp.waited))
            return True
        if guard is not None and event == "epoch":
            p = self.store.get(lp.jid)["progress"]
            drift = yield from guard.measure_during(trainer, p["train_ms"], p["step"])
            self._store_drift(lp.jid, spec, drift, run.walk.epoch, final=False, recorded=guard.recorded())
        return False

    def _begin_consolidation(self, lp: JobLoop, guard: DriftGuard, stopped: bool) -> Generator[None, None, None]:
        """The job's own epochs are over: the examples' hold, then spec.consolidate rehearsal-only epochs."""
        spec, trainer, run = lp.spec, lp.trainer, lp.run
        if stopped:
            lp.notes.append(lp.own.stop_note(run.walk.epoch))
        lp.notes.extend(_waited_note(lp.waited))
        lp.consolidating = True
        hold = lp.hold = ExampleHold(lp.own.final, spec.stop_loss, lp.checkable, trainer.lora_parameters())
        if lp.stop_leads is not None and lp.stop_leads[0] == hold.windows:
            hold.leads = lp.stop_leads[1]
        else:
            hold.leads = yield from guard.reply_leads(trainer, [lp.rendered.train[i] for i in hold.windows])
        run.consolidate(spec.consolidate, guard.consolidation_order)
        if spec.consolidate_decay:
            lp.decay = (0, sum(len(guard.consolidation_order(c)) for c in range(spec.consolidate)))
        lp.consolidate_note = len(lp.notes)
        lp.notes.append(f"then {spec.consolidate} rehearsal-only epochs (consolidate)")

    def _consolidation_kept(self, lp: JobLoop, event: str) -> Generator[None, None, str]:
        """A rehearsal-only epoch ended: kept only while the examples hold (ExampleHold):
        every greedy reply that was answered still is, and every loss within its bound.
        Otherwise the adapter goes back to before it and the walk ends ("done")."""
        hold, trainer, guard = lp.hold, lp.trainer, lp.guard
        assert hold is not None  # the caller checked
        windows = [lp.rendered.train[i] for i in hold.windows]
        why = None
        if guard is not None and hold.leads is not None:
            now = yield from guard.reply_leads(trainer, windows)
            why = reply_lost(hold.windows, hold.leads, now)
        if why is None:
            per = yield from self._window_losses(lp.spec, trainer, windows, lp.memory_cap, lp.notes,
                                                 "the examples' loss")
            why = hold.check(None if per is None else [loss for loss, _ in per])
        if why is None:
            hold.snapshot = trainer.lora_parameters()
            return event
        trainer.set_lora_parameters(hold.snapshot)
        lp.checkpoint = None                            # taken again as the next window begins
        lp.run.end_here()                               # no more rehearsal-only epochs
        lp.notes[lp.consolidate_note] = (
            f"then {hold.kept} of {lp.spec.consolidate} rehearsal-only epochs (consolidate): after the "
            f"next one {why}, so the adapter is the one before it")
        return "done"

    def _conclude(self, lp: JobLoop) -> Generator[None, None, None]:
        """The walk is over: the final drift, the save and promotion, the job's message."""
        guard, jid, spec = lp.guard, lp.jid, lp.spec
        if guard is not None:
            yield from guard.finish_recording()         # the promotion reads every measured anchor and the margin
            self._note_records(jid, guard)
            drift = yield from guard.measure_or_fail(lp.trainer)
            self._store_drift(jid, spec, drift, lp.run.walk.epoch, final=True)
        progress = self.store.get(jid)["progress"]
        message = yield from self._finish(jid, spec, lp.trainer, progress["eval_loss"], lp.eval_before, guard)
        if guard is not None and (note := guard.rehearsal_note()) is not None:
            lp.notes.append(note)
        if guard is not None and guard.neighbour_prompts:
            lp.notes.append(f"rehearsed {len(guard.neighbour_prompts)} neighbours of its prompts each epoch")
        yield from self._end(jid, "done", "; ".join([message, *lp.notes]))

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
        ok, why = promotion_decision(eval_before, eval_after, guard.drift if guard else None, spec.max_drift,
                                     spec.max_drift_kl, guard.failure if guard else None, guarded=guard is not None)
        if not ok:
            return f"{saved}; {why}"
        try:
            view = self.switch.book_promotion(name, version, None)
        except (AdapterLoadError, AdapterNotFound) as e:
            return f"{saved}; auto promotion failed: {e}"
        return f"{saved}; promoted as served version {view['served_version']} ({why})"

