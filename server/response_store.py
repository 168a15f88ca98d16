"""Responses kept for `previous_response_id` and GET / DELETE /v1/responses/{id}, in this process's
memory (a restart forgets them): the newest MAX_KEPT, at most MAX_BYTES of conversation between them.
A kept response is read only with the key scope that made it (an unscoped key reads every one), and
anything else is answered as unknown."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dreamstage.server.tenants import AdapterScope

MAX_KEPT = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class Kept:
    scope: AdapterScope
    messages: list[dict[str, Any]]    # the conversation it ended as chat messages, its answer included
    response: dict[str, Any]          # the Response object as it was answered
    size: int                         # bytes of the two as JSON, for MAX_BYTES


class ResponseStore:
    def __init__(self, max_kept: int = MAX_KEPT, max_bytes: int = MAX_BYTES):
        self.max_kept, self.max_bytes = max_kept, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, scope: AdapterScope, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        size = len(json.dumps(messages)) + len(json.dumps(response))
        with self._lock:
            self._kept[rid] = Kept(scope, messages, response, size)
            self._bytes += size
            while self._kept and (len(self._kept) > self.max_kept or self._bytes > self.max_bytes):
                _, gone = self._kept.popitem(last=False)
                self._bytes -= gone.size

    def get(self, rid: str, scope: AdapterScope) -> Kept | None:
        with self._lock:
            kept = self._kept.get(rid)
        return kept if kept is not None and (not scope.scoped or kept.scope == scope) else None

    def delete(self, rid: str, scope: AdapterScope) -> bool:
        with self._lock:
            kept = self._kept.get(rid)
            if kept is None or (scope.scoped and kept.scope != scope):
                return False
            del self._kept[rid]
            self._bytes -= kept.size
            return True
