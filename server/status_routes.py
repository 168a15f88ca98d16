"""Service routes: /health, /slots, /props and /metrics."""
from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from dreamstage.server import metrics
from dreamstage.serving import rpc

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    engine = request.app.state.service.engine
    # "ok" only when the engine thread runs and its last iteration did not fail.
    # A failed RPC worker holds layers this process can no longer compute: failing, naming it.
    worker = rpc.failed_worker(request.app.state.service.model.config.rpc)
    failing = (f"the RPC worker at {worker} failed; restart it: this server loads the model again once it "
               "answers" if worker else engine.failing)
    status = "stopped" if not engine.running else ("failing" if failing else "ok")
    body = {"status": status, "slots": engine.n_seq,
            "slots_busy": engine.busy_slots(), "queue_depth": engine.queue_depth,
            "adapter_version": engine.adapter_version}
    if status == "failing":
        body["error"] = failing
    follower = request.app.state.service.follower
    if follower is not None:                 # a replica: its leader, lag and served versions (server/follow.py)
        body["follow"] = follower.status(detail=False)
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/slots")
async def slots(request: Request):
    service = request.app.state.service
    return {"slot_context": service.engine.slot_ctx, "n_ctx": service.model.n_ctx,
            "n_ctx_train": service.model.n_ctx_train, "context": context(service),
            "sampling_defaults_source": service.sampling_source, "slots": service.engine.slots_info()}


def context(service) -> dict:
    """The slots' context and how it was chosen (ResidentModel.context_plan); with a
    unified K/V, the pool's cells (reserved, cached, lent, free: Engine.pool_info)."""
    plan = {**service.model.context_plan.as_dict(), "slot_ctx": service.engine.slot_ctx,
            "n_ctx": service.model.n_ctx, "pool": service.engine.pool_info()}
    return {**plan, "output_buffer_reserved_mib": round(service.output_reserve_bytes / (1 << 20), 1)}


@router.get("/props")
async def props(request: Request):
    """llama-server's /props, the parts that hold here: the context and the sampling defaults."""
    service = request.app.state.service
    defaults = {k: v for k, v in asdict(service.sampling_defaults).items() if k != "grammar"}
    return {"default_generation_settings": {"n_ctx": service.engine.slot_ctx, "params": defaults},
            "total_slots": service.engine.n_seq, "model_path": str(service.model.model_path),
            "model_alias": service.model_id, "n_ctx_train": service.model.n_ctx_train,
            "sampling_defaults_source": service.sampling_source, "chat_template": service.chat.source}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(request: Request):
    return Response(metrics.render(request.app.state.metrics), media_type=metrics.CONTENT_TYPE)
