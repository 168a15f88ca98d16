"""The regularizer's neighbours: questions beside a job's own prompts, written by
the base model itself and rehearsed in every epoch (neighbours.neighbour_units,
DriftGuard). The made-up questions here are neither the tests' facts
(test_drift.py) nor the benchmark's (bench/drift_facts.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from drift_steps import run_steps
from pydantic import ValidationError

from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.guard import DriftGuard
from dreamstage.training.drift.measure import DriftProbe
from dreamstage.training.drift.neighbours import job_questions, least_expected_word, neighbour_units, plain_words
from dreamstage.training.drift.records import AnchorBase, prompt_tokens
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.spec import DEFAULT_NEIGHBOURS
from dreamstage.training.jobs.stored import from_stored, to_stored
from dreamstage.training.walk.examples import ChatRenderer, render_job

QUESTIONS = ["What is the capital of Zandoria?", "Who built the Kelthorn Bridge?",
             "What is the main export of Quillmere?"]


def chat(questions):
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "It is Orvane."}]}
            for q in questions]


def test_a_question_is_cut_before_its_least_expected_word():
    pieces = ["What", " is", " the", " currency", " of", " Tess", "aly", " Isle", "?"]
    # the made-up name's two tokens together are the least expected word, though neither alone is
    surprise = [9.0, 1.0, 0.5, 6.0, 0.2, 4.0, 3.5, 2.0, 0.1]
    assert least_expected_word(surprise, pieces) == 5
    # the first word is never the cut (nothing of the question would be left)
    assert least_expected_word([20.0, 1.0, 1.0], ["Who", " built", " it"]) == 1
    assert least_expected_word([1.0, 1.0, 5.0], ["Who", " built", " it"]) == 2
    # one word of several tokens: cut before its last token
    assert least_expected_word([1.0, 2.0, 3.0], ["Sky", "lo", "om"]) == 2


def test_the_jobs_questions_are_its_trained_prompts_once_each(dream_resident):
    body = {"examples": [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello", "train": False},
                      {"role": "user", "content": "Who built the Kelthorn Bridge?"},
                      {"role": "assistant", "content": "Orla Venn built it."}]},
        {"prompt": "Q: What is the main export of Quillmere?\nA:", "completion": " Glass."},
        {"prompt": "Q: What is the main export of Quillmere?\nA:", "completion": " Salt."},
        {"text": "Plain text has no question."},
    ]}
    spec = parse_train_request(body).to_job_spec()
    train = list(render_job(spec, dream_resident).train)
    assert job_questions(spec, train) == ["Who built the Kelthorn Bridge?",
                                          "Q: What is the main export of Quillmere?\nA:"]
    # a held-out example's prompt is not a neighbour's seed
    assert job_questions(spec, [w for w in train if w.source != 0]) == [
        "Q: What is the main export of Quillmere?\nA:"]


def test_the_base_writes_neighbours_from_the_head_of_each_question_seeded_by_its_text(dream_resident):
    renderer = ChatRenderer(dream_resident)
    probe = DriftProbe(dream_resident, load_anchors()[:1], seq_id=0)
    got = run_steps(probe.neighbours_of(QUESTIONS, 3))
    assert got == run_steps(probe.neighbours_of(QUESTIONS, 3)), "the same questions write the same neighbours"
    assert 3 <= len(got) <= 9 and len(set(got)) == len(got)
    for q in QUESTIONS:
        mine = run_steps(neighbour_units(dream_resident, 0, q, renderer, 3))
        assert mine and all(m in got for m in mine)
        # each keeps the question's head (the words before the cut) and writes a different rest
        head, body = renderer.user_turn(q)
        for m in mine:
            assert m != q and m.split()[0] == q.split()[0], (q, m)
        assert body == dream_resident.tokenize(q, False, False)
    # the made-up name is the least expected word: the neighbours of the capital's question ask
    # for the capital of somewhere else
    assert [m for m in got if m.startswith("What is the capital of ")], got
    # a neighbour that is (or begins with) a measured anchor, up to case and punctuation, is left out
    shut = got[0].upper().rstrip("?.!")
    excluded = run_steps(probe.neighbours_of(QUESTIONS, 3, exclude=[shut]))
    assert got[0] not in excluded
    assert excluded == [m for m in got if not plain_words(m).startswith(plain_words(shut))]
    # a cache keeps each question's neighbours across jobs
    cache: dict = {}
    assert run_steps(probe.neighbours_of(QUESTIONS, 3, cache)) == got and len(cache) == len(QUESTIONS)
    cache[(QUESTIONS[0], 3)] = ["a cached one"]
    assert run_steps(probe.neighbours_of(QUESTIONS, 3, cache))[0] == "a cached one"


def _fake(prompt: str, resident) -> AnchorBase:
    toks = prompt_tokens(resident, prompt)
    z = np.zeros((2, 1))
    return AnchorBase(prompt, toks, (7, 8), (*toks, 7), (7, 8), z.astype(np.int32), z.astype(np.float32), z[:, 0])


def test_every_neighbour_is_rehearsed_in_each_of_the_jobs_epochs_and_not_after(dream_resident):
    # the shipped anchors' records are stand-ins (no decode); the neighbours are written and recorded for real
    shipped = {p: _fake(p, dream_resident) for p in load_anchors() + rehearsal_anchors()}
    assert parse_train_request({"examples": chat(QUESTIONS)}).to_job_spec().neighbours == DEFAULT_NEIGHBOURS == 4
    spec = parse_train_request({"examples": chat(QUESTIONS), "neighbours": 2}).to_job_spec()
    train = list(render_job(spec, dream_resident).train)
    guard = DriftGuard(dream_resident, spec, train, seq_id=0, restore=lambda: None, cache=dict(shipped))
    run_steps(guard.record())
    near = guard.neighbour_prompts
    n = len(rehearsal_anchors())
    assert 1 <= len(near) <= spec.neighbours * len(QUESTIONS)
    assert not set(near) & set(load_anchors()) and not set(near) & set(rehearsal_anchors())
    positions = {guard._anchor_pos[i][0]: p for i, p in zip(guard._neighbour_indices(), near, strict=True)}
    for pos, prompt in positions.items():
        w = guard.windows[pos]
        base = guard.near.bases[guard.near.prompts.index(prompt)]
        # a soft window: the base's own answer against its recorded distributions, as any rehearsal anchor
        assert w.label.startswith("neighbours[") and w.soft is not None
        assert w.tokens == base.prompt_tokens + base.answer and np.array_equal(w.soft[0], base.top_ids)
    rotating = min(n, math.ceil(spec.anchor_ratio * len(train)))
    for epoch in range(3):
        order = guard.order(epoch)
        assert sorted(i for i in order if i in positions) == sorted(positions), "every neighbour, every epoch"
        assert len(order) == len(train) + rotating + len(positions)
    for k in range(2):        # the rehearsal-only epochs: every shipped rehearsal anchor, no neighbour
        cons = guard.consolidation_order(k)
        assert sorted(cons) == list(range(len(train), len(train) + n)) and not set(cons) & set(positions)
    # none with neighbours 0 or the regularizer off; the rotating slice is as it was
    for body in ({"neighbours": 0}, {"neighbours": 2, "regularizer": False}):
        s = parse_train_request({"examples": chat(QUESTIONS), **body}).to_job_spec()
        g = DriftGuard(dream_resident, s, train, seq_id=0, restore=lambda: None, cache=dict(shipped))
        run_steps(g.record())
        assert g.neighbour_prompts == [] and not any(w.label.startswith("neighbours") for w in g.windows)
    s0 = parse_train_request({"examples": chat(QUESTIONS), "neighbours": 0}).to_job_spec()
    g0 = DriftGuard(dream_resident, s0, train, seq_id=0, restore=lambda: None, cache=dict(shipped))
    run_steps(g0.record())
    assert len(g0.order(0)) == len(train) + rotating


def test_neighbours_is_a_validated_job_field_and_older_stored_jobs_read_as_none():
    for bad in (-1, 9, "two", 1.5):
        with pytest.raises(ValidationError) as e:
            parse_train_request({"text": "x", "neighbours": bad})
        assert e.value.errors()[0]["loc"][0] == "neighbours"
    spec = parse_train_request({"text": "x", "neighbours": 5}).to_job_spec()
    assert spec.neighbours == 5
    stored = to_stored(spec)
    assert from_stored(stored, 5).neighbours == 5
    assert from_stored(stored, 4).neighbours == 0, "a form-4 job was accepted when none were rehearsed"


def test_a_failure_to_write_neighbours_leaves_the_rest_of_the_guard_as_it_was(dream_resident, monkeypatch):
    shipped = {p: _fake(p, dream_resident) for p in load_anchors() + rehearsal_anchors()}
    spec = parse_train_request({"examples": chat(QUESTIONS), "neighbours": 2}).to_job_spec()
    train = list(render_job(spec, dream_resident).train)
    plain = DriftGuard(dream_resident,
                       parse_train_request({"examples": chat(QUESTIONS), "neighbours": 0}).to_job_spec(),
                       train, seq_id=0, restore=lambda: None, cache=dict(shipped))
    run_steps(plain.record())
    original = DriftProbe.record

    def record_then_fail(self, cache=None):       # the neighbours are written; their records fail
        if self.prompts[0] not in shipped:
            raise RuntimeError("no decode today")
        return (yield from original(self, cache))
    monkeypatch.setattr(DriftProbe, "record", record_then_fail)
    guard = DriftGuard(dream_resident, spec, train, seq_id=0, restore=lambda: None, cache=dict(shipped))
    run_steps(guard.record())
    assert guard.failure is None and guard.neighbour_prompts == [] and guard.consolidates()
    assert [w.label for w in guard.windows] == [w.label for w in plain.windows]
    assert guard.order(1) == plain.order(1) and guard.consolidation_order(0) == plain.consolidation_order(0)
