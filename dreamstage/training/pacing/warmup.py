"""The drift records made ahead of time, while the server is idle.

Every job's drift guard starts by recording the base model's answers to the
shipped anchors (drift_guard.DriftGuard.record): about 40 anchors of some 30
decodes each, done once per process and cached by prompt. A job pays for it
inside its pacing, so under a steady chat client, which leaves the job a tenth
of the time, the recording alone took minutes. Idle time costs chat nothing,
so the scheduler records the default job's anchors in it before any job asks:
`AnchorWarmup.step` is called from the dream hook only while no job is active
and nothing was served for a second (scheduler.WARMUP_AFTER_IDLE_S: nothing
paces the warm-up, so a steady client's short gaps are not its to take), and
runs one probe step (a few decodes,
within the step's time budget) on an idle slot's leased sequence, which
serving takes back whenever it needs the slot. Once the records are made, it
measures the noise margin of the default adapter shape the same way (its null
draws: a server's first default job would spend them inside its pacing), on a
trainer made for it and closed after. A job that starts first stops the
warm-up; its guard makes whatever is still missing, through the same code and
the same caches.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator
from typing import Any

from dreamstage.training.drift.guard import DriftGuard
from dreamstage.training.jobs.request import parse_train_request

log = logging.getLogger("dreamstage.drift")


# The warm-up's trainer lends only its adapter (the null draws' A and served copy): the
# smallest window keeps its training memory small.
MARGIN_TRAINER_WINDOW = 32


class AnchorWarmup:
    def __init__(self, resident, cache: dict, lend: Callable[[], Any], enter: Callable[[], None],
                 restore: Callable[[], None], noise_cache: dict | None = None,
                 make_trainer: Callable[..., Any] | None = None):
        self.resident, self.cache, self.lend, self.enter, self.restore = resident, cache, lend, enter, restore
        self.noise_cache, self.make_trainer = noise_cache, make_trainer
        self.done = False
        self.steps = 0
        self._recorded = False          # the records are made; the noise margin may follow
        self._gen: Generator[None, None, None] | None = None

    def _start(self) -> Generator[None, None, None]:
        spec = parse_train_request({"text": "warm-up"}).to_job_spec()     # the defaults a job gets
        guard = DriftGuard(self.resident, spec, [], seq_id=self.lend, restore=self.restore, enter=self.enter,
                           cache=self.cache, noise_cache=self.noise_cache)
        yield from guard.record()
        self._recorded = True
        make = self.make_trainer
        if make is not None:
            small = dataclasses.replace(spec, window=MARGIN_TRAINER_WINDOW, chunk=MARGIN_TRAINER_WINDOW)
            yield from guard.margin_ahead(lambda: make(self.resident, small, small.chunk))

    def step(self) -> bool:
        """One step of the recording; False when there is nothing left to do."""
        if self.done:
            return False
        try:
            if self._gen is None:
                self._gen = self._start()
            next(self._gen)
            self.steps += 1
        except StopIteration:
            self.done, self._gen = True, None
            log.info("drift anchors recorded ahead of any job (%d idle steps)", self.steps)
        except Exception:
            # a job's guard records (and reports) for itself; the warm-up only saves it time
            log.exception("recording the drift anchors while idle failed; jobs will record them")
            self.stop()
            self.done = True
        return True

    def take_recorded(self) -> bool:
        """True once, at the first call after the records are all made (the scheduler saves
        them then, before the noise margin's minutes of draws)."""
        recorded, self._recorded = self._recorded, False
        return recorded

    def stop(self) -> None:
        """Give the leased sequence back; a later step starts over on what is not cached yet."""
        if self._gen is not None:
            gen, self._gen = self._gen, None
            gen.close()
