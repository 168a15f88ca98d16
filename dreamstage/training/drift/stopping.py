"""The job's own windows under the drift guard: the early stop that ends
training when each of them is learned (OwnLoss), and the hold that keeps them
learned through the rehearsal-only epochs (ExampleHold).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from dreamstage.training.walk.groups import pushed_away

# The rehearsal-only epochs pull the adapter back towards the base, the job's
# examples with it, so each is kept only while every checked window's forward
# loss stays at most max(stop_loss, its last training loss) x (1 + HOLD_SLACK):
# the facts measured stayed recalled up to about 3 x stop_loss (bench_drift.py `ratio8-c4`).
EXAMPLES_HELD = 64          # at most this many of the job's windows are checked (evenly spaced)
HOLD_SLACK = 2.0
# The floor of a job without an early stop (stop_loss null), whose windows end training far lower.
HOLD_FLOOR = 0.1


class OwnLoss:
    """The early stop on the job's own windows (indices below n_job_windows):
    an epoch converged when every one of its windows' loss is below stop_loss.
    Each window, not their mean: a mean can hide one fact not yet learned.
    (Anchor windows do not count: their loss is the base's own entropy, which
    does not fall towards zero. A group counts its positive replies: note_group.)"""

    def __init__(self, n_job_windows: int, stop_loss: float | None):
        self.n_job, self.stop_loss = n_job_windows, stop_loss
        self._windows: dict[int, tuple[float, int]] = {}
        self._groups: dict[int, float] = {}    # a group's loss for the stop (note_group), over its receipts'
        self._first: dict[int, list[float]] = {}   # a group's reply losses at its first pass
        self.last: float | None = None     # the epoch's highest window loss
        self.mean: float | None = None     # the epoch's token-weighted loss over the job's windows
        self.final: dict[int, float] = {}  # the last finished epoch's loss per window

    def note(self, window_index: int, receipt: Any) -> None:
        if window_index < self.n_job and getattr(receipt, "status", None) == "ok" and receipt.tokens:
            s, t = self._windows.get(window_index, (0.0, 0))
            self._windows[window_index] = (s + receipt.loss * receipt.tokens, t + receipt.tokens)

    def note_group(self, window_index: int, reply_losses: Sequence[float], weights: Sequence[float]) -> None:
        """A group's pass ended. Its loss here: the highest mean NLL of its positive-weight replies (a
        pushed-away reply's only rises); without a positive reply, 0 once every negative one is `pushed_away`
        (from its first pass's loss; a group of zero weights has nothing to learn)."""
        if window_index >= self.n_job or len(reply_losses) != len(weights):
            return
        first = self._first.setdefault(window_index, list(reply_losses))
        pulled = [x if math.isfinite(x) else math.inf for x, w in zip(reply_losses, weights, strict=True) if w > 0]
        past = all(pushed_away(x, f) for x, f, w in zip(reply_losses, first, weights, strict=True) if w < 0)
        self._groups[window_index] = max(pulled) if pulled else 0.0 if past else math.inf

    def converged(self) -> bool:
        """At an epoch's end: whether each window's loss is below stop_loss. Starts the next epoch's sums."""
        self.final = {**{i: s / t for i, (s, t) in self._windows.items() if t}, **self._groups}
        losses = list(self.final.values())
        self.last = max(losses) if losses else None
        tokens = sum(t for _, t in self._windows.values())
        self.mean = sum(s for s, _ in self._windows.values()) / tokens if tokens else None
        self._windows, self._groups = {}, {}
        return self.stop_loss is not None and self.last is not None and self.last < self.stop_loss

    def stop_note(self, epochs_done: int) -> str:
        return (f"stopped after epoch {epochs_done}: every example window's training loss is below stop_loss "
                f"{self.stop_loss:g} (the highest {self.last:.4f})")


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
    or below max(stop_loss, its last training loss), times 1 + HOLD_SLACK (a job
    without an early stop is held from HOLD_FLOOR).
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
        # (measure.reply_lead_units), or None when it could not be read
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
