"""Which adapter answers a request: a typed value resolved once, at the HTTP edge.

A request names an adapter (`model: "alice"`, `"alice@3"`, `"base"`, or
llama-server's `lora` list); the edge resolves that against the store into an
`AdapterChoice` (name, version, file, scale) and the engine trusts it from
there: a slot records the choice it was seated with, and a slot's cached
prefix is reused only by a request with the same `key`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# The name that selects no adapter (the base model), always present.
BASE_NAME = "base"
# Adapters resident beside the base unless --max-adapters says otherwise.
DEFAULT_MAX_ADAPTERS = 8
# Adapters of rank up to this share every decode batch (the adapter bank pads
# each slot to it); a larger one decodes in batches of its own (--adapter-max-rank).
DEFAULT_MIXED_MAX_RANK = 16

_PINNED = re.compile(r"(?P<name>.+)@(?P<version>[0-9]+)")


@dataclass(frozen=True)
class AdapterChoice:
    """One request's adapter. `version` is the file's version (0: the base);
    `served_version` is the promotion it was served under (None when the
    request pinned a version; 0 for the base)."""

    name: str
    version: int
    path: str | None
    scale: float = 1.0
    served_version: int | None = 0

    @property
    def is_base(self) -> bool:
        return self.path is None

    @property
    def key(self) -> tuple[str, int, float]:
        """What a cached prefix's K/V depend on: two choices with one key decode alike."""
        return (self.name, self.version, self.scale)

    @property
    def label(self) -> str:
        """How a response names it: "base", "alice@3" (or "alice@3*0.5" at another scale)."""
        if self.is_base:
            return BASE_NAME
        return f"{self.name}@{self.version}" + ("" if self.scale == 1.0 else f"*{self.scale:g}")


BASE = AdapterChoice(BASE_NAME, 0, None)


def split_model(model: str) -> tuple[str, int | None]:
    """"alice" -> ("alice", None); "alice@3" -> ("alice", 3)."""
    m = _PINNED.fullmatch(model)
    if m is None:
        return model, None
    return m.group("name"), int(m.group("version"))
