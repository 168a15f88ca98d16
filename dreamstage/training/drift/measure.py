"""Drift: how far a job's adapter moves the model on prompts the job never taught.

At a job's start the resident base model (adapter off, on the resident
context) answers every anchor prompt greedily and we record, at each token of
its own answer, its next-token distribution (the top `TOP_K` log-probabilities
plus the mass of the rest). After (and during) training the same sequences
are decoded once more with the job's adapter on, and two figures come out:

- `drift_kl`: the mean over all recorded anchor tokens of KL(base || adapter),
  the base's distribution against the adapter's at the same position;
- `anchors_changed_raw`: the fraction of anchors whose greedy answer changed.
  Greedy decoding is deterministic, so the adapter's greedy answer equals the
  base's exactly when, at every position of the base's answer, the adapter's
  argmax is the base's token. One teacher-forced decode per anchor decides it
  (no generation with the adapter on).
- `anchors_changed`: the same, counting only the positions where the base's
  top token led its second by more than the probe's `noise_margin`: the
  widest drop of the base token's lead that adapters which learned nothing
  (B ~ N(0, NULL_SIGMA^2)) made at any position of the same anchors
  (`DriftProbe.null_margin`, `lead_drops`). On a quantized model a
  perturbation of any size flips the base's near ties (the CPU backend's
  8-bit activations); those flips are the measurement's noise, not the job's.
  Without a noise margin both figures are the same.

The same records give the regularizer its data: each rehearsal anchor's
prompt with continuations the base itself sampled at temperature 1 as the
trained replies (`AnchorBase.windows`), ordinary cross-entropy examples the
native trainer already takes. In expectation over the samples that
cross-entropy is KL(base || adapter) plus a constant, the soft-target term
without a soft-target loss (docs/architecture/drift.md).

Every function here makes llama calls on the resident context, so it runs on
the engine thread, between decode batches, on a sequence no slot is using.
An anchor is decoded in units (a piece of PIECE_TOKENS tokens, or one
generated token), as many per engine step as fit the step's time, so a
waiting request waits about one unit, not one anchor.
"""
from __future__ import annotations

import ctypes
import json
import math
import time
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import numpy as np

from dreamstage.training.jobs.request import ChatExample, Message
from dreamstage.training.jobs.spec import DEFAULT_REHEARSAL, REHEARSAL_MODES
from dreamstage.training.walk.examples import ChatRenderer, TrainWindow, epoch_order

T = TypeVar("T")

# Tokens of each base answer recorded: long enough that a changed fact or a
# changed wording shows, short enough that one anchor is one short decode.
ANCHOR_TOKENS = 24
# Base probabilities kept per position. The rest is one "tail" bucket, so the
# KL we report is the KL of the two distributions coarsened to K+1 outcomes:
# never more than the exact KL (it is a coarsening), and on the default model
# the top 256 tokens hold all but ~1e-3 of the base's mass at a typical
# anchor position (docs/architecture/drift.md).
TOP_K = 256
MAX_ANCHORS = 256
# Tokens of one teacher-forced decode: an anchor is decoded piece by piece at
# fixed offsets, a piece per unit of work, so that one engine step stays
# short (about 50 ms on one quiet core of the shared machine) and a record
# and its measurement meet the same batch shapes.
PIECE_TOKENS = 16
# The decode time one step of the probe aims at (at least one unit runs): the
# guard passes half the job's max_pause_ms.
DEFAULT_STEP_MS = 100.0
MAX_ANCHOR_CHARS = 1000
# Continuations the regularizer trains per rehearsal anchor, each sampled
# from the base at temperature 1 (docs/architecture/drift.md, "The
# regularizer"); a visit of the anchor trains one of them, the next one at
# its next visit. The stream of an anchor's samples is seeded by its prompt
# and the sample's index only, so every job of a process, and the benchmark,
# gets the same ones, and the first S of 8 are the S of 4.
REHEARSAL_SAMPLES = 4
SAMPLE_SEED = 12
# The adapters that learned nothing, whose lead drops set a probe's noise
# margin: the job's A, B drawn from N(0, NULL_SIGMA^2) with NULL_DRAWS seeds. On
# the default model the flips do not depend on sigma from 1e-4 to 1e-2
# (bench/bench_drift_floor.py); 1e-4 is well below any trained B. The margin is
# the NULL_RANK-th widest of the draws' widest drops, so a further null
# adapter's widest drop exceeds it with probability NULL_RANK / (NULL_DRAWS + 1):
# 10 % with the second of 19, as with the widest of the 9 of until 2026-12-04,
# but one draw far out no longer sets it alone (a job seed's draws reached
# 1.143 once where the rest stayed under 0.73). About 5 s a draw on one shared
# core, once per process.
NULL_SIGMA = 1e-4
NULL_DRAWS = 19
NULL_RANK = 2
NULL_SEED = 7
# Neighbours of a job's own prompts (neighbour_units): per prompt, this many
# questions the base writes itself from the prompt's head, cut before its
# least expected word (a made-up name, usually); at most NEIGHBOUR_TOKENS
# tokens each, drawn at temperature 1 from the top NEIGHBOUR_TOP_K tokens.
NEIGHBOURS = 2
NEIGHBOUR_TOKENS = 20
NEIGHBOUR_TOP_K = 40
NEIGHBOUR_SEED = 29
MAX_NEIGHBOURS = 48




def rehearsal_samples(mode: str) -> int:
    """Continuations to sample per rehearsal anchor for a job's rehearsal `mode`
    (spec.REHEARSAL_MODES): "soft" trains the greedy answer and needs none."""
    return 0 if mode == "soft" else REHEARSAL_SAMPLES


def soft_targets(ids: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Recorded top-K rows (ids, log-probabilities) as soft targets: (ids int32,
    probabilities float32), as recorded. A row sums to the mass of its K tokens
    (all but 1.4 % on average on the default model, at least 75 %); the native
    loss trains what they leave out as one more outcome, "any other token"
    (dream_window_soft_targets). Renormalized over the K tokens (until
    2026-12-04) the target was not the base: at the base itself the loss sat
    0.018 nats a token above its minimum, and the rehearsal moved the adapter
    to push the rest's mass onto the K tokens (docs/architecture/drift.md,
    "The rest of the distribution")."""
    p = np.exp(np.asarray(logp, np.float64))
    s = p.sum(axis=1, keepdims=True)
    p = np.where(s > 1.0, p / s, p)      # rounding: never over one
    return np.ascontiguousarray(ids, np.int32), p.astype(np.float32)


def _shipped(part: str) -> list[str]:
    text = resources.files("dreamstage").joinpath("data/anchors.json").read_text(encoding="utf-8")
    return list(json.loads(text)[part])


def load_anchors(extra: Iterable[str] = ()) -> list[str]:
    """The anchors drift is measured on: the shipped `measure` half
    (dreamstage/data/anchors.json), then `extra` (a job's own), without
    duplicates. The regularizer never trains on these (rehearsal_anchors)."""
    out: list[str] = []
    for p in [*_shipped("measure"), *extra]:
        if p not in out:
            out.append(p)
    return out


def rehearsal_anchors() -> list[str]:
    """The anchors the regularizer trains on: the shipped `rehearse` half,
    disjoint from every measured anchor (a job may not name one of these as
    its own anchor: TrainRequest refuses it)."""
    return _shipped("rehearse")


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

    def window(self, source: int, label: str, reply: Sequence[int] | None = None,
               top: tuple[np.ndarray, np.ndarray] | None = None) -> TrainWindow:
        """A distillation example: the prompt as context, `reply` (the base's
        greedy continuation when None) trained; with `top` (ids, log-probabilities)
        per reply token, against those distributions (soft_targets), not the tokens."""
        reply = tuple(self.continuation if reply is None else reply)
        mask = (0,) * len(self.prompt_tokens) + (1,) * len(reply)
        return TrainWindow(self.prompt_tokens + reply, mask, source, label,
                           soft=None if top is None else soft_targets(*top))

    def windows(self, source: int, label: str, mode: str | None = None) -> list[TrainWindow]:
        """The regularizer's examples of this anchor (`mode`, a job's `rehearsal`; the default when None):

        - "samples": one per sampled continuation, in sample order, each trained
          on its tokens (the greedy answer when none was sampled);
        - "soft": one, the greedy answer as the records decoded it (`answer`),
          each position trained against the base's recorded distribution there;
        - "soft-samples": one per sample, each position against the distribution
          it was drawn from (the greedy "soft" window when none was sampled)."""
        mode = DEFAULT_REHEARSAL if mode is None else mode
        if mode not in REHEARSAL_MODES:
            raise ValueError(f"rehearsal mode {mode!r} is not one of {', '.join(REHEARSAL_MODES)}")
        if mode == "soft" or (mode == "soft-samples" and not self.sample_top):
            return [self.window(source, f"{label}.soft", self.answer, (self.top_ids, self.top_logp))]
        if mode == "soft-samples":
            return [self.window(source, f"{label}.samples[{i}].soft", s, top)
                    for i, (s, top) in enumerate(zip(self.samples, self.sample_top, strict=True))]
        if not self.samples:
            return [self.window(source, label)]
        return [self.window(source, f"{label}.samples[{i}]", s) for i, s in enumerate(self.samples)]


@dataclass(frozen=True)
class Drift:
    """Drift figures of one adapter against the base records."""

    drift_kl: float                     # mean KL(base || adapter) over the anchors' answer tokens, nats
    anchors_changed: float              # fraction of anchors whose answer changed beyond the noise margin
    changed: int
    anchors: int
    tokens: int
    # per anchor: the first answer token where the greedy answer changed, or None
    first_change: tuple[int | None, ...] = ()
    ms: float = 0.0                     # the measurement's decodes (not the serving between them)
    # the fraction (and count) of anchors whose greedy answer changed at all, near ties
    # included; the same as anchors_changed when no noise margin was measured (None)
    anchors_changed_raw: float | None = None
    changed_raw: int | None = None
    noise_margin: float | None = None
    # per anchor: the base's lead (log p1 - log p2) at every answer position the adapter's argmax left
    flip_leads: tuple[tuple[float, ...], ...] = ()
    # per anchor: the lead drop at every answer position (lead_drops), nats
    drops: tuple[tuple[float, ...], ...] = ()
    # per anchor: its prompt (what changed_anchors names)
    prompts: tuple[str, ...] = ()
    # the widest lead drop of each null adapter the noise margin was read from, in draw order
    noise_draws: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.changed_raw is None:
            object.__setattr__(self, "changed_raw", self.changed)
            object.__setattr__(self, "anchors_changed_raw", self.anchors_changed)

    @property
    def widest_drop(self) -> float:
        """The widest lead drop at any answer position of any anchor (0.0 when none fell), nats."""
        return max([0.0, *(x for d in self.drops for x in d)])

    def changed_within(self, n_tokens: int) -> float:
        """The fraction of anchors whose answer changed within its first n_tokens."""
        return sum(f is not None and f < n_tokens for f in self.first_change) / max(len(self.first_change), 1)

    def as_dict(self) -> dict[str, Any]:
        return {"drift_kl": self.drift_kl, "anchors_changed": self.anchors_changed, "anchors": self.anchors,
                "anchors_changed_count": self.changed, "anchor_tokens": self.tokens,
                "anchors_changed_raw": self.anchors_changed_raw, "anchors_changed_raw_count": self.changed_raw,
                "noise_margin": self.noise_margin, "noise_draws": [round(x, 4) for x in self.noise_draws],
                "changed_anchors": self.changed_anchors()}

    def changed_anchors(self) -> list[dict[str, Any]]:
        """Every anchor whose greedy answer changed at all, widest first: its prompt,
        `lead` (the widest base lead at which the adapter's argmax left the base's
        token: the anchor counts in anchors_changed when it exceeds the noise margin),
        `first` (the first answer token that changed) and `beyond` (whether it counts)."""
        out = []
        for i, (leads, first) in enumerate(zip(self.flip_leads, self.first_change, strict=False)):
            if first is None:
                continue
            lead = max(leads, default=0.0)
            out.append({"anchor": self.prompts[i] if i < len(self.prompts) else None, "lead": round(lead, 4),
                        "first": first,
                        "beyond": self.noise_margin is None or any(x > self.noise_margin for x in leads)})
        return sorted(out, key=lambda a: -a["lead"])


def prompt_tokens(tok, prompt: str, renderer: ChatRenderer | None = None) -> tuple[int, ...]:
    """A user turn rendered as a job's chat example renders it, up to the reply's first token."""
    r = (renderer or ChatRenderer(tok)).render(ChatExample(messages=[Message(role="user", content=prompt),
                                                                    Message(role="assistant", content="x")]))
    return tuple(r.tokens[:r.replies[0].start])


# -- decoding on the resident context -----------------------------------------------------
class FixedSequence:
    """A sequence the caller owns outright (tests, benchmarks, a resident with
    no serving): always valid, nothing to give back. The engine's leases
    (`Engine.hold_idle_sequence`) have the same three members."""

    valid = True

    def __init__(self, seq_id: int):
        self.seq_id = seq_id

    def release(self) -> None:
        pass


class _Decoder:
    """Single-sequence decodes on the resident context, on `seq_id`, which the
    caller guarantees no serving slot holds. Each `*_units` method is a
    generator that yields after every `llama_decode` (a unit of work: one
    piece of PIECE_TOKENS teacher-forced tokens, or one generated token), so a
    caller can stop between units and go on at a later engine step; its
    return value is the result. The sequence is cleared before and after."""

    def __init__(self, resident, seq_id: int):
        self.rm, self.lc, self.seq_id = resident, resident.lc, seq_id
        self._batch: Any = None         # a llama_batch of PIECE_TOKENS, made at the first decode

    def clear(self) -> None:
        self.lc.llama_memory_seq_rm(self.rm.memory, self.seq_id, -1, -1)

    def close(self) -> None:
        if self._batch is not None:
            self.lc.llama_batch_free(self._batch)
            self._batch = None

    def _decode(self, tokens: Sequence[int], pos0: int, want_from: int) -> None:
        if self._batch is None:
            self._batch = self.lc.llama_batch_init(max(PIECE_TOKENS, 1), 0, 1)
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = self.seq_id
            batch.logits[i] = i >= want_from
        rc = self.lc.llama_decode(self.rm.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc} on the drift sequence {self.seq_id}")

    def _row(self, i: int) -> np.ndarray:
        ptr = self.lc.llama_get_logits_ith(self.rm.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.rm.n_vocab,)).astype(np.float64)

    def forced_units(self, tokens: Sequence[int], first_row: int) -> Generator[None, None, np.ndarray]:
        """Logits of rows first_row .. len(tokens)-1 of a teacher-forced decode, (rows, n_vocab).

        The sequence is decoded in pieces of PIECE_TOKENS at fixed offsets, so
        the same tokens always meet the same batch shapes: the CPU backend
        picks kernels by batch size, and a record and its later measurement
        must see the same arithmetic (bit-identical logits with the adapter off)."""
        rows: list[np.ndarray] = []
        self.clear()
        for a in range(0, len(tokens), PIECE_TOKENS):
            piece = tokens[a:a + PIECE_TOKENS]
            want = min(max(first_row - a, 0), len(piece))
            self._decode(piece, a, want)
            rows.extend(self._row(i) for i in range(want, len(piece)))
            yield
        self.clear()
        return np.stack(rows)

    def _prompt_units(self, prompt: Sequence[int]) -> Generator[None, None, np.ndarray]:
        """Decodes the prompt from position 0 in pieces; the logits of its last token."""
        if not prompt:
            raise ValueError("an answer needs a prompt of at least one token")
        for a in range(0, len(prompt), PIECE_TOKENS):
            if a:
                yield
            piece = prompt[a:a + PIECE_TOKENS]
            self._decode(piece, a, len(piece) - 1 if a + len(piece) == len(prompt) else len(piece))
        return self._row(len(piece) - 1)

    def _answer_units(self, row: np.ndarray, pos: int, max_tokens: int,
                      pick: Callable[[np.ndarray], int]) -> Generator[None, None, list[int]]:
        """The continuation from `row` (the logits at pos - 1), one decoded token
        a unit, each token `pick(logits)`; its end-of-generation token included when reached."""
        tok, out = pick(row), []
        while True:
            out.append(tok)
            if self.rm.is_eog(tok) or len(out) >= max_tokens:
                return out
            yield
            self._decode([tok], pos, 0)
            pos += 1
            tok = pick(self._row(0))

    def greedy_units(self, prompt: Sequence[int], max_tokens: int) -> Generator[None, None, list[int]]:
        """The greedy answer, its end-of-generation token included when reached."""
        self.clear()
        row = yield from self._prompt_units(prompt)
        out = yield from self._answer_units(row, len(prompt), max_tokens, lambda r: int(r.argmax()))
        self.clear()
        return out

    def sample_units(self, prompt: Sequence[int], max_tokens: int, rngs: Sequence[np.random.Generator],
                     tops: list | None = None, draw: Callable[[np.ndarray, np.random.Generator], int] | None = None
                     ) -> Generator[None, None, list[list[int]]]:
        """One continuation per generator in `rngs`, each token drawn from the
        softmax of its logits (temperature 1), as the greedy answer is decoded.
        The prompt is decoded once; each sample drops the one before it from
        the sequence and starts again from the prompt's last row. `tops`: a
        list that gets, per sample, the top-K rows (ids, log-probabilities) of
        the distributions its tokens were drawn from. `draw(logits, rng)` picks
        each token (default: the whole softmax, _draw)."""
        draw = _draw if draw is None else draw
        self.clear()
        row = yield from self._prompt_units(prompt)
        out = []
        for i, rng in enumerate(rngs):
            if i:
                yield
                self.lc.llama_memory_seq_rm(self.rm.memory, self.seq_id, len(prompt), -1)
            kept: list[np.ndarray] = []

            def pick(logits: np.ndarray, rng=rng, kept=kept) -> int:
                if tops is not None:
                    kept.append(logits)
                return draw(logits, rng)
            out.append((yield from self._answer_units(row, len(prompt), max_tokens, pick)))
            if tops is not None:
                ids, logp = _top_k(_log_softmax(np.stack(kept)))
                tops.append((ids, logp.astype(np.float32)))
        self.clear()
        return out

    def logits(self, tokens: Sequence[int], first_row: int) -> np.ndarray:
        """forced_units run straight through (tests, benchmarks)."""
        try:
            return run_steps(self.forced_units(tokens, first_row))
        finally:
            self.clear()
            self.close()

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """greedy_units run straight through (tests, benchmarks)."""
        try:
            return run_steps(self.greedy_units(prompt, max_tokens))
        finally:
            self.clear()
            self.close()


def set_context_adapter(resident, handle) -> None:
    """Put one llama_adapter_lora (scale 1: alpha/rank) or none on the resident context.
    Serving's adapter must be put back before the next decode batch."""
    lc = resident.lc
    if handle is None:
        rc = lc.llama_set_adapters_lora(resident.ctx, None, 0, None)
    else:
        if isinstance(handle, int):             # an address (Trainer.served_adapter)
            handle = ctypes.cast(ctypes.c_void_p(handle), lc.llama_adapter_lora_p_ctypes)
        arr = (lc.llama_adapter_lora_p_ctypes * 1)(handle)
        rc = lc.llama_set_adapters_lora(resident.ctx, arr, 1, (ctypes.c_float * 1)(1.0))
    if rc != 0:
        raise RuntimeError(f"llama_set_adapters_lora failed with {rc}")


def _draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits) (float64; inverse CDF of one uniform)."""
    p = np.exp(logits - logits.max())
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(c) - 1))


def sample_keys(prompt: str, n: int) -> list[np.random.Generator]:
    """The generators of an anchor's n samples: seeded by SAMPLE_SEED, the
    prompt's text and the sample's index, not by a job, so a record cached
    across jobs and one made again (a restart, another process) sample alike."""
    key = zlib.crc32(prompt.encode("utf-8"))
    return [np.random.default_rng((SAMPLE_SEED, key, i)) for i in range(n)]


def _top_k(logp: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The top k (ids int32, log-probabilities in logp's type) of each row of logp."""
    k = min(k, logp.shape[1])
    top = np.argpartition(-logp, k - 1, axis=1)[:, :k].astype(np.int32)
    return top, np.take_along_axis(logp, top, axis=1)


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    m = rows.max(axis=1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))


def record_units(resident, seq_id: int, prompt: str, prompt_toks: Sequence[int],
                 max_tokens: int = ANCHOR_TOKENS, samples: int = 0) -> Generator[None, None, AnchorBase]:
    """The base's answer and distributions for one anchor, and `samples`
    continuations sampled from it (sample_keys), in units (see _Decoder).
    The context's adapter must be off during every unit."""
    dec = _Decoder(resident, seq_id)
    try:
        cont = yield from dec.greedy_units(prompt_toks, max_tokens)
        yield
        forced = (*prompt_toks, *cont[:-1])
        logp = _log_softmax((yield from dec.forced_units(forced, len(prompt_toks) - 1)))
        drawn: list[list[int]] = []
        tops: list[tuple[np.ndarray, np.ndarray]] = []
        if samples > 0:
            yield
            drawn = yield from dec.sample_units(prompt_toks, max_tokens, sample_keys(prompt, samples), tops)
    finally:
        dec.close()
    # The measurement decodes the answer teacher-forced, in pieces of
    # PIECE_TOKENS. The CPU backend's kernels depend on the batch's size
    # (quantized activations for short batches, not for long ones), so the
    # same prefix gets other logits (by ~1 on the default model) one token at
    # a time than in a batch. The records are therefore the teacher-forced
    # decode of exactly `forced`, which the measurement repeats piece for
    # piece (bit-identical with the adapter off); where its argmax departs
    # from the generated token the compared answer ends at its own choice.
    arg = logp.argmax(axis=1)
    answer = list(cont)
    for i, t in enumerate(cont):
        if int(arg[i]) != t:
            answer = cont[:i] + [int(arg[i])]
            logp = logp[:i + 1]
            break
    top, top_logp = _top_k(logp)
    rest = 1.0 - np.exp(top_logp).sum(axis=1)
    with np.errstate(divide="ignore"):
        tail = np.where(rest > 1e-12, np.log(np.clip(rest, 1e-300, None)), -np.inf)
    return AnchorBase(prompt, tuple(prompt_toks), tuple(cont), forced, tuple(answer), top,
                      top_logp.astype(np.float32), tail, tuple(tuple(d) for d in drawn), tuple(tops))


def _draw_top(logits: np.ndarray, rng: np.random.Generator, k: int = NEIGHBOUR_TOP_K) -> int:
    """A token drawn from softmax(logits) over its k largest logits only."""
    top = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    return int(top[_draw(logits[top], rng)])


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
                    n: int = NEIGHBOURS) -> Generator[None, None, list[str]]:
    """Up to `n` questions beside `question` (a job's prompt), written by the base
    itself, in units (see _Decoder); the context's adapter must be off.

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
    dec = _Decoder(resident, seq_id)
    try:
        rows = yield from dec.forced_units(head + body, len(head) - 1)    # row i predicts body[i]
        logp = _log_softmax(rows[:len(body)])
        surprise = -logp[np.arange(len(body)), np.asarray(body)]
        cut = least_expected_word(surprise, [resident.detokenize([t]) for t in body])
        yield
        drawn = yield from dec.sample_units(head + body[:cut], NEIGHBOUR_TOKENS, neighbour_keys(question, n),
                                            draw=_draw_top)
    finally:
        dec.close()
    out: list[str] = []
    for d in drawn:
        end = next((i for i, t in enumerate(d) if resident.is_eog(t)), len(d))
        text = resident.detokenize(list(body[:cut]) + list(d[:end])).split("\n")[0].strip()
        if text and text != question.strip() and text not in out and len(text) <= MAX_ANCHOR_CHARS:
            out.append(text)
    return out


def drift_units(resident, seq_id: int, base: AnchorBase
                ) -> Generator[None, None, tuple[float, int, int | None, tuple[float, ...], np.ndarray]]:
    """(sum of KL(base || now) over the answer's tokens, tokens, the first answer token the
    greedy answer changes at or None, the base's lead at every position the argmax
    changes at, the lead drop at every answer position: how far the base token's lead
    over every other token fell, lead_drops) for whatever adapter the context has on
    during the units."""
    n = len(base.answer)
    dec = _Decoder(resident, seq_id)
    try:
        rows = yield from dec.forced_units(base.forced, len(base.prompt_tokens) - 1)
    finally:
        dec.close()
    logq = _log_softmax(rows[:n])
    diff = np.flatnonzero(logq.argmax(axis=1) != np.asarray(base.answer))
    first = int(diff[0]) if diff.size else None
    lp = base.top_logp.astype(np.float64)
    lq = np.take_along_axis(logq, base.top_ids.astype(np.int64), axis=1)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    q_rest = np.clip(1.0 - np.exp(lq).sum(axis=1), 1e-30, None)
    has_tail = np.isfinite(base.tail_logp)
    lt = np.where(has_tail, base.tail_logp, 0.0)
    kl += np.where(has_tail, np.exp(lt) * (lt - np.log(q_rest)), 0.0)
    base_leads = base.leads()
    leads = tuple(float(x) for x in base_leads[diff])
    drops = lead_drops(base_leads, logq, base.answer)
    # a coarsened KL is >= 0; float error at identical distributions may dip below
    return float(np.clip(kl, 0.0, None).sum()), n, first, leads, drops


def reply_lead_units(resident, seq_id: int, tokens: Sequence[int], mask: Sequence[int]
                     ) -> Generator[None, None, float]:
    """The smallest lead, over a training window's trained positions, of the
    token trained there over the best other token (log-probabilities, nats),
    for whatever adapter the context has on during the units: one
    teacher-forced decode of the window in the records' fixed pieces. Above 0
    exactly when every trained token is the greedy choice after the tokens
    before it, so a reply is answered at temperature 0 as it was taught (up
    to the rounding a serving batch of another shape adds). A mean loss
    cannot say that: one token the model no longer prefers is a small share
    of a reply's loss, and a greedy answer turns on it."""
    trained = [t for t, m in enumerate(mask) if m]
    if not trained or trained[0] < 1:
        raise ValueError("a window needs a trained position after its first token")
    first = trained[0] - 1
    dec = _Decoder(resident, seq_id)
    try:
        rows = yield from dec.forced_units(tokens[:trained[-1]], first)
    finally:
        dec.close()
    lead = math.inf
    for t in trained:
        row = rows[t - 1 - first]
        own = row[tokens[t]]
        row = row.copy()
        row[tokens[t]] = -np.inf
        lead = min(lead, float(own - row.max()))
    return lead


def lead_drops(base_leads: np.ndarray, logq: np.ndarray, answer: Sequence[int]) -> np.ndarray:
    """At each answer position, how far the base token's lead over every other token
    fell: the base's lead (log p1 - log p2) less the lead of the same token under
    `logq` (its log-probability less the best other's; negative where the argmax
    left it). The argmax leaves the base token exactly where the drop exceeds the
    base's lead, so the widest drop a null adapter makes anywhere bounds the
    leads its rounding could cross, near tie or not (DriftProbe.null_margin)."""
    pos = np.arange(len(answer))
    own = logq[pos, np.asarray(answer)]
    other = logq.copy()
    other[pos, np.asarray(answer)] = -np.inf
    return base_leads - (own - other.max(axis=1))


class DriftProbe:
    """The base records of one job's anchors and the drift measurement, in engine steps.

    `record()` and `measure()` are generators; the generator's return value is
    the result. Each `next()` is one engine step: it decodes units of one
    anchor (a piece of PIECE_TOKENS teacher-forced tokens, or one generated
    token) while they fit `step_ms` (at least one), with the measured adapter
    (or none) on the context, and puts serving's adapter back (`restore`)
    before it returns. An anchor's units run on a sequence held across steps:
    `seq_id` is an int (a sequence the caller owns) or a callable that lends
    one (`Engine.hold_idle_sequence`: a lease, or None while every slot is
    busy, and the step waits). Serving takes a lent sequence back whenever it
    needs the slot; the anchor then starts again on the next lease
    (`restarts` counts those). `samples`: continuations sampled per anchor at
    recording (the regularizer's rehearsal anchors; none for measured ones).
    """

    def __init__(self, resident, prompts: Sequence[str], *, seq_id, restore=lambda: None,
                 renderer: ChatRenderer | None = None, step_ms: float | None = DEFAULT_STEP_MS, samples: int = 0):
        if not prompts:
            raise ValueError("a drift probe needs at least one anchor prompt")
        if step_ms is not None and not step_ms > 0:
            raise ValueError(f"step_ms {step_ms!r} must be > 0")
        self.resident = resident
        self.prompts = list(prompts)
        self.lend = seq_id if callable(seq_id) else (lambda: FixedSequence(seq_id))
        self.restore = restore
        self.renderer = renderer or ChatRenderer(resident)
        self.step_s = step_ms / 1000.0 if step_ms is not None else math.inf
        self.samples = samples
        self.bases: list[AnchorBase] = []
        # flips at a base lead at most this wide are not counted in anchors_changed (None: all are)
        self.noise_margin: float | None = None
        self.noise_draws: tuple[float, ...] = ()   # each null draw's widest drop (null_margin)
        self.anchor_ms: float | None = None     # the recent cost of measuring one anchor (a running mean)
        self.restarts = 0                       # anchors started again after serving took the sequence back
        self._lease: Any = None

    def _held(self) -> Generator[None, None, Any]:
        while self._lease is None or not self._lease.valid:
            got = self.lend()
            self._lease = FixedSequence(got) if isinstance(got, int) else got
            if self._lease is None:
                yield
        return self._lease

    def _give_back(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None and lease.valid:
            lease.release()

    def _anchor(self, units_on, adapter) -> Generator[None, None, tuple[Any, float]]:
        """One anchor's units (`units_on(seq_id)`), as many per step as fit
        step_s, on the held sequence; (its result, its decode ms)."""
        ms = 0.0
        while True:
            lease = yield from self._held()
            units = units_on(lease.seq_id)
            try:
                while True:
                    t0 = time.perf_counter()
                    set_context_adapter(self.resident, adapter)
                    try:
                        while True:
                            u0 = time.perf_counter()
                            try:
                                next(units)
                            except StopIteration as stop:
                                return stop.value, ms + (time.perf_counter() - t0) * 1000.0
                            now = time.perf_counter()
                            if (now - t0) + (now - u0) > self.step_s:
                                break
                    finally:
                        self.restore()
                    ms += (time.perf_counter() - t0) * 1000.0
                    yield
                    if not lease.valid:             # serving took the slot back: start the anchor again
                        self.restarts += 1
                        break
            finally:
                units.close()

    def record(self, cache: dict | None = None) -> Generator[None, None, None]:
        """Records every anchor with the adapter off. `cache` maps prompt -> AnchorBase
        across jobs (the base model does not change while the process lives);
        a cached record with fewer samples than this probe wants is made again."""
        out = []
        try:
            for prompt in self.prompts:
                if cache is not None and prompt in cache and len(cache[prompt].samples) >= self.samples:
                    out.append(cache[prompt])
                    continue
                toks = prompt_tokens(self.resident, prompt, self.renderer)
                base, _ = yield from self._anchor(
                    lambda s, p=prompt, t=toks: record_units(self.resident, s, p, t, samples=self.samples), None)
                if cache is not None:
                    cache[prompt] = base
                out.append(base)
                yield
        finally:
            self._give_back()
        self.bases = out

    def neighbours_of(self, questions: Sequence[str], n: int = NEIGHBOURS, cache: dict | None = None,
                      exclude: Iterable[str] = ()) -> Generator[None, None, list[str]]:
        """The base's neighbours of each of `questions` (neighbour_units, adapter
        off), in order, without duplicates, at most MAX_NEIGHBOURS; `cache` maps
        (question, n) -> its neighbours across jobs. A neighbour that is, or
        begins with, one of `exclude` (the measured anchors: never trained) up
        to case, spacing and punctuation is left out (plain_words)."""
        shut = [plain_words(x) for x in exclude]
        out: list[str] = []
        try:
            for q in questions:
                if len(out) >= MAX_NEIGHBOURS:
                    break
                key = (q, n)
                if cache is not None and key in cache:
                    got = cache[key]
                else:
                    got, _ = yield from self._anchor(
                        lambda s, q=q: neighbour_units(self.resident, s, q, self.renderer, n), None)
                    if cache is not None:
                        cache[key] = got
                    yield
                out.extend(x for x in got if x not in out and not any(plain_words(x).startswith(m) for m in shut))
        finally:
            self._give_back()
        return out[:MAX_NEIGHBOURS]

    def measure(self, adapter_handle, indices: Sequence[int] | None = None) -> Generator[None, None, Drift]:
        """Drift of `adapter_handle` (a llama_adapter_lora, or its address)
        against the records of every anchor, or of those at `indices`; returns a Drift."""
        if not self.bases:
            raise RuntimeError("record() the base answers before measuring drift")
        kl_sum, tokens, first, leads, ms, drops, prompts = 0.0, 0, [], [], 0.0, [], []
        try:
            for base in (self.bases if indices is None else [self.bases[i] for i in indices]):
                prompts.append(base.prompt)
                (kl, n, f, lead, d), one = yield from self._anchor(lambda s, b=base: drift_units(self.resident, s, b),
                                                                adapter_handle)
                ms += one
                self.anchor_ms = one if self.anchor_ms is None else 0.5 * (self.anchor_ms + one)
                kl_sum, tokens = kl_sum + kl, tokens + n
                first.append(f)
                leads.append(lead)
                drops.append(tuple(float(x) for x in d))
                yield
        finally:
            self._give_back()
        raw = sum(f is not None for f in first)
        margin = self.noise_margin
        changed = raw if margin is None else sum(any(x > margin for x in lead) for lead in leads)
        return Drift(drift_kl=kl_sum / tokens if tokens else 0.0, anchors_changed=changed / len(first),
                     changed=changed, anchors=len(first), tokens=tokens, first_change=tuple(first), ms=ms,
                     anchors_changed_raw=raw / len(first), changed_raw=raw, noise_margin=margin,
                     flip_leads=tuple(leads), drops=tuple(drops), prompts=tuple(prompts),
                     noise_draws=tuple(self.noise_draws) if margin is not None else ())

    def reply_leads(self, adapter_handle, windows: Sequence[Any]) -> Generator[None, None, list[float]]:
        """reply_lead_units of each of `windows` (TrainWindows: tokens and mask)
        with `adapter_handle` on the context, in short steps; one lead a window."""
        out = []
        try:
            for w in windows:
                lead, _ = yield from self._anchor(
                    lambda s, w=w: reply_lead_units(self.resident, s, w.tokens, w.mask), adapter_handle)
                out.append(lead)
                yield
        finally:
            self._give_back()
        return out

    def null_margin(self, trainer, draws: int = NULL_DRAWS, sigma: float = NULL_SIGMA,
                    seed: int = NULL_SEED) -> Generator[None, None, float]:
        """The noise margin of these records (sets `noise_margin`, and returns it): how
        far an adapter that learned nothing lowers a lead (lead_drops) at any answer
        position of any anchor, the NULL_RANK-th widest such drop of `draws` such
        adapters (noise_margin_of): `trainer`'s shadow adapter
        with its A as it is and every B drawn from N(0, sigma^2). A null adapter's
        argmax leaves the base token only where its drop exceeds the base's lead, so
        a draw's widest drop is never below the widest lead its flips crossed; it reads every
        position, not only the near ties a draw happened to cross, which makes it the
        reach of the rounding noise rather than of the few flips it made
        (docs/architecture/drift.md, "The noise margin"). The shadow adapter is put
        back as it was (B = 0 at a job's start). 0.0 when no null adapter lowered any
        lead: every flip counts."""
        if not self.bases:
            raise RuntimeError("record() the base answers before measuring the noise margin")
        self.noise_margin, self.noise_draws = None, ()
        nulls = yield from self.null_drifts(trainer, draws, sigma, seed)
        self.noise_draws = tuple(n.widest_drop for n in nulls)
        self.noise_margin = noise_margin_of(nulls)
        return self.noise_margin

    def null_drifts(self, trainer, draws: int = NULL_DRAWS, sigma: float = NULL_SIGMA,
                    seed: int = NULL_SEED, around: bool = False) -> Generator[None, None, list[Drift]]:
        """The figures of `draws` adapters that learned nothing, one Drift each:
        `trainer`'s shadow adapter with its A as it is and every B drawn from
        N(0, sigma^2), draw d seeded by (seed, d); the shadow adapter is put back
        as it was (null_margin reads their lead drops). `around`: the noise is
        added to the B it has instead (the rounding's reach around a trained
        adapter, as the null draws are around the base; bench_drift --jitters)."""
        before = trainer.lora_parameters()
        is_b = lora_b_mask(trainer)
        out = []
        try:
            for d in range(draws):
                vec = before.copy()
                noise = sigma * np.random.default_rng((seed, d)).standard_normal(int(is_b.sum()))
                vec[is_b] = vec[is_b] + noise if around else noise
                trainer.set_lora_parameters(vec)
                trainer.promote()
                out.append((yield from self.measure(trainer.served_adapter)))
        finally:
            trainer.set_lora_parameters(before)
            trainer.promote()
        return out


def noise_margin_of(nulls: Sequence[Drift], rank: int = NULL_RANK) -> float:
    """The noise margin the null adapters' figures give: the `rank`-th widest of
    their widest lead drops (the widest when there are fewer draws; 0.0 with none)."""
    widest = sorted((n.widest_drop for n in nulls), reverse=True)
    return widest[min(rank, len(widest)) - 1] if widest else 0.0


def lora_b_mask(trainer) -> np.ndarray:
    """Which entries of `trainer.lora_parameters()` belong to a B matrix (the rest: A)."""
    return np.concatenate([np.full(int(np.prod(shape)), ab == "b") for (_, ab), shape in
                           zip(trainer.parameter_order(), trainer.parameter_shapes(), strict=True)])


def anchor_visits(n_anchors: int, n_job_windows: int, ratio: float, epoch: int,
                  seed: int) -> list[tuple[int, int]]:
    """The anchors the regularizer trains in `epoch`, each with its visit
    number (0 at its first visit of the job, then 1, ...): ceil(ratio x the
    job's windows) of them (at most all), walking one seeded permutation of
    the whole set cyclically, so every anchor comes round every
    ceil(n_anchors / k) epochs, one visit per round."""
    if not ratio > 0 or n_anchors <= 0 or n_job_windows <= 0:
        return []
    k = min(n_anchors, math.ceil(ratio * n_job_windows))
    perm = np.random.default_rng(seed).permutation(n_anchors)
    return [(int(perm[p % n_anchors]), p // n_anchors) for p in range(epoch * k, epoch * k + k)]


def consolidation_visits(n_anchors: int, epoch: int, seed: int) -> list[tuple[int, int]]:
    """The (anchor, visit) pairs of rehearsal-only epoch `epoch` (0, 1, ... after
    the job's own training): every anchor once, visit number `epoch`, in a seeded order."""
    return [(a, epoch) for a in epoch_order(n_anchors, 1000 + epoch, seed)]


def run_steps(gen: Iterator[None]) -> Any:
    """Run a step generator to its end (tests, benchmarks); returns its value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def rehearsal_windows(base: AnchorBase, index: int, window: int, mode: str | None = None,
                      label: str | None = None) -> list[TrainWindow]:
    """Rehearsal anchor `index`'s windows (AnchorBase.windows) that fit the job's window."""
    return [w for w in base.windows(-1 - index, label or f"anchors[{index}]", mode) if len(w) <= window]


def visit_choice(options: Sequence[T], visit: int) -> T:
    """What visit `visit` of a rehearsal anchor trains, of its windows
    `options` (one per sample): the sample visit mod their number, so
    successive visits train different samples."""
    return options[visit % len(options)]


def anchor_windows(bases: Sequence[AnchorBase], visits: Iterable[tuple[int, int]], window: int,
                   mode: str | None = None) -> list[TrainWindow]:
    """The regularizer's windows for (anchor, visit) pairs (anchor_visits),
    each the visit's choice (visit_choice) of the anchor's windows (its greedy
    answer when it has no samples); an anchor with no window that fits is left out."""
    out = []
    for i, v in visits:
        fitting = rehearsal_windows(bases[i], i, window, mode)
        if fitting:
            out.append(visit_choice(fitting, v))
    return out
