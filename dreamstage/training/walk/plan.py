"""The walk over a job's windows: which micro-step comes next, and the chunk ladder.

Pure bookkeeping, no llama and no SQL: `Walk` says where the job is (epoch,
window in that epoch's seeded order, chunk position) and what a receipt
means for it; `JobRun` ties a walk to the job's store rows for the engine.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dreamstage.training.jobs.spec import JobSpec
from dreamstage.training.jobs.store import JobStore
from dreamstage.training.walk.examples import epoch_order
from dreamstage.training.walk.groups import TrainGroup
from dreamstage.training.walk.receipts import receipt_dict


# -- the chunk ladder ------------------------------------------------------------
def next_chunk(chunk: int, floor: int) -> int | None:
    """After a refusal at `chunk`: halve, never below `floor` (the floor itself
    is tried); None when `chunk` already is at or below the floor."""
    if chunk < 1 or floor < 1:
        raise ValueError(f"chunk {chunk} and floor {floor} must be >= 1")
    return None if chunk <= floor else max(chunk // 2, floor)


def chunk_after_refusal(receipt: Mapping[str, Any], floor: int) -> int | None:
    """The chunk to retry with after a refused receipt, or None: the job ends refused."""
    if receipt.get("status") != "refused":
        raise ValueError(f"chunk_after_refusal needs a refused receipt, got status {receipt.get('status')!r}")
    chunk = receipt.get("chunk") or receipt.get("refused_chunk_tokens")
    if not chunk:
        raise ValueError("a refused receipt names neither chunk nor refused_chunk_tokens")
    return next_chunk(int(chunk), floor)


def ladder(chunk: int, floor: int) -> list[int]:
    """Every chunk the ladder would try, from `chunk` down."""
    rungs = [chunk]
    while (nxt := next_chunk(rungs[-1], floor)) is not None:
        rungs.append(nxt)
    return rungs


# -- the walk: which micro-step comes next -----------------------------------------
@dataclass(frozen=True)
class MicroStep:
    epoch: int
    window_index: int      # index into the job's train windows
    order_pos: int         # how many windows of this epoch came before
    chunk_pos: int
    chunk_tokens: int
    chunk: int             # the ladder's current chunk size
    last_in_window: bool   # the optimizer update follows this chunk


@dataclass
class Walk:
    """The job's position: epochs x windows (seeded order) x chunks, and the
    chunk ladder. Pure; the engine asks `current()`, runs that micro-step, and
    reports its receipt to `advance()`, which says what happened:

    "step" (next chunk of the same window), "window" (a window finished),
    "epoch" (an epoch finished), "done", "retry" (refused; chunk halved, same
    position), "refused" (refused at the floor), "error".
    A refusal allocated nothing and changed nothing (issue 4), so the walk
    retries at the same chunk_pos with the smaller chunk.

    The exact walk (exact=True) runs a window as a forward sweep and a reverse
    pass whose chunks the native core chooses, so its positions are not
    predicted here: each step is the window's next micro-step (chunk_pos 0,
    chunk_tokens 0 in `current()`), and the engine says when the trainer has
    no chunks left (`advance(..., window_done=)`). A refusal that halved the
    horizon (the receipt's horizon differs from the one in use) retries with
    the same chunk; any other refusal goes down the chunk ladder.

    A shared-prefix group (`native_windows`: their indices) is walked the same
    way in any job: the native core schedules its prompt and replies.
    """

    window_lengths: list[int]
    epochs: int
    seed: int
    chunk: int
    floor: int
    epoch: int = 0
    order_pos: int = 0
    chunk_pos: int = 0
    exact: bool = False
    horizon: int = 0       # exact walk: the horizon in use (0: the whole window), as the receipts report it
    # the windows an epoch visits, in order (the drift guard's: the job's
    # windows and a rotating slice of anchor windows); None: every window, shuffled
    orders: Callable[[int], list[int]] | None = field(default=None, repr=False)
    native_windows: frozenset[int] = frozenset()   # windows whose micro-steps the native core chooses (groups)
    # the epoch's order, asked for when its first window is (None until then): the
    # drift guard's windows of an epoch may be made while the epoch before trains
    _order: list[int] | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.window_lengths:
            raise ValueError("a walk needs at least one window")

    def _epoch_order(self) -> list[int]:
        if self.orders is not None:
            return self.orders(self.epoch)
        return epoch_order(len(self.window_lengths), self.epoch, self.seed)

    @property
    def order(self) -> list[int]:
        """The windows the current epoch visits, in order."""
        if self._order is None:
            self._order = self._epoch_order()
        return self._order

    @property
    def order_known(self) -> bool:
        """Whether the current epoch's order was asked for already."""
        return self._order is not None

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def current(self) -> MicroStep | None:
        if self.finished:
            return None
        w = self.order[self.order_pos]
        if self.exact or w in self.native_windows:
            return MicroStep(self.epoch, w, self.order_pos, 0, 0, self.chunk, False)
        n = self.window_lengths[w]
        k = min(self.chunk, n - self.chunk_pos)
        return MicroStep(self.epoch, w, self.order_pos, self.chunk_pos, k, self.chunk, self.chunk_pos + k >= n)

    def advance(self, receipt: Mapping[str, Any], window_done: bool | None = None) -> str:
        step = self.current()
        if step is None:
            raise ValueError("the walk is finished")
        status = receipt.get("status")
        horizon = receipt.get("horizon")
        if self.exact and status in ("ok", "refused") and horizon is not None and horizon != self.horizon:
            self.horizon = horizon
            if status == "refused":
                return "retry"          # the native core halved the horizon; the chunk stays
        if status == "stopped":
            return "stopped"            # stopped at the step deadline: the next micro-step goes on with the chunk
        if status == "aborted":
            return "aborted"            # aborted at the time limit, undone: the next micro-step starts the chunk again
        if status == "refused":
            nxt = next_chunk(self.chunk, self.floor)
            if nxt is None:
                return "refused"
            self.chunk = nxt
            return "retry"
        if status != "ok":
            return "error"
        if self.exact or step.window_index in self.native_windows:
            if window_done is None:
                raise ValueError("the exact walk's windows end when the trainer says so: pass window_done")
            return self._next_window() if window_done else "step"
        got = (receipt.get("chunk_pos"), receipt.get("chunk_tokens"))
        if None not in got and got != (step.chunk_pos, step.chunk_tokens):
            raise ValueError(f"the trainer ran chunk_pos {got[0]} x {got[1]} tokens but the walk expected "
                             f"{step.chunk_pos} x {step.chunk_tokens}: the trainer's chunk is out of step")
        self.chunk_pos += step.chunk_tokens
        if not step.last_in_window:
            return "step"
        return self._next_window()

    def consolidate(self, epochs: int, orders: Callable[[int], list[int]]) -> None:
        """After the job's own training (its early stop at an epoch's end, or "done"):
        `epochs` more epochs, epoch k (0, 1, ...) visiting `orders(k)`."""
        start = self.epoch
        self.epochs = start + epochs
        self.orders = lambda e: orders(e - start)
        self.order_pos = self.chunk_pos = 0
        self._order = None

    def end_here(self) -> None:
        """No more epochs after the one that just ended (a rehearsal-only epoch
        undone): the walk is finished."""
        self.epochs = self.epoch

    def _next_window(self) -> str:
        self.chunk_pos = 0
        self.order_pos += 1
        if self.order_pos < len(self.order):
            return "window"
        self.order_pos = 0
        self.epoch += 1
        self._order = None
        return "done" if self.finished else "epoch"



class JobRun:
    """The bookkeeping of the job being trained: its walk and its store rows.

    The engine owns the Trainer and the llama calls; this owns everything
    else. Per micro-step: `current()` says which window and chunk; when
    `chunk_pos == 0` the engine begins that window on the trainer; it runs one
    micro-step and hands the receipt to `record()`, which stores it, moves the
    walk, closes finished windows, and ends the job `refused` (ladder at its
    floor) or `error`. The returned event is Walk.advance's; on "retry" the
    engine sets the trainer's chunk to `run.chunk`; on "epoch" and "done" it
    evaluates the held-out windows and calls `end_epoch`.
    """

    def __init__(self, store: JobStore, job_id: int, spec: JobSpec, windows: Sequence[Any],
                 orders: Callable[[int], list[int]] | None = None):
        self.store, self.job_id, self.windows = store, job_id, windows
        self.walk = Walk([len(w) for w in windows], spec.epochs, spec.seed, spec.chunk, spec.min_chunk,
                         exact=spec.exact, horizon=spec.horizon or 0,
                         native_windows=frozenset(i for i, w in enumerate(windows) if isinstance(w, TrainGroup)),
                         orders=orders)
        store.update_progress(job_id, windows=len(self.walk.order), window_in_epoch=0, epoch=0)

    @property
    def chunk(self) -> int:
        return self.walk.chunk

    def current(self) -> tuple[Any, MicroStep] | None:
        lengths = self.walk.window_lengths
        if len(lengths) < len(self.windows):            # the drift guard made more windows (rehearsal)
            lengths.extend(len(w) for w in self.windows[len(lengths):])
        step = self.walk.current()
        return None if step is None else (self.windows[step.window_index], step)

    def record(self, receipt: Any, window_done: bool | None = None, reply_losses: Sequence[float] | None = None) -> str:
        """window_done: the trainer has no chunks left (the exact walk's window end).
        reply_losses: a group's per-reply losses when it ended with this receipt, which
        then carries the group's structure and those losses under `group`."""
        d = receipt_dict(receipt)
        step = self.walk.current()
        win = self.windows[step.window_index] if step is not None else None
        if isinstance(win, TrainGroup) and step is not None and window_done and d.get("status") == "ok":
            d["group"] = {**win.structure(), "epoch": step.epoch,
                          "reply_losses": [None if x != x else x for x in (reply_losses or [])]}
        self.store.append_receipt(self.job_id, d)
        event = self.walk.advance(d, window_done)
        if event in ("window", "epoch", "done"):
            self.store.end_window(self.job_id)
            self.store.update_progress(self.job_id, window_in_epoch=self.walk.order_pos)
        elif event == "refused":
            self.store.transition(self.job_id, "refused", message=(
                f"chunk {self.walk.chunk} was refused at the ladder's floor ({self.walk.floor}): "
                f"{d.get('message') or 'no message'}"))
        elif event == "error":
            self.store.transition(self.job_id, "error", message=d.get("message") or "the micro-step failed")
        return event

    def end_epoch(self, eval_loss: float | None, examples_loss: float | None = None) -> dict[str, Any]:
        return self.store.end_epoch(self.job_id, eval_loss, examples_loss)

    def end_here(self) -> None:
        """Walk.end_here, with the job's progress (its epochs) to match."""
        self.walk.end_here()
        self.store.update_progress(self.job_id, epochs=self.walk.epochs)

    def consolidate(self, epochs: int, orders: Callable[[int], list[int]]) -> None:
        """Walk.consolidate, with the job's progress (epochs, windows per epoch) to match."""
        self.walk.consolidate(epochs, orders)
        self.store.update_progress(self.job_id, epochs=self.walk.epochs, windows=len(self.walk.order),
                                   window_in_epoch=0)
