"""The request body at the edge, as plain ASGI middleware, before any route parses it.

- Bodies over `max_bytes` get 413 (a declared Content-Length at once, a
  chunked upload as soon as it passes the limit).
- A body that is not valid UTF-8, or whose JSON strings hold a lone surrogate
  (`"\\ud800"` parses in Python, but cannot be encoded, so it would blow up in
  the tokenizer), gets 400 naming the field. Such text never reaches a route,
  a job or the engine thread.
- A JSON body with an object of more than MAX_OBJECT_KEYS keys, or nested
  deeper than MAX_JSON_DEPTH, gets 413 naming the bound: validating 300,000
  unknown keys took seconds on the event loop, which carries every stream.
  Large bodies are checked on a worker thread.
"""
from __future__ import annotations

import asyncio
import json
import re

from dreamstage.server.errors import send_error

# A \uD800-\uDFFF escape: the only way a lone surrogate gets past strict UTF-8.
# Valid pairs (emoji written as escapes) also match; the walk below decides.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Bodies larger than this are checked on a worker thread, so the event loop
# (which carries every open stream) does not stall on a JSON walk.
_INLINE_CHECK_BYTES = 64 << 10
# The shape a request body may have: keys in one object (a logit_bias or a tool's
# schema is far smaller) and nesting (a tool's JSON schema is the deepest we take).
MAX_OBJECT_KEYS = 4096
MAX_JSON_DEPTH = 64


class _TooManyKeys(Exception):
    pass


def _bounded_object(pairs):
    if len(pairs) > MAX_OBJECT_KEYS:
        raise _TooManyKeys
    return dict(pairs)


def _depth(obj) -> int:
    """How deeply `obj` nests (a scalar: 0); iterative, stops past MAX_JSON_DEPTH."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, d)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            stack.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def body_shape_problem(raw: bytes) -> tuple[str, str] | None:
    """(param, message) when a JSON body is larger in shape than a request can be, else None
    (a body that does not parse is left to the route, which names what is wrong)."""
    if raw.count(b":") <= MAX_OBJECT_KEYS and raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH:
        return None                     # too few keys and brackets to break either bound: no parse
    try:
        parsed = json.loads(raw, object_pairs_hook=_bounded_object)
    except _TooManyKeys:
        return "body", f"body: an object has more than {MAX_OBJECT_KEYS} keys (MAX_OBJECT_KEYS)"
    except RecursionError:
        return "body", f"body: nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)"
    except ValueError:
        return None
    if _depth(parsed) > MAX_JSON_DEPTH:
        return "body", f"body: nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)"
    return None


def _check_body(raw: bytes) -> tuple[int, str, str, str] | None:
    """(status, param, message, code) for a body refused at the edge, else None."""
    problem = body_text_problem(raw)
    if problem is not None:
        return 400, *problem, "invalid_text"
    problem = body_shape_problem(raw)
    if problem is not None:
        return 413, *problem, "body_too_complex"
    return None


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


def body_text_problem(raw: bytes) -> tuple[str, str] | None:
    """(param, message) when the body's text is unusable, else None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "body", f"body: not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return None          # the route reports malformed JSON itself, naming it
    path = unencodable_field(parsed)
    if path is None:
        return None
    return path, f"{path}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text"


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
                refusal = await asyncio.to_thread(_check_body, raw)
            else:
                refusal = _check_body(raw)
            if refusal is not None:
                status, param, message, code = refusal
                return await send_error(send, status, message, param, code)
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
