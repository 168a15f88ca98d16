"""Connections at the edge (server/connections.py, issue 49): limits in all and
per client address, head and body timeouts, bounded logging, the descriptor
limit. A tiny ASGI app behind the real guarded protocol: no model needed.
The same protocol in front of the real server: tests/test_hostile.py."""
from __future__ import annotations

import logging
import resource
import socket
import threading
import time

import pytest
import uvicorn

from dreamstage.server.connections import (
    BoundedLog,
    ConnectionLimits,
    EdgeLog,
    fds_in_use,
    raise_fd_limit,
    uvicorn_config,
)
from dreamstage.server.settings import ServerSettings

LIMITS = ConnectionLimits(max_connections=40, max_per_client=8, header_timeout_s=0.6, body_timeout_s=0.6,
                          keep_alive_s=5, fd_reserve=16)


async def echo_app(scope, receive, send):
    """Reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    n, more = 0, True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        n += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    body = str(n).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EdgeServer:
    def __init__(self, limits: ConnectionLimits = LIMITS):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn_config(echo_app, limits, log_level="warning", lifespan="off")
        self.book = config.connection_book
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.02)

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", self.port))
        return s

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def edge():
    srv = EdgeServer()
    yield srv
    srv.close()


def ask(s: socket.socket, body: bytes = b"abc") -> bytes:
    s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return read_response(s)


def read_response(s: socket.socket) -> bytes:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        if not chunk:
            return got
        got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += s.recv(4096)
    return head + b"\r\n\r\n" + rest


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_half_open_connections_past_the_per_client_limit_are_refused_and_others_are_served(edge):
    kept = edge.connect("127.0.0.2")
    assert ask(kept).endswith(b"\r\n\r\n3")                    # a keep-alive client of the attacker's address
    idle = [edge.connect("127.0.0.2") for _ in range(LIMITS.max_per_client - 1)]   # half-open: never send
    wait_for(lambda: edge.book.per_client["127.0.0.2"] == LIMITS.max_per_client)
    over = edge.connect("127.0.0.2")
    assert read_response(over).startswith(b"HTTP/1.1 503") and over.recv(10) == b""   # answered and closed, unread
    assert edge.book.log.totals["refused (max_connections_per_client)"] == 1
    other = edge.connect("127.0.0.3")                          # another address: served
    assert ask(other).startswith(b"HTTP/1.1 200")
    assert ask(kept).startswith(b"HTTP/1.1 200")               # the same address, on its open connection
    for s in idle + [kept, other, over]:
        s.close()
    wait_for(lambda: edge.book.open == 0)
    assert ask(edge.connect("127.0.0.2")).startswith(b"HTTP/1.1 200")   # its places came back


def test_past_max_connections_every_address_is_refused(edge):
    held = [edge.connect(f"127.0.1.{i}") for i in range(LIMITS.max_connections)]
    wait_for(lambda: edge.book.open == LIMITS.max_connections)
    assert read_response(edge.connect("127.0.2.1")).startswith(b"HTTP/1.1 503")
    held.pop().close()
    wait_for(lambda: edge.book.open == LIMITS.max_connections - 1)
    assert ask(edge.connect("127.0.2.1")).startswith(b"HTTP/1.1 200")
    for s in held:
        s.close()


def test_a_slowloris_head_is_cut_at_the_header_timeout(edge):
    s = edge.connect()
    t0 = time.monotonic()
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    got = b""
    with pytest.raises(OSError):                               # the server closes it: a send fails or reads EOF
        while time.monotonic() - t0 < 5:
            s.sendall(b"X-a: b\r\n")                           # a header line every 50 ms, never the end
            time.sleep(0.05)
            s.setblocking(False)
            try:
                chunk = s.recv(4096)
            except BlockingIOError:
                chunk = None
            s.setblocking(True)
            if chunk is not None:
                got += chunk
                if not chunk:
                    raise ConnectionResetError("closed")
    took = time.monotonic() - t0
    assert LIMITS.header_timeout_s <= took < LIMITS.header_timeout_s + 1.5
    assert got.startswith(b"HTTP/1.1 408") or got == b""
    assert edge.book.log.totals["head timeouts"] == 1


def test_a_connection_that_never_sends_is_cut_at_the_header_timeout(edge):
    s = edge.connect()
    t0 = time.monotonic()
    assert read_response(s).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 >= LIMITS.header_timeout_s - 0.05
    wait_for(lambda: edge.book.open == 0)


def test_a_slow_body_is_cut_at_the_body_timeout_and_a_kept_alive_connection_gets_a_new_head_timer(edge):
    s = edge.connect()
    s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"a" * 10)
    t0 = time.monotonic()
    assert read_response(s).startswith(b"HTTP/1.1 408")        # nothing of a response was sent yet
    assert s.recv(10) == b""
    assert LIMITS.body_timeout_s - 0.05 <= time.monotonic() - t0 < LIMITS.body_timeout_s + 1.5
    assert edge.book.log.totals["body timeouts"] == 1
    k = edge.connect()
    for _ in range(3):                                         # requests far apart in all, each one quick
        assert ask(k).startswith(b"HTTP/1.1 200")
        time.sleep(LIMITS.header_timeout_s / 2)
    k.sendall(b"GET / HTTP/1.1\r\n")                           # then one that stalls mid-head
    assert read_response(k).startswith(b"HTTP/1.1 408")


def test_a_flood_of_refusals_logs_a_few_lines_with_counts(edge, caplog):
    caplog.set_level(logging.WARNING, logger="dreamstage.server.connections")
    held = [edge.connect("127.0.0.5") for _ in range(LIMITS.max_per_client)]
    wait_for(lambda: edge.book.per_client["127.0.0.5"] == LIMITS.max_per_client)
    for _ in range(300):
        edge.connect("127.0.0.5").close()
    wait_for(lambda: edge.book.log.totals["refused (max_connections_per_client)"] == 300)
    edge.book.log.flush()
    lines = [r.getMessage() for r in caplog.records if r.name == "dreamstage.server.connections"]
    assert 1 <= len(lines) <= 3, lines
    counted = sum(int(m.split("connections: ")[1].split(" ")[0]) for m in lines if "per_client" in m)
    assert counted == 300
    for s in held:
        s.close()


def test_bounded_log_passes_one_record_per_kind_per_interval_and_counts_the_rest():
    now = [0.0]
    bounded = BoundedLog(interval_s=10, clock=lambda: now[0])

    def rec(msg):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    assert bounded.filter(rec("socket.accept() out of system resource\nsocket: <x>"))
    assert not any(bounded.filter(rec("socket.accept() out of system resource\nsocket: <y>")) for _ in range(999))
    assert bounded.filter(rec("Invalid HTTP request received."))       # another kind passes at once
    now[0] = 10.0
    r = rec("socket.accept() out of system resource")
    assert bounded.filter(r) and "999 more like this" in r.getMessage()


def test_edge_log_logs_each_interval_once():
    now = [0.0]
    el = EdgeLog(interval_s=10, clock=lambda: now[0])
    el.note("head timeouts")                 # the first is logged at once
    for _ in range(50):
        el.note("head timeouts")
    assert el.totals["head timeouts"] == 51 and el._pending["head timeouts"] == 50
    now[0] = 10.0
    el.note("head timeouts")
    assert not el._pending


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one_and_connections_keep_a_reserve():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raised = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == hard or (hard == resource.RLIM_INFINITY and raised > 256)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fitted = LIMITS.for_fd_limit(soft_limit=80, in_use=30)
    assert fitted.max_connections == 80 - 30 - LIMITS.fd_reserve < LIMITS.max_connections
    assert LIMITS.for_fd_limit(10_000, fds_in_use()) == LIMITS


def test_connection_settings_have_defaults_bounds_and_flags():
    s = ServerSettings()
    lim = s.connection_limits()
    assert lim.max_connections > lim.max_per_client > 0 and lim.header_timeout_s > 0 and lim.fd_reserve >= 16
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerSettings(header_timeout_s=0)
    from dreamstage.cli import build_parser, serve_settings
    args = build_parser().parse_args(["serve", "--no-train", "--max-connections-per-client", "0",
                                      "--header-timeout-s", "2.5", "--max-connections", "99"])
    got = serve_settings(args).connection_limits()
    assert (got.max_per_client, got.header_timeout_s, got.max_connections) == (0, 2.5, 99)
