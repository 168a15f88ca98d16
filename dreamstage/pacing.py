"""Pacing: may the engine run one dream micro-step now?

The engine asks after every decode batch (`should_dream(active_slots)`), and
in its idle loop with active_slots=0. Everything is measured with the
injected clock, never assumed from a model of the hardware.

Accounting is per *active interval*: the wall time W from the end of one
decode batch to the end of the next, with the tokens that batch produced,
and whether a micro-step ran inside it. Intervals broken by idleness are not
counted. A token bucket (`credit`, in seconds) decides:

- every micro-step's measured time is charged to the bucket at once;
- `share` f: each interval refills f * W, so over time dream time ≈ f of the
  active wall time;
- `max_slowdown` s: the slowdown is 1 - (decode tok/s overall) / (decode tok/s
  in intervals without a micro-step). Let r0 be that undisturbed rate over the
  recent intervals; an interval "lost" W - tokens/r0 seconds, which is the
  micro-step itself plus any contention it causes (a cold cache, a slower next
  batch). Each interval refills s * W and is charged the lost time beyond the
  micro-step already paid, so the measured lost fraction stays near s,
  contention included. Until a few undisturbed intervals are measured there is
  no r0, and the pacer does not dream under load.
A micro-step is allowed when credit >= 0 (debt is paid back before the next
one; one step may overshoot, which averages out), and at most one per decode
batch. Credit is capped at one median micro-step so quiet periods do not bank
a burst.

Idle: with no active slot the engine may dream continuously once the slots
have been idle for `idle_grace_s` (the last decode end, or since the pacer was
created); idle micro-steps are timed but not charged.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from dreamstage.trainspec import PacingSpec

DEFAULT_IDLE_GRACE_S = 0.2
MIN_BASELINE_INTERVALS = 3     # undisturbed intervals needed before r0 counts
HISTORY_INTERVALS = 512        # recent active intervals the figures and r0 use
HISTORY_STEPS = 1024           # recent micro-step times for the percentiles


@dataclass(frozen=True)
class Interval:
    seconds: float     # wall time since the previous decode batch ended
    tokens: int        # tokens that decode batch produced
    dream_s: float     # micro-step time inside the interval (0 when none ran)


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class Pacer:
    def __init__(self, mode: str, value: float, *, clock: Callable[[], float] = time.monotonic,
                 idle_grace_s: float = DEFAULT_IDLE_GRACE_S):
        if mode not in ("share", "max_slowdown"):
            raise ValueError(f"pacing mode {mode!r} is not one of share, max_slowdown")
        if not 0.0 < value < 1.0:
            raise ValueError(f"{mode} {value!r} must be in (0, 1)")
        if idle_grace_s < 0:
            raise ValueError(f"idle_grace_s {idle_grace_s!r} must be >= 0")
        self.mode, self.value = mode, float(value)
        self.clock = clock
        self.idle_grace_s = idle_grace_s
        self.credit = 0.0
        self._created = clock()
        self._last_end: float | None = None   # end of the last decode batch of an active run
        self._idle_since: float | None = None
        self._dream_in_interval = 0.0
        self._stepped_since_decode = False
        self._granted_idle = False
        self._intervals: deque[Interval] = deque(maxlen=HISTORY_INTERVALS)
        self._quiet: tuple[int, int, float] = (0, 0, 0.0)   # count, tokens, seconds
        self._p50_step_s = 0.0
        self._steps_ms: deque[float] = deque(maxlen=HISTORY_STEPS)
        self._max_step_ms = 0.0
        self._steps = 0
        self._idle_steps = 0

    @classmethod
    def from_spec(cls, spec: PacingSpec, **kw: Any) -> "Pacer":
        return cls(spec.mode, spec.value, **kw)

    # -- measurements -------------------------------------------------------------
    def undisturbed_rate(self) -> float | None:
        """Decode tok/s over recent intervals without a micro-step (r0)."""
        n, tokens, seconds = self._quiet
        if n < MIN_BASELINE_INTERVALS or seconds <= 0:
            return None
        return tokens / seconds

    def _remember(self, iv: Interval) -> None:
        # Running sums over the undisturbed intervals in the history, so the
        # per-batch decision stays O(1).
        if len(self._intervals) == self._intervals.maxlen:
            old = self._intervals[0]
            if old.dream_s == 0.0:
                n, t, s = self._quiet
                self._quiet = (n - 1, t - old.tokens, s - old.seconds)
        self._intervals.append(iv)
        if iv.dream_s == 0.0:
            n, t, s = self._quiet
            self._quiet = (n + 1, t + iv.tokens, s + iv.seconds)

    def record_decode(self, tokens: int) -> None:
        """Call right after a decode batch that produced `tokens` tokens."""
        now = self.clock()
        if self._last_end is not None:
            iv = Interval(now - self._last_end, tokens, self._dream_in_interval)
            r0 = self.undisturbed_rate()   # measured before this interval joins
            self._remember(iv)
            self.credit += self.value * iv.seconds
            if self.mode == "max_slowdown" and r0:
                self.credit -= iv.seconds - iv.tokens / r0 - iv.dream_s
            self.credit = min(self.credit, self._p50_step_s)
        self._last_end = now
        self._idle_since = None
        self._dream_in_interval = 0.0
        self._stepped_since_decode = False

    def record_dream(self, seconds: float) -> None:
        """Call after each micro-step the pacer allowed, with its measured time."""
        ms = seconds * 1000.0
        self._steps_ms.append(ms)
        self._max_step_ms = max(self._max_step_ms, ms)
        self._steps += 1
        self._p50_step_s = (_percentile(sorted(self._steps_ms), 50) or 0.0) / 1000.0
        if self._granted_idle:
            self._idle_steps += 1
            return
        self.credit -= seconds
        self._dream_in_interval += seconds
        self._stepped_since_decode = True

    # -- the decision ---------------------------------------------------------------
    def should_dream(self, active_slots: int) -> bool:
        now = self.clock()
        if active_slots <= 0:
            if self._idle_since is None:
                self._idle_since = self._last_end if self._last_end is not None else self._created
                self._last_end = None         # the next interval would include idle time
            self._granted_idle = now - self._idle_since >= self.idle_grace_s
            return self._granted_idle
        self._granted_idle = False
        if self._last_end is None or self._stepped_since_decode:
            return False                      # one micro-step per decode batch
        if self.mode == "max_slowdown" and self.undisturbed_rate() is None:
            return False                      # measure the undisturbed rate first
        return self.credit >= 0.0

    def idle_wait_s(self) -> float:
        """How long an idle engine should wait before asking again."""
        if self._idle_since is None:
            return self.idle_grace_s
        return max(0.0, self._idle_since + self.idle_grace_s - self.clock())

    # -- the report ------------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        ivs = list(self._intervals)
        busy = [iv for iv in ivs if iv.dream_s > 0]
        quiet = [iv for iv in ivs if iv.dream_s == 0]

        def rate(group: list[Interval]) -> float | None:
            s = sum(iv.seconds for iv in group)
            return sum(iv.tokens for iv in group) / s if s > 0 else None

        r0, overall = self.undisturbed_rate(), rate(ivs)
        total_s = sum(iv.seconds for iv in ivs)
        steps = sorted(self._steps_ms)
        return {
            "mode": self.mode,
            "target": self.value,
            "decode_tok_s_without": rate(quiet),
            "decode_tok_s_with": rate(busy),
            "decode_tok_s": overall,
            "realized_slowdown": (1.0 - overall / r0) if (r0 and overall is not None) else None,
            "dream_share": sum(iv.dream_s for iv in ivs) / total_s if total_s > 0 else None,
            "decode_batches_with": len(busy),
            "decode_batches_without": len(quiet),
            "micro_steps": self._steps,
            "idle_micro_steps": self._idle_steps,
            "micro_step_ms_p50": _percentile(steps, 50),
            "micro_step_ms_p95": _percentile(steps, 95),
            "micro_step_ms_max": self._max_step_ms if self._steps else None,
            "credit_ms": self.credit * 1000.0,
        }
