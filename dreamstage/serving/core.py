"""The engine's state (its slots, queues and lent sequence) and how a request
ends: the primitives every part of the engine thread shares.

`Engine` (engine.py) is this state plus its parts, one role each: the K/V
pool and the lent sequence (pool.py), intake and admission (admission.py), the
decode batch (batch.py) and embedding requests (embeddings.py).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dreamstage.adapters.choice import BASE, AdapterChoice
from dreamstage.adapters.selection import MixedAdapters
from dreamstage.serving.generation import Delta, Event, Failed, Finished
from dreamstage.serving.resident import ResidentModel
from dreamstage.serving.slots import SequenceLease, _Job, _Slot
from dreamstage.stats import EngineStats

if TYPE_CHECKING:
    from llama_cpp.llama_cpp import llama_batch


class EngineCore:
    """Continuous batching's state over the resident context's sequence slots."""

    def __init__(self, model: ResidentModel, *, max_queue: int, hook: object, idle_interval: float,
                 max_adapters: int, adapter_max_rank: int):
        self.model = model
        self.lc = model.lc
        self.n_seq = model.config.n_seq
        self.n_batch = model.n_batch
        # A request's context budget: prompt + max_tokens <= slot_ctx. With one
        # K/V stream per slot that is the stream's size. With a unified cache
        # (kv_unified) every slot draws on one pool of n_ctx cells and a request
        # may use all of it: admission reserves prompt + max_tokens cells of the
        # pool, so an admitted request can always finish (_make_room).
        self.slot_ctx = self.lc.llama_n_ctx_seq(model.ctx)
        self.pool: int | None = model.n_ctx if model.config.kv_unified else None
        self.max_queue = max_queue
        self.hook = hook
        self.idle_interval = idle_interval
        # Version of the served adapter set; 0 = base model. The dream stage's
        # promotion bumps it between two decode batches (on this thread).
        self.adapter_version = 0
        # Which adapter each batch row decodes with: the base and adapters of rank
        # <= adapter_max_rank share every batch (selection.py).
        self.adapters = MixedAdapters(model, max_adapters, adapter_max_rank)
        self.adapter_limits = (max_adapters, adapter_max_rank)   # a reloaded model's adapters are made again
        self._reconnect_at = 0.0       # when to ask a failed RPC worker again (engine._reconnect)
        # A request that names no adapter gets this one (the served default; the dream stage sets it).
        self.default_adapter: Callable[[], AdapterChoice] = lambda: BASE
        self.stats = EngineStats()
        self._vocab_ids = np.arange(model.n_vocab, dtype=np.int32)   # row index -> token id, for prompt scores
        self.slots = [_Slot(i) for i in range(self.n_seq)]
        self._lease: SequenceLease | None = None   # an idle slot lent to the dream hook
        self._cond = threading.Condition()
        self._inbox: deque[_Job] = deque()     # submitted, not yet tokenized
        self._waiting: deque[_Job] = deque()   # tokenized, waiting for a slot
        self._outstanding = 0                  # submitted and not finished
        self._ids = itertools.count(1)
        self._running = False
        self._thread: threading.Thread | None = None
        self._batch: llama_batch | None = None   # allocated by start()
        # The last decode batch, for the dream stage's pacer: all tokens in it, and
        # how many of them were single decode tokens of generating slots.
        self.last_batch_tokens = 0
        self.last_batch_decode_tokens = 0
        # The engine's own time for that batch (build, decode, sample, stream):
        # the pacer measures chat speed from this, not from gaps between batches.
        self.last_batch_s = 0.0
        # Why the last loop iteration failed (None once a batch decodes again):
        # /health reports an engine that cannot serve instead of "ok".
        self.failing: str | None = None

    def _clear_slot(self, slot: _Slot) -> None:
        self.lc.llama_memory_seq_rm(self.model.memory, slot.seq_id, -1, -1)
        slot.tokens.clear()

    def _send(self, job: _Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a dead consumer (closed loop) cancels its request
            job.handle.cancelled = True

    def _finish_job(self, job: _Job, event: Event, outcome: str) -> None:
        # followers still attached: the group was never admitted, and ends as its leader does
        followers, job.followers = job.followers, []
        for f in [job, *followers]:
            self._send(f, event)
            self.stats.count_request(outcome)
        with self._cond:
            self._outstanding -= 1 + len(followers)

    def _release(self, s: _Slot, reason: str | None, outcome: str | None = None, flush: bool = True) -> None:
        job = s.job
        assert job is not None, "released a free slot"
        if reason is not None and flush and s.stream is not None:
            tail = s.stream.flush()
            if tail:
                self._send(job, Delta(tail, -1))
        if reason is None:
            event: Event = Failed(499, "cancelled")
        else:
            event = Finished(reason, len(job.prompt), s.generated, s.cached, s.adapter_version, s.adapter)
        self._free_slot(s)
        self._finish_job(job, event, outcome or reason or "cancelled")

    def _free_slot(self, s: _Slot) -> None:
        for f in self.slots:
            if f.awaiting is s:           # its leader left before the prompt was decoded: decode it itself
                assert f.job is not None
                f.awaiting, f.pending, f.cached = None, list(f.job.prompt), 0
        if s.sampler is not None:
            s.sampler.free()
        if s.job is not None:
            self.adapters.release(s.job.adapter)
        s.sampler = None
        s.job = None
        s.reserved = 0
        s.used_at = time.perf_counter()
        s.pending = []
        s.next_token = None
        s.stream = None
        # s.tokens stays: the next request may extend this prefix.
