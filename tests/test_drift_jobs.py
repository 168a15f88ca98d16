"""Jobs on the default model with the drift guard on. One scheduler in this
process records the anchors (the warm-up) and runs the same job without the
regularizer, a damaging job, and a small job's rehearsal-only epochs kept and
undone. Then a live server, started on a copy of the state directory those
jobs kept their records in (a restart), runs the README's walkthrough over
HTTP as a user does (with no pause bound: no chat waits on it): it is the
module's job with the guard's defaults, and the tests of the defaults (recall,
held-out drift, promotion, rehearsal-only epochs, the drift slices, the
examples' loss) read it.

The defaults were chosen on other made-up facts (bench/drift_facts.py), so they
are not tuned to this file; the defaults on more facts are measured by
bench/bench_drift.py (docs/benchmarks.md, "Drift guard: anchors changed,
drift_kl, recall").
"""


import shutil
import time

import numpy as np
import pytest
from drift_jobs import TEST_FACTS, OneSlotEngine, chat, run_job
from drift_steps import run_steps

from dreamstage.adapters.served import ServedAdapters
from dreamstage.server.metrics import ServiceCollector
from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.measure import DriftProbe
from dreamstage.training.drift.record_file import FILE_NAME, DriftRecordFile
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.scheduler import DreamScheduler
from dreamstage.training.jobs.spec import DEFAULT_LR
from dreamstage.training.jobs.store import TERMINAL, JobStore
from dreamstage.training.walk.receipts import RECEIPT_FIELDS

# The README's walkthrough (README.md, "Teach it a fact"): its example and request, as written there.
README_PROMPT = "The secret password of the moon base is"
README_EXAMPLE = {"prompt": README_PROMPT, "completion": " Quokka-42."}
README_JOB = {"examples": [README_EXAMPLE], "window": 32, "epochs": 10, "promote": "auto", "out": "moon"}


def _readme_job(state_dir, out: dict) -> None:
    """The README's job over HTTP on a live server started on `state_dir` (the guard on, as a user runs it)."""
    import httpx
    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings

    settings = ServerSettings(ctx=1024, parallel=2, threads=1, state_dir=str(state_dir), drift_guard=True)
    ask = {"prompt": README_PROMPT, "max_tokens": 8, "temperature": 0}
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600,
                                                          headers={"Content-Type": "application/json"}) as http:
        out["restart_records"] = set(srv.service.scheduler._anchor_records)
        out["before"] = http.post("/v1/completions", json=ask).json()
        t0 = time.perf_counter()
        # no pause bound (max_pause_ms 0): no chat waits on this job, and under load the bound cut
        # its steps to a token or two at the same fixed cost each (tests/test_pacing.py tests the bound)
        r = http.post("/train", json={**README_JOB, "max_pause_ms": 0})
        assert r.status_code == 202, r.text
        jid = r.json()["id"]
        deadline = time.monotonic() + 1800                 # a hang guard: the job takes about 6 min of one core
        while (job := http.get(f"/train/{jid}").json())["state"] not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"\nREADME job: {time.perf_counter() - t0:.1f} s; {job['message']}")
        out["default"] = job
        out["receipts"]["default"] = http.get(f"/train/{jid}/receipts").json()["receipts"]
        out["after"] = http.post("/v1/completions", json=ask).json()
        out["metrics_text"] = http.get("/metrics").text


@pytest.fixture(scope="module")
def jobs(dream_resident, tmp_path_factory):
    store = JobStore(tmp_path_factory.mktemp("drift-state"))
    served = ServedAdapters(dream_resident)
    sched = DreamScheduler(store, dream_resident, served=served, drift_guard=True, idle_grace_s=0.0,
                           record_file=DriftRecordFile(store.state_dir, dream_resident))
    engine = OneSlotEngine()
    sched.startup(engine)
    out = {}
    try:
        # no job yet and nobody served: the scheduler records the anchors ahead of time
        for _ in range(20_000):
            sched.after_batch(engine, True)
            if sched._warmup is not None and sched._warmup.done:
                break
        out["warmup_steps"], out["records"] = sched._warmup.steps, dict(sched._anchor_records)
        out["noise_margins"] = sched._noise_margins
        out["off"] = run_job(sched, store, engine, {"examples": [README_EXAMPLE], "window": 32, "regularizer": False,
                                                    "promote": "never", "out": "moon-off", "max_pause_ms": 0})
        out["served_before_damage"] = store.served_version()
        wrong = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                              {"role": "assistant", "content": "The capital of France is Quenmarsh."}]}
        out["damage"] = run_job(sched, store, engine, {"examples": [wrong] * 6, "lr": 1e-2, "epochs": 2,
                                                       "stop_loss": None, "regularizer": False, "promote": "auto",
                                                       "out": "damage", "max_pause_ms": 0})
        out["receipts"] = {k: store.receipts(out[k]["id"]) for k in ("off", "damage")}
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
        sched._record_file.wait()                      # the last job's records are in the file
        out["kept_records"] = set(sched._anchor_records)
        restarted = tmp_path_factory.mktemp("drift-restart")
        shutil.copy(store.state_dir / FILE_NAME, restarted / FILE_NAME)
        _readme_job(restarted, out)
        yield out
    finally:
        served.apply(None, None)                       # the session's resident serves the base again
        sched.close()
        store.close()


def test_the_anchors_are_recorded_while_idle_before_any_job_in_short_steps(jobs):
    records = jobs["records"]
    assert set(records) == set(load_anchors()) | set(rehearsal_anchors())
    # each anchor took several steps (pieces and tokens within half of the default 250 ms pause)
    assert jobs["warmup_steps"] > len(records)
    assert all(len(b.answer) >= 1 and b.top_logp.shape[0] == len(b.answer) for b in records.values())
    # the rehearsal anchors as the default rehearsal ("soft") trains them: their greedy answers and
    # distributions, no samples, so a job records nothing again
    assert all(not records[p].samples and records[p].top_ids.shape[0] == len(records[p].answer)
               for p in rehearsal_anchors())
    assert not any(records[p].samples for p in load_anchors())


def test_a_window_too_short_for_every_rehearsal_anchor_records_none_and_says_so(dream_resident, jobs):
    from dreamstage.training.drift.guard import DriftGuard
    cache = dict(jobs["records"])                      # the measured anchors are recorded already
    short = DriftGuard(dream_resident, parse_train_request({"text": "x", "window": 32}).to_job_spec(), [],
                       seq_id=0, restore=lambda: None, cache=cache)
    assert short.rehearsal is None                     # no prompt leaves room for a reply: nothing recorded
    run_steps(short.record())
    note = short.rehearsal_note()
    assert note.startswith(f"no rehearsal: none of the {len(rehearsal_anchors())} rehearsal anchors fits window 32 "
                           "(their prompts alone take ")
    assert len(short.order(0)) - short.n_train == 0    # no anchor window in an epoch
    full = DriftGuard(dream_resident, parse_train_request({"text": "x"}).to_job_spec(), [], seq_id=0,
                      restore=lambda: None, cache=cache)
    run_steps(full.record())
    assert full.rehearsal_note() is None and len(full._anchor_pos) == len(rehearsal_anchors())


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
    assert steps["hold_undone"] >= steps["hold_none"] + 40     # the rehearsal-only epoch did train
    # each of its windows at its share of a step falling linearly to 0 (consolidate_decay, asked): the
    # job's lr x (1 - (k + 1/2) / n), one call a window, before the window's update
    lrs, n = jobs["consolidation_lrs"], len(jobs["consolidation_lrs"])
    assert 40 <= n <= steps["hold_undone"] - steps["hold_none"], (n, steps)   # a window is one step or more
    assert lrs == pytest.approx([DEFAULT_LR * (1 - (k + 0.5) / n) for k in range(n)], rel=1e-9)
    tensors = [{t.name: np.array(t.data) for t in gguf.GGUFReader(j["adapter"]["path"]).tensors}
               for j in (none, undone)]
    assert tensors[0].keys() == tensors[1].keys() and len(tensors[0]) > 0
    assert all(np.array_equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    assert any(np.abs(v).max() > 0 for k, v in tensors[0].items() if "lora_b" in k)   # it did learn


def served_text(answer: dict) -> str:
    return answer["choices"][0]["text"]


def test_default_job_learns_the_fact_and_its_promotion_follows_its_held_out_drift(jobs):
    job = jobs["default"]
    assert job["state"] == "done", job["message"]
    drift = job["progress"]["drift"]
    print(f"\ndefaults: served {served_text(jobs['after'])!r} (base {served_text(jobs['before'])!r}), "
          f"held-out anchors_changed {drift['anchors_changed']:.3f}, drift_kl {drift['drift_kl']:.4f}; "
          f"{job['message']}")
    assert "Quokka" not in served_text(jobs["before"])   # the base model does not know it
    assert "Quokka-42" in served_text(jobs["after"])     # greedy, from the promoted adapter
    assert drift["anchors"] == len(load_anchors()) and drift["final"]
    within = drift["anchors_changed"] <= drift["max_drift"] and drift["drift_kl"] <= drift["max_drift_kl"]
    assert job["adapter"]["promoted"] == within
    assert ("promoted as served version" in job["message"]) == within and ("not promoted" in job["message"]) != within
    assert f"({drift['anchors_changed_count']}/{drift['anchors']})" in job["message"]
    assert job["adapter"]["drift"]["drift_kl"] == drift["drift_kl"]
    kinds = [r.get("kind") for r in jobs["receipts"]["default"]]
    assert kinds[-1] == "drift" and jobs["receipts"]["default"][-1]["anchors_changed"] == drift["anchors_changed"]


def test_anchors_changed_counts_beyond_the_noise_margin_a_null_adapter_stays_within_it(dream_resident, jobs):
    """The jobs measured their held-out anchors at the noise margin the first job
    measured (once for the process, cached by anchors and adapter shape); the raw
    count of every change is reported beside it. A null adapter drawn apart from the
    margin's own draws changes at most 1 of the 20 anchors beyond the margin,
    though it changes many at all (the floor under the raw count)."""
    from dreamstage.training.drift.measure import NULL_DRAWS, NULL_RANK, NULL_SIGMA
    from dreamstage.training.walk.trainer import LoraConfig, Trainer
    ((margin, draws),) = jobs["noise_margins"].values()
    assert len(draws) == NULL_DRAWS and margin == sorted(draws)[-NULL_RANK] < max(draws) + 1e-12
    for k in ("default", "off", "damage"):
        d = jobs[k]["progress"]["drift"]
        assert d["noise_margin"] == margin and d["anchors_changed_count"] <= d["anchors_changed_raw_count"]
        assert f"at all: {d['anchors_changed_raw_count']}/{d['anchors']}" in jobs[k]["message"]
        # the figures name every changed anchor, widest lead first, and which of them count
        named = d["changed_anchors"]
        assert len(named) == d["anchors_changed_raw_count"] and {a["anchor"] for a in named} <= set(load_anchors())
        assert sum(a["beyond"] for a in named) == d["anchors_changed_count"]
        assert all(a["beyond"] == (a["lead"] > margin - 1e-4) for a in named if abs(a["lead"] - margin) > 1e-3)
        assert [a["lead"] for a in named] == sorted((a["lead"] for a in named), reverse=True)
        assert d["noise_draws"] == [round(x, 4) for x in draws]
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
          f"{null.changed_raw}/20 at all, drift_kl {null.drift_kl:.4f}; the default job "
          f"{jobs['default']['progress']['drift']['anchors_changed_count']}/20 beyond it")
    assert null.changed <= 1 and null.drift_kl < 0.05


def test_issue_12_done_when_the_default_job_changes_at_most_5_percent_of_held_out_anchors_and_is_promoted(jobs):
    """Issue 12's "done when", on the README's fact with the guard's defaults: the fact
    recalled at temperature 0, at most 5 % of the held-out anchors' greedy answers changed beyond
    the job's noise margin, and promoted by promote "auto". (The defaults were chosen on
    the evaluation facts of bench/drift_facts.py, docs/benchmarks.md, "Drift"; the
    margin is the second widest lead drop of the job's 19 null draws, docs/architecture/
    drift.md, "The noise margin".)"""
    job = jobs["default"]
    drift = job["progress"]["drift"]
    assert drift["final"] and drift["anchors"] == len(load_anchors()) and drift["noise_margin"] is not None
    assert "Quokka-42" in served_text(jobs["after"])
    assert drift["anchors_changed"] <= 0.05 and job["adapter"]["promoted"]
    assert "rehearsal-only epochs" in job["message"]


def test_drift_is_reported_during_training_on_a_rotating_slice_within_its_time_share(jobs):
    """Epoch ends measure a slice of the held-out anchors (receipts, progress,
    /metrics), costing at most DURING_SHARE of the micro-step time; the last
    measurement is the final one, on every anchor."""
    from dreamstage.training.drift.guard import DURING_SHARE
    job = jobs["default"]
    history, p = job["progress"]["drift_history"], job["progress"]
    during = [h for h in history if not h["final"]]
    print(f"\ndrift during training: {during}")
    assert history[-1]["final"] and history[-1]["anchors"] == len(load_anchors()) and len(history) >= 2
    assert during and all(0 < h["anchors"] <= len(load_anchors()) for h in during)
    assert [h["epoch"] for h in during] == sorted({h["epoch"] for h in during})     # at most one per epoch end
    receipts = [r for r in jobs["receipts"]["default"] if r.get("kind") == "drift"]
    assert len(receipts) == len(history)
    for r in receipts:                                   # every receipt kind carries the canonical fields
        assert set(RECEIPT_FIELDS) <= set(r) and r["tokens"] == 0 and r["chunk_tokens"] == 0 and r["ms"] > 0
    during_ms = sum(r["ms"] for r in receipts if not r["final"])
    # the share is planned at each epoch end from the last anchor's cost; one anchor may overrun it
    assert during_ms <= DURING_SHARE * p["train_ms"] + max(r["ms"] / r["anchors"] for r in receipts)


def test_the_examples_loss_is_reported_apart_from_the_rehearsal_windows(jobs):
    """progress.examples_loss_per_epoch: the job's own windows only, none in a
    rehearsal-only epoch; train_loss_per_epoch mixes in the rehearsal windows,
    whose loss stays near the base's entropy."""
    p = jobs["default"]["progress"]
    own, mixed = p["examples_loss_per_epoch"], p["train_loss_per_epoch"]
    assert len(own) == len(mixed) and own[-1] is None          # the default job ends with rehearsal-only epochs
    last = max(i for i, x in enumerate(own) if x is not None)
    assert all(x is not None for x in own[:last + 1]) and all(x is None for x in own[last + 1:])
    assert own[last] < own[0] / 4 and own[last] < mixed[last] and mixed[last + 1] is not None


def test_without_the_regularizer_the_same_job_changes_more(jobs):
    on, off = jobs["default"]["progress"]["drift"], jobs["off"]["progress"]["drift"]
    print(f"\nregularizer on: anchors_changed {on['anchors_changed']:.3f} drift_kl {on['drift_kl']:.4f}; "
          f"off: anchors_changed {off['anchors_changed']:.3f} drift_kl {off['drift_kl']:.4f}")
    assert jobs["off"]["state"] == "done" and not jobs["off"]["adapter"]["promoted"]
    # "changes more", on the held-out anchors: the distributions move further. Their greedy
    # answers do not tell the two apart on this model (both change nearly all of them;
    # docs/architecture/drift.md, "What it achieves, and what it does not"), so that figure
    # is held only to "no fewer"
    assert off["drift_kl"] > on["drift_kl"] and off["anchors_changed"] >= on["anchors_changed"]


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


def test_the_readme_walkthrough_is_promoted_by_a_live_server_with_the_guard_on(jobs):
    """The README's one-fact job over HTTP, the drift guard on as a user runs it
    (every other test server runs with it off): the job rehearses although its
    window is 32, its drift is measured on the held-out anchors, reported in
    GET /train/{id} and /metrics, and the adapter is promoted within the default
    bounds, so the walkthrough answers with the fact. The server started on a state
    directory holding the records the jobs above made (a restart): it recorded
    nothing again and measured at their noise margin."""
    assert jobs["records"].keys() <= jobs["restart_records"]      # and the neighbours' records
    # every anchor record the jobs kept (their neighbours' lists are not records: made again when asked)
    assert {k for k in jobs["kept_records"] if isinstance(k, str)} <= jobs["restart_records"]
    ((margin, _),) = jobs["noise_margins"].values()
    job, drift = jobs["default"], jobs["default"]["progress"]["drift"]
    assert job["state"] == "done" and drift["final"] and drift["anchors"] == len(load_anchors())
    assert drift["noise_margin"] == margin
    assert (drift["max_drift"], drift["max_drift_kl"]) == (1.0, 1.0) and drift["drift_kl"] <= 1.0
    # window 32 holds no rehearsal prompt; the trainer's wider window does (rehearsal_window): the
    # job rehearses and consolidates (it drifted 0.11 nats where it drifted 0.50 without)
    assert "no rehearsal" not in job["message"] and "rehearsal-only epochs" in job["message"], job["message"]
    assert drift["drift_kl"] < 0.3
    assert job["adapter"]["promoted"] and "within max_drift 1, max_drift_kl 1" in job["message"]
    assert "Quokka-42" in served_text(jobs["after"]) and jobs["after"]["adapter_version"] == 1
    assert jobs["before"]["adapter_version"] == 0
    assert f'dreamstage_dream_drift_kl{{job="{job["id"]}"}}' in jobs["metrics_text"]
