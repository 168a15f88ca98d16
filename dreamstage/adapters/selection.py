"""The one seam between the engine's batches and the adapters they decode with.

The engine asks, before building a batch, which adapters' slots may join it
(`batch_keys`), and, before `llama_decode`, hands over each batch row's
adapter (`bind`). Here each batch holds one adapter: `batch_keys` picks one
key, round-robin across the adapters that have work, and `bind` sets that
adapter on the context (llama_set_adapters_lora) when it is not the one set
already. Nothing is flushed: a slot's cached prefix is keyed by its adapter.

A per-token adapter bank replaces this class: `batch_keys` returns every key
(one batch holds them all) and `bind` sets each row's adapter id.

Engine thread only.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

from dreamstage.adapters.choice import AdapterChoice
from dreamstage.adapters.loaded import LoadedAdapters

Key = tuple[str, int, float]


class PerBatchAdapters:
    """One adapter per decode batch, switched on the context between batches."""

    def __init__(self, resident, capacity: int):
        self.resident, self.lc = resident, resident.lc
        self.loaded = LoadedAdapters(resident, capacity, before_free=self._freeing)
        self._set: Key | None = None        # the adapter the context holds now; None: unknown
        self._set_handle = None             # its llama handle (None: the base)
        self._last: Key | None = None       # the adapter the last batch decoded with

    def acquire(self, choice: AdapterChoice) -> None:
        """At admission: make the request's adapter loadable (AdapterLoadError, AdaptersFull)."""
        if not choice.is_base:
            assert choice.path is not None
            self.loaded.acquire(choice.name, choice.version, choice.path)

    def release(self, choice: AdapterChoice) -> None:
        """The request left its slot."""
        if not choice.is_base:
            self.loaded.release(choice.name, choice.version)

    def batch_keys(self, with_work: Sequence[Key]) -> frozenset[Key]:
        """The adapters whose slots the next batch may hold: one, the next after the last in turn."""
        keys = sorted(set(with_work))
        if not keys:
            return frozenset()
        if self._last in keys and len(keys) > 1:
            turn = keys[(keys.index(self._last) + 1) % len(keys)]
        else:
            turn = next((k for k in keys if self._last is None or k > self._last), keys[0])
        return frozenset({turn})

    def bind(self, rows: Sequence[AdapterChoice]) -> None:
        """Before llama_decode: each batch row's adapter (here all rows share one)."""
        if not rows:
            return
        choice = rows[0]
        assert all(r.key == choice.key for r in rows), "a per-batch switch decodes one adapter per batch"
        self._last = choice.key
        if self._set == choice.key:
            return
        lc, ctx = self.lc, self.resident.ctx
        if choice.is_base:
            rc, handle = lc.llama_set_adapters_lora(ctx, None, 0, None), None
        else:
            assert choice.path is not None
            handle = self.loaded.handle(choice.name, choice.version)   # acquired at admission
            arr = (lc.llama_adapter_lora_p_ctypes * 1)(handle)
            scales = (ctypes.c_float * 1)(choice.scale)
            rc = lc.llama_set_adapters_lora(ctx, arr, 1, scales)
        if rc != 0:
            self._set = None
            raise RuntimeError(f"llama_set_adapters_lora failed with {rc}")
        self._set, self._set_handle = choice.key, handle

    def _freeing(self, handle) -> None:
        if handle is not None and handle == self._set_handle:
            self.lc.llama_set_adapters_lora(self.resident.ctx, None, 0, None)
            self._set = self._set_handle = None

    def invalidate(self) -> None:
        """Someone else (a drift probe) set the context's adapters: set ours again at the next bind."""
        self._set = None

    def unload(self, name: str) -> bool:
        """Free `name`'s loaded versions; False (nothing freed) while a request uses one."""
        if self.loaded.in_use(name):
            return False
        self.loaded.unload(name)
        return True

    def close(self) -> None:
        self.loaded.close()
