"""Adapter files loaded by llama.cpp for serving, cached by (name, version).

Engine thread only. A slot holds a reference to its request's adapter from
admission to release; an unreferenced adapter stays loaded (the next request
for it pays nothing) until room is needed for another or it is unloaded.
At most `capacity` adapters are loaded at once (--max-adapters).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from dreamstage import native


class AdapterLoadError(ValueError):
    """llama.cpp could not load an adapter file for serving."""


class AdaptersFull(RuntimeError):
    """Every one of the `capacity` loaded adapters is in use by a request."""


def load_adapter_file(resident, path) -> Any:
    """A new llama_adapter_lora handle for `path` (the caller frees it). llama.cpp
    checks the file's architecture and every tensor's shape against the model."""
    path = str(path)
    if not os.path.isfile(path):
        raise AdapterLoadError(f"adapter file {path!r} does not exist")
    with native.LOAD_LOCK:
        handle = resident.lc.llama_adapter_lora_init(resident.model, path.encode())
    if not handle:
        raise AdapterLoadError(f"llama.cpp could not load {path!r} as a LoRA adapter for this model")
    return handle


class LoadedAdapters:
    """llama_adapter_lora handles by (name, version), at most `capacity`, least recently used freed first."""

    def __init__(self, resident, capacity: int, before_free=None):
        self.resident, self.lc, self.capacity = resident, resident.lc, capacity
        self.before_free = before_free      # called with a handle about to be freed (the context may hold it)
        self._handles: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._refs: dict[tuple[str, int], int] = {}

    def load_file(self, path: str) -> Any:
        return load_adapter_file(self.resident, path)

    def free(self, handle) -> None:
        if self.before_free is not None:
            self.before_free(handle)
        self.lc.llama_adapter_lora_free(handle)

    def handle(self, name: str, version: int) -> Any:
        """The loaded handle of (name, version) (acquired earlier; KeyError otherwise)."""
        return self._handles[(name, version)]

    def acquire(self, name: str, version: int, path: str) -> Any:
        """The handle for (name, version), loaded if need be, with one more reference."""
        key = (name, version)
        handle = self._handles.get(key)
        if handle is None:
            self._make_room()
            handle = self._handles[key] = self.load_file(path)
        self._handles.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1
        return handle

    def release(self, name: str, version: int) -> None:
        key = (name, version)
        left = self._refs.get(key, 0) - 1
        if left > 0:
            self._refs[key] = left
        else:
            self._refs.pop(key, None)

    def _make_room(self) -> None:
        while len(self._handles) >= self.capacity:
            idle = next((k for k in self._handles if not self._refs.get(k)), None)
            if idle is None:
                raise AdaptersFull(f"all {self.capacity} loaded adapters (--max-adapters) are answering requests")
            self.free(self._handles.pop(idle))

    def in_use(self, name: str) -> bool:
        return any(k[0] == name and n > 0 for k, n in self._refs.items())

    def unload(self, name: str) -> int:
        """Free every unreferenced loaded version of `name`; returns how many were freed."""
        keys = [k for k in self._handles if k[0] == name and not self._refs.get(k)]
        for k in keys:
            self.free(self._handles.pop(k))
        return len(keys)

    def loaded(self) -> list[tuple[str, int]]:
        return list(self._handles)

    def close(self) -> None:
        for handle in self._handles.values():
            self.free(handle)
        self._handles.clear()
        self._refs.clear()
