"""A job's measurements: the held-out loss of its shadow adapter and its drift guard's access and receipts.

JobProgram (program.py) inherits them; each method runs on the engine thread, inside the
job's generator, and a `yield` follows at most one native micro-step, as there.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from dreamstage.stats import DreamStats
from dreamstage.training.drift.decoding import set_context_adapter
from dreamstage.training.drift.guard import DriftGuard, drift_figures, drift_receipt
from dreamstage.training.jobs.spec import JobSpec
from dreamstage.training.pacing.shaper import StepShaper, trains_from
from dreamstage.training.pacing.threads import DreamThreads, StepRan
from dreamstage.training.walk.examples import RenderedJob

if TYPE_CHECKING:
    from dreamstage.training.jobs.store import JobStore


class JobMeasures:
    """JobProgram's held-out loss (`_evaluate`) and drift guard (`_drift_guard`, `_store_drift`)."""

    store: JobStore
    resident: Any
    make_trainer: Callable
    stats: DreamStats
    drift_guard: bool
    _anchor_records: dict
    _noise_margins: dict
    _shaper: StepShaper | None
    _threads: DreamThreads | None
    _step_ran: StepRan | None
    _closing: list[Any]

    def _evaluate(self, spec: JobSpec, trainer, windows, chunk: int,
                  notes: list[str]) -> Generator[None, None, float | None]:
        """Held-out loss of the shadow adapter as it is now (the token-weighted
        mean of `_window_losses`); None when it could not be measured, noted."""
        per = yield from self._window_losses(spec, trainer, windows, chunk, notes, "held-out loss")
        tokens = sum(t for _, t in per or ())
        return sum(loss * t for loss, t in per) / tokens if per and tokens else None

    def _window_losses(self, spec: JobSpec, trainer, windows, chunk: int, notes: list[str],
                       what: str) -> Generator[None, None, list[tuple[float, int]] | None]:
        """Each window's forward loss (and loss tokens) under the shadow adapter as it is now.

        The native core has no forward-only pass yet, so an evaluator is a
        second Trainer of the same shape with lr 0 (its AdamW update moves
        nothing) holding a copy of the shadow's parameters; its micro-steps'
        losses are exactly the forward loss. It costs a second training cache
        and a wasted backward, goes through the same memory gate, and its
        receipts are not the job's. A refusal or a failed step returns None
        and notes that `what` was not measured."""
        try:
            evaluator = self.make_trainer(self.resident, spec, chunk, 0.0)
        except Exception as e:  # noqa: BLE001 - any refusal or failure of the evaluator only costs the figure
            receipt = getattr(e, "receipt", None)
            why = (receipt is not None and receipt.message) or e
            notes.append(f"{what} not measured: the evaluator was refused ({why})")
            return None
        self._closing.append(evaluator)
        try:
            evaluator.set_lora_parameters(trainer.lora_parameters())
            out = []
            for w in windows:
                evaluator.begin_window(w.tokens, w.mask)
                pos, loss_sum, tokens = 0, 0.0, 0
                while evaluator.chunks_left:
                    step_chunk, threads = (self._shaper.choose(chunk, trains_from(w.mask, pos), cut=True)
                                           if self._shaper is not None
                                           else (chunk, self._threads.serve_batch if self._threads is not None else 0))
                    if step_chunk != evaluator.chunk:
                        evaluator.set_chunk(step_chunk)   # an evaluation step pauses serving like any other
                    r = (evaluator.micro_step() if self._threads is None
                         else self._threads.run(threads, evaluator.micro_step))
                    self._step_ran = (StepRan(r.chunk_tokens, threads, r.tokens > 0, "ok", r.ms, 0.0)
                                      if r.status == "ok" else None)
                    pos += r.chunk_tokens
                    yield
                    if r.status != "ok":
                        notes.append(f"{what} not measured: {r.message}")
                        return None
                    loss_sum += r.loss * r.tokens
                    tokens += r.tokens
                out.append((loss_sum / tokens if tokens else 0.0, tokens))
            return out
        finally:
            evaluator.close()
            self._closing.remove(evaluator)

    def _store_drift(self, jid: int, spec: JobSpec, drift, epoch: int, final: bool,
                     recorded: tuple[int, int] | None = None) -> None:
        """A drift measurement (None: none ran) as the job's receipt, and into /metrics."""
        figures = drift_figures(drift, spec.max_drift, spec.max_drift_kl, epoch, final, recorded)
        if drift is None or figures is None:
            return
        job = self.store.get(jid)
        self.store.append_receipt(jid, drift_receipt(figures, step=job["progress"]["step"], ms=drift.ms,
                                                     memory=job["memory"]))
        self.stats.record_drift(jid, drift)

    def _probe_access(self, engine) -> tuple[Callable[[], Any], Callable[[], None], Callable[[], None]] | None:
        """What a drift probe decodes with: the engine's sequence lender, the call
        that makes serving's adapters step aside before the probe's decodes, and
        the one that says the probe changed the context's adapters. None when the
        guard is off on this server, or on a resident without llama handles or an
        engine that lends no sequence (test doubles)."""
        lend = getattr(engine, "hold_idle_sequence", None)
        if not self.drift_guard or getattr(self.resident, "ctx", None) is None or lend is None:
            return None
        adapters = getattr(engine, "adapters", None)
        if adapters is None:
            return lend, lambda: None, lambda: set_context_adapter(self.resident, None)
        return lend, adapters.lend_context, adapters.invalidate

    def _drift_guard(self, spec: JobSpec, rendered: RenderedJob, engine) -> DriftGuard | None:
        """The job's drift guard, or None (`_probe_access`)."""
        access = self._probe_access(engine)
        if access is None:
            return None
        lend, enter, restore = access
        return DriftGuard(self.resident, spec, rendered.train, seq_id=lend, cache=self._anchor_records,
                          noise_cache=self._noise_margins, restore=restore, enter=enter)
