"""Decoding on the resident context over one sequence no serving slot holds:
teacher-forced, greedy and sampled, in units of work a caller can stop between
(a piece of PIECE_TOKENS tokens, or one generated token), and the switch that
puts one adapter (or none) on the context while they run.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from dreamstage.serving import rpc

# Tokens of one teacher-forced piece: fixed offsets give a record and its later
# measurement the same batch shapes (the CPU backend picks kernels by batch
# size), and one piece keeps an engine step short (about 50 ms on one core).
PIECE_TOKENS = 16
# Log-probabilities kept per recorded position; the rest of the mass is one
# "tail" outcome (on the default model all but ~1e-3 at a typical position).
TOP_K = 256


class FixedSequence:
    """A sequence the caller owns outright (tests, benchmarks, a resident with
    no serving): always valid, nothing to give back. The engine's leases
    (`Engine.hold_idle_sequence`) have the same members."""

    valid = True

    def __init__(self, seq_id: int):
        self.seq_id = seq_id

    def reserve(self, cells: int, keep: int = 0) -> bool:
        return True

    def release(self) -> None:
        pass


class Decoder:
    """Single-sequence decodes on the resident context, on `seq_id`, which the
    caller guarantees no serving slot holds. Each `*_units` method is a
    generator that yields after every `llama_decode` (a unit of work: one
    piece of PIECE_TOKENS teacher-forced tokens, or one generated token), so a
    caller can stop between units and go on at a later engine step; its
    return value is the result. The sequence is cleared before and after."""

    def __init__(self, resident, seq_id: int):
        self.rm, self.lc, self.seq_id = resident, resident.lc, seq_id
        self._batch: Any = None         # a llama_batch of PIECE_TOKENS (or more), made at the first decode
        self._batch_size = 0

    def clear(self, keep: int = 0) -> None:
        """Forget the sequence's positions from `keep` on (0: all of them)."""
        if not self.lc.llama_memory_seq_rm(self.rm.memory, self.seq_id, keep if keep else -1, -1):
            raise RuntimeError(f"the model's memory cannot drop positions {keep}.. of the drift sequence "
                               f"{self.seq_id} alone (a recurrent state): drift measurement needs a K/V cache")

    def close(self) -> None:
        if self._batch is not None:
            self.lc.llama_batch_free(self._batch)
            self._batch = None

    def _decode(self, tokens: Sequence[int], pos0: int | Sequence[int], want_from: int,
                seq_ids: Sequence[int] | None = None) -> None:
        """Decodes `tokens`, token i at position pos0 + i of this sequence, or (with
        `seq_ids`: one token per sequence) at pos0[i] of seq_ids[i]; logits from row want_from on."""
        if self._batch is None or (seq_ids is not None and len(seq_ids) > self._batch_size):
            if self._batch is not None:
                self.lc.llama_batch_free(self._batch)
            self._batch_size = max(PIECE_TOKENS, len(seq_ids or ()))
            self._batch = self.lc.llama_batch_init(self._batch_size, 0, 1)
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + i if isinstance(pos0, int) else pos0[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = self.seq_id if seq_ids is None else seq_ids[i]
            batch.logits[i] = i >= want_from
        workers = getattr(getattr(self.rm, "config", None), "rpc", ())
        if workers and (gone := rpc.failed_worker(workers)):   # nothing is computed past it (batch.py)
            raise RuntimeError(f"the RPC worker at {gone} failed; the drift sequence {self.seq_id} decodes nothing")
        rc = self.lc.llama_decode(self.rm.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc} on the drift sequence {self.seq_id}")

    def _row(self, i: int) -> np.ndarray:
        ptr = self.lc.llama_get_logits_ith(self.rm.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.rm.n_vocab,)).astype(np.float64)

    def forced_units(self, tokens: Sequence[int], first_row: int, kept: int = 0,
                     keep: int = 0) -> Generator[None, None, np.ndarray]:
        """Logits of rows first_row .. len(tokens)-1 of a teacher-forced decode, (rows, n_vocab).

        The sequence is decoded in pieces of PIECE_TOKENS at fixed offsets, so
        the same tokens always meet the same batch shapes: the CPU backend
        picks kernels by batch size, and a record and its later measurement
        must see the same arithmetic (bit-identical logits with the adapter off).
        `kept`: the sequence already holds the K/V of tokens[:kept], whole pieces
        before first_row, decoded so under the same adapter (they are not decoded
        again); `keep`: positions left on the sequence afterwards (0: it is cleared)."""
        if kept % PIECE_TOKENS or not 0 <= kept <= first_row:
            raise ValueError(f"kept {kept} must be whole pieces of {PIECE_TOKENS} tokens before row {first_row}")
        rows: list[np.ndarray] = []
        self.clear(kept)
        for a in range(kept, len(tokens), PIECE_TOKENS):
            piece = tokens[a:a + PIECE_TOKENS]
            want = min(max(first_row - a, 0), len(piece))
            self._decode(piece, a, want)
            rows.extend(self._row(i) for i in range(want, len(piece)))
            yield
        self.clear(keep)
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

    def greedy_many_units(self, prompts: Sequence[Sequence[int]], seq_ids: Sequence[int],
                          max_tokens: int) -> Generator[None, None, list[list[int]]]:
        """The greedy answers of several prompts at once, prompt i on seq_ids[i]
        (this decoder's own sequence need not be among them): each prompt decoded
        alone in its pieces, as greedy_units does, then one batch per answer token
        holding the next token of every answer not yet ended, so the answers take
        as many decodes as the longest. Units: a prompt piece, or one such batch."""
        if len(prompts) != len(seq_ids) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("greedy_many_units needs one distinct sequence per prompt")
        lanes = [Decoder(self.rm, s) for s in seq_ids]
        try:
            rows = []
            for lane, prompt in zip(lanes, prompts, strict=True):
                lane.clear()
                rows.append((yield from lane._prompt_units(prompt)))
                yield
            outs: list[list[int]] = [[int(r.argmax())] for r in rows]
            while True:
                live = [i for i, o in enumerate(outs) if not self.rm.is_eog(o[-1]) and len(o) < max_tokens]
                if not live:
                    return outs
                self._decode([outs[i][-1] for i in live], [len(prompts[i]) + len(outs[i]) - 1 for i in live], 0,
                             [seq_ids[i] for i in live])
                for row, i in enumerate(live):
                    outs[i].append(int(self._row(row).argmax()))
                yield
        finally:
            for lane in lanes:
                lane.clear()
                lane.close()

    def sample_units(self, prompt: Sequence[int], max_tokens: int, rngs: Sequence[np.random.Generator],
                     tops: list | None = None, draw: Callable[[np.ndarray, np.random.Generator], int] | None = None
                     ) -> Generator[None, None, list[list[int]]]:
        """One continuation per generator in `rngs`, each token drawn from the
        softmax of its logits (temperature 1), as the greedy answer is decoded.
        The prompt is decoded once; each sample drops the one before it from
        the sequence and starts again from the prompt's last row. `tops`: a
        list that gets, per sample, the top-K rows (ids, log-probabilities) of
        the distributions its tokens were drawn from. `draw(logits, rng)` picks
        each token (default: the whole softmax, draw_softmax)."""
        draw = draw_softmax if draw is None else draw
        self.clear()
        row = yield from self._prompt_units(prompt)
        out = []
        for i, rng in enumerate(rngs):
            if i:
                yield
                self.clear(len(prompt))
            kept: list[np.ndarray] = []

            def pick(logits: np.ndarray, rng=rng, kept=kept) -> int:
                if tops is not None:
                    kept.append(logits)
                return draw(logits, rng)
            out.append((yield from self._answer_units(row, len(prompt), max_tokens, pick)))
            if tops is not None:
                ids, logp = top_k(log_softmax(np.stack(kept)))
                tops.append((ids, logp.astype(np.float32)))
        self.clear()
        return out


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


def draw_softmax(logits: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits) (float64; inverse CDF of one uniform)."""
    p = np.exp(logits - logits.max())
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(c) - 1))


def top_k(logp: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The top k (ids int32, log-probabilities in logp's type) of each row of logp."""
    k = min(k, logp.shape[1])
    top = np.argpartition(-logp, k - 1, axis=1)[:, :k].astype(np.int32)
    return top, np.take_along_axis(logp, top, axis=1)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    m = rows.max(axis=1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
