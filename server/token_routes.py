"""llama-server's tokenizer routes: POST /tokenize and POST /detokenize, in its shapes.

Tokenizing runs on PromptTokenizer's worker threads (it reads only the
vocabulary), never on the engine thread.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dreamstage.server.fields import field_headers
from dreamstage.server.middleware import EdgeRoute
from dreamstage.server.schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter(route_class=EdgeRoute)     # bodies as the edge decoded them (middleware.py)


def _piece(model, token: int) -> str | list[int]:
    """A token's text, or its bytes as integers where they are not valid UTF-8 alone (llama-server's shape)."""
    data = model.token_piece(token, True)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    service = request.app.state.service
    headers = field_headers(body, service.settings.strict_api)
    tokens = await service.prompts.mixed(body.content, body.add_special, body.parse_special)
    out: list = [{"id": t, "piece": _piece(service.model, t)} for t in tokens] if body.with_pieces else tokens
    return JSONResponse({"tokens": out}, headers=headers)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    service = request.app.state.service
    headers = field_headers(body, service.settings.strict_api)
    return JSONResponse({"content": await service.prompts.detokenize(body.tokens)}, headers=headers)
