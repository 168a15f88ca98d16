"""Views of the store that more than one route shows (GET /train, GET /adapters, /events)."""
from __future__ import annotations

import os
from pathlib import Path


def with_unrecorded(service, view: dict) -> dict:
    """A job that ended while the store could not be written (a full disk) is
    shown as it is, an error, with `persisted: false` until the store takes it."""
    message = service.scheduler.unrecorded_error(view["id"])
    if message is None:
        return view
    return {**view, "state": "error", "message": message, "persisted": False}


def adapters_view(service) -> dict:
    """What GET /adapters returns: the served adapter, its promotions and every stored adapter."""
    jobs = service.store
    return public({"served_version": service.engine.adapter_version, "served": jobs.served(),
                   "served_error": service.scheduler.served_error, "promotions": jobs.promotions(),
                   "adapters": jobs.adapters()})


def public(view):
    """A view without absolute paths: an adapter's `path` is given relative to
    the state directory (`adapters/notes/v3.gguf`), which a client can use and
    which does not tell a caller where the server's files live."""
    if isinstance(view, dict):
        out = {}
        for k, v in view.items():
            if k == "path" and isinstance(v, str) and os.path.isabs(v):
                parts = Path(v).parts
                v = str(Path(*parts[-3:]))      # adapters/<name>/v<N>.gguf
            out[k] = public(v)
        return out
    if isinstance(view, list):
        return [public(v) for v in view]
    return view
