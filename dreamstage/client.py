"""A small Python client for a dreamstage server, sync and async, on httpx.

    from dreamstage.client import Client
    with Client("http://127.0.0.1:8080") as c:
        r = c.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        print(r.text, r.adapter_version)
        for piece in c.chat([{"role": "user", "content": "Hi"}], stream=True):
            print(piece, end="", flush=True)

After a stream ends, `client.last_stream` holds its finish_reason,
adapter_version and usage. Training: `train(examples, **fields)` posts a job,
`train_state(id)` reads its receipts, `wait(id)` polls with a progress bar,
`adapters()`, `promote(name)` and `rollback()` manage what serves. Errors come back as DreamstageError with the
server's status, message and the field it names.

Weighted replies to one prompt train as one shared-prefix group:

    c.train([group_example(prompt="Q: 2+2?\nA:", completions=[(" 4", 1.0), (" 5", -0.5)])])

`train_state(id)["progress"]["groups"]` then gives each group's per-reply losses.
"""
from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from httpx_sse import EventSource

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


def _payloads(events) -> Iterator[dict]:
    """The JSON objects of an OpenAI-style token stream (httpx-sse parses the SSE framing)."""
    for ev in events:
        if ev.data == "[DONE]":
            return
        yield json.loads(ev.data)


_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}

FINAL_STATES = frozenset({"done", "cancelled", "refused", "error", "interrupted"})


def progress_fraction(job: dict) -> tuple[int, int]:
    """(windows done, windows in all) over every epoch."""
    p = job.get("progress") or {}
    windows, epochs = p.get("windows") or 0, p.get("epochs") or 1
    total = windows * epochs
    done = min(total, (p.get("epoch") or 0) * windows + (p.get("window_in_epoch") or 0)) if total else 0
    if job.get("state") == "done":
        done = total
    return done, total


def eta_s(job: dict) -> float | None:
    """Seconds left at the rate so far (windows per second since the job started).

    Both ends are the server's clock (`started`, `updated`), so a client on
    another machine gets no skew; None before the first window or after the end."""
    done, total = progress_fraction(job)
    started, updated = job.get("started"), job.get("updated")
    if job.get("state") != "running" or not started or not updated or not 0 < done < total:
        return None
    return (updated - started) / done * (total - done)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(job: dict, width: int = 24) -> str:
    """One line for a job: a bar over epochs x windows, then state, step, loss, tok/s and ETA."""
    p = job.get("progress") or {}
    epochs = p.get("epochs") or 1
    done, total = progress_fraction(job)
    frac = done / total if total else 0.0
    bar = "#" * round(frac * width) + "." * (width - round(frac * width))
    loss = p.get("loss_avg")
    parts = [f"job {job.get('id')} [{bar}] {frac:4.0%}", job.get("state", "?"),
             f"step {p.get('step', 0)}", f"epoch {min((p.get('epoch') or 0) + 1, epochs)}/{epochs}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if p.get("eval_loss") is not None:
        parts.append(f"eval {p['eval_loss']:.3f}")
    if p.get("train_tok_s") is not None:
        parts.append(f"{p['train_tok_s']:.1f} tok/s")
    eta = eta_s(job)
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    if p.get("horizon") is not None:
        parts.append(f"exact horizon {p['horizon'] or 'all'}")
    if p.get("refusals"):
        parts.append(f"refusals {p['refusals']}")
    return "  ".join(parts)


def _auth_headers(api_key: str | None, headers=None) -> dict:
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


def _learn_call(name: str, settings: dict) -> tuple[str, str, dict | None]:
    """GET an adapter's learning, or PUT the settings given (mode, examples, minutes)."""
    given = {k: v for k, v in settings.items() if v is not None}
    return ("PUT", f"/adapters/{name}/learn", given) if given else ("GET", f"/adapters/{name}/learn", None)


def _rollback_path(name: str | None) -> str:
    return "/adapters/rollback" if name is None else f"/adapters/{name}/rollback"


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", timeout: float | None = 600.0, *,
                 api_key: str | None = None, **httpx_kwargs):
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                 headers=_auth_headers(api_key, httpx_kwargs.pop("headers", None)), **httpx_kwargs)

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

    def metrics(self) -> str:
        """/metrics, Prometheus' text format."""
        r = self._http.get("/metrics")
        r.raise_for_status()
        return r.text

    # -- training: POST /train, job receipts, adapters ------------------------------
    def train(self, examples: list[dict] | None = None, *, text: str | None = None, **fields) -> dict:
        """Submit a training job (the POST /train body's fields as keywords); returns the job (state queued).
        A keyword given as None is sent as null, which some fields mean (stop_loss=None: train every
        epoch; max_drift_kl=None: drift_kl not bounded); leave a field out for its default."""
        body = dict(fields)
        if examples is not None:
            body["examples"] = examples
        if text is not None:
            body["text"] = text
        return self._json("POST", "/train", body, expect=(202,))

    def train_state(self, job_id: int) -> dict:
        """One job: state, progress, memory, pacing, adapter, refusals."""
        return self._json("GET", f"/train/{job_id}")

    def train_receipts(self, job_id: int, after: int = 0) -> list[dict]:
        """A job's micro-step receipts in order (those after seq `after`)."""
        return self._json("GET", f"/train/{job_id}/receipts?after={int(after)}")["receipts"]

    def train_overview(self) -> dict:
        """The job training now (or None) and the queue."""
        return self._json("GET", "/train")

    def cancel(self, job_id: int) -> dict:
        return self._json("POST", f"/train/{job_id}/cancel")

    def pause(self, job_id: int) -> dict:
        return self._json("POST", f"/train/{job_id}/pause")

    def resume(self, job_id: int) -> dict:
        return self._json("POST", f"/train/{job_id}/resume")

    def wait(self, job_id: int, *, poll_s: float = 0.5, timeout: float | None = None, progress: bool = True,
             out=None) -> dict:
        """Poll until the job reaches a final state; returns it. With `progress`, a bar on stderr."""
        out = out if out is not None else sys.stderr
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = 0
        while True:
            job = self.train_state(job_id)
            if progress:
                line = progress_line(job)
                out.write("\r" + line.ljust(shown))      # blank what a longer previous line left
                out.flush()
                shown = max(shown, len(line))
            if job["state"] in FINAL_STATES:
                if progress:
                    out.write("\n")
                    out.flush()
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout} s")
            time.sleep(poll_s)

    def adapters(self) -> dict:
        """Saved adapters, the served one and the promotion stack."""
        return self._json("GET", "/adapters")

    def promote(self, name: str, version: int | None = None) -> dict:
        """Serve adapter `name` (its latest version by default) from the next batch on."""
        body = {} if version is None else {"version": version}
        return self._json("POST", f"/adapters/{name}/promote", body, expect=(200, 202))

    def rollback(self, name: str | None = None) -> dict:
        """Undo the latest promotion of `name` (None: of any name, what requests naming no adapter get)."""
        return self._json("POST", _rollback_path(name), None, expect=(200, 202))

    def adapter(self, name: str) -> dict:
        """One adapter name: its served version, promotions and stored versions."""
        return self._json("GET", f"/adapters/{name}")

    def import_adapter(self, name: str, path, *, promote: bool = True) -> dict:
        """Import a local GGUF LoRA file, or a PEFT folder (adapter_config.json +
        adapter_model.safetensors), as a new version of `name` (served unless promote=False)."""
        return self._json("POST", "/adapters", import_body(name, path, promote), expect=(201,))

    def export_adapter(self, name: str, version: int, dest, *, format: str = "gguf") -> Path:
        """Download a version to `dest`: the GGUF, or (format="peft") a zip of the PEFT files."""
        r = self._http.get(f"/adapters/{name}/versions/{version}", params={"format": format})
        if r.status_code != 200:
            _raise_for(r.status_code, r.content, r.headers)
        Path(dest).write_bytes(r.content)
        return Path(dest)

    def remove_adapter(self, name: str) -> dict:
        """Unload `name` (DELETE /adapters/{name}): it serves nothing; its versions stay stored."""
        return self._json("DELETE", f"/adapters/{name}")

    def feedback(self, id: str | None = None, **fields) -> dict:
        """Feedback on a recorded answer (serve --record): `correction=`, `rating=` (with `index=` for a
        choice), or `preferred=`/`rejected=` (feedback_body). Returns the stored item and the pending count."""
        return self._json("POST", "/v1/feedback", feedback_body(id, **fields))

    def records(self, adapter: str | None = None, limit: int = 100) -> list[dict]:
        """The newest recorded answers (of `adapter`; "base": the base model's)."""
        params = {"limit": str(limit), **({"adapter": adapter} if adapter else {})}
        r = self._http.get("/v1/records", params=params)
        if r.status_code != 200:
            _raise_for(r.status_code, r.content, r.headers)
        return r.json()["data"]

    def record(self, id: str) -> list[dict]:
        """Every recorded choice of completion `id`."""
        return self._json("GET", f"/v1/records/{id}")["data"]

    def delete_record(self, id: str) -> dict:
        return self._json("DELETE", f"/v1/records/{id}")

    def delete_records(self, adapter: str) -> dict:
        """Delete every record of `adapter`'s answers."""
        return self._json("DELETE", f"/adapters/{adapter}/records")

    def learning(self, name: str, *, mode: str | None = None, examples: int | None = None,
                 minutes: float | None = None) -> dict:
        """`name`'s learning from feedback and its pending count; with settings, change them first."""
        return self._json(*_learn_call(name, {"mode": mode, "examples": examples, "minutes": minutes}))

    def learn(self, name: str) -> dict:
        """A job of `name`'s pending feedback, now (202; 409 when none is pending)."""
        return self._json("POST", f"/adapters/{name}/learn", None, expect=(202,))

    def _json(self, method: str, path: str, body: dict | None = None, expect: tuple[int, ...] = (200,)) -> dict:
        # A state change without a body still says application/json: the server
        # refuses body-less POSTs without it (or the key), as a cross-site guard.
        if body is None and method == "POST":
            r = self._http.request(method, path, headers={"Content-Type": "application/json"})
        else:
            r = self._http.request(method, path, json=body) if body is not None else self._http.request(method, path)
        if r.status_code not in expect:
            _raise_for(r.status_code, r.content, r.headers)
        return r.json()

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
            for obj in _payloads(EventSource(r).iter_sse()):
                piece = state._piece(obj, kind)
                if piece:
                    yield piece
        self.last_stream = state


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", timeout: float | None = 600.0, *,
                 api_key: str | None = None, **httpx_kwargs):
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout,
                                 headers=_auth_headers(api_key, httpx_kwargs.pop("headers", None)), **httpx_kwargs)

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

    async def adapters(self) -> dict:
        return await self._json("GET", "/adapters")

    async def adapter(self, name: str) -> dict:
        return await self._json("GET", f"/adapters/{name}")

    async def promote(self, name: str, version: int | None = None) -> dict:
        body = {} if version is None else {"version": version}
        return await self._json("POST", f"/adapters/{name}/promote", body, expect=(200, 202))

    async def rollback(self, name: str | None = None) -> dict:
        return await self._json("POST", _rollback_path(name), {}, expect=(200, 202))

    async def import_adapter(self, name: str, path, *, promote: bool = True) -> dict:
        return await self._json("POST", "/adapters", import_body(name, path, promote), expect=(201,))

    async def export_adapter(self, name: str, version: int, dest, *, format: str = "gguf") -> Path:
        r = await self._http.get(f"/adapters/{name}/versions/{version}", params={"format": format})
        if r.status_code != 200:
            _raise_for(r.status_code, r.content, r.headers)
        Path(dest).write_bytes(r.content)
        return Path(dest)

    async def remove_adapter(self, name: str) -> dict:
        return await self._json("DELETE", f"/adapters/{name}")

    async def feedback(self, id: str | None = None, **fields) -> dict:
        return await self._json("POST", "/v1/feedback", feedback_body(id, **fields))

    async def record(self, id: str) -> list[dict]:
        return (await self._json("GET", f"/v1/records/{id}"))["data"]

    async def delete_record(self, id: str) -> dict:
        return await self._json("DELETE", f"/v1/records/{id}")

    async def learning(self, name: str, *, mode: str | None = None, examples: int | None = None,
                       minutes: float | None = None) -> dict:
        return await self._json(*_learn_call(name, {"mode": mode, "examples": examples, "minutes": minutes}))

    async def learn(self, name: str) -> dict:
        return await self._json("POST", f"/adapters/{name}/learn", {}, expect=(202,))

    async def _json(self, method: str, path: str, body: dict | None = None, expect: tuple[int, ...] = (200,)) -> dict:
        r = await self._http.request(method, path, json=body) if body is not None \
            else await self._http.request(method, path)
        if r.status_code not in expect:
            _raise_for(r.status_code, r.content, r.headers)
        return r.json()

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
            async for ev in EventSource(r).aiter_sse():
                if ev.data == "[DONE]":
                    break
                piece = state._piece(json.loads(ev.data), kind)
                if piece:
                    yield piece
        self.last_stream = state
