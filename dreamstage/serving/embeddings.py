"""Embedding requests on the engine thread: each admitted one is answered whole,
its prompt decoded alone with the context's embeddings on, pooled by mean and
L2-normalized. Streams wait meanwhile, as for a prompt chunk.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from dreamstage.serving.core import EngineCore
from dreamstage.serving.generation import Embedded, Failed
from dreamstage.serving.slots import _Job, _Slot

if TYPE_CHECKING:
    import ctypes


class EmbeddingMixin(EngineCore):
    def _embed_waiting(self) -> None:
        """Answer each admitted embedding request whole: its prompt decoded alone, in batches
        of n_batch with the context's embeddings on (llama.cpp then outputs every token),
        pooled by mean and L2-normalized. A failed decode fails that request only."""
        for s in self.slots:
            job = s.job
            if job is None or not job.request.embed or job.handle.cancelled:
                continue
            try:
                total = self._embed_sum(s, job)
            except RuntimeError as e:      # this request fails; the others go on
                self._clear_slot(s)
                self._free_slot(s)
                self._finish_job(job, Failed(500, str(e)), "error")
                continue
            mean = total / len(job.prompt)
            norm = float(np.linalg.norm(mean)) or 1.0
            event = Embedded(tuple(float(x) for x in mean / norm), len(job.prompt))
            s.pending = []
            self._free_slot(s)
            self._finish_job(job, event, "stop")

    def _embed_sum(self, s: _Slot, job: _Job) -> np.ndarray:
        """The sum of the prompt's token embeddings, decoded on `s`'s sequence from position 0."""
        lc, ctx, batch = self.lc, self.model.ctx, self._batch
        assert batch is not None
        pos = cast("ctypes.Array[ctypes.c_int32]", batch.pos)
        total = np.zeros(self.model.n_embd, dtype=np.float64)
        lc.llama_memory_seq_rm(self.model.memory, s.seq_id, 0, -1)
        s.tokens.clear()
        lc.llama_set_embeddings(ctx, True)
        try:
            for a in range(0, len(job.prompt), self.n_batch):
                chunk = job.prompt[a:a + self.n_batch]
                for i, t in enumerate(chunk):
                    batch.token[i], pos[i], batch.n_seq_id[i], batch.logits[i] = t, a + i, 1, 1
                    batch.seq_id[i][0] = s.seq_id
                batch.n_tokens = len(chunk)
                self.adapters.bind([s.adapter] * len(chunk))
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed for an embedding request")
                s.tokens.extend(chunk)
                for i in range(len(chunk)):
                    total += np.ctypeslib.as_array(lc.llama_get_embeddings_ith(ctx, i), shape=(self.model.n_embd,))
        finally:
            lc.llama_set_embeddings(ctx, False)
        return total
