"""Feedback into training: the body, the weights, the jobs it makes, the bound on negative weights, and
the whole loop on a server (a correction makes the next answer the corrected one)."""
from __future__ import annotations

import json
import math

import pytest

from dreamstage.records.feedback import FeedbackRequest, rating_weights
from dreamstage.records.learner import build_job
from dreamstage.records.store import Feedback
from dreamstage.training.jobs.example_forms import TokenExample
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.stored import SPEC_VERSION, from_stored, to_stored
from dreamstage.training.walk.groups import NEGATIVE_NLL_CAP, bounded_weights

JSON = {"Content-Type": "application/json"}


# -- the weights -------------------------------------------------------------------------------
def test_rating_weights_are_advantages_scaled_to_one():
    assert rating_weights([1, -1, 1, -1]) == [1.0, -1.0, 1.0, -1.0]
    assert rating_weights([5, 4, 1, 2]) == pytest.approx([2 / 2, 1 / 2, -2 / 2, -1 / 2])   # mean 3, max |a| 2
    assert rating_weights([1, 1, 0]) == pytest.approx([0.5, 0.5, -1.0])
    # no comparison in the ratings: each read against zero
    assert rating_weights([1]) == [1.0] and rating_weights([-1]) == [-1.0]
    assert rating_weights([3, 3]) == [1.0, 1.0] and rating_weights([0, 0]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        rating_weights([math.nan])


def test_a_negative_reply_is_dropped_once_its_nll_passes_the_cap():
    w = [1.0, -1.0, -0.5]
    assert bounded_weights(w, None) == w                                   # first pass: nothing measured
    assert bounded_weights(w, [0.3, NEGATIVE_NLL_CAP - 0.1, 2.0]) == w
    assert bounded_weights(w, [0.3, NEGATIVE_NLL_CAP + 0.1, 9.0]) == [1.0, 0.0, 0.0]
    assert bounded_weights(w, [50.0, math.nan, 1.0]) == [1.0, -1.0, -0.5]  # positives never; unmeasured kept
    assert bounded_weights(w, [1.0]) == w                                  # another group's losses: ignored


# -- the body --------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"rating": 1}, "id"),
    ({"id": "x", "rating": 1, "correction": "y"}, "body"),
    ({"id": "x"}, "body"),
    ({"id": "x", "correction": ""}, "correction"),
    ({"id": "x", "rating": "good"}, "rating"),
    ({"id": "x", "index": -1, "rating": 1}, "index"),
    ({"preferred": "a"}, "preferred"),
    ({"rejected": "a", "rating": 1, "id": "x"}, "rejected"),
    ({"preferred": "a", "rejected": "a"}, "rejected"),
    ({"id": "x", "preferred": "a", "rejected": "b"}, "id"),
    ({"id": "x", "rating": 1, "mood": "happy"}, "mood"),
])
def test_a_bad_body_names_its_field(body, param):
    from pydantic import ValidationError

    from dreamstage.server.record_routes import feedback_errors

    with pytest.raises(ValidationError) as e:
        FeedbackRequest.model_validate(body)
    assert feedback_errors(e.value)[0][0] == param


def test_the_kinds_and_their_answers():
    assert FeedbackRequest.model_validate({"id": "x", "correction": "c"}).kind == "correction"
    r = FeedbackRequest.model_validate({"id": "x", "index": 2, "rating": -1})
    assert r.kind == "rating" and r.ref().index == 2
    p = FeedbackRequest.model_validate({"preferred": {"id": "x", "index": 1}, "rejected": "x"})
    assert p.kind == "preference" and (p.ref("preferred").index, p.ref("rejected").index) == (1, 0)


# -- the jobs --------------------------------------------------------------------------------
def item(fid: int, kind: str, replies: list[dict], key: str = "k", prompt=(1, 5, 6)) -> Feedback:
    return Feedback(fid, 0.0, "alice", "rec", kind, key, {"prompt": list(prompt), "prompt_text": "Q:",
                                                          "replies": replies}, None)


def reply(text: str, tokens: list[int], index: int = 0, record: str = "rec", **more) -> dict:
    return {"record_id": record, "index": index, "text": text, "tokens": tokens, **more}


def test_a_job_of_corrections_ratings_and_a_preference():
    items = [item(1, "correction", [reply("right", [7, 2])]),
             *(item(2 + i, "rating", [reply(f"a{i}", [10 + i, 2], index=i, rating=r)], key="n4")
               for i, r in enumerate([1, -1, 1, 1])),
             item(6, "rating", [reply("a1", [11, 2], index=1, rating=1)], key="n4"),     # re-rated: +1 now
             item(7, "preference", [reply("good", [20, 2]), reply("bad", [21, 2], record="rec2")], key="p")]
    req, spec = build_job("alice", items)
    assert spec.out == "alice" and spec.promote == "auto" and spec.fit == "left" and spec.window == 512
    ex = spec.examples
    assert ex[0].group is None and ex[0].example == TokenExample(prompt=[1, 5, 6], reply=[7, 2])
    # the n = 4 ratings: one group; the answer rated twice counts its latest rating: 1, 1, 1, 1 -> each vs 0
    ratings = [e for e in ex if e.group == "examples[2]"]
    assert [e.example.reply for e in ratings] == [[10, 2], [11, 2], [12, 2], [13, 2]]
    assert [e.weight for e in ratings] == [1.0, 1.0, 1.0, 1.0]
    pair = [e for e in ex if e.group == "examples[1]"]
    assert [(e.example.reply, e.weight) for e in pair] == [([20, 2], 1.0), ([21, 2], -1.0)]
    # the request shows the same examples as text; it validates as a POST /train body would
    shown = req.model_dump(mode="json", exclude_none=True)["examples"]
    assert shown[0] == {"prompt": "Q:", "completion": "right"}
    assert [c["weight"] for c in shown[2]["completions"]] == [1.0, 1.0, 1.0, 1.0]
    # groups and weights survive the store (form 6 dropped them)
    back = from_stored(to_stored(spec), SPEC_VERSION)
    assert back.examples == spec.examples


def test_ratings_of_one_prompt_weigh_by_advantage():
    items = [item(i, "rating", [reply(f"a{i}", [10 + i], index=i, rating=r)]) for i, r in enumerate([1, -1, -1, 1])]
    _, spec = build_job("alice", items)
    assert [e.weight for e in spec.examples] == [1.0, -1.0, -1.0, 1.0]
    assert len({e.group for e in spec.examples}) == 1


def test_a_group_read_back_from_a_form_6_store_is_plain():
    spec = parse_train_request({"examples": [{"prompt": "a", "completions": [{"text": "x", "weight": -1}]}]}
                               ).to_job_spec()
    stored = json.loads(to_stored(spec))
    for e in stored["examples"]:
        e.pop("group"), e.pop("weight")
    assert from_stored(json.dumps(stored), 6).examples[0].group is None
