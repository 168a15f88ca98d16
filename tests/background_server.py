"""A dreamstage server in this process: uvicorn in a thread on a free loopback
port, for tests and benchmarks (bench/ puts tests/ on sys.path)."""
from __future__ import annotations

import socket
import threading

import uvicorn

from dreamstage.server.app import create_app
from dreamstage.server.connections import uvicorn_config
from dreamstage.server.service import Service
from dreamstage.server.settings import ServerSettings
from dreamstage.serving.engine import DreamHook


class BackgroundServer:
    """uvicorn in a thread on a free loopback port (tests, benchmarks, notebooks)."""

    def __init__(self, settings: ServerSettings, hook: DreamHook | None = None):
        self.service = Service(settings, hook).start()
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections of a socket that names it, and
        # without it a response written in two pieces (head, then body) waited about 40 ms for the
        # client's delayed ACK (uvicorn's own host/port sockets, as `dreamstage serve` binds, name it)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((settings.host, 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{settings.host}:{self.port}"
        config = uvicorn_config(create_app(self.service), settings.connection_limits(), log_level="warning",
                                timeout_graceful_shutdown=2)
        self.connections = config.connection_book          # the limits in force and what they refused
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="dreamstage-uvicorn", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            self._thread.join(0.02)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
        self.service.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
