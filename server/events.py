"""GET /events: a server-sent event stream of what the dashboard shows.

Usable without the page (`curl -N http://127.0.0.1:8080/events`). Each event
is `event: <kind>` plus one JSON `data:` line:

- `hello`: once, `{"training": bool, "follow": job id or null, "tick_s"}`.
- `slots`: `{"slots": GET /slots' list, "busy", "queue_depth",
  "adapter_version", "decode_tok_s"}`, when any of it changes. `decode_tok_s`
  is the engine's sampled tokens per second over the last tick.
- `job`: the followed job exactly as `GET /train/{id}` reports it, whenever it
  changes. A new `id` means the stream now follows another job.
- `receipt`: `{"job_id", "seq", "receipt"}`, one per stored receipt of the
  followed job, in order, the receipt unchanged (the canonical fields); on
  connecting and on switching jobs, the last `backlog` ones first.
- `adapters`: `GET /adapters`, whenever it changes.
- `devices`: `{"devices": [{name, description, free_mib, total_mib}]}`, every
  few seconds (the memory the gate's allowance is taken from).

The stream follows `?job=ID` if given, else the job training now (starting,
running or paused), else the next queued job, else the newest, and moves on
to a new job when one starts. It reads the job store and the engine's public
counters every tick; it never calls into llama, and slow readers only delay
their own stream. It ends when the engine stops.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from dreamstage.server.errors import APIError, strict_int
from dreamstage.server.views import adapters_view, public, with_unrecorded
from dreamstage.training.jobs.errors import JobNotFound

router = APIRouter()

TICK_S = 0.5
DEVICES_EVERY_S = 5.0
# A comment line this often keeps idle connections open through proxies
# (sse-starlette's ping).
KEEPALIVE_S = 15.0
DEFAULT_BACKLOG = 500
MAX_BACKLOG = 10_000
MIB = float(1 << 20)


def sse(kind: str, data: Any) -> dict[str, str]:
    """One event as sse-starlette takes it (a dict: it then writes the response's line separator)."""
    return {"event": kind, "data": json.dumps(data, separators=(",", ":"), allow_nan=False)}


def _int_param(request: Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    return strict_int(raw, name, lo, hi)


def _finite(obj: Any) -> Any:
    """NaN and infinities become null: the page's JSON.parse (and JSON itself) has no NaN."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


class Follower:
    """The state of one stream: which job it follows and what it has sent."""

    def __init__(self, service, pinned: int | None, backlog: int):
        self.service, self.pinned, self.backlog = service, pinned, backlog
        self.job_id: int | None = None
        self.seq = 0                 # receipts of job_id sent so far (seqs are 1, 2, ... per job)
        self.last: dict[str, str] = {}

    def _changed(self, kind: str, data: Any) -> bool:
        key = json.dumps(data, sort_keys=True, default=str)
        if self.last.get(kind) == key:
            return False
        self.last[kind] = key
        return True

    def _target(self) -> int | None:
        jobs = self.service.store
        if self.pinned is not None:
            return self.pinned
        current = jobs.current_id()
        if current is not None:
            return current
        queued = jobs.next_queued()
        if queued is not None:
            return queued
        newest = jobs.job_ids(1)
        return newest[0] if newest else None

    def store_events(self) -> list[dict[str, str]]:
        """The job, its new receipts and the adapters (a worker thread: SQLite reads)."""
        service = self.service
        if service.store is None:
            return []
        out: list[dict[str, str]] = []
        target = self._target()
        if target != self.job_id:
            self.job_id, self.seq = target, 0
            self.last.pop("job", None)
        if self.job_id is not None:
            try:
                job = _finite(public(with_unrecorded(service, service.store.get(self.job_id))))   # as GET /train/{id}
            except JobNotFound:
                raise APIError(404, f"no job {self.job_id}", "job", "not_found") from None
            if self.seq == 0 and job["receipts"] > self.backlog:
                self.seq = job["receipts"] - self.backlog
            new = service.store.receipts(self.job_id, after_seq=self.seq)
            if self._changed("job", job):
                out.append(sse("job", job))
            for receipt in new:
                self.seq += 1
                out.append(sse("receipt", {"job_id": self.job_id, "seq": self.seq, "receipt": _finite(receipt)}))
        view = _finite(adapters_view(service))
        if self._changed("adapters", view):
            out.append(sse("adapters", view))
        return out


def _devices() -> dict:
    from dreamstage.native import ggml_registry

    return {"devices": [{"name": d["name"], "description": d["description"], "free_mib": d["free"] / MIB,
                         "total_mib": d["total"] / MIB} for d in ggml_registry.devices()]}


async def stream(follower: Follower, tick_s: float = TICK_S) -> AsyncIterator[dict[str, str]]:
    service = follower.service
    engine = service.engine
    yield sse("hello", {"training": service.store is not None, "follow": follower.pinned, "tick_s": tick_s})
    generated, at = engine.stats.generated_tokens, time.monotonic()
    devices_at = -1e9
    # Ends when the engine stops: a shutdown that stops the engine first then
    # need not wait out its graceful timeout for open dashboards. A client
    # that leaves is sse-starlette's to notice: it cancels this generator.
    while engine.running:
        now = time.monotonic()
        g = engine.stats.generated_tokens
        rate = (g - generated) / (now - at) if now > at else 0.0
        generated, at = g, now
        slots = {"slots": engine.slots_info(), "busy": engine.busy_slots(), "queue_depth": engine.queue_depth,
                 "adapter_version": engine.adapter_version, "decode_tok_s": round(rate, 2)}
        if follower._changed("slots", slots):
            yield sse("slots", slots)
        for event in await asyncio.to_thread(follower.store_events):
            yield event
        if service.store is not None and now - devices_at >= DEVICES_EVERY_S:
            devices_at = now
            yield sse("devices", await asyncio.to_thread(_devices))
        await asyncio.sleep(tick_s)


@router.get("/events")
async def events(request: Request):
    service = request.app.state.service
    pinned = _int_param(request, "job", None, 1, 2**62)
    backlog = _int_param(request, "backlog", DEFAULT_BACKLOG, 0, MAX_BACKLOG)
    assert backlog is not None  # it has a default
    follower = Follower(service, pinned, backlog)
    if pinned is not None:
        if service.store is None:
            raise APIError(503, "training is off: this server was started without a state directory (--state-dir)",
                           None, "training_off")
        await asyncio.to_thread(follower.store_events)   # 404 now, not mid-stream
        follower.job_id, follower.seq, follower.last = None, 0, {}
    # sep="\n": the same bytes as the hand-written stream had (sse-starlette's default is CRLF)
    return EventSourceResponse(stream(follower), ping=KEEPALIVE_S, sep="\n",
                               headers={"Cache-Control": "no-cache"})
