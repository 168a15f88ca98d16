"""The one seam between the engine's batches and the adapters they decode with.

The engine asks, before building a batch, which adapters' slots may join it
(`batch_keys`), and, before `llama_decode`, hands over each batch row's
adapter (`bind`). A decode that is not serving's (the drift probe) goes
between `lend_context()` and `invalidate()`. Nothing is flushed: a slot's
cached prefix is keyed by its adapter.

- `MixedAdapters` (what the engine uses): the base and every adapter of rank
  up to the bank's max_rank decode in ONE batch, each row through its own
  slot of the adapter bank (bank.py); a larger adapter takes its turn in a
  batch of its own, as below.
- `PerBatchAdapters`: one adapter per batch, round-robin across the adapters
  with work, set on the context (llama_set_adapters_lora) between batches.

Engine thread only.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

from dreamstage.adapters.bank import BASE as BANK_BASE
from dreamstage.adapters.bank import AdapterBank, AdapterBankError
from dreamstage.adapters.choice import BASE, DEFAULT_MIXED_MAX_RANK, AdapterChoice
from dreamstage.adapters.files import lora_rank_of
from dreamstage.adapters.loaded import AdapterLoadError, AdaptersFull, LoadedAdapters

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
        return frozenset({_next_turn(sorted(set(with_work)), self._last)}) if with_work else frozenset()

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

    def lend_context(self) -> None:
        """A decode that is not serving's comes next (it sets the context's adapters itself)."""
        self._set = None

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


def _next_turn(keys: list, last):
    """Round-robin: the key after `last` in sorted `keys` (the first when `last` is gone)."""
    if last in keys and len(keys) > 1:
        return keys[(keys.index(last) + 1) % len(keys)]
    return next((k for k in keys if last is None or k > last), keys[0])


_MIXED = ("",)   # the turn of the mixed batch (base and banked adapters), before every wide adapter's


class MixedAdapters:
    """The base and adapters of rank <= max_rank in one batch, through an AdapterBank of
    `capacity` slots; a wider adapter (or one the bank refuses) decodes alone, as
    PerBatchAdapters does, taking turns with the mixed batch."""

    def __init__(self, resident, capacity: int, max_rank: int = DEFAULT_MIXED_MAX_RANK):
        self.bank = AdapterBank(resident, capacity, max_rank=max_rank)
        self.alone = PerBatchAdapters(resident, capacity)
        self._slots: OrderedDict[Key, int] = OrderedDict()   # banked adapters, least recently used first
        self._refs: dict[Key, int] = {}
        self._wide: set[Key] = set()      # decoded alone
        self._armed = False
        self._last_turn: tuple = _MIXED

    def acquire(self, choice: AdapterChoice) -> None:
        """At admission: the request's adapter in a bank slot, or loaded to decode alone
        (AdapterLoadError naming the file, AdaptersFull)."""
        if choice.is_base:
            return
        key = choice.key
        if key not in self._slots and key not in self._wide:
            assert choice.path is not None
            if lora_rank_of(choice.path) > self.bank.max_rank:
                self._wide.add(key)
            else:
                self._make_room()
                try:
                    self._slots[key] = self.bank.load(choice.path, choice.scale)
                except AdapterBankError as e:
                    raise AdapterLoadError(str(e)) from None
        if key in self._wide:
            self.alone.acquire(choice)
            return
        self._slots.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, choice: AdapterChoice) -> None:
        key = choice.key
        if key in self._wide:
            self.alone.release(choice)
        elif key in self._refs:
            self._refs[key] -= 1
            if self._refs[key] <= 0:
                del self._refs[key]

    def _make_room(self) -> None:
        while len(self._slots) >= self.bank.capacity:
            idle = next((k for k in self._slots if not self._refs.get(k)), None)
            if idle is None:
                raise AdaptersFull(f"all {self.bank.capacity} loaded adapters (--max-adapters) are answering requests")
            self._free(idle)

    def _free(self, key: Key) -> None:
        self._disarm()       # the armed rows may name the slot: disarm before it empties
        self.bank.unload(self._slots.pop(key))

    def batch_keys(self, with_work: Sequence[Key]) -> frozenset[Key]:
        """Every key but the wide ones in one batch; each wide key has a turn of its own."""
        keys = set(with_work)
        mixed = {k for k in keys if k not in self._wide}
        turns: list[tuple] = ([_MIXED] if mixed else []) + sorted(k for k in keys if k in self._wide)
        if not turns:
            return frozenset()
        turn = turns[0] if len(turns) == 1 else _next_turn(turns, self._last_turn)
        self._last_turn = turn
        return frozenset(mixed) if turn == _MIXED else frozenset({cast(Key, turn)})

    def bind(self, rows: Sequence[AdapterChoice]) -> None:
        """Before llama_decode: arm the bank with each row's slot, or set a wide adapter alone."""
        if not rows:
            return
        if rows[0].key in self._wide:
            self._disarm()
            self.alone.bind(rows)
            return
        self.alone.bind([BASE])        # the context's own adapters off (a no-op when they are)
        ids = [BANK_BASE if r.is_base else self._slots[r.key] for r in rows]
        if all(i == BANK_BASE for i in ids):
            self._disarm()
            return
        self.bank.set_token_adapters(ids)
        self._armed = True

    def _disarm(self) -> None:
        if self._armed:
            self.bank.set_token_adapters([])
            self._armed = False

    def lend_context(self) -> None:
        """A decode that is not serving's comes next: the bank reads no row of it."""
        self._disarm()
        self.alone.lend_context()

    def invalidate(self) -> None:
        self.alone.invalidate()

    def unload(self, name: str) -> bool:
        """Free `name`'s loaded versions; False (nothing freed) while a request uses one."""
        if any(k[0] == name for k in self._refs) or self.alone.loaded.in_use(name):
            return False
        for key in [k for k in self._slots if k[0] == name]:
            self._free(key)
        self._wide = {k for k in self._wide if k[0] != name}
        return self.alone.unload(name)

    def slot_bytes(self) -> int:
        """Bytes the bank's stacks hold for the loaded adapters."""
        return sum(self.bank.bytes(s) for s in self._slots.values())

    def close(self) -> None:
        self.alone.close()
        self.bank.close()

