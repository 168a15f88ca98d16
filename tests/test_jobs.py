"""Job store, state machine, recovery, receipts, adapters, the chunk ladder and the walk."""
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading

import pytest

from dreamstage.adapters.versions import AdapterNotFound
from dreamstage.training.jobs import request as spec_module
from dreamstage.training.jobs.errors import JobError, JobNotFound
from dreamstage.training.jobs.promotion import promotion_decision
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.schema import SCHEMA_VERSION
from dreamstage.training.jobs.store import (
    STATES,
    TERMINAL,
    TRANSITIONS,
    InvalidTransition,
    JobStore,
    check_transition,
)
from dreamstage.training.jobs.stored import SPEC_VERSION, to_stored
from dreamstage.training.walk.plan import JobRun, Walk, chunk_after_refusal, ladder, next_chunk
from dreamstage.training.walk.receipts import RECEIPT_FIELDS
from dreamstage.training.walk.receipts import Receipt as NativeReceipt
from dreamstage.training.walk.windows import TrainWindow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An ok micro-step as the native core reports it; tests override what they need.
OK_RECEIPT = dict(status="ok", step=0, window=64, chunk=32, chunk_pos=0, chunk_tokens=32, context_cache_type="q8_0",
                  recompute=False, exact=False, horizon=-1, walk_pass="backward", loss=2.5, tokens=30, ms=15.0,
                  graph_mib=12.5, context_mib=1.25, adapter_mib=0.5, optimizer_mib=1.0, walk_mib=0.0,
                  refused_chunk_pos=-1, refused_chunk_tokens=0, refused_need_mib=0.0, refused_allowance_mib=0.0,
                  message="")


def Receipt(**fields) -> NativeReceipt:
    """The real receipt dataclass (the mirror of struct dream_receipt), not a copy of its shape."""
    return NativeReceipt(**{**OK_RECEIPT, **fields})


def refused(chunk, pos=0):
    return Receipt(status="refused", chunk=chunk, chunk_tokens=chunk, loss=0.0, tokens=0, ms=0.1,
                   refused_chunk_pos=pos, refused_chunk_tokens=chunk, refused_need_mib=chunk * 2.0,
                   refused_allowance_mib=10.0, message=f"chunk of {chunk} tokens needs {chunk * 2.0} MiB")


def req(**kw):
    return parse_train_request({"text": "some text", "window": 64, **kw})


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "state")
    yield s
    s.close()



def should_step(run: JobRun) -> bool:
    """Whether the job is running (not paused, cancelled or ended) and has work left."""
    return not run.walk.finished and run.store.state(run.job_id) == "running"


def ended(run: JobRun) -> bool:
    """Whether the job reached a final state (cancelled by the server, refused, ...)."""
    return run.store.state(run.job_id) in TERMINAL

def test_a_receipt_is_stored_and_read_back_unchanged_under_its_canonical_names(store):
    jid = store.submit(req())["id"]
    r = Receipt(step=3, loss=1.75, message="")
    store.append_receipt(jid, r)
    (back,) = store.receipts(jid)
    assert tuple(back) == RECEIPT_FIELDS and back == dataclasses.asdict(r)
    assert NativeReceipt(**back) == r


# -- submit and durability ---------------------------------------------------------
def test_submit_commits_the_job_with_its_starting_fields_before_returning(store):
    job = store.submit(req(chunk=32, context_cache_type="f16", out="facts"))
    assert job["state"] == "queued" and job["out"] == "facts"
    assert {k: job[k] for k in ("context_cache_type", "chunk", "recompute", "exact", "horizon", "window")} == \
        {"context_cache_type": "f16", "chunk": 32, "recompute": False, "exact": False, "horizon": None, "window": 64}
    # A separate connection (another process, after a crash) already sees it.
    raw = sqlite3.connect(store.path)
    state, spec = raw.execute("SELECT state, spec FROM jobs WHERE id=?", (job["id"],)).fetchone()
    assert state == "queued" and json.loads(spec)["chunk"] == 32
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()
    assert store.spec(job["id"]) == req(chunk=32, context_cache_type="f16", out="facts").to_job_spec()


def test_an_unnamed_job_gets_a_default_adapter_name_and_the_view_omits_examples(store):
    job = store.submit(parse_train_request({"examples": [{"prompt": "p", "completion": "c"}] * 3, "text": "t"}))
    assert job["out"] == f"job-{job['id']}"
    assert job["spec"]["examples"] == 4 and "text" not in job["spec"]
    assert job["progress"]["eval_loss"] is None and job["refusals"] == [] and job["adapter"] is None


def test_a_null_examples_or_text_beside_the_other_is_counted_as_none(store):
    """The fuzzer's find: `"examples": null` beside a text was stored, then its view raised (a 500)."""
    job = store.submit(parse_train_request({"text": "t", "examples": None}))
    assert store.get(job["id"])["spec"]["examples"] == 1
    job = store.submit(parse_train_request({"text": None, "examples": [{"prompt": "p", "completion": "c"}]}))
    assert store.get(job["id"])["spec"]["examples"] == 1


def test_unknown_jobs_raise_naming_the_id(store):
    with pytest.raises(JobNotFound, match="no job 42"):
        store.get(42)
    with pytest.raises(JobNotFound):
        store.transition(42, "starting")


# -- the state machine -----------------------------------------------------------
@pytest.mark.parametrize("current", STATES)
@pytest.mark.parametrize("target", STATES)
def test_every_transition_follows_the_table(current, target):
    if target in TRANSITIONS[current]:
        check_transition(1, current, target)
    else:
        with pytest.raises(InvalidTransition, match=f"from {current} to {target}"):
            check_transition(1, current, target)


def test_terminal_states_are_final_and_unknown_states_are_named():
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    with pytest.raises(ValueError, match="unknown job state 'sleeping'"):
        check_transition(1, "running", "sleeping")


def test_a_job_walks_its_lifecycle_with_timestamps(tmp_path):
    now = [100.0]
    store = JobStore(tmp_path, clock=lambda: now[0])
    jid = store.submit(req())["id"]
    for state in ("starting", "running", "paused", "running"):
        now[0] += 1
        store.transition(jid, state)
    now[0] += 1
    assert store.transition(jid, "done", message="3 epochs") == "running"
    job = store.get(jid)
    assert (job["state"], job["started"], job["finished"], job["message"]) == ("done", 101.0, 105.0, "3 epochs")
    with pytest.raises(InvalidTransition, match=f"job {jid} cannot go from done to running"):
        store.transition(jid, "running")
    store.close()


def test_a_cancel_and_a_done_race_and_exactly_one_wins(store):
    for _ in range(20):
        jid = store.submit(req())["id"]
        store.transition(jid, "starting")
        store.transition(jid, "running")
        results = []
        barrier = threading.Barrier(2)

        def attempt(target, jid=jid, barrier=barrier, results=results):
            barrier.wait()
            try:
                store.transition(jid, target)
                results.append(target)
            except InvalidTransition:
                pass

        threads = [threading.Thread(target=attempt, args=(t,)) for t in ("cancelled", "done")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 1 and store.state(jid) == results[0]


# -- recovery ------------------------------------------------------------------------
# Run in a child process that is killed (SIGKILL) with the store open: no
# close, no checkpoint, no atexit; whatever survives was committed.
DIES_WITH_THE_STORE_OPEN = """
import json, os, signal, sys
from dreamstage.training.walk.receipts import Receipt
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.store import JobStore
s = JobStore(sys.argv[1])
ids = [s.submit(parse_train_request({"text": "some text", "window": 64, "seed": i}))["id"] for i in range(6)]
s.transition(ids[0], "starting")                                # starting
for j in ids[1:3]:
    s.transition(j, "starting")
    s.transition(j, "running")
s.transition(ids[2], "paused")                                  # paused
s.transition(ids[3], "cancelled")
s.append_receipt(ids[1], Receipt(**json.loads(sys.argv[2])))   # NORMAL sync: survives a process crash
print(json.dumps(ids), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_reopen_after_the_process_died_interrupts_active_jobs_and_keeps_the_queue_fifo(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", DIES_WITH_THE_STORE_OPEN, str(tmp_path),
                        json.dumps({**OK_RECEIPT, "step": 1})], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ids = json.loads(r.stdout)
    assert (tmp_path / f"{JobStore.DB_NAME}-wal").exists()         # it died before any checkpoint or close

    s2 = JobStore(tmp_path)
    assert s2.recovered == ids[:3]
    for j in ids[:3]:
        job = s2.get(j)
        assert job["state"] == "interrupted" and "stopped while the job was" in job["message"]
        assert job["finished"] is not None
    assert s2.state(ids[3]) == "cancelled"
    assert s2.queue() == ids[4:] and s2.next_queued() == ids[4]
    assert s2.receipts(ids[1]) == [dataclasses.asdict(Receipt(step=1))]   # nothing accepted is lost
    assert s2.spec(ids[5]).seed == 5
    s2.close()
    assert JobStore(tmp_path).recovered == []


def test_overview_shows_the_current_job_and_the_queue(store):
    a, b, c = (store.submit(req())["id"] for _ in range(3))
    assert store.overview()["current"] is None
    store.transition(a, "starting")
    view = store.overview()
    assert view["current"]["id"] == a and [j["id"] for j in view["queue"]] == [b, c]


# -- receipts and progress --------------------------------------------------------------
def test_receipts_are_stored_unchanged_and_refusals_carry_their_figures(store):
    jid = store.submit(req(chunk=64))["id"]
    store.transition(jid, "starting")
    store.append_receipt(jid, refused(64))
    store.append_receipt(jid, refused(32, pos=32))
    store.transition(jid, "running")
    store.append_receipt(jid, Receipt(chunk=16, chunk_tokens=16, tokens=16, ms=8.0, graph_mib=3.0))
    extra = {"status": "ok", "chunk": 16, "chunk_tokens": 16, "tokens": 16, "ms": 8.0, "extra": [1, 2]}
    store.append_receipt(jid, extra)
    assert store.receipts(jid)[3] == extra
    job = store.get(jid)
    assert [r["refused_chunk_tokens"] for r in job["refusals"]] == [64, 32]
    for r in job["refusals"]:
        assert r["refused_need_mib"] > r["refused_allowance_mib"] and r["refused_chunk_pos"] is not None
        assert r["message"]
    p = job["progress"]
    assert (p["step"], p["tokens"], p["refusals"], p["current_chunk"]) == (2, 32, 2, 16)
    assert p["train_tok_s"] == pytest.approx(32 / 0.016)
    assert job["memory"] == {"graph_mib": 3.0, "context_mib": 1.25, "adapter_mib": 0.5,
                             "optimizer_mib": 1.0, "walk_mib": 0.0}
    assert job["receipts"] == 4 and len(store.receipts(jid, after_seq=2)) == 2


@pytest.mark.parametrize("bad, words", [({"loss": 1.0}, "status None"), ({"status": "fine"}, "'fine'"),
                                        ({"status": "ok", "x": object()}, "not JSON serializable")])
def test_malformed_receipts_are_refused_and_nothing_is_written(store, bad, words):
    jid = store.submit(req())["id"]
    with pytest.raises((ValueError, TypeError), match=words):
        store.append_receipt(jid, bad)
    assert store.receipts(jid) == []


def test_a_job_stored_before_examples_loss_gets_null_for_its_earlier_epochs():
    from dreamstage.training.jobs.progress import close_epoch
    p = {"_epoch_loss_sum": 3.0, "_epoch_tokens": 2, "train_loss_per_epoch": [2.0, 1.8],
         "eval_loss_per_epoch": [None] * 2}
    close_epoch(p, None, 0.4)
    assert p["examples_loss_per_epoch"] == [None, None, 0.4] and p["train_loss_per_epoch"] == [2.0, 1.8, 1.5]


def test_window_and_epoch_losses_come_from_the_receipts(store):
    jid = store.submit(req(epochs=2))["id"]
    store.append_receipt(jid, Receipt(loss=5.0, tokens=6))      # window 1: two chunks
    store.append_receipt(jid, Receipt(loss=3.0, tokens=4))
    store.append_receipt(jid, refused(32))                       # refusals carry no loss
    assert store.end_window(jid) == pytest.approx(4.2)           # token-weighted: (30 + 12) / 10
    store.append_receipt(jid, Receipt(loss=2.0, tokens=30))
    store.append_receipt(jid, Receipt(loss=9.0, tokens=0))       # a decode-only chunk: no loss tokens
    assert store.end_window(jid) == 2.0
    p = store.end_epoch(jid, eval_loss=None)
    assert p["train_loss_per_epoch"] == [pytest.approx(102 / 40)] and p["eval_loss"] is None and p["epoch"] == 1
    assert p["loss"] == 2.0 and p["loss_avg"] == pytest.approx((0.9 * 0.1 * 4.2 + 0.1 * 2) / (1 - 0.81))
    assert p["windows_done"] == 2 and p["tokens"] == 40
    store.append_receipt(jid, Receipt(loss=1.0, tokens=5))
    store.end_window(jid)
    p = store.end_epoch(jid, eval_loss=1.5, examples_loss=0.75)
    assert p["train_loss_per_epoch"] == [pytest.approx(2.55), 1.0] and p["eval_loss_per_epoch"] == [None, 1.5]
    assert p["examples_loss_per_epoch"] == [None, 0.75]          # the job's own windows: the scheduler's figure
    assert p["train_loss"] == 1.0 and p["eval_loss"] == 1.5
    assert store.end_window(jid) is None                         # an empty window changes no loss
    store.update_progress(jid, window_in_epoch=3, windows=9)
    assert store.get(jid)["progress"]["windows"] == 9 and store.get(jid)["progress"]["window_in_epoch"] == 3
    with pytest.raises(ValueError, match=r"unknown progress fields \['window'\]"):
        store.update_progress(jid, window=4)                     # the old name of window_in_epoch
    assert "window" not in store.get(jid)["progress"]
    with pytest.raises(ValueError, match="not set directly"):
        store.update_progress(jid, _ema=1.0)


def test_pacing_figures_are_reported(store):
    jid = store.submit(req())["id"]
    store.set_pacing(jid, {"mode": "share", "realized_slowdown": 0.08})
    assert store.get(jid)["pacing"]["realized_slowdown"] == 0.08


def test_the_engine_writes_while_the_server_reads(store):
    jid = store.submit(req())["id"]
    store.transition(jid, "starting")
    store.transition(jid, "running")
    n, seen, errors = 300, [], []

    def engine():
        try:
            for i in range(n):
                store.append_receipt(jid, Receipt(step=i))
                if i % 50 == 0:
                    store.set_pacing(jid, {"i": i})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def server():
        try:
            while not seen or seen[-1] < n:
                job = store.get(jid)
                assert job["progress"]["step"] == job["receipts"]   # one transaction: consistent
                seen.append(job["receipts"])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=engine), threading.Thread(target=server)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and seen == sorted(seen) and seen[-1] == n
    assert [r["step"] for r in store.receipts(jid)] == list(range(n))


def test_a_closed_store_refuses_use(tmp_path):
    s = JobStore(tmp_path)
    s.close()
    with pytest.raises(Exception, match="closed"):
        s.queue()


# -- adapters -----------------------------------------------------------------------
def test_adapter_versions_promotion_and_rollback_survive_a_restart(tmp_path):
    s = JobStore(tmp_path)
    jid = s.submit(req(out="facts"))["id"]
    assert s.served() is None and s.served_version() == 0
    v1 = s.next_adapter_version("facts")
    assert v1 == 1 and s.adapter_path("facts", 1) == (tmp_path / "adapters" / "facts" / "v1.gguf").resolve()
    s.add_adapter("facts", v1, job_id=jid, eval_loss=2.0)
    s.add_adapter("facts", s.next_adapter_version("facts"), job_id=jid)
    assert s.get(jid)["adapter"]["version"] == 2 and s.get(jid)["adapter"]["promoted"] is False
    assert s.promote("facts", 1)["served_version"] == 1
    assert s.promote("facts")["version"] == 2 and s.served_version() == 2
    assert [a["promoted"] for a in s.adapters()] == [False, True]
    assert s.get(jid)["adapter"]["promoted"] is True
    s.close()

    s = JobStore(tmp_path)                               # a restart reloads what was served
    assert (s.served()["name"], s.served()["version"], s.served_version()) == ("facts", 2, 2)
    assert [p["version"] for p in s.promotions()] == [1, 2]
    back = s.rollback()
    assert (back["version"], back["served_version"]) == (1, 1)
    assert s.rollback() is None and s.served_version() == 0
    with pytest.raises(AdapterNotFound, match="nothing to roll back"):
        s.rollback()
    assert s.promote("facts", 2)["served_version"] == 3    # a new promotion, a new number
    s.close()


def test_adapter_names_and_versions_are_checked(store):
    for name in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError, match="bare adapter name"):
            store.adapter_path(name, 1)
    with pytest.raises(ValueError, match="positive integer"):
        store.adapter_path("ok", 0)
    with pytest.raises(AdapterNotFound, match="no adapter 'ghost'"):
        store.promote("ghost")
    store.add_adapter("real", 1)
    with pytest.raises(AdapterNotFound, match="version 7"):
        store.promote("real", 7)
    with pytest.raises(sqlite3.IntegrityError):
        store.add_adapter("real", 1)


def test_auto_promotion_decision():
    assert promotion_decision(2.0, 1.9, guarded=False)[0] is True
    assert promotion_decision(2.0, 2.0, guarded=False)[0] is True
    ok, why = promotion_decision(2.0, 2.1, guarded=False)
    assert not ok and "worse" in why
    assert promotion_decision(None, None, guarded=False) == (True, "nothing held out; promoted on completion")


# -- the chunk ladder ------------------------------------------------------------------
def test_the_ladder_halves_to_the_floor_then_gives_up():
    assert ladder(128, 16) == [128, 64, 32, 16]
    assert ladder(100, 16) == [100, 50, 25, 16]
    assert ladder(20, 16) == [20, 16] and ladder(8, 16) == [8]
    assert next_chunk(17, 16) == 16 and next_chunk(16, 16) is None
    assert chunk_after_refusal(dataclasses.asdict(refused(64)), 16) == 32
    assert chunk_after_refusal({"status": "refused", "refused_chunk_tokens": 16}, 16) is None
    with pytest.raises(ValueError, match="needs a refused receipt"):
        chunk_after_refusal({"status": "ok", "chunk": 64}, 16)
    with pytest.raises(ValueError, match=">= 1"):
        next_chunk(0, 16)


# -- the walk ----------------------------------------------------------------------------
def test_the_walk_visits_every_chunk_of_every_window_each_epoch():
    lengths = [64, 10, 33, 64]
    walk = Walk(lengths, epochs=2, seed=1, chunk=16, floor=4)
    events, seen = [], {0: [], 1: []}
    while (s := walk.current()) is not None:
        seen[s.epoch].append((s.window_index, s.chunk_pos, s.chunk_tokens, s.last_in_window))
        events.append(walk.advance({"status": "ok"}))
    for epoch in (0, 1):
        for w, n in enumerate(lengths):
            spans = [(p, k) for wi, p, k, _ in seen[epoch] if wi == w]
            assert [p for p, _ in spans] == list(range(0, n, 16)) and sum(k for _, k in spans) == n
        assert sum(last for *_, last in seen[epoch]) == len(lengths)
    order0 = [w for w, p, *_ in seen[0] if p == 0]
    order1 = [w for w, p, *_ in seen[1] if p == 0]
    assert sorted(order0) == sorted(order1) == [0, 1, 2, 3]
    assert events.count("window") == 6 and events.count("epoch") == 1 and events[-1] == "done"


@pytest.mark.parametrize("stop_after", [1, None], ids=["after-an-early-stop", "after-the-last-epoch"])
def test_consolidation_walks_its_own_epochs_after_the_jobs(stop_after):
    """Walk.consolidate: after the job's own epochs end (an early stop at an epoch's
    end, or "done"), `epochs` more, epoch k visiting orders(k) only, then "done"."""
    walk = Walk([8, 8, 8, 8], epochs=3, seed=0, chunk=8, floor=4, orders=lambda e: [0, 1])
    events = []
    while (s := walk.current()) is not None:
        events.append((s.epoch, s.window_index, walk.advance({"status": "ok"})))
        if events[-1][2] == "epoch" and stop_after is not None and s.epoch + 1 == stop_after:
            break
        if events[-1][2] == "done":
            break
    start = walk.epoch
    assert start == (stop_after or 3)
    walk.consolidate(2, lambda k: [3 - k, 2])
    while (s := walk.current()) is not None:
        events.append((s.epoch, s.window_index, walk.advance({"status": "ok"})))
    tail = [(e, w) for e, w, _ in events[-4:]]
    assert tail == [(start, 3), (start, 2), (start + 1, 2), (start + 1, 2)]
    assert [ev for *_, ev in events[-4:]] == ["window", "epoch", "window", "done"] and walk.finished


def test_a_walk_ended_after_an_epoch_has_no_more():
    """Walk.end_here (a rehearsal-only epoch undone): the epoch that just ended is the last."""
    walk = Walk([8, 8], epochs=1, seed=0, chunk=8, floor=4)
    while walk.advance({"status": "ok"}) != "done":
        pass
    walk.consolidate(3, lambda k: [0])
    assert walk.advance({"status": "ok"}) == "epoch" and walk.epoch == 2 and not walk.finished
    walk.end_here()
    assert walk.finished and walk.current() is None and walk.epochs == 2


def test_a_refusal_retries_the_same_position_with_half_the_chunk_until_the_floor():
    walk = Walk([64], epochs=1, seed=0, chunk=32, floor=8)
    assert walk.advance({"status": "ok"}) == "step"
    assert walk.advance({"status": "refused"}) == "retry"
    s = walk.current()
    assert (s.chunk_pos, s.chunk_tokens, s.chunk) == (32, 16, 16)
    assert walk.advance({"status": "refused"}) == "retry"
    assert walk.current().chunk_tokens == 8
    assert walk.advance({"status": "refused"}) == "refused"
    assert walk.advance({"status": "error"}) == "error"
    assert walk.current().chunk_pos == 32


def test_the_exact_walk_ends_windows_when_the_trainer_says_and_a_halved_horizon_keeps_the_chunk():
    walk = Walk([64, 64], epochs=1, seed=0, chunk=32, floor=8, exact=True, horizon=0)
    ok = {"status": "ok", "exact": True, "horizon": 0}
    assert walk.current().chunk_pos == 0
    with pytest.raises(ValueError, match="window_done"):
        walk.advance(ok)
    assert walk.advance(ok, window_done=False) == "step"
    # the native core halved the horizon: same chunk, the horizon the receipt names is in use
    assert walk.advance({"status": "refused", "exact": True, "horizon": 32}, window_done=False) == "retry"
    assert (walk.chunk, walk.horizon) == (32, 32)
    # a refusal that did not change the horizon walks the chunk ladder
    assert walk.advance({"status": "refused", "exact": True, "horizon": 32}, window_done=False) == "retry"
    assert walk.chunk == 16
    assert walk.advance({**ok, "horizon": 32}, window_done=True) == "window"
    assert walk.advance({**ok, "horizon": 32}, window_done=True) == "done"


# -- a job driven end to end, the way the engine will ----------------------------------------
class FakeTrainer:
    """The native Trainer's shape: begin_window, micro_step, a settable chunk.
    Chunks above `fits` tokens are refused, changing nothing."""

    def __init__(self, chunk, fits):
        self.chunk, self.fits, self.pos, self.n, self.mask, self.step_no = chunk, fits, 0, 0, (), 0

    def begin_window(self, tokens, mask, soft=None):
        self.pos, self.n, self.mask = 0, len(tokens), mask

    def micro_step(self):
        k = min(self.chunk, self.n - self.pos)
        if k > self.fits:
            return refused(self.chunk, pos=self.pos)
        self.step_no += 1
        r = Receipt(step=self.step_no, chunk=self.chunk, chunk_pos=self.pos, chunk_tokens=k,
                    tokens=sum(self.mask[self.pos:self.pos + k]), loss=1.0 / self.step_no, ms=2.0)
        self.pos += k
        return r


def drive(store, jid, trainer, text_tokens):
    from dreamstage.training.walk.examples import render_job

    class Tok:  # text needs tokenize only
        bos, eos = 0, 1

        def tokenize(self, text, add_special=True, parse_special=True):
            return text_tokens

    spec = store.spec(jid)
    store.transition(jid, "starting")
    run = JobRun(store, jid, spec, render_job(spec, Tok()).train)
    store.transition(jid, "running")
    events = []
    while should_step(run):
        window, step = run.current()
        if step.chunk_pos == 0:
            trainer.begin_window(window.tokens, window.mask)
        event = run.record(trainer.micro_step())
        events.append(event)
        if event == "retry":
            trainer.chunk = run.chunk
        if event in ("epoch", "done"):
            run.end_epoch(eval_loss=None)
        if event == "done":
            store.transition(jid, "done")
    return events


def test_a_job_runs_through_the_ladder_to_done(store):
    jid = store.submit(req(window=64, chunk=64, overlap=8, epochs=2, min_chunk=8))["id"]
    events = drive(store, jid, FakeTrainer(chunk=64, fits=20), list(range(150)))
    job = store.get(jid)
    assert job["state"] == "done" and events[-1] == "done"
    assert [r["refused_chunk_tokens"] for r in job["refusals"]] == [64, 32]   # 64 -> 32 -> 16 fits
    p = job["progress"]
    assert p["current_chunk"] == 16 and p["windows"] == 3 and p["epoch"] == 2 and p["windows_done"] == 6
    assert p["tokens"] == 2 * 149 and len(p["train_loss_per_epoch"]) == 2 and p["eval_loss"] is None


def test_a_job_that_never_fits_ends_refused_with_its_receipts(store):
    jid = store.submit(req(window=64, chunk=64, min_chunk=16))["id"]
    events = drive(store, jid, FakeTrainer(chunk=64, fits=4), list(range(100)))
    job = store.get(jid)
    assert events == ["retry", "retry", "refused"] and job["state"] == "refused"
    assert [r["refused_chunk_tokens"] for r in job["refusals"]] == [64, 32, 16]
    assert "floor (16)" in job["message"] and "needs 32.0 MiB" in job["message"]


def test_pause_stops_the_walk_and_resume_continues_it(store):
    jid = store.submit(req(window=64, chunk=16))["id"]
    spec = store.spec(jid)
    store.transition(jid, "starting")
    run = JobRun(store, jid, spec, [TrainWindow(tuple(range(40)), (0,) + (1,) * 39)])
    store.transition(jid, "running")
    run.record(Receipt(chunk=16, chunk_pos=0, chunk_tokens=16))
    store.transition(jid, "paused")                      # the server thread
    assert not should_step(run)
    store.transition(jid, "running")
    assert should_step(run) and run.current()[1].chunk_pos == 16
    with pytest.raises(ValueError, match="out of step"):
        run.record(Receipt(chunk=16, chunk_pos=0, chunk_tokens=16))
    assert not ended(run)
    store.transition(jid, "cancelled")                   # the server again
    assert ended(run) and not should_step(run)


def test_an_older_store_gains_the_checksum_column_and_private_modes(tmp_path):
    import hashlib
    import os
    import stat

    JobStore(tmp_path).close()
    db = tmp_path / JobStore.DB_NAME
    conn = sqlite3.connect(db)
    conn.execute("ALTER TABLE adapters DROP COLUMN sha256")      # as a store made before checksums
    conn.execute("PRAGMA user_version=0")                        # (and so before schema versions)
    conn.commit()
    conn.close()
    os.chmod(db, 0o644)                                          # as made under a 022 umask
    store = JobStore(tmp_path)
    try:
        assert "sha256" in [r[1] for r in store._conn().execute("PRAGMA table_info(adapters)")]
        assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
        path = store.adapter_path("notes", 1)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"adapter bytes")
        assert store.add_adapter("notes", 1)["sha256"] == hashlib.sha256(b"adapter bytes").hexdigest()
    finally:
        store.close()


# -- the stored spec and the schema's versions ------------------------------------
# The jobs and adapters tables as every store before schema version 1 had them
# (PRAGMA user_version 0): no stored spec, no adapter checksum.
OLD_TABLES = """
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, state TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
    started REAL, finished REAL, message TEXT, request TEXT NOT NULL, out TEXT NOT NULL,
    context_cache_type TEXT NOT NULL, chunk INTEGER NOT NULL, recompute INTEGER NOT NULL, exact INTEGER NOT NULL,
    horizon INTEGER, window INTEGER NOT NULL, progress TEXT NOT NULL, pacing TEXT, adapter_name TEXT,
    adapter_version INTEGER
);
CREATE TABLE adapters (
    name TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL, created REAL NOT NULL,
    job_id INTEGER REFERENCES jobs(id), eval_loss REAL, PRIMARY KEY (name, version)
);
"""


def old_store(state_dir, rows):
    """A store as the code before schema version 1 wrote it: each row is (request body, starting fields)."""
    state_dir.mkdir(parents=True)
    conn = sqlite3.connect(state_dir / JobStore.DB_NAME)
    conn.executescript(OLD_TABLES)
    for state, body, start in rows:
        # the progress under its old names: `window` (an index) and `chunk` (the size in use)
        progress = {"step": 0, "window": 2, "windows": 5, "chunk": start["chunk"], "memory": {}, "tokens": 0}
        conn.execute("INSERT INTO jobs (state, created, updated, request, out, context_cache_type, chunk, recompute,"
                     " exact, horizon, window, progress) VALUES (?, 1, 1, ?, 'o', ?, ?, ?, ?, ?, ?, ?)",
                     (state, json.dumps(body), start["context_cache_type"], start["chunk"], int(start["recompute"]),
                      int(start["exact"]), start["horizon"], start["window"], json.dumps(progress)))
    conn.commit()
    conn.close()


def test_a_queued_job_written_by_the_old_schema_means_the_same_after_the_upgrade(tmp_path):
    plain = {"text": "some text", "window": 64}
    # accepted when the default chunk was 256: the row kept the chunk it resolved to
    older_default = {"text": "some text", "window": 512, "share": 0.3}
    start = {"context_cache_type": "q8_0", "recompute": False, "exact": False, "horizon": None}
    old_store(tmp_path / "state", [("queued", plain, {**start, "chunk": 64, "window": 64}),
                                   ("queued", older_default, {**start, "chunk": 256, "window": 512}),
                                   ("queued", {"text": "x", "windw": 64}, {**start, "chunk": 64, "window": 64})])
    with JobStore(tmp_path / "state") as s:
        assert s.schema_found == 0
        conn = sqlite3.connect(s.path)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert "sha256" in {r[1] for r in conn.execute("PRAGMA table_info(adapters)")}
        # the starting fields are stored once, in the spec: their old columns are gone
        assert not {"context_cache_type", "chunk", "window"} & {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
        conn.close()
        assert s.spec(1) == parse_train_request(plain).to_job_spec()
        assert (s.get(2)["chunk"], s.get(2)["window"], s.get(2)["context_cache_type"]) == (256, 512, "q8_0")
        spec = s.spec(2)
        assert (spec.chunk, spec.min_chunk, spec.window) == (256, 16, 512)
        assert spec.pacing.mode == "share" and spec.pacing.value == 0.3
        assert s.queue() == [1, 2]
        progress = s.get(2)["progress"]
        assert (progress["window_in_epoch"], progress["current_chunk"]) == (2, 256)
        assert "window" not in progress and "chunk" not in progress
        bad = s.get(3)                       # a request that no longer validates: told, not run
        assert bad["state"] == "error" and "no longer validates" in bad["message"]
        with pytest.raises(JobError, match="no stored spec"):
            s.spec(3)
    with JobStore(tmp_path / "state") as s:   # a second open finds the current version and changes nothing
        assert s.schema_found == SCHEMA_VERSION and s.spec(2).chunk == 256


def test_a_stored_spec_keeps_the_defaults_it_was_accepted_with(tmp_path, monkeypatch):
    with JobStore(tmp_path / "state") as s:
        jid = s.submit(parse_train_request({"text": "some text", "window": 512}))["id"]
    monkeypatch.setattr(spec_module, "DEFAULT_CHUNK", 32)          # an upgrade changes a default
    assert parse_train_request({"text": "some text", "window": 512}).to_job_spec().chunk == 32
    with JobStore(tmp_path / "state") as s:
        assert s.spec(jid).chunk == 128 and s.get(jid)["chunk"] == 128


def test_a_form_1_spec_reads_back_as_it_meant_before_the_drift_guard(tmp_path):
    """Form 1 had no drift guard fields and no group_prefix: a job queued then
    keeps training its own examples only, with no early stop, after an upgrade."""
    with JobStore(tmp_path / "state") as s:
        jid = s.submit(req())["id"]
        now = s.spec(jid)
        assert now.regularizer and now.stop_loss is not None          # today's defaults
        stored = json.loads(to_stored(now))
        for k in ("regularizer", "anchor_ratio", "anchors", "max_drift", "max_drift_kl", "stop_loss", "group_prefix"):
            stored.pop(k)                                             # the form-1 shape
        conn = sqlite3.connect(s.path)
        conn.execute("UPDATE jobs SET spec=?, spec_version=1 WHERE id=?", (json.dumps(stored), jid))
        conn.commit()
        conn.close()
        old = s.spec(jid)
    assert (old.regularizer, old.anchor_ratio, old.anchors, old.stop_loss, old.group_prefix) == (
        False, 0.0, (), None, False)
    assert (old.lr, old.epochs, old.window, old.examples) == (now.lr, now.epochs, now.window, now.examples)


def test_a_form_2_spec_reads_back_without_a_drift_kl_bound(tmp_path):
    """Form 2 bounded only the changed-answer fraction: a job queued then keeps
    that rule after an upgrade (no max_drift_kl), and every other field."""
    with JobStore(tmp_path / "state") as s:
        jid = s.submit(req())["id"]
        now = s.spec(jid)
        assert now.max_drift_kl == 1.0
        stored = json.loads(to_stored(now))
        stored.pop("max_drift_kl")
        stored["max_drift"] = 0.05
        conn = sqlite3.connect(s.path)
        conn.execute("UPDATE jobs SET spec=?, spec_version=2 WHERE id=?", (json.dumps(stored), jid))
        conn.commit()
        conn.close()
        old = s.spec(jid)
    assert old.max_drift_kl is None and old.max_drift == 0.05 and old.regularizer == now.regularizer
    assert (old.lr, old.epochs, old.window, old.examples) == (now.lr, now.epochs, now.window, now.examples)


def test_a_form_3_spec_reads_back_rehearsing_samples_without_consolidation(tmp_path):
    """Form 3 had no `rehearsal` and no `consolidate`: its regularizer trained the
    base's sampled continuations and training ended with the job's own last
    epoch, and a job queued then keeps doing so after an upgrade."""
    with JobStore(tmp_path / "state") as s:
        jid = s.submit(req())["id"]
        now = s.spec(jid)
        assert now.rehearsal == "soft" and now.consolidate > 0
        stored = json.loads(to_stored(now))
        stored.pop("rehearsal")
        stored.pop("consolidate")
        conn = sqlite3.connect(s.path)
        conn.execute("UPDATE jobs SET spec=?, spec_version=3 WHERE id=?", (json.dumps(stored), jid))
        conn.commit()
        conn.close()
        old = s.spec(jid)
    assert old.rehearsal == "samples" and old.consolidate == 0 and old.max_drift_kl == now.max_drift_kl
    assert (old.lr, old.epochs, old.window, old.examples) == (now.lr, now.epochs, now.window, now.examples)


def test_a_store_or_a_spec_from_a_newer_version_is_refused_by_name(tmp_path):
    with JobStore(tmp_path / "state") as s:
        jid = s.submit(req())["id"]
        conn = sqlite3.connect(s.path)
        conn.execute("UPDATE jobs SET spec_version=? WHERE id=?", (SPEC_VERSION + 1, jid))
        conn.commit()
        with pytest.raises(JobError, match=f"stored in form {SPEC_VERSION + 1}"):
            s.spec(jid)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
        conn.commit()
        conn.close()
    with pytest.raises(JobError, match=f"schema version {SCHEMA_VERSION + 1}, written by a newer dreamstage"):
        JobStore(tmp_path / "state")
