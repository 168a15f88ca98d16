"""Records of served answers and feedback on them (`serve --record`; docs/architecture/feedback.md).

- `GET /v1/records?adapter=&limit=&before=`: the newest records first; `GET /v1/records/{id}`: one
  exchange's choices; `DELETE /v1/records/{id}`; `DELETE /adapters/{name}/records`.
- `POST /v1/feedback`: a correction, a rating or a preference on recorded answers (records/feedback.py);
  `GET /v1/feedback?adapter=&job=`: feedback and the job each went into; `DELETE /v1/feedback/{id}`: a pending
  item; `GET /v1/feedback/pending`: per adapter, its pending count and learning.
- `GET|PUT /adapters/{name}/learn`: an adapter's learning (`mode` manual | auto, `examples`, `minutes`) and
  its pending feedback; `POST /adapters/{name}/learn`: a job of its pending feedback now.

A key scoped to adapters (tenants.py) sees the records of its adapters only; the base model's records
(answers no adapter gave) belong to no scope. Anything outside the key's scope is a 404, as unknown.
"""
from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dreamstage.records.feedback import FeedbackRequest, ReplyRenderer, prompt_key, reply_entry
from dreamstage.records.store import LEARN_MODES, LearnMode, LearnSettings, ServedAnswer
from dreamstage.server.errors import APIError, strict_int
from dreamstage.server.tenants import AdapterScope, scope_of
from dreamstage.server.train_routes import _invalid, _json_object, _refused, _storage_error, service_with
from dreamstage.server.train_routes import adapter_name_in_scope as _name
from dreamstage.training.jobs.submit import SubmitRefused
from dreamstage.validation import field_errors

router = APIRouter()
log = logging.getLogger("dreamstage.records")
MAX_LIST = 1000


# -- recording (called by openai_routes) ---------------------------------------------------------
@dataclass
class Exchange:
    """One request being recorded: what was decoded, waiting for its answers."""

    records: Any
    kind: str
    prompt_tokens: list[list[int]]       # per choice (a batch of completion prompts has several)
    sampling: list[dict[str, Any]]       # per choice
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompts: list[str | None] | None = None   # per choice: a completion prompt's text (None: token ids)

    def answers(self, record_id: str, ends: list[tuple[str, Any]]) -> list[ServedAnswer]:
        """`ends`: per choice (its text, its Finished event)."""
        out = []
        for i, (text, fin) in enumerate(ends):
            a = fin.adapter
            out.append(ServedAnswer(record_id, i, self.kind, self.prompt_tokens[i], text, fin.finish_reason,  # type: ignore[arg-type]
                                    None if a.is_base else a.name, a.version, fin.adapter_version, self.sampling[i],
                                    self.messages, self.tools, self.prompts[i] if self.prompts else None))
        return out

    async def save(self, record_id: str, ends: list[tuple[str, Any]]) -> None:
        """Keep the answers, off the event loop. A store that cannot take them costs the record, not the answer."""
        try:
            await asyncio.to_thread(self.records.add, self.answers(record_id, ends))
        except Exception:
            log.exception("record %s not kept", record_id)


def _sampling(gen) -> dict[str, Any]:
    s = asdict(gen.sampling)
    s["logit_bias"] = [[t, b if math.isfinite(b) else "ban"] for t, b in gen.sampling.logit_bias]
    return {**s, "max_tokens": gen.max_tokens, "stop": list(gen.stop)}


def begin(service, body, kind: str, gens: list, **what: Any) -> Exchange | None:
    """The exchange to record for this request, or None: recording off, or the request said `"store": false`."""
    records = getattr(service, "records", None)
    if records is None or body.store is False:
        return None
    return Exchange(records, kind, [list(g.prompt) for g in gens], [_sampling(g) for g in gens], **what)


# -- helpers -----------------------------------------------------------------------------------------
def _records_service(request: Request):
    return service_with(request, "records", "recording is off: this server was started without --record (and a "
                        "state directory)", "recording_off")


def _visible(scope: AdapterScope, adapter: str | None) -> bool:
    return (not scope.scoped) if adapter is None else scope.allows(adapter)


def _record_id(raw: str) -> str:
    if not 1 <= len(raw) <= 200:
        raise APIError(422, "id: 1 to 200 characters", "id", "invalid_value")
    return raw


def _adapter_query(request: Request, adapter: str | None) -> None:
    """`?adapter=`: a name the key may touch, or "base" (the base model's, for an unscoped key); else 422/404."""
    if adapter == "base":
        if scope_of(request).scoped:
            raise APIError(404, "no adapter 'base' for this key", "adapter", "not_found")
    elif adapter is not None:
        _name(request, adapter, "adapter")


async def _store_call(fn, *args, what: str):
    try:
        return await asyncio.to_thread(fn, *args)
    except (OSError, sqlite3.Error) as e:
        raise _storage_error(e, what) from None


# -- records -----------------------------------------------------------------------------------------
@router.get("/v1/records")
async def list_records(request: Request, adapter: str | None = None, limit: str = "100", before: float | None = None):
    service = _records_service(request)
    scope = scope_of(request)
    n = strict_int(limit, "limit", 1, MAX_LIST)
    _adapter_query(request, adapter)
    got = await _store_call(service.records.recent, adapter, scope.names, n, before, what="records")
    on = service.records.policy
    return {"object": "list", "data": [a.view() for a in got], "recording": True,
            "retention": {"days": on.days, "mib": on.mib}}


def _own(request: Request, service, record_id: str) -> list[ServedAnswer]:
    got = [a for a in service.records.get(_record_id(record_id)) if _visible(scope_of(request), a.adapter)]
    if not got:
        raise APIError(404, f"no record {record_id!r}", "id", "not_found")
    return got


@router.get("/v1/records/{record_id}")
async def get_record(record_id: str, request: Request):
    service = _records_service(request)
    got = await asyncio.to_thread(_own, request, service, record_id)
    return {"id": record_id, "object": "list", "data": [a.view() for a in got]}


@router.delete("/v1/records/{record_id}")
async def delete_record(record_id: str, request: Request):
    service = _records_service(request)
    got = await asyncio.to_thread(_own, request, service, record_id)
    n = await _store_call(service.records.delete, got[0].id, what="records")
    return {"id": record_id, "deleted": n}


@router.delete("/adapters/{name}/records")
async def delete_adapter_records(name: str, request: Request):
    service = _records_service(request)
    name = _name(request, name)
    n = await _store_call(service.records.delete_adapter, name, what="records")
    return {"adapter": name, "deleted": n}


# -- feedback ----------------------------------------------------------------------------------------
# pydantic names the member of a union an error came from (`preferred.AnswerRef`); the field is the client's
_UNION_TAGS = (".AnswerRef", ".constrained-str")


def feedback_errors(e: ValidationError) -> list[tuple[str, str]]:
    """Each error's field; a cross-field message "rejected: ..." names its field."""
    out = []
    for path, msg in field_errors(e):
        for tag in _UNION_TAGS:
            path = path.replace(tag, "")
        head, sep, rest = msg.partition(": ")
        out.append((head, rest) if path == "body" and sep and head in FeedbackRequest.model_fields else (path, msg))
    return out


def _answer_of(request: Request, service, ref, param: str) -> ServedAnswer:
    a = service.records.answer(ref.id, ref.index)
    if a is None or not _visible(scope_of(request), a.adapter):
        where = f" choice {ref.index}" if ref.index else ""
        raise APIError(404, f"no record {ref.id!r}{where}", param, "not_found")
    return a


def _target(request: Request, service, a: ServedAnswer, param: str) -> str:
    """The adapter the feedback trains: the one that answered, or for the base model's answers the server's
    learning adapter (--learn-adapter). 409 when the adapter that answered has been deleted since."""
    if a.adapter is None:
        return service.settings.learn_adapter
    if a.adapter not in service.store.resident_names():
        raise APIError(409, f"the answer came from adapter {a.adapter!r}, which has been deleted (DELETE "
                            f"/adapters/{a.adapter}); its feedback has nothing to train. Promote a version of it "
                            "again to give feedback on its answers", param, "adapter_deleted")
    return a.adapter


def _prepare(request: Request, service, fb: FeedbackRequest) -> tuple[str, str, str, dict[str, Any]]:
    """(adapter, record id, prompt key, body) of one feedback item; raises APIError naming the field."""
    replies: ReplyRenderer = service.reply_renderer
    if fb.kind == "preference":
        good, bad = (_answer_of(request, service, fb.ref(k), k) for k in ("preferred", "rejected"))
        if fb.ref("preferred") == fb.ref("rejected"):
            raise APIError(422, "rejected: the same answer as preferred", "rejected", "invalid_value")
        adapter = _target(request, service, good, "preferred")
        if _target(request, service, bad, "rejected") != adapter or good.prompt_tokens != bad.prompt_tokens:
            raise APIError(422, "rejected: not an answer to the same prompt by the same adapter as preferred",
                           "rejected", "invalid_value")
        pairs = [(good, good.answer, "preferred"), (bad, bad.answer, "rejected")]
        first = good
    else:
        first = _answer_of(request, service, fb.ref(), "id")
        adapter = _target(request, service, first, "id")
        text = fb.correction if fb.correction is not None else first.answer
        pairs = [(first, text, "correction" if fb.correction is not None else "id")]
    out = []
    for a, text, param in pairs:
        if not text.strip():
            raise APIError(422, f"{param}: the answer is empty; nothing to train", param, "invalid_value")
        try:
            tokens = replies.reply_tokens(a, text)
        except ValueError as e:
            raise APIError(422, f"{param}: the reply cannot be rendered: {e}", param, "invalid_value") from None
        extra = {"rating": fb.rating} if fb.rating is not None else {}
        out.append(reply_entry(a, text, tokens, **extra))
    prompt_text = service.model.detokenize(first.prompt_tokens, special=True)
    body = {"prompt": first.prompt_tokens, "prompt_text": prompt_text, "replies": out}
    return adapter, first.id, prompt_key(adapter, first.prompt_tokens), body


@router.post("/v1/feedback")
async def post_feedback(request: Request):
    service = _records_service(request)
    if not scope_of(request).train:
        raise APIError(403, "this key may not train, and feedback trains", None, "forbidden")
    raw = await _json_object(request, required=True)
    try:
        fb = FeedbackRequest.model_validate(raw)
    except ValidationError as e:
        raise _invalid(feedback_errors(e)) from None
    adapter, record_id, key, body = await asyncio.to_thread(_prepare, request, service, fb)
    fid = await _store_call(service.records.add_feedback, adapter, record_id, fb.kind, key, body, what="feedback")
    service.learner.notify()
    view = await asyncio.to_thread(learn_view, service, adapter)
    return {"id": fid, "object": "feedback", "kind": fb.kind, "adapter": adapter, "record_id": record_id,
            "pending": view["pending"], "learn": {k: view[k] for k in ("mode", "examples", "minutes")}}


@router.get("/v1/feedback")
async def list_feedback(request: Request, adapter: str | None = None, job: str | None = None, limit: str = "100"):
    service = _records_service(request)
    scope = scope_of(request)
    _adapter_query(request, adapter)            # "base": none (feedback trains an adapter)
    if adapter is None and scope.scoped:
        raise APIError(422, "adapter: a scoped key lists one adapter's feedback at a time", "adapter",
                       "invalid_value")
    job_id = strict_int(job, "job", 1) if job is not None else None
    got = await asyncio.to_thread(service.records.feedback, adapter, job_id, strict_int(limit, "limit", 1, MAX_LIST))
    return {"object": "list", "data": [f.view() for f in got]}


@router.delete("/v1/feedback/{feedback_id}")
async def delete_feedback(feedback_id: str, request: Request):
    """A pending item (one a job has taken is part of that job, as a POST /train example is)."""
    service = _records_service(request)
    fid = strict_int(feedback_id, "id", 1)
    item = await asyncio.to_thread(service.records.feedback_item, fid)
    if item is None or not scope_of(request).allows(item.adapter):
        raise APIError(404, f"no feedback {fid}", "id", "not_found")
    if not await _store_call(service.records.delete_pending, fid, what="feedback"):
        raise APIError(409, f"feedback {fid} is in job {item.job_id}; only pending feedback can be deleted", "id",
                       "feedback_in_job")
    return {"id": fid, "deleted": True}


@router.get("/v1/feedback/pending")
async def pending_feedback(request: Request):
    """Per adapter the key may see: pending feedback and its learning (what the dashboard shows)."""
    service = _records_service(request)
    scope = scope_of(request)
    records = service.records
    counts = records.pending_counts()
    names = sorted(n for n in set(counts) | set(records.auto_names()) if scope.allows(n))
    return {"learn_adapter": service.settings.learn_adapter,
            "pending": {n: {"count": counts.get(n, (0, None))[0], "last": counts.get(n, (0, None))[1],
                            **asdict(records.learning(n))} for n in names}}


# -- learning ----------------------------------------------------------------------------------------
class LearnBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    mode: LearnMode | None = None
    examples: int | None = Field(None, ge=1, le=100_000)
    minutes: float | None = Field(None, gt=0, le=525_600)


def learn_view(service, name: str) -> dict[str, Any]:
    count, last = service.records.pending_counts().get(name, (0, None))
    return {"name": name, **asdict(service.records.learning(name)), "modes": list(LEARN_MODES),
            "pending": count, "last_feedback": last, "open_job": service.records.open_job(name),
            "versions_learned": {str(v): ids for v, ids in service.records.versions_learned(name).items()}}


@router.get("/adapters/{name}/learn")
async def get_learn(name: str, request: Request):
    service = _records_service(request)
    return await asyncio.to_thread(learn_view, service, _name(request, name))


@router.put("/adapters/{name}/learn")
async def put_learn(name: str, request: Request):
    service = _records_service(request)
    name = _name(request, name)
    try:
        body = LearnBody.model_validate(await _json_object(request, required=True))
    except ValidationError as e:
        raise _invalid(field_errors(e)) from None
    old = service.records.learning(name)
    new = LearnSettings(body.mode or old.mode, body.examples or old.examples, body.minutes or old.minutes)
    await _store_call(service.records.set_learning, name, new, what="learning")
    service.learner.notify()
    return await asyncio.to_thread(learn_view, service, name)


@router.post("/adapters/{name}/learn", status_code=202)
async def post_learn(name: str, request: Request):
    service = _records_service(request)
    name = _name(request, name)
    if not scope_of(request).train:
        raise APIError(403, "this key may not train", None, "forbidden")
    try:
        job = await asyncio.to_thread(service.learner.learn, name)
    except SubmitRefused as e:
        raise _refused(e) from None
    except LookupError as e:                 # an item deleted while the job was made: nothing was stored
        raise APIError(409, f"{e}; retry", "name", "feedback_changed") from None
    if job is None:
        raise APIError(409, f"adapter {name!r} has no pending feedback", "name", "nothing_pending")
    return {"id": job["id"], "state": job["state"], **await asyncio.to_thread(learn_view, service, name)}
