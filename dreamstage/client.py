"""A small Python client for a dreamstage server, sync and async, on httpx.

    from dreamstage.client import Client
    with Client("http://127.0.0.1:8080") as c:
        r = c.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        print(r.text, r.adapter_version)
        for piece in c.chat([{"role": "user", "content": "Hi"}], stream=True):
            print(piece, end="", flush=True)

After a stream ends, `client.last_stream` holds its finish_reason,
adapter_version and usage. Errors come back as DreamstageError with the
server's status, message and the field it names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import httpx

ADAPTER_HEADER = "X-Dreamstage-Adapter-Version"


class DreamstageError(RuntimeError):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    adapter_version: int
    usage: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)


class ChatStream:
    """Iterates text pieces; after the end, finish_reason and adapter_version are set."""

    def __init__(self):
        self.finish_reason: str | None = None
        self.adapter_version: int | None = None
        self.usage: dict = {}

    def _piece(self, obj: dict, kind: str) -> str:
        if "error" in obj:
            err = obj["error"]
            raise DreamstageError(500, err.get("message", "stream failed"), err.get("param"))
        self.adapter_version = obj.get("adapter_version", self.adapter_version)
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices") or []
        if not choices:
            return ""
        ch = choices[0]
        if ch.get("finish_reason"):
            self.finish_reason = ch["finish_reason"]
        if kind == "chat":
            return (ch.get("delta") or {}).get("content") or ""
        return ch.get("text") or ""


def _body(kind: str, prompt, stream: bool, params: dict) -> dict:
    body = {"messages": prompt} if kind == "chat" else {"prompt": prompt}
    body.update({k: v for k, v in params.items() if v is not None})
    body["stream"] = stream
    return body


def _raise_for(resp_status: int, content: bytes, headers) -> None:
    try:
        err = json.loads(content)["error"]
        msg, param = err.get("message", ""), err.get("param")
    except (ValueError, KeyError, TypeError):
        msg, param = content.decode("utf-8", "replace")[:500], None
    raise DreamstageError(resp_status, msg, param, headers.get("retry-after"))


def _completion(kind: str, obj: dict) -> Completion:
    ch = obj["choices"][0]
    text = ch["message"]["content"] if kind == "chat" else ch["text"]
    return Completion(text, ch.get("finish_reason"), obj.get("adapter_version", 0), obj.get("usage", {}), obj)


def _sse_payloads(lines) -> Iterator[dict]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", timeout: float | None = 600.0, **httpx_kwargs):
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, **httpx_kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def chat(self, messages: list[dict], *, stream: bool = False, **params):
        """Completion (stream=False) or a ChatStream-backed iterator of text pieces (stream=True)."""
        return self._call("chat", messages, stream, params)

    def complete(self, prompt: str | list[int], *, stream: bool = False, **params):
        return self._call("completion", prompt, stream, params)

    def health(self) -> dict:
        return self._http.get("/health").json()

    def _call(self, kind, prompt, stream, params):
        body = _body(kind, prompt, stream, params)
        if not stream:
            r = self._http.post(_PATHS[kind], json=body)
            if r.status_code != 200:
                _raise_for(r.status_code, r.content, r.headers)
            return _completion(kind, r.json())
        return self._stream(kind, body)

    def _stream(self, kind, body) -> Iterator[str]:
        state = ChatStream()
        with self._http.stream("POST", _PATHS[kind], json=body) as r:
            if r.status_code != 200:
                r.read()
                _raise_for(r.status_code, r.content, r.headers)
            for obj in _sse_payloads(r.iter_lines()):
                piece = state._piece(obj, kind)
                if piece:
                    yield piece
        self.last_stream = state


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", timeout: float | None = 600.0, **httpx_kwargs):
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, **httpx_kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def chat(self, messages: list[dict], **params) -> Completion:
        return await self._call("chat", messages, params)

    async def complete(self, prompt: str | list[int], **params) -> Completion:
        return await self._call("completion", prompt, params)

    def chat_stream(self, messages: list[dict], **params) -> AsyncIterator[str]:
        return self._stream("chat", _body("chat", messages, True, params))

    def complete_stream(self, prompt: str | list[int], **params) -> AsyncIterator[str]:
        return self._stream("completion", _body("completion", prompt, True, params))

    async def health(self) -> dict:
        return (await self._http.get("/health")).json()

    async def _call(self, kind, prompt, params) -> Completion:
        r = await self._http.post(_PATHS[kind], json=_body(kind, prompt, False, params))
        if r.status_code != 200:
            _raise_for(r.status_code, r.content, r.headers)
        return _completion(kind, r.json())

    async def _stream(self, kind, body) -> AsyncIterator[str]:
        state = ChatStream()
        async with self._http.stream("POST", _PATHS[kind], json=body) as r:
            if r.status_code != 200:
                await r.aread()
                _raise_for(r.status_code, r.content, r.headers)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                piece = state._piece(json.loads(data), kind)
                if piece:
                    yield piece
        self.last_stream = state
