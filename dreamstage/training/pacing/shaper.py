"""The pause: how big each micro-step may be, and on how many threads.

`StepShaper` picks each step's chunk (a rung of the chunk ladder) and
thread count so that one step stays inside the job's `max_pause_ms`;
`DreamThreads` sets that thread count on the resident context for the step
only. `pacing.Pacer` decides *whether* a step runs; this decides its size.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dreamstage.training.pacing.pacer import SizeTimes, percentile


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

    `keep_chunk`: the chunk is not cut at all. The plain walk reads earlier
    chunks' K/V as constants, so a window cut into smaller chunks trains on
    another (truncated) gradient: on a loaded machine the pause bound changed
    what the job learned and how much it drifted (docs/benchmarks.md, "The
    kept chunk: the pause bound keeps the arithmetic"). With `keep_chunk` every step runs at
    the memory ladder's chunk, and the step deadline alone bounds the pause:
    a step still computing at `DEADLINE` of the bound stops between two
    segments of its graph and the next step goes on with it, so only when a
    step runs, never what it computes, depends on the load. That needs graphs
    that can stop (wholly on the CPU); the scheduler calls `cut()` when a step
    that could not stop (a graph on a GPU) passed the bound, and the shaper
    cuts chunks from then on. Aborts in a row cut chunks for `REARM_AFTER` steps
    (twice as many after each such cut), then the kept chunk is tried again: an
    aborted step is undone, so trying costs work, never the bound.

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
    DEADLINE = 0.9        # a step still computing at this fraction of the bound stops, goes on later (deadline_ms)...
    MIN_DEADLINE = 0.5    # ...less the pause's own overhead, but never below this fraction
    ABORT = 1.0           # a step still computing at this fraction of the bound (less overhead) is aborted, undone
    ABORTS_TO_CUT = 2     # keep_chunk: aborts in a row before the shaper cuts chunks after all...
    REARM_AFTER = 64      # ...for this many steps, then keeps the chunk again (doubled after each such cut)

    def __init__(self, max_pause_ms: float, rungs: Sequence[int], threads: Sequence[int] = (1,),
                 other_load: Callable[[], float] | None = None, cores: int | None = None,
                 keep_chunk: bool = False):
        """`other_load` (optional) says how many cores other work keeps busy now
        (the load average less our own threads); more threads are then probed
        only when that many cores are free: a probe that spins costs seconds."""
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
        self.stops = 0                        # steps stopped at the deadline
        self.aborts = 0                       # steps aborted at the time limit (abort_ms)
        self._aborts_in_row = 0
        self._wins: dict[int, int] = {}       # probes in a row that beat the current count
        self._last_seen: dict[int, tuple[int, float]] = {}   # per count: its latest (chunk, seconds)
        self.keep_chunk = bool(keep_chunk)
        self._stopped_s = 0.0                 # keep_chunk: the parts of a stopped step so far
        self._rearm_at: int | None = None     # step number at which aborts' cut ends
        self._rearm_gap = self.REARM_AFTER
        self._overhead: deque[float] = deque(maxlen=2 * self.SAMPLES)   # a pause less its native step, seconds
        if self.keep_chunk:
            self.chunk = self.rungs[0]

    def cut(self, retry: bool = False) -> None:
        """From now on cut chunks to keep the bound (a step that could not stop at
        its deadline, a graph on a GPU, passed it); the fit starts over. `retry`
        (aborts made the cut): the kept chunk comes back after `REARM_AFTER` steps."""
        if not self.keep_chunk:
            return
        self.keep_chunk = False
        self._rearm_at = self._step_no + self._rearm_gap if retry else None
        if retry:
            self._rearm_gap *= 2
        self._stopped_s = 0.0
        self._hold = None
        for times in self._times.values():
            times.clear()
        self._ratios.clear()
        self.chunk = self._rung_below(self.FIRST_CHUNK)

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
        chunk for it would cost training and buy no shorter pause (an A/B
        without the cap under two busy loops showed no shorter pauses)."""
        if len(self._ratios) < 4:
            return 1.25                      # until measured: a quarter of room
        return min(self.NOISE_CAP, max(1.0, percentile(sorted(self._ratios), 95) or 1.0))

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
        # nothing is predicted to fit: the smallest rung is the shortest pause
        # there is (never the cap, the biggest: one slow first step or a loaded
        # moment must not be answered with the longest step of all)
        return self.rungs[-1]

    # -- the choice -------------------------------------------------------------------------
    def choose(self, cap: int | None = None, trains: Callable[[int], bool] | None = None,
               cut: bool = False) -> tuple[int, int]:
        """(chunk, threads) for the next micro-step. `cap` is the memory
        ladder's chunk; `trains(chunk)` says whether a step of that many
        tokens from the walk's position would hold loss tokens (None: yes).
        `cut`: this step computes the same at any chunk (a forward-only
        evaluation, an exact group), so it is cut to the bound even with
        `keep_chunk`."""
        if self.keep_chunk and not cut:
            return self._choose_kept(cap)
        if self._hold is not None:
            cap = self._hold[0] if cap is None else min(cap, self._hold[0])
        if self._measured():
            self.chunk = self._best_rung(cap, trains)
            self._explore(cap, trains)
        chunk = min(self.chunk, cap) if cap is not None else self.chunk
        self._probe = other = self._due_probe()
        if other is not None:
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

    def _choose_kept(self, cap: int | None) -> tuple[int, int]:
        """keep_chunk: the memory ladder's chunk (or the biggest rung), on the
        current threads, or on another count when a probe is due (at the same
        chunk: the deadline bounds a probe's pause as any other step's)."""
        self.chunk = cap if cap is not None else self.rungs[0]
        self._probe = self._due_probe()
        return self.chunk, self.threads if self._probe is None else self._probe

    def _due_probe(self) -> int | None:
        """The thread count a probe is due for now (the nearest first: 2 before 8 when on 1), or None."""
        due = [t for t in self.thread_counts if t != self.threads and self._step_no >= self._probe_due[t]
               and self._cores_free_for(t)]
        if not due or not self._measured():
            return None
        return min(due, key=lambda t: abs(math.log(t / self.threads)))

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

    def record_overhead(self, seconds: float) -> None:
        """The part of a pause outside the native step (the receipt's store
        write, the walk, the pacer): the deadline leaves room for it."""
        if math.isfinite(seconds):
            self._overhead.append(max(0.0, seconds))

    def overhead(self) -> float:
        """95th percentile of the recent pauses' overhead, seconds (0 until four are measured)."""
        if len(self._overhead) < 4:
            return 0.0
        return percentile(sorted(self._overhead), 95) or 0.0

    def deadline_ms(self) -> float | None:
        """The time after which the next step stops (`Trainer.set_step_deadline`),
        or None: let it run to its end.

        A step the prediction said would fit but that is still computing at
        `DEADLINE` of the bound was slowed by something the fit could not see
        (a descheduled thread, a busy moment). It stops between two segments of
        its graph, keeping what it computed, and the next step goes on with it;
        so the pause stays inside the bound and no work is lost. None while the
        bound cannot be kept at all (the smallest rung is over it). With
        `keep_chunk` always: it is what bounds the pause.

        The deadline is on the native step, the pause is more: so it is
        `DEADLINE` of the bound, or less where the pauses' overhead (its 95th
        percentile) needs more room inside `TARGET` of it, but never below
        `MIN_DEADLINE` of the bound."""
        if not self.keep_chunk and self._limit > self.TARGET * self.max_pause_s:
            return None
        room = self.TARGET * self.max_pause_s - self.overhead()
        return max(self.MIN_DEADLINE * self.max_pause_s, min(self.DEADLINE * self.max_pause_s, room)) * 1000.0

    def abort_ms(self) -> float | None:
        """The time limit after which the next step is aborted between two
        graph nodes and undone (`Trainer.set_step_abort`), or None: no limit
        (when there is no deadline either).

        The deadline stops a step between segments, predicted from what each
        segment took; on a crowded machine a segment begun in time may still
        run far past the bound (the pause was 11.7 s at p95 under four busy loops
        per core). The limit is `ABORT` of the bound less the pauses' overhead,
        and never before the deadline."""
        deadline = self.deadline_ms()
        if deadline is None:
            return None
        return max(deadline, (self.ABORT * self.max_pause_s - self.overhead()) * 1000.0)

    def record_aborted(self, chunk_tokens: int) -> None:
        """After a step aborted at its time limit (undone: the walk starts the
        chunk again). The parts of a stopped step are gone with it. Where chunks
        are cut, the next is a rung smaller, held like after a step over the bound;
        with `keep_chunk` the chunk stays once (the native step now knows the slow
        segment, so the deadline stops before it), and `ABORTS_TO_CUT` aborts in a
        row cut chunks from then on (`cut`)."""
        self.aborts += 1
        self._aborts_in_row += 1
        self._stopped_s = 0.0
        self._probe = None
        if self.keep_chunk:
            if self._aborts_in_row >= self.ABORTS_TO_CUT:
                self.cut(retry=True)
            return
        self._exploring = None
        if chunk_tokens > self.rungs[-1]:
            self.chunk = self._rung_below(chunk_tokens - 1)
            self._hold = (self.chunk, self.HOLD_STEPS)
        self._last_slow = True

    def _probe_lost(self, threads: int) -> None:
        """A probe of `threads` did not win: its run of wins ends and the next
        probe of that count waits twice as long (up to MAX_PROBE_EVERY)."""
        self._wins.pop(threads, None)
        self._probe_gap[threads] = min(2 * self._probe_gap[threads], self.MAX_PROBE_EVERY)
        self._probe_due[threads] = self._step_no + self._probe_gap[threads]

    def record_stopped(self, seconds: float, chunk_tokens: int, threads: int) -> None:
        """After a step that stopped at the deadline (the next step goes on with
        it, same chunk and threads): its time is a part of the step's, so the
        fit does not take it. The chunk after that one is at least a rung
        smaller, held there like after a step over the bound. With `keep_chunk`
        the chunk stays, and the parts add up to the step's time (`record_rest`)."""
        self.stops += 1
        if self.keep_chunk:
            self._stopped_s += seconds
            return
        if self._probe is not None and threads == self._probe:
            self._probe = None                # a probe that needed two pauses lost
            self._probe_lost(threads)
        self._exploring = None
        if chunk_tokens > self.rungs[-1]:
            self.chunk = self._rung_below(chunk_tokens - 1)
            self._hold = (self.chunk, self.HOLD_STEPS if self._last_slow else 2)
        self._last_slow = True

    def record_rest(self, seconds: float, chunk_tokens: int, threads: int, trains: bool = True) -> None:
        """After the part of a stopped step that finished it. With `keep_chunk`
        the step's parts together are fitted as one step (every step there is
        the same chunk, cut into pauses by the deadline); otherwise not fitted
        (the first part made the shaper cut the chunk already)."""
        if not self.keep_chunk:
            return
        total, self._stopped_s = self._stopped_s + seconds, 0.0
        self.record(total, chunk_tokens, threads, trains)

    def record(self, seconds: float, chunk_tokens: int, threads: int, trains: bool = True) -> None:
        """After a micro-step: its whole time, the tokens it ran, the threads it
        used, and whether it trained (had loss tokens) or only ran forward."""
        if chunk_tokens <= 0:
            return
        self._aborts_in_row = 0
        self._last_seen[threads] = (chunk_tokens, seconds)
        if self._probe is not None and threads == self._probe:
            self._probe = None
            # per token against the current count at its own rung: the probe ran a
            # chunk no bigger, so its fixed cost weighs more, and a switch has to
            # win despite that (no flapping on a fit that knows one size only)
            now = self.predict(self.chunk, trains)
            if now is None or seconds / chunk_tokens >= self.SWITCH_GAIN * now / self.chunk:
                self._probe_lost(threads)
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
        if self.keep_chunk:
            # the fit serves the thread probes only: nothing to move down or hold
            predicted = self.predict(chunk_tokens, trains) if self._times[trains] else None
            if predicted:
                self._ratios.append(seconds / predicted)
            self._times[trains].add(chunk_tokens, seconds)
            self._step_no += 1
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
        if self._rearm_at is not None and self._step_no >= self._rearm_at:
            self._rearm_at, self._aborts_in_row = None, 0
            self.keep_chunk, self._hold = True, None
            self.chunk = self.rungs[0]

    def figures(self) -> dict[str, Any]:
        p = self.predict(self.chunk)
        return {
            "step_chunk": self.chunk,
            "dream_threads": self.threads,
            "thread_switches": self.switches,
            "steps_stopped": self.stops,
            "steps_aborted": self.aborts,
            "chunk_kept": self.keep_chunk,
            "step_ms_predicted": p * 1000.0 if p is not None else None,
            "step_noise": self.noise(),
            "pause_overhead_ms_p95": self.overhead() * 1000.0,
            "step_deadline_ms": self.deadline_ms(),
            "step_abort_ms": self.abort_ms(),
        }


def trains_from(mask, pos: int) -> Callable[[int], bool]:
    """Whether a chunk of n tokens at `pos` would hold loss tokens: it predicts
    tokens pos+1 .. pos+n (the mask convention of `dream_window_begin`)."""
    return lambda n: any(mask[pos + 1:pos + n + 1])
