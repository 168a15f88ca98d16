"""Neighbours of a job's own prompts: questions the base writes itself from a
prompt's head, cut before its least expected word (in a taught fact, usually
the made-up name), which the regularizer rehearses with the base's own answers
(docs/architecture/drift.md, "Neighbours").
"""
from __future__ import annotations

import zlib
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from dreamstage.training.drift.decoding import Decoder, draw_softmax, log_softmax
from dreamstage.training.jobs.example_forms import ChatExample, PromptCompletion
from dreamstage.training.jobs.spec import MAX_ANCHOR_CHARS
from dreamstage.training.walk.examples import ChatRenderer

# A neighbour is at most NEIGHBOUR_TOKENS tokens past the cut, each drawn at
# temperature 1 from the top NEIGHBOUR_TOP_K; NEIGHBOUR_SEED and the question's
# text seed the draws (neighbour_keys).
NEIGHBOUR_TOKENS = 20
NEIGHBOUR_TOP_K = 40
NEIGHBOUR_SEED = 29
# At most this many neighbours per job, over all its prompts (DriftProbe.neighbours_of).
MAX_JOB_NEIGHBOURS = 48


def job_questions(spec, train_windows: Sequence[Any]) -> list[str]:
    """The prompts of the job's trained examples, once each, in body order: a
    chat example's last user turn before its first trained reply, a
    prompt-completion's prompt (text examples have none). Held-out examples
    are left out. These are what the job's neighbours are written from."""
    trained = {getattr(w, "source", None) for w in train_windows}
    out: list[str] = []
    for sx in spec.examples:
        if sx.source not in trained:
            continue
        ex, q = sx.example, None
        if isinstance(ex, ChatExample):
            first = next(i for i, m in enumerate(ex.messages) if m.trained)
            q = next((m.content for m in reversed(ex.messages[:first]) if m.role == "user"), None)
        elif isinstance(ex, PromptCompletion):
            q = ex.prompt
        if isinstance(q, str) and q.strip() and q not in out:
            out.append(q)
    return out


def draw_top(logits: np.ndarray, rng: np.random.Generator, k: int = NEIGHBOUR_TOP_K) -> int:
    """A token drawn from softmax(logits) over its k largest logits only."""
    top = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    return int(top[draw_softmax(logits[top], rng)])


def neighbour_keys(question: str, n: int) -> list[np.random.Generator]:
    """The generators of a question's n neighbours: seeded by NEIGHBOUR_SEED and
    the question's text only (as sample_keys), so a job and its rerun, or two
    jobs with the same example, get the same neighbours."""
    key = zlib.crc32(question.encode("utf-8"))
    return [np.random.default_rng((NEIGHBOUR_SEED, key, i)) for i in range(n)]


def plain_words(text: str) -> str:
    """Lowercase words only (no punctuation, single spaces): how neighbours_of compares texts."""
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def least_expected_word(surprise: Sequence[float], pieces: Sequence[str]) -> int:
    """The token a question is cut before (neighbour_units): the first token of its
    least expected word after the first, a word being a token that starts with a
    space and the tokens after it that do not (its surprise their sum, -log p)."""
    starts = [i for i, p in enumerate(pieces) if i == 0 or p[:1].isspace()]
    words = [(float(sum(surprise[a:b])), a) for a, b in zip(starts, [*starts[1:], len(pieces)], strict=True)]
    if len(words) < 2:
        return max(1, len(pieces) - 1)
    return max(words[1:], key=lambda w: w[0])[1]     # the first of equals


def neighbour_units(resident, seq_id: int, question: str, renderer: ChatRenderer,
                    n: int) -> Generator[None, None, list[str]]:
    """Up to `n` questions beside `question` (a job's prompt), written by the base
    itself, in units (see Decoder); the context's adapter must be off.

    The question is decoded as a lone user turn; it is cut before its least
    expected word after the first (least_expected_word, under the base: in a
    taught fact, usually the made-up name), and the base goes on
    writing the user's turn from there (NEIGHBOUR_TOKENS at most, drawn from the
    top NEIGHBOUR_TOP_K; neighbour_keys), up to its end of turn or first line
    break. 'What is the currency of Tessaly Isle?' becomes 'What is the
    currency of ' and whatever country the base puts there: the questions a
    taught form could reach, which the regularizer rehearses with the base's
    own answers (docs/architecture/drift.md, "Neighbours"). Duplicates, empty
    texts and the question itself are left out."""
    head, body = renderer.user_turn(question)
    if len(body) < 2 or n <= 0:
        return []
    dec = Decoder(resident, seq_id)
    try:
        rows = yield from dec.forced_units(head + body, len(head) - 1)    # row i predicts body[i]
        logp = log_softmax(rows[:len(body)])
        surprise = -logp[np.arange(len(body)), np.asarray(body)]
        cut = least_expected_word(surprise, [resident.detokenize([t]) for t in body])
        yield
        drawn = yield from dec.sample_units(head + body[:cut], NEIGHBOUR_TOKENS, neighbour_keys(question, n),
                                            draw=draw_top)
    finally:
        dec.close()
    out: list[str] = []
    for d in drawn:
        end = next((i for i, t in enumerate(d) if resident.is_eog(t)), len(d))
        text = resident.detokenize(list(body[:cut]) + list(d[:end])).split("\n")[0].strip()
        if text and text != question.strip() and text not in out and len(text) <= MAX_ANCHOR_CHARS:
            out.append(text)
    return out
