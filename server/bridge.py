"""Between the asyncio event loop and the engine thread.

The engine calls a request's sink on its own thread; the sink hands each event
to the event loop with call_soon_threadsafe, so route code awaits events from
an asyncio.Queue and never touches llama.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from dreamstage.server.errors import APIError
from dreamstage.serving.engine import (
    Admitted,
    Delta,
    Engine,
    EngineStopped,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
)

# How often a waiting request checks whether its client went away.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


class EngineRequest:
    def __init__(self, engine: Engine, request: GenerationRequest, retry_after_s: int = 1):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(self.events.put_nowait, ev)

        try:
            self.handle = engine.submit(request, sink)
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", None, "queue_full",
                           {"Retry-After": str(retry_after_s)}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), None, "engine_stopped", {"Retry-After": str(retry_after_s)}) from None
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens") from None

    async def next(self, disconnected: Callable[[], Awaitable[bool]] | None = None) -> Event:
        """The next event; with `disconnected`, cancels and raises ClientGone once the client has left."""
        while True:
            if disconnected is None:
                return await self.events.get()
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await disconnected():
                    self.handle.cancel()
                    raise ClientGone() from None

    async def admitted(self, disconnected) -> Admitted:
        """Wait for a slot; a refusal becomes an APIError with the engine's status."""
        ev = await self.next(disconnected)
        if isinstance(ev, Failed):
            raise APIError(ev.status, ev.message, ev.param)
        assert isinstance(ev, Admitted), ev
        return ev

    async def collect(self, disconnected) -> tuple[str, Finished]:
        parts: list[str] = []
        while True:
            ev = await self.next(disconnected)
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Finished):
                return "".join(parts), ev
            elif isinstance(ev, Failed):
                raise APIError(ev.status, ev.message, ev.param)

    def cancel(self) -> None:
        self.handle.cancel()
