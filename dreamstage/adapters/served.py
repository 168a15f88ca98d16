"""The adapter serving runs with, and how it changes: reload, promotion, rollback, the swap.

Served adapters are files: a finished job's shadow adapter is saved as a
GGUF LoRA (atomically) and promotion loads that file with llama.cpp's own
loader (`llama_adapter_lora_init`), the same path stock llama.cpp takes. So
what serves survives the job's Trainer and a restart.

A promotion or rollback is booked in the store first (so it survives a
restart), with the file already loaded (a file llama.cpp refuses books
nothing), and becomes the pending swap. The scheduler applies it between two
decode batches once no slot is busy (`DreamScheduler.hold_admission`): the
idle slots' cached prefixes are dropped (their K/V came from the old
weights) and `engine.adapter_version` moves, so every completion ran on
exactly one adapter version, the one it reports.

Engine thread only (or before the engine starts).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from dreamstage.adapters.files import atomic_file, file_sha256
from dreamstage.training.jobs.request import check_adapter_name
from dreamstage.training.jobs.store import AdapterNotFound, JobStore

log = logging.getLogger("dreamstage.served")


class AdapterLoadError(ValueError):
    """llama.cpp could not load an adapter file for serving."""


class ServedAdapters:
    """The adapter serving runs with: one GGUF LoRA loaded by llama.cpp, or none (the base model).

    Engine thread only (or before the engine starts)."""

    def __init__(self, resident):
        self.resident = resident
        self.lc = resident.lc
        self.handle = None          # the llama_adapter_lora set on the context now
        self.path: str | None = None

    def load(self, path) -> Any:
        path = str(path)
        if not os.path.isfile(path):
            raise AdapterLoadError(f"adapter file {path!r} does not exist")
        handle = self.lc.llama_adapter_lora_init(self.resident.model, path.encode())
        if not handle:
            raise AdapterLoadError(f"llama.cpp could not load {path!r} as a LoRA adapter for this model")
        return handle

    def apply(self, handle, path: str | None) -> None:
        lc = self.lc
        if handle is None:
            lc.llama_set_adapters_lora(self.resident.ctx, None, 0, None)
        else:
            arr = (lc.llama_adapter_lora_p_ctypes * 1)(handle)
            scales = (ctypes.c_float * 1)(1.0)
            rc = lc.llama_set_adapters_lora(self.resident.ctx, arr, 1, scales)
            if rc != 0:
                raise AdapterLoadError(f"llama_set_adapters_lora failed with {rc}")
        old, self.handle, self.path = self.handle, handle, path
        if old is not None and old != handle:
            lc.llama_adapter_lora_free(old)

    def discard(self, handle) -> None:
        """Free a loaded adapter that never became the served one."""
        if handle is not None and handle != self.handle:
            self.lc.llama_adapter_lora_free(handle)


class _Swap:
    """A promotion or rollback booked in the store, waiting to be applied."""

    def __init__(self, handle, path: str | None, version: int, view: Any, future: concurrent.futures.Future | None):
        self.handle, self.path, self.version, self.view, self.future = handle, path, version, view, future


class AdapterSwitch:
    """What serves (reloaded at startup), and the one pending swap to apply
    between batches. `served` holds the llama handles (a fake in tests)."""

    def __init__(self, store: JobStore, served: ServedAdapters):
        self.store = store
        self.served = served
        self.pending: _Swap | None = None
        self.served_error: str | None = None   # why the stored served adapter could not be reloaded

    def reload(self, engine, adapter_path: str | None = None) -> None:
        """Reload the served adapter the store names; import and promote `adapter_path` (--adapter).

        Call before the engine starts. A bad --adapter raises ValueError; a
        stored adapter that no longer loads is reported (`served_error`) and
        the base model serves, version 0."""
        served = self.store.served()
        if served is not None:
            try:
                if served.get("sha256") and Path(served["path"]).is_file() \
                        and file_sha256(served["path"]) != served["sha256"]:
                    raise AdapterLoadError("its bytes differ from the sha256 recorded when it was saved")
                handle = self.served.load(served["path"])
                self.served.apply(handle, served["path"])
                engine.adapter_version = served["served_version"]
            except AdapterLoadError as e:
                self.served_error = (f"the promoted adapter {served['name']} v{served['version']} "
                                     f"could not be reloaded: {e}; serving the base model")
                log.error("%s", self.served_error)
                engine.adapter_version = 0
        if adapter_path is not None:
            self._import_startup_adapter(engine, Path(adapter_path))

    def _import_startup_adapter(self, engine, src: Path) -> None:
        if not src.is_file():
            raise ValueError(f"--adapter {str(src)!r}: no such file")
        if self.served.path and _same_bytes(self.served.path, src):
            return                                         # already served (a restart with the same flag)
        handle = self.served.load(src)                      # AdapterLoadError is a ValueError
        name = _adapter_name_from(src)
        version = self.store.next_adapter_version(name)
        dst = self.store.adapter_path(name, version)
        _copy_atomic(src, dst)
        self.store.add_adapter(name, version)
        self.store.promote(name, version)
        self.served.apply(handle, str(dst))
        engine.adapter_version = self.store.served_version()
        self.served_error = None
        log.info("serving --adapter %s as %s v%d (served version %d)", src, name, version, engine.adapter_version)

    def book_promotion(self, name: str, version: int | None, applied) -> dict:
        store = self.store
        versions = [a["version"] for a in store.adapters() if a["name"] == name]
        if not versions:
            raise AdapterNotFound(f"no adapter {name!r}")
        if version is None:
            version = max(versions)
        elif version not in versions:
            raise AdapterNotFound(f"no adapter {name!r} version {version}")
        path = str(store.adapter_path(name, version))
        handle = self.served.load(path)                 # refuse a file llama.cpp cannot load: nothing booked
        try:
            view = store.promote(name, version)
        except BaseException:
            self.served.discard(handle)
            raise
        self._queue_swap(_Swap(handle, path, store.served_version(), view, applied))
        return view

    def book_rollback(self, applied) -> dict | None:
        store = self.store
        stack = store.promotions()
        if not stack:
            raise AdapterNotFound("nothing to roll back: the base model is served")
        handle = path = None
        if len(stack) >= 2:
            prev = stack[-2]
            path = str(store.adapter_path(prev["name"], prev["version"]))
            handle = self.served.load(path)
        try:
            view = store.rollback()
        except BaseException:
            self.served.discard(handle)
            raise
        self._queue_swap(_Swap(handle, path, store.served_version(), view, applied))
        return view

    def _queue_swap(self, swap: _Swap) -> None:
        old = self.pending
        if old is not None:                             # superseded before it was applied
            self.served.discard(old.handle)
            if old.future is not None:
                old.future.set_result(False)
        self.pending = swap

    def apply_pending(self, engine) -> None:
        swap, self.pending = self.pending, None
        assert swap is not None  # callers check for a pending swap
        try:
            self.served.apply(swap.handle, swap.path)
        except Exception as e:
            log.exception("adapter swap failed")
            self.served.discard(swap.handle)
            if swap.future is not None:
                swap.future.set_exception(e)
            return
        engine.forget_cached_prefixes()         # their K/V came from the old weights
        engine.adapter_version = swap.version
        self.served_error = None
        if swap.future is not None:
            swap.future.set_result(True)
        log.info("serving adapter version %d (%s)", swap.version, swap.path or "base model")


def _adapter_name_from(path: Path) -> str:
    """An adapter name for an imported file: its stem, or its folder's name for
    our own layout (`<name>/v3.gguf`)."""
    stem = path.name.removesuffix(".gguf")
    if re.fullmatch(r"v\d+", stem) and path.parent.name:
        stem = path.parent.name
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", stem).strip(".-") or "adapter"
    if not stem[0].isalnum():
        stem = "a" + stem
    return check_adapter_name(stem.replace("..", ".")[:64])


def _same_bytes(a, b) -> bool:
    try:
        return os.path.getsize(a) == os.path.getsize(b) and file_sha256(a) == file_sha256(b)
    except OSError:
        return False


def _copy_atomic(src: Path, dst: Path) -> None:
    with atomic_file(dst) as tmp:
        shutil.copyfile(src, tmp)
