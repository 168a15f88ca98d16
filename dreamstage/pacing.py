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
- an idle micro-step a request arrived during: the time that request waited.

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
credit). In debt it waits `idle_grace_s` and then steps only when the recent
gaps between requests say the next one is unlikely to arrive within a step.

**The pause (`StepShaper`).** The chunk of each step is a rung of the chunk
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

from dreamstage.trainspec import DEFAULT_MAX_PAUSE_MS, PacingSpec

DEFAULT_IDLE_GRACE_S = 0.2
MIN_BASELINE_BATCHES = 3       # undisturbed batches needed before max_slowdown dreams under load
HISTORY_BATCHES = 512          # recent active intervals the figures use
HISTORY_STEPS = 1024           # recent micro-step times for the percentiles
REFERENCE_BATCHES = 32         # undisturbed batch times kept per batch size
HISTORY_GAPS = 32              # recent idle gaps (slots empty -> next request)


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

    @property
    def seconds(self) -> float:
        return self.batch_s + self.dream_s + self.wait_s

    @property
    def undisturbed(self) -> bool:
        return self.dream_s == 0.0 and self.wait_s == 0.0 and not self.after_step


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
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
        if max_pause_ms is not None and not max_pause_ms > 0:
            raise ValueError(f"max_pause_ms {max_pause_ms!r} must be > 0")
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
        self._created = clock()
        self._idle_since: float | None = None
        self._granted_idle = False
        self._stepped_since_batch = False
        self._pending_dream_s = 0.0       # in-batch step time waiting for the next batch
        self._pending_wait_s = 0.0        # idle-collision wait waiting for the next batch
        self._after_step = False          # the next batch follows an in-batch step
        self._reference = SizeTimes(per_size=REFERENCE_BATCHES)
        self._last_step_s = 0.0
        self._intervals: deque[Interval] = deque(maxlen=HISTORY_BATCHES)
        self._gaps: deque[float] = deque(maxlen=HISTORY_GAPS)
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
        if self._idle_since is not None:
            # the request that ended the idle stretch arrived about when this batch began
            self._gaps.append(max(0.0, now - batch_s - self._pending_wait_s - self._idle_since))
            self._idle_since = None
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
                      size)
        self._intervals.append(iv)
        if iv.undisturbed:
            self._baseline += 1
        self._refill(batch_s)
        if self.mode == "max_slowdown" and contention:
            self._charge(contention)
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
        self._p50_step_s = (_percentile(sorted(self._steps_ms), 50) or 0.0) / 1000.0
        if self._granted_idle:
            self._idle_steps += 1
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
        return self.credit >= 0.0

    # -- the report --------------------------------------------------------------------
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
        lost = sum(iv.dream_s + iv.wait_s + iv.contention_s for iv in ivs)
        total_s = sum(iv.seconds for iv in ivs)
        steps = sorted(self._steps_ms)
        wall = self.clock() - self._created
        dream = self._dream_active_s + self._dream_idle_s
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
            "micro_step_ms_p50": _percentile(steps, 50),
            "micro_step_ms_p95": _percentile(steps, 95),
            "micro_step_ms_max": self._max_step_ms if self._steps else None,
            "pauses_over_max": self._over_pause,
            "wall_s": wall,
            "active_s": self._active_s,
            "dream_s": dream,
            "dream_idle_s": self._dream_idle_s,
            "job_share_of_wall": dream / wall if wall > 0 else None,
            "credit_ms": self.credit * 1000.0,
            "forgiven_ms": self.forgiven_s * 1000.0,
        }


class StepShaper:
    """Picks each micro-step's chunk (a rung of the ladder) and thread count
    so that one step stays inside `max_pause_ms`. Engine thread only.

    It fits step time = fixed + per_token * chunk through the last `SAMPLES`
    steps on the current thread count (`SizeTimes`), and takes the biggest
    rung whose prediction, times this machine's noise (the 95th percentile
    of measured / predicted over recent steps), fits the bound. A step over
    the bound moves down at once, by the measured ratio, and holds there for
    `HOLD_STEPS` (a whole fit window) when the step before was slow too, while
    the fit catches up with a machine that got slower.

    Threads: it starts on the fewest (one thread has no barrier to spin at,
    the safe choice on a machine shared with other programs; measured on the
    project VM under load: 0.2-0.4 s per step on one thread, 1.5-4.7 s on
    two). After `FIRST_PROBE` steps, and then every `PROBE_EVERY`, one step
    probes another count, at a chunk that should keep the bound (what that
    count last did, scaled; unseen: half). Two probes in a row that are
    clearly faster per token switch to it; a probe that loses doubles that
    count's interval (up to `MAX_PROBE_EVERY`), so a machine where more
    threads spin is not probed often. Before anything is measured the first
    step runs at most `FIRST_CHUNK` tokens. `rungs` is the chunk ladder;
    `threads` the counts the dream step may use."""

    FIRST_CHUNK = 8
    SAMPLES = 16          # recent steps the fit uses
    HOLD_STEPS = SAMPLES  # after a step over the bound, stay at or below the rung it moved to
    FIRST_PROBE = 4       # steps before the first probe of another thread count
    PROBE_EVERY = 48      # steps between probes of another thread count...
    MAX_PROBE_EVERY = 768  # ...doubled after each probe that lost, up to this
    SWITCH_GAIN = 0.9     # switch when a probe took less than this fraction of the current prediction
    TARGET = 0.95         # aim a little inside the bound: rungs are coarse, the noise estimate is not exact
    NOISE_CAP = 2.0       # the most room kept for noise (see noise())
    OVER_SMALLEST = 1.25  # when the bound cannot be kept: the longest pause over the shortest possible one
    EXPLORE_EVERY = 8     # steps between tries of an unmeasured rung above
    RELAX_FOR = 64        # steps a measurement of the smallest rung stands for
    FORWARD_TO_TRAIN = 4.0  # a training step over a forward-only one of the same chunk, until both are measured

    def __init__(self, max_pause_ms: float, rungs: Sequence[int], threads: Sequence[int] = (1,),
                 other_load: Callable[[], float] | None = None, cores: int | None = None):
        """`other_load` (optional) says how many cores other work keeps busy now
        (the load average less our own threads); more threads are then probed
        only when that many cores are free: a probe that spins costs seconds."""
        if not max_pause_ms > 0:
            raise ValueError(f"max_pause_ms {max_pause_ms!r} must be > 0")
        if not rungs or any(not isinstance(r, int) or r < 1 for r in rungs):
            raise ValueError(f"chunk rungs {list(rungs)!r} must be positive integers")
        if not threads or any(not isinstance(t, int) or t < 1 for t in threads):
            raise ValueError(f"thread counts {list(threads)!r} must be positive integers")
        self.max_pause_s = max_pause_ms / 1000.0
        self.other_load, self.cores = other_load, cores
        self.rungs = sorted(set(rungs), reverse=True)
        self.thread_counts = list(dict.fromkeys(threads))
        self.threads = min(self.thread_counts)
        first = [r for r in self.rungs if r <= self.FIRST_CHUNK]
        self.chunk = first[0] if first else self.rungs[-1]
        # per kind of step: True trains (forward and backward), False only runs
        # forward (a chunk with no loss tokens: a prompt, earlier turns), several
        # times cheaper; one fit for both would read the difference as noise
        self._times = {True: SizeTimes(window=self.SAMPLES), False: SizeTimes(window=self.SAMPLES)}
        self._ratios: deque[float] = deque(maxlen=2 * self.SAMPLES)   # measured / predicted
        self._step_no = 0
        self._probe: int | None = None        # the thread count the pending step probes
        self._probe_gap = {t: self.PROBE_EVERY for t in self.thread_counts}
        self._probe_due = {t: self.FIRST_PROBE for t in self.thread_counts}   # step numbers
        self._hold: tuple[int, int] | None = None   # (rung cap, steps left) after a step over the bound
        self._last_slow = False               # the last step took longer than predicted with noise
        self._limit = 0.0                     # the pause the last choice aimed under (the bound, or above it)
        self._explored = 0                    # step number of the last try of an unmeasured rung
        self._exploring: int | None = None    # the rung the pending step tries
        self._explore_failed: dict[int, int] = {}   # rung -> step number its try went over
        # recent steps at the smallest rung, per kind, and when the last one ran
        self._smallest: dict[bool, deque[float]] = {True: deque(maxlen=5), False: deque(maxlen=5)}
        self._smallest_at = {True: 0, False: 0}
        self.switches = 0
        self._wins: dict[int, int] = {}       # probes in a row that beat the current count
        self._last_seen: dict[int, tuple[int, float]] = {}   # per count: its latest (chunk, seconds)

    # -- the model ----------------------------------------------------------------------
    def predict(self, chunk: int, trains: bool = True) -> float | None:
        """Seconds one step of `chunk` tokens is expected to take on the current
        threads; `trains`: the chunk has loss tokens (a backward pass too)."""
        own = self._times[trains]
        if own:
            return own.predict(chunk)
        other = self._times[not trains]
        if not other:
            return None
        p = other.predict(chunk)
        if p is None:
            return None
        # from the other kind: a backward costs about 3x the forward (docs/benchmarks.md),
        # so a training step is read as 4 forward steps; a forward step as a training one
        return p * self.FORWARD_TO_TRAIN if trains else p

    def _measured(self) -> bool:
        return bool(self._times[True] or self._times[False])

    def noise(self) -> float:
        """95th percentile of measured / predicted step time, within [1, NOISE_CAP].

        Capped: a tail longer than that is a thread another program
        descheduled, which takes as long whatever the chunk; shrinking the
        chunk for it would cost training and buy no shorter pause."""
        if len(self._ratios) < 4:
            return 1.25                      # until measured: a quarter of room
        return min(self.NOISE_CAP, max(1.0, _percentile(sorted(self._ratios), 95) or 1.0))

    def _rung_below(self, tokens: float) -> int:
        fits = [r for r in self.rungs if r <= tokens]
        return fits[0] if fits else self.rungs[-1]

    def _best_rung(self, cap: int | None, trains: Callable[[int], bool] | None = None) -> int:
        noise = self.noise()
        limit = self.TARGET * self.max_pause_s
        # When steps at the smallest rung could not keep the bound either (a step's
        # fixed cost is above it), 1-token steps would buy a pause hardly shorter
        # at a fraction of the training: stay within OVER_SMALLEST of it. That
        # measurement expires after RELAX_FOR steps; the shaper then runs the
        # smallest rung again (the machine may have got faster).
        kind = trains(self.rungs[-1]) if trains is not None else True
        smallest = self._smallest[kind]
        if (len(smallest) >= 3 and self._step_no - self._smallest_at[kind] <= self.RELAX_FOR
                and statistics.median(smallest) * noise > limit):
            limit = self.OVER_SMALLEST * statistics.median(smallest) * noise
        self._limit = limit
        for r in self.rungs:
            if cap is not None and r > cap:
                continue
            p = self.predict(r, trains(r) if trains is not None else True)
            if p is not None and p * noise <= limit:
                return r
        return self._rung_below(cap) if cap is not None else self.rungs[-1]

    # -- the choice -------------------------------------------------------------------------
    def choose(self, cap: int | None = None, trains: Callable[[int], bool] | None = None) -> tuple[int, int]:
        """(chunk, threads) for the next micro-step. `cap` is the memory
        ladder's chunk; `trains(chunk)` says whether a step of that many
        tokens from the walk's position would hold loss tokens (None: yes)."""
        if self._hold is not None:
            cap = self._hold[0] if cap is None else min(cap, self._hold[0])
        if self._measured():
            self.chunk = self._best_rung(cap, trains)
            self._explore(cap, trains)
        chunk = min(self.chunk, cap) if cap is not None else self.chunk
        self._probe = None
        due = [t for t in self.thread_counts if t != self.threads and self._step_no >= self._probe_due[t]
               and self._cores_free_for(t)]
        if due and self._measured():
            # the nearest count first (2 before 8 when on 1)
            other = min(due, key=lambda t: abs(math.log(t / self.threads)))
            self._probe = other
            seen = self._last_seen.get(other)
            if seen is not None:
                # what that count last did, scaled to the bound (and never bigger than now)
                want = min(chunk, seen[0] * self.TARGET * self.max_pause_s / seen[1])
            elif other < self.threads:
                want = chunk * other / self.threads   # fewer threads: at worst perfect scaling
            else:
                want = chunk / 2                      # more threads may spin: half, to be safe
            return self._rung_below(want), other
        return chunk, self.threads

    def _explore(self, cap: int | None, trains: Callable[[int], bool] | None) -> None:
        """While no rung keeps the bound, now and then try the rung above when
        nothing was measured there.

        With one size in the window the fit scales a bigger chunk up linearly,
        which is right when time is mostly per token and far too slow when it
        is mostly the step's fixed cost; one step at the next rung settles it.
        Only when that rung would fit even if it cost no more than this one."""
        if (self._hold is not None or self._step_no - self._explored < self.EXPLORE_EVERY
                or self._limit <= self.TARGET * self.max_pause_s):
            return                            # only while the bound itself cannot be kept
        up = [r for r in self.rungs if r > self.chunk and (cap is None or r <= cap)]
        if not up:
            return
        nxt = up[-1]
        kind = trains(nxt) if trains is not None else True
        here = self.predict(self.chunk, kind)
        if (self._times[kind].line() is not None or self._times[kind]._by_size.get(nxt)
                or here is None or here * self.noise() > self._limit
                or self._step_no - self._explore_failed.get(nxt, -self.RELAX_FOR) < self.RELAX_FOR):
            return                            # the fit knows what bigger chunks cost, or a try just failed
        self._explored = self._step_no
        self._exploring = nxt
        self.chunk = nxt

    def _cores_free_for(self, threads: int) -> bool:
        if threads <= self.threads or self.other_load is None or self.cores is None:
            return True
        others = max(0.0, self.other_load() - self.threads)
        return others + threads <= self.cores + 0.5

    def record(self, seconds: float, chunk_tokens: int, threads: int, trains: bool = True) -> None:
        """After a micro-step: its whole time, the tokens it ran, the threads it
        used, and whether it trained (had loss tokens) or only ran forward."""
        if chunk_tokens <= 0:
            return
        self._last_seen[threads] = (chunk_tokens, seconds)
        if self._probe is not None and threads == self._probe:
            self._probe = None
            # per token against the current count at its own rung: the probe ran a
            # chunk no bigger, so its fixed cost weighs more, and a switch has to
            # win despite that (no flapping on a fit that knows one size only)
            now = self.predict(self.chunk, trains)
            if now is None or seconds / chunk_tokens >= self.SWITCH_GAIN * now / self.chunk:
                self._wins.pop(threads, None)
                self._probe_gap[threads] = min(2 * self._probe_gap[threads], self.MAX_PROBE_EVERY)
                self._probe_due[threads] = self._step_no + self._probe_gap[threads]
                return
            # one lucky step is not enough on a noisy machine: probe again at
            # once, and switch on the second win in a row
            self._wins[threads] = self._wins.get(threads, 0) + 1
            if self._wins[threads] < 2:
                self._probe_due[threads] = self._step_no
                return
            self._wins.clear()
            old = self.threads
            self._probe_gap[old] = self._probe_gap[threads] = self.PROBE_EVERY
            self._probe_due[old] = self._step_no + self.PROBE_EVERY
            self.threads = threads               # clearly faster: start over on this count
            for times in self._times.values():
                times.clear()
            self._times[trains].add(chunk_tokens, seconds)
            self._hold = None
            self.switches += 1
            return
        predicted = self.predict(chunk_tokens, trains) if self._times[trains] else None
        slow = predicted is not None and seconds > predicted * self.noise()
        if predicted:
            self._ratios.append(seconds / predicted)
        self._times[trains].add(chunk_tokens, seconds)
        if chunk_tokens == self.rungs[-1]:
            self._smallest[trains].append(seconds)
            self._smallest_at[trains] = self._step_no
        self._step_no += 1
        if self._hold is not None:
            self._hold = (self._hold[0], self._hold[1] - 1) if self._hold[1] > 1 else None
        tried, self._exploring = self._exploring, None
        if seconds > max(self.max_pause_s, self._limit) and tried == chunk_tokens:
            self._explore_failed[tried] = self._step_no
        if seconds > max(self.max_pause_s, self._limit):
            # Over the bound: the machine got slower, or this one step was
            # descheduled. Go down by the measured ratio at once; if the step
            # before was slow too, the machine changed: stay at most there until
            # the fit's window holds only steps measured since. A lone spike
            # costs two small steps.
            self.chunk = self._rung_below(chunk_tokens * max(self.max_pause_s, self._limit) / seconds)
            self._hold = (self.chunk, self.HOLD_STEPS if self._last_slow else 2)
            if self.chunk == self.rungs[-1]:
                # at the smallest rung: try fewer threads next (more would spin longer)
                for t in self.thread_counts:
                    if t < self.threads:
                        self._probe_due[t] = self._step_no
        self._last_slow = slow or seconds > max(self.max_pause_s, self._limit)

    def figures(self) -> dict[str, Any]:
        p = self.predict(self.chunk)
        return {
            "step_chunk": self.chunk,
            "dream_threads": self.threads,
            "thread_switches": self.switches,
            "step_ms_predicted": p * 1000.0 if p is not None else None,
            "step_noise": self.noise(),
        }
