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
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.measure import DEFAULT_STEP_MS, Drift, DriftProbe, summary_of
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
        self.probe = DriftProbe(resident, load_anchors(spec.anchors), seq_id=seq_id, restore=restore,
                                enter=enter, step_ms=step_ms)
        # ... and trained, never measured: the regularizer's samples of the base
        # (only the anchors whose prompt leaves room in the job's window for a
        # reply: the others could never be trained, so recording them is waste)
        self.rehearsal_prompts = rehearsal_anchors()
        lengths = {p: len(prompt_tokens(resident, p)) for p in self.rehearsal_prompts} if self.ratio > 0 else {}
        self._prompt_span = (min(lengths.values(), default=0), max(lengths.values(), default=0))
        roomy = [p for p, n in lengths.items() if n + MIN_REHEARSED_REPLY <= spec.window]
        self.rehearsal = (DriftProbe(resident, roomy, seq_id=seq_id, restore=restore, enter=enter,
                                     step_ms=step_ms, samples=rehearsal_samples(spec.rehearsal)) if roomy else None)
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
        self.n_rehearsed = 0
        self.drift: Drift | None = None          # the final measurement (the promotion reads it)
        self.failure: str | None = None          # why the measurement failed, if it did
        self.during_ms = 0.0                     # time spent on measurements during training
        self._during_next = 0                    # the next measured anchor of the rotating slice

    @property
    def ratio(self) -> float:
        return self.spec.anchor_ratio if self.spec.regularizer else 0.0

    @property
    def _rehearsed(self) -> list[Any]:
        return self.rehearsal.bases if self.rehearsal is not None else []

    def record(self) -> Generator[None, None, None]:
        yield from self.probe.record(self.cache)
        self._anchor_pos = {}
        if self.rehearsal is not None:
            yield from self.rehearsal.record(self.cache)
            for i, base in enumerate(self._rehearsed):
                self._add_windows(i, rehearsal_windows(base, i, self.spec.window, self.spec.rehearsal))
        self.n_rehearsed = len(self._rehearsed)
        if self.questions:
            shipped_windows = len(self.windows)
            try:
                yield from self._record_neighbours()
            except Exception:
                # an extra: the shipped rehearsal and the measurement stand without it
                log.exception("writing the neighbours of the job's prompts failed; it rehearses none")
                self._anchor_pos = {i: v for i, v in self._anchor_pos.items() if i < self.n_rehearsed}
                del self.windows[shipped_windows:]
                self.near, self.neighbour_prompts = None, []

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
        self.near = DriftProbe(self._resident, roomy, seq_id=self._seq_id, restore=self._restore,
                               enter=self._enter, step_ms=self._step_ms, samples=rehearsal_samples(self.spec.rehearsal))
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
                  for a, v in anchor_visits(len(self._rehearsed), self.n_train, self.ratio, epoch, self.spec.seed)
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

    def record_or_fail(self, trainer=None) -> Iterator[None]:
        """record(), then (given the job's trainer, before its first step) the
        noise margin; a failure to record is kept (`failure`) and the job trains on
        without anchor windows: auto promotion then refuses, naming it. A failure
        of the noise margin is logged and leaves it unmeasured: anchors_changed
        then counts every change, near ties included (as anchors_changed_raw)."""
        try:
            yield from self.record()
        except Exception as e:
            log.exception("recording the anchors failed")
            self.failure = f"recording the anchors failed: {type(e).__name__}: {e}"
            return
        if trainer is None or not hasattr(trainer, "lora_parameters"):
            return
        try:
            yield from self.noise_margin(trainer)
        except Exception:
            log.exception("measuring the drift noise margin failed; anchors_changed counts every change")
            self.probe.noise_margin = None

    def noise_margin(self, trainer) -> Generator[None, None, float]:
        """The probe's noise margin (DriftProbe.null_margin), measured once per
        process for these anchors and this adapter shape."""
        lora: dict[str, Any] = self.spec.lora_fields()
        key = (tuple(self.probe.prompts), lora["rank"], lora["alpha"], lora["targets"], lora["top_layers"])
        if self.noise_cache is not None and key in self.noise_cache:
            margin, self.probe.noise_draws = self.noise_cache[key]
            self.probe.noise_margin = margin
        else:
            margin = yield from self.probe.null_margin(trainer)
            if self.noise_cache is not None:
                self.noise_cache[key] = (margin, self.probe.noise_draws)
        return margin

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
        trainer.promote()                     # shadow -> the stage's own served copy, a llama_adapter_lora
        self.drift = yield from self.probe.measure(trainer.served_adapter)
        return self.drift

    def reply_leads(self, trainer, windows: Sequence[Any]) -> Generator[None, None, list[float] | None]:
        """The shadow adapter's reply leads on the job's `windows`
        (measure.reply_lead_units: above 0 where the window's every trained token is
        the greedy choice), through serving's decode like a measurement; None
        after a failure (logged), which leaves the caller to its loss rule."""
        try:
            trainer.promote()
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
            trainer.promote()
            drift = yield from self.probe.measure(trainer.served_adapter, picked)
        except Exception:
            log.exception("a drift measurement during training failed")
            return None
        self.during_ms += drift.ms
        return drift


def drift_figures(drift: Drift | None, max_drift: float, max_drift_kl: float | None, epoch: int | None = None,
                  final: bool = True) -> dict[str, Any] | None:
    """The figures a job, its receipt and its adapter report. `final`: the
    measurement on every measured anchor after training (the promotion's); a
    measurement during training covers a slice of them (`anchors` says how many)."""
    if drift is None:
        return None
    out = {**drift.as_dict(), "max_drift": max_drift, "max_drift_kl": max_drift_kl, "final": final}
    if epoch is not None:
        out["epoch"] = epoch
    return out


def drift_receipt(figures: dict[str, Any], *, step: int, ms: float, memory: dict[str, Any] | None) -> dict[str, Any]:
    """The drift measurement as a job receipt: kind "drift", after micro-step
    `step`, with every canonical receipt field (receipts.kind_receipt) and the figures."""
    return kind_receipt("drift", step=step, ms=ms, memory=memory, message=summary_of(figures), **figures)


