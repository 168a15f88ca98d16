"""The adapter bank: many GGUF LoRA adapters resident at once, chosen per token in one decode batch.

`ServedAdapters` sets one adapter on the whole context; the bank instead keeps
up to `capacity` adapters in slots beside the base model and, once armed with
each batch token's slot (`set_token_adapters`, right before `llama_decode`),
adds every token's own LoRA term inside the same decode. Sequences on
different adapters and on the base therefore share a batch. Unarmed, a decode
is exactly the decode without a bank. The native side is dream-bank.cpp
(dream.h, "The adapter bank").

Engine thread only (or before the engine starts), like every llama call.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

from dreamstage import native
from dreamstage.owner import NativeOwner

BASE = -1   # the slot id of a token on the base model
_ERR = 512


class AdapterBankError(ValueError):
    """A bank refused a value: a file it cannot load, a full bank, an empty slot."""


class AdapterBank(NativeOwner):
    """Slots of LoRA adapters on `resident`'s context, applied per token.

    `capacity` slots, each adapter of rank at most `max_rank` (smaller ranks
    are padded: every slot costs what a max_rank adapter costs). A weight's
    stack is allocated when the first adapter adapting it loads; loading and
    unloading write into it and rebuild nothing serving holds."""

    def __init__(self, resident, capacity: int, *, max_rank: int = 16):
        self.resident = resident
        self.handle = None
        self.capacity = _positive("capacity", capacity)
        self.max_rank = _positive("max_rank", max_rank)
        self.paths: dict[int, str] = {}
        err = ctypes.create_string_buffer(_ERR)
        handle = native.lib().dream_bank_init(resident.ctx, self.capacity, self.max_rank, err, _ERR)
        if not handle:
            raise AdapterBankError(err.value.decode(errors="replace"))
        self.handle = handle
        resident.dependents.add(self)

    def load(self, path, scale: float = 1.0) -> int:
        """Load a GGUF LoRA into the lowest free slot and return the slot.
        Raises AdapterBankError naming the file when it is refused."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise AdapterBankError(f"adapter file {path!r} does not exist")
        err = ctypes.create_string_buffer(_ERR)
        slot = native.lib().dream_bank_load(self._h(), path.encode(), float(scale), err, _ERR)
        if slot < 0:
            raise AdapterBankError(err.value.decode(errors="replace"))
        self.paths[slot] = path
        return slot

    def unload(self, slot: int) -> None:
        """Empty `slot`; tokens still armed on it read the base. Raises AdapterBankError for an empty slot."""
        if not native.lib().dream_bank_unload(self._h(), int(slot)):
            raise AdapterBankError(f"slot {slot} holds no adapter")
        del self.paths[slot]

    def set_token_adapters(self, ids: Sequence[int]) -> None:
        """Arm the bank for the next decodes: ids[i] is the slot of the batch's
        i-th token (BASE = -1 for the base model). An empty list, or only BASE,
        disarms. Call right before llama_decode with the batch it decodes; the
        arming holds until the next call, so a decode of another batch that
        should not read these slots comes after a disarm."""
        n = len(ids)
        arr = (ctypes.c_int32 * max(n, 1))(*ids)
        err = ctypes.create_string_buffer(_ERR)
        if not native.lib().dream_bank_set_token_adapters(self._h(), arr, n, err, _ERR):
            raise AdapterBankError(err.value.decode(errors="replace"))

    def bytes(self, slot: int) -> int:
        """Bytes one loaded slot takes on its devices (0 for an empty slot): what the gate counts per adapter."""
        return int(native.lib().dream_bank_slot_bytes(self._h(), int(slot)))

    @property
    def total_bytes(self) -> int:
        """Bytes of every stack the bank allocated, all slots."""
        return int(native.lib().dream_bank_total_bytes(self._h()))

    def _h(self):
        if not self.handle:
            raise AdapterBankError("the adapter bank is closed")
        return self.handle

    def close(self) -> None:
        if getattr(self, "handle", None):
            native.lib().dream_bank_free(self.handle)
            self.handle = None
            self.paths = {}


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterBankError(f"{name} must be a positive integer, got {value!r}")
    return value
