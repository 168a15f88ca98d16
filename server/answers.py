"""The bodies the two completion routes answer with: whole (`full`) or as
stream chunks (`opening`, `prompt`, `delta`, `final`), in OpenAI's shapes.

A shape is built per request from what it asked for (logprobs, echo); the
engine's events (serving.generation) go in, JSON-ready dicts come out.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from dreamstage.server.bridge import Collected
from dreamstage.server.logprobs import chat_entry, completion_logprobs
from dreamstage.serving.generation import Delta, Finished, PromptScored
from dreamstage.serving.sampling import TokenLogprob
from dreamstage.serving.tools import parse_tool_calls, streamable_prefix


def usage(ends: list[Finished], starts: tuple[int, ...] = (0,)) -> dict:
    """One request's usage: each prompt once (its choices share it; `starts`: the index of each
    prompt's first choice), every choice's completion."""
    prompt = sum(ends[i].prompt_tokens for i in starts)
    completion = sum(f.completion_tokens for f in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(ends[i].cached_tokens for i in starts)}}


@dataclass
class _Held:
    """A streamed answer read for tool calls at its end: its text so far, how much of it
    went out as content, and its tokens' logprobs."""
    text: str = ""
    sent: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class ChatShape:
    """With `tools` (the offered names), an answer is read for tool calls (serving.tools)
    once it ends. Streamed, the text no call format could claim goes out as it comes
    (`streamable_prefix`); the rest is held to the end, then sent as one delta of
    content or of tool_calls. With logprobs the whole answer is held."""

    def __init__(self, base: dict, pieces: tuple[bytes, ...], logprobs: bool, tools: frozenset[str] | None = None,
                 one_call: bool = False):
        self.base, self.pieces, self.logprobs = base, pieces, logprobs
        self.tools, self.one_call = tools, one_call
        self._held: dict[int, _Held] = {}

    def assistant_message(self, text: str) -> tuple[dict, bool]:
        """The assistant message for `text`, and whether it holds tool calls."""
        parsed = parse_tool_calls(text, self.tools) if self.tools else None
        if parsed is None:
            return {"role": "assistant", "content": text}, False
        head, calls = parsed
        calls = calls[:1] if self.one_call else calls
        return {"role": "assistant", "content": head or None,
                "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}, True

    def _chunk(self, version: int | None, choices: list[dict]) -> dict:
        return {**self.base, "object": "chat.completion.chunk", "adapter_version": version, "choices": choices}

    def opening(self, version: int | None, n: int) -> dict | None:
        return self._chunk(version, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None} for i in range(n)])

    def prompt(self, ev: PromptScored, version: int | None, index: int) -> dict | None:
        return None

    def delta(self, ev: Delta, version: int | None, index: int) -> dict | None:
        if self.tools:
            held = self._held.setdefault(index, _Held())
            held.text += ev.text
            if ev.logprob is not None:
                held.logprobs.append(ev.logprob)
            safe = 0 if self.logprobs else streamable_prefix(held.text)
            if safe <= held.sent:
                return None
            text, held.sent = held.text[held.sent:safe], safe
            return self._chunk(version, [{"index": index, "delta": {"content": text}, "logprobs": None,
                                          "finish_reason": None}])
        lp = None if ev.logprob is None else {"content": [chat_entry(self.pieces, ev.logprob)]}
        if not ev.text and lp is None:
            return None
        return self._chunk(version, [{"index": index, "delta": {"content": ev.text}, "logprobs": lp,
                                      "finish_reason": None}])

    def final(self, fin: Finished, index: int) -> list[dict]:
        out, finish = [], fin.finish_reason
        if self.tools:
            held = self._held.pop(index, _Held())
            message, called = self.assistant_message(held.text)
            lp = {"content": [chat_entry(self.pieces, t) for t in held.logprobs]} if self.logprobs else None
            if called:     # what went out is the content before the calls, white space aside
                rest = (message["content"] or "")[len(held.text[:held.sent].strip()):]
                delta: dict = {"content": rest or None, "tool_calls": [
                    {"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
                finish = "tool_calls"
            else:
                rest = held.text[held.sent:]
                delta = {"content": rest}
            if called or rest or not held.sent:
                out.append(self._chunk(fin.adapter_version, [{"index": index, "delta": delta, "logprobs": lp,
                                                              "finish_reason": None}]))
        out.append(self._chunk(fin.adapter_version, [{"index": index, "delta": {}, "logprobs": None,
                                                      "finish_reason": finish}]))
        return out

    def full(self, got: list[Collected], starts: tuple[int, ...] = (0,)) -> dict:
        def choice(i: int, c: Collected) -> dict:
            lp = {"content": [chat_entry(self.pieces, t) for t in c.logprobs]} if self.logprobs else None
            message, called = self.assistant_message(c.text)
            return {"index": i, "message": message, "logprobs": lp,
                    "finish_reason": "tool_calls" if called else c.finished.finish_reason}
        return {**self.base, "object": "chat.completion", "adapter_version": got[0].finished.adapter_version,
                "choices": [choice(i, c) for i, c in enumerate(got)],
                "usage": usage([c.finished for c in got], starts)}


class CompletionShape:
    """`echo` puts the prompt's text first; with `logprobs`, its tokens' scores lead the lists.
    Choice i answers prompt i // n (a batch of prompts, n choices each)."""

    def __init__(self, base: dict, pieces: tuple[bytes, ...], logprobs: bool, echo_texts: list[str] | None,
                 prompts: list[list[int]], n: int = 1):
        self.base, self.pieces, self.logprobs = base, pieces, logprobs
        self.echo_texts, self.prompts, self.n = echo_texts, prompts, n
        self._offsets: dict[int, int] = {}   # per choice: where its next token's text starts

    def _echo(self, index: int) -> str | None:
        return None if self.echo_texts is None else self.echo_texts[index // self.n]

    def _start(self, index: int) -> int:
        """Where the choice's first token's text starts (after its echo)."""
        echo = self._echo(index)
        return len(echo) if echo is not None else 0

    def _chunk(self, version: int | None, index: int, text: str, logprobs, finish: str | None) -> dict:
        return {**self.base, "adapter_version": version,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def _prompt_logprobs(self, scores, index: int) -> dict:
        return completion_logprobs(self.pieces, list(scores), self.prompts[index // self.n], 0)

    def opening(self, version: int | None, n: int) -> dict | None:
        if self.echo_texts is None or self.logprobs:
            return None                      # with logprobs the echo waits for the prompt's scores
        return {**self.base, "adapter_version": version,
                "choices": [{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}
                            for i in range(n)]}

    def prompt(self, ev: PromptScored, version: int | None, index: int) -> dict | None:
        echo = self._echo(index)
        if echo is None:
            return None
        return self._chunk(version, index, echo, self._prompt_logprobs(ev.logprobs, index), None)

    def delta(self, ev: Delta, version: int | None, index: int) -> dict | None:
        lp = None
        at = self._offsets.get(index, self._start(index))
        if ev.logprob is not None:
            lp = completion_logprobs(self.pieces, [ev.logprob], [ev.token], at)
        self._offsets[index] = at + len(ev.text)
        if not ev.text and lp is None:
            return None
        return self._chunk(version, index, ev.text, lp, None)

    def final(self, fin: Finished, index: int) -> list[dict]:
        return [self._chunk(fin.adapter_version, index, "", None, fin.finish_reason)]

    def _choice(self, i: int, c: Collected) -> dict:
        echo = self._echo(i)
        text = c.text if echo is None else echo + c.text
        lp = None
        if self.logprobs:
            lp = completion_logprobs(self.pieces, list(c.logprobs), [t.token for t in c.logprobs], self._start(i))
            if echo is not None and c.prompt_logprobs is not None:
                head = self._prompt_logprobs(c.prompt_logprobs, i)
                lp = {k: head[k] + lp[k] for k in lp}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finished.finish_reason}

    def full(self, got: list[Collected], starts: tuple[int, ...] = (0,)) -> dict:
        return {**self.base, "adapter_version": got[0].finished.adapter_version,
                "choices": [self._choice(i, c) for i, c in enumerate(got)],
                "usage": usage([c.finished for c in got], starts)}
