"""A job whose RPC worker failed: held until the engine has loaded the model again, then resumed.

With RPC workers in the resident model, a job copies its trainer's state out
(`Trainer.checkpoint`: the shadow adapter, AdamW's moments and update count)
as its first window begins and as each window ends, after its update. When a
worker fails under a micro-step the job is `held`; once the engine has loaded
the model again (`Engine._reconnect`), the trainer is made again from that
checkpoint (`Trainer.reopen`) and the window in progress is walked again from
its start. docs/architecture/rpc.md, "A worker that dies".
"""
from __future__ import annotations

import logging
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from dreamstage.serving import rpc

if TYPE_CHECKING:
    from dreamstage.training.jobs.store import JobStore

log = logging.getLogger("dreamstage.scheduler")


class WorkerHold:
    """JobProgram's (program.py) part that holds and resumes a job across a failed RPC worker."""

    store: JobStore
    resident: Any

    if TYPE_CHECKING:
        def _end(self, jid: int, target: str, message: str) -> Generator[None, None, None]: ...

    def _workers(self) -> tuple[str, ...]:
        return getattr(getattr(self.resident, "config", None), "rpc", ()) or ()

    def _failed_worker(self) -> str | None:
        """The resident's RPC worker whose connection failed (None: none, or no workers)."""
        workers = self._workers()
        return rpc.failed_worker(workers) if workers else None

    def _worker_lost(self, lp: Any) -> bool:
        """Whether, since the job's checkpoint, a worker failed or the model was loaded again."""
        cp = lp.checkpoint
        return cp is not None and (cp[2] != self.resident.loads or self._failed_worker() is not None)

    def _checkpoint(self, lp: Any) -> bool:
        """Copy the trainer's state out as the next window's start (with RPC workers, between
        windows). False, keeping the last one, when a worker failed meanwhile (what it
        answered is zeros: ggml's degraded client)."""
        failures = rpc.traffic().failures
        cp = lp.trainer.checkpoint()
        if rpc.traffic().failures != failures:
            return False
        lp.checkpoint = (cp, lp.decay, self.resident.loads)
        return True

    def _hold(self, lp: Any, receipt: Any) -> Generator[None, None, bool]:
        """An RPC worker under the job failed (`receipt`, the last step's, stored; None: it
        failed between two steps, or the engine already loaded the model again). The job
        is `held` until the engine has loaded the model again (engine._reconnect), then
        the window in progress starts again from the checkpoint taken as it began: the
        adapter and optimizer state after the last update, so no update is lost or made
        twice. False: the job ended instead."""
        cp, decay, loads = lp.checkpoint or (None, None, 0)
        assert cp is not None  # the callers checked
        gone = self._failed_worker()
        if receipt is not None:
            self.store.append_receipt(lp.jid, receipt)
        if gone is not None:
            during = ("between two steps" if receipt is None else f"during a micro-step ({receipt.message})"
                      if receipt.status == "error" else "before the window's update was copied out")
            self.store.transition(lp.jid, "held", (
                f"waiting for the RPC worker at {gone}, which failed {during}; the job goes on once the worker "
                "answers and the model is loaded again (cancel it to give up)"))
            log.warning("dream job %s held: the RPC worker at %s failed", lp.jid, gone)
        while self.resident.loads == loads or self._failed_worker():
            yield                                       # the scheduler does not step a held job meanwhile
        try:
            lp.trainer.close()                          # (the reload closed it already)
            lp.trainer.reopen(cp)
        except Exception as e:  # noqa: BLE001 - the gate's refusal or a worker gone again: the job ends
            yield from self._end(lp.jid, "error", f"resuming after the RPC worker came back failed: {e}")
            return False
        lp.checkpoint = (cp, decay, self.resident.loads)
        lp.decay, lp.begun, lp.resume_threads = decay, None, None
        lp.run.walk.chunk_pos = 0
        self.store.restart_window(lp.jid)
        if self.store.state(lp.jid) == "held":
            self.store.transition(lp.jid, "running", (
                f"resumed after the model was loaded again: the window in progress starts again from the "
                f"adapter after update {cp.updates}"))
        return True
