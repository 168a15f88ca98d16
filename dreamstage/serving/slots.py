"""The engine's records of a request and of a sequence slot, and the handles it
gives out: a request's (cancel) and a lent idle sequence's (the dream hook's).

Data and small handles only: the engine thread (engine.py and its parts) is
the one that changes them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from dreamstage.adapters.choice import BASE, AdapterChoice
from dreamstage.serving.generation import GenerationRequest, Sink, TextStream
from dreamstage.serving.sampling import Sampler, TokenLogprob


class _Wakes(Protocol):
    def wake(self) -> None: ...


class _Lends(Protocol):
    _lease: SequenceLease | None

    def _reserve_lease(self, lease: SequenceLease, cells: int, keep: int = 0) -> bool: ...

    def _end_lease(self) -> None: ...


class RequestHandle:
    """What `submit` returns: an id and a way to cancel."""

    def __init__(self, engine: _Wakes, rid: int):
        self._engine = engine
        self.id = rid
        self.cancelled = False

    def cancel(self) -> None:
        """Free the request's slot at the next loop iteration (idempotent, any thread)."""
        if not self.cancelled:
            self.cancelled = True
            self._engine.wake()


@dataclass
class _Job:
    handle: RequestHandle
    request: GenerationRequest
    sink: Sink
    submitted: float
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    adapter: AdapterChoice = BASE     # resolved at intake (the request's, else the engine's default)
    # The other choices of an n > 1 request: admitted with this job, they share
    # its prompt's K/V (copied once it is decoded). Emptied at admission.
    followers: list[_Job] = field(default_factory=list)


class _Slot:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.tokens: list[int] = []   # tokens whose K/V this sequence holds, in order
        self.job: _Job | None = None
        self.sampler: Sampler | None = None   # sampler chain of the active request
        self.prompt_scores: list[TokenLogprob | None] = []   # with prompt_logprobs, filled during prefill
        self.pending: list[int] = []  # prompt tokens still to decode
        self.next_token: int | None = None  # sampled, not yet decoded
        self.generated = 0
        self.cached = 0
        self.stream: TextStream | None = None
        self.awaiting: _Slot | None = None   # a follower waiting for this slot's leader to finish its prompt
        self.adapter_version: int | None = 0
        self.adapter: AdapterChoice = BASE   # what `tokens`' K/V were computed with (and the job's while busy)
        # Unified pool: the cells the busy request may hold at most (prompt + max_tokens); 0 while idle.
        self.reserved = 0
        self.used_at = 0.0   # when the slot last finished or took a request: idle prefixes go least recent first
        self.t_last: float = 0.0
        self.first_token_at: float | None = None

    @property
    def busy(self) -> bool:
        return self.job is not None

    def seat(self, job: _Job, sampler: Sampler, n_common: int) -> None:
        """This slot's fields for `job`, keeping the first n_common cached prompt tokens
        (the caller drops the rest of the sequence's K/V)."""
        del self.tokens[n_common:]
        self.job, self.sampler = job, sampler
        self.prompt_scores = [None]
        self.pending = job.prompt[n_common:]
        self.next_token = None
        self.generated = 0
        self.cached = n_common
        self.stream = TextStream(job.request.stop)
        self.adapter = job.adapter
        self.adapter_version = job.adapter.served_version
        self.first_token_at = None
        self.awaiting = None
        self.reserved = len(job.prompt) + job.max_tokens
        self.used_at = time.perf_counter()


class SequenceLease:
    """An idle slot's sequence lent to the dream hook (Engine.hold_idle_sequence).
    `valid` turns False when the loan ends: the borrower's `release()`, or
    serving taking the slot back. Either way the sequence is cleared."""

    def __init__(self, engine: _Lends, slot: _Slot):
        self.engine, self.slot, self.valid = engine, slot, True
        self.cells = 0     # unified pool: the room held for the borrower's decodes (reserve)

    @property
    def seq_id(self) -> int:
        return self.slot.seq_id

    def reserve(self, cells: int, keep: int = 0) -> bool:
        """Engine thread only: clear the sequence from position `keep` on (the
        borrower's own decodes before it stay) and hold room for decodes of
        positions 0 .. cells-1 on it, before the borrower starts a run of them.
        False while a unified pool has no such room (ask again at a later step);
        always True with one K/V stream per slot. Raises ValueError when `cells`
        exceeds the context, which no room could hold."""
        return self.valid and self.engine._reserve_lease(self, cells, keep)

    def release(self) -> None:
        if self.valid and self.engine._lease is self:
            self.engine._end_lease()
        self.valid = False
