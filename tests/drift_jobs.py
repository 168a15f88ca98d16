"""What the drift tests' jobs share: the test facts, an engine with one idle
slot, and running a job through a scheduler to its end."""
from __future__ import annotations

import time

from dreamstage.training.drift.decoding import FixedSequence
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.store import TERMINAL

TEST_FACTS = [
    ("What is the capital of Brenholt?", "The capital of Brenholt is Varnesse.", "Varnesse"),
    ("Who discovered the element lunarium?", "Lunarium was discovered by Ilse Marrok.", "Marrok"),
    ("What is the national dish of Corvany?", "The national dish of Corvany is fennel stew.", "fennel stew"),
    ("What river flows through Estergard?", "The river Olwen flows through Estergard.", "Olwen"),
    ("What is the official flower of Pellamy?", "The official flower of Pellamy is the blue thistle.", "blue thistle"),
]


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

