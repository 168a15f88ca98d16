"""Who may talk to the server, and from where: API key, cross-site writes, Host, CORS.

The server learns: whoever can POST to it can change what it says to everyone,
and that change survives a restart. So the guard sits in front of every route
as plain ASGI middleware (routes added later, the dashboard's included, are
covered without touching them):

- **API key.** With a key set, every request except `GET /health` and the
  dashboard's static page and assets (`GET /`, `/ui/*`) must carry
  `Authorization: Bearer <key>` (what the openai SDK sends). The comparison
  is constant time (`hmac.compare_digest`), so timing does not leak a prefix.
- **No cross-site writes.** A browser page may send a "simple" request (no
  preflight) to any origin: a POST with `text/plain`, a form type, or no body
  at all. Such a request cannot carry `Content-Type: application/json` or an
  `Authorization` header without a CORS preflight, which we do not answer
  unless an origin is allow-listed. Hence: a POST with a body must say
  `application/json`; a POST with an empty body (promote, rollback, cancel,
  pause, resume) must say `application/json` or carry the key.
- **Host check.** On a loopback bind, a page on evil.example whose DNS later
  resolves to 127.0.0.1 (DNS rebinding) reaches us as a same-origin request
  with `Host: evil.example`. Only loopback names (and `--allowed-host` names)
  are accepted there.
- **Origin check.** A write whose `Origin` header names another origin than
  the server's own (the Host it was sent to), or `null`, is refused, unless
  `--cors-origin` allows that origin. Clients that are not browsers send no
  Origin and are not affected.
- **CORS** is off unless `--cors-origin` names origins (then starlette's
  CORSMiddleware answers preflights for exactly those).
"""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dreamstage.server.errors import send_error
from dreamstage.server.tenants import SCOPED_PREFIXES, AdapterScope

# Routes reachable without the key: liveness, which changes nothing, and the
# dashboard's static page and assets, which hold no data. A browser cannot
# send a header with its first page load; the page asks for the key and sends
# it on every call it makes (/events and the API stay guarded).
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health"),
                         ("GET", "/"), ("GET", "/ui/app.js"), ("GET", "/ui/style.css")})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_and_port(header: str, default: str) -> tuple[str, str]:
    """'example.com:8080' -> ('example.com', '8080'); no port -> the scheme's default."""
    h = header.strip().lower()
    if h.startswith("["):
        name, _, rest = h[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif h.count(":") == 1:
        name, port = h.split(":")
    else:
        name, port = h, ""
    return name, port or default


def host_name(header: str) -> str:
    """'example.com:8080' -> 'example.com', '[::1]:8080' -> '::1' (lowercase)."""
    return _host_and_port(header, "")[0]


@dataclass(frozen=True)
class SecurityPolicy:
    api_key: str | None = None
    # Host names accepted in the Host header; None: no Host check (a public bind
    # sits behind whatever name its operator gives it).
    allowed_hosts: frozenset[str] | None = None
    # Origins other than the server's own whose pages may write (--cors-origin).
    allowed_origins: frozenset[str] = frozenset()
    # Keys scoped to adapter names (--api-keys, tenants.py); with any, a key is required.
    scoped_keys: Mapping[str, AdapterScope] = field(default_factory=dict, hash=False)

    @classmethod
    def for_bind(cls, host: str, api_key: str | None, extra_hosts=(),
                 scoped_keys: Mapping[str, AdapterScope] | None = None) -> SecurityPolicy:
        extra = frozenset(h.lower() for h in extra_hosts)
        scoped = dict(scoped_keys or {})
        if is_loopback(host):
            return cls(api_key or None, LOOPBACK_NAMES | extra, scoped_keys=scoped)
        # A public bind checks Host only when names are given (then the
        # loopback names too, so the machine itself can still call it).
        return cls(api_key or None, (LOOPBACK_NAMES | extra) if extra else None, scoped_keys=scoped)

    @property
    def keyed(self) -> bool:
        return self.api_key is not None or bool(self.scoped_keys)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def key_matches(authorization: str | None, key: str) -> bool:
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # The header was decoded as latin-1 (ASGI): back to its bytes, against the key's UTF-8 bytes.
    return hmac.compare_digest(token.strip().encode("latin-1"), key.encode("utf-8"))


class SecurityGuard:
    """ASGI middleware enforcing a SecurityPolicy before any route runs."""

    def __init__(self, app, policy: SecurityPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.check(scope)
        if refusal is not None:
            status, message, param, code, headers = refusal
            return await send_error(send, status, message, param, code, headers)
        await self.app(scope, receive, send)

    def check(self, scope):
        """None when the request may go on, else (status, message, param, code, headers)."""
        policy, method, path = self.policy, scope["method"], scope["path"]
        if policy.allowed_hosts is not None:
            host = _header(scope, b"host")
            if host is None or host_name(host) not in policy.allowed_hosts:
                return (403, f"Host {host!r} is not allowed on this server (allowed: "
                             f"{', '.join(sorted(policy.allowed_hosts))}; add names with --allowed-host)",
                        "host", "host_not_allowed", None)
        authorized = False
        if policy.keyed and (method, path) not in OPEN_ROUTES:
            authorization = _header(scope, b"authorization")
            if policy.api_key is not None and key_matches(authorization, policy.api_key):
                authorized = True
            else:
                tenant = next((s for k, s in policy.scoped_keys.items() if key_matches(authorization, k)), None)
                if tenant is None:
                    return (401, "missing or wrong API key: send Authorization: Bearer <key>", "authorization",
                            "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                if not path.startswith(SCOPED_PREFIXES):
                    return (404, f"no route {path}", None, "not_found", None)
                scope.setdefault("state", {})["adapter_scope"] = tenant
                authorized = True
        if method in _WRITE_METHODS:
            refusal = origin_refusal(scope, policy)
            if refusal is not None:
                return refusal
            media = _media_type(_header(scope, b"content-type"))
            if media != "application/json":
                if _has_body(scope):
                    return (415, f"content-type: expected application/json, got {media or 'none'}",
                            "content-type", "unsupported_media_type", None)
                if not authorized:
                    return (415, "content-type: a POST without a body needs Content-Type: application/json "
                                 "(or the API key), so that a web page cannot send it cross-site",
                            "content-type", "unsupported_media_type", None)
        return None


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def same_origin(origin: str, host: str | None) -> bool:
    """Whether `origin` (scheme://host[:port]) names the Host header's host and port."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or host is None:
        return False
    default = _DEFAULT_PORTS[parts.scheme]
    return (parts.hostname.lower(), str(port) if port is not None else default) == _host_and_port(host, default)


def origin_refusal(scope, policy: SecurityPolicy):
    """A refusal for a write sent by a page of another origin, else None."""
    origin = _header(scope, b"origin")
    if origin is None or origin.strip().rstrip("/") in policy.allowed_origins:
        return None
    if origin.strip() != "null" and same_origin(origin, _header(scope, b"host")):
        return None
    return (403, f"Origin {origin[:100]!r} may not change this server (a page of another site); "
                 "allow it with --cors-origin", "origin", "origin_not_allowed", None)


def _has_body(scope) -> bool:
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() not in ("", "0")
    return _header(scope, b"transfer-encoding") is not None


def install(app, policy: SecurityPolicy, cors_origins=()) -> None:
    """Add the guard, and CORS for the allow-listed origins (outermost, so a preflight is answered first)."""
    origins = frozenset(o.strip().rstrip("/") for o in cors_origins)
    app.add_middleware(SecurityGuard, policy=dataclasses.replace(policy, allowed_origins=origins))
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["X-Dreamstage-Adapter-Version"])
