"""The request body at the edge, as plain ASGI middleware, before any route parses it.

- Bodies over `max_bytes` get 413 (a declared Content-Length at once, a
  chunked upload as soon as it passes the limit).
- A body that is not valid UTF-8, or whose JSON strings hold a lone surrogate
  (`"\\ud800"` parses in Python, but cannot be encoded, so it would blow up in
  the tokenizer), gets 400 naming the field. Such text never reaches a route,
  a job or the engine thread.
- A JSON body with an object of more than MAX_OBJECT_KEYS keys, nested
  deeper than MAX_JSON_DEPTH, or with a string longer than MAX_STRING_CHARS,
  gets 413 naming the bound: validating 300,000 unknown keys took seconds on
  the event loop, which carries every stream. The check is a scan of the
  raw bytes that builds nothing (json.loads would hold the GIL, and so the
  event loop, for the whole parse of a hostile body); large bodies are
  scanned on a worker thread, in small steps the event loop runs between.
- Every JSON body is then decoded here, once, and handed to the route
  through the ASGI scope (BODY_KEY): a router made with EdgeRoute validates it
  with the route's body model and gives FastAPI the model; a route that parses
  its own body reads it with json_body. A large body is decoded, and validated,
  on worker threads, the decoding by a decoder that yields the GIL, so a legal
  4 MiB body does not pause the streams either. A number with a zero fraction
  is an integer (2.0 is 2), as JSON Schema, and so the OpenAPI document, reads it.
"""
from __future__ import annotations

import asyncio
import json
import json.scanner
import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from dreamstage.server.errors import send_error

# A \uD800-\uDFFF escape: the only way a lone surrogate gets past strict UTF-8.
# Valid pairs (emoji written as escapes) also match; the walk below decides.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Bodies larger than this are checked, decoded and validated on a worker thread,
# so the event loop (which carries every open stream) does not stall on them.
_INLINE_CHECK_BYTES = 64 << 10
# The shape a request body may have: keys in one object (a logit_bias or a tool's
# schema is far smaller) and nesting (a tool's JSON schema is the deepest we take).
MAX_OBJECT_KEYS = 4096
MAX_JSON_DEPTH = 64
# One JSON string (a prompt, a message): longer than any slot's context holds
# (1 Mi characters is about 250k tokens), and a key this long is no field.
MAX_STRING_CHARS = 1 << 20

# The scan's tokens: a whole string (escapes included), a bracket, a colon.
_SHAPE_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:]')


def body_shape_problem(raw: bytes) -> tuple[str, str] | None:
    """(param, message) when a JSON body is larger in shape than a request can be, else None
    (a body that does not parse is left to the route, which names what is wrong)."""
    if (raw.count(b":") <= MAX_OBJECT_KEYS and raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH
            and len(raw) <= MAX_STRING_CHARS):
        return None                     # too few keys, brackets and bytes to break a bound: no scan
    keys: list[int] = []                # per open object its keys so far; -1 for an open list
    for m in _SHAPE_TOKEN.finditer(raw):
        tok = m.group()
        first = tok[:1]
        if first == b'"':
            # characters as written (an escape counts its own), not bytes: UTF-8 takes up to 4 per character
            if len(tok) - 2 > MAX_STRING_CHARS and len(tok.decode("utf-8", "replace")) - 2 > MAX_STRING_CHARS:
                return "body", f"body: a string is longer than {MAX_STRING_CHARS} characters (MAX_STRING_CHARS)"
        elif first == b":":
            if keys and keys[-1] >= 0:
                keys[-1] += 1
                if keys[-1] > MAX_OBJECT_KEYS:
                    return "body", f"body: an object has more than {MAX_OBJECT_KEYS} keys (MAX_OBJECT_KEYS)"
        elif first in (b"{", b"["):
            keys.append(0 if first == b"{" else -1)
            if len(keys) > MAX_JSON_DEPTH:
                return "body", f"body: nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)"
        elif keys:
            keys.pop()
    return None


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it is a whole one
    (JSON Schema's integer: 2.0 is 2), a float otherwise."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) <= _EXACT_FLOAT_INT else value


_EXACT_FLOAT_INT = 2**53      # past this a float no longer spells one integer


def _decoder(yielding: bool) -> json.JSONDecoder:
    decoder = json.JSONDecoder(parse_float=_number)
    if yielding:
        # The pure-Python scanner: slower, but it runs bytecode, so a worker thread
        # hands the GIL back every switch interval; the C scanner holds it for the
        # whole parse (170 ms for 2 million token ids on this project's VM).
        decoder.scan_once = json.scanner.py_make_scanner(decoder)   # type: ignore[attr-defined]
    return decoder


@dataclass(frozen=True)
class DecodedBody:
    """A request body as the edge decoded it, handed to the route through the ASGI scope (BODY_KEY)."""

    value: Any = None                       # the JSON value
    not_json: json.JSONDecodeError | None = None   # why the body is not JSON (the route names it)
    large: bool = False                     # validate it off the event loop too


BODY_KEY = "dreamstage.body"


def read_body(raw: bytes, large: bool = False) -> DecodedBody | tuple[int, str, str, str]:
    """The body decoded, or (status, param, message, code) refusing it. The shape
    first: the decoder must never meet a hostile shape. `large`: decode with the
    decoder that yields the GIL (the caller runs this on a worker thread)."""
    problem = body_shape_problem(raw)
    if problem is not None:
        return 413, *problem, "body_too_complex"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return 400, "body", f"body: not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})", "invalid_text"
    try:
        value, end = _decoder(large).raw_decode(text, _after_space(text, 0))
        if _after_space(text, end) != len(text):
            raise json.JSONDecodeError("Extra data", text, end)
    except json.JSONDecodeError as e:
        return DecodedBody(not_json=e, large=large)
    if _SURROGATE_ESCAPE.search(raw):
        path = unencodable_field(value)
        if path is not None:
            return 400, path, (f"{path}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                               "which is not text"), "invalid_text"
    return DecodedBody(value, large=large)


class EdgeRoute(APIRoute):
    """A route whose body model validates what BodyGuard decoded (off the event
    loop when the body is large) instead of FastAPI parsing the body again; the
    validated model then passes FastAPI's own validation as it is."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = None if self._embed_body_fields else self.body_field
        if field is None:
            return handler

        async def app(request: Request):
            decoded = request.scope.get(BODY_KEY)
            if decoded is not None:
                e = decoded.not_json
                if e is not None:
                    raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                                   "msg": "JSON decode error", "input": {}, "ctx": {"error": e.msg}}])
                if decoded.large:
                    model, errors = await asyncio.to_thread(field.validate, decoded.value, {}, loc=("body",))
                else:
                    model, errors = field.validate(decoded.value, {}, loc=("body",))
                if errors:
                    raise RequestValidationError(errors, body=decoded.value)
                request._json = model       # Starlette's cache of request.json(), which FastAPI reads
            return await handler(request)
        return app


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _after_space(text: str, i: int) -> int:
    m = _WHITESPACE.match(text, i)
    return m.end() if m else i


def json_body(request, raw: bytes) -> Any:
    """The JSON value of a request's body, for a route that parses its own: as
    the edge decoded it, else (a request that did not pass BodyGuard) decoded here."""
    decoded = request.scope.get(BODY_KEY)
    if decoded is None:
        return json.loads(raw, parse_float=_number)
    if decoded.not_json is not None:
        raise decoded.not_json
    return decoded.value


def unencodable_field(obj) -> str | None:
    """The path (`messages[0].content`) of the first string or key that is not
    encodable as UTF-8, or None. Iterative: depth costs no recursion."""
    stack = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


class BodyGuard:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await self._too_large(send)
        # Read the whole body (bounded by max_bytes), check it, then replay it.
        parts, seen, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._too_large(send)
            parts.append(chunk)
            more = msg.get("more_body", False)
        raw = b"".join(parts)
        if raw:
            if len(raw) > _INLINE_CHECK_BYTES:
                decoded = await asyncio.to_thread(read_body, raw, True)
            else:
                decoded = read_body(raw)
            if not isinstance(decoded, DecodedBody):
                status, param, message, code = decoded
                return await send_error(send, status, message, param, code)
            scope = {**scope, BODY_KEY: decoded}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()       # after the body: wait for the disconnect, as the server would send it

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        await send_error(send, 413, f"body: request body exceeds {self.max_bytes} bytes", "body", "body_too_large")
