"""What each adapter name serves, and how it changes: reload, promotion, rollback.

Served adapters are files: a finished job's shadow adapter is saved as a
GGUF LoRA (atomically) and serving loads that file with llama.cpp's own
loader (`llama_adapter_lora_init`), the same path stock llama.cpp takes. So
what serves survives the job's Trainer and a restart.

Each name has its own served version (its latest live promotion in the
store); the default adapter, which a request naming none gets, is the
latest live promotion of any name. A promotion or rollback is booked in the
store (so it survives a restart) once the file has loaded (a file llama.cpp
refuses books nothing) and the adapter fits (--max-adapters names resident,
and their files' bytes within the memory allowance). It then applies at
once, between two batches: requests that start after it resolve to the new
version; requests already running finish on theirs (each slot holds its own
choice, and its cached prefix is keyed by it), so nothing is drained or flushed.

Engine thread only (or before the engine starts).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from dreamstage.adapters.choice import BASE, DEFAULT_MAX_ADAPTERS, DEFAULT_MIXED_MAX_RANK, AdapterChoice
from dreamstage.adapters.files import atomic_file, file_sha256, lora_rank_of
from dreamstage.adapters.loaded import AdapterLoadError, load_adapter_file
from dreamstage.adapters.names import check_adapter_name
from dreamstage.adapters.replicas import mirror_promotions
from dreamstage.adapters.versions import AdapterNotFound, AdapterVersions
from dreamstage.native import ggml_registry

log = logging.getLogger("dreamstage.served")


__all__ = ["AdapterLoadError", "AdapterSwitch", "AdapterRefused", "ServedAdapters"]

# Memory the adapter allowance keeps free on the device, as the training gate does.
ADAPTER_SLACK_MIB = 64.0


class AdapterRefused(RuntimeError):
    """An adapter that would not fit: more names than --max-adapters, or more
    bytes than the allowance. Nothing was booked or allocated."""

    def __init__(self, message: str, code: str, need_mib: float = 0.0, allowance_mib: float = 0.0):
        super().__init__(message)
        self.code, self.need_mib, self.allowance_mib = code, need_mib, allowance_mib

    def receipt(self) -> dict:
        return {"status": "refused", "code": self.code, "message": str(self),
                "refused_need_mib": round(self.need_mib, 3), "refused_allowance_mib": round(self.allowance_mib, 3)}


class ServedAdapters:
    """Checks that llama.cpp loads an adapter file for this model, and
    remembers the default adapter's file. Serving itself loads adapters
    through the engine's `PerBatchAdapters`; a handle loaded here is only
    a check and is freed once the file is booked.

    Engine thread only (or before the engine starts)."""

    def __init__(self, resident):
        self.resident = resident
        self.lc = resident.lc
        self.handle = None          # always None: serving's handles live in the engine's cache
        self.path: str | None = None

    def load(self, path) -> Any:
        return load_adapter_file(self.resident, path)

    def apply(self, handle, path: str | None) -> None:
        """`path` is the default adapter's file now (None: the base); the check's handle is freed."""
        self.path = path
        self.discard(handle)

    def discard(self, handle) -> None:
        """Free a handle loaded as a check."""
        if handle is not None:
            self.lc.llama_adapter_lora_free(handle)


class _Swap:
    """A promotion or rollback booked in the store, waiting to be applied."""

    def __init__(self, handle, path: str | None, version: int, view: Any, future: concurrent.futures.Future | None):
        self.handle, self.path, self.version, self.view, self.future = handle, path, version, view, future


class AdapterSwitch:
    """What serves (reloaded at startup), and the one booked change to apply
    at the next batch boundary. `served` checks files (a fake in tests)."""

    def __init__(self, store: AdapterVersions, served: ServedAdapters, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 budget_mib: float | None = None, mixed_max_rank: int = DEFAULT_MIXED_MAX_RANK):
        self.store = store
        self.served = served
        self.max_adapters = max_adapters
        self.budget_mib = budget_mib            # the resident adapters' bytes allowance; None: device free memory
        self.mixed_max_rank = mixed_max_rank    # adapters up to this rank take a bank slot of this rank
        self.pending: _Swap | None = None
        self.served_error: str | None = None   # why the stored served adapter could not be reloaded
        self.default = BASE                    # what a request naming no adapter gets (engine.default_adapter)

    def default_choice(self) -> AdapterChoice:
        return self.default

    def _set_default(self, engine) -> None:
        view = self.store.served()
        if view is None:
            self.default = BASE
        else:
            self.default = AdapterChoice(view["name"], view["version"], view["path"], 1.0, view["served_version"])
        self.served.path = self.default.path
        engine.adapter_version = self.default.served_version or 0
        engine.default_adapter = self.default_choice

    def check_room(self, name: str, path: str, others: dict[str, str] | None = None) -> None:
        """Raise AdapterRefused when serving `path` as `name` would pass --max-adapters or the memory allowance.
        `others`: the other resident names' files (default: what the store serves now)."""
        adds = others is not None or name not in self.store.resident_names()
        if others is None:
            others = {n: v["path"] for n in self.store.resident_names() if n != name
                      for v in [self.store.served(n)] if v is not None}
        if adds and len(others) >= self.max_adapters:
            resident = ", ".join(sorted(others))
            raise AdapterRefused(f"adapter {name!r} would be adapter {len(others) + 1} resident beside the base, "
                                 f"more than --max-adapters {self.max_adapters} (resident: {resident}); "
                                 "retire one with DELETE /adapters/{name}", "max_adapters")
        held = sum(self._resident_mib(p) for p in others.values())
        need = self._resident_mib(path)
        if self.budget_mib is not None:
            allowance, source = self.budget_mib - held, f"--adapter-budget-mib {self.budget_mib:g} MiB"
        else:
            allowance = _device_free_mib() - ADAPTER_SLACK_MIB
            source = f"the device's free memory less {ADAPTER_SLACK_MIB:g} MiB"
        if need > allowance:
            raise AdapterRefused(f"adapter {name!r} needs {need:.2f} MiB; the allowance is {max(allowance, 0):.2f} "
                                 f"MiB ({source}, {held:.2f} MiB held by the other resident adapters)",
                                 "adapter_memory", need, max(allowance, 0.0))

    def reload(self, engine, adapter_path: str | None = None) -> None:
        """Reload the served adapter the store names; import and promote `adapter_path` (--adapter).

        Call before the engine starts. A bad --adapter raises ValueError; a
        stored adapter that no longer loads is reported (`served_error`) and
        the base model serves, version 0."""
        errors = []
        for name in self.store.resident_names():
            served = self.store.served(name)
            assert served is not None  # resident: it has a live promotion
            try:
                if served.get("sha256") and Path(served["path"]).is_file() \
                        and file_sha256(served["path"]) != served["sha256"]:
                    raise AdapterLoadError("its bytes differ from the sha256 recorded when it was saved")
                handle = self.served.load(served["path"])
                self.served.apply(handle, served["path"])
            except AdapterLoadError as e:
                errors.append(f"the promoted adapter {served['name']} v{served['version']} could not be reloaded: "
                              f"{e}; it is rolled back")
                self.store.retire(name)
        if errors:
            self.served_error = "; ".join(errors) + " (requests naming no adapter get what serves now)"
            log.error("%s", self.served_error)
        self._set_default(engine)
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
        self._set_default(engine)
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
        self.check_room(name, path)
        handle = self.served.load(path)                 # refuse a file llama.cpp cannot load: nothing booked
        try:
            view = store.promote(name, version)
        except BaseException:
            self.served.discard(handle)
            raise
        self._queue_swap(_Swap(handle, path, store.served_version(), view, applied))
        return view

    def book_mirror(self, live: list[tuple[int, str, int]], applied) -> dict | None:
        """A follower's: serve exactly the leader's live promotions `live` [(served_version, name, version)],
        every file stored already. Each name whose served file changes is checked as a promotion is (room,
        llama.cpp's loader) against the set after the change; a refusal books nothing."""
        store = self.store
        tops: dict[str, tuple[int, int]] = {}
        for sv, name, version in sorted(live):
            tops[name] = (sv, version)
        after = {name: str(store.adapter_path(name, version)) for name, (_, version) in tops.items()}
        for name, path in after.items():
            served = store.served(name)
            if served is None or served["served_version"] != tops[name][0]:
                self.check_room(name, path, {n: p for n, p in after.items() if n != name})
                self.served.discard(self.served.load(path))
        mirror_promotions(store, live)
        default = store.served()
        self._queue_swap(_Swap(None, default["path"] if default else None, store.served_version(), default,
                               applied))
        return default

    def book_rollback(self, applied, name: str | None = None) -> dict | None:
        """Undo the latest promotion of `name` (None: of any name, the default's)."""
        store = self.store
        stack = store.promotions(name)
        if not stack:
            raise AdapterNotFound("nothing to roll back: the base model is served" if name is None
                                  else f"nothing to roll back: adapter {name!r} has no served version")
        handle = path = None
        if len(stack) >= 2:
            prev = stack[-2]
            path = str(store.adapter_path(prev["name"], prev["version"]))
            handle = self.served.load(path)
        try:
            view = store.rollback(name)
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
        """Make the booked change the default for requests that start from now on."""
        swap, self.pending = self.pending, None
        assert swap is not None  # callers check for a pending swap
        try:
            self.served.apply(swap.handle, swap.path)
            self._set_default(engine)
        except Exception as e:
            log.exception("adapter swap failed")
            if swap.future is not None:
                swap.future.set_exception(e)
            return
        self.served_error = None
        if swap.future is not None:
            swap.future.set_result(True)
        log.info("served version %d (%s); the default is %s", swap.version, swap.path or "base model",
                 self.default.label)

    def retire(self, engine, name: str) -> int:
        """DELETE /adapters/{name}: roll back all its promotions (the caller checked it is not in use)."""
        n = self.store.retire(name)
        self._set_default(engine)
        return n


    def _resident_mib(self, path) -> float:
        """What serving `path` holds: its factors, padded to the bank's rank when it takes a bank slot."""
        rank = lora_rank_of(str(path))
        pad = self.mixed_max_rank / rank if 0 < rank <= self.mixed_max_rank else 1.0
        return _file_mib(path) * pad


def _file_mib(path) -> float:
    try:
        return os.path.getsize(path) / 2**20
    except OSError:
        return 0.0


def _device_free_mib() -> float:
    """Free memory of the device adapters load on: the first GPU, else the host."""
    devices = ggml_registry.devices()
    gpus = [d for d in devices if d["name"] != "CPU"]
    chosen = gpus or [d for d in devices if d["name"] == "CPU"]
    return chosen[0]["free"] / 2**20 if chosen else 0.0


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
