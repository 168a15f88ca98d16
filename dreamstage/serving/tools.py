"""Tool calling without llama calls: the prompt text that offers tools to a
model whose chat template does not, the grammar that forces a call, and the
parsers that turn a model's output into calls.

Formats read (`parse_tool_calls`), the ones common chat templates teach:
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a
  control token, which the served text omits, so a bare JSON list is read too);
- Llama 3.x: the whole answer one JSON object `{"name": ..., "parameters": {...}}`
  (after an optional `<|python_tag|>`), several separated by `;`;
- a generic JSON answer: `{"tool_calls": [...]}`, `{"tool_call": {...}}` or one call object.
A call must name an offered tool and carry an object of arguments; anything
else (malformed JSON, an unknown name) leaves the answer as text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The call format this server teaches a template that has no tool support,
# and the one a grammar forces: Hermes's, which many models have seen.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_HERMES = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str      # JSON text of an object, as OpenAI's tool_calls carry it


def offer_text(tools: list[dict]) -> str:
    """System-prompt text that describes `tools` (OpenAI's tool objects) and the call format."""
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call these functions. Each is described by a JSON object:\n"
            f"<tools>\n{specs}\n</tools>\n"
            "To call one, answer with its name and arguments as JSON between tags, and nothing else:\n"
            f'{CALL_OPEN}{{"name": "function_name", "arguments": {{"argument": "value"}}}}{CALL_CLOSE}')


def call_text(name: str, arguments: str) -> str:
    """An assistant's earlier call, written back into a prompt in the format offer_text teaches."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return CALL_OPEN + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + CALL_CLOSE


def _arguments_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def prompt_messages(messages: list[dict], offered: list[dict], native: bool) -> list[dict]:
    """Chat messages as the template reads them. A template that reads tools (`native`)
    gets assistant tool_calls with their arguments as objects (the Hugging Face
    convention) and tool messages' tool_call_id; for one that does not, earlier calls
    become CALL_OPEN/CALL_CLOSE text in the assistant's content and the `offered`
    tools a system message (offer_text), added to the first one or put first."""
    if native:
        return [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": _arguments_value(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    out = []
    for src in messages:
        m = {k: v for k, v in src.items() if k not in ("tool_calls", "tool_call_id")}
        calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                          for c in src.get("tool_calls") or [])
        if calls:
            m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
        out.append(m)
    if offered:
        text = offer_text(offered)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _as_call(obj, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):           # OpenAI's own shape, echoed back
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _all_calls(objs, names: frozenset[str]) -> list[ToolCall] | None:
    calls = [_as_call(o, names) for o in objs]
    return None if not calls or any(c is None for c in calls) else [c for c in calls if c is not None]


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]] | None:
    """(the text before the calls, the calls) when `text` holds calls to tools in `names`; None otherwise."""
    if CALL_OPEN in text:
        head = text[:text.index(CALL_OPEN)].strip()
        calls = _all_calls([_json(m) for m in _HERMES.findall(text)], names)
        return (head, calls) if calls else None
    body = text.strip()
    head = ""
    if "[TOOL_CALLS]" in body:
        head, _, body = (s.strip() for s in body.partition("[TOOL_CALLS]"))
    body = body.removeprefix("<|python_tag|>").strip()
    whole = _json(body)
    if isinstance(whole, list):
        calls = _all_calls(whole, names)
    elif isinstance(whole, dict) and isinstance(whole.get("tool_calls"), list):
        calls = _all_calls(whole["tool_calls"], names)
    elif isinstance(whole, dict) and "tool_call" in whole:
        calls = _all_calls([whole["tool_call"]], names)
    elif isinstance(whole, dict):
        calls = _all_calls([whole], names)
    else:      # Llama 3.x: several JSON objects separated by ";"
        parts = [_json(p) for p in body.split(";")] if ";" in body else []
        calls = _all_calls(parts, names) if parts else None
    return (head, calls) if calls else None


# Where a call can begin after some text: the Hermes tag, Mistral's marker.
_CALL_MARKERS = (CALL_OPEN, "[TOOL_CALLS]")
# An answer whose first text starts so may be a call as a whole (a JSON object
# or list, Llama 3.x's tag): it is held until it ends.
_WHOLE_CALL_STARTS = ("{", "[", "<|python_tag|>", *_CALL_MARKERS)


def streamable_prefix(text: str) -> int:
    """How much of an answer still being written can be streamed as content: the
    text that no call format could claim, whatever comes after it. parse_tool_calls
    gives the same text (less surrounding white space) as the content before any call."""
    body = text.lstrip()
    if not body or any(body.startswith(s) or s.startswith(body) for s in _WHOLE_CALL_STARTS):
        return 0
    cut = min((i for i in (text.find(m) for m in _CALL_MARKERS) if i >= 0), default=len(text))
    # a marker may be arriving: hold back a tail that begins one
    for m in _CALL_MARKERS:
        for k in range(min(len(m) - 1, cut), 0, -1):
            if text[cut - k:cut] == m[:k]:
                cut -= k
                break
    return len(text[:cut].rstrip())


def forced_call_grammar(tools: list[dict], json_schema_grammar) -> str:
    """GBNF for exactly one call, in CALL_OPEN/CALL_CLOSE tags, to one of `tools`, its
    arguments valid for the tool's JSON schema. `json_schema_grammar(schema) -> GBNF` converts."""
    options = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"oneOf": options}
    inner = json_schema_grammar(schema)
    renamed = re.sub(r"^root(\s*::=)", r"tool-call\1", inner, count=1, flags=re.M)
    return f'root ::= "{CALL_OPEN}" tool-call "{CALL_CLOSE}"\n' + renamed
