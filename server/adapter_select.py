"""A request's adapter, resolved once at the edge into an `AdapterChoice`.

`model` follows OpenAI/vLLM: an adapter name answers with its served
version, `name@version` pins a stored version, the base model's id or
`"base"` selects no adapter, and no `model` gets the default adapter (the
latest promotion of any name, as before names existed). llama-server's
`lora: [{"id" | "name", "scale"}]` is accepted too: `id` is the adapter's
position in /v1/models' list of adapters (0 = the first after the base);
entries with scale 0 are off; one adapter per request. An unknown name, or
one outside the key's scope, is a 404 `model_not_found` on `model` (never
the default); a name with versions but none served is a 404 that says so.
"""
from __future__ import annotations

from dreamstage.adapters.choice import BASE, BASE_NAME, AdapterChoice, split_model
from dreamstage.server.errors import APIError
from dreamstage.server.tenants import AdapterScope


def not_found(model: str, why: str = "") -> APIError:
    return APIError(404, f"The model `{model}` does not exist{why}.", "model", "model_not_found")


def listed_adapters(service, scope: AdapterScope) -> list[dict]:
    """The adapters /v1/models lists after the base, in order (their index is llama-server's lora `id`)."""
    store = service.store
    if store is None:
        return []
    return [v for n in store.resident_names() if scope.allows(n) for v in [store.served(n)] if v is not None]


def resolve(service, model: str | None, lora, scope: AdapterScope) -> AdapterChoice | None:
    """The request's AdapterChoice, or an APIError naming `model` or `lora`. None: the
    default adapter, which the engine reads when it admits the request."""
    if lora is not None:
        return _from_lora(service, model, lora, scope)
    if model is None:
        if not scope.scoped:
            return None                   # the engine reads the default at admission, after a booked promotion
        default = service.scheduler.switch.default_choice() if service.scheduler is not None else BASE
        return default if default.is_base or scope.allows(default.name) else BASE
    if model in (BASE_NAME, service.model_id):
        return BASE
    return _named(service, model, scope, 1.0)


def _named(service, model: str, scope: AdapterScope, scale: float, param: str = "model") -> AdapterChoice:
    name, pinned = split_model(model)
    store = service.store
    if store is None or not scope.allows(name):
        raise _missing(model, param)
    if pinned is not None:
        view = next((v for v in store.adapters(name) if v["version"] == pinned), None)
        if view is None:
            raise _missing(model, param)
        served_version = view["served_version"] if view["promoted"] else None
        return AdapterChoice(name, pinned, view["path"], scale, served_version)
    view = store.served(name)
    if view is None:
        if store.adapters(name):
            raise _missing(model, param, f": adapter `{name}` has no served version; promote one or pin "
                                         f"`{name}@<version>`")
        raise _missing(model, param)
    return AdapterChoice(name, view["version"], view["path"], scale, view["served_version"])


def _missing(model: str, param: str, why: str = "") -> APIError:
    e = not_found(model, why)
    e.param = param
    return e


def _from_lora(service, model: str | None, lora, scope: AdapterScope) -> AdapterChoice:
    on = [(i, e) for i, e in enumerate(lora) if e.scale != 0.0]
    if len(on) > 1:
        raise APIError(400, f"lora: {len(on)} adapters with a non-zero scale; this server applies one adapter "
                            "per request", "lora")
    if not on:
        choice = BASE
    else:
        i, entry = on[0]
        if entry.name is not None:
            choice = _named(service, entry.name, scope, entry.scale, f"lora[{i}].name")
        else:
            listed = listed_adapters(service, scope)
            assert entry.id is not None  # the schema requires id or name
            if not 0 <= entry.id < len(listed):
                raise APIError(404, f"lora[{i}].id: no adapter {entry.id} (this server lists {len(listed)}: "
                                    "GET /v1/models, after the base)", f"lora[{i}].id", "model_not_found")
            choice = _named(service, listed[entry.id]["name"], scope, entry.scale, f"lora[{i}].id")
    if model is not None and model not in (BASE_NAME, service.model_id) and split_model(model)[0] != choice.name:
        raise APIError(400, f"model {model!r} and lora name different adapters; give one", "lora")
    return choice
