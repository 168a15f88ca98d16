"""A job's drift guard: the anchor records, the regularizer's windows, the
drift figures, and the promotion rule that reads them.

The scheduler (scheduler.py) owns the engine-thread calls; this module
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
   anchors, `drift.anchor_visits`), each anchor's next sample at each visit,
   shuffled together. With `neighbours` > 0, the base's own neighbours of the
   job's prompts (drift.neighbour_units) are rehearsed too, every one in every
   epoch of the job's own. With the regularizer off no anchor window is visited.
3. `measure(trainer)` (steps): the shadow adapter's drift, copied to the
   stage's own served adapter (`Trainer.promote`; never set on the context
   for serving) and decoded against the records.
4. The promotion rule that reads these figures is jobs/promotion.py.

`OwnLoss` is the early stop: each of the job's own windows' epoch loss below
`stop_loss` ends training (anchor windows do not count: their loss is the
base's own entropy on its samples, and does not fall towards zero).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

from dreamstage.training.drift.measure import (
    ANCHOR_TOKENS,
    DEFAULT_STEP_MS,
    Drift,
    DriftProbe,
    anchor_visits,
    consolidation_visits,
    load_anchors,
    prompt_tokens,
    rehearsal_anchors,
    rehearsal_samples,
    rehearsal_windows,
    visit_choice,
)
from dreamstage.training.jobs.request import ChatExample, PromptCompletion
from dreamstage.training.walk.examples import epoch_order
from dreamstage.training.walk.receipts import kind_receipt

log = logging.getLogger("dreamstage.drift")

# Measurements during training (at epoch ends) take at most this share of the
# job's micro-step time: a slice of the measured anchors each time, rotating.
DURING_SHARE = 0.1
# A rehearsal anchor is recorded for a job only when its prompt leaves at
# least this many tokens of the job's window for a reply.
MIN_REHEARSED_REPLY = 4


def job_questions(spec, train_windows: Sequence[Any]) -> list[str]:
    """The prompts of the job's trained examples, once each, in body order: a
    chat example's last user turn before its first trained reply, a
    prompt-completion's prompt (text examples have none). Held-out examples
    are left out. These are what the job's neighbours are written from."""
    trained = {getattr(w, "source", None) for w in train_windows}
    out: list[str] = []
    for sx in spec.examples:
        if sx.source not in trained:
            continue
        ex, q = sx.example, None
        if isinstance(ex, ChatExample):
            first = next(i for i, m in enumerate(ex.messages) if m.trained)
            q = next((m.content for m in reversed(ex.messages[:first]) if m.role == "user"), None)
        elif isinstance(ex, PromptCompletion):
            q = ex.prompt
        if isinstance(q, str) and q.strip() and q not in out:
            out.append(q)
    return out


def rehearsal_window(resident, spec) -> int:
    """The trainer window a job needs for its rehearsal: the job's own `window`,
    or, with the regularizer on, enough for the longest rehearsal anchor (its
    chat-rendered prompt and an answer of ANCHOR_TOKENS), if that is longer.
    The job's examples are still cut to its `window` (render_job); the
    scheduler gives the trainer, the walk and the guard this one. Without it
    a short window (the README's 32) trained no anchor at all: the default
    model's rehearsal prompts alone take 34 to 43 tokens."""
    if not (spec.regularizer and spec.anchor_ratio > 0):
        return spec.window
    longest = max((len(prompt_tokens(resident, p)) for p in rehearsal_anchors()), default=0)
    return max(spec.window, longest + ANCHOR_TOKENS)


class DriftGuard:
    def __init__(self, resident, spec, train_windows: Sequence[Any], *, seq_id: Callable[[], Any] | int,
                 restore: Callable[[], None], cache: dict | None = None, noise_cache: dict | None = None):
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
                                step_ms=step_ms)
        # ... and trained, never measured: the regularizer's samples of the base
        # (only the anchors whose prompt leaves room in the job's window for a
        # reply: the others could never be trained, so recording them is waste)
        self.rehearsal_prompts = rehearsal_anchors()
        lengths = {p: len(prompt_tokens(resident, p)) for p in self.rehearsal_prompts} if self.ratio > 0 else {}
        self._prompt_span = (min(lengths.values(), default=0), max(lengths.values(), default=0))
        roomy = [p for p, n in lengths.items() if n + MIN_REHEARSED_REPLY <= spec.window]
        self.rehearsal = (DriftProbe(resident, roomy, seq_id=seq_id, restore=restore,
                                     step_ms=step_ms, samples=rehearsal_samples(spec.rehearsal)) if roomy else None)
        # ... and the base's own neighbours of the job's prompts (written at record(),
        # each rehearsed every epoch: the questions a taught form reaches first)
        self._resident, self._seq_id, self._restore, self._step_ms = resident, seq_id, restore, step_ms
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
                               step_ms=self._step_ms, samples=rehearsal_samples(self.spec.rehearsal))
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
        anchor's visit trains the window drift.visit_choice picks."""
        picked = [visit_choice(self._anchor_pos[a], v)
                  for a, v in anchor_visits(len(self._rehearsed), self.n_train, self.ratio, epoch, self.spec.seed)
                  if a in self._anchor_pos]
        picked += [visit_choice(self._anchor_pos[a], epoch) for a in self._neighbour_indices()]
        visit = list(range(self.n_train)) + picked
        return [visit[i] for i in epoch_order(len(visit), epoch, self.spec.seed)]

    def consolidation_order(self, epoch: int) -> list[int]:
        """Window indices of rehearsal-only epoch `epoch` (0, 1, ... after the
        job's own training): every shipped rehearsal anchor's visit choice once, no
        job window and no neighbour. (Rehearsed there too, a fact's neighbours pull
        the taught form back with nothing to hold the fact: evaluation seed 5 lost
        one of six in the second such epoch; docs/architecture/drift.md, "Neighbours".)"""
        return [visit_choice(self._anchor_pos[a], v)
                for a, v in consolidation_visits(self.n_rehearsed, epoch, self.spec.seed) if a in self._anchor_pos]

    def consolidates(self) -> bool:
        """Whether the job's training ends with rehearsal-only epochs: `consolidate`
        > 0, the regularizer on and some rehearsal anchor fits the job's window."""
        return (self.ratio > 0 and self.spec.consolidate > 0 and any(i < self.n_rehearsed for i in self._anchor_pos)
                and self.failure is None)

    def anchor_windows_per_epoch(self) -> int:
        return len(self.order(0)) - self.n_train

    def rehearsal_note(self) -> str | None:
        """What the job's message says when its window kept the regularizer
        from some or all of its rehearsal anchors (None: all of them fit, or
        the regularizer is off)."""
        if self.ratio <= 0 or self.failure is not None:
            return None
        total, used = len(self.rehearsal_prompts), sum(i < self.n_rehearsed for i in self._anchor_pos)
        if used == total:
            return None
        lengths = [len(w) for i, b in enumerate(self._rehearsed) for w in b.windows(-1 - i, "", self.spec.rehearsal)]
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
        (drift.reply_lead_units: above 0 where the window's every trained token is
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


def summary_of(figures: dict[str, Any]) -> str:
    beyond = ""
    if figures.get("noise_margin") is not None:
        beyond = (f" beyond the noise margin {figures['noise_margin']:.3f} (at all: "
                  f"{figures['anchors_changed_raw_count']}/{figures['anchors']})")
    return (f"anchors_changed {figures['anchors_changed']:.3f} ({figures['anchors_changed_count']}/"
            f"{figures['anchors']}){beyond}, drift_kl {figures['drift_kl']:.4f}")


def summary(drift: Drift) -> str:
    return summary_of(drift.as_dict())


class OwnLoss:
    """The early stop on the job's own windows (indices below n_job_windows):
    an epoch converged when every one of its windows' loss is below stop_loss.
    The mean over windows hid a fact that was not learned: in the chat-log
    example three facts averaged 0.04 while one name was still answered wrong."""

    def __init__(self, n_job_windows: int, stop_loss: float | None):
        self.n_job, self.stop_loss = n_job_windows, stop_loss
        self._windows: dict[int, tuple[float, int]] = {}
        self.last: float | None = None     # the epoch's highest window loss
        self.mean: float | None = None     # the epoch's token-weighted loss over the job's windows
        self.final: dict[int, float] = {}  # the last finished epoch's loss per window

    def note(self, window_index: int, receipt: Any) -> None:
        if window_index < self.n_job and getattr(receipt, "status", None) == "ok" and receipt.tokens:
            s, t = self._windows.get(window_index, (0.0, 0))
            self._windows[window_index] = (s + receipt.loss * receipt.tokens, t + receipt.tokens)

    def converged(self) -> bool:
        """At an epoch's end: whether each window's loss is below stop_loss. Starts the next epoch's sums."""
        self.final = {i: s / t for i, (s, t) in self._windows.items() if t}
        losses = list(self.final.values())
        self.last = max(losses) if losses else None
        tokens = sum(t for _, t in self._windows.values())
        self.mean = sum(s for s, _ in self._windows.values()) / tokens if tokens else None
        self._windows = {}
        return self.stop_loss is not None and self.last is not None and self.last < self.stop_loss

    def stop_note(self, epochs_done: int) -> str:
        return (f"stopped after epoch {epochs_done}: every example window's training loss is below stop_loss "
                f"{self.stop_loss:g} (the highest {self.last:.4f})")


# The rehearsal-only epochs (consolidate) pull the adapter back towards the
# base, the job's examples with it: at lr 3e-3 the README's one-fact job had
# learned its answer (loss 0.09) and answered " Quokpok." after them. So each
# such epoch is kept only while the examples' loss stays near where training
# left it. The bound's factor is measured (bench_drift.py `ratio8-c4`, seeds 3
# and 4, each fact window's forward loss after each rehearsal-only epoch):
# every fact was recalled while its window's loss was at most 0.43, and two
# were lost at 0.44 and 0.52; 3 x stop_loss (0.3) keeps both seeds' two
# default epochs (their highest: 0.30 and 0.19).
EXAMPLES_HELD = 64          # at most this many of the job's windows are checked (evenly spaced)
HOLD_SLACK = 2.0            # a window's bound: max(stop_loss, its last training loss) x (1 + this)
# a job without an early stop (stop_loss null) is held from this: the default
# stop_loss when the bound was measured (it is 0.2 since 2026-12-04)
HOLD_FLOOR = 0.1


def consolidation_lr(lr: float, begun: int, total: int) -> float:
    """The optimizer's lr for the next window of a job's rehearsal-only epochs
    when their step decays (`consolidate_decay`): `lr` falling linearly to 0
    over their `total` windows, at the middle of window `begun` (0-based), so
    the first update takes almost the whole step and the last almost none."""
    if total <= 0:
        return lr
    return lr * max(0.0, 1.0 - (begun + 0.5) / total)


def held_windows(final: dict[int, float], checkable: Iterable[int]) -> list[int]:
    """The job windows the early stop's and the hold's checks read: those with a
    training loss (`final`) among `checkable` (not groups), at most
    EXAMPLES_HELD, evenly spaced."""
    have = [i for i in checkable if i in final]
    step = max(1, -(-len(have) // EXAMPLES_HELD))
    return have[::step][:EXAMPLES_HELD]


def reply_lost(windows: Sequence[int], before: Sequence[float] | None, now: Sequence[float] | None) -> str | None:
    """Why the greedy replies no longer hold, or None: a window whose every
    trained token was the greedy choice (lead above 0 in `before`) has one
    that is not (`now`). Nothing to say when either reading is missing."""
    if before is None or now is None:
        return None
    for i, b, n in zip(windows, before, now, strict=True):
        if b > 0.0 >= n:
            return f"example window {i}'s greedy reply changed (its smallest lead fell from {b:.3f} to {n:.3f})"
    return None


class ExampleHold:
    """The job's own windows through its rehearsal-only epochs.

    At the job's last training epoch each window had a loss (OwnLoss.final);
    after each rehearsal-only epoch the scheduler measures the forward loss of
    the checked windows (`windows`) and `check`s it: every window must stay at
    or below max(stop_loss, its last training loss), times 1 + HOLD_SLACK (so
    0.6 for a window that passed the default early stop of 0.2). A job
    without an early stop (stop_loss null) is held from HOLD_FLOOR, 0.1:
    its windows end training far lower, and three times that (0.065 in
    examples/teach_facts.py) undid an epoch at 0.27, where the facts measured
    were all still recalled (up to 0.43).
    Before the losses, the scheduler reads the checked windows' greedy
    replies (DriftGuard.reply_leads, against `leads` as the epochs began):
    one that was answered and no longer is fails the epoch (reply_lost).
    On a failure the scheduler puts back the adapter as the last kept epoch
    left it (`snapshot`) and ends the rehearsal-only epochs."""

    def __init__(self, final: dict[int, float], stop_loss: float | None, checkable: Sequence[int], snapshot: Any):
        """checkable: the job windows a forward loss can be measured for (not groups)."""
        self.windows = held_windows(final, checkable)
        floor = HOLD_FLOOR if stop_loss is None else stop_loss
        self.bounds = [max(floor, final[i]) * (1.0 + HOLD_SLACK) for i in self.windows]
        self.snapshot = snapshot
        self.kept = 0
        # each checked window's reply lead as the rehearsal-only epochs began
        # (drift.reply_lead_units), or None when it could not be read
        self.leads: list[float] | None = None

    def check(self, losses: Sequence[float] | None) -> str | None:
        """None when every checked window is within its bound (the epoch is kept),
        else why the epoch is undone."""
        if losses is None:
            return "the examples' loss could not be measured"
        worst = max(range(len(losses)), key=lambda k: losses[k] - self.bounds[k], default=None)
        if worst is None or losses[worst] <= self.bounds[worst]:
            self.kept += 1
            return None
        return (f"example window {self.windows[worst]}'s loss rose to {losses[worst]:.4f}, "
                f"above {self.bounds[worst]:.4f}")
