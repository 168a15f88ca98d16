"""The OpenAPI document, made to say what the server really answers.

FastAPI's generated document was wrong in two ways (issue 15): it promised
422 on every route where the OpenAI routes answer 400, and it had no body
schema for `POST /train` and promote, which parse their own bodies (to answer
422 naming `examples[i]...`). Here the generated document is corrected:
request bodies from the pydantic models those routes validate with, every
status a route can answer (the guards' 401/403/413/415 included), and one
error schema for all of them. tests/test_fuzz.py holds the server to it.
"""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

_WHY = {
    400: "invalid request: the message and `param` name the field",
    401: "missing or wrong API key (when the server has one)",
    403: "Host header not allowed (loopback binds check it against DNS rebinding)",
    404: "no such job or adapter",
    409: "the job or adapter state does not allow this",
    413: "body or job over a limit: the message names the limit and its value",
    415: "content type is not application/json",
    422: "invalid training request: the message and `param` name the field or limit",
    503: "busy (queue full, Retry-After), shutting down, training off, or storage unavailable",
    507: "the state directory is full; nothing was changed",
}

# Statuses each operation can answer besides its success, beyond the guards'.
_COMMON = (401, 403)
_WRITE = (400, 413, 415)
_ROUTES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/chat/completions"): (400, 503),
    ("post", "/v1/completions"): (400, 503),
    ("get", "/health"): (503,),
    ("post", "/train"): (413, 422, 503, 507),
    ("get", "/train"): (503,),
    ("get", "/train/{job_id}"): (404, 503),
    ("post", "/train/{job_id}/cancel"): (404, 409, 503, 507),
    ("post", "/train/{job_id}/pause"): (404, 409, 503, 507),
    ("post", "/train/{job_id}/resume"): (404, 409, 503, 507),
    ("get", "/adapters"): (503,),
    ("post", "/adapters/{name}/promote"): (404, 422, 503, 507),
    ("post", "/adapters/rollback"): (409, 503, 507),
}


def _bodies():
    from dreamstage.server.train_routes import PromoteBody  # noqa: PLC0415
    from dreamstage.trainspec import TrainRequest  # noqa: PLC0415
    return {("post", "/train"): (TrainRequest, True), ("post", "/adapters/{name}/promote"): (PromoteBody, False)}


def build(app) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for (method, path), (model, required) in _bodies().items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
        op = doc["paths"][path][method]
        op["requestBody"] = {"required": required, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses = op["responses"]
            # FastAPI's own 422 (HTTPValidationError) is not what these routes answer.
            responses.pop("422", None)
            extra = _ROUTES.get((method, path), ())
            codes = set(_COMMON) | set(extra) | (set(_WRITE) if method == "post" else set())
            for code in sorted(codes):
                responses[str(code)] = {"description": _WHY[code], "content": error_ref}
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    # Completions stream as server-sent events when `stream` is true.
    for path in ("/v1/chat/completions", "/v1/completions"):
        if path in doc["paths"]:
            ok = doc["paths"][path]["post"]["responses"]["200"]
            # One schema per event: `data:` is a JSON chunk (or an error body), then "[DONE]".
            ok["content"]["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    return doc


def install(app) -> None:
    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema
    app.openapi = openapi
