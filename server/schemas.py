"""Request models for the OpenAI-compatible routes.

Wrong JSON types are refused rather than coerced ("5" is not 5; 2.0 is 2,
as JSON Schema reads it: the edge decodes a whole number as an integer). Fields no
model here declares are kept aside, not refused, as llama-server and vLLM do:
the route names them in a response header and the log (`ignored_fields`), and
`--strict-api` turns them back into 400s so a typo (`max_token`) is named.
The llama-server / vLLM extras that mean something here are declared and
honoured; those that do not are in IGNORED_EXTRAS, accepted in either mode.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dreamstage.serving.chat import ROLES
from dreamstage.serving.sampling import BANNED_LOGIT


class StrictModel(BaseModel):
    # allow_inf_nan: Python's json reads Infinity and NaN, which no field means.
    # extra="allow": undeclared fields land in model_extra, for ignored_fields().
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True, allow_inf_nan=False)


# Fields llama-server or vLLM define that change nothing here: accepted even
# with --strict-api, and listed in the ignored-fields header like unknown ones.
IGNORED_EXTRAS = frozenset({"n_probs", "skip_special_tokens", "guided_decoding_backend",
                            "spaces_between_special_tokens", "id_slot", "return_tokens", "timings_per_token"})


def ignored_fields(model: BaseModel, prefix: str = "") -> tuple[list[str], list[str]]:
    """(unknown, ignored_extras): paths of the undeclared fields of a request, nested models included."""
    unknown: list[str] = []
    extras: list[str] = []
    for name in model.model_extra or {}:
        path = f"{prefix}.{name}" if prefix else name
        (extras if name in IGNORED_EXTRAS and not prefix else unknown).append(path)
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, list) and not (value and isinstance(value[0], StrictModel)):
            continue        # a list holds models or none: 1.5 million token ids need no walk on the event loop
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, StrictModel):
                sub = f"{prefix}.{name}" if prefix else name
                u, e = ignored_fields(item, sub if i is None else f"{sub}[{i}]")
                unknown += u
                extras += e
    return unknown, extras


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)   # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    """A call an assistant message made earlier in the conversation."""
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=64)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema of the arguments object
    strict: bool | None = None


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-cpp-python's spelling

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.answer_schema() is None:
            raise ValueError("json_schema.schema: required for type json_schema")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer follows (None: any JSON value, or plain text)."""
        return self.json_schema.schema_ if self.json_schema is not None else self.schema_


StopField = str | Annotated[list[str], Field(max_length=16)] | None


class LoraEntry(StrictModel):
    """llama-server's per-request adapter: {"id": i | "name": n, "scale": s} (adapter_select.py)."""
    id: int | None = Field(None, ge=0, le=2**31 - 1)
    name: str | None = Field(None, min_length=1, max_length=80)
    scale: float = Field(1.0, ge=-100.0, le=100.0)

    @model_validator(mode="after")
    def _one_of(self) -> LoraEntry:
        if (self.id is None) == (self.name is None):
            raise ValueError("each lora entry gives id or name (one of them)")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs: one constraint on the answer (Constraint)."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")   # a JSON schema, or its JSON text
    regex: str | None = Field(None, min_length=1, max_length=1 << 16)
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = Field(None, min_length=1)                   # GBNF, root rule "root"
    json_object: bool | None = None


class Constraint(BaseModel):
    """The one constraint a request puts on its answer, as given: `kind` is "gbnf" (value: the
    grammar), "json" (value: a schema, its JSON text, or None for any JSON value), "regex" (the
    whole answer matches it) or "choice" (the answer is one of the strings); `param` names the field."""
    model_config = ConfigDict(frozen=True)
    param: str
    kind: str                   # "gbnf", "json", "regex" or "choice"
    value: Any = None


class _Sampling(StrictModel):
    # an adapter name, name@version, "base" or the base model's id (adapter_select.py); none: the default adapter
    model: str | None = Field(None, max_length=200)
    lora: Annotated[list[LoraEntry], Field(max_length=64)] | None = None
    # Sampling fields left out (None) take the model's defaults (sampling.model_defaults).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)   # llama.cpp's int32; larger values would wrap
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, gt=0.0, le=1.0)        # llama-server / vLLM; 1.0: off
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)   # vLLM's name for repeat_penalty
    repeat_last_n: int | None = Field(None, ge=-1, le=2**31 - 1)    # llama-server; -1: the whole context
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)   # llama.cpp's uint32; larger values would wrap
    stop: StopField = None
    # OpenAI's {"token id": bias} or llama-server's [[id, bias | false]]; false and -100 and below ban
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | \
        Annotated[list[Annotated[list[int | float | bool], Field(min_length=2, max_length=2)]],
                  Field(max_length=4096)] | \
        None = Field(None)
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(max_length=64)] | None = None
    ignore_eos: bool = False       # llama-server / vLLM: end-of-generation tokens do not stop
    # vLLM: no end-of-generation or stop token is drawn, and no stop string is looked for, before this many tokens
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    cache_prompt: bool = True      # llama-server: False starts the slot's K/V afresh
    n_predict: int | None = Field(None, ge=-1)   # llama-server's max_tokens; -1: to the context's end
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)   # choices; at most the server's slots (checked by the route)
    user: str | None = None
    store: bool | None = None      # OpenAI's; false: this exchange is never recorded (serve --record)
    grammar: str | None = Field(None, min_length=1)  # GBNF, root rule "root"
    # vLLM's constraints: structured_outputs, and the guided_* fields it replaced
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=1 << 16)
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = Field(None, min_length=1)

    def constraints(self) -> list[Constraint]:
        """Every constraint the request gives (at most one is allowed: _one_constraint_given)."""
        out = []
        if self.grammar is not None:
            out.append(Constraint(param="grammar", kind="gbnf", value=self.grammar))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "gbnf")):
            if getattr(self, name) is not None:
                out.append(Constraint(param=name, kind=kind, value=getattr(self, name)))
        so = self.structured_outputs
        if so is not None:
            for name, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "gbnf")):
                if getattr(so, name) is not None:
                    out.append(Constraint(param=f"structured_outputs.{name.rstrip('_')}", kind=kind,
                                          value=getattr(so, name)))
            if so.json_object:
                out.append(Constraint(param="structured_outputs.json_object", kind="json"))
        return out

    def limit(self) -> int | None:
        """The most tokens an answer may have (None: to a stop or the context's end)."""
        return self._predict()

    @model_validator(mode="after")
    def _min_within_limit(self):
        limit = self.limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than the {limit} tokens an answer may have")
        return self

    @model_validator(mode="after")
    def _one_constraint_given(self):
        given = [c.param for c in self.constraints()]
        if len(given) > 1:
            raise ValueError(f"give at most one constraint on the answer (got {', '.join(given)})")
        return self

    @field_validator("repetition_penalty")
    @classmethod
    def _one_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        # repeat_penalty is declared first, so it is validated by now
        if v is not None and info.data.get("repeat_penalty") not in (None, v):
            raise ValueError("give either repeat_penalty or repetition_penalty, not both")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is None:
            return v
        if isinstance(v, dict):
            if len(v) > 4096:
                raise ValueError("at most 4096 tokens")
            bad = next((k for k in v if not (k.isascii() and k.isdigit())), None)
            if bad is not None:
                raise ValueError(f"key {bad[:32]!r} is not a token id")
            return v
        for i, (token, bias) in enumerate(v):
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"[{i}][0]: a token id (an integer >= 0), got {token!r}")
            if bias is True or (not isinstance(bias, bool) and not -100.0 <= bias <= 100.0):
                raise ValueError(f"[{i}][1]: a bias in [-100, 100] or false, got {bias!r}")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token, bias) pairs; a ban (false, or -100 and below) is BANNED_LOGIT."""
        if self.logit_bias is None:
            return ()
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        out = []
        for key, bias in items:
            value = BANNED_LOGIT if bias is False or float(bias) <= -100.0 else float(bias)
            out.append((int(key), value))
        return tuple(out)

    def sampling_given(self, slot_ctx: int) -> dict[str, Any]:
        """The SamplingParams fields this request sets (the rest keep the model's defaults)."""
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        penalty = self.repeat_penalty if self.repeat_penalty is not None else self.repetition_penalty
        if penalty is not None:
            given["repeat_penalty"] = penalty
        if self.repeat_last_n is not None:
            given["penalty_last_n"] = slot_ctx if self.repeat_last_n < 0 else self.repeat_last_n
        return given

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _predict(self) -> int | None:
        # n_predict -1 (llama-server's "no limit") and absence are both None here
        return None if self.n_predict is None or self.n_predict < 0 else max(self.n_predict, 1)


# Request fields that are SamplingParams fields of the same name.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "frequency_penalty", "presence_penalty",
                    "seed")


# More messages than any slot could hold is refused while parsing: validating
# 110k messages took 0.65 s of the event loop, which every stream shares.
MAX_MESSAGES = 4096


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)   # needs logprobs: true
    chat_template_kwargs: dict[str, Any] | None = None   # extra variables for the chat template
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # None: auto with tools
    parallel_tool_calls: bool | None = None     # False: at most one call is returned

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v, info: ValidationInfo):
        tools = info.data.get("tools") or []
        if v in ("required",) or isinstance(v, NamedToolChoice):
            if not tools:
                raise ValueError("needs tools")
            if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
                raise ValueError(f"names {v.function.name!r}, which is not in tools")
        return v

    def constraints(self) -> list[Constraint]:
        out = super().constraints()
        rf = self.response_format
        if rf is not None and rf.type != "text":
            out.append(Constraint(param="response_format", kind="json", value=rf.answer_schema()))
        return out

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self.constraints()
        if given and self.forced_tools():
            raise ValueError(f"tool_choice: a required or named tool call cannot be combined with {given[0].param}")
        return self

    def offered_tools(self) -> list[dict]:
        """The tools the model is told about: none with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self) -> list[dict]:
        """The tools a grammar must hold the answer to: all with "required", the named one, else none."""
        if not self.tools or self.tool_choice is None or self.tool_choice in ("none", "auto"):
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            return [t.model_dump(exclude_none=True) for t in self.tools if t.function.name == name]
        return self.offered_tools()

    def logprob_count(self) -> int | None:
        """None: no logprobs; else how many top alternatives each token carries."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else self._predict()


# Prompts one /v1/completions request may batch (OpenAI's bound on the array).
MAX_PROMPTS = 2048


class CompletionRequest(_Sampling):
    # one prompt (text, or token ids) or a batch of them (each answered by n choices, in order)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: int | None = Field(None, ge=1)  # None: to a stop or the context's end, as llama-server
    echo: bool = False          # the prompt's text (and, with logprobs, its scores) before the answer
    # A dreamstage extension: parse control-token text in the prompt (e.g. a
    # hand-written "<|im_start|>") as control tokens. Off by default, so user
    # text cannot forge turns; llama.cpp's special-token pass is also quadratic.
    parse_special: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)   # each token's logprob and this many alternatives
    suffix: None = None

    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self._predict()

    def prompt_values(self) -> list[str | list[int]]:
        """The prompts, in order: one, or each of the batch."""
        return _one_or_many(self.prompt)


class EmbeddingRequest(StrictModel):
    """OpenAI's POST /v1/embeddings: one text, texts, token ids or lists of them."""
    input: str | Annotated[list[str], Field(min_length=1, max_length=64)] | \
        Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)] | \
        Annotated[list[Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]],
                  Field(min_length=1, max_length=64)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"   # base64: little-endian float32 bytes
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input, as text or token ids."""
        return _one_or_many(self.input)


def _one_or_many(v: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's text-or-tokens field as a list of items: one text, one list of ids, or a list of either."""
    if isinstance(v, str):
        return [v]
    if v and isinstance(v[0], int):
        return [v]          # a list of ids is one item
    return list(cast("list[str] | list[list[int]]", v))


class TokenizeRequest(StrictModel):
    """llama-server's POST /tokenize: text, or text pieces and token ids mixed."""
    content: str | list[str | Annotated[int, Field(ge=0, le=2**31 - 1)]] = ""
    add_special: bool = False       # BOS etc., as the vocabulary wants, before the first text piece
    parse_special: bool = True      # control-token text becomes control tokens (llama-server's default)
    with_pieces: bool = False       # each token as {"id", "piece"}


class DetokenizeRequest(StrictModel):
    """llama-server's POST /detokenize."""
    tokens: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(default_factory=list)
