"""Prompts into token ids on worker threads, before the engine sees them.

Two attacks shaped this module (issue 15):
- **Freezing every stream.** llama.cpp's special-token pass
  (`parse_special=true`) is quadratic in the number of special-token matches:
  a 1.1 MB prompt of `"<|im_end|>x"` took 30 s. On the engine thread that
  stalls every stream. Here tokenizing runs on worker threads (llama_tokenize
  reads only the vocabulary, as llama-server's HTTP threads do), user text is
  tokenized with `parse_special=false` (linear), and a prompt whose byte length
  proves it cannot fit the slot is refused before any tokenizing at all.
- **Chat-template injection.** A user message containing `<|im_start|>system`
  must stay text. The chat template is rendered once with unguessable markers
  in place of each message's content; the template's own text is tokenized
  with special tokens parsed and each content with them as plain text.
"""
from __future__ import annotations

import asyncio
import re
import secrets

from dreamstage.server.errors import APIError

# Concurrent tokenizations: each holds a CPU core for a long prompt, and the
# engine thread needs one too.
_TOKENIZE_SLOTS = 2


class PromptTokenizer:
    def __init__(self, model, slot_ctx: int):
        self.model = model
        self.slot_ctx = slot_ctx
        # No token's text is longer than this, so a prompt of more bytes than
        # slot_ctx * max_piece has more than slot_ctx tokens: refused unread.
        # Every token's text, control tokens' included (logprobs and echo read these).
        self.pieces: tuple[bytes, ...] = tuple(model.token_piece(t, True) for t in range(model.n_vocab))
        self.max_piece_bytes = max(1, max(len(p) for p in self.pieces))
        self.max_prompt_bytes = slot_ctx * self.max_piece_bytes
        lc, vocab = model.lc, model.vocab
        self.control_texts = tuple(sorted({model.token_text(t) for t in range(model.n_vocab)
                                           if lc.llama_vocab_get_attr(vocab, t) & (lc.LLAMA_TOKEN_ATTR_CONTROL
                                                                                   | lc.LLAMA_TOKEN_ATTR_USER_DEFINED)}
                                          - {""}))
        self._slots = asyncio.Semaphore(_TOKENIZE_SLOTS)

    def check_size(self, n_bytes: int, param: str) -> None:
        if n_bytes > self.max_prompt_bytes:
            raise APIError(400, f"{param}: {n_bytes} bytes is more than any prompt that fits the per-slot context "
                                f"of {self.slot_ctx} tokens can be (at most {self.max_piece_bytes} bytes a token)",
                           param, "context_length_exceeded")

    async def text(self, prompt: str, parse_special: bool, param: str = "prompt") -> list[int]:
        """A completion prompt: user text, special tokens parsed only on request; `param` names it in a refusal."""
        self.check_size(len(prompt.encode("utf-8")), param)
        async with self._slots:
            return await asyncio.to_thread(self.model.tokenize, prompt, True, parse_special)

    async def mixed(self, content: str | list[str | int], add_special: bool, parse_special: bool) -> list[int]:
        """llama-server's /tokenize input: text pieces tokenized, token ids kept; only the
        first piece gets the vocabulary's added tokens. Ids outside the vocabulary are a 400."""
        pieces: list[str | int] = [content] if isinstance(content, str) else list(content)
        for i, p in enumerate(pieces):
            if isinstance(p, int) and p >= self.model.n_vocab:
                raise APIError(400, f"content[{i}]: token {p} is not in the vocabulary (0..{self.model.n_vocab - 1})",
                               f"content[{i}]")
        if parse_special:       # the quadratic special-token pass: bounded as a prompt is
            self.check_size(sum(len(p.encode("utf-8")) for p in pieces if isinstance(p, str)), "content")
        async with self._slots:
            return await asyncio.to_thread(self._mixed, pieces, add_special, parse_special)

    def _mixed(self, pieces: list[str | int], add_special: bool, parse_special: bool) -> list[int]:
        out: list[int] = []
        for i, p in enumerate(pieces):
            out += [p] if isinstance(p, int) else self.model.tokenize(p, add_special and i == 0, parse_special)
        return out

    async def detokenize(self, tokens: list[int]) -> str:
        """llama-server's /detokenize: the tokens' pieces (control tokens as their text) joined."""
        bad = next((i for i, t in enumerate(tokens) if t >= self.model.n_vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad}]: token {tokens[bad]} is not in the vocabulary "
                                f"(0..{self.model.n_vocab - 1})", f"tokens[{bad}]")
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", "replace")

    async def chat(self, chat_template, messages: list[dict], variables: dict | None = None,
                   tools: list[dict] | None = None) -> list[int]:
        """A chat prompt: the template's text parses special tokens, message content never does.
        `variables`: extra template variables (chat_template_kwargs); `tools`: for a template that reads them."""
        self.check_size(sum(len(m["content"].encode("utf-8")) for m in messages), "messages")
        async with self._slots:
            # Rendering a long conversation takes a while too: off the event loop, which carries every stream.
            return await asyncio.to_thread(self._chat, chat_template, messages, variables, tools)

    def _chat(self, chat_template, messages: list[dict], variables: dict | None = None,
              tools: list[dict] | None = None) -> list[int]:
        self._refuse_control_text_outside_content(messages, tools)
        try:
            segments, located = chat_segments(lambda ms: chat_template.render(ms, variables, tools), messages)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        if not located:
            self._refuse_control_text(messages)
        self.check_size(sum(len(t.encode("utf-8")) for t, _ in segments), "messages")
        out: list[int] = []
        add_special = not chat_template.starts_with_bos(segments[0][0])
        for text, parse_special in segments:
            if text:
                out += self.model.tokenize(text, add_special=add_special and not out, parse_special=parse_special)
        return out

    def _refuse_control_text_outside_content(self, messages: list[dict], tools: list[dict] | None) -> None:
        """Tool definitions, tool calls' arguments and names are rendered as template text, where
        special tokens are parsed: a control token's text there could forge a turn, so it is a 400."""
        stack: list[tuple[object, str]] = [(tools or [], "tools")]
        stack += [({k: v for k, v in m.items() if k != "content"}, f"messages[{i}]") for i, m in enumerate(messages)]
        while stack:
            value, path = stack.pop()
            if isinstance(value, str):
                hit = next((c for c in self.control_texts if c in value), None)
                if hit is not None:
                    raise APIError(400, f"{path}: contains the control token {hit!r}, which the chat template "
                                        "would read as one", path, "control_token_in_content")
            elif isinstance(value, dict):
                stack.extend((v, f"{path}.{k}") for k, v in value.items())
            elif isinstance(value, list):
                stack.extend((v, f"{path}[{j}]") for j, v in enumerate(value))

    def _refuse_control_text(self, messages: list[dict]) -> None:
        for i, m in enumerate(messages):
            hit = next((c for c in self.control_texts if c in m["content"]), None)
            if hit is not None:
                raise APIError(400, f"messages[{i}].content: contains the control token {hit!r}, and this model's "
                                    "chat template rewrites message content, so it cannot be kept as plain text",
                               f"messages[{i}].content", "control_token_in_content")


def chat_segments(render, messages: list[dict]) -> tuple[list[tuple[str, bool]], bool]:
    """The rendered chat prompt as (text, parse_special) segments: template text
    parses special tokens, message content never does.

    `render(messages) -> str` is the chat template. The nonce makes the markers
    unguessable, so content cannot forge one. If the template transforms
    content (the marked render, with the contents put back, differs from the
    real render), the content cannot be located: then the whole prompt is one
    segment, the second value is False, and the caller refuses content that
    holds a control token."""
    nonce = secrets.token_hex(8)
    marked = render([{**m, "content": f"\x00{nonce}.{i}\x00"} for i, m in enumerate(messages)])
    pieces = re.split(f"\x00{nonce}\\.(\\d+)\x00", marked)
    # re.split with one group alternates: text, index, text, index, ..., text
    segments = [(piece, True) if k % 2 == 0 else (messages[int(piece)]["content"], False)
                for k, piece in enumerate(pieces)]
    real = render(messages)
    if "".join(t for t, _ in segments) == real:
        return [seg for seg in segments if seg[0]] or [("", True)], True
    return [(real, True)], False
