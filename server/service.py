"""The service's lifecycle: resident model, engine and chat template, built once."""
from __future__ import annotations

from dreamstage.chat import ChatTemplate
from dreamstage.engine import DreamHook, Engine
from dreamstage.resident import ResidentModel
from dreamstage.server.settings import ServerSettings


class Service:
    def __init__(self, settings: ServerSettings, hook: DreamHook | None = None):
        settings.validate()
        self.settings = settings
        self.model = ResidentModel(settings.resident_config())
        # Built before the engine thread starts: after that, only it calls llama.
        self.chat = ChatTemplate.for_model(self.model)
        self.model_id = settings.model_alias or self.model.model_path.stem
        # The dream stage (POST /train) needs a state directory for its jobs and adapters.
        self.jobs = self.dream = None
        if settings.state_dir is not None and hook is None:
            from dreamstage.dreamer import DreamScheduler  # noqa: PLC0415
            from dreamstage.jobs import JobStore  # noqa: PLC0415
            self.jobs = JobStore(settings.state_dir)
            self.dream = hook = DreamScheduler(self.jobs, self.model)
        elif settings.adapter is not None:
            raise ValueError("--adapter needs a state directory (--state-dir) to keep its versions in")
        self.engine = Engine(self.model, max_queue=settings.max_queue, hook=hook)
        if self.dream is not None:
            try:
                self.dream.startup(self.engine, settings.adapter)   # before the engine thread: reload what was served
            except BaseException:
                self.jobs.close()
                self.model.close()
                raise

    def start(self) -> "Service":
        self.engine.start()
        return self

    def close(self) -> None:
        self.engine.stop()
        if self.dream is not None:
            self.dream.close()
            self.jobs.close()
        self.model.close()


class BackgroundServer:
    """uvicorn in a thread on a free loopback port (tests, benchmarks, notebooks)."""

    def __init__(self, settings: ServerSettings, hook: DreamHook | None = None):
        import socket  # noqa: PLC0415

        import uvicorn  # noqa: PLC0415

        from dreamstage.server.app import create_app  # noqa: PLC0415

        self.service = Service(settings, hook).start()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((settings.host, 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{settings.host}:{self.port}"
        config = uvicorn.Config(create_app(self.service), log_level="warning", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        import threading  # noqa: PLC0415

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
