"""Routes for training jobs and adapters: /train and /adapters.

Routes only. Validation lives in dreamstage.trainspec and dreamstage.examples,
jobs and adapter versions in dreamstage.jobs, and everything that touches the
model in dreamstage.dreamer (on the engine thread). A body is validated and
rendered before the job is committed, so a 202 means a job that will run and
that survives a restart.
"""
from __future__ import annotations

import asyncio
import json
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
    if not isinstance(body, dict):
        raise _invalid([("body", f"must be a JSON object, not {type(body).__name__}")])
    return body


def _job_id(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise APIError(404, f"no job {raw!r}: job ids are integers", "id", "not_found") from None


@router.post("/train", status_code=202)
async def submit(request: Request):
    service = _dream(request)
    body = await _json_object(request, required=True)
    try:
        req = parse_train_request(body)
    except ValidationError as e:
        raise _invalid(_pydantic_errors(e)) from None
    spec = req.to_job_spec()
    try:
        rendered = await asyncio.to_thread(render_job, spec, service.model)
    except ExampleErrors as e:
        raise _invalid([(field_path(err.loc), err.message) for err in e.errors]) from None
    job = await asyncio.to_thread(service.jobs.submit, req)   # committed (fsynced) before the 202
    service.dream.notify_submitted(job["id"], rendered)
    return JSONResponse(job, status_code=202, headers={"Location": f"/train/{job['id']}"})


@router.get("/train")
async def overview(request: Request):
    service = _dream(request)
    return {**service.jobs.overview(), "adapter_version": service.engine.adapter_version}


@router.get("/train/{job_id}")
async def one_job(job_id: str, request: Request):
    service = _dream(request)
    try:
        return service.jobs.get(_job_id(job_id))
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None


@router.get("/train/{job_id}/receipts")
async def job_receipts(job_id: str, request: Request, after: int = 0):
    """Every micro-step's receipt (after seq `after`): its pass, horizon, memory, refusal."""
    service = _dream(request)
    try:
        return {"receipts": service.jobs.receipts(_job_id(job_id), after_seq=after)}
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None


async def _move(request: Request, job_id: str, target: str) -> dict:
    service = _dream(request)
    jid = _job_id(job_id)
    try:
        await asyncio.to_thread(service.jobs.transition, jid, target)
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None
    except InvalidTransition as e:
        raise APIError(409, str(e), "state", "invalid_transition") from None
    return service.jobs.get(jid)


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
    return {"served_version": service.engine.adapter_version, "served": jobs.served(),
            "served_error": service.dream.served_error, "promotions": jobs.promotions(),
            "adapters": jobs.adapters()}


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
