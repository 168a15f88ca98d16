"""Connections at the edge: limits, timeouts and bounded logging, below the HTTP app.

uvicorn accepts every connection and waits on it forever until a request
arrives; 21,000 half-open sockets used up the file descriptors, chat timed
out for everyone, and each failed accept logged a traceback (198 MB in 25 s).
Here, in uvicorn's own h11 protocol (a subclass, so parsing stays uvicorn's):

- a connection past `max_connections` in all, or past `max_per_client` from
  one client address, is answered with a fixed 503 and closed before anything
  is read or parsed;
- a request's head must arrive within `header_timeout_s` of its first byte
  (of the connection, for the first request), its body within `body_timeout_s`
  of the head: a client that trickles either (Slowloris) is cut, with a 408
  when nothing of a response was sent yet; idle keep-alive is uvicorn's
  `timeout_keep_alive`;
- each kind of refusal or timeout is counted and logged once per
  `LOG_INTERVAL_S` with its count, never once per connection; `BoundedLog`
  does the same for the records of the `asyncio` and `uvicorn.error` loggers
  (a failed accept, an invalid request).

`raise_fd_limit` lifts the soft RLIMIT_NOFILE to the hard one at start, and
`ConnectionLimits.for_fd_limit` keeps `fd_reserve` descriptors below it that
connections never take, so /health, the state store and the model files can
always open.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass, replace

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dreamstage.server.connections")

LOG_INTERVAL_S = 10.0    # one line per kind of refusal or timeout, at most this often
# Answers written by hand: no parsing, no app, no allocation per connection.
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 34\r\n"
            b"retry-after: 1\r\nconnection: close\r\n\r\nToo many connections; retry later.")
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 34\r\n"
              b"connection: close\r\n\r\nThe request did not arrive in time.")


@dataclass(frozen=True)
class ConnectionLimits:
    """The edge's limits (ServerSettings declares each default and flag once)."""

    max_connections: int          # open connections in all; past it new ones get 503 and are closed
    max_per_client: int           # open connections from one client address (0: no per-address limit)
    header_timeout_s: float       # from a request's first byte to the end of its head
    body_timeout_s: float         # from the end of the head to the end of the body
    keep_alive_s: int             # an idle keep-alive connection is closed after this many seconds
    fd_reserve: int               # descriptors connections never take (files the server must open)

    def for_fd_limit(self, soft_limit: int, in_use: int) -> ConnectionLimits:
        """These limits with max_connections lowered to what the descriptor limit
        leaves after `in_use` descriptors and the reserve (at least 1)."""
        room = max(1, soft_limit - in_use - self.fd_reserve)
        return self if room >= self.max_connections else replace(self, max_connections=room)


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard one (where the hard one is
    unlimited, as far as the kernel's nr_open allows); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def fds_in_use() -> int:
    """Descriptors this process holds now (0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class EdgeLog:
    """Counts refusals and timeouts by kind and logs each kind once per interval."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock=time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.totals: Counter[str] = Counter()     # since start, by kind (read by tests and /metrics)
        self._pending: Counter[str] = Counter()
        self._flush_at: float | None = None
        self._flush_handle: asyncio.TimerHandle | None = None

    def note(self, kind: str) -> None:
        self.totals[kind] += 1
        self._pending[kind] += 1
        now = self.clock()
        if self._flush_at is None or now >= self._flush_at:
            self.flush()
        elif self._flush_handle is None:
            try:                     # the last burst's count is logged even when nothing follows it
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._flush_handle = loop.call_later(self._flush_at - now, self.flush)

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._pending:
            log.warning("connections: %s (in the last %.0f s at most)",
                        ", ".join(f"{n} {kind}" for kind, n in sorted(self._pending.items())), self.interval_s)
            self._pending.clear()
        self._flush_at = self.clock() + self.interval_s


class ConnectionBook:
    """The open connections, in all and per client address, shared by every protocol instance."""

    def __init__(self, limits: ConnectionLimits, edge_log: EdgeLog | None = None):
        self.limits = limits
        self.log = edge_log or EdgeLog()
        self.open = 0
        self.per_client: Counter[str] = Counter()

    def admit(self, host: str | None) -> str | None:
        """Counts a new connection in, or says which limit refuses it."""
        if self.open >= self.limits.max_connections:
            return "refused (max_connections)"
        if host is not None and self.limits.max_per_client and self.per_client[host] >= self.limits.max_per_client:
            return "refused (max_connections_per_client)"
        self.open += 1
        if host is not None:
            self.per_client[host] += 1
        return None

    def release(self, host: str | None) -> None:
        self.open -= 1
        if host is not None:
            self.per_client[host] -= 1
            if self.per_client[host] <= 0:
                del self.per_client[host]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the book's limits and the head and body timeouts."""

    book: ConnectionBook       # set on the subclass protocol_class() makes

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self._host = peer[0] if isinstance(peer, tuple) and peer else None
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None            # "head" | "body" | None (a request being answered, or idle)
        self._seen_cycle: object | None = None     # the cycle whose head was last seen in
        refusal = self.book.admit(self._host)
        self._admitted = refusal is None
        if refusal is not None:
            self.book.log.note(refusal)
            transport.write(_REFUSED)
            transport.close()
            return
        super().connection_made(transport)
        self._start("head", self.book.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._cancel()
        self.book.release(self._host)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase is None and (self.cycle is None or self.cycle.response_complete):
            self._start("head", self.book.limits.header_timeout_s)   # a new request on a kept-alive connection
        super().data_received(data)
        self._follow_cycle()

    def on_response_complete(self) -> None:
        self._cancel()
        super().on_response_complete()
        self._follow_cycle()                      # a pipelined request may have begun

    def _follow_cycle(self) -> None:
        """Moves the timer along with h11: head read, then body read, then none."""
        if self.cycle is not None and self.cycle is not self._seen_cycle:
            self._seen_cycle = self.cycle           # its head is in
            self._cancel()
            if self.cycle.more_body:
                self._start("body", self.book.limits.body_timeout_s)
        elif self._phase == "body" and not self.cycle.more_body:
            self._cancel()

    def _start(self, phase: str, seconds: float) -> None:
        self._cancel()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _timed_out(self) -> None:
        phase, self._timer = self._phase, None
        if phase is None or self.transport.is_closing():
            return
        self._phase = None
        self.book.log.note(f"{phase} timeouts")
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (
                self.cycle is None or self.cycle.response_complete or not self.cycle.response_started):
            self.transport.write(_TIMED_OUT)
        self.transport.close()


def protocol_class(book: ConnectionBook) -> type[GuardedH11Protocol]:
    """uvicorn's `http` protocol class for one server, bound to its book."""
    return type("DreamstageH11Protocol", (GuardedH11Protocol,), {"book": book})


class BoundedLog(logging.Filter):
    """Passes the first record of each kind (logger and message template) per
    interval; the next one that passes says how many were left out."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock=time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._kinds: dict[tuple[str, str], list] = {}     # kind -> [next time one passes, left out since]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        state = self._kinds.get(key)
        if state is not None and now < state[0]:
            state[1] += 1
            return False
        left_out = state[1] if state is not None else 0
        if len(self._kinds) > 1024:
            self._kinds.clear()
        self._kinds[key] = [now + self.interval_s, 0]
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like this left out of the log)"
        return True


class ConnectionCollector:
    """The book's figures for GET /metrics: open connections, the limit in force,
    refusals by the limit that refused and timeouts by phase (EdgeLog.totals)."""

    def __init__(self, book: ConnectionBook):
        self.book = book

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("dreamstage_connections_open", "Open client connections.", value=self.book.open)
        yield GaugeMetricFamily("dreamstage_connections_limit", "Connections admitted at once (max_connections, "
                                "fitted under the open-file limit).", value=self.book.limits.max_connections)
        refused = CounterMetricFamily("dreamstage_connections_refused",
                                      "Connections answered 503 and closed unread, by the limit that refused them.",
                                      labels=["limit"])
        timed_out = CounterMetricFamily("dreamstage_connections_timed_out",
                                        "Connections cut because a request's head or body came too slowly.",
                                        labels=["phase"])
        totals = self.book.log.totals
        for limit in ("max_connections", "max_connections_per_client"):
            refused.add_metric([limit], totals[f"refused ({limit})"])
        for phase in ("head", "body"):
            timed_out.add_metric([phase], totals[f"{phase} timeouts"])
        yield refused
        yield timed_out


EDGE_LOGGERS = ("asyncio", "uvicorn.error")


def bound_logging(interval_s: float = LOG_INTERVAL_S) -> BoundedLog:
    """Installs one BoundedLog on the loggers that log per connection (once per process)."""
    for name in EDGE_LOGGERS:
        for f in logging.getLogger(name).filters:
            if isinstance(f, BoundedLog):
                return f
    bounded = BoundedLog(interval_s)
    for name in EDGE_LOGGERS:
        logging.getLogger(name).addFilter(bounded)
    return bounded


def uvicorn_config(app, limits: ConnectionLimits, **kwargs):
    """The uvicorn.Config every dreamstage server runs with (run_uvicorn, the
    tests' background server): the guarded protocol, keep-alive, and the
    connection limit fitted under the descriptor limit, raised first."""
    import uvicorn

    soft = raise_fd_limit()
    fitted = limits.for_fd_limit(soft, fds_in_use())
    if fitted.max_connections < limits.max_connections:
        log.warning("max_connections lowered from %d to %d: the open-file limit is %d, %d descriptors are "
                    "in use and %d are kept in reserve", limits.max_connections, fitted.max_connections, soft,
                    fds_in_use(), limits.fd_reserve)
    bound_logging()
    book = ConnectionBook(fitted)
    config = uvicorn.Config(app, http=protocol_class(book), timeout_keep_alive=limits.keep_alive_s,
                            **kwargs)
    config.connection_book = book   # type: ignore[attr-defined]  # for tests and benchmarks
    registry = getattr(getattr(app, "state", None), "metrics", None)
    if registry is not None:                          # GET /metrics reports the book
        registry.register(ConnectionCollector(book))
    return config
