"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Request bodies are validated by schemas.py; a request becomes token ids off the
engine thread (prompts.py) and a GenerationRequest the engine decodes.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from dreamstage.adapters.choice import BASE_NAME, AdapterChoice
from dreamstage.server import errors
from dreamstage.server.adapter_select import listed_adapters, resolve
from dreamstage.server.answers import ChatShape, CompletionShape, usage
from dreamstage.server.bridge import ClientGone, EngineRequest
from dreamstage.server.errors import APIError
from dreamstage.server.fields import field_headers
from dreamstage.server.middleware import EdgeRoute
from dreamstage.server.record_routes import Exchange, begin
from dreamstage.server.schemas import ChatCompletionRequest, CompletionRequest
from dreamstage.server.tenants import scope_of
from dreamstage.server.views import public
from dreamstage.serving.constraints import constraint_grammar
from dreamstage.serving.engine import Delta, Failed, Finished, GenerationRequest
from dreamstage.serving.generation import PromptScored
from dreamstage.serving.sampling import GrammarError, json_schema_grammar
from dreamstage.serving.tools import forced_call_grammar, prompt_messages

router = APIRouter(route_class=EdgeRoute)     # bodies as the edge decoded them (middleware.py)
ADAPTER_HEADER = "X-Dreamstage-Adapter-Version"
# Which adapter answered: "base", or "<name>@<version>" (adapter_select.py).
ADAPTER_NAME_HEADER = "X-Dreamstage-Adapter"

# How long a token stream may take to end by itself once the server is told to
# stop: the engine first finishes its step, then ends every open request with
# an error event (serving.md, "Shutdown"). run_uvicorn gives uvicorn's own
# graceful timeout the same value.
SHUTDOWN_GRACE_S = 5   # seconds; an int, as uvicorn's timeout_graceful_shutdown takes


class EngineStream(EventSourceResponse):
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


def _generation(service, body, prompt: list[int], grammar: tuple[str, str] | None, prompt_param: str,
                adapter: AdapterChoice | None) -> GenerationRequest:
    """The engine's request: the body's sampling fields over the model's defaults, on `adapter`."""
    bias = body.bias_pairs()
    bad = next((t for t, _ in bias if t >= service.model.n_vocab), None)
    if bad is not None:
        raise APIError(400, f"logit_bias: token {bad} is not in the vocabulary (0..{service.model.n_vocab - 1})",
                       "logit_bias")
    gbnf, grammar_param = grammar if grammar is not None else (None, "grammar")
    sampling = replace(service.sampling_defaults, **body.sampling_given(service.engine.slot_ctx), grammar=gbnf,
                       logit_bias=bias)
    return GenerationRequest(prompt, body.limit(), sampling, body.stop_list(),
                             stop_tokens=frozenset(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                             min_tokens=body.min_tokens, cache_prompt=body.cache_prompt, prompt_param=prompt_param,
                             grammar_param=grammar_param, adapter=adapter)


def _grammar(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """(GBNF, the field it comes from) for the request's one constraint on its answer (schemas.Constraint), or None."""
    given = body.constraints()
    if not given:
        return None
    c = given[0]
    try:
        return constraint_grammar(c.kind, c.value), c.param
    except GrammarError as e:
        raise APIError(400, f"{c.param}: {e}", c.param) from None


def _sse(obj) -> dict[str, str]:
    # a dict, not a ServerSentEvent: sse-starlette then writes the response's separator ("\n")
    return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}


async def _run(request: Request, groups: list[list[GenerationRequest]], stream: bool, shape, include_usage: bool,
               extra_headers: dict[str, str], exchange: Exchange | None = None):
    """Admit the request's choices (a group per prompt) to the engine; answer whole (JSON) or as an SSE
    stream, in `shape` (answers.py)."""
    service = request.app.state.service
    job = EngineRequest(service.engine, groups, service.settings.retry_after_s)
    disconnected = request.is_disconnected
    try:
        adm = await job.admitted(disconnected)
    except ClientGone:
        return JSONResponse(errors.error_body(499, "client closed the request"), status_code=499)
    headers = {ADAPTER_NAME_HEADER: adm.adapter.label, **extra_headers}
    shape.base["adapter"] = adm.adapter.label           # known once admitted (the default is read then)
    if adm.adapter_version is not None:
        headers[ADAPTER_HEADER] = str(adm.adapter_version)
    if not stream:
        try:
            got = await job.collect(disconnected)
        except ClientGone:
            return JSONResponse(errors.error_body(499, "client closed the request"), status_code=499)
        answer = shape.full(got, job.starts)
        if exchange is not None:
            await exchange.save(shape.base["id"], [(c.text, c.finished) for c in got])
        return JSONResponse(answer, headers=headers)
    return EngineStream(_events(job, shape, adm.adapter_version, include_usage, exchange), job, headers)


async def _events(job: EngineRequest, shape, version: int | None, include_usage: bool,
                  exchange: Exchange | None = None):
    """The SSE events of a streamed answer: chunks per choice, each choice's final one, usage, [DONE]."""
    first = shape.opening(version, job.n)
    if first is not None:
        yield _sse(first)
    ends: dict[int, Finished] = {}
    texts: list[list[str]] = [[] for _ in range(job.n)]     # each choice's answer, for its record
    while True:
        i, ev = await job.next()
        if exchange is not None and isinstance(ev, Delta):
            texts[i].append(ev.text)
        if isinstance(ev, (Delta, PromptScored)):
            piece = shape.delta(ev, version, i) if isinstance(ev, Delta) else shape.prompt(ev, version, i)
            if piece is not None:
                yield _sse(piece)
        elif isinstance(ev, Finished):
            ends[i] = ev
            closing = shape.final(ev, i)
            for piece in closing:
                yield _sse(piece)
            if len(ends) < job.n:
                continue
            if include_usage:
                u = dict(closing[-1])
                u["choices"], u["usage"] = [], usage([ends[k] for k in sorted(ends)], job.starts)
                yield _sse(u)
            if exchange is not None:
                await exchange.save(shape.base["id"], [("".join(texts[k]), ends[k]) for k in range(job.n)])
            yield {"data": "[DONE]"}
            return
        elif isinstance(ev, Failed):
            yield _sse(errors.error_body(ev.status, ev.message, ev.param))
            return


def _message_dicts(body: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the template's dicts (tool_calls in OpenAI's shape, ids filled in)."""
    out = []
    for m in body.messages:
        d: dict = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id or f"call_{i}", "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for i, c in enumerate(m.tool_calls)]
        out.append(d)
    return out


def _tool_grammar(tools: list[dict]) -> tuple[str, str]:
    try:
        return forced_call_grammar(tools, json_schema_grammar), "tools"
    except GrammarError as e:
        raise APIError(400, f"tools: a parameters schema could not be made a grammar: {e}", "tools") from None


def _choices(body, gen: GenerationRequest, n_slots: int) -> list[GenerationRequest]:
    """One request per choice: choice i draws with seed + i, so each is reproducible alone."""
    if body.n > n_slots:
        raise APIError(400, f"n: {body.n} choices, where this server has {n_slots} slots (--parallel)", "n")
    seed = gen.sampling.seed
    return [gen if i == 0 else replace(gen, sampling=replace(
        gen.sampling, seed=None if seed is None else (seed + i) % 2**32)) for i in range(body.n)]


@dataclass
class ChatJob:
    """A chat request made ready for the engine: its choices, the tools offered (names), the
    answering model's name, and what to record (None: not recorded)."""
    gens: list[GenerationRequest]
    tools: frozenset[str] | None
    model: str
    exchange: Exchange | None


async def prepare_chat(service, body: ChatCompletionRequest, request: Request) -> ChatJob:
    """Messages through the chat template into token ids (off the engine thread), the grammar of a
    forced tool call or of the request's constraint, and the choices (chat completions, responses.py)."""
    adapter = resolve(service, body.model, body.lora, scope_of(request))
    offered = body.offered_tools()
    native = bool(offered) and service.chat.supports_tools
    messages = prompt_messages(_message_dicts(body), offered, native)
    grammar = _tool_grammar(body.forced_tools()) if body.forced_tools() else _grammar(body)
    prompt = await service.prompts.chat(service.chat, messages, body.chat_template_kwargs, offered if native else None)
    gen = replace(_generation(service, body, prompt, grammar, "messages", adapter), logprobs=body.logprob_count())
    gens = _choices(body, gen, service.engine.n_seq)
    names = frozenset(t["function"]["name"] for t in offered) if offered else None
    exchange = begin(service, body, "chat", gens, messages=messages, tools=offered if native else None)
    return ChatJob(gens, names, _answered_as(service, body.model, adapter), exchange)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    service = request.app.state.service
    ignored = field_headers(body, service.settings.strict_api)
    job = await prepare_chat(service, body, request)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": job.model,
            "system_fingerprint": None}
    shape = ChatShape(base, service.prompts.pieces, body.logprobs is True, job.tools, body.parallel_tool_calls is False)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _run(request, [job.gens], body.stream, shape, include_usage, ignored, job.exchange)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    service = request.app.state.service
    ignored = field_headers(body, service.settings.strict_api)
    adapter = resolve(service, body.model, body.lora, scope_of(request))
    given = body.prompt_values()
    batch = len(given) > 1
    if body.n * len(given) > service.engine.n_seq + service.settings.max_queue:
        raise APIError(400, f"prompt: {len(given)} prompts of n = {body.n} choices are more than this server's "
                            f"{service.engine.n_seq} slots and waiting room of {service.settings.max_queue} hold",
                       "prompt")
    grammar = _grammar(body)
    prompts = [await _completion_prompt(service, body, p, f"prompt[{k}]" if batch else "prompt")
               for k, p in enumerate(given)]
    scored = body.echo and body.logprobs is not None
    groups = []
    for prompt in prompts:
        gen = replace(_generation(service, body, prompt, grammar, "prompt", adapter), logprobs=body.logprobs,
                      prompt_logprobs=body.logprobs if scored else None)
        groups.append(_choices(body, gen, service.engine.n_seq))
    base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": _answered_as(service, body.model, adapter)}
    echo_texts = None
    if body.echo:
        echo_texts = [p if isinstance(p, str) else await service.prompts.detokenize(t)
                      for p, t in zip(given, prompts, strict=True)]
    shape = CompletionShape(base, service.prompts.pieces, body.logprobs is not None, echo_texts, prompts, body.n)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    texts = [p if isinstance(p, str) else None for p in given for _ in range(body.n)]
    exchange = begin(service, body, "completion", [g for group in groups for g in group], prompts=texts)
    return await _run(request, groups, body.stream, shape, include_usage, ignored, exchange)


async def _completion_prompt(service, body: CompletionRequest, given: str | list[int], param: str) -> list[int]:
    """One completion prompt's token ids (text tokenized off the engine thread); a 400 naming `param`."""
    if isinstance(given, str):
        if not given:
            raise APIError(400, f"{param}: must not be empty", param)
        return await service.prompts.text(given, body.parse_special, param)
    if len(given) > service.engine.slot_ctx:       # refused here, not by a scan on the engine thread
        raise APIError(400, f"{param}: {len(given)} tokens exceed the per-slot context of {service.engine.slot_ctx} "
                            "tokens", param, "context_length_exceeded")
    return given


def _answered_as(service, model: str | None, adapter: AdapterChoice | None) -> str:
    """The response's `model`: what the request named (vLLM echoes an adapter's name), else the base model's id."""
    if model is not None and adapter is not None and not adapter.is_base:
        return model
    return service.model_id


@router.get("/v1/models")
async def models(request: Request):
    """The base model, then every adapter with a served version (the key's, when it is scoped), as vLLM lists them."""
    return {"object": "list", "data": _model_entries(request)}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    """One entry of /v1/models (OpenAI's retrieve): by its id, or "base"; else 404."""
    entries = _model_entries(request)
    found = entries[0] if model_id == BASE_NAME else next((e for e in entries if e["id"] == model_id), None)
    if found is None:
        raise APIError(404, f"The model `{model_id[:200]}` does not exist.", "model", "model_not_found")
    return found


def _model_entries(request: Request) -> list[dict]:
    service = request.app.state.service
    engine = service.engine
    scope = scope_of(request)
    # max_model_len (vLLM's): the tokens one request may hold, prompt and answer together
    base = {"id": service.model_id, "object": "model", "created": 0, "owned_by": "dreamstage", "root": None,
            "parent": None, "max_model_len": engine.slot_ctx,
            "adapter_version": engine.adapter_version if not scope.scoped else None}
    data = [base]
    for v in listed_adapters(service, scope):
        data.append({"id": v["name"], "object": "model", "created": int(v["created"]), "owned_by": "dreamstage",
                     "root": v["path"], "parent": service.model_id, "max_model_len": engine.slot_ctx,
                     "version": v["version"], "adapter_version": v["served_version"], "default": v["default"]})
    return public(data)
