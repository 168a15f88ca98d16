"""Serving counters and histograms, written by the engine thread only.

Readers (the /metrics route) take plain snapshots; a torn read of one bucket
is harmless for monitoring, so no lock sits on the decode path.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds. Time to first token spans queueing plus prefill; inter-token
# latency is one decode step, milliseconds on CPU for small models.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, plus +Inf last
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip((*(repr(x) for x in self.buckets), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((b, acc))
        return out


@dataclass
class EngineStats:
    requests: dict[str, int] = field(default_factory=dict)  # by finish reason / outcome
    prompt_tokens: int = 0          # prompt tokens of admitted requests
    prompt_tokens_cached: int = 0   # of those, reused from a slot's cache
    generated_tokens: int = 0
    decode_batches: int = 0
    decode_failures: int = 0
    hook_errors: int = 0            # dream-hook calls that raised (logged, serving went on)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def count_request(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1
