"""Between the asyncio event loop and the engine thread.

The engine calls a request's sink on its own thread; the sink hands each event
to the event loop with call_soon_threadsafe, so route code awaits events from
an asyncio.Queue and never touches llama.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dreamstage.server.errors import APIError
from dreamstage.serving.engine import (
    Admitted,
    Delta,
    Embedded,
    Engine,
    EngineStopped,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    PromptScored,
    QueueFull,
)
from dreamstage.serving.sampling import TokenLogprob

# How often a waiting request checks whether its client went away.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


@dataclass(frozen=True)
class Collected:
    """A whole answer: its text, how it ended, each token's logprob (when asked) and the prompt's."""
    text: str
    finished: Finished
    logprobs: list[TokenLogprob]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None


class EngineRequest:
    """The choices of one HTTP request, submitted to the engine as groups: one group of n
    choices (1 unless asked) per prompt, each group's prompt decoded once. Their events
    arrive tagged with the choice's index, counted across the groups in order."""

    def __init__(self, engine: Engine, groups: list[list[GenerationRequest]], retry_after_s: int = 1):
        loop = asyncio.get_running_loop()
        self.n = sum(len(g) for g in groups)
        self.first_group = len(groups[0])
        self.starts = (0, *itertools.accumulate(len(g) for g in groups[:-1]))   # each group's first choice
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._early: deque[tuple[int, Event]] = deque()    # read while waiting for the admission, not yet returned

        def sink_for(i: int):
            def sink(ev: Event) -> None:
                loop.call_soon_threadsafe(self.events.put_nowait, (i, ev))
            return sink

        self.handles: list = []
        try:
            for group in groups:
                at = len(self.handles)
                self.handles += engine.submit_group(group, [sink_for(at + i) for i in range(len(group))])
        except QueueFull as e:
            self.cancel()
            raise APIError(503, f"server busy: {e}; retry later", None, "queue_full",
                           {"Retry-After": str(retry_after_s)}) from None
        except EngineStopped as e:
            self.cancel()
            raise APIError(503, str(e), None, "engine_stopped", {"Retry-After": str(retry_after_s)}) from None
        except ValueError as e:
            self.cancel()
            raise APIError(400, str(e), "n" if str(e).startswith("n:") else "max_tokens") from None

    async def next(self, disconnected: Callable[[], Awaitable[bool]] | None = None) -> tuple[int, Event]:
        """The next (choice, event); with `disconnected`, cancels and raises ClientGone once the client has left."""
        if self._early:
            return self._early.popleft()
        while True:
            if disconnected is None:
                return await self.events.get()
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await disconnected():
                    self.cancel()
                    raise ClientGone() from None

    async def admitted(self, disconnected) -> Admitted:
        """Wait until every choice of the first group holds a slot (a group is admitted together;
        later groups wait for slots, and their events are kept for next()); a refusal becomes an
        APIError with the engine's status. Returns the first choice's admission."""
        first: Admitted | None = None
        waiting, early = self.first_group, []
        while waiting:
            i, ev = await self.next(disconnected)
            if isinstance(ev, Failed):
                self.cancel()
                raise APIError(ev.status, ev.message, ev.param)
            if isinstance(ev, Admitted) and i < self.first_group:
                first = first or ev
                waiting -= 1
            else:
                early.append((i, ev))
        self._early.extend(early)
        assert first is not None
        return first

    async def collect(self, disconnected) -> list[Collected]:
        """Every choice's events up to its end, gathered; a failure becomes an APIError."""
        parts: list[list[str]] = [[] for _ in range(self.n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.n)]
        prompt: list[tuple[TokenLogprob | None, ...] | None] = [None] * self.n
        done: dict[int, Finished] = {}
        while len(done) < self.n:
            i, ev = await self.next(disconnected)
            if isinstance(ev, Delta):
                parts[i].append(ev.text)
                if ev.logprob is not None:
                    logprobs[i].append(ev.logprob)
            elif isinstance(ev, PromptScored):
                prompt[i] = ev.logprobs
            elif isinstance(ev, Finished):
                done[i] = ev
            elif isinstance(ev, Failed):
                self.cancel()                           # the other prompts' choices too
                raise APIError(ev.status, ev.message, ev.param)
        return [Collected("".join(parts[i]), done[i], logprobs[i], prompt[i]) for i in range(self.n)]

    async def embedded(self, disconnected) -> Embedded:
        """The single choice's embedding; a failure becomes an APIError."""
        while True:
            _, ev = await self.next(disconnected)
            if isinstance(ev, Embedded):
                return ev
            if isinstance(ev, Failed):
                raise APIError(ev.status, ev.message, ev.param)

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()
