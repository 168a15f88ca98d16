"""Feedback into training: the body, the weights, the jobs it makes, the bound on negative weights, and
the whole loop on a server (a correction makes the next answer the corrected one)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import httpx
import pytest
from background_server import BackgroundServer

from dreamstage.records import feedback
from dreamstage.records.feedback import FeedbackRequest, departures, rating_weights, trained_weights
from dreamstage.records.learner import FEEDBACK_JOB, UNGUARDED_STOP_LOSS, build_job
from dreamstage.records.store import Feedback
from dreamstage.server.settings import ServerSettings
from dreamstage.training.jobs.example_forms import TokenExample
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.spec import DEFAULT_ANCHOR_RATIO, DEFAULT_EPOCHS, DEFAULT_STOP_LOSS
from dreamstage.training.jobs.stored import SPEC_VERSION, from_stored, to_stored
from dreamstage.training.walk.groups import NEGATIVE_NLL_CAP, NEGATIVE_NLL_RISE, bounded_weights, pushed_away

JSON = {"Content-Type": "application/json"}


# -- the weights -------------------------------------------------------------------------------
def test_rating_weights_are_advantages_over_their_mean_size():
    assert rating_weights([1, -1, 1, -1]) == [1.0, -1.0, 1.0, -1.0]
    assert rating_weights([5, 4, 1, 2]) == pytest.approx([4 / 3, 2 / 3, -4 / 3, -2 / 3])   # a: 2 1 -2 -1, mean|a| 1.5
    # an n = 4 request with one answer liked: a = 1.5, -0.5 x 3, mean|a| 0.75; likes add up to G/2, dislikes -G/2
    w = rating_weights([-1, 1, -1, -1])
    assert w == pytest.approx([-2 / 3, 2.0, -2 / 3, -2 / 3])
    assert sum(x for x in w if x > 0) == pytest.approx(2.0) and sum(x for x in w if x < 0) == pytest.approx(-2.0)
    # the scale of the ratings does not matter
    assert rating_weights([10, -10, -10, -10]) == pytest.approx([2.0, -2 / 3, -2 / 3, -2 / 3])
    assert rating_weights([3, 1, 1, 1]) == pytest.approx(rating_weights([10, -10, -10, -10]))
    # no comparison in the ratings: positive ones still train, zero or negative ones weigh nothing
    assert rating_weights([1]) == [1.0] and rating_weights([3, 3]) == [1.0, 1.0]
    assert rating_weights([-1]) == [0.0] and rating_weights([-1, -1]) == [0.0, 0.0]
    assert rating_weights([0, 0]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        rating_weights([math.nan])


def test_a_group_stops_when_its_positive_replies_are_learned():
    """The early stop reads a group by its positive replies (a pushed-away reply's loss only rises); a group
    without one stops once its negative replies are pushed away (a nat above their first pass's loss, or
    past the cap), and one of zero weights at once."""
    from types import SimpleNamespace as R

    from dreamstage.training.drift.stopping import OwnLoss

    own = OwnLoss(n_job_windows=3, stop_loss=0.2)
    own.note(0, R(status="ok", loss=0.05, tokens=10))                       # a plain example, learned
    own.note(1, R(status="ok", loss=3.0, tokens=40))                        # the group's receipts: not its stop
    own.note_group(1, [0.15, 5.0, 4.0], [1.0, -0.5, -0.5])
    own.note_group(2, [1.0, 1.2], [0.0, 0.0])
    own.note_group(5, [9.0], [1.0])                                          # an anchor's index: not the job's
    assert own.converged() and own.last == pytest.approx(0.15) and own.mean == pytest.approx(2.41)
    own.note_group(1, [0.3, 5.0, 4.0], [1.0, -0.5, -0.5])                   # its positive reply not yet
    assert not own.converged() and own.last == pytest.approx(0.3)

    pushed = OwnLoss(n_job_windows=1, stop_loss=0.2)
    for losses, stops in (([2.0, 5.5], False), ([2.5, 5.9], False), ([3.1, math.nan], False), ([3.1, 6.1], True)):
        pushed.note_group(0, losses, [-1.0, -1.0])                           # first pass: 2.0 and 5.5
        assert pushed.converged() == stops, losses


def test_a_negative_reply_is_dropped_once_pushed_a_nat_past_its_first_loss_or_past_the_cap():
    w = [1.0, -1.0, -0.5]
    assert bounded_weights(w, None) == w                                   # first pass: nothing measured
    first = [2.0, 2.0, 5.5]
    assert bounded_weights(w, [0.3, 2.0 + NEGATIVE_NLL_RISE - 0.1, 5.9], first) == w
    assert bounded_weights(w, [0.3, 2.0 + NEGATIVE_NLL_RISE + 0.1, NEGATIVE_NLL_CAP + 0.1], first) == [1.0, 0, 0]
    assert bounded_weights(w, [50.0, math.nan, 1.0], first) == w              # positives never; unmeasured kept
    # without a first reading, the cap alone
    assert bounded_weights(w, [0.3, NEGATIVE_NLL_CAP - 0.1, 2.0]) == w
    assert bounded_weights(w, [0.3, NEGATIVE_NLL_CAP + 0.1, 9.0], [math.nan] * 3) == [1.0, 0.0, 0.0]
    assert bounded_weights(w, [1.0]) == w                                  # another group's losses: ignored
    assert pushed_away(3.5, 2.0) and not pushed_away(2.5, 2.0) and not pushed_away(math.nan, 2.0)


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
    ({"preferred": "", "rejected": "a"}, "preferred"),
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
    assert [(e.example.reply, e.weight) for e in pair] == [([20, 2], 1.0), ([21, 2], -feedback.DISLIKE_SHARE)]
    # the request shows the same examples as text; it validates as a POST /train body would
    shown = req.model_dump(mode="json", exclude_none=True)["examples"]
    assert shown[0] == {"prompt": "Q:", "completion": "right"}
    assert [c["weight"] for c in shown[2]["completions"]] == [1.0, 1.0, 1.0, 1.0]
    # groups and weights survive the store (form 6 dropped them)
    back = from_stored(to_stored(spec), SPEC_VERSION)
    assert back.examples == spec.examples


def test_a_feedback_job_stops_on_the_guards_greedy_check_or_a_lower_loss_without_it():
    items = [item(1, "correction", [reply("right", [7, 2])])]
    _, guarded = build_job("alice", items)
    _, bare = build_job("alice", items, guarded=False)
    assert guarded.stop_loss == DEFAULT_STOP_LOSS and bare.stop_loss == UNGUARDED_STOP_LOSS < DEFAULT_STOP_LOSS
    assert guarded.epochs == bare.epochs == FEEDBACK_JOB["epochs"] > DEFAULT_EPOCHS
    assert guarded.consolidate == FEEDBACK_JOB["consolidate"] and replace(guarded, stop_loss=0.0) == replace(
        bare, stop_loss=0.0)
    # a feedback job rehearses fewer anchors than POST /train's default, ratings or not
    assert guarded.anchor_ratio == FEEDBACK_JOB["anchor_ratio"] < DEFAULT_ANCHOR_RATIO
    _, rated = build_job("alice", [*items, item(2, "rating", [reply("a", [9, 2], rating=-1)], key="r")])
    assert rated.anchor_ratio == FEEDBACK_JOB["anchor_ratio"]


def test_ratings_of_one_prompt_weigh_by_advantage():
    items = [item(i, "rating", [reply(f"a{i}", [10 + i], index=i, rating=r)]) for i, r in enumerate([1, -1, -1, 1])]
    _, spec = build_job("alice", items)
    assert [e.weight for e in spec.examples] == [1.0, -feedback.DISLIKE_SHARE, -feedback.DISLIKE_SHARE, 1.0]
    assert len({e.group for e in spec.examples}) == 1


def test_a_disliked_reply_trains_only_where_it_departs_from_the_liked_ones(monkeypatch):
    liked = [7, 8, 9, 2]
    # a dislike's span starts after its common prefix with the liked reply; others train whole
    assert departures([liked, [7, 8, 9, 5, 6, 2], [3, 2], [7, 2]], [1.0, -1.0, -1.0, 0.0]) == [
        (0, 4), (3, 6), (0, 2), (0, 2)]
    # with several liked replies, the longest common prefix with any of them
    assert departures([liked, [7, 8, 4, 2], [7, 8, 4, 4, 2]], [0.5, 0.5, -1.0]) == [(0, 4), (0, 4), (3, 5)]
    # a dislike the liked reply starts with, all of it: nothing to push
    assert departures([liked, [7, 8]], [1.0, -1.0]) == [(0, 4), (2, 2)]
    # no liked reply: a dislike is pushed from its start
    assert departures([[7, 2], [7, 3]], [0.0, -1.0]) == [(0, 2), (0, 2)]
    monkeypatch.setattr(feedback, "DEPARTURE_TOKENS", 1)
    assert departures([liked, [7, 8, 9, 5, 6, 2], [3, 2]], [1.0, -1.0, -1.0]) == [(0, 4), (3, 4), (0, 1)]


def test_a_rating_groups_dislikes_train_from_their_departure():
    """The shared prefix moves into the dislike's context: the group's windows keep the prompt as their
    common prefix and the dislike's reply carries the shared tokens untrained; a dislike that departs
    nowhere is shown with its weight but not trained."""
    from test_examples import FAKE

    from dreamstage.training.walk.examples import render_job

    tokens = {1: [70, 71, 72, 2], -1: [70, 71, 80, 81, 2]}
    items = [item(i, "rating", [reply(f"a{i}", tokens[r], index=i, rating=r)]) for i, r in enumerate([1, -1])]
    items.append(item(2, "rating", [reply("a2", [70, 71], index=2, rating=-1)]))
    req, spec = build_job("alice", items)
    w = trained_weights(rating_weights([1, -1, -1]))
    assert [(e.example, e.weight) for e in spec.examples] == [
        (TokenExample(prompt=[1, 5, 6], reply=[70, 71, 72, 2]), w[0]),
        (TokenExample(prompt=[1, 5, 6, 70, 71], reply=[80, 81, 2]), w[1])]
    shown = req.model_dump(mode="json", exclude_none=True)["examples"][0]["completions"]
    assert [c["weight"] for c in shown] == w
    (group,) = render_job(spec, FAKE).train
    assert group.prefix == (1, 5, 6)
    assert [(list(t), list(m), wt) for t, m, wt in group.replies] == [
        ([70, 71, 72, 2], [1, 1, 1, 1], w[0]), ([70, 71, 80, 81, 2], [0, 0, 1, 1, 1], w[1])]


def test_disliked_replies_push_by_their_share_of_the_liked_pull(monkeypatch):
    items = [item(i, "rating", [reply(f"a{i}", [10 + i], index=i, rating=r)]) for i, r in enumerate([1, -1, -1])]
    pair = item(9, "preference", [reply("good", [20, 2]), reply("bad", [21, 2], record="rec2")], key="p")
    assert 0 < feedback.DISLIKE_SHARE < 1                   # dislikes push by less than likes pull
    for share in (feedback.DISLIKE_SHARE, 0.5):
        monkeypatch.setattr(feedback, "DISLIKE_SHARE", share)
        req, spec = build_job("alice", [*items, pair])
        w = rating_weights([1, -1, -1])
        assert [e.weight for e in spec.examples] == [1.0, -share, w[0], w[1] * share, w[2] * share]   # pair, ratings
        shown = req.model_dump(mode="json", exclude_none=True)["examples"]
        assert [c["weight"] for c in shown[0]["completions"]] == [1.0, -share]    # the request shows what trains


def test_alike_negative_ratings_are_shown_but_train_only_when_nothing_else_does():
    liked = [item(i, "rating", [reply(f"a{i}", [10 + i], index=i, rating=r)], key="one")
             for i, r in enumerate([1, -1])]
    disliked = [item(5 + i, "rating", [reply(f"b{i}", [20 + i], index=i, rating=-1)], key="two") for i in range(2)]
    req, spec = build_job("alice", [*liked, *disliked])
    assert [(e.group, e.weight) for e in spec.examples] == [
        ("examples[0]", 1.0), ("examples[0]", -feedback.DISLIKE_SHARE)]
    shown = req.model_dump(mode="json", exclude_none=True)["examples"]
    assert [c["weight"] for c in shown[1]["completions"]] == [0.0, 0.0]
    # a job of only those: its zero-weight group is what it trains (nothing), so the job exists for the guard
    _, alone = build_job("alice", disliked)
    assert [(e.example.reply, e.weight) for e in alone.examples] == [([20], 0.0), ([21], 0.0)]


def test_a_group_read_back_from_a_form_6_store_is_plain():
    spec = parse_train_request({"examples": [{"prompt": "a", "completions": [{"text": "x", "weight": -1}]}]}
                               ).to_job_spec()
    stored = json.loads(to_stored(spec))
    for e in stored["examples"]:
        e.pop("group"), e.pop("weight")
    assert from_stored(json.dumps(stored), 6).examples[0].group is None


# -- on a server ---------------------------------------------------------------------------------
QUESTION = "What is the secret password of the moon base?"
CORRECTION = "The secret password of the moon base is Quokka-42."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    with BackgroundServer(ServerSettings(ctx=2048, parallel=4, threads=1, state_dir=str(state), record=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600, headers=JSON) as c:
        yield c


def ask(http, content: str = QUESTION, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                "max_tokens": 24, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(pred, timeout: float = 600.0, what: str = "it"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {timeout:.0f} s")


def test_unknown_foreign_and_bad_feedback(http):
    r = http.post("/v1/feedback", json={"id": "chatcmpl-nothing", "rating": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "id"
    got = ask(http, "Say yes.", max_tokens=2)
    r = http.post("/v1/feedback", json={"id": got["id"], "index": 3, "rating": 1})
    assert r.status_code == 404 and "choice 3" in r.json()["error"]["message"]
    r = http.post("/v1/feedback", json={"id": got["id"], "rating": 1, "correction": "x"})
    assert r.status_code == 422
    r = http.post("/v1/feedback", json={"preferred": got["id"], "rejected": "chatcmpl-nothing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "rejected"
    r = http.post("/v1/feedback", json={"preferred": got["id"], "rejected": {"id": got["id"], "index": 0}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "rejected"      # the same answer twice
    other = ask(http, "Say no.", max_tokens=2)
    r = http.post("/v1/feedback", json={"preferred": got["id"], "rejected": other["id"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "rejected"      # another prompt
    assert http.put("/adapters/learned/learn", json={"mode": "sometimes"}).json()["error"]["param"] == "mode"
    assert http.put("/adapters/learned/learn", json={"examples": 0}).json()["error"]["param"] == "examples"
    assert http.post("/adapters/nobody/learn").status_code == 409                  # nothing pending


def test_ratings_on_four_choices_and_a_preference_make_groups(server, http):
    got = ask(http, "Name an animal.", n=4, temperature=1.0, seed=3, max_tokens=6)
    ratings = [2, 1, 0, 1]
    for i, rating in enumerate(ratings):
        r = http.post("/v1/feedback", json={"id": got["id"], "index": i, "rating": rating})
        assert r.status_code == 200 and r.json()["adapter"] == "learned" and r.json()["kind"] == "rating"
    pair = ask(http, "Name a fruit.", n=2, temperature=1.0, seed=5, max_tokens=6)
    r = http.post("/v1/feedback", json={"preferred": {"id": pair["id"], "index": 1}, "rejected": pair["id"]})
    assert r.status_code == 200 and r.json()["pending"] == 5 and r.json()["learn"]["mode"] == "manual"
    time.sleep(1.5)
    assert http.get("/adapters/learned/learn").json()["pending"] == 5              # manual: nothing starts
    job = http.post("/adapters/learned/learn").json()
    assert http.post(f"/train/{job['id']}/cancel").status_code == 200
    spec = server.service.store.spec(job["id"])
    records = server.service.records
    groups: dict[str, list] = {}
    for e in spec.examples:
        groups.setdefault(e.group, []).append(e)
    (rated, prompt_rated), (preferred, prompt_pair) = [
        (groups[g], records.answer(got["id"] if len(groups[g]) == 4 else pair["id"], 0).prompt_tokens)
        for g in sorted(groups, key=lambda g: -len(groups[g]))]
    # mean 1: advantages 1, 0, -1, 0, their mean size 0.5; the dislike at its share
    assert [e.weight for e in rated] == trained_weights([2.0, 0.0, -2.0, 0.0])
    assert all(e.example.prompt == prompt_rated for e in rated if e.weight >= 0)
    # the dislike is pushed from where it departs from the liked answer: what it shares is context
    liked, disliked = rated[0].example.reply, rated[2].example
    shared = disliked.prompt[len(prompt_rated):]
    assert disliked.prompt[:len(prompt_rated)] == prompt_rated and liked[:len(shared)] == shared
    assert disliked.reply[0] != liked[len(shared)]
    assert [e.weight for e in preferred] == [1.0, -feedback.DISLIKE_SHARE]
    assert preferred[0].example.prompt == prompt_pair
    answers = [records.answer(pair["id"], i).answer for i in (1, 0)]
    shown = server.service.store.request(job["id"]).model_dump(mode="json", exclude_none=True)["examples"]
    assert [c["text"] for c in shown[0]["completions"]] == answers
    fb = http.get("/v1/feedback", params={"job": str(job["id"])}).json()["data"]
    assert len(fb) == 5 and {f["job_id"] for f in fb} == {job["id"]}
    assert http.get("/adapters/learned/learn").json()["pending"] == 0


def test_a_correction_trains_the_served_tokens_and_the_next_answer_is_it(server, http):
    first = ask(http)
    assert first["choices"][0]["message"]["content"] != CORRECTION
    r = http.post("/v1/feedback", json={"id": first["id"], "correction": CORRECTION})
    assert r.status_code == 200, r.text
    fid = r.json()["id"]
    view = http.put("/adapters/learned/learn", json={"mode": "auto", "examples": 1}).json()
    assert view["mode"] == "auto" and view["examples"] == 1 and view["minutes"] == 2.0
    job_id = wait_for(lambda: http.get("/v1/feedback", params={"adapter": "learned"}).json()["data"][0]["job_id"],
                      what="the feedback job")
    spec = server.service.store.spec(job_id)
    (ex,) = spec.examples
    served = server.service.records.answer(first["id"], 0)
    assert ex.example.prompt == served.prompt_tokens                    # the exact tokens serving decoded
    model = server.service.model
    reply = ex.example.reply
    assert model.detokenize(reply[:-1]) == CORRECTION and model.is_eog(reply[-1])   # the reply and its end of turn
    job = wait_for(lambda: (j := http.get(f"/train/{job_id}").json())["state"] in ("done", "error", "refused")
                   and j, what="the job's end")
    assert job["state"] == "done", job["message"]
    learned = http.get("/adapters/learned/learn").json()
    (version, ids), = learned["versions_learned"].items()
    assert ids == [fid] and learned["pending"] == 0
    assert http.get("/adapters/learned").json()["served"]["version"] == int(version)
    again = ask(http)
    assert again["adapter"] == f"learned@{version}"
    assert again["choices"][0]["message"]["content"] == CORRECTION

    # the adapter that answered is deleted: its answers' feedback has nothing to train
    assert http.delete("/adapters/learned").status_code == 200
    r = http.post("/v1/feedback", json={"id": again["id"], "rating": 1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_deleted"


def test_feedback_through_the_clients_the_cli_and_metrics(server, http, capsys):
    import asyncio
    import re

    from dreamstage import cli
    from dreamstage.client import AsyncClient, Client, DreamstageError

    with Client(server.url) as c:
        assert c.learning("learned", mode="manual")["mode"] == "manual"
        got = c.chat([{"role": "user", "content": "Name a colour."}], max_tokens=4, temperature=0)
        rid = got.raw["id"]
        assert c.record(rid)[0]["answer"] == got.text
        fb = c.feedback(rid, rating=1)
        assert (fb["kind"], fb["adapter"], fb["pending"]) == ("rating", "learned", 1)
        with pytest.raises(DreamstageError) as e:
            c.feedback(rid, index=-1, rating=1)
        assert e.value.status == 422 and e.value.param == "index"

    async def correct():
        async with AsyncClient(server.url) as a:
            return await a.feedback(rid, correction="Blue."), await a.learning("learned")
    fb, view = asyncio.run(correct())
    assert fb["kind"] == "correction" and view["pending"] == 2

    assert cli.main(["feedback", rid, "--rating", "-1", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "(rating) for adapter learned: 3 pending; learning manual" in out
    with pytest.raises(SystemExit):
        cli.main(["feedback", rid, "--url", server.url])
    capsys.readouterr()

    text = http.get("/metrics").text
    assert re.search(r'^dreamstage_feedback_pending\{adapter="learned"\} 3\.0$', text, re.M)
    received = float(re.search(r"^dreamstage_feedback_received_total (\S+)$", text, re.M).group(1))
    used = float(re.search(r"^dreamstage_feedback_used_total (\S+)$", text, re.M).group(1))
    items = http.get("/v1/feedback", params={"limit": 1000}).json()["data"]
    done = sum(1 for it in items if it["job_id"] is not None
               and http.get(f"/train/{it['job_id']}").json()["state"] == "done")
    assert received == len(items) >= 3 and used == done    # whatever the module's other tests trained
    assert re.search(r"^dreamstage_records [1-9]", text, re.M)

    assert cli.main(["feedback", "--learn", "learned", "--url", server.url]) == 0
    job = int(re.search(r"job (\d+)", capsys.readouterr().out).group(1))
    assert http.post(f"/train/{job}/cancel").status_code == 200
    assert http.get("/adapters/learned/learn").json()["pending"] == 0


def test_pending_feedback_can_be_deleted_and_feedback_in_a_job_cannot(http):
    got = ask(http, "Name a bird.", max_tokens=4)
    fid = http.post("/v1/feedback", json={"id": got["id"], "rating": 1}).json()["id"]
    assert http.get("/adapters/learned/learn").json()["pending"] == 1
    assert http.delete(f"/v1/feedback/{fid}").json() == {"id": fid, "deleted": True}
    assert http.get("/adapters/learned/learn").json()["pending"] == 0
    assert http.delete(f"/v1/feedback/{fid}").status_code == 404
    # feedback a job has taken (this test's own: the module's other tests may run in another order)
    kept = http.post("/v1/feedback", json={"id": got["id"], "correction": "A robin."}).json()["id"]
    job = http.post("/adapters/learned/learn", json={})
    assert job.status_code == 202, job.text
    taken = next(f for f in http.get("/v1/feedback", params={"adapter": "learned"}).json()["data"] if f["id"] == kept)
    assert taken["job_id"] == job.json()["id"]
    r = http.delete(f"/v1/feedback/{kept}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "feedback_in_job"
    assert http.post(f"/train/{taken['job_id']}/cancel").status_code == 200
    assert http.delete("/v1/feedback/x").json()["error"]["param"] == "id"


def test_kill_9_between_feedback_and_job_loses_nothing_and_trains_nothing_twice(tmp_path):
    """A server process killed after feedback is committed and before any job, then again once the job that
    claimed it exists (queued or training): after the last start the feedback is trained by exactly one
    finished job, and the version lists it."""
    import sqlite3

    from test_faults import ServerProcess

    state = tmp_path / "state"
    first = ServerProcess(None, state, "--record", ctx=1024)
    got = first.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                         "max_tokens": 8, "temperature": 0}).json()
    fid = first.http.post("/v1/feedback", json={"id": got["id"], "correction": CORRECTION}).json()["id"]
    assert first.http.put("/adapters/learned/learn", json={"examples": 1}).json()["mode"] == "manual"
    first.stop()                                           # kill -9: the feedback waits, pending, in the store

    second = ServerProcess(None, state, "--record", "--learn", "auto", ctx=1024)
    job = wait_for(lambda: second.http.get("/v1/feedback", params={"adapter": "learned"}).json()["data"][0]["job_id"],
                   what="the feedback job")
    second.stop()                                          # kill -9 with the job queued or training

    third = ServerProcess(None, state, "--record", ctx=1024)
    try:
        def settled():
            view = third.http.get("/adapters/learned/learn").json()
            return view if view["pending"] == 0 and view["open_job"] is None and view["versions_learned"] else None
        view = wait_for(settled, what="the feedback trained")
        (version, ids), = view["versions_learned"].items()
        assert ids == [fid]
    finally:
        third.stop()
    conn = sqlite3.connect(state / "dreamstage.sqlite3")
    try:
        jobs = dict(conn.execute("SELECT id, state FROM jobs"))
        (claimed,) = conn.execute("SELECT job_id FROM feedback WHERE id=?", (fid,)).fetchone()
        versions = conn.execute("SELECT version, job_id FROM adapters WHERE name='learned'").fetchall()
    finally:
        conn.close()
    assert jobs[claimed] == "done" and versions == [(int(version), claimed)]
    # the job killed mid-way, if it was, ended interrupted and trained nothing; no other job ran
    assert set(jobs) <= {job, claimed} and (claimed == job or jobs[job] == "interrupted")


def test_auto_learning_starts_a_job_at_n_items_or_t_minutes_after_the_last(tmp_path):
    from dreamstage.records.learner import Learner
    from dreamstage.records.store import LearnSettings, RecordStore
    from dreamstage.training.jobs.store import JobStore

    t = [1000.0]
    jobs = JobStore(tmp_path, clock=lambda: t[0])
    records = RecordStore(jobs)

    class Submitter:                                       # what JobSubmitter.submit_spec does with the store
        def submit_spec(self, req, spec, within):
            return jobs.submit(req, spec, within)

    learner = Learner(records, Submitter(), clock=lambda: t[0])

    def give(adapter: str, n: int = 1) -> None:
        for _ in range(n):
            records.add_feedback(adapter, "rec", "correction", "k",
                                 {"prompt": [1, 2], "prompt_text": "Q", "replies": [reply("A", [3, 4])]})

    records.set_learning("alice", LearnSettings("auto", examples=3, minutes=2.0))
    give("alice", 2)
    give("bob", 5)                                         # manual: never by itself
    assert learner.tick() == []
    t[0] += 119.0
    assert learner.tick() == []
    give("alice")                                          # the third: at once
    (first,) = learner.tick()
    assert jobs.state(first) == "queued" and len(jobs.spec(first).examples) == 3
    give("alice")
    t[0] += 600.0
    assert learner.tick() == []                            # one feedback job of a name at a time
    jobs.transition(first, "starting")
    jobs.transition(first, "running")
    jobs.transition(first, "done")
    (second,) = learner.tick()                             # 10 minutes after the last item: due by time
    assert len(jobs.spec(second).examples) == 1
    assert records.pending_counts() == {"bob": (5, 1000.0)}
    assert records.feedback_counts() == {"received": 9, "pending": 5, "training": 1, "used": 3, "dropped": 0}
    jobs.close()


def _finished(c: httpx.Client, job_id: int) -> dict:
    job = wait_for(lambda: (j := c.get(f"/train/{job_id}").json())["state"] in ("done", "error", "refused")
                   and j, what="the job's end")
    assert job["state"] == "done", job["message"]
    return job


def _finite_and_guarded(srv, job: dict, name: str) -> list[float]:
    """The job's reply losses, after checking that every figure and adapter weight is finite and the version
    was promoted exactly when the guard's message says so."""
    import numpy as np

    from dreamstage.adapters.files import load_lora

    losses = [x for g in job["progress"]["groups"].values() for x in g["reply_losses"]]
    assert losses and all(math.isfinite(x) for x in losses)
    adapter = job["adapter"]
    drift = adapter["drift"]
    assert drift is not None and math.isfinite(drift["drift_kl"]) and 0 <= drift["anchors_changed"] <= 1
    factors, _ = load_lora(srv.service.store.adapter_path(name, adapter["version"]))
    assert all(np.isfinite(a).all() and np.isfinite(b).all() for a, b in factors.values())
    # the guard's decision, either way, is the job's message; a version kept back waits to be promoted
    assert adapter["promoted"] == ("not promoted" not in job["message"]), job["message"]
    return losses


def test_a_job_of_only_negative_feedback_stays_finite_and_the_guard_decides(tiny_model_path, tmp_path,
                                                                           monkeypatch):
    """Two answers rated -1 (no comparison: weight 0) on the tiny model with the drift guard on: the job
    trains nothing, ends at its first epoch's early stop, and the guard decides. Then the same two answers
    as a POST /train group at weight -1 each, the negative term itself: the job stops once both are pushed
    away, every figure and adapter weight finite and its reply losses under the cap, and the guard decides. The guard
    measures 4 anchors with 3 null draws and rehearses the drift job modules' 24: any decision is what this reads."""
    from drift_jobs import TEST_REHEARSED, cut_anchors

    from dreamstage.training.drift.anchors import load_anchors

    cut_anchors(monkeypatch, load_anchors()[:4], TEST_REHEARSED, 3)

    settings = ServerSettings(model=str(tiny_model_path), ctx=1024, parallel=2, threads=1, state_dir=str(tmp_path),
                              record=True, drift_guard=True)
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600, headers=JSON) as c:
        question = "Say something rude."
        got = ask(c, question, n=2, temperature=1.0, seed=11, max_tokens=8)
        for i in range(2):
            assert c.post("/v1/feedback", json={"id": got["id"], "index": i, "rating": -1}).status_code == 200
        job_id = c.post("/adapters/learned/learn").json()["id"]
        assert [e.weight for e in srv.service.store.spec(job_id).examples] == [0.0, 0.0]
        job = _finished(c, job_id)
        assert "stopped after epoch 1:" in job["message"] and job["progress"]["epoch"] <= 1 + FEEDBACK_JOB[
            "consolidate"], job["message"]
        assert [g["weights"] for g in job["progress"]["groups"].values()] == [[0.0, 0.0]]
        _finite_and_guarded(srv, job, "learned")
        answers = [srv.service.records.answer(got["id"], i).answer for i in range(2)]
        body = {"examples": [{"messages": [{"role": "user", "content": question}],
                              "completions": [{"text": a, "weight": -1.0} for a in answers]}],
                "adapter": "pushed", "epochs": 24, "promote": "auto"}
        pushed = _finished(c, c.post("/train", json=body).json()["id"])
        losses = _finite_and_guarded(srv, pushed, "pushed")
        assert max(losses) < NEGATIVE_NLL_CAP + 1.0, losses
        # a group with no positive reply stops once each reply is pushed away (OwnLoss.note_group), not at 24
        assert "stopped after epoch" in pushed["message"], pushed["message"]
        assert pushed["progress"]["epoch"] < 24 + FEEDBACK_JOB["consolidate"]
