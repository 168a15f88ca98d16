"""A job's drift guard: the anchor records, the regularizer's windows, the
drift figures, and the promotion rule that reads them.

The scheduler (jobs/scheduler.py) owns the engine-thread calls; this module
decides what they are. One guard per job:

1. `record()` (steps): the base's answers on the shipped anchors plus the
   job's own (`anchors`), adapter off; cached across jobs by prompt, since the
   base model does not change while the process lives. Then, given the job's
   trainer, the noise margin of those records (`DriftProbe.null_margin`: the
   widest drop of a base token's lead that adapters which learned nothing
   made at any answer position), cached by anchors
   and adapter shape; `anchors_changed` counts only changes beyond it.
2. `windows` / `order(epoch)`: the job's windows followed by each rehearsal
   anchor's windows (the job's `rehearsal`: its greedy answer against the
   base's recorded distributions, or one per sampled continuation); each epoch visits every job
   window and `anchor_ratio` x as many anchor windows (a rotating slice of the
   anchors, `rehearsal.anchor_visits`), each anchor's next sample at each visit,
   shuffled together. With `neighbours` > 0, the base's own neighbours of the
   job's prompts (neighbours.neighbour_units) are rehearsed too, every one in every
   epoch of the job's own. With the regularizer off no anchor window is visited.
3. `measure(trainer)` (steps): the shadow adapter's drift, copied to the
   stage's own served adapter (`Trainer.promote`; never set on the context
   for serving) and decoded against the records.
4. The promotion rule that reads these figures is jobs/promotion.py.

The early stop and the hold on the job's own windows are stopping.py.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any

from dreamstage.training.drift import measure as drift_measure
from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.measure import DEFAULT_STEP_MS, Drift, DriftProbe, null_vectors, summary_of
from dreamstage.training.drift.neighbours import job_questions
from dreamstage.training.drift.records import prompt_tokens
from dreamstage.training.drift.rehearsal import (
    anchor_visits,
    consolidation_visits,
    distillation_windows,
    rehearsal_samples,
    rehearsal_windows,
    visit_choice,
)
from dreamstage.training.walk.examples import epoch_order
from dreamstage.training.walk.receipts import kind_receipt

log = logging.getLogger("dreamstage.drift")

# Measurements during training (at epoch ends) take at most this share of the
# job's micro-step time: a slice of the measured anchors each time, rotating.
DURING_SHARE = 0.1
# A rehearsal anchor is recorded for a job only when its prompt leaves at
# least this many tokens of the job's window for a reply.
MIN_REHEARSED_REPLY = 4


class DriftGuard:
    def __init__(self, resident, spec, train_windows: Sequence[Any], *, seq_id: Callable[[], Any] | int,
                 restore: Callable[[], None], enter: Callable[[], None] = lambda: None,
                 cache: dict | None = None, noise_cache: dict | None = None):
        self.spec = spec
        self.noise_cache = noise_cache
        self.n_train = len(train_windows)
        self.train_windows = list(train_windows)
        # measured, never trained (the shipped `measure` half and the job's own) ...
        # a probe's step aims at half the job's pause bound (its units are
        # decodes of up to PIECE_TOKENS tokens; at least one runs per step)
        pause = getattr(getattr(spec, "pacing", None), "max_pause_ms", None)
        step_ms = pause / 2.0 if pause else DEFAULT_STEP_MS
        self._turn: list = [None]                # the guard's probes share one lent sequence
        self.probe = DriftProbe(resident, load_anchors(spec.anchors), seq_id=seq_id, restore=restore,
                                enter=enter, step_ms=step_ms, turn=self._turn)
        # ... and trained, never measured: the regularizer's samples of the base
        # (only the anchors whose prompt leaves room in the job's window for a
        # reply: the others could never be trained, so recording them is waste)
        self.rehearsal_prompts = rehearsal_anchors()
        lengths = {p: len(prompt_tokens(resident, p)) for p in self.rehearsal_prompts} if self.ratio > 0 else {}
        self._prompt_span = (min(lengths.values(), default=0), max(lengths.values(), default=0))
        roomy = [p for p, n in lengths.items() if n + MIN_REHEARSED_REPLY <= spec.window]
        self.rehearsal = (DriftProbe(resident, roomy, seq_id=seq_id, restore=restore, enter=enter, step_ms=step_ms,
                                     samples=rehearsal_samples(spec.rehearsal), turn=self._turn) if roomy else None)
        # ... and the base's own neighbours of the job's prompts (written at record(),
        # each rehearsed every epoch: the questions a taught form reaches first)
        self._resident, self._seq_id, self._step_ms = resident, seq_id, step_ms
        self._restore, self._enter = restore, enter
        self.questions = job_questions(spec, train_windows) if self.ratio > 0 and spec.neighbours > 0 else []
        self.near: DriftProbe | None = None
        self.neighbour_prompts: list[str] = []
        self.cache = cache
        self.windows: list[Any] = list(train_windows)
        # rehearsal anchor -> its windows' positions in self.windows; the neighbours
        # follow the shipped rehearsal anchors, from index n_rehearsed on
        self._anchor_pos: dict[int, list[int]] = {}
        self.n_rehearsed = len(self.rehearsal.prompts) if self.rehearsal is not None else 0
        self._rehearsed_bases: dict[int, Any] = {}          # rehearsal anchor -> its record, once made
        self._neighbours_done = not self.questions
        # a job's records made while it trains (start(); None: not started, or all made)
        self._backlog: Generator[None, None, None] | None = None
        self._null_start: Any = None             # the shadow's parameters at the job's start (the null draws' A)
        self._served: Any = None                 # what the trainer's served copy holds: "shadow" or ("null", d)
        self.drift: Drift | None = None          # the final measurement (the promotion reads it)
        self.failure: str | None = None          # why the measurement failed, if it did
        self.during_ms = 0.0                     # time spent on measurements during training
        self._during_next = 0                    # the next measured anchor of the rotating slice

    @property
    def ratio(self) -> float:
        return self.spec.anchor_ratio if self.spec.regularizer else 0.0

    @property
    def _rehearsed(self) -> list[Any]:
        return [self._rehearsed_bases[i] for i in sorted(self._rehearsed_bases)]

    def record(self) -> Generator[None, None, None]:
        """Every record at once: the measured anchors, the rehearsal anchors in
        order, the neighbours (the warm-up's and the tests' way; a job's is start())."""
        yield from self._record_measured()
        try:
            for i in range(self.n_rehearsed):
                yield from self._record_rehearsal(i)
        finally:
            if self.rehearsal is not None:
                self.rehearsal.release()
        yield from self._neighbours_or_none()

    def _record_measured(self) -> Generator[None, None, None]:
        """The measured anchors' records, in order; `probe.bases` grows with each."""
        self.probe.bases = []
        try:
            for prompt in self.probe.prompts:
                self.probe.bases.append((yield from self.probe.record_prompt(prompt, self.cache)))
        finally:
            self.probe.release()

    def _record_rehearsal(self, i: int) -> Generator[None, None, None]:
        """Rehearsal anchor i's record and windows (none when recorded already)."""
        if i in self._rehearsed_bases or self.rehearsal is None:
            return
        base = yield from self.rehearsal.record_prompt(self.rehearsal.prompts[i], self.cache)
        self._rehearsed_bases[i] = base
        self._add_windows(i, rehearsal_windows(base, i, self.spec.window, self.spec.rehearsal))

    def _neighbours_or_none(self) -> Generator[None, None, None]:
        if self._neighbours_done:
            return
        shipped_windows = len(self.windows)
        try:
            yield from self._record_neighbours()
        except Exception:
            # an extra: the shipped rehearsal and the measurement stand without it
            log.exception("writing the neighbours of the job's prompts failed; it rehearses none")
            self._anchor_pos = {i: v for i, v in self._anchor_pos.items() if i < self.n_rehearsed}
            del self.windows[shipped_windows:]
            self.near, self.neighbour_prompts = None, []
        finally:
            self.probe.release()
            if self.near is not None:
                self.near.release()
        self._neighbours_done = True

    def _add_windows(self, index: int, fitting: Sequence[Any]) -> None:
        if fitting:
            self._anchor_pos[index] = list(range(len(self.windows), len(self.windows) + len(fitting)))
            self.windows.extend(fitting)

    def _record_neighbours(self) -> Generator[None, None, None]:
        """The base's neighbours of the job's prompts (DriftProbe.neighbours_of;
        never a measured anchor, nor a shipped rehearsal one), those that leave
        the window room for a reply, recorded and made into rehearsal windows."""
        written = yield from self.probe.neighbours_of(self.questions, self.spec.neighbours, self.cache,
                                                      exclude=self.probe.prompts)
        shipped = set(self.rehearsal_prompts)
        roomy = [p for p in written if p not in shipped and
                 len(prompt_tokens(self._resident, p)) + MIN_REHEARSED_REPLY <= self.spec.window]
        if not roomy:
            return
        self.near = DriftProbe(self._resident, roomy, seq_id=self._seq_id, restore=self._restore, enter=self._enter,
                               step_ms=self._step_ms, samples=rehearsal_samples(self.spec.rehearsal), turn=self._turn)
        yield from self.near.record(self.cache)
        for j, base in enumerate(self.near.bases):
            i = self.n_rehearsed + j
            self._add_windows(i, rehearsal_windows(base, i, self.spec.window, self.spec.rehearsal,
                                                   f"neighbours[{j}]"))
        self.neighbour_prompts = [b.prompt for j, b in enumerate(self.near.bases)
                                  if self.n_rehearsed + j in self._anchor_pos]
        log.info("rehearsing %d neighbours of the job's prompts each epoch: %s", len(self.neighbour_prompts),
                 "; ".join(repr(p) for p in self.neighbour_prompts))

    def _neighbour_indices(self) -> list[int]:
        n = len(self.near.bases) if self.near is not None else 0
        return [i for i in range(self.n_rehearsed, self.n_rehearsed + n) if i in self._anchor_pos]

    def order(self, epoch: int) -> list[int]:
        """Window indices (into `windows`) visited in `epoch`, in order: an
        anchor's visit trains the window rehearsal.visit_choice picks."""
        picked = [visit_choice(self._anchor_pos[a], v)
                  for a, v in anchor_visits(self.n_rehearsed, self.n_train, self.ratio, epoch, self.spec.seed)
                  if a in self._anchor_pos]
        picked += [visit_choice(self._anchor_pos[a], epoch) for a in self._neighbour_indices()]
        visit = list(range(self.n_train)) + picked
        return [visit[i] for i in epoch_order(len(visit), epoch, self.spec.seed)]

    def consolidation_order(self, epoch: int) -> list[int]:
        """Window indices of rehearsal-only epoch `epoch` (0, 1, ... after the
        job's own training): every shipped rehearsal anchor's visit choice once, no
        job window and no neighbour (rehearsed there, a fact's neighbours pull
        the taught form back with nothing to hold the fact; docs/architecture/drift.md, "Neighbours")."""
        return [visit_choice(self._anchor_pos[a], v)
                for a, v in consolidation_visits(self.n_rehearsed, epoch, self.spec.seed) if a in self._anchor_pos]

    def consolidates(self) -> bool:
        """Whether the job's training ends with rehearsal-only epochs: `consolidate`
        > 0, the regularizer on and some rehearsal anchor fits the job's window."""
        return (self.ratio > 0 and self.spec.consolidate > 0 and any(i < self.n_rehearsed for i in self._anchor_pos)
                and self.failure is None)

    def rehearsal_note(self) -> str | None:
        """What the job's message says when its window kept the regularizer
        from some or all of its rehearsal anchors (None: all of them fit, or
        the regularizer is off)."""
        if self.ratio <= 0 or self.failure is not None:
            return None
        total, used = len(self.rehearsal_prompts), sum(i < self.n_rehearsed for i in self._anchor_pos)
        if used == total:
            return None
        lengths = [len(w) for i, b in enumerate(self._rehearsed)
                   for w in distillation_windows(b, -1 - i, "", self.spec.rehearsal)]
        need = (f"the shortest needs {min(lengths)} tokens" if lengths else
                "their prompts alone take {} to {} tokens".format(*self._prompt_span))
        if used == 0:
            return (f"no rehearsal: none of the {total} rehearsal anchors fits window {self.spec.window} ({need}), "
                    "so the regularizer did not run; a longer window turns it on")
        return f"rehearsal on {used} of {total} anchors (the others are longer than window {self.spec.window})"

    # -- a job's records, made while it trains ------------------------------------------
    def start(self, trainer=None) -> None:
        """Plan the job's records (`step_recording` makes them, one probe step a call)
        in the order the job needs them: the rehearsal anchors its first epoch
        visits, the neighbours, the second epoch's anchors, the measured anchors,
        the other epochs' anchors and the rest, then (given the trainer, whose
        parameters now are the null draws' A) the noise margin. The walk waits
        only for what an epoch visits (`ready`); a measurement during training
        reads the measured records made so far; the final one, which the
        promotion reads, waits for all (`finish_recording`). A failure to record
        is kept (`failure`): the job trains on with the windows it has and auto
        promotion refuses, naming it. A failure of the noise margin is logged and
        leaves it unmeasured (anchors_changed then counts every change)."""
        if trainer is not None and hasattr(trainer, "lora_parameters"):
            self._null_start = trainer.lora_parameters()
        self._backlog = self._backlog_steps(trainer)

    @property
    def recording(self) -> bool:
        """Whether some of the job's records are still to be made (start)."""
        return self._backlog is not None

    def step_recording(self) -> None:
        """One probe step of the job's records (nothing when all are made)."""
        if self._backlog is None:
            return
        try:
            next(self._backlog)
        except StopIteration:
            self._backlog = None

    def finish_recording(self) -> Generator[None, None, None]:
        """The rest of the job's records, one probe step a yield."""
        while self._backlog is not None:
            self.step_recording()
            yield

    def ready(self, epoch: int, consolidating: bool = False) -> bool:
        """Whether every record epoch `epoch` visits is made (a rehearsal-only epoch:
        every rehearsal anchor's), or recording failed (the walk goes on without)."""
        if self._backlog is None or self.failure is not None:
            return True
        if consolidating:
            return len(self._rehearsed_bases) == self.n_rehearsed
        return self._neighbours_done and all(a in self._rehearsed_bases for a in self._visited(epoch))

    def until_rehearsed(self) -> Generator[None, None, None]:
        """Until every rehearsal anchor's record is made (before the rehearsal-only epochs)."""
        while not self.ready(0, consolidating=True):
            self.step_recording()
            yield

    def recorded(self) -> tuple[int, int]:
        """(measured anchors recorded, measured anchors in all)."""
        return len(self.probe.bases), len(self.probe.prompts)

    def close(self) -> None:
        """Stop recording (the job ended first): the lent sequence goes back."""
        if self._backlog is not None:
            self._backlog.close()
            self._backlog = None

    def _visited(self, epoch: int) -> list[int]:
        return [a for a, _ in anchor_visits(self.n_rehearsed, self.n_train, self.ratio, epoch, self.spec.seed)]

    def _backlog_steps(self, trainer) -> Generator[None, None, None]:
        epochs = getattr(self.spec, "epochs", 1)
        try:
            try:
                for i in self._visited(0):
                    yield from self._record_rehearsal(i)
                yield from self._neighbours_or_none()
                for i in self._visited(1) if epochs > 1 else []:
                    yield from self._record_rehearsal(i)
                yield from self._record_measured()
                for i in [a for e in range(2, epochs) for a in self._visited(e)] + list(range(self.n_rehearsed)):
                    yield from self._record_rehearsal(i)
            finally:
                if self.rehearsal is not None:
                    self.rehearsal.release()
        except Exception as e:
            log.exception("recording the anchors failed")
            self.failure = f"recording the anchors failed: {type(e).__name__}: {e}"
            return
        if self._null_start is None:
            return
        try:
            yield from self._noise_margin(trainer)
        except Exception:
            log.exception("measuring the drift noise margin failed; anchors_changed counts every change")
            self.probe.noise_margin = None

    def _noise_key(self) -> tuple:
        """What a noise margin is kept by: the measured anchors and the adapter's shape (not its seed)."""
        lora: dict[str, Any] = self.spec.lora_fields()
        return (tuple(self.probe.prompts), lora["rank"], lora["alpha"], lora["targets"], lora["top_layers"])

    def margin_ahead(self, make_trainer: Callable[[], Any]) -> Generator[None, None, None]:
        """The noise margin of this spec's adapter shape before any job asks for it
        (the idle warm-up, after record()): a trainer from `make_trainer` lends its
        adapter's A and served copy, and is closed after; nothing when the margin is kept."""
        if self.noise_cache is None or self._noise_key() in self.noise_cache:
            return
        try:
            trainer = make_trainer()
        except Exception as e:  # noqa: BLE001 - refused by the memory gate, say: the first job measures it
            log.info("no trainer for the noise margin ahead of a job (%s); the first job measures it", e)
            return
        try:
            self._null_start = trainer.lora_parameters()
            yield from self._noise_margin(trainer)
        finally:
            trainer.close()

    def _noise_margin(self, trainer) -> Generator[None, None, None]:
        """The probe's noise margin (DriftProbe.null_margin), measured once per
        process for these anchors and this adapter shape, while the job trains:
        each null adapter goes to the trainer's served copy and the shadow is put
        back at once, so the micro-steps between its decodes train as if it
        were not there."""
        key = self._noise_key()
        if self.noise_cache is not None and key in self.noise_cache:
            self.probe.noise_margin, self.probe.noise_draws = self.noise_cache[key]
            return
        nulls = []
        try:
            for d, vec in enumerate(null_vectors(trainer, self._null_start, drift_measure.NULL_DRAWS)):
                nulls.append((yield from self._measure_served(trainer, vec, ("null", d))))
        finally:
            self.probe.release()
        margin = self.probe.adopt_nulls(nulls)
        if self.noise_cache is not None:
            self.noise_cache[key] = (margin, self.probe.noise_draws)

    def _measure_served(self, trainer, vec, tag) -> Generator[None, None, Drift]:
        """probe.measure of parameters `vec` on the trainer's served copy, written
        there again whenever something else (a measurement of the shadow) took it."""
        steps = self.probe.measure(trainer.served_adapter)
        try:
            while True:
                if self._served != tag:
                    now = trainer.lora_parameters()
                    trainer.set_lora_parameters(vec)
                    trainer.promote()
                    trainer.set_lora_parameters(now)
                    self._served = tag
                try:
                    next(steps)
                except StopIteration as stop:
                    return stop.value
                yield
        finally:
            steps.close()

    def _promote_shadow(self, trainer) -> None:
        trainer.promote()                     # shadow -> the stage's own served copy, a llama_adapter_lora
        self._served = "shadow"

    def measure_or_fail(self, trainer) -> Generator[None, None, Drift | None]:
        """measure() (a Drift), or None after a failure (kept in `failure`):
        the trained adapter is saved either way."""
        if self.failure is not None:
            return None
        try:
            return (yield from self.measure(trainer))
        except Exception as e:
            log.exception("the drift measurement failed")
            self.failure = f"the drift measurement failed: {type(e).__name__}: {e}"
            return None

    # -- measurement ---------------------------------------------------------------
    def measure(self, trainer) -> Generator[None, None, Drift]:
        """The shadow adapter's drift now on every measured anchor (a Drift), in short steps."""
        self._promote_shadow(trainer)
        self.drift = yield from self.probe.measure(trainer.served_adapter)
        return self.drift

    def reply_leads(self, trainer, windows: Sequence[Any]) -> Generator[None, None, list[float] | None]:
        """The shadow adapter's reply leads on the job's `windows`
        (measure.reply_lead_units: above 0 where the window's every trained token is
        the greedy choice), through serving's decode like a measurement; None
        after a failure (logged), which leaves the caller to its loss rule."""
        try:
            self._promote_shadow(trainer)
            return (yield from self.probe.reply_leads(trainer.served_adapter, windows))
        except Exception:
            log.exception("reading the examples' greedy replies failed")
            return None

    def during_count(self, train_ms: float, steps: int) -> int:
        """How many measured anchors an epoch-end measurement may decode now:
        as many as keep all measurements during training within DURING_SHARE
        of the job's micro-step time so far, at the last measured cost per
        anchor (before any, a micro-step's mean time: one anchor is a forward
        pass of about a window, cheaper than a step's forward and backward)."""
        if self.failure is not None or not self.probe.bases or steps <= 0:
            return 0
        per = self.probe.anchor_ms or train_ms / steps
        return max(0, min(len(self.probe.bases), int((DURING_SHARE * train_ms - self.during_ms) / max(per, 1e-3))))

    def measure_during(self, trainer, train_ms: float, steps: int) -> Generator[None, None, Drift | None]:
        """At an epoch's end: the drift on the next slice of the measured
        anchors (rotating, so successive epochs cover them all), or None when
        the time share allows none yet. A failure here is logged and costs only
        this figure: the final measurement decides the promotion."""
        n = self.during_count(train_ms, steps)
        if n == 0:
            return None
        total = len(self.probe.bases)
        picked = [(self._during_next + i) % total for i in range(n)]
        self._during_next = (self._during_next + n) % total
        try:
            self._promote_shadow(trainer)
            drift = yield from self.probe.measure(trainer.served_adapter, picked)
        except Exception:
            log.exception("a drift measurement during training failed")
            return None
        self.during_ms += drift.ms
        return drift


def drift_figures(drift: Drift | None, max_drift: float, max_drift_kl: float | None, epoch: int | None = None,
                  final: bool = True, recorded: tuple[int, int] | None = None) -> dict[str, Any] | None:
    """The figures a job, its receipt and its adapter report. `final`: the
    measurement on every measured anchor after training (the promotion's); a
    measurement during training covers a slice of them (`anchors` says how many)
    of those recorded by then (`recorded`: made, in all; `anchors_recorded`)."""
    if drift is None:
        return None
    out = {**drift.as_dict(), "max_drift": max_drift, "max_drift_kl": max_drift_kl, "final": final}
    if recorded is not None and recorded[0] < recorded[1]:
        out["anchors_recorded"] = list(recorded)
    if epoch is not None:
        out["epoch"] = epoch
    return out


def drift_receipt(figures: dict[str, Any], *, step: int, ms: float, memory: dict[str, Any] | None) -> dict[str, Any]:
    """The drift measurement as a job receipt: kind "drift", after micro-step
    `step`, with every canonical receipt field (receipts.kind_receipt) and the figures."""
    return kind_receipt("drift", step=step, ms=ms, memory=memory, message=summary_of(figures), **figures)


