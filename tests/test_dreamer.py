"""The dream scheduler against a fake trainer and a fake engine (no model, no native core).

The fake trainer follows the documented Trainer API (begin_window,
micro_step -> receipt, chunks_left, set_chunk, lora_parameters,
set_lora_parameters, save, close) and can be told which chunk sizes its
"memory gate" refuses, so the scheduler's walk, ladder, pause/cancel,
evaluation, promotion and recovery are tested in milliseconds. The real
Trainer is exercised end to end in tests/test_train_api.py.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from char_tokenizer import CharTokenizer

from dreamstage.training.jobs.scheduler import DreamScheduler
from dreamstage.training.jobs.store import JobStore
from dreamstage.training.jobs.submit import JobSubmitter
from dreamstage.training.pacing.shaper import StepShaper
from dreamstage.training.walk.receipts import RECEIPT_FIELDS, Receipt

TEXT = "the quick brown fox jumps over the lazy dog. " * 3   # 135 characters = 136 tokens with BOS


class FakeRefusal(RuntimeError):
    def __init__(self, receipt):
        super().__init__(receipt.message)
        self.receipt = receipt


class FakeTrainer:
    """Loss falls 10% per window (lr > 0). `refuse_above`: chunks longer than this are refused."""

    live: list[FakeTrainer] = []
    # computes the same at any chunk, as the exact walk does: the pause shaper may cut it
    exact = True

    def __init__(self, spec, chunk, lr=None, *, refuse_above=None, refuse_init=False):
        self.spec, self.chunk, self.lr = spec, chunk, spec.lr if lr is None else lr
        self.refuse_above = refuse_above
        self.value = 5.0          # the "adapter": the loss it gives
        self.steps = 0
        self.closed = False
        self.tokens, self.mask, self.pos = (), (), 0
        if refuse_init:
            raise FakeRefusal(self._receipt("refused", 0, 0, 0.0, 0, need=9.0, allowance=1.0,
                                            message="the training cache needs 9.00 MiB; allowance 1.00 MiB"))
        FakeTrainer.live.append(self)

    def _receipt(self, status, pos, n, loss, tokens, need=0.0, allowance=0.0, message=""):
        refused = status == "refused"
        return Receipt(status, self.steps, self.spec.window, self.chunk, pos, n, self.spec.context_cache_type,
                       False, False, -1, "backward" if tokens else "forward", loss, tokens,
                       1.0, 2.0, 0.5, 0.25, 0.5, 0.0,
                       pos if refused else -1, n if refused else 0, need, allowance, message)

    def begin_window(self, tokens, mask, soft=None):
        assert not self.closed
        self.tokens, self.mask, self.pos, self.soft = tuple(tokens), tuple(mask), 0, soft

    @property
    def chunks_left(self):
        return math.ceil((len(self.tokens) - self.pos) / self.chunk)

    def set_chunk(self, chunk):
        self.chunk = chunk

    deadline_ms: float | None = None

    def set_step_deadline(self, ms):
        self.deadline_ms = ms

    abort_ms: float | None = None

    def set_step_abort(self, ms):
        self.abort_ms = ms

    def micro_step(self):
        assert not self.closed and self.chunks_left
        p = self.pos
        n = min(self.chunk, len(self.tokens) - p)
        if self.refuse_above is not None and n > self.refuse_above:
            return self._receipt("refused", p, n, 0.0, 0, need=float(n), allowance=float(self.refuse_above),
                                 message=f"chunk at {p} ({n} tokens) needs {n} MiB; allowance {self.refuse_above} MiB")
        self.steps += 1
        tokens = sum(self.mask[p + 1:p + n + 1])
        self.pos += n
        r = self._receipt("ok", p, n, self.value, tokens)
        if not self.chunks_left and self.lr > 0:
            self.value *= 0.9
        return r

    def lora_parameters(self):
        return [self.value]

    def set_lora_parameters(self, vec):
        self.value = vec[0]

    def save(self, path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(f"fake adapter {self.value}\n")

    def close(self):
        self.closed = True


class FakeServed:
    def __init__(self):
        self.handle, self.path, self.applied = None, None, []

    def load(self, path):
        assert Path(path).is_file()
        return ("handle", str(path))

    def apply(self, handle, path):
        self.handle, self.path = handle, path
        self.applied.append(path)

    def discard(self, handle):
        pass


class FakeSlot:
    def __init__(self, i):
        self.seq_id, self.tokens, self.busy = i, [1, 2, 3], False


class FakeEngine:
    def __init__(self):
        self.slots = [FakeSlot(0), FakeSlot(1)]
        self.last_batch_decode_tokens = 0
        self.adapter_version = 0
        self.queue_depth = 0

    def forget_cached_prefixes(self):
        for s in self.slots:
            if not s.busy:
                s.tokens.clear()

    def busy_slots(self):
        return sum(s.busy for s in self.slots)


class Clock:
    """The scheduler's clock: every reading moves it by `tick` (a timed fake trainer moves it more)."""

    def __init__(self, tick=0.01):
        self.t, self.tick = 1000.0, tick

    def __call__(self):
        self.t += self.tick
        return self.t


def make(tmp_path, **trainer_kw):
    store = JobStore(tmp_path / "state")
    FakeTrainer.live = []
    sched = DreamScheduler(store, CharTokenizer(), served=FakeServed(), clock=Clock(), idle_grace_s=0.05,
                           make_trainer=lambda rm, spec, chunk, lr=None: FakeTrainer(spec, chunk, lr, **trainer_kw))
    engine = FakeEngine()
    sched.startup(engine)
    return store, sched, engine


def submit(store, sched, **body):
    body.setdefault("text", TEXT)
    body.setdefault("window", 64)
    body.setdefault("chunk", 32)
    body.setdefault("epochs", 1)     # these tests count one epoch's steps; the default is 10 (drift.md)
    job = JobSubmitter(store, sched, CharTokenizer()).submit(body)    # as POST /train does
    return job["id"]


def drive(sched, engine, until, calls=5000, idle=True):
    for _ in range(calls):
        if until():
            return
        sched.after_batch(engine, idle)
    raise AssertionError("the scheduler never got there")


def test_jobs_train_fifo_one_at_a_time_and_save_a_new_adapter_version(tmp_path):
    store, sched, engine = make(tmp_path)
    # no pause bound: every step runs the job's chunk, so the walk below is exact
    a = submit(store, sched, out="notes", promote="never", max_pause_ms=0)
    b = submit(store, sched, out="notes", promote="never", max_pause_ms=0)
    seen_together = []

    def both_done():
        states = (store.state(a), store.state(b))
        seen_together.append(states)
        return states == ("done", "done")

    drive(sched, engine, both_done)
    # b never left the queue while a was not done
    assert all(sb == "queued" for sa, sb in seen_together if sa != "done")
    ja, jb = store.get(a), store.get(b)
    # text: 136 tokens, window 64, overlap 8 -> 3 windows of 64, 64, 24 -> chunks 2 + 2 + 1
    assert ja["progress"]["windows"] == 3 and ja["progress"]["step"] == 5 and ja["receipts"] == 5
    assert ja["progress"]["tokens"] == 135           # every token after the first is a target once
    assert ja["progress"]["train_loss"] < 5.0         # the fake's loss fell over the windows
    assert ja["adapter"]["name"] == "notes" and ja["adapter"]["version"] == 1 and not ja["adapter"]["promoted"]
    assert jb["adapter"]["version"] == 2
    assert Path(jb["adapter"]["path"]).is_file()
    assert "not promoted (promote=never)" in ja["message"]
    assert all(t.closed for t in FakeTrainer.live)
    assert engine.adapter_version == 0
    assert ja["pacing"]["micro_steps"] >= 5


def test_chunk_ladder_halves_on_refusal_and_keeps_every_receipt(tmp_path):
    store, sched, engine = make(tmp_path, refuse_above=16)
    jid = submit(store, sched, chunk=64, min_chunk=8, max_pause_ms=0)
    drive(sched, engine, lambda: store.state(jid) in ("done", "refused", "error"))
    job = store.get(jid)
    assert job["state"] == "done", job["message"]
    refusals = job["refusals"]
    assert [r["refused_chunk_tokens"] for r in refusals] == [64, 32]
    for r in refusals:
        assert set(RECEIPT_FIELDS) <= set(r)
        assert r["refused_chunk_pos"] == 0 and r["refused_need_mib"] > r["refused_allowance_mib"]
    assert job["progress"]["current_chunk"] == 16 and job["progress"]["refusals"] == 2
    assert job["progress"]["tokens"] == 135          # nothing lost by the retries
    # the process's figures for /metrics agree with the job's own
    p, st = job["progress"], sched.stats
    assert st.steps == {"refused": 2, "ok": p["step"]} and st.refusals == {"memory_gate": 2}
    assert (st.walked_tokens, st.loss_tokens, st.step.n) == (p["walked"], p["tokens"], p["step"])
    assert st.pause.n >= p["step"] + 2 and st.memory_mib["graph"] == job["memory"]["graph_mib"]
    assert st.train_tok_s == pytest.approx(p["train_tok_s"])


def test_nothing_fits_ends_refused_with_the_ladder_in_refusals(tmp_path):
    store, sched, engine = make(tmp_path, refuse_above=4)
    jid = submit(store, sched, chunk=32, min_chunk=8, max_pause_ms=0)
    nxt = submit(store, sched)
    drive(sched, engine, lambda: store.state(jid) == "refused" and store.state(nxt) != "queued")
    job = store.get(jid)
    assert [r["refused_chunk_tokens"] for r in job["refusals"]] == [32, 16, 8]
    assert "floor" in job["message"]
    assert FakeTrainer.live[0].closed                # the refused job's trainer is freed


def test_a_refusal_at_construction_is_a_receipt_not_a_crash(tmp_path):
    store, sched, engine = make(tmp_path, refuse_init=True)
    jid = submit(store, sched)
    drive(sched, engine, lambda: store.state(jid) != "queued" and store.state(jid) != "starting")
    job = store.get(jid)
    assert job["state"] == "refused"
    assert job["refusals"][0]["refused_need_mib"] == 9.0 and "allowance" in job["message"]
    assert sched.stats.refusals == {"memory_gate": 1} and sched.stats.steps == {}


def test_pause_stops_micro_steps_resume_continues_cancel_frees_the_trainer(tmp_path):
    store, sched, engine = make(tmp_path)
    jid = submit(store, sched, epochs=50)
    drive(sched, engine, lambda: store.get(jid)["progress"]["step"] >= 3)
    store.transition(jid, "paused")
    before = store.get(jid)["receipts"]
    for _ in range(50):
        sched.after_batch(engine, True)
    assert store.get(jid)["receipts"] == before
    store.transition(jid, "running")
    drive(sched, engine, lambda: store.get(jid)["receipts"] > before + 2)
    trainer = FakeTrainer.live[0]
    nxt = submit(store, sched, promote="never")
    store.transition(jid, "cancelled")
    drive(sched, engine, lambda: store.state(nxt) == "done")
    assert trainer.closed
    assert store.get(jid)["adapter"] is None        # a cancelled job saves nothing


def test_epochs_report_held_out_loss_and_auto_promotion_applies_at_the_next_batch_without_a_drain(tmp_path):
    store, sched, engine = make(tmp_path)
    examples = [{"prompt": f"q{i}?", "completion": f"answer number {i}"} for i in range(4)]
    jid = submit(store, sched, text=None, examples=examples, epochs=3, val_split=0.25, promote="auto", out="qa")
    engine.slots[0].busy = True                      # a request is mid-flight when training ends
    drive(sched, engine, lambda: store.state(jid) == "done")
    p = store.get(jid)["progress"]
    assert len(p["eval_loss_per_epoch"]) == 3 and all(v is not None for v in p["eval_loss_per_epoch"])
    assert p["eval_loss_per_epoch"] == sorted(p["eval_loss_per_epoch"], reverse=True)
    assert store.served_version() == 1 and store.served()["name"] == "qa"
    # applied at the batch boundary with the busy slot still busy: admission is not held,
    # nothing is flushed (a slot's cached prefix is keyed by its own adapter)
    assert sched.hold_admission(engine) is False
    assert engine.adapter_version == 1 and engine.default_adapter().label == "qa@1"
    assert sched.served.path.endswith("qa/v1.gguf")
    assert engine.slots[1].tokens == [1, 2, 3] and engine.slots[0].tokens == [1, 2, 3]
    assert "promoted as served version 1" in store.get(jid)["message"]


def test_without_held_out_examples_eval_loss_is_null(tmp_path):
    store, sched, engine = make(tmp_path)
    jid = submit(store, sched, epochs=2)
    drive(sched, engine, lambda: store.state(jid) == "done")
    p = store.get(jid)["progress"]
    assert p["eval_loss"] is None and p["eval_loss_per_epoch"] == [None, None]


def test_promote_and_rollback_commands_run_on_the_engine_thread(tmp_path):
    store, sched, engine = make(tmp_path)
    for _ in range(2):
        jid = submit(store, sched, out="k", promote="never")
        drive(sched, engine, lambda jid=jid: store.state(jid) == "done")
    fut = sched.promote("k", 1)
    sched.after_batch(engine, True)
    view, applied = fut.result(0)
    assert view["promoted"] and applied.result(0) is True and engine.adapter_version == 1
    fut = sched.promote("k")                         # latest version by default
    sched.after_batch(engine, True)
    assert fut.result(0)[0]["version"] == 2 and engine.adapter_version == 2
    fut = sched.rollback()
    sched.after_batch(engine, True)
    fut.result(0)[1].result(0)
    assert engine.adapter_version == 1 and sched.served.path.endswith("k/v1.gguf")
    fut = sched.rollback()
    sched.after_batch(engine, True)
    fut.result(0)
    assert engine.adapter_version == 0 and sched.served.handle is None
    fut = sched.rollback()
    sched.after_batch(engine, True)
    with pytest.raises(KeyError, match="nothing to roll back"):
        fut.result(0)
    fut = sched.promote("nope")
    sched.after_batch(engine, True)
    with pytest.raises(KeyError, match="no adapter 'nope'"):
        fut.result(0)


def test_restart_reports_interrupted_runs_queued_and_reloads_the_served_adapter(tmp_path):
    store, sched, engine = make(tmp_path)
    first = submit(store, sched, out="r", promote="auto")
    drive(sched, engine, lambda: store.state(first) == "done")
    sched.hold_admission(engine)
    assert engine.adapter_version == 1
    running = submit(store, sched, epochs=100)
    queued = submit(store, sched, promote="never")
    drive(sched, engine, lambda: store.get(running)["progress"]["step"] >= 2)
    # the process dies: no close(), a new store and scheduler on the same directory
    store2 = JobStore(tmp_path / "state")
    assert store2.recovered == [running]
    assert store2.state(running) == "interrupted" and store2.state(queued) == "queued"
    sched2 = DreamScheduler(store2, CharTokenizer(), served=FakeServed(), clock=Clock(), idle_grace_s=0.05,
                            make_trainer=lambda rm, spec, chunk, lr=None: FakeTrainer(spec, chunk, lr))
    engine2 = FakeEngine()
    sched2.startup(engine2)
    assert engine2.adapter_version == 1 and sched2.served.path.endswith("r/v1.gguf")
    drive(sched2, engine2, lambda: store2.state(queued) == "done")
    assert store2.state(running) == "interrupted"


def test_under_load_max_slowdown_waits_for_a_baseline_and_reports_figures(tmp_path):
    store, sched, engine = make(tmp_path)
    jid = submit(store, sched, max_slowdown=0.5, epochs=20)
    engine.slots[0].busy = True
    for _ in range(3):                               # starting + running, before any baseline exists
        engine.last_batch_decode_tokens = 1
        sched.after_batch(engine, False)
    assert store.state(jid) == "running" and store.get(jid)["receipts"] == 0
    for _ in range(400):
        engine.last_batch_decode_tokens = 1
        sched.after_batch(engine, False)
    sched._flush_figures(final=True)
    job = store.get(jid)
    assert job["receipts"] > 0
    f = job["pacing"]
    assert f["decode_tok_s_without"] and f["decode_tok_s_with"] and f["micro_step_ms_p50"] is not None
    assert f["micro_step_ms_p95"] >= f["micro_step_ms_p50"] and f["micro_step_ms_max"] >= f["micro_step_ms_p95"]
    # steps ran only between batches, after a baseline of undisturbed batches
    assert f["decode_batches_with"] >= 1 and f["decode_batches_without"] >= 3


def test_close_marks_the_active_job_interrupted_and_frees_its_trainer(tmp_path):
    store, sched, engine = make(tmp_path)
    jid = submit(store, sched, epochs=100)
    drive(sched, engine, lambda: store.get(jid)["progress"]["step"] >= 1)
    sched.close()
    assert store.state(jid) == "interrupted" and FakeTrainer.live[0].closed


# -- pacing wiring: the pause bound, the dream step's threads, idle collisions ----------------
class TimedTrainer(FakeTrainer):
    """A micro-step takes 20 ms + 10 ms per chunk token on the scheduler's clock."""

    clock: Clock | None = None

    def micro_step(self):
        t0 = TimedTrainer.clock.t
        r = self._timed_step()
        return dataclasses.replace(r, ms=(TimedTrainer.clock.t - t0) * 1000.0)   # the native step time

    def _timed_step(self):
        r = super().micro_step()
        if r.status == "ok":
            TimedTrainer.clock.t += 0.020 + 0.010 * r.chunk_tokens
        return r


class SpikyTrainer(TimedTrainer):
    """A timed trainer whose every 7th step is descheduled for 8x its time,
    and which honours the step deadline as the native core does: a step that
    would pass it stops there, and the next micro_step goes on with it."""

    calls = 0
    left: float | None = None        # seconds a stopped step still needs

    def _timed_step(self):
        p = self.pos
        n = min(self.chunk, len(self.tokens) - p)
        if self.left is None:
            SpikyTrainer.calls += 1
            self.left = (0.020 + 0.010 * n) * (8 if SpikyTrainer.calls % 7 == 0 else 1)
        if self.deadline_ms and self.left * 1000 > self.deadline_ms:
            TimedTrainer.clock.t += self.deadline_ms / 1000
            self.left -= self.deadline_ms / 1000
            return self._receipt("stopped", p, n, 0.0, sum(self.mask[p + 1:p + n + 1]),
                                 message="stopped at the step deadline")
        r = FakeTrainer.micro_step(self)
        TimedTrainer.clock.t += self.left
        self.left = None
        return r


class FakeThreadsLlama:
    """The three llama.cpp thread calls DreamThreads uses, recorded."""

    def __init__(self):
        self.n, self.nb, self.calls = 2, 2, []

    def llama_n_threads(self, ctx):
        return self.n

    def llama_n_threads_batch(self, ctx):
        return self.nb

    def llama_set_n_threads(self, ctx, n, nb):
        self.n, self.nb = n, nb
        self.calls.append((n, nb))


class ThreadedTokenizer(CharTokenizer):
    def __init__(self):
        self.lc, self.ctx = FakeThreadsLlama(), object()


def timed(tmp_path, resident=None):
    store = JobStore(tmp_path / "state")
    FakeTrainer.live = []
    TimedTrainer.clock = Clock(tick=0.0001)
    sched = DreamScheduler(store, resident or CharTokenizer(), served=FakeServed(), clock=TimedTrainer.clock,
                           idle_grace_s=0.05,
                           make_trainer=lambda rm, spec, chunk, lr=None: TimedTrainer(spec, chunk, lr))
    engine = FakeEngine()
    sched.startup(engine)
    return store, sched, engine


def test_the_pause_bound_picks_the_chunk_and_the_walk_follows(tmp_path):
    store, sched, engine = timed(tmp_path)
    jid = submit(store, sched, chunk=64, max_pause_ms=100, epochs=3, promote="never")
    drive(sched, engine, lambda: store.state(jid) in ("done", "error"))
    job = store.get(jid)
    assert job["state"] == "done", job["message"]
    sizes = [r["chunk_tokens"] for r in store.receipts(jid)]
    # 16 tokens would take 180 ms; the first step is at most 8 (nothing measured yet)
    assert max(sizes) <= 8 and sizes.count(4) > len(sizes) / 2
    assert job["progress"]["tokens"] == 3 * 135        # the walk followed every chunk change
    f = job["pacing"]
    # only the first step, before anything was measured, may reach the bound
    assert f["micro_step_ms_p95"] <= 100 and f["max_pause_ms"] == 100 and f["pauses_over_max"] <= 1
    assert f["step_chunk"] == 4 and f["micro_steps"] >= len(sizes)    # the save and the first yield pause too


def spiky_job(tmp_path, trainer=None, max_pause_ms=100):
    """A 3-epoch job with a 100 ms pause bound on a SpikyTrainer (or `trainer`, a subclass), run to its end."""
    trainer = trainer or SpikyTrainer
    store = JobStore(tmp_path / "state")
    FakeTrainer.live = []
    TimedTrainer.clock = Clock(tick=0.0001)
    SpikyTrainer.calls = 0
    sched = DreamScheduler(store, CharTokenizer(), served=FakeServed(), clock=TimedTrainer.clock, idle_grace_s=0.05,
                           make_trainer=lambda rm, spec, chunk, lr=None: trainer(spec, chunk, lr))
    engine = FakeEngine()
    sched.startup(engine)
    jid = submit(store, sched, chunk=64, max_pause_ms=max_pause_ms, epochs=3, promote="never")
    drive(sched, engine, lambda: store.state(jid) in ("done", "error"))
    return store, jid


def assert_next_is_the_same_chunk(receipts, status):
    for r, nxt in zip(receipts, receipts[1:], strict=False):
        if r["status"] == status:
            assert (nxt["chunk_pos"], nxt["chunk_tokens"]) == (r["chunk_pos"], r["chunk_tokens"])


def test_a_step_past_the_deadline_is_stopped_and_the_walk_retries_it(tmp_path):
    # every 7th step is descheduled for 8x its time (a 4-token step: 480 ms
    # against a 100 ms bound): it stops at the deadline (90 ms) as often as it
    # needs, the scheduler goes on with the same chunk each time, and no pause
    # but the first, unmeasured, one passes the bound; every token is trained
    store, jid = spiky_job(tmp_path)
    job = store.get(jid)
    assert job["state"] == "done", job["message"]
    receipts = store.receipts(jid)
    stopped = [r for r in receipts if r["status"] == "stopped"]
    # each stopped step is gone on with: the next micro-step is the same chunk
    assert_next_is_the_same_chunk(receipts, "stopped")
    assert len(stopped) >= 5 and job["progress"]["stopped"] == len(stopped) == job["pacing"]["steps_stopped"]
    assert job["progress"]["stopped_ms"] == pytest.approx(sum(r["ms"] for r in stopped)) and stopped[0]["ms"] > 0
    assert job["progress"]["tokens"] == 3 * 135          # every stopped chunk was trained later
    f = job["pacing"]
    assert f["pauses_over_max"] <= 1 and f["micro_step_ms_p95"] <= 100


class PlainSpikyTrainer(SpikyTrainer):
    """A spiky trainer whose gradient depends on the chunk, as the plain walk's
    does: the shaper keeps the job's chunk and only the deadline bounds the
    pause. `stoppable`: whether its steps can stop (False: a graph on a GPU)."""

    exact = False
    stoppable = True

    @property
    def last_step_stoppable(self):
        return self.stoppable

    def _timed_step(self):
        if not self.stoppable:
            self.deadline_ms = None          # the native core ignores it for such a graph
        return super()._timed_step()


def plain_job(tmp_path, stoppable, max_pause_ms=100):
    PlainSpikyTrainer.stoppable = stoppable
    return spiky_job(tmp_path, PlainSpikyTrainer, max_pause_ms)


def test_the_plain_walk_keeps_its_chunk_and_the_deadline_bounds_the_pause(tmp_path):
    # A plain-walk window cut smaller trains on another gradient, so the pause
    # bound must not cut it: every step runs at the job's chunk (64 tokens:
    # 660 ms against a 100 ms bound) and stops at the deadline as often as it
    # needs. No pause passes the bound, and every token is trained.
    store, jid = plain_job(tmp_path, stoppable=True)
    job = store.get(jid)
    assert job["state"] == "done", job["message"]
    receipts = store.receipts(jid)
    ok = [r for r in receipts if r["status"] == "ok"]
    # each window is cut only where the chunk grid cuts it: 64 tokens, its end shorter
    assert max(r["chunk_tokens"] for r in ok) == 64
    assert all(r["chunk_tokens"] == 64 or nxt["chunk_pos"] == 0
               for r, nxt in zip(ok, ok[1:] + [{"chunk_pos": 0}], strict=True))
    assert all(r["chunk_pos"] % 64 == 0 for r in ok)
    assert job["progress"]["tokens"] == 3 * 135
    assert len([r for r in receipts if r["status"] == "stopped"]) >= 3 * 2 * 6   # each 64-token step in 7 parts
    f = job["pacing"]
    assert f["chunk_kept"] is True and f["pauses_over_max"] == 0 and f["micro_step_ms_p95"] <= 100


def test_a_plain_walk_whose_steps_cannot_stop_is_cut_once_one_passes_the_bound(tmp_path):
    # the same trainer on a graph that ignores the deadline (a GPU): the first
    # step runs whole at the job's chunk (660 ms against 100); from then on the
    # shaper cuts chunks
    store, jid = plain_job(tmp_path, stoppable=False)
    job = store.get(jid)
    assert job["state"] == "done", job["message"]
    sizes = [r["chunk_tokens"] for r in store.receipts(jid)]
    # at most 4 tokens (60 ms) after that: the spikes, which nothing stops here, hold it lower
    assert sizes[0] == 64 and max(sizes[1:]) <= 4
    assert job["pacing"]["chunk_kept"] is False and job["progress"]["stopped"] == 0
    # with a 1 s bound its whole steps fit: the chunk is kept until the first
    # spike (every 7th step, 8x: 5.3 s) passes it
    store, jid = plain_job(tmp_path / "wide", stoppable=False, max_pause_ms=1000)
    receipts = store.receipts(jid)
    over = next(i for i, r in enumerate(receipts) if r["ms"] > 1000)
    assert over == 6 and all(r["chunk_pos"] % 64 == 0 for r in receipts[:over + 1])       # the job's own grid
    assert max(r["chunk_tokens"] for r in receipts[over + 1:]) < 64
    assert store.get(jid)["pacing"]["chunk_kept"] is False


class SegmentSpikyTrainer(PlainSpikyTrainer):
    """A plain-walk spiky trainer whose spikes (every 7th step) fall inside one
    segment, which the deadline cannot cut (it was begun in time), and which
    honours the time limit as the native core does: such a step is aborted
    at the limit and undone. Other steps stop at the deadline as before."""

    def _timed_step(self):
        if self.left is None and self.abort_ms and (SpikyTrainer.calls + 1) % 7 == 0:
            SpikyTrainer.calls += 1
            p = self.pos
            n = min(self.chunk, len(self.tokens) - p)
            TimedTrainer.clock.t += self.abort_ms / 1000
            r = self._receipt("aborted", p, n, 0.0, sum(self.mask[p + 1:p + n + 1]),
                              message="aborted at the step's time limit")
            return dataclasses.replace(r, aborted_had_ms=self.abort_ms, aborted_need_ms=8 * (20.0 + 10.0 * n))
        return super()._timed_step()


def test_a_step_past_its_time_limit_is_aborted_undone_and_run_again(tmp_path):
    # every 7th step is descheduled for 8x its time inside one segment, which
    # the deadline cannot stop: it is aborted at the time limit (the bound,
    # 100 ms) and undone, and the walk runs the same chunk again. No pause
    # passes the limit, every token is trained once, and the kept chunk is
    # cut only after two aborts in a row (here: never, the spikes are apart).
    SegmentSpikyTrainer.stoppable = True
    store, jid = spiky_job(tmp_path, SegmentSpikyTrainer)
    job = store.get(jid)
    assert job["state"] == "done", job["message"]
    receipts = store.receipts(jid)
    aborted = [r for r in receipts if r["status"] == "aborted"]
    assert_next_is_the_same_chunk(receipts, "aborted")
    assert all(r["aborted_had_ms"] == pytest.approx(100.0, abs=1) and r["aborted_need_ms"] > 100.0 for r in aborted)
    assert len(aborted) >= 1 and job["progress"]["aborted"] == len(aborted) == job["pacing"]["steps_aborted"]
    assert job["progress"]["aborted_ms"] == pytest.approx(sum(r["ms"] for r in aborted))
    assert job["progress"]["tokens"] == 3 * 135           # each aborted chunk trained once, later
    f = job["pacing"]
    assert f["chunk_kept"] is True and f["step_abort_ms"] == pytest.approx(100.0, abs=5)
    assert f["pauses_over_max"] <= len(aborted) and f["micro_step_ms_p95"] <= 100 + 5


def test_without_a_deadline_the_same_spikes_pass_the_bound(tmp_path, monkeypatch):
    # the contrast: the same trainer with the shaper's deadline off
    monkeypatch.setattr(StepShaper, "deadline_ms", lambda self: None)
    store, jid = spiky_job(tmp_path)
    job = store.get(jid)
    assert job["state"] == "done" and job["progress"]["stopped"] == 0
    assert job["pacing"]["pauses_over_max"] >= 5


def test_the_dream_step_runs_on_its_own_threads_and_serving_gets_them_back(tmp_path):
    resident = ThreadedTokenizer()
    store, sched, engine = timed(tmp_path, resident)
    jid = submit(store, sched, chunk=16, max_pause_ms=100, promote="never")
    drive(sched, engine, lambda: store.state(jid) == "done")
    calls = resident.lc.calls
    # the configured 2 threads need no call; a probe on 1 thread sets it and restores 2
    assert (resident.lc.n, resident.lc.nb) == (2, 2)
    assert all(c == (2, 2) for c in calls[1::2]) and all(c != (2, 2) for c in calls[0::2])
    assert store.get(jid)["pacing"]["dream_threads"] in (1, 2)


def test_an_idle_step_a_request_waited_for_is_charged_as_a_collision(tmp_path):
    store, sched, engine = timed(tmp_path)
    jid = submit(store, sched, epochs=50, max_pause_ms=100)
    drive(sched, engine, lambda: store.get(jid)["progress"]["step"] >= 2)
    trainer = FakeTrainer.live[-1]
    step = trainer.micro_step

    def arrives_during_the_step():
        r = step()
        engine.queue_depth = 1                       # a request came in while this step ran...
        return r

    trainer.micro_step = arrives_during_the_step
    engine.oldest_wait_s = lambda: 0.03              # ...30 ms before it ended
    sched._pacer.credit = 0.0
    before = sched._pacer.credit
    sched.after_batch(engine, False)                 # no slot busy: the idle path, one step, then stop
    f = sched.pacing()
    assert f["idle_collisions"] == 1 and engine.queue_depth == 1
    assert sched._pacer.credit == pytest.approx(before + 0.1 * 0.03 - 0.03, abs=1e-3)


def test_the_job_view_shows_only_documented_fields(tmp_path):
    """Issue 11: internal accumulators must not leak into GET /train/{id}."""
    import re
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture" / "training-control.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", doc))
    store, sched, engine = timed(tmp_path)
    jid = submit(store, sched, promote="never")
    drive(sched, engine, lambda: store.state(jid) == "done")
    job = store.get(jid)
    progress = set(job["progress"])
    assert not [k for k in progress if k.startswith("_")]
    assert progress - documented == set() and set(job["pacing"]) - documented == set()
    assert "train_loss_per_epoch" in progress and "pauses_over_max" in job["pacing"]
