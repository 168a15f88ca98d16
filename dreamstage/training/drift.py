"""Drift: how far a job's adapter moves the model on prompts the job never taught.

At a job's start the resident base model (adapter off, on the resident
context) answers every anchor prompt greedily and we record, at each token of
its own answer, its next-token distribution (the top `TOP_K` log-probabilities
plus the mass of the rest). After (and during) training the same sequences
are decoded once more with the job's adapter on, and two figures come out:

- `drift_kl`: the mean over all recorded anchor tokens of KL(base || adapter),
  the base's distribution against the adapter's at the same position;
- `anchors_changed`: the fraction of anchors whose greedy answer changed.
  Greedy decoding is deterministic, so the adapter's greedy answer equals the
  base's exactly when, at every position of the base's answer, the adapter's
  argmax is the base's token. One teacher-forced decode per anchor decides it
  (no generation with the adapter on).

The same records give the regularizer its data: each anchor's prompt with
the base's own continuation as the trained reply (`AnchorBase.window`),
ordinary cross-entropy examples the native trainer already takes
(docs/architecture/drift.md says why not a soft-target KL).

Every function here makes llama calls on the resident context, so it runs on
the engine thread, between decode batches, on a sequence no slot is using;
each anchor is one `step` so a waiting request waits at most one anchor.
"""
from __future__ import annotations

import ctypes
import json
import math
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from dreamstage.training.examples import ChatRenderer, TrainWindow
from dreamstage.training.spec import ChatExample, Message

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
MAX_ANCHOR_CHARS = 1000


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

    def window(self, source: int, label: str) -> TrainWindow:
        """The distillation example: the prompt as context, the base's continuation trained."""
        toks = self.prompt_tokens + self.continuation
        mask = (0,) * len(self.prompt_tokens) + (1,) * len(self.continuation)
        return TrainWindow(toks, mask, source, label)


@dataclass(frozen=True)
class Drift:
    """Drift figures of one adapter against the base records."""

    drift_kl: float                     # mean KL(base || adapter) over the anchors' answer tokens, nats
    anchors_changed: float              # fraction of anchors whose greedy answer changed
    changed: int
    anchors: int
    tokens: int
    # per anchor: the first answer token where the greedy answer changed, or None
    first_change: tuple[int | None, ...] = ()
    ms: float = 0.0                     # the measurement's decodes (not the serving between them)

    def changed_within(self, n_tokens: int) -> float:
        """The fraction of anchors whose answer changed within its first n_tokens."""
        return sum(f is not None and f < n_tokens for f in self.first_change) / max(len(self.first_change), 1)

    def as_dict(self) -> dict[str, Any]:
        return {"drift_kl": self.drift_kl, "anchors_changed": self.anchors_changed, "anchors": self.anchors,
                "anchors_changed_count": self.changed, "anchor_tokens": self.tokens}


def prompt_tokens(tok, prompt: str, renderer: ChatRenderer | None = None) -> tuple[int, ...]:
    """A user turn rendered as a job's chat example renders it, up to the reply's first token."""
    r = (renderer or ChatRenderer(tok)).render(ChatExample(messages=[Message(role="user", content=prompt),
                                                                    Message(role="assistant", content="x")]))
    return tuple(r.tokens[:r.replies[0].start])


# -- decoding on the resident context -----------------------------------------------------
class _Decoder:
    """Single-sequence decodes on the resident context, on `seq_id`, which the
    caller guarantees no serving slot holds; the sequence is cleared before and after."""

    def __init__(self, resident, seq_id: int):
        self.rm, self.lc, self.seq_id = resident, resident.lc, seq_id

    def _clear(self) -> None:
        self.lc.llama_memory_seq_rm(self.rm.memory, self.seq_id, -1, -1)

    def _decode(self, batch, tokens: Sequence[int], pos0: int, want_from: int) -> None:
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

    def logits(self, tokens: Sequence[int], first_row: int) -> np.ndarray:
        """Logits of rows first_row .. len(tokens)-1 of one teacher-forced decode, (rows, n_vocab)."""
        n = len(tokens)
        if n > self.rm.config.n_batch:
            raise ValueError(f"an anchor of {n} tokens exceeds n_batch {self.rm.config.n_batch}")
        batch = self.lc.llama_batch_init(n, 0, 1)
        self._clear()
        try:
            self._decode(batch, tokens, 0, first_row)
            return np.stack([self._row(i) for i in range(first_row, n)])
        finally:
            self._clear()
            self.lc.llama_batch_free(batch)

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """The greedy answer, its end-of-generation token included when reached."""
        batch = self.lc.llama_batch_init(max(len(prompt), 1), 0, 1)
        self._clear()
        out: list[int] = []
        try:
            pending, pos = list(prompt), 0
            while len(out) < max_tokens:
                self._decode(batch, pending, pos, len(pending) - 1)
                pos += len(pending)
                best = int(self._row(len(pending) - 1).argmax())
                out.append(best)
                if self.rm.is_eog(best):
                    break
                pending = [best]
            return out
        finally:
            self._clear()
            self.lc.llama_batch_free(batch)


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


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    m = rows.max(axis=1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))


def record_anchor(resident, seq_id: int, prompt: str, prompt_toks: Sequence[int],
                  max_tokens: int = ANCHOR_TOKENS) -> AnchorBase:
    """The base's answer and distributions for one anchor. The context's adapter must be off."""
    dec = _Decoder(resident, seq_id)
    cont = dec.greedy(prompt_toks, max_tokens)
    forced = (*prompt_toks, *cont[:-1])
    logp = _log_softmax(dec.logits(forced, len(prompt_toks) - 1))
    # The measurement decodes the answer teacher-forced, in one batch. The CPU
    # backend's kernels depend on the batch's size (quantized activations
    # for short batches, not for long ones), so the same prefix gets other
    # logits (by ~1 on the default model) one token at a time than in a batch.
    # The records are therefore the batched decode of exactly `forced`, which
    # the measurement repeats token for token (bit-identical with the adapter
    # off); where its argmax departs from the generated token the compared
    # answer ends at the batched choice.
    arg = logp.argmax(axis=1)
    answer = list(cont)
    for i, t in enumerate(cont):
        if int(arg[i]) != t:
            answer = cont[:i] + [int(arg[i])]
            logp = logp[:i + 1]
            break
    k = min(TOP_K, logp.shape[1])
    top = np.argpartition(-logp, k - 1, axis=1)[:, :k].astype(np.int32)
    top_logp = np.take_along_axis(logp, top, axis=1)
    rest = 1.0 - np.exp(top_logp).sum(axis=1)
    with np.errstate(divide="ignore"):
        tail = np.where(rest > 1e-12, np.log(np.clip(rest, 1e-300, None)), -np.inf)
    return AnchorBase(prompt, tuple(prompt_toks), tuple(cont), forced, tuple(answer), top,
                      top_logp.astype(np.float32), tail)


def anchor_drift(resident, seq_id: int, base: AnchorBase) -> tuple[float, int, int | None]:
    """(sum of KL(base || now) over the answer's tokens, tokens, the first answer token the
    greedy answer changes at or None) for whatever adapter the context has on now."""
    n = len(base.answer)
    logq = _log_softmax(_Decoder(resident, seq_id).logits(base.forced, len(base.prompt_tokens) - 1)[:n])
    diff = np.flatnonzero(logq.argmax(axis=1) != np.asarray(base.answer))
    first = int(diff[0]) if diff.size else None
    lp = base.top_logp.astype(np.float64)
    lq = np.take_along_axis(logq, base.top_ids.astype(np.int64), axis=1)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    q_rest = np.clip(1.0 - np.exp(lq).sum(axis=1), 1e-30, None)
    has_tail = np.isfinite(base.tail_logp)
    lt = np.where(has_tail, base.tail_logp, 0.0)
    kl += np.where(has_tail, np.exp(lt) * (lt - np.log(q_rest)), 0.0)
    # a coarsened KL is >= 0; float error at identical distributions may dip below
    return float(np.clip(kl, 0.0, None).sum()), n, first


class DriftProbe:
    """The base records of one job's anchors and the drift measurement, one anchor per step.

    `record()` and `measure()` are generators: each `next()` decodes one
    anchor (about a prompt's prefill and, when recording, ANCHOR_TOKENS
    single-token decodes) and the generator's return value is the result.
    `seq_id()` is asked before every step for a sequence no slot is using
    (None: none free now, the step waits); `adapter_on`/`adapter_off` put
    the measured adapter or none on the context and `restore` puts serving's
    back, all within the step.
    """

    def __init__(self, resident, prompts: Sequence[str], *, seq_id, restore=lambda: None,
                 renderer: ChatRenderer | None = None):
        if not prompts:
            raise ValueError("a drift probe needs at least one anchor prompt")
        self.resident = resident
        self.prompts = list(prompts)
        self.seq_id = seq_id if callable(seq_id) else (lambda: seq_id)
        self.restore = restore
        self.renderer = renderer or ChatRenderer(resident)
        self.bases: list[AnchorBase] = []
        self.anchor_ms: float | None = None     # the recent cost of measuring one anchor (a running mean)

    def _free_seq(self) -> Generator[None, None, int]:
        while (s := self.seq_id()) is None:
            yield
        return s

    def record(self, cache: dict | None = None) -> Generator[None, None, None]:
        """Records every anchor with the adapter off. `cache` maps prompt -> AnchorBase
        across jobs (the base model does not change while the process lives)."""
        out = []
        for prompt in self.prompts:
            if cache is not None and prompt in cache:
                out.append(cache[prompt])
                continue
            toks = prompt_tokens(self.resident, prompt, self.renderer)
            seq = yield from self._free_seq()
            set_context_adapter(self.resident, None)
            try:
                base = record_anchor(self.resident, seq, prompt, toks)
            finally:
                self.restore()
            if cache is not None:
                cache[prompt] = base
            out.append(base)
            yield
        self.bases = out

    def measure(self, adapter_handle, indices: Sequence[int] | None = None) -> Generator[None, None, Drift]:
        """Drift of `adapter_handle` (a llama_adapter_lora, or its address)
        against the records of every anchor, or of those at `indices`; returns a Drift."""
        if not self.bases:
            raise RuntimeError("record() the base answers before measuring drift")
        kl_sum, tokens, first, ms = 0.0, 0, [], 0.0
        for base in (self.bases if indices is None else [self.bases[i] for i in indices]):
            seq = yield from self._free_seq()
            t0 = time.perf_counter()
            set_context_adapter(self.resident, adapter_handle)
            try:
                kl, n, f = anchor_drift(self.resident, seq, base)
            finally:
                self.restore()
            one = (time.perf_counter() - t0) * 1000.0
            ms += one
            self.anchor_ms = one if self.anchor_ms is None else 0.5 * (self.anchor_ms + one)
            kl_sum, tokens = kl_sum + kl, tokens + n
            first.append(f)
            yield
        changed = sum(f is not None for f in first)
        return Drift(drift_kl=kl_sum / tokens if tokens else 0.0, anchors_changed=changed / len(first),
                     changed=changed, anchors=len(first), tokens=tokens, first_change=tuple(first), ms=ms)


def anchor_schedule(n_anchors: int, n_job_windows: int, ratio: float, epoch: int, seed: int) -> list[int]:
    """The anchors the regularizer trains in `epoch`: ceil(ratio x the job's
    windows) of them (at most all), walking one seeded permutation of the
    whole set cyclically, so every anchor comes round every
    ceil(n_anchors / k) epochs."""
    if not ratio > 0 or n_anchors <= 0 or n_job_windows <= 0:
        return []
    k = min(n_anchors, math.ceil(ratio * n_job_windows))
    perm = np.random.default_rng(seed).permutation(n_anchors)
    return [int(perm[(epoch * k + j) % n_anchors]) for j in range(k)]


def run_steps(gen: Iterator[None]) -> Any:
    """Run a step generator to its end (tests, benchmarks); returns its value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def anchor_windows(bases: Sequence[AnchorBase], indices: Iterable[int], window: int) -> list[TrainWindow]:
    """The regularizer's windows: the chosen anchors' base answers as trained
    replies (an anchor longer than the job's window is left out)."""
    return [bases[i].window(-1 - i, f"anchors[{i}]") for i in indices
            if len(bases[i].prompt_tokens) + len(bases[i].continuation) <= window]
