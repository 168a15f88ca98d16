"""Serving and dream-stage counters and histograms, written by the engine thread only.

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
# Seconds. A micro-step is ~0.2 s on the project's 2-core CPU and can reach
# seconds under load; the pause is the step plus the store write around it.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
    mixed_batches: int = 0          # decode batches whose rows decoded with more than one adapter (base included)
    decode_failures: int = 0
    hook_errors: int = 0            # dream-hook calls that raised (logged, serving went on)
    model_reloads: int = 0          # the model loaded again once a failed RPC worker answered (engine._reconnect)
    evicted_prefixes: int = 0       # idle slots' cached prefixes dropped to make room in a unified K/V pool
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def count_request(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1


@dataclass
class DreamStats:
    """What the dream stage did, for /metrics. The job store keeps each job's
    own figures; these are the process's, across jobs."""
    steps: dict[str, int] = field(default_factory=dict)      # the jobs' micro-steps by receipt status
    refusals: dict[str, int] = field(default_factory=dict)   # by reason
    loss_tokens: int = 0            # tokens that carried loss
    walked_tokens: int = 0          # tokens run forward (+ backward): the receipts' chunk_tokens
    loss: float | None = None       # mean CE of the last micro-step that had loss tokens
    train_tok_s: float | None = None   # the current job's walked tokens per second of micro-step time
    memory_mib: dict[str, float] = field(default_factory=dict)   # the last ok receipt's *_mib, by part
    step: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))    # native micro-step time
    pause: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))   # what serving waited, store included
    # the last drift measurement (docs/architecture/drift.md): its job and figures
    drift_job: int | None = None
    drift_kl: float | None = None
    anchors_changed: float | None = None
    anchors_changed_raw: float | None = None   # near ties included (docs/architecture/drift.md)
    drift_anchors: int | None = None   # anchors it decoded: a slice during training, all of them at the end
    _job_walked: int = 0
    _job_ms: float = 0.0

    def job_started(self) -> None:
        self._job_walked, self._job_ms, self.train_tok_s = 0, 0.0, None

    def record_drift(self, job_id: int, drift) -> None:
        self.drift_job, self.drift_kl, self.anchors_changed = job_id, drift.drift_kl, drift.anchors_changed
        self.drift_anchors = drift.anchors
        self.anchors_changed_raw = getattr(drift, "anchors_changed_raw", drift.anchors_changed)

    def count_refusal(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def record(self, receipt) -> None:
        """One of a job's receipts (the Receipt dataclass)."""
        self.steps[receipt.status] = self.steps.get(receipt.status, 0) + 1
        if receipt.status == "refused":
            self.count_refusal("memory_gate")        # the gate is what refuses a step (dream-stage.md)
            return
        if receipt.status != "ok":
            return
        self.step.observe(receipt.ms / 1000.0)
        self.walked_tokens += receipt.chunk_tokens
        self.loss_tokens += receipt.tokens
        if receipt.tokens:
            self.loss = receipt.loss
        self._job_walked += receipt.chunk_tokens
        self._job_ms += receipt.ms
        if self._job_ms > 0:
            self.train_tok_s = self._job_walked / (self._job_ms / 1000.0)
        for part in ("graph", "context", "adapter", "optimizer", "walk"):
            self.memory_mib[part] = getattr(receipt, f"{part}_mib")
