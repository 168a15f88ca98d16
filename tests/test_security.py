"""The server's guard: API key, no cross-site writes, Host check, CORS (server/security.py).

The policy matrix runs against a stub ASGI app (fast, no model); the end to
end checks run the real server with a key and training on.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
from background_server import BackgroundServer
from fastapi import FastAPI, Request

from dreamstage.server import security
from dreamstage.server.security import SecurityPolicy, host_name, is_loopback
from dreamstage.server.settings import ServerSettings

KEY = "s3cret-key"
JSON = {"Content-Type": "application/json"}


def stub_app(policy: SecurityPolicy, cors=()) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/")
    async def page():
        return {"page": True}

    @app.get("/events")
    async def events():
        return {"events": True}

    @app.post("/train")
    async def train(request: Request):
        return {"got": (await request.body()).decode()}

    @app.post("/adapters/rollback")
    async def rollback():
        return {"rolled": True}

    security.install(app, policy, cors)
    return app


def call(app, method, path, host="127.0.0.1:8080", **kw):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


LOOPBACK_KEYED = SecurityPolicy.for_bind("127.0.0.1", KEY)
LOOPBACK_OPEN = SecurityPolicy.for_bind("127.0.0.1", None)


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/train"), ("POST", "/adapters/rollback")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x"])
def test_a_keyed_server_refuses_requests_without_the_right_key(method, path, auth):
    headers = {**JSON, **({"Authorization": auth} if auth else {})}
    r = call(stub_app(LOOPBACK_KEYED), method, path, headers=headers, content=b"{}" if method == "POST" else None)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_every_route_and_health_needs_none():
    app = stub_app(LOOPBACK_KEYED)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/v1/models", headers=auth).status_code == 200
    assert call(app, "POST", "/train", headers={**auth, **JSON}, content=b'{"a": 1}').json() == {"got": '{"a": 1}'}
    # with the key, an empty-body state change needs no content type
    assert call(app, "POST", "/adapters/rollback", headers=auth).json() == {"rolled": True}


def test_the_dashboard_page_loads_without_the_key_but_its_data_does_not():
    """A browser's first load of the page cannot carry a header; the page holds
    no data and asks for the key, which every call it makes then carries."""
    app = stub_app(LOOPBACK_KEYED)
    assert call(app, "GET", "/").status_code == 200
    assert call(app, "GET", "/events").status_code == 401
    assert call(app, "POST", "/", headers=JSON, content=b"{}").status_code in (401, 405)
    assert call(app, "GET", "/", headers={"Host": "evil.example"}).status_code == 403   # the Host check still applies


def test_a_non_ascii_key_works():
    app = stub_app(SecurityPolicy.for_bind("127.0.0.1", "clé-ü"))
    good = {"Authorization": "Bearer " + "clé-ü".encode().decode("latin-1")}   # the header's bytes are UTF-8
    assert call(app, "GET", "/v1/models", headers={k: v.encode("latin-1") for k, v in good.items()}).status_code == 200
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer cle-u"}).status_code == 401


def test_keys_are_compared_in_constant_time(monkeypatch):
    seen = []

    def spy(a, b):
        seen.append((a, b))
        return a == b
    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    app = stub_app(LOOPBACK_KEYED)
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert seen == [(b"nope", KEY.encode())]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("policy", [LOOPBACK_OPEN, LOOPBACK_KEYED], ids=["no-key", "key"])
def test_a_write_with_a_body_must_be_json(content_type, policy):
    # What a web page can send without a preflight: text/plain, forms, or no type.
    headers = {"Authorization": f"Bearer {KEY}"} if policy.api_key else {}
    if content_type:
        headers["Content-Type"] = content_type
    r = call(stub_app(policy), "POST", "/train", headers=headers,
             content=b'{"text": "x", "promote": "auto"}')
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"


def test_an_empty_state_change_needs_json_or_the_key():
    app = stub_app(LOOPBACK_OPEN)
    for headers in ({}, {"Content-Type": "text/plain"}):
        r = call(app, "POST", "/adapters/rollback", headers=headers)
        assert r.status_code == 415, headers
    assert call(app, "POST", "/adapters/rollback", headers=JSON).json() == {"rolled": True}


@pytest.mark.parametrize("host,ok", [("127.0.0.1:8080", True), ("localhost", True), ("LOCALHOST:1", True),
                                     ("[::1]:8080", True), ("evil.example", False), ("evil.example:8080", False),
                                     ("127.0.0.1.evil.example", False), ("", False)])
def test_loopback_binds_check_the_host_header_against_dns_rebinding(host, ok):
    r = call(stub_app(LOOPBACK_OPEN), "GET", "/health", headers={"Host": host})
    assert (r.status_code == 200) == ok
    if not ok:
        assert r.status_code == 403 and r.json()["error"]["param"] == "host"


def test_allowed_hosts_extend_the_loopback_names_and_public_binds_do_not_check():
    app = stub_app(SecurityPolicy.for_bind("127.0.0.1", None, ["box.lan"]))
    assert call(app, "GET", "/health", headers={"Host": "box.lan:8080"}).status_code == 200
    assert call(app, "GET", "/health", headers={"Host": "other.lan"}).status_code == 403
    public = stub_app(SecurityPolicy.for_bind("0.0.0.0", KEY))
    assert call(public, "GET", "/health", headers={"Host": "anything.example"}).status_code == 200
    named = stub_app(SecurityPolicy.for_bind("0.0.0.0", KEY, ["api.example"]))
    assert call(named, "GET", "/health", headers={"Host": "api.example"}).status_code == 200
    assert call(named, "GET", "/health", headers={"Host": "127.0.0.1:8080"}).status_code == 200
    assert call(named, "GET", "/health", headers={"Host": "other.example"}).status_code == 403


def test_no_cors_headers_unless_an_origin_is_allow_listed():
    origin = {"Origin": "https://evil.example"}
    plain = stub_app(LOOPBACK_OPEN)
    r = call(plain, "GET", "/health", headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    assert "access-control-allow-origin" not in call(plain, "OPTIONS", "/train", headers=pre).headers
    listed = stub_app(LOOPBACK_KEYED, cors=["https://app.example"])
    ok = call(listed, "OPTIONS", "/train", headers={**pre, "Origin": "https://app.example",
                                                    "Access-Control-Request-Headers": "authorization,content-type"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = call(listed, "OPTIONS", "/train", headers=pre)
    assert bad.headers.get("access-control-allow-origin") != "https://evil.example"


def test_binds_and_host_names():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.2")
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM:1") == "example.com"


def test_training_on_a_public_bind_needs_a_key():
    with pytest.raises(ValueError, match="--api-key"):
        ServerSettings(host="0.0.0.0", state_dir="/tmp/x")
    ServerSettings(host="0.0.0.0", state_dir="/tmp/x", api_key=KEY)
    ServerSettings(host="0.0.0.0", state_dir=None)      # --no-train


def test_the_cli_refuses_a_public_bind_with_training_and_no_key(tmp_path, capsys, monkeypatch):
    from dreamstage import cli
    monkeypatch.delenv("DREAMSTAGE_API_KEY", raising=False)
    assert cli.main(["serve", "--host", "0.0.0.0", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a loopback address" in err and "--no-train" in err
    assert not any(tmp_path.iterdir())          # nothing was created: it stopped before the model and the store


# -- end to end: the real server with a key and training on -----------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    settings = ServerSettings(ctx=512, parallel=1, threads=1, api_key=KEY,
                              state_dir=str(tmp_path_factory.mktemp("state")))
    with BackgroundServer(settings) as srv:
        yield srv


def test_keyed_server_end_to_end(keyed):
    url = keyed.url
    assert httpx.get(f"{url}/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/slots"), ("GET", "/train"),
                         ("GET", "/adapters"), ("GET", "/openapi.json"), ("POST", "/adapters/rollback"),
                         ("POST", "/train/1/cancel")]:
        r = httpx.request(method, f"{url}{path}", headers=JSON)
        assert r.status_code == 401, (method, path)
    # a cross-site text/plain POST /train is refused, with or without a key
    body = b'{"text": "the moon is made of cheese", "promote": "auto"}'
    r = httpx.post(f"{url}/train", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 401
    r = httpx.post(f"{url}/train", content=body,
                   headers={"Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 415
    assert keyed.service.store.overview() == {"current": None, "queue": []}


def test_keyed_server_serves_the_openai_sdk_and_our_client(keyed):
    import openai

    from dreamstage.client import Client
    sdk = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY)
    out = sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                      temperature=0)
    assert out.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong").models.list()
    with Client(keyed.url, api_key=KEY) as c:
        assert c.adapters()["served_version"] == 0
        assert c.train_overview()["queue"] == []


@pytest.mark.parametrize("origin,ok", [
    (None, True),                                   # not a browser: no Origin
    ("http://127.0.0.1:8080", True),                # the server's own page (the dashboard)
    ("https://127.0.0.1:8080", True),               # host and port are ours (TLS may end at a proxy)
    ("http://127.0.0.1:8081", False), ("http://localhost:8080", False), ("http://evil.example", False),
    ("http://evil.example:8080", False), ("null", False), ("file://", False), ("not a url", False),
])
def test_a_write_from_a_page_of_another_origin_is_refused(origin, ok):
    app = stub_app(LOOPBACK_OPEN)
    headers = {**JSON, **({"Origin": origin} if origin else {})}
    r = call(app, "POST", "/train", json={"text": "x"}, headers=headers)
    assert r.status_code == (200 if ok else 403), r.text
    if not ok:
        assert r.json()["error"]["param"] == "origin" and r.json()["error"]["code"] == "origin_not_allowed"
    # reads are not writes: the browser's same-origin policy keeps their answers from the page
    assert call(app, "GET", "/v1/models", headers=headers).status_code == 200


def test_an_allow_listed_origin_may_write_and_default_ports_match():
    app = stub_app(LOOPBACK_KEYED, cors=["https://app.example/"])
    keyed = {**JSON, "Authorization": f"Bearer {KEY}"}
    assert call(app, "POST", "/train", json={}, headers={**keyed, "Origin": "https://app.example"}).status_code == 200
    assert call(app, "POST", "/train", json={}, headers={**keyed, "Origin": "https://other.example"}).status_code == 403
    own = stub_app(SecurityPolicy.for_bind("0.0.0.0", None))
    assert call(own, "POST", "/train", host="api.example", json={},
                headers={**JSON, "Origin": "http://api.example"}).status_code == 200
    assert call(own, "POST", "/train", host="api.example:80", json={},
                headers={**JSON, "Origin": "http://api.example"}).status_code == 200
