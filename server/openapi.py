"""The OpenAPI document, made to say what the server really answers.

FastAPI's generated document was wrong in two ways (issue 15): it promised
422 on every route where the OpenAI routes answer 400, and it had no body
schema for `POST /train` and promote, which parse their own bodies (to answer
422 naming `examples[i]...`). Here the generated document is corrected:
request bodies from the pydantic models those routes validate with, every
status a route can answer (the guards' 401/403/413/415 included), one error
schema for all of them, and typed success bodies (the fields clients rely
on). tests/test_fuzz.py holds the server to it.
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

# What the success answers look like: the fields clients rely on, typed, so
# the fuzzer checks every answer against them. Objects stay open (more fields
# may come), but a listed field must have its type.
_INT, _STR, _NUM = {"type": "integer"}, {"type": "string"}, {"type": "number"}
_OPT_STR = {"type": ["string", "null"]}
_JOB_STATES = ["queued", "starting", "running", "paused", "held", "done", "cancelled", "refused", "error",
               "interrupted"]
_JOB = {"type": "object", "required": ["id", "state", "message", "progress", "refusals"], "properties": {
    "id": _INT, "state": {"enum": _JOB_STATES}, "message": _OPT_STR, "out": _OPT_STR,
    "window": _INT, "chunk": _INT, "context_cache_type": _STR, "progress": {"type": "object"},
    "refusals": {"type": "array", "items": {"type": "object"}}, "persisted": {"type": "boolean"}}}
_ADAPTER = {"type": "object", "required": ["name", "version", "path"], "properties": {
    "name": _STR, "version": _INT, "path": _STR, "sha256": _OPT_STR, "promoted": {"type": "boolean"}}}
_ADAPTERS = {"type": "object", "required": ["served_version", "served", "adapters", "promotions"], "properties": {
    "served_version": _INT, "served": {"anyOf": [_ADAPTER, {"type": "null"}]}, "served_error": _OPT_STR,
    "adapters": {"type": "array", "items": _ADAPTER}, "promotions": {"type": "array"}, "generation": _INT}}
_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"]}}
_COMPLETION = {"type": "object", "required": ["id", "object", "choices", "adapter_version"], "properties": {
    "id": _STR, "object": {"enum": ["chat.completion", "text_completion"]}, "choices": _CHOICES,
    "adapter_version": _INT, "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens"]}}}
_SUCCESS: dict[tuple[str, str], tuple[str, dict]] = {
    ("post", "/v1/chat/completions"): ("200", _COMPLETION),
    ("post", "/v1/completions"): ("200", _COMPLETION),
    ("get", "/v1/models"): ("200", {"type": "object", "required": ["object", "data"], "properties": {
        "data": {"type": "array", "items": {"type": "object", "required": ["id", "adapter_version"]}}}}),
    ("get", "/health"): ("200", {"type": "object", "required": ["status", "slots", "slots_busy", "queue_depth"],
                                 "properties": {"status": {"enum": ["ok"]}, "slots": _INT, "slots_busy": _INT,
                                                "queue_depth": _INT, "adapter_version": _INT}}),
    ("get", "/slots"): ("200", {"type": "object", "required": ["slot_context", "slots"]}),
    ("get", "/props"): ("200", {"type": "object", "required": ["default_generation_settings", "total_slots"]}),
    ("post", "/tokenize"): ("200", {"type": "object", "required": ["tokens"], "properties": {
        "tokens": {"type": "array", "items": {"anyOf": [_INT, {"type": "object", "required": ["id", "piece"]}]}}}}),
    ("post", "/detokenize"): ("200", {"type": "object", "required": ["content"], "properties": {"content": _STR}}),
    ("post", "/train"): ("202", _JOB),
    ("get", "/train"): ("200", {"type": "object", "required": ["current", "queue", "adapter_version"], "properties": {
        "current": {"anyOf": [_JOB, {"type": "null"}]}, "queue": {"type": "array", "items": _JOB}}}),
    ("get", "/train/{job_id}"): ("200", _JOB),
    ("post", "/train/{job_id}/cancel"): ("200", _JOB),
    ("post", "/train/{job_id}/pause"): ("200", _JOB),
    ("post", "/train/{job_id}/resume"): ("200", _JOB),
    ("get", "/adapters"): ("200", _ADAPTERS),
}

_WHY = {
    400: "invalid request: the message and `param` name the field",
    401: "missing or wrong API key (when the server has one)",
    403: "Host header not allowed (loopback binds check it against DNS rebinding), or a write from another "
         "origin's page",
    404: "no such job, adapter, model or kept response",
    409: "the job or adapter state does not allow this, or this server follows a leader (--follow): "
         "train and change adapters there",
    413: "body or job over a limit: the message names the limit and its value",
    415: "content type is not application/json",
    422: "invalid training request or parameter: the message and `param` name the field, parameter or limit",
    501: "not served by this server (POST /v1/embeddings without --embeddings)",
    503: "busy (queue full, Retry-After), shutting down, training off, or storage unavailable",
    507: "the state directory is full; nothing was changed",
}

# Statuses each operation can answer besides its success, beyond the guards'.
_COMMON = (401, 403)
_WRITE = (400, 413, 415)
_ROUTES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/chat/completions"): (400, 404, 503),
    ("post", "/v1/completions"): (400, 404, 503),
    ("post", "/v1/responses"): (400, 404, 503),         # 404: a model, or a previous_response_id, not here
    ("get", "/v1/responses/{response_id}"): (404,),
    ("delete", "/v1/responses/{response_id}"): (404,),
    ("get", "/v1/models/{model_id}"): (404,),
    ("get", "/health"): (503,),
    ("post", "/v1/embeddings"): (400, 404, 501, 503),
    ("post", "/tokenize"): (400,),
    ("post", "/detokenize"): (400,),
    ("post", "/train"): (413, 422, 503, 507),
    ("get", "/train"): (503,),
    ("get", "/train/{job_id}"): (404, 422, 503),
    ("get", "/train/{job_id}/receipts"): (404, 422, 503),
    ("post", "/train/{job_id}/cancel"): (404, 409, 422, 503, 507),
    ("post", "/train/{job_id}/pause"): (404, 409, 422, 503, 507),
    ("post", "/train/{job_id}/resume"): (404, 409, 422, 503, 507),
    ("get", "/adapters"): (503,),
    ("post", "/adapters/{name}/promote"): (404, 409, 422, 503, 507),
    ("post", "/adapters/rollback"): (404, 409, 503, 507),
    ("post", "/adapters/{name}/rollback"): (404, 409, 422, 503, 507),
    ("post", "/adapters"): (403, 404, 409, 422, 503, 507),
    ("delete", "/adapters/{name}"): (404, 409, 422, 503),
    ("get", "/adapters/{name}"): (404, 422, 503),
    ("get", "/adapters/{name}/versions/{version}"): (404, 422, 503),
    # records and feedback (record_routes.py); 503: recording off
    ("get", "/v1/records"): (404, 422, 503),
    ("get", "/v1/records/{record_id}"): (404, 422, 503),
    ("delete", "/v1/records/{record_id}"): (404, 422, 503, 507),
    ("delete", "/adapters/{name}/records"): (404, 422, 503, 507),
    ("post", "/v1/feedback"): (403, 404, 409, 422, 503, 507),
    ("get", "/v1/feedback"): (404, 422, 503),
    ("get", "/v1/feedback/pending"): (503,),
    ("delete", "/v1/feedback/{feedback_id}"): (404, 409, 422, 503, 507),
    ("get", "/adapters/{name}/learn"): (404, 422, 503),
    ("put", "/adapters/{name}/learn"): (404, 413, 415, 422, 503, 507),
    ("post", "/adapters/{name}/learn"): (403, 404, 409, 422, 503, 507),
}


def _parameters() -> dict[str, dict]:
    """The path and query parameters the routes parse themselves, as the parsers take them
    (errors.strict_int, check_adapter_name); FastAPI sees only strings."""
    from dreamstage.adapters.choice import BASE_NAME
    from dreamstage.server.errors import MAX_SQL_INT
    # ADAPTER_NAME_RE without "..", a trailing "." or the reserved name.
    name = {"type": "string",
            "pattern": rf"^(?!{BASE_NAME}$)(?!.*\.\.)[A-Za-z0-9]([A-Za-z0-9_.-]{{0,62}}[A-Za-z0-9_-])?$"}
    # ?adapter= (records, feedback): a name, or the base model's
    adapter = {"type": "string", "pattern": r"^(?!.*\.\.)[A-Za-z0-9]([A-Za-z0-9_.-]{0,62}[A-Za-z0-9_-])?$"}
    return {"job_id": {"type": "integer", "minimum": 1, "maximum": MAX_SQL_INT},
            "feedback_id": {"type": "integer", "minimum": 1, "maximum": MAX_SQL_INT},
            "job": {"type": "integer", "minimum": 1, "maximum": MAX_SQL_INT},
            "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
            "record_id": {"type": "string", "minLength": 1, "maxLength": 200},
            "version": {"type": "integer", "minimum": 1, "maximum": MAX_SQL_INT},
            "after": {"type": "integer", "minimum": 0, "maximum": MAX_SQL_INT, "default": 0},
            "name": name, "adapter": adapter}


# Rules the request models check in validators, which pydantic does not write
# into their schemas: the document states them, so a client (and the fuzzer)
# can tell a valid body from one the server will refuse.
_NOT_EMPTY_TEXT = {"type": "string", "minLength": 1}


def _only(given: tuple[str, ...], absent: tuple[str, ...]) -> dict:
    """A body with the fields `given` (not null) and the fields `absent` null or left out."""
    return {"required": list(given), "properties": {**{k: {"not": {"type": "null"}} for k in given},
                                                    **{k: {"type": "null"} for k in absent}}}

_RULES: dict[str, dict] = {
    # LoraEntry._one_of: an id or a name, not both (two disjoint shapes: a oneOf is slow to generate)
    "LoraEntry": {"anyOf": [
        {"required": ["id"], "properties": {"id": {"type": "integer"}, "name": {"type": "null"}}},
        {"required": ["name"], "properties": {"name": {"type": "string"}, "id": {"type": "null"}}}]},
    # TrainRequest._has_examples
    "TrainRequest": {"anyOf": [{"required": ["text"], "properties": {"text": {"type": "string"}}},
                               {"required": ["examples"], "properties": {"examples": {"type": "array",
                                                                                      "minItems": 1}}}]},
    # FeedbackRequest._one_kind: id with a correction or a rating, or preferred with rejected
    "FeedbackRequest": {"anyOf": [_only(("id", "correction"), ("rating", "preferred", "rejected")),
                                  _only(("id", "rating"), ("correction", "preferred", "rejected")),
                                  _only(("preferred", "rejected"), ("id", "correction", "rating"))]},
}


def _apply_rules(schemas: dict) -> None:
    for name, rule in _RULES.items():
        if name in schemas:
            schemas[name].update(rule)
    for model, field in (("CompletionRequest", "prompt"), ("EmbeddingRequest", "input")):
        texts = schemas.get(model, {}).get("properties", {}).get(field, {})
        for member in texts.get("anyOf", ()):        # the routes refuse an empty text
            if member.get("type") == "string":
                member.update(_NOT_EMPTY_TEXT)
            elif member.get("items", {}).get("type") == "string":
                member["items"] = {**member["items"], **_NOT_EMPTY_TEXT}


def _bodies():
    from dreamstage.records.feedback import FeedbackRequest
    from dreamstage.server.adapter_routes import ImportBody, PromoteBody
    from dreamstage.server.record_routes import LearnBody
    from dreamstage.training.jobs.request import TrainRequest
    return {("post", "/train"): (TrainRequest, True), ("post", "/adapters/{name}/promote"): (PromoteBody, False),
            ("post", "/adapters"): (ImportBody, True), ("post", "/v1/feedback"): (FeedbackRequest, True),
            ("put", "/adapters/{name}/learn"): (LearnBody, True)}


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
    params = _parameters()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", ()):
                if param["name"] in params and param["in"] in ("path", "query"):
                    param["schema"] = {"title": param["schema"].get("title", param["name"]), **params[param["name"]]}
            responses = op["responses"]
            # FastAPI's own 422 (HTTPValidationError) is not what these routes answer.
            responses.pop("422", None)
            extra = _ROUTES.get((method, path), ())
            codes = set(_COMMON) | set(extra) | (set(_WRITE) if method == "post" else set())
            for code in sorted(codes):
                responses[str(code)] = {"description": _WHY[code], "content": error_ref}
    for (method, path), (status, body) in _SUCCESS.items():
        if path in doc["paths"]:
            responses = doc["paths"][path][method]["responses"]
            if status != "200":                   # FastAPI lists 200 for routes whose decorator says otherwise
                responses.pop("200", None)
            responses.setdefault(status, {"description": "success"})["content"] = {
                "application/json": {"schema": body}}
    if "/health" in doc["paths"]:                 # 503 carries the health body, not an error
        doc["paths"]["/health"]["get"]["responses"]["503"] = {
            "description": "the engine is stopped or its last iteration failed",
            "content": {"application/json": {"schema": {"type": "object", "required": ["status"], "properties": {
                "status": {"enum": ["stopped", "failing"]}, "error": _STR}}}}}
    for path in ("/adapters/{name}/promote", "/adapters/rollback"):
        if path in doc["paths"]:                  # 200 applied, 202 booked and pending (the same body)
            responses = doc["paths"][path]["post"]["responses"]
            swap = {"allOf": [_ADAPTERS, {"type": "object", "required": ["applied", "served"]}]}
            for c in ("200", "202"):
                responses[c] = {"description": "the swap applied (200) or pending (202)",
                                "content": {"application/json": {"schema": swap}}}
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _apply_rules(schemas)
    # Completions stream as server-sent events when `stream` is true.
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
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
