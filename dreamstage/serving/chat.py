"""Chat messages to a prompt, with the chat template stored in the GGUF.

Rendering is pure Python (Jinja2 through llama-cpp-python's formatter), so the
HTTP side may call it; tokenizing the result happens on the engine thread.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, cast

from dreamstage import native

# The roles a message may have, in chat requests and in training examples alike.
ROLES = ("system", "developer", "user", "assistant", "tool")

# ChatML, as llama.cpp falls back to when a GGUF carries no template: serving
# and training render with it alike, so a model without a template trains on
# the prompts it is served.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Template variables the formatter sets itself; a request's variables cannot replace them.
_RESERVED = frozenset({"messages", "eos_token", "bos_token", "raise_exception", "add_generation_prompt",
                       "functions", "function_call", "tools", "tool_choice", "strftime_now"})


def reads_tools(template_source: str) -> bool:
    """Whether a chat template reads a `tools` variable (else tools go into a system message)."""
    return "tools" in template_source


@lru_cache(maxsize=16)
def chat_formatter(source: str, bos_text: str, eos_text: str, generation_prompt: bool) -> Any:
    """llama-cpp-python's Jinja2ChatFormatter for a template, compiled once per
    (source, BOS, EOS, generation prompt) and shared: rendering keeps no state,
    and a compile costs milliseconds that every job's renderer would pay again.
    Raises what Jinja raises for a template that does not compile."""
    native.llama_cpp()  # llama_cpp modules must load against our libllama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return Jinja2ChatFormatter(source, eos_token=eos_text, bos_token=bos_text, add_generation_prompt=generation_prompt)


class ChatTemplate:
    def __init__(self, template: str | None, bos_text: str, eos_text: str):
        self.source = template or FALLBACK_TEMPLATE
        self.bos_text = bos_text
        self._fmt = chat_formatter(self.source, bos_text, eos_text, True)

    @classmethod
    def for_model(cls, model) -> ChatTemplate:
        return cls(model.chat_template(), model.token_text(model.bos) if model.bos >= 0 else "",
                   model.token_text(model.eos) if model.eos >= 0 else "")

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads a `tools` variable (else tools go into a system message)."""
        return reads_tools(self.source)

    def render(self, messages: list[dict], variables: dict[str, Any] | None = None,
               tools: list[dict] | None = None) -> str:
        """The prompt text; raises ValueError when the template refuses the messages.

        `variables` are extra template variables (a request's chat_template_kwargs,
        e.g. enable_thinking); they cannot replace the ones set here."""
        extra = {k: v for k, v in (variables or {}).items() if k not in _RESERVED}
        try:
            # our message dicts have the shape of llama_cpp's TypedDicts, which a list[dict] cannot say
            return self._fmt(messages=cast("list[Any]", messages), tools=cast("Any", tools or None), **extra).prompt
        except ValueError:
            raise
        except Exception as e:  # jinja errors of any kind mean bad messages for this template
            raise ValueError(f"the model's chat template could not render these messages: {e}") from e

    def starts_with_bos(self, prompt: str) -> bool:
        """Whether the rendered prompt already carries BOS (then the tokenizer must not add another)."""
        return bool(self.bos_text) and prompt.startswith(self.bos_text)
