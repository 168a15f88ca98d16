"""Routes for adapters: list, import, promote, roll back, unload, download.

- `GET /adapters`: every name's served version, promotions and stored versions (each
  with its sha256), and the promotions' `generation`; `?since=G[&wait=S]` answers
  once the generation is not G (a follower's long poll); `GET /adapters/{name}`: one name's.
- `POST /adapters`: import a LoRA as a new version of a name. The body is JSON
  (the server takes no multipart): `{"name": n, "gguf": "<base64 of a GGUF LoRA>"}`,
  or `{"name": n, "peft": {"config": {adapter_config.json}, "safetensors":
  "<base64 of adapter_model.safetensors>"}}` (converted to GGUF on the way in), or,
  for an unscoped key, `{"name": n, "path": "<a .gguf file or a PEFT folder on
  the server>"}`. `"promote": false` stores it without serving it (default:
  served). llama.cpp's own loader checks the file against the resident model
  (architecture, every tensor's dimensions, targets) on the engine thread
  before anything is stored: a 422 names what failed.
- `POST /adapters/{name}/promote`, `POST /adapters/{name}/rollback`, and
  `POST /adapters/rollback` (the latest promotion of any name).
- `DELETE /adapters/{name}`: unload: its promotions rolled back, its loaded
  files freed; 409 while it trains or answers requests. Its versions stay stored.
- `GET /adapters/{name}/versions/{v}`: the GGUF (its recorded sha256 in
  X-Dreamstage-Sha256); `?format=peft`: a zip of
  adapter_model.safetensors and adapter_config.json.

A key scoped to adapters (tenants.py) sees and touches only its own names:
any other answers 404, as an unknown name does.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import os
import sqlite3
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dreamstage.adapters.files import atomic_file, load_lora, save_lora
from dreamstage.adapters.peft import PeftError, factors_to_peft, peft_to_factors, read_safetensors
from dreamstage.adapters.replicas import generation
from dreamstage.adapters.served import AdapterRefused
from dreamstage.adapters.versions import AdapterNotFound
from dreamstage.server.errors import APIError, strict_int
from dreamstage.server.tenants import scope_of
from dreamstage.server.train_routes import _invalid, _json_object, _storage_error, _training_service
from dreamstage.server.train_routes import adapter_name_in_scope as _name
from dreamstage.server.views import adapters_view, name_view, public
from dreamstage.training.jobs.scheduler import AdapterInUse
from dreamstage.validation import field_errors

router = APIRouter()
SHA256_HEADER = "X-Dreamstage-Sha256"

# How long a promote/rollback/import/unload call waits for the engine thread
# to take it (between two batches); past this the answer is 503, retry.
SWAP_WAIT_S = 30.0
# GET /adapters?since=G: how long it waits for a change unless `wait` says, the most `wait` may say,
# and how often it looks at the store meanwhile (a change is seen within this).
DEFAULT_CHANGE_WAIT_S = 30.0
MAX_CHANGE_WAIT_S = 120.0
CHANGE_POLL_S = 0.05


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int | None = Field(default=None, ge=1)


class PeftBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    config: dict[str, Any]
    safetensors: str = Field(min_length=1)


class ImportBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    gguf: str | None = Field(default=None, min_length=1)
    peft: PeftBody | None = None
    path: str | None = Field(default=None, min_length=1)
    promote: bool = True


def _known(request: Request, raw: str):
    """(service, name) for a stored adapter the key may touch; 404 otherwise."""
    service = _training_service(request)
    name = _name(request, raw)
    if not service.store.adapters(name):
        raise APIError(404, f"no adapter {name!r}", "name", "not_found")
    return service, name


def _scoped_view(request: Request, service) -> dict:
    scope = scope_of(request)
    if not scope.scoped:
        return adapters_view(service)
    store = service.store
    names = [n for n in store.names() if scope.allows(n)]
    return public({"names": [name_view(service, n) for n in names], "generation": generation(store),
                   "adapters": [v for n in names for v in store.adapters(n)]})


@router.get("/adapters")
async def adapters(request: Request):
    """With `?since=G[&wait=S]`, answer once the promotions' generation is not G, or after S seconds
    (default 30, at most 120): a follower's long poll (server/follow.py). `generation` (also the ETag) grows
    with every promotion and rollback. The two are read from the query string rather than declared: a
    fuzzer filling declared parameters would hold each call open, as on /events."""
    service = _training_service(request)
    since = request.query_params.get("since")
    if since is not None:
        wait = _wait_s(request.query_params.get("wait"))
        await _generation_change(request, service, strict_int(since, "since", 0), wait)
    with service.store.reading():                  # one snapshot: the generation is the listing's
        view = _scoped_view(request, service)
    if service.follower is not None:           # a replica: whom it follows, and how it goes (server/follow.py)
        view["follow"] = service.follower.status(detail=not scope_of(request).scoped)
    return JSONResponse(view, headers={"ETag": f'"{view["generation"]}"'})


def _wait_s(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_CHANGE_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_CHANGE_WAIT_S:
        raise APIError(422, f"wait: expected seconds 0..{MAX_CHANGE_WAIT_S:g}, got {raw[:40]!r}", "wait",
                       "invalid_value")
    return value


async def _generation_change(request: Request, service, since: int, wait_s: float) -> None:
    """Return when the store's generation is not `since`, `wait_s` passed, the client left or the server stops."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while generation(service.store) == since and service.engine.running:
        if asyncio.get_running_loop().time() >= deadline or await request.is_disconnected():
            return
        await asyncio.sleep(CHANGE_POLL_S)


@router.get("/adapters/{name}")
async def one_adapter(name: str, request: Request):
    service, name = _known(request, name)
    return public({**name_view(service, name), "adapters": service.store.adapters(name)})


async def _engine_call(service, fut):
    """The engine thread's answer to a scheduler command, mapped to HTTP errors (a failed RPC
    worker's WorkerFailed goes on to the app's handler: 503 with Retry-After)."""
    if not service.engine.running:
        fut.cancel()
        raise APIError(503, "the engine is not running", None, "engine_stopped")
    try:
        return await asyncio.wait_for(asyncio.wrap_future(fut), SWAP_WAIT_S)
    except AdapterNotFound as e:
        raise APIError(404, str(e), "name", "not_found") from None
    except AdapterRefused as e:
        raise APIError(409, str(e), "name", e.code) from None
    except AdapterInUse as e:
        raise APIError(409, str(e), "name", "adapter_in_use") from None
    except ValueError as e:               # the file does not load (AdapterLoadError)
        raise APIError(422, str(e), "name", "adapter_unloadable") from None
    except (OSError, sqlite3.Error) as e:  # booking could not be written
        raise _storage_error(e, "adapters") from None
    except asyncio.TimeoutError:
        raise APIError(503, "the engine did not take the request in time; retry", None, "busy") from None


async def _swap(service, fut) -> JSONResponse:
    """Wait for the engine to book a promotion or rollback; it applies at the next batch."""
    view, applied = await _engine_call(service, fut)
    try:
        done = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(applied)), SWAP_WAIT_S)
    except asyncio.TimeoutError:
        done = False
    body = {"applied": bool(done), "served": view, **adapters_view(service)}
    return JSONResponse(body, status_code=200 if done else 202)


@router.post("/adapters/rollback")
async def rollback(request: Request):
    """Undo the latest promotion of any name (what requests naming no adapter get)."""
    service = _training_service(request)
    if scope_of(request).scoped:
        raise APIError(404, "a scoped key rolls back its own adapters: POST /adapters/{name}/rollback", None,
                       "not_found")
    return await _rollback(service, None)


async def _rollback(service, name: str | None):
    try:
        return await _swap(service, service.scheduler.rollback(name))
    except APIError as e:
        if e.status == 404:               # nothing to roll back is a state conflict, not a missing name
            raise APIError(409, e.message, None, "nothing_to_roll_back") from None
        raise


@router.post("/adapters/{name}/rollback")
async def rollback_name(name: str, request: Request):
    service, name = _known(request, name)
    return await _rollback(service, name)


@router.post("/adapters/{name}/promote")
async def promote(name: str, request: Request):
    service = _training_service(request)
    name = _name(request, name)
    body = await _json_object(request, required=False)
    try:
        version = PromoteBody.model_validate(body or {}).version
    except ValidationError as e:
        raise _invalid(field_errors(e)) from None
    return await _swap(service, service.scheduler.promote(name, version))


@router.delete("/adapters/{name}")
async def unload(name: str, request: Request):
    service, name = _known(request, name)
    current = service.store.overview()["current"]
    if current is not None and current["out"] == name:
        raise APIError(409, f"adapter {name!r} is training; cancel its job first", "name", "adapter_in_use")
    retired = await _engine_call(service, service.scheduler.retire(name))
    return public({"name": name, "unloaded": True, "promotions_rolled_back": retired, **adapters_view(service)})


@router.get("/adapters/{name}/versions/{version}")
async def download(name: str, version: str, request: Request, format: str = "gguf"):
    service = _training_service(request)
    name = _name(request, name)
    v = strict_int(version, "version", 1)
    view = next((a for a in service.store.adapters(name) if a["version"] == v), None)
    if view is None or not Path(view["path"]).is_file():
        raise APIError(404, f"no adapter {name!r} version {v}", "version", "not_found")
    if format == "gguf":
        # The sha256 recorded when the file was saved: a follower checks the bytes it got against it.
        headers = {SHA256_HEADER: view["sha256"]} if view["sha256"] else None
        return FileResponse(view["path"], media_type="application/octet-stream", filename=f"{name}-v{v}.gguf",
                            headers=headers)
    if format != "peft":
        raise APIError(422, f"format: {format!r} is not gguf or peft", "format", "invalid_value")
    shape = service.adapter_shape
    factors, alpha = await asyncio.to_thread(load_lora, view["path"])
    try:
        config, tensors = factors_to_peft(factors, alpha, shape.arch, shape.n_head, shape.n_head_kv,
                                          service.model_id)
    except PeftError as e:
        raise APIError(422, f"format=peft: {e}", "format", "not_convertible") from None
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("adapter_config.json", json.dumps(config, indent=2))
        z.writestr("adapter_model.safetensors", tensors)
    return Response(buf.getvalue(), media_type="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{name}-v{v}-peft.zip"'})


@router.post("/adapters", status_code=201)
async def import_adapter(request: Request):
    service = _training_service(request)
    raw = await _json_object(request, required=True)
    try:
        body = ImportBody.model_validate(raw)
    except ValidationError as e:
        raise _invalid(field_errors(e)) from None
    name = _name(request, body.name)
    given = [k for k in ("gguf", "peft", "path") if getattr(body, k) is not None]
    if len(given) != 1:
        raise _invalid([("body", f"give one of gguf, peft or path (got {', '.join(given) or 'none'})")])
    if body.path is not None and scope_of(request).scoped:
        raise APIError(403, "path: importing a file on the server needs the server's own key", "path",
                       "path_import_not_allowed")
    tmp = await asyncio.to_thread(_staged_file, service, body)
    try:
        await _engine_call(service, service.scheduler.check_file(name, str(tmp)) if body.promote
                           else service.scheduler.check_file(None, str(tmp)))
        store = service.store
        try:
            version = store.next_adapter_version(name)
            with atomic_file(store.adapter_path(name, version)) as dst:
                os.replace(tmp, dst)
            store.add_adapter(name, version)
        except (OSError, sqlite3.Error) as e:
            raise _storage_error(e, "POST /adapters") from None
    finally:
        tmp.unlink(missing_ok=True)
    if not body.promote:
        return JSONResponse(public({"imported": store.adapters(name)[-1], "applied": False}), status_code=201)
    response = await _swap(service, service.scheduler.promote(name, version))
    data = json.loads(bytes(response.body))
    return JSONResponse(public({"imported": data["served"], **data}), status_code=201)


def _staged_file(service, body: ImportBody) -> Path:
    """The body's adapter as a GGUF LoRA in a temporary file in the state directory; 422 naming what is wrong."""
    adapters_dir = service.store.adapters_dir
    adapters_dir.mkdir(mode=0o700, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".import.", suffix=".gguf", dir=adapters_dir)
    os.close(fd)
    tmp = Path(name)
    try:
        if body.gguf is not None:
            tmp.write_bytes(_b64(body.gguf, "gguf"))
            _check_gguf(service, tmp, "gguf")
        elif body.peft is not None:
            _convert_peft(service, body.peft.config, _b64(body.peft.safetensors, "peft.safetensors"), tmp)
        else:
            assert body.path is not None
            src = Path(body.path)
            if src.is_dir():
                try:
                    config = json.loads((src / "adapter_config.json").read_text())
                    data = (src / "adapter_model.safetensors").read_bytes()
                except (OSError, ValueError) as e:
                    raise _invalid([("path", f"not a PEFT folder (adapter_config.json, "
                                             f"adapter_model.safetensors): {e}")]) from None
                _convert_peft(service, config, data, tmp)
            elif src.is_file():
                tmp.write_bytes(src.read_bytes())
                _check_gguf(service, tmp, "path")
            else:
                raise _invalid([("path", f"{body.path!r}: no such file or folder on the server")])
        return tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _b64(text: str, param: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _invalid([(param, f"not base64: {e}")]) from None


def _check_gguf(service, path: Path, param: str) -> None:
    """A GGUF LoRA for this model's architecture (llama.cpp checks the tensors next)."""
    import gguf

    try:
        r = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure of untrusted bytes is the client's 422
        raise _invalid([(param, f"not a GGUF file: {type(e).__name__}: {e}")]) from None

    def value(key):
        f = r.get_field(key)
        return None if f is None else f.contents()

    if value("general.type") != "adapter" or value("adapter.type") != "lora":
        raise _invalid([(param, f"not a GGUF LoRA adapter (general.type={value('general.type')!r}, "
                                f"adapter.type={value('adapter.type')!r})")])
    arch = value("general.architecture")
    if arch != service.adapter_shape.arch:
        raise _invalid([(param, f"a LoRA for architecture {arch!r}; the resident model is "
                                f"{service.adapter_shape.arch!r}")])


def _convert_peft(service, config: dict, data: bytes, dst: Path) -> None:
    shape = service.adapter_shape
    try:
        factors, alpha = peft_to_factors(config, read_safetensors(data), shape.arch, shape.n_head, shape.n_head_kv)
        save_lora(dst, factors, alpha=alpha, model_arch=shape.arch)
    except (PeftError, ValueError) as e:
        raise _invalid([("peft", str(e))]) from None
