"""Token logprobs in the OpenAI shapes: chat's `{"content": [...]}` and completions'
parallel lists. The engine reports token ids and natural-log probabilities
(TokenLogprob); the text and bytes come from the vocabulary's pieces, read once
at startup (PromptTokenizer.pieces), so nothing here calls llama."""
from __future__ import annotations

import math

from dreamstage.serving.sampling import TokenLogprob

# JSON has no -Infinity: a token the grammar ruled out, or a banned one, is reported this low (OpenAI's floor).
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) and value > _FLOOR else _FLOOR


def _text(pieces: tuple[bytes, ...], token: int) -> str:
    return pieces[token].decode("utf-8", "replace")


def chat_entry(pieces: tuple[bytes, ...], tl: TokenLogprob) -> dict:
    """One entry of a chat choice's `logprobs.content`."""
    def one(token: int, lp: float) -> dict:
        return {"token": _text(pieces, token), "logprob": _lp(lp), "bytes": list(pieces[token])}
    return {**one(tl.token, tl.logprob), "top_logprobs": [one(t, lp) for t, lp in tl.top]}


def completion_logprobs(pieces: tuple[bytes, ...], entries: list[TokenLogprob | None], tokens: list[int],
                        offset: int) -> dict:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs, text_offset.
    `tokens[i]` is entry i's token (an entry is None where a position has no score: the
    prompt's first token); `offset` is where the first token's text starts in the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, tl in zip(tokens, entries, strict=True):
        text = _text(pieces, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if tl is None else _lp(tl.logprob))
        out["top_logprobs"].append(None if tl is None else {_text(pieces, t): _lp(lp) for t, lp in tl.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out
