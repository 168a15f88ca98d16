"""Views of the store that more than one route shows (GET /train, GET /adapters, /events)."""
from __future__ import annotations

import os
from pathlib import Path

from dreamstage.adapters.replicas import generation


def with_unrecorded(service, view: dict) -> dict:
    """A job that ended while the store could not be written (a full disk) is
    shown as it is, an error, with `persisted: false` until the store takes it."""
    message = service.scheduler.unrecorded_error(view["id"])
    if message is None:
        return view
    return {**view, "state": "error", "message": message, "persisted": False}


def adapters_view(service) -> dict:
    """What GET /adapters returns: the default's served adapter, the promotions and their
    generation, every name (`name_view`) and every stored adapter version."""
    jobs = service.store
    return public({"served_version": service.engine.adapter_version, "served": jobs.served(),
                   "generation": generation(jobs),
                   "served_error": service.scheduler.served_error, "promotions": jobs.promotions(),
                   "names": [name_view(service, n) for n in jobs.names()], "adapters": jobs.adapters()})


def name_view(service, name: str) -> dict:
    """One adapter name: what it serves, its promotions and versions, and whether a job trains it now."""
    store = service.store
    served = store.served(name)
    jobs = store.overview()
    current = jobs["current"]
    return {"name": name, "served": served, "served_version": served["served_version"] if served else None,
            "promotions": store.promotions(name), "versions": [v["version"] for v in store.adapters(name)],
            "training": current is not None and current["out"] == name,
            "queued_jobs": [j["id"] for j in jobs["queue"] if j["out"] == name]}


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
