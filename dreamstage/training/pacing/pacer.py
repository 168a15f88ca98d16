"""Pacing: may the engine run one dream micro-step now, and how big may it be?

Two promises, kept at once:

- **chat's bound.** `max_slowdown` s: chat's throughput while it is being
  served slows by at most s. `share` f: dreaming takes f of the time chat is
  being served.
- **training's share.** The job gets all the time the bound allows, plus the
  idle time between and after requests.

and a third one for a single turn: **the pause.** No micro-step takes longer
than the job's `max_pause_ms`, so a request that arrives waits at most that.

Everything is measured with the injected clock, never assumed from a model of
the hardware. Time is measured per decode batch (the engine's own work for
that batch), never as the gap between two batch ends: a gap may hold a
request's round trip, a prompt batch of another shape, or a thread the OS
descheduled, and none of that was caused by dreaming.

**The ledger (`Pacer`).** Active time W is the engine's batch time plus the
micro-steps run between batches plus the time a request waited for an idle
micro-step. Chat without the job would have needed W minus what the job cost
it, so the slowdown is (job's cost) / W. A token bucket, `credit` in seconds,
refills s * W (or f * W) and is charged the job's cost:

- a micro-step between two batches: its whole time;
- with `max_slowdown`, the contention it caused: how much longer the next
  batch took than the median undisturbed batch of its size (signed, so noise
  averages out, and within +-the step's own time);
- an idle micro-step a request arrived during: the time that request waited;
- with `max_slowdown`, a request that came late after a gap an idle step ran
  in (its client lost the CPU to the step): the gap against the usual gap
  without a step, signed, within +-the last step's time (`_gap_lateness`).

Nothing else is charged. In particular a slow batch with no micro-step
before it (another process took the core) costs the job nothing: that was
the machine, not the job. A step between batches starts only at credit >= 0,
at most one per decode batch, so debt comes from one step's cost; idle
collisions, the one charge a step started in debt can add, are floored at
`debt_floor_s` and what the floor forgives is reported. Credit is capped at
two pauses, so quiet periods do not bank a burst.

**Idle.** With no busy slot a micro-step costs chat nothing unless a request
arrives while it runs. With credit >= 0 the pacer dreams at once (the gaps
between back-to-back requests are used; a collision is paid from the
credit). While such gaps recur, an in-batch step waits for a whole step's
credit, so the credit goes to the gaps first, where part of a step is free.
In debt it waits `idle_grace_s` and then steps only when the recent gaps
between requests say the next one is unlikely to arrive within a step.

**The pause (`shaper.StepShaper`).** The chunk of each step is a rung of the chunk
ladder, the biggest whose predicted time (a fit of recent steps, times this
machine's noise) fits `max_pause_ms`; a step over it moves down at once.
Under load from other programs a step is faster on fewer threads (ggml's
workers meet at a spinning barrier after every node, and one that lost its
core stalls the rest), so the shaper starts on one thread and probes more
only when cores are free, switching when they are clearly faster.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dreamstage.training.jobs.spec import DEFAULT_MAX_PAUSE_MS, PacingSpec

DEFAULT_IDLE_GRACE_S = 0.2
MIN_BASELINE_BATCHES = 3       # undisturbed batches needed before max_slowdown dreams under load
HISTORY_BATCHES = 512          # recent active intervals the figures use
HISTORY_STEPS = 1024           # recent micro-step times for the percentiles
REFERENCE_BATCHES = 32         # undisturbed batch times kept per batch size
HISTORY_GAPS = 32              # recent idle gaps (slots empty -> next request)
# Gaps "recur" while at least RECUR_GAPS of them ended within the last
# RECUR_WINDOW_S: a client that sends its next request as soon as a reply
# ends leaves one round trip between requests, every few hundred ms.
RECUR_GAPS = 2
RECUR_WINDOW_S = 5.0


@dataclass(frozen=True)
class Interval:
    """One active interval: a decode batch and what the dream stage did right before it."""

    tokens: int        # decode tokens the batch produced
    batch_s: float     # the engine's time for the batch
    dream_s: float     # micro-step time charged to this interval (0 when none ran)
    wait_s: float      # time a request waited for an idle micro-step before this batch
    contention_s: float = 0.0   # estimated extra batch time caused by the step before it
    after_step: bool = False    # an in-batch micro-step ran right before this batch
    size: int = 0               # the batch's tokens, prompt tokens included
    late_s: float = 0.0         # how much later than usual its request came after a gap with steps in it

    @property
    def seconds(self) -> float:
        return self.batch_s + self.dream_s + self.wait_s + self.late_s

    @property
    def undisturbed(self) -> bool:
        return self.dream_s == 0.0 and self.wait_s == 0.0 and not self.after_step


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class SizeTimes:
    """Recent times of some work by its size (a batch's tokens, a step's chunk),
    and a straight line through them: time = fixed + per_token * size.

    A size measured three times or more answers with its own median; other
    sizes from the line through every size's typical time. With one size
    measured there is no line: a bigger size is scaled up linearly and a
    smaller one takes at most as long (both err on the slow side)."""

    def __init__(self, per_size: int = 16, sizes: int = 32, window: int = 0):
        self.per_size, self.max_sizes = per_size, sizes
        self._by_size: dict[int, deque[float]] = {}
        # window > 0: only the last `window` samples of any size count, so the
        # whole picture follows a machine that got slower, not just one size
        self._recent: deque[tuple[int, float]] | None = deque(maxlen=window) if window else None

    def add(self, size: int, seconds: float) -> None:
        if self._recent is not None:
            self._recent.append((size, seconds))
            by: dict[int, deque[float]] = {}
            for n, sec in self._recent:
                by.setdefault(n, deque()).append(sec)
            self._by_size = by
            return
        d = self._by_size.pop(size, None) or deque(maxlen=self.per_size)
        d.append(seconds)
        self._by_size[size] = d                  # most recently used last
        if len(self._by_size) > self.max_sizes:
            del self._by_size[next(iter(self._by_size))]

    def clear(self) -> None:
        self._by_size = {}
        if self._recent is not None:
            self._recent.clear()

    def __bool__(self) -> bool:
        return bool(self._by_size)

    @staticmethod
    def _typical(v: Sequence[float]) -> float:
        # the median once a size has three samples; before that the fastest, so
        # one descheduled run does not condemn a size
        return statistics.median(v) if len(v) >= 3 else min(v)

    def line(self) -> tuple[float, float] | None:
        pts = [(n, self._typical(v)) for n, v in self._by_size.items()]
        if len(pts) < 2:
            return None
        mn = sum(n for n, _ in pts) / len(pts)
        ms = sum(t for _, t in pts) / len(pts)
        var = sum((n - mn) ** 2 for n, _ in pts)
        slope = sum((n - mn) * (t - ms) for n, t in pts) / var
        if slope <= 0:
            return None                          # noise swamped the sizes
        return max(0.0, ms - slope * mn), slope

    def predict(self, size: int) -> float | None:
        own = self._by_size.get(size)
        if own and len(own) >= 3:
            return self._typical(own)
        line = self.line()
        if line is not None:
            return line[0] + line[1] * size
        if own:
            return self._typical(own)
        if not self._by_size:
            return None
        # no line: scale from the biggest size measured at or below, else the smallest above
        below = [n for n in self._by_size if n <= size]
        n = max(below) if below else min(self._by_size)
        t = self._typical(self._by_size[n])
        return t * max(1.0, size / n)


class Pacer:
    """The ledger and the decision. Engine thread only."""

    def __init__(self, mode: str, value: float, *, clock: Callable[[], float] = time.monotonic,
                 idle_grace_s: float = DEFAULT_IDLE_GRACE_S, max_pause_ms: float | None = DEFAULT_MAX_PAUSE_MS,
                 debt_floor_s: float | None = None):
        if mode not in ("share", "max_slowdown"):
            raise ValueError(f"pacing mode {mode!r} is not one of share, max_slowdown")
        if not 0.0 < value < 1.0:
            raise ValueError(f"{mode} {value!r} must be in (0, 1)")
        if idle_grace_s < 0:
            raise ValueError(f"idle_grace_s {idle_grace_s!r} must be >= 0")
        self.mode, self.value = mode, float(value)
        self.clock = clock
        self.idle_grace_s = idle_grace_s
        # None: the job set no pause bound; the ledger's sizes then assume the default
        self.max_pause_s = max_pause_ms / 1000.0 if max_pause_ms is not None else None
        scale_s = self.max_pause_s or DEFAULT_MAX_PAUSE_MS / 1000.0
        self._scale_s = scale_s
        # Debt beyond a few pauses can only come from idle collisions in debt;
        # flooring it keeps one unlucky stretch from starving the job for minutes.
        self.debt_floor_s = debt_floor_s if debt_floor_s is not None else 4.0 * scale_s
        self.credit = 0.0
        self.forgiven_s = 0.0
        self.late_s = 0.0                 # requests' lateness charged after gaps idle steps ran in (signed sum)
        self._created = clock()
        self._idle_since: float | None = None
        self._idle_s = 0.0                # closed idle stretches: slots empty until the next request arrived
        self._granted_idle = False
        self._stepped_since_batch = False
        self._pending_dream_s = 0.0       # in-batch step time waiting for the next batch
        self._pending_wait_s = 0.0        # idle-collision wait waiting for the next batch
        self._after_step = False          # the next batch follows an in-batch step
        self._reference = SizeTimes(per_size=REFERENCE_BATCHES)
        self._last_step_s = 0.0
        self._intervals: deque[Interval] = deque(maxlen=HISTORY_BATCHES)
        self._gaps: deque[float] = deque(maxlen=HISTORY_GAPS)
        self._gap_ends: deque[float] = deque(maxlen=RECUR_GAPS)
        self._quiet_gaps: deque[float] = deque(maxlen=HISTORY_GAPS)   # gaps no step ran in
        self._gap_last_step_s = 0.0       # the last idle step's time in the current gap (0: none ran)
        self._steps_ms: deque[float] = deque(maxlen=HISTORY_STEPS)
        self._p50_step_s = 0.0
        self._max_step_ms = 0.0
        self._steps = 0
        self._idle_steps = 0
        self._collisions = 0
        self._over_pause = 0
        self._active_s = 0.0
        self._dream_active_s = 0.0
        self._dream_idle_s = 0.0
        self._baseline = 0                # undisturbed batches seen

    @classmethod
    def from_spec(cls, spec: PacingSpec, **kw: Any) -> Pacer:
        return cls(spec.mode, spec.value, max_pause_ms=spec.max_pause_ms, **kw)

    # -- the ledger -----------------------------------------------------------------
    def _refill(self, seconds: float) -> None:
        self._active_s += seconds
        self.credit += self.value * seconds

    def _charge(self, seconds: float) -> None:
        self.credit -= seconds

    def _cap_credit(self) -> None:
        # Banked credit only ever buys one step per batch, so two pauses' worth
        # is enough: a long prompt batch refills more than one step, and a
        # smaller cap would throw that share away.
        self.credit = min(self.credit, 2.0 * max(self._p50_step_s, self._scale_s))

    def reference_batch_s(self, batch_tokens: int) -> float | None:
        """Median time of recent undisturbed batches of this size, or the line
        through the other sizes (None before any undisturbed batch). The median,
        because one descheduled batch must not move what "usual" means."""
        return self._reference.predict(batch_tokens)

    # -- measurements -------------------------------------------------------------------
    def record_batch(self, tokens: int, batch_s: float | None, batch_tokens: int | None = None) -> None:
        """Call right after a decode batch: `tokens` decode tokens it produced,
        `batch_s` the engine's time for it (None when unknown: the batch then
        only ends the previous one's turn), `batch_tokens` every token in it
        (prompt tokens included; the size its reference time is kept under)."""
        if batch_s is None:
            self._idle_since = None
            self._stepped_since_batch = self._granted_idle = False
            return
        if batch_s < 0:
            raise ValueError(f"batch_s {batch_s!r} must be >= 0")
        now = self.clock()
        size = batch_tokens if batch_tokens is not None else tokens
        late = 0.0
        if self._idle_since is not None:
            # the request that ended the idle stretch arrived about when this batch began
            gap = max(0.0, now - batch_s - self._pending_wait_s - self._idle_since)
            self._idle_s += gap
            self._gaps.append(gap)
            self._gap_ends.append(now)
            late = self._gap_lateness(gap)
            self._idle_since = None
            self._gap_last_step_s = 0.0
        contention = 0.0
        if self._after_step:
            ref = self.reference_batch_s(size)
            if ref is not None:
                # Signed, so that noise averages out, and within +-the step's own
                # time: a cold cache cannot cost more than the step that cooled
                # it, and a batch another program descheduled for seconds says
                # nothing about the step.
                bound = self._last_step_s
                contention = max(-bound, min(batch_s - ref, bound))
        else:
            self._reference.add(size, batch_s)
        iv = Interval(tokens, batch_s, self._pending_dream_s, self._pending_wait_s, contention, self._after_step,
                      size, late)
        self._intervals.append(iv)
        if iv.undisturbed:
            self._baseline += 1
        self._refill(batch_s + late)
        if self.mode == "max_slowdown" and contention:
            self._charge(contention)
        if late:
            self._charge(late)
            self.late_s += late
        self._cap_credit()
        self._pending_dream_s = self._pending_wait_s = 0.0
        self._after_step = False
        self._stepped_since_batch = False
        self._granted_idle = False

    def record_dream(self, seconds: float, waited_s: float = 0.0) -> None:
        """Call after each micro-step the pacer allowed, with its measured time
        and, for an idle step, how long the oldest request that arrived during
        it had waited when it ended (0 when none arrived)."""
        ms = seconds * 1000.0
        self._last_step_s = seconds
        self._steps_ms.append(ms)
        self._max_step_ms = max(self._max_step_ms, ms)
        self._steps += 1
        if self.max_pause_s is not None and seconds > self.max_pause_s:
            self._over_pause += 1
        self._p50_step_s = (percentile(sorted(self._steps_ms), 50) or 0.0) / 1000.0
        if self._granted_idle:
            self._idle_steps += 1
            self._gap_last_step_s = seconds
            self._after_step = True           # the batch after it may pay for a cold cache too
            waited = min(max(waited_s, 0.0), seconds)
            self._dream_idle_s += seconds - waited
            if waited > 0:
                # the request was being served (waiting) during that part of the step
                self._collisions += 1
                self._pending_wait_s += waited
                self._dream_active_s += waited
                self._refill(waited)
                # Collisions are the one charge a step started in debt can add, so
                # they alone are floored; what the floor forgives is reported.
                charge = min(waited, max(0.0, self.credit + self.debt_floor_s))
                self.forgiven_s += waited - charge
                self._charge(charge)
                self._cap_credit()
            return
        self._pending_dream_s += seconds
        self._dream_active_s += seconds
        self._after_step = True
        self._stepped_since_batch = True
        self._refill(seconds)
        self._charge(seconds)
        self._cap_credit()

    # -- the decision -----------------------------------------------------------------
    def _idle_step_ok(self, idle_s: float) -> bool:
        """May an idle micro-step start after `idle_s` of idleness?

        With credit, yes: a request arriving during the step is paid for. In
        debt, only past the grace and only when recent gaps between requests
        say the next one is unlikely (<= 20%) to arrive during this step: a
        client that returns every 0.3 s is not stepped into each time, and a
        long pause is used until shortly before it usually ends."""
        if self.credit >= 0.0:
            return True
        if idle_s < self.idle_grace_s:
            return False
        longer = [g for g in self._gaps if g > idle_s]
        if len(longer) < 3:
            return True                       # longer than most gaps seen: nobody is about to come
        step = self._p50_step_s or self._scale_s
        ending = sum(1 for g in longer if g <= idle_s + step)
        return ending <= 0.2 * len(longer)

    def should_dream(self, active_slots: int) -> bool:
        now = self.clock()
        if active_slots <= 0:
            if self._idle_since is None:
                self._idle_since = now
            self._granted_idle = self._idle_step_ok(now - self._idle_since)
            return self._granted_idle
        self._granted_idle = False
        if self._stepped_since_batch:
            return False                  # one micro-step per decode batch
        if self.mode == "max_slowdown" and self._baseline < MIN_BASELINE_BATCHES:
            return False                  # measure undisturbed batches first
        return self.credit >= self._gap_reserve(now)

    def _gap_lateness(self, gap: float) -> float:
        """How much later than usual a request came after a gap that idle steps
        ran in: the gap against the median of recent gaps without a step,
        signed so that noise averages out, and within +-the last step's time.

        On a machine with a free core the client's next request comes when it
        would have come anyway, and this is noise about zero. On one whose
        cores are all taken (other programs, the clients themselves), an idle
        step takes CPU from the client that is about to send the next request:
        the request comes late and chat loses that time, which no wait in the
        engine's queue shows. Only the step that ran while the client was
        getting its request ready can have delayed it, hence the bound; a gap
        longer than usual by more than two such steps is a pause of the
        client's own (a burst's end, a user reading) and costs nothing.
        `max_slowdown` charges it; `share` (f of the time chat is served)
        does not, as it charges no contention."""
        step = self._gap_last_step_s
        if step <= 0.0:
            self._quiet_gaps.append(gap)
            return 0.0
        if self.mode != "max_slowdown" or len(self._quiet_gaps) < MIN_BASELINE_BATCHES:
            return 0.0
        extra = gap - statistics.median(self._quiet_gaps)
        if extra > 2.0 * step:
            return 0.0
        return max(-step, min(extra, step))

    def _gap_reserve(self, now: float) -> float:
        """Credit an in-batch step must leave for the next gap between requests.

        A step that starts when the slots empty is free until the next
        request arrives and charged only the wait after that; the same step
        between two batches is charged all of its time. So while gaps recur
        (a client's round trip after each reply), credit is spent in them
        first: an in-batch step needs a whole step's credit banked. Where no
        gaps come (streaming clients that keep a slot busy), nothing is
        reserved and the credit goes to in-batch steps as it comes."""
        if len(self._gap_ends) < RECUR_GAPS or now - self._gap_ends[0] > RECUR_WINDOW_S:
            return 0.0
        return self._p50_step_s or self._scale_s

    # -- the report --------------------------------------------------------------------
    def ledger(self) -> tuple[float, float, float, float]:
        """(clock, seconds of chat's batches and the steps between them,
        seconds the job trained (in chat's time and in idle time), seconds
        idle) so far. Idle is time with no request in the system: from the
        moment the slots emptied to the next request's arrival (steps that ran
        then included), the open stretch too. The rest of the wall time is
        chat's, the serving loop's own work between batches included. Read
        twice, the difference is a window's ledger (bench_dream_pacing reads
        the clients' window)."""
        now = self.clock()
        idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        return now, self._active_s, self._dream_active_s + self._dream_idle_s, idle

    def figures(self) -> dict[str, Any]:
        ivs = list(self._intervals)
        busy = [iv for iv in ivs if iv.dream_s > 0 or iv.wait_s > 0]
        quiet = [iv for iv in ivs if iv.undisturbed]

        def rate(group: list[Interval]) -> float | None:
            s = sum(iv.seconds for iv in group)
            return sum(iv.tokens for iv in group) / s if s > 0 else None

        r0, overall = rate(quiet), rate(ivs)
        # What chat lost over the recent intervals, as measured: the steps it
        # waited for, the waits behind idle steps, and the extra time of the
        # batches right after a step. (Comparing tok/s with and without steps
        # would be noisier: every batch's noise, and a different mix of prompt
        # and decode batches on each side, would read as slowdown.)
        lost = sum(iv.dream_s + iv.wait_s + iv.contention_s + iv.late_s for iv in ivs)
        total_s = sum(iv.seconds for iv in ivs)
        steps = sorted(self._steps_ms)
        now, active, dream, idle = self.ledger()
        wall = now - self._created
        return {
            "mode": self.mode,
            "target": self.value,
            "max_pause_ms": self.max_pause_s * 1000.0 if self.max_pause_s is not None else None,
            "decode_tok_s_without": r0,
            "decode_tok_s_with": rate(busy),
            "decode_tok_s": overall,
            "realized_slowdown": lost / total_s if total_s > 0 else None,
            "dream_share": sum(iv.dream_s + iv.wait_s for iv in ivs) / total_s if total_s > 0 else None,
            "decode_batches_with": len(busy),
            "decode_batches_without": len(quiet),
            "micro_steps": self._steps,
            "idle_micro_steps": self._idle_steps,
            "idle_collisions": self._collisions,
            "micro_step_ms_p50": percentile(steps, 50),
            "micro_step_ms_p95": percentile(steps, 95),
            "micro_step_ms_p99": percentile(steps, 99),
            "micro_step_ms_max": self._max_step_ms if self._steps else None,
            "pauses_over_max": self._over_pause,
            "wall_s": wall,
            "active_s": active,
            "dream_s": dream,
            "dream_idle_s": self._dream_idle_s,
            "idle_s": idle,
            "job_share_of_wall": dream / wall if wall > 0 else None,
            "credit_ms": self.credit * 1000.0,
            "forgiven_ms": self.forgiven_s * 1000.0,
            "late_ms": self.late_s * 1000.0,
        }
