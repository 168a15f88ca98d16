"""Keys scoped to adapter names (--api-keys FILE), and what a request's key may touch.

The key file is JSON: {"<key>": {"adapters": ["alice", "bob"], "train": true}}.
A scoped key selects, trains, exports, promotes and deletes only its
adapters (and the base model); anything else answers 404, as an unknown
name does, so names do not leak across tenants. It reaches the OpenAI
routes, /train and /adapters only. The single --api-key (and a server with
no key) keeps its full access: `ALL`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dreamstage.training.jobs.request import check_adapter_name

# What a scoped key may reach: path prefixes (the dashboard, /slots, /events and /metrics name every adapter).
SCOPED_PREFIXES = ("/v1/", "/train", "/adapters", "/tokenize", "/detokenize", "/health")


@dataclass(frozen=True)
class AdapterScope:
    names: frozenset[str] | None      # None: every adapter
    train: bool = True

    def allows(self, name: str) -> bool:
        return self.names is None or name in self.names

    @property
    def scoped(self) -> bool:
        return self.names is not None


ALL = AdapterScope(None, True)


def load_key_file(path: str) -> dict[str, AdapterScope]:
    """Read a key file; ValueError naming the file and the entry otherwise."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"api_keys {path!r}: cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"api_keys {path!r}: must be a non-empty JSON object of key -> scope")
    out = {}
    for key, entry in raw.items():
        where = f"api_keys {path!r}, key {key[:4]}…"
        if not key.strip():
            raise ValueError(f"api_keys {path!r}: an empty key")
        if not isinstance(entry, dict) or set(entry) - {"adapters", "train"} or "adapters" not in entry:
            raise ValueError(f"{where}: expected {{\"adapters\": [names], \"train\": true|false}}")
        names = entry["adapters"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: adapters must be a list of names")
        for n in names:
            check_adapter_name(n, "adapters")
        train = entry.get("train", False)
        if not isinstance(train, bool):
            raise ValueError(f"{where}: train must be true or false")
        out[key] = AdapterScope(frozenset(names), train)
    return out


def scope_of(request) -> AdapterScope:
    """The scope the security guard found for this request's key (ALL without scoped keys)."""
    return getattr(request.state, "adapter_scope", ALL)
