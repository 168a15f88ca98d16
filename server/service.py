"""The service's lifecycle: resident model, engine and chat template, built once."""
from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dreamstage.server.prompts import PromptTokenizer
from dreamstage.server.settings import ServerSettings
from dreamstage.serving.chat import ChatTemplate
from dreamstage.serving.engine import DreamHook, Engine
from dreamstage.serving.resident import ResidentModel
from dreamstage.serving.sampling import defaults_source, model_defaults

if TYPE_CHECKING:
    from dreamstage.records.feedback import ReplyRenderer
    from dreamstage.records.learner import Learner
    from dreamstage.records.store import RecordStore
    from dreamstage.server.follow import Follower

log = logging.getLogger("dreamstage.server")


class _Terminated(Exception):
    """SIGTERM, turned into an exception once uvicorn has shut down."""


def run_uvicorn(service: Service, app, *, host: str, port: int, log_level: str = "warning") -> None:
    """Serve until SIGINT or SIGTERM, then shut down in order.

    uvicorn treats both signals alike, but after its shutdown it re-raises the
    signal with the previous handler; for SIGTERM that was the default one, which
    killed the process (exit 143) before the service could close. Here both
    first end the open requests (streams get an error event), then uvicorn
    drains its connections, then the service waits for the running micro-step,
    marks the job interrupted and frees native memory."""
    import uvicorn

    from dreamstage.server.connections import uvicorn_config
    from dreamstage.server.openai_routes import SHUTDOWN_GRACE_S

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                service.begin_shutdown()
            super().handle_exit(sig, frame)

    def _raise_terminated(sig, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    server = _Server(uvicorn_config(app, service.settings.connection_limits(), host=host, port=port,
                                    log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    try:
        server.run()
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.close()


@dataclass(frozen=True)
class AdapterShape:
    """What an imported or exported adapter must match: the resident model's architecture and heads."""
    arch: str
    n_head: int
    n_head_kv: int


class Service:
    def __init__(self, settings: ServerSettings, hook: DreamHook | None = None):
        self.settings = settings      # checked when it was made (ServerSettings validates itself)
        self.model = ResidentModel(settings.resident_config())
        # Built before the engine thread starts: after that, only it calls llama.
        self.chat = ChatTemplate.for_model(self.model)
        self.sampling_defaults = model_defaults(self.model.meta)   # a request's unset sampling fields
        self.sampling_source = defaults_source(self.model.meta)
        # /v1/embeddings decodes n_batch outputs at a time: their buffer is taken now,
        # before any job measures free memory, rather than at the first request.
        self.output_reserve_bytes = self.model.reserve_outputs() if settings.embeddings else 0
        self.model_id = settings.model_alias or self.model.model_path.stem
        lc, m = self.model.lc, self.model.model
        self.adapter_shape = AdapterShape(self.model.meta("general.architecture") or "", lc.llama_model_n_head(m),
                                          lc.llama_model_n_head_kv(m))
        # The dream stage (POST /train) needs a state directory for its jobs and adapters.
        self.store = self.scheduler = self.submitter = None
        self.follower: Follower | None = None        # --follow (server/follow.py)
        self.records: RecordStore | None = None       # --record (_start_records)
        self.learner: Learner | None = None
        self.reply_renderer: ReplyRenderer | None = None
        if settings.state_dir is not None and hook is None:
            from dreamstage.training.drift.record_file import DriftRecordFile
            from dreamstage.training.jobs.scheduler import DreamScheduler
            from dreamstage.training.jobs.store import JobStore
            from dreamstage.training.jobs.submit import JobSubmitter
            self.store = JobStore(settings.state_dir)
            # A follower trains nothing: no drift anchors to record while idle.
            drift_guard = settings.drift_guard and settings.follow is None
            self.scheduler = hook = DreamScheduler(self.store, self.model, drift_guard=drift_guard,
                                                   record_file=DriftRecordFile(settings.state_dir, self.model),
                                                   max_adapters=settings.max_adapters,
                                                   adapter_budget_mib=settings.adapter_budget_mib,
                                                   adapter_max_rank=settings.adapter_max_rank)
            self.submitter = JobSubmitter(self.store, self.scheduler, self.model, settings.limits)
        elif settings.adapter is not None:
            raise ValueError("--adapter needs a state directory (--state-dir) to keep its versions in")
        self.engine = Engine(self.model, max_queue=settings.max_queue, hook=hook, max_adapters=settings.max_adapters,
                             adapter_max_rank=settings.adapter_max_rank)
        self.prompts = PromptTokenizer(self.model, self.engine.slot_ctx)
        if self.scheduler is not None:
            try:
                if settings.follow is not None:
                    from dreamstage.server.follow import Follower
                    self.follower = Follower(self, settings.follow, settings.follow_key, settings.follow_interval)
                    self.follower.probe()
                self.scheduler.startup(self.engine, settings.adapter)   # before the engine thread: reload the served
                self._start_records(settings)
            except BaseException:
                if self.follower is not None:
                    self.follower.close()
                if self.store is not None:
                    self.store.close()
                self.model.close()
                raise

    def _start_records(self, settings: ServerSettings) -> None:
        """With --record: the records and feedback (dreamstage/records/) and the learner that turns feedback
        into jobs; --learn sets the default adapter's learning (the learning adapter's while none serves)."""
        if not settings.record or self.store is None:
            return
        from dataclasses import replace

        from dreamstage.records.feedback import ReplyRenderer
        from dreamstage.records.learner import Learner
        from dreamstage.records.store import RecordPolicy, RecordStore
        records = RecordStore(self.store, RecordPolicy(settings.record_days, settings.record_mib))
        records.release_interrupted()
        if settings.learn is not None:
            served = self.store.served()
            name = served["name"] if served is not None else settings.learn_adapter
            records.set_learning(name, replace(records.learning(name), mode=settings.learn))
        self.records, self.reply_renderer = records, ReplyRenderer(self.model)
        self.learner = Learner(records, self.submitter, guarded=settings.drift_guard)

    def start(self) -> Service:
        self.engine.start()
        if self.follower is not None:
            self.follower.start()
        if self.learner is not None:
            self.learner.start()
        return self

    def begin_shutdown(self) -> None:
        """Stop taking work and end every open request now, from any thread.

        The engine finishes the micro-step in progress (native code cannot be
        interrupted), then fails each open request with a 503 error event, so
        a stream ends with an error rather than being cut by the HTTP server's
        own shutdown."""
        threading.Thread(target=self.engine.stop, kwargs={"timeout": None}, name="dreamstage-stop",
                         daemon=True).start()

    def close(self, step_wait_s: float = 300.0) -> None:
        if self.follower is not None:
            self.follower.close()          # nothing is booked while the engine stops
        if self.learner is not None:
            self.learner.close()           # no job starts while the engine stops
        # Native memory (trainers, the context) is freed only once the engine
        # thread has left: freeing it under a running micro-step would crash.
        if not self.engine.stop(timeout=step_wait_s):
            log.error("the engine thread is still inside a step after %.0f s; leaving native memory alone "
                      "(the job is marked interrupted at the next start)", step_wait_s)
            if self.store is not None:
                self.store.close()
            return
        if self.scheduler is not None:
            self.scheduler.close()
        if self.store is not None:
            self.store.close()
        self.engine.adapters.close()
        self.model.close()
