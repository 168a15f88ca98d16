"""Feedback on served answers: the POST /v1/feedback body, validated once here, and what each kind trains.

- `correction`: the answer it should have given. Trains the recorded prompt's exact tokens with the
  corrected reply (a plain example: context untrained, the reply and its end-of-turn trained).
- `rating`: a number on one answer. Pending ratings of answers to one prompt (same adapter, same prompt
  tokens: the choices of an `n > 1` request, or separate requests) train as one weighted group with weights
  from `rating_weights`; a group whose weights are all zero (alike negative ratings) trains nothing.
- `preferred` / `rejected`: two answers to one prompt; a group of the two with weights +1 and -1.

In a group, a negative-weight reply trains only where it departs from the liked ones (`departures`), at
DISLIKE_SHARE of its weight (`trained_weights`).

A reply is tokenized as training renders it (the chat template's reply span: content + end-of-turn; a
completion's text + EOS); its context is the prompt tokens serving decoded, never re-rendered.
"""
from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dreamstage.records.store import ServedAnswer

MAX_ID_CHARS = 200
MAX_CORRECTION_CHARS = 1 << 16


class AnswerRef(BaseModel):
    """One served answer: a completion id and its choice."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    index: int = Field(0, ge=0, le=127)


class FeedbackRequest(BaseModel):
    """POST /v1/feedback: `id` (+ `index`) with `correction` or `rating`, or `preferred` and `rejected`
    (each an id, index 0, or `{id, index}`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    index: int = Field(0, ge=0, le=127)
    correction: str | None = Field(None, min_length=1, max_length=MAX_CORRECTION_CHARS)
    rating: float | None = Field(None, ge=-1e6, le=1e6)
    preferred: AnswerRef | Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    rejected: AnswerRef | Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> FeedbackRequest:
        given = [k for k in ("correction", "rating", "preferred") if getattr(self, k) is not None]
        if self.rejected is not None and self.preferred is None:
            raise ValueError("rejected: needs preferred (a preference names both answers)")
        if len(given) != 1:
            raise ValueError("give exactly one of correction, rating, or preferred with rejected"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.preferred is not None:
            if self.rejected is None:
                raise ValueError("preferred: needs rejected (a preference names both answers)")
            if self.id is not None:
                raise ValueError("id: a preference names its answers in preferred and rejected, not id")
        elif self.id is None:
            raise ValueError(f"id: required with {given[0]} (the completion id the answer carried)")
        return self

    @property
    def kind(self) -> str:
        return "correction" if self.correction is not None else "rating" if self.rating is not None else "preference"

    def ref(self, which: str = "id") -> AnswerRef:
        """The answer `which` ("id", "preferred", "rejected") names."""
        if which == "id":
            assert self.id is not None
            return AnswerRef(id=self.id, index=self.index)
        v = getattr(self, which)
        return AnswerRef(id=v, index=0) if isinstance(v, str) else v


def prompt_key(adapter: str, prompt_tokens: list[int]) -> str:
    """Answers with one key were answers to one prompt by one adapter: their ratings form one group."""
    h = hashlib.sha256(adapter.encode() + b"\0" + ",".join(map(str, prompt_tokens)).encode())
    return h.hexdigest()[:32]


def rating_weights(ratings: list[float]) -> list[float]:
    """Group weights from ratings: the advantage a_g = r_g - mean(r), divided by the mean |a| over the group,
    so whatever the rating scale and however many answers were liked or disliked, the liked ones' weights add
    up to G/2 and the disliked ones' to -G/2 (the group loss, a mean over G, pulls by half and pushes by half).
    When the ratings do not differ (one answer rated, or all alike) there is no comparison in them: positive
    ones still train their answers, r_g / max|r| (a lone +1 at weight 1); zero or negative ones weigh 0, for
    pushed away with nothing to pull towards a rated prompt's answers turned to unrelated text
    (docs/architecture/feedback.md)."""
    if not ratings or any(not math.isfinite(r) for r in ratings):
        raise ValueError(f"ratings must be finite numbers, got {ratings}")
    mean = sum(ratings) / len(ratings)
    adv = [r - mean for r in ratings]
    if max(abs(a) for a in adv) <= 1e-12 * max(1.0, abs(mean)):
        top = max(ratings)
        return [r / top if top > 0 else 0.0 for r in ratings]
    scale = sum(abs(a) for a in adv) / len(adv)
    return [a / scale for a in adv]


# A disliked reply is pushed on at most this many tokens from where it departs from the liked replies.
DEPARTURE_TOKENS: int | None = None
# A group's disliked replies push by this share of what its liked replies pull (1: as much; at 1, four rounds
# of ratings moved the guard's anchors: docs/architecture/feedback.md).
DISLIKE_SHARE = 0.25


def trained_weights(weights: list[float]) -> list[float]:
    """A group's weights as trained: each negative one times DISLIKE_SHARE."""
    return [w * DISLIKE_SHARE if w < 0 else w for w in weights]


def departures(replies: list[list[int]], weights: list[float]) -> list[tuple[int, int]]:
    """Each reply's trained span [start, end) in a group: a positive- or zero-weight reply trains whole; a
    negative-weight one from its departure, the length of its longest common prefix with any positive-weight
    reply (that prefix is what the liked reply says too, so it carries no negative weight), for at most
    DEPARTURE_TOKENS tokens. A disliked reply that departs nowhere (a liked reply starts with all of it) has
    an empty span: nothing of it is pushed."""
    liked = [r for r, w in zip(replies, weights, strict=True) if w > 0]
    out = []
    for r, w in zip(replies, weights, strict=True):
        if w >= 0:
            out.append((0, len(r)))
            continue
        start = max((_common_prefix(r, t) for t in liked), default=0)
        out.append((start, len(r) if DEPARTURE_TOKENS is None else min(len(r), start + DEPARTURE_TOKENS)))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ReplyRenderer:
    """A reply's tokens as training renders them, after a recorded prompt (see the module doc)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._chat = None

    def reply_tokens(self, answer: ServedAnswer, text: str) -> list[int]:
        if answer.kind == "completion":
            reply = self.tok.tokenize(text, False, False)
            return [*reply, self.tok.eos] if self.tok.eos >= 0 else reply
        from dreamstage.training.jobs.example_forms import ChatExample, Message
        from dreamstage.training.walk.examples import ChatRenderer

        if self._chat is None:
            self._chat = ChatRenderer(self.tok)
        context = [Message.model_validate({**m, "train": False} if m.get("role") == "assistant" else m)
                   for m in answer.messages or []]
        ex = ChatExample(messages=[*context, Message(role="assistant", content=text)], tools=answer.tools)
        r = self._chat.render(ex)
        span = r.replies[-1]
        return r.tokens[span.start:span.end]


def reply_entry(answer: ServedAnswer, text: str, tokens: list[int], **more: Any) -> dict[str, Any]:
    return {"record_id": answer.id, "index": answer.index, "text": text, "tokens": tokens, **more}
