"""Request models for the OpenAI-compatible routes.

Strict: wrong JSON types are refused rather than coerced ("5" is not 5), and
unknown fields are refused so a typo (`max_token`) is named instead of
silently ignored. OpenAI fields we accept but do not act on are declared
explicitly (`user`, `stream_options`, `n` = 1 only).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dreamstage.serving.chat import ROLES


class _Strict(BaseModel):
    # allow_inf_nan: Python's json reads Infinity and NaN, which no field means.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-cpp-python's spelling


StopField = str | Annotated[list[str], Field(max_length=16)] | None


class _Sampling(_Strict):
    model: str | None = None       # any id is accepted: one model is resident
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=2**31 - 1)   # llama.cpp's int32; larger values would wrap
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)   # llama.cpp's uint32; larger values would wrap
    stop: StopField = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    grammar: str | None = Field(None, min_length=1)  # GBNF, root rule "root"

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# More messages than any slot could hold is refused while parsing: validating
# 110k messages took 0.65 s of the event loop, which every stream shares.
MAX_MESSAGES = 4096


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    logprobs: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_grammar(self):
        if self.grammar and self.response_format and self.response_format.type != "text":
            raise ValueError("give either grammar or response_format, not both")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: Literal[False] = False
    # A dreamstage extension: parse control-token text in the prompt (e.g. a
    # hand-written "<|im_start|>") as control tokens. Off by default, so user
    # text cannot forge turns; llama.cpp's special-token pass is also quadratic.
    parse_special: bool = False
    logprobs: None = None
    suffix: None = None

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            return p[0]
        # a list of strings has exactly one item (the field's length bounds), taken above
        return cast("str | list[int]", p)
