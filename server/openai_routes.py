"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Request bodies are validated by schemas.py; a request becomes token ids off the
engine thread (prompts.py) and a GenerationRequest the engine decodes.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from dreamstage.server import errors
from dreamstage.server.bridge import ClientGone, EngineRequest
from dreamstage.server.errors import APIError
from dreamstage.server.fields import field_headers
from dreamstage.server.schemas import ChatCompletionRequest, CompletionRequest
from dreamstage.serving.engine import Delta, Failed, Finished, GenerationRequest
from dreamstage.serving.sampling import GrammarError, json_schema_grammar

router = APIRouter()
ADAPTER_HEADER = "X-Dreamstage-Adapter-Version"

# How long a token stream may take to end by itself once the server is told to
# stop: the engine first finishes its step, then ends every open request with
# an error event (serving.md, "Shutdown"). run_uvicorn gives uvicorn's own
# graceful timeout the same value.
SHUTDOWN_GRACE_S = 5   # seconds; an int, as uvicorn's timeout_graceful_shutdown takes


class _EngineStream(EventSourceResponse):
    """An SSE response that cancels its engine request however it ends (finish, error, disconnect, shutdown)."""

    def __init__(self, content, job: EngineRequest, headers: dict):
        # sep="\n": the bytes OpenAI's own streams carry (sse-starlette defaults to CRLF)
        super().__init__(content, headers=headers, sep="\n", shutdown_grace_period=SHUTDOWN_GRACE_S)
        self._job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.cancel()


def _generation(service, body, prompt: list[int], grammar: str | None, prompt_param: str) -> GenerationRequest:
    """The engine's request: the body's sampling fields over the model's defaults."""
    sampling = replace(service.sampling_defaults, **body.sampling_given(service.engine.slot_ctx), grammar=grammar)
    return GenerationRequest(prompt, body.limit(), sampling, body.stop_list(),
                             stop_tokens=frozenset(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                             cache_prompt=body.cache_prompt, prompt_param=prompt_param)


def _grammar(body: ChatCompletionRequest | CompletionRequest) -> str | None:
    rf = getattr(body, "response_format", None)
    if rf is None or rf.type == "text":
        return body.grammar
    schema = None
    if rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else rf.schema_
        if schema is None:
            raise APIError(400, "response_format.json_schema.schema: required for type json_schema",
                           "response_format.json_schema.schema")
    elif rf.schema_ is not None:
        schema = rf.schema_
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise APIError(400, f"response_format: {e}", "response_format") from None


def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _sse(obj) -> dict[str, str]:
    # a dict, not a ServerSentEvent: sse-starlette then writes the response's separator ("\n")
    return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}


async def _run(request: Request, gen: GenerationRequest, stream: bool, make_chunk, make_final, make_full,
               include_usage: bool, extra_headers: dict[str, str]):
    """Admit `gen` to the engine; answer whole (JSON) or as an SSE stream of the given chunk shapes."""
    service = request.app.state.service
    job = EngineRequest(service.engine, gen, service.settings.retry_after_s)
    disconnected = request.is_disconnected
    try:
        adm = await job.admitted(disconnected)
    except ClientGone:
        return JSONResponse(errors.error_body(499, "client closed the request"), status_code=499)
    headers = {ADAPTER_HEADER: str(adm.adapter_version), **extra_headers}
    if not stream:
        try:
            text, fin = await job.collect(disconnected)
        except ClientGone:
            return JSONResponse(errors.error_body(499, "client closed the request"), status_code=499)
        return JSONResponse(make_full(text, fin), headers=headers)

    async def events():
        first = make_chunk(None, adm.adapter_version)
        if first is not None:
            yield _sse(first)
        while True:
            ev = await job.next()
            if isinstance(ev, Delta):
                if ev.text:
                    yield _sse(make_chunk(ev.text, adm.adapter_version))
            elif isinstance(ev, Finished):
                yield _sse(make_final(ev))
                if include_usage:
                    u = make_final(ev)
                    u["choices"], u["usage"] = [], _usage(ev)
                    yield _sse(u)
                yield {"data": "[DONE]"}
                return
            elif isinstance(ev, Failed):
                yield _sse(errors.error_body(ev.status, ev.message, ev.param))
                return

    return _EngineStream(events(), job, headers)



@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    service = request.app.state.service
    ignored = field_headers(body, service.settings.strict_api)
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in body.messages]
    grammar = _grammar(body)
    # token ids, off the engine thread
    prompt = await service.prompts.chat(service.chat, messages, body.chat_template_kwargs)
    gen = _generation(service, body, prompt, grammar, "messages")
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), service.model_id
    base = {"id": cid, "created": created, "model": model, "system_fingerprint": None}

    def chunk(text, version):
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        return {**base, "object": "chat.completion.chunk", "adapter_version": version,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}

    def final(fin: Finished):
        return {**base, "object": "chat.completion.chunk", "adapter_version": fin.adapter_version,
                "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": fin.finish_reason}]}

    def full(text, fin: Finished):
        return {**base, "object": "chat.completion", "adapter_version": fin.adapter_version,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": fin.finish_reason}],
                "usage": _usage(fin)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _run(request, gen, body.stream, chunk, final, full, include_usage, ignored)

@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    service = request.app.state.service
    ignored = field_headers(body, service.settings.strict_api)
    engine = service.engine
    prompt = body.prompt_value()
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "prompt: must not be empty", "prompt")
    grammar = _grammar(body)
    if isinstance(prompt, str):
        prompt = await service.prompts.text(prompt, body.parse_special)   # token ids, off the engine thread
    elif len(prompt) > engine.slot_ctx:       # refused here, not by a scan on the engine thread
        raise APIError(400, f"prompt: {len(prompt)} tokens exceed the per-slot context of {engine.slot_ctx} "
                            "tokens", "prompt", "context_length_exceeded")
    gen = _generation(service, body, prompt, grammar, "prompt")
    cid, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), service.model_id
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}

    def chunk(text, version):
        if text is None:
            return None
        return {**base, "adapter_version": version,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}

    def final(fin: Finished):
        return {**base, "adapter_version": fin.adapter_version,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": fin.finish_reason}]}

    def full(text, fin: Finished):
        return {**base, "adapter_version": fin.adapter_version,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fin.finish_reason}],
                "usage": _usage(fin)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _run(request, gen, body.stream, chunk, final, full, include_usage, ignored)

@router.get("/v1/models")
async def models(request: Request):
    service = request.app.state.service
    engine = service.engine
    return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": 0,
                                        "owned_by": "dreamstage", "adapter_version": engine.adapter_version}]}
