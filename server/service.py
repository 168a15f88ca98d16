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
        self.engine = Engine(self.model, max_queue=settings.max_queue, hook=hook)

    def start(self) -> "Service":
        self.engine.start()
        return self

    def close(self) -> None:
        self.engine.stop()
        self.model.close()
