"""The POST /train body: the one validator of a job, and its normalization into a JobSpec.

`TrainRequest` is the pydantic model of the body. Unknown fields are refused
by name (extra="forbid"), and every check raises a message that names the
field and the offending value, so the server's 422 explains itself.
`TrainRequest.to_job_spec()` resolves every default (spec.py) and flattens
groups into plain examples; the engine consumes only the `JobSpec`.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dreamstage.serving.chat import ROLES  # one list for chat requests and training examples
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

# A bare adapter name: no separators, no leading dot, so it can never leave the
# state directory's adapters/ folder. Matched with fullmatch (`$` would allow a trailing "\n").
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _strict() -> ConfigDict:
    # strict: JSON `"8"` is not silently an int, `1` is not a bool. Python's
    # json accepts Infinity and NaN; no field means them (a budget of Infinity
    # would be stored as null, i.e. "no budget").
    return ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class Message(BaseModel):
    """One chat message. `train` is meaningful on assistant messages only."""

    model_config = _strict()

    role: str
    content: str | None = None
    train: bool | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"role {v!r} is not one of {', '.join(ROLES)}")
        return v

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or tool_calls on an assistant message)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong on assistant messages, not {self.role!r}")
        if self.train is True and self.role != "assistant":
            raise ValueError(
                f"train=true on a {self.role!r} message: only assistant turns carry loss; "
                "drop `train` (other roles are always context)"
            )
        return self

    @property
    def trained(self) -> bool:
        """An assistant message is trained unless it says train=false."""
        return self.role == "assistant" and self.train is not False

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (no `train` key)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            v = getattr(self, key)
            if v is not None:
                d[key] = v
        return d


class TextExample(BaseModel):
    model_config = _strict()
    text: str = Field(min_length=1)


class PromptCompletion(BaseModel):
    model_config = _strict()
    prompt: str
    completion: str = Field(min_length=1)


def _check_trained_reply(messages: list[Message]) -> None:
    if not any(m.trained for m in messages):
        raise ValueError("messages has no trained assistant message (every assistant turn is train=false)")


class ChatExample(BaseModel):
    model_config = _strict()
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _has_reply(self) -> ChatExample:
        _check_trained_reply(self.messages)
        return self


class Completion(BaseModel):
    """One reply of a group: its `text` (or an assistant `message`) and its `weight`.

    The weight multiplies the reply's mean token loss (docs/architecture/groups.md):
    any finite number, negative to push the reply away (a reward or an advantage)."""

    model_config = _strict()
    text: str | None = None
    message: Message | None = None
    weight: float = 1.0

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("text is empty")
        return v

    @field_validator("message")
    @classmethod
    def _message(cls, v: Message | None) -> Message | None:
        if v is not None and v.role != "assistant":
            raise ValueError(f"a completion's message is the assistant's reply; role {v.role!r} is not 'assistant'")
        if v is not None and v.train is False:
            raise ValueError("a completion's message is trained; train=false would leave nothing to train")
        return v

    @model_validator(mode="after")
    def _one_reply(self) -> Completion:
        if (self.text is None) == (self.message is None):
            raise ValueError("a completion needs exactly one of text or message")
        return self

    def reply_message(self) -> Message:
        return self.message if self.message is not None else Message(role="assistant", content=self.text)


class GroupExample(BaseModel):
    """One prompt (text or chat) with several weighted completions.

    The prompt is context only; each completion is one trained reply, a plain
    string (weight 1) or `{text | message, weight}`. The job trains the group as
    one shared-prefix group (`dreamstage.training.walk.groups`): the prompt once, every reply
    against it, one update for the group.
    """

    model_config = _strict()
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    completions: list[Completion | str] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_prefix(self) -> GroupExample:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a group needs exactly one of prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools apply to a messages group only")
        for i, m in enumerate(self.messages or []):
            if m.train is True:
                raise ValueError(f"messages[{i}].train=true: a group's messages are context; "
                                 "its completions are trained")
        for i, c in enumerate(self.completions):
            if isinstance(c, str) and not c:
                raise ValueError(f"completions[{i}] is empty")
            if self.prompt is not None and isinstance(c, Completion) and c.message is not None:
                raise ValueError(f"completions[{i}].message belongs to a messages group; a prompt group's "
                                 "completions are text")
        return self

    def weights(self) -> list[float]:
        return [c.weight if isinstance(c, Completion) else 1.0 for c in self.completions]

    def expand(self) -> list[PromptCompletion | ChatExample]:
        """One plain example per completion (prompt + that reply); the weights are `weights()`."""
        if self.prompt is not None:
            # a prompt group's completions carry text (the validator above refuses a message)
            return [PromptCompletion(prompt=self.prompt, completion=c if isinstance(c, str) else cast(str, c.text))
                    for c in self.completions]
        context = [m.model_copy(update={"train": False}) if m.role == "assistant" else m for m in self.messages or []]
        return [
            ChatExample(messages=[*context, Message(role="assistant", content=c) if isinstance(c, str)
                                  else c.reply_message()], tools=self.tools)
            for c in self.completions
        ]


FORM_OF_MODEL = {"TextExample": "text", "PromptCompletion": "prompt_completion",
                  "ChatExample": "chat", "GroupExample": "group"}


def _example_form(v: Any) -> str | None:
    """Which of the four forms a raw example is, judged by its keys."""
    if isinstance(v, BaseModel):
        return FORM_OF_MODEL.get(type(v).__name__)
    if not isinstance(v, dict):
        return None
    if "completions" in v:
        return "group"
    if "messages" in v:
        return "chat"
    if "prompt" in v or "completion" in v:
        return "prompt_completion"
    if "text" in v:
        return "text"
    return None


Example = Annotated[
    Annotated[TextExample, Tag("text")]
    | Annotated[PromptCompletion, Tag("prompt_completion")]
    | Annotated[ChatExample, Tag("chat")]
    | Annotated[GroupExample, Tag("group")],
    Discriminator(
        _example_form,
        custom_error_type="example_form",
        custom_error_message=(
            "an example is an object with one of: text; prompt+completion; "
            "messages (+tools); prompt or messages with completions"
        ),
    ),
]

# Normalized examples the renderer consumes (groups flattened).
PlainExample = TextExample | PromptCompletion | ChatExample
PLAIN_FORMS: dict[str, type[TextExample] | type[PromptCompletion] | type[ChatExample]] = {
    "text": TextExample, "prompt_completion": PromptCompletion, "chat": ChatExample}


def context_cache_types() -> tuple[str, ...]:
    """The training cache types the native core supports (loads the library on first use)."""
    from dreamstage import native  # importing the spec must not load the library

    return native.context_cache_types()


def _cache_type_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = list(context_cache_types())


class TrainRequest(BaseModel):
    """The POST /train body."""

    model_config = _strict()

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

    @field_validator("out")
    @classmethod
    def _out(cls, v: str | None) -> str | None:
        if v is not None:
            check_adapter_name(v)
        return v

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
            out=self.out,
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


def check_adapter_name(name: str) -> str:
    """A bare, safe adapter name; raise ValueError naming it otherwise."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name) or ".." in name or name.endswith("."):
        raise ValueError(
            f"out {name!r} is not a bare adapter name (letters, digits, '_', '-', '.', "
            "at most 64, starting with a letter or digit, no paths)"
        )
    return name


def parse_train_request(body: Mapping[str, Any] | str | bytes) -> TrainRequest:
    """Validate a body (a dict, or raw JSON). Raises pydantic.ValidationError."""
    if isinstance(body, (str, bytes)):
        return TrainRequest.model_validate_json(body)
    return TrainRequest.model_validate(body)
