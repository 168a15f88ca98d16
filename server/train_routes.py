"""Routes for training jobs and adapters: /train and /adapters.

Routes only. Validation lives in dreamstage.trainspec and dreamstage.examples,
jobs and adapter versions in dreamstage.jobs, and everything that touches the
model in dreamstage.dreamer (on the engine thread). A body is validated and
rendered before the job is committed, so a 202 means a job that will run and
that survives a restart.
"""
from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dreamstage.examples import ExampleErrors, render_job
from dreamstage.jobs import AdapterNotFound, InvalidTransition, JobNotFound
from dreamstage.server.errors import APIError, field_path
from dreamstage.trainspec import check_adapter_name, parse_train_request

router = APIRouter()

# How long a promote/rollback call waits for the swap. The swap waits for the
# busy slots to finish their requests; past this the answer is 202 (booked,
# applied as soon as they drain).
SWAP_WAIT_S = 30.0


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int | None = Field(default=None, ge=1)


def _dream(request: Request):
    service = request.app.state.service
    if getattr(service, "dream", None) is None:
        raise APIError(503, "training is off: this server was started without a state directory (--state-dir)",
                       None, "training_off")
    return service


def _invalid(errors: list[tuple[str, str]]) -> APIError:
    """422 naming the first field; the message lists up to five."""
    return APIError(422, "; ".join(f"{p}: {m}" for p, m in errors[:5]), errors[0][0], "invalid_value")


def _pydantic_errors(e: ValidationError) -> list[tuple[str, str]]:
    out, seen = [], set()
    for err in e.errors():
        path = field_path(err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "field required"
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if (path, msg) not in seen:
            seen.add((path, msg))
            out.append((path, msg))
    return out or [("body", "invalid body")]


async def _json_object(request: Request, required: bool) -> dict[str, Any] | None:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise _invalid([("body", "a JSON object is required")])
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid([("body", f"not valid JSON: {e}")]) from None
    except RecursionError:
        raise _invalid([("body", "JSON nested too deeply")]) from None
    if not isinstance(body, dict):
        raise _invalid([("body", f"must be a JSON object, not {type(body).__name__}")])
    return body


# SQLite's INTEGER: a larger id cannot name a job (and would overflow the driver).
_MAX_JOB_ID = 2**63 - 1


def _job_id(raw: str) -> int:
    try:
        jid = int(raw)
    except ValueError:
        raise APIError(404, f"no job {raw!r}: job ids are integers", "id", "not_found") from None
    if not 1 <= jid <= _MAX_JOB_ID:
        raise APIError(404, f"no job {raw}: job ids are 1..{_MAX_JOB_ID}", "id", "not_found")
    return jid


def _storage_error(e: Exception, what: str) -> APIError:
    """A full or unwritable state directory: 507 (or 503), naming it, never a bare 500."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return APIError(507, f"{what}: the state directory is full ({e.strerror}); nothing was changed",
                        None, "insufficient_storage")
    if isinstance(e, sqlite3.OperationalError) and "full" in str(e):
        return APIError(507, f"{what}: the state directory is full ({e}); nothing was changed",
                        None, "insufficient_storage")
    return APIError(503, f"{what}: the state directory cannot be written ({type(e).__name__}: {e}); "
                         "nothing was changed", None, "storage_unavailable")


def _too_big(limit: str, value: int, what: str, param: str = "examples") -> APIError:
    return APIError(413, f"{what} is more than the server's limit {limit} = {value}", param, "limit_exceeded")


def _submit_lock(app) -> asyncio.Lock:
    lock = getattr(app.state, "train_submit_lock", None)
    if lock is None:                       # made on the app's own event loop, at first use
        lock = app.state.train_submit_lock = asyncio.Lock()
    return lock


def _check_queue(service) -> None:
    limits = service.settings.limits
    queued = len(service.jobs.overview()["queue"])
    if queued >= limits.max_queued_jobs:
        raise APIError(422, f"{queued} jobs are queued, the server's limit max_queued_jobs = "
                            f"{limits.max_queued_jobs}; wait for one to start or cancel one", None, "limit_exceeded")


def _check_limits(service, spec, rendered) -> None:
    """Count what will run: expanded examples, rendered tokens, the queue."""
    limits = service.settings.limits
    per_source: dict[int, int] = {}
    total = 0
    for w in (*rendered.train, *rendered.held_out):
        per_source[w.source] = per_source.get(w.source, 0) + len(w.tokens)
        total += len(w.tokens)
    worst = max(per_source.items(), key=lambda kv: kv[1], default=None)
    if worst is not None and worst[1] > limits.max_example_tokens:
        raise _too_big("max_example_tokens", limits.max_example_tokens,
                       f"examples[{worst[0]}] renders to {worst[1]} tokens, which", f"examples[{worst[0]}]")
    if total > limits.max_job_tokens:
        raise _too_big("max_job_tokens", limits.max_job_tokens, f"the job renders to {total} tokens, which")
    queued = service.dream.queued_tokens()
    if queued + total > limits.max_queued_tokens:
        raise APIError(422, f"the queued jobs hold {queued} tokens; this job's {total} would pass the server's limit "
                            f"max_queued_tokens = {limits.max_queued_tokens}; wait for the queue to drain",
                       "examples", "limit_exceeded")


@router.post("/train", status_code=202)
async def submit(request: Request):
    service = _dream(request)
    body = await _json_object(request, required=True)
    assert body is not None  # required=True: an empty body is a 4xx
    try:
        req = parse_train_request(body)
    except ValidationError as e:
        raise _invalid(_pydantic_errors(e)) from None
    spec = req.to_job_spec()
    limits = service.settings.limits
    if len(spec.examples) > limits.max_job_examples:   # counted after groups expand: one per completion
        raise _too_big("max_job_examples", limits.max_job_examples,
                       f"the job has {len(spec.examples)} examples (groups expanded), which")
    _check_queue(service)                  # early: a full queue costs no rendering
    try:
        rendered = await asyncio.to_thread(render_job, spec, service.model)
    except ExampleErrors as e:
        raise _invalid([(field_path(err.loc), err.message) for err in e.errors]) from None
    # Checked again and committed under one lock: two posts rendering at once
    # must not both take the queue's last place.
    async with _submit_lock(request.app):
        _check_queue(service)
        _check_limits(service, spec, rendered)
        try:
            job = await asyncio.to_thread(service.jobs.submit, req)   # committed (fsynced) before the 202
        except (OSError, sqlite3.Error) as e:
            raise _storage_error(e, "POST /train") from None
        service.dream.notify_submitted(job["id"], rendered)
    return JSONResponse(public(job), status_code=202, headers={"Location": f"/train/{job['id']}"})


@router.get("/train")
async def overview(request: Request):
    service = _dream(request)
    return public({**service.jobs.overview(), "adapter_version": service.engine.adapter_version})


@router.get("/train/{job_id}")
async def one_job(job_id: str, request: Request):
    service = _dream(request)
    try:
        return public(_with_unrecorded(service, service.jobs.get(_job_id(job_id))))
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None


@router.get("/train/{job_id}/receipts")
async def job_receipts(job_id: str, request: Request, after: int = 0):
    """Every micro-step's receipt (after seq `after`): its pass, horizon, memory, refusal."""
    service = _dream(request)
    try:
        return public({"receipts": service.jobs.receipts(_job_id(job_id), after_seq=after)})
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None


def _with_unrecorded(service, view: dict) -> dict:
    """A job that ended while the store could not be written (a full disk) is
    shown as it is, an error, with `persisted: false` until the store takes it."""
    message = service.dream.unrecorded_error(view["id"])
    if message is None:
        return view
    return {**view, "state": "error", "message": message, "persisted": False}


async def _move(request: Request, job_id: str, target: str) -> dict:
    service = _dream(request)
    jid = _job_id(job_id)
    try:
        await asyncio.to_thread(service.jobs.transition, jid, target)
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None
    except InvalidTransition as e:
        raise APIError(409, str(e), "state", "invalid_transition") from None
    except (OSError, sqlite3.Error) as e:
        raise _storage_error(e, f"job {jid}: {target}") from None
    if target == "cancelled":
        service.dream.forget(jid)          # a queued job's rendered windows go now, not when it would have run
    return public(service.jobs.get(jid))


@router.post("/train/{job_id}/cancel")
async def cancel(job_id: str, request: Request):
    return await _move(request, job_id, "cancelled")


@router.post("/train/{job_id}/pause")
async def pause(job_id: str, request: Request):
    return await _move(request, job_id, "paused")


@router.post("/train/{job_id}/resume")
async def resume(job_id: str, request: Request):
    return await _move(request, job_id, "running")


def _adapters_view(service) -> dict:
    jobs = service.jobs
    return public({"served_version": service.engine.adapter_version, "served": jobs.served(),
                   "served_error": service.dream.served_error, "promotions": jobs.promotions(),
                   "adapters": jobs.adapters()})


def public(view):
    """A view without absolute paths: an adapter's `path` is given relative to
    the state directory (`adapters/notes/v3.gguf`), which a client can use and
    which does not tell a caller where the server's files live."""
    if isinstance(view, dict):
        out = {}
        for k, v in view.items():
            if k == "path" and isinstance(v, str) and os.path.isabs(v):
                parts = Path(v).parts
                v = str(Path(*parts[-3:]))      # adapters/<name>/v<N>.gguf
            out[k] = public(v)
        return out
    if isinstance(view, list):
        return [public(v) for v in view]
    return view


@router.get("/adapters")
async def adapters(request: Request):
    return _adapters_view(_dream(request))


async def _swap(service, fut) -> JSONResponse:
    """Wait for the engine to book the swap, then (a while) for it to apply."""
    if not service.engine.running:
        fut.cancel()
        raise APIError(503, "the engine is not running", None, "engine_stopped")
    try:
        view, applied = await asyncio.wait_for(asyncio.wrap_future(fut), SWAP_WAIT_S)
    except AdapterNotFound as e:
        raise APIError(404, str(e), "name", "not_found") from None
    except ValueError as e:               # the file does not load (AdapterLoadError)
        raise APIError(422, str(e), "name", "adapter_unloadable") from None
    except (OSError, sqlite3.Error) as e:  # booking the promotion could not be written
        raise _storage_error(e, "promotion") from None
    except asyncio.TimeoutError:
        raise APIError(503, "the engine did not take the request in time; retry", None, "busy") from None
    try:
        done = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(applied)), SWAP_WAIT_S)
    except asyncio.TimeoutError:
        done = False
    body = {"applied": bool(done), "served": view, **_adapters_view(service)}
    return JSONResponse(body, status_code=200 if done else 202)


@router.post("/adapters/rollback")
async def rollback(request: Request):
    service = _dream(request)
    try:
        return await _swap(service, service.dream.rollback())
    except APIError as e:
        if e.status == 404:               # nothing to roll back is a state conflict, not a missing name
            raise APIError(409, e.message, None, "nothing_to_roll_back") from None
        raise


@router.post("/adapters/{name}/promote")
async def promote(name: str, request: Request):
    service = _dream(request)
    try:
        check_adapter_name(name)
    except ValueError as e:
        raise _invalid([("name", str(e))]) from None
    body = await _json_object(request, required=False)
    try:
        version = PromoteBody.model_validate(body or {}).version
    except ValidationError as e:
        raise _invalid(_pydantic_errors(e)) from None
    return await _swap(service, service.dream.promote(name, version))
