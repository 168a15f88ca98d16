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

import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
from httpx_sse import EventSource

from dreamstage.client.progress import FINAL_STATES, progress_line
from dreamstage.client.wire import (
    ADAPTER_HEADER,
    COMPLETION_PATHS,
    ChatStream,
    Completion,
    DreamstageError,
    auth_headers,
    completion_of,
    feedback_body,
    group_example,
    import_body,
    learn_call,
    raise_server_error,
    request_body,
    rollback_path,
    stream_payloads,
)

# The names users import from here (the module docstring's), beside the two clients.
__all__ = ["ADAPTER_HEADER", "AsyncClient", "ChatStream", "Client", "Completion", "DreamstageError",
           "feedback_body", "group_example", "import_body"]


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", timeout: float | None = 600.0, *,
                 api_key: str | None = None, **httpx_kwargs):
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                 headers=auth_headers(api_key, httpx_kwargs.pop("headers", None)), **httpx_kwargs)

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
        return self._json("POST", rollback_path(name), None, expect=(200, 202))

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
            raise_server_error(r.status_code, r.content, r.headers)
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
            raise_server_error(r.status_code, r.content, r.headers)
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
        return self._json(*learn_call(name, {"mode": mode, "examples": examples, "minutes": minutes}))

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
            raise_server_error(r.status_code, r.content, r.headers)
        return r.json()

    def _call(self, kind, prompt, stream, params):
        body = request_body(kind, prompt, stream, params)
        if not stream:
            r = self._http.post(COMPLETION_PATHS[kind], json=body)
            if r.status_code != 200:
                raise_server_error(r.status_code, r.content, r.headers)
            return completion_of(kind, r.json())
        return self._stream(kind, body)

    def _stream(self, kind, body) -> Iterator[str]:
        state = ChatStream()
        with self._http.stream("POST", COMPLETION_PATHS[kind], json=body) as r:
            if r.status_code != 200:
                r.read()
                raise_server_error(r.status_code, r.content, r.headers)
            for obj in stream_payloads(EventSource(r).iter_sse()):
                piece = state.piece_of(obj, kind)
                if piece:
                    yield piece
        self.last_stream = state


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", timeout: float | None = 600.0, *,
                 api_key: str | None = None, **httpx_kwargs):
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout,
                                 headers=auth_headers(api_key, httpx_kwargs.pop("headers", None)), **httpx_kwargs)

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
        return self._stream("chat", request_body("chat", messages, True, params))

    def complete_stream(self, prompt: str | list[int], **params) -> AsyncIterator[str]:
        return self._stream("completion", request_body("completion", prompt, True, params))

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
        return await self._json("POST", rollback_path(name), {}, expect=(200, 202))

    async def import_adapter(self, name: str, path, *, promote: bool = True) -> dict:
        return await self._json("POST", "/adapters", import_body(name, path, promote), expect=(201,))

    async def export_adapter(self, name: str, version: int, dest, *, format: str = "gguf") -> Path:
        r = await self._http.get(f"/adapters/{name}/versions/{version}", params={"format": format})
        if r.status_code != 200:
            raise_server_error(r.status_code, r.content, r.headers)
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
        return await self._json(*learn_call(name, {"mode": mode, "examples": examples, "minutes": minutes}))

    async def learn(self, name: str) -> dict:
        return await self._json("POST", f"/adapters/{name}/learn", {}, expect=(202,))

    async def _json(self, method: str, path: str, body: dict | None = None, expect: tuple[int, ...] = (200,)) -> dict:
        r = await self._http.request(method, path, json=body) if body is not None \
            else await self._http.request(method, path)
        if r.status_code not in expect:
            raise_server_error(r.status_code, r.content, r.headers)
        return r.json()

    async def _call(self, kind, prompt, params) -> Completion:
        r = await self._http.post(COMPLETION_PATHS[kind], json=request_body(kind, prompt, False, params))
        if r.status_code != 200:
            raise_server_error(r.status_code, r.content, r.headers)
        return completion_of(kind, r.json())

    async def _stream(self, kind, body) -> AsyncIterator[str]:
        state = ChatStream()
        async with self._http.stream("POST", COMPLETION_PATHS[kind], json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise_server_error(r.status_code, r.content, r.headers)
            async for ev in EventSource(r).aiter_sse():
                if ev.data == "[DONE]":
                    break
                piece = state.piece_of(json.loads(ev.data), kind)
                if piece:
                    yield piece
        self.last_stream = state
