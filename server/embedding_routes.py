"""POST /v1/embeddings (OpenAI's shape), on the `--embeddings` flag as llama-server has it.

Each input is a request the engine answers with its prompt's mean-pooled,
L2-normalized last hidden states (Engine._embed_waiting), on the resident
context, with the served adapter.
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dreamstage.server.adapter_select import resolve
from dreamstage.server.bridge import EngineRequest
from dreamstage.server.errors import APIError
from dreamstage.server.fields import field_headers
from dreamstage.server.middleware import EdgeRoute
from dreamstage.server.schemas import EmbeddingRequest
from dreamstage.server.tenants import scope_of
from dreamstage.serving.generation import GenerationRequest

router = APIRouter(route_class=EdgeRoute)     # bodies as the edge decoded them (middleware.py)


async def _one(request: Request, tokens: list[int], body_model: str | None):
    service = request.app.state.service
    if len(tokens) >= service.engine.slot_ctx:
        raise APIError(400, f"input: {len(tokens)} tokens exceed the per-slot context of {service.engine.slot_ctx} "
                            "tokens", "input", "context_length_exceeded")
    adapter = resolve(service, body_model, None, scope_of(request))
    job = EngineRequest(service.engine, [[GenerationRequest(tokens, 1, embed=True, adapter=adapter)]],
                        service.settings.retry_after_s)
    try:
        await job.admitted(request.is_disconnected)
        return await job.embedded(request.is_disconnected)
    finally:
        job.cancel()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    service = request.app.state.service
    if not service.settings.embeddings:
        raise APIError(501, "this server does not serve embeddings: start it with --embeddings", None,
                       "embeddings_off")
    headers = field_headers(body, service.settings.strict_api)
    prompts = []
    for i, item in enumerate(body.inputs()):
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"input[{i}]: must not be empty", f"input[{i}]")
            item = await service.prompts.text(item, False)
        elif any(t >= service.model.n_vocab for t in item):
            raise APIError(400, f"input[{i}]: a token is not in the vocabulary (0..{service.model.n_vocab - 1})",
                           f"input[{i}]")
        prompts.append(item)
    done = await asyncio.gather(*(_one(request, p, body.model) for p in prompts))
    used = sum(d.prompt_tokens for d in done)

    def encoded(vector: tuple[float, ...]):
        if body.encoding_format == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        return list(vector)
    return JSONResponse({"object": "list", "model": service.model_id,
                         "data": [{"object": "embedding", "index": i, "embedding": encoded(d.embedding)}
                                  for i, d in enumerate(done)],
                         "usage": {"prompt_tokens": used, "total_tokens": used}}, headers=headers)
