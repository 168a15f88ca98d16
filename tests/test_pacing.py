"""Pacing on a fake clock: share, max_slowdown (with contention), idle grace, figures."""
import random

import pytest

from dreamstage.pacing import Pacer
from dreamstage.trainspec import PacingSpec


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def serve(pacer, clock, batches, *, batch_s=0.010, tokens=4, step_s=0.030, contention=0.0, jitter=0.0, seed=0):
    """Continuous load: decode batches back to back, a micro-step whenever the
    pacer allows. A batch right after a micro-step is `contention` slower.
    Returns ground truth: (tokens, wall seconds, dream seconds)."""
    rng = random.Random(seed)
    start, dream_total, produced, dreamed = clock(), 0.0, 0, False
    for _ in range(batches):
        cost = batch_s * (1 + contention if dreamed else 1) * (1 + rng.uniform(-jitter, jitter))
        clock.advance(cost)
        pacer.record_decode(tokens)
        produced += tokens
        dreamed = pacer.should_dream(active_slots=2)
        if dreamed:
            s = step_s * (1 + rng.uniform(-jitter, jitter))
            clock.advance(s)
            pacer.record_dream(s)
            dream_total += s
    return produced, clock() - start, dream_total


def test_share_spends_that_fraction_of_active_wall_time_dreaming():
    clock = FakeClock()
    pacer = Pacer("share", 0.25, clock=clock)
    _, wall, dream = serve(pacer, clock, 4000, jitter=0.2)
    assert dream / wall == pytest.approx(0.25, abs=0.015)
    f = pacer.figures()
    assert f["dream_share"] == pytest.approx(0.25, abs=0.02)
    assert f["decode_batches_with"] > 0 and f["decode_batches_without"] > f["decode_batches_with"]


@pytest.mark.parametrize("share", [0.05, 0.2])  # one 4 ms step per 10 ms batch caps it at 0.29
def test_share_tracks_other_targets_too(share):
    clock = FakeClock()
    pacer = Pacer("share", share, clock=clock)
    _, wall, dream = serve(pacer, clock, 4000, step_s=0.004)
    assert dream / wall == pytest.approx(share, abs=0.02)


@pytest.mark.parametrize("contention", [0.0, 0.5])
def test_max_slowdown_keeps_the_measured_slowdown_at_the_bound(contention):
    clock = FakeClock()
    pacer = Pacer("max_slowdown", 0.10, clock=clock)
    produced, wall, dream = serve(pacer, clock, 6000, contention=contention, jitter=0.1)
    undisturbed = 4 / 0.010
    true_slowdown = 1 - (produced / wall) / undisturbed
    assert 0.07 <= true_slowdown <= 0.11
    f = pacer.figures()
    assert f["realized_slowdown"] == pytest.approx(true_slowdown, abs=0.02)
    assert f["decode_tok_s_without"] == pytest.approx(undisturbed, rel=0.03)
    if contention:  # the cost of the slower batch is paid out of the dream budget
        assert dream / wall < 0.095


def test_max_slowdown_measures_before_it_dreams():
    clock = FakeClock()
    pacer = Pacer("max_slowdown", 0.5, clock=clock)
    granted = []
    for _ in range(5):
        clock.advance(0.01)
        pacer.record_decode(4)
        granted.append(pacer.should_dream(1))
    # an interval needs two batch ends; r0 needs three undisturbed intervals
    assert granted == [False, False, False, True, True]
    assert pacer.figures()["decode_tok_s_without"] == pytest.approx(400)


def test_at_most_one_micro_step_per_decode_batch():
    clock = FakeClock()
    pacer = Pacer("share", 0.9, clock=clock)
    clock.advance(0.01)
    pacer.record_decode(4)
    clock.advance(0.01)
    pacer.record_decode(4)
    assert pacer.should_dream(1)
    pacer.record_dream(0.001)
    assert not pacer.should_dream(1)            # not again before the next batch
    clock.advance(0.01)
    pacer.record_decode(4)
    assert pacer.should_dream(1)


def test_idle_grace_then_continuous_dreaming_and_no_charge():
    clock = FakeClock()
    pacer = Pacer("share", 0.1, clock=clock, idle_grace_s=0.2)
    clock.advance(0.01)
    pacer.record_decode(4)                      # the last batch before the slots go quiet
    clock.advance(0.1)
    assert not pacer.should_dream(0)
    assert pacer.idle_wait_s() == pytest.approx(0.1)
    clock.advance(0.1)
    for _ in range(10):                         # continuous once the grace is over
        assert pacer.should_dream(0)
        clock.advance(0.05)
        pacer.record_dream(0.05)
    f = pacer.figures()
    assert f["idle_micro_steps"] == 10 and f["micro_steps"] == 10 and pacer.credit == 0.0
    # A client arrives: the interval spanning the idle time is not counted.
    clock.advance(0.01)
    pacer.record_decode(4)
    assert pacer.figures()["decode_batches_without"] == 0
    assert pacer.credit == 0.0                  # idle steps were not charged to active time
    clock.advance(0.01)
    pacer.record_decode(4)
    assert pacer.figures()["decode_batches_without"] == 1


def test_idle_grace_counts_from_creation_when_nothing_was_served():
    clock = FakeClock()
    pacer = Pacer("max_slowdown", 0.1, clock=clock, idle_grace_s=0.2)
    assert not pacer.should_dream(0)
    clock.advance(0.2)
    assert pacer.should_dream(0)


def test_figures_report_what_was_measured():
    clock = FakeClock()
    pacer = Pacer("share", 0.5, clock=clock)
    clock.advance(0.01)
    pacer.record_decode(4)
    steps = [0.010, 0.020, 0.030, 0.040, 0.100]
    for s in steps:
        clock.advance(0.020)                    # an undisturbed batch: 4 tokens in 20 ms
        pacer.record_decode(4)
        assert pacer.should_dream(1)
        clock.advance(s)
        pacer.record_dream(s)
        pacer.credit = 0.0                      # force the next grant; this test is about figures
    clock.advance(0.020)
    pacer.record_decode(4)
    f = pacer.figures()
    assert (f["micro_step_ms_p50"], f["micro_step_ms_p95"], f["micro_step_ms_max"]) == pytest.approx((30, 100, 100))
    assert f["micro_steps"] == 5 and f["decode_batches_with"] == 5 and f["decode_batches_without"] == 1
    assert f["decode_tok_s_without"] == pytest.approx(200)   # one undisturbed interval, reported as measured
    with_s = sum(0.020 + s for s in steps)
    assert f["decode_tok_s_with"] == pytest.approx(20 / with_s)
    assert f["decode_tok_s"] == pytest.approx(24 / (with_s + 0.020))
    assert f["dream_share"] == pytest.approx(sum(steps) / (with_s + 0.020))
    assert f["realized_slowdown"] is None and f["mode"] == "share" and f["target"] == 0.5


def test_from_spec_and_bad_settings_are_named():
    assert Pacer.from_spec(PacingSpec("share", 0.3)).mode == "share"
    with pytest.raises(ValueError, match="'sometimes'"):
        Pacer("sometimes", 0.1)
    with pytest.raises(ValueError, match="max_slowdown 1.5"):
        Pacer("max_slowdown", 1.5)
    with pytest.raises(ValueError, match="idle_grace_s"):
        Pacer("share", 0.1, idle_grace_s=-1)
