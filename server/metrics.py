"""GET /metrics: serving's and the dream stage's figures, in Prometheus text format (dreamstage_ prefix).

prometheus_client formats and types them. The figures themselves stay in
the engine's and the scheduler's plain counters (written by the engine
thread without a lock on the decode path); a collector reads them at scrape
time, so nothing is counted twice and the engine imports no exporter.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from dreamstage.stats import Histogram
from dreamstage.training.walk.receipts import RECEIPT_STATUSES

# The classic text format generate_latest writes, as before (every Prometheus reads it).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
REQUEST_OUTCOMES = ("stop", "length", "cancelled", "invalid", "error")


def _histogram(name: str, help_: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, help_, buckets=h.cumulative(), sum_value=h.total)


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_, value=value)


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, value=value)


def _by(family, counts: dict[str, int], always: tuple[str, ...] = ()):
    for key in sorted(set(counts) | set(always)):
        family.add_metric([key], counts.get(key, 0))
    return family


class ServiceCollector:
    """Reads the service's counters at each scrape."""

    def __init__(self, service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        engine = self.service.engine
        s = engine.stats
        yield _counter("dreamstage_prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield _counter("dreamstage_prompt_tokens_cached", "Prompt tokens reused from a slot's cache.",
                       s.prompt_tokens_cached)
        yield _counter("dreamstage_generated_tokens", "Tokens sampled.", s.generated_tokens)
        yield _by(CounterMetricFamily("dreamstage_requests", "Finished requests by outcome.", labels=["outcome"]),
                  s.requests, REQUEST_OUTCOMES)
        yield _counter("dreamstage_decode_batches", "llama_decode calls made by the engine.", s.decode_batches)
        yield _counter("dreamstage_mixed_adapter_batches",
                       "Decode batches whose rows decoded with more than one adapter (the base counts as one).",
                       s.mixed_batches)
        yield _counter("dreamstage_decode_failures", "llama_decode calls that failed.", s.decode_failures)
        yield _counter("dreamstage_model_reloads", "Times the model was loaded again once a failed RPC worker "
                                                   "answered.", s.model_reloads)
        yield _histogram("dreamstage_time_to_first_token_seconds", "Submission to first sampled token.", s.ttft)
        yield _histogram("dreamstage_inter_token_latency_seconds", "Time between two sampled tokens of one request.",
                         s.itl)
        yield _gauge("dreamstage_busy_slots", "Slots serving a request.", engine.busy_slots())
        yield _gauge("dreamstage_slots", "Slots (parallel sequences).", engine.n_seq)
        yield _gauge("dreamstage_queue_depth", "Requests waiting for a slot.", engine.queue_depth)
        yield _gauge("dreamstage_adapter_version", "Served adapter version (0 = base model).", engine.adapter_version)
        dream = getattr(self.service, "scheduler", None)
        if dream is not None:
            yield from self._dream(dream)
        records = getattr(self.service, "records", None)
        if records is not None:
            yield from self._feedback(records)
        follower = getattr(self.service, "follower", None)
        if follower is not None:
            yield from self._follow(follower.status(detail=False))
        submitter = getattr(self.service, "submitter", None)
        if submitter is not None:
            yield _by(CounterMetricFamily("dreamstage_train_submissions_refused",
                                          "POST /train bodies refused, by error code.", labels=["code"]),
                      dict(submitter.refused), ("invalid_value", "limit_exceeded"))

    @staticmethod
    def _follow(status: dict) -> Iterator[Metric]:
        """A follower's channel (server/follow.py)."""
        yield _gauge("dreamstage_follow_in_sync", "1 while the follower serves the leader's promotions as of its "
                                                   "last answer, else 0.", 1 if status["state"] == "in_sync" else 0)
        if status["lag_s"] is not None:
            yield _gauge("dreamstage_follow_lag_seconds", "Seconds since the follower last confirmed it serves the "
                                                          "leader's promotions.", status["lag_s"])
        yield _counter("dreamstage_follow_refused_downloads", "Adapter downloads refused: their sha256 was not the "
                                                              "one the leader published.", status["refused_downloads"])
        since = status["unreachable_since"]
        yield _gauge("dreamstage_follow_leader_reachable", "0 while the leader does not answer (the follower serves "
                                                           "its last set), else 1.", 0 if since is not None else 1)
        if since is not None:
            yield _gauge("dreamstage_follow_unreachable_seconds", "Seconds since the leader stopped answering.",
                         round(max(0.0, time.time() - since), 3))
        yield _gauge("dreamstage_follow_failed_polls", "Rounds of the follow channel failed since the last one that "
                                                       "succeeded.", status["failed_polls"])

    @staticmethod
    def _feedback(records) -> Iterator[Metric]:
        """Read from the store at the scrape (a few indexed counts): feedback survives restarts, and so do these."""
        n = records.feedback_counts()
        yield _counter("dreamstage_feedback_received", "Feedback items received (POST /v1/feedback).", n["received"])
        yield _counter("dreamstage_feedback_used", "Feedback items trained by a job that finished.", n["used"])
        yield _gauge("dreamstage_feedback_training", "Feedback items in a job queued or training now.", n["training"])
        pending = GaugeMetricFamily("dreamstage_feedback_pending", "Feedback items waiting for a job, by adapter.",
                                    labels=["adapter"])
        for name, (count, _) in sorted(records.pending_counts().items()):
            pending.add_metric([name], count)
        yield pending
        kept, size = records.totals()
        yield _gauge("dreamstage_records", "Served answers recorded (serve --record).", kept)
        yield _gauge("dreamstage_records_bytes", "Bytes the records take in the store.", size)

    @staticmethod
    def _dream(dream) -> Iterator[Metric]:
        d = dream.stats
        yield _by(CounterMetricFamily("dreamstage_dream_steps", "Training micro-steps by receipt status.",
                                      labels=["status"]), dict(d.steps), RECEIPT_STATUSES)
        yield _by(CounterMetricFamily("dreamstage_dream_refusals", "Refused micro-steps and job starts, by reason.",
                                      labels=["reason"]), dict(d.refusals), ("memory_gate",))
        yield _counter("dreamstage_dream_tokens", "Tokens run forward (and backward) by training micro-steps.",
                       d.walked_tokens)
        yield _counter("dreamstage_dream_loss_tokens", "Tokens that carried loss in training micro-steps.",
                       d.loss_tokens)
        yield _histogram("dreamstage_dream_step_seconds", "Native time of one training micro-step.", d.step)
        yield _histogram("dreamstage_dream_pause_seconds",
                         "What serving waited for one dream step (the micro-step and its store writes).", d.pause)
        if d.train_tok_s is not None:
            yield _gauge("dreamstage_dream_train_tokens_per_second",
                         "The current job's walked tokens per second of micro-step time.", d.train_tok_s)
        if d.loss is not None:
            yield _gauge("dreamstage_dream_loss", "Mean cross-entropy of the last micro-step with loss tokens.",
                         d.loss)
        if d.drift_job is not None:
            for name, help_, value in (
                    ("dreamstage_dream_drift_kl", "Mean KL(base || adapter) on the anchors' answer tokens, nats, "
                                                  "at the last drift measurement.", d.drift_kl),
                    ("dreamstage_dream_anchors_changed", "Fraction of anchor answers the last measured adapter "
                                                         "changed beyond the noise margin.", d.anchors_changed),
                    ("dreamstage_dream_anchors_changed_raw", "Fraction of anchor answers the last measured "
                                                             "adapter changed at all, near ties included.",
                     d.anchors_changed_raw),
                    ("dreamstage_dream_drift_anchors", "Held-out anchors the last drift measurement decoded "
                                                       "(a slice during training, all after it).", d.drift_anchors)):
                g = GaugeMetricFamily(name, help_, labels=["job"])
                g.add_metric([str(d.drift_job)], value)
                yield g
        memory = GaugeMetricFamily("dreamstage_dream_memory_mib", "The last ok receipt's memory, MiB, by part.",
                                   labels=["part"])
        for part, mib in sorted(d.memory_mib.items()):
            memory.add_metric([part], mib)
        yield memory
        yield _gauge("dreamstage_dream_active_job", "The job training now (0: none).", dream.active_job or 0)


def registry(service) -> CollectorRegistry:
    """A registry of this service only (several servers may share a process, as the tests do)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ServiceCollector(service))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
