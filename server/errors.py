"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Validation errors name the offending field (`messages[0].role`), so a client
can fix its request without reading server logs.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dreamstage.serving.rpc import WorkerFailed
from dreamstage.validation import field_path

log = logging.getLogger("dreamstage.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error",
          409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 499: "request_cancelled", 501: "not_supported_error",
          503: "server_overloaded",
          507: "insufficient_storage"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


# SQLite's INTEGER: the largest number a job id, receipt position or other stored integer can be.
MAX_SQL_INT = 2**63 - 1


def strict_int(raw: str, param: str, low: int, high: int = MAX_SQL_INT) -> int:
    """A path or query parameter as an integer: ASCII digits only (no sign, space,
    underscore or other script's digits), low..high; anything else is a 422 naming it."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(high)) or not low <= int(raw) <= high:
        raise APIError(422, f"{param}: expected an integer {low}..{high} in ASCII digits, got {raw[:40]!r}", param,
                       "invalid_value")
    return int(raw)


# Codes whose type OpenAI gives differently from their status's (a 404 model_not_found is a bad request).
_CODE_TYPES = {"model_not_found": "invalid_request_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _CODE_TYPES.get(code or "", _TYPES.get(status, "server_error"))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def send_error(send, status: int, message: str, param: str | None = None, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """Answer from ASGI middleware (before FastAPI), in the same OpenAI shape."""
    import json

    data = json.dumps(error_body(status, message, param, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _describe(err: dict) -> tuple[str, str]:
    path = field_path(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return "body", f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
    if kind == "extra_forbidden":
        return path, f"{path}: unknown field"
    if kind == "missing":
        return path, f"{path}: field required"
    msg = err.get("msg", "invalid value")
    return path, f"{path}: {msg}"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # A union field reports one error per member; the first names the field well enough.
        seen, parts, first_param = set(), [], None
        for err in errors:
            param, msg = _describe(err)
            if param in seen:
                continue
            seen.add(param)
            first_param = first_param or param
            parts.append(msg)
        return error_response(400, "; ".join(parts[:5]) or "invalid request", first_param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        param, code = ("body", "body_too_large") if exc.status_code == 413 else (None, None)
        return error_response(exc.status_code, str(exc.detail), param, code, getattr(exc, "headers", None))

    @app.exception_handler(WorkerFailed)
    async def _worker_failed(request: Request, exc: WorkerFailed):
        # the model is gone until its RPC workers answer and the engine loads it again
        return error_response(503, str(exc), None, "rpc_worker_failed", {"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
