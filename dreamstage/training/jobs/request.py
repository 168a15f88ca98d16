"""The POST /train body: the one validator of a job, and its normalization into a JobSpec.

`TrainRequest` is the pydantic model of the body. Unknown fields are refused
by name (extra="forbid"), and every check raises a message that names the
field and the offending value, so the server's 422 explains itself.
`TrainRequest.to_job_spec()` resolves every default (spec.py) and flattens
groups into plain examples; the engine consumes only the `JobSpec`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dreamstage.adapters.names import check_adapter_name
from dreamstage.training.jobs.example_forms import (
    Example,
    GroupExample,
    TextExample,
    strict_config,
)
from dreamstage.training.jobs.spec import (
    DEFAULT_ALPHA,
    DEFAULT_ANCHOR_RATIO,
    DEFAULT_CHUNK,
    DEFAULT_CONSOLIDATE,
    DEFAULT_CONSOLIDATE_DECAY,
    DEFAULT_CONTEXT_CACHE_TYPE,
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    DEFAULT_MAX_DRIFT,
    DEFAULT_MAX_DRIFT_KL,
    DEFAULT_MAX_PAUSE_MS,
    DEFAULT_MAX_SLOWDOWN,
    DEFAULT_MIN_CHUNK,
    DEFAULT_NEIGHBOURS,
    DEFAULT_RANK,
    DEFAULT_REHEARSAL,
    DEFAULT_STOP_LOSS,
    DEFAULT_TARGETS,
    DEFAULT_WINDOW,
    GATE_SLACK_MIB,
    LORA_TARGETS,
    MAX_ANCHOR_CHARS,
    MAX_CONSOLIDATE,
    MAX_EXAMPLES,
    MAX_EXTRA_ANCHORS,
    MAX_NEIGHBOURS,
    MAX_WINDOW,
    MIN_WINDOW,
    JobSpec,
    PacingSpec,
    Rehearsal,
    SourcedExample,
    default_overlap,
)


def context_cache_types() -> tuple[str, ...]:
    """The training cache types the native core supports (loads the library on first use)."""
    from dreamstage import native  # importing the spec must not load the library

    return native.context_cache_types()


def _cache_type_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = list(context_cache_types())


class TrainRequest(BaseModel):
    """The POST /train body."""

    model_config = strict_config()

    text: str | None = Field(default=None, min_length=1)
    examples: list[Example] | None = None

    window: int = Field(default=DEFAULT_WINDOW, ge=MIN_WINDOW, le=MAX_WINDOW)
    overlap: int | None = Field(default=None, ge=1)
    fit: Literal["middle", "left"] = "middle"
    chunk: int | None = Field(default=None, ge=1)
    min_chunk: int = Field(default=DEFAULT_MIN_CHUNK, ge=1)
    # The types the training K/V cache may use are the native core's to say
    # (dream_context_cache_types): read when a body is validated, not listed here.
    context_cache_type: str = Field(default=DEFAULT_CONTEXT_CACHE_TYPE, json_schema_extra=_cache_type_schema)
    recompute: bool = False
    exact: bool = False
    horizon: int | None = Field(default=None, ge=1)
    memory_budget_mib: float | None = Field(default=None, gt=0)

    rank: int = Field(default=DEFAULT_RANK, ge=1, le=256)
    alpha: float = Field(default=DEFAULT_ALPHA, gt=0, le=4096)
    targets: str | list[str] = ",".join(DEFAULT_TARGETS)
    top_layers: int | None = Field(default=None, ge=1)

    lr: float = Field(default=DEFAULT_LR, gt=0, le=1.0)
    epochs: int = Field(default=DEFAULT_EPOCHS, ge=1, le=1000)
    val_split: float = Field(default=0.0, ge=0.0, lt=1.0)
    seed: int = Field(default=0, ge=0, lt=2**32)

    share: float | None = Field(default=None, gt=0.0, lt=1.0)
    max_slowdown: float | None = Field(default=None, gt=0.0, lt=1.0)
    # 0: no pause bound, every step runs the job's chunk (a machine nobody chats with)
    max_pause_ms: float = Field(default=DEFAULT_MAX_PAUSE_MS, ge=0.0, le=600_000.0)

    promote: Literal["never", "manual", "auto"] = "manual"
    # The adapter the job trains: an existing name starts from its served
    # version, a new one from zero. `out` is its older spelling (the two must
    # agree); neither: a new adapter named job-<id>.
    adapter: str | None = None
    out: str | None = None
    # plain examples whose rendered prompt (the tokens before the first trained
    # one) is the same train as one shared-prefix group of unit weights: one
    # update for them together instead of one each
    group_prefix: bool = False

    # the drift guard (docs/architecture/drift.md)
    regularizer: bool = True
    anchor_ratio: float = Field(default=DEFAULT_ANCHOR_RATIO, gt=0.0, le=64.0)
    rehearsal: Rehearsal = DEFAULT_REHEARSAL
    consolidate: int = Field(default=DEFAULT_CONSOLIDATE, ge=0, le=MAX_CONSOLIDATE)
    consolidate_decay: bool = DEFAULT_CONSOLIDATE_DECAY
    neighbours: int = Field(default=DEFAULT_NEIGHBOURS, ge=0, le=MAX_NEIGHBOURS)
    anchors: list[str] | None = Field(default=None, max_length=MAX_EXTRA_ANCHORS)
    max_drift: float = Field(default=DEFAULT_MAX_DRIFT, ge=0.0, le=1.0)
    # null: drift_kl not bounded
    max_drift_kl: float | None = Field(default=DEFAULT_MAX_DRIFT_KL, gt=0.0, le=100.0)
    # null: train every epoch
    stop_loss: float | None = Field(default=DEFAULT_STOP_LOSS, gt=0.0, le=100.0)

    @field_validator("anchors")
    @classmethod
    def _anchors(cls, v: list[str] | None) -> list[str] | None:
        for i, a in enumerate(v or []):
            if not a.strip():
                raise ValueError(f"anchors[{i}] is empty")
            if len(a) > MAX_ANCHOR_CHARS:
                raise ValueError(f"anchors[{i}] has {len(a)} characters, more than {MAX_ANCHOR_CHARS}")
        if v:
            from dreamstage.training.drift.anchors import rehearsal_anchors
            rehearsed = set(rehearsal_anchors())
            for i, a in enumerate(v):
                if a in rehearsed:
                    raise ValueError(f"anchors[{i}] {a!r} is one of the regularizer's rehearsal anchors: "
                                     "drift is measured only on prompts it never trains")
        return v

    @field_validator("context_cache_type")
    @classmethod
    def _cache_type(cls, v: str) -> str:
        supported = context_cache_types()
        if v not in supported:
            raise ValueError(f"context_cache_type {v!r} is not one of {', '.join(supported)}")
        return v

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: str | list[str]) -> str | list[str]:
        _parse_targets(v)
        return v

    @field_validator("out", "adapter")
    @classmethod
    def _out(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            check_adapter_name(v, info.field_name or "out")
        return v

    @model_validator(mode="after")
    def _adapter_is_out(self) -> TrainRequest:
        if self.adapter is not None and self.out is not None and self.adapter != self.out:
            raise ValueError(f"adapter {self.adapter!r} and out {self.out!r} name different adapters; "
                             "give one (out is adapter's older name)")
        return self

    @field_validator("examples")
    @classmethod
    def _examples_len(cls, v: list | None) -> list | None:
        if v is not None and len(v) > MAX_EXAMPLES:
            raise ValueError(f"examples has {len(v)} items, more than {MAX_EXAMPLES}")
        return v

    # Cross-field checks live on the later field (pydantic validates fields in
    # declaration order, so the earlier ones are in info.data); that puts the
    # field's own name in the 422's loc, not just in the message.
    @field_validator("overlap")
    @classmethod
    def _overlap(cls, v: int | None, info: ValidationInfo) -> int | None:
        window = info.data.get("window")
        if v is not None and window is not None and v > window // 2:
            raise ValueError(f"overlap {v} is more than half of window {window}")
        return v

    @field_validator("chunk")
    @classmethod
    def _chunk(cls, v: int | None, info: ValidationInfo) -> int | None:
        window = info.data.get("window")
        if v is not None and window is not None and v > window:
            raise ValueError(f"chunk {v} is larger than window {window}")
        return v

    @field_validator("horizon")
    @classmethod
    def _horizon(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None:
            return v
        if info.data.get("exact") is False:
            raise ValueError("horizon applies to the exact walk only; it needs exact=true")
        if any(isinstance(ex, GroupExample) for ex in info.data.get("examples") or []):
            raise ValueError("a group trains its whole prompt (the shared-prefix walk has no horizon); "
                             "leave horizon out for a job with groups")
        window = info.data.get("window")
        if window is not None and v > window:
            raise ValueError(f"horizon {v} is larger than window {window}")
        return v

    @field_validator("memory_budget_mib")
    @classmethod
    def _budget_above_slack(cls, v: float | None) -> float | None:
        if v is not None and v <= GATE_SLACK_MIB:
            raise ValueError(f"memory_budget_mib {v:g} is not above the memory gate's slack of {GATE_SLACK_MIB:g} MiB, "
                             "which it keeps free on top of every allowance, so nothing could ever be allocated; "
                             f"give more than {GATE_SLACK_MIB:g} or leave it out (device free memory only)")
        return v

    @field_validator("max_slowdown")
    @classmethod
    def _pacing(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and info.data.get("share") is not None:
            raise ValueError("share and max_slowdown are exclusive; give one")
        return v

    @field_validator("group_prefix")
    @classmethod
    def _group_prefix(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("horizon") is not None:
            raise ValueError("a group trains its whole prompt (the shared-prefix walk has no horizon); "
                             "group_prefix=true needs horizon left out")
        return v

    @model_validator(mode="after")
    def _has_examples(self) -> TrainRequest:
        if self.text is None and not self.examples:
            raise ValueError("the body needs text or a non-empty examples list")
        return self

    # -- normalization --------------------------------------------------------
    def to_job_spec(self) -> JobSpec:
        examples: list[SourcedExample] = []
        if self.text is not None:
            examples.append(SourcedExample(0, "text", TextExample(text=self.text)))
        base = len(examples)
        for i, ex in enumerate(self.examples or []):
            if isinstance(ex, GroupExample):
                for j, (plain, w) in enumerate(zip(ex.expand(), ex.weights(), strict=True)):
                    examples.append(SourcedExample(base + i, f"examples[{i}].completions[{j}]", plain,
                                                   group=f"examples[{i}]", weight=w))
            else:
                examples.append(SourcedExample(base + i, f"examples[{i}]", ex))
        chunk = self.chunk if self.chunk is not None else min(DEFAULT_CHUNK, self.window)
        if self.share is not None:
            pacing = PacingSpec("share", self.share, self.max_pause_ms or None)
        else:
            bound = self.max_slowdown if self.max_slowdown is not None else DEFAULT_MAX_SLOWDOWN
            pacing = PacingSpec("max_slowdown", bound, self.max_pause_ms or None)
        return JobSpec(
            examples=tuple(examples),
            window=self.window,
            overlap=self.overlap if self.overlap is not None else default_overlap(self.window),
            fit=self.fit,
            chunk=chunk,
            min_chunk=min(self.min_chunk, chunk),
            context_cache_type=self.context_cache_type,
            recompute=self.recompute,
            exact=self.exact,
            horizon=self.horizon,
            memory_budget_mib=self.memory_budget_mib,
            rank=self.rank,
            alpha=self.alpha,
            targets=_parse_targets(self.targets),
            top_layers=self.top_layers,
            lr=self.lr,
            epochs=self.epochs,
            val_split=self.val_split,
            seed=self.seed,
            pacing=pacing,
            promote=self.promote,
            out=self.adapter or self.out,
            regularizer=self.regularizer,
            anchor_ratio=self.anchor_ratio,
            rehearsal=self.rehearsal,
            consolidate=self.consolidate,
            consolidate_decay=self.consolidate_decay,
            neighbours=self.neighbours,
            anchors=tuple(self.anchors or ()),
            max_drift=self.max_drift,
            max_drift_kl=self.max_drift_kl,
            stop_loss=self.stop_loss,
            group_prefix=self.group_prefix,
        )


def _parse_targets(v: str | list[str]) -> tuple[str, ...]:
    names = [s.strip() for s in v.split(",")] if isinstance(v, str) else [s.strip() for s in v]
    if not names or any(not n for n in names):
        raise ValueError(f"targets {v!r} has an empty name; give a comma list of {', '.join(LORA_TARGETS)}")
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"targets {', '.join(map(repr, unknown))} not one of {', '.join(LORA_TARGETS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"targets {v!r} names a target twice")
    return tuple(sorted(names, key=LORA_TARGETS.index))


def parse_train_request(body: Mapping[str, Any] | str | bytes) -> TrainRequest:
    """Validate a body (a dict, or raw JSON). Raises pydantic.ValidationError."""
    if isinstance(body, (str, bytes)):
        return TrainRequest.model_validate_json(body)
    return TrainRequest.model_validate(body)
