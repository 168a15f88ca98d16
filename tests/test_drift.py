"""The drift guard on the default model: measurement, regularizer, promotion rule.

Whole jobs on the default model are test_drift_jobs.py; the README's job on a
live server is test_drift_readme.py.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
from drift_jobs import TEST_FACTS, OneSlotEngine, chat
from drift_steps import forced_logits, run_steps

from dreamstage.adapters.served import ServedAdapters
from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.decoding import Decoder, FixedSequence, log_softmax, set_context_adapter
from dreamstage.training.drift.measure import Drift, DriftProbe
from dreamstage.training.drift.records import prompt_tokens
from dreamstage.training.drift.rehearsal import REHEARSAL_SAMPLES, anchor_visits
from dreamstage.training.jobs.promotion import promotion_decision
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.scheduler import DreamScheduler
from dreamstage.training.jobs.store import JobStore


@pytest.fixture(scope="module")
def small_probe(dream_resident):
    probe = DriftProbe(dream_resident, load_anchors()[:4], seq_id=0)
    run_steps(probe.record())
    return probe


def test_adapter_off_and_a_zero_adapter_measure_no_drift(dream_resident, small_probe):
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    off = run_steps(small_probe.measure(None))
    assert off.anchors_changed == 0 and off.drift_kl < 1e-6 and off.tokens > 0
    tr = Trainer(dream_resident, LoraConfig(rank=4, targets="attn_q,attn_v"), window=128, chunk=128)
    try:
        tr.promote()                               # B = 0: the adapter adds exactly nothing
        zero = run_steps(small_probe.measure(tr.served_adapter))
    finally:
        tr.close()
    assert zero.anchors_changed == 0 and zero.drift_kl == pytest.approx(off.drift_kl, abs=1e-9)


def test_a_reply_lead_is_above_zero_exactly_when_every_trained_token_is_the_greedy_choice(dream_resident):
    """drift.reply_lead_units, what the early stop and the hold read: the smallest lead of a
    trained token over the best other, checked against the same decode's logits row by row
    (a reply whose tokens are the argmax chain, one with a gap in its mask, one with a token
    that is not the argmax)."""
    from dreamstage.training.drift.measure import reply_lead_units
    prompt = list(prompt_tokens(dream_resident, "What is the capital of France?"))
    reply: list[int] = []
    for _ in range(6):          # the batched argmax chain: each token the argmax of the decode before it
        rows = forced_logits(dream_resident, 0, prompt + reply, len(prompt) + len(reply) - 1)
        reply.append(int(rows[-1].argmax()))
    tokens = prompt + reply
    rows = forced_logits(dream_resident, 0, tokens, len(prompt) - 1)

    def ref(mask):
        out = math.inf
        for t, m in enumerate(mask):
            if m:
                row = rows[t - len(prompt)].copy()
                own = row[tokens[t]]
                row[tokens[t]] = -np.inf
                out = min(out, own - row.max())
        return out
    full = [0] * len(prompt) + [1] * len(reply)
    gap = [0] * len(prompt) + [1, 1, 0, 0, 1, 1]
    for mask in (full, gap):
        lead = run_steps(reply_lead_units(dream_resident, 0, tokens, mask))
        assert lead == pytest.approx(ref(mask), abs=1e-4) and lead > 0
    # the third reply token swapped for the row's second choice: no longer the greedy reply
    second = int(np.argsort(rows[2])[-2])        # rows[2]: the logits that predict reply token 2
    wrong = tokens[:len(prompt) + 2] + [second] + tokens[len(prompt) + 3:]
    assert wrong != tokens
    lead = run_steps(reply_lead_units(dream_resident, 0, wrong, full))
    assert lead < 0
    with pytest.raises(ValueError, match="trained position"):
        run_steps(reply_lead_units(dream_resident, 0, tokens, [0] * len(tokens)))


def test_drift_matches_a_full_vocabulary_reference(dream_resident, small_probe):
    """KL from the top-K records against the exact KL over the whole vocabulary
    (both sides' full logits, NumPy), `changed` against the argmax directly, and the
    widest lead drop against the two sides' sorted rows."""
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    tr = Trainer(dream_resident, LoraConfig(rank=4, targets="attn_q,attn_v"), window=128, chunk=128)
    try:
        v = tr.lora_parameters()
        tr.set_lora_parameters(v + np.random.default_rng(1).normal(0.0, 0.02, v.shape))
        tr.promote()
        got = run_steps(small_probe.measure(tr.served_adapter))
        exact_kl, tokens, changed, drops = 0.0, 0, 0, []
        for b in small_probe.bases:
            rows = slice(len(b.prompt_tokens) - 1, None)
            set_context_adapter(dream_resident, None)
            lp = log_softmax(forced_logits(dream_resident, 0, b.forced, rows.start))[:len(b.answer)]
            set_context_adapter(dream_resident, tr.served_adapter)
            lq = log_softmax(forced_logits(dream_resident, 0, b.forced, rows.start))[:len(b.answer)]
            set_context_adapter(dream_resident, None)
            exact_kl += float((np.exp(lp) * (lp - lq)).sum())
            tokens += len(b.answer)
            changed += bool((lq.argmax(axis=1) != np.asarray(b.answer)).any())
            for i, a in enumerate(b.answer):       # the base token's lead over the best other, both sides
                base2, now = np.sort(lp[i])[-2:], np.delete(lq[i], a)
                drops.append((base2[1] - base2[0]) - (lq[i, a] - now.max()))
    finally:
        set_context_adapter(dream_resident, None)
        tr.close()
    assert got.tokens == tokens and got.changed == changed
    assert max(drops) > 0 and abs(got.widest_drop - max(drops)) < 1e-4
    exact = exact_kl / tokens
    assert exact > 1e-4, "the perturbation must move the distributions"
    # the coarsened KL is a lower bound, and the top 256 tokens carry nearly all the mass
    assert got.drift_kl <= exact * (1 + 1e-6) and got.drift_kl >= 0.9 * exact


def test_the_engine_lends_an_idle_slots_sequence_and_takes_it_back_for_a_request(dream_resident):
    from dreamstage.serving.engine import Engine
    engine = Engine(dream_resident)                    # not started: the test is the engine thread
    slot = engine.slots[0]
    slot.tokens[:] = [1, 2, 3]                         # a cached prefix the lent decode will overwrite
    lease = engine.hold_idle_sequence()
    assert lease.seq_id == slot.seq_id and lease.valid and slot.tokens == []
    assert engine.hold_idle_sequence() is lease        # one loan at a time, held across calls
    lease.release()
    assert not lease.valid and engine.hold_idle_sequence() is not lease
    engine.hold_idle_sequence().release()
    slot.job = object()                                # busy: its K/V are a request's
    try:
        assert engine.hold_idle_sequence() is None
    finally:
        slot.job = None
    # a waiting request takes the lent slot back (the only one), and the lease says so
    from dreamstage.serving.engine import GenerationRequest, RequestHandle
    from dreamstage.serving.slots import _Job
    others = engine.slots[1:]
    for s in others:
        s.job = object()
    try:
        lease = engine.hold_idle_sequence()
        events = []
        engine._waiting.append(_Job(RequestHandle(engine, 1), GenerationRequest(prompt=[1, 2, 3], max_tokens=1),
                                    events.append, time.perf_counter(), prompt=[1, 2, 3], max_tokens=1))
        engine._admit()
        assert not lease.valid and slot.busy and events and engine.hold_idle_sequence() is None
    finally:
        for s in engine.slots:
            s.job = None


def test_the_noise_margin_is_the_second_widest_lead_drop_of_null_adapters_and_the_shadow_is_put_back(
        dream_resident, small_probe):
    """null_margin: adapters that learned nothing (B ~ N(0, 1e-4^2)) flip the base's
    near ties; each one's widest drop of the base token's lead at any answer position
    is never below the widest lead one of its flips crossed, and the margin is the
    second widest of them (NULL_RANK), so measured again at that margin every null
    adapter but the widest changes nothing, while the raw count keeps their flips; a
    real perturbation still counts; the adapter off drops no lead; the shadow
    adapter is as before."""
    from dreamstage.training.drift.measure import NULL_RANK, NULL_SIGMA
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    tr = Trainer(dream_resident, LoraConfig(rank=8, targets="attn_q,attn_v"), window=128, chunk=128)
    try:
        before = tr.lora_parameters()
        probe = DriftProbe(dream_resident, small_probe.prompts, seq_id=0)
        run_steps(probe.record({b.prompt: b for b in small_probe.bases}))
        margin = run_steps(probe.null_margin(tr, draws=3, seed=5))
        assert np.array_equal(tr.lora_parameters(), before) and probe.noise_margin == margin >= 0.0
        is_b = np.concatenate([np.full(int(np.prod(s)), ab == "b") for (_, ab), s in
                               zip(tr.parameter_order(), tr.parameter_shapes(), strict=True)])
        nulls = []
        for d in range(3):                               # the same null adapters, by hand
            vec = before.copy()
            vec[is_b] = NULL_SIGMA * np.random.default_rng((5, d)).standard_normal(int(is_b.sum()))
            tr.set_lora_parameters(vec)
            tr.promote()
            null = run_steps(probe.measure(tr.served_adapter))
            nulls.append(null)
            for lead, f in zip(null.flip_leads, null.first_change, strict=True):
                assert (f is None) == (not lead) and all(x >= 0 for x in lead)
            assert null.widest_drop >= max((x for lead in null.flip_leads for x in lead), default=0.0)
        widest = sorted(n.widest_drop for n in nulls)
        assert probe.noise_draws == tuple(n.widest_drop for n in nulls)
        assert NULL_RANK == 2 and margin == widest[-2] > 0
        assert run_steps(probe.measure(None)).widest_drop < 1e-5
        assert all(n.noise_margin == margin and n.changed_raw == sum(map(bool, n.flip_leads)) for n in nulls)
        assert all(n.changed == 0 for n in nulls if n.widest_drop <= margin)       # every draw but the widest
        tr.set_lora_parameters(before + np.random.default_rng(1).normal(0.0, 0.3, before.shape))
        tr.promote()
        moved = run_steps(probe.measure(tr.served_adapter))
        assert moved.changed >= 1 and moved.changed <= moved.changed_raw
        assert moved.as_dict()["anchors_changed_raw_count"] == moved.changed_raw
    finally:
        tr.close()


def test_measured_anchors_decode_their_common_head_once_and_measure_as_if_decoded_whole(
        dream_resident, small_probe, monkeypatch):
    """Within one measure() an anchor does not decode again the whole pieces before its first
    measured row that it shares with the anchor before it (the chat template's system turn),
    and its figures are bit-identical to every anchor decoded whole: on an engine's lent
    sequence, which is empty once given back; after serving took the loan back mid-measure; and
    after another probe decoded on the same lent sequence between two anchors."""
    from dreamstage.serving.engine import Engine
    from dreamstage.training.drift.decoding import PIECE_TOKENS
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    bases = small_probe.bases
    heads = 0                                          # the pieces the anchors after the first can skip
    for prev, b in zip(bases, bases[1:], strict=False):
        keep = (len(prev.prompt_tokens) - 1) // PIECE_TOKENS * PIECE_TOKENS
        first = len(b.prompt_tokens) - 1
        same = next((i for i, (x, y) in enumerate(zip(prev.forced[:keep], b.forced[:first], strict=False))
                     if x != y), min(keep, first))
        heads += same // PIECE_TOKENS
    assert heads >= len(bases) - 1                     # the system turn fills a piece at least
    decodes = []
    real = Decoder._decode
    monkeypatch.setattr(Decoder, "_decode", lambda self, *a, **k: (decodes.append(self.seq_id), real(self, *a, **k)))
    tr = Trainer(dream_resident, LoraConfig(rank=8, targets="attn_q,attn_v"), window=128, chunk=128)
    try:
        v = tr.lora_parameters()
        tr.set_lora_parameters(v + np.random.default_rng(3).normal(0.0, 0.2, v.shape))
        tr.promote()

        def measured(probe):
            probe.bases = bases
            decodes.clear()
            return run_steps(probe.measure(tr.served_adapter)), len(decodes)

        whole, n_whole = measured(DriftProbe(dream_resident, small_probe.prompts, seq_id=0, share_head=False))
        assert whole.changed_raw >= 1 and whole.drift_kl > 0          # the adapter moved something
        engine = Engine(dream_resident)                # not started: the test is the engine thread
        shared, n_shared = measured(DriftProbe(dream_resident, small_probe.prompts, seq_id=engine.hold_idle_sequence))
        seq = decodes[-1]
        assert dream_resident.lc.llama_memory_seq_pos_max(dream_resident.memory, seq) == -1
        assert engine._lease is None                    # the loan was given back
        assert n_shared == n_whole - heads

        def same(a, b):
            assert a.drift_kl == b.drift_kl and a.first_change == b.first_change and a.flip_leads == b.flip_leads
            assert a.drops == b.drops and a.changed_raw == b.changed_raw
        same(shared, whole)
        # serving takes the loan back in the middle: the anchor starts again, whole
        leases = []

        def lend():
            leases.append(FixedSequence(0))
            return leases[-1]
        def after_step(gen, at: int, then):
            """Run `gen` to its end, calling `then()` after its step number `at`; its value."""
            steps = 0
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    return stop.value
                steps += 1
                if steps == at:
                    then()
        probe = DriftProbe(dream_resident, small_probe.prompts, seq_id=lend, step_ms=1e-6)
        probe.bases = bases
        taken = after_step(probe.measure(tr.served_adapter), 9, lambda: setattr(leases[-1], "valid", False))
        same(taken, whole)
        assert probe.restarts == 1 and len(leases) == 2
        # another probe of the same turn decodes on the sequence between two anchors
        turn: list = [None]
        a = DriftProbe(dream_resident, small_probe.prompts, seq_id=0, turn=turn, step_ms=None)
        other = DriftProbe(dream_resident, small_probe.prompts[:1], seq_id=0, turn=turn)
        a.bases, other.bases = bases, bases[:1]
        # step_ms None: a step is one whole anchor, so step 1 ends just after the first one (its head kept)
        interleaved = after_step(a.measure(tr.served_adapter), 1, lambda: run_steps(other.measure(None)))
        same(interleaved, whole)
    finally:
        tr.close()


def test_a_recording_runs_in_short_steps_and_restarts_an_anchor_serving_took_back(dream_resident):
    """Each step decodes at most a piece of PIECE_TOKENS (step_ms tiny: one unit a step);
    a lease that turns invalid mid-anchor makes the anchor start again, with the same record."""
    from dreamstage.training.drift.decoding import PIECE_TOKENS
    prompts = load_anchors()[:2]
    whole = DriftProbe(dream_resident, prompts, seq_id=0, step_ms=None)
    assert sum(1 for _ in whole.record()) == len(prompts)     # unbounded: one step per anchor

    leases, taken = [], {"at": 5}

    def lend():
        lease = FixedSequence(0)
        leases.append(lease)
        return lease

    probe = DriftProbe(dream_resident, prompts, seq_id=lend, step_ms=1e-6)
    gen, steps = probe.record(), 0
    while True:
        try:
            next(gen)
        except StopIteration:
            break
        steps += 1
        if steps == taken["at"]:
            leases[-1].valid = False                   # serving took the slot back mid-anchor
    assert probe.restarts == 1 and len(leases) == 2
    n_units = sum(-(-len(b.prompt_tokens) // PIECE_TOKENS) + len(b.continuation) - 1
                  + -(-len(b.forced) // PIECE_TOKENS) + 1 for b in whole.bases)
    assert steps >= n_units + len(prompts)             # one unit per step, plus each anchor's closing step
    for a, b in zip(whole.bases, probe.bases, strict=True):
        assert a.answer == b.answer and np.array_equal(a.top_logp, b.top_logp)


def test_anchor_schedule_rotates_through_every_anchor():
    def anchor_schedule(*args, **kw):
        return [a for a, _ in anchor_visits(*args, **kw)]
    n, jobs, ratio = 40, 5, 2.0
    per_epoch = [anchor_schedule(n, jobs, ratio, e, seed=3) for e in range(4)]
    assert all(len(p) == 10 and len(set(p)) == 10 for p in per_epoch)
    assert set().union(*per_epoch) == set(range(n))            # ceil(40 / 10) = 4 epochs cover them all
    assert anchor_schedule(n, jobs, 0.0, 0, 3) == [] and len(anchor_schedule(n, 100, 2.0, 0, 3)) == n


# -- sampled rehearsal ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampled_probe(dream_resident):
    probe = DriftProbe(dream_resident, rehearsal_anchors()[:2], seq_id=0, samples=3)
    run_steps(probe.record())
    return probe


def test_sampled_continuations_are_seeded_drawn_and_recorded_with_the_adapter_off(dream_resident, sampled_probe):
    """The same samples again (in one-unit steps, with serving's perturbed
    adapter put back after every step), the first ones of a longer record,
    not all the greedy answer, and equal with a zero adapter on the context;
    the perturbed adapter itself would have drawn others."""
    from dreamstage.training.drift.records import ANCHOR_TOKENS, record_units
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    prompts, bases = sampled_probe.prompts, sampled_probe.bases
    for b in bases:
        assert len(b.samples) == 3
        for s in b.samples:
            assert len(s) == ANCHOR_TOKENS or (len(s) < ANCHOR_TOKENS and dream_resident.is_eog(s[-1]))
    assert any(s != b.continuation for b in bases for s in b.samples)
    assert any(len(set(b.samples)) > 1 for b in bases)
    tr = Trainer(dream_resident, LoraConfig(rank=4, targets="attn_q,attn_v"), window=128, chunk=128)
    try:
        v = tr.lora_parameters()
        tr.set_lora_parameters(v + np.random.default_rng(2).normal(0.0, 0.3, v.shape))
        tr.promote()
        again = DriftProbe(dream_resident, prompts, seq_id=0, samples=4, step_ms=1e-6,
                           restore=lambda: set_context_adapter(dream_resident, tr.served_adapter))
        run_steps(again.record())
        set_context_adapter(dream_resident, tr.served_adapter)
        moved = run_steps(record_units(dream_resident, 0, prompts[0], bases[0].prompt_tokens, samples=3))
        tr.set_lora_parameters(v)                      # B = 0: the adapter adds exactly nothing
        tr.promote()
        set_context_adapter(dream_resident, tr.served_adapter)
        zero = run_steps(record_units(dream_resident, 0, prompts[0], bases[0].prompt_tokens, samples=3))
    finally:
        set_context_adapter(dream_resident, None)
        tr.close()
    assert [b.samples[:3] for b in again.bases] == [b.samples for b in bases] and len(again.bases[0].samples) == 4
    assert zero.samples == bases[0].samples
    assert moved.samples != bases[0].samples


def test_each_sample_keeps_the_distributions_it_was_drawn_from(dream_resident, sampled_probe):
    """A sample's recorded rows are the base's next-token distributions along
    it, as the sampling decode saw them: decoding the same tokens the same way
    (the prompt in pieces, then one token a unit) gives them bit for bit; and
    the soft targets made of them are those rows renormalized over their ids."""
    from dreamstage.training.drift.decoding import TOP_K, top_k
    from dreamstage.training.drift.records import ANCHOR_TOKENS
    from dreamstage.training.drift.rehearsal import soft_targets
    base = sampled_probe.bases[0]
    assert len(base.sample_top) == len(base.samples) == 3
    for s, (ids, logp) in zip(base.samples, base.sample_top, strict=True):
        assert ids.shape == logp.shape == (len(s), TOP_K) and ids.dtype == np.int32
    sample = base.samples[1]
    dec = Decoder(dream_resident, 0)
    rows: list[np.ndarray] = []
    feed = iter(sample)

    def pick(logits):
        rows.append(logits)
        return next(feed)
    try:
        dec.clear()
        first = run_steps(dec._prompt_units(base.prompt_tokens))
        again = run_steps(dec._answer_units(first, len(base.prompt_tokens), ANCHOR_TOKENS, pick))
    finally:
        dec.clear()
        dec.close()
    # sample 1 was drawn after sample 0 from the same prompt row; the rows after the first are
    # one-token decodes on the same prefix either way
    assert tuple(again) == sample
    ids, logp = top_k(log_softmax(np.stack(rows)))
    want_ids, want_logp = base.sample_top[1]
    order = np.argsort(ids, axis=1)
    assert np.array_equal(np.take_along_axis(ids, order, 1), np.sort(want_ids, axis=1))
    assert np.array_equal(np.take_along_axis(logp.astype(np.float32), order, 1),
                          np.take_along_axis(want_logp, np.argsort(want_ids, axis=1), 1))
    soft_ids, probs = soft_targets(want_ids, want_logp)
    assert np.array_equal(soft_ids, want_ids)
    # the recorded probabilities themselves: the mass outside the top K is the rest, not spread over them
    assert np.all(probs.sum(axis=1) <= 1.0 + 1e-6) and np.all(probs.sum(axis=1) > 0.5)
    np.testing.assert_allclose(probs, np.exp(want_logp), rtol=1e-5)


def test_rehearsal_modes_make_the_windows_they_name(dream_resident):
    """"samples": the sampled replies, one-hot; "soft": the greedy answer against the
    recorded rows; "soft-samples": each sample against the rows it was drawn from.
    Another mode is refused by name."""
    from dreamstage.training.drift.records import AnchorBase
    from dreamstage.training.drift.rehearsal import distillation_windows, soft_targets
    toks = prompt_tokens(dream_resident, rehearsal_anchors()[0])
    rng = np.random.default_rng(4)

    def rows(n):
        return rng.permutation(100)[:3 * n].reshape(n, 3).astype(np.int32), np.log(
            rng.dirichlet(np.ones(3), size=n)).astype(np.float32)
    top = rows(3)
    tops = (rows(2), rows(4))
    base = AnchorBase("p", toks, (7, 8, 9), (*toks, 7, 8), (7, 8, 9), top[0], top[1], np.full(3, -np.inf),
                      samples=((11, 12), (13, 14, 15, 16)), sample_top=tops)
    hard = distillation_windows(base, -1, "a", "samples")
    assert [w.tokens[len(toks):] for w in hard] == [(11, 12), (13, 14, 15, 16)] and all(w.soft is None for w in hard)
    (soft,) = distillation_windows(base, -1, "a", "soft")
    assert soft.tokens == toks + (7, 8, 9) and soft.n_targets == 3
    assert np.array_equal(soft.soft[0], top[0]) and np.array_equal(soft.soft[1], soft_targets(*top)[1])
    both = distillation_windows(base, -1, "a", "soft-samples")
    assert [w.tokens[len(toks):] for w in both] == [(11, 12), (13, 14, 15, 16)]
    for w, t in zip(both, tops, strict=True):
        assert np.array_equal(w.soft[0], t[0]) and np.array_equal(w.soft[1], soft_targets(*t)[1])
    with pytest.raises(ValueError, match="rehearsal mode 'kl' is not one of soft, samples, soft-samples"):
        distillation_windows(base, -1, "a", "kl")


def test_an_epochs_rehearsal_windows_train_each_anchors_samples_in_turn(dream_resident):
    """With `rehearsal: "samples"` the guard's rehearsal windows are the samples
    (never the greedy answer); each visit of an anchor trains its next sample, so
    a rotation of 2 x S epochs at half the anchors an epoch trains every sample
    once. By default ("soft") each anchor has one window: its greedy answer
    against the recorded distributions."""
    from dreamstage.training.drift.guard import DriftGuard
    from dreamstage.training.drift.records import AnchorBase
    from dreamstage.training.walk.examples import render_job
    S = REHEARSAL_SAMPLES

    def fake(k, prompt):                               # a record with marked samples: no decode needed
        toks = prompt_tokens(dream_resident, prompt)
        z = np.zeros((2, 1))
        return AnchorBase(prompt, toks, (7, 8), (*toks, 7), (7, 8), z.astype(np.int32), z.astype(np.float32),
                          z[:, 0], samples=tuple((1000 + k, 2000 + j) for j in range(S)))

    cache = {p: fake(k, p) for k, p in enumerate(load_anchors() + rehearsal_anchors())}
    n = len(rehearsal_anchors())
    for ratio in (8.0, 2.0):
        per_epoch = min(n, math.ceil(ratio * len(TEST_FACTS)))   # anchors an epoch
        rounds = math.ceil(n / per_epoch)                          # epochs that visit every anchor once
        assert n % per_epoch == 0, "the shipped set is a whole number of rotations at these ratios"
        epochs = rounds * S
        spec = parse_train_request({"examples": chat(TEST_FACTS), "anchor_ratio": ratio, "neighbours": 0,
                                    "rehearsal": "samples"}).to_job_spec()
        train = list(render_job(spec, dream_resident).train)
        guard = DriftGuard(dream_resident, spec, train, seq_id=0, restore=lambda: None, cache=cache)
        run_steps(guard.record())
        trained: dict[str, list[int]] = {}
        for epoch in range(epochs):
            picked = [guard.windows[i] for i in guard.order(epoch) if i >= len(train)]
            assert len(picked) == per_epoch
            for w in picked:
                base = cache[rehearsal_anchors()[-1 - w.source]]
                reply = w.tokens[len(base.prompt_tokens):]
                assert w.tokens[:len(base.prompt_tokens)] == base.prompt_tokens and reply in base.samples
                assert all(w.mask[len(base.prompt_tokens):]) and not any(w.mask[:len(base.prompt_tokens)])
                trained.setdefault(base.prompt, []).append(base.samples.index(reply))
        assert len(trained) == n and all(v == list(range(S)) for v in trained.values()), trained
    spec = parse_train_request({"examples": chat(TEST_FACTS), "neighbours": 0}).to_job_spec()
    train = list(render_job(spec, dream_resident).train)
    guard = DriftGuard(dream_resident, spec, train, seq_id=0, restore=lambda: None, cache=cache)
    run_steps(guard.record())
    soft = guard.windows[len(train):]
    assert len(soft) == n and all(w.soft is not None for w in soft)
    for w in soft:
        base = cache[rehearsal_anchors()[-1 - w.source]]
        assert w.tokens == base.prompt_tokens + base.answer and np.array_equal(w.soft[0], base.top_ids)
    # the rehearsal-only epochs after the job's own: every anchor's window once, no job window
    assert guard.consolidates() and spec.consolidate > 0
    firsts = [guard.consolidation_order(k) for k in range(3)]
    for order in firsts:
        assert sorted(order) == list(range(len(train), len(train) + n))
    assert firsts[0] != firsts[1] != firsts[2]
    off = parse_train_request({"examples": chat(TEST_FACTS), "regularizer": False}).to_job_spec()
    none = parse_train_request({"examples": chat(TEST_FACTS), "consolidate": 0, "neighbours": 0}).to_job_spec()
    for s in (off, none):
        g = DriftGuard(dream_resident, s, train, seq_id=0, restore=lambda: None, cache=cache)
        run_steps(g.record())
        assert not g.consolidates()


def test_measured_anchors_are_never_rehearsed():
    measured, rehearsed = load_anchors(["Why is grass green?"]), rehearsal_anchors()
    assert len(rehearsed) >= 20 and len(measured) == 21 and not set(measured) & set(rehearsed)
    assert measured[-1] == "Why is grass green?"


def test_guard_fields_are_validated_by_name():
    from pydantic import ValidationError
    for body, field in [({"max_drift": 1.5}, "max_drift"), ({"max_drift_kl": 0}, "max_drift_kl"),
                        ({"max_drift_kl": "lots"}, "max_drift_kl"), ({"anchor_ratio": 0}, "anchor_ratio"),
                        ({"anchors": [" "]}, "anchors"), ({"anchors": ["x" * 1001]}, "anchors"),
                        ({"anchors": [rehearsal_anchors()[3]]}, "anchors"),
                        ({"stop_loss": -1}, "stop_loss"), ({"regularizer": "yes"}, "regularizer"),
                        ({"rehearsal": "kl"}, "rehearsal"), ({"rehearsal": 1}, "rehearsal"),
                        ({"consolidate": -1}, "consolidate"), ({"consolidate": 65}, "consolidate"),
                        ({"consolidate": "some"}, "consolidate"), ({"consolidate_decay": "yes"}, "consolidate_decay"),
                        ({"consolidate_decay": 1}, "consolidate_decay")]:
        with pytest.raises(ValidationError) as e:
            parse_train_request({"text": "x", **body})
        assert e.value.errors()[0]["loc"][0] == field
    spec = parse_train_request({"text": "x", "anchors": ["Why is grass green?"]}).to_job_spec()
    assert spec.anchors == ("Why is grass green?",) and spec.regularizer
    # the measured defaults: drift_kl bounded, the changed-answer fraction not (it saturates on this model)
    assert spec.max_drift_kl == 1.0 and spec.max_drift == 1.0
    assert parse_train_request({"text": "x", "max_drift_kl": None}).to_job_spec().max_drift_kl is None
    # the rehearsal-only epochs' step decays by default and a job can turn it off; a job stored
    # before the field existed took the full step, whatever it says now
    from dreamstage.training.jobs.stored import from_stored, to_stored
    full = parse_train_request({"text": "x", "consolidate_decay": False}).to_job_spec()
    assert spec.consolidate_decay and not full.consolidate_decay
    assert from_stored(to_stored(spec), 6).consolidate_decay
    assert not from_stored(to_stored(full), 6).consolidate_decay
    assert not from_stored(to_stored(spec), 5).consolidate_decay


def test_promotion_rule_needs_held_out_and_drift():
    def d(changed):
        return Drift(drift_kl=0.01, anchors_changed=changed / 40, changed=changed, anchors=40, tokens=900)
    assert promotion_decision(None, None, d(2), 0.05)[0]                 # 2/40 = 0.05: within
    ok, why = promotion_decision(None, None, d(3), 0.05)
    assert not ok and "anchors_changed 0.075 (3/40)" in why and "exceeds max_drift 0.05" in why
    ok, why = promotion_decision(1.0, 1.2, d(0), 0.05)
    assert not ok and "held-out loss 1.2000 is worse than 1.0000" in why
    assert promotion_decision(1.0, 0.9, d(0), 0.05)[0]
    ok, why = promotion_decision(None, None, None, 0.05, failure="the probe failed")
    assert not ok and "drift not measured (the probe failed)" in why
    far = Drift(drift_kl=2.5, anchors_changed=1.0, changed=40, anchors=40, tokens=900)
    ok, why = promotion_decision(None, None, far, 1.0, 2.0)
    assert not ok and "drift_kl 2.5000" in why and "exceeds max_drift_kl 2" in why
    near = Drift(drift_kl=0.4, anchors_changed=1.0, changed=40, anchors=40, tokens=900)
    ok, why = promotion_decision(None, None, near, 1.0, 2.0)
    assert ok and "within max_drift 1, max_drift_kl 2" in why
    assert promotion_decision(None, None, far, 1.0, None)[0]              # drift_kl not bounded


def test_the_noise_margin_is_the_second_widest_null_drop_so_one_draw_far_out_does_not_set_it():
    from dreamstage.training.drift.measure import NULL_RANK, noise_margin_of

    def nulls(*widest):
        return [Drift(drift_kl=0.0, anchors_changed=0.0, changed=0, anchors=1, tokens=3, drops=((w, w / 2),))
                for w in widest]
    assert NULL_RANK == 2
    assert noise_margin_of(nulls(0.5, 1.14, 0.72, 0.61)) == 0.72
    assert noise_margin_of(nulls(0.5, 0.8, 0.8)) == 0.8
    assert noise_margin_of(nulls(0.55)) == 0.55 and noise_margin_of([]) == 0.0
    assert noise_margin_of(nulls(0.5, 1.14, 0.72), rank=1) == 1.14


def test_changed_anchors_name_every_change_widest_first_and_which_count():
    d = Drift(drift_kl=0.02, anchors_changed=1 / 4, changed=1, anchors=4, tokens=90,
              first_change=(None, 3, 17, 0), flip_leads=((), (0.2, 0.4), (0.75,), (0.05,)),
              prompts=("a?", "b?", "c?", "d?"), noise_margin=0.6, noise_draws=(0.5, 0.6))
    figures = d.as_dict()
    assert figures["changed_anchors"] == [
        {"anchor": "c?", "lead": 0.75, "first": 17, "beyond": True},
        {"anchor": "b?", "lead": 0.4, "first": 3, "beyond": False},
        {"anchor": "d?", "lead": 0.05, "first": 0, "beyond": False}]
    assert figures["noise_draws"] == [0.5, 0.6]
    raw = Drift(drift_kl=0.02, anchors_changed=0.5, changed=1, anchors=2, tokens=9, first_change=(None, 2),
                flip_leads=((), (0.1,)), prompts=("a?", "b?"))
    assert raw.as_dict()["changed_anchors"] == [{"anchor": "b?", "lead": 0.1, "first": 2, "beyond": True}]
    assert raw.as_dict()["noise_draws"] == []      # no margin measured: every change counts



def test_the_warm_up_waits_for_a_second_of_quiet_and_stops_for_a_job(dream_resident, tmp_path):
    now = [100.0]
    store = JobStore(tmp_path / "state")
    sched = DreamScheduler(store, dream_resident, served=ServedAdapters(dream_resident), drift_guard=True,
                           clock=lambda: now[0])
    engine = OneSlotEngine()
    try:
        sched.after_batch(engine, False)               # a request was just served
        now[0] += 0.5
        sched.after_batch(engine, True)
        assert sched._warmup is None and engine.lent == 0   # a gap between requests: not the warm-up's
        now[0] += 0.6
        sched.after_batch(engine, True)                # a second of quiet: it starts
        assert sched._warmup is not None and sched._warmup.steps == 1 and engine.lent == 1
        job = store.submit(parse_train_request({"text": "x", "promote": "never"}))
        sched.notify_submitted(job["id"])
        engine.queue_depth = 1                         # a request waits: the job is picked, not stepped
        sched.after_batch(engine, True)                # the job starts; the warm-up gives its sequence back
        assert sched._job_id == job["id"] and sched._warmup._gen is None
    finally:
        sched.close()
        store.close()


def test_a_short_job_window_gets_a_trainer_window_that_holds_every_rehearsal_anchor(dream_resident, tmp_path):
    """The README's window 32 holds no rehearsal prompt (34 to 43 tokens on the default
    model), so before the trainer's window was widened such a job trained no anchor at all.
    The scheduler now runs its trainer, walk and guard with room for the longest rehearsal
    anchor (a chunk of the whole window grows with it; a smaller one stays), the job's own
    windows stay cut at 32, and the guard built so rehearses every anchor; when the memory
    gate refuses the longer window, the job's own is used."""
    import dataclasses

    from dreamstage.training.drift.guard import DriftGuard
    from dreamstage.training.drift.records import ANCHOR_TOKENS
    from dreamstage.training.drift.rehearsal import rehearsal_window

    spec = parse_train_request({"text": "x", "window": 32}).to_job_spec()
    longest = max(len(prompt_tokens(dream_resident, p)) for p in rehearsal_anchors())
    wide = longest + ANCHOR_TOKENS
    assert longest + 4 > 32 and spec.chunk == 32         # no prompt leaves a reply room in 32 tokens
    assert rehearsal_window(dream_resident, spec) == wide
    assert rehearsal_window(dream_resident, parse_train_request({"text": "x"}).to_job_spec()) == 512
    off = parse_train_request({"text": "x", "window": 32, "regularizer": False}).to_job_spec()
    assert rehearsal_window(dream_resident, off) == 32

    asked: list[tuple[int, int]] = []

    def make(resident, s, chunk, lr=None, refuse_above=None):
        asked.append((s.window, chunk))
        if refuse_above is not None and s.window > refuse_above:
            raise RuntimeError("refused: need above the allowance")
        return "trainer"

    sched = DreamScheduler(JobStore(tmp_path / "state"), dream_resident, drift_guard=True, make_trainer=make)
    engine = OneSlotEngine()                           # an engine that lends the probe a sequence
    trainer, walked = sched._job_trainer(spec, engine)
    assert trainer == "trainer" and (walked.window, walked.chunk) == asked[-1] == (wide, wide)
    assert walked.epochs == spec.epochs and walked.min_chunk == spec.min_chunk    # nothing else moves
    small = parse_train_request({"text": "x", "window": 32, "chunk": 16}).to_job_spec()
    assert (sched._job_trainer(small, engine)[1].window, asked[-1]) == (wide, (wide, 16))  # a chosen chunk stays
    sched.make_trainer = lambda r, s, c, lr=None: make(r, s, c, lr, refuse_above=32)
    asked.clear()
    assert sched._job_trainer(spec, engine)[1] is spec and asked == [(wide, wide), (32, 32)]
    assert sched._job_trainer(spec, object())[1] is spec          # no sequence to lend: no guard, no room
    assert DreamScheduler(JobStore(tmp_path / "s2"), dream_resident, drift_guard=False,
                          make_trainer=make)._job_trainer(spec, engine)[1] is spec

    # the guard with that spec records (and so trains) every rehearsal anchor; with the job's, none
    guard = DriftGuard(dream_resident, walked, [], seq_id=0, restore=lambda: None)
    assert guard.rehearsal is not None and guard.rehearsal.prompts == rehearsal_anchors()
    assert DriftGuard(dream_resident, spec, [], seq_id=0, restore=lambda: None).rehearsal is None
    assert dataclasses.replace(walked, window=32, chunk=32) == spec


def test_a_rehearsal_only_epoch_is_kept_only_while_the_examples_still_pass_the_jobs_own_test():
    """ExampleHold: each checked window's loss must stay within 1 + HOLD_SLACK times
    max(stop_loss, the loss it ended training with); groups are not checked, and at most
    EXAMPLES_HELD windows, evenly spaced, are."""
    from dreamstage.training.drift.stopping import EXAMPLES_HELD, HOLD_SLACK, ExampleHold

    f = 1.0 + HOLD_SLACK
    hold = ExampleHold({0: 0.05, 1: 0.4, 2: 0.02}, 0.1, [0, 1, 2], snapshot="before")
    assert hold.windows == [0, 1, 2] and hold.bounds == pytest.approx([0.1 * f, 0.4 * f, 0.1 * f])
    assert hold.check([0.1 * f - 1e-6, 0.4 * f, 0.0]) is None and hold.kept == 1
    why = hold.check([0.05, 0.39, 0.1 * f + 0.01])
    assert why == f"example window 2's loss rose to {0.1 * f + 0.01:.4f}, above {0.1 * f:.4f}" and hold.kept == 1
    assert "window 1's loss rose to" in hold.check([0.0, 0.4 * f + 0.01, 0.0])
    assert hold.check(None) == "the examples' loss could not be measured" and hold.snapshot == "before"
    # stop_loss null: from where each ended, but never below HOLD_FLOOR's bound
    from dreamstage.training.drift.stopping import HOLD_FLOOR
    loose = ExampleHold({0: 0.3, 1: 0.02}, None, [0, 1], snapshot=None)
    assert loose.bounds == pytest.approx([0.3 * f, HOLD_FLOOR * f]) and loose.check([0.3 * f, 0.2]) is None
    assert loose.check([0.3 * f + 0.01, 0.0]) is not None and loose.check([0.0, HOLD_FLOOR * f + 0.01])
    assert ExampleHold({0: 0.1, 1: 0.1}, 0.1, [1], snapshot=None).windows == [1]   # window 0: a group
    many = ExampleHold({i: 0.01 for i in range(500)}, 0.1, range(500), snapshot=None)
    assert len(many.windows) <= EXAMPLES_HELD and many.windows[0] == 0 and many.windows[-1] >= 440
    # the greedy replies: a window answered when the epochs began (lead > 0) must still be
    from dreamstage.training.drift.stopping import held_windows, reply_lost
    assert held_windows({0: 0.1, 2: 0.1, 3: 0.2}, [0, 1, 2]) == [0, 2] and many.windows == held_windows(
        {i: 0.01 for i in range(500)}, range(500))
    assert reply_lost([4, 7], [0.5, -0.1], [0.2, -0.3]) is None           # window 7 was never answered
    assert reply_lost([4, 7], [0.5, 0.2], [0.5, 0.0]) == (
        "example window 7's greedy reply changed (its smallest lead fell from 0.200 to 0.000)")
    assert reply_lost([4], [0.5], None) is None and reply_lost([4], None, [-1.0]) is None
