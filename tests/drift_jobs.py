"""What the drift tests' jobs share: the test facts, an engine with one idle
slot, running a job through a scheduler to its end, the checks of a finished
job's drift figures, and the hand-over of the base's records between the two
job modules (test_drift_jobs.py makes them; test_drift_readme.py restarts a
server on them)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.decoding import FixedSequence
from dreamstage.training.drift.record_file import FILE_NAME
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.store import TERMINAL

TEST_FACTS = [
    ("What is the capital of Brenholt?", "The capital of Brenholt is Varnesse.", "Varnesse"),
    ("Who discovered the element lunarium?", "Lunarium was discovered by Ilse Marrok.", "Marrok"),
    ("What is the national dish of Corvany?", "The national dish of Corvany is fennel stew.", "fennel stew"),
    ("What river flows through Estergard?", "The river Olwen flows through Estergard.", "Olwen"),
    ("What is the official flower of Pellamy?", "The official flower of Pellamy is the blue thistle.", "blue thistle"),
]


# The drift job modules rehearse this share of the shipped rehearsal anchors (all 20 measured ones
# are measured): what they prove (records, holds, rehearsal-only epochs, the guard's decisions) does
# not need all 80, and each one is a record and a window of every rehearsal-only epoch. The defaults
# over all of them are measured by bench/bench_drift.py.
TEST_REHEARSED = rehearsal_anchors()[:24]


def chat(facts):
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a, _ in facts]


class OneSlotEngine:
    """The engine as the scheduler sees it between batches: one idle slot to lend."""

    def __init__(self):
        self.adapter_version = 0
        self.queue_depth = 0
        self.last_batch_decode_tokens = 0
        self.lent = 0

    def busy_slots(self):
        return 0

    def forget_cached_prefixes(self):
        return 0

    def hold_idle_sequence(self):
        self.lent += 1
        return FixedSequence(0)


def cut_anchors(mp, measured: list[str], rehearsed: list[str], nulls: int) -> None:
    """Through the monkeypatch `mp`: the guard measures `measured` (and a job's extra anchors),
    rehearses `rehearsed`, and draws `nulls` null adapters for the noise margin."""
    from dreamstage.training.drift import guard as guard_module
    from dreamstage.training.drift import measure as measure_module
    mp.setattr(guard_module, "load_anchors", lambda extra=(): [*measured, *extra])
    mp.setattr(guard_module, "rehearsal_anchors", lambda: list(rehearsed))
    mp.setattr(measure_module, "NULL_DRAWS", nulls)


def cut_rehearsal(mp) -> None:
    """Through the monkeypatch `mp`: the guard rehearses TEST_REHEARSED, measures the shipped anchors."""
    from dreamstage.training.drift import guard as guard_module
    mp.setattr(guard_module, "rehearsal_anchors", lambda: list(TEST_REHEARSED))


def run_job(sched, store, engine, body, max_calls=200_000):
    t0 = time.perf_counter()
    job = store.submit(parse_train_request(body))
    sched.notify_submitted(job["id"])
    for _ in range(max_calls):
        if store.state(job["id"]) in TERMINAL:
            break
        sched.after_batch(engine, True)
    for _ in range(5):                                 # a booked promotion is applied between batches
        sched.after_batch(engine, True)
    print(f"\njob {body.get('out')}: {time.perf_counter() - t0:.1f} s")
    return store.get(job["id"])



def record_anchors_while_idle(sched, engine) -> int:
    """No job yet and nobody served: the scheduler records the anchors ahead of time. Its steps."""
    for _ in range(20_000):
        sched.after_batch(engine, True)
        if sched._warmup is not None and sched._warmup.done:
            break
    return sched._warmup.steps


def assert_drift_figures(job: dict, margin: float, draws) -> None:
    """A finished job's held-out drift as reported: measured at `margin` (of `draws`), the raw
    count of every change beside the count beyond the margin, every changed anchor named."""
    d = job["progress"]["drift"]
    assert d["noise_margin"] == margin and d["anchors_changed_count"] <= d["anchors_changed_raw_count"]
    assert f"at all: {d['anchors_changed_raw_count']}/{d['anchors']}" in job["message"]
    # the figures name every changed anchor, widest lead first, and which of them count
    named = d["changed_anchors"]
    assert len(named) == d["anchors_changed_raw_count"] and {a["anchor"] for a in named} <= set(load_anchors())
    assert sum(a["beyond"] for a in named) == d["anchors_changed_count"]
    assert all(a["beyond"] == (a["lead"] > margin - 1e-4) for a in named if abs(a["lead"] - margin) > 1e-3)
    assert [a["lead"] for a in named] == sorted((a["lead"] for a in named), reverse=True)
    assert d["noise_draws"] == [round(x, 4) for x in draws]


# The base's records and noise margin, handed from test_drift_jobs.py (whose warm-up records
# them and measures the margin) to test_drift_readme.py, which would otherwise
# spend about 3.5 CPU-minutes making them again. Under xdist the two modules run on
# different workers at once; the directory is the run's (all workers' temp dirs are in it).
JOBS_MODULE = "test_drift_jobs.py"
HANDOFF_WAIT_S = 1800           # a hang guard: the warm-up takes about 2 min of one core


def _handoff_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / "drift-base-handoff"


def hand_over_base(tmp_path_factory, records_file: Path | None) -> None:
    """The jobs module's side: the state directory's record file (or None: it has none to give)."""
    out = _handoff_dir(tmp_path_factory)
    out.mkdir(exist_ok=True)
    if records_file is None:
        (out / "failed").touch()
        return
    shutil.copy(records_file, out / f".{FILE_NAME}")
    os.replace(out / f".{FILE_NAME}", out / FILE_NAME)
    (out / "ready").touch()


def handed_base(request, tmp_path_factory) -> Path | None:
    """The readme module's side: the jobs module's record file once it is handed over, or None
    when that module does not run in this session (or failed first): then make your own."""
    if not any(item.path.name == JOBS_MODULE for item in request.session.items):
        return None
    out = _handoff_dir(tmp_path_factory)
    # one process runs the modules in turn (tests/conftest.py: the jobs module first): ready or not, it is over
    deadline = time.monotonic() + (HANDOFF_WAIT_S if os.environ.get("PYTEST_XDIST_WORKER") else 0)
    while True:
        if (out / "ready").exists():
            return out / FILE_NAME
        if (out / "failed").exists() or time.monotonic() >= deadline:
            return None
        time.sleep(1.0)
