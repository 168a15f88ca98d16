"""The base's records of anchor prompts: at a job's start the resident base
model (adapter off) answers each anchor greedily, and at each token of that
answer we keep its next-token distribution (the top TOP_K log-probabilities
and the mass of the rest), plus, for a rehearsal anchor, continuations it
samples at temperature 1 with the distributions they were drawn from. The
measurement decodes the same sequences with an adapter on (measure.py); the
regularizer trains on them (rehearsal.py).
"""
from __future__ import annotations

import zlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np

from dreamstage.training.drift.decoding import Decoder, log_softmax, top_k
from dreamstage.training.jobs.example_forms import ChatExample, Message
from dreamstage.training.walk.examples import ChatRenderer

# Tokens of each base answer recorded: long enough that a changed fact or a
# changed wording shows, short enough that one anchor is one short decode.
ANCHOR_TOKENS = 24
# Seeds an anchor's samples together with its prompt's text (sample_keys).
SAMPLE_SEED = 12


@dataclass(frozen=True)
class AnchorBase:
    """One anchor as the base model answered it."""

    prompt: str
    prompt_tokens: tuple[int, ...]      # the chat-rendered prompt, generation header included
    continuation: tuple[int, ...]       # the base's greedy answer as serving generates it (end-of-turn if reached)
    forced: tuple[int, ...]             # the teacher-forced sequence both sides decode: prompt + continuation[:-1]
    answer: tuple[int, ...]             # the greedy answer as that batched decode sees it (compared tokens)
    top_ids: np.ndarray                 # (len(answer), TOP_K) int32
    top_logp: np.ndarray                # (len(answer), TOP_K) float32 log-probabilities
    tail_logp: np.ndarray               # (len(answer),) float64: log of the mass outside top_ids
    # continuations sampled from the base at temperature 1 (a rehearsal anchor's; see sample_keys)
    samples: tuple[tuple[int, ...], ...] = ()
    # per sample, the base's distribution it was drawn from at each of its tokens:
    # (ids, log-probabilities), each (len(sample), TOP_K), as top_ids and top_logp
    sample_top: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    def leads(self) -> np.ndarray:
        """At each answer position, log p1 - log p2 of the base's top two tokens (nats)."""
        if self.top_logp.shape[1] < 2:
            return np.full(self.top_logp.shape[0], np.inf)
        two = -np.partition(-self.top_logp.astype(np.float64), 1, axis=1)[:, :2]
        return two[:, 0] - two[:, 1]


def prompt_tokens(tok, prompt: str, renderer: ChatRenderer | None = None) -> tuple[int, ...]:
    """A user turn rendered as a job's chat example renders it, up to the reply's first token."""
    r = (renderer or ChatRenderer(tok)).render(ChatExample(messages=[Message(role="user", content=prompt),
                                                                    Message(role="assistant", content="x")]))
    return tuple(r.tokens[:r.replies[0].start])


def sample_keys(prompt: str, n: int) -> list[np.random.Generator]:
    """The generators of an anchor's n samples: seeded by SAMPLE_SEED, the
    prompt's text and the sample's index, not by a job, so a record cached
    across jobs and one made again (a restart, another process) sample alike."""
    key = zlib.crc32(prompt.encode("utf-8"))
    return [np.random.default_rng((SAMPLE_SEED, key, i)) for i in range(n)]


def record_units(resident, seq_id: int, prompt: str, prompt_toks: Sequence[int],
                 max_tokens: int = ANCHOR_TOKENS, samples: int = 0) -> Generator[None, None, AnchorBase]:
    """The base's answer and distributions for one anchor, and `samples`
    continuations sampled from it (sample_keys), in units (see Decoder).
    The context's adapter must be off during every unit."""
    dec = Decoder(resident, seq_id)
    try:
        cont = yield from dec.greedy_units(prompt_toks, max_tokens)
        yield
        return (yield from _finish_units(dec, prompt, prompt_toks, cont, max_tokens, samples))
    finally:
        dec.close()


def record_many_units(resident, seq_ids: Sequence[int], prompts: Sequence[str],
                      prompt_toks: Sequence[Sequence[int]], max_tokens: int = ANCHOR_TOKENS,
                      samples: int = 0) -> Generator[None, None, list[AnchorBase]]:
    """record_units of several anchors, anchor i on seq_ids[i]: their greedy
    answers decoded together (Decoder.greedy_many_units: one batch per answer
    token), the rest of each record on seq_ids[0] alone, in the fixed pieces
    the measurement repeats."""
    dec = Decoder(resident, seq_ids[0])
    try:
        conts = yield from dec.greedy_many_units(prompt_toks, seq_ids, max_tokens)
        out = []
        for prompt, toks, cont in zip(prompts, prompt_toks, conts, strict=True):
            yield
            out.append((yield from _finish_units(dec, prompt, toks, cont, max_tokens, samples)))
        return out
    finally:
        dec.close()


def _finish_units(dec: Decoder, prompt: str, prompt_toks: Sequence[int], cont: list[int], max_tokens: int,
                  samples: int) -> Generator[None, None, AnchorBase]:
    """An anchor's record from its greedy answer `cont`: the teacher-forced
    distributions and the samples, on dec's sequence."""
    forced = (*prompt_toks, *cont[:-1])
    logp = log_softmax((yield from dec.forced_units(forced, len(prompt_toks) - 1)))
    drawn: list[list[int]] = []
    tops: list[tuple[np.ndarray, np.ndarray]] = []
    if samples > 0:
        yield
        drawn = yield from dec.sample_units(prompt_toks, max_tokens, sample_keys(prompt, samples), tops)
    # The records are the teacher-forced decode of exactly `forced`, which the
    # measurement repeats piece for piece (the CPU kernels depend on the batch
    # size; so the logits are bit-identical with the adapter off); where its argmax
    # departs from the generated token, the compared answer ends at its own choice.
    arg = logp.argmax(axis=1)
    answer = list(cont)
    for i, t in enumerate(cont):
        if int(arg[i]) != t:
            answer = cont[:i] + [int(arg[i])]
            logp = logp[:i + 1]
            break
    top, top_logp = top_k(logp)
    rest = 1.0 - np.exp(top_logp).sum(axis=1)
    with np.errstate(divide="ignore"):
        tail = np.where(rest > 1e-12, np.log(np.clip(rest, 1e-300, None)), -np.inf)
    return AnchorBase(prompt, tuple(prompt_toks), tuple(cont), forced, tuple(answer), top,
                      top_logp.astype(np.float32), tail, tuple(tuple(d) for d in drawn), tuple(tops))
