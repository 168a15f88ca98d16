"""A follower's booking, without servers: the promotion generation and `mirror_promotions` (adapters/replicas.py), and
`AdapterSwitch.book_mirror` (the leader's whole live set at once, checked against the set after it)."""
from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest

from dreamstage.adapters.replicas import generation, mirror_promotions
from dreamstage.adapters.served import AdapterRefused, AdapterSwitch
from dreamstage.training.jobs.store import JobStore


class FakeServed:
    """Checks files as llama.cpp's loader would, minus the loading."""

    def __init__(self):
        self.path, self.loaded = None, []

    def load(self, path):
        self.loaded.append(str(path))
        return ("handle", str(path))

    def apply(self, handle, path):
        self.path = path

    def discard(self, handle):
        pass


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "state")
    for name, version in (("alice", 1), ("alice", 2), ("bob", 1)):
        path = s.adapter_path(name, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1024)
        s.add_adapter(name, version)
    yield s
    s.close()


def live(store) -> list[tuple[int, str, int]]:
    return [(p["served_version"], p["name"], p["version"]) for p in store.promotions()]


def test_the_generation_grows_with_every_promotion_and_rollback(store):
    seen = [generation(store)]
    store.promote("alice", 1)
    store.promote("bob", 1)
    store.promote("alice", 2)
    seen.append(generation(store))
    store.rollback("alice")
    seen.append(generation(store))
    store.retire("bob")
    seen.append(generation(store))
    store.add_adapter("carol", 1)                     # a stored version serves nothing: no change
    seen.append(generation(store))
    assert seen == [0, 3, 4, 5, 5]


def test_mirror_makes_the_live_promotions_the_leaders_under_its_numbers(store):
    mirror_promotions(store, [(4, "alice", 1), (9, "bob", 1)])
    assert live(store) == [(4, "alice", 1), (9, "bob", 1)] and store.served_version() == 9
    assert store.served()["name"] == "bob" and store.served("alice")["served_version"] == 4
    mirror_promotions(store, [(4, "alice", 1), (11, "alice", 2)])       # bob rolled back, alice moved on
    assert live(store) == [(4, "alice", 1), (11, "alice", 2)] and store.served("bob") is None
    mirror_promotions(store, [(4, "alice", 1), (9, "bob", 1)])          # a rolled-back row lives again
    assert live(store) == [(4, "alice", 1), (9, "bob", 1)]
    mirror_promotions(store, [])
    assert live(store) == [] and store.served() is None and store.served_version() == 0


def switch_on(store, **kw) -> tuple[AdapterSwitch, SimpleNamespace]:
    engine = SimpleNamespace(adapter_version=0, default_adapter=None)
    return AdapterSwitch(store, FakeServed(), budget_mib=100.0, **kw), engine


def book(switch, engine, set_) -> bool:
    applied: concurrent.futures.Future = concurrent.futures.Future()
    switch.book_mirror(set_, applied)
    switch.apply_pending(engine)
    return applied.result(0)


def test_book_mirror_checks_room_against_the_set_after_the_change(store):
    switch, engine = switch_on(store, max_adapters=1)
    assert book(switch, engine, [(3, "alice", 1)])
    assert engine.adapter_version == 3 and switch.served.path.endswith("alice/v1.gguf")
    # alice out and bob in, as one change (the follower missed the step between): one resident, accepted
    assert book(switch, engine, [(5, "bob", 1)])
    assert live(store) == [(5, "bob", 1)] and engine.adapter_version == 5
    # two resident names with --max-adapters 1: refused, nothing booked
    with pytest.raises(AdapterRefused, match="max-adapters"):
        switch.book_mirror([(5, "bob", 1), (6, "alice", 2)], concurrent.futures.Future())
    assert live(store) == [(5, "bob", 1)] and switch.pending is None


def test_book_mirror_loads_only_the_names_whose_served_file_changes(store):
    switch, engine = switch_on(store)
    book(switch, engine, [(3, "alice", 1), (4, "bob", 1)])
    switch.served.loaded.clear()
    assert book(switch, engine, [(3, "alice", 1), (4, "bob", 1), (8, "alice", 2)])
    assert [p.split("/state/")[1] for p in switch.served.loaded] == ["adapters/alice/v2.gguf"]
    assert engine.adapter_version == 8 and store.served("bob")["served_version"] == 4
    assert book(switch, engine, [])                   # the leader rolled everything back: the base serves
    assert engine.adapter_version == 0 and switch.served.path is None
