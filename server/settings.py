"""Server settings: one pydantic-settings model, the one place for defaults.

Each field may come from the CLI (or a caller's keyword), else from the
environment, `DREAMSTAGE_<FIELD>` (`DREAMSTAGE_PORT=9000`,
`DREAMSTAGE_API_KEY`, `DREAMSTAGE_ALLOWED_HOSTS='["box.lan"]'`,
`DREAMSTAGE_LIMITS__MAX_QUEUED_JOBS=4`), else from the default here. A
settings object is checked when it is made: a bad value raises
pydantic.ValidationError (a ValueError) naming the field.
"""
from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dreamstage.adapters.choice import DEFAULT_MAX_ADAPTERS, DEFAULT_MIXED_MAX_RANK
from dreamstage.records.store import DEFAULT_LEARN_ADAPTER, DEFAULT_RECORD_DAYS, DEFAULT_RECORD_MIB, LearnMode
from dreamstage.server.connections import ConnectionLimits
from dreamstage.server.follow import check_leader_url
from dreamstage.server.security import SecurityPolicy, is_loopback
from dreamstage.server.tenants import load_key_file
from dreamstage.serving import rpc
from dreamstage.serving.resident import KV_TYPES, ResidentConfig
from dreamstage.serving.rpc import DEAD_AFTER_RANGE, DEAD_AFTER_S
from dreamstage.training.jobs.request import check_adapter_name
from dreamstage.training.jobs.submit import JobLimits


class ServerSettings(BaseSettings):
    # extra="forbid": a misspelt keyword is an error, as it was for the
    # dataclass; environment variables that name no field are not read at all.
    model_config = SettingsConfigDict(env_prefix="DREAMSTAGE_", env_nested_delimiter="__", frozen=True,
                                      extra="forbid")

    model: str | None = None          # GGUF path; None: the embedded default model
    host: str = "127.0.0.1"           # loopback unless asked otherwise
    port: int = Field(default=8080, ge=0, le=65535)
    parallel: int = Field(default=4, ge=1)   # slots (sequence ids) decoded together
    # Total context; each slot gets ctx // parallel (one K/V stream per slot), or,
    # with kv_unified, every request may use all of it. None: the model's trained
    # context per slot (or in all, kv_unified), as memory allows (resident.plan_context).
    ctx: int | None = Field(default=None, ge=1)
    # With ctx None: the largest share of the K/V device's free memory the slots' K/V may take.
    ctx_memory_share: float = Field(default=0.25, gt=0.0, le=1.0)
    # One K/V pool all slots share, as llama-server's unified cache (True), or one
    # stream per slot (False): a request's output then does not depend on what
    # else is in its batch (docs/architecture/serving.md, "K/V layout").
    kv_unified: bool = False
    batch: int = 512                  # tokens per llama_decode (prompt chunks + decode tokens)
    threads: int = 0                  # 0: all cores
    kv_type: str = "f16"
    state_dir: str | None = None      # the dream stage's jobs and adapters; None: training is off
    adapter: str | None = None        # a GGUF LoRA to import and serve at startup (--adapter)
    # Named adapters with a served version resident beside the base; also how
    # many adapter files serving keeps loaded at once.
    max_adapters: int = Field(default=DEFAULT_MAX_ADAPTERS, ge=1, le=256)
    # Adapters of rank up to this decode in one batch with the base and each other;
    # a wider one decodes in batches of its own. Each resident adapter costs a slot of this rank.
    adapter_max_rank: int = Field(default=DEFAULT_MIXED_MAX_RANK, ge=1, le=256)
    # The resident adapters' files may take this many MiB; None: the device's free memory.
    adapter_budget_mib: float | None = Field(default=None, gt=0)
    # A key file (JSON: key -> {"adapters": [names], "train": bool}) of keys scoped to adapter names.
    api_keys: str | None = None
    max_queue: int = Field(default=64, ge=0)           # requests that may wait for a slot before 503
    max_body_bytes: int = Field(default=4 << 20, ge=1024)   # larger request bodies get 413
    # Connections (server/connections.py): past a limit a new connection gets a
    # fixed 503 and is closed unread; a head or body slower than its timeout is cut.
    max_connections: int = Field(default=4096, ge=1)   # in all (lowered to fit the open-file limit)
    max_connections_per_client: int = Field(default=64, ge=0)   # per client address; 0: none (behind a proxy)
    header_timeout_s: float = Field(default=10.0, gt=0)    # a request's head, from its first byte
    body_timeout_s: float = Field(default=60.0, gt=0)      # its body, from the end of the head
    keep_alive_s: int = Field(default=5, ge=1)             # an idle keep-alive connection is closed
    fd_reserve: int = Field(default=128, ge=16)            # descriptors connections never take
    retry_after_s: int = 1            # Retry-After on 503
    model_alias: str | None = None    # the id /v1/models reports; default: the file's stem
    n_gpu_layers: int = -1            # layers on the GPU (-ngl); negative: all; 0: none
    # RPC workers holding layers (dreamstage.serving.rpc): "HOST:PORT" each; a
    # non-loopback one needs rpc_allow_remote (RPC has no authentication).
    rpc: tuple[str, ...] = ()
    rpc_allow_remote: bool = False
    tensor_split: tuple[float, ...] = ()   # each device's share of the offloaded layers; empty: by free memory
    split_mode: str = "layer"
    # a worker host silent this long fails (rpc.keep_alive)
    rpc_dead_after_s: float = Field(default=DEAD_AFTER_S, ge=DEAD_AFTER_RANGE[0], le=DEAD_AFTER_RANGE[1])
    api_key: str | None = None        # required as "Authorization: Bearer" on every route but /health
    allowed_hosts: tuple[str, ...] = ()   # Host names accepted besides the loopback names (loopback binds)
    cors_origins: tuple[str, ...] = ()    # origins that get CORS headers; none by default
    limits: JobLimits = Field(default_factory=JobLimits)
    # The drift guard (docs/architecture/drift.md): anchor records, the
    # regularizer, drift figures and the auto-promotion check. Off
    # (--no-drift-guard, DREAMSTAGE_DRIFT_GUARD=false; the test suite sets
    # that for the tests that are not about drift), jobs train without them.
    drift_guard: bool = True
    # Unknown request fields on the OpenAI routes: ignored and named in a
    # response header (False, as llama-server and vLLM do), or a 400 (True).
    strict_api: bool = False
    # POST /v1/embeddings (llama-server's --embeddings): off, it answers 501.
    embeddings: bool = False
    # Keep each served exchange (docs/architecture/feedback.md) for feedback (POST /v1/feedback); off by default.
    # Needs the state directory. Records older than record_days go, then the oldest past record_mib.
    record: bool = False
    record_days: float = Field(default=DEFAULT_RECORD_DAYS, gt=0)
    record_mib: float = Field(default=DEFAULT_RECORD_MIB, gt=0)
    # Set at startup: the default adapter's learning (manual: feedback waits for POST /adapters/{name}/learn;
    # auto: it trains by itself). None: as stored (manual unless set through PUT /adapters/{name}/learn).
    learn: LearnMode | None = None
    # What feedback on the base model's answers (no adapter answered) trains.
    learn_adapter: str = DEFAULT_LEARN_ADAPTER

    # A follower (server/follow.py): serve the adapter versions promoted on the leader at this URL
    # (http[s]://host[:port]), and only those. follow_key: the leader's API key, or a scoped key that reads
    # the adapters. follow_interval: how long one wait on the leader lasts, and the pause before a retry.
    follow: str | None = None
    follow_key: str | None = None
    follow_interval: float = Field(default=5.0, gt=0, le=60)

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if self.ctx is not None and self.ctx < (1 if self.kv_unified else self.parallel) * 16:
            raise ValueError(f"ctx {self.ctx} leaves fewer than 16 tokens per slot for {self.parallel} slots")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        # Anyone who can POST /train changes what the model says to everyone,
        # and that change persists. Off this machine that needs a key.
        if self.api_keys is not None:
            load_key_file(self.api_keys)          # a bad key file is refused at startup, naming the entry
        if self.state_dir is not None and not self.api_key and not self.api_keys and not is_loopback(self.host):
            raise ValueError(f"refusing to serve training routes on {self.host}, which is not a loopback address, "
                             "without an API key: set --api-key (or DREAMSTAGE_API_KEY), or turn training off "
                             "with --no-train")
        if self.record and self.state_dir is None:
            raise ValueError("record needs a state directory (--state-dir) to keep the records in")
        if self.learn is not None and not self.record:
            raise ValueError("learn needs --record: feedback is given on recorded answers")
        check_adapter_name(self.learn_adapter, "learn_adapter")
        if self.follow is not None:
            check_leader_url(self.follow)
            if self.state_dir is None:
                raise ValueError("follow needs a state directory (--state-dir): the follower keeps the leader's "
                                 "adapters and which of them it serves there")
            if self.record or self.adapter is not None:
                raise ValueError("follow: --record and --adapter belong on the leader; a follower serves what the "
                                 "leader promoted")
        if self.rpc:
            rpc.check_remote(rpc.parse_endpoints(",".join(self.rpc)), self.rpc_allow_remote)
        if self.tensor_split:
            rpc.parse_tensor_split(",".join(map(str, self.tensor_split)))
        if self.split_mode not in rpc.SPLIT_MODES:
            raise ValueError(f"split_mode {self.split_mode!r} is not one of {', '.join(rpc.SPLIT_MODES)}")
        self.limits.validate()
        return self

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(max_connections=self.max_connections, max_per_client=self.max_connections_per_client,
                                header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                                keep_alive_s=self.keep_alive_s, fd_reserve=self.fd_reserve)

    def security(self) -> SecurityPolicy:
        scoped = load_key_file(self.api_keys) if self.api_keys is not None else None
        return SecurityPolicy.for_bind(self.host, self.api_key, self.allowed_hosts, scoped)

    def resident_config(self) -> ResidentConfig:
        return ResidentConfig(model_path=self.model, n_ctx=self.ctx or 0, n_seq=self.parallel,
                              auto_ctx_memory_share=self.ctx_memory_share,
                              n_batch=self.batch, n_threads=self.threads, kv_type=self.kv_type,
                              kv_unified=self.kv_unified, n_gpu_layers=self.n_gpu_layers, rpc=self.rpc,
                              tensor_split=self.tensor_split, split_mode=self.split_mode,
                              rpc_dead_after_s=self.rpc_dead_after_s)
