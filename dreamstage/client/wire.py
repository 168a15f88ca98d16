"""What the Python client sends and reads: request bodies, replies, errors and
token streams of the dreamstage server's HTTP API (no connection of its own).
"""
from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ADAPTER_HEADER = "X-Dreamstage-Adapter-Version"


def group_example(*, prompt: str | None = None, messages: list[dict] | None = None,
                  completions: list, tools: list[dict] | None = None) -> dict:
    """A group example for `train`: one prompt (text or chat messages) and its
    completions, each a string (weight 1), a (text, weight) pair, or a dict
    `{text | message, weight}` as POST /train takes it."""
    out: dict = {"prompt": prompt} if prompt is not None else {"messages": messages}
    if tools is not None:
        out["tools"] = tools
    out["completions"] = [{"text": c[0], "weight": float(c[1])} if isinstance(c, tuple) else c for c in completions]
    return out


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

    def piece_of(self, obj: dict, kind: str) -> str:
        """The text piece of one stream payload; notes its finish_reason, adapter_version and usage."""
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


def request_body(kind: str, prompt, stream: bool, params: dict) -> dict:
    body = {"messages": prompt} if kind == "chat" else {"prompt": prompt}
    body.update({k: v for k, v in params.items() if v is not None})
    body["stream"] = stream
    return body


def raise_server_error(resp_status: int, content: bytes, headers) -> None:
    try:
        err = json.loads(content)["error"]
        msg, param = err.get("message", ""), err.get("param")
    except (ValueError, KeyError, TypeError):
        msg, param = content.decode("utf-8", "replace")[:500], None
    raise DreamstageError(resp_status, msg, param, headers.get("retry-after"))


def completion_of(kind: str, obj: dict) -> Completion:
    ch = obj["choices"][0]
    text = ch["message"]["content"] if kind == "chat" else ch["text"]
    return Completion(text, ch.get("finish_reason"), obj.get("adapter_version", 0), obj.get("usage", {}), obj)


def stream_payloads(events) -> Iterator[dict]:
    """The JSON objects of an OpenAI-style token stream (httpx-sse parses the SSE framing)."""
    for ev in events:
        if ev.data == "[DONE]":
            return
        yield json.loads(ev.data)


COMPLETION_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def auth_headers(api_key: str | None, headers=None) -> dict:
    out = dict(headers or {})
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def import_body(name: str, path, promote: bool = True) -> dict:
    """POST /adapters' body for a local GGUF file or PEFT folder (sent inline, base64)."""
    path = Path(path)
    if path.is_dir():
        return {"name": name, "promote": promote,
                "peft": {"config": json.loads((path / "adapter_config.json").read_text()),
                         "safetensors": base64.b64encode((path / "adapter_model.safetensors").read_bytes()).decode()}}
    return {"name": name, "promote": promote, "gguf": base64.b64encode(path.read_bytes()).decode()}


def feedback_body(id: str | None = None, *, index: int = 0, correction: str | None = None,
                  rating: float | None = None, preferred: str | dict | None = None,
                  rejected: str | dict | None = None) -> dict:
    """POST /v1/feedback's body: on answer `id` (choice `index`) a `correction` or a `rating`, or a preference
    between two answers (`preferred`, `rejected`: an id, or {"id", "index"}); the server checks the rest."""
    given = {"id": id, "correction": correction, "rating": rating, "preferred": preferred, "rejected": rejected}
    body = {k: v for k, v in given.items() if v is not None}
    if index:
        body["index"] = index
    return body


def learn_call(name: str, settings: dict) -> tuple[str, str, dict | None]:
    """GET an adapter's learning, or PUT the settings given (mode, examples, minutes)."""
    given = {k: v for k, v in settings.items() if v is not None}
    return ("PUT", f"/adapters/{name}/learn", given) if given else ("GET", f"/adapters/{name}/learn", None)


def rollback_path(name: str | None) -> str:
    return "/adapters/rollback" if name is None else f"/adapters/{name}/rollback"

