"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}. A response is kept
(response_store.py, in memory) unless the request says `"store": false`, so a later request may continue
it by `previous_response_id`: its conversation, answer included, goes before the new input (its
instructions do not, as OpenAI's do not).

A request's input items become chat messages (`instructions` first), its function tools and
`text.format` the chat request's tools and response_format, so it is answered by the chat path
(openai_routes.prepare_chat: template, tool grammar, sampling, records) and shaped here as a
Response (message and function_call output items, usage) or as its stream of typed events.
"""
from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from dreamstage.server import errors
from dreamstage.server.answers import ChatShape
from dreamstage.server.bridge import ClientGone, EngineRequest
from dreamstage.server.errors import APIError
from dreamstage.server.fields import field_headers
from dreamstage.server.middleware import EdgeRoute
from dreamstage.server.openai_routes import ADAPTER_HEADER, ADAPTER_NAME_HEADER, EngineStream, prepare_chat
from dreamstage.server.response_store import ResponseStore
from dreamstage.server.schemas import MAX_MESSAGES, ChatCompletionRequest, StrictModel
from dreamstage.server.tenants import scope_of
from dreamstage.serving.engine import Delta, Failed, Finished

router = APIRouter(route_class=EdgeRoute)

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    model: str | None = Field(None, max_length=200)
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # chat request fields a Responses body may carry as they are (vLLM's and llama-server's sampling
    # extras), validated by the chat request: every field typed Any (FORWARDED)
    top_k: Any = None
    min_p: Any = None
    typical_p: Any = None
    repetition_penalty: Any = None
    repeat_penalty: Any = None
    repeat_last_n: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    seed: Any = None
    stop: Any = None
    logit_bias: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    cache_prompt: Any = None
    chat_template_kwargs: Any = None
    grammar: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    lora: Any = None


FORWARDED = tuple(name for name, f in ResponsesRequest.model_fields.items() if f.annotation is Any)


def chat_body(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers `body`, whose conversation (chat messages: a kept response's, then
    its input's) is `conversation`; a 400 naming the Responses field that cannot be one."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    d: dict[str, Any] = {"messages": messages, "stream": False}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "store", *FORWARDED):
        if getattr(body, name) is not None:
            d[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        d["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        d["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                      for t in body.tools]
    if body.tool_choice is not None:
        d["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else \
            {"type": "function", "function": {"name": body.tool_choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        d["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else \
            {"type": "json_schema", "json_schema": {"name": fmt.name or "answer", "schema": fmt.schema_}}
    try:
        return ChatCompletionRequest.model_validate(d)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        top = str(err["loc"][0]) if err["loc"] else "body"
        param = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}.get(top, top)
        raise APIError(400, f"{loc or param}: {err['msg']}", param) from None


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a message (text parts only), function_call items as the tool_calls
    of one assistant message, function_call_output items as tool messages; reasoning items are left out."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": _role(item, i), "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant" and not out[-1]["content"] and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                        "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":
            raise APIError(400, f"input[{i}].type: {str(kind)[:40]!r} is not an item this server takes (message, "
                                "function_call, function_call_output, reasoning)", f"input[{i}].type")
    if not out:
        raise APIError(400, "input: no message in it", "input")
    return out


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"input[{i}].role: user, assistant, system or developer, got {str(role)[:40]!r}",
                       f"input[{i}].role")
    return role


def _string(item: dict[str, Any], key: str, i: int) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise APIError(400, f"input[{i}].{key}: a string is required", f"input[{i}].{key}")
    return v


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: a string or a list of text parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise APIError(400, f"{param}[{j}].type: only text parts ({', '.join(_TEXT_PARTS[:3])}) are taken, "
                                f"got {str(kind)[:40]!r}", f"{param}[{j}].type")
        parts.append(part.get("text", part.get("refusal")))
    return "".join(parts)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    service = request.app.state.service
    ignored = field_headers(body, service.settings.strict_api)
    conversation = [*_earlier(request, body.previous_response_id), *input_messages(body.input)]
    job = await prepare_chat(service, chat_body(body, conversation), request)
    engine_job = EngineRequest(service.engine, [job.gens], service.settings.retry_after_s)
    shape = ChatShape({}, service.prompts.pieces, False, job.tools, body.parallel_tool_calls is False)
    rid = f"resp_{uuid.uuid4().hex[:32]}"
    head = _head(rid, job.model, body)
    try:
        adm = await engine_job.admitted(request.is_disconnected)
    except ClientGone:
        return JSONResponse(errors.error_body(499, "client closed the request"), status_code=499)
    headers = {ADAPTER_NAME_HEADER: adm.adapter.label, **ignored}
    if adm.adapter_version is not None:
        headers[ADAPTER_HEADER] = str(adm.adapter_version)
    if not body.stream:
        try:
            (got,) = await engine_job.collect(request.is_disconnected)
        except ClientGone:
            return JSONResponse(errors.error_body(499, "client closed the request"), status_code=499)
        if job.exchange is not None:
            await job.exchange.save(rid, [(got.text, got.finished)])
        message, items = _answer(shape, got.text)
        done = _done(head, items, got.finished)
        _keep(request, body, conversation, message, done)
        return JSONResponse(done, headers=headers)
    keep = functools.partial(_keep, request, body, conversation)
    return EngineStream(_events(engine_job, shape, head, job, keep), engine_job, headers)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    kept = _store(request).get(response_id, scope_of(request))
    if kept is None:
        raise APIError(404, f"response {response_id[:80]!r} is not kept here", "response_id", "not_found")
    return kept.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not _store(request).delete(response_id, scope_of(request)):
        raise APIError(404, f"response {response_id[:80]!r} is not kept here", "response_id", "not_found")
    return {"id": response_id, "object": "response", "deleted": True}


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def _earlier(request: Request, rid: str | None) -> list[dict[str, Any]]:
    """The conversation `previous_response_id` ended, its answer included; a 404 naming the field if not kept."""
    if rid is None:
        return []
    kept = _store(request).get(rid, scope_of(request))
    if kept is None:
        raise APIError(404, f"previous_response_id: response {rid[:80]!r} is not kept here (a restart forgets "
                            "responses; one sent with store false is never kept)", "previous_response_id",
                       "not_found")
    return kept.messages


def _keep(request: Request, body: ResponsesRequest, conversation: list[dict[str, Any]], message: dict[str, Any],
          done: dict[str, Any]) -> None:
    if body.store is not False:
        _store(request).put(done["id"], scope_of(request), [*conversation, message], done)


def _head(rid: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
    """The fields every Response object of this request carries."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
        {"type": "text"}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
            "store": body.store is not False,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(), "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "text": {"format": fmt}, "truncation": "disabled", "user": body.user}


def _answer(shape: ChatShape, text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A whole answer as a chat message and as output items: its text as a message item, its tool
    calls as function_call items (with the message's call ids)."""
    message, called = shape.assistant_message(text)
    out = []
    if message.get("content") or not called:
        out.append(_message_item(message.get("content") or ""))
    for call in message.get("tool_calls") or ():
        out.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                    "status": "completed"})
    return message, out


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex[:24]}", "status": status,
            "role": "assistant", "content": content}


def _done(head: dict[str, Any], items: list[dict[str, Any]], fin: Finished) -> dict[str, Any]:
    cut = fin.finish_reason == "length"
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "output": items,
            "usage": {"input_tokens": fin.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": fin.cached_tokens},
                      "output_tokens": fin.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": fin.prompt_tokens + fin.completion_tokens}}


async def _events(engine_job: EngineRequest, shape: ChatShape, head: dict[str, Any], job,
                  keep: Callable[[dict[str, Any], dict[str, Any]], None]) -> AsyncIterator[dict]:
    """The typed events of a streamed response. Text streams as it comes when no tools are offered;
    with tools, the answer is read for calls once it ends and its items are sent then."""
    seq = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> dict[str, str]:
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": next(seq), **fields},
                                                  ensure_ascii=False, separators=(",", ":"))}

    opening = {**head, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    live = job.tools is None
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    parts: list[str] = []
    if live:
        yield event("response.output_item.added", output_index=0, item=_message_item("", "in_progress", msg_id))
        yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
    while True:
        _, ev = await engine_job.next()
        if isinstance(ev, Delta):
            parts.append(ev.text)
            if live and ev.text:
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=ev.text, logprobs=[])
        elif isinstance(ev, Failed):
            yield event("error", code=str(ev.status), message=ev.message, param=ev.param)
            return
        elif isinstance(ev, Finished):
            text = "".join(parts)
            message, items = _answer(shape, text)
            if live:
                items = [_message_item(text, item_id=msg_id)]
            for k, item in enumerate(items):
                async for e in _item_events(event, k, item, announced=live):
                    yield e
            if job.exchange is not None:
                await job.exchange.save(head["id"], [(text, ev)])
            done = _done(head, items, ev)
            keep(message, done)
            yield event("response.completed", response=done)
            return


async def _item_events(event, index: int, item: dict[str, Any], announced: bool) -> AsyncIterator[dict]:
    """The events that finish output item `index` (and, unless `announced`, open it and send its content whole)."""
    if item["type"] == "message":
        text = item["content"][0]["text"]
        part = {"type": "output_text", "text": text, "annotations": []}
        if not announced:
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                                "content": []})
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part={**part, "text": ""})
            if text:
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=text, logprobs=[])
        yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
    else:
        yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                            "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"])
    yield event("response.output_item.done", output_index=index, item=item)
