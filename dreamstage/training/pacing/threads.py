"""A micro-step's threads: the count set on the resident context for the step, this
machine's load that the shaper weighs it against, and what a step ran (`StepRan`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class DreamThreads:
    """The thread count a micro-step computes with, set on the resident context
    just for the step and restored for serving afterwards.

    The dream graph runs through `llama_context::graph_compute`, which takes
    `n_threads_batch` (or `n_threads` for a one-token chunk) from the context's
    cparams; `llama_set_n_threads` only stores them, so switching per step is
    free. Engine thread only."""

    def __init__(self, resident):
        lc, ctx = getattr(resident, "lc", None), getattr(resident, "ctx", None)
        self.lc, self.ctx = lc, ctx
        if lc is None or ctx is None or not hasattr(lc, "llama_set_n_threads"):
            self.serve = None
            self.counts = [1]
            self.serve_batch = 1
            return
        self.serve = (int(lc.llama_n_threads(ctx)), int(lc.llama_n_threads_batch(ctx)))
        top = self.serve_batch = max(1, self.serve[1])
        counts = [top]
        while counts[-1] > 1:                         # the configured count and its halves down to one
            counts.append(counts[-1] // 2)
        self.counts = counts                          # the shaper starts on the fewest

    def run(self, threads: int, fn: Callable[[], Any]) -> Any:
        if self.serve is None or threads == self.serve[1] == self.serve[0]:
            return fn()
        self.lc.llama_set_n_threads(self.ctx, threads, threads)
        try:
            return fn()
        finally:
            self.lc.llama_set_n_threads(self.ctx, *self.serve)


def load_average() -> float:
    """Runnable threads on this machine (1-minute load average; 0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


@dataclass(frozen=True)
class StepRan:
    """The micro-step a `next()` ran, for the step shaper (None when it ran none)."""

    tokens: int             # the chunk's tokens
    threads: int
    trains: bool            # it had loss tokens
    kind: str               # "ok" | "stopped" (at its deadline) | "resumed" (the rest of a stopped step) | "aborted"
    native_ms: float
    before_s: float         # the pause's time before the native step
