"""Jobs on the default model with the drift guard on, in one scheduler in this
process: it records the anchors and measures the default adapter shape's
noise margin (the warm-up), then runs a damaging job, and a small job's
rehearsal-only epochs kept and undone. The base's records and margin are
handed over to tests/test_drift_readme.py as soon as the warm-up has saved
them: that module runs the README's job on a live server restarted on them,
on another worker meanwhile.
"""


import numpy as np
import pytest
from drift_jobs import (
    TEST_FACTS,
    TEST_REHEARSED,
    OneSlotEngine,
    assert_drift_figures,
    chat,
    cut_rehearsal,
    hand_over_base,
    record_anchors_while_idle,
    run_job,
)
from drift_steps import run_steps

from dreamstage.adapters.served import ServedAdapters
from dreamstage.server.metrics import ServiceCollector
from dreamstage.training.drift.anchors import load_anchors
from dreamstage.training.drift.measure import DriftProbe
from dreamstage.training.drift.record_file import FILE_NAME, DriftRecordFile
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.scheduler import DreamScheduler
from dreamstage.training.jobs.spec import DEFAULT_LR
from dreamstage.training.jobs.store import JobStore


@pytest.fixture(scope="module")
def jobs(dream_resident, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:           # for every test of the module
        cut_rehearsal(mp)
        yield from _jobs(dream_resident, tmp_path_factory)


def _jobs(dream_resident, tmp_path_factory):
    store = JobStore(tmp_path_factory.mktemp("drift-state"))
    served = ServedAdapters(dream_resident)
    sched = DreamScheduler(store, dream_resident, served=served, drift_guard=True, idle_grace_s=0.0,
                           record_file=DriftRecordFile(store.state_dir, dream_resident))
    engine = OneSlotEngine()
    sched.startup(engine)
    out: dict = {"saves": []}
    handed = False
    save = sched._save_records

    def saving():                                      # what each save of the record file held
        out["saves"].append((len(sched._anchor_records), len(sched._noise_margins)))
        save()
    sched._save_records = saving
    try:
        out["warmup_steps"] = record_anchors_while_idle(sched, engine)
        out["records"] = dict(sched._anchor_records)
        out["noise_margins"] = dict(sched._noise_margins)      # the warm-up's, of the default adapter shape
        sched._record_file.wait()                      # the warm-up's records and margin are in the file
        out["handed"] = DriftRecordFile(store.state_dir, dream_resident).load()   # what the readme module gets
        hand_over_base(tmp_path_factory, store.state_dir / FILE_NAME)
        handed = True
        out["served_before_damage"] = store.served_version()
        wrong = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                              {"role": "assistant", "content": "The capital of France is Quenmarsh."}]}
        out["damage"] = run_job(sched, store, engine, {"examples": [wrong] * 6, "lr": 1e-2, "epochs": 2,
                                                       "stop_loss": None, "regularizer": False, "promote": "auto",
                                                       "out": "damage", "max_pause_ms": 0})
        out["margins_after_damage"] = dict(sched._noise_margins)
        out["receipts"] = {"damage": store.receipts(out["damage"]["id"])}
        drift_series = ("dreamstage_dream_drift_kl", "dreamstage_dream_anchors_changed",
                        "dreamstage_dream_drift_anchors")
        out["metrics"] = {m.name: (m.samples[0].labels, m.samples[0].value) for m in ServiceCollector._dream(sched)
                          if m.name in drift_series}
        out["served_version"] = store.served_version()
        out["adapters"] = store.adapters()
        # the examples' hold through the rehearsal-only epochs (ExampleHold): the same small job
        # without them, and with one that the hold must undo (a bound below any loss)
        import dreamstage.training.drift.stopping as stopping_module
        # (with the base's own neighbours of its prompt, rehearsed in its own epochs only: test_neighbours.py)
        small = {"examples": chat(TEST_FACTS[:1]), "epochs": 2, "stop_loss": None, "anchor_ratio": 1, "seed": 3,
                 "neighbours": 2, "promote": "never", "max_pause_ms": 0}
        out["hold_none"] = run_job(sched, store, engine, {**small, "consolidate": 0, "out": "hold-none"})
        saved_slack = stopping_module.HOLD_SLACK
        stopping_module.HOLD_SLACK = -1.0
        # ... and the lr each of its rehearsal-only windows was given (consolidate_decay on)
        from dreamstage.training.walk.trainer import Trainer
        saved_set_lr, out["consolidation_lrs"] = Trainer.set_lr, []

        def set_lr(trainer, lr):
            out["consolidation_lrs"].append(lr)
            saved_set_lr(trainer, lr)
        Trainer.set_lr = set_lr
        try:
            out["hold_undone"] = run_job(sched, store, engine, {**small, "consolidate": 1, "consolidate_decay": True,
                                                                "out": "hold-undone"})
        finally:
            stopping_module.HOLD_SLACK = saved_slack
            Trainer.set_lr = saved_set_lr
        out["receipts"].update({k: store.receipts(out[k]["id"]) for k in ("hold_none", "hold_undone")})
        yield out
    finally:
        if not handed:
            hand_over_base(tmp_path_factory, None)     # the readme module makes its own
        served.apply(None, None)                       # the session's resident serves the base again
        sched.close()
        store.close()


def test_the_anchors_are_recorded_while_idle_before_any_job_in_short_steps(jobs):
    records = jobs["records"]
    assert set(records) == set(load_anchors()) | set(TEST_REHEARSED)
    # each anchor took several steps (pieces and tokens within half of the default 250 ms pause)
    assert jobs["warmup_steps"] > len(records)
    assert all(len(b.answer) >= 1 and b.top_logp.shape[0] == len(b.answer) for b in records.values())
    # the rehearsal anchors as the default rehearsal ("soft") trains them: their greedy answers and
    # distributions, no samples, so a job records nothing again
    assert all(not records[p].samples and records[p].top_ids.shape[0] == len(records[p].answer)
               for p in TEST_REHEARSED)
    assert not any(records[p].samples for p in load_anchors())


def test_the_warm_up_measures_the_default_shapes_noise_margin_and_hands_it_over_with_the_records(jobs):
    """Idle, before any job: every anchor recorded and the noise margin of the default adapter
    shape measured (its 19 null draws), which the first job then measures at instead of drawing
    them inside its pacing; test_drift_readme.py restarts a server on both."""
    from dreamstage.training.jobs.request import parse_train_request as parse
    ((key, (margin, draws)),) = jobs["noise_margins"].items()
    lora = parse({"text": "x"}).to_job_spec().lora_fields()
    assert key == (tuple(load_anchors()), lora["rank"], lora["alpha"], lora["targets"], lora["top_layers"])
    assert jobs["margins_after_damage"] == jobs["noise_margins"]     # the damaging job drew none of its own
    # the records were saved as soon as they were made, before the draws' minutes; then with the margin
    assert jobs["saves"][:2] == [(len(jobs["records"]), 0), (len(jobs["records"]), 1)]
    records, margins = jobs["handed"]
    assert set(records) == set(jobs["records"])
    assert all(np.array_equal(records[p].top_logp, b.top_logp) for p, b in jobs["records"].items())
    assert [(m, tuple(d)) for m, d in margins.values()] == [(margin, tuple(draws))]


def test_a_window_too_short_for_every_rehearsal_anchor_records_none_and_says_so(dream_resident, jobs):
    from dreamstage.training.drift.guard import DriftGuard
    cache = dict(jobs["records"])                      # the measured anchors are recorded already
    short = DriftGuard(dream_resident, parse_train_request({"text": "x", "window": 32}).to_job_spec(), [],
                       seq_id=0, restore=lambda: None, cache=cache)
    assert short.rehearsal is None                     # no prompt leaves room for a reply: nothing recorded
    run_steps(short.record())
    note = short.rehearsal_note()
    assert note.startswith(f"no rehearsal: none of the {len(TEST_REHEARSED)} rehearsal anchors fits window 32 "
                           "(their prompts alone take ")
    assert len(short.order(0)) - short.n_train == 0    # no anchor window in an epoch
    full = DriftGuard(dream_resident, parse_train_request({"text": "x"}).to_job_spec(), [], seq_id=0,
                      restore=lambda: None, cache=cache)
    run_steps(full.record())
    assert full.rehearsal_note() is None and len(full._anchor_pos) == len(TEST_REHEARSED)


def test_a_rehearsal_only_epoch_the_examples_do_not_survive_is_undone(jobs):
    """With the hold's bound below any loss, the job's one rehearsal-only epoch runs and is
    undone: the message says so, and the saved adapter is the one the same job saves without
    that epoch, tensor for tensor (one thread, no pacing: the runs are deterministic)."""
    import gguf

    none, undone = jobs["hold_none"], jobs["hold_undone"]
    assert none["state"] == undone["state"] == "done", (none["message"], undone["message"])
    assert ("then 0 of 1 rehearsal-only epochs (consolidate): after the next one example window 0's loss rose to "
            in undone["message"] and "so the adapter is the one before it" in undone["message"]), undone["message"]
    # both rehearsed the same neighbours of the fact's question in their own epochs, and say so
    import re
    said = [re.search(r"rehearsed (\d) neighbours of its prompts each epoch", j["message"]) for j in (none, undone)]
    assert all(said) and said[0].group(1) == said[1].group(1) in ("1", "2"), (none["message"], undone["message"])
    steps = {k: sum(1 for r in jobs["receipts"][k] if r.get("kind") != "drift" and r["tokens"])
             for k in ("hold_none", "hold_undone")}
    least = len(TEST_REHEARSED) // 2                   # rehearsal anchors whose window fits, at the least
    assert steps["hold_undone"] >= steps["hold_none"] + least     # the rehearsal-only epoch did train
    # each of its windows at its share of a step falling linearly to 0 (consolidate_decay, asked): the
    # job's lr x (1 - (k + 1/2) / n), one call a window, before the window's update
    lrs, n = jobs["consolidation_lrs"], len(jobs["consolidation_lrs"])
    assert least <= n <= steps["hold_undone"] - steps["hold_none"], (n, steps)   # a window is one step or more
    assert lrs == pytest.approx([DEFAULT_LR * (1 - (k + 0.5) / n) for k in range(n)], rel=1e-9)
    tensors = [{t.name: np.array(t.data) for t in gguf.GGUFReader(j["adapter"]["path"]).tensors}
               for j in (none, undone)]
    assert tensors[0].keys() == tensors[1].keys() and len(tensors[0]) > 0
    assert all(np.array_equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    assert any(np.abs(v).max() > 0 for k, v in tensors[0].items() if "lora_b" in k)   # it did learn


def test_anchors_changed_counts_beyond_the_noise_margin_a_null_adapter_stays_within_it(dream_resident, jobs):
    """The jobs measured their held-out anchors at the noise margin the warm-up
    measured (once for the process, cached by anchors and adapter shape); the raw
    count of every change is reported beside it. A null adapter drawn apart from the
    margin's own draws changes at most 1 of the 20 anchors beyond the margin,
    though it changes many at all (the floor under the raw count)."""
    from dreamstage.training.drift.measure import NULL_DRAWS, NULL_RANK, NULL_SIGMA
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    ((margin, draws),) = jobs["noise_margins"].values()
    assert len(draws) == NULL_DRAWS and margin == sorted(draws)[-NULL_RANK] < max(draws) + 1e-12
    assert_drift_figures(jobs["damage"], margin, draws)        # and the README's jobs: test_drift_readme.py
    probe = DriftProbe(dream_resident, load_anchors(), seq_id=0)
    run_steps(probe.record(dict(jobs["records"])))
    probe.noise_margin = margin
    tr = Trainer(dream_resident, LoraConfig(rank=8, targets="attn_q,attn_v"), window=128, chunk=128)
    try:
        v = tr.lora_parameters()
        is_b = np.concatenate([np.full(int(np.prod(s)), ab == "b") for (_, ab), s in
                               zip(tr.parameter_order(), tr.parameter_shapes(), strict=True)])
        v[is_b] = NULL_SIGMA * np.random.default_rng(2024).standard_normal(int(is_b.sum()))
        tr.set_lora_parameters(v)
        tr.promote()
        null = run_steps(probe.measure(tr.served_adapter))
    finally:
        tr.close()
    print(f"\nnoise margin {margin:.3f}; a fresh null adapter: {null.changed}/20 beyond it, "
          f"{null.changed_raw}/20 at all, drift_kl {null.drift_kl:.4f}")
    assert null.changed <= 1 and null.drift_kl < 0.05


def test_a_damaging_job_is_saved_but_not_promoted_and_says_why(jobs):
    job = jobs["damage"]
    drift = job["progress"]["drift"]
    print(f"\ndamaging job: {job['message']}")
    assert job["state"] == "done" and job["adapter"] is not None and not job["adapter"]["promoted"]
    assert drift["anchors_changed"] > drift["max_drift"] or drift["drift_kl"] > drift["max_drift_kl"]
    assert "not promoted" in job["message"]
    assert f"({drift['anchors_changed_count']}/{drift['anchors']})" in job["message"]
    assert jobs["receipts"]["damage"][-1]["kind"] == "drift"
    # serving did not move: the version served before the damaging job is served after it
    assert jobs["served_version"] == jobs["served_before_damage"]
    listed = {(a["name"], a["version"]): a for a in jobs["adapters"]}
    assert listed[("damage", 1)]["drift"]["anchors_changed"] == drift["anchors_changed"]
    # /metrics carries the last measurement, labelled with its job
    label = {"job": str(job["id"])}
    assert jobs["metrics"]["dreamstage_dream_anchors_changed"] == (label, drift["anchors_changed"])
    assert jobs["metrics"]["dreamstage_dream_drift_kl"] == (label, drift["drift_kl"])
    assert jobs["metrics"]["dreamstage_dream_drift_anchors"] == (label, drift["anchors"])
