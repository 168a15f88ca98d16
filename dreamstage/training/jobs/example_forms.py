"""The example shapes a POST /train body accepts: text, prompt/completion,
chat and a weighted group of completions. Validated once here; groups are
flattened into the plain forms (`PlainExample`) the renderer consumes."""
from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from dreamstage.serving.chat import ROLES  # one list for chat requests and training examples


def strict_config() -> ConfigDict:
    # strict: JSON `"8"` is not silently an int, `1` is not a bool. Python's
    # json accepts Infinity and NaN; no field means them (a budget of Infinity
    # would be stored as null, i.e. "no budget").
    return ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class CalledFunction(BaseModel):
    """The function an assistant message called: its name and its arguments (JSON text, as OpenAI's tool_calls)."""

    model_config = strict_config()
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)


class ToolCall(BaseModel):
    """A call in an assistant message of a training conversation (an agent's transcript)."""

    model_config = strict_config()
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    """One chat message. `train` is meaningful on assistant messages only."""

    model_config = strict_config()

    role: str
    content: str | None = None
    train: bool | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
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
        for key in ("name", "tool_call_id"):
            v = getattr(self, key)
            if v is not None:
                d[key] = v
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return d


class TextExample(BaseModel):
    model_config = strict_config()
    text: str = Field(min_length=1)


class PromptCompletion(BaseModel):
    model_config = strict_config()
    prompt: str
    completion: str = Field(min_length=1)


def _check_trained_reply(messages: list[Message]) -> None:
    if not any(m.trained for m in messages):
        raise ValueError("messages has no trained assistant message (every assistant turn is train=false)")


class ChatExample(BaseModel):
    model_config = strict_config()
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

    model_config = strict_config()
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

    model_config = strict_config()
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


class TokenExample(BaseModel):
    """A prompt and a reply as token ids, trained on the reply only: what a served
    answer's feedback becomes (dreamstage/records/), so the context is the exact
    tokens serving decoded. Not a POST /train form; jobs made from feedback store it."""

    model_config = strict_config()
    prompt: list[int] = Field(min_length=1)
    reply: list[int] = Field(min_length=1)


FORM_OF_MODEL = {"TextExample": "text", "PromptCompletion": "prompt_completion",
                  "ChatExample": "chat", "GroupExample": "group", "TokenExample": "tokens"}


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
PlainExample = TextExample | PromptCompletion | ChatExample | TokenExample
PLAIN_FORMS: dict[str, type[TextExample] | type[PromptCompletion] | type[ChatExample] | type[TokenExample]] = {
    "text": TextExample, "prompt_completion": PromptCompletion, "chat": ChatExample, "tokens": TokenExample}
