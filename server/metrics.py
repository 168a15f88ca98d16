"""GET /metrics: the engine's counters in Prometheus text format (dreamstage_ prefix)."""
from __future__ import annotations

from dreamstage.engine import Engine
from dreamstage.stats import Histogram


def _hist(lines: list[str], name: str, help_: str, h: Histogram) -> None:
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for le, n in h.cumulative():
        lines.append(f'{name}_bucket{{le="{le}"}} {n}')
    lines += [f"{name}_sum {h.total:.6f}", f"{name}_count {h.n}"]


def render(engine: Engine) -> str:
    s = engine.stats
    lines: list[str] = []

    def metric(name, kind, help_, value):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])

    metric("dreamstage_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", s.prompt_tokens)
    metric("dreamstage_prompt_tokens_cached_total", "counter", "Prompt tokens reused from a slot's cache.",
           s.prompt_tokens_cached)
    metric("dreamstage_generated_tokens_total", "counter", "Tokens sampled.", s.generated_tokens)
    lines += ["# HELP dreamstage_requests_total Finished requests by outcome.",
              "# TYPE dreamstage_requests_total counter"]
    for outcome in sorted(set(s.requests) | {"stop", "length", "cancelled", "invalid", "error"}):
        lines.append(f'dreamstage_requests_total{{outcome="{outcome}"}} {s.requests.get(outcome, 0)}')
    metric("dreamstage_decode_batches_total", "counter", "llama_decode calls made by the engine.", s.decode_batches)
    metric("dreamstage_decode_failures_total", "counter", "llama_decode calls that failed.", s.decode_failures)
    _hist(lines, "dreamstage_time_to_first_token_seconds", "Submission to first sampled token.", s.ttft)
    _hist(lines, "dreamstage_inter_token_latency_seconds", "Time between two sampled tokens of one request.", s.itl)
    metric("dreamstage_busy_slots", "gauge", "Slots serving a request.", engine.busy_slots())
    metric("dreamstage_slots", "gauge", "Slots (parallel sequences).", engine.n_seq)
    metric("dreamstage_queue_depth", "gauge", "Requests waiting for a slot.", engine.queue_depth)
    metric("dreamstage_adapter_version", "gauge", "Served adapter version (0 = base model).", engine.adapter_version)
    return "\n".join(lines) + "\n"
