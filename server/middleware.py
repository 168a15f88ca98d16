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


def _check_body(raw: bytes) -> tuple[int, str, str, str] | None:
    """(status, param, message, code) for a body refused at the edge, else None.
    The shape first: the text check may parse the body, which a hostile shape must never reach."""
    problem = body_shape_problem(raw)
    if problem is not None:
        return 413, *problem, "body_too_complex"
    problem = body_text_problem(raw)
    if problem is not None:
        return 400, *problem, "invalid_text"
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
