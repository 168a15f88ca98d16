"""One decode batch on the engine thread: the next token of every generating
slot first (decode never starves), then prompt chunks of prefilling slots, up
to n_batch tokens; one llama_decode; then each output row sampled and its text
streamed, or the prompt scored (prompt_logprobs). A failed decode fails the
batch's requests only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from dreamstage.adapters.choice import AdapterChoice
from dreamstage.serving import rpc
from dreamstage.serving.core import EngineCore
from dreamstage.serving.generation import Delta, Failed, PromptScored
from dreamstage.serving.sampling import BANNED_LOGIT, GrammarDeadEnd, log_softmax, scored
from dreamstage.serving.slots import _Slot

if TYPE_CHECKING:
    import ctypes


@dataclass
class _Rows:
    """What one batch holds, row by row, for after its decode."""
    n: int = 0                                   # rows filled
    n_decode: int = 0                            # of them, single decode tokens of generating slots
    outputs: list[tuple[_Slot, int]] = field(default_factory=list)           # (slot, row to sample)
    prompt_rows: list[tuple[_Slot, int, int]] = field(default_factory=list)  # (slot, row, prompt position it predicts)
    copies: list[tuple[_Slot, _Slot]] = field(default_factory=list)  # (leader, follower): prompt K/V to copy after
    adapters: list[AdapterChoice] = field(default_factory=list)     # each row's adapter, for the seam


class BatchMixin(EngineCore):
    def _step(self) -> bool:
        """Build and decode one batch; sample and stream. False when there was nothing to decode."""
        t_start = time.perf_counter()
        batch = self._batch
        assert batch is not None  # allocated before the loop runs
        rows = self._fill_batch(batch)
        if rows.n == 0:
            return False
        # past a failed RPC worker nothing is computed: ggml's client drops the worker's
        # commands, and a graph that still reached it could read an address it never got
        # (nor while a reload after one failed: engine._reconnect)
        gone = self.model.config.rpc and (rpc.failed_worker(self.model.config.rpc) or not self.model.ctx)
        failures = rpc.traffic().failures if self.model.config.rpc else 0
        if not gone:
            self.adapters.bind(rows.adapters)
        batch.n_tokens = rows.n
        self.last_batch_tokens = rows.n
        self.last_batch_decode_tokens = rows.n_decode
        rc = -3 if gone else self.lc.llama_decode(self.model.ctx, batch)
        if rc == 0 and self.model.config.rpc:
            # a worker that failed during the decode answered zeros (llama_decode cannot tell):
            # its answers are in once the context is synchronized, and the batch fails
            self.lc.llama_synchronize(self.model.ctx)
            if rpc.traffic().failures != failures and rpc.failed_worker(self.model.config.rpc):
                rc = -3
        self.stats.decode_batches += 1
        self.stats.mixed_batches += len({r.key for r in rows.adapters}) > 1
        if rc != 0:
            self._decode_failed(rc, rows.outputs)
            self.last_batch_s = time.perf_counter() - t_start
            if rc != 1:
                self.failing = f"llama_decode failed with status {rc}"
            return True
        self.failing = None
        for leader, f in rows.copies:
            # one stream per slot: a whole-stream copy, done by llama.cpp before the next decode;
            # a unified pool: the prompt's cells are tagged with the follower's sequence too
            self.lc.llama_memory_seq_rm(self.model.memory, f.seq_id, -1, -1)
            self.lc.llama_memory_seq_cp(self.model.memory, leader.seq_id, f.seq_id, -1, -1)
            f.tokens, f.awaiting = list(leader.tokens), None
        self._score_prompts(rows.prompt_rows, rows.copies)
        self._sample(rows.outputs)
        self.last_batch_s = time.perf_counter() - t_start
        return True

    def _fill_batch(self, batch) -> _Rows:
        """Fill `batch`: generating slots' next tokens, then prompt chunks, for the adapters
        whose turn it is (MixedAdapters.batch_keys)."""
        tok, nseq, seq, logits = batch.token, batch.n_seq_id, batch.seq_id, batch.logits
        # llama_cpp annotates llama_batch.pos as an array of arrays; it is flat (llama_pos *)
        pos = cast("ctypes.Array[ctypes.c_int32]", batch.pos)
        r = _Rows()
        working = [s for s in self.slots if s.busy and (s.next_token is not None or (
            s.pending and not (s.job is not None and s.job.request.embed)))]
        turn = self.adapters.batch_keys([s.adapter.key for s in working])
        # Generating slots first: each costs one token, so decode never starves.
        for s in self.slots:
            if s.busy and s.next_token is not None and s.adapter.key in turn:
                tok[r.n], pos[r.n], nseq[r.n], logits[r.n] = s.next_token, len(s.tokens), 1, 1
                seq[r.n][0] = s.seq_id
                r.adapters.append(s.adapter)
                s.tokens.append(s.next_token)
                s.next_token = None
                r.outputs.append((s, r.n))
                r.n += 1
        r.n_decode = r.n
        for s in self.slots:
            if r.n >= self.n_batch:
                break
            if s.busy and s.pending and not (s.job is not None and s.job.request.embed) and s.adapter.key in turn:
                take = min(len(s.pending), self.n_batch - r.n)
                chunk, s.pending = s.pending[:take], s.pending[take:]
                base = len(s.tokens)
                score = s.job is not None and s.job.request.prompt_logprobs is not None
                for i, t in enumerate(chunk):
                    tok[r.n], pos[r.n], nseq[r.n], logits[r.n] = t, base + i, 1, int(score)
                    seq[r.n][0] = s.seq_id
                    if score and (s.pending or i < len(chunk) - 1):
                        r.prompt_rows.append((s, r.n, base + i + 1))
                    r.n += 1
                s.tokens.extend(chunk)
                r.adapters += [s.adapter] * len(chunk)
                if not s.pending:
                    logits[r.n - 1] = 1
                    r.outputs.append((s, r.n - 1))
                    joining = [f for f in self.slots if f.awaiting is s]
                    r.outputs += [(f, r.n - 1) for f in joining]     # the same row: the same distribution
                    r.copies += [(s, f) for f in joining]
        return r

    def _score_prompts(self, rows: list[tuple[_Slot, int, int]], copies: list[tuple[_Slot, _Slot]]) -> None:
        """Score prompt positions from their rows' logits (the raw model distribution); send
        PromptScored to each slot whose prompt this batch finished, and to its followers (`copies`)."""
        for s, idx, at in rows:
            job = s.job
            if job is None or job.request.prompt_logprobs is None:
                continue
            row = self.lc.llama_get_logits_ith(self.model.ctx, idx)
            logits = np.ctypeslib.as_array(row, shape=(self.model.n_vocab,)).astype(np.float64)
            s.prompt_scores.append(scored(self._vocab_ids, log_softmax(logits), job.prompt[at],
                                          job.request.prompt_logprobs))
        for s in {r[0] for r in rows}:
            if s.job is not None and not s.pending:
                scores = PromptScored(tuple(s.prompt_scores))
                for j in [s.job, *(f.job for leader, f in copies if leader is s and f.job is not None)]:
                    self._send(j, scores)

    def _sample(self, outputs: list[tuple[_Slot, int]]) -> None:
        """Sample each slot that has an output row; stream its text; release finished slots."""
        now = time.perf_counter()
        eog = self.model.eog_tokens
        for s, idx in outputs:
            job, stream, sampler = s.job, s.stream, s.sampler
            if job is None or stream is None or sampler is None or job.handle.cancelled:
                continue
            early = s.generated < job.request.min_tokens
            if early:
                self._ban_ends(idx, job.request.stop_tokens if job.request.ignore_eos else
                               eog | job.request.stop_tokens)
            top = job.request.logprobs
            try:
                if top is None:
                    token, logprob = sampler.sample(self.model.ctx, idx), None
                else:
                    token, logprob = sampler.sample_scored(self.model.ctx, idx, top)
            except GrammarDeadEnd as e:
                self._clear_slot(s)
                self._free_slot(s)
                param = job.request.grammar_param
                self._finish_job(job, Failed(400, f"{param}: {e} (after {s.generated} tokens)", param), "invalid")
                continue
            s.generated += 1
            self.stats.generated_tokens += 1
            if s.first_token_at is None:
                s.first_token_at = now
                self.stats.ttft.observe(now - job.submitted)
            else:
                self.stats.itl.observe(now - s.t_last)
            s.t_last = now
            if (token in eog and not job.request.ignore_eos) or token in job.request.stop_tokens:
                self._release(s, "stop")
                continue
            text = stream.push(self.model.token_piece(token), look=not early)
            self._send(job, Delta(text, token, logprob))
            if stream.stopped:
                self._release(s, "stop", flush=False)
            elif s.generated >= job.max_tokens:
                self._release(s, "length")
            else:
                s.next_token = token

    def _ban_ends(self, idx: int, tokens: frozenset[int]) -> None:
        """Logits row `idx` with `tokens` banned (BANNED_LOGIT: a grammar that allows nothing else still ends)."""
        if tokens:
            row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.model.ctx, idx), shape=(self.model.n_vocab,))
            row[np.fromiter(tokens, dtype=np.int64, count=len(tokens))] = BANNED_LOGIT

    def _decode_failed(self, rc: int, outputs) -> None:
        # Status 1 means no free K/V cells; others are hard errors. Either way the
        # batch's slots are failed and their sequences cleared, and serving goes on.
        self.stats.decode_failures += 1
        # a gone RPC worker holding layers: 503 naming it, as /health does
        worker = rpc.failed_worker(self.model.config.rpc) if rc != 1 else None
        msg = ("the K/V cache has no room for this batch" if rc == 1 else
               f"the RPC worker at {worker} failed (llama_decode status {rc})" if worker else
               f"llama_decode failed with status {rc}")
        for s in self.slots:
            if s.busy and (s in (o[0] for o in outputs) or s.pending):
                self._clear_slot(s)
                job = s.job
                assert job is not None  # busy
                self._free_slot(s)
                self._finish_job(job, Failed(503 if rc == 1 or worker else 500, msg), "error")

