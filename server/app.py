"""The app: middleware and routers, wired; each route lives in its role's module.

- openai_routes.py: /v1/chat/completions, /v1/completions, /v1/models; responses.py: /v1/responses;
- train_routes.py: /train; adapter_routes.py: /adapters;
- events.py: /events, the live stream; dashboard.py: the page at /;
- status_routes.py: /health, /slots, /props, /metrics;
- token_routes.py: /tokenize, /detokenize (llama-server's shapes);
- embedding_routes.py: /v1/embeddings (with --embeddings);
- record_routes.py: /v1/records, /v1/feedback, /adapters/{name}/records and /learn (with --record);
- follow.py: with --follow, the follow channel and the guard that sends training to the leader.
Lifecycle lives in service.py, request models in schemas.py, errors in errors.py.
"""
from __future__ import annotations

from fastapi import FastAPI

from dreamstage.server import errors, metrics, openapi, security
from dreamstage.server.adapter_routes import router as adapter_router
from dreamstage.server.dashboard import router as dashboard_router
from dreamstage.server.embedding_routes import router as embedding_router
from dreamstage.server.events import router as events_router
from dreamstage.server.follow import FollowerGuard
from dreamstage.server.middleware import BodyGuard
from dreamstage.server.openai_routes import router as openai_router
from dreamstage.server.record_routes import router as record_router
from dreamstage.server.response_store import ResponseStore
from dreamstage.server.responses import router as responses_router
from dreamstage.server.service import Service
from dreamstage.server.status_routes import router as status_router
from dreamstage.server.token_routes import router as token_router
from dreamstage.server.train_routes import router as train_router


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="dreamstage", version="0.1.0")
    app.state.service = service
    app.state.response_store = ResponseStore()      # /v1/responses kept for previous_response_id
    app.state.metrics = metrics.registry(service)
    errors.install(app)
    # Outermost first when a request arrives: CORS (if allow-listed), the
    # security guard (Host, key, content type), then the body checks.
    if service.follower is not None:            # innermost: after the key is checked
        app.add_middleware(FollowerGuard, leader=service.follower.leader)
    app.add_middleware(BodyGuard, max_bytes=service.settings.max_body_bytes)
    security.install(app, service.settings.security(), service.settings.cors_origins)
    for router in (openai_router, responses_router, record_router, embedding_router, token_router, train_router,
                   adapter_router, events_router, dashboard_router, status_router):
        app.include_router(router)
    openapi.install(app)
    return app
