"""Routes for training jobs: /train (adapters are adapter_routes.py).

Routes only: they parse JSON, call the training package and map its errors
to HTTP. Submitting (validate, render, limits, commit, enqueue) is
`dreamstage.training.jobs.submit`; jobs and adapter versions are
`dreamstage.training.jobs.store`; everything that touches the model runs in
`dreamstage.training.jobs.scheduler` on the engine thread. A 202 means a job that
will run and that survives a restart.
"""
from __future__ import annotations

import asyncio
import errno
import sqlite3
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dreamstage.server.errors import APIError, strict_int
from dreamstage.server.middleware import json_body
from dreamstage.server.tenants import scope_of
from dreamstage.server.views import public, with_unrecorded
from dreamstage.training.jobs.errors import JobNotFound
from dreamstage.training.jobs.request import check_adapter_name
from dreamstage.training.jobs.store import InvalidTransition
from dreamstage.training.jobs.submit import SubmitRefused, invalid

router = APIRouter()


def service_with(request: Request, part: str, message: str, code: str):
    """The service, when it has `part` (e.g. its scheduler); else 503 `message` naming the missing flag."""
    service = request.app.state.service
    if getattr(service, part, None) is None:
        raise APIError(503, message, None, code)
    return service


def _training_service(request: Request):
    return service_with(request, "scheduler", "training is off: this server was started without a state directory "
                        "(--state-dir)", "training_off")


def _invalid(errors: list[tuple[str, str]]) -> APIError:
    """422 naming the first field; the message lists up to five."""
    return _refused(invalid(errors))


def adapter_name_in_scope(request: Request, raw: str, param: str = "name") -> str:
    """A valid name the key may touch; 404 (as unknown) outside its scope."""
    try:
        check_adapter_name(raw, param)
    except ValueError as e:
        raise _invalid([(param, str(e))]) from None
    if not scope_of(request).allows(raw):
        raise APIError(404, f"no adapter {raw!r}", param, "not_found")
    return raw


async def _json_object(request: Request, required: bool) -> dict[str, Any] | None:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise _invalid([("body", "a JSON object is required")])
        return None
    try:
        body = json_body(request, raw)      # as the edge decoded it (server/middleware.py)
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid([("body", f"not valid JSON: {e}")]) from None
    except RecursionError:
        raise _invalid([("body", "JSON nested too deeply")]) from None
    if not isinstance(body, dict):
        raise _invalid([("body", f"must be a JSON object, not {type(body).__name__}")])
    return body


def _job_id(raw: str) -> int:
    return strict_int(raw, "job_id", 1)


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


def _refused(e: SubmitRefused) -> APIError:
    return APIError(e.status, e.message, e.param, e.code)


def _check_train_scope(request: Request, body: dict) -> None:
    """A scoped key trains only its own adapters, and only when its key file says train: true."""
    scope = scope_of(request)
    if not scope.scoped:
        return
    if not scope.train:
        raise APIError(403, "this API key may chat but not train (train: false in the key file)", None,
                       "training_not_allowed")
    name = body.get("adapter", body.get("out"))
    if not isinstance(name, str):
        raise _invalid([("adapter", "a key scoped to adapters names the adapter it trains")])
    if not scope.allows(name):
        raise APIError(404, f"no adapter {name!r}", "adapter", "not_found")


def _visible(request: Request, job: dict) -> bool:
    return scope_of(request).allows(job["out"])


@router.post("/train", status_code=202)
async def submit(request: Request):
    service = _training_service(request)
    body = await _json_object(request, required=True)
    assert body is not None  # required=True: an empty body is a 4xx
    _check_train_scope(request, body)
    try:
        job = await asyncio.to_thread(service.submitter.submit, body)
    except SubmitRefused as e:
        raise _refused(e) from None
    except (OSError, sqlite3.Error) as e:
        raise _storage_error(e, "POST /train") from None
    return JSONResponse(public(job), status_code=202, headers={"Location": f"/train/{job['id']}"})


@router.get("/train")
async def overview(request: Request):
    service = _training_service(request)
    view = service.store.overview()
    # the jobs as GET /train/{id} shows them: one that ended unrecorded (a full disk) is its error here too
    current = view["current"] and _visible(request, view["current"]) and with_unrecorded(service, view["current"])
    queue = [with_unrecorded(service, j) for j in view["queue"] if _visible(request, j)]
    return public({"current": current or None, "queue": queue, "adapter_version": service.engine.adapter_version})


@router.get("/train/{job_id}")
async def one_job(job_id: str, request: Request):
    service = _training_service(request)
    jid = _job_id(job_id)
    _own_job(request, service, jid)
    try:
        return public(with_unrecorded(service, service.store.get(jid)))
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None


def _own_job(request: Request, service, jid: int) -> None:
    """404 for a job of an adapter outside the key's scope (as for a job that does not exist)."""
    if not scope_of(request).scoped:
        return
    try:
        job = service.store.get(jid)
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None
    if not _visible(request, job):
        raise APIError(404, f"no job {jid}", "id", "not_found")


@router.get("/train/{job_id}/receipts")
async def job_receipts(job_id: str, request: Request, after: str = "0"):
    """Every micro-step's receipt (after seq `after`): its pass, horizon, memory, refusal."""
    service = _training_service(request)
    jid, after_seq = _job_id(job_id), strict_int(after, "after", 0)
    _own_job(request, service, jid)
    try:
        return public({"receipts": service.store.receipts(jid, after_seq=after_seq)})
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None


async def _move(request: Request, job_id: str, target: str) -> dict:
    service = _training_service(request)
    jid = _job_id(job_id)
    _own_job(request, service, jid)
    try:
        view = await asyncio.to_thread(service.submitter.transition, jid, target)
    except JobNotFound as e:
        raise APIError(404, str(e), "id", "not_found") from None
    except InvalidTransition as e:
        raise APIError(409, str(e), "state", "invalid_transition") from None
    except (OSError, sqlite3.Error) as e:
        raise _storage_error(e, f"job {jid}: {target}") from None
    return public(view)


@router.post("/train/{job_id}/cancel")
async def cancel(job_id: str, request: Request):
    return await _move(request, job_id, "cancelled")


@router.post("/train/{job_id}/pause")
async def pause(job_id: str, request: Request):
    return await _move(request, job_id, "paused")


@router.post("/train/{job_id}/resume")
async def resume(job_id: str, request: Request):
    return await _move(request, job_id, "running")
