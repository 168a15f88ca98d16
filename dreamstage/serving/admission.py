"""Intake and admission on the engine thread: a submitted request is tokenized
and checked against the context budget (a 400 naming the field, else it waits),
then takes a free slot: the slot whose cache it continues, else an empty one
(`_slot_preference`), with room made in a unified pool (pool.py) first.
"""
from __future__ import annotations

import logging

from dreamstage.adapters.loaded import AdapterLoadError, AdaptersFull
from dreamstage.serving import rpc
from dreamstage.serving.generation import Admitted, Failed
from dreamstage.serving.pool import PoolMixin
from dreamstage.serving.sampling import GrammarError, Sampler
from dreamstage.serving.slots import _Job, _Slot

log = logging.getLogger("dreamstage.serving.engine")


class AdmissionMixin(PoolMixin):
    def _admission_held(self) -> bool:
        # A dream hook may hold admission (an optional `hold_admission(engine)`):
        # an adapter swap waits for the busy slots to drain, so every request
        # runs on one adapter version. Waiting requests then stay queued.
        hold = getattr(self.hook, "hold_admission", None)
        if hold is None:
            return False
        try:
            return bool(hold(self))
        except Exception:
            self.stats.hook_errors += 1
            log.exception("dream hook failed in hold_admission")
            return False

    def _intake(self, jobs: list[_Job]) -> None:
        for job in jobs:
            # Whatever goes wrong with one request fails that request and
            # releases its place; the others are still taken in.
            try:
                self._intake_one(job)
            except Exception as e:
                log.exception("intake of request %d failed", job.handle.id)
                bad_text = isinstance(e, UnicodeError)
                self._finish_job(job, Failed(400 if bad_text else 500, f"prompt: {type(e).__name__}: {e}",
                                             "prompt" if bad_text else None), "invalid" if bad_text else "error")

    def _intake_one(self, job: _Job) -> None:
        m = self.model
        if job.handle.cancelled:
            self._finish_job(job, Failed(499, "cancelled before admission"), "cancelled")
            return
        req = job.request
        if isinstance(req.prompt, str):
            toks = m.tokenize(req.prompt, add_special=req.add_special, parse_special=True)
        else:
            toks = list(req.prompt)
            bad = next((t for t in toks if not isinstance(t, int) or not 0 <= t < m.n_vocab), None)
            if bad is not None:
                msg = f"prompt token {bad!r} is not in the vocabulary (0..{m.n_vocab - 1})"
                self._finish_job(job, Failed(400, msg, "prompt"), "invalid")
                return
        if not toks:
            self._finish_job(job, Failed(400, "prompt is empty after tokenization", "prompt"), "invalid")
            return
        budget, words = self._budget(1 + len(job.followers))
        room = budget - len(toks)
        if req.max_tokens is None or room < 1:
            if room < 1:
                self._finish_job(job, Failed(400, f"{req.prompt_param}: the prompt has {len(toks)} tokens; {words}, "
                                                  "leaving no room to generate", req.prompt_param), "invalid")
                return
            max_tokens = room
        elif req.max_tokens > room:
            self._finish_job(job, Failed(400, f"prompt ({len(toks)} tokens) plus max_tokens ({req.max_tokens}) "
                                              f"exceeds {words}", "max_tokens"), "invalid")
            return
        else:
            max_tokens = req.max_tokens
        job.prompt, job.max_tokens = toks, max_tokens
        self._waiting.append(job)

    def _budget(self, choices: int) -> tuple[int, str]:
        """The most prompt + max_tokens one choice of a request of `choices` may take, and
        those numbers in words for a 400. One stream per slot: the stream. A unified pool:
        all of it, split evenly between the choices of n > 1 (each reserves its own)."""
        if self.pool is None:
            return self.slot_ctx, (f"the per-slot context of {self.slot_ctx} tokens "
                                   f"(n_ctx {self.model.n_ctx} / {self.n_seq} slots)")
        if choices == 1:
            return self.slot_ctx, f"the context of {self.slot_ctx} tokens (shared by {self.n_seq} slots)"
        share = self.slot_ctx // choices
        return share, f"the context of {self.slot_ctx} tokens split between {choices} choices ({share} each)"

    def _reap_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.handle.cancelled]:
            self._waiting.remove(job)
            self._finish_job(job, Failed(499, "cancelled before admission"), "cancelled")
        for s in self.slots:
            if s.job is not None and s.job.handle.cancelled:
                self._release(s, None, "cancelled")

    def _admit(self) -> None:
        if self._waiting and self._admission_held():
            return
        while self._waiting:
            lent = self._lease.slot if self._lease is not None else None
            free = [s for s in self.slots if not s.busy and s is not lent]
            job = self._waiting[0]
            need = 1 + len(job.followers)
            if len(free) < need and lent is not None and not lent.busy:
                self._end_lease()                   # serving needs the lent slot back
                free.append(lent)
            if len(free) < need:
                return
            # the default is read here, after hold_admission applied any booked promotion
            adapter = job.request.adapter if job.request.adapter is not None else self.default_adapter()
            slot, n_common = max(((s, _common_prefix(s.tokens, job.prompt) if s.adapter.key == adapter.key else 0)
                                  for s in free), key=_slot_preference)
            others = [s for s in free if s is not slot][:need - 1]
            # A unified pool: the group's cells must fit now (each choice reserves prompt +
            # max_tokens), else it waits at the head of the queue for busy slots to finish.
            if self.pool is not None and not self._make_room(need * (len(job.prompt) + job.max_tokens),
                                                             (slot, *others), take_lease=True):
                return
            self._waiting.popleft()
            job.adapter = adapter
            for f in job.followers:
                f.adapter = job.adapter
            if not self._acquire_adapter(job, need):
                continue
            fresh = not job.request.cache_prompt or job.request.prompt_logprobs is not None
            # At least the last prompt token is decoded again: its logits are needed.
            n_common = 0 if fresh else min(n_common, len(job.prompt) - 1)
            group = [job, *job.followers]
            samplers = self._samplers(group)
            if samplers is None:
                for _ in range(need):
                    self.adapters.release(job.adapter)
                continue
            job.followers = []
            self._seat(slot, job, samplers[0], n_common)
            for follower, fslot, sampler in zip(group[1:], others, samplers[1:], strict=True):
                follower.prompt, follower.max_tokens = job.prompt, job.max_tokens
                self._clear_slot(fslot)
                self._seat(fslot, follower, sampler, len(job.prompt))
                fslot.pending, fslot.awaiting = [], slot

    def _acquire_adapter(self, job: _Job, need: int) -> bool:
        """One reference to the job's adapter per slot it takes; False (the job failed) when it cannot load."""
        got = 0
        try:
            for _ in range(need):
                self.adapters.acquire(job.adapter)
                got += 1
            return True
        except (AdapterLoadError, AdaptersFull) as e:
            for _ in range(got):
                self.adapters.release(job.adapter)
            # a gone RPC worker refuses the adapter's buffers: 503 naming it, not a bad file
            worker = rpc.failed_worker(self.model.config.rpc) if self.model.config.rpc else None
            status = 503 if isinstance(e, AdaptersFull) or worker else 422
            why = f"the RPC worker at {worker} failed; the adapter loads once it is back" if worker else str(e)
            self._finish_job(job, Failed(status, f"adapter {job.adapter.label}: {why}", "model"), "error")
            return False

    def _samplers(self, group: list[_Job]) -> list[Sampler] | None:
        """One sampler per job of an admitted group; None (the group failed with a 400) if one cannot be built."""
        made: list[Sampler] = []
        try:
            for j in group:
                made.append(Sampler(self.model.vocab, self.model.n_vocab, j.request.sampling))
            return made
        except Exception as e:  # noqa: BLE001 - a grammar or sampling value llama.cpp refused
            for m in made:
                m.free()
            leader = group[0]
            leader.followers = group[1:]
            if isinstance(e, GrammarError):
                param = leader.request.grammar_param
                self._finish_job(leader, Failed(400, f"{param}: {e}", param), "invalid")
            else:
                self._finish_job(leader, Failed(400, f"sampler could not be built: {e}", "sampling"), "invalid")
            return None

    def _seat(self, slot: _Slot, job: _Job, sampler: Sampler, n_common: int) -> None:
        """Put `job` in `slot`, keeping the first n_common cached prompt tokens (none where the
        memory cannot drop a sequence's tail, as a recurrent state cannot: the prompt is decoded whole)."""
        if not self.lc.llama_memory_seq_rm(self.model.memory, slot.seq_id, n_common, -1):
            self.lc.llama_memory_seq_rm(self.model.memory, slot.seq_id, -1, -1)
            n_common = 0
        slot.seat(job, sampler, n_common)
        self.stats.prompt_tokens += len(job.prompt)
        self.stats.prompt_tokens_cached += n_common     # a follower's whole prompt: its leader's copied K/V
        self._send(job, Admitted(slot.seq_id, slot.adapter_version, len(job.prompt), n_common, slot.adapter))


def _slot_preference(cand: tuple[_Slot, int]) -> tuple:
    """Which free slot a request takes (the max): one whose cache it continues (the
    common prefix, computed with the same adapter, is at least half of what the slot
    holds), the longest first; else an empty slot, so another conversation's cache is
    not given up for a shared template header; else the longest common prefix; on a
    tie the least recently used."""
    slot, common = cand
    continues = common > 0 and 2 * common >= len(slot.tokens)
    return (continues, common if continues else -1, not slot.tokens, common, -slot.used_at)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
