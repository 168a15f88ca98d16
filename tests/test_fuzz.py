"""Schemathesis against the server's own OpenAPI document (server/openapi.py).

Every operation gets at least 100 generated requests (the two completion
routes and POST /train 75), valid and invalid, in-process through ASGI (no sockets):
each operation's cases reach every status a run of 300 reached (all by its 58th case). The server runs the tiny model
(tests/tiny_model.py: the default tokenizer and chat template, a 2-layer
transformer), so completions and training jobs run for real but fast.

Checks: every one schemathesis has (ALL_CHECKS): no 5xx; every status code,
content type, header and body is one the document declares; a request the
document calls invalid is refused (4xx) and one it calls valid is accepted,
except for the refusals REFUSED_WHEN_VALID names; unsupported methods get
405, and a request without the key gets 401.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.python import asgi

from dreamstage.server.app import create_app
from dreamstage.server.service import Service
from dreamstage.server.settings import JobLimits, ServerSettings

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CASES = 100
# The completion routes' bodies are the largest schemas (generating them is most of their time);
# valid /train bodies queue jobs that train on the shared server.
FEWER_CASES = {"POST /v1/chat/completions": 75, "POST /v1/completions": 75, "POST /v1/responses": 75,
               "POST /train": 75}
load_all_checks()
ALL_CHECKS = CHECKS.get_all()


@pytest.fixture(scope="module")
def service(tiny_model_path, tmp_path_factory):
    # max_queue: an embeddings body of 64 inputs queues 64 requests at once (beyond the queue, a 503).
    settings = ServerSettings(model=str(tiny_model_path), ctx=512, parallel=2, threads=1, api_key=KEY,
                              state_dir=str(tmp_path_factory.mktemp("fuzz-state")), max_queue=72, embeddings=True,
                              record=True,
                              allowed_hosts=(asgi.HOST,),      # the in-process client's Host name
                              limits=JobLimits(max_queued_jobs=2, max_job_tokens=20_000))
    svc = Service(settings).start()
    yield svc
    svc.close()


# Schema-valid requests this server may still refuse, by operation: what the
# body asks of the model or the server's state, which no schema can say
# (a prompt longer than a slot's context, a job over the server's token limit).
REFUSED_WHEN_VALID: dict[str, list[int]] = {
    "POST /v1/chat/completions": [400],    # the prompt past a slot's context; a token id past the vocabulary
    "POST /v1/completions": [400],
    "POST /v1/responses": [400, 404],      # as chat; a previous_response_id not kept
    "POST /v1/embeddings": [400],
    "POST /tokenize": [400],               # a token id past the vocabulary
    "POST /detokenize": [400],
    "POST /train": [413, 422],             # past the job limits; cross-field checks (targets, walks, windows)
}


@pytest.fixture(scope="module")
def api_schema(service):
    default = ["2xx", "3xx", 401, 403, 404, 409, 429, "5xx"]
    config = SchemathesisConfig.from_dict({
        "output": {"sanitization": {"enabled": False}},      # a failure shows the body as sent (the key is a test's)
        "operations": [{"include-name": label, "checks": {"positive_data_acceptance": {
            "expected-statuses": default + codes}}} for label, codes in REFUSED_WHEN_VALID.items()]})
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(service), headers=AUTH, config=config)


# The operations to fuzz: every one the document lists today.
# Each is its own test, so a failure names the route. (schemathesis's own pytest
# plugin does not run under pytest 9, hence the explicit strategy per operation.)
OPERATIONS = [
    "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health", "GET /slots",
    "GET /metrics", "POST /train", "GET /train", "GET /train/{job_id}", "GET /train/{job_id}/receipts",
    "POST /train/{job_id}/cancel", "POST /train/{job_id}/pause", "POST /train/{job_id}/resume", "GET /adapters",
    "POST /adapters/{name}/promote", "POST /adapters/rollback", "POST /tokenize", "POST /detokenize", "GET /props",
    "GET /adapters/{name}", "POST /adapters/{name}/rollback", "DELETE /adapters/{name}",
    "GET /adapters/{name}/versions/{version}", "POST /v1/embeddings",
    "GET /v1/records", "GET /v1/records/{record_id}", "DELETE /v1/records/{record_id}",
    "DELETE /adapters/{name}/records", "POST /v1/feedback", "GET /v1/feedback", "GET /v1/feedback/pending",
    "DELETE /v1/feedback/{feedback_id}", "GET /adapters/{name}/learn", "PUT /adapters/{name}/learn",
    "POST /adapters/{name}/learn", "POST /v1/responses", "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}", "GET /v1/models/{model_id}",
]


@pytest.mark.parametrize("label", OPERATIONS)
def test_every_operation_answers_what_its_schema_says(api_schema, label):
    method, path = label.split(" ", 1)
    calls = []
    cases = FEWER_CASES.get(label, CASES)

    @given(case=api_schema[path][method].as_strategy())
    @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        calls.append(case.call_and_validate(headers=AUTH, checks=ALL_CHECKS).status_code)
    run()
    if label == "POST /train":
        _cancel_the_jobs_left(api_schema)
    spec = api_schema.raw_schema["paths"][path][method.lower()]
    if spec.get("parameters") or spec.get("requestBody"):
        assert len(calls) >= cases, f"{label}: only {len(calls)} cases ran"
    else:
        assert calls, label          # no inputs: there is exactly one request to make
    RESULTS[label] = calls


RESULTS: dict[str, list[int]] = {}


def _cancel_the_jobs_left(api_schema) -> None:
    """The jobs the fuzzed bodies queued would train through every later operation (a promotion
    waits for the step running): cancelled through the API, the server is idle again."""
    from fastapi.testclient import TestClient
    http = TestClient(api_schema.app, base_url=f"http://{asgi.HOST}", headers=AUTH)
    view = http.get("/train").json()
    for job in [view["current"], *view["queue"]]:
        if job:
            assert http.post(f"/train/{job['id']}/cancel").status_code in (200, 409), job["id"]
    assert not (view := http.get("/train").json())["current"] and not view["queue"], view


def test_fuzz_summary():
    """Cases and statuses per operation (the reliability table in docs/ quotes a run of this)."""
    from collections import Counter
    for label, calls in RESULTS.items():
        print(f"{label}: {len(calls)} cases, statuses {dict(sorted(Counter(calls).items()))}")
    assert all(code < 500 for calls in RESULTS.values() for code in calls)


def test_the_run_uses_every_check_schemathesis_has():
    names = {c.__name__ for c in ALL_CHECKS}
    assert {"not_a_server_error", "status_code_conformance", "content_type_conformance",
            "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
            "positive_data_acceptance", "unsupported_method", "ignored_auth"} <= names, names


def test_every_listed_operation_is_in_the_document(api_schema):
    # A subset, not equality: a route added later (the dashboard's endless
    # event stream, say) cannot be fuzzed blindly; add it to OPERATIONS when
    # it can.
    documented = {r.ok().label for r in api_schema.get_all_operations()}
    assert set(OPERATIONS) <= documented, set(OPERATIONS) - documented


def test_the_document_declares_real_bodies_and_statuses(api_schema):
    doc = api_schema.raw_schema
    train = doc["paths"]["/train"]["post"]
    assert train["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TrainRequest"}
    assert "examples" in doc["components"]["schemas"]["TrainRequest"]["properties"]
    promote = doc["paths"]["/adapters/{name}/promote"]["post"]
    assert promote["requestBody"]["required"] is False
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and "400" in chat and "text/event-stream" in chat["200"]["content"]
    assert {"401", "413", "415", "422", "507"} <= set(train["responses"])
    job = train["responses"]["202"]["content"]["application/json"]["schema"]
    assert {"id", "state"} <= set(job["required"]) and "200" not in train["responses"]
