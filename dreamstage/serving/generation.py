"""What a request is and what it gets back: the events the engine sends
through a request's sink, the request itself, the engine's refusals, and the
text stream that turns sampled tokens' bytes into text safe to emit.

Plain data and one small state machine, with no llama calls: the HTTP layer
and tests build and read these without the engine (dreamstage.serving.engine
re-exports them, the names callers have always used).
"""
from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

from dreamstage.adapters.choice import BASE, AdapterChoice
from dreamstage.serving.sampling import SamplingParams, TokenLogprob


# -- events sent to a request's sink ---------------------------------------------
@dataclass(frozen=True)
class Admitted:
    slot: int
    adapter_version: int | None      # the served version it runs on (None: a pinned version)
    prompt_tokens: int
    cached_tokens: int
    adapter: AdapterChoice = BASE


@dataclass(frozen=True)
class Delta:
    text: str          # may be "" while a multi-byte character or a stop-string prefix is held back
    token: int         # -1: held-back text flushed at the end, no token of its own
    logprob: TokenLogprob | None = None   # with GenerationRequest.logprobs


@dataclass(frozen=True)
class PromptScored:
    """The prompt's tokens scored by the model (GenerationRequest.prompt_logprobs), sent
    once the prompt is decoded, before the first Delta. Entry 0 is None (no context)."""
    logprobs: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True)
class Embedded:
    """The answer to an embedding request (GenerationRequest.embed): the mean of the
    prompt's last hidden states, L2-normalized. Ends the request, as Finished does."""
    embedding: tuple[float, ...]
    prompt_tokens: int


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (EOS/EOG or a stop string) | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    adapter_version: int | None
    adapter: AdapterChoice = BASE


@dataclass(frozen=True)
class Failed:
    status: int         # an HTTP status: 400 for bad input, 503 for shutdown, 500 otherwise
    message: str
    param: str | None = None


Event = Admitted | PromptScored | Delta | Finished | Embedded | Failed
Sink = Callable[[Event], None]


class QueueFull(RuntimeError):
    """More requests are outstanding than slots plus the waiting room."""


class EngineStopped(RuntimeError):
    """The engine is not running."""


@dataclass
class GenerationRequest:
    prompt: str | list[int]          # text (tokenized on the engine thread) or token ids
    max_tokens: int | None = None    # None: up to the slot's context budget
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    add_special: bool = True         # add BOS when the vocabulary wants it (text prompts)
    stop_tokens: frozenset[int] = frozenset()   # sampling one ends the request ("stop"), not emitted
    ignore_eos: bool = False         # end-of-generation tokens do not end the request
    min_tokens: int = 0              # no end-of-generation or stop token or stop string before this many tokens
    cache_prompt: bool = True        # False: the slot's cached prefix is not reused
    prompt_param: str = "prompt"     # the request field a too-long prompt is blamed on
    grammar_param: str = "grammar"   # the request field a grammar llama.cpp refuses (or that dead-ends) is blamed on
    logprobs: int | None = None      # each token's logprob with this many top alternatives; None: none
    prompt_logprobs: int | None = None   # score the prompt too (its whole prefix is decoded afresh)
    embed: bool = False              # decode the prompt only and answer its pooled embedding (Embedded)
    adapter: AdapterChoice | None = None   # None: the engine's default adapter (Engine.default_adapter)



# -- text streaming: UTF-8 split across tokens, and stop strings -------------------
class TextStream:
    """Turns token bytes into text that is safe to emit.

    A token may end inside a multi-byte UTF-8 character; the incremental
    decoder holds those bytes back. Text that could be the start of a stop
    string is held back too, so a stop string is never emitted.
    """

    def __init__(self, stop: tuple[str, ...]):
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    def push(self, data: bytes, look: bool = True) -> str:
        """The text now safe to emit; `look` False: stop strings are not looked for in this text."""
        text = self._held + self._dec.decode(data)
        if not self._stop or not look:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return text[:cut]
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep] if keep else text

    def flush(self) -> str:
        text = self._held + self._dec.decode(b"", final=True)
        self._held = ""
        return text
