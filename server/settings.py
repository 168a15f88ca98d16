"""Server settings: one dataclass, filled by the CLI (or tests) and validated here."""
from __future__ import annotations

from dataclasses import dataclass, field

from dreamstage.resident import KV_TYPES, ResidentConfig
from dreamstage.server.security import SecurityPolicy, is_loopback
from dreamstage.training.submit import JobLimits


@dataclass(frozen=True)
class ServerSettings:
    model: str | None = None          # GGUF path; None: the embedded default model
    host: str = "127.0.0.1"           # loopback unless asked otherwise
    port: int = 8080
    parallel: int = 4                 # slots (sequence ids) decoded together
    ctx: int = 4096                   # total context; each slot gets ctx // parallel
    batch: int = 512                  # tokens per llama_decode (prompt chunks + decode tokens)
    threads: int = 0                  # 0: all cores
    kv_type: str = "f16"
    state_dir: str | None = None      # the dream stage's jobs and adapters; None: training is off
    adapter: str | None = None        # a GGUF LoRA to import and serve at startup (--adapter)
    max_queue: int = 64               # requests that may wait for a slot before 503
    max_body_bytes: int = 4 << 20     # larger request bodies get 413
    retry_after_s: int = 1            # Retry-After on 503
    model_alias: str | None = None    # the id /v1/models reports; default: the file's stem
    n_gpu_layers: int = -1            # layers on the GPU (-ngl); negative: all; 0: none
    api_key: str | None = None        # required as "Authorization: Bearer" on every route but /health
    allowed_hosts: tuple[str, ...] = ()   # Host names accepted besides the loopback names (loopback binds)
    cors_origins: tuple[str, ...] = ()    # origins that get CORS headers; none by default
    limits: JobLimits = field(default_factory=JobLimits)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {self.parallel}")
        if self.ctx < self.parallel * 16:
            raise ValueError(f"ctx {self.ctx} leaves fewer than 16 tokens per slot for {self.parallel} slots")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        # Anyone who can POST /train changes what the model says to everyone,
        # and that change persists. Off this machine that needs a key.
        if self.state_dir is not None and not self.api_key and not is_loopback(self.host):
            raise ValueError(f"refusing to serve training routes on {self.host}, which is not a loopback address, "
                             "without an API key: set --api-key (or DREAMSTAGE_API_KEY), or turn training off "
                             "with --no-train")
        self.limits.validate()

    def security(self) -> SecurityPolicy:
        return SecurityPolicy.for_bind(self.host, self.api_key, self.allowed_hosts)

    def resident_config(self) -> ResidentConfig:
        # One K/V stream per slot: a request's output does not depend on what
        # its neighbours are doing (see docs/architecture/serving.md).
        return ResidentConfig(model_path=self.model, n_ctx=self.ctx, n_seq=self.parallel,
                              n_batch=self.batch, n_threads=self.threads, kv_type=self.kv_type,
                              kv_unified=False, n_gpu_layers=self.n_gpu_layers)
