"""The engine's K/V cells: cached prefixes, the unified pool's accounting, and
the idle sequence lent to the dream hook (engine thread only).

With one K/V stream per slot there is nothing to account: every request fits
its slot. With a unified pool (kv_unified) each busy slot reserves prompt +
max_tokens cells, each idle slot's cached prefix holds its tokens, and the
lease holds the room its borrower reserved; `_make_room` frees the last two
for a request that needs them.
"""
from __future__ import annotations

from dreamstage.serving.core import EngineCore
from dreamstage.serving.slots import SequenceLease, _Slot


class PoolMixin(EngineCore):
    def forget_cached_prefixes(self) -> int:
        """Engine thread only: drop every idle slot's cached prefix, so no later
        request reuses it. An adapter swap calls this: those K/V were computed
        with the old weights. Returns the number of slots cleared."""
        cleared = 0
        for s in self.slots:
            if not s.busy and s.tokens:
                self._clear_slot(s)
                cleared += 1
        return cleared

    def hold_idle_sequence(self) -> SequenceLease | None:
        """Engine thread only (the dream hook): lend an idle slot's sequence for
        decodes of the hook's own (the drift probe) that span several hook
        calls; None when every slot is busy. The slot's cached prefix is
        dropped first (the borrower's decodes overwrite it). The loan ends with
        `release()`, or when serving needs the slot: `_admit` takes a lent slot
        only when no other is free, clears it, and marks the lease invalid, so
        a request never waits for the borrower. One lease at a time: asking
        again while it is valid returns the same lease. With a unified pool the
        borrower calls `lease.reserve(cells)` before each run of decodes: the
        lease holds that room, and admission ends the loan before a request waits."""
        if self._lease is not None and self._lease.valid:
            return self._lease
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        slot = min(idle, key=lambda s: len(s.tokens))   # the smallest cached prefix is the cheapest to lose
        self._clear_slot(slot)
        self._lease = SequenceLease(self, slot)
        return self._lease

    def pool_info(self) -> dict | None:
        """The unified pool's cells (/slots): None with one K/V stream per slot."""
        if self.pool is None:
            return None
        lease = self._lease.cells if self._lease is not None and self._lease.valid else 0
        reserved = sum(s.reserved for s in self.slots if s.busy)
        cached = sum(len(s.tokens) for s in self.slots if not s.busy)
        return {"cells": self.pool, "reserved": reserved, "cached": cached, "lent": lease,
                "free": self.pool - reserved - cached - lease, "evicted_prefixes": self.stats.evicted_prefixes}

    def _pool_demand(self, skip: tuple[_Slot, ...] = ()) -> int:
        """Cells of the unified pool spoken for: each busy slot's reservation, each idle
        slot's cached prefix (a prefix copied to n > 1 choices counts once per slot:
        never less than llama.cpp holds), the lease's room; `skip`'s slots left out."""
        lease = self._lease.cells if self._lease is not None and self._lease.valid else 0
        return lease + sum(s.reserved if s.busy else len(s.tokens) for s in self.slots if s not in skip)

    def _make_room(self, need: int, skip: tuple[_Slot, ...], take_lease: bool) -> bool:
        """Unified pool: True when `need` cells fit beside what is spoken for, after ending
        the lease (take_lease) and evicting idle slots' cached prefixes, least recently used
        first, as far as that takes. Nothing is taken when even all of it would not make the
        room: the request waits for busy slots to finish, and the prefixes stay."""
        assert self.pool is not None
        free = self.pool - self._pool_demand(skip)
        if need <= free:
            return True
        lease = self._lease if take_lease and self._lease is not None and self._lease.valid else None
        idle = sorted((s for s in self.slots if not s.busy and s.tokens and s not in skip), key=lambda s: s.used_at)
        if need > free + (lease.cells if lease else 0) + sum(len(s.tokens) for s in idle):
            return False
        if lease is not None and lease.cells:
            free += lease.cells
            self._end_lease()                         # serving takes the lent room back first
        for s in idle:
            if need <= free:
                break
            free += len(s.tokens)
            self._clear_slot(s)
            self.stats.evicted_prefixes += 1
        return True

    def _reserve_lease(self, lease: SequenceLease, cells: int, keep: int = 0) -> bool:
        if cells > self.slot_ctx:
            raise ValueError(f"a lent sequence of {cells} positions exceeds the context of {self.slot_ctx} tokens")
        if not 0 <= keep <= cells:
            raise ValueError(f"keep {keep} must be within the {cells} positions reserved")
        if not keep or not self.lc.llama_memory_seq_rm(self.model.memory, lease.slot.seq_id, keep, -1):
            self._clear_slot(lease.slot)
            if keep:
                return False        # the tail cannot be dropped alone: refused (the caller retries keeping none)
        if self.pool is None:
            return True
        lease.cells = 0
        if not self._make_room(cells, (), take_lease=False):
            self._clear_slot(lease.slot)              # what was kept is not held now
            return False
        lease.cells = cells
        return True

    def _end_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None and lease.valid:
            lease.valid, lease.cells = False, 0
            self._clear_slot(lease.slot)
