"""A body-size limit as plain ASGI middleware: oversize bodies get 413 before parsing."""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await self._refuse(send)
        seen = 0

        async def counted_receive():
            # Chunked bodies carry no length: count as they arrive. FastAPI
            # re-raises HTTPException from body reading, so the error handler
            # answers 413 instead of a generic parse error.
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, f"body: request body exceeds {self.max_bytes} bytes")
            return msg

        await self.app(scope, counted_receive, send)

    async def _refuse(self, send):
        body = json.dumps({"error": {"message": f"body: request body exceeds {self.max_bytes} bytes",
                                     "type": "invalid_request_error", "param": "body", "code": "body_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
